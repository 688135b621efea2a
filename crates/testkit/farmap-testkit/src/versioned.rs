//! Checks of the [`Objects`] that hold versioned regions (Redis, CQL): folders of folders as
//! the versioned layout lists them, and a versioned region over the objects (versions,
//! snapshots, a second writer fenced, a garbage collection). Built with the `versions`
//! feature.

use std::sync::Arc;

use bytes::Bytes;
use farmap_core::{ChunkIdx, ErrorKind, Geometry, Objects, Store};
use farmap_versions::{history, At, Versioned, VersionedOptions};

/// Folders of folders: what the versioned layout lists (chunk folders, versions, tags), over
/// `o` (empty); panics naming what broke.
pub async fn check_nested_folders(o: &dyn Objects) {
    let one = || Bytes::from_static(b"1");
    for key in [
        "chunks/cd/22",
        "chunks/ab/11",
        "chunks/ab/00",
        "chunks/ab-x/33",
        "regions/r/versions/00000000000000000000",
        "regions/r/versions/00000000000000000001",
        "regions/r/tags/first",
        "regions/s/versions/00000000000000000000",
        "gc/grace",
    ] {
        assert!(o.create(key, one()).await.unwrap(), "{key}");
    }
    assert_eq!(o.list("chunks").await.unwrap(), ["ab", "ab-x", "cd"]);
    assert_eq!(o.list("chunks/ab").await.unwrap(), ["00", "11"]);
    assert_eq!(o.list("regions").await.unwrap(), ["r", "s"]);
    assert_eq!(o.list("regions/r").await.unwrap(), ["tags", "versions"]);
    assert_eq!(
        o.list("regions/r/versions").await.unwrap(),
        ["00000000000000000000", "00000000000000000001"]
    );
    assert_eq!(o.list("gc").await.unwrap(), ["grace"]);
    // A deleted object leaves its folder's list; the emptied folder stays listed in its
    // parent (as a directory would).
    o.delete("chunks/cd/22").await.unwrap();
    assert!(o.list("chunks/cd").await.unwrap().is_empty());
    assert_eq!(o.list("chunks").await.unwrap(), ["ab", "ab-x", "cd"]);
    // A name that is an object and a folder lists once, and stays listed as a folder when
    // the object goes.
    assert!(o.create("x/y", one()).await.unwrap());
    assert!(o.create("x/y/z", one()).await.unwrap());
    assert_eq!(o.list("x").await.unwrap(), ["y"]);
    o.delete("x/y").await.unwrap();
    assert_eq!(o.list("x").await.unwrap(), ["y"]);
    assert_eq!(o.list("x/y").await.unwrap(), ["z"]);
    // More names than one page of the listing.
    let many: Vec<String> = (0..2500).map(|i| format!("{i:05}")).collect();
    let creates = many.iter().map(|n| {
        let key = format!("big/{n}");
        async move { o.create(&key, one()).await.unwrap() }
    });
    assert!(futures::future::join_all(creates)
        .await
        .into_iter()
        .all(|c| c));
    assert_eq!(o.list("big").await.unwrap(), many);
}

/// The versioned layout's promises over `o` (empty): versions reopen with their bytes, a
/// snapshot names one, a second writer is fenced at its flush, and the collector (grace
/// 300 ms) takes what the fenced writer stored in two runs.
pub async fn check_versioned(o: Arc<dyn Objects>) {
    let g = Geometry::new(1 << 20, 65536).unwrap();
    let opts = |at: At, read_only: bool| VersionedOptions {
        region: "r".into(),
        at,
        read_only,
        create: Some(g),
        grace: Some(std::time::Duration::from_millis(300)),
        read_ahead: true,
    };
    let chunk = |b: u8| Bytes::from(vec![b; 65536]);
    let one = Versioned::open(o.clone(), opts(At::Latest, false))
        .await
        .unwrap();
    let two = Versioned::open(o.clone(), opts(At::Latest, false))
        .await
        .unwrap();
    one.write(ChunkIdx(1), chunk(1)).await.unwrap();
    one.write(ChunkIdx(5), chunk(5)).await.unwrap();
    assert_eq!(one.snapshot("first").await.unwrap(), 1);
    two.write(ChunkIdx(1), chunk(2)).await.unwrap();
    let e = two.flush().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Fenced, "{e}");
    one.write(ChunkIdx(2), chunk(3)).await.unwrap();
    one.write(ChunkIdx(5), chunk(0)).await.unwrap();
    one.flush().await.unwrap();
    for at in [At::Tag("first".into()), At::Seq(1)] {
        let first = Versioned::open(o.clone(), opts(at, true)).await.unwrap();
        assert_eq!(first.read(ChunkIdx(1)).await.unwrap(), chunk(1));
        assert_eq!(first.read(ChunkIdx(2)).await.unwrap(), chunk(0));
        assert_eq!(first.read(ChunkIdx(5)).await.unwrap(), chunk(5));
    }
    let latest = Versioned::open(o.clone(), opts(At::Latest, true))
        .await
        .unwrap();
    for (i, b) in [(1, 1), (2, 3), (5, 0), (7, 0)] {
        assert_eq!(
            latest.read(ChunkIdx(i)).await.unwrap(),
            chunk(b),
            "chunk {i}"
        );
    }
    let h = history(&*o, "r").await.unwrap();
    assert_eq!(h.iter().map(|v| v.seq).collect::<Vec<_>>(), [0, 1, 2]);
    assert_eq!(h[1].names, ["first"]);
    assert_eq!(o.list("regions").await.unwrap(), ["r"]);
    assert!(!o.list("chunks").await.unwrap().is_empty());

    // What the fenced writer stored no version lists: the collector takes it in two runs.
    drop(two);
    let gc_opts = farmap_versions::GcOptions::default();
    let r = farmap_versions::gc(&*o, &gc_opts).await.unwrap();
    assert_eq!((r.grace_ms, r.chunks, r.trashed), (300, 4, 1), "{r:?}");
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let r = farmap_versions::gc(&*o, &gc_opts).await.unwrap();
    assert_eq!((r.deleted, r.restored, r.chunks), (1, 0, 3), "{r:?}");
    assert_eq!(latest.read(ChunkIdx(1)).await.unwrap(), chunk(1));
}
