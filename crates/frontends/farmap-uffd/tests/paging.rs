//! Bounded local memory: a region larger than its local limit loses no write whatever the
//! limit does, and its resident memory stays under the limit.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::paging::{bounded, no_write_lost, no_write_lost_as, paging_available, CHUNK, CHUNKS};
use farmap_core::Geometry;
use farmap_store::MemoryStore;
use farmap_testkit::contents::{snapshot, with_pattern};
use farmap_testkit::pattern_bytes;
use farmap_uffd::{LocalLimit, Region};
use proptest::prelude::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, ..ProptestConfig::default() })]

    /// A concurrent writer and random limit changes (1% to 100% of the region): no write is
    /// lost, in memory or in the store, with faults served by the reader or (staged chunks)
    /// in the faulting thread.
    #[test]
    fn bounded_region_loses_no_write(
        seed in any::<u64>(),
        limits in proptest::collection::vec(1u8..=100, 1..6),
        background in any::<bool>(),
        in_thread in any::<bool>(),
    ) {
        if !paging_available("bounded_region_loses_no_write") {
            return Ok(());
        }
        let push = background.then(|| Duration::from_millis(2));
        no_write_lost(seed, &limits, push, in_thread);
    }
}

/// A fixed tight limit (4 of 64 chunks) and the same workload: no write lost, and every
/// eviction path is exercised.
#[test]
fn tight_limit_loses_no_write() {
    if !paging_available("tight_limit_loses_no_write") {
        return;
    }
    no_write_lost(7, &[6], None, false);
}

/// A writer sweeping the region chunk after chunk with sequential prefetch: the chunks it
/// leaves behind are evicted first (drop-behind), and no write is lost, with faults served by
/// the reader or in the faulting thread, with or without background pushes.
#[test]
fn sequential_sweep_drops_behind_and_loses_no_write() {
    if !paging_available("sequential_sweep_drops_behind_and_loses_no_write") {
        return;
    }
    for (seed, in_thread, push) in [(11, false, None), (12, true, Some(2)), (13, false, Some(2))] {
        let push = push.map(Duration::from_millis);
        let paging = no_write_lost_as(seed, &[25, 10, 40], push, in_thread, true);
        assert!(
            paging.dropped_behind > 0,
            "the sweep left nothing behind to drop: {paging:?}"
        );
    }
}

/// The same with staged chunks moved back by the faulting thread itself (SIGBUS mode).
#[test]
fn tight_limit_loses_no_write_in_thread() {
    if !paging_available("tight_limit_loses_no_write_in_thread") {
        return;
    }
    no_write_lost(8, &[6], None, true);
}

