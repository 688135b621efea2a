//! [`LiveView`]: a live region as a read-only [`Store`] whose chunks are its pages, for the
//! seeder's data plane; and [`MigrationStore`], the store under the leecher's region.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use farmap_core::{
    zero_chunk, BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, Store,
    StoreError, StoreResult, MAX_CHUNK_SIZE,
};
use farmap_net::wire::RunData;
use farmap_net::{RemoteStore, RunReader};
use farmap_store::MemoryStore;
use farmap_uffd::Region;
use futures::future::try_join_all;
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
        // A region's geometry is valid with its chunk size, and its page size is a power of
        // two no larger than its chunks: the same size in pages is valid too.
        let geometry = Geometry::new(region.len() as u64, region.page_size() as u64)
            .unwrap_or_else(|_| region.geometry());
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

impl RunReader for LiveView {
    /// One copy of the run's pages out of the region's memory into one buffer (the server
    /// finds the zero pages in it and sends the rest as slices of it).
    fn read_run(&self, start: ChunkIdx, count: u32) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            let g = self.geometry;
            let end = start.0.saturating_add(u64::from(count));
            if count == 0 || end > g.chunk_count() {
                return Err(StoreError::new(
                    ErrorKind::OutOfRange,
                    format!(
                        "pages {}..{end} reach past the region's {} pages",
                        start.0,
                        g.chunk_count()
                    ),
                ));
            }
            let offset = g.offset_of(start) as usize;
            let last = ChunkIdx(end - 1);
            let len = (g.offset_of(last) + g.chunk_len(last) as u64) as usize - offset;
            let region = self.region.clone();
            let what = move || format!("reading pages {}..{end}", start.0);
            // As in `read`: memory whose chunks are present is copied here, the rest (which
            // may fault and wait for the region's store) on a blocking thread.
            if region.holds(offset, len) {
                return region
                    .read_vec_at(offset, len)
                    .map(Bytes::from)
                    .map_err(|e| StoreError::new(ErrorKind::Closed, what()).with_source(e));
            }
            tokio::task::spawn_blocking(move || region.read_vec_at(offset, len).map(Bytes::from))
                .await
                .map_err(|e| StoreError::new(ErrorKind::Io, what()).with_source(e))?
                .map_err(|e| StoreError::new(ErrorKind::Closed, what()).with_source(e))
        })
    }
}

/// The [`Store`] methods but `read` of a migrating view (a region's [`LiveView`], a mount's
/// page view: `$what`), written inside its `impl Store`: the view has a field `geometry`;
/// the leecher only reads; status is unknown (every page is sent as it is).
macro_rules! read_only_view {
    ($what:literal) => {
        fn geometry(&self) -> farmap_core::Geometry {
            self.geometry
        }

        fn caps(&self) -> farmap_core::Caps {
            farmap_core::Caps::PARALLEL
        }

        fn write(
            &self,
            idx: farmap_core::ChunkIdx,
            _data: bytes::Bytes,
        ) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<()>> {
            Box::pin(async move {
                Err(farmap_core::StoreError::new(
                    farmap_core::ErrorKind::ReadOnly,
                    format!(
                        "writing {idx}: a migrating {} is read-only to its leecher",
                        $what
                    ),
                ))
            })
        }

        fn flush(&self) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<()>> {
            Box::pin(async { Ok(()) })
        }

        fn trim(
            &self,
            _range: farmap_core::ChunkRange,
        ) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<()>> {
            Box::pin(async move {
                Err(farmap_core::StoreError::new(
                    farmap_core::ErrorKind::ReadOnly,
                    format!("a migrating {} is read-only to its leecher", $what),
                ))
            })
        }

        fn status(
            &self,
            idx: farmap_core::ChunkIdx,
        ) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<farmap_core::ChunkStatus>> {
            Box::pin(async move {
                self.geometry.check_idx(idx)?;
                Ok(farmap_core::ChunkStatus::Unknown)
            })
        }
    };
}
pub(crate) use read_only_view;

impl Store for LiveView {
    read_only_view!("region");

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            self.geometry.check_idx(idx)?;
            let (region, len) = (self.region.clone(), self.geometry.chunk_len(idx));
            let offset = self.geometry.offset_of(idx) as usize;
            // Reading region memory can fault (a page not yet fetched from the region's own
            // store waits for it): such a copy runs on a blocking thread, never on the data
            // plane's workers. A page whose chunk is present is copied here: a thread
            // hand-off per 4 KiB page would cost more than the copy (it tripled the time of a
            // 1 GiB migration).
            if region.holds(offset, len) {
                return region
                    .read_vec_at(offset, len)
                    .map(Bytes::from)
                    .map_err(|e| {
                        StoreError::new(ErrorKind::Closed, format!("reading {idx}")).with_source(e)
                    });
            }
            tokio::task::spawn_blocking(move || region.read_vec_at(offset, len).map(Bytes::from))
                .await
                .map_err(|e| {
                    StoreError::new(ErrorKind::Io, format!("reading {idx}")).with_source(e)
                })?
                .map_err(|e| {
                    StoreError::new(ErrorKind::Closed, format!("reading {idx}")).with_source(e)
                })
        })
    }
}

