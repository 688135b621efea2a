//! `FileStore` behaviour through its public API, on real files in a temporary directory.

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use farmap_core::{Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Store};
use farmap_store::{FileOptions, FileStore};
use farmap_testkit::conformance::chunk_content;
use tempfile::TempDir;

fn opts(size: Option<u64>, chunk_size: u32) -> FileOptions {
    FileOptions {
        size,
        chunk_size,
        read_only: false,
    }
}

fn read_only(size: Option<u64>) -> FileOptions {
    FileOptions {
        size,
        read_only: true,
        ..FileOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_store_conforms() {
    let dir = TempDir::new().unwrap();
    let counter = AtomicU64::new(0);
    farmap_testkit::run_conformance(|g| {
        let path = dir
            .path()
            .join(format!("{}.img", counter.fetch_add(1, Ordering::Relaxed)));
        async move {
            let store = FileStore::open(&path, opts(Some(g.size()), g.chunk_size())).unwrap();
            Arc::new(store) as Arc<dyn Store>
        }
    })
    .await;
}

#[tokio::test]
async fn created_files_are_sparse_and_trim_releases_blocks() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("disk.img");
    let store = FileStore::open(&path, opts(Some(64 << 20), 65536)).unwrap();
    assert_eq!(store.path(), path);
    let meta = std::fs::metadata(&path).unwrap();
    assert_eq!(meta.len(), 64 << 20);
    assert_eq!(meta.blocks(), 0, "a new file must not allocate blocks");

    let g = store.geometry();
    store
        .write(ChunkIdx(3), chunk_content(g, ChunkIdx(3), 1))
        .await
        .unwrap();
    store.flush().await.unwrap();
    let used = std::fs::metadata(&path).unwrap().blocks() * 512;
    assert!(used >= 65536, "a written chunk uses blocks ({used} bytes)");
    assert_eq!(store.status(ChunkIdx(3)).await.unwrap(), ChunkStatus::Data);
    assert_eq!(store.status(ChunkIdx(4)).await.unwrap(), ChunkStatus::Zero);

    store
        .trim(ChunkRange::new(ChunkIdx(0), ChunkIdx(1024)))
        .await
        .unwrap();
    assert_eq!(std::fs::metadata(&path).unwrap().blocks(), 0);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 64 << 20);
    assert_eq!(store.status(ChunkIdx(3)).await.unwrap(), ChunkStatus::Zero);
}

#[tokio::test]
async fn reopening_without_a_size_reads_back_the_data() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("disk.img");
    // A short last chunk: 10 000 bytes in 4 KiB chunks.
    let store = FileStore::open(&path, opts(Some(10_000), 4096)).unwrap();
    let g = store.geometry();
    for i in [0, 2] {
        store
            .write(ChunkIdx(i), chunk_content(g, ChunkIdx(i), 7))
            .await
            .unwrap();
    }
    store.flush().await.unwrap();
    drop(store);

    let store = FileStore::open(&path, opts(None, 4096)).unwrap();
    assert_eq!(store.geometry(), g);
    for i in [0, 2] {
        assert_eq!(
            store.read(ChunkIdx(i)).await.unwrap(),
            chunk_content(g, ChunkIdx(i), 7)
        );
    }
    assert!(farmap_core::is_zero(
        &store.read(ChunkIdx(1)).await.unwrap()
    ));
    // Giving the same size again is fine too (once the first writer is gone).
    drop(store);
    assert!(FileStore::open(&path, opts(Some(10_000), 4096)).is_ok());
}

#[test]
fn a_conflicting_size_is_refused() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("disk.img");
    std::fs::write(&path, vec![1u8; 1 << 20]).unwrap();
    let err = FileStore::open(&path, opts(Some(2 << 30), 65536)).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert_eq!(
        err.context(),
        format!(
            "{} is 1048576 bytes but size=2GiB was asked for",
            path.display()
        )
    );
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        1 << 20,
        "untouched"
    );
}

#[test]
fn a_missing_file_error_names_the_path_and_the_fix() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("nothing-here.img");
    let err = FileStore::open(&path, FileOptions::default()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound);
    assert!(err.context().contains(&*path.to_string_lossy()), "{err}");
    assert!(err.context().contains("?size="), "{err}");

    let err = FileStore::open(&path, read_only(Some(1 << 20))).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound);
    assert!(!path.exists(), "a read-only open must not create the file");
}

#[test]
fn bad_options_are_refused_before_anything_is_created() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("disk.img");
    let err = FileStore::open(&path, opts(Some(1 << 20), 1000)).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert!(!path.exists());

    std::fs::write(&path, b"").unwrap();
    let err = FileStore::open(&path, FileOptions::default()).unwrap_err();
    assert_eq!(
        err.kind(),
        ErrorKind::InvalidInput,
        "an empty file has no size"
    );
    assert!(err.context().contains("empty"), "{err}");

    let err = FileStore::open(dir.path(), FileOptions::default()).unwrap_err();
    assert!(
        err.context().contains(&*dir.path().to_string_lossy()),
        "{err}"
    );
}

