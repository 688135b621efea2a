//! [`Pusher`]: write-back of dirty chunks from a local store to a remote one, in the
//! background on an interval and completely on `flush`.

use std::collections::VecDeque;
use std::fmt;
use std::ops::Range;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use farmap_core::{
    BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, Geometry, Store, StoreError, StoreResult,
};
use futures::StreamExt;
use parking_lot::Mutex;
use tokio::sync::{Notify, RwLock, RwLockWriteGuard};
use tokio::task::JoinHandle;

use crate::dirty::DirtySet;
use crate::retry::{retry, RetryPolicy};
use crate::tracked::Tracked;

/// How a [`Pusher`] writes back.
#[derive(Debug, Clone)]
pub struct PushOptions {
    /// Chunk pushes in flight at once (at least 1 is used).
    pub workers: usize,
    /// How often the background task pushes what is dirty; `None` pushes only on `flush`.
    pub interval: Option<Duration>,
    /// How often a checkpoint runs: everything dirty is pushed and the remote flushed (for
    /// a store that keeps versions, a version each time something changed), as a `flush`
    /// does; `None`: only at a `flush`. A checkpoint that fails is logged and counted in
    /// the stats; the next one tries again.
    pub checkpoint_every: Option<Duration>,
    /// Retries of reads, writes and flushes that fail with a retryable error.
    pub retry: RetryPolicy,
}

impl Default for PushOptions {
    /// 16 pushes in flight, every second, the default retry policy.
    fn default() -> Self {
        Self {
            workers: 16,
            interval: Some(Duration::from_secs(1)),
            checkpoint_every: None,
            retry: RetryPolicy::default(),
        }
    }
}

/// What a [`Pusher`] has done so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PushStats {
    /// Chunks written to the remote.
    pub pushed_chunks: u64,
    /// Bytes of those chunks.
    pub pushed_bytes: u64,
    /// Pushes that failed after their retries (the chunk was marked dirty again).
    pub failed_pushes: u64,
    /// The most recent failure (of a push, or of a flush), with its causes.
    pub last_error: Option<String>,
}

/// A stage that writes every write (and trim) to its inner store and, later, to a remote:
/// the write-back half of a managed mount (`Pusher` over `Arc<Cached<local, remote>>`, with
/// the same remote).
///
/// - Writes and trims go to the inner store through a [`Tracked`] stage, which marks each
///   chunk dirty **after** the inner operation completes (see `Tracked` for why); the pusher
///   takes that dirty set, so the two share one implementation of dirty tracking.
/// - Reads and status go to the inner store.
/// - A background task (when [`PushOptions::interval`] is set) takes the dirty set on every
///   tick and pushes each chunk: reads it from the inner store, writes it to the remote.
/// - [`flush`](Store::flush) returns `Ok` only when every chunk written before it was called
///   is in the remote and the remote (and the inner store) are flushed. If any chunk could
///   not be pushed, it returns the first error; the chunk stays dirty for the next try.
///
/// # Concurrency
/// - App writes never wait for pushes or flushes.
/// - Background rounds hold a read guard of one `RwLock` from before they take the dirty set
///   until their last push has finished (or failed and been marked dirty again). A flush
///   takes the write guard, which waits for the round in flight and holds off new ones, then
///   takes the dirty set itself: a chunk taken by a round but not yet in the remote is
///   therefore never missed by a flush.
/// - Rounds and flushes exclude each other, so one chunk is never pushed twice at once, and
///   pushes of the same chunk reach the remote in the order their data was read.
/// - A push interrupted (a flush future dropped) marks its chunks dirty again.
/// - Dropping the `Pusher` stops the background task; chunks still dirty are **not** pushed.
///   Call [`shutdown`](Self::shutdown) for a final flush.
///
/// # The push ledger
/// Every successful push records, for its chunk, a generation (one counter per pusher,
/// starting at 1) and the XXH3-64 of the bytes written. [`seal`](Self::seal) stops all
/// pushing for good and returns the ledger with the chunks still dirty: what an instant
/// migration hands over (a chunk with a ledger entry and not dirty is in the remote exactly
/// as hashed). The ledger costs 16 bytes per chunk of address space, committed only for
/// chunks pushed.
pub struct Pusher<S, R> {
    shared: Arc<Shared<S, R>>,
    stop: Arc<Stop>,
    background: Option<JoinHandle<()>>,
}

/// Where a [`Pusher`] finds chunks written behind its back — a userfaultfd region whose
/// application writes memory directly, say — drained into the pusher's dirty set at the start
/// of every background round and every flush, under the same exclusion as the push itself.
pub trait DirtySource: Send + Sync + 'static {
    /// Marks in `into` every chunk written since the last call and starts tracking anew,
    /// atomically with respect to concurrent writers (a write is reported by this call or by
    /// the next one, never lost).
    fn collect(&self, into: &DirtySet) -> StoreResult<()>;

    /// Like [`collect`](Self::collect), for the chunks of `runs` (ascending chunk runs) only:
    /// writes elsewhere stay for a later call. The default collects everything, which is
    /// never wrong (a write is reported no later than it would have been).
    fn collect_within(&self, into: &DirtySet, runs: &[Range<u64>]) -> StoreResult<()> {
        let _ = runs;
        self.collect(into)
    }
}

/// What a [`Pusher`] asks before pushing a chunk, when its inner store may drop chunks it
/// holds (a bounded [`Cached`](crate::cached::Cached) store, which implements this).
pub trait PushHold: Send + Sync + 'static {
    /// Runs `push` (read chunk `idx` from the inner store, write it to the remote) while
    /// chunk `idx` is held in the inner store, so that nothing else writes it to the remote
    /// meanwhile; returns `Ok(false)` without running it when the chunk need not be pushed
    /// (not held, and the remote already has its newest data).
    fn hold<'a>(
        &'a self,
        idx: ChunkIdx,
        push: BoxFuture<'a, StoreResult<()>>,
    ) -> BoxFuture<'a, StoreResult<bool>>;
}

struct Shared<S, R> {
    /// The inner store, with the dirty set of every chunk written or trimmed through it: the
    /// pusher's writes and trims go through `Tracked`, which marks after the inner operation.
    tracked: Tracked<S>,
    remote: R,
    source: Option<Arc<dyn DirtySource>>,
    hold: Option<Arc<dyn PushHold>>,
    gate: RwLock<()>,
    workers: usize,
    policy: RetryPolicy,
    pushed_chunks: AtomicU64,
    pushed_bytes: AtomicU64,
    failed_pushes: AtomicU64,
    last_error: Mutex<Option<String>>,
    /// Per chunk: [generation, XXH3-64] of its last push (generation 0: never pushed).
    ledger: Mutex<Vec<[u64; 2]>>,
    generation: AtomicU64,
    /// Set by [`Pusher::seal`]: nothing is pushed any more.
    sealed: AtomicBool,
    /// Set when a seal starts: the round in flight starts no more pushes (its chunks stay
    /// dirty), so that the seal waits only for the pushes already running.
    sealing: AtomicBool,
    /// (when, generation) at the start of the latest rounds and flushes, oldest first: which
    /// chunks were pushed lately (the hot ones of a [`Pusher::draft`]).
    marks: Mutex<VecDeque<(Instant, u64)>>,
    /// What the last [`Pusher::draft`] handed over, for the seals that follow it.
    draft: Mutex<Option<DraftState>>,
    /// Notified when a seal pending since a draft (or a seal waiting for the gate) is
    /// resolved: sealed for good, or undone by [`Pusher::unseal`]. Flushes wait for it.
    resolved: Notify,
}

/// Longest a flush waits for a migration that drafted the hand-over of the region to seal it
/// or give it up (then it fails with `Timeout`). Between the two the writers are being
/// suspended, which takes milliseconds. A writer that flushes while the suspension waits for
/// it (a thread blocked in `fsync` does not stop for `SIGSTOP`; a writer may sync while it
/// holds its pass) keeps both waiting until the suspension gives up: its patience is far
/// shorter than this (seconds at most), the migration is abandoned, and the flush pushes.
pub const DRAFT_PATIENCE: Duration = Duration::from_secs(30);

