//! [`Spans`]: the free runs of pages of the region, in bins by length, behind one lock.
//!
//! - A free span is *zero* (it reads as zeros: never used, or purged) or *dirty*. Spans of
//!   the same state that touch are always merged; a dirty and a zero span may touch.
//! - Freeing a span merges it with its dirty neighbours (found through the page table, in
//!   O(1)). If the result is at least [`PURGE_PAGES`] long it is purged
//!   ([`Backing::purge`]), becomes zero and merges with its zero neighbours too. So dirty
//!   free spans are shorter than 1 MiB unless a purge failed.
//! - Allocation takes the first fit from the dirty bins, then from the zero bins (memory
//!   that is already resident first). Bins hold spans by length: one bin per length up to
//!   16 pages, then four per doubling. A bin is searched for a fit up to [`SCAN_LIMIT`]
//!   spans deep, then the next non-empty bin (found in a bitmap) gives any of its spans;
//!   only when both fail (the region is nearly full) is the first bin searched to its end.
//! - The allocated span comes from the front of the free span (or its first aligned page);
//!   what is left keeps its state.
//! - When that finds nothing, every span long enough is tried (an aligned request may fit a
//!   span shorter than the length that surely holds it); if none fits, every dirty span is
//!   purged (so it merges with its zero neighbours) and the zero spans are tried again.
//!   These scans over many spans happen only when no free span is surely long enough: when
//!   the region is (nearly) full, or for alignments above 64 KiB.

use core::cell::UnsafeCell;

use crate::backing::Backing;
use crate::class::{PAGE_SHIFT, PAGE_SIZE};
use crate::lock::RawLock;
use crate::pagemap::{Env, Kind, NIL};

/// Freed spans of this many pages (1 MiB) or more are purged.
pub(crate) const PURGE_PAGES: u32 = 16;
const NBINS: usize = 128;
const EXACT_BINS: u32 = 16;
/// Spans of a bin tried for a fit before a longer bin is taken.
const SCAN_LIMIT: usize = 8;
const DIRTY: usize = 0;
const ZERO: usize = 1;

/// Bins 0..16 hold spans of 1..=16 pages; then four bins per doubling, up to `u32::MAX`.
fn bin_of(len: u32) -> usize {
    if len <= EXACT_BINS {
        return len as usize - 1;
    }
    let k = 31 - len.leading_zeros();
    let quarter = (len >> (k - 2)) & 3;
    (EXACT_BINS + (k - 4) * 4 + quarter) as usize
}

struct Bins {
    heads: [u32; NBINS],
    nonempty: [u64; NBINS / 64],
}

impl Bins {
    const fn new() -> Self {
        Self {
            heads: [NIL; NBINS],
            nonempty: [0; NBINS / 64],
        }
    }

    fn set_head(&mut self, bin: usize, head: u32) {
        self.heads[bin] = head;
        let bit = 1u64 << (bin % 64);
        if head == NIL {
            self.nonempty[bin / 64] &= !bit;
        } else {
            self.nonempty[bin / 64] |= bit;
        }
    }

    /// The first non-empty bin at or after `from`.
    fn next_nonempty(&self, from: usize) -> Option<usize> {
        let mut word = from / 64;
        let mut mask = !0u64 << (from % 64);
        while word < self.nonempty.len() {
            let bits = self.nonempty[word] & mask;
            if bits != 0 {
                return Some(word * 64 + bits.trailing_zeros() as usize);
            }
            word += 1;
            mask = !0;
        }
        None
    }
}

/// What the span lock guards.
pub(crate) struct SpanState {
    bins: [Bins; 2],
    pages_in_use: usize,
    large_pages: usize,
    large_objects: usize,
    purged_bytes: u64,
    high_water: u32,
}

/// Counters of the span allocator, read under its lock.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SpanStats {
    pub(crate) pages_in_use: usize,
    pub(crate) large_pages: usize,
    pub(crate) large_objects: usize,
    pub(crate) purged_bytes: u64,
    pub(crate) high_water: u32,
}