/// One chunk's pages as the leecher's store knows them.
///
/// A chunk with no entry is fetched whole (never fetched, or fetched and not discarded since:
/// then the region holds it and does not ask). A dirty round or the hand-over discards runs
/// of its pages: its next fetch reads only those (`discarded`), and a read-ahead may have
/// `staged` some of its pages so that the fetch needs no round trip.
#[derive(Debug, Default)]
struct ChunkPages {
    /// Runs of its pages discarded since its last fetch (within the chunk).
    discarded: Vec<Range<u64>>,
    /// Pages read ahead for its next fetch.
    staged: BTreeMap<u64, Bytes>,
    /// The whole chunk read ahead (a bulk pull): its next fetch takes it as it is, with no
    /// page-by-page lookup or copy.
    whole: Option<Bytes>,
}

impl ChunkPages {
    fn is_empty(&self) -> bool {
        self.discarded.is_empty() && self.staged.is_empty() && self.whole.is_none()
    }

    /// Drops the staged `pages` (within the chunk) and the whole chunk read ahead.
    fn unstage(&mut self, pages: Range<u64>) {
        let gone: Vec<u64> = self.staged.range(pages).map(|(p, _)| *p).collect();
        for p in gone {
            self.staged.remove(&p);
        }
        self.whole = None;
    }
}

/// The store under the leecher's region: while migrating, chunks come from the seeder's
/// data plane (a [`RemoteStore`] of pages); once complete, it is [`detach`](Self::detach)ed
/// and becomes a local memory store, so the region no longer depends on the old seeder.
///
/// Chunks whose pages were partly discarded (a dirty round) are fetched page by page: only
/// the discarded pages are read from the seeder, the others are returned as zeros, which the
/// region's install skips because those pages are present (an install only fills missing
/// pages). Each chunk's discarded pages are kept as runs within that chunk (never expanded
/// beyond one chunk); every page the seeder sends is checked to be exactly one page.
pub struct MigrationStore {
    geometry: Geometry,
    page: u64,
    remote: RwLock<Option<Arc<RemoteStore>>>,
    local: MemoryStore,
    /// What is known of each chunk beyond "fetch it whole" (chunks with nothing to say have
    /// no entry).
    chunks: Mutex<HashMap<u64, ChunkPages>>,
    postcopy: AtomicBool,
    bytes_pre: AtomicU64,
    bytes_post: AtomicU64,
    /// Instant mode: the shared store and the manifest.
    instant: Option<InstantSide>,
}

/// The instant-mode half of a [`MigrationStore`]: chunks the manifest places in the shared
/// store are read from it and checked; writes go to it.
struct InstantSide {
    shared: Arc<dyn Store>,
    /// Per chunk, where it is. Empty until the manifest.
    manifest: RwLock<Vec<Place>>,
    /// Source chunks read (or read ahead) already: a read-ahead skips them.
    taken: Mutex<Vec<bool>>,
    /// Chunks still pending (not confirmed by the source).
    pending: AtomicU64,
    /// Woken by every confirmation.
    confirmed: tokio::sync::Notify,
    /// Chunks that failed their check and were read from the source instead: the shared
    /// store still holds a bad copy of each.
    failed: Mutex<Vec<ChunkIdx>>,
    from_store: AtomicU64,
    from_source: AtomicU64,
    verify_failures: AtomicU64,
    /// Source chunks read from the seeder (their newest content is here).
    received: Mutex<Vec<bool>>,
    /// Source chunks that, the seeder lost, were read from the shared store instead.
    rolled_back: Mutex<Vec<u64>>,
}

/// Where a chunk of an instant migration is (for a chunk in the store: the XXH3-64 its
/// content must have, if the source knows it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// Only the source holds its newest content.
    Source,
    /// In the shared store, confirmed (or written there by this side).
    Store(Option<u64>),
    /// In the shared store says the manifest, unless the source wrote it since: not read
    /// until a confirmation says which.
    Pending(Option<u64>),
}

