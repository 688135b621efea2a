//! A sparse in-memory store: only written chunks use memory.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::ops::Range;

use bytes::Bytes;
use farmap_core::{
    zero_chunk, BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, Geometry, Store, StoreResult,
};
use parking_lot::RwLock;

/// log2 of the number of shards.
const SHARD_BITS: u32 = 6;
/// Number of shards; chunk `i` lives in shard `i % SHARDS` under key `i / SHARDS`, so
/// neighbouring chunks (what sequential readers touch) land in different shards.
const SHARDS: u64 = 1 << SHARD_BITS;

type Shard = RwLock<HashMap<u64, Bytes, KeyHasherBuilder>>;

/// A sparse in-memory store: a map from chunk index to the `Bytes` last written there.
///
/// Only written chunks use memory; a chunk never written (or trimmed) reads as a shared static
/// zero chunk, without allocation. A write keeps the `Bytes` it is given (no copy: a slice of a
/// larger buffer keeps that buffer alive) and a read returns a clone of it (a reference count
/// increment), which makes this the store for benchmarks of everything above the store.
///
/// # Concurrency
/// - 64 shards, each a `parking_lot::RwLock<HashMap>`; chunk `i` is in shard `i % 64`. A read
///   holds its shard's read lock only for the map look-up and the `Bytes` clone.
/// - Reads of any chunks run in parallel; a write or trim excludes only the chunks of the same
///   shard, and only for the map update.
/// - A write replaces a chunk whole: readers see the old or the new `Bytes`, never a mix.
pub struct MemoryStore {
    geometry: Geometry,
    shards: Box<[Shard]>,
}

impl MemoryStore {
    /// An empty store (every chunk reads as zeros) of the given geometry.
    pub fn new(geometry: Geometry) -> Self {
        let hasher = KeyHasherBuilder::new();
        Self {
            geometry,
            shards: (0..SHARDS)
                .map(|_| RwLock::new(HashMap::with_hasher(hasher.clone())))
                .collect(),
        }
    }

    /// Number of chunks that hold written data (trimmed chunks are not counted).
    pub fn allocated_chunks(&self) -> u64 {
        self.shards.iter().map(|s| s.read().len() as u64).sum()
    }

    /// The shard of chunk `idx` and its key within that shard.
    fn locate(&self, idx: ChunkIdx) -> (&Shard, u64) {
        (&self.shards[(idx.0 % SHARDS) as usize], idx.0 >> SHARD_BITS)
    }
}

/// The keys of shard `shard` whose chunks lie in `range`.
fn keys_in(range: ChunkRange, shard: u64) -> Range<u64> {
    // Chunks below `x` in shard `s` are those with keys `0..(x + SHARDS - 1 - s) / SHARDS`.
    let below = |x: u64| (x + (SHARDS - 1) - shard) / SHARDS;
    below(range.start.0)..below(range.end.0)
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("geometry", &self.geometry)
            .field("allocated_chunks", &self.allocated_chunks())
            .finish()
    }
}

impl Store for MemoryStore {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn caps(&self) -> Caps {
        Caps::WRITE | Caps::TRIM | Caps::STATUS | Caps::PARALLEL
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            self.geometry.check_idx(idx)?;
            let (shard, key) = self.locate(idx);
            let hit = shard.read().get(&key).cloned();
            Ok(hit.unwrap_or_else(|| zero_chunk(self.geometry.chunk_len(idx))))
        })
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            self.geometry.check_write(idx, data.len())?;
            let (shard, key) = self.locate(idx);
            let old = shard.write().insert(key, data);
            // The replaced chunk, if this was its last reference, is freed here, after the
            // shard lock is released.
            drop(old);
            Ok(())
        })
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async { Ok(()) })
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            self.geometry.check_range(range)?;
            if range.is_empty() {
                return Ok(());
            }
            for (s, shard) in (0..SHARDS).zip(self.shards.iter()) {
                let keys = keys_in(range, s);
                let mut map = shard.write();
                // Visit whichever is smaller: the keys of the range or the entries present
                // (a trim of a whole large region must not cost one probe per chunk).
                if (map.len() as u64) < keys.end - keys.start {
                    map.retain(|k, _| !keys.contains(k));
                } else {
                    for k in keys {
                        map.remove(&k);
                    }
                }
                // Give table memory back once most of it is unused.
                if map.capacity() > 64 && map.capacity() > 4 * map.len() {
                    map.shrink_to_fit();
                }
            }
            Ok(())
        })
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        Box::pin(async move {
            self.geometry.check_idx(idx)?;
            let (shard, key) = self.locate(idx);
            Ok(ChunkStatus::data_if(shard.read().contains_key(&key)))
        })
    }
}

/// Builds [`KeyHasher`]s with a per-store random seed.
#[derive(Clone)]
struct KeyHasherBuilder {
    seed: u64,
}

