//! Regions under concurrent load: writers racing dirty scans and pushes, many threads faulting
//! a slow store while the background puller fills the region.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use farmap_core::{Geometry, Store};
use farmap_pipeline::{DelayOptions, Delayed, PullOptions, PushOptions, RetryPolicy};
use farmap_testkit::pattern_bytes;
use farmap_uffd::{Region, RegionMode, RegionOptions, WriteTracking};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const PAGE: usize = 4096;

/// Several threads write random bytes at random places while another loop takes the dirty
/// set and pushes those chunks itself; after the writers stop and a final sync, the store
/// equals the memory byte for byte. Run with the background pusher off and on.
#[test]
fn take_dirty_and_push_race_with_writers() {
    if !uffd_available("take_dirty_and_push_race_with_writers") {
        return;
    }
    for tracking in tracking_modes() {
        for background in [None, Some(Duration::from_millis(3))] {
            race_once(tracking, background);
        }
    }
}

fn race_once(tracking: WriteTracking, background: Option<Duration>) {
    let what = format!("{tracking:?}, background push {background:?}");
    let g = Geometry::new(4 << 20, 16 << 10).unwrap();
    let store = pattern_memory(g, 9);
    let opts = RegionOptions {
        push: PushOptions {
            interval: background,
            ..PushOptions::default()
        },
        ..direct(tracking)
    };
    let region = Arc::new(Region::open(store.clone(), opts).unwrap());
    let base = SendPtr(region.as_ptr());
    let len = region.len();
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..3u64)
        .map(|t| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let base = base;
                let mut rng = SmallRng::seed_from_u64(t);
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    // Mostly a hot set (re-dirtied between scans), sometimes anywhere.
                    let off = if rng.gen_bool(0.8) {
                        rng.gen_range(0..64 * PAGE)
                    } else {
                        rng.gen_range(0..len)
                    };
                    poke(base.0, off, rng.gen());
                    n += 1;
                }
                n
            })
        })
        .collect();
    let started = Instant::now();
    let mut rounds = 0;
    let mut pushed = 0;
    while started.elapsed() < Duration::from_millis(700) {
        let dirty = region.take_dirty().unwrap();
        for idx in dirty.chunks {
            let data = region.read_chunk(idx).unwrap();
            block_on(store.write(idx, data)).unwrap();
            pushed += 1;
        }
        rounds += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let writes: u64 = writers.into_iter().map(|w| w.join().unwrap()).sum();
    region.sync().unwrap();
    let memory = region.as_slice().to_vec();
    let stored = snapshot(&*store);
    let differ = memory.iter().zip(&stored).filter(|(a, b)| a != b).count();
    assert_eq!(
        differ, 0,
        "{what}: {differ} bytes differ after {writes} writes, {rounds} scans, {pushed} pushes"
    );
    assert!(
        rounds > 10 && writes > 10_000,
        "{what}: the race ran ({rounds}, {writes})"
    );
    println!("{what}: {writes} writes, {rounds} scans, {pushed} chunk pushes: store == memory");
}

/// A region over a store 10 ms away: 8 threads read and write random places while the
/// background puller fills the region; every read sees the store's data or the thread's own
/// write, the pull completes, and after sync the store holds the memory.
#[test]
fn a_slow_store_under_eight_threads_with_the_puller() {
    if !uffd_available("a_slow_store_under_eight_threads_with_the_puller") {
        return;
    }
    let g = Geometry::new(8 << 20, 64 << 10).unwrap();
    let backing = pattern_memory(g, 4);
    let delayed = Arc::new(Delayed::new(
        backing.clone(),
        DelayOptions {
            latency: Duration::from_millis(10),
            bandwidth: None,
        },
    ));
    let opts = RegionOptions {
        mode: RegionMode::Managed(PullOptions {
            workers: 8,
            ..PullOptions::default()
        }),
        push: PushOptions {
            interval: Some(Duration::from_millis(20)),
            ..PushOptions::default()
        },
        worker_threads: 2,
        ..RegionOptions::default()
    };
    let store: Arc<dyn Store> = delayed;
    let region = Arc::new(Region::open(store, opts).unwrap());
    let base = SendPtr(region.as_ptr());
    let len = region.len();
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            std::thread::spawn(move || {
                let base = base;
                let mut rng = SmallRng::seed_from_u64(100 + t);
                // Thread t writes only pages with page % 8 == t, and remembers what it wrote.
                let mut mine: Vec<Option<u8>> = vec![None; len / PAGE];
                let mut reads = 0;
                let started = Instant::now();
                while started.elapsed() < Duration::from_millis(400) {
                    let off = rng.gen_range(0..len);
                    let page = off / PAGE;
                    let got = peek(base.0, off);
                    // Only the first byte of a page is ever written, by its owner thread.
                    let want = match (off % PAGE, mine[page]) {
                        (0, Some(v)) => v,
                        (0, None) if page % 8 != t as usize => got,
                        _ => pattern_bytes(4, off as u64, 1)[0],
                    };
                    assert_eq!(got, want, "thread {t}: byte {off}");
                    reads += 1;
                    if page % 8 == t as usize && rng.gen_bool(0.3) {
                        let v: u8 = rng.gen();
                        poke(base.0, page * PAGE, v);
                        mine[page] = Some(v);
                    }
                }
                reads
            })
        })
        .collect();
    let reads: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    let report = within(Duration::from_secs(30), "the pull", {
        let region = region.clone();
        move || region.wait_pull().expect("managed")
    });
    assert!(report.is_complete(), "{report:?}");
    region.sync().unwrap();
    let s = region.stats();
    assert_eq!(s.present_chunks, g.chunk_count(), "{s:?}");
    assert!(
        snapshot(&*backing) == region.as_slice(),
        "store == memory after sync"
    );
    println!("{reads} checked reads; {s:?}");
}