/// Rounds remembered in `marks`.
const MARKS: usize = 64;

/// Hot runs closer than this many chunks are scanned as one (a scan's system call costs more
/// than walking a few chunks' page tables).
const HOT_GAP: u64 = 8;

/// A draft handed over, and what the seals since found.
struct DraftState {
    /// Per chunk: placed at the source (by the draft or a seal since).
    at_source: Vec<bool>,
    /// The chunk runs the first seal collects (the rest are collected after the hand-over).
    hot: Vec<Range<u64>>,
}

/// What a [`Pusher`] hands over before its writers stop: the ledger as it stands once the
/// pushes are quiesced, and the chunks written lately.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushDraft {
    /// The ledger; `dirty` holds the chunks written and not pushed so far.
    pub ledger: PushLedger,
    /// Ascending chunk runs pushed lately and not dirty: the chunks in the remote most likely
    /// to be written again before the writers stop, which [`Pusher::seal_hot`] collects.
    pub hot: Vec<Range<u64>>,
}

/// What a seal after a [`Pusher::draft`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SealDelta {
    /// Chunk runs (ascending) written since the draft that it placed in the remote: only
    /// the local store holds them now.
    pub at_source: Vec<Range<u64>>,
    /// Chunk runs (ascending) not collected yet: a later seal says whether they were written.
    pub pending: Vec<Range<u64>>,
}

/// A pusher's seal in two steps as an object ([`Pusher::draft`], [`Pusher::seal_hot`],
/// [`Pusher::seal_rest`], [`Pusher::unseal`]): for a frontend that hands its store over
/// without knowing the pusher's type (a managed mount's instant migration).
pub trait Seal: Send + Sync {
    /// [`Pusher::draft`].
    fn draft(&self, window: Duration) -> BoxFuture<'_, StoreResult<PushDraft>>;
    /// [`Pusher::seal_hot`].
    fn seal_hot(&self) -> BoxFuture<'_, StoreResult<SealDelta>>;
    /// [`Pusher::seal_rest`].
    fn seal_rest(&self) -> BoxFuture<'_, SealDelta>;
    /// [`Pusher::unseal`].
    fn unseal(&self);
    /// Pushes what is dirty for at most `budget` (a flush cut short leaves the rest
    /// dirty); `Ok(true)` if everything was pushed.
    fn push_for(&self, budget: Duration) -> BoxFuture<'_, StoreResult<bool>>;
}

impl<S: Store, R: Store> Seal for Pusher<S, R> {
    fn draft(&self, window: Duration) -> BoxFuture<'_, StoreResult<PushDraft>> {
        Box::pin(Pusher::draft(self, window))
    }

    fn seal_hot(&self) -> BoxFuture<'_, StoreResult<SealDelta>> {
        Box::pin(Pusher::seal_hot(self))
    }

    fn seal_rest(&self) -> BoxFuture<'_, SealDelta> {
        Box::pin(Pusher::seal_rest(self))
    }

    fn unseal(&self) {
        Pusher::unseal(self)
    }

    fn push_for(&self, budget: Duration) -> BoxFuture<'_, StoreResult<bool>> {
        Box::pin(async move {
            match tokio::time::timeout(budget, self.shared.flush()).await {
                Ok(r) => r.map(|()| true),
                Err(_) => Ok(false),
            }
        })
    }
}

/// What a [`Pusher`] hands over when it is [sealed](Pusher::seal).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushLedger {
    /// Per chunk: (generation, XXH3-64 of the bytes pushed) of its last push, or `None` if
    /// this pusher never pushed it.
    pub pushed: Vec<Option<(u64, u64)>>,
    /// Chunks written and not pushed (their remote copy, if any, is older): those the
    /// dirty source reported at the seal (written most recently) first, then the others,
    /// each part ascending.
    pub dirty: Vec<ChunkIdx>,
}

/// A stop signal the background task waits on without keeping the shared state alive.
#[derive(Default)]
struct Stop {
    stopped: AtomicBool,
    event: Notify,
}

impl Stop {
    fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
        self.event.notify_waiters();
    }

    async fn wait(&self) {
        let mut notified = pin!(self.event.notified());
        notified.as_mut().enable();
        if !self.stopped.load(Ordering::Acquire) {
            notified.await;
        }
    }
}

/// Chunks taken from the dirty set and being pushed; marked dirty again if dropped armed.
struct Taken<'a> {
    dirty: &'a DirtySet,
    chunks: Vec<ChunkIdx>,
    armed: bool,
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        if self.armed {
            for &idx in &self.chunks {
                self.dirty.mark(idx);
            }
        }
    }
}

impl<S: Store, R: Store> Shared<S, R> {
    /// Pushes one chunk (held, when there is a [`PushHold`]).
    async fn push_one(&self, idx: ChunkIdx) -> StoreResult<()> {
        match &self.hold {
            None => self.push_now(idx).await,
            Some(hold) => hold
                .hold(idx, Box::pin(self.push_now(idx)))
                .await
                .map(|_| ()),
        }
    }

