//! What an opening shares in memory with other openings of the same content on one host
//! ([`MemoryBase`]): forks of one version, or openings of one version, keep one copy of each
//! clean chunk when they are mapped as userfaultfd regions.
//!
//! The base of an opening is the version its region was forked from, or, for a region that
//! was not forked, the version it opened. Its key is the SHA-256 of the base's shape and
//! chunk map (its pages and the deltas over them, see [`Map::key`]), so that every opening
//! of one version (or fork of it) gets the same key, whatever it is called, and openings of
//! different content get different keys. A key costs the pages' count, not the region's.
//!
//! Whether a chunk is the base's is only answered once the pages that say so are read (an
//! opening reads a chunk's page when it first reads the chunk); until then it is not, and
//! the chunk is copied privately: correct, only not shared.

use std::fmt;
use std::sync::Arc;

use farmap_core::{ChunkIdx, Geometry, MemoryBase, Objects, StoreResult};

use crate::history::{load, manifest};
use crate::page::{Map, PageCache};
use crate::Hash;

/// What an opening reads at a chunk now (`Some(None)`: zeros), `None` when the page to say
/// it is not read yet.
pub(crate) type Lookup = Arc<dyn Fn(u64) -> Option<Option<Hash>> + Send + Sync>;

/// The base of one opening (see the module documentation).
pub(crate) struct Base {
    key: [u8; 32],
    /// The base's chunk map.
    map: Map,
    /// The opening's pages (the base's among them).
    pages: Arc<PageCache>,
    /// What the opening reads now.
    now: Lookup,
}

impl Base {
    /// The base of an opening of `region` that reads `opened` (its map when it asks, before
    /// it writes anything: the base when it is not a fork) and `now` as it goes on. The
    /// base's pages are kept in `pages` for as long as the opening lives.
    pub async fn of(
        objects: &dyn Objects,
        region: &str,
        geometry: Geometry,
        opened: impl FnOnce() -> Map,
        now: Lookup,
        pages: Arc<PageCache>,
    ) -> StoreResult<Base> {
        let first = manifest(objects, region, 0).await?;
        let map = match &first.from {
            Some(parent) => load(objects, &parent.region, parent.seq).await?.1,
            None => opened(),
        };
        pages.pin(map.pages().iter().map(|p| p.hash));
        Ok(Base {
            key: map.key(geometry),
            map,
            pages,
            now,
        })
    }

    /// The base's content at `idx`, when its page is read (a chunk of the base is read in
    /// the opening before it is shared: reading it reads its page).
    fn base(&self, idx: u64) -> Option<Hash> {
        self.map.get(idx, &self.pages).ok().flatten()
    }
}

impl MemoryBase for Base {
    fn key(&self) -> [u8; 32] {
        self.key
    }

    fn is_base(&self, idx: ChunkIdx) -> bool {
        let Some(base) = self.base(idx.0) else {
            return false;
        };
        (self.now)(idx.0) == Some(Some(base))
    }

    fn check(&self, idx: ChunkIdx, data: &[u8]) -> bool {
        self.base(idx.0).is_some_and(|base| Hash::of(data) == base)
    }
}

impl fmt::Debug for Base {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Base")
            .field("key", &Hash(self.key))
            .field("pages", &self.map.pages().len())
            .field("overlay", &self.map.overlay().len())
            .finish()
    }
}