impl SpanState {
    fn push<B>(&mut self, env: &Env<'_, B>, s: u32, n: u32, zero: bool) {
        let head = env.page(s);
        head.set_free(n, zero);
        if n > 1 {
            env.page(s + n - 1).set(Kind::FreeTail, s);
        }
        let bins = &mut self.bins[usize::from(zero)];
        let bin = bin_of(n);
        let first = bins.heads[bin];
        head.set_prev(NIL);
        head.set_next(first);
        if first != NIL {
            env.page(first).set_prev(s);
        }
        bins.set_head(bin, s);
    }

    fn unlink<B>(&mut self, env: &Env<'_, B>, s: u32) {
        let head = env.page(s);
        let (next, prev) = (head.next(), head.prev());
        let bins = &mut self.bins[usize::from(head.zero())];
        if prev == NIL {
            bins.set_head(bin_of(head.x()), next);
        } else {
            env.page(prev).set_next(next);
        }
        if next != NIL {
            env.page(next).set_prev(prev);
        }
    }

    /// A span of `set` holding `pages` pages at an `align`-aligned address, and where
    /// they start in it. Quick: up to [`SCAN_LIMIT`] spans of the bin of the length that
    /// surely fits, then the first span of a later bin. Exhaustive: every span long enough.
    fn find_in<B>(
        &self,
        env: &Env<'_, B>,
        set: usize,
        want: Want,
        exhaustive: bool,
    ) -> Option<(u32, u32)> {
        let bins = &self.bins[set];
        let fit = |s: u32| fit(env, s, want).map(|a| (s, a));
        if exhaustive {
            let mut bin = bins.next_nonempty(bin_of(want.pages));
            while let Some(b) = bin {
                let mut s = bins.heads[b];
                while s != NIL {
                    if let Some(found) = fit(s) {
                        return Some(found);
                    }
                    s = env.page(s).next();
                }
                bin = bins.next_nonempty(b + 1);
            }
            return None;
        }
        let bin = bin_of(want.sure_fit()?);
        let mut s = bins.heads[bin];
        for _ in 0..SCAN_LIMIT {
            if s == NIL {
                break;
            }
            if let Some(found) = fit(s) {
                return Some(found);
            }
            s = env.page(s).next();
        }
        // Every span of a later bin is longer than every length of this one.
        bins.next_nonempty(bin + 1).and_then(|b| fit(bins.heads[b]))
    }

    fn find<B>(&self, env: &Env<'_, B>, want: Want) -> Option<(u32, u32)> {
        [false, true].into_iter().find_map(|exhaustive| {
            [DIRTY, ZERO]
                .into_iter()
                .find_map(|set| self.find_in(env, set, want, exhaustive))
        })
    }

    /// Takes `pages` pages starting at an `align`-aligned address (a power of two) out of
    /// the free spans; returns the first page and whether they read as zeros. When nothing
    /// fits, purges every dirty span (merging it with its zero neighbours) and looks again.
    fn take<B: Backing>(
        &mut self,
        env: &Env<'_, B>,
        pages: u32,
        align: usize,
    ) -> Option<(u32, bool)> {
        let want = Want { pages, align };
        let (s, a) = self.find(env, want).or_else(|| {
            self.purge_dirty(env);
            self.find_in(env, ZERO, want, true)
        })?;
        let (len, zero) = (env.page(s).x(), env.page(s).zero());
        self.unlink(env, s);
        if a > s {
            self.push(env, s, a - s, zero);
        }
        let (end, span_end) = (a + pages, s + len);
        if span_end > end {
            self.push(env, end, span_end - end, zero);
        }
        self.high_water = self.high_water.max(end);
        self.pages_in_use += pages as usize;
        Some((a, zero))
    }

    /// Purges every dirty free span, so that free memory is as contiguous as it can be.
    /// Runs only when an allocation found no room, on its way to failing.
    fn purge_dirty<B: Backing>(&mut self, env: &Env<'_, B>) {
        while let Some(bin) = self.bins[DIRTY].next_nonempty(0) {
            let s = self.bins[DIRTY].heads[bin];
            let n = env.page(s).x();
            self.unlink(env, s);
            if !self.purge(env, s, n) {
                self.push(env, s, n, false);
                return;
            }
        }
    }