    /// Pushes one chunk now: inner read, remote write, both retried.
    async fn push_now(&self, idx: ChunkIdx) -> StoreResult<()> {
        let wrap = |what: &'static str| {
            move |e: StoreError| {
                StoreError::new(e.kind(), format!("pushing {idx}: {what}")).with_source(e)
            }
        };
        let data: Bytes = retry(self.policy, || self.tracked.inner().read(idx))
            .await
            .map_err(wrap("reading it locally"))?;
        let len = data.len() as u64;
        let sum = xxhash_rust::xxh3::xxh3_64(&data);
        retry(self.policy, || self.remote.write(idx, data.clone()))
            .await
            .map_err(wrap("writing it to the remote store"))?;
        let gen = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
        if let Some(e) = self.ledger.lock().get_mut(idx.0 as usize) {
            *e = [gen, sum];
        }
        self.pushed_chunks.fetch_add(1, Ordering::Relaxed);
        self.pushed_bytes.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }

    /// Takes the dirty set and pushes it; failed chunks are marked dirty again. Returns the
    /// first error. The caller holds a guard of `gate`.
    async fn push_dirty(&self) -> Option<StoreError> {
        // Sealed, or a seal (or a draft) waits: nothing would be pushed, so nothing is
        // collected either (a collect may walk the whole region).
        if self.sealed.load(Ordering::Acquire) || self.sealing.load(Ordering::Acquire) {
            return Some(sealed_error());
        }
        {
            let mut marks = self.marks.lock();
            if marks.len() == MARKS {
                marks.pop_front();
            }
            marks.push_back((Instant::now(), self.generation.load(Ordering::Relaxed)));
        }
        if let Some(source) = &self.source {
            if let Err(e) = source.collect(self.tracked.dirty()) {
                *self.last_error.lock() = Some(e.to_owned_lossy().to_string());
                return Some(e);
            }
        }
        self.push_taken(Taken {
            dirty: self.tracked.dirty(),
            chunks: self.tracked.take_dirty(),
            armed: true,
        })
        .await
    }

    /// Pushes the chunks of `taken`, `workers` at a time; each that fails (or is not started
    /// because a seal is waiting) is marked dirty again. Returns the first error.
    async fn push_taken(&self, mut taken: Taken<'_>) -> Option<StoreError> {
        let first_error = Mutex::new(None);
        let dirty = taken.dirty;
        futures::stream::iter(taken.chunks.iter().copied())
            .for_each_concurrent(self.workers, |idx| {
                let first_error = &first_error;
                async move {
                    if self.sealing.load(Ordering::Acquire) {
                        // A seal is waiting: leave the chunk dirty (and a flush fails: it
                        // did not push everything).
                        dirty.mark(idx);
                        first_error.lock().get_or_insert_with(sealed_error);
                        return;
                    }
                    if let Err(e) = self.push_one(idx).await {
                        dirty.mark(idx);
                        self.failed_pushes.fetch_add(1, Ordering::Relaxed);
                        *self.last_error.lock() = Some(e.to_owned_lossy().to_string());
                        first_error.lock().get_or_insert(e);
                    }
                }
            })
            .await;
        taken.armed = false;
        first_error.into_inner()
    }

    /// Pushes `chunks` (and nothing else), then flushes the remote. The caller holds the
    /// write guard of `gate`. Their dirty marks are cleared first and set again for every
    /// chunk whose push fails (or if this future is dropped part way).
    async fn push_chunks(&self, chunks: &[ChunkIdx]) -> StoreResult<()> {
        if self.sealed.load(Ordering::Acquire) {
            return Err(sealed_error());
        }
        let dirty = self.tracked.dirty();
        for &idx in chunks {
            dirty.clear(idx);
        }
        let taken = Taken {
            dirty,
            chunks: chunks.to_vec(),
            armed: true,
        };
        if let Some(e) = self.push_taken(taken).await {
            return Err(e);
        }
        retry(self.policy, || self.remote.flush())
            .await
            .map_err(|e| {
                StoreError::new(e.kind(), "flushing the remote store after a push").with_source(e)
            })
    }

    async fn background_round(&self) {
        let _round = self.gate.read().await;
        if self.sealed.load(Ordering::Acquire) {
            return;
        }
        // Errors are recorded in the stats and the chunks stay dirty: the next round or
        // flush retries them, and a flush reports them.
        let _ = self.push_dirty().await;
    }

    /// Whether a seal has started (a draft, or a seal waiting for the gate) but not ended:
    /// no push may start, and the region may be handed over or kept.
    fn seal_pending(&self) -> bool {
        self.sealing.load(Ordering::Acquire) && !self.sealed.load(Ordering::Acquire)
    }

    /// Called when a pending seal is resolved (sealed, or unsealed).
    fn seal_resolved(&self) {
        self.resolved.notify_waiters();
    }

    async fn flush(&self) -> StoreResult<()> {
        // A flush while a migration hands the region over waits to learn how that ends: kept
        // (unsealed), it pushes as usual; handed over (sealed), it fails with `Closed`, as
        // every flush after a seal does. It does not push meanwhile: the seal would then wait
        // for those pushes inside the application's downtime.
        let started = Instant::now();
        loop {
            let resolved = self.resolved.notified();
            {
                // Waits for the background round in flight, holds off new ones; app writes
                // go on.
                let exclusive = self.gate.write().await;
                if !self.seal_pending() {
                    match self.push_dirty().await {
                        None => return self.flush_remote(exclusive).await,
                        // A draft started meanwhile: its chunks stay dirty; wait for it.
                        Some(_) if self.seal_pending() => {}
                        Some(e) => return Err(e),
                    }
                }
            }
            let left = DRAFT_PATIENCE.saturating_sub(started.elapsed());
            let timeout = pin!(crate::timer::sleep(left));
            if let futures::future::Either::Right(_) =
                futures::future::select(pin!(resolved), timeout).await
            {
                return Err(StoreError::new(
                    farmap_core::ErrorKind::Timeout,
                    format!(
                        "flushing: a migration has been handing this region over for \
                         {DRAFT_PATIENCE:?} without sealing it or giving up; nothing was pushed \
                         meanwhile"
                    ),
                ));
            }
        }
    }

    /// The end of a flush whose pushes succeeded: flushes the remote and the inner store.
    async fn flush_remote(&self, _exclusive: RwLockWriteGuard<'_, ()>) -> StoreResult<()> {
        let (remote, inner) = futures::join!(
            retry(self.policy, || self.remote.flush()),
            self.tracked.inner().flush()
        );
        let result = remote
            .map_err(|e| {
                StoreError::new(e.kind(), "flushing the remote store after a push").with_source(e)
            })
            .and(inner);
        if let Err(e) = &result {
            *self.last_error.lock() = Some(e.to_owned_lossy().to_string());
        }
        result
    }
}

/// The runs of indices whose flag is set, joining runs less than `gap` apart.
fn merge_runs(flags: impl Iterator<Item = bool>, gap: u64) -> Vec<Range<u64>> {
    let mut runs: Vec<Range<u64>> = Vec::new();
    for (i, set) in flags.enumerate() {
        let i = i as u64;
        if !set {
            continue;
        }
        match runs.last_mut() {
            Some(r) if i <= r.end + gap => r.end = i + 1,
            _ => runs.push(i..i + 1),
        }
    }
    runs
}

/// `0..n` less the ascending, disjoint `runs`.
fn complement(runs: &[Range<u64>], n: u64) -> Vec<Range<u64>> {
    let mut out = Vec::new();
    let mut at = 0;
    for r in runs {
        if r.start > at {
            out.push(at..r.start.min(n));
        }
        at = at.max(r.end);
    }
    if at < n {
        out.push(at..n);
    }
    out
}

