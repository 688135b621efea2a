//! [`Region`]: memory that fetches its chunks from a store on first touch and writes the
//! chunks the application changed back to it.

use std::fmt;
use std::future::Future;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use farmap_core::{ChunkIdx, Geometry, Store};
use farmap_pipeline::{PullOptions, PullOrder, PullReport, Puller, PushOptions, Pusher};
use parking_lot::Mutex;
use tokio::runtime::Handle;

use crate::error::{RegionError, Unsupported};
use crate::mapping::{Mapping, OwnedMapping};
use crate::memory::{Events, PushReads, RegionMemory};
use crate::options::LocalLimit;
use crate::options::{
    FaultWait, PagingOptions, RegionMode, RegionOptions, RemoveMeans, TrackingMode, WriteTracking,
};
use crate::pagemap::Pagemap;
use crate::paging::{Pager, PagerParts, Reclaimer};
use crate::server::{OwnedRuntime, Reader, Server, ServerParts};
use crate::shared::{BaseFirst, SharedBase};
use crate::signal::{Registration, SignalPath};
use crate::space::{Area, Moves};
use crate::stats::{
    Counters, DirtyReport, HandlerLocation, MemoryUse, PagingStats, RegionStats, SharedStats,
};
use crate::sys;
use crate::tracking::{PageBits, Tracker};
use crate::uffd::{Uffd, UffdRange};
use farmap_memory::RegionSlice;

pub(crate) type RegionPusher = Pusher<Arc<RegionMemory>, Arc<dyn Store>>;

/// What this kernel's userfaultfd supports, from [`probe`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Support {
    /// The feature bits `UFFDIO_API` reports.
    pub features: u64,
    /// The tracking [`WriteTracking::Auto`] would choose.
    pub tracking: TrackingMode,
    /// Whether a failed fetch can raise SIGBUS in the faulting thread (`UFFDIO_POISON`).
    pub poison: bool,
}

impl Support {
    /// Why a bounded region ([`RegionOptions::paging`]) cannot be had here, if it cannot:
    /// it needs `UFFDIO_MOVE` and asynchronous write protection.
    pub fn paging_unsupported(&self) -> Option<Unsupported> {
        if self.features & sys::UFFD_FEATURE_MOVE == 0 {
            return Some(Unsupported::Move);
        }
        (self.tracking != TrackingMode::Async).then_some(Unsupported::PagingNeedsAsync)
    }
}

/// [`probe`], failing when bounded regions cannot be had here
/// ([`Support::paging_unsupported`]).
pub fn probe_paging() -> Result<Support, RegionError> {
    let support = probe()?;
    match support.paging_unsupported() {
        Some(why) => Err(RegionError::unsupported(why)),
        None => Ok(support),
    }
}

/// Checks that userfaultfd works here (the syscall, or `/dev/userfaultfd`) and what it
/// supports.
pub fn probe() -> Result<Support, RegionError> {
    let features = Uffd::probe().map_err(|e| RegionError::Unsupported {
        reason: match e.raw_os_error() {
            Some(libc::ENOSYS) => Unsupported::NoUserfaultfd,
            Some(libc::EPERM) | Some(libc::EACCES) => Unsupported::Refused,
            _ => Unsupported::Open,
        },
        source: Some(e),
    })?;
    let has_async = features & (sys::UFFD_FEATURE_WP_ASYNC | sys::UFFD_FEATURE_WP_UNPOPULATED)
        == (sys::UFFD_FEATURE_WP_ASYNC | sys::UFFD_FEATURE_WP_UNPOPULATED);
    if features & sys::UFFD_FEATURE_EVENT_REMOVE == 0 {
        return Err(RegionError::unsupported(Unsupported::EventRemove));
    }
    Ok(Support {
        features,
        tracking: if has_async {
            TrackingMode::Async
        } else {
            TrackingMode::SyncFaults
        },
        poison: features & sys::UFFD_FEATURE_POISON != 0,
    })
}

/// The owner's side of a hand-over in progress (`handover::send`): the watcher of the
/// process that serves the region's faults, stopped when the region closes.
pub(crate) trait HandedOver: Send + fmt::Debug {
    /// Stops the watcher (it will not take over) and returns the socket, which the caller
    /// closes once the region is unmapped.
    fn detach(self: Box<Self>) -> Arc<std::os::unix::net::UnixStream>;
    /// The socket to the process that serves the faults.
    fn socket(&self) -> Arc<std::os::unix::net::UnixStream>;
    /// Forgets the watcher thread without joining it (called on that thread).
    fn forget_watcher(&mut self);
}

/// A memory region whose content lives in a store: touching a chunk for the first time
/// fetches it, writes are tracked per page and pushed back.
///
/// See the [crate documentation](crate) for the design and the aliasing contract.
pub struct Region {
    inner: Arc<Inner>,
    mapping: OwnedMapping,
    /// The staging area of bounded local memory.
    staging: Option<OwnedMapping>,
    /// In-thread fault resolution: the region's entry in the SIGBUS handler's registry.
    signal: Option<Registration>,
    runtime: Option<OwnedRuntime>,
}

/// The parts of a region that its hand-over watcher shares.
pub(crate) struct Inner {
    pub geometry: Geometry,
    pub server: Arc<Server>,
    pub memory: Arc<RegionMemory>,
    pub tracker: Arc<Tracker>,
    pub pusher: Arc<RegionPusher>,
    pub handle: Handle,
    pub reader: Mutex<Option<Reader>>,
    pub pull: Option<PullOptions>,
    pub spec: Option<String>,
    pub remote: Mutex<Option<Box<dyn HandedOver>>>,
    /// Set when the region starts closing: no take-over after that.
    pub closed: AtomicBool,
    /// Bounded local memory: the pager and its reclaim thread.
    pub pager: Option<Arc<Pager>>,
    pub reclaimer: Mutex<Option<Reclaimer>>,
    /// Clean pages shared with other regions over the same base.
    pub shared: Option<Arc<SharedBase>>,
}