/// In-thread mode: every chunk read (served by the reader, posted by the SIGBUS handler),
/// some written, all staged, all read again: the staged ones come back in the faulting
/// thread with their content, and the writes made before and after still reach the store.
#[test]
fn staged_chunks_come_back_in_the_faulting_thread() {
    if !paging_available("staged_chunks_come_back_in_the_faulting_thread") {
        return;
    }
    let g = Geometry::new(CHUNKS * u64::from(CHUNK), u64::from(CHUNK)).unwrap();
    let store = with_pattern(MemoryStore::new(g), 11);
    let mut opts = bounded(LocalLimit::Percent(100.0), None);
    if let Some(p) = &mut opts.paging {
        p.in_thread = true;
        // The whole region fits: no reclaim drops what the test stages.
        p.proactive = false;
    }
    let region = Region::open(store.clone(), opts).unwrap();
    let mem = region.memory();
    let mut model = pattern_bytes(11, 0, g.size() as usize);
    let chunk = CHUNK as usize;
    let check = |model: &[u8], what: &str| {
        for c in 0..CHUNKS as usize {
            for off in [c * chunk, c * chunk + chunk - 8] {
                let want = u64::from_ne_bytes(model[off..off + 8].try_into().unwrap());
                assert_eq!(mem.load_u64(off).unwrap(), want, "{what}: offset {off:#x}");
            }
        }
    };
    check(&model, "first touch");
    let first = region.stats();
    assert!(
        first.faults_signalled >= CHUNKS,
        "every first touch goes to the reader: {first:?}"
    );
    // Writes before staging, to every fourth chunk.
    for c in (0..CHUNKS as usize).step_by(4) {
        let off = c * chunk + 64;
        mem.store_u64(off, 0xfeed_0000 + c as u64).unwrap();
        model[off..off + 8].copy_from_slice(&(0xfeed_0000 + c as u64).to_ne_bytes());
    }
    // Written chunks get a second chance in the first pass; a chunk whose fetch has woken
    // its thread may not be active yet (the pager hears of it just after).
    let mut staged = 0;
    let deadline = Instant::now() + Duration::from_secs(10);
    while staged < CHUNKS && Instant::now() < deadline {
        staged += region.deactivate(CHUNKS).unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(staged, CHUNKS, "every chunk staged");
    check(&model, "after staging");
    let after = region.stats();
    let paging = after.paging.clone().unwrap();
    assert_eq!(
        paging.staged_refaults_in_thread, CHUNKS,
        "every staged chunk came back in its thread: {after:?}"
    );
    assert_eq!(after.faults_in_thread - first.faults_in_thread, CHUNKS);
    assert_eq!(
        after.faults_signalled, first.faults_signalled,
        "no staged fault went to the reader"
    );
    // Writes after the move back are tracked (the chunk was protected again).
    for c in (1..CHUNKS as usize).step_by(4) {
        let off = c * chunk + 128;
        mem.store_u64(off, 0xbeef_0000 + c as u64).unwrap();
        model[off..off + 8].copy_from_slice(&(0xbeef_0000 + c as u64).to_ne_bytes());
    }
    region.sync().unwrap();
    assert!(
        snapshot(&*store) == model,
        "the store differs from the model"
    );
    assert!(region.memory().to_vec() == model);
}

/// Two threads touch the whole region again and again (reads and writes) under a limit of
/// 20%: at every sample, the pages present in the region and its staging area (from the
/// page tables) and the pager's own count stay within limit + min_free chunks.
#[test]
fn resident_memory_stays_under_limit() {
    if !paging_available("resident_memory_stays_under_limit") {
        return;
    }
    let g = Geometry::new(CHUNKS * u64::from(CHUNK), u64::from(CHUNK)).unwrap();
    let store = with_pattern(MemoryStore::new(g), 3);
    let region = Arc::new(Region::open(store, bounded(LocalLimit::Percent(20.0), None)).unwrap());
    let paging = region.stats().paging.unwrap();
    let bound_chunks = paging.limit_chunks + paging.min_free_chunks;
    assert_eq!(paging.limit_chunks, CHUNKS / 5);
    let pages_per_chunk = u64::from(CHUNK) / region.page_size() as u64;
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..2u64)
        .map(|t| {
            let (region, stop) = (region.clone(), stop.clone());
            std::thread::spawn(move || {
                let mem = region.memory();
                let mut rng = SmallRng::seed_from_u64(t);
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let off = rng.gen_range(0..region.len() / 8) * 8;
                    if rng.gen_bool(0.3) {
                        mem.store_u64(off, n).unwrap();
                    } else {
                        mem.load_u64(off).unwrap();
                    }
                    n += 1;
                }
                n
            })
        })
        .collect();
    let start = Instant::now();
    let mut samples = 0;
    let mut max_pages = 0;
    let mut max_referenced = 0;
    while start.elapsed() < Duration::from_millis(400) {
        let (in_region, staged) = region.local_pages().unwrap().unwrap();
        let resident = region.stats().paging.unwrap().resident_chunks;
        assert!(
            in_region + staged <= bound_chunks * pages_per_chunk,
            "{in_region} pages in the region and {staged} staged: more than {bound_chunks} \
             chunks of {pages_per_chunk} pages"
        );
        assert!(
            resident <= bound_chunks,
            "{resident} chunks resident > {bound_chunks}"
        );
        // The working set as the pager sees it: mapped chunks touched since the clock
        // passed them, never more than the limit allows.
        let referenced = region.referenced_chunks().unwrap();
        assert!(
            referenced <= bound_chunks,
            "{referenced} chunks referenced > {bound_chunks}"
        );
        max_referenced = max_referenced.max(referenced);
        max_pages = max_pages.max(in_region + staged);
        samples += 1;
        std::thread::sleep(Duration::from_millis(1));
    }
    stop.store(true, Ordering::Relaxed);
    let accesses: u64 = workers.into_iter().map(|w| w.join().unwrap()).sum();
    let paging = region.stats().paging.unwrap();
    assert!(samples > 50, "only {samples} samples");
    assert!(accesses > 0);
    assert!(
        paging.evictions_reactive + paging.evictions_proactive > 0,
        "nothing was evicted: {paging:?}"
    );
    assert!(max_pages > 0);
    assert!(max_referenced > 0, "no chunk was ever referenced");
}

