//! [`Puller`]: background prefetch of every chunk of a [`Fill`] target (a [`Cached`] store or
//! a userfaultfd region), by N async workers in a chosen order.
//!
//! [`Cached`]: crate::cached::Cached

use std::collections::VecDeque;
use std::fmt;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use farmap_core::{ChunkIdx, ErrorKind, StoreError};
use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::cached::Fill;
use crate::retry::RetryPolicy;

/// How many chunk failures a [`PullReport`] keeps (the first ones); all are counted.
pub const MAX_RECORDED_FAILURES: usize = 32;

/// The order in which a [`Puller`] goes through the chunks.
#[derive(Clone)]
pub enum PullOrder {
    /// Chunk 0, 1, 2, ... to the end.
    Sequential,
    /// Every chunk, highest key first (ties in index order). The function is called once per
    /// chunk when the puller starts.
    Priority(Arc<dyn Fn(ChunkIdx) -> i64 + Send + Sync>),
    /// Exactly these chunks, in this order (a recorded working set); chunks not listed are
    /// not pulled.
    List(Vec<ChunkIdx>),
}

impl fmt::Debug for PullOrder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PullOrder::Sequential => f.write_str("Sequential"),
            PullOrder::Priority(_) => f.write_str("Priority(..)"),
            PullOrder::List(l) => write!(f, "List({} chunks)", l.len()),
        }
    }
}

/// How a [`Puller`] works.
#[derive(Debug, Clone)]
pub struct PullOptions {
    /// Number of async worker tasks, i.e. fetches in flight; 0 (the default): farmap's
    /// choice, [`PullOptions::workers_for`] the store's chunk size.
    pub workers: usize,
    /// The order of the chunks.
    pub order: PullOrder,
    /// Retries of fetches that fail with a retryable error.
    pub retry: RetryPolicy,
}

/// Bytes of fetches the default pull keeps in flight: what a link's bandwidth-delay product
/// asks for. `farmap bench net --case managed-native` at a 10 ms round trip: 64 fetches of
/// 64 KiB in flight (4 MiB) cap a pull at about 330 MB/s, 256 (16 MiB) reach what 1024 do;
/// at 0 ms the count makes no difference.
pub const PULL_BYTES_IN_FLIGHT: u64 = 16 << 20;

/// Bytes one fetch asks for when the target reads runs of chunks in one request
/// ([`Fill::chunks_per_fetch`]): `farmap bench net --case managed-native` at 0 ms, runs of
/// 16 chunks of 64 KiB with 4 in flight moved 3.5-4.5 GB/s where 256 single chunks in
/// flight moved 1.7-1.9 (the same runs' `tcp-region`: 1.3-3.0).
pub const PULL_RUN_BYTES: u64 = 1 << 20;

impl Default for PullOptions {
    /// Farmap's choice of workers ([`PullOptions::workers_for`]), sequential order, the
    /// default retry policy.
    fn default() -> Self {
        Self {
            workers: 0,
            order: PullOrder::Sequential,
            retry: RetryPolicy::default(),
        }
    }
}

impl PullOptions {
    /// The workers a pull of chunks of `chunk_size` bytes runs: `workers`, or when it is 0,
    /// enough for [`PULL_BYTES_IN_FLIGHT`] (256 of 64 KiB chunks), from 8 to 1024.
    pub fn workers_for(&self, chunk_size: u32) -> usize {
        if self.workers > 0 {
            return self.workers;
        }
        let fit = PULL_BYTES_IN_FLIGHT / u64::from(chunk_size.max(1));
        fit.clamp(8, 1024) as usize
    }

    /// Chunks one fetch asks for, for a target that fetches up to `per_fetch` chunks of
    /// `chunk_size` bytes in one request: [`PULL_RUN_BYTES`] worth (1 when the target
    /// fetches chunk by chunk).
    pub fn run_for(chunk_size: u32, per_fetch: u32) -> u64 {
        let fit = (PULL_RUN_BYTES / u64::from(chunk_size.max(1))).max(1);
        fit.min(u64::from(per_fetch.max(1)))
    }
}