/// The union of two lists of ascending, disjoint runs, as ascending disjoint runs.
fn merge_sorted(a: &[Range<u64>], b: &[Range<u64>]) -> Vec<Range<u64>> {
    let mut all: Vec<Range<u64>> = a.iter().chain(b).cloned().collect();
    all.sort_unstable_by_key(|r| r.start);
    let mut out: Vec<Range<u64>> = Vec::new();
    for r in all {
        match out.last_mut() {
            Some(l) if r.start <= l.end => l.end = l.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

fn sealed_error() -> StoreError {
    StoreError::new(
        farmap_core::ErrorKind::Closed,
        "this pusher was sealed (its region was handed over): it pushes nothing any more",
    )
}

async fn run_background<S: Store, R: Store>(
    shared: Weak<Shared<S, R>>,
    stop: Arc<Stop>,
    interval: Option<Duration>,
    checkpoint_every: Option<Duration>,
) {
    let after = |d: Option<Duration>| d.map(|d| tokio::time::Instant::now() + d);
    let (mut round_at, mut checkpoint_at) = (after(interval), after(checkpoint_every));
    loop {
        // Checked before a timer is made: once stopped, the runtime may be shutting down,
        // and making a timer then panics.
        if stop.stopped.load(Ordering::Acquire) {
            return;
        }
        let Some(wake) = round_at.into_iter().chain(checkpoint_at).min() else {
            return;
        };
        tokio::select! {
            // The stop first: woken by it while the runtime shuts down, the task must not
            // poll its timer (that panics then).
            biased;
            _ = stop.wait() => return,
            _ = tokio::time::sleep_until(wake) => {}
        }
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let now = tokio::time::Instant::now();
        if checkpoint_at.is_some_and(|at| at <= now) {
            // A checkpoint pushes everything too: the next round counts from it.
            if let Err(e) = shared.flush().await {
                tracing::warn!(
                    "a checkpoint failed (the next one tries again): {}",
                    farmap_core::error_chain(&e)
                );
            }
            checkpoint_at = after(checkpoint_every);
            round_at = after(interval);
        } else {
            shared.background_round().await;
            round_at = after(interval);
        }
        drop(shared);
        // The round's dirty scan may have run under `block_in_place`, which hands this
        // worker's core to another thread: this thread then finishes the task's poll on its
        // own, and the runtime may shut down (its timer too) meanwhile, whatever the stop
        // check above says. Yielding moves the task back onto a worker that holds a core
        // (or, if the runtime is shutting down, it is dropped) before it makes a timer.
        tokio::task::yield_now().await;
    }
}

impl<S: Store, R: Store> Pusher<S, R> {
    /// Writes through to `inner` and back to `remote`, which must have the same geometry.
    /// Starts the background task when `opts.interval` is set.
    ///
    /// # Panics
    /// With an interval, outside a tokio runtime.
    pub fn new(inner: S, remote: R, opts: PushOptions) -> StoreResult<Self> {
        Self::build(inner, remote, opts, None, None)
    }

    /// Like [`new`](Self::new), asking `hold` before every push (for an inner store that
    /// drops chunks: a bounded [`Cached`](crate::cached::Cached), passed here as well).
    pub fn with_hold(
        inner: S,
        remote: R,
        opts: PushOptions,
        hold: Arc<dyn PushHold>,
    ) -> StoreResult<Self> {
        Self::build(inner, remote, opts, None, Some(hold))
    }

    /// Like [`new`](Self::new), and also pushes the chunks that `source` reports written
    /// (collected at the start of every round and every flush).
    pub fn with_source(
        inner: S,
        remote: R,
        opts: PushOptions,
        source: Arc<dyn DirtySource>,
    ) -> StoreResult<Self> {
        Self::build(inner, remote, opts, Some(source), None)
    }

    fn build(
        inner: S,
        remote: R,
        opts: PushOptions,
        source: Option<Arc<dyn DirtySource>>,
        hold: Option<Arc<dyn PushHold>>,
    ) -> StoreResult<Self> {
        let geometry = crate::same_geometry(&inner, &remote, "a pusher")?;
        let shared = Arc::new(Shared {
            tracked: Tracked::new(inner),
            source,
            hold,
            remote,
            gate: RwLock::new(()),
            workers: opts.workers.max(1),
            policy: opts.retry,
            pushed_chunks: AtomicU64::new(0),
            pushed_bytes: AtomicU64::new(0),
            failed_pushes: AtomicU64::new(0),
            last_error: Mutex::new(None),
            // Zeroed memory: committed only where chunks are pushed.
            ledger: Mutex::new(vec![[0; 2]; geometry.chunk_count() as usize]),
            generation: AtomicU64::new(0),
            sealed: AtomicBool::new(false),
            sealing: AtomicBool::new(false),
            marks: Mutex::new(VecDeque::with_capacity(MARKS)),
            draft: Mutex::new(None),
            resolved: Notify::new(),
        });
        let stop = Arc::new(Stop::default());
        let background = (opts.interval.is_some() || opts.checkpoint_every.is_some()).then(|| {
            tokio::spawn(run_background(
                Arc::downgrade(&shared),
                stop.clone(),
                opts.interval,
                opts.checkpoint_every,
            ))
        });
        Ok(Self {
            shared,
            stop,
            background,
        })
    }

    /// Marks `idx` dirty, as if it had been written through this pusher (for writes made
    /// to the inner store directly). Out-of-range indices are ignored.
    pub fn mark_dirty(&self, idx: ChunkIdx) {
        if self.shared.tracked.geometry().contains(idx) {
            self.shared.tracked.dirty().mark(idx);
        }
    }

    /// Writes back `chunks` now, whether marked dirty or not, and only them: for a caller
    /// about to drop its local copies (a bounded region's reclaim), for which a whole
    /// [`flush`](Store::flush) would also push every other dirty chunk.
    ///
    /// Ordered like a flush: it waits for the background round in flight and holds off new
    /// ones, so no push of an older copy of one of these chunks can land after it. Their
    /// dirty marks are cleared before their pushes read them (a write meanwhile marks the
    /// chunk again, for the next round). `Ok` means each chunk's content as read by its push
    /// is in the remote, and the remote is flushed; on an error the chunks that failed are
    /// marked dirty again and the first error is returned.
    pub async fn write_back(&self, chunks: &[ChunkIdx]) -> StoreResult<()> {
        let g = self.shared.tracked.geometry();
        for &idx in chunks {
            g.check_idx(idx)?;
        }
        let _exclusive = self.shared.gate.write().await;
        self.shared.push_chunks(chunks).await
    }

    /// Stops pushing for good and returns the ledger and the chunks still dirty (after
    /// collecting the dirty source one last time). A round in flight starts no more pushes
    /// (its other chunks stay dirty) and the seal waits only for the pushes already running
    /// (or a write-back in flight); from then on, rounds push nothing and flushes and write-backs fail with
    /// `Closed`. Meant for a region whose writers are stopped and whose remote now belongs
    /// to someone else (an instant migration's source after the hand-over): a push landing
    /// later could overwrite the new owner's data.
    pub async fn seal(&self) -> StoreResult<PushLedger> {
        self.shared.sealing.store(true, Ordering::Release);
        let _exclusive = self.shared.gate.write().await;
        self.shared.sealed.store(true, Ordering::Release);
        self.shared.seal_resolved();
        let mut older = self.shared.tracked.take_dirty();
        let collected = match &self.shared.source {
            Some(source) => source.collect(self.shared.tracked.dirty()),
            None => Ok(()),
        };
        let mut recent = self.shared.tracked.take_dirty();
        // Still dirty: give them back, so that the stage's count stays honest.
        for &idx in older.iter().chain(&recent) {
            self.shared.tracked.dirty().mark(idx);
        }
        collected?;
        recent.sort_unstable();
        older.sort_unstable();
        older.retain(|c| recent.binary_search(c).is_err());
        let mut dirty = recent;
        dirty.extend(older);
        let pushed = self
            .shared
            .ledger
            .lock()
            .iter()
            .map(|[gen, sum]| (*gen > 0).then_some((*gen, *sum)))
            .collect();
        Ok(PushLedger { pushed, dirty })
    }

    /// Undoes a [`draft`](Self::draft) or a seal: pushes resume (a
    /// migration abandoned before its hand-over; the chunks still dirty are pushed by the
    /// next round).
    pub fn unseal(&self) {
        *self.shared.draft.lock() = None;
        self.shared.sealed.store(false, Ordering::Release);
        self.shared.sealing.store(false, Ordering::Release);
        self.shared.seal_resolved();
    }

    /// The first half of a seal in two steps, while the writers still run: starts no more
    /// pushes and waits for the ones running, collects the dirty source, and returns the
    /// ledger as it stands (from here on it only changes by chunks turning dirty) with the
    /// chunks not dirty and pushed by the rounds and flushes that started within `window`:
    /// the *hot* chunks, which
    /// [`seal_hot`](Self::seal_hot) collects once the writers are stopped, so that the work
    /// inside the downtime follows what the writers touch, not the region's size.
    /// [`seal_rest`](Self::seal_rest) collects the others after that. Undone by
    /// [`unseal`](Self::unseal). A flush from then on waits for the seal (and fails with
    /// `Closed`) or the unseal (and pushes), at most [`DRAFT_PATIENCE`]. Without a dirty source, every chunk is hot (the dirty set
    /// is all there is to look at).
    pub async fn draft(&self, window: Duration) -> StoreResult<PushDraft> {
        let s = &self.shared;
        s.sealing.store(true, Ordering::Release);
        let _exclusive = s.gate.write().await;
        if let Some(source) = &s.source {
            source.collect(s.tracked.dirty())?;
        }
        // No push runs or starts from here on: a flush now saves every push, so that a store
        // that keeps what it saves as versions lists them all in one (the version the new
        // host reads). A failed flush costs only speed: the new host checks each chunk
        // against the ledger and takes a stale one from the source.
        if let Err(e) = retry(s.policy, || s.remote.flush()).await {
            tracing::warn!(
                "flushing the remote store before the hand-over failed (the new host takes \
                 what it cannot read there from here): {}",
                farmap_core::error_chain(&e)
            );
        }
        let mut dirty = s.tracked.take_dirty();
        for &idx in &dirty {
            s.tracked.dirty().mark(idx);
        }
        dirty.sort_unstable();
        let n = s.tracked.geometry().chunk_count();
        // Pushed lately: by the rounds (and flushes) that started within the window.
        let since = {
            let marks = s.marks.lock();
            let cut = Instant::now().checked_sub(window);
            marks
                .iter()
                .find(|(at, _)| cut.is_none_or(|c| *at > c))
                .map_or(s.generation.load(Ordering::Relaxed), |&(_, gen)| gen)
        };
        let mut at_source = vec![false; n as usize];
        for &idx in &dirty {
            at_source[idx.0 as usize] = true;
        }
        let ledger = s.ledger.lock();
        let pushed: Vec<Option<(u64, u64)>> = ledger
            .iter()
            .map(|[gen, sum]| (*gen > 0).then_some((*gen, *sum)))
            .collect();
        let hot = if s.source.is_none() {
            std::iter::once(0..n).filter(|r| !r.is_empty()).collect()
        } else {
            // A chunk at the source already needs no look: what it holds is read from
            // here after the hand-over whatever was written.
            let lately = ledger
                .iter()
                .zip(&at_source)
                .map(|([gen, _], &src)| !src && *gen > since);
            merge_runs(lately, HOT_GAP)
        };
        drop(ledger);
        *s.draft.lock() = Some(DraftState {
            at_source,
            hot: hot.clone(),
        });
        Ok(PushDraft {
            ledger: PushLedger { pushed, dirty },
            hot,
        })
    }

    /// With the writers stopped, after a [`draft`](Self::draft): stops pushing for good
    /// (like [`seal`](Self::seal)), collects the dirty source within the draft's hot chunks
    /// only, and returns the chunks written since the draft there; every other chunk is
    /// `pending` until [`seal_rest`](Self::seal_rest). On an error the pusher stays sealed
    /// (call [`unseal`](Self::unseal) to resume).
    pub async fn seal_hot(&self) -> StoreResult<SealDelta> {
        let s = &self.shared;
        s.sealing.store(true, Ordering::Release);
        let _exclusive = s.gate.write().await;
        s.sealed.store(true, Ordering::Release);
        s.seal_resolved();
        let n = s.tracked.geometry().chunk_count();
        let hot = match s.draft.lock().as_ref() {
            Some(d) => d.hot.clone(),
            None => {
                return Err(StoreError::invalid(
                    "a seal of the hot chunks needs a draft first",
                ))
            }
        };
        if let Some(source) = &s.source {
            source.collect_within(s.tracked.dirty(), &hot)?;
        }
        Ok(self.take_new(complement(&hot, n)))
    }

    /// [`seal_hot`](Self::seal_hot) on the calling thread, which may block (a suspension's):
    /// inside a migration's downtime, a round trip to a runtime's worker would cost two
    /// thread wake-ups. Not for an async task.
    pub fn seal_hot_blocking(&self) -> StoreResult<SealDelta> {
        futures::executor::block_on(self.seal_hot())
    }

    /// After [`seal_hot`](Self::seal_hot): collects the dirty source over the chunks it left
    /// pending and returns those written since the draft. If the source cannot be collected,
    /// every pending chunk is placed at the source (never wrong, only slower for the new
    /// owner), and the error is logged.
    pub async fn seal_rest(&self) -> SealDelta {
        let s = &self.shared;
        let _exclusive = s.gate.write().await;
        let n = s.tracked.geometry().chunk_count();
        let Some(hot) = s.draft.lock().as_ref().map(|d| d.hot.clone()) else {
            return SealDelta::default();
        };
        let cold = complement(&hot, n);
        let collected = match &s.source {
            Some(source) if !cold.is_empty() => source.collect_within(s.tracked.dirty(), &cold),
            _ => Ok(()),
        };
        match collected {
            Ok(()) => self.take_new(Vec::new()),
            Err(e) => {
                tracing::warn!(
                    "collecting the chunks written last failed ({}): placing every chunk not \
                     looked at yet at the source",
                    farmap_core::error_chain(&e)
                );
                let mut delta = self.take_new(Vec::new());
                if let Some(d) = s.draft.lock().as_mut() {
                    for r in &cold {
                        for c in r.clone() {
                            d.at_source[c as usize] = true;
                        }
                    }
                }
                delta.at_source = merge_sorted(&delta.at_source, &cold);
                delta
            }
        }
    }

    /// The dirty chunks not placed at the source yet (placing them there), and `pending`.
    fn take_new(&self, pending: Vec<Range<u64>>) -> SealDelta {
        let s = &self.shared;
        let dirty = s.tracked.take_dirty();
        for &idx in &dirty {
            s.tracked.dirty().mark(idx);
        }
        let mut new = Vec::new();
        if let Some(d) = s.draft.lock().as_mut() {
            for idx in dirty {
                if let Some(x) = d.at_source.get_mut(idx.0 as usize) {
                    if !std::mem::replace(x, true) {
                        new.push(idx.0);
                    }
                }
            }
        }
        new.sort_unstable();
        let mut at_source: Vec<Range<u64>> = Vec::new();
        for c in new {
            match at_source.last_mut() {
                Some(r) if r.end == c => r.end += 1,
                _ => at_source.push(c..c + 1),
            }
        }
        SealDelta { at_source, pending }
    }

    /// Whether [`seal`](Self::seal) was called.
    pub fn is_sealed(&self) -> bool {
        self.shared.sealed.load(Ordering::Acquire)
    }

    /// Stops the background task for good, before its runtime shuts down: a round in flight
    /// is cancelled at its next await (its chunks stay dirty). Flushes still push.
    pub fn stop_background(&self) {
        self.stop.stop();
        // Woken and not yet polled, the task is dropped instead: a timer polled while its
        // runtime shuts down panics.
        if let Some(task) = &self.background {
            task.abort();
        }
    }

    /// Number of chunks written and not yet taken for a push.
    pub fn dirty_count(&self) -> u64 {
        self.shared.tracked.dirty_count()
    }

    /// What has been pushed, and the last failure.
    pub fn stats(&self) -> PushStats {
        let s = &self.shared;
        PushStats {
            pushed_chunks: s.pushed_chunks.load(Ordering::Relaxed),
            pushed_bytes: s.pushed_bytes.load(Ordering::Relaxed),
            failed_pushes: s.failed_pushes.load(Ordering::Relaxed),
            last_error: s.last_error.lock().clone(),
        }
    }

    /// The inner (local) store. Writes made directly to it are not pushed.
    pub fn inner(&self) -> &S {
        self.shared.tracked.inner()
    }

    /// The remote store.
    pub fn remote(&self) -> &R {
        &self.shared.remote
    }

    /// Stops the background task and flushes a last time; returns the flush's result.
    /// On an error, the chunks that could not be pushed are lost with the `Pusher`: call
    /// [`flush`](Store::flush) until it succeeds first if they must not be.
    pub async fn shutdown(mut self) -> StoreResult<()> {
        self.stop.stop();
        if let Some(task) = self.background.take() {
            // The task only ends by returning; a panic in a store is re-raised here.
            if let Err(e) = task.await {
                if e.is_panic() {
                    std::panic::resume_unwind(e.into_panic());
                }
            }
        }
        self.shared.flush().await
    }
}

impl<S, R> Drop for Pusher<S, R> {
    /// Stops the background task (a round in flight finishes). Does not flush.
    fn drop(&mut self) {
        self.stop.stop();
    }
}

impl<S: Store, R: Store> Store for Pusher<S, R> {
    fn geometry(&self) -> Geometry {
        self.shared.tracked.geometry()
    }

    /// The inner store's caps, except `FLUSH`, which is the remote's: a flush makes data
    /// durable in the remote.
    fn caps(&self) -> Caps {
        let s = &self.shared;
        s.tracked.caps().without(Caps::FLUSH) | (s.remote.caps() & Caps::FLUSH)
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        self.shared.tracked.read(idx)
    }

    /// Through `Tracked`: marked after the inner write, even a failed one (it may have landed).
    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        self.shared.tracked.write(idx, data)
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(self.shared.flush())
    }

    /// Through `Tracked`, like writes.
    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        self.shared.tracked.trim(range)
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        self.shared.tracked.status(idx)
    }
}

impl<S: fmt::Debug, R: fmt::Debug> fmt::Debug for Pusher<S, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.shared;
        f.debug_struct("Pusher")
            .field("pushed_chunks", &s.pushed_chunks.load(Ordering::Relaxed))
            .field("background", &self.background.is_some())
            .field("tracked", &s.tracked)
            .field("remote", &s.remote)
            .finish()
    }
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // chunk runs: one run is a real case
mod tests {
    use super::*;
    use farmap_core::ErrorKind;
    use farmap_testkit::ModelStore;
    use farmap_testkit::{Hooked, Op};
    use std::sync::atomic::AtomicUsize;
    use tokio::sync::Semaphore;

