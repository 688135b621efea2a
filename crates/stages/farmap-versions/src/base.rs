//! What an opening shares in memory with other openings of the same content on one host
//! ([`MemoryBase`]): forks of one version, or openings of one version, keep one copy of each
//! clean chunk when they are mapped as userfaultfd regions.
//!
//! The base of an opening is the version its region was forked from, or, for a region that
//! was not forked, the version it opened. Its key is the SHA-256 of the base's shape and
//! chunk list, so that every opening whose base holds the same chunks gets the same key,
//! whatever it is called.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use farmap_core::{ChunkIdx, Geometry, MemoryBase, Objects, StoreResult};

use crate::history::{load, manifest};
use crate::Hash;

/// What an opening reads at a chunk now (`None`: zeros).
pub(crate) type Lookup = Arc<dyn Fn(u64) -> Option<Hash> + Send + Sync>;

/// The base of one opening (see the module documentation).
pub(crate) struct Base {
    key: [u8; 32],
    /// The base's chunks that hold data.
    chunks: HashMap<u64, Hash>,
    /// What the opening reads now.
    now: Lookup,
}

impl Base {
    /// The base of an opening of `region` that reads `opened` (its chunks when it asks,
    /// before it writes anything: the base when it is not a fork) and `now` as it goes on.
    pub async fn of(
        objects: &dyn Objects,
        region: &str,
        geometry: Geometry,
        opened: impl FnOnce() -> HashMap<u64, Hash>,
        now: Lookup,
    ) -> StoreResult<Base> {
        let first = manifest(objects, region, 0).await?;
        let chunks = match &first.from {
            Some(parent) => load(objects, &parent.region, parent.seq).await?.1,
            None => opened(),
        };
        Ok(Base {
            key: key(geometry, &chunks),
            chunks,
            now,
        })
    }
}

/// The SHA-256 of a base's shape and chunk list.
fn key(geometry: Geometry, chunks: &HashMap<u64, Hash>) -> [u8; 32] {
    let mut list: Vec<(&u64, &Hash)> = chunks.iter().collect();
    list.sort_unstable();
    let mut body = Vec::with_capacity(32 + list.len() * 40);
    body.extend_from_slice(b"farmap memory base 1\0");
    body.extend_from_slice(&geometry.size().to_le_bytes());
    body.extend_from_slice(&geometry.chunk_size().to_le_bytes());
    for (idx, hash) in list {
        body.extend_from_slice(&idx.to_le_bytes());
        body.extend_from_slice(&hash.0);
    }
    Hash::of(&body).0
}

impl MemoryBase for Base {
    fn key(&self) -> [u8; 32] {
        self.key
    }

    fn is_base(&self, idx: ChunkIdx) -> bool {
        let Some(base) = self.chunks.get(&idx.0) else {
            return false;
        };
        (self.now)(idx.0).as_ref() == Some(base)
    }

    fn check(&self, idx: ChunkIdx, data: &[u8]) -> bool {
        self.chunks
            .get(&idx.0)
            .is_some_and(|base| Hash::of(data) == *base)
    }
}

impl fmt::Debug for Base {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Base")
            .field("key", &Hash(self.key))
            .field("chunks", &self.chunks.len())
            .finish()
    }
}
