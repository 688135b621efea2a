//! The polling fault path (`FaultWait::Poll`): faults are served with the right bytes, every
//! fault message is counted once as found by polling or after sleeping, and the idle-priority
//! companions stop spinning when the window closes and are joined when the region closes.
//! The sleeping path (`FaultWait::Sleep`): a reader per CPU, each serving faults, resting when
//! its CPU faults nothing, joined at close.
//!
//! One test function: it counts this process's threads by name, which other tests running
//! in parallel in the same process would disturb.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use farmap_core::{Geometry, Store};
use farmap_testkit::{pattern_bytes, PatternStore};
use farmap_uffd::{FaultWait, Region, RegionOptions, RegionStats, WriteTracking};

const CHUNK: u64 = 64 << 10;
const SIZE: u64 = 8 << 20;

/// This process's threads named `name`, with their state letter (`R`, `S`, ...).
fn threads_named(name: &str) -> Vec<(String, char)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc/self/task").unwrap() {
        let dir = entry.unwrap().path();
        let (Ok(comm), Ok(stat)) = (
            std::fs::read_to_string(dir.join("comm")),
            std::fs::read_to_string(dir.join("stat")),
        ) else {
            continue; // exited meanwhile
        };
        // The kernel keeps the first 15 bytes of a thread's name.
        if comm.trim_end() == &name[..name.len().min(15)] {
            // "pid (comm) S ...": the state follows the last ')'.
            let state = stat[stat.rfind(')').unwrap() + 2..].chars().next().unwrap();
            out.push((dir.display().to_string(), state));
        }
    }
    out
}

