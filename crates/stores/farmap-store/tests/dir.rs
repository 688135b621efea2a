//! `DirStore` behaviour through its public API, on real directories in a temporary directory.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use farmap_core::{is_zero, Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, Store};
use farmap_store::{DirOptions, DirStore};
use farmap_testkit::conformance::chunk_content;
use tempfile::TempDir;

fn create(size: u64, chunk_size: u32) -> DirOptions {
    DirOptions {
        size: Some(size),
        chunk_size: Some(chunk_size),
        ..DirOptions::default()
    }
}

/// Options to open an existing store read-only.
fn read_only() -> DirOptions {
    DirOptions {
        read_only: true,
        ..DirOptions::default()
    }
}

/// Every regular file under `dir`, recursively.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(files_under(&path));
        } else {
            out.push(path);
        }
    }
    out.sort();
    out
}

/// Runs the conformance suite on directory stores created with `opts`, each in a directory
/// of its own.
async fn conforms(opts: impl Fn(Geometry) -> DirOptions) {
    let dir = TempDir::new().unwrap();
    let counter = AtomicU64::new(0);
    farmap_testkit::run_conformance(|g| {
        let path = dir
            .path()
            .join(format!("store-{}", counter.fetch_add(1, Ordering::Relaxed)));
        let opts = opts(g);
        async move { Arc::new(DirStore::open(&path, opts).unwrap()) as Arc<dyn Store> }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dir_store_conforms() {
    conforms(|g| create(g.size(), g.chunk_size())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dir_store_with_a_tiny_handle_cache_conforms() {
    conforms(|g| DirOptions {
        max_open_files: 1,
        ..create(g.size(), g.chunk_size())
    })
    .await;
}

/// Checks that chunk `idx` of `store` holds version `version` of its content.
async fn holds_version(store: &DirStore, idx: ChunkIdx, version: u32) {
    let want = chunk_content(store.geometry(), idx, version);
    assert_eq!(store.read(idx).await.unwrap(), want, "{idx}");
}

#[tokio::test]
async fn reopen_round_trip_and_layout() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("region");
    // 5000 chunks of 4 KiB, the last one short: two subdirectories.
    let store = DirStore::open(&path, create(5000 * 4096 - 100, 4096)).unwrap();
    assert_eq!(store.path(), path);
    let g = store.geometry();
    let written = [ChunkIdx(0), ChunkIdx(0xa1f), ChunkIdx(4999)];
    for idx in written {
        store.write(idx, chunk_content(g, idx, 3)).await.unwrap();
    }
    // An all-zero write leaves no file.
    store
        .write(ChunkIdx(7), Bytes::from(vec![0u8; 4096]))
        .await
        .unwrap();
    store.flush().await.unwrap();
    drop(store);

    let rel: Vec<String> = files_under(&path)
        .iter()
        .map(|p| p.strip_prefix(&path).unwrap().display().to_string())
        .collect();
    assert_eq!(
        rel,
        [
            "0000/0000000000000000.chunk",
            "0000/0000000000000a1f.chunk",
            "0001/0000000000001387.chunk",
            "farmap-dir.meta",
        ]
    );
    let meta = std::fs::read_to_string(path.join("farmap-dir.meta")).unwrap();
    assert_eq!(meta, "farmap-dir 1\nsize=20479900\nchunk=4096\n");

    let store = DirStore::open(&path, DirOptions::default()).unwrap();
    assert_eq!(store.geometry(), g);
    for idx in written {
        assert_eq!(store.read(idx).await.unwrap(), chunk_content(g, idx, 3));
        assert_eq!(store.status(idx).await.unwrap(), ChunkStatus::Data);
    }
    assert!(is_zero(&store.read(ChunkIdx(7)).await.unwrap()));
    assert_eq!(store.status(ChunkIdx(7)).await.unwrap(), ChunkStatus::Zero);
}

#[test]
fn conflicting_or_missing_metadata_is_refused() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("region");
    drop(DirStore::open(&path, create(1 << 30, 65536)).unwrap());

    let err = DirStore::open(&path, create(2 << 30, 65536)).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert!(err.context().contains("size=1GiB"), "{err}");
    assert!(err.context().contains("size=2GiB"), "{err}");
    let err = DirStore::open(&path, create(1 << 30, 4096)).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert!(err.context().contains("64KiB") && err.context().contains("4KiB"));

    let missing = dir.path().join("nothing");
    let err = DirStore::open(&missing, DirOptions::default()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound);
    assert!(err.context().contains(&*missing.to_string_lossy()), "{err}");
    assert!(err.context().contains("?size="), "{err}");
    assert!(!missing.exists(), "nothing is created without a size");

    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let err = DirStore::open(&empty, DirOptions::default()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound);
    assert!(err.context().contains("?size="), "{err}");

    let err = DirStore::open(&dir.path().join("bad"), create(1 << 20, 1000)).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "bad chunk size");
    assert!(!dir.path().join("bad").exists());

    std::fs::write(path.join("farmap-dir.meta"), "farmap-dir 9\n").unwrap();
    let err = DirStore::open(&path, DirOptions::default()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt);
}

#[test]
fn someone_elses_directory_is_left_alone() {
    let dir = TempDir::new().unwrap();
    let theirs = dir.path().join("photos");
    std::fs::create_dir(&theirs).unwrap();
    std::fs::write(theirs.join("cat.jpg"), b"meow").unwrap();
    let err = DirStore::open(&theirs, create(1 << 20, 4096)).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert!(err.context().contains("not empty"), "{err}");
    assert_eq!(files_under(&theirs), [theirs.join("cat.jpg")]);

    // An empty directory becomes a store.
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    assert!(DirStore::open(&empty, create(1 << 20, 4096)).is_ok());
    assert!(empty.join("farmap-dir.meta").exists());
}

#[tokio::test]
async fn leftover_temp_files_are_removed_on_open() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("region");
    let store = DirStore::open(&path, create(1 << 20, 4096)).unwrap();
    let g = store.geometry();
    store
        .write(ChunkIdx(1), chunk_content(g, ChunkIdx(1), 1))
        .await
        .unwrap();
    drop(store);
    // What a crash in the middle of a write leaves behind.
    let leftover = path.join("tmp").join("0000000000000002-1234-0.tmp");
    std::fs::write(&leftover, vec![9u8; 100]).unwrap();

    let ro = DirStore::open(&path, read_only()).unwrap();
    assert!(leftover.exists(), "a read-only open changes nothing");
    drop(ro);

    let store = DirStore::open(&path, DirOptions::default()).unwrap();
    assert!(!leftover.exists(), "the temp file must be removed");
    assert_eq!(std::fs::read_dir(path.join("tmp")).unwrap().count(), 0);
    holds_version(&store, ChunkIdx(1), 1).await;
    assert!(is_zero(&store.read(ChunkIdx(2)).await.unwrap()));
}

#[tokio::test]
async fn open_files_stay_within_the_bound() {
    let dir = TempDir::new().unwrap();
    let opts = DirOptions {
        max_open_files: 4,
        ..create(64 * 4096, 4096)
    };
    let store = DirStore::open(&dir.path().join("region"), opts).unwrap();
    let g = store.geometry();
    for idx in g.all().iter() {
        store.write(idx, chunk_content(g, idx, 1)).await.unwrap();
    }
    assert_eq!(store.open_files(), 0, "writes do not cache read handles");
    for round in 0..2 {
        for idx in g.all().iter() {
            assert_eq!(store.read(idx).await.unwrap(), chunk_content(g, idx, 1));
            assert!(
                store.open_files() <= 4,
                "round {round}, {idx}: over the bound"
            );
        }
    }
    assert_eq!(store.open_files(), 4, "the cache fills up to its bound");

    let none = DirOptions {
        max_open_files: 0,
        ..read_only()
    };
    let uncached = DirStore::open(&dir.path().join("region"), none).unwrap();
    holds_version(&uncached, ChunkIdx(5), 1).await;
    assert_eq!(uncached.open_files(), 0);
}

#[tokio::test]
async fn a_rewrite_is_seen_through_a_cached_handle() {
    let dir = TempDir::new().unwrap();
    let store = DirStore::open(&dir.path().join("region"), create(1 << 20, 4096)).unwrap();
    let g = store.geometry();
    let idx = ChunkIdx(9);
    store.write(idx, chunk_content(g, idx, 1)).await.unwrap();
    assert_eq!(store.read(idx).await.unwrap(), chunk_content(g, idx, 1));
    assert_eq!(store.open_files(), 1, "the read cached its handle");
    store.write(idx, chunk_content(g, idx, 2)).await.unwrap();
    assert_eq!(
        store.read(idx).await.unwrap(),
        chunk_content(g, idx, 2),
        "a stale handle would read the replaced file"
    );
    store.trim(ChunkRange::single(idx)).await.unwrap();
    assert!(
        is_zero(&store.read(idx).await.unwrap()),
        "trim drops the handle too"
    );
}

#[tokio::test]
async fn flush_syncs_what_was_written() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("region");
    let store = DirStore::open(&path, create(32 << 20, 4096)).unwrap();
    let g = store.geometry();
    for i in [1, 2, 3, 4097, 4098] {
        let idx = ChunkIdx(i);
        store.write(idx, chunk_content(g, idx, 1)).await.unwrap();
    }
    store
        .write(ChunkIdx(2), chunk_content(g, ChunkIdx(2), 2))
        .await
        .unwrap();
    assert_eq!(store.unflushed_chunks(), 5);
    // A chunk written and then removed before the flush: nothing to sync, no error.
    store.trim(ChunkRange::single(ChunkIdx(3))).await.unwrap();
    store.flush().await.unwrap();
    assert_eq!(
        store.unflushed_chunks(),
        0,
        "flush syncs every written chunk"
    );
    store.flush().await.unwrap();
    drop(store);

    let store = DirStore::open(&path, DirOptions::default()).unwrap();
    holds_version(&store, ChunkIdx(2), 2).await;
    assert!(is_zero(&store.read(ChunkIdx(3)).await.unwrap()));
}

