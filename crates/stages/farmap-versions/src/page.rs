//! Paged chunk maps: what a version holds at each chunk, loaded a page at a time.
//!
//! A whole version does not list its chunks itself: it lists **pages**, one per run of
//! [`PAGE_CHUNKS`] chunks, each named by the SHA-256 of its bytes and stored like a chunk
//! (`chunks/HH/HASH`, compressed when smaller, checked on every read). Opening a version
//! reads its manifest only; a page is read the first time a chunk in it is looked up. So an
//! open costs the same at 1 GiB and at 1 TiB, and a whole version of a big region that
//! changed in a few places writes only the pages that changed: the others are the same
//! objects as before, shared by every version (and every region) that holds them.
//!
//! ```text
//!   a page:   magic "FMPAGE01" | count u32 | count × (offset u32 | hash [32])
//! ```
//!
//! Integers are little-endian; offsets (the chunk's place in its page) ascend and stay below
//! the page's chunk count; no hash is zero (a chunk of zeros is not listed). An empty page is
//! not stored: the manifest names it by [`Hash::ZERO`].
//!
//! An opening holds a version's map as its pages plus an **overlay**: the chunks changed
//! since (the deltas after the whole manifest, its own writes). The pages it read are kept,
//! by hash, for the maps it holds (the version it is on, the base it shares memory with).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use bytes::Bytes;
use farmap_core::{ErrorKind, Geometry, Objects, StoreError, StoreResult};
use parking_lot::Mutex;

use crate::chunk::from_trash;
use crate::{chunk, Hash};

/// Chunks per page in the versions this crate writes: 256 MiB of a region in 64 KiB chunks,
/// a page of at most 144 KiB.
pub const PAGE_CHUNKS: u32 = 4096;

/// The fewest chunks per page a manifest may give.
pub const MIN_PAGE_CHUNKS: u32 = 64;

/// The most chunks per page a manifest may give (a page of at most 2.3 MiB).
pub const MAX_PAGE_CHUNKS: u32 = 1 << 16;

const MAGIC: &[u8; 8] = b"FMPAGE01";
const HEADER: usize = 8 + 4;
const ENTRY: usize = 4 + 32;

/// A whole manifest's reference to one page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PageRef {
    /// The page's hash ([`Hash::ZERO`]: the page lists nothing, and is not stored).
    pub hash: Hash,
    /// Chunks the page lists.
    pub chunks: u32,
}

impl PageRef {
    /// A page that lists nothing.
    pub const EMPTY: PageRef = PageRef {
        hash: Hash::ZERO,
        chunks: 0,
    };
}

/// The pages of a region of `geometry` with `page_chunks` chunks per page.
pub fn page_count(geometry: Geometry, page_chunks: u32) -> u64 {
    geometry.chunk_count().div_ceil(u64::from(page_chunks))
}

/// Whether `page_chunks` is a page size a manifest may give.
pub fn valid_page_chunks(page_chunks: u32) -> bool {
    (MIN_PAGE_CHUNKS..=MAX_PAGE_CHUNKS).contains(&page_chunks) && page_chunks.is_power_of_two()
}

/// One page: `(offset, hash)` of each chunk it lists, ascending.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Page {
    entries: Vec<(u32, Hash)>,
}

impl Page {
    /// A page of `entries` (ascending offsets, no zero hash).
    pub fn new(entries: Vec<(u32, Hash)>) -> Page {
        debug_assert!(entries.windows(2).all(|w| w[0].0 < w[1].0));
        Page { entries }
    }

    /// What it lists.
    pub fn entries(&self) -> &[(u32, Hash)] {
        &self.entries
    }

    /// The content of the chunk at `offset` (`None`: zeros).
    pub fn get(&self, offset: u32) -> Option<Hash> {
        self.entries
            .binary_search_by_key(&offset, |(o, _)| *o)
            .ok()
            .map(|i| self.entries[i].1)
    }