    /// Purges the free span `s..s + n` (in no bin); if the backing did, merges it with its
    /// zero neighbours into a zero span. Returns whether it did.
    fn purge<B: Backing>(&mut self, env: &Env<'_, B>, s: u32, n: u32) -> bool {
        let len = (n as usize) << PAGE_SHIFT;
        // SAFETY: `s..s + n` is a free span in no bin, inside the region, and the span lock
        // is held: nothing uses it, and nothing can take it until it is pushed.
        let purged = unsafe { env.backing.purge(env.ptr(s), len) };
        if purged {
            self.purged_bytes += len as u64;
            let (s, n) = self.merge(env, s, n, true);
            self.push(env, s, n, true);
        }
        purged
    }

    /// Merges the free span `s..s + n` (in no bin) with its neighbours whose state is `zero`.
    fn merge<B>(&mut self, env: &Env<'_, B>, mut s: u32, mut n: u32, zero: bool) -> (u32, u32) {
        if s > 0 {
            let left = env.page(s - 1);
            let head = match left.kind() {
                Kind::Free => Some(s - 1),
                Kind::FreeTail => Some(left.x()),
                _ => None,
            };
            if let Some(h) = head.filter(|&h| env.page(h).zero() == zero) {
                self.unlink(env, h);
                // The span's head (an object's, before it was freed) and the left span's
                // tail are inside the merged span now: a stale head there would pass for a
                // live object (a second free of it would give away pages in use).
                env.page(s).set(Kind::Unset, 0);
                env.page(s - 1).set(Kind::Unset, 0);
                n += s - h;
                s = h;
            }
        }
        let r = s + n;
        if r < env.npages() {
            let right = env.page(r);
            if right.kind() == Kind::Free && right.zero() == zero {
                let len = right.x();
                self.unlink(env, r);
                right.set(Kind::Unset, 0);
                n += len;
            }
        }
        (s, n)
    }

    /// Gives back the pages `s..s + n`, which nothing uses any more.
    fn release<B: Backing>(&mut self, env: &Env<'_, B>, s: u32, n: u32) {
        self.pages_in_use -= n as usize;
        let (s, n) = self.merge(env, s, n, false);
        if n < PURGE_PAGES || !self.purge(env, s, n) {
            self.push(env, s, n, false);
        }
    }
}

/// What an allocation asks of the span allocator.
#[derive(Clone, Copy)]
struct Want {
    pages: u32,
    /// A power of two; up to a page, every page is aligned.
    align: usize,
}

impl Want {
    /// A length of free span that holds the pages whatever its alignment.
    fn sure_fit(self) -> Option<u32> {
        let extra = (self.align >> PAGE_SHIFT).saturating_sub(1);
        self.pages.checked_add(u32::try_from(extra).ok()?)
    }
}

/// Where the pages `want` asks for would start in the free span `s`, if they fit in it.
fn fit<B>(env: &Env<'_, B>, s: u32, want: Want) -> Option<u32> {
    let start = env.ptr(s).addr();
    let skip = (start.checked_next_multiple_of(want.align)? - start) >> PAGE_SHIFT;
    let a = s.checked_add(u32::try_from(skip).ok()?)?;
    (a.checked_add(want.pages)? <= s + env.page(s).x()).then_some(a)
}

fn mark_large<B>(env: &Env<'_, B>, s: u32, n: u32) {
    env.page(s).set(Kind::Large, n);
    if n > 1 {
        env.page(s + n - 1).set(Kind::LargeTail, s);
    }
}

/// The span allocator: bins of free spans and counters, behind the span lock. Arena locks
/// are taken before it, never after.
pub(crate) struct Spans {
    lock: RawLock,
    state: UnsafeCell<SpanState>,
}

impl Spans {
    pub(crate) const fn new() -> Self {
        Self {
            lock: RawLock::new(),
            state: UnsafeCell::new(SpanState {
                bins: [Bins::new(), Bins::new()],
                pages_in_use: 0,
                large_pages: 0,
                large_objects: 0,
                purged_bytes: 0,
                high_water: 0,
            }),
        }
    }

