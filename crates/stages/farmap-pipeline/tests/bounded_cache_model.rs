//! Model test of a bounded cache under a pusher (the pieces of `farmap mount --managed
//! --cache-max`): concurrent writers, trimmers and readers over a cache that holds a few
//! chunks of a larger region, behind a slow remote. Every acknowledged write must read back,
//! every read must return a version that was current at some moment of the read, the cache
//! must never hold more than its bound, and after a flush the remote holds every chunk's
//! last version.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use farmap_core::{ChunkIdx, ChunkRange, Geometry, Store};
use farmap_pipeline::retry::RetryPolicy;
use farmap_pipeline::{Cached, DelayOptions, Delayed, PushHold, PushOptions, Pusher};
use farmap_store::MemoryStore;
use farmap_testkit::ModelStore;
use parking_lot::Mutex;
use rand::{Rng, SeedableRng};

const CHUNK: u64 = 4096;
const CHUNKS: u64 = 48;
const WRITERS: u64 = 3;

/// Chunk `idx` at version `v` (`None`: trimmed, all zeros). Version 0 is the remote's
/// initial content.
fn content(idx: u64, v: u64) -> Bytes {
    let mut b = vec![(idx as u8) ^ (v as u8) | 1; CHUNK as usize];
    b[..8].copy_from_slice(&(idx + 1).to_le_bytes());
    b[8..16].copy_from_slice(&v.to_le_bytes());
    Bytes::from(b)
}

/// The version a chunk's bytes encode; `None` for zeros. Panics on anything else.
fn decode(idx: u64, data: &[u8]) -> Option<u64> {
    if farmap_core::is_zero(data) {
        return None;
    }
    let v = u64::from_le_bytes(data[8..16].try_into().unwrap());
    assert!(
        data[..] == content(idx, v)[..],
        "chunk {idx}: bytes that are no version of it"
    );
    Some(v)
}

/// What the writers did to one chunk: `kinds[v]` is true for a trim.
struct History {
    /// Highest version acknowledged.
    acked: AtomicU64,
    /// Highest version started.
    started: AtomicU64,
    kinds: Mutex<Vec<bool>>,
}

