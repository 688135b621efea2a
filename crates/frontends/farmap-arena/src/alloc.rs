//! [`ArenaAlloc`]: the allocator that collections in arena objects take. Allocation goes to
//! the object on top of this thread's *context stack* (pushed by [`Obj::write`] and while an
//! object is built), so everything an object allocates lies in its slot; freeing goes by
//! address (the slot of the address), so it needs no context.
//!
//! [`Obj::write`]: crate::Obj::write

use std::cell::Cell;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, Ordering};

use allocator_api2::alloc::{AllocError, Allocator, Layout};
use farmap_heap::{Backing, Heap};

use crate::config::ArenaConfig;
use crate::slots::{SlotState, SlotTable};

/// What the allocator needs of the arena that serves this process's objects: leaked, so
/// that a `&'static` reaches it from anywhere (one per arena opened; a few hundred bytes).
#[derive(Debug)]
pub(crate) struct Shared {
    pub cfg: ArenaConfig,
    pub slots: SlotTable,
    /// Frees of arena pointers whose slot is not this process's to free in (leaked).
    pub dealloc_foreign: AtomicU64,
    /// Purges refused because the slot was not `Local` (the span stays dirty).
    pub purges_refused: AtomicU64,
}

/// The arena whose objects `ArenaAlloc` serves in this process (null: none yet).
static CURRENT: AtomicPtr<Shared> = AtomicPtr::new(std::ptr::null_mut());

pub(crate) fn current() -> Option<&'static Shared> {
    // SAFETY: only leaked `Shared`s (never freed) are stored in CURRENT.
    unsafe { CURRENT.load(Ordering::Acquire).as_ref() }
}

/// Makes `shared` the arena of this process's objects; false if another arena is.
pub(crate) fn make_current(shared: &'static Shared) -> bool {
    let p = shared as *const Shared as *mut Shared;
    match CURRENT.compare_exchange(std::ptr::null_mut(), p, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => true,
        Err(cur) => cur == p,
    }
}

/// Forgets `shared` as the current arena (it is being dropped).
pub(crate) fn retire(shared: &'static Shared) {
    let p = shared as *const Shared as *mut Shared;
    let _ = CURRENT.compare_exchange(p, std::ptr::null_mut(), Ordering::AcqRel, Ordering::Acquire);
}

/// Bytes at the start of a slot for the object's header (one heap page).
pub(crate) const HEADER_BYTES: usize = 64 << 10;
/// Heap arenas per object (the heap's lock stripes).
pub(crate) const HEAP_ARENAS: usize = 2;
/// `ObjHeader::magic`.
pub(crate) const MAGIC: u64 = u64::from_be_bytes(*b"farmapob");

/// The start of an object's slot: what another process needs to use the object.
#[repr(C)]
pub(crate) struct ObjHeader {
    pub magic: u64,
    pub tag: u64,
    pub build_id: [u8; 32],
    /// The object's `T`, in its heap.
    pub root: usize,
    pub heap: Heap<SlotBacking>,
}

impl Shared {
    pub fn slot_of(&self, addr: usize) -> Option<u32> {
        let off = addr.checked_sub(self.cfg.base)?;
        (off < self.cfg.size).then_some((off >> self.cfg.slot_shift) as u32)
    }

    pub fn slot_base(&self, slot: u32) -> usize {
        self.cfg.base + ((slot as usize) << self.cfg.slot_shift)
    }

    /// Bytes after the header reserved for the heap's metadata: about 560 B per 64 KiB
    /// page of the slot (the heap's own figures), rounded up to heap pages.
    pub fn meta_reserve(&self) -> usize {
        let pages = self.cfg.slot_size() >> 16;
        (pages * 576 + (64 << 10)).next_multiple_of(64 << 10)
    }

    /// The header of `slot`'s object.
    ///
    /// # Safety
    /// The slot holds an object (its header was written), in memory this process may read.
    pub unsafe fn header(&self, slot: u32) -> &ObjHeader {
        // SAFETY: the caller's promise; slot bases are 64 KiB aligned.
        unsafe { &*(self.slot_base(slot) as *const ObjHeader) }
    }
}

