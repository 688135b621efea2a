//! Exact cases: usable sizes, realloc in place, zeros after purges, exhaustion, odd input.

mod common;

use std::ptr;

use common::{fill, holds, MmapBacking, TestHeap, MIB};
use farmap_heap::{
    class_size, AllocError, Heap, HeapError, MAX_SMALL, NCLASSES, PAGE_SIZE, PURGE_BYTES,
};

const KIB: usize = 1024;

/// Frees `p`, a live allocation of `heap`.
fn free(heap: &TestHeap, p: *mut u8) {
    // SAFETY: the callers pass live allocations of `heap` and do not use them afterwards.
    unsafe { heap.free(p) };
}

/// Reallocs `p`, a live allocation of `heap`.
fn realloc(heap: &TestHeap, p: *mut u8, size: usize) -> *mut u8 {
    // SAFETY: the callers pass live allocations of `heap` and use only the result afterwards.
    unsafe { heap.realloc(p, size) }
}

#[test]
fn usable_size_is_the_class_or_the_span() {
    let heap = TestHeap::new(64 * MIB, 1);
    let cases = [
        (0, 16),
        (1, 16),
        (16, 16),
        (17, 32),
        (128, 128),
        (129, 160),
        (1000, 1024),
        (1025, 1280),
        (MAX_SMALL, MAX_SMALL),
        (MAX_SMALL + 1, 64 * KIB),
        (64 * KIB, 64 * KIB),
        (64 * KIB + 1, 128 * KIB),
        (MIB + 1, MIB + 64 * KIB),
    ];
    for (size, usable) in cases {
        let p = heap.malloc(size);
        assert_eq!(heap.usable_size(p), usable, "malloc({size})");
        free(&heap, p);
    }
    for class in 0..NCLASSES {
        let smallest = if class == 0 {
            1
        } else {
            class_size(class - 1) + 1
        };
        for size in [smallest, class_size(class)] {
            let p = heap.malloc(size);
            assert_eq!(heap.usable_size(p), class_size(class), "malloc({size})");
            // The program may use all of it.
            // SAFETY: `p` has `class_size(class)` usable bytes.
            unsafe { fill(p, class_size(class), 0xEE) };
            free(&heap, p);
        }
    }
    let local = 0u8;
    assert_eq!(heap.usable_size(ptr::null()), 0);
    assert_eq!(heap.usable_size(&local), 0);
    assert_eq!(heap.stats().objects_in_use, 0);
}

#[test]
fn malloc_zero_is_unique_and_free_null_is_nothing() {
    let heap = TestHeap::new(16 * MIB, 1);
    let (a, b) = (heap.malloc(0), heap.malloc(0));
    assert!(!a.is_null() && !b.is_null() && a != b);
    let before = heap.stats();
    free(&heap, ptr::null_mut());
    let local = 0u8;
    free(&heap, ptr::addr_of!(local).cast_mut());
    assert_eq!(heap.stats(), before);
    assert!(heap.owns(a) && !heap.owns(&local) && !heap.owns(ptr::null()));
    free(&heap, a);
    free(&heap, b);
}

#[test]
fn double_frees_that_are_noticed_change_nothing() {
    let heap = TestHeap::new(16 * MIB, 1);
    let (small, other, large) = (heap.malloc(40), heap.malloc(40), heap.malloc(200 * KIB));
    free(&heap, small);
    free(&heap, large);
    let before = heap.stats();
    free(&heap, small);
    free(&heap, large);
    free(&heap, other.wrapping_add(16));
    assert_eq!(heap.stats(), before);
    assert_eq!(before.objects_in_use, 1);
    free(&heap, other);
}