impl Inner {
    pub fn range(&self) -> &UffdRange {
        &self.server.range
    }

    /// Stops this process's handler (reader thread and puller): another process serves faults
    /// from now on.
    pub fn pause_local(&self) {
        if let Some(mut reader) = self.reader.lock().take() {
            reader.stop();
        }
        if let Some(puller) = self.server.puller.write().take() {
            puller.cancel();
        }
    }

    /// Serves faults in this process again: starts the reader and (managed) a puller over the
    /// chunks not fully present, then wakes every thread blocked on the region, so that a
    /// fault read by a handler that died is raised again.
    pub fn take_over(&self) -> Result<(), RegionError> {
        if self.closed.load(Ordering::Acquire) || !self.start_reader(false)? {
            return Ok(());
        }
        if let (Some(pull), None) = (&self.pull, &self.pager) {
            let missing = self.chunks_not_present()?;
            let _enter = self.handle.enter();
            let puller = Puller::start(
                self.server.cache.clone(),
                PullOptions {
                    order: PullOrder::List(missing),
                    ..pull.clone()
                },
            );
            *self.server.puller.write() = Some(Arc::new(puller));
        }
        self.range()
            .wake(0, self.range().len())
            .map_err(|e| RegionError::sys("waking the region's blocked threads", e))
    }

    /// Starts the reader thread unless it runs (or, without `closing`, the region is
    /// closing); returns whether it started it.
    fn start_reader(&self, closing: bool) -> Result<bool, RegionError> {
        let mut reader = self.reader.lock();
        if reader.is_some() || (!closing && self.closed.load(Ordering::Acquire)) {
            return Ok(false);
        }
        *reader = Some(
            Reader::spawn(self.server.clone(), self.handle.clone())
                .map_err(|e| RegionError::sys("starting the fault reader", e))?,
        );
        Ok(true)
    }

    /// The chunks with at least one page that holds no data, ascending.
    fn chunks_not_present(&self) -> Result<Vec<ChunkIdx>, RegionError> {
        let present = self.present_bitmap()?;
        Ok(self
            .geometry
            .all()
            .iter()
            .filter(|idx| present[(idx.0 / 8) as usize] & (1 << (idx.0 % 8)) == 0)
            .collect())
    }

    /// One bit per chunk (chunk `i`: byte `i / 8`, bit `i % 8`), set when every page of the
    /// chunk holds data, from the page tables.
    pub fn present_bitmap(&self) -> Result<Vec<u8>, RegionError> {
        let chunks = self.geometry.chunk_count();
        let mut bits = vec![0u8; chunks.div_ceil(8) as usize];
        let base = self.range().base();
        let shift = self.geometry.chunk_shift();
        let pagemap = Pagemap::open_self().map_err(|e| RegionError::sys("opening pagemap", e))?;
        let mut scratch = Vec::new();
        let mut covered = vec![0u64; chunks as usize];
        pagemap
            .present(base, base + self.range().len(), &mut scratch, |run| {
                let (mut s, e) = ((run.start - base) as u64, (run.end - base) as u64);
                while s < e {
                    let idx = s >> shift;
                    let chunk_end = ((idx + 1) << shift).min(e);
                    covered[idx as usize] += chunk_end - s;
                    s = chunk_end;
                }
            })
            .map_err(|e| RegionError::sys("PAGEMAP_SCAN of present pages", e))?;
        for idx in self.geometry.all().iter() {
            if covered[idx.as_usize()] == self.geometry.chunk_len(idx) as u64 {
                bits[(idx.0 / 8) as usize] |= 1 << (idx.0 % 8);
            }
        }
        Ok(bits)
    }

    /// Runs `fut` on the region's runtime and waits for it on this thread.
    fn block_on<T: Send + 'static>(&self, fut: impl Future<Output = T> + Send + 'static) -> T {
        run_on(&self.handle, fut).expect("the region's runtime runs until the region is dropped")
    }
}

