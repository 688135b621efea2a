//! The polling fault path (`FaultWait::Poll`): faults are served with the right bytes, every
//! fault message is counted once as found by polling or after sleeping, and the idle-priority
//! companions stop spinning when the window closes and are joined when the region closes.
//!
//! One test function: it counts this process's threads by name, which other tests running
//! in parallel in the same process would disturb.

mod common;

use std::sync::Arc;
use std::time::Duration;

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
                peek(&region, off as usize),
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
            poke(&region, page * 4096 * 7, 0xa5);
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
        for (task, state) in threads_named("farmap-uffd-spin") {
            assert_eq!(state, 'S', "{tracking:?}: companion {task} sleeps");
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
            threads_named("farmap-uffd-spin").is_empty(),
            "{tracking:?}: companions are joined at close"
        );
        assert!(
            threads_named("farmap-uffd-reader").is_empty(),
            "{tracking:?}: the reader is joined at close"
        );
    }

    // The sleeping path: no companions, every fault found after poll(2).
    let store: Arc<dyn Store> = Arc::new(PatternStore::new(g, 6));
    let region = Region::open(store, options(WriteTracking::Auto, FaultWait::Sleep)).unwrap();
    assert!(threads_named("farmap-uffd-spin").is_empty());
    assert!(region.memory().to_vec() == pattern_bytes(6, 0, SIZE as usize));
    let s = region.stats();
    assert_counts_add_up(&s, "sleep");
    assert_eq!(s.faults_polled, 0, "{s:?}");
    assert_eq!(s.handler_cpu.companions, 0, "{s:?}");
}