/// A fetch that fails for good gives the faulting thread SIGBUS (checked in a child process:
/// the test binary re-runs itself with `FARMAP_UFFD_CHILD` set).
#[test]
fn a_failing_fetch_raises_sigbus() {
    if std::env::var("FARMAP_UFFD_CHILD").is_ok()
        || !uffd_available("a_failing_fetch_raises_sigbus")
    {
        return;
    }
    use std::os::unix::process::ExitStatusExt;
    for (case, want_signal) in [
        ("permanent", Some(libc::SIGBUS)),
        ("retryable-exhausted", Some(libc::SIGBUS)),
        ("retryable-recovers", None),
    ] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                "sigbus_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("FARMAP_UFFD_CHILD", case)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            out.status.signal(),
            want_signal,
            "{case}: child status {:?}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("child: touching"),
            "{case}: the child ran\n{stdout}"
        );
        if want_signal.is_none() {
            assert!(out.status.success(), "{case}: {stdout}");
        }
    }
}

/// The child half of `a_failing_fetch_raises_sigbus`, started by it; not a test of its own.
#[test]
#[ignore = "a child process started by a_failing_fetch_raises_sigbus"]
fn sigbus_child() {
    let Ok(case) = std::env::var("FARMAP_UFFD_CHILD") else {
        return;
    };
    use farmap_core::ErrorKind;
    use farmap_pipeline::{FaultPlan, FaultTrigger, Faulty, OpSet};
    use farmap_testkit::PatternStore;
    let g = Geometry::new(1 << 20, 64 << 10).unwrap();
    let (kind, trigger) = match case.as_str() {
        "permanent" => (ErrorKind::Io, FaultTrigger::Always),
        "retryable-exhausted" => (ErrorKind::Timeout, FaultTrigger::Always),
        _ => (ErrorKind::Timeout, FaultTrigger::Nth(1)),
    };
    let store = Arc::new(Faulty::new(
        PatternStore::new(g, 2),
        FaultPlan {
            ops: OpSet::READ,
            trigger,
            kind,
        },
    ));
    let opts = RegionOptions {
        fetch_retry: RetryPolicy::immediate(3),
        ..direct(WriteTracking::Auto)
    };
    let region = Region::open(store.clone(), opts).unwrap();
    println!("child: touching");
    let v = region.as_slice()[4096 + 5];
    assert_eq!(v, pattern_bytes(2, 4096 + 5, 1)[0]);
    assert_eq!(store.injected(), 1, "one failure, then the retry succeeded");
    println!("child: read {v} after a retry");
}

/// A fault on a chunk the puller is fetching waits for that fetch instead of starting
/// another: the store is read once.
#[test]
fn a_fault_joins_the_pullers_fetch_of_its_chunk() {
    if !uffd_available("a_fault_joins_the_pullers_fetch_of_its_chunk") {
        return;
    }
    use farmap_core::ChunkIdx;
    use farmap_pipeline::{Counting, PullOrder};
    use farmap_testkit::PatternStore;
    // A fetch of its own could not complete sooner than this (the delay never fires early).
    const LATENCY: Duration = Duration::from_millis(400);
    let g = Geometry::new(1 << 20, 64 << 10).unwrap();
    let counting = Arc::new(Counting::new(Delayed::new(
        PatternStore::new(g, 8),
        DelayOptions {
            latency: LATENCY,
            bandwidth: None,
        },
    )));
    let opts = RegionOptions {
        mode: RegionMode::Managed(PullOptions {
            workers: 1,
            order: PullOrder::List(vec![ChunkIdx(5)]),
            ..PullOptions::default()
        }),
        readahead_chunks: 0,
        ..direct(WriteTracking::Auto)
    };
    let store: Arc<dyn Store> = counting.clone();
    let region = Region::open(store, opts).unwrap();
    // Give the puller a head start (generous: the machine may be busy), so that the fault
    // arrives while its fetch is in flight.
    std::thread::sleep(Duration::from_millis(100));
    let started = Instant::now();
    let off = 5 * (64 << 10) + 99;
    assert_eq!(region.as_slice()[off], pattern_bytes(8, off as u64, 1)[0]);
    let waited = started.elapsed();
    assert!(region.wait_pull().unwrap().is_complete());
    assert_eq!(
        counting.counts().reads,
        1,
        "one fetch for the puller and the fault"
    );
    assert!(
        waited < LATENCY,
        "the fault waited for the fetch in flight ({waited:?}), not a new one"
    );
}