impl Region {
    /// Maps a region over `store` (whose size must be a multiple of the page size), registers
    /// it with a new userfaultfd and starts its handler, puller (managed mode) and pusher.
    pub fn open(store: Arc<dyn Store>, opts: RegionOptions) -> Result<Region, RegionError> {
        let geometry = store.geometry();
        let page = sys::page_size();
        let len = region_len(geometry, page)?;
        let support = probe()?;
        let mut features = Features::choose(&opts, &support)?;
        let mode = features.mode;
        let paging = opts.paging.clone();
        let runtime = OwnedRuntime::new(opts.worker_threads, "farmap-uffd-rt")
            .map_err(|e| RegionError::sys("starting the region's runtime", e))?;
        let handle = runtime.handle().clone();
        let counters = Arc::new(Counters::default());
        let shared = open_shared(&store, &opts, &support, &counters, &handle);
        if shared.is_some() {
            features.bits |= sys::UFFD_FEATURE_MINOR_SHMEM;
        }
        let (owned, uffd) = map_registered(len, opts.address, features.bits, shared.as_deref())?;
        let mapping = owned.shared();
        let range = UffdRange::new(uffd.clone(), mapping.addr(), len);
        let events = Arc::new(Events::default());
        let written = (mode == TrackingMode::SyncFaults)
            .then(|| Arc::new(PageBits::new((len / page) as u64)));
        let pagemap = Pagemap::open_self().map_err(|e| RegionError::sys("opening pagemap", e))?;
        let (staging, pager) = paging
            .as_ref()
            .map(|p| new_pager(p, &range, geometry, &events, &counters, &pagemap))
            .transpose()?
            .unzip();
        let memory = region_memory(
            &range,
            geometry,
            &mapping,
            &events,
            &counters,
            pager.as_ref(),
            shared.clone(),
        );
        let signal = match (&pager, features.in_thread) {
            (Some(p), true) => Some(new_signal_path(
                &range,
                geometry,
                p,
                &counters,
                opts.fault_wait,
            )?),
            _ => None,
        };
        let server = Arc::new(Server::new(ServerParts {
            range: range.clone(),
            geometry,
            cache: Arc::new(
                farmap_pipeline::Cached::new(memory.clone(), fetch_from(&store, &shared))
                    .expect("the region's memory has the store's geometry"),
            ),
            pagemap: dup_pagemap(&pagemap)?,
            readahead: u64::from(opts.readahead_chunks),
            fetch_retry: opts.fetch_retry,
            written: written.clone(),
            events: events.clone(),
            counters: counters.clone(),
            pager: pager.clone(),
            fault_wait: opts.fault_wait,
            signal: signal.clone(),
            program: None,
        }));
        let tracker = Arc::new(Tracker::new(
            mode,
            range,
            geometry,
            written,
            events,
            counters,
            Area::Local(mapping.clone()),
            pagemap,
        ));
        let pusher = start_pusher(&memory, store, opts.push, &tracker, &handle)?;
        let reclaimer = match &pager {
            Some(pager) => connect_pager(pager, &server, &pusher, paging.as_ref(), &handle)?,
            None => None,
        };
        let reader = Reader::spawn(server.clone(), handle.clone())
            .map_err(|e| RegionError::sys("starting the fault reader", e))?;
        // Registered last: from here on, this region's faults are served in their threads.
        let signal = signal
            .map(Registration::new)
            .transpose()
            .map_err(|e| RegionError::sys("installing the SIGBUS handler", e))?;
        let pull = start_pull(opts.mode, pager.is_some(), &server, &handle);
        Ok(Region {
            inner: Arc::new(Inner {
                geometry,
                server,
                memory,
                tracker,
                pusher,
                handle,
                reader: Mutex::new(Some(reader)),
                pull,
                spec: opts.store_spec,
                remote: Mutex::new(None),
                closed: AtomicBool::new(false),
                pager,
                reclaimer: Mutex::new(reclaimer),
                shared,
            }),
            mapping: owned,
            staging,
            signal,
            runtime: Some(runtime),
        })
    }

    pub(crate) fn inner(&self) -> &Arc<Inner> {
        &self.inner
    }

    pub(crate) fn mapping(&self) -> &OwnedMapping {
        &self.mapping
    }

