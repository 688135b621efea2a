//! [`LiveView`]: a live region as a read-only [`Store`] whose chunks are its pages, for the
//! seeder's data plane; and [`MigrationStore`], the store under the leecher's region.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use farmap_core::{
    BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, Store, StoreError,
    StoreResult,
};
use farmap_net::RemoteStore;
use farmap_store::MemoryStore;
use farmap_uffd::Region;
use parking_lot::{Mutex, RwLock};

/// The seeder's region seen as a store of page-sized chunks: `read` copies the page out of
/// the region's memory as it is now (the application may be writing it: a torn copy is
/// reported by the next dirty set). Writes and trims are refused.
///
/// Pages as chunks let the leecher fetch exactly the pages that changed, whatever the
/// region's chunk size (bulk pulls batch many pages per request).
pub struct LiveView {
    region: Arc<Region>,
    geometry: Geometry,
}

impl LiveView {
    /// A view of `region`.
    pub fn new(region: Arc<Region>) -> Self {
        let geometry = Geometry::new(region.len() as u64, region.page_size() as u64)
            .expect("a region's size is a multiple of its page size");
        Self { region, geometry }
    }
}

impl fmt::Debug for LiveView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LiveView")
            .field("geometry", &self.geometry)
            .finish()
    }
}

impl Store for LiveView {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn caps(&self) -> Caps {
        Caps::PARALLEL
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            self.geometry.check_idx(idx)?;
            let mut buf = vec![0u8; self.geometry.chunk_len(idx)];
            // A page of a live region is present (or is fetched by the region's own threads):
            // the copy is a memcpy, done inline.
            self.region
                .read_at(self.geometry.offset_of(idx) as usize, &mut buf)
                .map_err(|e| StoreError::new(ErrorKind::Closed, format!("reading {idx}: {e}")))?;
            Ok(Bytes::from(buf))
        })
    }

    fn write(&self, idx: ChunkIdx, _data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            Err(StoreError::new(
                ErrorKind::ReadOnly,
                format!("writing {idx}: a migrating region is read-only to its leecher"),
            ))
        })
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async { Ok(()) })
    }

    fn trim(&self, _range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async {
            Err(StoreError::new(
                ErrorKind::ReadOnly,
                "a migrating region is read-only to its leecher",
            ))
        })
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        Box::pin(async move {
            self.geometry.check_idx(idx)?;
            Ok(ChunkStatus::Unknown)
        })
    }
}

/// The store under the leecher's region: while migrating, chunks come from the seeder's
/// data plane (a [`RemoteStore`] of pages); once complete, it is [`detach`](Self::detach)ed
/// and becomes a local memory store, so the region no longer depends on the old seeder.
///
/// Chunks whose pages were partly discarded (a dirty round) are fetched page by page: only
/// the discarded pages are read from the seeder, the others are returned as zeros, which the
/// region's install skips because those pages are present (an install only fills missing
/// pages).
pub struct MigrationStore {
    geometry: Geometry,
    page: u64,
    remote: RwLock<Option<Arc<RemoteStore>>>,
    local: MemoryStore,
    partial: Mutex<HashMap<u64, Vec<u64>>>,
    staged: Mutex<HashMap<u64, Bytes>>,
    postcopy: AtomicBool,
    bytes_pre: AtomicU64,
    bytes_post: AtomicU64,
}

impl fmt::Debug for MigrationStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MigrationStore")
            .field("geometry", &self.geometry)
            .field("attached", &self.remote.read().is_some())
            .finish()
    }
}

impl MigrationStore {
    /// A store of `geometry` reading pages of `page` bytes from `remote`.
    pub fn new(geometry: Geometry, page: u64, remote: Arc<RemoteStore>) -> Self {
        Self {
            geometry,
            page,
            remote: RwLock::new(Some(remote)),
            local: MemoryStore::new(geometry),
            partial: Mutex::new(HashMap::new()),
            staged: Mutex::new(HashMap::new()),
            postcopy: AtomicBool::new(false),
            bytes_pre: AtomicU64::new(0),
            bytes_post: AtomicU64::new(0),
        }
    }

    /// Notes pages about to be discarded: their chunks' next fetch reads only those pages.
    /// Pages of chunks never fetched are fetched whole anyway. Pages staged before are
    /// dropped (they may be older than the discard).
    pub fn note_discarded(&self, runs: &[std::ops::Range<u64>]) {
        let per_chunk = self.geometry.chunk_size() as u64 / self.page;
        let mut partial = self.partial.lock();
        let mut staged = self.staged.lock();
        for r in runs {
            for p in r.clone() {
                partial.entry(p / per_chunk).or_default().push(p);
                staged.remove(&p);
            }
        }
    }

