//! Model test of a managed mount: byte-range reads, writes, trims and flushes through
//! `Unaligned` → (`Pusher` →) `Cached`, while a `Puller` prefetches in the background from a
//! slow remote, all compared with a plain `Vec<u8>`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use farmap_core::{ChunkIdx, ErrorKind, Geometry, Store};
use farmap_pipeline::cached::{Cached, Fill};
use farmap_pipeline::puller::{PullOptions, PullOrder, Puller};
use farmap_pipeline::pusher::{PushOptions, Pusher};
use farmap_pipeline::retry::RetryPolicy;
use farmap_pipeline::{Counting, DelayOptions, Delayed, Unaligned};
use farmap_testkit::{pattern_bytes, ModelStore, PatternStore};
use proptest::prelude::*;

mod common;
use common::Backing;

const CHUNK: u64 = 4096;

#[derive(Debug, Clone)]
enum Op {
    Read {
        offset: u64,
        len: usize,
    },
    Write {
        offset: u64,
        data: Vec<u8>,
    },
    Trim {
        offset: u64,
        len: u64,
    },
    Flush,
    /// Let the background tasks run for a moment.
    Pause,
}

fn ops(size: u64) -> impl Strategy<Value = Vec<Op>> {
    let range = (0..size).prop_flat_map(move |offset| {
        let room = size - offset;
        let to_boundary = (offset / CHUNK + 1) * CHUNK - offset;
        let len = prop_oneof![
            1..=room.min(64),
            Just(to_boundary.min(room)),
            1..=room.min(3 * CHUNK),
        ];
        (Just(offset), len)
    });
    let op = prop_oneof![
        4 => range.clone().prop_map(|(offset, len)| Op::Read { offset, len: len as usize }),
        4 => range.clone().prop_flat_map(|(offset, len)| {
            proptest::collection::vec(any::<u8>(), len as usize)
                .prop_map(move |data| Op::Write { offset, data })
        }),
        1 => range.prop_map(|(offset, len)| Op::Trim { offset, len }),
        1 => Just(Op::Flush),
        1 => Just(Op::Pause),
    ];
    proptest::collection::vec(op, 1..40)
}

#[derive(Debug, Clone)]
enum Order {
    Sequential,
    Reverse,
    Scattered(u64),
}

fn order() -> impl Strategy<Value = Order> {
    prop_oneof![
        Just(Order::Sequential),
        Just(Order::Reverse),
        any::<u64>().prop_map(Order::Scattered),
    ]
}

struct Case {
    size: u64,
    ops: Vec<Op>,
    workers: usize,
    order: Order,
    with_pusher: bool,
    seed: u64,
    local: Backing,
}