/// A fresh bounded region: the first touch of every chunk maps zero pages and reads nothing
/// from the store (counted by a `Counting` stage under it), even while chunks are evicted
/// (reactively); later writes are kept, in memory and in the store.
#[test]
fn never_written_chunks_are_not_read_from_the_store() {
    if !paging_available("never_written_chunks_are_not_read_from_the_store") {
        return;
    }
    let g = Geometry::new(CHUNKS * u64::from(CHUNK), u64::from(CHUNK)).unwrap();
    let counting = Arc::new(farmap_pipeline::Counting::new(
        farmap_store::MemoryStore::new(g),
    ));
    let mut opts = bounded(LocalLimit::Percent(25.0), None);
    let paging = opts.paging.as_mut().unwrap();
    paging.fresh = true;
    // Only this thread's faults evict (reactively): no chunk is evicted between its zero
    // fill and the access that faulted, so no chunk is ever read back in phase one.
    paging.proactive = false;
    let region = Region::open(counting.clone(), opts).unwrap();
    let mem = region.memory();
    // Every chunk once, with reads only: 64 chunks through a limit of 16 (evictions happen).
    for c in 0..CHUNKS as usize {
        assert_eq!(mem.load_u64(c * CHUNK as usize + 8).unwrap(), 0);
    }
    let paging = region.stats().paging.unwrap();
    assert_eq!(
        counting.counts().reads,
        0,
        "untouched chunks were read from the store: {paging:?}"
    );
    assert_eq!(paging.zero_fills, CHUNKS, "{paging:?}");
    assert!(paging.deactivations > 0, "nothing evicted: {paging:?}");
    // Now write every chunk, and read everything back.
    let mut model = vec![0u8; g.size() as usize];
    for c in 0..CHUNKS as usize {
        let off = c * CHUNK as usize + 8 * c;
        let v = 0x5eed_0000_0000_0000 | c as u64;
        mem.store_u64(off, v).unwrap();
        model[off..off + 8].copy_from_slice(&v.to_ne_bytes());
    }
    assert!(mem.to_vec() == model, "the region lost a write");
    region.sync().unwrap();
    assert!(
        snapshot(&*counting) == model,
        "the store lacks a write after a sync"
    );
    assert_eq!(region.stats().paging.unwrap().recovered, 0);
}

