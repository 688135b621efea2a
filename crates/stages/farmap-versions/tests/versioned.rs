//! The versioned layout over a real directory: versions, snapshots, sharing, fencing, damage.

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use farmap_core::{ChunkIdx, ChunkRange, ErrorKind, Geometry, Objects, Store};
use farmap_store::DirObjects;
use farmap_versions::{history, At, Versioned, VersionedOptions, MAX_CHAIN};

const CHUNK: u32 = 4096;

fn objects(dir: &Path) -> Arc<dyn Objects> {
    Arc::new(DirObjects::open(dir).unwrap())
}

fn opts(region: &str, at: At, read_only: bool) -> VersionedOptions {
    VersionedOptions {
        region: region.into(),
        at,
        read_only,
        create: Some(Geometry::new(64 * u64::from(CHUNK), u64::from(CHUNK)).unwrap()),
        grace: None,
        read_ahead: true,
    }
}

async fn open(o: &Arc<dyn Objects>, region: &str) -> Versioned {
    Versioned::open(o.clone(), opts(region, At::Latest, false))
        .await
        .unwrap()
}

fn chunk(byte: u8) -> Bytes {
    Bytes::from(vec![byte; CHUNK as usize])
}

/// Chunk files under the object directory.
fn stored_chunks(dir: &Path) -> usize {
    let root = dir.join("chunks");
    let Ok(fanout) = std::fs::read_dir(root) else {
        return 0;
    };
    fanout
        .map(|d| std::fs::read_dir(d.unwrap().path()).unwrap().count())
        .sum()
}

#[tokio::test]
async fn versions_keep_what_each_flush_saved() {
    let dir = tempfile::tempdir().unwrap();
    let o = objects(dir.path());
    let v = open(&o, "r").await;
    assert_eq!(v.version(), 0);
    v.write(ChunkIdx(1), chunk(1)).await.unwrap();
    v.flush().await.unwrap();
    assert_eq!(v.version(), 1);
    v.write(ChunkIdx(1), chunk(2)).await.unwrap();
    v.write(ChunkIdx(5), chunk(5)).await.unwrap();
    assert_eq!(v.snapshot("two").await.unwrap(), 2);
    v.flush().await.unwrap();
    assert_eq!(v.version(), 2, "nothing new: no version");
    drop(v);

    let latest = open(&o, "r").await;
    assert_eq!(latest.read(ChunkIdx(1)).await.unwrap(), chunk(2));
    assert_eq!(latest.read(ChunkIdx(5)).await.unwrap(), chunk(5));
    assert_eq!(latest.read(ChunkIdx(0)).await.unwrap(), chunk(0));
    let first = Versioned::open(o.clone(), opts("r", At::Seq(1), true))
        .await
        .unwrap();
    assert_eq!(first.read(ChunkIdx(1)).await.unwrap(), chunk(1));
    assert_eq!(first.read(ChunkIdx(5)).await.unwrap(), chunk(0));
    let e = first.write(ChunkIdx(0), chunk(9)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ReadOnly);
    let named = Versioned::open(o.clone(), opts("r", At::Tag("two".into()), true))
        .await
        .unwrap();
    assert_eq!(named.read(ChunkIdx(5)).await.unwrap(), chunk(5));

    let e = Versioned::open(o.clone(), opts("r", At::Seq(1), false))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ReadOnly, "{e}");
    let e = Versioned::open(o.clone(), opts("r", At::Tag("nope".into()), true))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    let e = latest.snapshot("two").await.unwrap_err();
    assert!(e.to_string().contains("already has a snapshot"), "{e}");

    let h = history(&*o, "r").await.unwrap();
    let seqs: Vec<u64> = h.iter().map(|v| v.seq).collect();
    assert_eq!(seqs, [0, 1, 2]);
    assert_eq!(h[2].names, ["two"]);
    assert_eq!(h[2].chunks, 2, "a delta lists what changed");
}