#[test]
fn small_reallocs_stay_in_place_within_their_class() {
    let heap = TestHeap::new(16 * MIB, 1);
    let p = heap.malloc(20);
    // SAFETY: `p` has 32 usable bytes.
    unsafe { fill(p, 32, 7) };
    assert_eq!(realloc(&heap, p, 32), p);
    assert_eq!(realloc(&heap, p, 17), p);
    assert_eq!(realloc(&heap, p, 1), p);
    let q = realloc(&heap, p, 100);
    assert_ne!(q, p);
    // SAFETY: `q` has at least 100 bytes.
    assert!(unsafe { holds(q, 32, 7) });
    // A big shrink moves to a smaller class.
    let r = heap.malloc(1000);
    assert_eq!(realloc(&heap, r, 600), r);
    let s = realloc(&heap, r, 100);
    assert_ne!(s, r);
    assert_eq!(heap.usable_size(s), 112);
    assert!(realloc(&heap, q, 0).is_null());
    free(&heap, s);
    let t = realloc(&heap, ptr::null_mut(), 10);
    assert_eq!(heap.usable_size(t), 16);
    free(&heap, t);
    assert_eq!(heap.stats().objects_in_use, 0);
}

#[test]
fn large_reallocs_grow_and_shrink_in_place() {
    let heap = TestHeap::new(64 * MIB, 1);
    let a = heap.malloc(100 * KIB);
    // SAFETY: `a` has 128 KiB usable.
    unsafe { fill(a, 128 * KIB, 9) };
    assert_eq!(realloc(&heap, a, 120 * KIB), a);
    assert_eq!(
        realloc(&heap, a, MIB),
        a,
        "grows into the free span after it"
    );
    assert_eq!(heap.usable_size(a), MIB);
    assert_eq!(realloc(&heap, a, 200 * KIB), a, "shrinks");
    assert_eq!(heap.usable_size(a), 256 * KIB);
    let b = heap.malloc(500 * KIB);
    assert_eq!(b, a.wrapping_add(256 * KIB), "the freed tail is reused");
    let c = realloc(&heap, a, 400 * KIB);
    assert_ne!(c, a, "blocked by b");
    // SAFETY: `c` has at least 400 KiB.
    assert!(unsafe { holds(c, 128 * KIB, 9) });
    let d = realloc(&heap, c, 100);
    assert_eq!(heap.usable_size(d), 112);
    // SAFETY: `d` has at least 100 bytes.
    assert!(unsafe { holds(d, 100, 9) });
    free(&heap, b);
    free(&heap, d);
    assert_eq!(heap.stats().bytes_in_use, 0);
}

#[test]
fn calloc_reads_zeros_after_reuse_and_after_purges() {
    let heap = TestHeap::new(64 * MIB, 1);
    for size in [64, 40 * KIB, 200 * KIB, 2 * MIB] {
        let p = heap.malloc(size);
        // SAFETY: `p` has `size` bytes.
        unsafe { fill(p, size, 0xAB) };
        free(&heap, p);
        let reach = heap.stats().high_water_pages;
        let q = heap.calloc(size / 8, 8);
        assert_eq!(
            heap.stats().high_water_pages,
            reach,
            "{size}: freed memory again"
        );
        // SAFETY: `q` has `size` bytes.
        assert!(unsafe { holds(q, size, 0) }, "calloc({size}) is not zeros");
        free(&heap, q);
    }
    assert!(heap.stats().purged_bytes >= 2 * MIB as u64);
    assert!(
        heap.backing()
            .purges
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1
    );
}

#[test]
fn calloc_trusts_purges_and_skips_its_memset() {
    let backing = MmapBacking {
        lie: true,
        ..MmapBacking::default()
    };
    let heap = TestHeap::with_backing(64 * MIB, 1, backing);
    let p = heap.malloc(PURGE_BYTES);
    // SAFETY: `p` has `PURGE_BYTES` bytes.
    unsafe { fill(p, PURGE_BYTES, 0xCD) };
    free(&heap, p);
    assert_eq!(heap.stats().purged_bytes, PURGE_BYTES as u64);
    let q = heap.calloc(1, PURGE_BYTES);
    assert_eq!(q, p);
    // The backing said these pages were zeros and did nothing: calloc did not write them.
    // SAFETY: `q` has `PURGE_BYTES` bytes.
    assert!(unsafe { holds(q, PURGE_BYTES, 0xCD) });
    // Never-used memory is not written either, and reads as zeros.
    let r = heap.calloc(1000, 1000);
    // SAFETY: `r` has 10^6 bytes.
    assert!(unsafe { holds(r, 1_000_000, 0) });
}

