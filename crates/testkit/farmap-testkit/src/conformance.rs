//! The conformance suite that every store and every stage runs.
//!
//! Call [`run_conformance`] with a factory that builds a *fresh, empty, writable* store of the
//! geometry it is given; each check gets its own store. A failure panics with the name of the
//! check and what was seen, so `#[tokio::test]` reports it.
//!
//! ```text
//! #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
//! async fn memory_store_conforms() {
//!     farmap_testkit::run_conformance(|g| async move {
//!         Arc::new(MemoryStore::new(g)) as Arc<dyn Store>
//!     }).await;
//! }
//! ```

use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use farmap_core::{
    is_zero, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, Store, StoreResult,
};
use futures::future::join_all;

/// Geometries every writable store is checked with: an exact multiple of the chunk size, a
/// short last chunk, 4 KiB chunks, and a single chunk.
pub fn geometries() -> Vec<Geometry> {
    vec![
        Geometry::new(16 * 65536, 65536).expect("valid"),
        Geometry::new(7 * 4096 + 1000, 4096).expect("valid"),
        Geometry::new(64 * 4096, 4096).expect("valid"),
        Geometry::new(1 << 20, 1 << 20).expect("valid"),
        Geometry::new(2 * (4 << 20), 4 << 20).expect("valid"),
    ]
}

/// Content of chunk `idx` at write `version`: every byte derived from both, so a torn chunk
/// (half one version, half another) is detectable.
pub fn chunk_content(geometry: Geometry, idx: ChunkIdx, version: u32) -> Bytes {
    let len = geometry.chunk_len(idx);
    let tag = (idx.0 as u32).wrapping_mul(2_654_435_761) ^ version.wrapping_mul(40503);
    let mut v = Vec::with_capacity(len);
    for i in 0..len {
        v.push((tag.wrapping_add(i as u32 / 4) % 251) as u8 | 1);
    }
    Bytes::from(v)
}

/// Which version of [`chunk_content`] `data` is, if it is exactly one of `0..versions`.
fn version_of(geometry: Geometry, idx: ChunkIdx, data: &[u8], versions: u32) -> Option<u32> {
    (0..versions).find(|v| chunk_content(geometry, idx, *v) == data)
}

fn expect_kind<T: std::fmt::Debug>(what: &str, r: StoreResult<T>, kind: ErrorKind) {
    match r {
        Err(e) if e.kind() == kind => {}
        Err(e) => panic!("{what}: expected a {kind:?} error, got {:?}: {e}", e.kind()),
        Ok(v) => panic!("{what}: expected a {kind:?} error, got Ok({v:?})"),
    }
}

/// Runs every check against fresh stores from `make`, for each of [`geometries`].
pub async fn run_conformance<F, Fut>(make: F)
where
    F: Fn(Geometry) -> Fut,
    Fut: Future<Output = Arc<dyn Store>>,
{
    run_conformance_with(geometries(), make).await;
}

/// Runs every check against fresh stores from `make`, for each geometry of `geometries`: for
/// a store that cannot take all of [`geometries`] (a CQL row holds at most 1 MiB, so
/// `geometries().into_iter().filter(|g| g.chunk_size() <= 1 << 20)`).
pub async fn run_conformance_with<F, Fut>(geometries: impl IntoIterator<Item = Geometry>, make: F)
where
    F: Fn(Geometry) -> Fut,
    Fut: Future<Output = Arc<dyn Store>>,
{
    for g in geometries {
        check_geometry_and_zeros(make(g).await, g).await;
        check_round_trip(make(g).await, g).await;
        check_lengths(make(g).await, g).await;
        check_out_of_range(make(g).await, g).await;
        check_trim_and_status(make(g).await, g).await;
        check_concurrent_writers(make(g).await, g).await;
        check_same_chunk_races(make(g).await, g).await;
        check_no_torn_reads(make(g).await, g).await;
    }
}

/// Runs the checks that apply to a read-only store whose content is given by `expected`.
pub async fn run_read_only_conformance(
    store: Arc<dyn Store>,
    expected: impl Fn(ChunkIdx) -> Vec<u8>,
) {
    let g = store.geometry();
    assert!(
        !store.caps().contains(farmap_core::Caps::WRITE),
        "a read-only store must not report the write capability"
    );
    for idx in g.all().iter() {
        let data = store.read(idx).await.expect("read");
        assert_eq!(data.len(), g.chunk_len(idx), "length of {idx}");
        assert!(data[..] == expected(idx)[..], "content of {idx}");
    }
    expect_kind(
        "write to a read-only store",
        store
            .write(ChunkIdx(0), Bytes::from(vec![0; g.chunk_len(ChunkIdx(0))]))
            .await,
        ErrorKind::ReadOnly,
    );
    let past = ChunkIdx(g.chunk_count());
    expect_kind(
        "read past the end",
        store.read(past).await,
        ErrorKind::OutOfRange,
    );
    store.flush().await.expect("flush of a read-only store");
}

