//! [`Managed`]: a managed mount's store — a local memory cache in front of a remote store,
//! filled in the background and written back on an interval. Frontend-agnostic: the FUSE
//! mount (`farmap mount --managed`) and the NBD server use it as any other [`Store`].
//!
//! ```text
//!   frontend ──▶ Managed = Pusher ──▶ Cached(local memory + presence) ◀── Puller
//!                            │                 │ miss: fetch once          (N workers,
//!                            │ dirty chunks,   ▼                           order)
//!                            └── interval ──▶ remote ◀─────────────────────────┘
//! ```
//!
//! The pieces are the pipeline's own ([`Cached`], [`Puller`], [`Pusher`]), assembled as a
//! userfaultfd region assembles them, with the local store a sparse [`MemoryStore`].
//!
//! With [`ManagedOptions::cache_max`], the local copy is bounded: [`Cached::bounded`] drops
//! chunks (writing modified ones back first) to stay under the bound, the pusher holds each
//! chunk while it pushes it ([`Pusher::with_hold`]), and there is no background pull (a
//! full pull into a bounded cache would only evict what it just fetched); reads fetch on
//! demand.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use bytes::Bytes;
use farmap_core::{
    BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, Geometry, Store, StoreError, StoreResult,
};
use farmap_pipeline::{
    Cached, DirtySet, EvictStats, PullOptions, PullOrder, PullProgress, PullReport, Puller,
    PushHold, PushOptions, PushStats, Pusher,
};
use farmap_store::{DenseMemoryStore, MemoryStore};

type Cache = Cached<Box<dyn Store>, Arc<dyn Store>>;

/// The local memory of a managed store: a sparse [`MemoryStore`] that keeps no chunk of
/// zeros (one is trimmed instead), so chunks the remote never wrote cost no memory and keep
/// reading as [`ChunkStatus::Zero`].
#[derive(Debug)]
struct SparseLocal(MemoryStore);

impl Store for SparseLocal {
    fn geometry(&self) -> Geometry {
        self.0.geometry()
    }

    fn caps(&self) -> Caps {
        self.0.caps()
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        self.0.read(idx)
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        if farmap_core::is_zero(&data) && self.0.geometry().check_write(idx, data.len()).is_ok() {
            self.0.trim(ChunkRange::single(idx))
        } else {
            self.0.write(idx, data)
        }
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        self.0.flush()
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        self.0.trim(range)
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        self.0.status(idx)
    }
}

/// How a [`Managed`] store pulls and pushes.
#[derive(Debug, Clone)]
pub struct ManagedOptions {
    /// The background pull (workers, order, retries); `None`: chunks are fetched only when
    /// read. A remote that knows its working set ([`Store::working_set`], a versioned
    /// region) has it pulled first, in its order, then the rest in this order (unless the
    /// order is a [list](PullOrder::List)).
    pub pull: Option<PullOptions>,
    /// The write-back (workers, interval, retries).
    pub push: PushOptions,
    /// When a read misses, this many chunks after it jump the puller's queue with it.
    pub readahead_chunks: u32,
    /// Keep the local copy in memory allocated (and written) up front for the whole region,
    /// which every write is copied into ([`DenseMemoryStore`]), instead of a sparse map
    /// that keeps the written buffers and grows as chunks arrive. For a server whose
    /// writes must not allocate (`farmap swap on`).
    pub dense_local: bool,
    /// Most bytes of the region held locally (rounded down to whole chunks, at least one);
    /// `None`: unbounded. Needs a sparse local copy (not [`dense_local`](Self::dense_local),
    /// which cannot give memory back), and turns the background pull and the read-ahead off.
    /// A bound the whole region fits in is no bound.
    pub cache_max: Option<u64>,
}

impl Default for ManagedOptions {
    /// The pipeline's default pull (farmap's choice of fetches in flight, sequential) and
    /// push (16 workers, every second), 4 chunks of read-ahead.
    fn default() -> Self {
        Self {
            pull: Some(PullOptions::default()),
            push: PushOptions::default(),
            readahead_chunks: 4,
            dense_local: false,
            cache_max: None,
        }
    }
}