#[tokio::test]
async fn equal_chunks_are_stored_once_and_zeros_not_at_all() {
    let dir = tempfile::tempdir().unwrap();
    let o = objects(dir.path());
    let a = open(&o, "a").await;
    let b = open(&o, "b").await;
    for i in 0..8 {
        a.write(ChunkIdx(i), chunk(7)).await.unwrap();
        b.write(ChunkIdx(i), chunk(7)).await.unwrap();
    }
    a.write(ChunkIdx(9), chunk(0)).await.unwrap();
    a.flush().await.unwrap();
    b.flush().await.unwrap();
    assert_eq!(stored_chunks(dir.path()), 1);
    let bytes: u64 = walk(&dir.path().join("chunks"));
    assert!(
        bytes < u64::from(CHUNK) / 8,
        "a repetitive chunk is compressed: {bytes} bytes"
    );
    b.trim(ChunkRange::new(ChunkIdx(0), ChunkIdx(4)))
        .await
        .unwrap();
    b.flush().await.unwrap();
    drop(b);
    let b = open(&o, "b").await;
    assert_eq!(b.read(ChunkIdx(3)).await.unwrap(), chunk(0));
    assert_eq!(b.read(ChunkIdx(4)).await.unwrap(), chunk(7));
}

fn walk(p: &Path) -> u64 {
    std::fs::read_dir(p)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                walk(&e.path())
            } else {
                e.metadata().unwrap().len()
            }
        })
        .sum()
}

/// Two writers of one region: the second to flush is fenced, and stays fenced; a writer
/// that claims the region fences the one before it.
#[tokio::test]
async fn a_second_writer_is_fenced_at_its_flush() {
    let dir = tempfile::tempdir().unwrap();
    let o = objects(dir.path());
    let one = open(&o, "r").await;
    let two = open(&o, "r").await;
    one.write(ChunkIdx(0), chunk(1)).await.unwrap();
    two.write(ChunkIdx(0), chunk(2)).await.unwrap();
    one.flush().await.unwrap();
    let e = two.flush().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Fenced, "{e}");
    assert!(e.to_string().contains("another writer"), "{e}");
    assert_eq!(
        two.flush().await.unwrap_err().kind(),
        ErrorKind::Fenced,
        "stays failed"
    );
    assert_eq!(
        two.write(ChunkIdx(1), chunk(3)).await.unwrap_err().kind(),
        ErrorKind::Fenced
    );

    let three = open(&o, "r").await;
    assert_eq!(three.read(ChunkIdx(0)).await.unwrap(), chunk(1));
    assert_eq!(three.claim().await.unwrap(), 2);
    one.write(ChunkIdx(2), chunk(4)).await.unwrap();
    assert_eq!(one.flush().await.unwrap_err().kind(), ErrorKind::Fenced);
    three.write(ChunkIdx(2), chunk(5)).await.unwrap();
    three.flush().await.unwrap();
    let h = history(&*o, "r").await.unwrap();
    assert_eq!(h.last().unwrap().epoch, 2);
}

/// After many flushes the chain is cut by a whole manifest, and every version still reads
/// back as it was saved.
#[tokio::test]
async fn long_histories_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let o = objects(dir.path());
    let v = open(&o, "r").await;
    let n = 2 * MAX_CHAIN + 5;
    for i in 1..=n {
        v.write(ChunkIdx(i % 64), chunk(i as u8)).await.unwrap();
        v.flush().await.unwrap();
    }
    drop(v);
    let h = history(&*o, "r").await.unwrap();
    assert_eq!(h.len() as u64, n + 1);
    assert!(
        h.iter().filter(|v| v.whole).count() >= 3,
        "whole every {MAX_CHAIN}"
    );
    for seq in [1, MAX_CHAIN, MAX_CHAIN + 1, n] {
        let old = Versioned::open(o.clone(), opts("r", At::Seq(seq), true))
            .await
            .unwrap();
        for i in 1..=seq {
            if i + 64 > seq {
                assert_eq!(old.read(ChunkIdx(i % 64)).await.unwrap(), chunk(i as u8));
            }
        }
    }
}