async fn run(max_chunks: u64, seed: u64, remote_can_trim: bool) {
    let g = Geometry::new(CHUNKS * CHUNK, CHUNK).unwrap();
    let model = Arc::new(ModelStore::new(g));
    for i in 0..CHUNKS {
        model.write(ChunkIdx(i), content(i, 0)).await.unwrap();
    }
    let remote: Arc<dyn Store> = if remote_can_trim {
        Arc::new(Delayed::new(
            model.clone(),
            DelayOptions {
                latency: Duration::from_micros(100),
                bandwidth: None,
            },
        ))
    } else {
        Arc::new(NoTrim(model.clone()))
    };
    let cached =
        Arc::new(Cached::bounded(MemoryStore::new(g), remote.clone(), max_chunks).unwrap());
    let opts = PushOptions {
        checkpoint_every: None,
        workers: 4,
        interval: Some(Duration::from_millis(1)),
        retry: RetryPolicy::none(),
    };
    let pusher = Arc::new(
        Pusher::with_hold(
            cached.clone(),
            remote.clone(),
            opts,
            cached.clone() as Arc<dyn PushHold>,
        )
        .unwrap(),
    );
    let history: Arc<Vec<History>> = Arc::new(
        (0..CHUNKS)
            .map(|_| History {
                acked: AtomicU64::new(0),
                started: AtomicU64::new(0),
                kinds: Mutex::new(vec![false]),
            })
            .collect(),
    );
    let done = Arc::new(AtomicBool::new(false));

    // The sampler: the bound holds at every sample.
    let sampler = tokio::spawn({
        let (cached, done) = (cached.clone(), done.clone());
        async move {
            let mut samples = 0u64;
            // At least one sample, however soon the writers finish.
            while samples == 0 || !done.load(Ordering::Acquire) {
                let present = cached.present_count();
                assert!(
                    present <= max_chunks,
                    "{present} chunks present, bound {max_chunks}"
                );
                samples += 1;
                tokio::time::sleep(Duration::from_micros(50)).await;
            }
            samples
        }
    });

    // Writers own chunks idx % WRITERS == w, so each chunk's versions are sequential.
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (pusher, history) = (pusher.clone(), history.clone());
            tokio::spawn(async move {
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ ((w + 1) * 0x9E37));
                let mine: Vec<u64> = (0..CHUNKS).filter(|i| i % WRITERS == w).collect();
                for _ in 0..120 {
                    let idx = mine[rng.gen_range(0..mine.len())];
                    let h = &history[idx as usize];
                    let v = h.started.load(Ordering::Acquire) + 1;
                    let trim = rng.gen_ratio(1, 8);
                    h.kinds.lock().push(trim);
                    h.started.store(v, Ordering::Release);
                    if trim {
                        // Sometimes a run of two of this writer's chunks... kept to one chunk
                        // so that every chunk's history stays its own.
                        pusher
                            .trim(ChunkRange::single(ChunkIdx(idx)))
                            .await
                            .unwrap();
                    } else {
                        pusher.write(ChunkIdx(idx), content(idx, v)).await.unwrap();
                    }
                    h.acked.store(v, Ordering::Release);
                    // Read your own write.
                    let back = pusher.read(ChunkIdx(idx)).await.unwrap();
                    let got = decode(idx, &back);
                    if trim {
                        assert_eq!(got, None, "chunk {idx} version {v}: the trim reads back");
                    } else {
                        assert_eq!(got, Some(v), "chunk {idx}: the write reads back");
                    }
                    if rng.gen_ratio(1, 50) {
                        pusher.flush().await.unwrap();
                    }
                }
            })
        })
        .collect();
    let readers: Vec<_> = (0..2u64)
        .map(|r| {
            let (pusher, history, done) = (pusher.clone(), history.clone(), done.clone());
            tokio::spawn(async move {
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ (r + 100));
                let mut reads = 0u64;
                // At least one read, however soon the writers finish.
                while reads == 0 || !done.load(Ordering::Acquire) {
                    let idx = rng.gen_range(0..CHUNKS);
                    let h = &history[idx as usize];
                    let lo = h.acked.load(Ordering::Acquire);
                    let data = pusher.read(ChunkIdx(idx)).await.unwrap();
                    let hi = h.started.load(Ordering::Acquire);
                    let kinds = h.kinds.lock().clone();
                    let ok = match decode(idx, &data) {
                        Some(v) => lo <= v && v <= hi && !kinds[v as usize],
                        None => (lo..=hi).any(|v| kinds[v as usize]),
                    };
                    assert!(
                        ok,
                        "chunk {idx}: read {:?}, current versions {lo}..={hi}",
                        decode(idx, &data)
                    );
                    reads += 1;
                }
                reads
            })
        })
        .collect();
    for w in writers {
        w.await.unwrap();
    }
    done.store(true, Ordering::Release);
    let mut reads = 0;
    for r in readers {
        reads += r.await.unwrap();
    }
    let samples = sampler.await.unwrap();
    assert!(reads > 0 && samples > 0);

    pusher.flush().await.unwrap();
    let stats = cached.evict_stats().unwrap();
    assert!(
        stats.evicted_chunks > 0,
        "the bound forced evictions: {stats:?}"
    );
    assert!(
        stats.written_back_chunks > 0,
        "of modified chunks: {stats:?}"
    );
    assert!(cached.present_count() <= max_chunks);
    for i in 0..CHUNKS {
        let h = &history[i as usize];
        let last = h.acked.load(Ordering::Acquire);
        let want = if h.kinds.lock()[last as usize] {
            None
        } else {
            Some(last)
        };
        let through = pusher.read(ChunkIdx(i)).await.unwrap();
        assert_eq!(decode(i, &through), want, "chunk {i} through the cache");
        let remote = model.read(ChunkIdx(i)).await.unwrap();
        assert_eq!(
            decode(i, &remote),
            want,
            "chunk {i} in the remote after flush"
        );
    }
}

/// A remote that cannot trim (the bounded cache writes zeros instead).
#[derive(Debug)]
struct NoTrim(Arc<ModelStore>);

impl Store for NoTrim {
    fn geometry(&self) -> Geometry {
        self.0.geometry()
    }
    fn caps(&self) -> farmap_core::Caps {
        self.0.caps().without(farmap_core::Caps::TRIM)
    }
    fn read(&self, idx: ChunkIdx) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<Bytes>> {
        self.0.read(idx)
    }
    fn write(
        &self,
        idx: ChunkIdx,
        data: Bytes,
    ) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<()>> {
        self.0.write(idx, data)
    }
    fn flush(&self) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<()>> {
        self.0.flush()
    }
    fn trim(&self, range: ChunkRange) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<()>> {
        Box::pin(async move {
            panic!("trim of {range} reached a remote that cannot trim");
        })
    }
    fn status(
        &self,
        idx: ChunkIdx,
    ) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<farmap_core::ChunkStatus>> {
        self.0.status(idx)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_bounds_lose_no_write() {
    for (max, seed) in [(1, 1), (2, 2), (4, 3), (7, 4)] {
        run(max, seed, true).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_without_trim_gets_zeros() {
    run(3, 9, false).await;
}