/// A remote store behind a local memory cache with background pull and write-back; a
/// [`Store`] itself, plus controls.
///
/// - Reads are served locally once a chunk is present; a miss fetches it from the remote
///   (once, however many ask) and moves the next `readahead_chunks` to the front of the
///   puller's queue.
/// - Writes and trims are local; the chunks they touch are pushed to the remote on the push
///   interval and at [`flush`](Store::flush), which returns once everything written before
///   it is in the remote and the remote is flushed.
/// - Dropping it stops the pull and the write-back **without** pushing what is dirty: call
///   [`shutdown`](Self::shutdown) (or `flush`) first.
pub struct Managed {
    geometry: Geometry,
    cache: Arc<Cache>,
    pusher: Pusher<Arc<Cache>, Arc<dyn Store>>,
    puller: Option<Pull>,
    readahead: u64,
    /// Chunks the application read or wrote since the cache opened (reported to the remote,
    /// see [`Store::reports_touches`]).
    touched: DirtySet,
}

/// An instant migration hands a managed store's remote over through its pusher's seal.
impl farmap_pipeline::Seal for Managed {
    fn draft(
        &self,
        window: std::time::Duration,
    ) -> farmap_core::BoxFuture<'_, StoreResult<farmap_pipeline::PushDraft>> {
        farmap_pipeline::Seal::draft(&self.pusher, window)
    }

    fn seal_hot(&self) -> farmap_core::BoxFuture<'_, StoreResult<farmap_pipeline::SealDelta>> {
        farmap_pipeline::Seal::seal_hot(&self.pusher)
    }

    fn seal_rest(&self) -> farmap_core::BoxFuture<'_, farmap_pipeline::SealDelta> {
        farmap_pipeline::Seal::seal_rest(&self.pusher)
    }

    fn unseal(&self) {
        self.pusher.unseal()
    }

    fn push_for(
        &self,
        budget: std::time::Duration,
    ) -> farmap_core::BoxFuture<'_, StoreResult<bool>> {
        farmap_pipeline::Seal::push_for(&self.pusher, budget)
    }
}

impl Managed {
    /// Starts a managed store over `remote`.
    ///
    /// # Panics
    /// Outside a tokio runtime (the puller and the push interval run on it).
    pub fn open(remote: Arc<dyn Store>, opts: ManagedOptions) -> StoreResult<Managed> {
        let geometry = remote.geometry();
        // The pull reads ahead of the application: the remote learns what it touched from
        // here (a versioned region records it as the working set of its next start).
        remote.reports_touches();
        let local: Box<dyn Store> = if opts.dense_local {
            Box::new(DenseMemoryStore::new(geometry))
        } else {
            Box::new(SparseLocal(MemoryStore::new(geometry)))
        };
        let bound = match opts.cache_max {
            Some(max) if max < geometry.size() => {
                if opts.dense_local {
                    return Err(StoreError::invalid(
                        "a bounded managed cache (cache max) needs a sparse local copy: a \
                         dense one holds memory for the whole region and cannot give it back",
                    ));
                }
                let chunks = max / u64::from(geometry.chunk_size());
                if chunks == 0 {
                    return Err(StoreError::invalid(format!(
                        "a cache max of {max} bytes holds no chunk of {} bytes",
                        geometry.chunk_size()
                    )));
                }
                Some(chunks)
            }
            _ => None,
        };
        let (cache, pusher, puller, readahead) = match bound {
            None => {
                let cache = Arc::new(Cached::new(local, remote.clone())?);
                let pusher = Pusher::new(cache.clone(), remote, opts.push)?;
                let puller = opts
                    .pull
                    .map(|mut pull| match cache.remote().working_set() {
                        Some(set) => {
                            pull.order = working_set_first(&set, pull.order);
                            Pull::at_first_touch(cache.clone(), pull)
                        }
                        None => Pull::now(Puller::start(cache.clone(), pull)),
                    });
                (cache, pusher, puller, u64::from(opts.readahead_chunks))
            }
            Some(chunks) => {
                let cache = Arc::new(Cached::bounded(local, remote.clone(), chunks)?);
                let hold: Arc<dyn PushHold> = cache.clone();
                let pusher = Pusher::with_hold(cache.clone(), remote, opts.push, hold)?;
                (cache, pusher, None, 0)
            }
        };
        Ok(Managed {
            geometry,
            cache,
            pusher,
            puller,
            readahead,
            touched: DirtySet::new(geometry.chunk_count()),
        })
    }