    /// The region's memory, for volatile reads and writes from any thread (touching a chunk
    /// for the first time waits for its fetch; writes are tracked and pushed).
    pub fn memory(&self) -> RegionSlice<'_> {
        self.mapping.slice()
    }

    /// The first byte of the region. Accessing memory through it is `unsafe`: see
    /// [`RegionSlice::new`] for what such code must accept.
    pub fn as_ptr(&self) -> *mut u8 {
        self.memory().as_ptr()
    }

    /// The region's size in bytes.
    pub fn len(&self) -> usize {
        self.mapping.len()
    }

    /// Whether the region is empty (never: stores are not empty).
    pub fn is_empty(&self) -> bool {
        self.mapping.len() == 0
    }

    /// The region's shape (size and chunk size), the store's.
    pub fn geometry(&self) -> Geometry {
        self.inner.geometry
    }

    /// The page size, the unit of write tracking.
    pub fn page_size(&self) -> usize {
        self.inner.range().page_size()
    }

    /// A copy of chunk `idx` as the region holds it now (fetching it if it is missing).
    pub fn read_chunk(&self, idx: ChunkIdx) -> Result<Bytes, RegionError> {
        self.inner.memory.read_now(idx).map_err(|e| match e.kind() {
            farmap_core::ErrorKind::Closed => RegionError::Closed,
            _ => RegionError::Read(e),
        })
    }

    /// The write tracking in use.
    pub fn tracking_mode(&self) -> TrackingMode {
        self.inner.tracker.mode()
    }

    /// Who serves faults now.
    pub fn handler(&self) -> HandlerLocation {
        if self.inner.remote.lock().is_some() {
            HandlerLocation::Remote
        } else {
            HandlerLocation::Local
        }
    }

    /// The pages written since the last scan (this call, or a push round), and their chunks;
    /// re-protects them atomically with respect to concurrent writers, so that a write is
    /// reported by this call or a later one, never lost.
    ///
    /// The chunks returned are no longer known to the region's pusher: the caller now owns
    /// them (migration), or calls [`sync`](Self::sync) after writing them again.
    pub fn take_dirty(&self) -> Result<DirtyReport, RegionError> {
        self.inner.tracker.take()
    }

    /// Like [`take_dirty`](Self::take_dirty), for the chunks of `runs` (ascending runs of
    /// chunk indices) only: a scan of part of the region (an arena's slot) costs that part.
    /// Writes elsewhere stay recorded for a later scan.
    pub fn take_dirty_within(&self, runs: &[Range<u64>]) -> Result<DirtyReport, RegionError> {
        self.inner.tracker.take_within(runs)
    }

    /// The runs of pages (page indices, ascending, merged) within `pages` that are present
    /// in memory, from the page tables; changes nothing. The page set of an arena's object is
    /// these runs of its slot.
    ///
    /// Pages the kernel swapped out are not included: `PAGEMAP_SCAN` reports them, and the
    /// write-protect markers that asynchronous tracking leaves on empty entries, alike as
    /// "swapped". A caller that needs every page with data keeps the range out of swap.
    pub fn pages_in_memory(&self, pages: Range<u64>) -> Result<Vec<Range<u64>>, RegionError> {
        self.inner.tracker.in_memory_within(pages)
    }

    /// The pages written since the previous call, and their chunks, for a consumer that
    /// works beside the region's pusher (a live migration of a region whose store is shared):
    /// unlike [`take_dirty`](Self::take_dirty), nothing is taken from the pusher (the chunks
    /// found are still pushed), and pages that push rounds or `take_dirty` scanned since the
    /// previous call are reported too. Each write is reported by this call or a later one,
    /// never lost. The first call starts the record and reports what its scan finds (the
    /// pages written since the last scan of any kind).
    pub fn take_written(&self) -> Result<DirtyReport, RegionError> {
        let (scanned, observed) = self.inner.tracker.take_observed()?;
        for idx in scanned.chunks {
            self.inner.pusher.mark_dirty(idx);
        }
        Ok(observed)
    }

    /// Pushes every chunk written so far to the store, flushes the store, and waits.
    /// On an error, the chunks not pushed stay dirty for the next round or `sync`.
    pub fn sync(&self) -> Result<(), RegionError> {
        let pusher = self.inner.pusher.clone();
        self.inner
            .block_on(async move { pusher.flush().await })
            .map_err(RegionError::Push)
    }

    /// Pushes written chunks to the store for at most `budget` (the rest stay dirty for the
    /// next round); `Ok(true)` if everything written before the call is in the store.
    pub fn sync_for(&self, budget: Duration) -> Result<bool, RegionError> {
        let pusher = self.inner.pusher.clone();
        self.inner
            .block_on(async move { tokio::time::timeout(budget, pusher.flush()).await })
            .map_or(Ok(false), |r| r.map(|()| true).map_err(RegionError::Push))
    }

    /// The first half of a seal in two steps, while the application runs (see
    /// [`Pusher::draft`](farmap_pipeline::Pusher::draft)): no more pushes start, and the
    /// ledger as it stands comes back with the chunks written or pushed within `window`,
    /// which [`seal_hot_pushes`](Self::seal_hot_pushes) looks at once the writers are
    /// stopped.
    pub fn draft_pushes(
        &self,
        window: Duration,
    ) -> Result<farmap_pipeline::PushDraft, RegionError> {
        let pusher = self.inner.pusher.clone();
        self.inner
            .block_on(async move { pusher.draft(window).await })
            .map_err(RegionError::Push)
    }

    /// With the writers stopped, after [`draft_pushes`](Self::draft_pushes): stops every push
    /// for good and says which of the draft's hot chunks were written since (see
    /// [`Pusher::seal_hot`](farmap_pipeline::Pusher::seal_hot)).
    ///
    /// Runs on the calling thread (no hop to the region's runtime inside the downtime), which
    /// must be one that may block.
    pub fn seal_hot_pushes(&self) -> Result<farmap_pipeline::SealDelta, RegionError> {
        self.inner
            .pusher
            .seal_hot_blocking()
            .map_err(RegionError::Push)
    }

    /// After [`seal_hot_pushes`](Self::seal_hot_pushes): which of the other chunks were
    /// written since the draft (see [`Pusher::seal_rest`](farmap_pipeline::Pusher::seal_rest)).
    pub fn seal_rest_pushes(&self) -> farmap_pipeline::SealDelta {
        let pusher = self.inner.pusher.clone();
        self.inner.block_on(async move { pusher.seal_rest().await })
    }

    /// Lets pushes run again after [`draft_pushes`](Self::draft_pushes) or
    /// [`seal_hot_pushes`](Self::seal_hot_pushes) (a migration abandoned before its
    /// hand-over).
    pub fn unseal_pushes(&self) {
        self.inner.pusher.unseal();
    }

    /// Pushes `chunks` to the store now, written or not (see
    /// [`Pusher::write_back`](farmap_pipeline::Pusher::write_back)): for chunks that came from
    /// somewhere else than the store and must be in it.
    pub fn push_chunks(&self, chunks: Vec<ChunkIdx>) -> Result<(), RegionError> {
        let pusher = self.inner.pusher.clone();
        self.inner
            .block_on(async move { pusher.write_back(&chunks).await })
            .map_err(RegionError::Push)
    }

    /// The spec of the region's store, if it was opened from one
    /// ([`RegionOptions::store_spec`](crate::RegionOptions::store_spec)).
    pub fn store_spec(&self) -> Option<&str> {
        self.inner.spec.as_deref()
    }

    /// [`sync`](Self::sync) as a future (for async code; the work runs on the region's own
    /// runtime, so any executor can await it).
    pub fn sync_async(&self) -> impl Future<Output = Result<(), RegionError>> + Send + 'static {
        let pusher = self.inner.pusher.clone();
        let task = self.inner.handle.spawn(async move { pusher.flush().await });
        async move {
            match task.await {
                Ok(r) => r.map_err(RegionError::Push),
                Err(_) => Err(RegionError::Closed),
            }
        }
    }

    /// Waits until the background pull has gone through every chunk (managed mode; `None` in
    /// direct mode or while another process serves faults).
    pub fn wait_pull(&self) -> Option<PullReport> {
        let puller = self.inner.server.puller.read().clone()?;
        Some(self.inner.block_on(async move { puller.wait().await }))
    }

    /// The region's counters.
    pub fn stats(&self) -> RegionStats {
        let inner = &self.inner;
        region_stats(
            &inner.server,
            &inner.pusher,
            inner.pager.as_deref(),
            self.tracking_mode(),
            self.handler(),
            inner.shared.as_deref(),
        )
    }

    /// What the region's memory costs now, from the kernel's accounting of its mapping:
    /// pages mapped, and of those the region's own (not a shared base's).
    pub fn memory_use(&self) -> Result<MemoryUse, RegionError> {
        MemoryUse::of_mapping(self.as_ptr() as usize)
            .map_err(|e| RegionError::sys("reading /proc/self/smaps", e))
    }

    /// The file of the base whose clean pages this region shares with other regions, if it
    /// does (see [`RegionOptions::share_clean_pages`]).
    pub fn shared_base(&self) -> Option<&std::path::Path> {
        self.inner.shared.as_ref().map(|s| s.path())
    }

    /// Changes the bound on local memory at run time (bounded regions only: `false`
    /// otherwise). Resident memory goes down to the new limit at once, in the background
    /// (written chunks are written back first).
    pub fn set_local_max(&self, limit: LocalLimit) -> bool {
        let Some(pager) = &self.inner.pager else {
            return false;
        };
        let g = self.inner.geometry;
        pager.set_limit(limit.chunks(g.size(), u64::from(g.chunk_size())));
        true
    }

    /// Moves up to `max` of a bounded region's mapped chunks, oldest first (the eviction
    /// policy's order, written-to chunks given a second chance), to its staging pool: they
    /// stay local and count against the limit, their next touch moves them back with no
    /// I/O, and a reclaim drops them after their write-back. Returns how many moved (`None`
    /// for an unbounded region). For tests and benchmarks of the staged path, and for an
    /// application that knows a phase is over.
    pub fn deactivate(&self, max: u64) -> Option<u64> {
        self.inner.pager.as_ref().map(|p| p.deactivate(max))
    }

    /// A bounded region's mapped chunks touched since the eviction clock last passed them
    /// (its working set as the pager sees it; counted in blocks, not at one instant);
    /// `None` for an unbounded region.
    pub fn referenced_chunks(&self) -> Option<u64> {
        Some(self.inner.pager.as_ref()?.referenced_chunks())
    }

    /// Pages of a bounded region present in memory now, from the page tables: `(in the
    /// region, in its staging area)`; `None` for an unbounded region.
    pub fn local_pages(&self) -> Option<Result<(u64, u64), RegionError>> {
        let pager = self.inner.pager.as_ref()?;
        Some(
            pager
                .local_pages()
                .map_err(|e| RegionError::sys("PAGEMAP_SCAN of present pages", e)),
        )
    }

    /// What tests and debugging look at inside the region (see [`Diagnostics`]).
    pub fn diagnostics(&self) -> Diagnostics<'_> {
        Diagnostics { region: self }
    }

    /// Whether the region's local memory is bounded.
    pub fn is_paged(&self) -> bool {
        self.inner.pager.is_some()
    }

    /// Syncs, then unmaps the region and stops its threads. On a sync error the region is
    /// closed all the same and the chunks not pushed are lost: call [`sync`](Self::sync)
    /// until it succeeds first if they must not be.
    pub fn close(self) -> Result<(), RegionError> {
        self.sync()
        // `drop` does the rest.
    }
}

