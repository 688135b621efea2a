//! Opening and dropping regions leaks nothing: every thread and file descriptor a region
//! makes is gone shortly after it is dropped (its own test binary, so that no other test
//! opens descriptors meanwhile).

use std::time::{Duration, Instant};

use farmap_core::Geometry;
use farmap_pipeline::PushOptions;
use farmap_store::MemoryStore;
use farmap_testkit::contents::with_pattern;
use farmap_uffd::{Region, RegionOptions};

fn count(dir: &str) -> usize {
    std::fs::read_dir(dir).unwrap().count()
}

#[test]
fn dropped_regions_release_threads_and_descriptors() {
    let test = "dropped_regions_release_threads_and_descriptors";
    if farmap_testkit::skip::unless(test, farmap_uffd::probe()).is_none() {
        return;
    }
    let g = Geometry::new(4 << 20, 64 << 10).unwrap();
    let store = with_pattern(MemoryStore::new(g), 1);
    let cycle = |i: usize| {
        let opts = RegionOptions {
            push: PushOptions {
                interval: Some(Duration::from_millis(1)),
                ..PushOptions::default()
            },
            ..RegionOptions::default()
        };
        let region = Region::open(store.clone(), opts).unwrap();
        region.memory().store_u8(i * 4096, i as u8).unwrap();
        region.sync().unwrap();
        if i.is_multiple_of(2) {
            region.close().unwrap();
        }
    };
    cycle(0); // the process-wide timer thread and the like start here
    std::thread::sleep(Duration::from_millis(50));
    let (fds, threads) = (count("/proc/self/fd"), count("/proc/self/task"));
    for i in 1..20 {
        cycle(i);
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (f, t) = (count("/proc/self/fd"), count("/proc/self/task"));
        if f <= fds && t <= threads {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "leak: {f} fds (was {fds}), {t} threads (was {threads})"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