    pub(crate) fn raw_lock(&self) -> &RawLock {
        &self.lock
    }

    /// Runs `f` on the state with the span lock held.
    fn with<B: Backing, R>(&self, env: &Env<'_, B>, f: impl FnOnce(&mut SpanState) -> R) -> R {
        let _guard = self.lock.guard(env.backing);
        // SAFETY: the span lock is held until `_guard` drops, after `f` returns; the state
        // is only ever reached through this function, so this is its only reference.
        f(unsafe { &mut *self.state.get() })
    }

    /// Makes the whole region one free zero span (the region reads as zeros at first).
    pub(crate) fn init<B: Backing>(&self, env: &Env<'_, B>) {
        self.with(env, |st| st.push(env, 0, env.npages(), true));
    }

    /// A large object of `pages` pages at an `align`-aligned address: its first page, and
    /// whether it reads as zeros.
    pub(crate) fn alloc_large<B: Backing>(
        &self,
        env: &Env<'_, B>,
        pages: u32,
        align: usize,
    ) -> Option<(u32, bool)> {
        self.with(env, |st| {
            let (s, zero) = st.take(env, pages, align)?;
            mark_large(env, s, pages);
            st.large_pages += pages as usize;
            st.large_objects += 1;
            Some((s, zero))
        })
    }

    /// A slab of `pages` pages for `class`, owned by `arena`.
    pub(crate) fn alloc_slab<B: Backing>(
        &self,
        env: &Env<'_, B>,
        pages: u32,
        class: usize,
        arena: usize,
    ) -> Option<(u32, bool)> {
        self.with(env, |st| {
            let (s, zero) = st.take(env, pages, PAGE_SIZE)?;
            env.page(s).set_small(pages, class, arena);
            for p in s + 1..s + pages {
                env.page(p).set(Kind::SmallTail, s);
            }
            Some((s, zero))
        })
    }

    /// Frees the large object starting at page `s`; a page that starts none is ignored.
    /// Returns its length in pages (0 if ignored).
    pub(crate) fn free_large<B: Backing>(&self, env: &Env<'_, B>, s: u32) -> u32 {
        self.with(env, |st| {
            let head = env.page(s);
            if head.kind() != Kind::Large {
                return 0;
            }
            let n = head.x();
            st.large_pages -= n as usize;
            st.large_objects -= 1;
            st.release(env, s, n);
            n
        })
    }

    /// Frees the slab of `n` pages starting at page `s`, which its arena no longer uses.
    pub(crate) fn free_slab<B: Backing>(&self, env: &Env<'_, B>, s: u32, n: u32) {
        self.with(env, |st| st.release(env, s, n));
    }

    /// Resizes the large object at page `s` to `new` pages in place: shrinks it (freeing its
    /// tail) or grows it into the free span after it. Returns whether it did.
    pub(crate) fn resize_large<B: Backing>(&self, env: &Env<'_, B>, s: u32, new: u32) -> bool {
        self.with(env, |st| {
            let head = env.page(s);
            let n = head.x();
            if head.kind() != Kind::Large || new == 0 {
                return false;
            }
            if new <= n {
                mark_large(env, s, new);
                st.large_pages -= (n - new) as usize;
                if new < n {
                    st.release(env, s + new, n - new);
                }
                return true;
            }
            let (r, want) = (s + n, new - n);
            if r >= env.npages() {
                return false;
            }
            let right = env.page(r);
            if right.kind() != Kind::Free || right.x() < want {
                return false;
            }
            let (len, zero) = (right.x(), right.zero());
            st.unlink(env, r);
            if len > want {
                st.push(env, r + want, len - want, zero);
            }
            mark_large(env, s, new);
            st.large_pages += want as usize;
            st.pages_in_use += want as usize;
            st.high_water = st.high_water.max(s + new);
            true
        })
    }

