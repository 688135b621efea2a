//! The Rust global allocator of the library: a bump arena of its own, so that whatever Rust
//! code inside the library allocates (a panic's message) never enters the program's heaps,
//! whose locks the allocating code may hold. Nothing is freed; past the arena's 256 KiB,
//! each allocation is a mapping of its own (rare: the library's code does not allocate).

use core::alloc::{GlobalAlloc, Layout};
use core::cell::UnsafeCell;
use core::ptr;
use core::sync::atomic::{AtomicUsize, Ordering};

use crate::sys;

const LEN: usize = 256 << 10;

#[repr(C, align(4096))]
struct Arena(UnsafeCell<[u8; LEN]>);

// SAFETY: disjoint parts of the arena are handed out (an atomic cursor), each to one owner.
unsafe impl Sync for Arena {}

static ARENA: Arena = Arena(UnsafeCell::new([0; LEN]));
static NEXT: AtomicUsize = AtomicUsize::new(0);

/// See the module docs.
#[derive(Debug)]
pub(crate) struct Bump;

// SAFETY: every allocation is a part of the arena no other allocation got (the cursor only
// grows) or a fresh mapping, aligned as asked (offsets are aligned within a 4 KiB aligned
// arena; mappings are page-aligned and refused for larger alignments).
unsafe impl GlobalAlloc for Bump {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let mut at = NEXT.load(Ordering::Relaxed);
        while let Some(start) = at.checked_next_multiple_of(layout.align()) {
            let end = start.saturating_add(layout.size());
            if end > LEN || layout.align() > 4096 {
                break;
            }
            match NEXT.compare_exchange_weak(at, end, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return ARENA.0.get().cast::<u8>().wrapping_add(start),
                Err(now) => at = now,
            }
        }
        if layout.align() > 4096 {
            return ptr::null_mut();
        }
        sys::map_anon(layout.size().max(1))
    }

    unsafe fn dealloc(&self, _ptr: *mut u8, _layout: Layout) {}
}