    /// Its bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER + self.entries.len() * ENTRY);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        for (offset, hash) in &self.entries {
            out.extend_from_slice(&offset.to_le_bytes());
            out.extend_from_slice(&hash.0);
        }
        out
    }

    /// Reads a page of a map with `page_chunks` chunks per page, checking every entry.
    /// Nothing is allocated beyond what `bytes` holds.
    pub fn decode(bytes: &[u8], page_chunks: u32) -> StoreResult<Page> {
        let bad = |why: String| {
            StoreError::new(
                ErrorKind::Corrupt,
                format!("a page of a version's chunk map {why}"),
            )
        };
        let rest = bytes
            .strip_prefix(MAGIC)
            .ok_or_else(|| bad("does not start with FMPAGE01".into()))?;
        let (count, rest) = rest
            .split_first_chunk::<4>()
            .ok_or_else(|| bad("is cut short".into()))?;
        let count = u32::from_le_bytes(*count) as usize;
        if count.checked_mul(ENTRY) != Some(rest.len()) {
            return Err(bad(format!(
                "counts {count} entries in {} bytes",
                rest.len()
            )));
        }
        let mut entries: Vec<(u32, Hash)> = Vec::with_capacity(count);
        for e in rest.chunks_exact(ENTRY) {
            let offset = u32::from_le_bytes(e[..4].try_into().expect("4"));
            let hash = Hash(e[4..].try_into().expect("32"));
            if offset >= page_chunks {
                return Err(bad(format!(
                    "lists chunk {offset} of a page of {page_chunks}"
                )));
            }
            if entries.last().is_some_and(|(last, _)| *last >= offset) {
                return Err(bad(format!("lists chunk {offset} out of order")));
            }
            if hash == Hash::ZERO {
                return Err(bad(format!("lists chunk {offset} as zeros")));
            }
            entries.push((offset, hash));
        }
        Ok(Page { entries })
    }

    /// Its reference and stored bytes (`None` when it is empty: not stored).
    pub fn stored(&self) -> (PageRef, Option<Bytes>) {
        if self.entries.is_empty() {
            return (PageRef::EMPTY, None);
        }
        let bytes = self.encode();
        let r = PageRef {
            hash: Hash::of(&bytes),
            chunks: self.entries.len() as u32,
        };
        (r, Some(Bytes::from(chunk::encode(&bytes))))
    }
}

/// The most bytes a page of `page_chunks` chunks takes.
pub fn max_page_len(page_chunks: u32) -> usize {
    HEADER + page_chunks as usize * ENTRY
}

/// The pages an opening has read, by hash, shared by its maps (the version it is on, the
/// base it shares memory with). Pages of neither are dropped at [`retain`](Self::retain).
#[derive(Debug, Default)]
pub(crate) struct PageCache {
    loaded: Mutex<HashMap<Hash, Arc<Page>>>,
    /// Pages kept whatever the version: the base's.
    pinned: Mutex<HashSet<Hash>>,
}

impl PageCache {
    /// Page `hash`, if it was read.
    pub fn get(&self, hash: &Hash) -> Option<Arc<Page>> {
        self.loaded.lock().get(hash).cloned()
    }

    /// Page `hash` (of a map with `page_chunks` chunks per page): the one read already, or
    /// [`read_page`], kept.
    pub async fn load(
        &self,
        objects: &dyn Objects,
        hash: Hash,
        page_chunks: u32,
    ) -> StoreResult<Arc<Page>> {
        if let Some(p) = self.get(&hash) {
            return Ok(p);
        }
        let page = Arc::new(read_page(objects, hash, page_chunks).await?);
        self.loaded.lock().insert(hash, page.clone());
        Ok(page)
    }

    /// Keeps page `hash` whatever [`retain`](Self::retain) is told.
    pub fn pin(&self, hashes: impl IntoIterator<Item = Hash>) {
        self.pinned.lock().extend(hashes);
    }

    /// Drops the pages `map` does not name, but the pinned ones.
    pub fn retain(&self, map: &Map) {
        let named: HashSet<Hash> = map.pages.iter().map(|p| p.hash).collect();
        let pinned = self.pinned.lock();
        self.loaded
            .lock()
            .retain(|h, _| named.contains(h) || pinned.contains(h));
    }
}

/// A version's chunk map: its pages, then the chunks changed since (see the module
/// documentation).
#[derive(Debug, Clone)]
pub(crate) struct Map {
    page_chunks: u32,
    pages: Arc<[PageRef]>,
    /// Chunks changed over the pages ([`Hash::ZERO`]: zeros now).
    overlay: HashMap<u64, Hash>,
}