/// The heap's metadata and services for one slot: plain addresses (the arena lies at the
/// same address in every process, so they are valid wherever the object migrates).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SlotBacking {
    pub slot: u32,
    pub meta: usize,
    pub meta_cap: usize,
}

// SAFETY: metadata is the slot's reserved range (zeros in a fresh slot, used by nothing
// else, mapped as long as the arena); purge discards whole pages of the range only and says
// true only when they read as zeros after (a `Local` slot reads zeros from the store); the
// futex calls sleep and wake on the word given.
unsafe impl Backing for SlotBacking {
    fn map_metadata(&self, len: usize) -> *mut u8 {
        if len <= self.meta_cap {
            self.meta as *mut u8
        } else {
            std::ptr::null_mut()
        }
    }

    unsafe fn purge(&self, ptr: *mut u8, len: usize) -> bool {
        // Only while the object is here and not migrating: a discarded page is not reported
        // as written, so a destination would keep stale bytes the heap believes are zeros.
        let Some(shared) = current() else {
            return false;
        };
        if shared.slots.state(self.slot) != Some(SlotState::Local) {
            shared.purges_refused.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        // SAFETY: a free span of the heap, which nothing uses (Backing's contract).
        unsafe { libc::madvise(ptr.cast(), len, libc::MADV_DONTNEED) == 0 }
    }

    fn wait(&self, word: &AtomicU32, expected: u32) {
        // SAFETY: FUTEX_WAIT_PRIVATE on a live atomic word; no timeout.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
                expected,
                std::ptr::null::<libc::timespec>(),
            );
        }
    }

    fn wake_one(&self, word: &AtomicU32) {
        // SAFETY: FUTEX_WAKE_PRIVATE of one waiter on a live atomic word.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
                1,
            );
        }
    }
}

/// Most objects nested on one thread's context stack.
pub const MAX_CONTEXT_DEPTH: usize = 8;

thread_local! {
    static STACK: Cell<[u32; MAX_CONTEXT_DEPTH]> = const { Cell::new([0; MAX_CONTEXT_DEPTH]) };
    static DEPTH: Cell<usize> = const { Cell::new(0) };
}

/// Pushes `slot` on this thread's context stack; returns the depth to pop back to, or
/// `None` when the stack is full.
pub(crate) fn push_context(slot: u32) -> Option<usize> {
    let depth = DEPTH.get();
    if depth == MAX_CONTEXT_DEPTH {
        return None;
    }
    let mut s = STACK.get();
    s[depth] = slot;
    STACK.set(s);
    DEPTH.set(depth + 1);
    Some(depth)
}

/// Pops the context stack back to `depth` (what [`push_context`] returned).
pub(crate) fn pop_context(depth: usize) {
    DEPTH.set(depth.min(DEPTH.get()));
}

/// The object this thread allocates for now, if any.
pub fn context() -> Option<u32> {
    let depth = DEPTH.get();
    (depth > 0).then(|| STACK.get()[depth - 1])
}

/// The allocator of arena objects' collections: zero-sized (so it takes no room in the
/// object and means the same in every process), `Copy`, `Send` and `Sync`.
///
/// Allocation needs a context (inside [`Obj::new_in`]'s `init`, or while a
/// [`Obj::write`] guard is held on this thread) and fails without one, which a collection
/// turns into `handle_alloc_error`. Deallocation goes by address and needs none.
///
/// [`Obj::new_in`]: crate::Obj::new_in
/// [`Obj::write`]: crate::Obj::write
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct ArenaAlloc;

