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
//!
//! For code that allocates on other threads (a server on a runtime's workers), it also keeps
//! the bytes live in the whole process and their peak ([`process_live_bytes`],
//! [`reset_process_peak`], [`process_peak_bytes`]); tests that read those must not run side
//! by side with other tests that allocate much.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicIsize, Ordering};

/// The counting allocator (see the [module docs](self)).
#[derive(Debug, Clone, Copy, Default)]
pub struct CountingAlloc;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static TRACK: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

/// Bytes live in the whole process, and the most there were since the last reset.
static PROCESS_LIVE: AtomicIsize = AtomicIsize::new(0);
static PROCESS_PEAK: AtomicIsize = AtomicIsize::new(0);

/// Records `delta` more bytes live on this thread and in the process (negative: freed).
fn add(delta: isize) {
    // `try_with`: the thread-locals may be gone while a thread shuts down.
    let _ = LIVE.try_with(|l| l.set(l.get() + delta));
    let now = PROCESS_LIVE.fetch_add(delta, Ordering::Relaxed) + delta;
    if delta > 0 {
        PROCESS_PEAK.fetch_max(now, Ordering::Relaxed);
    }
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

/// The bytes allocated and not freed by every thread of the process (through
/// [`CountingAlloc`], which must be the global allocator).
pub fn process_live_bytes() -> usize {
    PROCESS_LIVE.load(Ordering::Relaxed).max(0) as usize
}

/// Starts measuring a new peak: sets it to the bytes live now, which it returns.
pub fn reset_process_peak() -> usize {
    let now = PROCESS_LIVE.load(Ordering::Relaxed);
    PROCESS_PEAK.store(now, Ordering::Relaxed);
    now.max(0) as usize
}

/// The most bytes live in the process at once since [`reset_process_peak`] (through
/// [`CountingAlloc`], which must be the global allocator).
pub fn process_peak_bytes() -> usize {
    PROCESS_PEAK.load(Ordering::Relaxed).max(0) as usize
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