    /// The remote store.
    pub fn remote(&self) -> &Arc<dyn Store> {
        self.cache.remote()
    }

    /// Chunks present locally.
    pub fn present_count(&self) -> u64 {
        self.cache.present_count()
    }

    /// The bound on the local copy and what its evictions did (`None`: unbounded).
    pub fn evict_stats(&self) -> Option<EvictStats> {
        self.cache.evict_stats()
    }

    /// Whether every chunk is present locally.
    pub fn is_complete(&self) -> bool {
        self.cache.is_complete()
    }

    /// How far the background pull has come (`None` without one, or before it starts).
    pub fn pull_progress(&self) -> Option<PullProgress> {
        self.puller.as_ref()?.get().map(Puller::progress)
    }

    /// Waits until the background pull is through every chunk (`None` without one, or when
    /// it was stopped before it started).
    pub async fn wait_pull(&self) -> Option<PullReport> {
        self.puller.as_ref()?.wait().await
    }

    /// Whether the write-back was sealed for good (an instant migration handed the remote
    /// over): nothing is pushed any more.
    pub fn is_sealed(&self) -> bool {
        self.pusher.is_sealed()
    }

    /// Chunks written and not yet taken for a push.
    pub fn dirty_count(&self) -> u64 {
        self.pusher.dirty_count()
    }

    /// What the write-back has done so far.
    pub fn push_stats(&self) -> PushStats {
        self.pusher.stats()
    }

    /// Stops the pull and the push interval, then pushes everything dirty and flushes the
    /// remote; returns that flush's result (on an error, unpushed chunks are lost with the
    /// store: call [`flush`](Store::flush) until it succeeds first if they must not be).
    pub async fn shutdown(self) -> StoreResult<()> {
        if let Some(p) = &self.puller {
            p.cancel();
        }
        self.pusher.shutdown().await
    }

    /// Reports the application's first touch of `idx` to the remote. On every read and write:
    /// a chunk touched before costs one load (`mark` would also write the set's counter).
    fn touch(&self, idx: ChunkIdx) {
        if self.geometry.contains(idx) && !self.touched.is_dirty(idx) && self.touched.mark(idx) {
            self.remote().touched(idx);
            if let Some(p) = &self.puller {
                p.start();
            }
        }
    }

    fn read_ahead(&self, idx: ChunkIdx) {
        if let Some(p) = self.puller.as_ref().and_then(Pull::get) {
            // `is_present` is false outside the region: check the index first.
            if self.readahead > 0 && self.geometry.contains(idx) && !self.cache.is_present(idx) {
                let end = (idx.0 + 1)
                    .saturating_add(self.readahead)
                    .min(self.geometry.chunk_count());
                p.prioritize((idx.0 + 1..end).map(ChunkIdx));
            }
        }
    }
}

/// A managed store's background pull: started at once, or, over a remote that knows its
/// working set (a region restored where it ran before), at the application's first read or
/// write, so that it does not compete with the application's own start (a VM's device state
/// loading: `farmap bench vm`'s lazy start reached the guest's first instruction in 20-24 ms
/// without a pull and 25-186 ms with one running, 2026-12-02).
struct Pull {
    puller: OnceLock<Puller>,
    /// What starts it, until it starts.
    pending: Mutex<Option<(Arc<Cache>, PullOptions, tokio::runtime::Handle)>>,
    /// Set once it started, or was cancelled before.
    settled: tokio::sync::watch::Sender<bool>,
}

impl Pull {
    fn now(puller: Puller) -> Pull {
        Pull {
            puller: OnceLock::from(puller),
            pending: Mutex::new(None),
            settled: tokio::sync::watch::Sender::new(true),
        }
    }

    /// # Panics
    /// Outside a tokio runtime.
    fn at_first_touch(cache: Arc<Cache>, opts: PullOptions) -> Pull {
        let rt = tokio::runtime::Handle::current();
        Pull {
            puller: OnceLock::new(),
            pending: Mutex::new(Some((cache, opts, rt))),
            settled: tokio::sync::watch::Sender::new(false),
        }
    }