/// How many runs a pull that reads runs keeps in flight when the user did not say: the
/// fewest that keep the link busy, found as TCP Vegas finds its window. On a fast link few
/// runs in flight do best (at 0 ms, 4 MiB in flight moved twice what 16 MiB did, probably by
/// staying in the CPU's caches); a long round trip needs many. Once a window's worth of runs has
/// completed, the runs queued beyond what the fastest fetch seen needs are estimated
/// (`limit × (1 − fastest ÷ mean)`): below [`Window::GROW`] the limit doubles (at first)
/// or grows by one, above [`Window::SHRINK`] it shrinks by one.
struct Window {
    limit: AtomicUsize,
    max: usize,
    /// Set for good when the pull ends or is cancelled: every worker may go.
    opened: AtomicBool,
    state: Mutex<WindowState>,
    changed: Notify,
}

struct WindowState {
    fastest: Duration,
    sum: Duration,
    count: usize,
    doubling: bool,
}

impl Window {
    const MIN: usize = 2;
    const GROW: f64 = 1.0;
    const SHRINK: f64 = 3.0;

    fn new(max: usize) -> Window {
        Window {
            limit: AtomicUsize::new(Self::MIN.min(max)),
            max,
            opened: AtomicBool::new(false),
            state: Mutex::new(WindowState {
                fastest: Duration::MAX,
                sum: Duration::ZERO,
                count: 0,
                doubling: true,
            }),
            changed: Notify::new(),
        }
    }

    fn limit(&self) -> usize {
        if self.opened.load(Ordering::Acquire) {
            return self.max;
        }
        self.limit.load(Ordering::Acquire)
    }

    /// A fetch of a run took `took`.
    fn completed(&self, took: Duration) {
        let mut st = self.state.lock();
        st.fastest = st.fastest.min(took);
        st.sum += took;
        st.count += 1;
        let limit = self.limit();
        if st.count < limit {
            return;
        }
        let mean = st.sum.as_secs_f64() / st.count as f64;
        (st.sum, st.count) = (Duration::ZERO, 0);
        let queued = limit as f64 * (1.0 - st.fastest.as_secs_f64() / mean.max(f64::MIN_POSITIVE));
        let next = if queued < Self::GROW {
            if st.doubling {
                limit * 2
            } else {
                limit + 1
            }
        } else {
            st.doubling = false;
            if queued > Self::SHRINK {
                limit - 1
            } else {
                limit
            }
        };
        let next = next.clamp(Self::MIN.min(self.max), self.max);
        drop(st);
        if next != limit {
            self.limit.store(next, Ordering::Release);
            tracing::trace!(limit = next, "pull window");
            if next > limit {
                self.changed.notify_waiters();
            }
        }
    }

    /// Opens the window to every worker (the pull ends or is cancelled: parked workers must
    /// see it).
    fn open(&self) {
        self.opened.store(true, Ordering::Release);
        self.changed.notify_waiters();
    }
}

/// How far a pull has come. Counters are read one by one and may be a moment apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PullProgress {
    /// Chunks in the pull order.
    pub total_chunks: u64,
    /// Chunks of the order the puller is through with: found present, fetched, or failed.
    pub done_chunks: u64,
    /// Chunks this puller fetched (including [prioritized](Puller::prioritize) ones): absent
    /// when a worker reached them, present after its fetch (which may have been a wait for a
    /// foreground fetch of the same chunk).
    pub fetched_chunks: u64,
    /// Bytes of the chunks this puller fetched.
    pub fetched_bytes: u64,
    /// Chunks whose fetch failed permanently (or ran out of retries); they stay absent.
    pub failed_chunks: u64,
}

/// A chunk the puller could not fetch.
#[derive(Debug)]
pub struct PullFailure {
    /// The chunk.
    pub chunk: ChunkIdx,
    /// The last error of its fetch.
    pub error: StoreError,
}

/// The outcome of a pull, from [`Puller::wait`].
#[derive(Debug)]
pub struct PullReport {
    /// Final counters.
    pub progress: PullProgress,
    /// From start until the last worker finished.
    pub elapsed: Duration,
    /// Whether [`Puller::cancel`] stopped the pull before it went through every chunk.
    pub cancelled: bool,
    /// The first [`MAX_RECORDED_FAILURES`] failures (`progress.failed_chunks` counts all).
    pub failures: Vec<PullFailure>,
    /// Chunks one fetch asked for (more than 1 when the target reads runs in one request).
    pub run_chunks: u64,
    /// Fetches in flight at the end: the workers, or the window the pull settled on when it
    /// chose it (see [`PULL_RUN_BYTES`]).
    pub in_flight: usize,
}

