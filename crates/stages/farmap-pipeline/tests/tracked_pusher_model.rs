//! Model tests of dirty tracking and write-back: a `Pusher` over a faulty remote must never
//! report a flush as done with chunks missing, and `Tracked` must never lose a write to a
//! concurrent take.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use farmap_core::{ChunkIdx, ChunkRange, ErrorKind, Geometry, Store};
use farmap_pipeline::pusher::{PushOptions, Pusher};
use farmap_pipeline::retry::RetryPolicy;
use farmap_pipeline::tracked::Tracked;
use farmap_pipeline::{DelayOptions, Delayed, FaultPlan, FaultTrigger, Faulty, OpSet};
use farmap_testkit::ModelStore;
use proptest::prelude::*;

mod common;
use common::Backing;

const CHUNK: usize = 4096;
const CHUNKS: u64 = 12;

fn geometry() -> Geometry {
    Geometry::new(CHUNKS * CHUNK as u64 - 100, CHUNK as u64).unwrap()
}

#[derive(Debug, Clone)]
enum Op {
    Write { chunk: u64, byte: u8 },
    Trim { chunk: u64, len: u64 },
    Flush,
    Faults(Option<(u32, ErrorKind, u64)>),
    Pause,
}

fn kind() -> impl Strategy<Value = ErrorKind> {
    prop_oneof![
        Just(ErrorKind::Timeout),
        Just(ErrorKind::Unavailable),
        Just(ErrorKind::Io),
        Just(ErrorKind::Corrupt),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..CHUNKS, any::<u8>()).prop_map(|(chunk, byte)| Op::Write { chunk, byte }),
        1 => (0..CHUNKS, 1u64..4).prop_map(|(chunk, len)| Op::Trim { chunk, len }),
        3 => Just(Op::Flush),
        1 => proptest::option::of((100_000u32..700_000, kind(), any::<u64>())).prop_map(Op::Faults),
        1 => Just(Op::Pause),
    ]
}

fn plan(faults: Option<(u32, ErrorKind, u64)>) -> FaultPlan {
    match faults {
        None => FaultPlan::never(),
        Some((per_million, kind, seed)) => FaultPlan {
            ops: OpSet::WRITE | OpSet::FLUSH,
            trigger: FaultTrigger::Rate { per_million, seed },
            kind,
        },
    }
}

async fn run_flush_model(
    ops: Vec<Op>,
    interval: Option<Duration>,
    workers: usize,
    attempts: u32,
    local: Backing,
) {
    let g = geometry();
    let remote = Arc::new(Faulty::new(ModelStore::new(g), FaultPlan::never()));
    let opts = PushOptions {
        checkpoint_every: None,
        workers,
        interval,
        retry: RetryPolicy::immediate(attempts),
    };
    // The pusher's local store: the model store or a real one (memory, file, dir).
    let (local, _tmp) = common::new_store(local, g);
    let p = Pusher::new(local, remote.clone(), opts).unwrap();
    let mut model = vec![0u8; g.size() as usize];
    let mut faults = None;
    let mut errors = 0;
    for op in ops {
        match op {
            Op::Write { chunk, byte } => {
                let idx = ChunkIdx(chunk);
                let data = vec![byte; g.chunk_len(idx)];
                p.write(idx, Bytes::from(data)).await.unwrap();
                let r = g.byte_range(idx);
                model[r.start as usize..r.end as usize].fill(byte);
            }
            Op::Trim { chunk, len } => {
                let range = ChunkRange::new(ChunkIdx(chunk), ChunkIdx((chunk + len).min(CHUNKS)));
                p.trim(range).await.unwrap();
                let start = g.offset_of(range.start) as usize;
                let end = (g.offset_of(range.end) as usize).min(model.len());
                model[start..end].fill(0);
            }
            Op::Flush => {
                let expected = model.clone();
                match p.flush().await {
                    Ok(()) => {
                        assert!(
                            remote.inner().snapshot() == expected,
                            "a flush returned Ok but the remote differs from the model"
                        );
                    }
                    Err(e) => {
                        errors += 1;
                        let (_, kind, _) = faults.expect("an error only while faults are on");
                        assert_eq!(e.kind(), kind, "{e}");
                        // Only checkable without background rounds: with an `interval`, a
                        // round may push the chunk again between the flush's return and this
                        // check (a slow local store, such as the dir store, leaves time for
                        // it); the final flush below still checks that nothing was lost.
                        assert!(
                            interval.is_some()
                                || p.dirty_count() > 0
                                || e.context().contains("flushing the remote"),
                            "a failed push leaves its chunk dirty: {e}"
                        );
                        assert!(p.stats().failed_pushes > 0 || e.context().contains("flushing"));
                    }
                }
            }
            Op::Faults(f) => {
                faults = f;
                remote.set_plan(plan(f));
            }
            Op::Pause => tokio::time::sleep(Duration::from_millis(2)).await,
        }
    }
    remote.set_plan(FaultPlan::never());
    p.flush().await.expect("a flush without faults succeeds");
    assert_eq!(p.dirty_count(), 0);
    assert!(
        remote.inner().snapshot() == model,
        "remote after the final flush"
    );
    if errors > 0 {
        assert!(p.stats().last_error.is_some(), "failures are recorded");
    }
    p.shutdown().await.unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn a_flush_never_reports_unpushed_chunks_as_pushed(
        ops in proptest::collection::vec(op(), 1..60),
        interval in prop_oneof![Just(None), Just(Some(Duration::from_millis(1)))],
        workers in 1usize..8,
        attempts in 1u32..4,
        local in common::backing(),
    ) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(run_flush_model(ops, interval, workers, attempts, local));
    }
}