async fn check_geometry_and_zeros(store: Arc<dyn Store>, g: Geometry) {
    assert_eq!(
        store.geometry(),
        g,
        "the store must report the geometry it was made with"
    );
    for idx in g.all().iter() {
        let data = store.read(idx).await.expect("read of a fresh chunk");
        assert_eq!(data.len(), g.chunk_len(idx), "length of fresh {idx}");
        assert!(is_zero(&data), "fresh {idx} must read as zeros");
    }
    store.flush().await.expect("flush of an empty store");
}

async fn check_round_trip(store: Arc<dyn Store>, g: Geometry) {
    let n = g.chunk_count();
    // Write every other chunk, then overwrite a few with a new version.
    for i in (0..n).step_by(2) {
        let idx = ChunkIdx(i);
        store
            .write(idx, chunk_content(g, idx, 1))
            .await
            .unwrap_or_else(|e| panic!("write {idx}: {e}"));
    }
    for i in (0..n).step_by(4) {
        let idx = ChunkIdx(i);
        store
            .write(idx, chunk_content(g, idx, 2))
            .await
            .expect("overwrite");
    }
    store.flush().await.expect("flush");
    for i in 0..n {
        let idx = ChunkIdx(i);
        let data = store.read(idx).await.expect("read back");
        assert_eq!(data.len(), g.chunk_len(idx), "length of {idx}");
        let want = match i {
            i if i % 4 == 0 => chunk_content(g, idx, 2),
            i if i % 2 == 0 => chunk_content(g, idx, 1),
            _ => {
                assert!(is_zero(&data), "unwritten {idx} must read as zeros");
                continue;
            }
        };
        assert!(data == want, "{idx} must read back what was last written");
    }
    // Writing zeros is a write like any other.
    let idx = ChunkIdx(0);
    store
        .write(idx, Bytes::from(vec![0u8; g.chunk_len(idx)]))
        .await
        .expect("write zeros");
    assert!(
        is_zero(&store.read(idx).await.expect("read")),
        "zeros written read as zeros"
    );
}

async fn check_lengths(store: Arc<dyn Store>, g: Geometry) {
    let last = ChunkIdx(g.chunk_count() - 1);
    let len = g.chunk_len(last);
    expect_kind(
        "write one byte too long",
        store.write(last, Bytes::from(vec![1u8; len + 1])).await,
        ErrorKind::InvalidInput,
    );
    expect_kind(
        "write one byte too short",
        store.write(last, Bytes::from(vec![1u8; len - 1])).await,
        ErrorKind::InvalidInput,
    );
    expect_kind(
        "write of nothing",
        store.write(last, Bytes::new()).await,
        ErrorKind::InvalidInput,
    );
    assert!(
        is_zero(&store.read(last).await.expect("read")),
        "a refused write must change nothing"
    );
    store
        .write(last, chunk_content(g, last, 3))
        .await
        .expect("write of the exact length of the last chunk");
    assert!(store.read(last).await.expect("read") == chunk_content(g, last, 3));
}

async fn check_out_of_range(store: Arc<dyn Store>, g: Geometry) {
    let past = ChunkIdx(g.chunk_count());
    let far = ChunkIdx(u64::MAX);
    for idx in [past, far] {
        expect_kind(
            "read past the end",
            store.read(idx).await,
            ErrorKind::OutOfRange,
        );
        expect_kind(
            "write past the end",
            store.write(idx, Bytes::from(vec![1u8; 4096])).await,
            ErrorKind::OutOfRange,
        );
        expect_kind(
            "status past the end",
            store.status(idx).await,
            ErrorKind::OutOfRange,
        );
    }
    expect_kind(
        "trim past the end",
        store
            .trim(ChunkRange::new(ChunkIdx(0), ChunkIdx(g.chunk_count() + 1)))
            .await,
        ErrorKind::OutOfRange,
    );
}

