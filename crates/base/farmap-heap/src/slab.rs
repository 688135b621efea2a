//! [`SlabState`]: which objects of a slab are free, kept outside the region.
//!
//! A slab hands out its objects first through a bump cursor (objects at or after the
//! cursor were never handed out), then from a bitmap of the objects freed since (one bit per
//! object below the cursor, set when free). Bitmap words are cleared as the cursor enters
//! them, so a new slab costs no more than its header. A slab that was a zero span when it
//! was made gives out zeros from its cursor: `calloc` skips its memset there.

use core::cell::UnsafeCell;

use crate::class::MAX_OBJECTS;
use crate::pagemap::NIL;

const WORDS: usize = MAX_OBJECTS / 64;

/// The state of one slab, guarded by the lock of the arena that owns it.
pub(crate) struct SlabState {
    /// Next and previous slab (first pages) in the arena's list of its class, or [`NIL`].
    pub(crate) next: u32,
    pub(crate) prev: u32,
    /// Objects not handed out (free bits set, plus the objects from the cursor on).
    pub(crate) nfree: u32,
    /// Objects handed out by the cursor so far.
    cursor: u32,
    /// Bits set in `bitmap`.
    freed: u32,
    /// No word before this one has a bit set.
    scan: u32,
    /// Objects from the cursor on read as zeros.
    zero: bool,
    bitmap: [u64; WORDS],
}

impl SlabState {
    pub(crate) fn init(&mut self, objects: u32, zero: bool) {
        self.next = NIL;
        self.prev = NIL;
        self.nfree = objects;
        self.cursor = 0;
        self.freed = 0;
        self.scan = 0;
        self.zero = zero;
    }

    /// Takes a free object: its index, and whether it reads as zeros.
    pub(crate) fn take(&mut self, objects: u32) -> Option<(u32, bool)> {
        if self.freed > 0 {
            let mut w = self.scan as usize;
            while self.bitmap[w] == 0 {
                w += 1;
            }
            let bit = self.bitmap[w].trailing_zeros();
            self.bitmap[w] &= !(1 << bit);
            self.scan = w as u32;
            self.freed -= 1;
            self.nfree -= 1;
            return Some((w as u32 * 64 + bit, false));
        }
        if self.cursor >= objects {
            return None;
        }
        let idx = self.cursor;
        if idx.is_multiple_of(64) {
            self.bitmap[idx as usize / 64] = 0;
        }
        self.cursor += 1;
        self.nfree -= 1;
        Some((idx, self.zero))
    }

    /// Puts object `idx` back; false (and nothing done) if it is not handed out.
    pub(crate) fn put(&mut self, idx: u32) -> bool {
        if idx >= self.cursor {
            return false;
        }
        let (w, bit) = (idx as usize / 64, 1u64 << (idx % 64));
        if self.bitmap[w] & bit != 0 {
            return false;
        }
        self.bitmap[w] |= bit;
        self.freed += 1;
        self.nfree += 1;
        self.scan = self.scan.min(w as u32);
        true
    }
}

/// One slab's state in the metadata mapping, indexed by the slab's first page. All zeros
/// (a fresh mapping) is a valid value; [`SlabState::init`] runs before a slab is used.
pub(crate) struct SlabMeta(UnsafeCell<SlabState>);

const _: () = assert!(core::mem::size_of::<SlabMeta>() == 32 + 8 * WORDS);

impl SlabMeta {
    /// The state; only the owner of the slab's arena lock may reach through it.
    pub(crate) fn get(&self) -> *mut SlabState {
        self.0.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slab(objects: u32, zero: bool) -> SlabState {
        let mut s = SlabState {
            next: 7,
            prev: 7,
            nfree: 7,
            cursor: 7,
            freed: 7,
            scan: 7,
            zero: false,
            bitmap: [!0; WORDS],
        };
        s.init(objects, zero);
        s
    }

    #[test]
    fn bumps_then_reuses_freed_objects_lowest_first() {
        let mut s = slab(130, true);
        for i in 0..130 {
            assert_eq!(s.take(130), Some((i, true)));
        }
        assert_eq!(s.take(130), None);
        assert!(s.put(129));
        assert!(s.put(3));
        assert!(!s.put(3), "double free");
        assert_eq!(s.nfree, 2);
        assert_eq!(s.take(130), Some((3, false)));
        assert_eq!(s.take(130), Some((129, false)));
        assert_eq!(s.take(130), None);
        assert_eq!(s.nfree, 0);
    }

    #[test]
    fn stale_bits_from_an_earlier_slab_are_ignored() {
        let mut s = slab(4096, false);
        assert!(!s.put(0), "never handed out");
        assert_eq!(s.take(4096), Some((0, false)));
        assert_eq!(s.take(4096), Some((1, false)));
        assert!(s.put(1));
        assert_eq!(s.take(4096), Some((1, false)));
        assert_eq!(s.take(4096), Some((2, false)));
    }
}