impl PullReport {
    /// Whether every chunk of the order is present: not cancelled, nothing failed.
    pub fn is_complete(&self) -> bool {
        !self.cancelled && self.progress.failed_chunks == 0
    }
}

/// Background prefetch: `workers` async tasks on the current tokio runtime fetch every chunk
/// of the order that is not present yet.
///
/// # Concurrency
/// - Workers claim chunks with one atomic increment of a shared cursor; no lock on that path.
///   [`prioritize`](Self::prioritize)d chunks sit in a mutex-guarded queue that workers drain
///   first; an atomic length hint keeps them from taking the lock while it is empty.
/// - A worker skips a chunk already present (one atomic load in a [`Cached`] store). Two
///   fetches of the same chunk, by the puller and by a foreground read, are merged by the
///   target ([`Cached`] fetches once).
/// - Retryable errors are retried per [`PullOptions::retry`]; a chunk that still fails is
///   counted and left absent, and the puller moves on (a foreground read will fetch it
///   again, or report the error).
/// - [`cancel`](Self::cancel) (or dropping the `Puller`) stops workers from starting new
///   fetches and interrupts retry pauses; fetches in flight finish.
/// - [`wait`](Self::wait) resolves as soon as the last worker finishes: a wake-up, not a poll.
///
/// [`Cached`]: crate::cached::Cached
pub struct Puller {
    shared: Arc<Shared>,
}

enum Order {
    Sequential(u64),
    List(Box<[ChunkIdx]>),
}

impl Order {
    fn len(&self) -> u64 {
        match self {
            Order::Sequential(n) => *n,
            Order::List(l) => l.len() as u64,
        }
    }

    fn get(&self, i: u64) -> Option<ChunkIdx> {
        match self {
            Order::Sequential(n) => (i < *n).then_some(ChunkIdx(i)),
            Order::List(l) => usize::try_from(i).ok().and_then(|i| l.get(i).copied()),
        }
    }
}

struct Shared {
    order: Order,
    chunk_count: u64,
    /// Chunks a worker takes from a sequential order at once (fetched in runs).
    run: u64,
    /// Worker tasks started.
    workers: usize,
    /// The runs in flight, when the pull chooses them.
    window: Option<Window>,
    cursor: AtomicU64,
    urgent: Mutex<VecDeque<ChunkIdx>>,
    urgent_len: AtomicUsize,
    done: AtomicU64,
    fetched: AtomicU64,
    fetched_bytes: AtomicU64,
    failed: AtomicU64,
    failures: Mutex<Vec<PullFailure>>,
    last_failure: Mutex<Option<PullFailure>>,
    cancelled: AtomicBool,
    cancel_event: Notify,
    workers_left: AtomicUsize,
    finished: AtomicBool,
    finished_event: Notify,
    stopped_early: AtomicBool,
    started: Instant,
    finished_at: OnceLock<Instant>,
}

enum Outcome {
    /// This many chunks from the one asked for are present.
    Fetched(u64),
    Failed(StoreError),
    Stopped,
}

impl Shared {
    fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    /// Resolves once the pull is cancelled.
    async fn cancelled(&self) {
        let mut notified = pin!(self.cancel_event.notified());
        notified.as_mut().enable();
        if !self.is_cancelled() {
            notified.await;
        }
    }

    /// The next chunks to look at (a run of consecutive ones), and whether they belong to
    /// the order (or were prioritized).
    fn next(&self) -> Option<(ChunkIdx, u64, bool)> {
        if self.urgent_len.load(Ordering::Acquire) > 0 {
            let mut q = self.urgent.lock();
            let idx = q.pop_front();
            self.urgent_len.store(q.len(), Ordering::Release);
            if let Some(idx) = idx {
                return Some((idx, 1, false));
            }
        }
        match &self.order {
            Order::Sequential(n) => {
                let first = self.cursor.fetch_add(self.run, Ordering::Relaxed);
                (first < *n).then(|| (ChunkIdx(first), self.run.min(*n - first), true))
            }
            order => {
                let i = self.cursor.fetch_add(1, Ordering::Relaxed);
                order.get(i).map(|idx| (idx, 1, true))
            }
        }
    }

