//! Bounded local memory with the paths of a program's region (`farmap run`), on a region of
//! this process: staged chunks come back by copy (`FARMAP_PAGER_REFAULT=copy`), their
//! slots left stale until reclaim drops them; and, in regions of one-page chunks, discarded
//! pages read as zeros (`FARMAP_PAGER_REMOVE=zero`).

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

use common::paging::{bounded, paging_available, Model, CHUNK, CHUNKS};
use farmap_core::Geometry;
use farmap_store::MemoryStore;
use farmap_testkit::contents::{snapshot, with_pattern};
use farmap_testkit::pattern_bytes;
use farmap_testkit::wait::eventually;
use farmap_uffd::{LocalLimit, PagingStats, Region};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Sets the pager's hidden switches for every region of this binary (once, before any
/// region is opened: every test calls this first).
fn program_paths() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        std::env::set_var("FARMAP_PAGER_REFAULT", "copy");
        // Only regions of one-page chunks take it (the others fetch removed chunks again).
        std::env::set_var("FARMAP_PAGER_REMOVE", "zero");
    });
}

/// Whether paging works here (a skip is recorded otherwise), with the switches set.
fn ready(test: &str) -> bool {
    program_paths();
    paging_available(test)
}

/// Staged refaults came back by copy, none in a faulting thread.
fn assert_copied(paging: &PagingStats) {
    assert!(paging.staged_refaults > 0, "no staged refault: {paging:?}");
    assert_eq!(paging.staged_refaults_in_thread, 0, "{paging:?}");
}

/// The no-write-lost model (a writer keeping a model, the limit moving from 1% to 100%) over
/// seeds, with and without background pushes and in-thread mode (which leaves every staged
/// refault to the reader's copy), half of the runs with syncs while the writer runs (each
/// finds every earlier write in the store): memory and store equal the model.
#[test]
fn copy_refaults_lose_no_write() {
    if !ready("copy_refaults_lose_no_write") {
        return;
    }
    let mut rng = SmallRng::seed_from_u64(41);
    let mut refaults = 0;
    for seed in 0..12u64 {
        let limits: Vec<u8> = (0..rng.gen_range(2..6))
            .map(|_| rng.gen_range(1..=100))
            .collect();
        let paging = Model {
            seed,
            limits: &limits,
            push: (seed % 2 == 1).then(|| Duration::from_millis(2)),
            in_thread: seed % 3 == 2,
            min_writes: 15_000,
            syncs: seed % 4 < 2,
            ..Model::default()
        }
        .run();
        assert_eq!(paging.staged_refaults_in_thread, 0, "{paging:?}");
        refaults += paging.staged_refaults;
    }
    eprintln!("{refaults} staged refaults by copy in 12 runs");
    assert!(refaults > 0, "no staged refault in 12 runs");
}

/// A tight limit (6% of the region) and a sequential sweep with drop-behind: no write lost.
#[test]
fn copy_refaults_lose_no_write_at_a_tight_limit() {
    if !ready("copy_refaults_lose_no_write_at_a_tight_limit") {
        return;
    }
    for seed in [7, 8] {
        assert_copied(
            &Model {
                seed,
                limits: &[6],
                min_writes: 20_000,
                ..Model::default()
            }
            .run(),
        );
    }
    for (seed, push) in [(11, None), (12, Some(Duration::from_millis(2)))] {
        let paging = Model {
            seed,
            limits: &[25, 10, 40],
            push,
            sequential: true,
            ..Model::default()
        }
        .run();
        assert!(paging.dropped_behind > 0, "{paging:?}");
    }
}