/// A chunk changed behind farmap's back is refused, not served.
#[tokio::test]
async fn damaged_chunks_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let o = objects(dir.path());
    let v = open(&o, "r").await;
    let data: Vec<u8> = (0..CHUNK).map(|i| (i * 7 % 251) as u8).collect();
    v.write(ChunkIdx(3), Bytes::from(data)).await.unwrap();
    v.flush().await.unwrap();
    drop(v);
    let fanout = std::fs::read_dir(dir.path().join("chunks"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let file = std::fs::read_dir(fanout)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::remove_file(&file).unwrap();
    std::fs::write(&file, bytes).unwrap();
    let v = open(&o, "r").await;
    let e = v.read(ChunkIdx(3)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
}

/// The store contract every store keeps, over a directory of objects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keeps_the_store_contract() {
    let dir = tempfile::tempdir().unwrap();
    let o = objects(dir.path());
    let n = std::sync::atomic::AtomicU64::new(0);
    farmap_testkit::run_conformance(|g| {
        let o = o.clone();
        let region = format!("c{}", n.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        async move {
            let v = Versioned::open(
                o,
                VersionedOptions {
                    region,
                    at: At::Latest,
                    read_only: false,
                    create: Some(g),
                    grace: None,
                    read_ahead: true,
                },
            )
            .await
            .unwrap();
            Arc::new(v) as Arc<dyn Store>
        }
    })
    .await;
}

#[tokio::test]
async fn a_region_without_versions_needs_a_size() {
    let dir = tempfile::tempdir().unwrap();
    let o = objects(dir.path());
    let e = Versioned::open(
        o.clone(),
        VersionedOptions {
            create: None,
            grace: None,
            read_ahead: true,
            ..opts("none", At::Latest, false)
        },
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    let e = Versioned::open(o, opts("bad/name", At::Latest, false))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
}

/// Forks share every chunk of the version they start from, and go their own ways.
#[tokio::test]
async fn forks_share_chunks_and_diverge() {
    let dir = tempfile::tempdir().unwrap();
    let o = objects(dir.path());
    let base = open(&o, "base").await;
    for i in 0..16 {
        base.write(ChunkIdx(i), chunk(i as u8 + 1)).await.unwrap();
    }
    base.snapshot("golden").await.unwrap();
    base.write(ChunkIdx(0), chunk(99)).await.unwrap();
    base.flush().await.unwrap();
    let before = stored_chunks(dir.path());
    let names = ["f1".to_string(), "f2".to_string()];
    let from = farmap_versions::fork(&*o, "base", &At::Tag("golden".into()), &names)
        .await
        .unwrap();
    assert_eq!(from, 1);
    assert_eq!(stored_chunks(dir.path()), before, "a fork copies no chunk");
    let f1 = open(&o, "f1").await;
    let f2 = open(&o, "f2").await;
    assert_eq!(
        f1.read(ChunkIdx(0)).await.unwrap(),
        chunk(1),
        "the named version"
    );
    f1.write(ChunkIdx(3), chunk(42)).await.unwrap();
    f1.flush().await.unwrap();
    assert_eq!(f2.read(ChunkIdx(3)).await.unwrap(), chunk(4));
    assert_eq!(
        open(&o, "f1").await.read(ChunkIdx(3)).await.unwrap(),
        chunk(42)
    );
    assert_eq!(base.read(ChunkIdx(3)).await.unwrap(), chunk(4));
    let e = farmap_versions::fork(&*o, "base", &At::Latest, &["f1".to_string()])
        .await
        .unwrap_err();
    assert!(e.to_string().contains("already exists"), "{e}");
}

/// Objects whose next version create lands but reports an error, and whose next read of
/// it fails too: the writer cannot tell whether its version landed.
#[derive(Debug)]
struct Unsure {
    inner: DirObjects,
    armed: std::sync::atomic::AtomicU32,
}

impl Objects for Unsure {
    fn get<'a>(
        &'a self,
        key: &'a str,
    ) -> farmap_core::BoxFuture<'a, farmap_core::StoreResult<Option<Bytes>>> {
        Box::pin(async move {
            if key.contains("/versions/")
                && self.armed.load(std::sync::atomic::Ordering::SeqCst) == 1
            {
                self.armed.store(0, std::sync::atomic::Ordering::SeqCst);
                return Err(farmap_core::StoreError::new(
                    ErrorKind::Unavailable,
                    "get: cut off",
                ));
            }
            self.inner.get(key).await
        })
    }
    fn create<'a>(
        &'a self,
        key: &'a str,
        data: Bytes,
    ) -> farmap_core::BoxFuture<'a, farmap_core::StoreResult<bool>> {
        Box::pin(async move {
            let landed = self.inner.create(key, data).await?;
            if key.contains("/versions/")
                && self.armed.load(std::sync::atomic::Ordering::SeqCst) == 2
            {
                self.armed.store(1, std::sync::atomic::Ordering::SeqCst);
                return Err(farmap_core::StoreError::new(
                    ErrorKind::Timeout,
                    "create: no answer",
                ));
            }
            Ok(landed)
        })
    }
    fn list<'a>(
        &'a self,
        dir: &'a str,
    ) -> farmap_core::BoxFuture<'a, farmap_core::StoreResult<Vec<String>>> {
        self.inner.list(dir)
    }
    fn delete<'a>(
        &'a self,
        key: &'a str,
    ) -> farmap_core::BoxFuture<'a, farmap_core::StoreResult<()>> {
        self.inner.delete(key)
    }
    fn location(&self) -> String {
        self.inner.location()
    }
}