impl ArenaAlloc {
    fn heap_for_alloc() -> Result<&'static Heap<SlotBacking>, AllocError> {
        let shared = current().ok_or(AllocError)?;
        let slot = context().ok_or(AllocError)?;
        match shared.slots.state(slot) {
            Some(SlotState::Local | SlotState::Outbound) => {
                // SAFETY: a slot on a context stack holds an object (pushed by Obj's guards).
                Ok(unsafe { &shared.header(slot).heap })
            }
            _ => Err(AllocError),
        }
    }

    /// The heap that owns `ptr`, if this process may free there.
    fn heap_of(ptr: *mut u8) -> Option<&'static Heap<SlotBacking>> {
        let shared = current()?;
        let slot = shared.slot_of(ptr.addr())?;
        match shared.slots.state(slot) {
            Some(SlotState::Local | SlotState::Outbound | SlotState::Installed) => {
                // SAFETY: a slot in these states holds an object.
                Some(unsafe { &shared.header(slot).heap })
            }
            _ => {
                shared.dealloc_foreign.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }
}

fn block(ptr: *mut u8, len: usize) -> Result<NonNull<[u8]>, AllocError> {
    let p = NonNull::new(ptr).ok_or(AllocError)?;
    Ok(NonNull::slice_from_raw_parts(p, len))
}

fn dangling(layout: Layout) -> NonNull<[u8]> {
    // A zero-sized block: any aligned non-null address (never dereferenced, never freed).
    let p =
        NonNull::new(std::ptr::without_provenance_mut::<u8>(layout.align())).expect("align > 0");
    NonNull::slice_from_raw_parts(p, 0)
}

// SAFETY: blocks come from the slot heap of the thread's context object and stay valid until
// freed (by address, through the heap that owns them); every copy of the ZST is the same
// allocator. The exception, documented on `Obj`: once an object migrated away, its blocks in
// this process are gone, and `Obj`'s guards refuse access.
unsafe impl Allocator for ArenaAlloc {
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        if layout.size() == 0 {
            return Ok(dangling(layout));
        }
        let heap = Self::heap_for_alloc()?;
        let p = if layout.align() <= 16 {
            heap.malloc(layout.size())
        } else {
            heap.memalign(layout.align(), layout.size())
        };
        block(p, layout.size())
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() == 0 {
            return;
        }
        if let Some(heap) = Self::heap_of(ptr.as_ptr()) {
            // SAFETY: the caller's block, allocated by this heap (its slot is its address's).
            unsafe { heap.free(ptr.as_ptr()) };
        }
    }

    unsafe fn grow(
        &self,
        ptr: NonNull<u8>,
        old: Layout,
        new: Layout,
    ) -> Result<NonNull<[u8]>, AllocError> {
        if old.size() == 0 || new.align() > 16 || old.align() != new.align() {
            // A fresh block, the copy and the free.
            let fresh = self.allocate(new)?;
            // SAFETY: both blocks are valid for `old.size()` bytes and do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    ptr.as_ptr(),
                    fresh.cast::<u8>().as_ptr(),
                    old.size(),
                );
                self.deallocate(ptr, old);
            }
            return Ok(fresh);
        }
        // Growing in place needs a context too (the block may move within its own heap).
        Self::heap_for_alloc()?;
        let heap = Self::heap_of(ptr.as_ptr()).ok_or(AllocError)?;
        // SAFETY: the caller's live block of this heap.
        block(
            unsafe { heap.realloc(ptr.as_ptr(), new.size()) },
            new.size(),
        )
    }

    unsafe fn shrink(
        &self,
        ptr: NonNull<u8>,
        old: Layout,
        new: Layout,
    ) -> Result<NonNull<[u8]>, AllocError> {
        if new.size() == 0 {
            // SAFETY: the caller's block.
            unsafe { self.deallocate(ptr, old) };
            return Ok(dangling(new));
        }
        if !ptr.as_ptr().addr().is_multiple_of(new.align()) {
            let fresh = self.allocate(new)?;
            // SAFETY: both blocks are valid for `new.size()` bytes and do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    ptr.as_ptr(),
                    fresh.cast::<u8>().as_ptr(),
                    new.size(),
                );
                self.deallocate(ptr, old);
            }
            return Ok(fresh);
        }
        // A smaller block is still a valid block of `new`'s size (the heap frees by address).
        Ok(NonNull::slice_from_raw_parts(ptr, new.size()))
    }
}