#[tokio::test]
async fn read_only_stores_refuse_changes() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("disk.img");
    let content: Vec<u8> = (0..5 * 4096 + 10).map(|i| (i % 253) as u8).collect();
    std::fs::write(&path, &content).unwrap();

    let store = Arc::new(FileStore::open(&path, read_only(None)).unwrap());
    assert!(!store.caps().contains(Caps::WRITE));
    assert!(!store.caps().contains(Caps::TRIM));
    assert!(store.caps().contains(Caps::STATUS));
    let err = store
        .trim(ChunkRange::single(ChunkIdx(0)))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ReadOnly);

    let g = store.geometry();
    assert_eq!(g.size(), content.len() as u64);
    farmap_testkit::run_read_only_conformance(store, |idx| {
        let r = g.byte_range(idx);
        content[r.start as usize..r.end as usize].to_vec()
    })
    .await;
    assert_eq!(
        std::fs::read(&path).unwrap(),
        content,
        "the file is unchanged"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_chunks_from_many_tasks_in_parallel() {
    const VERSIONS: u32 = 8;
    let dir = TempDir::new().unwrap();
    let path: PathBuf = dir.path().join("disk.img");
    let store = Arc::new(FileStore::open(&path, opts(Some(1 << 20), 65536)).unwrap());
    let g = store.geometry();
    let chunks = [ChunkIdx(1), ChunkIdx(2)];
    let mut tasks = Vec::new();
    for t in 0..16u32 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let idx = chunks[(t % 2) as usize];
            for round in 0..40u32 {
                if t < 8 {
                    let v = (t / 2 + round) % VERSIONS;
                    store.write(idx, chunk_content(g, idx, v)).await.unwrap();
                } else {
                    let data = store.read(idx).await.unwrap();
                    let whole = farmap_core::is_zero(&data)
                        || (0..VERSIONS).any(|v| data == chunk_content(g, idx, v));
                    assert!(whole, "a read of {idx} saw a torn chunk");
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    for idx in chunks {
        let data = store.read(idx).await.unwrap();
        assert!((0..VERSIONS).any(|v| data == chunk_content(g, idx, v)));
    }
    let untouched = store.read(ChunkIdx(3)).await.unwrap();
    assert!(farmap_core::is_zero(&untouched));
}

#[tokio::test]
async fn writes_to_a_read_only_store_leave_the_data() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("disk.img");
    let store = FileStore::open(&path, opts(Some(65536 * 2), 65536)).unwrap();
    let g = store.geometry();
    store
        .write(ChunkIdx(0), chunk_content(g, ChunkIdx(0), 1))
        .await
        .unwrap();
    drop(store);
    let ro = FileStore::open(&path, read_only(Some(65536 * 2))).unwrap();
    let err = ro
        .write(ChunkIdx(0), Bytes::from(vec![0u8; 65536]))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ReadOnly);
    assert!(err.context().contains("read-only"));
    assert_eq!(
        ro.read(ChunkIdx(0)).await.unwrap(),
        chunk_content(g, ChunkIdx(0), 1)
    );
    ro.flush().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_never_see_half_a_large_write() {
    // 4 MiB chunks take long enough to copy that an unlocked read would overlap a write.
    const CHUNK: usize = 4 << 20;
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("disk.img");
    let opts = opts(Some(2 * CHUNK as u64), CHUNK as u32);
    let store = Arc::new(FileStore::open(&path, opts).unwrap());
    let fills: Arc<Vec<Bytes>> = Arc::new((1..=4u8).map(|b| Bytes::from(vec![b; CHUNK])).collect());
    let writers = (0..2).map(|w| {
        let (store, fills) = (store.clone(), fills.clone());
        tokio::spawn(async move {
            for round in 0..100 {
                let fill = fills[(w + round) % fills.len()].clone();
                store.write(ChunkIdx(0), fill).await.unwrap();
            }
        })
    });
    let readers = (0..2).map(|_| {
        let store = store.clone();
        tokio::spawn(async move {
            for _ in 0..200 {
                let data = store.read(ChunkIdx(0)).await.unwrap();
                // One byte per page is enough to see two writes mixed.
                let first = data[0];
                let uniform = data.iter().step_by(4096).all(|&b| b == first);
                assert!(
                    uniform && data[CHUNK - 1] == first,
                    "a read saw a torn chunk"
                );
            }
        })
    });
    let all: Vec<_> = writers.chain(readers).collect();
    for t in all {
        t.await.unwrap();
    }
}

#[test]
fn a_failed_create_leaves_nothing_and_names_the_problem() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("huge.img");
    // 1 PiB: more than ext4 (16 TiB) or tmpfs allow in one file.
    let e = match FileStore::open(&path, opts(Some(1 << 50), 4 << 20)) {
        Ok(store) => {
            drop(store);
            std::fs::remove_file(&path).unwrap();
            farmap_testkit::skip(
                "a_failed_create_leaves_nothing_and_names_the_problem",
                "the file system of the temporary directory holds a 1 PiB sparse file",
            );
            return;
        }
        Err(e) => e,
    };
    assert!(!path.exists(), "the failed create removed the file it made");
    let msg = e.to_string();
    assert!(
        msg.contains("file too large") && !msg.contains("no space"),
        "the error names the real problem: {msg}"
    );
    assert_eq!(e.kind(), ErrorKind::InvalidInput);

    // A file that was there before is never removed by a failed open.
    std::fs::write(&path, b"").unwrap();
    assert!(FileStore::open(&path, opts(Some(1 << 50), 4 << 20)).is_err());
    assert!(path.exists(), "a file this open did not create stays");
}

#[tokio::test]
async fn a_failed_flush_stays_failed_until_the_store_is_reopened() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("region.img");
    let store = FileStore::open(&path, opts(Some(1 << 20), 4096)).unwrap();
    store
        .write(ChunkIdx(1), Bytes::from(vec![1u8; 4096]))
        .await
        .unwrap();
    store.flush().await.unwrap();
    store
        .write(ChunkIdx(2), Bytes::from(vec![2u8; 4096]))
        .await
        .unwrap();
    // The sync fails as fdatasync does after a write-back error (EIO).
    store.fail_next_sync(5);
    let first = store.flush().await.unwrap_err();
    assert_eq!(first.kind(), ErrorKind::Io, "{first}");
    // Linux has marked the pages clean: another fdatasync would succeed. The store says no.
    for _ in 0..2 {
        let again = store.flush().await.unwrap_err();
        assert!(
            again.context().contains("an earlier flush") && again.context().contains("reopen"),
            "{again}"
        );
    }
    store
        .write(ChunkIdx(3), Bytes::from(vec![3u8; 4096]))
        .await
        .unwrap();
    assert!(store.flush().await.is_err(), "new writes do not clear it");
    drop(store);
    let reopened = FileStore::open(&path, opts(None, 4096)).unwrap();
    reopened.flush().await.expect("a reopened store flushes");
}

