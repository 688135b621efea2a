//! The page table: one 16-byte [`Entry`] per 64 KiB page of the region, outside the region.
//!
//! Every span (a run of pages that is free, one large object, or one slab of small objects)
//! keeps accurate entries on its first and its last page; a slab keeps all of them, so that
//! any object finds its slab. Pages inside a free or large span may hold stale entries: no
//! lookup ever reads them (a pointer the heap handed out is a span start or lies in a slab;
//! coalescing looks only at the pages just outside a span).
//!
//! Entries are written only with the span lock held. They are atomics read with `Relaxed`
//! ordering, so that a lookup without a lock (`free`, `usable_size`) is never a data race: a
//! thread that received a pointer from another one received it after the entries were
//! written, and the entries of a live object do not change until it is freed.

use core::sync::atomic::{AtomicU32, AtomicU8, Ordering::Relaxed};

use crate::class::PAGE_SHIFT;

/// "No page": the end of a list.
pub(crate) const NIL: u32 = u32::MAX;

/// What a page is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Never written: a page inside a span, never looked at.
    Unset,
    /// First page of a free span: `x` is its length, `next`/`prev` link its bin, `zero` says
    /// whether the whole span reads as zeros (never used, or purged).
    Free,
    /// Last page of a free span of two pages or more: `x` is its first page.
    FreeTail,
    /// First page of a large object: `x` is its length in pages.
    Large,
    /// Last page of a large object of two pages or more: `x` is its first page.
    LargeTail,
    /// First page of a slab: `x` is its length, `class` and `arena` its owner.
    Small,
    /// Any other page of a slab: `x` is its first page.
    SmallTail,
}

impl Kind {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::Free,
            2 => Self::FreeTail,
            3 => Self::Large,
            4 => Self::LargeTail,
            5 => Self::Small,
            6 => Self::SmallTail,
            _ => Self::Unset,
        }
    }

    fn to_u8(self) -> u8 {
        match self {
            Self::Unset => 0,
            Self::Free => 1,
            Self::FreeTail => 2,
            Self::Large => 3,
            Self::LargeTail => 4,
            Self::Small => 5,
            Self::SmallTail => 6,
        }
    }
}

/// One page's entry; all zeros (what a fresh mapping holds) is [`Kind::Unset`].
#[derive(Default)]
#[repr(C)]
pub(crate) struct Entry {
    kind: AtomicU8,
    class: AtomicU8,
    arena: AtomicU8,
    zero: AtomicU8,
    x: AtomicU32,
    next: AtomicU32,
    prev: AtomicU32,
}

const _: () = assert!(core::mem::size_of::<Entry>() == 16);

impl Entry {
    pub(crate) fn kind(&self) -> Kind {
        Kind::from_u8(self.kind.load(Relaxed))
    }

    /// The span length (first pages) or the span's first page (other pages); see [`Kind`].
    pub(crate) fn x(&self) -> u32 {
        self.x.load(Relaxed)
    }

    pub(crate) fn class(&self) -> usize {
        self.class.load(Relaxed) as usize
    }

    pub(crate) fn arena(&self) -> usize {
        self.arena.load(Relaxed) as usize
    }

    pub(crate) fn zero(&self) -> bool {
        self.zero.load(Relaxed) != 0
    }

    pub(crate) fn next(&self) -> u32 {
        self.next.load(Relaxed)
    }

    pub(crate) fn prev(&self) -> u32 {
        self.prev.load(Relaxed)
    }

    pub(crate) fn set_next(&self, page: u32) {
        self.next.store(page, Relaxed);
    }

    pub(crate) fn set_prev(&self, page: u32) {
        self.prev.store(page, Relaxed);
    }

    pub(crate) fn set(&self, kind: Kind, x: u32) {
        self.kind.store(kind.to_u8(), Relaxed);
        self.x.store(x, Relaxed);
    }

    pub(crate) fn set_free(&self, len: u32, zero: bool) {
        self.set(Kind::Free, len);
        self.zero.store(u8::from(zero), Relaxed);
    }

    pub(crate) fn set_small(&self, len: u32, class: usize, arena: usize) {
        self.set(Kind::Small, len);
        self.class.store(class as u8, Relaxed);
        self.arena.store(arena as u8, Relaxed);
    }
}

/// The page table and where the region starts: what span code works on.
pub(crate) struct Env<'a, B> {
    pub(crate) pages: &'a [Entry],
    /// Page 0 (64 KiB aligned); every pointer the heap hands out is derived from it.
    pub(crate) base: *mut u8,
    pub(crate) backing: &'a B,
}

impl<B> Env<'_, B> {
    pub(crate) fn npages(&self) -> u32 {
        self.pages.len() as u32
    }

    pub(crate) fn page(&self, page: u32) -> &Entry {
        &self.pages[page as usize]
    }

    /// The first byte of `page` (a page of the region, or the end of the region).
    pub(crate) fn ptr(&self, page: u32) -> *mut u8 {
        self.base.wrapping_add((page as usize) << PAGE_SHIFT)
    }
}