/// Dropping staged chunks raises no remove event on the region's userfaultfd (each would
/// make every copy into the region fail until its madvise returned): the staging area has
/// its own quiet fd. Sweeps read and write every page, twice, through a limit of a quarter
/// of the region; everything is still there afterwards.
#[test]
fn evictions_raise_no_remove_events() {
    if !paging_available("evictions_raise_no_remove_events") {
        return;
    }
    let g = Geometry::new(256 * u64::from(CHUNK), u64::from(CHUNK)).unwrap();
    let store = with_pattern(MemoryStore::new(g), 11);
    let mut opts = bounded(LocalLimit::Percent(25.0), None);
    if let Some(p) = &mut opts.paging {
        p.min_free = Some(16);
    }
    let region = Region::open(store, opts).unwrap();
    let mem = region.memory();
    let page = region.page_size() as u64;
    for sweep in 0..2u64 {
        for off in (0..region.len() as u64).step_by(page as usize) {
            let want = if sweep == 0 {
                u64::from_le_bytes(pattern_bytes(11, off, 8).try_into().unwrap())
            } else {
                off ^ 0x5a5a
            };
            assert_eq!(
                mem.load_u64(off as usize).unwrap(),
                want,
                "page at {off:#x}"
            );
            mem.store_u64(off as usize, off ^ 0x5a5a).unwrap();
        }
    }
    let stats = region.stats();
    let paging = stats.paging.unwrap();
    let evictions = paging.evictions_reactive + paging.evictions_proactive;
    assert!(evictions >= 256, "only {evictions} evictions: {paging:?}");
    assert_eq!(
        stats.remove_events, 0,
        "remove events on the region's fd for {evictions} evictions"
    );
}

/// Sequential prefetch: a thread reading the region in order, twice, through a limit of 30%,
/// faults at least half as often with `seq:32` as without prefetch (3-5 times less often
/// when measured here; how much less is for `farmap bench paging --prefetch` to say), and
/// reads the same bytes; the chunks it went through count as hits. A thread reading pages at
/// random starts (almost) no window.
#[test]
fn sequential_prefetch_cuts_faults() {
    if !paging_available("sequential_prefetch_cuts_faults") {
        return;
    }
    let g = Geometry::new(512 * u64::from(CHUNK), u64::from(CHUNK)).unwrap();
    let run = |prefetch: farmap_uffd::Prefetch, random: bool| {
        let store = with_pattern(MemoryStore::new(g), 5);
        let mut opts = bounded(LocalLimit::Percent(30.0), None);
        if let Some(p) = &mut opts.paging {
            p.prefetch = prefetch;
            p.min_free = Some(48);
        }
        let region = Region::open(store, opts).unwrap();
        let mem = region.memory();
        let page = region.page_size() as u64;
        let pages = region.len() as u64 / page;
        let mut rng = SmallRng::seed_from_u64(3);
        for sweep in 0..2 * pages {
            let p = if random {
                rng.gen_range(0..pages)
            } else {
                sweep % pages
            };
            let off = p * page;
            let want = u64::from_le_bytes(pattern_bytes(5, off, 8).try_into().unwrap());
            assert_eq!(
                mem.load_u64(off as usize).unwrap(),
                want,
                "page at {off:#x}"
            );
        }
        region.stats()
    };
    let off = run(farmap_uffd::Prefetch::Off, false);
    let seq = run(farmap_uffd::Prefetch::Sequential { max_chunks: 32 }, false);
    let (p_off, p_seq) = (off.paging.unwrap(), seq.paging.clone().unwrap());
    eprintln!(
        "faults: {} with prefetch, {} without; {p_seq:?}",
        seq.faults, off.faults
    );
    assert_eq!(p_off.prefetched, 0);
    assert!(
        seq.faults * 2 <= off.faults,
        "{} faults with prefetch, {} without ({p_seq:?})",
        seq.faults,
        off.faults
    );
    assert!(p_seq.prefetched > 0 && p_seq.prefetch_hits > 0, "{p_seq:?}");
    let random = run(farmap_uffd::Prefetch::Sequential { max_chunks: 16 }, true);
    let p_random = random.paging.unwrap();
    assert!(
        p_random.prefetched * 20 <= random.faults,
        "random reads prefetched {} chunks for {} faults",
        p_random.prefetched,
        random.faults
    );
}
