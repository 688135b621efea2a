//! [`Arena`]: small objects of every class, from slabs this arena owns, behind its lock.
//!
//! Each arena keeps, per class, a doubly linked list of its slabs that have a free object
//! (the links live in the slabs' metadata), so an allocation is O(1) plus a bitmap scan
//! inside one slab. A slab that fills up leaves the list; one that gets an object back
//! joins it again. A slab that empties goes back to the span allocator, unless it is the
//! only slab in its list (which spares a loop of one `malloc` and one `free` a new slab each
//! time); [`Arena::trim`] gives those back too.

use core::cell::UnsafeCell;

use crate::backing::Backing;
use crate::class::{class_size, slab_objects, slab_pages, NCLASSES};
use crate::lock::RawLock;
use crate::pagemap::{Env, NIL};
use crate::slab::{SlabMeta, SlabState};
use crate::span::Spans;

/// The metadata an arena works on.
pub(crate) struct Ctx<'a, B> {
    pub(crate) env: Env<'a, B>,
    pub(crate) slabs: &'a [SlabMeta],
    pub(crate) spans: &'a Spans,
}

impl<B> Ctx<'_, B> {
    fn slab(&self, s: u32) -> *mut SlabState {
        self.slabs[s as usize].get()
    }
}

/// What an arena's lock guards.
pub(crate) struct ArenaState {
    /// First slab of each class's list of slabs with a free object, or [`NIL`].
    partial: [u32; NCLASSES],
    pub(crate) small_bytes: usize,
    pub(crate) objects: usize,
    pub(crate) slab_pages: usize,
}

/// One arena; aligned to a cache line so that arenas do not share one.
#[repr(C, align(64))]
pub(crate) struct Arena {
    lock: RawLock,
    state: UnsafeCell<ArenaState>,
}

impl Arena {
    pub(crate) const fn new() -> Self {
        Self {
            lock: RawLock::new(),
            state: UnsafeCell::new(ArenaState {
                partial: [NIL; NCLASSES],
                small_bytes: 0,
                objects: 0,
                slab_pages: 0,
            }),
        }
    }

    pub(crate) fn raw_lock(&self) -> &RawLock {
        &self.lock
    }

    /// A copy of the counters.
    ///
    /// # Safety
    /// The caller holds this arena's lock.
    pub(crate) unsafe fn counters(&self) -> (usize, usize, usize) {
        // SAFETY: the lock is held (the caller's contract), so nothing writes the state.
        let st = unsafe { &*self.state.get() };
        (st.small_bytes, st.objects, st.slab_pages)
    }

    /// An object of `class`: its address, and whether it reads as zeros. `id` is this
    /// arena's index, recorded in the page table of new slabs.
    ///
    /// # Safety
    /// The caller holds this arena's lock.
    pub(crate) unsafe fn alloc<B: Backing>(
        &self,
        cx: &Ctx<'_, B>,
        id: usize,
        class: usize,
    ) -> Option<(*mut u8, bool)> {
        // SAFETY: the lock is held (the caller's contract); this is the only reference.
        let st = unsafe { &mut *self.state.get() };
        let mut s = st.partial[class];
        if s == NIL {
            s = new_slab(st, cx, id, class)?;
        }
        // SAFETY: slab `s` is in this arena's list, so this arena owns it; its lock is held.
        let slab = unsafe { &mut *cx.slab(s) };
        let (idx, zero) = slab.take(slab_objects(class))?;
        if slab.nfree == 0 {
            unlink(st, cx, class, s);
        }
        st.small_bytes += class_size(class);
        st.objects += 1;
        let offset = idx as usize * class_size(class);
        Some((cx.env.ptr(s).wrapping_add(offset), zero))
    }