    /// Reads `pages` from the seeder in as few requests as the data plane allows (all in
    /// flight at once) and keeps them for the next fetch of their chunks, which then needs
    /// no round trip. The caller installs them at once ([`Region::fetch_chunks`]) and then
    /// calls [`unstage`](Self::unstage): staged data is only as fresh as its read.
    ///
    /// [`Region::fetch_chunks`]: farmap_uffd::Region::fetch_chunks
    pub async fn stage(&self, pages: &[u64]) -> StoreResult<()> {
        let Some(remote) = self.remote() else {
            return Ok(());
        };
        let idx: Vec<ChunkIdx> = pages.iter().map(|p| ChunkIdx(*p)).collect();
        let data = remote.read_many(&idx).await?;
        let n: u64 = data.iter().map(|d| d.len() as u64).sum();
        self.count(n);
        let mut staged = self.staged.lock();
        for (p, d) in pages.iter().zip(data) {
            staged.insert(*p, d);
        }
        Ok(())
    }

    /// Reads `pages` from the seeder (all requests in flight at once), counted like fetches.
    pub async fn read_pages(&self, pages: &[u64]) -> StoreResult<Vec<Bytes>> {
        let Some(remote) = self.remote() else {
            return Err(StoreError::new(
                ErrorKind::Closed,
                "the migration store is detached from its seeder",
            ));
        };
        let idx: Vec<ChunkIdx> = pages.iter().map(|p| ChunkIdx(*p)).collect();
        let data = remote.read_many(&idx).await?;
        self.count(data.iter().map(|d| d.len() as u64).sum());
        Ok(data)
    }

    /// Drops staged pages that no fetch used.
    pub fn unstage(&self, pages: &[u64]) {
        let mut staged = self.staged.lock();
        for p in pages {
            staged.remove(p);
        }
    }

    fn count(&self, n: u64) {
        let counter = if self.postcopy.load(Ordering::Acquire) {
            &self.bytes_post
        } else {
            &self.bytes_pre
        };
        counter.fetch_add(n, Ordering::AcqRel);
    }

    /// From now on, fetched bytes count as post-copy.
    pub fn start_postcopy(&self) {
        self.postcopy.store(true, Ordering::Release);
    }

    /// Bytes fetched before and after the hand-over.
    pub fn bytes(&self) -> (u64, u64) {
        (
            self.bytes_pre.load(Ordering::Acquire),
            self.bytes_post.load(Ordering::Acquire),
        )
    }

    /// The remote, while attached.
    pub fn remote(&self) -> Option<Arc<RemoteStore>> {
        self.remote.read().clone()
    }

    /// Detaches from the seeder: reads are local from now on (the region holds every chunk).
    pub fn detach(&self) {
        if let Some(r) = self.remote.write().take() {
            r.close();
        }
    }

    async fn fetch(&self, idx: ChunkIdx) -> StoreResult<Bytes> {
        let Some(remote) = self.remote() else {
            return self.local.read(idx).await;
        };
        let per_chunk = self.geometry.chunk_size() as u64 / self.page;
        let first = self.geometry.offset_of(idx) / self.page;
        let len = self.geometry.chunk_len(idx);
        let pages: Vec<u64> = match self.partial.lock().remove(&idx.0) {
            Some(mut p) => {
                p.sort_unstable();
                p.dedup();
                p
            }
            None => (first..first + (len as u64 / self.page).min(per_chunk)).collect(),
        };
        let local: Option<Vec<Bytes>> = {
            let mut staged = self.staged.lock();
            if pages.iter().all(|p| staged.contains_key(p)) {
                Some(pages.iter().filter_map(|p| staged.remove(p)).collect())
            } else {
                None
            }
        };
        let from_remote = local.is_none();
        let data = match local {
            Some(d) => Ok(d),
            None => {
                remote
                    .read_many(&pages.iter().map(|p| ChunkIdx(*p)).collect::<Vec<_>>())
                    .await
            }
        };
        let data = match data {
            Ok(d) => d,
            Err(e) => {
                // Put the pages back for the retry.
                if pages.len() as u64 != per_chunk {
                    self.partial.lock().entry(idx.0).or_default().extend(pages);
                }
                return Err(e);
            }
        };
        let mut out = BytesMut::zeroed(len);
        let mut n = 0;
        for (p, d) in pages.iter().zip(data) {
            let at = ((p - first) * self.page) as usize;
            out[at..at + d.len()].copy_from_slice(&d);
            n += d.len() as u64;
        }
        if from_remote {
            self.count(n);
        }
        Ok(out.freeze())
    }
}

impl Store for MigrationStore {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn caps(&self) -> Caps {
        Caps::WRITE | Caps::PARALLEL
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            self.geometry.check_idx(idx)?;
            self.fetch(idx).await
        })
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        // Pushes of the region (at its sync) land locally: the seeder is read-only.
        self.local.write(idx, data)
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        self.local.flush()
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        self.local.trim(range)
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        Box::pin(async move {
            self.geometry.check_idx(idx)?;
            Ok(ChunkStatus::Unknown)
        })
    }
}