    /// Waits while worker `id` is outside the window of runs in flight.
    async fn wait_turn(&self, id: usize) {
        let Some(w) = &self.window else {
            return;
        };
        while id >= w.limit() && !self.is_cancelled() {
            let mut changed = pin!(w.changed.notified());
            changed.as_mut().enable();
            if id < w.limit() || self.is_cancelled() {
                return;
            }
            changed.await;
        }
    }

    async fn fetch<F: Fill>(
        &self,
        target: &F,
        idx: ChunkIdx,
        max: u64,
        policy: RetryPolicy,
    ) -> Outcome {
        let mut attempt = 1;
        loop {
            let started = Instant::now();
            match target.fetch_run(idx, max).await {
                Ok(n) => {
                    if let Some(w) = &self.window {
                        w.completed(started.elapsed());
                    }
                    return Outcome::Fetched(n.clamp(1, max));
                }
                Err(e) if e.is_retryable() && policy.allows_another(attempt) => {
                    let pause = policy.backoff(attempt);
                    tokio::select! {
                        _ = tokio::time::sleep(pause) => {}
                        _ = self.cancelled() => return Outcome::Stopped,
                    }
                    attempt += 1;
                }
                Err(e) => return Outcome::Failed(e),
            }
        }
    }

    /// Fetches in flight: the workers, or the window the pull settled on.
    fn in_flight(&self) -> usize {
        self.window
            .as_ref()
            .map_or(self.workers, |w| w.limit.load(Ordering::Acquire))
    }

    fn record_failure(&self, chunk: ChunkIdx, error: StoreError) {
        self.failed.fetch_add(1, Ordering::Relaxed);
        let mut failures = self.failures.lock();
        if failures.len() < MAX_RECORDED_FAILURES {
            let copy = error.to_owned_lossy();
            failures.push(PullFailure { chunk, error: copy });
        }
        drop(failures);
        *self.last_failure.lock() = Some(PullFailure { chunk, error });
    }

    fn progress(&self) -> PullProgress {
        PullProgress {
            total_chunks: self.order.len(),
            done_chunks: self.done.load(Ordering::Acquire),
            fetched_chunks: self.fetched.load(Ordering::Acquire),
            fetched_bytes: self.fetched_bytes.load(Ordering::Acquire),
            failed_chunks: self.failed.load(Ordering::Acquire),
        }
    }
}

/// Counts a worker out when it ends, however it ends (even by a panic in the target).
struct WorkerExit<'a> {
    shared: &'a Shared,
    current: Option<ChunkIdx>,
}

impl Drop for WorkerExit<'_> {
    fn drop(&mut self) {
        let shared = self.shared;
        if std::thread::panicking() {
            let chunk = self.current.unwrap_or_default();
            let e = StoreError::new(ErrorKind::Io, format!("a pull worker panicked on {chunk}"));
            shared.record_failure(chunk, e);
        }
        if shared.workers_left.fetch_sub(1, Ordering::AcqRel) == 1 {
            let _ = shared.finished_at.set(Instant::now());
            let all = shared.done.load(Ordering::Acquire) >= shared.order.len();
            shared
                .stopped_early
                .store(shared.is_cancelled() && !all, Ordering::Release);
            shared.finished.store(true, Ordering::Release);
            let p = shared.progress();
            // What the pull chose, said once (the window is farmap's pick, not the user's).
            tracing::info!(
                chunks = p.done_chunks,
                fetched = p.fetched_chunks,
                failed = p.failed_chunks,
                mb = p.fetched_bytes as f64 / 1e6,
                secs = shared.started.elapsed().as_secs_f64(),
                run_chunks = shared.run,
                in_flight = shared.in_flight(),
                "background pull finished"
            );
            shared.finished_event.notify_waiters();
        }
    }
}