/// A version that landed although its create reported an error is not taken for another
/// writer's: the next flush tries the same bytes, finds them there, and goes on.
#[tokio::test]
async fn a_version_whose_create_was_unsure_is_not_taken_for_another_writers() {
    let dir = tempfile::tempdir().unwrap();
    let unsure = Arc::new(Unsure {
        inner: DirObjects::open(dir.path()).unwrap(),
        armed: std::sync::atomic::AtomicU32::new(0),
    });
    let o: Arc<dyn Objects> = unsure.clone();
    let v = open(&o, "r").await;
    v.write(ChunkIdx(0), chunk(1)).await.unwrap();
    unsure.armed.store(2, std::sync::atomic::Ordering::SeqCst);
    let e = v.flush().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    v.write(ChunkIdx(1), chunk(2)).await.unwrap();
    v.flush().await.unwrap();
    assert_eq!(v.version(), 2);
    drop(v);
    let h = history(&*o, "r").await.unwrap();
    assert_eq!(h.iter().map(|v| v.chunks).collect::<Vec<_>>(), [0, 1, 1]);
    let back = open(&o, "r").await;
    assert_eq!(back.read(ChunkIdx(0)).await.unwrap(), chunk(1));
    assert_eq!(back.read(ChunkIdx(1)).await.unwrap(), chunk(2));
}

#[tokio::test]
async fn a_new_host_catches_up_then_takes_over_and_the_old_one_is_fenced() {
    let dir = tempfile::tempdir().unwrap();
    let o = objects(dir.path());
    let old = open(&o, "r").await;
    // The new host opens before the old one saves its last writes (as a migration's
    // destination does).
    let new = open(&o, "r").await;
    old.write(ChunkIdx(1), chunk(1)).await.unwrap();
    old.flush().await.unwrap();
    assert_eq!(
        new.read(ChunkIdx(1)).await.unwrap(),
        chunk(0),
        "not caught up yet"
    );
    new.catch_up().await.unwrap();
    assert_eq!(new.version(), 1);
    assert_eq!(new.read(ChunkIdx(1)).await.unwrap(), chunk(1));
    Store::take_over(&new).await.unwrap();
    assert_eq!(new.version(), 2);
    let h = history(&*o, "r").await.unwrap();
    assert_eq!(
        h.iter().map(|v| v.epoch).collect::<Vec<_>>(),
        [1, 1, 2],
        "the take-over is the next epoch"
    );
    old.write(ChunkIdx(2), chunk(2)).await.unwrap();
    let e = old.flush().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Fenced, "{e}");
    // An opening with unsaved writes cannot catch up over another writer's version.
    let e = old.catch_up().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Fenced, "{e}");
    new.write(ChunkIdx(3), chunk(3)).await.unwrap();
    new.flush().await.unwrap();
}

/// Region `region` with chunks 0..8 holding 1..=8, saved.
async fn eight_chunks(o: &Arc<dyn Objects>, region: &str) {
    let v = open(o, region).await;
    for i in 0..8 {
        v.write(ChunkIdx(i), chunk(i as u8 + 1)).await.unwrap();
    }
    v.flush().await.unwrap();
}

#[tokio::test]
async fn a_run_s_first_reads_are_read_ahead_in_order_at_the_next_opening() {
    let dir = tempfile::tempdir().unwrap();
    let o = objects(dir.path());
    eight_chunks(&o, "r").await;
    // A run reads 5, 2, 7 (2 twice), and writes nothing: its flush saves the order only.
    let run = open(&o, "r").await;
    for i in [5, 2, 2, 7] {
        run.read(ChunkIdx(i)).await.unwrap();
    }
    run.flush().await.unwrap();
    assert_eq!(run.version(), 1, "reading makes no version");
    drop(run);
    let sets = o.list("regions/r/touched").await.unwrap();
    assert_eq!(sets, [format!("{:020}.3", 1)]);
    let got = o
        .get(&format!("regions/r/touched/{}", sets[0]))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        farmap_versions::touched::decode(&got, 64).unwrap(),
        [5, 2, 7]
    );

    // The next opening (here read-only, at that version) reads them ahead.
    let again = Versioned::open(o.clone(), opts("r", At::Seq(1), true))
        .await
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    for i in [5, 2, 7, 1] {
        assert_eq!(again.read(ChunkIdx(i)).await.unwrap(), chunk(i as u8 + 1));
    }
    assert_eq!(again.read_ahead_hits(), 3, "5, 2 and 7 were read ahead");
    // A chunk written after it was read ahead reads as written.
    let writer = open(&o, "r").await;
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    writer.write(ChunkIdx(5), chunk(50)).await.unwrap();
    assert_eq!(writer.read(ChunkIdx(5)).await.unwrap(), chunk(50));
    assert_eq!(writer.read(ChunkIdx(2)).await.unwrap(), chunk(3));
    assert_eq!(
        writer.read_ahead_hits(),
        1,
        "2 came from the read-ahead, 5 did not"
    );
    let no = Versioned::open(
        o.clone(),
        VersionedOptions {
            read_ahead: false,
            ..opts("r", At::Seq(1), true)
        },
    )
    .await
    .unwrap();
    no.read(ChunkIdx(5)).await.unwrap();
    assert_eq!(no.read_ahead_hits(), 0);
}

