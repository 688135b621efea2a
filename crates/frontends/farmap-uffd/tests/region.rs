//! A region over real userfaultfd: reads fault data in, writes are tracked per page and
//! pushed, discarded chunks come back, the region can sit at a fixed address, and a forked
//! child does not inherit it.

mod common;

use std::sync::Arc;

use common::*;
use farmap_core::{ChunkIdx, Geometry, Store, StoreError};
use farmap_store::MemoryStore;
use farmap_testkit::contents::{snapshot, with_pattern};
use farmap_testkit::wait::eventually;
use farmap_testkit::{block_on, pattern_bytes, Hooked, Op, PatternStore};
use farmap_uffd::{Region, RegionOptions, SliceError, TrackingMode, WriteTracking};

const PAGE: usize = 4096;
/// How long a counter may lag the memory (counters are bumped just after the faulting thread
/// is woken).
const SETTLE: std::time::Duration = std::time::Duration::from_secs(1);

/// The write-tracking modes this kernel has, or none when userfaultfd is unavailable
/// (`test` is then reported skipped).
fn tracking_modes_if_uffd(test: &str) -> Vec<WriteTracking> {
    if !uffd_available(test) {
        return Vec::new();
    }
    tracking_modes()
}

/// A region of 1 MiB in 64 KiB chunks over a pattern store (seed 3).
fn pattern_region() -> Region {
    let g = Geometry::new(1 << 20, 64 << 10).unwrap();
    Region::open(
        Arc::new(PatternStore::new(g, 3)),
        direct(WriteTracking::Auto),
    )
    .unwrap()
}

#[test]
fn read_faults_return_store_data() {
    if !uffd_available("read_faults_return_store_data") {
        return;
    }
    let g = Geometry::new(8 << 20, 64 << 10).unwrap();
    let store: Arc<dyn Store> = Arc::new(PatternStore::new(g, 11));
    let region = Region::open(store, direct(WriteTracking::Auto)).unwrap();
    assert_eq!(region.len(), 8 << 20);
    let mem = region.memory();
    // A few scattered single bytes first: each faults its chunk in whole.
    for off in [5 * PAGE + 7, 0, (3 << 20) + 12345, (8 << 20) - 1] {
        assert_eq!(
            mem.load_u8(off).unwrap(),
            pattern_bytes(11, off as u64, 1)[0],
            "byte {off}"
        );
    }
    eventually("three chunks fetched", SETTLE, || {
        region.stats().chunks_fetched == 3
    });
    let s = region.stats();
    assert_eq!(s.faults, 3, "{s:?}");
    assert_eq!(s.bytes_fetched, 3 * (64 << 10));
    // Then everything.
    assert!(
        mem.to_vec() == pattern_bytes(11, 0, 8 << 20),
        "the region equals the store"
    );
    eventually("every chunk fetched", SETTLE, || {
        region.stats().chunks_fetched == 128
    });
    assert_eq!(region.stats().present_chunks, 128);
    assert!(
        region.take_dirty().unwrap().is_empty(),
        "reading writes nothing"
    );
}

/// A store that opens a socket to `to` in the runtime that polls its read, as the S3
/// store's HTTP pool does on its first request.
fn connects_on_read(inner: PatternStore, to: std::net::SocketAddr) -> Hooked<PatternStore> {
    Hooked::new(inner, move |op, _| {
        Box::pin(async move {
            if op == Op::Read {
                tokio::net::TcpStream::connect(to)
                    .await
                    .map_err(|e| StoreError::io("connecting", e))?;
            }
            Ok(())
        })
    })
}