#[tokio::test]
async fn a_permanent_error_fails_the_flush_until_it_clears() {
    let g = geometry();
    let always = FaultPlan {
        ops: OpSet::WRITE,
        trigger: FaultTrigger::Always,
        kind: ErrorKind::Corrupt,
    };
    let remote = Arc::new(Faulty::new(ModelStore::new(g), always));
    let opts = PushOptions {
        interval: None,
        ..PushOptions::default()
    };
    let p = Pusher::new(ModelStore::new(g), remote.clone(), opts).unwrap();
    p.write(ChunkIdx(2), Bytes::from(vec![2; CHUNK]))
        .await
        .unwrap();
    for _ in 0..3 {
        assert_eq!(p.flush().await.unwrap_err().kind(), ErrorKind::Corrupt);
        assert_eq!(p.dirty_count(), 1);
    }
    assert_eq!(
        remote.injected(),
        3,
        "a permanent error is tried once per flush"
    );
    remote.set_plan(FaultPlan::never());
    p.flush().await.unwrap();
    assert!(remote.inner().snapshot() == p.inner().snapshot());
}

/// Chunk content carrying its index and a version, checkable for tearing.
fn versioned(g: Geometry, idx: ChunkIdx, version: u64) -> Bytes {
    let mut v = vec![version as u8; g.chunk_len(idx)];
    v[..8].copy_from_slice(&version.to_le_bytes());
    v[8..16].copy_from_slice(&idx.0.to_le_bytes());
    Bytes::from(v)
}

/// The version in a chunk (0 for a chunk never written).
fn version_of(idx: ChunkIdx, data: &[u8]) -> u64 {
    let version = u64::from_le_bytes(data[..8].try_into().unwrap());
    if version == 0 {
        assert!(data.iter().all(|&b| b == 0), "{idx}: torn zero chunk");
        return 0;
    }
    assert_eq!(u64::from_le_bytes(data[8..16].try_into().unwrap()), idx.0);
    assert!(
        data[16..].iter().all(|&b| b == version as u8),
        "{idx}: torn"
    );
    version
}

/// Writers own disjoint chunks and write increasing versions; `completed[i]` is the last
/// version whose write returned. Runs until `stop`.
fn spawn_writers<S: Store>(
    store: Arc<S>,
    completed: Arc<Vec<AtomicU64>>,
    stop: Arc<AtomicBool>,
    writers: u64,
) -> Vec<tokio::task::JoinHandle<u64>> {
    let g = store.geometry();
    (0..writers)
        .map(|w| {
            let (store, completed, stop) = (store.clone(), completed.clone(), stop.clone());
            tokio::spawn(async move {
                let mine: Vec<u64> = (w..g.chunk_count()).step_by(writers as usize).collect();
                let mut version = 0;
                while !stop.load(Ordering::SeqCst) {
                    version += 1;
                    let idx = ChunkIdx(mine[(version as usize * 7) % mine.len()]);
                    store.write(idx, versioned(g, idx, version)).await.unwrap();
                    completed[idx.as_usize()].store(version, Ordering::SeqCst);
                    if version % 4 == 0 {
                        tokio::task::yield_now().await;
                    }
                }
                version
            })
        })
        .collect()
}