    fn get(&self) -> Option<&Puller> {
        self.puller.get()
    }

    /// Starts it, if it waits.
    fn start(&self) {
        if *self.settled.borrow() {
            return;
        }
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((cache, opts, rt)) = pending.take() {
            let _rt = rt.enter();
            let _ = self.puller.set(Puller::start(cache, opts));
            self.settled.send_replace(true);
        }
    }

    fn cancel(&self) {
        // Under the lock: a start either finished (its puller is cancelled here) or finds
        // nothing to start.
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        pending.take();
        self.settled.send_replace(true);
        if let Some(p) = self.puller.get() {
            p.cancel();
        }
    }

    async fn wait(&self) -> Option<PullReport> {
        let _ = self.settled.subscribe().wait_for(|s| *s).await;
        Some(self.puller.get()?.wait().await)
    }
}

/// `order` with the chunks of `set` first, in their order (a list order stays as it is).
fn working_set_first(set: &[ChunkIdx], order: PullOrder) -> PullOrder {
    // Keys: the set from i64::MAX down, the rest below it in `order`'s own ranking.
    const REST: i64 = i64::MAX - (1 << 32);
    let rest: Arc<dyn Fn(ChunkIdx) -> i64 + Send + Sync> = match order {
        _ if set.is_empty() => return order,
        PullOrder::Sequential => Arc::new(|idx: ChunkIdx| -(idx.0.min(i64::MAX as u64) as i64)),
        PullOrder::Priority(f) => Arc::new(move |idx| f(idx).min(REST)),
        list @ PullOrder::List(_) => return list,
    };
    let rank: HashMap<u64, i64> = set
        .iter()
        .take(1 << 31)
        .enumerate()
        .map(|(i, c)| (c.0, i64::MAX - i as i64))
        .collect();
    PullOrder::Priority(Arc::new(move |idx| {
        rank.get(&idx.0).copied().unwrap_or_else(|| rest(idx))
    }))
}

impl Store for Managed {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn caps(&self) -> Caps {
        self.pusher.caps()
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        self.touch(idx);
        self.read_ahead(idx);
        self.pusher.read(idx)
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        self.touch(idx);
        self.pusher.write(idx, data)
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        self.pusher.flush()
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        self.pusher.trim(range)
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        self.pusher.status(idx)
    }

    /// Pulls the chunk into the local cache (NBD `CACHE` on a managed export).
    fn prefetch(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move { self.read(idx).await.map(drop) })
    }

    /// The remote's: reading it through this store fills the local cache too.
    fn working_set(&self) -> Option<Arc<[ChunkIdx]>> {
        self.remote().working_set()
    }
}