/// What an instant migration's destination read from where.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InstantCounts {
    /// Chunks read from the shared store that matched the manifest (or had no checksum).
    pub chunks_from_store: u64,
    /// Chunks read from the source (placed there, or failing their check).
    pub chunks_from_source: u64,
    /// Chunks the shared store returned that did not match the manifest's checksum.
    pub verify_failures: u64,
    /// Chunks that only the source held and that, the source lost after the hand-over,
    /// read as the shared store's last version holds them (see
    /// [`MigrationStore::fall_back_to_shared`]).
    pub chunks_rolled_back: u64,
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
            chunks: Mutex::new(HashMap::new()),
            postcopy: AtomicBool::new(false),
            bytes_pre: AtomicU64::new(0),
            bytes_post: AtomicU64::new(0),
            instant: None,
        }
    }

    /// The same for an instant migration: chunks are read from `shared` (the store both hosts
    /// reach, of the region's geometry) where the manifest says so, checked against it, and
    /// from the seeder otherwise; writes go to `shared`. Until
    /// [`install_manifest`](Self::install_manifest), everything comes from the seeder.
    pub fn instant(
        geometry: Geometry,
        page: u64,
        remote: Arc<RemoteStore>,
        shared: Arc<dyn Store>,
    ) -> StoreResult<Self> {
        if shared.geometry() != geometry {
            return Err(StoreError::invalid(format!(
                "the shared store is {}, the region {geometry}: an instant migration needs the \
                 same geometry on both hosts",
                shared.geometry()
            )));
        }
        let mut s = Self::new(geometry, page, remote);
        s.instant = Some(InstantSide {
            shared,
            manifest: RwLock::new(Vec::new()),
            taken: Mutex::new(Vec::new()),
            pending: AtomicU64::new(0),
            confirmed: tokio::sync::Notify::new(),
            failed: Mutex::new(Vec::new()),
            received: Mutex::new(Vec::new()),
            rolled_back: Mutex::new(Vec::new()),
            from_store: AtomicU64::new(0),
            from_source: AtomicU64::new(0),
            verify_failures: AtomicU64::new(0),
        });
        Ok(s)
    }

    /// Instant mode: the shared store catches up with what the source saved last (see
    /// [`Store::catch_up`]); before the hand-over.
    pub async fn catch_up_shared(&self) -> StoreResult<()> {
        match &self.instant {
            Some(side) => side.shared.catch_up().await,
            None => Ok(()),
        }
    }

    /// Instant mode: makes this host the shared store's one writer (see
    /// [`Store::take_over`]); once the region is here.
    pub async fn take_over_shared(&self) -> StoreResult<()> {
        match &self.instant {
            Some(side) => side.shared.take_over().await,
            None => Ok(()),
        }
    }

    /// Installs a checked manifest (instant mode; ignored otherwise). Every chunk it places
    /// in the store is pending until a [confirmation](Self::apply_confirm) says where it is.
    pub fn install_manifest(&self, m: &crate::machine::Manifest) {
        let Some(side) = &self.instant else { return };
        let mut table = vec![Place::Source; self.geometry.chunk_count() as usize];
        let mut sums = m.pushed.iter();
        let mut pending = 0;
        for r in &m.runs {
            for c in r.chunks.clone() {
                let at = match r.location {
                    crate::msg::Location::Source => Place::Source,
                    crate::msg::Location::Store => {
                        let (gen, sum) = sums.next().copied().unwrap_or((0, 0));
                        pending += 1;
                        Place::Pending((gen != 0).then_some(sum))
                    }
                };
                if let Some(e) = table.get_mut(c as usize) {
                    *e = at;
                }
            }
        }
        *side.taken.lock() = vec![false; table.len()];
        *side.received.lock() = vec![false; table.len()];
        *side.manifest.write() = table;
        side.pending.store(pending, Ordering::Release);
        side.confirmed.notify_waiters();
    }

    /// Applies a checked confirmation (instant mode; ignored otherwise): pending chunks of
    /// `at_source` are at the source, every other pending chunk outside `pending` is where
    /// the manifest said. Costs the runs it confirms, not the region.
    pub fn apply_confirm(&self, c: &crate::machine::Confirm) {
        let Some(side) = &self.instant else { return };
        let mut table = side.manifest.write();
        let n = table.len() as u64;
        let mut settled = 0;
        let mut settle = |table: &mut Vec<Place>, c: u64, source: bool| {
            if let Some(e) = table.get_mut(c as usize) {
                if let Place::Pending(sum) = *e {
                    *e = if source {
                        Place::Source
                    } else {
                        Place::Store(sum)
                    };
                    settled += 1;
                }
            }
        };
        for r in &c.at_source {
            for i in r.start..r.end.min(n) {
                settle(&mut table, i, true);
            }
        }
        let mut at = 0;
        for r in c.pending.iter().chain(std::iter::once(&(n..n))) {
            for i in at..r.start.min(n) {
                settle(&mut table, i, false);
            }
            at = at.max(r.end);
        }
        drop(table);
        let _ = side
            .pending
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| {
                Some(p.saturating_sub(settled))
            });
        side.confirmed.notify_waiters();
    }

    /// Whether every chunk is confirmed (always, outside instant mode).
    pub fn all_confirmed(&self) -> bool {
        self.instant
            .as_ref()
            .is_none_or(|s| s.pending.load(Ordering::Acquire) == 0)
    }

    /// Waits until every chunk is confirmed.
    pub async fn wait_confirmed(&self) {
        let Some(side) = &self.instant else { return };
        loop {
            let notified = side.confirmed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if side.pending.load(Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
    }

    /// Instant mode, once every chunk is confirmed: the chunks at the source and those in
    /// the store, each ascending.
    pub fn instant_places(&self) -> (Vec<ChunkIdx>, Vec<ChunkIdx>) {
        let Some(side) = &self.instant else {
            return Default::default();
        };
        let (mut source, mut store) = (Vec::new(), Vec::new());
        for (i, p) in side.manifest.read().iter().enumerate() {
            match p {
                Place::Source => source.push(ChunkIdx(i as u64)),
                Place::Store(_) | Place::Pending(_) => store.push(ChunkIdx(i as u64)),
            }
        }
        (source, store)
    }

    /// The chunks that failed their check since the last call (read from the source
    /// instead: the shared store still holds a bad copy of each).
    pub fn take_failed(&self) -> Vec<ChunkIdx> {
        self.instant
            .as_ref()
            .map(|s| std::mem::take(&mut *s.failed.lock()))
            .unwrap_or_default()
    }

    /// Before chunk `idx`, at the source, is read: reads it and the next source chunks not
    /// read yet (up to [`SOURCE_READ_AHEAD`]) in one run read and stages them, so that the
    /// faults that follow on a working set find them here instead of making a round trip
    /// each.
    async fn read_ahead_source(&self, side: &InstantSide, idx: ChunkIdx) {
        let per_chunk = self.per_chunk();
        let last = {
            let manifest = side.manifest.read();
            let mut taken = side.taken.lock();
            if taken.get(idx.0 as usize).copied().unwrap_or(true) {
                return;
            }
            let mut last = idx.0;
            taken[idx.0 as usize] = true;
            while last + 1 < manifest.len() as u64
                && last + 1 < idx.0 + SOURCE_READ_AHEAD
                && manifest[(last + 1) as usize] == Place::Source
                && !taken[(last + 1) as usize]
                && !self.chunks.lock().contains_key(&(last + 1))
            {
                last += 1;
                taken[last as usize] = true;
            }
            last
        };
        if last == idx.0 {
            return;
        }
        let pages = self.geometry.size().div_ceil(self.page);
        let run = idx.0 * per_chunk..((last + 1) * per_chunk).min(pages);
        // A failed read-ahead leaves each chunk to its own fetch.
        let _ = self.stage(&[run]).await;
    }

    /// Instant mode, the seeder lost for good after the hand-over: every chunk only the
    /// source held and not received from it yet is read from the shared store from now on,
    /// as its last version holds it (a pending chunk counts as the source's), and the seeder
    /// is let go. Returns those chunks, ascending (they roll back to what the store holds);
    /// empty in other modes.
    pub fn fall_back_to_shared(&self) -> Vec<u64> {
        let Some(side) = &self.instant else {
            return Vec::new();
        };
        let rolled: Vec<u64> = {
            let mut table = side.manifest.write();
            let received = side.received.lock();
            let mut rolled = Vec::new();
            for (i, p) in table.iter_mut().enumerate() {
                if matches!(p, Place::Pending(_)) {
                    *p = Place::Source;
                }
                if matches!(p, Place::Source) && !received.get(i).copied().unwrap_or(false) {
                    rolled.push(i as u64);
                }
            }
            rolled
        };
        side.pending.store(0, Ordering::Release);
        *side.rolled_back.lock() = rolled.clone();
        // Reads of source chunks go to the shared store once the seeder is let go.
        self.detach();
        side.confirmed.notify_waiters();
        rolled
    }

    /// The chunks [`fall_back_to_shared`](Self::fall_back_to_shared) rolled back, ascending.
    pub fn rolled_back(&self) -> Vec<u64> {
        self.instant
            .as_ref()
            .map(|s| s.rolled_back.lock().clone())
            .unwrap_or_default()
    }

    /// What an instant destination read from where (zeros in other modes).
    pub fn instant_counts(&self) -> InstantCounts {
        self.instant
            .as_ref()
            .map(|s| InstantCounts {
                chunks_from_store: s.from_store.load(Ordering::Relaxed),
                chunks_from_source: s.from_source.load(Ordering::Relaxed),
                verify_failures: s.verify_failures.load(Ordering::Relaxed),
                chunks_rolled_back: s.rolled_back.lock().len() as u64,
            })
            .unwrap_or_default()
    }

    /// Reads `idx` in instant mode: from the shared store when the manifest places it there
    /// and it matches, else from the seeder (while attached).
    async fn fetch_instant(&self, side: &InstantSide, idx: ChunkIdx) -> StoreResult<Bytes> {
        let place = Self::confirmed_place(side, idx).await;
        let attached = self.remote.read().is_some();
        let mut failed = false;
        match place {
            Some(Place::Store(expect)) => match side.shared.read(idx).await {
                Ok(data) => {
                    let good = match expect {
                        None => true,
                        Some(sum) => xxhash_rust::xxh3::xxh3_64(&data) == sum,
                    };
                    if good {
                        side.from_store.fetch_add(1, Ordering::Relaxed);
                        return Ok(data);
                    }
                    side.verify_failures.fetch_add(1, Ordering::Relaxed);
                    failed = true;
                    tracing::warn!(
                        "{idx} from the shared store does not match the manifest: reading it \
                         from the source"
                    );
                    if !attached {
                        return Err(StoreError::new(
                            ErrorKind::Corrupt,
                            format!(
                                "{idx} from the shared store does not match the manifest of \
                                 the migration, and the source is released"
                            ),
                        ));
                    }
                }
                Err(e) if attached => tracing::warn!(
                    "reading {idx} from the shared store failed ({}): reading it from the \
                     source",
                    farmap_core::error_chain(&e)
                ),
                Err(e) => return Err(e),
            },
            // At the source (or no manifest yet): from the seeder while attached; once
            // released, the destination pushed it to the shared store.
            Some(Place::Source | Place::Pending(_)) | None if !attached => {
                return side.shared.read(idx).await
            }
            Some(Place::Source | Place::Pending(_)) => self.read_ahead_source(side, idx).await,
            None => {}
        }
        let data = self.fetch(idx).await?;
        side.from_source.fetch_add(1, Ordering::Relaxed);
        if let Some(r) = side.received.lock().get_mut(idx.0 as usize) {
            *r = true;
        }
        if failed {
            side.failed.lock().push(idx);
        }
        Ok(data)
    }

    /// Where `idx` is, once the source has confirmed it (waits while it is pending).
    async fn confirmed_place(side: &InstantSide, idx: ChunkIdx) -> Option<Place> {
        loop {
            let notified = side.confirmed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let place = side.manifest.read().get(idx.0 as usize).copied();
            if !matches!(place, Some(Place::Pending(_))) {
                return place;
            }
            notified.await;
        }
    }

    /// Notes pages about to be discarded: their chunks' next fetch reads only those pages.
    /// Pages of chunks never fetched are fetched whole anyway. Pages staged before are
    /// dropped (they may be older than the discard).
    ///
    /// `runs` are checked runs of the region's pages (see [`crate::msg::check_runs`]); they
    /// are split at chunk boundaries, never expanded page by page.
    pub fn note_discarded(&self, runs: &[Range<u64>]) {
        let per_chunk = self.per_chunk();
        let mut chunks = self.chunks.lock();
        for r in runs {
            for (chunk, pages) in by_chunk(r.clone(), per_chunk) {
                let c = chunks.entry(chunk).or_default();
                c.discarded.push(pages.clone());
                c.unstage(pages);
            }
        }
    }

    fn per_chunk(&self) -> u64 {
        (u64::from(self.geometry.chunk_size()) / self.page).max(1)
    }

    /// Reads `runs` of pages (ascending, disjoint, within the region) from the seeder: run
    /// reads of at most [`RUN_PAGES`] pages (runs shorter than [`MIN_RUN`] pages in batches of
    /// scattered pages), all in flight at once. Zero pages cost no
    /// bytes on the wire (nor in the counts of [`bytes`](Self::bytes)); the others arrive in
    /// one piece per run and are handed out as slices of it, never copied.
    pub async fn read_runs(&self, runs: &[Range<u64>]) -> StoreResult<Vec<Segment>> {
        let Some(remote) = self.remote() else {
            return Err(StoreError::new(
                ErrorKind::Closed,
                "the migration store is detached from its seeder",
            ));
        };
        self.read_runs_from(&remote, runs).await
    }

    async fn read_runs_from(
        &self,
        remote: &RemoteStore,
        runs: &[Range<u64>],
    ) -> StoreResult<Vec<Segment>> {
        let max = u64::from(remote.max_run()).clamp(1, RUN_PAGES);
        let mut reads: Vec<(u64, u32)> = Vec::new();
        // Pages of short runs (scattered writes) go in batches of many pages per request, as
        // a request per page would cost a round of the data plane each.
        let mut scattered: Vec<ChunkIdx> = Vec::new();
        for r in runs {
            if r.end - r.start < MIN_RUN {
                scattered.extend((r.start..r.end).map(ChunkIdx));
                continue;
            }
            let mut at = r.start;
            while at < r.end {
                let n = (r.end - at).min(max);
                reads.push((at, n as u32));
                at += n;
            }
        }
        let (got, pages) = futures::future::try_join(
            try_join_all(
                reads
                    .iter()
                    .map(|(at, n)| remote.read_run(ChunkIdx(*at), *n)),
            ),
            async {
                if scattered.is_empty() {
                    Ok(Vec::new())
                } else {
                    remote.read_many(&scattered).await
                }
            },
        )
        .await?;
        let page = self.page as usize;
        let mut segments = Vec::with_capacity(reads.len() + pages.len());
        let mut bytes = 0u64;
        for ((at, _), run) in reads.iter().zip(got) {
            bytes += run.data_len() as u64;
            self.segments(*at, &run, &mut segments)?;
        }
        if pages.len() != scattered.len() || pages.iter().any(|d| d.len() != page) {
            return Err(StoreError::new(
                ErrorKind::Corrupt,
                format!(
                    "the seeder's data plane answered {} pages of {page} bytes with {} pieces of \
                     other sizes",
                    scattered.len(),
                    pages.len()
                ),
            ));
        }
        for (p, d) in scattered.iter().zip(pages) {
            // Zero pages came as a flag (the remote store gives shared zeros for them).
            let zero = farmap_core::is_zero(&d);
            if !zero {
                bytes += d.len() as u64;
            }
            segments.push(Segment {
                pages: p.0..p.0 + 1,
                data: (!zero).then_some(d),
            });
        }
        segments.sort_by_key(|s| s.pages.start);
        self.count(bytes);
        Ok(segments)
    }

    /// Cuts a run read from page `first` into segments of zero pages and of pages holding
    /// data (each one slice of the run's bytes), checking that its data is whole pages.
    fn segments(&self, first: u64, run: &RunData, out: &mut Vec<Segment>) -> StoreResult<()> {
        let page = self.page as usize;
        let data = run.data();
        let holding = (0..run.count()).filter(|i| !run.is_zero(*i)).count();
        if data.len() != holding * page {
            return Err(StoreError::new(
                ErrorKind::Corrupt,
                format!(
                    "the seeder's data plane answered pages {first}..{} with {} bytes for {holding} \
                     pages of {page} bytes that are not zero",
                    first + run.count() as u64,
                    data.len()
                ),
            ));
        }
        let (mut i, mut at) = (0, 0);
        while i < run.count() {
            let zero = run.is_zero(i);
            let mut j = i + 1;
            while j < run.count() && run.is_zero(j) == zero {
                j += 1;
            }
            let data = (!zero).then(|| {
                let n = (j - i) * page;
                at += n;
                data.slice(at - n..at)
            });
            out.push(Segment {
                pages: first + i as u64..first + j as u64,
                data,
            });
            i = j;
        }
        Ok(())
    }

    /// Reads `runs` of pages (ascending, disjoint, within the region) from the seeder in run
    /// reads (see [`read_runs`](Self::read_runs)) and keeps them for the next fetch of their
    /// chunks, which then needs no round trip: a chunk a run covers whole is kept as one
    /// buffer (a slice of the run's bytes when none of its pages is zero), other pages one by
    /// one. The caller installs them at once ([`Region::fetch_chunks`]) and then calls
    /// [`unstage`](Self::unstage): staged data is only as fresh as its read.
    ///
    /// [`Region::fetch_chunks`]: farmap_uffd::Region::fetch_chunks
    pub async fn stage(&self, runs: &[Range<u64>]) -> StoreResult<()> {
        let Some(remote) = self.remote() else {
            return Ok(());
        };
        let per_chunk = self.per_chunk();
        let page = self.page as usize;
        let segments = split_at_chunks(self.read_runs_from(&remote, runs).await?, per_chunk, page);
        let mut chunks = self.chunks.lock();
        let mut k = 0;
        while k < segments.len() {
            let chunk = segments[k].pages.start / per_chunk;
            let first = chunk * per_chunk;
            let count = self.geometry.check_idx(ChunkIdx(chunk)).map_or(0, |()| {
                self.geometry.chunk_len(ChunkIdx(chunk)) as u64 / self.page
            });
            let mut next = k + 1;
            while next < segments.len() && segments[next].pages.start / per_chunk == chunk {
                next += 1;
            }
            let mine = &segments[k..next];
            k = next;
            let covered = count > 0
                && mine[0].pages.start == first
                && mine[mine.len() - 1].pages.end == first + count
                && mine.windows(2).all(|w| w[0].pages.end == w[1].pages.start);
            // A chunk that came whole and has nothing else staged or discarded is kept whole:
            // its fetch is one lookup, not one per page.
            if covered && chunks.get(&chunk).is_none_or(ChunkPages::is_empty) {
                chunks.entry(chunk).or_default().whole = Some(whole_chunk(mine, first, page));
                continue;
            }
            let c = chunks.entry(chunk).or_default();
            for s in mine {
                for p in s.pages.clone() {
                    let piece = match &s.data {
                        None => zero_chunk(page),
                        Some(d) => {
                            let at = (p - s.pages.start) as usize * page;
                            d.slice(at..at + page)
                        }
                    };
                    c.staged.insert(p, piece);
                }
            }
        }
        Ok(())
    }

    /// Drops staged pages of `runs` that no fetch used.
    pub fn unstage(&self, runs: &[Range<u64>]) {
        let per_chunk = self.per_chunk();
        let mut chunks = self.chunks.lock();
        for r in runs {
            for (chunk, pages) in by_chunk(r.clone(), per_chunk) {
                if let Some(c) = chunks.get_mut(&chunk) {
                    c.unstage(pages);
                    if c.is_empty() {
                        chunks.remove(&chunk);
                    }
                }
            }
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
        let per_chunk = self.per_chunk();
        let first = self.geometry.offset_of(idx) / self.page;
        let len = self.geometry.chunk_len(idx);
        // Take this chunk's discarded runs, and its staged pages if they cover what is needed.
        let (taken, pages, local) = {
            let mut chunks = self.chunks.lock();
            let c = chunks.entry(idx.0).or_default();
            if c.discarded.is_empty() {
                if let Some(whole) = c.whole.take() {
                    if c.is_empty() {
                        chunks.remove(&idx.0);
                    }
                    return Ok(whole);
                }
            }
            let taken = std::mem::take(&mut c.discarded);
            let pages = chunk_pages(&taken, first, len as u64 / self.page, per_chunk);
            let local: Option<Vec<Bytes>> = pages
                .iter()
                .all(|p| c.staged.contains_key(p))
                .then(|| pages.iter().filter_map(|p| c.staged.remove(p)).collect());
            if c.is_empty() {
                chunks.remove(&idx.0);
            }
            (taken, pages, local)
        };
        let local = match local {
            Some(d) => d,
            None => {
                // Runs of the pages wanted, read as run reads: the chunk is one slice of
                // a run when it came whole and none of its pages is zero.
                let runs = ascending_runs(&pages);
                match self.read_runs_from(&remote, &runs).await {
                    Ok(segments) => {
                        let segments = split_at_chunks(segments, per_chunk, self.page as usize);
                        let whole = segments.first().is_some_and(|s| s.pages.start == first)
                            && segments
                                .last()
                                .is_some_and(|s| (s.pages.end - first) * self.page == len as u64)
                            && segments
                                .windows(2)
                                .all(|w| w[0].pages.end == w[1].pages.start);
                        if whole {
                            return Ok(whole_chunk(&segments, first, self.page as usize));
                        }
                        let mut out = BytesMut::zeroed(len);
                        for s in &segments {
                            if let Some(d) = &s.data {
                                let at = (s.pages.start.saturating_sub(first) * self.page) as usize;
                                let Some(dst) = out.get_mut(at..at + d.len()) else {
                                    return Err(StoreError::new(
                                        ErrorKind::Corrupt,
                                        format!("pages {:?} do not fall in {idx}", s.pages),
                                    ));
                                };
                                dst.copy_from_slice(d);
                            }
                        }
                        return Ok(out.freeze());
                    }
                    Err(e) => {
                        // Put the runs back for the retry.
                        if !taken.is_empty() {
                            self.chunks
                                .lock()
                                .entry(idx.0)
                                .or_default()
                                .discarded
                                .extend(taken);
                        }
                        return Err(e);
                    }
                }
            }
        };
        let mut out = BytesMut::zeroed(len);
        for (p, d) in pages.iter().zip(local) {
            let at = (p.saturating_sub(first) * self.page) as usize;
            let Some(dst) = out.get_mut(at..at + d.len()) else {
                return Err(StoreError::new(
                    ErrorKind::Corrupt,
                    format!("page {p} does not fall in {idx}"),
                ));
            };
            dst.copy_from_slice(&d);
        }
        Ok(out.freeze())
    }
}

/// Ascending indices (pages, chunks) as runs.
pub(crate) fn ascending_runs(indices: &[u64]) -> Vec<Range<u64>> {
    let mut runs: Vec<Range<u64>> = Vec::new();
    for p in indices {
        match runs.last_mut() {
            Some(r) if r.end == *p => r.end += 1,
            _ => runs.push(*p..*p + 1),
        }
    }
    runs
}

/// The pages a fetch of a chunk reads: its discarded runs (within the chunk, so at most
/// `per_chunk` pages), or all its `count` pages from `first` when none were discarded.
fn chunk_pages(discarded: &[Range<u64>], first: u64, count: u64, per_chunk: u64) -> Vec<u64> {
    if discarded.is_empty() {
        return (first..first + count.min(per_chunk)).collect();
    }
    let mut p: Vec<u64> = discarded.iter().flat_map(|r| r.clone()).collect();
    p.sort_unstable();
    p.dedup();
    p
}

/// Source chunks an instant destination reads ahead of a fault on one (2 MiB in 64 KiB
/// chunks).
pub const SOURCE_READ_AHEAD: u64 = 32;

/// Pages per run read: a run costs one request and one copy on each side, and a bulk batch
/// of a few MiB still spreads over the data plane's connections.
pub const RUN_PAGES: u64 = 256;

/// Runs shorter than this many pages are read with other short runs' pages in batches (one
/// request for many scattered pages) rather than as runs of their own.
pub const MIN_RUN: u64 = 8;

/// Pages of a run read: zero pages (no bytes), or pages holding data (one slice of the run's
/// bytes).
#[derive(Debug, Clone)]
pub struct Segment {
    /// The pages.
    pub pages: Range<u64>,
    /// Their bytes, `None` for zero pages.
    pub data: Option<Bytes>,
}

/// `pages` cut where they cross a chunk boundary (`per_chunk` pages to a chunk): each piece
/// with its chunk, in order.
fn by_chunk(pages: Range<u64>, per_chunk: u64) -> impl Iterator<Item = (u64, Range<u64>)> {
    let mut at = pages.start;
    std::iter::from_fn(move || {
        (at < pages.end).then(|| {
            let chunk = at / per_chunk;
            let end = chunk
                .saturating_add(1)
                .saturating_mul(per_chunk)
                .min(pages.end);
            let piece = (chunk, at..end);
            at = end;
            piece
        })
    })
}

/// `segments` cut where they cross a chunk boundary (slices, no copy).
fn split_at_chunks(segments: Vec<Segment>, per_chunk: u64, page: usize) -> Vec<Segment> {
    let mut out = Vec::with_capacity(segments.len());
    for s in segments {
        for (_, pages) in by_chunk(s.pages.clone(), per_chunk) {
            let data = s.data.as_ref().map(|d| {
                let from = (pages.start - s.pages.start) as usize * page;
                d.slice(from..from + (pages.end - pages.start) as usize * page)
            });
            out.push(Segment { pages, data });
        }
    }
    out
}

/// A chunk from the segments that cover it, in order, from page `first`: the one slice when
/// it is one segment of data, shared zeros when it is all zero, else one buffer.
fn whole_chunk(segments: &[Segment], first: u64, page: usize) -> Bytes {
    let len = (segments[segments.len() - 1].pages.end - first) as usize * page;
    if let [one] = segments {
        match &one.data {
            Some(d) => return d.clone(),
            None if len <= MAX_CHUNK_SIZE as usize => return zero_chunk(len),
            None => {}
        }
    }
    let mut buf = BytesMut::zeroed(len);
    for s in segments {
        if let Some(d) = &s.data {
            let at = (s.pages.start - first) as usize * page;
            buf[at..at + d.len()].copy_from_slice(d);
        }
    }
    buf.freeze()
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
            match &self.instant {
                Some(side) => self.fetch_instant(side, idx).await,
                None => self.fetch(idx).await,
            }
        })
    }

    /// Pushes of the region land locally (the seeder is read-only), or in the shared store
    /// in instant mode.
    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        match &self.instant {
            Some(side) => Box::pin(async move {
                // The store holds this now, whatever the manifest said: a later read (after
                // the release, or of a chunk dropped here) checks against it.
                let sum = xxhash_rust::xxh3::xxh3_64(&data);
                let res = side.shared.write(idx, data).await;
                let was = side
                    .manifest
                    .write()
                    .get_mut(idx.0 as usize)
                    .map(|e| std::mem::replace(e, Place::Store(res.is_ok().then_some(sum))));
                if matches!(was, Some(Place::Pending(_))) {
                    // Written here: whatever the source says of it no longer matters.
                    let _ = side
                        .pending
                        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| {
                            Some(p.saturating_sub(1))
                        });
                    side.confirmed.notify_waiters();
                }
                res
            }),
            None => self.local.write(idx, data),
        }
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        match &self.instant {
            Some(side) => side.shared.flush(),
            None => self.local.flush(),
        }
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        match &self.instant {
            Some(side) => side.shared.trim(range),
            None => self.local.trim(range),
        }
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        Box::pin(async move {
            self.geometry.check_idx(idx)?;
            Ok(ChunkStatus::Unknown)
        })
    }
}