#[tokio::test]
async fn under_a_cache_that_reports_touches_the_working_set_is_the_touches_not_the_reads() {
    let dir = tempfile::tempdir().unwrap();
    let o = objects(dir.path());
    eight_chunks(&o, "r").await;
    assert_eq!(
        open(&o, "r").await.working_set(),
        None,
        "no run recorded one yet"
    );

    let run = open(&o, "r").await;
    // Read before the cache says it reports (its pull starting): forgotten.
    run.read(ChunkIdx(0)).await.unwrap();
    run.reports_touches();
    // The pull's reads are not the application's.
    for i in 0..8 {
        run.read(ChunkIdx(i)).await.unwrap();
    }
    // The application touched 6, then 3 (twice), then 40 (no data yet: still its touch),
    // and a report outside the region is dropped.
    for i in [6, 3, 3, 40, 1000] {
        run.touched(ChunkIdx(i));
    }
    run.reports_touches();
    run.touched(ChunkIdx(2));
    run.flush().await.unwrap();
    drop(run);
    let again = open(&o, "r").await;
    let set: Vec<u64> = again.working_set().unwrap().iter().map(|c| c.0).collect();
    assert_eq!(set, [6, 3, 40, 2], "a second report changes nothing");

    // Without reports, reads are the order again (the next run's, on the next version).
    let plain = open(&o, "r").await;
    plain.read(ChunkIdx(7)).await.unwrap();
    plain.touched(ChunkIdx(5));
    plain.write(ChunkIdx(9), chunk(9)).await.unwrap();
    plain.flush().await.unwrap();
    drop(plain);
    let set: Vec<u64> = open(&o, "r")
        .await
        .working_set()
        .unwrap()
        .iter()
        .map(|c| c.0)
        .collect();
    assert_eq!(set, [7], "a touch without the report is not recorded");
}

#[tokio::test]
async fn a_fork_names_its_parent_and_a_fork_too_deep_lists_every_chunk() {
    let dir = tempfile::tempdir().unwrap();
    let o = objects(dir.path());
    let v = open(&o, "f0").await;
    v.write(ChunkIdx(1), chunk(1)).await.unwrap();
    v.flush().await.unwrap();
    drop(v);
    // A chain of forks, each writing one chunk of its own.
    for d in 1..=farmap_versions::MAX_DEPTH + 1 {
        let (parent, name) = (format!("f{}", d - 1), format!("f{d}"));
        farmap_versions::fork(&*o, &parent, &At::Latest, std::slice::from_ref(&name))
            .await
            .unwrap();
        let h = history(&*o, &name).await.unwrap();
        let deep_enough = d <= farmap_versions::MAX_DEPTH;
        assert_eq!(h[0].whole, !deep_enough, "fork {d}: {h:?}");
        assert_eq!(h[0].chunks, if deep_enough { 0 } else { d as u64 });
        let f = open(&o, &name).await;
        f.write(ChunkIdx(d as u64 + 1), chunk(d as u8 + 1))
            .await
            .unwrap();
        f.flush().await.unwrap();
    }
    let last = format!("f{}", farmap_versions::MAX_DEPTH + 1);
    let f = open(&o, &last).await;
    for i in 1..=farmap_versions::MAX_DEPTH as u64 + 2 {
        assert_eq!(
            f.read(ChunkIdx(i)).await.unwrap(),
            chunk(i as u8),
            "chunk {i}"
        );
    }
    // A fork's later writes do not reach its parent.
    let parent = open(&o, "f1").await;
    assert_eq!(parent.read(ChunkIdx(3)).await.unwrap(), chunk(0));
}