impl Drop for Region {
    /// Stops the puller, unmaps the memory (after reads in flight, which may need faults
    /// served), stops the handler and the runtime; the userfaultfd is closed last, when the
    /// last task lets go of it. Chunks not pushed are not pushed: see [`Region::close`].
    fn drop(&mut self) {
        let inner = &self.inner;
        inner.closed.store(true, Ordering::Release);
        if let Some(mut reclaimer) = inner.reclaimer.lock().take() {
            reclaimer.stop();
        }
        let remote = inner.remote.lock().take();
        let remote = remote.map(|r| r.detach());
        if remote.is_some() {
            // Reads in flight may wait for faults the other process serves, and it may die
            // now that nobody watches it: serve here too until the memory is gone (both
            // handlers only fill missing pages, so sharing the work is harmless).
            if inner.start_reader(true).is_ok() {
                let _ = inner.range().wake(0, inner.range().len());
            }
        }
        if let Some(puller) = inner.server.puller.write().take() {
            puller.cancel();
        }
        drop(self.signal.take());
        self.mapping.unmap();
        if let Some(staging) = &mut self.staging {
            staging.unmap();
        }
        // Only now that nothing can fault: stop serving and close the hand-over socket.
        drop(remote);
        if let Some(mut reader) = inner.reader.lock().take() {
            reader.stop();
        }
        // The pusher outlives the runtime (others may hold it): its background task stops
        // first, so that it makes no timer while the runtime shuts down.
        inner.pusher.stop_background();
        drop(self.runtime.take());
    }
}

/// What tests and debugging look at inside a region, apart from the surface an application
/// needs ([`Region::diagnostics`]).
#[derive(Debug, Clone, Copy)]
pub struct Diagnostics<'r> {
    region: &'r Region,
}

