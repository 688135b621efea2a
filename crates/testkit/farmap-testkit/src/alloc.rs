//! A global allocator that counts, for tests that measure what code allocates.
//!
//! A test binary installs it (`unsafe` stays in this module; the test needs none):
//!
//! ```text
//! #[global_allocator]
//! static GLOBAL: farmap_testkit::alloc::CountingAlloc = farmap_testkit::alloc::CountingAlloc;
//! ```
//!
//! Every call is passed on to [`System`]; on the way, the allocator keeps two figures for the
//! calling thread: the bytes allocated and not yet freed ([`live_bytes`]), and the largest
//! single allocation made while [`largest_allocation`] runs a closure. Only the thread's own
//! allocations count, so tests running side by side do not disturb each other.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// The counting allocator (see the [module docs](self)).
#[derive(Debug, Clone, Copy, Default)]
pub struct CountingAlloc;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static TRACK: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

/// Records `delta` more bytes live on this thread (negative: freed).
fn add(delta: isize) {
    // `try_with`: the thread-locals may be gone while a thread shuts down.
    let _ = LIVE.try_with(|l| l.set(l.get() + delta));
}

/// Records an allocation of `size` bytes for [`largest_allocation`], if it is running.
fn note(size: usize) {
    let _ = TRACK.try_with(|t| {
        if t.get() {
            let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
        }
    });
}

// SAFETY: every call forwards to `System` with the same arguments; the wrapper only records
// sizes in const-initialized thread-locals, which never allocate.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        add(layout.size() as isize);
        note(layout.size());
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, passed on unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        add(-(layout.size() as isize));
        // SAFETY: `ptr` was allocated by `System` with `layout` (every allocation goes there).
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        add(new_size as isize - layout.size() as isize);
        note(new_size);
        // SAFETY: as for `dealloc`; the caller upholds `realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// The bytes this thread allocated and has not freed (through [`CountingAlloc`], which must
/// be the global allocator); compare two readings.
pub fn live_bytes() -> isize {
    LIVE.with(|l| l.get())
}

/// Runs `f` and returns the largest single allocation (or reallocation's new size) it made on
/// this thread (through [`CountingAlloc`], which must be the global allocator).
pub fn largest_allocation(f: impl FnOnce()) -> usize {
    LARGEST.with(|l| l.set(0));
    TRACK.with(|t| t.set(true));
    f();
    TRACK.with(|t| t.set(false));
    LARGEST.with(|l| l.get())
}
