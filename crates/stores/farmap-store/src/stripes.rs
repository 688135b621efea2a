//! Per-chunk lock striping for the file-backed stores.

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Number of stripes: chunk `i` uses stripe `i % STRIPES`, so any `STRIPES` consecutive
/// chunks use distinct stripes.
pub(crate) const STRIPES: usize = 1024;

/// A fixed array of `RwLock<()>`, one per stripe of chunks: readers of a chunk share its
/// stripe, a writer holds it alone. Never one lock for the whole region.
#[derive(Debug)]
pub(crate) struct Stripes {
    locks: Box<[RwLock<()>]>,
}

impl Stripes {
    pub(crate) fn new() -> Self {
        Self {
            locks: (0..STRIPES).map(|_| RwLock::new(())).collect(),
        }
    }

    fn lock_of(&self, idx: u64) -> &RwLock<()> {
        &self.locks[(idx % STRIPES as u64) as usize]
    }

    /// Shared access to chunk `idx`.
    pub(crate) fn read(&self, idx: u64) -> RwLockReadGuard<'_, ()> {
        self.lock_of(idx).read()
    }

    /// Exclusive access to chunk `idx`.
    pub(crate) fn write(&self, idx: u64) -> RwLockWriteGuard<'_, ()> {
        self.lock_of(idx).write()
    }

    /// Exclusive access to the chunks `start..end`, which must span at most [`STRIPES`]
    /// chunks. Stripes are taken in ascending stripe order, so two callers locking
    /// overlapping batches cannot deadlock (single-chunk lockers hold one stripe only).
    pub(crate) fn write_batch(&self, start: u64, end: u64) -> Vec<RwLockWriteGuard<'_, ()>> {
        debug_assert!(end - start <= STRIPES as u64);
        let mut stripes: Vec<usize> = (start..end)
            .map(|i| (i % STRIPES as u64) as usize)
            .collect();
        stripes.sort_unstable();
        stripes.into_iter().map(|s| self.locks[s].write()).collect()
    }
}