/// A store whose reads keep to a pull budget (the seeder's data plane under `--max-rate` or
/// `--cpu-share`): each read pauses as long as the budget needs before it runs.
pub(crate) struct Paced {
    inner: Arc<dyn Store>,
    pacer: Arc<crate::budget::Pacer>,
}

impl Paced {
    pub(crate) fn new(inner: Arc<dyn Store>, pacer: Arc<crate::budget::Pacer>) -> Self {
        Self { inner, pacer }
    }
}

/// Run reads that keep to the same pull budget as [`Paced`] reads (they share its pacer).
#[derive(Debug)]
pub(crate) struct PacedRuns {
    inner: Arc<dyn RunReader>,
    geometry: Geometry,
    pacer: Arc<crate::budget::Pacer>,
}

impl PacedRuns {
    pub(crate) fn new(
        inner: Arc<dyn RunReader>,
        geometry: Geometry,
        pacer: Arc<crate::budget::Pacer>,
    ) -> Self {
        Self {
            inner,
            geometry,
            pacer,
        }
    }
}

impl RunReader for PacedRuns {
    fn read_run(&self, start: ChunkIdx, count: u32) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            let bytes = u64::from(count).saturating_mul(u64::from(self.geometry.chunk_size()));
            self.pacer.pace(bytes).await;
            self.inner.read_run(start, count).await
        })
    }
}