async fn check_trim_and_status(store: Arc<dyn Store>, g: Geometry) {
    let exact = store.caps().contains(farmap_core::Caps::STATUS);
    let n = g.chunk_count();
    for idx in g.all().iter() {
        let st = store.status(idx).await.expect("status");
        if exact {
            assert_eq!(
                st,
                ChunkStatus::Zero,
                "fresh {idx} of a status-capable store"
            );
        } else {
            assert_ne!(st, ChunkStatus::Data, "fresh {idx} cannot hold data");
        }
        store
            .write(idx, chunk_content(g, idx, 5))
            .await
            .expect("write");
        let st = store.status(idx).await.expect("status");
        assert_ne!(
            st,
            ChunkStatus::Zero,
            "{idx} was written: it is not known zero"
        );
        if exact {
            assert_eq!(
                st,
                ChunkStatus::Data,
                "written {idx} of a status-capable store"
            );
        }
    }
    // Trim the middle third (at least one chunk).
    let range = ChunkRange::new(ChunkIdx(n / 3), ChunkIdx((n / 3 + n.div_ceil(3)).min(n)));
    store.trim(range).await.expect("trim");
    store
        .trim(ChunkRange::new(ChunkIdx(0), ChunkIdx(0)))
        .await
        .expect("empty trim");
    for idx in g.all().iter() {
        let data = store.read(idx).await.expect("read");
        if range.contains(idx) {
            assert!(is_zero(&data), "trimmed {idx} must read as zeros");
            let st = store.status(idx).await.expect("status");
            assert_ne!(st, ChunkStatus::Data, "trimmed {idx} does not hold data");
        } else {
            assert!(
                data == chunk_content(g, idx, 5),
                "{idx} outside the trim is kept"
            );
        }
    }
    store.flush().await.expect("flush after trim");
}

async fn check_concurrent_writers(store: Arc<dyn Store>, g: Geometry) {
    // Every chunk gets its own writer task writing versions 0..4 in turn, while reader tasks
    // read all chunks repeatedly; every read must be exactly one version (or zeros).
    const VERSIONS: u32 = 4;
    let n = g.chunk_count();
    let writers = (0..n).map(|i| {
        let store = store.clone();
        tokio::spawn(async move {
            let idx = ChunkIdx(i);
            for v in 0..VERSIONS {
                store
                    .write(idx, chunk_content(g, idx, v))
                    .await
                    .expect("concurrent write");
            }
        })
    });
    let readers = (0..4).map(|_| {
        let store = store.clone();
        tokio::spawn(async move {
            for _ in 0..3 {
                for idx in g.all().iter() {
                    let data = store.read(idx).await.expect("concurrent read");
                    assert!(
                        is_zero(&data) || version_of(g, idx, &data, VERSIONS).is_some(),
                        "a concurrent read of {idx} saw a torn or foreign chunk"
                    );
                }
            }
        })
    });
    let all: Vec<_> = writers.chain(readers).collect();
    for r in join_all(all).await {
        r.expect("task panicked");
    }
    for idx in g.all().iter() {
        let data = store.read(idx).await.expect("read");
        assert!(
            data == chunk_content(g, idx, VERSIONS - 1),
            "{idx} must hold the last version its writer wrote"
        );
    }
}

async fn check_same_chunk_races(store: Arc<dyn Store>, g: Geometry) {
    // Many tasks write different versions of the same chunk at once: the result is one of
    // them, whole.
    const VERSIONS: u32 = 16;
    let idx = ChunkIdx(g.chunk_count() / 2);
    let tasks: Vec<_> = (0..VERSIONS)
        .map(|v| {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .write(idx, chunk_content(g, idx, v))
                    .await
                    .expect("racing write");
            })
        })
        .collect();
    for t in join_all(tasks).await {
        t.expect("task panicked");
    }
    let data = store.read(idx).await.expect("read");
    assert!(
        version_of(g, idx, &data, VERSIONS).is_some(),
        "racing writes of {idx} must leave one of them, whole"
    );
}

async fn check_no_torn_reads(store: Arc<dyn Store>, g: Geometry) {
    // One writer rewrites the largest chunk with alternating versions while readers read it
    // in a loop: every read must be exactly one version. Large chunks make a missing lock
    // (a read overlapping a positional write) visible.
    const VERSIONS: u32 = 2;
    const ROUNDS: usize = 48;
    let idx = ChunkIdx(0);
    let contents: Arc<Vec<Bytes>> =
        Arc::new((0..VERSIONS).map(|v| chunk_content(g, idx, v)).collect());
    store.write(idx, contents[0].clone()).await.expect("write");
    let writer = {
        let (store, contents) = (store.clone(), contents.clone());
        tokio::spawn(async move {
            for r in 0..ROUNDS {
                let data = contents[r % VERSIONS as usize].clone();
                store.write(idx, data).await.expect("write");
            }
        })
    };
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (store, contents) = (store.clone(), contents.clone());
            tokio::spawn(async move {
                for _ in 0..ROUNDS {
                    let data = store.read(idx).await.expect("read");
                    assert!(
                        contents.contains(&data),
                        "a read of {idx} racing a write of it saw a torn chunk"
                    );
                }
            })
        })
        .collect();
    writer.await.expect("writer panicked");
    for r in join_all(readers).await {
        r.expect("reader panicked");
    }
}