impl fmt::Debug for Managed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Managed")
            .field("geometry", &self.geometry)
            .field("present", &self.cache.present_count())
            .field("dirty", &self.pusher.dirty_count())
            .field("pull", &self.pull_progress())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// The chunks of a region of `n` in the order `order` pulls them.
    fn pulled(order: &PullOrder, n: u64) -> Vec<u64> {
        match order {
            PullOrder::Sequential => (0..n).collect(),
            PullOrder::List(l) => l.iter().map(|c| c.0).collect(),
            PullOrder::Priority(f) => {
                let mut v: Vec<u64> = (0..n).collect();
                v.sort_by_key(|&i| (std::cmp::Reverse(f(ChunkIdx(i))), i));
                v
            }
        }
    }

    #[test]
    fn the_working_set_is_pulled_first_then_the_rest_in_the_pull_s_order() {
        let set: Vec<ChunkIdx> = [5, 1, 7].into_iter().map(ChunkIdx).collect();
        let seq = working_set_first(&set, PullOrder::Sequential);
        assert_eq!(pulled(&seq, 9), [5, 1, 7, 0, 2, 3, 4, 6, 8]);
        let reverse = PullOrder::Priority(Arc::new(|idx| idx.0 as i64));
        let rev = working_set_first(&set, reverse);
        assert_eq!(pulled(&rev, 9), [5, 1, 7, 8, 6, 4, 3, 2, 0]);
        let huge = PullOrder::Priority(Arc::new(|_| i64::MAX));
        assert_eq!(pulled(&working_set_first(&set, huge), 4)[..2], [1, 0]);
        let list = PullOrder::List(vec![ChunkIdx(3)]);
        assert_eq!(pulled(&working_set_first(&set, list), 9), [3]);
        assert!(matches!(
            working_set_first(&[], PullOrder::Sequential),
            PullOrder::Sequential
        ));
    }

    fn remote(g: Geometry) -> Arc<MemoryStore> {
        Arc::new(MemoryStore::new(g))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn conformance() {
        farmap_testkit::run_conformance(|g| async move {
            let opts = ManagedOptions {
                push: PushOptions {
                    interval: Some(Duration::from_millis(5)),
                    ..PushOptions::default()
                },
                ..ManagedOptions::default()
            };
            Arc::new(Managed::open(remote(g), opts).unwrap()) as Arc<dyn Store>
        })
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pulls_everything_and_flush_pushes_everything() {
        for dense_local in [false, true] {
            pulls_and_pushes(dense_local).await;
        }
    }

    async fn pulls_and_pushes(dense_local: bool) {
        let g = Geometry::new(64 * 4096, 4096).unwrap();
        let r = remote(g);
        for i in 0..64u64 {
            r.write(ChunkIdx(i), Bytes::from(vec![i as u8 + 1; 4096]))
                .await
                .unwrap();
        }
        let opts = ManagedOptions {
            pull: Some(PullOptions {
                workers: 4,
                order: PullOrder::Sequential,
                ..PullOptions::default()
            }),
            push: PushOptions {
                interval: None,
                ..PushOptions::default()
            },
            readahead_chunks: 2,
            dense_local,
            cache_max: None,
        };
        let m = Managed::open(r.clone(), opts).unwrap();
        let report = m.wait_pull().await.unwrap();
        assert!(report.is_complete(), "{report:?}");
        assert!(m.is_complete());
        assert_eq!(m.read(ChunkIdx(9)).await.unwrap()[0], 10);
        m.write(ChunkIdx(3), Bytes::from(vec![0xee; 4096]))
            .await
            .unwrap();
        assert_eq!(m.dirty_count(), 1);
        assert_eq!(
            r.read(ChunkIdx(3)).await.unwrap()[0],
            4,
            "not pushed before flush"
        );
        m.flush().await.unwrap();
        assert_eq!(r.read(ChunkIdx(3)).await.unwrap()[0], 0xee);
        m.write(ChunkIdx(5), Bytes::from(vec![0xdd; 4096]))
            .await
            .unwrap();
        m.shutdown().await.unwrap();
        assert_eq!(
            r.read(ChunkIdx(5)).await.unwrap()[0],
            0xdd,
            "shutdown pushed it"
        );
    }
    /// The working set a versioned region records under a managed cache is the application's
    /// first touches, in order, not the pull's sweep.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_versioned_remote_records_the_application_s_touches_not_the_pull() {
        use farmap_versions::{At, Versioned, VersionedOptions};
        let dir = tempfile::tempdir().unwrap();
        let objects: Arc<dyn farmap_core::Objects> =
            Arc::new(farmap_store::DirObjects::open(dir.path()).unwrap());
        let g = Geometry::new(64 * 4096, 4096).unwrap();
        let open = || async {
            Arc::new(
                Versioned::open(
                    objects.clone(),
                    VersionedOptions {
                        region: "r".into(),
                        at: At::Latest,
                        read_only: false,
                        create: Some(g),
                        grace: None,
                        read_ahead: true,
                    },
                )
                .await
                .unwrap(),
            )
        };
        let v = open().await;
        for i in 0..64u64 {
            v.write(ChunkIdx(i), Bytes::from(vec![i as u8 + 1; 4096]))
                .await
                .unwrap();
        }
        v.flush().await.unwrap();
        drop(v);

        let m = Managed::open(open().await, ManagedOptions::default()).unwrap();
        // The pull reads all 64 chunks, in its own order.
        assert!(m.wait_pull().await.unwrap().is_complete());
        assert_eq!(m.read(ChunkIdx(40)).await.unwrap()[0], 41);
        m.write(ChunkIdx(7), Bytes::from(vec![0xee; 4096]))
            .await
            .unwrap();
        assert_eq!(m.read(ChunkIdx(7)).await.unwrap()[0], 0xee);
        m.read(ChunkIdx(2)).await.unwrap();
        m.read(ChunkIdx(40)).await.unwrap();
        m.shutdown().await.unwrap();

        let next = open().await;
        let set: Vec<u64> = next.working_set().unwrap().iter().map(|c| c.0).collect();
        assert_eq!(set, [40, 7, 2]);

        // Restored where it ran: the pull waits for the application's first touch.
        let m = Managed::open(next, ManagedOptions::default()).unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            m.pull_progress().is_none(),
            "no pull before the first touch"
        );
        assert_eq!(m.present_count(), 0);
        assert_eq!(m.read(ChunkIdx(5)).await.unwrap()[0], 6);
        assert!(m.wait_pull().await.unwrap().is_complete());
        assert!(m.is_complete());
        assert_eq!(m.read(ChunkIdx(7)).await.unwrap()[0], 0xee);
        m.shutdown().await.unwrap();

        // Shut down before any touch: nothing was pulled, and nothing waits for it.
        let m = Managed::open(open().await, ManagedOptions::default()).unwrap();
        m.shutdown().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_bounded_cache_conforms() {
        farmap_testkit::run_conformance(|g| async move {
            let opts = ManagedOptions {
                push: PushOptions {
                    interval: Some(Duration::from_millis(5)),
                    ..PushOptions::default()
                },
                // Two chunks (or the whole region for the smallest geometries).
                cache_max: Some(2 * u64::from(g.chunk_size())),
                ..ManagedOptions::default()
            };
            Arc::new(Managed::open(remote(g), opts).unwrap()) as Arc<dyn Store>
        })
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_bounded_cache_stays_bounded_and_loses_nothing() {
        let g = Geometry::new(64 * 4096, 4096).unwrap();
        let r = remote(g);
        let opts = ManagedOptions {
            push: PushOptions {
                interval: None,
                ..PushOptions::default()
            },
            cache_max: Some(8 * 4096 + 100),
            ..ManagedOptions::default()
        };
        let m = Managed::open(r.clone(), opts).unwrap();
        assert!(
            m.pull_progress().is_none(),
            "no background pull with a bound"
        );
        for i in 0..64u64 {
            m.write(ChunkIdx(i), Bytes::from(vec![i as u8 + 1; 4096]))
                .await
                .unwrap();
            assert!(m.present_count() <= 8, "{} present", m.present_count());
        }
        let stats = m.evict_stats().unwrap();
        assert_eq!(stats.max_chunks, 8);
        assert_eq!(stats.evicted_chunks, 56);
        assert_eq!(
            stats.written_back_chunks, 56,
            "every evicted chunk was modified"
        );
        for i in 0..64u64 {
            assert_eq!(m.read(ChunkIdx(i)).await.unwrap()[0], i as u8 + 1);
            assert!(m.present_count() <= 8);
        }
        m.shutdown().await.unwrap();
        for i in 0..64u64 {
            assert_eq!(
                r.read(ChunkIdx(i)).await.unwrap()[0],
                i as u8 + 1,
                "chunk {i}"
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_bound_refuses_a_dense_local_copy_and_sub_chunk_sizes() {
        let g = Geometry::new(64 * 4096, 4096).unwrap();
        for (dense_local, max) in [(true, 8 * 4096), (false, 4095)] {
            let opts = ManagedOptions {
                dense_local,
                cache_max: Some(max),
                ..ManagedOptions::default()
            };
            let err = Managed::open(remote(g), opts).unwrap_err();
            assert_eq!(err.kind(), farmap_core::ErrorKind::InvalidInput, "{err}");
        }
        // A bound the region fits in is no bound.
        let opts = ManagedOptions {
            dense_local: true,
            cache_max: Some(64 * 4096),
            ..ManagedOptions::default()
        };
        let m = Managed::open(remote(g), opts).unwrap();
        assert!(m.evict_stats().is_none());
    }
}