impl Diagnostics<'_> {
    /// The bounded-memory pager's recent history of `chunk` (what moved it, when), oldest
    /// first; empty for an unbounded region.
    pub fn pager_trace(&self, chunk: u64) -> Vec<String> {
        self.region
            .inner
            .pager
            .as_ref()
            .map(|p| p.trace_of(chunk))
            .unwrap_or_default()
    }
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("addr", &self.as_ptr())
            .field("geometry", &self.inner.geometry)
            .field("tracking", &self.tracking_mode())
            .field("handler", &self.handler())
            .finish()
    }
}
/// A region's counters, from its parts (a region of this process, or a program's).
pub(crate) fn region_stats(
    server: &Server,
    pusher: &RegionPusher,
    pager: Option<&Pager>,
    tracking: TrackingMode,
    handler: HandlerLocation,
    shared: Option<&SharedBase>,
) -> RegionStats {
    let c = &server.counters;
    let push = pusher.stats();
    let last_error = c.last_error.lock().clone().or(push.last_error);
    RegionStats {
        tracking,
        handler,
        faults: Counters::get(&c.faults),
        faults_inline: Counters::get(&c.faults_inline),
        wp_faults: Counters::get(&c.wp_faults),
        faults_polled: Counters::get(&c.faults_polled),
        faults_slept: Counters::get(&c.faults_slept),
        fault_readers: server.readers() as u32,
        reader_rests: Counters::get(&c.reader_rests),
        faults_in_thread: Counters::get(&c.faults_in_thread),
        faults_signalled: Counters::get(&c.faults_signalled),
        handler_cpu: server.handler_cpu(),
        chunks_fetched: Counters::get(&c.chunks_fetched),
        bytes_fetched: Counters::get(&c.bytes_fetched),
        present_chunks: server.cache.present_count(),
        refetched_chunks: Counters::get(&c.refetched_chunks),
        remove_events: Counters::get(&c.remove_events),
        removed_chunks: Counters::get(&c.removed_chunks),
        poisoned_pages: Counters::get(&c.poisoned_pages),
        dirty_pages: Counters::get(&c.dirty_pages),
        dirty_chunks: Counters::get(&c.dirty_chunks),
        pushed_chunks: push.pushed_chunks,
        pushed_bytes: push.pushed_bytes,
        failed_pushes: push.failed_pushes,
        pull: server.puller.read().as_ref().map(|p| p.progress()),
        paging: pager.map(|p| {
            let (resident, staged) = p.resident();
            let pc = &p.counters;
            PagingStats {
                limit_chunks: p.limit(),
                min_free_chunks: p.min_free(),
                resident_chunks: resident,
                staged_chunks: staged,
                evictions_reactive: Counters::get(&pc.evictions_reactive),
                evictions_proactive: Counters::get(&pc.evictions_proactive),
                deactivations: Counters::get(&pc.deactivations),
                staged_refaults: Counters::get(&pc.staged_refaults),
                staged_refaults_in_thread: Counters::get(&pc.staged_refaults_in_thread),
                overcommits: Counters::get(&pc.overcommits),
                full_faults: Counters::get(&pc.full_faults),
                recovered: Counters::get(&pc.recovered),
                partial_moves: Counters::get(&pc.partial_moves),
                pushes_from_store: Counters::get(&pc.pushes_from_store),
                zero_fills: Counters::get(&pc.zero_fills),
                prefetched: Counters::get(&pc.prefetched),
                prefetch_hits: Counters::get(&pc.prefetch_hits),
                prefetch_wasted: Counters::get(&pc.prefetch_wasted),
                dropped_behind: Counters::get(&pc.dropped_behind),
            }
        }),
        shared: shared.map(|s| SharedStats {
            path: s.path().to_owned(),
            mapped_chunks: Counters::get(&c.base_mapped),
            filled_chunks: Counters::get(&c.base_filled),
        }),
        last_error,
    }
}

/// The region's length in bytes, if `geometry` can be a region: whole pages, chunks of at
/// least a page, within the address space.
fn region_len(geometry: Geometry, page: usize) -> Result<usize, RegionError> {
    let geometry_error = |reason| RegionError::Geometry {
        size: geometry.size(),
        chunk_size: geometry.chunk_size(),
        reason,
    };
    if !geometry.size().is_multiple_of(page as u64) {
        return Err(geometry_error(
            "the size is not a multiple of the page size",
        ));
    }
    if (geometry.chunk_size() as usize) < page {
        return Err(geometry_error("chunks are smaller than a page"));
    }
    usize::try_from(geometry.size())
        .map_err(|_| geometry_error("the size does not fit the address space"))
}

/// What a region asks of userfaultfd: its write-tracking mode, the feature bits, whether
/// missing faults are resolved in the faulting thread.
struct Features {
    mode: TrackingMode,
    bits: u64,
    in_thread: bool,
}

impl Features {
    /// The features `opts` need, refused when this kernel (`support`) lacks one.
    fn choose(opts: &RegionOptions, support: &Support) -> Result<Features, RegionError> {
        let mode = match (opts.tracking, support.tracking) {
            (WriteTracking::SyncFaults, _) => TrackingMode::SyncFaults,
            (_, TrackingMode::Async) => TrackingMode::Async,
            (WriteTracking::Auto, TrackingMode::SyncFaults) => TrackingMode::SyncFaults,
            (WriteTracking::Async, TrackingMode::SyncFaults) => {
                return Err(RegionError::unsupported(Unsupported::WpAsync))
            }
        };
        let paging = opts.paging.clone();
        if paging.is_some() {
            if let Some(why) = support.paging_unsupported() {
                return Err(RegionError::unsupported(why));
            }
            if mode != TrackingMode::Async {
                return Err(RegionError::unsupported(Unsupported::PagingNeedsAsync));
            }
        }
        let in_thread = paging.as_ref().is_some_and(|p| p.in_thread);
        if in_thread && support.features & sys::UFFD_FEATURE_SIGBUS == 0 {
            return Err(RegionError::unsupported(Unsupported::Sigbus));
        }
        let mut features = sys::UFFD_FEATURE_EVENT_REMOVE;
        if let Some(p) = &paging {
            features |= sys::UFFD_FEATURE_MOVE;
            if p.prefetch != crate::Prefetch::Off {
                // The faulting thread's id, for per-thread prefetch windows.
                features |= sys::UFFD_FEATURE_THREAD_ID;
            }
        }
        if support.features & sys::UFFD_FEATURE_THREAD_ID != 0 {
            // Also tells a fault reader where the faulting thread runs (`src/server.rs`).
            features |= sys::UFFD_FEATURE_THREAD_ID;
        }
        if mode == TrackingMode::Async {
            features |= sys::UFFD_FEATURE_WP_ASYNC | sys::UFFD_FEATURE_WP_UNPOPULATED;
        }
        if support.poison {
            features |= sys::UFFD_FEATURE_POISON;
        }
        if in_thread {
            // Missing faults raise SIGBUS in the faulting thread (the `signal` module).
            features |= sys::UFFD_FEATURE_SIGBUS;
        }
        Ok(Features {
            mode,
            bits: features,
            in_thread,
        })
    }
}