    fn geometry() -> Geometry {
        Geometry::new(32 * 4096, 4096).unwrap()
    }

    fn chunk(byte: u8) -> Bytes {
        Bytes::from(vec![byte; 4096])
    }

    fn manual() -> PushOptions {
        PushOptions {
            checkpoint_every: None,
            workers: 4,
            interval: None,
            retry: RetryPolicy::immediate(3),
        }
    }

    /// Reports chunks written to the inner store behind the pusher's back, once each.
    #[derive(Default)]
    struct Behind {
        written: Mutex<Vec<ChunkIdx>>,
        fail: AtomicBool,
    }

    impl DirtySource for Behind {
        fn collect(&self, into: &DirtySet) -> StoreResult<()> {
            if self.fail.load(Ordering::SeqCst) {
                return Err(StoreError::new(ErrorKind::Io, "scan failed"));
            }
            for idx in self.written.lock().drain(..) {
                into.mark(idx);
            }
            Ok(())
        }
    }

    /// Reports chunks written behind the pusher's back, and only those asked for when asked
    /// for some.
    #[derive(Default)]
    struct Ranged {
        written: Mutex<Vec<ChunkIdx>>,
        fail: AtomicBool,
    }

    impl DirtySource for Ranged {
        fn collect(&self, into: &DirtySet) -> StoreResult<()> {
            self.collect_within(into, &[0..u64::MAX])
        }

