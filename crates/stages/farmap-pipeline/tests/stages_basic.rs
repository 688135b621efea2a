//! The small stages over the model store: conformance, then what each one is for.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use farmap_core::{ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, Store};
use farmap_pipeline::{
    timer, Counting, Counts, DelayOptions, Delayed, FaultPlan, FaultTrigger, Faulty, GateState,
    Gated, OpSet, Unaligned,
};
use farmap_testkit::conformance::chunk_content;
use farmap_testkit::{run_conformance, ModelStore};
use tokio::sync::RwLock;
use tokio::time::timeout;

/// Tests that measure time take the write side, alone on the machine's two cores; every other
/// test takes the read side.
static MACHINE: RwLock<()> = RwLock::const_new(());

fn geometry() -> Geometry {
    Geometry::new(16 * 4096, 4096).expect("geometry")
}

fn model() -> ModelStore {
    ModelStore::new(geometry())
}

fn delay(latency: Duration) -> DelayOptions {
    DelayOptions {
        latency,
        bandwidth: None,
    }
}

fn plan(ops: OpSet, trigger: FaultTrigger) -> FaultPlan {
    FaultPlan {
        ops,
        trigger,
        kind: ErrorKind::Io,
    }
}

// ---- conformance ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counting_conforms() {
    let _machine = MACHINE.read().await;
    run_conformance(
        |g| async move { Arc::new(Counting::new(ModelStore::new(g))) as Arc<dyn Store> },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faulty_never_conforms() {
    let _machine = MACHINE.read().await;
    run_conformance(|g| async move {
        let never = FaultPlan {
            ops: OpSet::ALL,
            trigger: FaultTrigger::Never,
            kind: ErrorKind::Io,
        };
        Arc::new(Faulty::new(ModelStore::new(g), never)) as Arc<dyn Store>
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_conforms() {
    let _machine = MACHINE.read().await;
    run_conformance(|g| async move {
        let opts = DelayOptions {
            latency: Duration::from_micros(100),
            bandwidth: Some(1 << 30),
        };
        Arc::new(Delayed::new(ModelStore::new(g), opts)) as Arc<dyn Store>
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_gate_conforms() {
    let _machine = MACHINE.read().await;
    run_conformance(|g| async move {
        Arc::new(Gated::new(ModelStore::new(g), GateState::Open)) as Arc<dyn Store>
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unaligned_as_a_store_conforms() {
    let _machine = MACHINE.read().await;
    run_conformance(
        |g| async move { Arc::new(Unaligned::new(ModelStore::new(g))) as Arc<dyn Store> },
    )
    .await;
}

// ---- Gated ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_gate_holds_reads_until_opened() {
    let _machine = MACHINE.read().await;
    let gated = Arc::new(Gated::new(model(), GateState::Closed));
    assert!(!gated.is_open());
    let reader = {
        let gated = gated.clone();
        tokio::spawn(async move { gated.read(ChunkIdx(1)).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!reader.is_finished(), "a read passed a closed gate");
    assert!(
        timeout(Duration::from_millis(20), gated.status(ChunkIdx(0)))
            .await
            .is_err(),
        "a status passed a closed gate"
    );
    // Geometry and caps are not gated.
    assert_eq!(gated.geometry(), geometry());
    gated.open();
    assert!(gated.is_open());
    let data = timeout(Duration::from_secs(5), reader)
        .await
        .expect("the read ends once the gate opens")
        .expect("reader task")
        .expect("read");
    assert_eq!(data.len(), 4096);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_waits_for_operations_in_flight() {
    let _machine = MACHINE.read().await;
    let slow = Delayed::new(model(), delay(Duration::from_millis(150)));
    let gated = Arc::new(Gated::new(slow, GateState::Open));
    let writer = {
        let gated = gated.clone();
        tokio::spawn(async move {
            let g = geometry();
            gated
                .write(ChunkIdx(2), chunk_content(g, ChunkIdx(2), 1))
                .await
                .expect("write");
        })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    let model = gated.inner().inner();
    assert_eq!(
        model.status(ChunkIdx(2)).await.expect("status"),
        ChunkStatus::Zero,
        "the write is still in flight"
    );
    gated.close().await;
    assert_eq!(
        model.status(ChunkIdx(2)).await.expect("status"),
        ChunkStatus::Data,
        "close returned before the write in flight finished"
    );
    assert!(!gated.is_open());
    writer.await.expect("writer");

    // Idempotent: a second close returns at once, and new operations wait.
    timeout(Duration::from_secs(1), gated.close())
        .await
        .expect("a second close returns at once");
    assert!(timeout(Duration::from_millis(200), gated.flush())
        .await
        .is_err());
    gated.open();
    gated.open();
    assert!(gated.is_open());
    let data = timeout(Duration::from_secs(2), gated.read(ChunkIdx(2)))
        .await
        .expect("open gate")
        .expect("read");
    assert!(data == chunk_content(geometry(), ChunkIdx(2), 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_overlapping_a_close_wins() {
    let _machine = MACHINE.read().await;
    let slow = Delayed::new(model(), delay(Duration::from_millis(100)));
    let gated = Arc::new(Gated::new(slow, GateState::Open));
    let reader = {
        let gated = gated.clone();
        tokio::spawn(async move { gated.read(ChunkIdx(0)).await })
    };
    tokio::time::sleep(Duration::from_millis(10)).await;
    let closer = {
        let gated = gated.clone();
        tokio::spawn(async move { gated.close().await })
    };
    tokio::time::sleep(Duration::from_millis(10)).await;
    gated.open();
    closer.await.expect("close");
    reader.await.expect("reader").expect("read");
    assert!(gated.is_open());
    timeout(Duration::from_secs(2), gated.status(ChunkIdx(0)))
        .await
        .expect("the gate is open")
        .expect("status");
}

// ---- Delayed ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_takes_at_least_the_latency() {
    let _machine = MACHINE.write().await;
    let latency = Duration::from_millis(5);
    let d = Delayed::new(model(), delay(latency));
    let g = geometry();
    let idx = ChunkIdx(3);
    let timed = |start: Instant, what: &str| {
        let took = start.elapsed();
        assert!(took >= latency, "{what} took {took:?}");
    };
    let t = Instant::now();
    d.write(idx, chunk_content(g, idx, 1)).await.expect("write");
    timed(t, "write");
    let t = Instant::now();
    d.read(idx).await.expect("read");
    timed(t, "read");
    let t = Instant::now();
    d.flush().await.expect("flush");
    timed(t, "flush");
    let t = Instant::now();
    d.trim(ChunkRange::single(idx)).await.expect("trim");
    timed(t, "trim");
    let t = Instant::now();
    assert_eq!(d.status(idx).await.expect("status"), ChunkStatus::Zero);
    timed(t, "status");

    // Concurrent operations each wait at least the latency (that they wait concurrently,
    // not one after the other, is measured by `farmap bench timer`, case delayed-concurrent).
    d.set_latency(Duration::from_millis(20));
    let t = Instant::now();
    let reads = (0..16).map(|i| d.read(ChunkIdx(i)));
    let got = futures::future::try_join_all(reads).await.expect("reads");
    assert_eq!(got.len(), 16);
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(20),
        "16 concurrent reads of 20 ms latency took {took:?}"
    );

    // No latency, no bandwidth limit: straight through, data intact (chunk 4 was never
    // written, the trimmed chunk reads as zeros).
    d.set_latency(Duration::ZERO);
    assert_eq!(d.latency(), Duration::ZERO);
    let five = ChunkIdx(5);
    d.write(five, chunk_content(g, five, 2))
        .await
        .expect("write");
    for _ in 0..100 {
        assert!(d.read(five).await.expect("read") == chunk_content(g, five, 2));
        assert!(d.read(idx).await.expect("read").iter().all(|&b| b == 0));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bandwidth_caps_throughput() {
    let _machine = MACHINE.write().await;
    const BANDWIDTH: u64 = 8_000_000;
    let g = Geometry::new(64 * 65536, 65536).expect("geometry");
    let opts = DelayOptions {
        latency: Duration::from_millis(1),
        bandwidth: Some(BANDWIDTH),
    };
    let d = Arc::new(Delayed::new(ModelStore::new(g), opts));
    assert_eq!(d.bandwidth(), Some(BANDWIDTH));
    // 8 writers, then 8 readers, of 64 chunks of 64 KiB each: 4 MiB, about 0.52 s each way.
    for phase in ["write", "read"] {
        let start = Instant::now();
        let tasks: Vec<_> = (0..8u64)
            .map(|t| {
                let d = d.clone();
                tokio::spawn(async move {
                    for i in (t..64).step_by(8) {
                        let idx = ChunkIdx(i);
                        if phase == "write" {
                            d.write(idx, chunk_content(g, idx, 1)).await.expect("write");
                        } else {
                            d.read(idx).await.expect("read");
                        }
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("task");
        }
        let secs = start.elapsed().as_secs_f64();
        let rate = (64 * 65536) as f64 / secs;
        eprintln!(
            "{phase}: {:.2} MB/s over a {:.1} MB/s link",
            rate / 1e6,
            BANDWIDTH as f64 / 1e6
        );
        // Never faster than the link; how close to it is measured by `farmap bench timer`.
        assert!(
            rate <= BANDWIDTH as f64 * 1.01,
            "{phase} rate {rate} exceeds the bandwidth"
        );
    }
}

// ---- Faulty ----

#[tokio::test]
async fn nth_fails_only_the_nth_matching_operation() {
    let _machine = MACHINE.read().await;
    let g = geometry();
    let f = Faulty::new(model(), plan(OpSet::WRITE, FaultTrigger::Nth(3)));
    for i in 0..5u64 {
        let idx = ChunkIdx(i);
        // Reads are not in the plan and do not count.
        f.read(idx).await.expect("read");
        let r = f.write(idx, chunk_content(g, idx, 1)).await;
        if i == 2 {
            let e = r.expect_err("the third write fails");
            assert_eq!(e.kind(), ErrorKind::Io);
            assert_eq!(e.context(), "injected fault on write of chunk 2");
        } else {
            r.expect("other writes pass");
        }
    }
    assert_eq!(f.injected(), 1);
    // The failed write never reached the inner store.
    assert_eq!(
        f.inner().status(ChunkIdx(2)).await.expect("status"),
        ChunkStatus::Zero
    );
    assert_eq!(
        f.inner().status(ChunkIdx(3)).await.expect("status"),
        ChunkStatus::Data
    );
}

#[tokio::test]
async fn from_nth_and_every_nth() {
    let _machine = MACHINE.read().await;
    let f = Faulty::new(
        model(),
        plan(OpSet::READ | OpSet::STATUS, FaultTrigger::FromNth(3)),
    );
    let mut failed = Vec::new();
    for n in 1..=6u64 {
        let r = if n % 2 == 0 {
            f.status(ChunkIdx(n)).await.map(|_| ())
        } else {
            f.read(ChunkIdx(n)).await.map(|_| ())
        };
        if r.is_err() {
            failed.push(n);
        }
    }
    assert_eq!(failed, vec![3, 4, 5, 6]);
    f.flush().await.expect("flush is not in the plan");

    // A new plan restarts the numbering.
    f.set_plan(FaultPlan {
        ops: OpSet::FLUSH | OpSet::TRIM,
        trigger: FaultTrigger::EveryNth(2),
        kind: ErrorKind::Timeout,
    });
    assert_eq!(f.plan().trigger, FaultTrigger::EveryNth(2));
    f.flush().await.expect("first flush");
    let e = f
        .trim(ChunkRange::new(ChunkIdx(0), ChunkIdx(4)))
        .await
        .expect_err("second matching op");
    assert_eq!(e.kind(), ErrorKind::Timeout);
    assert!(e.is_retryable());
    assert_eq!(e.context(), "injected fault on trim of chunks 0..4");
    f.read(ChunkIdx(0))
        .await
        .expect("reads are no longer in the plan");
    f.flush().await.expect("third");
    f.flush().await.expect_err("fourth");
    assert_eq!(f.injected(), 4 + 2);
}

#[tokio::test]
async fn rate_is_deterministic_per_seed() {
    let _machine = MACHINE.read().await;
    let run = |seed: u64| async move {
        let trigger = FaultTrigger::Rate {
            per_million: 200_000,
            seed,
        };
        let f = Faulty::new(model(), plan(OpSet::READ, trigger));
        let mut failed = Vec::new();
        for n in 0..1000u64 {
            if f.read(ChunkIdx(n % 16)).await.is_err() {
                failed.push(n);
            }
        }
        assert_eq!(f.injected(), failed.len() as u64);
        failed
    };
    let a = run(42).await;
    assert_eq!(a, run(42).await, "the same seed fails the same operations");
    assert_ne!(a, run(43).await);
    assert!(
        (120..=280).contains(&a.len()),
        "20% of 1000 gave {}",
        a.len()
    );
}

#[tokio::test]
async fn a_failed_write_leaves_the_inner_store_unchanged() {
    let _machine = MACHINE.read().await;
    let g = geometry();
    let idx = ChunkIdx(5);
    let f = Faulty::new(model(), FaultPlan::never());
    f.write(idx, chunk_content(g, idx, 1)).await.expect("write");
    f.set_plan(FaultPlan {
        ops: OpSet::ALL,
        trigger: FaultTrigger::Always,
        kind: ErrorKind::NoSpace,
    });
    let e = f
        .write(idx, chunk_content(g, idx, 2))
        .await
        .expect_err("write fails");
    assert_eq!(e.kind(), ErrorKind::NoSpace);
    assert!(f.inner().read(idx).await.expect("inner read") == chunk_content(g, idx, 1));
    f.read(idx).await.expect_err("reads fail too");
}

// ---- Counting ----

#[tokio::test]
async fn counting_counts() {
    let _machine = MACHINE.read().await;
    let g = geometry();
    let faulty = Faulty::new(model(), plan(OpSet::FLUSH, FaultTrigger::Nth(2)));
    let c = Counting::new(faulty);
    for i in 0..3 {
        let idx = ChunkIdx(i);
        c.write(idx, chunk_content(g, idx, 1)).await.expect("write");
    }
    c.read(ChunkIdx(0)).await.expect("read");
    c.read(ChunkIdx(99)).await.expect_err("out of range");
    c.write(ChunkIdx(0), Bytes::from_static(b"short"))
        .await
        .expect_err("wrong length");
    c.flush().await.expect("flush");
    c.flush().await.expect_err("injected");
    c.trim(ChunkRange::new(ChunkIdx(0), ChunkIdx(2)))
        .await
        .expect("trim");
    c.status(ChunkIdx(0)).await.expect("status");
    let before = c.counts();
    assert_eq!(
        before,
        Counts {
            reads: 2,
            writes: 4,
            flushes: 2,
            trims: 1,
            statuses: 1,
            bytes_read: 4096,
            bytes_written: 3 * 4096,
            errors: 3,
        }
    );
    assert_eq!(before.ops(), 10);
    c.read(ChunkIdx(1)).await.expect("read");
    assert_eq!(
        c.counts() - before,
        Counts {
            reads: 1,
            bytes_read: 4096,
            ..Counts::default()
        }
    );
    assert_eq!(c.inner().injected(), 1);
    let taken = c.reset();
    assert_eq!(taken.reads, 3);
    assert_eq!(c.counts(), Counts::default());
}

// ---- the precise timer ----

/// Lateness of `tasks` concurrent tasks each sleeping `rounds` times for `d`, with starts
/// staggered over one period so that wake-ups are spread as in a real workload.
async fn lateness(d: Duration, tasks: u32, rounds: u32) -> Vec<Duration> {
    let handles: Vec<_> = (0..tasks)
        .map(|t| {
            tokio::spawn(async move {
                timer::sleep(d * t / tasks).await;
                let mut late = Vec::with_capacity(rounds as usize);
                for _ in 0..rounds {
                    let start = Instant::now();
                    timer::sleep(d).await;
                    let took = start.elapsed();
                    assert!(took >= d, "a sleep of {d:?} ended early, after {took:?}");
                    late.push(took - d);
                }
                late
            })
        })
        .collect();
    let mut all = Vec::new();
    for h in handles {
        all.extend(h.await.expect("sleeping task"));
    }
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_sleeps_never_end_early() {
    // Sleeping early is never allowed (`lateness` asserts it); how late sleeps are is
    // measured by `farmap bench timer`.
    let _machine = MACHINE.write().await;
    for (d, tasks, rounds) in [
        (Duration::from_millis(2), 100, 40),
        (Duration::from_millis(10), 200, 10),
    ] {
        let late = lateness(d, tasks, rounds).await;
        assert_eq!(
            late.len(),
            (tasks * rounds) as usize,
            "every sleep completed"
        );
        let mean = late.iter().sum::<Duration>() / late.len() as u32;
        let max = late.iter().max().copied().unwrap_or_default();
        eprintln!(
            "{} sleeps of {d:?}: mean lateness {mean:?}, max {max:?}",
            late.len()
        );
    }
}