/// The region's memory, mapped (at `address` if given) and registered with a new
/// userfaultfd for missing and write-protect faults; refused if this kernel cannot
/// write-protect it.
fn map_registered(
    len: usize,
    address: Option<usize>,
    features: u64,
    shared: Option<&SharedBase>,
) -> Result<(OwnedMapping, Arc<Uffd>), RegionError> {
    let owned = match shared {
        // Minor faults too: a page the shared file holds is mapped from it.
        Some(s) => OwnedMapping::of_file(len, address, s.fd()),
        None => OwnedMapping::new(len, address),
    }
    .map_err(|e| RegionError::sys("mapping the region's memory", e))?;
    let uffd =
        Arc::new(Uffd::open(features).map_err(|e| RegionError::sys("opening a userfaultfd", e))?);
    let mut mode_bits = sys::UFFDIO_REGISTER_MODE_MISSING | sys::UFFDIO_REGISTER_MODE_WP;
    if shared.is_some() {
        mode_bits |= sys::UFFDIO_REGISTER_MODE_MINOR;
    }
    let ioctls = owned
        .shared()
        .register(&uffd, mode_bits)
        .map_err(|e| RegionError::sys("registering the region with userfaultfd", e))?;
    if ioctls & sys::UFFDIO_BIT_WRITEPROTECT == 0 {
        return Err(RegionError::unsupported(Unsupported::WriteProtect));
    }
    Ok((owned, uffd))
}

/// The region's memory as the pipeline's stages see it: chunks copied in and out of the
/// mapping (and, with bounded local memory, of the pager's staging area).
pub(crate) fn region_memory(
    range: &UffdRange,
    geometry: Geometry,
    mapping: &Arc<Mapping>,
    events: &Arc<Events>,
    counters: &Arc<Counters>,
    pager: Option<&Arc<Pager>>,
    shared: Option<Arc<SharedBase>>,
) -> Arc<RegionMemory> {
    Arc::new(
        RegionMemory::new(
            range.clone(),
            geometry,
            true,
            Some(Area::Local(mapping.clone())),
            events.clone(),
            counters.clone(),
            pager.cloned().map(|p| p as Arc<dyn PushReads>),
        )
        .with_shared(shared),
    )
}

/// Runs `fut` on the runtime of `handle` and waits for it on this thread (which must not be
/// one of that runtime's); `None` if the runtime dropped it.
fn run_on<T: Send + 'static>(
    handle: &Handle,
    fut: impl Future<Output = T> + Send + 'static,
) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    handle.spawn(async move {
        let _ = tx.send(fut.await);
    });
    rx.recv().ok()
}

/// The shared base of a region over `store`, when the store has one, `opts` ask for it
/// (the default) and the region can have it (no bounded memory; minor faults on shmem). Not
/// sharing is never an error: the region then keeps private copies, as any other.
fn open_shared(
    store: &Arc<dyn Store>,
    opts: &RegionOptions,
    support: &Support,
    counters: &Arc<Counters>,
    handle: &Handle,
) -> Option<Arc<SharedBase>> {
    if !opts.share_clean_pages
        || opts.paging.is_some()
        || support.features & sys::UFFD_FEATURE_MINOR_SHMEM == 0
    {
        return None;
    }
    let s = store.clone();
    let base = match run_on(handle, async move { s.memory_base().await }) {
        Some(Ok(Some(base))) => base,
        Some(Ok(None)) | None => return None,
        Some(Err(e)) => {
            tracing::warn!("not sharing clean pages: the store cannot say what its base is: {e}");
            return None;
        }
    };
    let dir = opts
        .shared_dir
        .clone()
        .unwrap_or_else(crate::shared::default_shared_dir);
    match SharedBase::open(&dir, base, store.geometry(), counters.clone()) {
        Ok(s) => Some(Arc::new(s)),
        Err(e) => {
            tracing::warn!("not sharing clean pages through {}: {e}", dir.display());
            None
        }
    }
}

/// What the region's cache fetches from: the store, or, with a shared base, the base's
/// file first.
pub(crate) fn fetch_from(
    store: &Arc<dyn Store>,
    shared: &Option<Arc<SharedBase>>,
) -> Arc<dyn Store> {
    match shared {
        Some(s) => Arc::new(BaseFirst {
            store: store.clone(),
            shared: s.clone(),
        }),
        None => store.clone(),
    }
}