    /// Frees the object `offset` bytes into slab `s` of `class`; an offset that is no
    /// object handed out is ignored.
    ///
    /// # Safety
    /// The caller holds this arena's lock, and this arena owns slab `s` (the page table
    /// says so, and the object is live, so that cannot change).
    pub(crate) unsafe fn free<B: Backing>(
        &self,
        cx: &Ctx<'_, B>,
        s: u32,
        class: usize,
        offset: usize,
    ) {
        let size = class_size(class);
        let objects = slab_objects(class);
        if !offset.is_multiple_of(size) || offset / size >= objects as usize {
            return;
        }
        // SAFETY: the lock is held (the caller's contract); this is the only reference.
        let st = unsafe { &mut *self.state.get() };
        // SAFETY: this arena owns slab `s` and its lock is held (the caller's contract).
        let slab = unsafe { &mut *cx.slab(s) };
        if !slab.put((offset / size) as u32) {
            return;
        }
        let nfree = slab.nfree;
        st.small_bytes -= size;
        st.objects -= 1;
        if nfree == 1 {
            push(st, cx, class, s);
        }
        let sole = st.partial[class] == s && slab_next(cx, s) == NIL;
        if nfree == objects && !sole {
            release(st, cx, class, s);
        }
    }

    /// Gives every empty slab back to the span allocator.
    ///
    /// # Safety
    /// The caller holds this arena's lock.
    pub(crate) unsafe fn trim<B: Backing>(&self, cx: &Ctx<'_, B>) {
        // SAFETY: the lock is held (the caller's contract); this is the only reference.
        let st = unsafe { &mut *self.state.get() };
        for class in 0..NCLASSES {
            let mut s = st.partial[class];
            while s != NIL {
                let next = slab_next(cx, s);
                // SAFETY: slab `s` is in this arena's list and its lock is held.
                let nfree = unsafe { (*cx.slab(s)).nfree };
                if nfree == slab_objects(class) {
                    release(st, cx, class, s);
                }
                s = next;
            }
        }
    }
}

fn new_slab<B: Backing>(
    st: &mut ArenaState,
    cx: &Ctx<'_, B>,
    id: usize,
    class: usize,
) -> Option<u32> {
    let pages = slab_pages(class);
    let (s, zero) = cx.spans.alloc_slab(&cx.env, pages, class, id)?;
    // SAFETY: the span allocator just gave this slab to this arena (whose lock the caller
    // holds); whoever used its metadata before gave the pages back under the span lock,
    // which this thread has taken since.
    unsafe { (*cx.slab(s)).init(slab_objects(class), zero) };
    st.slab_pages += pages as usize;
    push(st, cx, class, s);
    Some(s)
}

fn release<B: Backing>(st: &mut ArenaState, cx: &Ctx<'_, B>, class: usize, s: u32) {
    unlink(st, cx, class, s);
    let pages = slab_pages(class);
    st.slab_pages -= pages as usize;
    cx.spans.free_slab(&cx.env, s, pages);
}

// The list functions below run with the arena lock held (their callers hold it) on slabs of
// the arena's lists, and hold no other reference to a slab's state while they run.

fn slab_next<B>(cx: &Ctx<'_, B>, s: u32) -> u32 {
    // SAFETY: see above the list functions.
    unsafe { (*cx.slab(s)).next }
}

fn set_links<B>(cx: &Ctx<'_, B>, s: u32, prev: Option<u32>, next: Option<u32>) {
    // SAFETY: see above the list functions.
    let slab = unsafe { &mut *cx.slab(s) };
    if let Some(prev) = prev {
        slab.prev = prev;
    }
    if let Some(next) = next {
        slab.next = next;
    }
}

fn push<B>(st: &mut ArenaState, cx: &Ctx<'_, B>, class: usize, s: u32) {
    let first = st.partial[class];
    set_links(cx, s, Some(NIL), Some(first));
    if first != NIL {
        set_links(cx, first, Some(s), None);
    }
    st.partial[class] = s;
}

fn unlink<B>(st: &mut ArenaState, cx: &Ctx<'_, B>, class: usize, s: u32) {
    // SAFETY: see above the list functions.
    let (prev, next) = unsafe { ((*cx.slab(s)).prev, (*cx.slab(s)).next) };
    if prev == NIL {
        st.partial[class] = next;
    } else {
        set_links(cx, prev, None, Some(next));
    }
    if next != NIL {
        set_links(cx, next, Some(prev), None);
    }
}