#[test]
fn a_store_that_opens_sockets_as_it_reads_is_served() {
    // The region's runtime once had timers only: such a store's read panicked on a worker
    // thread of the region, and the faulting thread waited for ever.
    if !uffd_available("a_store_that_opens_sockets_as_it_reads_is_served") {
        return;
    }
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let g = Geometry::new(1 << 20, 64 << 10).unwrap();
    let store: Arc<dyn Store> = Arc::new(connects_on_read(
        PatternStore::new(g, 3),
        listener.local_addr().unwrap(),
    ));
    let region = Arc::new(Region::open(store, direct(WriteTracking::Auto)).unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = {
        let region = region.clone();
        std::thread::spawn(move || {
            let _ = tx.send(region.memory().load_u8(5 * PAGE + 7));
        })
    };
    let got = rx
        .recv_timeout(std::time::Duration::from_secs(30))
        .expect("the fault is served");
    assert_eq!(got.unwrap(), pattern_bytes(3, 5 * PAGE as u64 + 7, 1)[0]);
    reader.join().unwrap();
    let region = Arc::try_unwrap(region).expect("the reader is gone");
    region.close().unwrap();
}

#[test]
fn writes_are_tracked_per_page_in_both_modes() {
    for tracking in tracking_modes_if_uffd("writes_are_tracked_per_page_in_both_modes") {
        let g = Geometry::new(4 << 20, 64 << 10).unwrap();
        let store = Arc::new(MemoryStore::new(g));
        let region = Region::open(store.clone(), direct(tracking)).unwrap();
        let want_mode = match tracking {
            WriteTracking::SyncFaults => TrackingMode::SyncFaults,
            _ => TrackingMode::Async,
        };
        assert_eq!(region.tracking_mode(), want_mode);
        // The first scan may report nothing: nothing was touched.
        assert!(region.take_dirty().unwrap().is_empty(), "{tracking:?}");
        let mem = region.memory();
        let _ = mem.load_u8(40 * PAGE).unwrap(); // a read fault: installed clean
        mem.store_u8(3 * PAGE + 1, 1).unwrap(); // a write fault on a missing page (chunk 0)
        mem.store_u8(17 * PAGE, 2).unwrap(); // chunk 1
        mem.store_u8(18 * PAGE + 4095, 3).unwrap(); // its neighbour page
        mem.store_u8(100 * PAGE + 9, 4).unwrap(); // chunk 6
        mem.store_u8(41 * PAGE, 5).unwrap(); // chunk 2, a page whose chunk a read installed
        let d = region.take_dirty().unwrap();
        assert_eq!(
            d.pages,
            vec![3..4, 17..19, 41..42, 100..101],
            "{tracking:?}: written pages"
        );
        assert_eq!(d.page_count(), 5);
        assert_eq!(
            d.chunks,
            [0, 1, 2, 6].map(ChunkIdx).to_vec(),
            "{tracking:?}: chunks"
        );
        assert!(
            region.take_dirty().unwrap().is_empty(),
            "{tracking:?}: re-protected"
        );
        // A second write to a page already reported is reported again.
        region.memory().store_u8(17 * PAGE + 1, 9).unwrap();
        let d = region.take_dirty().unwrap();
        assert_eq!(d.pages, vec![17..18], "{tracking:?}");
        // The chunks taken are the caller's: sync pushes only what is dirty now.
        region.memory().store_u8(200 * PAGE, 7).unwrap();
        region.sync().unwrap();
        let s = region.stats();
        assert_eq!(s.pushed_chunks, 1, "{tracking:?}: {s:?}");
        let pushed = block_on(store.read(ChunkIdx(12))).unwrap();
        assert_eq!(pushed[(200 * PAGE) % (64 << 10)], 7);
        if want_mode == TrackingMode::SyncFaults {
            assert!(s.wp_faults >= 6, "{s:?}");
        } else {
            assert_eq!(s.wp_faults, 0, "{s:?}");
        }
        region.close().unwrap();
    }
}

/// A scan of part of the region reports the writes there only and leaves the others for a
/// later scan; the runs in memory of a sparse range are the chunks touched, merged.
#[test]
fn a_scan_within_chunks_sees_writes_there_only_and_runs_in_memory_are_exact() {
    for tracking in tracking_modes_if_uffd("a_scan_within_chunks_sees_writes_there_only") {
        if tracking == WriteTracking::SyncFaults {
            continue; // synchronous tracking takes every recorded page (documented)
        }
        let g = Geometry::new(4 << 20, 64 << 10).unwrap();
        let region = Region::open(Arc::new(MemoryStore::new(g)), direct(tracking)).unwrap();
        assert!(region.take_dirty().unwrap().is_empty());
        let mem = region.memory();
        for p in [1, 2, 3, 20, 33, 700, 1000] {
            mem.store_u8(p * PAGE, 1).unwrap();
        }
        let _ = mem.load_u8(34 * PAGE).unwrap(); // read: present, not written
                                                 // Chunks 1..3 are pages 16..48.
        let chunks_1_2 = std::slice::from_ref(&(1..3));
        let d = region.take_dirty_within(chunks_1_2).unwrap();
        assert_eq!(d.pages, vec![20..21, 33..34], "{tracking:?}");
        assert_eq!(d.chunks, [1, 2].map(ChunkIdx).to_vec());
        assert!(region.take_dirty_within(chunks_1_2).unwrap().is_empty());
        // Two runs at once; the writes outside are still there for a whole scan.
        let d = region.take_dirty_within(&[0..1, 62..63]).unwrap();
        assert_eq!(d.pages, vec![1..4, 1000..1001], "{tracking:?}");
        let d = region.take_dirty().unwrap();
        assert_eq!(d.pages, vec![700..701], "{tracking:?}");
        // A fault installs its whole chunk (16 pages): chunks 0, 1, 2, 43 and 62, where
        // chunks 1 and 2 merge; the range cuts the runs it crosses. Write-protect markers
        // on the pages never touched (asynchronous tracking) are not in memory.
        assert_eq!(
            region.pages_in_memory(0..1024).unwrap(),
            vec![0..48, 688..704, 992..1008]
        );
        assert_eq!(region.pages_in_memory(2..20).unwrap(), vec![2..20]);
        assert_eq!(
            region.pages_in_memory(40..690).unwrap(),
            vec![40..48, 688..690]
        );
        assert_eq!(
            region.pages_in_memory(1001..5000).unwrap(),
            vec![1001..1008]
        );
        assert_eq!(
            region.pages_in_memory(1008..5000).unwrap(),
            Vec::<std::ops::Range<u64>>::new()
        );
        assert_eq!(
            region.pages_in_memory(5..5).unwrap(),
            Vec::<std::ops::Range<u64>>::new()
        );
        region.close().unwrap();
    }
}

/// `take_written` (a migration's view) and the pusher each see every write: a push round
/// does not hide a page from the next `take_written`, and `take_written` leaves the chunks
/// it reports to the pusher (the store still gets them).
#[test]
fn take_written_and_the_pusher_both_see_every_write() {
    for tracking in tracking_modes_if_uffd("take_written_and_the_pusher_both_see_every_write") {
        let g = Geometry::new(4 << 20, 64 << 10).unwrap();
        let store = Arc::new(MemoryStore::new(g));
        let region = Region::open(store.clone(), direct(tracking)).unwrap();
        let mem = region.memory();
        mem.store_u8(PAGE, 1).unwrap();
        // The first call starts the record with what its scan finds.
        assert_eq!(
            region.take_written().unwrap().pages,
            vec![1..2],
            "{tracking:?}"
        );
        mem.store_u8(3 * PAGE, 2).unwrap();
        region.sync().unwrap(); // a push scans (and pushes) page 3
        mem.store_u8(40 * PAGE, 3).unwrap();
        let d = region.take_written().unwrap();
        assert_eq!(
            d.pages,
            vec![3..4, 40..41],
            "{tracking:?}: the push hid nothing"
        );
        assert_eq!(d.chunks, [0, 2].map(ChunkIdx).to_vec(), "{tracking:?}");
        // Page 40 was scanned by take_written only: the next sync still pushes its chunk.
        region.sync().unwrap();
        let pushed = block_on(store.read(ChunkIdx(2))).unwrap();
        assert_eq!(pushed[(40 * PAGE) % (64 << 10)], 3, "{tracking:?}");
        assert_eq!(block_on(store.read(ChunkIdx(0))).unwrap()[3 * PAGE], 2);
        // take_dirty takes from the pusher, not from take_written.
        mem.store_u8(70 * PAGE, 4).unwrap();
        assert_eq!(region.take_dirty().unwrap().pages, vec![70..71]);
        assert_eq!(
            region.take_written().unwrap().pages,
            vec![70..71],
            "{tracking:?}"
        );
        assert!(region.take_written().unwrap().is_empty(), "{tracking:?}");
        region.close().unwrap();
    }
}

#[test]
fn sync_pushes_every_written_chunk_and_close_syncs() {
    for tracking in tracking_modes_if_uffd("sync_pushes_every_written_chunk_and_close_syncs") {
        let g = Geometry::new(2 << 20, 16 << 10).unwrap();
        let store = with_pattern(MemoryStore::new(g), 5);
        let region = Region::open(store.clone(), direct(tracking)).unwrap();
        let mem = region.memory();
        for (i, off) in [0usize, 70_000, 1 << 20, (2 << 20) - 1]
            .into_iter()
            .enumerate()
        {
            mem.store_u8(off, 0xA0 + i as u8).unwrap();
        }
        let expect = region.memory().to_vec();
        region.sync().unwrap();
        assert_eq!(region.stats().pushed_chunks, 4, "{tracking:?}");
        assert!(
            snapshot(&*store) == expect,
            "{tracking:?}: the store has the writes"
        );
        region.memory().store_u8(9, 0x99).unwrap();
        block_on(region.sync_async()).unwrap();
        assert_eq!(
            block_on(store.read(ChunkIdx(0))).unwrap()[9],
            0x99,
            "{tracking:?}"
        );
        region.memory().store_u8(5, 0x55).unwrap();
        let expect = region.memory().to_vec();
        region.close().unwrap();
        assert!(snapshot(&*store) == expect, "{tracking:?}: close syncs");
    }
}

#[test]
fn discarded_chunks_are_fetched_again() {
    for tracking in tracking_modes_if_uffd("discarded_chunks_are_fetched_again") {
        let chunk = 64 << 10;
        let g = Geometry::new(1 << 20, chunk as u64).unwrap();
        let store = with_pattern(MemoryStore::new(g), 21);
        let region = Region::open(store.clone(), direct(tracking)).unwrap();
        let expected = pattern_bytes(21, 0, 1 << 20);
        let mem = region.memory();
        assert!(mem.subslice(0, 4 * chunk).unwrap().to_vec()[..] == expected[..4 * chunk]);
        mem.store_u8(2 * chunk, !expected[2 * chunk]).unwrap(); // page 0 of chunk 2: written
        mem.store_u8(chunk + 3, !expected[chunk + 3]).unwrap(); // chunk 1: written, then discarded whole
                                                                // Discard chunk 1 whole and the second half of chunk 2.
        let page = region.page_size() as u64;
        let (c, p) = (chunk as u64, page);
        // The copies woke their readers before the cache counted them.
        eventually("four chunks present", SETTLE, || {
            region.stats().present_chunks == 4
        });
        let present = region.stats().present_chunks;
        region
            .discard_pages(&[c / p..2 * c / p, (2 * c + c / 2) / p..3 * c / p])
            .unwrap();
        // Absent as soon as the call returns, whenever the reader gets to the remove events
        // (a fetch started right after must not find them present: a migration's post-copy
        // did, and finished with pages missing).
        assert_eq!(
            region.stats().present_chunks,
            present - 2,
            "{tracking:?}: discarded chunks are absent when discard_pages returns"
        );
        eventually("two remove events", SETTLE, || {
            region.stats().remove_events == 2
        });
        assert_eq!(region.stats().removed_chunks, 2, "{tracking:?}");
        let s = region.stats();
        assert_eq!(s.remove_events, 2, "{tracking:?}: {s:?}");
        let fetched = s.chunks_fetched;
        let mem = region.memory();
        assert!(
            mem.subslice(chunk, chunk).unwrap().to_vec()[..] == expected[chunk..2 * chunk],
            "{tracking:?}: a discarded chunk reads the store again"
        );
        assert_eq!(
            mem.load_u8(2 * chunk).unwrap(),
            !expected[2 * chunk],
            "kept page keeps its write"
        );
        assert!(
            mem.subslice(2 * chunk + 1, chunk - 1).unwrap().to_vec()[..]
                == expected[2 * chunk + 1..3 * chunk],
            "{tracking:?}: the discarded half is fetched again, the rest kept"
        );
        eventually("two chunks fetched again", SETTLE, || {
            region.stats().chunks_fetched == fetched + 2
        });
        let d = region.take_dirty().unwrap();
        assert!(
            d.chunks.contains(&ChunkIdx(2)),
            "{tracking:?}: the kept written page is still dirty: {d:?}"
        );
        assert!(!d.chunks.contains(&ChunkIdx(1)), "{tracking:?}: {d:?}");
    }
}

#[test]
fn a_region_can_live_at_a_fixed_address() {
    if !uffd_available("a_region_can_live_at_a_fixed_address") {
        return;
    }
    let g = Geometry::new(1 << 20, 64 << 10).unwrap();
    // An address far from where the kernel places mappings (top-down from below the stack;
    // the program and its heap sit near 0x55..): a free one found by mapping and unmapping
    // could be taken by another test's thread before the region claims it.
    let addr = 0x2000_0000_0000 + (std::process::id() as usize % 4096) * (1 << 30);
    let store: Arc<dyn Store> = Arc::new(PatternStore::new(g, 3));
    let opts = RegionOptions {
        address: Some(addr),
        ..direct(WriteTracking::Auto)
    };
    let region = Region::open(store.clone(), opts.clone()).unwrap();
    assert_eq!(region.as_ptr() as usize, addr);
    assert_eq!(
        region.memory().load_u8(77).unwrap(),
        pattern_bytes(3, 77, 1)[0]
    );
    let err = Region::open(store, opts).unwrap_err();
    assert!(err.to_string().contains("mapping"), "{err}");
}

#[test]
fn a_forked_child_does_not_inherit_the_region() {
    if !uffd_available("a_forked_child_does_not_inherit_the_region") {
        return;
    }
    let region = pattern_region();
    assert_eq!(
        region.memory().load_u8(0).unwrap(),
        pattern_bytes(3, 0, 1)[0]
    );
    let base = region.as_ptr();
    // SAFETY: the child only reads one byte of memory and exits: no allocation, no lock.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: in the child; the read faults (SIGSEGV) because the mapping is not inherited.
        unsafe {
            std::ptr::read_volatile(base);
            libc::_exit(0);
        }
    }
    assert!(pid > 0);
    let mut status = 0;
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    assert!(
        libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSEGV,
        "the child dies of SIGSEGV (status {status:#x})"
    );
    // The parent's region still works.
    assert_eq!(
        region.memory().load_u8((1 << 20) - 1).unwrap(),
        pattern_bytes(3, (1 << 20) - 1, 1)[0]
    );
}