/// What [`Map::get`] needs read first: a page's hash and its map's chunks per page.
pub(crate) type Missing = (Hash, u32);

impl Map {
    /// The map of a whole manifest of pages.
    pub fn paged(page_chunks: u32, pages: Vec<PageRef>) -> Map {
        Map {
            page_chunks,
            pages: pages.into(),
            overlay: HashMap::new(),
        }
    }

    /// A map holding nothing, for a region of `geometry`.
    pub fn empty(geometry: Geometry) -> Map {
        let n = page_count(geometry, PAGE_CHUNKS) as usize;
        Map::paged(PAGE_CHUNKS, vec![PageRef::EMPTY; n])
    }

    /// A map listing `entries` over no pages (a whole manifest written before pages).
    pub fn of_entries(geometry: Geometry, entries: Vec<(u64, Hash)>) -> Map {
        let mut map = Map::empty(geometry);
        map.overlay.extend(entries);
        map
    }

    /// Applies a delta's `entries`.
    pub fn apply(&mut self, entries: Vec<(u64, Hash)>) {
        self.overlay.extend(entries);
    }

    /// Chunks per page.
    pub fn page_chunks(&self) -> u32 {
        self.page_chunks
    }

    /// Its pages.
    pub fn pages(&self) -> &[PageRef] {
        &self.pages
    }

    /// Its overlay.
    pub fn overlay(&self) -> &HashMap<u64, Hash> {
        &self.overlay
    }

    /// Chunk `idx` holds `hash` now ([`Hash::ZERO`]: zeros).
    pub fn set(&mut self, idx: u64, hash: Hash) {
        self.overlay.insert(idx, hash);
    }

    /// What chunk `idx` holds (`None`: zeros), or the page to read first.
    pub fn get(&self, idx: u64, cache: &PageCache) -> Result<Option<Hash>, Missing> {
        if let Some(h) = self.overlay.get(&idx) {
            return Ok((*h != Hash::ZERO).then_some(*h));
        }
        let pc = u64::from(self.page_chunks);
        let Some(page) = self.pages.get((idx / pc) as usize) else {
            return Ok(None);
        };
        if page.hash == Hash::ZERO {
            return Ok(None);
        }
        match cache.get(&page.hash) {
            Some(p) => Ok(p.get((idx % pc) as u32)),
            None => Err((page.hash, self.page_chunks)),
        }
    }

    /// The pages with the overlay applied: the references of a whole manifest, and the
    /// pages to store first (those that changed and list something), with their hashes.
    /// The new pages are kept in `cache`.
    pub async fn fold(
        &self,
        objects: &dyn Objects,
        cache: &PageCache,
    ) -> StoreResult<(Vec<PageRef>, Vec<(Hash, Bytes)>)> {
        let pc = u64::from(self.page_chunks);
        let mut changed: BTreeMap<usize, Vec<(u32, Hash)>> = BTreeMap::new();
        for (idx, hash) in &self.overlay {
            changed
                .entry((idx / pc) as usize)
                .or_default()
                .push(((idx % pc) as u32, *hash));
        }
        let mut pages = self.pages.to_vec();
        let mut store = Vec::new();
        for (n, changes) in changed {
            let Some(old) = pages.get(n).copied() else {
                continue;
            };
            let mut entries: BTreeMap<u32, Hash> = if old.hash == Hash::ZERO {
                BTreeMap::new()
            } else {
                let page = cache.load(objects, old.hash, self.page_chunks).await?;
                page.entries().iter().copied().collect()
            };
            for (offset, hash) in changes {
                if hash == Hash::ZERO {
                    entries.remove(&offset);
                } else {
                    entries.insert(offset, hash);
                }
            }
            let page = Page::new(entries.into_iter().collect());
            let (r, bytes) = page.stored();
            if let Some(b) = bytes {
                if r != old {
                    store.push((r.hash, b));
                    // The version being written reads it next.
                    cache.loaded.lock().insert(r.hash, Arc::new(page));
                }
            }
            pages[n] = r;
        }
        Ok((pages, store))
    }