/// A quarter of the region read, part of it written, all of it staged and read again: each
/// staged chunk comes back by copy with its content, and leaves its slot's pages behind
/// (counted as resident) until reclaim drops them, which a lower limit makes it do; writes
/// before and after reach the store.
#[test]
fn staged_chunks_come_back_by_copy_and_their_slots_are_dropped() {
    if !ready("staged_chunks_come_back_by_copy_and_their_slots_are_dropped") {
        return;
    }
    let g = Geometry::new(CHUNKS * u64::from(CHUNK), u64::from(CHUNK)).unwrap();
    let store = with_pattern(MemoryStore::new(g), 21);
    let region = Region::open(store.clone(), bounded(LocalLimit::Percent(100.0), None)).unwrap();
    let (mem, chunk) = (region.memory(), CHUNK as usize);
    let touched = (CHUNKS / 4) as usize;
    let mut model = pattern_bytes(21, 0, g.size() as usize);
    let check = |model: &[u8], what: &str| {
        for c in 0..touched {
            for off in [c * chunk, c * chunk + 64, c * chunk + chunk - 8] {
                let want = u64::from_ne_bytes(model[off..off + 8].try_into().unwrap());
                assert_eq!(mem.load_u64(off).unwrap(), want, "{what}: offset {off:#x}");
            }
        }
    };
    check(&model, "first touch");
    for c in (0..touched).step_by(2) {
        let off = c * chunk + 64;
        mem.store_u64(off, 0xfeed_0000 + c as u64).unwrap();
        model[off..off + 8].copy_from_slice(&(0xfeed_0000 + c as u64).to_ne_bytes());
    }
    let mut staged = 0;
    let deadline = Instant::now() + Duration::from_secs(10);
    while staged < touched as u64 && Instant::now() < deadline {
        staged += region.deactivate(CHUNKS).unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(staged, touched as u64, "every touched chunk staged");
    check(&model, "after staging");
    // Counted just after the copy woke the thread.
    eventually("every staged chunk counted", Duration::from_secs(5), || {
        region.stats().paging.unwrap().staged_refaults == touched as u64
    });
    let paging = region.stats().paging.unwrap();
    assert_copied(&paging);
    assert_eq!(paging.staged_chunks, 0);
    assert_eq!(
        paging.resident_chunks,
        2 * touched as u64,
        "the stale slots count"
    );
    let pages_per_chunk = (chunk / region.page_size()) as u64;
    let (in_region, in_staging) = region.local_pages().unwrap().unwrap();
    assert_eq!(in_region, touched as u64 * pages_per_chunk);
    assert_eq!(
        in_staging,
        touched as u64 * pages_per_chunk,
        "the stale slots keep their pages until reclaim drops them"
    );
    for c in (1..touched).step_by(2) {
        let off = c * chunk + 128;
        mem.store_u64(off, 0xbeef_0000 + c as u64).unwrap();
        model[off..off + 8].copy_from_slice(&(0xbeef_0000 + c as u64).to_ne_bytes());
    }
    // A limit of the touched chunks: reclaim drops the stale slots first, and nothing else.
    assert!(region.set_local_max(LocalLimit::Percent(50.0)));
    let deadline = Instant::now() + Duration::from_secs(10);
    while region.local_pages().unwrap().unwrap().1 > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    let paging = region.stats().paging.unwrap();
    assert_eq!(region.local_pages().unwrap().unwrap().1, 0, "{paging:?}");
    assert_eq!(paging.resident_chunks, touched as u64, "{paging:?}");
    assert_eq!(paging.evictions_proactive + paging.evictions_reactive, 0);
    check(&model, "after the drop");
    region.sync().unwrap();
    assert!(
        snapshot(&*store) == model,
        "the store differs from the model"
    );
    assert!(region.memory().to_vec() == model);
}

/// Two threads touch the whole region (reads and writes, most of them in a hot quarter, so
/// that staged chunks are touched again before they are dropped) under a limit of 20%: at
/// every sample (for 500 ms, and until a staged chunk came back by copy), the pages in the
/// region and the staging area, stale slots included, stay within limit + min_free chunks.
#[test]
fn copy_refaults_keep_resident_memory_under_the_limit() {
    if !ready("copy_refaults_keep_resident_memory_under_the_limit") {
        return;
    }
    let g = Geometry::new(CHUNKS * u64::from(CHUNK), u64::from(CHUNK)).unwrap();
    let store = with_pattern(MemoryStore::new(g), 3);
    let region = Arc::new(Region::open(store, bounded(LocalLimit::Percent(20.0), None)).unwrap());
    let paging = region.stats().paging.unwrap();
    let bound = paging.limit_chunks + paging.min_free_chunks;
    let pages_per_chunk = u64::from(CHUNK) / region.page_size() as u64;
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..2u64)
        .map(|t| {
            let (region, stop) = (region.clone(), stop.clone());
            std::thread::spawn(move || {
                let mem = region.memory();
                let mut rng = SmallRng::seed_from_u64(t);
                while !stop.load(Ordering::Relaxed) {
                    let words = region.len() / 8;
                    let hot = if rng.gen_bool(0.7) { words / 4 } else { words };
                    let off = rng.gen_range(0..hot) * 8;
                    if rng.gen_bool(0.3) {
                        mem.store_u64(off, off as u64).unwrap();
                    } else {
                        mem.load_u64(off).unwrap();
                    }
                }
            })
        })
        .collect();
    // At least 500 ms, and until a staged chunk came back by copy (a loaded machine may
    // take longer to get there), 20 s at most.
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(500)
        || (region.stats().paging.unwrap().staged_refaults == 0
            && start.elapsed() < Duration::from_secs(20))
    {
        let (in_region, staged) = region.local_pages().unwrap().unwrap();
        let resident = region.stats().paging.unwrap().resident_chunks;
        assert!(
            in_region + staged <= bound * pages_per_chunk,
            "{in_region} pages in the region and {staged} staged: more than {bound} chunks"
        );
        assert!(resident <= bound, "{resident} chunks resident > {bound}");
        std::thread::sleep(Duration::from_millis(1));
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    assert_copied(&region.stats().paging.unwrap());
}

/// The model's region in chunks of one page (removed pages read as zeros), 4 MiB.
const PAGE_CHUNK: u32 = 4096;
const PAGE_CHUNKS: u64 = 1024;

/// Pages discarded (`madvise(MADV_DONTNEED)`, half of the writer's operations) while a reader
/// sweeps the region with sequential prefetch, eviction runs under a limit of a quarter and
/// pushes run in the background: each discarded page reads zeros at once, every sync in
/// between finds zeros (or later writes) in the store for what was discarded before it, and
/// at the end memory and store hold zeros there, the model's content everywhere else.
#[test]
fn discarded_pages_read_zeros_while_eviction_and_prefetch_run() {
    if !ready("discarded_pages_read_zeros_while_eviction_and_prefetch_run") {
        return;
    }
    for seed in 0..6 {
        let paging = Model {
            seed,
            limits: &[25, 20, 30],
            push: Some(Duration::from_millis(2)),
            chunk: PAGE_CHUNK,
            chunks: PAGE_CHUNKS,
            min_writes: 6000,
            syncs: true,
            discards: Some(2),
            reader: true,
            ..Model::default()
        }
        .run();
        assert!(paging.prefetched > 0, "nothing prefetched: {paging:?}");
        assert!(
            paging.zero_fills > 0,
            "no discarded page touched again: {paging:?}"
        );
    }
}

/// The no-write-lost model in a region whose discarded pages read as zeros, over 16 seeds:
/// writes, discards (one operation in 16) and a moving limit (1% to 100%), with and without
/// a prefetching reader, background pushes, syncs during the run and in-thread mode: every
/// byte of memory and store equals the model (zeros where discarded).
#[test]
fn zero_mode_model_loses_no_write() {
    if !ready("zero_mode_model_loses_no_write") {
        return;
    }
    let mut rng = SmallRng::seed_from_u64(43);
    let mut refaults = 0;
    for seed in 0..16u64 {
        let limits: Vec<u8> = (0..rng.gen_range(2..6))
            .map(|_| rng.gen_range(1..=100))
            .collect();
        let paging = Model {
            seed,
            limits: &limits,
            push: (seed % 2 == 1).then(|| Duration::from_millis(2)),
            in_thread: seed % 5 == 4,
            chunk: PAGE_CHUNK,
            chunks: PAGE_CHUNKS / 4,
            min_writes: 10_000,
            syncs: seed % 4 < 2,
            discards: Some(16),
            reader: seed % 3 != 0,
            ..Model::default()
        }
        .run();
        refaults += paging.staged_refaults;
    }
    eprintln!("{refaults} staged refaults by copy in 16 runs");
    assert!(refaults > 0, "no staged refault in 16 runs");
}