/// Two writers of one file could tear a chunk (each write lands page by page): the second
/// writable opening is refused, a read-only one is not, and the lock goes with the writer.
#[tokio::test]
async fn one_writer_per_file() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("region.img");
    let writer = FileStore::open(&path, opts(Some(16 * 4096), 4096)).unwrap();
    writer
        .write(ChunkIdx(1), Bytes::from(vec![7u8; 4096]))
        .await
        .unwrap();
    let e = FileStore::open(&path, opts(None, 4096)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(
        e.context().contains(&path.display().to_string()) && e.context().contains("in use"),
        "the refusal names the file: {e}"
    );
    let reader = FileStore::open(
        &path,
        FileOptions {
            chunk_size: 4096,
            ..read_only(None)
        },
    )
    .unwrap();
    assert_eq!(
        reader.read(ChunkIdx(1)).await.unwrap(),
        Bytes::from(vec![7u8; 4096])
    );
    drop(writer);
    let again = FileStore::open(&path, opts(None, 4096)).unwrap();
    assert_eq!(
        again.read(ChunkIdx(1)).await.unwrap(),
        Bytes::from(vec![7u8; 4096])
    );
}

#[tokio::test]
async fn part_of_a_chunk_is_read_alone_and_checked() {
    let dir = TempDir::new().unwrap();
    let store = FileStore::open(&dir.path().join("r.img"), opts(Some(1 << 20), 65536)).unwrap();
    let g = store.geometry();
    let data = chunk_content(g, ChunkIdx(3), 5);
    store.write(ChunkIdx(3), data.clone()).await.unwrap();
    let part = store.read_part(ChunkIdx(3), 1000, 10).await.unwrap();
    assert_eq!(part, data.slice(1000..1010));
    assert_eq!(part.len(), 10, "only the part, not the chunk");
    let e = store.read_part(ChunkIdx(3), 65530, 10).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfRange, "{e}");
    let e = store.read_part(ChunkIdx(16), 0, 1).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfRange, "{e}");
    // A hint: nothing changes.
    store.prefetch(ChunkIdx(3)).await.unwrap();
    assert_eq!(store.read(ChunkIdx(3)).await.unwrap(), data);
}