    pub(crate) fn stats<B: Backing>(&self, env: &Env<'_, B>) -> SpanStats {
        self.with(env, |st| SpanStats {
            pages_in_use: st.pages_in_use,
            large_pages: st.large_pages,
            large_objects: st.large_objects,
            purged_bytes: st.purged_bytes,
            high_water: st.high_water,
        })
    }

    /// The free spans, as (first page, length, zero), sorted by first page.
    #[cfg(test)]
    pub(crate) fn free_spans<B: Backing>(
        &self,
        env: &Env<'_, B>,
    ) -> std::vec::Vec<(u32, u32, bool)> {
        self.with(env, |st| {
            let mut out = std::vec::Vec::new();
            for bins in &st.bins {
                for &first in &bins.heads {
                    let mut s = first;
                    while s != NIL {
                        out.push((s, env.page(s).x(), env.page(s).zero()));
                        s = env.page(s).next();
                    }
                }
            }
            out.sort_unstable();
            out
        })
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::vec::Vec;

    use super::*;
    use crate::pagemap::Entry;

    /// Records purges; never touches memory (the region here is a fake address).
    #[derive(Default)]
    struct Recorder {
        purged: RefCell<Vec<(usize, usize)>>,
    }

    // SAFETY: no metadata is ever mapped through it in these tests, and purge says it did
    // nothing that anyone reads (nothing reads the fake region).
    unsafe impl Backing for Recorder {
        fn map_metadata(&self, _len: usize) -> *mut u8 {
            core::ptr::null_mut()
        }
        unsafe fn purge(&self, ptr: *mut u8, len: usize) -> bool {
            self.purged.borrow_mut().push((ptr.addr(), len));
            true
        }
    }

    const BASE: usize = 1 << 40;

    fn setup(npages: usize, backing: &Recorder) -> (Vec<Entry>, Spans) {
        let pages: Vec<Entry> = (0..npages).map(|_| Entry::default()).collect();
        let spans = Spans::new();
        spans.init(&env(&pages, backing));
        (pages, spans)
    }

    fn env<'a>(pages: &'a [Entry], backing: &'a Recorder) -> Env<'a, Recorder> {
        Env {
            pages,
            base: core::ptr::without_provenance_mut(BASE),
            backing,
        }
    }

    #[test]
    fn bins_are_ordered_by_length() {
        assert_eq!(bin_of(1), 0);
        assert_eq!(bin_of(16), 15);
        assert_eq!(bin_of(17), 16);
        assert_eq!(bin_of(u32::MAX), NBINS - 1);
        for len in 2..100_000 {
            assert!(bin_of(len) >= bin_of(len - 1));
        }
    }

    #[test]
    fn freed_spans_merge_back_into_one() {
        let backing = Recorder::default();
        let (pages, spans) = setup(1024, &backing);
        let env = env(&pages, &backing);
        let a = spans.alloc_large(&env, 3, PAGE_SIZE).unwrap();
        let b = spans.alloc_large(&env, 5, PAGE_SIZE).unwrap();
        let c = spans.alloc_large(&env, 2, PAGE_SIZE).unwrap();
        assert_eq!((a, b, c), ((0, true), (3, true), (8, true)));
        assert_eq!(spans.free_large(&env, 0), 3);
        assert_eq!(spans.free_large(&env, 8), 2);
        // Dirty 0..3, taken 3..8, dirty 8..10, zero 10..1024.
        assert_eq!(
            spans.free_spans(&env),
            [(0, 3, false), (8, 2, false), (10, 1014, true)]
        );
        assert_eq!(spans.free_large(&env, 3), 5);
        // 0..10 merged: dirty and shorter than 1 MiB, so not purged.
        assert_eq!(spans.free_spans(&env), [(0, 10, false), (10, 1014, true)]);
        assert!(backing.purged.borrow().is_empty());
        // Dirty first: the next allocation reuses them.
        assert_eq!(spans.alloc_large(&env, 4, PAGE_SIZE), Some((0, false)));
        assert_eq!(spans.stats(&env).high_water, 10);
    }

    #[test]
    fn a_freed_mebibyte_is_purged_and_merged_with_zero_spans() {
        let backing = Recorder::default();
        let (pages, spans) = setup(100, &backing);
        let env = env(&pages, &backing);
        assert_eq!(spans.alloc_large(&env, 20, PAGE_SIZE), Some((0, true)));
        assert_eq!(spans.free_large(&env, 0), 20);
        assert_eq!(*backing.purged.borrow(), [(BASE, 20 * PAGE_SIZE)]);
        assert_eq!(spans.free_spans(&env), [(0, 100, true)]);
        assert_eq!(spans.stats(&env).purged_bytes, 20 * PAGE_SIZE as u64);
        assert_eq!(spans.stats(&env).pages_in_use, 0);
    }

    #[test]
    fn aligned_spans_leave_their_front_free() {
        let backing = Recorder::default();
        let (pages, spans) = setup(100, &backing);
        let env = env(&pages, &backing);
        assert_eq!(spans.alloc_large(&env, 1, PAGE_SIZE), Some((0, true)));
        assert_eq!(spans.alloc_large(&env, 2, 4 * PAGE_SIZE), Some((4, true)));
        assert_eq!(spans.free_spans(&env), [(1, 3, true), (6, 94, true)]);
        assert_eq!(spans.alloc_large(&env, 1, 1 << 40), None);
    }

    #[test]
    fn large_objects_resize_in_place() {
        let backing = Recorder::default();
        let (pages, spans) = setup(100, &backing);
        let env = env(&pages, &backing);
        assert_eq!(spans.alloc_large(&env, 4, PAGE_SIZE), Some((0, true)));
        assert!(spans.resize_large(&env, 0, 10));
        assert_eq!(spans.free_spans(&env), [(10, 90, true)]);
        assert!(spans.resize_large(&env, 0, 2));
        assert_eq!(spans.free_spans(&env), [(2, 8, false), (10, 90, true)]);
        assert_eq!(spans.alloc_large(&env, 1, PAGE_SIZE), Some((2, false)));
        assert!(!spans.resize_large(&env, 0, 3));
        assert!(!spans.resize_large(&env, 1, 3), "not a span start");
        assert_eq!(spans.stats(&env).pages_in_use, 3);
        assert_eq!(spans.stats(&env).large_pages, 3);
    }

    #[test]
    fn no_room_purges_dirty_spans_to_merge_them() {
        let backing = Recorder::default();
        let (pages, spans) = setup(64, &backing);
        let env = env(&pages, &backing);
        assert_eq!(spans.alloc_large(&env, 8, PAGE_SIZE), Some((0, true)));
        assert_eq!(spans.free_large(&env, 0), 8);
        assert_eq!(spans.free_spans(&env), [(0, 8, false), (8, 56, true)]);
        assert!(backing.purged.borrow().is_empty());
        assert_eq!(spans.alloc_large(&env, 60, PAGE_SIZE), Some((0, true)));
        assert_eq!(*backing.purged.borrow(), [(BASE, 8 * PAGE_SIZE)]);
        assert_eq!(spans.free_spans(&env), [(60, 4, true)]);
    }

    #[test]
    fn an_aligned_fit_in_a_short_span_is_found() {
        let backing = Recorder::default();
        let (pages, spans) = setup(8, &backing);
        let env = env(&pages, &backing);
        assert_eq!(spans.alloc_large(&env, 4, PAGE_SIZE), Some((0, true)));
        // 4..8 could not hold 2 pages at every 4-page alignment, but it is aligned.
        assert_eq!(spans.alloc_large(&env, 2, 4 * PAGE_SIZE), Some((4, true)));
        assert_eq!(spans.free_spans(&env), [(6, 2, true)]);
        assert!(backing.purged.borrow().is_empty());
    }

    #[test]
    fn exhaustion_is_none_and_the_last_fit_is_found() {
        let backing = Recorder::default();
        let (pages, spans) = setup(64, &backing);
        let env = env(&pages, &backing);
        assert_eq!(spans.alloc_large(&env, 65, PAGE_SIZE), None);
        assert_eq!(spans.alloc_large(&env, 64, PAGE_SIZE), Some((0, true)));
        assert_eq!(spans.alloc_large(&env, 1, PAGE_SIZE), None);
    }
}