        fn collect_within(&self, into: &DirtySet, runs: &[Range<u64>]) -> StoreResult<()> {
            if self.fail.load(Ordering::SeqCst) {
                return Err(StoreError::new(ErrorKind::Io, "scan failed"));
            }
            self.written.lock().retain(|idx| {
                let within = runs.iter().any(|r| r.contains(&idx.0));
                if within {
                    into.mark(*idx);
                }
                !within
            });
            Ok(())
        }
    }

    /// A manual pusher between two model stores, with a new `D` as its dirty source;
    /// returns the source, the remote and the pusher.
    fn with_source<D: DirtySource + Default>(
    ) -> (Arc<D>, Arc<ModelStore>, Pusher<ModelStore, Arc<ModelStore>>) {
        let g = geometry();
        let source = Arc::new(D::default());
        let remote = Arc::new(ModelStore::new(g));
        let pusher =
            Pusher::with_source(ModelStore::new(g), remote.clone(), manual(), source.clone())
                .unwrap();
        (source, remote, pusher)
    }

    /// A pusher between two model stores that pushes every `interval`; returns the remote
    /// and the pusher.
    fn pushing_every(interval: Duration) -> (Arc<ModelStore>, Pusher<ModelStore, Arc<ModelStore>>) {
        let g = geometry();
        let remote = Arc::new(ModelStore::new(g));
        let opts = PushOptions {
            interval: Some(interval),
            ..manual()
        };
        let p = Pusher::new(ModelStore::new(g), remote.clone(), opts).unwrap();
        (remote, p)
    }