async fn run(case: Case) {
    let g = Geometry::new(case.size, CHUNK).unwrap();
    let n = g.chunk_count();
    // The remote: a model store filled with the pattern, behind a small latency so that the
    // puller is still busy while the operations run.
    let filled = ModelStore::new(g);
    farmap_testkit::contents::write_pattern(&filled, case.seed).await;
    let remote = Arc::new(Delayed::new(
        filled,
        DelayOptions {
            latency: Duration::from_micros(300),
            bandwidth: None,
        },
    ));
    // The cache's local store: the model store or a real one (memory, file, dir).
    let (local, _tmp) = common::new_store(case.local, g);
    let cached = Arc::new(Cached::new(local, remote.clone()).unwrap());
    let pusher = case.with_pusher.then(|| {
        let opts = PushOptions {
            checkpoint_every: None,
            workers: 4,
            interval: Some(Duration::from_millis(2)),
            retry: RetryPolicy::none(),
        };
        Arc::new(Pusher::new(cached.clone(), remote.clone(), opts).unwrap())
    });
    let top: Arc<dyn Store> = match &pusher {
        Some(p) => p.clone(),
        None => cached.clone(),
    };
    let front = Unaligned::new(top);

    let order = match case.order {
        Order::Sequential => PullOrder::Sequential,
        Order::Reverse => PullOrder::List(g.all().iter().rev().collect()),
        Order::Scattered(salt) => PullOrder::Priority(Arc::new(move |idx: ChunkIdx| {
            (idx.0.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ salt) as i64
        })),
    };
    let puller = Puller::start(
        cached.clone(),
        PullOptions {
            workers: case.workers,
            order,
            retry: RetryPolicy::none(),
        },
    );

    let mut model = pattern_bytes(case.seed, 0, case.size as usize);
    for op in &case.ops {
        match op {
            Op::Read { offset, len } => {
                let got = front.read_bytes(*offset, *len).await.unwrap();
                let o = *offset as usize;
                assert!(got[..] == model[o..o + len], "read {len} bytes at {offset}");
            }
            Op::Write { offset, data } => {
                front.write_at(*offset, data).await.unwrap();
                let o = *offset as usize;
                model[o..o + data.len()].copy_from_slice(data);
            }
            Op::Trim { offset, len } => {
                front.trim_at(*offset, *len).await.unwrap();
                let o = *offset as usize;
                model[o..o + *len as usize].fill(0);
            }
            Op::Flush => {
                front.flush().await.unwrap();
                if let Some(p) = &pusher {
                    assert_eq!(p.dirty_count(), 0);
                    assert!(remote.inner().snapshot() == model, "remote after a flush");
                }
            }
            Op::Pause => tokio::time::sleep(Duration::from_millis(1)).await,
        }
    }

    let report = puller.wait().await;
    assert!(report.is_complete(), "{report:?}");
    assert_eq!(report.progress.total_chunks, n);
    assert_eq!(report.progress.done_chunks, n);
    assert!(cached.is_complete());
    assert_eq!(cached.present_count(), n);
    assert!(
        farmap_testkit::contents::read_all(cached.local().as_ref()).await == model,
        "local after the pull"
    );
    // Every chunk was fetched at most once, by the puller or by a foreground miss.
    assert!(report.progress.fetched_chunks <= n);
    if let Some(p) = pusher {
        front.flush().await.unwrap();
        drop(front);
        let p = Arc::into_inner(p).expect("the only handle");
        p.shutdown().await.unwrap();
        assert!(remote.inner().snapshot() == model, "remote after shutdown");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn cached_with_puller_matches_a_vec(
        (size, ops) in (1u64..24, prop_oneof![Just(0u64), 1u64..CHUNK]).prop_flat_map(|(c, s)| {
            let size = c * CHUNK - s;
            (Just(size), ops(size))
        }),
        workers in prop_oneof![Just(1usize), 2usize..16, Just(256usize)],
        order in order(),
        with_pusher in any::<bool>(),
        seed in any::<u64>(),
        local in common::backing(),
    ) {
        let case = Case { size, ops, workers, order, with_pusher, seed, local };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(run(case));
    }
}

// Plain tests of the Cached and Puller public API, over the shipped Delayed and Counting
// stages.

type SlowRemote = Counting<Delayed<PatternStore>>;

fn slow_cache(g: Geometry, latency: Duration) -> Arc<Cached<ModelStore, SlowRemote>> {
    let remote = Counting::new(Delayed::new(
        PatternStore::new(g, 5),
        DelayOptions {
            latency,
            bandwidth: None,
        },
    ));
    Arc::new(Cached::new(ModelStore::new(g), remote).unwrap())
}

async fn assert_pattern(c: &Cached<ModelStore, SlowRemote>) {
    let g = c.geometry();
    for idx in g.all().iter() {
        let got = c.local().read(idx).await.unwrap();
        let want = pattern_bytes(5, g.offset_of(idx), g.chunk_len(idx));
        assert!(got[..] == want[..], "content of {idx}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_conforms() {
    farmap_testkit::run_conformance(|g| async move {
        let c = Cached::new(ModelStore::new(g), ModelStore::new(g)).unwrap();
        Arc::new(c) as Arc<dyn Store>
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fill_fetches_until_complete() {
    let g = Geometry::new(20 * CHUNK + 77, CHUNK).unwrap();
    let c = slow_cache(g, Duration::ZERO);
    let fill: &dyn Fill = &*c;
    for idx in g.all().iter() {
        assert!(!fill.is_present(idx));
        fill.fetch(idx).await.unwrap();
        assert!(fill.is_present(idx));
        fill.fetch(idx).await.unwrap();
    }
    assert!(c.is_complete());
    assert_eq!(
        c.remote().counts().reads,
        21,
        "a present chunk is not fetched again"
    );
    let past = ChunkIdx(g.chunk_count());
    assert_eq!(
        fill.fetch(past).await.unwrap_err().kind(),
        ErrorKind::OutOfRange
    );
    assert_pattern(&c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_promptly() {
    let g = Geometry::new(512 * CHUNK, CHUNK).unwrap();
    let c = slow_cache(g, Duration::from_millis(5));
    let p = Puller::start(
        c.clone(),
        PullOptions {
            workers: 4,
            ..PullOptions::default()
        },
    );
    tokio::time::sleep(Duration::from_millis(30)).await;
    p.cancel();
    // Reads are counted as they finish: after the cancel, only the fetches in flight (one per
    // worker at most) may still finish, and no new one starts.
    let at_cancel = c.remote().counts().reads;
    let r = p.wait().await;
    let after = c.remote().counts().reads;
    assert!(
        after - at_cancel <= 4,
        "{} fetches finished after the cancel, with 4 workers",
        after - at_cancel
    );
    assert!(r.cancelled && !r.is_complete());
    assert!(r.progress.done_chunks > 0 && r.progress.done_chunks < 512);
    assert_eq!(c.present_count(), r.progress.fetched_chunks);
    let seen = c.remote().counts().reads;
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert_eq!(c.remote().counts().reads, seen, "no fetch after wait()");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_puller_cancels_it() {
    let g = Geometry::new(512 * CHUNK, CHUNK).unwrap();
    let c = slow_cache(g, Duration::from_millis(2));
    let opts = PullOptions {
        workers: 64,
        ..PullOptions::default()
    };
    drop(Puller::start(c.clone(), opts));
    tokio::time::sleep(Duration::from_millis(30)).await;
    let seen = c.remote().counts().reads;
    assert!(seen <= 64, "at most one fetch per worker: {seen}");
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert_eq!(c.remote().counts().reads, seen);
    assert!(!c.is_complete());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_workers() {
    let g = Geometry::new(1000 * CHUNK, CHUNK).unwrap();
    let c = slow_cache(g, Duration::from_millis(1));
    let opts = PullOptions {
        workers: 3000,
        ..PullOptions::default()
    };
    let t = Instant::now();
    let r = Puller::start(c.clone(), opts).wait().await;
    assert!(r.is_complete(), "{r:?}");
    assert!(c.is_complete());
    assert_eq!(c.remote().counts().reads, 1000);
    assert!(r.elapsed <= t.elapsed());
    assert_eq!(r.progress.fetched_bytes, g.size());
    assert_pattern(&c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreground_misses_and_the_puller_fetch_each_chunk_once() {
    let g = Geometry::new(256 * CHUNK, CHUNK).unwrap();
    let c = slow_cache(g, Duration::from_micros(500));
    let p = Puller::start(
        c.clone(),
        PullOptions {
            workers: 8,
            ..PullOptions::default()
        },
    );
    // Foreground readers touch chunks from the end while the puller works from the start.
    let readers: Vec<_> = (0..4u64)
        .map(|r| {
            let c = c.clone();
            tokio::spawn(async move {
                for i in (0..256u64).rev().skip(r as usize).step_by(4) {
                    c.read(ChunkIdx(i)).await.unwrap();
                }
            })
        })
        .collect();
    for r in readers {
        r.await.unwrap();
    }
    let report = p.wait().await;
    assert!(report.is_complete());
    assert_eq!(c.remote().counts().reads, 256, "one remote read per chunk");
    assert!(report.progress.fetched_chunks <= 256);
    assert_pattern(&c).await;
}
