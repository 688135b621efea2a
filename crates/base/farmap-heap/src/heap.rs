//! [`Heap`]: the malloc family over one region.

use core::fmt;
use core::mem::size_of;
use core::ptr::{self, NonNull};

use crate::arena::{Arena, Ctx};
use crate::backing::Backing;
use crate::class::{
    aligned_class, class_of, class_size, MAX_SMALL, MIN_ALIGN, PAGE_SHIFT, PAGE_SIZE,
};
use crate::pagemap::{Entry, Env, Kind, NIL};
use crate::slab::SlabMeta;
use crate::span::Spans;
use crate::stats::{AllocError, HeapError, Stats};

/// The most arenas a heap has (arena numbers are kept in a byte of the page table).
pub const MAX_ARENAS: usize = 64;

/// A size-class allocator over one region; see the [crate] documentation.
///
/// All methods take `&self`: share it between threads (it is `Sync` when its backing is).
/// None of them allocates from the global allocator, uses thread-local storage or panics on
/// exhaustion (they return null).
pub struct Heap<B: Backing> {
    backing: B,
    /// Page 0 of the region (the region's start rounded up to 64 KiB).
    base: *mut u8,
    npages: u32,
    narenas: usize,
    /// The metadata mapping: arenas, span allocator, page table, slab states.
    meta: *mut u8,
    meta_len: usize,
    arenas: *const Arena,
    spans: *const Spans,
    pages: *const Entry,
    slabs: *const SlabMeta,
}

// SAFETY: the heap owns its metadata mapping and shares the region only through the
// pointers it hands out; nothing in it is tied to the thread that made it.
unsafe impl<B: Backing + Send> Send for Heap<B> {}
// SAFETY: every piece of shared state is an atomic or is guarded by an arena lock or the
// span lock (see the crate docs, "Locking"); the backing is shared, hence `B: Sync`.
unsafe impl<B: Backing + Sync> Sync for Heap<B> {}

impl<B: Backing> fmt::Debug for Heap<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Heap")
            .field("base", &self.base)
            .field("pages", &self.npages)
            .field("arenas", &self.narenas)
            .finish_non_exhaustive()
    }
}

/// Offsets of the parts of the metadata mapping (arenas first, at 0).
struct Layout {
    spans: usize,
    pages: usize,
    slabs: usize,
    len: usize,
}

impl Layout {
    fn new(narenas: usize, npages: usize) -> Option<Self> {
        let after = |start: usize, len: usize| start.checked_add(len)?.checked_next_multiple_of(64);
        let spans = after(0, narenas.checked_mul(size_of::<Arena>())?)?;
        let pages = after(spans, size_of::<Spans>())?;
        let slabs = after(pages, npages.checked_mul(size_of::<Entry>())?)?;
        let len = after(slabs, npages.checked_mul(size_of::<SlabMeta>())?)?;
        Some(Self {
            spans,
            pages,
            slabs,
            len,
        })
    }
}