#[tokio::test]
async fn large_trims_remove_only_files_in_range() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("region");
    let store = DirStore::open(&path, create(1 << 30, 4096)).unwrap();
    let g = store.geometry();
    let kept = [ChunkIdx(99), ChunkIdx(100_001), ChunkIdx(200_000)];
    for idx in kept
        .into_iter()
        .chain([100, 4095, 4096, 5000, 100_000].map(ChunkIdx))
    {
        store.write(idx, chunk_content(g, idx, 4)).await.unwrap();
    }
    store
        .trim(ChunkRange::new(ChunkIdx(100), ChunkIdx(100_001)))
        .await
        .unwrap();
    // A small trim of chunks without files.
    store
        .trim(ChunkRange::new(ChunkIdx(100_002), ChunkIdx(100_010)))
        .await
        .unwrap();
    let chunk_files = files_under(&path)
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "chunk"))
        .count();
    assert_eq!(chunk_files, kept.len());
    for idx in kept {
        assert_eq!(store.status(idx).await.unwrap(), ChunkStatus::Data);
    }
    assert_eq!(
        store.status(ChunkIdx(4096)).await.unwrap(),
        ChunkStatus::Zero
    );
}

#[tokio::test]
async fn read_only_stores_refuse_changes() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("region");
    let store = DirStore::open(&path, create(8 * 4096, 4096)).unwrap();
    let g = store.geometry();
    for idx in g.all().iter().step_by(3) {
        store.write(idx, chunk_content(g, idx, 1)).await.unwrap();
    }
    drop(store);

    let opts = read_only();
    let ro = Arc::new(DirStore::open(&path, opts.clone()).unwrap());
    assert!(!ro.caps().contains(Caps::WRITE) && !ro.caps().contains(Caps::TRIM));
    let err = ro.trim(ChunkRange::single(ChunkIdx(0))).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ReadOnly);
    farmap_testkit::run_read_only_conformance(ro, |idx| {
        if idx.0 % 3 == 0 {
            chunk_content(g, idx, 1).to_vec()
        } else {
            vec![0; g.chunk_len(idx)]
        }
    })
    .await;

    let err = DirStore::open(
        &dir.path().join("new"),
        DirOptions {
            size: Some(1 << 20),
            ..opts
        },
    )
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "read-only never creates");
}