#[test]
fn unaligned_sizes_are_refused() {
    if !uffd_available("unaligned_sizes_are_refused") {
        return;
    }
    let g = Geometry::new(10_000, 4096).unwrap();
    let err = Region::open(Arc::new(PatternStore::new(g, 1)), RegionOptions::direct()).unwrap_err();
    assert!(err.to_string().contains("page size"), "{err}");
}

#[test]
fn written_chunks_are_pushed_on_the_interval() {
    if !uffd_available("written_chunks_are_pushed_on_the_interval") {
        return;
    }
    let g = Geometry::new(1 << 20, 64 << 10).unwrap();
    let store = Arc::new(MemoryStore::new(g));
    let opts = RegionOptions {
        push: farmap_pipeline::PushOptions {
            interval: Some(std::time::Duration::from_millis(5)),
            ..Default::default()
        },
        ..RegionOptions::direct()
    };
    let region = Region::open(store.clone(), opts).unwrap();
    region.memory().store_u8(3 * (64 << 10) + 1, 42).unwrap();
    eventually("the background push", SETTLE, || {
        block_on(store.read(ChunkIdx(3))).unwrap()[1] == 42
    });
    assert!(region.stats().pushed_chunks >= 1);
}

#[test]
fn a_failed_push_fails_sync_and_stays_dirty() {
    if !uffd_available("a_failed_push_fails_sync_and_stays_dirty") {
        return;
    }
    use farmap_core::ErrorKind;
    use farmap_pipeline::{FaultPlan, FaultTrigger, Faulty, OpSet, RetryPolicy};
    let g = Geometry::new(1 << 20, 64 << 10).unwrap();
    let faulty = Arc::new(Faulty::new(MemoryStore::new(g), FaultPlan::never()));
    let mut opts = direct(WriteTracking::Auto);
    opts.push.retry = RetryPolicy::immediate(2);
    let region = Region::open(faulty.clone(), opts).unwrap();
    region.memory().store_u8(70_000, 7).unwrap();
    faulty.set_plan(FaultPlan {
        ops: OpSet::WRITE,
        trigger: FaultTrigger::Always,
        kind: ErrorKind::Io,
    });
    let err = region.sync().unwrap_err();
    assert!(matches!(err, farmap_uffd::RegionError::Push(_)), "{err}");
    let s = region.stats();
    assert_eq!(s.failed_pushes, 1, "{s:?}");
    assert!(s.last_error.is_some());
    faulty.set_plan(FaultPlan::never());
    region.sync().unwrap();
    assert_eq!(
        block_on(faulty.read(ChunkIdx(1))).unwrap()[70_000 - 65_536],
        7
    );
}