/// The pager of bounded local memory (`p`), moving pages between the region (`range`) and
/// its staging area (made here, and returned with it).
pub(crate) fn new_pager(
    p: &PagingOptions,
    range: &UffdRange,
    geometry: Geometry,
    events: &Arc<Events>,
    counters: &Arc<Counters>,
    pagemap: &Pagemap,
) -> Result<(OwnedMapping, Arc<Pager>), RegionError> {
    let (staging, quiet) = staging_area(range.len(), geometry)?;
    let limit = p
        .local_max
        .chunks(geometry.size(), u64::from(geometry.chunk_size()));
    let pager = Pager::new(PagerParts {
        region: range.clone(),
        staging: UffdRange::new(quiet, staging.addr(), range.len()),
        staging_map: Area::Local(staging.shared()),
        moves: Moves::Local,
        events: events.clone(),
        geometry,
        limit,
        min_free: p.min_free,
        fresh: p.fresh,
        prefetch: p.prefetch,
        region_counters: counters.clone(),
        pagemap: dup_pagemap(pagemap)?,
        remove: RemoveMeans::Refetch,
    });
    Ok((staging, Arc::new(pager)))
}

/// Another handle on the region's pagemap, for one more of its users.
pub(crate) fn dup_pagemap(pagemap: &Pagemap) -> Result<Pagemap, RegionError> {
    pagemap
        .try_clone()
        .map_err(|e| RegionError::sys("duplicating the pagemap fd", e))
}

/// In-thread fault resolution's pipe to the pager (polling for `fault_wait`'s window).
fn new_signal_path(
    range: &UffdRange,
    geometry: Geometry,
    pager: &Arc<Pager>,
    counters: &Arc<Counters>,
    fault_wait: FaultWait,
) -> Result<Arc<SignalPath>, RegionError> {
    let poll = match fault_wait {
        FaultWait::Poll(window) => window,
        FaultWait::Sleep => Duration::ZERO,
    };
    SignalPath::new(
        range,
        geometry.chunk_shift(),
        pager.clone(),
        counters.clone(),
        poll,
    )
    .map(Arc::new)
    .map_err(|e| RegionError::sys("making the in-thread fault pipe", e))
}

/// Starts the pusher of the region's written chunks (on the region's runtime), tracked by
/// `tracker`.
pub(crate) fn start_pusher(
    memory: &Arc<RegionMemory>,
    store: Arc<dyn Store>,
    opts: PushOptions,
    tracker: &Arc<Tracker>,
    handle: &Handle,
) -> Result<Arc<RegionPusher>, RegionError> {
    let _enter = handle.enter();
    Pusher::with_source(memory.clone(), store, opts, tracker.clone())
        .map(Arc::new)
        .map_err(RegionError::Push)
}

/// Starts a managed region's background pull; returns its options (none for a direct
/// region, nor a `bounded` one: the pull would fill it past its limit).
fn start_pull(
    mode: RegionMode,
    bounded: bool,
    server: &Server,
    handle: &Handle,
) -> Option<PullOptions> {
    let pull = match mode {
        RegionMode::Managed(_) if bounded => None,
        RegionMode::Managed(pull) => Some(pull),
        RegionMode::Direct => None,
    };
    if let Some(pull) = &pull {
        let _enter = handle.enter();
        let puller = Puller::start(server.cache.clone(), pull.clone());
        *server.puller.write() = Some(Arc::new(puller));
    }
    pull
}

/// Bounded local memory: a staging area as large as the region and a trash area after it
/// (MAP_NORESERVE: only staged pages take memory), registered with a second, quiet
/// userfaultfd (no events, write-protect mode only: its holes read as zeros). A move is
/// issued on its destination's fd, so pages move both ways; and dropping staged pages
/// (madvise) raises no remove event on the region's fd, whose copies would fail with EAGAIN
/// until the madvise returned (the paging module's docs).
pub(crate) fn staging_area(
    len: usize,
    geometry: Geometry,
) -> Result<(OwnedMapping, Arc<Uffd>), RegionError> {
    let quiet = Uffd::open(sys::UFFD_FEATURE_MOVE)
        .map_err(|e| RegionError::sys("opening the staging area's userfaultfd", e))?;
    let owned = OwnedMapping::new(len + crate::paging::trash_len(geometry), None)
        .map_err(|e| RegionError::sys("mapping the staging area", e))?;
    owned
        .register(&quiet, sys::UFFDIO_REGISTER_MODE_WP)
        .map_err(|e| RegionError::sys("registering the staging area", e))?;
    Ok((owned, Arc::new(quiet)))
}

/// Connects the pager to the region's cache and pusher (write-backs before a staged copy is
/// dropped, dirty marks of chunks being staged); starts the reclaim thread if asked.
pub(crate) fn connect_pager(
    pager: &Arc<Pager>,
    server: &Arc<Server>,
    pusher: &Arc<RegionPusher>,
    paging: Option<&PagingOptions>,
    handle: &Handle,
) -> Result<Option<Reclaimer>, RegionError> {
    let (wb_pusher, mark_pusher) = (Arc::downgrade(pusher), Arc::downgrade(pusher));
    pager.connect(
        Arc::downgrade(&server.cache),
        Box::new(move |chunks| {
            let pusher = wb_pusher.clone();
            Box::pin(async move {
                match pusher.upgrade() {
                    Some(p) => p.write_back(&chunks).await,
                    None => Err(farmap_core::StoreError::new(
                        farmap_core::ErrorKind::Closed,
                        "the region is closed",
                    )),
                }
            })
        }),
        Box::new(move |idx| {
            if let Some(p) = mark_pusher.upgrade() {
                p.mark_dirty(idx);
            }
        }),
    );
    if !paging.is_some_and(|p| p.proactive) {
        return Ok(None);
    }
    pager
        .spawn_reclaimer(handle.clone())
        .map(Some)
        .map_err(|e| RegionError::sys("starting the reclaim thread", e))
}