impl fmt::Debug for Paced {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Paced").field("pacer", &self.pacer).finish()
    }
}

impl Store for Paced {
    fn geometry(&self) -> Geometry {
        self.inner.geometry()
    }

    fn caps(&self) -> Caps {
        self.inner.caps()
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            let g = self.inner.geometry();
            if g.check_idx(idx).is_ok() {
                self.pacer.pace(g.chunk_len(idx) as u64).await;
            }
            self.inner.read(idx).await
        })
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        self.inner.write(idx, data)
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        self.inner.flush()
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        self.inner.trim(range)
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        self.inner.status(idx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_are_cut_at_chunk_boundaries() {
        let pieces: Vec<_> = by_chunk(5..20, 8).collect();
        assert_eq!(pieces, [(0, 5..8), (1, 8..16), (2, 16..20)]);
        assert_eq!(by_chunk(8..16, 8).collect::<Vec<_>>(), [(1, 8..16)]);
        assert_eq!(by_chunk(3..3, 8).count(), 0);
        let top = u64::MAX - 2..u64::MAX;
        assert_eq!(by_chunk(top.clone(), 1).count(), 2);
        assert_eq!(
            by_chunk(top.clone(), 4).collect::<Vec<_>>(),
            [(top.start / 4, top)]
        );

        let data = Bytes::from((0..20u8).collect::<Vec<_>>());
        let cut = split_at_chunks(
            vec![Segment {
                pages: 3..13,
                data: Some(data.slice(..10)),
            }],
            4,
            1,
        );
        let pages: Vec<_> = cut.iter().map(|s| s.pages.clone()).collect();
        assert_eq!(pages, [3..4, 4..8, 8..12, 12..13]);
        assert_eq!(cut[1].data.as_deref(), Some(&[1, 2, 3, 4][..]));
        assert_eq!(cut[3].data.as_deref(), Some(&[9][..]));
    }
}
