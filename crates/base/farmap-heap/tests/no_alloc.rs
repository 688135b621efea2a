//! The heap's operations allocate nothing from the global allocator: this test binary's
//! global allocator counts the allocations made on the test's thread.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::hint::black_box;

use common::{TestHeap, MIB};

struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
}

fn count() -> usize {
    ALLOCATIONS.with(Cell::get)
}

fn counted() {
    // A const-initialized thread local without a destructor: touching it never allocates.
    let _ = ALLOCATIONS.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: every call is passed on to `System` unchanged; counting touches no allocation.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        counted();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        counted();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        counted();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Every operation, small and large, with purges, on a heap made before counting starts.
fn exercise(heap: &TestHeap) {
    let mut ptrs = [std::ptr::null_mut::<u8>(); 64];
    for (i, slot) in ptrs.iter_mut().enumerate() {
        let size = [0, 24, 700, 5000, 40_000, 300_000, 3 * MIB][i % 7];
        *slot = match i % 4 {
            0 => heap.malloc(size),
            1 => heap.calloc(1, size),
            2 => heap.memalign(4096, size),
            _ => heap
                .posix_memalign(64, size)
                .map_or(std::ptr::null_mut(), |p| p.as_ptr()),
        };
        assert!(!slot.is_null());
        black_box(heap.usable_size(*slot));
        black_box(heap.owns(*slot));
    }
    for p in &mut ptrs[..32] {
        // SAFETY: a live allocation of `heap`, replaced by the result.
        *p = unsafe { heap.realloc(*p, 2 * heap.usable_size(*p) + 1) };
        assert!(!p.is_null());
    }
    black_box(heap.stats());
    heap.lock_all();
    // SAFETY: this thread called lock_all just before.
    unsafe { heap.unlock_all() };
    for p in ptrs {
        // SAFETY: live allocations of `heap`, not used again.
        unsafe { heap.free(p) };
    }
    heap.trim();
}

#[test]
fn heap_operations_allocate_nothing() {
    let heap = TestHeap::new(256 * MIB, 4);
    let before = count();
    exercise(&heap);
    let after = count();
    assert!(heap.stats().purged_bytes > 0, "the purge path ran");
    assert_eq!(
        after, before,
        "the heap allocated from the global allocator"
    );
    // The counter does count: a Box is one allocation.
    black_box(Box::new(1u64));
    assert_eq!(count(), after + 1);
}