#[test]
fn out_of_range_accesses_through_the_region_are_errors() {
    if !uffd_available("out_of_range_accesses_through_the_region_are_errors") {
        return;
    }
    let region = pattern_region();
    let len = region.len();
    let mut buf = [0u8; 16];
    for offset in [len - 15, len, usize::MAX - 4] {
        let err = region.read_at(offset, &mut buf).unwrap_err();
        assert!(
            matches!(
                err,
                farmap_uffd::RegionError::Slice(SliceError::OutOfRange { .. })
            ),
            "{err}"
        );
        assert!(region.write_at(offset, &buf).is_err());
    }
    let mem = region.memory();
    assert!(mem.load_u8(len).is_err());
    assert!(mem.store_u64(len - 4, 1).is_err());
    assert!(mem.subslice(len - 8, 9).is_err());
    let pages = (len / region.page_size()) as u64;
    assert!(region.discard_pages(&[0..1, pages - 1..pages + 1]).is_err());
    assert_eq!(
        region.stats().remove_events,
        0,
        "a refused discard discards nothing"
    );
    // Nothing was fetched for the refused accesses, nor written.
    assert_eq!(region.stats().chunks_fetched, 0);
    assert!(region.take_dirty().unwrap().is_empty());
    // The last byte is fine.
    region.read_at(len - 16, &mut buf).unwrap();
    assert_eq!(buf.to_vec(), pattern_bytes(3, (len - 16) as u64, 16));
}

