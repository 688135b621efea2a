//! The store against a real web server: nginx (scripts/services/nginx.sh) serving files the
//! tests write, honouring Range and If-Match as web servers do.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use farmap_core::{ChunkIdx, ErrorKind, Store};
use farmap_http::{HttpLocation, HttpOptions, HttpStore};
use farmap_testkit::{skip, Service};

/// The nginx of this test binary, or `None` after recording why the test is skipped.
fn nginx(test: &str) -> Option<&'static Service> {
    skip::unless(test, Service::shared("nginx"))
}

/// Writes `data` as `name` in the server's root; returns its URL.
fn put(svc: &Service, name: &str, data: &[u8]) -> String {
    std::fs::write(std::path::Path::new(svc.var("ROOT")).join(name), data).unwrap();
    format!("{}/{name}", svc.var("URL_BASE"))
}

fn options(url: &str, size: Option<u64>) -> HttpOptions {
    let location = HttpLocation::parse("http", url.strip_prefix("http:").unwrap()).unwrap();
    HttpOptions {
        location,
        size,
        chunk_size: None,
    }
}

/// `len` bytes that differ from chunk to chunk.
fn content(len: usize, seed: u64) -> Vec<u8> {
    farmap_testkit::XorShift(seed)
        .take(len)
        .map(|x| x as u8)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_a_file_with_a_short_last_chunk() {
    let Some(svc) = nginx("reads_a_file_with_a_short_last_chunk") else {
        return;
    };
    // 3 MiB and a bit: 49 chunks of 64 KiB, the last one 12345 bytes.
    let data = content((3 << 20) + 12345, 7);
    let url = put(svc, "short-tail.img", &data);
    let store = Arc::new(
        HttpStore::open(options(&url, Some(data.len() as u64)))
            .await
            .unwrap(),
    );
    let g = store.geometry();
    assert_eq!((g.size(), g.chunk_count()), (data.len() as u64, 49));
    assert_eq!(g.chunk_len(ChunkIdx(48)), 12345);
    // All chunks at once, through the connection pool.
    let reads: Vec<_> = g
        .all()
        .iter()
        .map(|idx| {
            let s = store.clone();
            tokio::spawn(async move { (idx, s.read(idx).await) })
        })
        .collect();
    for r in reads {
        let (idx, chunk) = r.await.unwrap();
        let chunk = chunk.unwrap();
        let range = g.byte_range(idx);
        assert!(
            chunk[..] == data[range.start as usize..range.end as usize],
            "{idx}"
        );
    }
    let part = store.read_part(ChunkIdx(48), 100, 200).await.unwrap();
    let at = g.offset_of(ChunkIdx(48)) as usize + 100;
    assert!(part[..] == data[at..at + 200]);
    let expected = |idx: ChunkIdx| {
        let r = g.byte_range(idx);
        data[r.start as usize..r.end as usize].to_vec()
    };
    farmap_testkit::conformance::run_read_only_conformance(store.clone(), expected).await;
    let err = store.trim(g.all()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ReadOnly, "{err}");
    assert!(err.to_string().contains("read-only"), "{err}");
}

#[tokio::test]
async fn a_file_changed_on_the_server_is_an_error_not_mixed_data() {
    let test = "a_file_changed_on_the_server_is_an_error_not_mixed_data";
    let Some(svc) = nginx(test) else { return };
    let data = content(1 << 20, 1);
    let url = put(svc, "changing.img", &data);
    let store = HttpStore::open(options(&url, None)).await.unwrap();
    assert!(store.read(ChunkIdx(0)).await.unwrap()[..] == data[..65536]);
    // New content of the same size, written later (nginx's ETag is mtime and size).
    let path = std::path::Path::new(svc.var("ROOT")).join("changing.img");
    std::fs::write(&path, content(1 << 20, 2)).unwrap();
    let later = SystemTime::now() + Duration::from_secs(10);
    std::fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_modified(later)
        .unwrap();
    let err = store.read(ChunkIdx(1)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    assert!(err.to_string().contains("changed on the server"), "{err}");
    // A shorter file is caught as well.
    std::fs::write(&path, content(1000, 3)).unwrap();
    let err = store.read(ChunkIdx(2)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    // Opened again, the new version reads.
    let again = HttpStore::open(options(&url, None)).await.unwrap();
    assert_eq!(again.geometry().size(), 1000);
}

#[tokio::test]
async fn bad_input_gets_a_clear_error() {
    let Some(svc) = nginx("bad_input_gets_a_clear_error") else {
        return;
    };
    let url = put(svc, "sized.img", &content(100_000, 4));
    let err = HttpStore::open(options(&url, Some(200_000)))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(err.to_string().contains("but the spec says size="), "{err}");
    let missing = format!("{}/no-such.img", svc.var("URL_BASE"));
    let err = HttpStore::open(options(&missing, None)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    assert!(
        err.to_string()
            .contains("no such file on the server (404 Not Found)"),
        "{err}"
    );
    let empty = put(svc, "empty.img", b"");
    let err = HttpStore::open(options(&empty, None)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(err.to_string().contains("empty"), "{err}");
    let store = HttpStore::open(options(&url, None)).await.unwrap();
    let err = store
        .write(ChunkIdx(0), vec![0; 65536].into())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ReadOnly, "{err}");
}
