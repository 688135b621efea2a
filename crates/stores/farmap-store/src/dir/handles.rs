//! A bounded cache of open chunk files, closing the least recently used.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::sync::Arc;

use parking_lot::Mutex;

/// Most shards the cache is split into (fewer when the bound is smaller).
const MAX_SHARDS: usize = 16;

/// Open read handles of chunk files, at most `max` of them.
///
/// The cache is split into shards by chunk index (each with its own `Mutex` and an equal part
/// of the bound), so readers of different chunks rarely contend; recency is tracked per shard,
/// which approximates a global LRU. Handles are `Arc`s: one evicted while a reader still uses
/// it is closed when that read finishes, so the number of open files can briefly exceed the
/// bound by the number of reads in flight.
#[derive(Debug)]
pub(super) struct HandleCache {
    shards: Box<[Mutex<Shard>]>,
}

#[derive(Debug, Default)]
struct Shard {
    capacity: usize,
    /// Incremented on every use; the recency stamp of an entry.
    clock: u64,
    /// Chunk index → (handle, stamp of its last use).
    entries: HashMap<u64, (Arc<File>, u64)>,
    /// Stamp → chunk index, oldest first.
    by_age: BTreeMap<u64, u64>,
}

impl HandleCache {
    /// A cache of at most `max` handles; `0` caches nothing.
    pub(super) fn new(max: usize) -> Self {
        let shards = max.min(MAX_SHARDS);
        let capacity = max.checked_div(shards).unwrap_or(0);
        Self {
            shards: (0..shards)
                .map(|_| {
                    Mutex::new(Shard {
                        capacity,
                        ..Shard::default()
                    })
                })
                .collect(),
        }
    }

    fn shard(&self, idx: u64) -> Option<&Mutex<Shard>> {
        let n = self.shards.len() as u64;
        (n > 0).then(|| &self.shards[(idx % n) as usize])
    }

    /// The cached handle of chunk `idx`, marked as just used.
    pub(super) fn get(&self, idx: u64) -> Option<Arc<File>> {
        let mut shard = self.shard(idx)?.lock();
        let shard = &mut *shard;
        let (file, stamp) = shard.entries.get_mut(&idx)?;
        shard.by_age.remove(stamp);
        shard.clock += 1;
        *stamp = shard.clock;
        shard.by_age.insert(shard.clock, idx);
        Some(file.clone())
    }

    /// Caches `file` as chunk `idx`'s handle, closing the least recently used one if full.
    pub(super) fn insert(&self, idx: u64, file: Arc<File>) {
        let Some(shard) = self.shard(idx) else {
            return;
        };
        let mut closed = Vec::new();
        {
            let mut shard = shard.lock();
            let shard = &mut *shard;
            shard.clock += 1;
            if let Some((old, stamp)) = shard.entries.insert(idx, (file, shard.clock)) {
                shard.by_age.remove(&stamp);
                closed.push(old);
            }
            shard.by_age.insert(shard.clock, idx);
            while shard.entries.len() > shard.capacity {
                let (_, oldest) = shard.by_age.pop_first().expect("ages track entries");
                let (old, _) = shard.entries.remove(&oldest).expect("ages track entries");
                closed.push(old);
            }
        }
        // `closed` drops here, outside the lock: closing a file is a system call.
    }

    /// Forgets chunk `idx`'s handle (its file was replaced or removed).
    pub(super) fn remove(&self, idx: u64) {
        let Some(shard) = self.shard(idx) else {
            return;
        };
        let closed = {
            let mut shard = shard.lock();
            let removed = shard.entries.remove(&idx);
            if let Some((_, stamp)) = &removed {
                shard.by_age.remove(stamp);
            }
            removed
        };
        drop(closed);
    }

    /// Number of cached handles.
    pub(super) fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().entries.len()).sum()
    }

    /// The most handles this cache keeps.
    pub(super) fn capacity(&self) -> usize {
        self.shards.iter().map(|s| s.lock().capacity).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle() -> Arc<File> {
        Arc::new(File::open("/dev/null").expect("open /dev/null"))
    }

    #[test]
    fn bound_and_recency() {
        let cache = HandleCache::new(4);
        assert_eq!(cache.capacity(), 4);
        let cache = HandleCache::new(34);
        assert_eq!(
            cache.capacity(),
            32,
            "the bound is never exceeded by rounding"
        );
        // Two shards of two: chunks 0, 2 and 4 share a shard.
        let cache = HandleCache {
            shards: (0..2)
                .map(|_| {
                    Mutex::new(Shard {
                        capacity: 2,
                        ..Shard::default()
                    })
                })
                .collect(),
        };
        cache.insert(0, handle());
        cache.insert(2, handle());
        assert!(cache.get(0).is_some(), "0 is now the most recent");
        cache.insert(4, handle());
        assert!(cache.get(2).is_none(), "2 was the least recently used");
        assert!(cache.get(0).is_some() && cache.get(4).is_some());
        cache.insert(1, handle());
        assert_eq!(cache.len(), 3);
        cache.remove(0);
        assert!(cache.get(0).is_none());
        assert_eq!(cache.len(), 2);
    }

    #[test]
    fn zero_bound_caches_nothing() {
        let cache = HandleCache::new(0);
        cache.insert(1, handle());
        assert!(cache.get(1).is_none());
        assert_eq!(cache.len(), 0);
    }
}