async fn worker<F: Fill>(target: Arc<F>, shared: Arc<Shared>, policy: RetryPolicy, id: usize) {
    let mut exit = WorkerExit {
        shared: &shared,
        current: None,
    };
    let geometry = target.geometry();
    'pull: while !shared.is_cancelled() {
        shared.wait_turn(id).await;
        let Some((first, len, ordered)) = shared.next() else {
            if let Some(w) = &shared.window {
                w.open();
            }
            break;
        };
        let end = first.0 + len;
        let mut at = first.0;
        while at < end {
            let idx = ChunkIdx(at);
            exit.current = Some(idx);
            let mut n = 1;
            if !target.is_present(idx) {
                match shared.fetch(&*target, idx, end - at, policy).await {
                    Outcome::Fetched(got) => {
                        n = got;
                        let bytes: u64 = (at..at + n)
                            .map(|c| geometry.chunk_len(ChunkIdx(c)) as u64)
                            .sum();
                        shared.fetched.fetch_add(n, Ordering::Relaxed);
                        shared.fetched_bytes.fetch_add(bytes, Ordering::Relaxed);
                    }
                    Outcome::Failed(e) => shared.record_failure(idx, e),
                    Outcome::Stopped => break 'pull,
                }
            }
            if ordered {
                shared.done.fetch_add(n, Ordering::AcqRel);
            }
            at += n;
        }
    }
}

impl Puller {
    /// Starts pulling `target` in the background with [`PullOptions::workers_for`] its chunk
    /// size tasks spawned on the current tokio runtime.
    ///
    /// # Panics
    /// Outside a tokio runtime.
    pub fn start<F: Fill>(target: Arc<F>, opts: PullOptions) -> Puller {
        let geometry = target.geometry();
        let chunk_count = geometry.chunk_count();
        let run = PullOptions::run_for(geometry.chunk_size(), target.chunks_per_fetch());
        let (workers, window) = if run > 1 && opts.workers == 0 {
            let run_bytes = run * u64::from(geometry.chunk_size());
            let max = (PULL_BYTES_IN_FLIGHT / run_bytes).clamp(Window::MIN as u64, 1024) as usize;
            (max, Some(Window::new(max)))
        } else {
            (opts.workers_for(geometry.chunk_size()), None)
        };
        tracing::debug!(workers, run, chunk_count, "pull started");
        let order = match opts.order {
            PullOrder::Sequential => Order::Sequential(chunk_count),
            PullOrder::List(list) => Order::List(list.into_boxed_slice()),
            PullOrder::Priority(key) => {
                let mut keyed: Vec<(i64, ChunkIdx)> =
                    geometry.all().iter().map(|idx| (key(idx), idx)).collect();
                keyed.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
                Order::List(keyed.into_iter().map(|(_, idx)| idx).collect())
            }
        };
        let shared = Arc::new(Shared {
            order,
            chunk_count,
            run,
            workers,
            window,
            cursor: AtomicU64::new(0),
            urgent: Mutex::new(VecDeque::new()),
            urgent_len: AtomicUsize::new(0),
            done: AtomicU64::new(0),
            fetched: AtomicU64::new(0),
            fetched_bytes: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            failures: Mutex::new(Vec::new()),
            last_failure: Mutex::new(None),
            cancelled: AtomicBool::new(false),
            cancel_event: Notify::new(),
            workers_left: AtomicUsize::new(workers),
            finished: AtomicBool::new(false),
            finished_event: Notify::new(),
            stopped_early: AtomicBool::new(false),
            started: Instant::now(),
            finished_at: OnceLock::new(),
        });
        for id in 0..workers {
            tokio::spawn(worker(target.clone(), shared.clone(), opts.retry, id));
        }
        Puller { shared }
    }

    /// Puts `chunks` ahead of the order (a fault is waiting on them); returns how many were
    /// queued. Indices outside the region are ignored, and so is everything once the pull
    /// has finished.
    pub fn prioritize(&self, chunks: impl IntoIterator<Item = ChunkIdx>) -> usize {
        if self.is_finished() {
            return 0;
        }
        let mut q = self.shared.urgent.lock();
        let before = q.len();
        q.extend(
            chunks
                .into_iter()
                .filter(|idx| idx.0 < self.shared.chunk_count),
        );
        self.shared.urgent_len.store(q.len(), Ordering::Release);
        q.len() - before
    }

    /// Current counters.
    pub fn progress(&self) -> PullProgress {
        self.shared.progress()
    }

    /// Whether every worker has finished (completed, or stopped by [`cancel`](Self::cancel)).
    pub fn is_finished(&self) -> bool {
        self.shared.finished.load(Ordering::Acquire)
    }

    /// Stops the pull: no new fetch starts and retry pauses end; fetches in flight finish.
    /// [`wait`](Self::wait) then reports `cancelled` (unless everything was already done).
    pub fn cancel(&self) {
        self.shared.cancelled.store(true, Ordering::Release);
        self.shared.cancel_event.notify_waiters();
        if let Some(w) = &self.shared.window {
            w.open();
        }
    }