/// Whether no thread named `name` is left, waiting up to two seconds for joined ones to go:
/// a join returns when the thread clears its id, before the kernel removes its task from
/// `/proc`, so a thread joined a moment ago can still be listed.
fn none_named(name: &str) -> bool {
    let start = Instant::now();
    while !threads_named(name).is_empty() {
        if start.elapsed() > Duration::from_secs(2) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

/// Samples the companions' CPU time until two samples 50 ms apart agree (all parked) or
/// ten seconds pass; returns the last sample and whether it settled.
fn companions_settle(region: &Region) -> (u64, bool) {
    let mut last = region.stats().handler_cpu.companions_ns;
    for _ in 0..200 {
        std::thread::sleep(Duration::from_millis(50));
        let now = region.stats().handler_cpu.companions_ns;
        if now == last {
            return (now, true);
        }
        last = now;
    }
    (last, false)
}

fn assert_counts_add_up(s: &RegionStats, what: &str) {
    assert_eq!(
        s.faults + s.wp_faults,
        s.faults_polled + s.faults_slept,
        "{what}: every fault message is counted once, as polled or slept: {s:?}"
    );
}

fn options(tracking: WriteTracking, wait: FaultWait) -> RegionOptions {
    RegionOptions {
        fault_wait: wait,
        ..direct(tracking)
    }
}

#[test]
fn polling_serves_faults_counts_them_and_its_companions_stop() {
    if !uffd_available("polling_serves_faults_counts_them_and_its_companions_stop") {
        return;
    }
    let g = Geometry::new(SIZE, CHUNK).unwrap();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    for tracking in tracking_modes() {
        // A window long enough that back-to-back touches are found by polling.
        let wait = FaultWait::Poll(Duration::from_millis(300));
        let store: Arc<dyn Store> = Arc::new(PatternStore::new(g, 5));
        let region = Region::open(store, options(tracking, wait)).unwrap();
        // Companions name themselves as they start.
        for _ in 0..1000 {
            if threads_named("farmap-uffd-spin").len() == cpus {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(
            threads_named("farmap-uffd-spin").len(),
            cpus,
            "{tracking:?}: one companion per CPU"
        );
        // Scattered single bytes, then everything but the last chunk (kept for a fault after
        // a pause): data byte for byte.
        let head = SIZE - CHUNK;
        for off in [3 * CHUNK + 17, 0, head - 1, SIZE / 2 + 4095] {
            assert_eq!(
                region.memory().load_u8(off as usize).unwrap(),
                pattern_bytes(5, off, 1)[0],
                "{tracking:?}: byte {off}"
            );
        }
        assert!(
            region.memory().subslice(0, head as usize).unwrap().to_vec()
                == pattern_bytes(5, 0, head as usize),
            "{tracking:?}: the region equals the store"
        );
        // Writes: with synchronous tracking each first write per page is a fault too.
        for page in 0..32usize {
            region.memory().store_u8(page * 4096 * 7, 0xa5).unwrap();
        }
        let s = region.stats();
        assert_eq!(s.faults, head / CHUNK, "{tracking:?}: one fault per chunk");
        if tracking == WriteTracking::SyncFaults {
            assert_eq!(s.wp_faults, 32, "{tracking:?}: {s:?}");
        }
        assert_counts_add_up(&s, &format!("{tracking:?}"));
        assert!(
            s.faults_polled > 0,
            "{tracking:?}: back-to-back faults within the window are found by polling: {s:?}"
        );
        assert!(s.faults_slept >= 1, "{tracking:?}: the first fault: {s:?}");
        assert!(s.handler_cpu.reader_ns > 0, "{s:?}");
        assert_eq!(s.handler_cpu.companions, cpus as u32, "{s:?}");

        // Idle now: once the window has passed, the companions park (their CPU time stops
        // growing and they sleep).
        std::thread::sleep(Duration::from_millis(400));
        let (parked_ns, settled) = companions_settle(&region);
        assert!(
            settled,
            "{tracking:?}: companions stop spinning after the window"
        );
        // A parked companion is asleep; on a loaded host one may be seen runnable for a
        // moment (a spurious wake-up, a timer), so each gets a second to be seen asleep.
        let start = Instant::now();
        loop {
            let awake: Vec<_> = threads_named("farmap-uffd-spin")
                .into_iter()
                .filter(|(_, state)| *state != 'S')
                .collect();
            if awake.is_empty() {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(1),
                "{tracking:?}: companions not asleep a second after settling: {awake:?}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        // A fault after the pause is found after sleeping, and serves the right bytes.
        let slept = region.stats().faults_slept;
        assert!(
            region
                .memory()
                .subslice(head as usize, CHUNK as usize)
                .unwrap()
                .to_vec()
                == pattern_bytes(5, head, CHUNK as usize),
            "{tracking:?}: the last chunk equals the store"
        );
        let s = region.stats();
        assert_eq!(s.faults, SIZE / CHUNK, "{tracking:?}: {s:?}");
        assert!(s.faults_slept > slept, "{tracking:?}: {s:?}");
        assert_counts_add_up(&s, &format!("{tracking:?} after the pause"));
        assert!(s.handler_cpu.companions_ns >= parked_ns);

        drop(region);
        assert!(
            none_named("farmap-uffd-spin"),
            "{tracking:?}: companions are joined at close"
        );
        assert!(
            none_named("farmap-uffd-reader"),
            "{tracking:?}: the reader is joined at close"
        );
    }

    // The sleeping path: no companions, every fault found after poll(2).
    let store: Arc<dyn Store> = Arc::new(PatternStore::new(g, 6));
    let region = Region::open(store, options(WriteTracking::Auto, FaultWait::Sleep)).unwrap();
    assert!(none_named("farmap-uffd-spin"));
    assert!(region.memory().to_vec() == pattern_bytes(6, 0, SIZE as usize));
    let s = region.stats();
    assert_counts_add_up(&s, "sleep");
    assert_eq!(s.faults_polled, 0, "{s:?}");
    assert_eq!(s.handler_cpu.companions, 0, "{s:?}");
    drop(region);

    sleeping_readers_one_per_cpu();
}

/// The CPUs this process may run on.
fn affinity() -> Vec<usize> {
    let set = rustix::thread::sched_getaffinity(None).unwrap();
    (0..rustix::thread::CpuSet::MAX_CPU)
        .filter(|c| set.is_set(*c))
        .collect()
}

/// Runs `f` on a thread kept to `cpu`.
fn on_cpu<T: Send + 'static>(cpu: usize, f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(move || {
        let mut set = rustix::thread::CpuSet::new();
        set.set(cpu);
        rustix::thread::sched_setaffinity(None, &set).unwrap();
        f()
    })
    .join()
    .unwrap()
}

/// A sleeping region has a reader per CPU; faults from threads on every CPU are served with
/// the right bytes; a reader whose CPU has no faulting thread rests; the readers are joined at
/// close.
fn sleeping_readers_one_per_cpu() {
    let cpus = affinity();
    let readers = cpus.len().min(8);
    // 4 KiB chunks: a fault per page.
    let g = Geometry::new(SIZE, 4096).unwrap();
    let store: Arc<dyn Store> = Arc::new(PatternStore::new(g, 7));
    let region =
        Arc::new(Region::open(store, options(WriteTracking::Auto, FaultWait::Sleep)).unwrap());
    assert_eq!(region.stats().fault_readers as usize, readers);
    for _ in 0..1000 {
        if threads_named("farmap-uffd-reader").len() == readers {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(threads_named("farmap-uffd-reader").len(), readers);

    // The first half from one thread on the first CPU; the second half in slices, each from a
    // thread on the next CPU in turn.
    let half = (SIZE / 2) as usize;
    let r = region.clone();
    let first = on_cpu(cpus[0], move || {
        r.memory().subslice(0, half).unwrap().to_vec()
    });
    assert!(first == pattern_bytes(7, 0, half), "the first half");
    let after_one_cpu = region.stats();
    if readers > 1 {
        assert!(
            after_one_cpu.reader_rests >= 1,
            "a reader whose CPU faults nothing rests: {after_one_cpu:?}"
        );
    }
    let slice = half / 8;
    for (i, cpu) in cpus.iter().cycle().take(8).enumerate() {
        let r = region.clone();
        let off = half + i * slice;
        let got = on_cpu(*cpu, move || {
            r.memory().subslice(off, slice).unwrap().to_vec()
        });
        assert!(
            got == pattern_bytes(7, off as u64, slice),
            "slice {i} on CPU {cpu}"
        );
    }
    let s = region.stats();
    assert_eq!(s.faults, SIZE / 4096, "a fault per page: {s:?}");
    assert_counts_add_up(&s, "per-CPU readers");
    drop(region);
    assert!(
        none_named("farmap-uffd-reader"),
        "the readers are joined at close"
    );
}