/// The arena a hint picks first (a multiplicative hash spreads nearby hints).
fn arena_index(hint: usize, narenas: usize) -> usize {
    ((hint as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize % narenas
}

impl<B: Backing> Heap<B> {
    /// A heap over `region_len` bytes at `region`, with `arenas` arenas (`1..=MAX_ARENAS`),
    /// its metadata mapped through `backing`. Only the whole 64 KiB pages of the region are
    /// used. The heap itself is a few words (its state is in the metadata mapping), so it
    /// can be moved freely: store it wherever it should live (a `static` set once in a
    /// malloc replacement).
    ///
    /// # Safety
    /// - `region..region + region_len` is readable and writable memory that reads as zeros
    ///   (a fresh anonymous mapping), and stays mapped for as long as the heap or any
    ///   pointer it handed out is used.
    /// - Nothing touches that memory except through the pointers the heap hands out, within
    ///   their usable size, while they are live.
    pub unsafe fn new(
        region: *mut u8,
        region_len: usize,
        backing: B,
        arenas: usize,
    ) -> Result<Self, HeapError> {
        if !(1..=MAX_ARENAS).contains(&arenas) {
            return Err(HeapError::Arenas(arenas));
        }
        let start = region.addr();
        let skip = start
            .checked_next_multiple_of(PAGE_SIZE)
            .ok_or(HeapError::RegionTooSmall)?
            - start;
        let npages = region_len.saturating_sub(skip) >> PAGE_SHIFT;
        if npages == 0 {
            return Err(HeapError::RegionTooSmall);
        }
        let npages = u32::try_from(npages)
            .ok()
            .filter(|&n| n != NIL)
            .ok_or(HeapError::RegionTooLarge)?;
        let layout = Layout::new(arenas, npages as usize).ok_or(HeapError::RegionTooLarge)?;
        let meta = backing.map_metadata(layout.len);
        if meta.is_null() || !meta.addr().is_multiple_of(64) {
            if !meta.is_null() {
                // SAFETY: `meta` was just mapped with this length and nothing uses it.
                unsafe { backing.unmap_metadata(meta, layout.len) };
            }
            return Err(HeapError::MetadataUnavailable(layout.len));
        }
        // SAFETY: `meta` is `layout.len` bytes of fresh zeroed memory, 64-byte aligned
        // (Backing's contract, alignment checked above); the arenas and the span allocator
        // lie inside it at 64-byte aligned offsets (`Layout`), and nothing else uses it.
        let (arenas_ptr, spans) = unsafe {
            let arenas_ptr = meta.cast::<Arena>();
            for i in 0..arenas {
                arenas_ptr.add(i).write(Arena::new());
            }
            let spans = meta.add(layout.spans).cast::<Spans>();
            spans.write(Spans::new());
            (arenas_ptr, spans)
        };
        let heap = Self {
            backing,
            base: region.wrapping_add(skip),
            npages,
            narenas: arenas,
            meta,
            meta_len: layout.len,
            arenas: arenas_ptr,
            spans,
            pages: meta.wrapping_add(layout.pages).cast::<Entry>().cast_const(),
            slabs: meta
                .wrapping_add(layout.slabs)
                .cast::<SlabMeta>()
                .cast_const(),
        };
        heap.spans().init(&heap.env());
        Ok(heap)
    }

    fn arena_slice(&self) -> &[Arena] {
        // SAFETY: `new` wrote `narenas` arenas there; the mapping lives as long as `self`.
        unsafe { core::slice::from_raw_parts(self.arenas, self.narenas) }
    }

    fn spans(&self) -> &Spans {
        // SAFETY: `new` wrote the span allocator there; the mapping lives as long as `self`.
        unsafe { &*self.spans }
    }

    fn env(&self) -> Env<'_, B> {
        // SAFETY: one zero-filled (hence valid) entry per page, inside the metadata mapping,
        // which lives as long as `self`; entries are atomics.
        let pages = unsafe { core::slice::from_raw_parts(self.pages, self.npages as usize) };
        Env {
            pages,
            base: self.base,
            backing: &self.backing,
        }
    }

    fn ctx(&self) -> Ctx<'_, B> {
        // SAFETY: one slab state per page (zero-filled is valid), inside the metadata
        // mapping, which lives as long as `self`; states sit in `UnsafeCell`s.
        let slabs = unsafe { core::slice::from_raw_parts(self.slabs, self.npages as usize) };
        Ctx {
            env: self.env(),
            slabs,
            spans: self.spans(),
        }
    }

    /// The backing the heap was made with.
    pub fn backing(&self) -> &B {
        &self.backing
    }

    /// The part of the region the heap uses: its first byte and its length.
    pub fn region(&self) -> (*mut u8, usize) {
        (self.base, (self.npages as usize) << PAGE_SHIFT)
    }

    /// Whether `ptr` lies in the region (whether this heap should free it).
    pub fn owns(&self, ptr: *const u8) -> bool {
        self.page_of(ptr).is_some()
    }

    fn page_of(&self, ptr: *const u8) -> Option<u32> {
        let offset = ptr.addr().wrapping_sub(self.base.addr());
        (offset < (self.npages as usize) << PAGE_SHIFT).then_some((offset >> PAGE_SHIFT) as u32)
    }

    /// `size` bytes, 16-byte aligned, or null if the region is full. `malloc(0)` returns a
    /// unique pointer (to 16 usable bytes).
    pub fn malloc(&self, size: usize) -> *mut u8 {
        self.alloc(size, MIN_ALIGN)
            .map_or(ptr::null_mut(), |(p, _)| p)
    }

    /// `n * size` bytes of zeros, or null if that overflows or the region is full. Memory
    /// known to read as zeros (never used, or purged) is not written.
    pub fn calloc(&self, n: usize, size: usize) -> *mut u8 {
        let Some(total) = n.checked_mul(size) else {
            return ptr::null_mut();
        };
        let Some((p, zero)) = self.alloc(total, MIN_ALIGN) else {
            return ptr::null_mut();
        };
        if !zero {
            // SAFETY: `p` was just allocated with at least `total` bytes and is not yet
            // handed out; no heap lock is held while the memory is written.
            unsafe { p.write_bytes(0, total) };
        }
        p
    }

    /// `size` bytes aligned to `align` (a power of two; 16 is the least used), or null if
    /// `align` is not a power of two or the region is full. Alignments up to 32 KiB come
    /// from size classes, larger ones are spans (any power of two the region can hold).
    pub fn memalign(&self, align: usize, size: usize) -> *mut u8 {
        if !align.is_power_of_two() {
            return ptr::null_mut();
        }
        self.alloc(size, align.max(MIN_ALIGN))
            .map_or(ptr::null_mut(), |(p, _)| p)
    }

    /// `posix_memalign`: like [`memalign`](Self::memalign), but `align` must also be a
    /// multiple of the size of a pointer, and the failure says why.
    pub fn posix_memalign(&self, align: usize, size: usize) -> Result<NonNull<u8>, AllocError> {
        if !align.is_power_of_two() || align < size_of::<*const ()>() {
            return Err(AllocError::InvalidAlignment);
        }
        NonNull::new(self.memalign(align, size)).ok_or(AllocError::OutOfMemory)
    }

    /// [`try_alloc`](Self::try_alloc); when the region is full, the empty slabs the arenas
    /// keep for reuse are given back ([`trim`](Self::trim), no lock held) and it is tried
    /// once more.
    fn alloc(&self, size: usize, align: usize) -> Option<(*mut u8, bool)> {
        if align > (self.npages as usize) << PAGE_SHIFT {
            // No span of the region can be aligned so (nothing to purge or trim for).
            return None;
        }
        self.try_alloc(size, align).or_else(|| {
            self.trim();
            self.try_alloc(size, align)
        })
    }

    fn try_alloc(&self, size: usize, align: usize) -> Option<(*mut u8, bool)> {
        let class = if align <= MIN_ALIGN {
            (size <= MAX_SMALL).then(|| class_of(size))
        } else if align <= MAX_SMALL {
            aligned_class(size, align)
        } else {
            None
        };
        match class {
            Some(class) => self.alloc_small(class),
            None => self.alloc_large(size, align),
        }
    }

    fn alloc_large(&self, size: usize, align: usize) -> Option<(*mut u8, bool)> {
        let pages = u32::try_from(size.max(1).div_ceil(PAGE_SIZE)).ok()?;
        if pages > self.npages {
            return None;
        }
        let env = self.env();
        let (s, zero) = self.spans().alloc_large(&env, pages, align)?;
        Some((env.ptr(s), zero))
    }

    /// From the hinted arena, or the next one whose lock is free; if all are busy, waits
    /// for the hinted one; if it has no room (the region is full), tries every arena.
    fn alloc_small(&self, class: usize) -> Option<(*mut u8, bool)> {
        let cx = self.ctx();
        let arenas = self.arena_slice();
        let first = arena_index(self.backing.thread_hint(), arenas.len());
        let mut order = (0..arenas.len()).map(|i| (first + i) % arenas.len());
        for id in order.clone() {
            if let Some(_guard) = arenas[id].raw_lock().try_guard(&self.backing) {
                // SAFETY: the arena's lock is held until `_guard` drops.
                let found = unsafe { arenas[id].alloc(&cx, id, class) };
                if found.is_some() {
                    return found;
                }
                break;
            }
        }
        order.find_map(|id| {
            let _guard = arenas[id].raw_lock().guard(&self.backing);
            // SAFETY: the arena's lock is held until `_guard` drops.
            unsafe { arenas[id].alloc(&cx, id, class) }
        })
    }

    /// Frees what `ptr` points to. Null, and pointers outside the region, are ignored (a
    /// malloc replacement checks [`owns`](Self::owns) first to send others elsewhere).
    ///
    /// # Safety
    /// `ptr` is null, outside the region, or a live pointer returned by this heap, which is
    /// not used after this call.
    pub unsafe fn free(&self, ptr: *mut u8) {
        let Some(p) = self.page_of(ptr) else {
            return;
        };
        let env = self.env();
        match env.page(p).kind() {
            Kind::Small | Kind::SmallTail => self.free_small(ptr, p),
            Kind::Large if ptr == env.ptr(p) => {
                self.spans().free_large(&env, p);
            }
            _ => {}
        }
    }

    fn free_small(&self, ptr: *mut u8, p: u32) {
        let env = self.env();
        let s = self.slab_of(p);
        if s == NIL {
            return;
        }
        let head = env.page(s);
        let Some(arena) = self.arena_slice().get(head.arena()) else {
            return;
        };
        let offset = ptr.addr().wrapping_sub(env.ptr(s).addr());
        let _guard = arena.raw_lock().guard(&self.backing);
        // SAFETY: the arena's lock is held until `_guard` drops; the page table says this
        // arena owns slab `s`, and cannot change while the object `ptr` is live (free's
        // contract: it is live until this call).
        unsafe { arena.free(&self.ctx(), s, head.class(), offset) };
    }

    /// The first page of the slab page `p` belongs to, or [`NIL`] if it is in no slab.
    fn slab_of(&self, p: u32) -> u32 {
        let env = self.env();
        let e = env.page(p);
        let s = match e.kind() {
            Kind::Small => p,
            Kind::SmallTail => e.x(),
            _ => return NIL,
        };
        if s < self.npages && env.page(s).kind() == Kind::Small {
            s
        } else {
            NIL
        }
    }

    /// The bytes usable at `ptr`: its size class, or its span's length in whole pages. The
    /// program may use all of them. 0 for null and for pointers the heap did not hand out;
    /// the result for a pointer already freed is meaningless.
    pub fn usable_size(&self, ptr: *const u8) -> usize {
        let Some(p) = self.page_of(ptr) else {
            return 0;
        };
        let env = self.env();
        let e = env.page(p);
        match e.kind() {
            Kind::Large if ptr == env.ptr(p).cast_const() => (e.x() as usize) << PAGE_SHIFT,
            Kind::Small | Kind::SmallTail => match self.slab_of(p) {
                NIL => 0,
                s => class_size(env.page(s).class()),
            },
            _ => 0,
        }
    }

    /// Resizes the allocation at `ptr` to `size` bytes, keeping its first `min(usable,
    /// size)` bytes; returns the new pointer, or null (and `ptr` untouched) if it grows and
    /// the region is full (a shrink never fails). Null `ptr` is `malloc(size)`; `size == 0` frees `ptr` and returns null (as
    /// glibc does). Stays in place when the new size fits the object's size class and is
    /// not less than about half of it, or when a large object shrinks or the span after it
    /// is free and long enough.
    ///
    /// # Safety
    /// `ptr` is null or a live pointer returned by this heap; if the result is not null,
    /// `ptr` is not used after this call (unless they are equal).
    pub unsafe fn realloc(&self, ptr: *mut u8, size: usize) -> *mut u8 {
        if ptr.is_null() {
            return self.malloc(size);
        }
        if size == 0 {
            // SAFETY: `ptr` is live and not used after this (the caller's contract).
            unsafe { self.free(ptr) };
            return ptr::null_mut();
        }
        let old = self.usable_size(ptr);
        if old == 0 {
            return ptr::null_mut();
        }
        if self.resize_in_place(ptr, old, size) {
            return ptr;
        }
        let new = self.malloc(size);
        if new.is_null() && size <= old {
            // A shrink never fails (programs rely on it, as glibc's does not fail): the
            // object stays where it is, larger than asked.
            return ptr;
        }
        if !new.is_null() {
            // SAFETY: `ptr` is live with `old` usable bytes and `new` was just allocated
            // with at least `size`; two live allocations never overlap. `ptr` is not used
            // after this (the caller's contract).
            unsafe {
                ptr::copy_nonoverlapping(ptr, new, old.min(size));
                self.free(ptr);
            }
        }
        new
    }

    fn resize_in_place(&self, ptr: *mut u8, old: usize, size: usize) -> bool {
        if old <= MAX_SMALL {
            return size <= old && class_of(size) + 4 >= class_of(old);
        }
        let (Ok(pages), Some(p)) = (u32::try_from(size.div_ceil(PAGE_SIZE)), self.page_of(ptr))
        else {
            return false;
        };
        size > MAX_SMALL && self.spans().resize_large(&self.env(), p, pages)
    }

    /// Gives every empty slab kept for reuse back to the span allocator (`malloc_trim`).
    pub fn trim(&self) {
        let cx = self.ctx();
        for arena in self.arena_slice() {
            let _guard = arena.raw_lock().guard(&self.backing);
            // SAFETY: the arena's lock is held until `_guard` drops.
            unsafe { arena.trim(&cx) };
        }
    }

    /// The heap's counters; see [`Stats`].
    pub fn stats(&self) -> Stats {
        let mut stats = Stats {
            region_pages: self.npages as usize,
            ..Stats::default()
        };
        for arena in self.arena_slice() {
            let _guard = arena.raw_lock().guard(&self.backing);
            // SAFETY: the arena's lock is held until `_guard` drops.
            let (bytes, objects, slab_pages) = unsafe { arena.counters() };
            stats.bytes_in_use += bytes;
            stats.objects_in_use += objects;
            stats.slab_pages += slab_pages;
        }
        let spans = self.spans().stats(&self.env());
        stats.bytes_in_use += spans.large_pages << PAGE_SHIFT;
        stats.objects_in_use += spans.large_objects;
        stats.pages_in_use = spans.pages_in_use;
        stats.large_pages = spans.large_pages;
        stats.purged_bytes = spans.purged_bytes;
        stats.high_water_pages = spans.high_water as usize;
        stats
    }

    /// Takes every lock of the heap (each arena's, then the span allocator's), for
    /// `pthread_atfork`'s prepare handler: a child forked meanwhile gets a heap that no
    /// other thread was changing. Any heap call on this thread blocks until
    /// [`unlock_all`](Self::unlock_all).
    pub fn lock_all(&self) {
        for arena in self.arena_slice() {
            arena.raw_lock().lock(&self.backing);
        }
        self.spans().raw_lock().lock(&self.backing);
    }

    /// Releases what [`lock_all`](Self::lock_all) took (atfork's parent and child handlers).
    ///
    /// # Safety
    /// This thread called `lock_all` and has not called `unlock_all` since (in a forked
    /// child: its parent's thread did, before forking).
    pub unsafe fn unlock_all(&self) {
        self.spans().raw_lock().unlock(&self.backing);
        for arena in self.arena_slice().iter().rev() {
            arena.raw_lock().unlock(&self.backing);
        }
    }
}

impl<B: Backing> Drop for Heap<B> {
    fn drop(&mut self) {
        // SAFETY: the mapping came from `map_metadata` with this length; the heap is going
        // away, so nothing uses it any more.
        unsafe { self.backing.unmap_metadata(self.meta, self.meta_len) };
    }
}