    /// Waits until every worker has finished, and reports. May be called any number of times.
    pub async fn wait(&self) -> PullReport {
        let shared = &self.shared;
        loop {
            let mut notified = pin!(shared.finished_event.notified());
            notified.as_mut().enable();
            if self.is_finished() {
                break;
            }
            notified.await;
        }
        let end = shared
            .finished_at
            .get()
            .copied()
            .unwrap_or_else(Instant::now);
        PullReport {
            run_chunks: shared.run,
            in_flight: shared.in_flight(),
            progress: shared.progress(),
            elapsed: end.duration_since(shared.started),
            cancelled: shared.stopped_early.load(Ordering::Acquire),
            failures: shared
                .failures
                .lock()
                .iter()
                .map(|f| PullFailure {
                    chunk: f.chunk,
                    error: f.error.to_owned_lossy(),
                })
                .collect(),
        }
    }

    /// The most recent failure, if any (a copy: the error's source is folded into its
    /// context).
    pub fn last_failure(&self) -> Option<PullFailure> {
        self.shared
            .last_failure
            .lock()
            .as_ref()
            .map(|f| PullFailure {
                chunk: f.chunk,
                error: f.error.to_owned_lossy(),
            })
    }
}

impl Drop for Puller {
    /// Cancels the pull (workers finish their fetches in flight and stop).
    fn drop(&mut self) {
        self.cancel();
    }
}