    /// Writes chunk `i`, drafts, and starts a flush, still waiting 50 ms later.
    async fn flush_in_draft(
        p: &Arc<Pusher<ModelStore, Arc<ModelStore>>>,
        i: u64,
    ) -> JoinHandle<StoreResult<()>> {
        p.write(ChunkIdx(i), chunk(i as u8)).await.unwrap();
        p.draft(Duration::from_millis(10)).await.unwrap();
        let flush = tokio::spawn({
            let p = p.clone();
            async move { p.flush().await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !flush.is_finished(),
            "a flush waits while the draft is pending"
        );
        flush
    }

    #[tokio::test]
    async fn a_flush_during_a_draft_waits_for_the_seal_or_the_unseal() {
        let g = geometry();
        let remote = Arc::new(ModelStore::new(g));
        let pusher = Arc::new(Pusher::new(ModelStore::new(g), remote.clone(), manual()).unwrap());
        // Given up: the flush, waiting until then, pushes as usual.
        let flush = flush_in_draft(&pusher, 1).await;
        assert_eq!(
            remote.read(ChunkIdx(1)).await.unwrap(),
            chunk(0),
            "nothing pushed yet"
        );
        pusher.unseal();
        flush.await.unwrap().unwrap();
        assert_eq!(remote.read(ChunkIdx(1)).await.unwrap(), chunk(1));

        // Handed over: the waiting flush fails as every flush after a seal does, and pushed
        // nothing.
        let flush = flush_in_draft(&pusher, 2).await;
        pusher.seal_hot().await.unwrap();
        let e = flush.await.unwrap().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Closed, "{e}");
        assert_eq!(remote.read(ChunkIdx(2)).await.unwrap(), chunk(0));
    }

    #[tokio::test]
    async fn a_draft_then_two_seals_place_every_chunk_written_since() {
        let (source, _, pusher) = with_source::<Ranged>();
        for i in [1, 2, 30] {
            pusher
                .inner()
                .write(ChunkIdx(i), chunk(i as u8))
                .await
                .unwrap();
            source.written.lock().push(ChunkIdx(i));
        }
        pusher.flush().await.unwrap();
        // Chunk 30 is cold: pushed by an older round.
        tokio::time::sleep(Duration::from_millis(30)).await;
        for i in [1, 2] {
            source.written.lock().push(ChunkIdx(i));
        }
        pusher.flush().await.unwrap();
        source.written.lock().push(ChunkIdx(3));
        let draft = pusher.draft(Duration::from_millis(10)).await.unwrap();
        assert_eq!(draft.ledger.dirty, [ChunkIdx(3)]);
        assert!(draft.ledger.pushed[1].is_some() && draft.ledger.pushed[30].is_some());
        assert_eq!(draft.hot, [1..3], "pushed lately, not chunk 30 nor dirty 3");
        // Written after the draft: one hot chunk, one cold one, and the dirty one again.
        for i in [2, 20, 3] {
            source.written.lock().push(ChunkIdx(i));
        }
        let hot = pusher.seal_hot().await.unwrap();
        assert_eq!(hot.at_source, [2..3], "chunk 3 was at the source already");
        assert_eq!(hot.pending, [0..1, 3..32]);
        assert!(pusher.is_sealed());
        assert_eq!(pusher.flush().await.unwrap_err().kind(), ErrorKind::Closed);
        let rest = pusher.seal_rest().await;
        assert_eq!(rest.at_source, [20..21]);
        assert!(rest.pending.is_empty());
        // Nothing left: a second look finds nothing new.
        assert_eq!(pusher.seal_rest().await.at_source, Vec::<Range<u64>>::new());
    }

    #[tokio::test]
    async fn a_failed_look_at_the_rest_places_it_all_at_the_source() {
        let (source, _, pusher) = with_source::<Ranged>();
        source.written.lock().push(ChunkIdx(5));
        pusher.flush().await.unwrap();
        let draft = pusher.draft(Duration::from_secs(10)).await.unwrap();
        assert_eq!(draft.hot, [5..6]);
        let hot = pusher.seal_hot().await.unwrap();
        assert!(hot.at_source.is_empty());
        assert_eq!(hot.pending, [0..5, 6..32]);
        source.fail.store(true, Ordering::SeqCst);
        let rest = pusher.seal_rest().await;
        assert_eq!(rest.at_source, [0..5, 6..32]);
        // Abandoned: pushes resume, and a seal of the hot chunks needs a new draft.
        source.fail.store(false, Ordering::SeqCst);
        pusher.unseal();
        pusher.flush().await.unwrap();
        assert_eq!(
            pusher.seal_hot().await.unwrap_err().kind(),
            ErrorKind::InvalidInput
        );
    }

    #[test]
    fn runs_merge_across_small_gaps_and_complement() {
        let flags = [
            false, true, true, false, false, true, false, false, false, true,
        ];
        assert_eq!(merge_runs(flags.iter().copied(), 0), [1..3, 5..6, 9..10]);
        assert_eq!(merge_runs(flags.iter().copied(), 2), [1..6, 9..10]);
        assert_eq!(complement(&[1..3, 5..6], 8), [0..1, 3..5, 6..8]);
        assert_eq!(complement(&[0..8], 8), Vec::<Range<u64>>::new());
        assert_eq!(merge_sorted(&[4..6], &[0..2, 5..9]), [0..2, 4..9]);
    }

    #[tokio::test]
    async fn flush_pushes_what_a_dirty_source_reports() {
        let (source, remote, pusher) = with_source::<Behind>();
        // Written to the inner store directly: only the source knows.
        pusher.inner().write(ChunkIdx(3), chunk(7)).await.unwrap();
        source.written.lock().push(ChunkIdx(3));
        source.fail.store(true, Ordering::SeqCst);
        let err = pusher.flush().await.unwrap_err();
        assert_eq!(
            err.context(),
            "scan failed",
            "a failing source fails the flush"
        );
        source.fail.store(false, Ordering::SeqCst);
        pusher.flush().await.unwrap();
        assert_eq!(remote.read(ChunkIdx(3)).await.unwrap(), chunk(7));
        // mark_dirty is the same door for a single chunk.
        pusher.inner().write(ChunkIdx(4), chunk(9)).await.unwrap();
        pusher.mark_dirty(ChunkIdx(4));
        pusher.mark_dirty(ChunkIdx(10_000));
        assert_eq!(pusher.dirty_count(), 1);
        pusher.flush().await.unwrap();
        assert_eq!(remote.read(ChunkIdx(4)).await.unwrap(), chunk(9));
    }

    #[tokio::test]
    async fn seal_hands_over_the_ledger_and_stops_every_push() {
        let (source, remote, pusher) = with_source::<Behind>();
        pusher.write(ChunkIdx(1), chunk(1)).await.unwrap();
        pusher.write(ChunkIdx(2), chunk(2)).await.unwrap();
        pusher.flush().await.unwrap();
        pusher.write(ChunkIdx(2), chunk(3)).await.unwrap();
        pusher.flush().await.unwrap();
        // Written after the last push: through the pusher, and behind its back.
        pusher.write(ChunkIdx(1), chunk(4)).await.unwrap();
        pusher.inner().write(ChunkIdx(5), chunk(5)).await.unwrap();
        source.written.lock().push(ChunkIdx(5));
        let ledger = pusher.seal().await.unwrap();
        assert!(pusher.is_sealed());
        // What the dirty source reported at the seal (written last) comes first.
        assert_eq!(ledger.dirty, [ChunkIdx(5), ChunkIdx(1)]);
        let sum = |b: u8| xxhash_rust::xxh3::xxh3_64(&chunk(b));
        let (g1, s1) = ledger.pushed[1].unwrap();
        let (g2, s2) = ledger.pushed[2].unwrap();
        assert_eq!(
            (s1, s2),
            (sum(1), sum(3)),
            "the sums of what was pushed last"
        );
        assert!(g2 > g1, "a later push has a later generation");
        assert_eq!(ledger.pushed[5], None);
        assert_eq!(ledger.pushed.len() as u64, geometry().chunk_count());
        // Nothing is pushed any more, whatever asks.
        let e = pusher.flush().await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Closed, "{e}");
        assert!(pusher.write_back(&[ChunkIdx(1)]).await.is_err());
        assert_eq!(remote.read(ChunkIdx(1)).await.unwrap(), chunk(1));
        assert_eq!(remote.read(ChunkIdx(5)).await.unwrap(), chunk(0));
        assert_eq!(pusher.dirty_count(), 2, "the dirty chunks stay counted");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn seal_waits_only_for_the_pushes_already_running() {
        let g = geometry();
        let remote = Arc::new(crate::Delayed::new(
            ModelStore::new(g),
            crate::DelayOptions {
                latency: Duration::from_millis(50),
                bandwidth: None,
            },
        ));
        let pusher = Arc::new(
            Pusher::new(
                ModelStore::new(g),
                remote.clone(),
                PushOptions {
                    workers: 1,
                    ..manual()
                },
            )
            .unwrap(),
        );
        for c in 0..20 {
            pusher.write(ChunkIdx(c), chunk(c as u8)).await.unwrap();
        }
        // A flush of 20 chunks one at a time takes a second; the seal comes in its first push.
        let flushing = tokio::spawn({
            let p = pusher.clone();
            async move { p.flush().await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let t = std::time::Instant::now();
        let ledger = pusher.seal().await.unwrap();
        assert!(
            t.elapsed() < Duration::from_millis(400),
            "the seal waited {:?}",
            t.elapsed()
        );
        assert!(ledger.dirty.len() >= 18, "{:?}", ledger.dirty);
        let pushed = ledger.pushed.iter().filter(|p| p.is_some()).count();
        assert_eq!(
            pushed + ledger.dirty.len(),
            20,
            "each chunk pushed or still dirty"
        );
        assert!(
            flushing.await.unwrap().is_err(),
            "the flush did not push everything"
        );
    }

    #[tokio::test]
    async fn write_back_pushes_only_the_chunks_named() {
        let g = geometry();
        let remote = Arc::new(ModelStore::new(g));
        let p = Pusher::new(ModelStore::new(g), remote.clone(), manual()).unwrap();
        for i in 0..4 {
            p.write(ChunkIdx(i), chunk(i as u8 + 1)).await.unwrap();
        }
        // Not marked dirty at all: written back all the same.
        p.inner().write(ChunkIdx(7), chunk(70)).await.unwrap();
        p.write_back(&[ChunkIdx(1), ChunkIdx(7)]).await.unwrap();
        assert_eq!(remote.read(ChunkIdx(1)).await.unwrap(), chunk(2));
        assert_eq!(remote.read(ChunkIdx(7)).await.unwrap(), chunk(70));
        assert_eq!(
            remote.read(ChunkIdx(0)).await.unwrap(),
            Bytes::from(vec![0u8; 4096]),
            "a chunk not named stays unpushed"
        );
        assert_eq!(
            p.dirty_count(),
            3,
            "the others stay dirty, the named one is clean"
        );
        assert_eq!(p.stats().pushed_chunks, 2);
        let err = p
            .write_back(&[ChunkIdx(2), ChunkIdx(32)])
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::OutOfRange);
        assert_eq!(p.stats().pushed_chunks, 2, "nothing pushed on bad input");
        assert_eq!(p.dirty_count(), 3);
        p.flush().await.unwrap();
        assert_eq!(remote.snapshot(), p.inner().snapshot());
    }

    #[tokio::test]
    async fn a_failed_write_back_leaves_the_chunk_dirty() {
        let g = geometry();
        let failing = Arc::new(AtomicBool::new(true));
        let f = failing.clone();
        let remote = Arc::new(Hooked::new(ModelStore::new(g), move |op, _| {
            let fail = op == Op::Write && f.load(Ordering::SeqCst);
            Box::pin(async move {
                if fail {
                    Err(StoreError::new(ErrorKind::InvalidInput, "refused"))
                } else {
                    Ok(())
                }
            })
        }));
        let p = Pusher::new(ModelStore::new(g), remote.clone(), manual()).unwrap();
        p.inner().write(ChunkIdx(5), chunk(5)).await.unwrap();
        p.write_back(&[ChunkIdx(5)]).await.unwrap_err();
        assert_eq!(p.dirty_count(), 1, "marked dirty again for the next round");
        failing.store(false, Ordering::SeqCst);
        p.flush().await.unwrap();
        assert_eq!(remote.inner.read(ChunkIdx(5)).await.unwrap(), chunk(5));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pusher_conforms() {
        farmap_testkit::run_conformance(|g| async move {
            let opts = PushOptions {
                interval: Some(Duration::from_millis(1)),
                ..PushOptions::default()
            };
            let p = Pusher::new(ModelStore::new(g), ModelStore::new(g), opts).unwrap();
            Arc::new(p) as Arc<dyn Store>
        })
        .await;
    }

    #[tokio::test]
    async fn flush_pushes_everything_written_and_trimmed() {
        let g = geometry();
        let remote = Arc::new(ModelStore::new(g));
        remote.write(ChunkIdx(9), chunk(9)).await.unwrap();
        let local = ModelStore::new(g);
        local.write(ChunkIdx(9), chunk(9)).await.unwrap();
        let p = Pusher::new(local, remote.clone(), manual()).unwrap();
        for i in 0..5 {
            p.write(ChunkIdx(i), chunk(i as u8 + 1)).await.unwrap();
        }
        p.trim(ChunkRange::single(ChunkIdx(9))).await.unwrap();
        assert_eq!(p.dirty_count(), 6);
        assert!(
            remote.snapshot() != p.inner().snapshot(),
            "nothing pushed yet"
        );
        p.flush().await.unwrap();
        assert!(remote.snapshot() == p.inner().snapshot());
        assert_eq!(p.dirty_count(), 0);
        let stats = p.stats();
        assert_eq!((stats.pushed_chunks, stats.pushed_bytes), (6, 6 * 4096));
        assert_eq!(stats.failed_pushes, 0);
        p.flush().await.unwrap();
        assert_eq!(p.stats().pushed_chunks, 6, "nothing dirty, nothing pushed");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_background_task_pushes_on_its_interval() {
        let (remote, p) = pushing_every(Duration::from_millis(5));
        p.write(ChunkIdx(3), chunk(3)).await.unwrap();
        for _ in 0..200 {
            if remote.read(ChunkIdx(3)).await.unwrap() == chunk(3) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(remote.read(ChunkIdx(3)).await.unwrap() == chunk(3));
        assert_eq!(p.dirty_count(), 0);
        drop(p);
        // Dropped: the task stops and pushes nothing more (the store is not written again).
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(Arc::strong_count(&remote), 1, "the background task let go");
    }

    #[tokio::test]
    async fn checkpoints_push_and_flush_on_their_own() {
        let g = geometry();
        let flushes = Arc::new(AtomicUsize::new(0));
        let counted = flushes.clone();
        let remote = Arc::new(Hooked::new(ModelStore::new(g), move |op, _| {
            if op == Op::Flush {
                counted.fetch_add(1, Ordering::Relaxed);
            }
            Box::pin(async { Ok(()) })
        }));
        let opts = PushOptions {
            checkpoint_every: Some(Duration::from_millis(20)),
            ..manual()
        };
        let p = Pusher::new(ModelStore::new(g), remote.clone(), opts).unwrap();
        p.write(ChunkIdx(3), chunk(3)).await.unwrap();
        for _ in 0..500 {
            if flushes.load(Ordering::Relaxed) > 0
                && remote.read(ChunkIdx(3)).await.unwrap() == chunk(3)
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(flushes.load(Ordering::Relaxed) > 0, "no checkpoint in 5 s");
        assert!(remote.read(ChunkIdx(3)).await.unwrap() == chunk(3));
        assert_eq!(p.dirty_count(), 0);
        // Each checkpoint flushes, written or not: they go on.
        let before = flushes.load(Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(flushes.load(Ordering::Relaxed) > before);
        drop(p);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(Arc::strong_count(&remote), 1, "the background task let go");
    }

    /// A remote whose writes of chunk 0 block on `gate` (announcing `entered`) and whose
    /// writes fail while `failing` holds an error kind; `writes` counts write attempts.
    struct GatedRemote {
        store: Arc<Hooked<ModelStore>>,
        gate: Arc<Semaphore>,
        entered: Arc<Notify>,
        failing: Arc<Mutex<Option<ErrorKind>>>,
        writes: Arc<AtomicUsize>,
    }

    fn gated_remote() -> GatedRemote {
        let g = geometry();
        let gate = Arc::new(Semaphore::new(0));
        let entered = Arc::new(Notify::new());
        let failing = Arc::new(Mutex::new(None));
        let writes = Arc::new(AtomicUsize::new(0));
        let (gt, en, fl, wr) = (
            gate.clone(),
            entered.clone(),
            failing.clone(),
            writes.clone(),
        );
        let remote = Hooked::new(ModelStore::new(g), move |op, idx| {
            let (gt, en) = (gt.clone(), en.clone());
            let fail = *fl.lock();
            if op == Op::Write {
                wr.fetch_add(1, Ordering::SeqCst);
            }
            Box::pin(async move {
                if op == Op::Write && idx == ChunkIdx(0) {
                    en.notify_one();
                    gt.acquire().await.expect("open").forget();
                }
                match fail {
                    Some(k) if op == Op::Write => Err(StoreError::new(k, "injected")),
                    _ => Ok(()),
                }
            })
        });
        GatedRemote {
            store: Arc::new(remote),
            gate,
            entered,
            failing,
            writes,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn flush_waits_for_a_push_in_flight() {
        let GatedRemote {
            store: remote,
            gate,
            entered,
            ..
        } = gated_remote();
        let opts = PushOptions {
            interval: Some(Duration::from_millis(1)),
            ..manual()
        };
        let p = Arc::new(Pusher::new(ModelStore::new(geometry()), remote.clone(), opts).unwrap());
        p.write(ChunkIdx(0), chunk(7)).await.unwrap();
        entered.notified().await;
        // The background round holds chunk 0: its bit is clear but the remote lacks it.
        assert_eq!(p.dirty_count(), 0);
        let flush = tokio::spawn({
            let p = p.clone();
            async move { p.flush().await }
        });
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(!flush.is_finished(), "flush waits for the background push");
        // App writes are not blocked by the flush.
        tokio::time::timeout(Duration::from_secs(1), p.write(ChunkIdx(1), chunk(1)))
            .await
            .expect("a write during a flush completes")
            .unwrap();
        gate.add_permits(1000);
        flush.await.unwrap().unwrap();
        assert!(remote.inner.read(ChunkIdx(0)).await.unwrap() == chunk(7));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_push_fails_the_flush_and_stays_dirty() {
        let r = gated_remote();
        r.gate.add_permits(1000);
        let (remote, failing, writes) = (r.store, r.failing, r.writes);
        let p = Pusher::new(ModelStore::new(geometry()), remote.clone(), manual()).unwrap();
        p.write(ChunkIdx(4), chunk(4)).await.unwrap();
        p.write(ChunkIdx(5), chunk(5)).await.unwrap();
        *failing.lock() = Some(ErrorKind::Timeout);
        let e = p.flush().await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Timeout);
        assert!(e.context().contains("pushing chunk"), "{e}");
        assert_eq!(
            writes.load(Ordering::SeqCst),
            6,
            "3 attempts for each chunk"
        );
        assert_eq!(p.dirty_count(), 2, "failed chunks are dirty again");
        *failing.lock() = Some(ErrorKind::Corrupt);
        assert_eq!(p.flush().await.unwrap_err().kind(), ErrorKind::Corrupt);
        assert_eq!(
            writes.load(Ordering::SeqCst),
            8,
            "permanent errors are not retried"
        );
        let stats = p.stats();
        assert_eq!(stats.failed_pushes, 4);
        assert!(stats.last_error.unwrap().contains("injected"));
        *failing.lock() = None;
        p.flush().await.unwrap();
        assert!(remote.inner.snapshot() == p.inner().snapshot());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_flush_leaves_its_chunks_dirty() {
        let r = gated_remote();
        let p = Pusher::new(ModelStore::new(geometry()), r.store.clone(), manual()).unwrap();
        p.write(ChunkIdx(0), chunk(1)).await.unwrap();
        p.write(ChunkIdx(2), chunk(2)).await.unwrap();
        {
            let flush = p.flush();
            tokio::select! {
                _ = flush => panic!("the flush cannot finish while chunk 0 is blocked"),
                _ = r.entered.notified() => {}
            }
        }
        assert_eq!(p.dirty_count(), 2, "both chunks are dirty again");
        r.gate.add_permits(1000);
        p.flush().await.unwrap();
        assert!(r.store.inner.snapshot() == p.inner().snapshot());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shutdown_flushes() {
        let (remote, p) = pushing_every(Duration::from_secs(3600));
        p.write(ChunkIdx(31), chunk(31)).await.unwrap();
        p.shutdown().await.unwrap();
        assert!(remote.read(ChunkIdx(31)).await.unwrap() == chunk(31));
        assert_eq!(Arc::strong_count(&remote), 1);
    }

    #[test]
    fn geometries_must_match() {
        let a = Geometry::new(8 * 4096, 4096).unwrap();
        let b = Geometry::new(9 * 4096, 4096).unwrap();
        let e = Pusher::new(ModelStore::new(a), ModelStore::new(b), manual()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
        assert!(e.context().contains(&b.to_string()), "{e}");
    }
}