impl KeyHasherBuilder {
    fn new() -> Self {
        // The standard library's random keys, folded to one word: no dependency on `rand`.
        Self {
            seed: RandomState::new().hash_one(0x6661_726d_6170_u64),
        }
    }
}

impl BuildHasher for KeyHasherBuilder {
    type Hasher = KeyHasher;
    fn build_hasher(&self) -> KeyHasher {
        KeyHasher(self.seed)
    }
}

/// A hasher for `u64` keys: one seeded folded multiply (the full 128-bit product's halves
/// XORed), much cheaper than SipHash on the read path while still spreading dense or strided
/// keys over both the low bits (bucket) and the high bits (tag) that `HashMap` uses.
struct KeyHasher(u64);

/// An odd constant with well mixed bits (2^64 / golden ratio).
const MIX: u64 = 0x9e37_79b9_7f4a_7c15;

impl Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used by `u64` keys; this keeps the hasher correct for any key.
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, v: u64) {
        let p = u128::from(v ^ self.0) * u128::from(MIX);
        self.0 = (p as u64) ^ ((p >> 64) as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn geometry() -> Geometry {
        Geometry::new(1000 * 4096, 4096).unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn memory_store_conforms() {
        farmap_testkit::run_conformance(|g| async move {
            Arc::new(MemoryStore::new(g)) as Arc<dyn Store>
        })
        .await;
    }

    #[tokio::test]
    async fn only_written_chunks_are_allocated() {
        let s = MemoryStore::new(geometry());
        assert_eq!(s.allocated_chunks(), 0);
        for i in 0..1000 {
            s.read(ChunkIdx(i)).await.unwrap();
        }
        assert_eq!(s.allocated_chunks(), 0, "reads must not allocate chunks");
        for i in [3, 64, 67, 999] {
            s.write(ChunkIdx(i), Bytes::from(vec![7u8; 4096]))
                .await
                .unwrap();
        }
        s.write(ChunkIdx(3), Bytes::from(vec![8u8; 4096]))
            .await
            .unwrap();
        assert_eq!(s.allocated_chunks(), 4, "an overwrite reuses its chunk");
        s.trim(ChunkRange::new(ChunkIdx(60), ChunkIdx(68)))
            .await
            .unwrap();
        assert_eq!(s.allocated_chunks(), 2, "trimmed chunks are freed");
        assert_eq!(s.status(ChunkIdx(64)).await.unwrap(), ChunkStatus::Zero);
        assert_eq!(s.status(ChunkIdx(999)).await.unwrap(), ChunkStatus::Data);
        assert_eq!(&s.read(ChunkIdx(3)).await.unwrap()[..], &[8u8; 4096][..]);
    }

    #[tokio::test]
    async fn writes_are_kept_without_copy() {
        let s = MemoryStore::new(geometry());
        let data = Bytes::from(vec![5u8; 4096]);
        s.write(ChunkIdx(10), data.clone()).await.unwrap();
        let back = s.read(ChunkIdx(10)).await.unwrap();
        assert_eq!(
            back.as_ptr(),
            data.as_ptr(),
            "a read must share the written buffer"
        );
        let zeros = s.read(ChunkIdx(11)).await.unwrap();
        assert_eq!(
            zeros.as_ptr(),
            zero_chunk(4096).as_ptr(),
            "zeros are the static chunk"
        );
    }

    #[tokio::test]
    async fn large_trims_visit_only_present_entries() {
        // A region of 2^40 chunks: a per-chunk trim would never finish.
        let g = Geometry::new(1 << 52, 4096).unwrap();
        let s = MemoryStore::new(g);
        let last = ChunkIdx(g.chunk_count() - 1);
        s.write(last, Bytes::from(vec![1u8; 4096])).await.unwrap();
        s.write(ChunkIdx(5), Bytes::from(vec![1u8; 4096]))
            .await
            .unwrap();
        s.trim(ChunkRange::new(ChunkIdx(6), ChunkIdx(g.chunk_count())))
            .await
            .unwrap();
        assert_eq!(s.allocated_chunks(), 1);
        assert_eq!(s.status(ChunkIdx(5)).await.unwrap(), ChunkStatus::Data);
    }

    #[test]
    fn shard_keys_cover_exactly_the_range() {
        for (start, end) in [(0, 0), (0, 1), (5, 200), (63, 65), (64, 128), (1, 1000)] {
            let range = ChunkRange::new(ChunkIdx(start), ChunkIdx(end));
            let mut seen: Vec<u64> = (0..SHARDS)
                .flat_map(|s| keys_in(range, s).map(move |k| (k << SHARD_BITS) | s))
                .collect();
            seen.sort_unstable();
            assert_eq!(seen, (start..end).collect::<Vec<_>>(), "{start}..{end}");
        }
    }
}