impl fmt::Debug for Puller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Puller")
            .field("progress", &self.progress())
            .field("finished", &self.is_finished())
            .field("cancelled", &self.shared.is_cancelled())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cached::Cached;
    use farmap_core::{Geometry, Store};
    use farmap_testkit::{pattern_bytes, ModelStore, PatternStore};
    use farmap_testkit::{Hooked, Op};
    use std::collections::HashMap;

    #[test]
    fn the_default_pull_keeps_16_mib_in_flight_within_8_to_1024_workers() {
        let auto = PullOptions::default();
        assert_eq!(auto.workers_for(64 << 10), 256);
        assert_eq!(auto.workers_for(4 << 10), 1024, "at most 1024");
        assert_eq!(auto.workers_for(4 << 20), 8, "at least 8");
        let set = PullOptions {
            workers: 3,
            ..PullOptions::default()
        };
        assert_eq!(set.workers_for(64 << 10), 3, "a count given is kept");
    }

    type Target = Cached<ModelStore, Hooked<PatternStore>>;

    /// A cache over a pattern remote whose reads are recorded in order and may be delayed or
    /// failed by `hook`.
    fn target(
        g: Geometry,
        hook: impl Fn(ChunkIdx, usize) -> farmap_core::BoxFuture<'static, StoreResult<()>>
            + Send
            + Sync
            + 'static,
    ) -> (Arc<Target>, Arc<Mutex<Vec<ChunkIdx>>>) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let l = log.clone();
        let remote = Hooked::new(PatternStore::new(g, 3), move |op, idx| {
            assert_eq!(op, Op::Read, "a puller only reads the remote");
            let n = {
                let mut l = l.lock();
                l.push(idx);
                l.iter().filter(|&&c| c == idx).count()
            };
            hook(idx, n)
        });
        let c = Cached::new(ModelStore::new(g), remote).unwrap();
        (Arc::new(c), log)
    }

    fn ok() -> farmap_core::BoxFuture<'static, StoreResult<()>> {
        Box::pin(async { Ok(()) })
    }

    use farmap_core::StoreResult;

    async fn assert_content(c: &Target, chunks: impl Iterator<Item = ChunkIdx>) {
        let g = c.local().geometry();
        for idx in chunks {
            let got = c.local().read(idx).await.unwrap();
            let want = pattern_bytes(3, g.offset_of(idx), g.chunk_len(idx));
            assert!(got[..] == want[..], "content of {idx}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_target_that_reads_runs_is_pulled_in_runs_within_a_window() {
        use crate::cached::tests::RunReads;
        let g = Geometry::new(1000 * 4096 + 123, 4096).unwrap();
        let c = Arc::new(
            Cached::new(
                ModelStore::new(g),
                RunReads::new(PatternStore::new(g, 3), 16),
            )
            .unwrap(),
        );
        c.fetch(ChunkIdx(40)).await.unwrap();
        let p = Puller::start(c.clone(), PullOptions::default());
        let r = p.wait().await;
        assert!(r.is_complete(), "{r:?}");
        assert!(c.is_complete());
        assert_eq!(r.progress.done_chunks, 1001);
        assert_eq!(r.progress.fetched_chunks, 1000);
        assert_eq!(r.progress.fetched_bytes, g.size() - 4096);
        assert_eq!(r.run_chunks, 16);
        let max = (PULL_BYTES_IN_FLIGHT / (16 * 4096)) as usize;
        assert!(
            (Window::MIN..=max).contains(&r.in_flight),
            "{} runs in flight",
            r.in_flight
        );
        let runs = c.remote().runs.lock().clone();
        assert!(runs.iter().all(|r| r.len() <= 16));
        let read: u64 = runs.iter().map(|r| r.len()).sum();
        assert_eq!(read, 1001, "each chunk read once");
        assert!(runs.len() <= 1001 / 16 + 3, "{} requests", runs.len());
        assert_content_of(&c, g.all().iter()).await;
    }

    async fn assert_content_of<S: Store>(
        c: &Cached<ModelStore, S>,
        chunks: impl Iterator<Item = ChunkIdx>,
    ) {
        let g = c.local().geometry();
        for idx in chunks {
            let got = c.local().read(idx).await.unwrap();
            let want = pattern_bytes(3, g.offset_of(idx), g.chunk_len(idx));
            assert!(got[..] == want[..], "content of {idx}");
        }
    }

    #[test]
    fn the_window_grows_on_a_long_round_trip_and_stays_small_when_fetches_queue() {
        let ms = Duration::from_millis;
        // Every fetch takes the round trip: nothing queues, the window opens to its max.
        let w = Window::new(16);
        for _ in 0..200 {
            w.completed(ms(10));
        }
        assert_eq!(w.limit(), 16);
        // Fetches that take as much longer as there are in flight: they queue; the window
        // does not grow past a few.
        let w = Window::new(16);
        for _ in 0..400 {
            let n = w.limit() as u64;
            w.completed(Duration::from_micros(300 * n));
        }
        assert!(w.limit() <= 4, "{} in flight", w.limit());
        w.open();
        assert_eq!(w.limit(), 16, "opened for good");
        w.completed(ms(100));
        assert_eq!(w.limit(), 16);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pulls_every_chunk() {
        let g = Geometry::new(100 * 4096 + 123, 4096).unwrap();
        let (c, log) = target(g, |_, _| ok());
        c.fetch(ChunkIdx(10)).await.unwrap();
        let p = Puller::start(c.clone(), PullOptions::default());
        let r = p.wait().await;
        assert!(r.is_complete(), "{r:?}");
        assert!(c.is_complete());
        assert_eq!(
            r.progress,
            PullProgress {
                total_chunks: 101,
                done_chunks: 101,
                fetched_chunks: 100,
                fetched_bytes: g.size() - 4096,
                failed_chunks: 0,
            }
        );
        assert_eq!(
            log.lock().len(),
            101,
            "each chunk read from the remote once"
        );
        assert_content(&c, g.all().iter()).await;
        assert!(p.is_finished());
        assert_eq!(
            p.prioritize([ChunkIdx(1)]),
            0,
            "nothing is queued after the end"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn prioritized_chunks_go_first() {
        let g = Geometry::new(64 * 4096, 4096).unwrap();
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let gt = gate.clone();
        let (c, log) = target(g, move |_, _| {
            let gt = gt.clone();
            Box::pin(async move {
                gt.acquire().await.expect("open").forget();
                Ok(())
            })
        });
        let p = Puller::start(
            c.clone(),
            PullOptions {
                workers: 1,
                ..PullOptions::default()
            },
        );
        while log.lock().is_empty() {
            tokio::task::yield_now().await;
        }
        assert_eq!(p.prioritize([ChunkIdx(50), ChunkIdx(40), ChunkIdx(99)]), 2);
        gate.add_permits(1000);
        let r = p.wait().await;
        assert!(r.is_complete());
        let log = log.lock().clone();
        assert_eq!(&log[..3], &[ChunkIdx(0), ChunkIdx(50), ChunkIdx(40)]);
        assert_eq!(log.len(), 64, "prioritized chunks are not fetched twice");
        assert_eq!(r.progress.done_chunks, 64);
        assert_eq!(r.progress.fetched_chunks, 64);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn list_and_priority_orders() {
        let g = Geometry::new(32 * 4096, 4096).unwrap();
        let list: Vec<_> = [5, 3, 9, 3].into_iter().map(ChunkIdx).collect();
        let (c, log) = target(g, |_, _| ok());
        let opts = PullOptions {
            workers: 1,
            order: PullOrder::List(list.clone()),
            ..PullOptions::default()
        };
        let r = Puller::start(c.clone(), opts).wait().await;
        assert_eq!(*log.lock(), list[..3], "the list, without the repeat");
        assert_eq!(r.progress.total_chunks, 4);
        assert_eq!(r.progress.done_chunks, 4);
        assert_eq!(r.progress.fetched_chunks, 3);
        assert_eq!(c.present_count(), 3, "unlisted chunks are not pulled");

        let (c, log) = target(g, |_, _| ok());
        let opts = PullOptions {
            workers: 1,
            order: PullOrder::Priority(Arc::new(|idx| -((idx.0 % 8) as i64))),
            ..PullOptions::default()
        };
        assert!(Puller::start(c.clone(), opts).wait().await.is_complete());
        let keys: Vec<u64> = log.lock().iter().map(|c| c.0 % 8).collect();
        assert!(
            keys.is_sorted(),
            "highest key (lowest idx % 8) first: {keys:?}"
        );
        assert_eq!(
            log.lock()[..2],
            [ChunkIdx(0), ChunkIdx(8)],
            "ties in index order"
        );
        assert!(c.is_complete());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn retryable_errors_are_retried_and_permanent_ones_counted() {
        let g = Geometry::new(16 * 4096, 4096).unwrap();
        let (c, log) = target(g, |idx, n| {
            let fail = |k| -> farmap_core::BoxFuture<'static, StoreResult<()>> {
                Box::pin(async move { Err(StoreError::new(k, "injected")) })
            };
            match (idx.0, n) {
                (3, 1 | 2) => fail(ErrorKind::Timeout),
                (7, _) => fail(ErrorKind::Corrupt),
                (9, _) => fail(ErrorKind::Unavailable),
                _ => ok(),
            }
        });
        let opts = PullOptions {
            workers: 3,
            retry: RetryPolicy::immediate(3),
            ..PullOptions::default()
        };
        let p = Puller::start(c.clone(), opts);
        let r = p.wait().await;
        let calls: HashMap<u64, usize> = log.lock().iter().fold(HashMap::new(), |mut m, c| {
            *m.entry(c.0).or_default() += 1;
            m
        });
        assert_eq!(calls[&3], 3, "two timeouts, then success");
        assert_eq!(calls[&7], 1, "a permanent error is not retried");
        assert_eq!(calls[&9], 3, "retries are bounded");
        assert!(c.is_present(ChunkIdx(3)));
        assert!(!c.is_present(ChunkIdx(7)) && !c.is_present(ChunkIdx(9)));
        assert_eq!(r.progress.failed_chunks, 2);
        assert_eq!(r.progress.done_chunks, 16);
        assert_eq!(r.progress.fetched_chunks, 14);
        assert!(!r.cancelled && !r.is_complete());
        let mut failed: Vec<_> = r
            .failures
            .iter()
            .map(|f| (f.chunk, f.error.kind()))
            .collect();
        failed.sort_by_key(|f| f.0);
        assert_eq!(
            failed,
            [
                (ChunkIdx(7), ErrorKind::Corrupt),
                (ChunkIdx(9), ErrorKind::Unavailable)
            ]
        );
        assert!(p.last_failure().is_some());
        // A later foreground read surfaces the error.
        assert_eq!(
            c.read(ChunkIdx(7)).await.unwrap_err().kind(),
            ErrorKind::Corrupt
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panicking_target_does_not_hang_wait() {
        let g = Geometry::new(8 * 4096, 4096).unwrap();
        let (c, _) = target(g, |idx, _| {
            assert_ne!(idx.0, 4, "injected panic");
            ok()
        });
        let r = Puller::start(c, PullOptions::default()).wait().await;
        assert_eq!(r.progress.failed_chunks, 1);
        assert_eq!(r.failures[0].chunk, ChunkIdx(4));
    }
}