fn versions_now(completed: &[AtomicU64]) -> Vec<u64> {
    completed.iter().map(|v| v.load(Ordering::SeqCst)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_and_flushes() {
    let g = Geometry::new(64 * CHUNK as u64, CHUNK as u64).unwrap();
    let slow = Delayed::new(
        ModelStore::new(g),
        DelayOptions {
            latency: Duration::from_micros(50),
            bandwidth: None,
        },
    );
    let flaky = FaultPlan {
        ops: OpSet::WRITE,
        trigger: FaultTrigger::Rate {
            per_million: 50_000,
            seed: 9,
        },
        kind: ErrorKind::Timeout,
    };
    let remote = Arc::new(Faulty::new(slow, flaky));
    let opts = PushOptions {
        checkpoint_every: None,
        workers: 8,
        interval: Some(Duration::from_millis(1)),
        retry: RetryPolicy::immediate(3),
    };
    let p = Arc::new(Pusher::new(ModelStore::new(g), remote.clone(), opts).unwrap());
    let completed: Arc<Vec<AtomicU64>> = Arc::new((0..64).map(|_| AtomicU64::new(0)).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let writers = spawn_writers(p.clone(), completed.clone(), stop.clone(), 4);
    let (mut ok, mut failed) = (0, 0);
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(400) {
        let before = versions_now(&completed);
        match p.flush().await {
            Ok(()) => {
                ok += 1;
                for idx in g.all().iter() {
                    let data = remote.inner().inner().read(idx).await.unwrap();
                    let v = version_of(idx, &data);
                    assert!(
                        v >= before[idx.as_usize()],
                        "{idx}: flushed remote holds version {v}, older than {} written before \
                         the flush",
                        before[idx.as_usize()]
                    );
                }
            }
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Timeout);
                failed += 1;
            }
        }
    }
    stop.store(true, Ordering::SeqCst);
    let mut written = 0;
    for w in writers {
        written += w.await.unwrap();
    }
    remote.set_plan(FaultPlan::never());
    p.flush().await.unwrap();
    assert!(remote.inner().inner().snapshot() == p.inner().snapshot());
    assert!(ok > 5, "{ok} flushes succeeded, {failed} failed");
    assert!(written > 100, "writers wrote {written} chunks");
    assert!(p.stats().pushed_chunks > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tracked_take_and_copy_never_misses_a_write() {
    let g = Geometry::new(64 * CHUNK as u64, CHUNK as u64).unwrap();
    // Delayed writes widen the window between a write starting and completing.
    let slow = Delayed::new(
        ModelStore::new(g),
        DelayOptions {
            latency: Duration::from_micros(30),
            bandwidth: None,
        },
    );
    let src = Arc::new(Tracked::new(slow));
    let dst = ModelStore::new(g);
    let completed: Arc<Vec<AtomicU64>> = Arc::new((0..64).map(|_| AtomicU64::new(0)).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let writers = spawn_writers(src.clone(), completed.clone(), stop.clone(), 4);
    let mut rounds = 0;
    let mut copied = 0;
    let copy = |chunks: Vec<ChunkIdx>| {
        let (src, dst) = (&src, &dst);
        async move {
            for &idx in &chunks {
                dst.write(idx, src.inner().inner().read(idx).await.unwrap())
                    .await
                    .unwrap();
            }
            chunks.len()
        }
    };
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(300) {
        let before = versions_now(&completed);
        copied += copy(src.take_dirty()).await;
        rounds += 1;
        for idx in g.all().iter() {
            let v = version_of(idx, &dst.read(idx).await.unwrap());
            assert!(
                v >= before[idx.as_usize()],
                "{idx}: copy holds version {v} after a take, but {} was written before it",
                before[idx.as_usize()]
            );
        }
    }
    stop.store(true, Ordering::SeqCst);
    for w in writers {
        w.await.unwrap();
    }
    copy(src.take_dirty()).await;
    assert_eq!(src.dirty_count(), 0);
    assert!(dst.snapshot() == src.inner().inner().snapshot());
    assert!(
        rounds > 10 && copied > 0,
        "{rounds} rounds, {copied} chunks copied"
    );
}