/// Allocates objects of `size` bytes until there is no room.
fn fill_up(heap: &TestHeap, size: usize) -> Vec<*mut u8> {
    std::iter::repeat_with(|| heap.malloc(size))
        .take_while(|p| !p.is_null())
        .collect()
}

#[test]
fn exhaustion_returns_null_and_freeing_makes_room_again() {
    let heap = TestHeap::new(4 * MIB, 2);
    assert!(heap.malloc(4 * MIB + 1).is_null());
    assert!(heap.malloc(usize::MAX).is_null());
    assert!(heap.calloc(usize::MAX / 2, 3).is_null());
    assert!(heap.calloc(1 << 40, 1).is_null());
    let whole = heap.malloc(4 * MIB);
    assert!(!whole.is_null());
    assert!(heap.malloc(1).is_null());
    free(&heap, whole);
    let ptrs = fill_up(&heap, 1000);
    assert_eq!(
        ptrs.len(),
        4 * MIB / 1024,
        "1 KiB objects fill the region exactly"
    );
    assert!(heap.malloc(20).is_null() && heap.memalign(4096, 1).is_null());
    for p in ptrs {
        free(&heap, p);
    }
    let ptrs = fill_up(&heap, 1000);
    assert_eq!(ptrs.len(), 4 * MIB / 1024, "all of it again");
    for p in ptrs {
        free(&heap, p);
    }
    heap.trim();
    assert_eq!(heap.stats().pages_in_use, 0);
}

#[test]
fn memalign_aligns_up_to_the_region() {
    let heap = TestHeap::new(64 * MIB, 1);
    for shift in 0..=23 {
        let align = 1usize << shift;
        for size in [0, 1, 100, 5000, 70_000] {
            let p = heap.memalign(align, size);
            assert!(!p.is_null(), "memalign({align}, {size})");
            assert_eq!(p.addr() % align.max(16), 0, "memalign({align}, {size})");
            assert!(heap.usable_size(p) >= size);
            free(&heap, p);
        }
    }
    assert!(heap.memalign(3, 8).is_null());
    assert!(heap.memalign(1 << 40, 8).is_null());
    assert_eq!(heap.posix_memalign(4, 8), Err(AllocError::InvalidAlignment));
    assert_eq!(
        heap.posix_memalign(24, 8).map_err(AllocError::errno),
        Err(22)
    );
    let err = heap.posix_memalign(64, 1 << 40).unwrap_err();
    assert_eq!((err, err.errno()), (AllocError::OutOfMemory, 12));
    let p = heap.posix_memalign(64 * KIB, 10).expect("room").as_ptr();
    assert_eq!(p.addr() % (64 * KIB), 0);
    free(&heap, p);
    assert_eq!(heap.stats().objects_in_use, 0);
}

#[test]
fn trim_returns_the_slabs_kept_for_reuse() {
    let heap = TestHeap::new(16 * MIB, 1);
    let p = heap.malloc(16);
    free(&heap, p);
    let stats = heap.stats();
    assert_eq!((stats.objects_in_use, stats.slab_pages), (0, 1));
    assert_eq!(heap.malloc(16), p, "the kept slab serves the next one");
    free(&heap, p);
    heap.trim();
    let stats = heap.stats();
    assert_eq!((stats.pages_in_use, stats.slab_pages), (0, 0));
}

#[test]
fn bad_arguments_to_new_are_refused() {
    let region = common::map(4 * MIB);
    assert!(!region.is_null());
    let new = |len: usize, arenas: usize| {
        // SAFETY: the mapping is fresh, used by nothing else, and outlives the heap (dropped
        // at once); it is never unmapped in this test.
        let heap = unsafe { Heap::new(region, len, MmapBacking::default(), arenas) };
        heap.map(|_| ())
    };
    assert_eq!(new(4 * MIB, 0), Err(HeapError::Arenas(0)));
    assert_eq!(new(4 * MIB, 65), Err(HeapError::Arenas(65)));
    assert_eq!(new(PAGE_SIZE / 2, 1), Err(HeapError::RegionTooSmall));
    assert_eq!(new(4 * MIB, 64), Ok(()));
}
