//! Regions under concurrent load: writers racing dirty scans and pushes, many threads faulting
//! a slow store while the background puller fills the region.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use farmap_core::{Geometry, Store};
use farmap_pipeline::{DelayOptions, Delayed, PullOptions, PushOptions, RetryPolicy};
use farmap_store::MemoryStore;
use farmap_testkit::contents::{snapshot, with_pattern};
use farmap_testkit::wait::within;
use farmap_testkit::{block_on, pattern_bytes};
use farmap_uffd::{Region, RegionMode, RegionOptions, WriteTracking};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const PAGE: usize = 4096;

/// Three threads write through the slice API (aligned words, byte copies, single bytes) at
/// random places while another loop takes the dirty set and pushes those chunks itself (and
/// the background pusher, when on, pushes too); each writer owns every third 8-byte word and
/// keeps a model of what it wrote. After the writers stop and a final sync, the memory equals
/// the model (the store's pattern with every writer's last writes) and the store equals the
/// memory, byte for byte. Run with the background pusher off and on.
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

const WRITERS: usize = 3;

/// One writer: random writes to the words `w` with `w % WRITERS == t`; returns how many
/// writes it made and its model of every word it wrote (offset → last value).
fn writer(region: &Region, t: usize, stop: &AtomicBool) -> (u64, HashMap<usize, [u8; 8]>) {
    let mem = region.memory();
    let words = region.len() / 8;
    let mut rng = SmallRng::seed_from_u64(t as u64);
    let mut model: HashMap<usize, [u8; 8]> = HashMap::new();
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        // Mostly a hot set (re-dirtied between scans), sometimes anywhere.
        let w = if rng.gen_bool(0.8) {
            rng.gen_range(0..64 * PAGE / 8)
        } else {
            rng.gen_range(0..words)
        };
        let w = w - w % WRITERS + t;
        if w >= words {
            continue;
        }
        let off = w * 8;
        let mut word = match model.get(&off) {
            Some(v) => *v,
            None => {
                let mut v = [0u8; 8];
                mem.read_into(off, &mut v).unwrap();
                v
            }
        };
        match rng.gen_range(0..3) {
            0 => {
                let v: u64 = rng.gen();
                mem.store_u64(off, v).unwrap();
                word = v.to_ne_bytes();
            }
            1 => {
                let (from, to) = (rng.gen_range(0..8), rng.gen_range(0..=8));
                let (from, to) = (from.min(to), from.max(to));
                let bytes: Vec<u8> = (from..to).map(|_| rng.gen()).collect();
                mem.write_from(off + from, &bytes).unwrap();
                word[from..to].copy_from_slice(&bytes);
            }
            _ => {
                let (k, v) = (rng.gen_range(0..8), rng.gen());
                mem.store_u8(off + k, v).unwrap();
                word[k] = v;
            }
        }
        model.insert(off, word);
        n += 1;
    }
    (n, model)
}

fn race_once(tracking: WriteTracking, background: Option<Duration>) {
    let what = format!("{tracking:?}, background push {background:?}");
    let g = Geometry::new(4 << 20, 16 << 10).unwrap();
    let store = with_pattern(MemoryStore::new(g), 9);
    let opts = RegionOptions {
        push: PushOptions {
            interval: background,
            ..PushOptions::default()
        },
        ..direct(tracking)
    };
    let region = Region::open(store.clone(), opts).unwrap();
    let stop = AtomicBool::new(false);
    let (writes, models, rounds, pushed, taken) = std::thread::scope(|scope| {
        let writers: Vec<_> = (0..WRITERS)
            .map(|t| {
                let (region, stop) = (&region, &stop);
                scope.spawn(move || writer(region, t, stop))
            })
            .collect();
        let started = Instant::now();
        let mut rounds = 0;
        let mut pushed = 0;
        let mut taken = std::collections::BTreeSet::new();
        while started.elapsed() < Duration::from_millis(700) {
            let dirty = region.take_dirty().unwrap();
            for idx in dirty.chunks {
                let data = region.read_chunk(idx).unwrap();
                block_on(store.write(idx, data)).unwrap();
                taken.insert(idx);
                pushed += 1;
            }
            if rounds % 16 == 0 {
                region.sync().unwrap();
            }
            rounds += 1;
        }
        stop.store(true, Ordering::Relaxed);
        let mut writes = 0;
        let mut models = Vec::new();
        for w in writers {
            let (n, model) = w.join().unwrap();
            writes += n;
            models.push(model);
        }
        (writes, models, rounds, pushed, taken)
    });
    region.sync().unwrap();
    // The chunks `take_dirty` returned are this loop's to push, and with the background
    // pusher on, its write of a chunk can land after the pusher's write of a newer copy (the
    // pusher took the chunk again after a later write). As an owner must, write the final
    // contents of every chunk it took once the writers are done and the pusher is idle.
    // (Without the pusher nothing else writes the store: no second chance is given there.)
    for idx in taken.into_iter().filter(|_| background.is_some()) {
        let data = region.read_chunk(idx).unwrap();
        block_on(store.write(idx, data)).unwrap();
    }
    let mut expected = pattern_bytes(9, 0, 4 << 20);
    for model in &models {
        for (off, word) in model {
            expected[*off..*off + 8].copy_from_slice(word);
        }
    }
    let memory = region.memory().to_vec();
    let wrong = memory.iter().zip(&expected).filter(|(a, b)| a != b).count();
    assert_eq!(
        wrong, 0,
        "{what}: {wrong} bytes of memory differ from the writers' model"
    );
    let stored = snapshot(&*store);
    let differ = memory.iter().zip(&stored).filter(|(a, b)| a != b).count();
    assert_eq!(
        differ, 0,
        "{what}: {differ} bytes differ after {writes} writes, {rounds} scans, {pushed} pushes"
    );
    assert!(
        rounds > 10 && writes > 1_000,
        "{what}: the race ran ({rounds}, {writes})"
    );
    println!(
        "{what}: {writes} writes, {rounds} scans, {pushed} chunk pushes: store == memory == model"
    );
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
    let backing = with_pattern(MemoryStore::new(g), 4);
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
    let len = region.len();
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let region = region.clone();
            std::thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(100 + t);
                // Thread t writes only pages with page % 8 == t, and remembers what it wrote.
                let mut mine: Vec<Option<u8>> = vec![None; len / PAGE];
                let mut reads = 0;
                let started = Instant::now();
                while started.elapsed() < Duration::from_millis(400) {
                    let off = rng.gen_range(0..len);
                    let page = off / PAGE;
                    let got = region.memory().load_u8(off).unwrap();
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
                        region.memory().store_u8(page * PAGE, v).unwrap();
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
        snapshot(&*backing) == region.memory().to_vec(),
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
    let case = std::env::var("FARMAP_UFFD_CHILD")
        .expect("started by a SIGBUS test, with FARMAP_UFFD_CHILD set");
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
    let v = region.memory().load_u8(4096 + 5).unwrap();
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
    assert_eq!(
        region.memory().load_u8(off).unwrap(),
        pattern_bytes(8, off as u64, 1)[0]
    );
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