#[test]
fn holds_says_which_ranges_read_without_a_fetch() {
    if !uffd_available("holds_says_which_ranges_read_without_a_fetch") {
        return;
    }
    let chunk = 64 << 10;
    let g = Geometry::new(1 << 20, chunk as u64).unwrap();
    let region = Region::open(
        Arc::new(PatternStore::new(g, 5)),
        RegionOptions {
            readahead_chunks: 0,
            ..direct(WriteTracking::Auto)
        },
    )
    .unwrap();
    let last = region.len() - chunk;
    assert!(!region.holds(0, 1), "nothing is fetched yet");
    assert!(region.holds(0, 0));
    let mut buf = [0u8; 8];
    region.read_at(last + 100, &mut buf).unwrap();
    // The faulting read is woken by the copy itself; the chunk counts as present once its
    // fetch has finished its bookkeeping, an instant later.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !region.holds(last, chunk) {
        assert!(
            std::time::Instant::now() < deadline,
            "the touched chunk never counts as present"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert!(region.holds(last + 10, 100));
    assert!(
        !region.holds(last - 1, 2),
        "the chunk before is not present"
    );
    assert!(!region.holds(0, region.len()));
    assert!(!region.holds(region.len(), 1), "outside the region");
    assert!(!region.holds(usize::MAX, 2));
}

#[test]
#[allow(clippy::single_range_in_vec_init)] // chunk runs: one run is a real case
fn a_seal_in_two_steps_looks_at_the_hot_chunks_first_and_misses_no_write() {
    for tracking in tracking_modes_if_uffd(
        "a_seal_in_two_steps_looks_at_the_hot_chunks_first_and_misses_no_write",
    ) {
        let g = Geometry::new(4 << 20, 64 << 10).unwrap();
        let store = with_pattern(MemoryStore::new(g), 9);
        let region = Region::open(store.clone(), direct(tracking)).unwrap();
        let at = |c: u64| (c * (64 << 10)) as usize + 100;
        region.memory().store_u8(at(40), 1).unwrap();
        region.sync().unwrap();
        // Chunk 40 was pushed before the window, chunk 2 within it; chunk 3 is dirty.
        std::thread::sleep(std::time::Duration::from_millis(300));
        region.memory().store_u8(at(2), 1).unwrap();
        region.sync().unwrap();
        region.memory().store_u8(at(3), 1).unwrap();
        let draft = region
            .draft_pushes(std::time::Duration::from_millis(200))
            .unwrap();
        assert_eq!(draft.ledger.dirty, [ChunkIdx(3)], "{tracking:?}");
        assert!(draft.ledger.pushed[40].is_some() && draft.ledger.pushed[2].is_some());
        assert_eq!(draft.hot, [2..3], "{tracking:?}: pushed lately, not dirty");
        // Written after the draft: a hot chunk, a cold one, one never pushed.
        for c in [2, 40, 50] {
            region.memory().store_u8(at(c), 2).unwrap();
        }
        let hot = region.seal_hot_pushes().unwrap();
        assert_eq!(hot.pending, [0..2, 3..64], "{tracking:?}");
        let rest = region.seal_rest_pushes();
        assert!(rest.pending.is_empty());
        let mut found: Vec<u64> = hot
            .at_source
            .iter()
            .chain(&rest.at_source)
            .flat_map(|r| r.clone())
            .collect();
        found.sort_unstable();
        assert_eq!(
            found,
            [2, 40, 50],
            "{tracking:?}: every write since the draft"
        );
        if tracking == WriteTracking::Async {
            assert_eq!(
                hot.at_source,
                [2..3],
                "inside the downtime, only the hot chunks are looked at"
            );
        }
        assert!(region.sync().is_err(), "{tracking:?}: sealed");
        region.unseal_pushes();
        region.sync().unwrap();
        assert_eq!(
            block_on(store.read(ChunkIdx(50))).unwrap()[100],
            2,
            "{tracking:?}: unsealed, the pushes resume"
        );
    }
}