/// Child process of `one_writer_per_directory_across_processes`: opens the store named by
/// `FARMAP_LOCK_DIR` writable, says so on stdout, and holds it until stdin closes.
#[test]
#[ignore = "child process of one_writer_per_directory_across_processes; run only by it"]
fn lock_holder_child() {
    use std::io::{BufRead, Write};
    let path = std::env::var("FARMAP_LOCK_DIR").expect("FARMAP_LOCK_DIR is set by the parent");
    let _store = DirStore::open(Path::new(&path), DirOptions::default()).unwrap();
    let mut out = std::io::stdout().lock();
    writeln!(out, "LOCKED").unwrap();
    out.flush().unwrap();
    // Hold the lock until the parent closes our stdin.
    for _ in std::io::stdin().lock().lines() {}
}

#[tokio::test]
async fn one_writer_per_directory_in_a_process() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("region");
    let writer = DirStore::open(&path, create(16 * 4096, 4096)).unwrap();
    writer
        .write(ChunkIdx(1), Bytes::from(vec![7u8; 4096]))
        .await
        .unwrap();
    let e = DirStore::open(&path, DirOptions::default()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable);
    assert!(
        e.context().contains(&path.display().to_string()) && e.context().contains("in use"),
        "the refusal names the directory: {e}"
    );
    // A temporary file of the running writer (as if a write were in progress).
    let pending = path.join("tmp").join("pending.tmp");
    std::fs::write(&pending, b"in flight").unwrap();
    let reader = DirStore::open(&path, read_only()).unwrap();
    assert_eq!(
        reader.read(ChunkIdx(1)).await.unwrap(),
        Bytes::from(vec![7u8; 4096])
    );
    assert!(pending.exists(), "a read-only open leaves tmp/ alone");
    drop(reader);
    drop(writer);
    let again = DirStore::open(&path, DirOptions::default()).unwrap();
    assert!(
        !pending.exists(),
        "the next writer clears what a dead one left"
    );
    assert_eq!(
        again.read(ChunkIdx(1)).await.unwrap(),
        Bytes::from(vec![7u8; 4096])
    );
}

#[tokio::test]
async fn one_writer_per_directory_across_processes() {
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("region");
    drop(DirStore::open(&path, create(16 * 4096, 4096)).unwrap());
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "lock_holder_child",
            "--ignored",
            "--exact",
            "--nocapture",
            "-q",
        ])
        .env("FARMAP_LOCK_DIR", &path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(
        lines.any(|l| l.unwrap().contains("LOCKED")),
        "the child opened the store"
    );
    let pending = path.join("tmp").join("pending.tmp");
    std::fs::write(&pending, b"in flight").unwrap();

    let e = DirStore::open(&path, DirOptions::default()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(e.context().contains(&path.display().to_string()), "{e}");
    let reader = DirStore::open(&path, read_only()).unwrap();
    assert_eq!(reader.read(ChunkIdx(0)).await.unwrap().len(), 4096);
    assert!(pending.exists(), "the reader left the writer's tmp/ alone");

    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    DirStore::open(&path, DirOptions::default()).expect("the lock died with its holder");
}