    /// After a whole version made of `folded` (its pages, from this map's overlay as it was
    /// then) is written: the map is those pages, and what changed since.
    pub fn folded(&mut self, pages: Arc<[PageRef]>, overlay: &HashMap<u64, Hash>) {
        self.pages = pages;
        self.overlay.retain(|i, h| overlay.get(i) != Some(h));
    }

    /// A SHA-256 of the region's shape, the pages and the overlay: equal for equal maps, and
    /// different (but for a collision) for maps that hold different content.
    pub fn key(&self, geometry: Geometry) -> [u8; 32] {
        let mut overlay: Vec<(&u64, &Hash)> = self.overlay.iter().collect();
        overlay.sort_unstable();
        let mut body = Vec::with_capacity(64 + self.pages.len() * 36 + overlay.len() * 40);
        body.extend_from_slice(b"farmap chunk map 1\0");
        body.extend_from_slice(&geometry.size().to_le_bytes());
        body.extend_from_slice(&geometry.chunk_size().to_le_bytes());
        body.extend_from_slice(&self.page_chunks.to_le_bytes());
        for p in self.pages.iter() {
            body.extend_from_slice(&p.hash.0);
            body.extend_from_slice(&p.chunks.to_le_bytes());
        }
        for (idx, hash) in overlay {
            body.extend_from_slice(&idx.to_le_bytes());
            body.extend_from_slice(&hash.0);
        }
        Hash::of(&body).0
    }
}

/// Reads page `hash` (of a map with `page_chunks` chunks per page) from `objects`, or from
/// the trash when a collector moved it, checking it.
pub(crate) async fn read_page(
    objects: &dyn Objects,
    hash: Hash,
    page_chunks: u32,
) -> StoreResult<Page> {
    let stored = match objects.get(&chunk::key(&hash)).await? {
        Some(b) => Some(b),
        None => from_trash(objects, &hash).await?,
    };
    let stored = stored.ok_or_else(|| {
        StoreError::new(
            ErrorKind::Corrupt,
            format!(
                "page {} of a version's chunk map is missing from {}",
                hash.hex(),
                objects.location()
            ),
        )
    })?;
    let bytes = chunk::decode_within(&stored, max_page_len(page_chunks), &hash)?;
    Page::decode(&bytes, page_chunks)
}

/// What `map` holds at chunk `idx` (`None`: zeros), reading its page when needed.
pub(crate) async fn lookup(
    map: impl Fn() -> Result<Option<Hash>, Missing>,
    objects: &dyn Objects,
    cache: &PageCache,
) -> StoreResult<Option<Hash>> {
    loop {
        match map() {
            Ok(h) => return Ok(h),
            Err((page, page_chunks)) => {
                cache.load(objects, page, page_chunks).await?;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Page {
        Page::new(vec![
            (0, Hash::of(b"a")),
            (7, Hash::of(b"b")),
            (4095, Hash::of(b"c")),
        ])
    }

    #[test]
    fn round_trips_and_finds() {
        let p = sample();
        assert_eq!(Page::decode(&p.encode(), PAGE_CHUNKS).unwrap(), p);
        assert_eq!(p.get(7), Some(Hash::of(b"b")));
        assert_eq!(p.get(8), None);
        assert!(p.encode().len() <= max_page_len(PAGE_CHUNKS));
        assert_eq!(Page::default().stored(), (PageRef::EMPTY, None));
    }

    #[test]
    fn damage_and_lies_are_refused() {
        let bytes = sample().encode();
        for cut in [0, 5, HEADER, bytes.len() - 1] {
            assert!(
                Page::decode(&bytes[..cut], PAGE_CHUNKS).is_err(),
                "cut at {cut}"
            );
        }
        assert!(
            Page::decode(&bytes, 4095).is_err(),
            "offset beyond the page"
        );
        let unordered = Page {
            entries: vec![(7, Hash::of(b"b")), (0, Hash::of(b"a"))],
        };
        assert!(Page::decode(&unordered.encode(), PAGE_CHUNKS).is_err());
        let zero = Page {
            entries: vec![(3, Hash::ZERO)],
        };
        assert!(Page::decode(&zero.encode(), PAGE_CHUNKS).is_err());
        let mut count = bytes.clone();
        count[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Page::decode(&count, PAGE_CHUNKS).is_err());
    }
}
