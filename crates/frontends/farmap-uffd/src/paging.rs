//! Bounded local memory: the [`Pager`] keeps a region's resident chunks (mapped plus staged)
//! at or below a limit that can change at run time.
//!
//! # Chunk states
//! ```text
//!   remote ──fault: fetch (UFFDIO_COPY|WP)──▶ active ──deactivate: UFFDIO_MOVE──▶ staged
//!     ▲                                         ▲  (region → staging slot, marked     │
//!     │                                         │   dirty for the pusher)            │
//!     │                                         └──fault: UFFDIO_MOVE back, re-protect┘
//!     └────── drop (MADV_DONTNEED of the slot), only after a write-back of the chunk
//!             that began after it was staged succeeded: its staged content is in the store
//! ```
//! - *zero*: never written (a fresh region, [`PagingOptions::fresh`](crate::PagingOptions)):
//!   the first touch maps the shared zero page with `UFFDIO_ZEROPAGE` and reads nothing from
//!   the store; the chunk is then active like any other, and remote once written back.
//! - *remote*: not local; the next touch fetches it from the store (a chunk the store does
//!   not hold reads as zeros, so a never-written chunk costs one store lookup, no data).
//! - *active*: mapped in the region (write-protected when installed, so that PAGEMAP_SCAN
//!   sees the writes).
//! - *moving*: active chunks a deactivation is moving to staging. The moves run outside the
//!   state lock (scattered victims are one move, and one TLB flush, each: a group of them
//!   takes hundreds of µs, which every fault would otherwise wait for); a fault on a page
//!   already moved waits until the group is recorded as staged, then moves it back; a push
//!   waits too.
//! - *staged* (inactive): moved with `UFFDIO_MOVE` into a staging area (the region's pages
//!   are missing again, the next touch faults, and the fault moves them back with no I/O,
//!   ≈ 1 µs a page). Chunk `i` has slot `i` of a staging mapping as large as the region
//!   (`MAP_NORESERVE`: only staged pages take memory).
//!
//! The staging area is registered with a second, *quiet* userfaultfd: no events, and
//! write-protect mode only (its holes read as zeros). `UFFDIO_MOVE` only requires its
//! destination to be registered with the fd it is issued on, so moves are issued on the
//! destination's fd and pages go both ways. Dropping staged pages (`madvise`) then raises no
//! `UFFD_EVENT_REMOVE` on the region's fd. With one fd for both (the first design), every
//! drop set the region's `mmap_changing` from the `madvise` until its caller returned, and
//! every fetch, zero fill and move into the region failed with `EAGAIN` meanwhile: a
//! reclaim thread descheduled inside `madvise` stalled all faults for its time slice.
//!
//! Resident = active + staged (+ fetches in flight + slots being dropped). A fault admits a
//! new chunk only below the limit; at the limit it reclaims synchronously (a *reactive*
//! eviction) and, if nothing can be reclaimed (everything resident is being fetched), it may
//! go over by at most `min_free` chunks. A fault that finds a reclaim pass already running
//! does not queue behind it: it is woken as soon as the pass frees a chunk. The reclaim
//! thread keeps chunks free ahead of faults (*proactive* evictions), between two watermarks:
//! once fewer than `min_free / 2` are free it frees up to `min_free`, in steps of up to 64
//! chunks (each one write-back and one `madvise`, so that faults waiting for room wait for
//! a step, not for the pass). Resident memory therefore stays ≤ limit + `min_free`; after
//! the limit is lowered, reclaim brings it down at once.
//!
//! Deactivation takes its victims a group at a time (up to 256 KiB of chunks) and moves
//! each run of consecutive chunks with one `UFFDIO_MOVE`: the kernel flushes the TLB once
//! per move (this kernel batches the present pages of one move), and every flush interrupts
//! each CPU the application runs on. Moving chunk by chunk, `perf` found those interrupts
//! and their wait in 15% of the CPU samples of a paging run; grouped, a sequential scan at
//! 30% local memory with 4 KiB chunks ran 1.6× faster (`bench paging --pattern seq --chunk
//! 4KiB --system farmap --prefetch off`: 10.7-11.7 s → 6.9-7.2 s, 3 runs each, alternating).
//!
//! # Why every staged chunk is written back before its copy is dropped
//! `UFFDIO_MOVE` does not carry the uffd-wp bit (measured on this kernel: after moving 16
//! write-protected pages of which 2 were written, PAGEMAP_SCAN reports all 16 as written in
//! the destination), and a write can land between a scan of the chunk and its move. So the
//! staged content cannot be proven clean: the pager marks each chunk it stages dirty in the
//! region's pusher before it moves the pages (under the pager's lock, so that a flush that
//! starts while they move sees the mark, and its push waits until the chunk is staged) and
//! drops its slot only after a write-back of that chunk that started after the staging
//! succeeded. A write-back ([`Pusher::write_back`](farmap_pipeline::Pusher::write_back)) pushes just the victims, not
//! every dirty chunk of the region as a flush would, and is ordered with the pusher's rounds
//! and flushes like a flush is. The pusher reads staged chunks out of the staging slot (no fault, no
//! move back; see below), and rounds, flushes and write-backs are ordered, so a stale push of older content can
//! never land after the write-back. Nothing written is ever lost, whatever the limit does;
//! the price is one chunk write per drop (clean chunks included).
//!
//! A chunk moved back is write-protected again before its faulting thread is woken, so later
//! writes are tracked; moved pages arrive unprotected and another thread may write one before
//! that, so the chunk is marked dirty again after the protection.
//!
//! # Pushes never touch a page that can be missing
//! A fault on a missing page of the region may have to wait for the pager: for room (a
//! reclaim, which writes back through the pusher), for a fetch, or for a move back. So nothing the pager
//! waits for (a push, a flush, an eviction) may ever read the region where a page can be
//! missing, or the wait goes round in a circle. The rule, enforced under the state lock by
//! [`Pager::read_for_push`]: an active chunk is pinned (not deactivated) while a push reads it
//! out of the region; a staged chunk is copied out of its staging slot; a chunk being fetched
//! is waited for; a remote chunk is read from the store (its staged copy was written back
//! before it was dropped). Moves go run by run over the pages actually present, so a move that
//! stops part way is finished (or undone) by the next call, and no chunk is left split
//! between the region and its slot.
//!
//! An active chunk whose pages are found in its staging slot would be a bug of this module
//! (an earlier version, which kept partly moved chunks as staged and let pushes fault chunks
//! in through the region, saw it about one model run in three). The fault path checks for it
//! before fetching again, moves the pages back rather than fetch stale data, counts it in
//! `recovered` and records an error; the model test asserts it never happens.

//! # Eviction policy
//! RackMem keeps an active FIFO with a recency score. With no accessed bits from userspace
//! on this kernel, the score here is a referenced flag per chunk, set (a) when the chunk
//! becomes active (its fault: fetch or move back) and (b) when a non-destructive
//! `PAGEMAP_SCAN` (which takes nothing from the write tracking) finds written pages in it;
//! the scan runs once per reclaim pass. Victims are picked from the FIFO's head with a
//! second chance (CLOCK): a referenced chunk has its flag cleared and goes to the tail.
//! Read-only accesses to a resident chunk are invisible (no fault, no written bit), so a
//! chunk that is only read ages out after one pass of the clock: the cost of having no
//! accessed bits. Staged chunks are dropped oldest first.
//!
//! With sequential prefetch, chunks that a thread's stream has left more than a maximal
//! window behind are queued for *drop-behind* and taken as victims before the clock's,
//! whatever their referenced flag: a scan writes half its chunks (say), and the clock would
//! give those a second chance, so the victims of a group would alternate, one move and one
//! TLB flush each (runs averaged 2.7 chunks); in queue order they are consecutive.
//! `bench paging --pattern seq --chunk 4KiB --prefetch seq:32`: 4.16 → 2.10-2.20 s.
//!
//! # Not supported with paging
//! The managed mode's background pull (it would fill the region past the limit), hand-over
//! of fault handling to another process, and synchronous write tracking.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use farmap_core::{ChunkIdx, Geometry, StoreError, StoreResult};
use parking_lot::{Condvar, Mutex};
use tokio::runtime::Handle;
use tokio::sync::Notify;

use crate::mapping::Mapping;
use crate::memory::{Events, PushRead, PushReads, RegionCache};
use crate::options::Prefetch;
use crate::pagemap::Pagemap;
use crate::stats::Counters;
use crate::sys;
use crate::uffd::UffdRange;

/// Writes back the given chunks through the region's pusher, ordered with its rounds and
/// flushes ([`farmap_pipeline::Pusher::write_back`]; set once the pusher exists).
pub(crate) type WriteBackFn =
    Box<dyn Fn(Vec<ChunkIdx>) -> farmap_core::BoxFuture<'static, StoreResult<()>> + Send + Sync>;
/// Marks a chunk dirty in the region's pusher.
pub(crate) type MarkFn = Box<dyn Fn(ChunkIdx) + Send + Sync>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum St {
    /// Never written: the store holds nothing for it (a fresh region), so its first touch
    /// maps zero pages, with no store read.
    Zero,
    Remote,
    /// Being fetched; `new` when the fetch took a new unit of the limit (from remote or
    /// zero), `zero` when it is filled with zeros rather than read.
    Fetching {
        new: bool,
        zero: bool,
    },
    Active,
    /// Active, its pages being moved to its staging slot by a deactivation (outside the
    /// state lock); then staged, or active again if the move could be undone.
    Moving,
    Staged,
}

struct State {
    chunk: Vec<St>,
    /// The staging slot holds pages (staged, or being dropped).
    slot_busy: Vec<bool>,
    /// The epoch when the chunk was last staged.
    staged_epoch: Vec<u64>,
    /// The epoch at the start of the chunk's last successful write-back: a staged chunk whose
    /// `staged_epoch` is older is in the store, and its slot can be dropped.
    written_back: Vec<u64>,
    referenced: Vec<bool>,
    /// Fetched ahead of faults and not yet found used.
    prefetched: Vec<bool>,
    /// Pushes reading the chunk out of the region now: it is not deactivated meanwhile.
    pins: Vec<u32>,
    active: VecDeque<u64>,
    /// Drop-behind: chunks that a sequential stream has left behind, oldest first, taken as
    /// victims before the clock's (entries whose chunk is no longer active are skipped).
    behind: VecDeque<u64>,
    /// Staged chunks, oldest first, with the id of their staging: an entry is current only
    /// while its chunk is staged with that id (leaving the staged state removes nothing
    /// here, so that a move back, in a signal handler too, is O(1)).
    staged: VecDeque<(u64, u64)>,
    /// The id of each chunk's last staging.
    stage_id: Vec<u64>,
    /// The last staging id given.
    stage_seq: u64,
    /// Chunks in the staged state.
    n_staged: u64,
    /// Chunks counted against the limit.
    resident: u64,
    /// Bumped when a write-back starts.
    epoch: u64,
}

/// What a fault on a chunk must do, decided under the pager's lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admit {
    /// Nothing more: the page is there (woken), or the chunk was moved back (woken).
    Done,
    /// Another task's copy in flight will wake the thread.
    InFlight,
    /// Fetch the chunk from the store (it is marked fetching), then call
    /// [`Pager::fetched`].
    Fetch,
    /// The chunk was never written: fill it with zero pages ([`Pager::fill_zero`]), then
    /// call [`Pager::fetched`].
    Zero,
    /// The region is at its limit: reclaim, then ask again.
    Full,
    /// A userfaultfd event is pending, or the chunk is being staged: wait for the event
    /// generation to move on (the reader read the event; the deactivation recorded the
    /// chunk as staged), then ask again.
    Retry,
}

/// What a fault served in the faulting thread's signal handler came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InThread {
    /// The chunk was moved back: retry the access.
    Done,
    /// The reader must serve this fault.
    Elsewhere,
}

/// The paging counters.
#[derive(Debug, Default)]
pub(crate) struct PagingCounters {
    pub evictions_reactive: AtomicU64,
    pub evictions_proactive: AtomicU64,
    pub deactivations: AtomicU64,
    pub staged_refaults: AtomicU64,
    pub staged_refaults_in_thread: AtomicU64,
    pub writebacks: AtomicU64,
    pub recovered: AtomicU64,
    pub overcommits: AtomicU64,
    pub partial_moves: AtomicU64,
    pub pushes_from_store: AtomicU64,
    pub zero_fills: AtomicU64,
    pub prefetched: AtomicU64,
    pub prefetch_hits: AtomicU64,
    pub prefetch_wasted: AtomicU64,
    pub dropped_behind: AtomicU64,
}

/// A faulting thread's sequential stream (prefetch).
#[derive(Debug, Clone, Copy, Default)]
struct Stream {
    /// The chunk whose fault would continue the stream.
    next: Option<u64>,
    /// The window, in chunks (0: closed).
    window: u64,
    /// The chunks prefetched for this window: `next - pending .. next`.
    pending: u64,
    /// A fault inside the window has already extended it.
    extended: bool,
    /// The first chunk behind the thread not queued for drop-behind yet.
    behind: u64,
}

/// Threads whose streams are remembered at most (a process that churns through threads
/// forgets them all and starts over).
const MAX_STREAMS: usize = 4096;

/// Most bytes of victims a deactivation takes at once under the state lock (see
/// [`Pager::deactivate`]): 64 pages of 4 KiB.
const GROUP_BYTES: u64 = 256 << 10;

/// Most chunks of the active FIFO a deactivation looks at under one hold of the state lock.
/// After a scan for written chunks most resident chunks can be referenced, and the clock
/// then goes through all of them before it finds a victim (≈ 20,000 chunks, a few hundred
/// µs, at 30% of a 256 MiB region in 4 KiB chunks): faults would wait for all of it.
const SCAN_PER_HOLD: usize = 1024;

/// Most chunks one sequential fault queues for drop-behind (a stream that jumped far ahead
/// does not queue everything it skipped).
const MAX_BEHIND: u64 = 4096;

/// The pager's state lock: a futex lock that puts a contended waiter to sleep after a short
/// spin, and wakes it when the holder unlocks.
///
/// Not `parking_lot::Mutex`: its waiters call `sched_yield` several times before they sleep,
/// and the lock is held across system calls (moves, scans), so its holder is sometimes
/// preempted while it holds it, often by the fault reader of its own CPU. That reader then
/// yields to the holder, which, under EEVDF, runs on for the rest of its time slice (the
/// reader, runnable, is not woken by the unlock): measured with `perf sched timehist`, a
/// fault waited 606 µs this way while the other CPU was idle.
///
/// The lock is not fair by itself: a thread that unlocks and locks again at once (a
/// write-back reading chunk after chunk) keeps a woken waiter out, which wakes, finds the
/// lock taken and sleeps again, for as long as the loop runs (measured: 850 µs, 50 such
/// wake-ups). So the background work takes it with [`lock_yielding`](Self::lock_yielding),
/// whose unlock waits (at most [`HANDOFF_MAX`]) until a fault that was waiting has had it.
struct SleepLock<T> {
    inner: std::sync::Mutex<T>,
    /// Fault-path threads in [`lock`](Self::lock) that found the lock taken and have not
    /// got it yet.
    waiting: AtomicU32,
    /// Bumped by each of those when it gets the lock.
    handed: AtomicU32,
}

/// Longest a background unlock waits for a waiting fault to take the lock.
const HANDOFF_MAX: Duration = Duration::from_micros(100);

impl<T> SleepLock<T> {
    fn new(value: T) -> Self {
        Self {
            inner: std::sync::Mutex::new(value),
            waiting: AtomicU32::new(0),
            handed: AtomicU32::new(0),
        }
    }

    /// Locks, sleeping while another thread holds the lock; for the fault path (a background
    /// holder lets it in when it unlocks). A panic while the lock was held (a bug) leaves the
    /// state as the panicking thread left it, as `parking_lot`'s lock did: the lock is not
    /// poisoned for the region's other threads.
    fn lock(&self) -> std::sync::MutexGuard<'_, T> {
        if let Some(g) = self.try_lock() {
            return g;
        }
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let g = self.lock_inner();
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        self.handed.fetch_add(1, Ordering::SeqCst);
        g
    }

    /// Locks for background work (reclaim, write-back): see [`Yielding`].
    fn lock_yielding(&self) -> Yielding<'_, T> {
        Yielding {
            guard: Some(self.lock_inner()),
            lock: self,
        }
    }

    fn lock_inner(&self) -> std::sync::MutexGuard<'_, T> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Locks if nobody holds the lock (async-signal-safe: one atomic compare-exchange).
    fn try_lock(&self) -> Option<std::sync::MutexGuard<'_, T>> {
        match self.inner.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }
}

/// A background hold of a [`SleepLock`]: when it ends and a fault waits for the lock, the
/// unlocking thread yields until that fault has taken it (at most [`HANDOFF_MAX`]) instead of
/// taking it again first.
struct Yielding<'a, T> {
    guard: Option<std::sync::MutexGuard<'a, T>>,
    lock: &'a SleepLock<T>,
}

impl<T> std::ops::Deref for Yielding<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.guard.as_deref().expect("held until dropped")
    }
}

impl<T> std::ops::DerefMut for Yielding<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.guard.as_deref_mut().expect("held until dropped")
    }
}

impl<T> Drop for Yielding<'_, T> {
    fn drop(&mut self) {
        let handed = self.lock.handed.load(Ordering::SeqCst);
        let waiting = self.lock.waiting.load(Ordering::SeqCst) > 0;
        drop(self.guard.take());
        if !waiting {
            return;
        }
        let start = std::time::Instant::now();
        while self.lock.handed.load(Ordering::SeqCst) == handed && start.elapsed() < HANDOFF_MAX {
            // The waiter may be on this CPU: give it the CPU.
            std::thread::yield_now();
        }
    }
}

/// `sorted` (ascending, no repeats) cut into runs of consecutive chunk indices.
fn consecutive_runs(sorted: &[u64]) -> impl Iterator<Item = &[u64]> {
    sorted.chunk_by(|a, b| *a + 1 == *b)
}

/// The pager of one region (see the module documentation).
pub(crate) struct Pager {
    region: UffdRange,
    staging: UffdRange,
    /// The staging area's tail, past the slots: dropped chunks' pages are moved here so that
    /// one `madvise` frees a batch of them (see [`discard_slots`](Self::discard_slots)).
    trash: Option<UffdRange>,
    /// Where the trash starts in `staging_map`, and how many chunks it holds.
    trash_offset: usize,
    trash_chunks: usize,
    /// Bumped after every discard, for copies waiting on `EAGAIN`.
    events: Arc<Events>,
    staging_map: Arc<Mapping>,
    geometry: Geometry,
    pagemap: Pagemap,
    state: SleepLock<State>,
    limit: AtomicU64,
    min_free: AtomicU64,
    min_free_auto: bool,
    prefetch: Prefetch,
    /// Each faulting thread's sequential stream, by thread id.
    streams: Mutex<HashMap<u32, Stream>>,
    cache: OnceLock<Weak<RegionCache>>,
    write_back: OnceLock<WriteBackFn>,
    mark: OnceLock<MarkFn>,
    /// Serializes reclaim passes (one write-back at a time).
    reclaim_lock: tokio::sync::Mutex<()>,
    /// Signalled when resident memory goes down or the limit changes.
    changed: Notify,
    /// Wakes the reclaim thread.
    kick: (Mutex<bool>, Condvar),
    stop: AtomicBool,
    /// Deactivations moving pages outside the state lock now, and how many such batches
    /// have ended: [`local_pages`](Self::local_pages) counts only between two batches.
    moving: AtomicU64,
    moved: AtomicU64,
    /// Chunks moved back in a faulting thread and not write-protected yet (one bit each):
    /// the next reclaim pass protects them, off the fault path.
    unprotected: Vec<AtomicU64>,
    /// Some bit of `unprotected` may be set.
    unprotected_any: AtomicBool,
    pub counters: PagingCounters,
    region_counters: Arc<Counters>,
    trace: Option<Mutex<Vec<(u64, String)>>>,
}

impl Pager {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        region: UffdRange,
        staging: UffdRange,
        staging_map: Arc<Mapping>,
        events: Arc<Events>,
        geometry: Geometry,
        limit: u64,
        min_free: Option<u64>,
        fresh: bool,
        prefetch: Prefetch,
        region_counters: Arc<Counters>,
    ) -> std::io::Result<Pager> {
        let n = geometry.chunk_count() as usize;
        let limit = limit.max(1);
        // The staging mapping's tail past the slots (see `trash_len`) is the trash.
        let trash_offset = staging.len();
        let trash_len = staging_map.len().saturating_sub(trash_offset);
        let trash_chunks = trash_len / geometry.chunk_size() as usize;
        let trash = (trash_chunks > 0).then(|| {
            UffdRange::new(
                staging.uffd().clone(),
                staging.base() + trash_offset,
                trash_len,
            )
        });
        Ok(Pager {
            region,
            staging,
            trash,
            trash_offset,
            trash_chunks,
            events,
            staging_map,
            geometry,
            pagemap: Pagemap::open_self()?,
            state: SleepLock::new(State {
                chunk: vec![if fresh { St::Zero } else { St::Remote }; n],
                slot_busy: vec![false; n],
                staged_epoch: vec![0; n],
                written_back: vec![0; n],
                referenced: vec![false; n],
                prefetched: vec![false; n],
                pins: vec![0; n],
                // Reserved so that a move back in a signal handler never allocates (one
                // entry per chunk, plus stale duplicates of refetched chunks).
                active: VecDeque::with_capacity(n + n / 8 + 64),
                behind: VecDeque::new(),
                staged: VecDeque::new(),
                stage_id: vec![0; n],
                stage_seq: 0,
                n_staged: 0,
                resident: 0,
                epoch: 0,
            }),
            limit: AtomicU64::new(limit),
            min_free: AtomicU64::new(min_free.unwrap_or_else(|| auto_min_free(limit))),
            min_free_auto: min_free.is_none(),
            prefetch,
            streams: Mutex::new(HashMap::new()),
            cache: OnceLock::new(),
            write_back: OnceLock::new(),
            mark: OnceLock::new(),
            reclaim_lock: tokio::sync::Mutex::new(()),
            changed: Notify::new(),
            kick: (Mutex::new(false), Condvar::new()),
            stop: AtomicBool::new(false),
            moving: AtomicU64::new(0),
            moved: AtomicU64::new(0),
            unprotected: (0..n.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            unprotected_any: AtomicBool::new(false),
            counters: PagingCounters::default(),
            region_counters,
            trace: std::env::var_os("FARMAP_PAGER_TRACE").map(|_| Mutex::new(Vec::new())),
        })
    }

    /// Connects the cache and the pusher (made after the pager).
    pub fn connect(&self, cache: Weak<RegionCache>, write_back: WriteBackFn, mark: MarkFn) {
        let _ = self.cache.set(cache);
        let _ = self.write_back.set(write_back);
        let _ = self.mark.set(mark);
    }

    fn chunk_span(&self, idx: u64) -> (usize, usize) {
        let i = ChunkIdx(idx);
        (
            self.geometry.offset_of(i) as usize,
            self.geometry.chunk_len(i),
        )
    }

    /// The bytes of a run of consecutive chunks (not empty): its first one's offset and the
    /// length up to the end of its last one.
    fn run_span(&self, run: &[u64]) -> (usize, usize) {
        let (off, _) = self.chunk_span(run[0]);
        let (last_off, last_len) = self.chunk_span(run[run.len() - 1]);
        (off, last_off + last_len - off)
    }

    /// The limit, in chunks.
    pub fn limit(&self) -> u64 {
        self.limit.load(Ordering::Relaxed)
    }

    /// Chunks kept free by proactive reclaim.
    pub fn min_free(&self) -> u64 {
        self.min_free.load(Ordering::Relaxed)
    }

    /// The free chunks below which the reclaim thread starts a pass (which frees up to
    /// `min_free`): half of `min_free`, so that a pass drops batches of chunks, one write-back
    /// and one `madvise` each, rather than one chunk each time a fault takes one.
    fn low_water(&self) -> u64 {
        self.min_free().div_ceil(2)
    }

    /// Changes the limit (in chunks, at least 1); reclaim brings resident memory under it.
    pub fn set_limit(&self, chunks: u64) {
        let chunks = chunks.clamp(1, self.geometry.chunk_count().max(1));
        self.limit.store(chunks, Ordering::Relaxed);
        if self.min_free_auto {
            self.min_free
                .store(auto_min_free(chunks), Ordering::Relaxed);
        }
        self.changed.notify_waiters();
        self.kick();
    }

    fn tr(&self, i: u64, what: impl FnOnce() -> String) {
        if let Some(t) = &self.trace {
            let (off, len) = self.chunk_span(i);
            let count = |r: &UffdRange| {
                let mut n = 0;
                let mut v = Vec::new();
                let _ =
                    self.pagemap
                        .in_memory(r.base() + off, r.base() + off + len, &mut v, |run| {
                            n += (run.end - run.start) / 4096
                        });
                n
            };
            let line = format!(
                "{} [region {} slot {}]",
                what(),
                count(&self.region),
                count(&self.staging)
            );
            t.lock().push((i, line));
        }
    }

    pub fn trace_install(&self, idx: ChunkIdx, copied: usize, present: usize) {
        self.tr(idx.0, || {
            format!("install copied {copied} present {present}")
        });
    }

    /// The trace of chunk `i` (debugging; `FARMAP_PAGER_TRACE` set).
    pub fn trace_of(&self, i: u64) -> Vec<String> {
        self.trace
            .as_ref()
            .map(|t| {
                let t = t.lock();
                let pos = t
                    .iter()
                    .rposition(|(c, s)| *c == i && s.starts_with("active-missing"))
                    .unwrap_or(t.len());
                t[..(pos + 1).min(t.len())]
                    .iter()
                    .filter(|(c, _)| *c == i)
                    .map(|(c, s)| format!("{c}: {s}"))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Pages present in the region and in the staging area (slots and trash) now, from the
    /// page tables. A page moving between two of the scans could be counted twice: the
    /// scans run under the state lock (which the moves back and a push's moves take) while
    /// no deactivation moves pages (it moves outside the lock; the count is taken again if
    /// one ran meanwhile, up to a few times). The other moves go from the staging slots to
    /// the trash, scanned first: a page moving meanwhile is missed, never counted twice.
    pub fn local_pages(&self) -> std::io::Result<(u64, u64)> {
        let mut tries = 0;
        loop {
            let before = self.moved.load(Ordering::SeqCst);
            let idle = self.moving.load(Ordering::SeqCst) == 0;
            let counts = {
                let _st = self.state.lock();
                self.count_local_pages()?
            };
            tries += 1;
            let quiet = idle
                && self.moving.load(Ordering::SeqCst) == 0
                && self.moved.load(Ordering::SeqCst) == before;
            if quiet || tries >= 100 {
                return Ok(counts);
            }
            std::thread::yield_now();
        }
    }

    fn count_local_pages(&self) -> std::io::Result<(u64, u64)> {
        let ps = self.region.page_size();
        let count = |r: &UffdRange| -> std::io::Result<u64> {
            let mut n = 0;
            let mut scratch = Vec::new();
            self.pagemap
                .in_memory(r.base(), r.base() + r.len(), &mut scratch, |run| {
                    n += ((run.end - run.start) / ps) as u64
                })?;
            Ok(n)
        };
        let trash = match &self.trash {
            Some(t) => count(t)?,
            None => 0,
        };
        Ok((count(&self.region)?, count(&self.staging)? + trash))
    }

    /// `(resident, staged)` chunks now.
    pub fn resident(&self) -> (u64, u64) {
        let st = self.state.lock();
        (st.resident, st.n_staged)
    }

    /// Decides what a missing fault at `page` (offset in the region) of chunk `idx` does.
    pub fn on_fault(&self, idx: ChunkIdx, page: usize, overcommit: bool) -> Admit {
        let i = idx.0;
        let mut st = self.state.lock();
        match st.chunk[i as usize] {
            St::Fetching { .. } => Admit::InFlight,
            // Its pages are on their way to the staging slot: ask again once they are there
            // (the deactivation bumps the event generation), and move them back then.
            St::Moving => Admit::Retry,
            St::Active => {
                let addr = self.region.base() + page;
                let ps = self.region.page_size();
                if self.pagemap.all_in_memory(addr, addr + ps).unwrap_or(false) {
                    let _ = self.region.wake(page, ps);
                    return Admit::Done;
                }
                // Its pages in its staging slot although it is active: a bug (see the module
                // docs). Move them back rather than fetch stale data, and say so.
                if !st.slot_busy[i as usize] && self.slot_pages(i) > 0 {
                    self.tr(i, || {
                        format!("active-missing page {page:#x} -> recover from slot")
                    });
                    Counters::add(&self.counters.recovered, 1);
                    self.region_counters.error(format!(
                        "chunk {i} is active but its pages are in its staging slot"
                    ));
                    return self.move_back(&mut st, i);
                }
                // Discarded behind our back (the application's madvise): fetch it again,
                // already counted.
                st.chunk[i as usize] = St::Fetching {
                    new: false,
                    zero: false,
                };
                self.tr(i, || format!("active-missing page {page:#x} -> refetch"));
                self.evict_from_cache(idx);
                Admit::Fetch
            }
            St::Staged => self.move_back(&mut st, i),
            St::Remote | St::Zero => {
                let zero = st.chunk[i as usize] == St::Zero;
                let limit = self.limit();
                if st.resident < limit || (overcommit && st.resident < limit + self.min_free()) {
                    if st.resident >= limit {
                        Counters::add(&self.counters.overcommits, 1);
                    }
                    st.resident += 1;
                    self.tr(i, || format!("remote fault page {page:#x} -> fetch"));
                    st.chunk[i as usize] = St::Fetching { new: true, zero };
                    self.evict_from_cache(idx);
                    if limit.saturating_sub(st.resident) < self.low_water() {
                        self.kick();
                    }
                    if zero {
                        Admit::Zero
                    } else {
                        Admit::Fetch
                    }
                } else {
                    self.kick();
                    Admit::Full
                }
            }
        }
    }

    fn evict_from_cache(&self, idx: ChunkIdx) {
        if let Some(cache) = self.cache.get().and_then(Weak::upgrade) {
            cache.evict(idx);
        }
    }

    /// The fetch of a chunk [`on_fault`](Self::on_fault) admitted finished.
    pub fn fetched(&self, idx: ChunkIdx, ok: bool) {
        let i = idx.0 as usize;
        let mut st = self.state.lock();
        if let St::Fetching { new, zero } = st.chunk[i] {
            self.tr(idx.0, || format!("fetched ok={ok}"));
            if ok {
                st.chunk[i] = St::Active;
                st.referenced[i] = true;
                st.active.push_back(idx.0);
            } else {
                st.chunk[i] = if zero { St::Zero } else { St::Remote };
                st.prefetched[i] = false;
                if new {
                    st.resident -= 1;
                    drop(st);
                    self.changed.notify_waiters();
                }
            }
        }
    }

    /// Moves every page of `off..off+len` that is present in `from` to the same offset of
    /// `to`, run by run, with `UFFDIO_MOVE` (no wake-up). Holes of `from` are skipped, so
    /// the call is idempotent: after a partial move (`EAGAIN`: an event is pending or a page
    /// is busy) calling it again moves the rest. Called under the state lock, or by a
    /// deactivation on chunks it marked `Moving`: either keeps every other mover of this
    /// module away from the pages, so they stay where the page tables said they were.
    fn move_present(
        &self,
        from: &UffdRange,
        to: &UffdRange,
        off: usize,
        len: usize,
    ) -> Result<(), i32> {
        self.move_present_to(from, off, to, off, len)
    }

    /// [`move_present`](Self::move_present) from `from_off` of `from` to `to_off` of `to`.
    fn move_present_to(
        &self,
        from: &UffdRange,
        from_off: usize,
        to: &UffdRange,
        to_off: usize,
        len: usize,
    ) -> Result<(), i32> {
        let base = from.base();
        let mut runs = Vec::new();
        let mut scratch = Vec::new();
        self.pagemap
            .in_memory(
                base + from_off,
                base + from_off + len,
                &mut scratch,
                |run| runs.push((run.start - base, run.end - run.start)),
            )
            .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
        for (o, l) in runs {
            from.move_to(
                o,
                to,
                to_off + (o - from_off),
                l,
                sys::UFFDIO_MOVE_MODE_DONTWAKE,
            )
            .map_err(|(_, e)| e)?;
        }
        Ok(())
    }

    /// Moves staged chunk `i` back into the region, re-protects it, wakes its waiters.
    fn move_back(&self, st: &mut State, i: u64) -> Admit {
        let (off, len) = self.chunk_span(i);
        // One move of the whole slot first; if it stops part way, the page-by-page path
        // below finishes it.
        let r = match self.move_slot_back(off, len) {
            Ok(()) => Ok(()),
            Err(()) => {
                let _ = self.region.write_protect(off, len, false, false);
                self.move_present(&self.staging, &self.region, off, len)
            }
        };
        self.tr(i, || format!("move back {r:?}"));
        if let Err(e) = r {
            // EAGAIN: an event is pending, or a page is busy. The pages already moved stay
            // in the region; the retry moves the rest.
            Counters::add(&self.counters.partial_moves, 1);
            if e != libc::EAGAIN {
                self.region_counters.error(format!(
                    "moving staged chunk {i} back into the region: {}",
                    std::io::Error::from_raw_os_error(e)
                ));
            }
            return Admit::Retry;
        }
        // Moved pages arrive unprotected (UFFDIO_MOVE drops the uffd-wp bit) and present,
        // so a thread may write one before the protection below: mark the chunk dirty after
        // protecting it, and the next push reads every such write. A protection failure
        // leaves the pages unprotected, which only means extra pushes.
        let _ = self.region.write_protect(off, len, true, false);
        if let Some(mark) = self.mark.get() {
            mark(ChunkIdx(i));
        }
        let _ = self.region.wake(off, len);
        Self::staged_to_active(st, i);
        Counters::add(&self.counters.staged_refaults, 1);
        Admit::Done
    }

    /// Moves the pages of the staging slot at `off..off+len` back into the region with one
    /// `UFFDIO_MOVE` (holes of the slot skipped). The region's empty entries may carry
    /// write-protect markers (WP_UNPOPULATED: the tracker's scans protect holes too), which
    /// a move refuses as not empty (`EEXIST`): then they are cleared and the move tried once
    /// more. `Err` if it stopped part way (the pages moved stay in the region, and
    /// [`move_present`](Self::move_present) finishes the rest). Async-signal-safe.
    fn move_slot_back(&self, off: usize, len: usize) -> Result<(), ()> {
        let mode = sys::UFFDIO_MOVE_MODE_DONTWAKE | sys::UFFDIO_MOVE_MODE_ALLOW_SRC_HOLES;
        let mut moved = self.staging.move_to(off, &self.region, off, len, mode);
        if let Err((0, libc::EEXIST)) = moved {
            let _ = self.region.write_protect(off, len, false, false);
            moved = self.staging.move_to(off, &self.region, off, len, mode);
        }
        moved.map(|_| ()).map_err(|_| ())
    }

    /// The state change of a move back (its pages are in the region, protected, marked).
    fn staged_to_active(st: &mut State, i: u64) {
        let iu = i as usize;
        st.chunk[iu] = St::Active;
        st.slot_busy[iu] = false;
        st.referenced[iu] = true;
        st.n_staged -= 1;
        st.active.push_back(i);
    }

    /// A fault on chunk `i`, served in the faulting thread's signal handler (see the
    /// `signal` module): a staged chunk whose slot holds all its pages is moved back with one
    /// `UFFDIO_MOVE`, re-protected and marked dirty, and [`InThread::Done`] tells the thread to
    /// retry its access. Anything else (another state, the lock taken, a move that stops part
    /// way, a trace being recorded) is [`InThread::Elsewhere`]: the reader serves it, and
    /// finishes any partial move as [`move_back`](Self::move_back) does. Async-signal-safe:
    /// no allocation, no blocking lock.
    pub fn move_back_in_thread(&self, i: u64) -> InThread {
        if self.trace.is_some() {
            return InThread::Elsewhere;
        }
        let Some(mut st) = self.state.try_lock() else {
            return InThread::Elsewhere;
        };
        let iu = i as usize;
        if st.chunk.get(iu) != Some(&St::Staged) || st.active.len() >= st.active.capacity() {
            return InThread::Elsewhere;
        }
        let (off, len) = self.chunk_span(i);
        if self.move_slot_back(off, len).is_err() {
            Counters::add(&self.counters.partial_moves, 1);
            return InThread::Elsewhere;
        }
        // Not write-protected here (one ioctl, a µs, off the fault path): moved pages carry
        // no uffd-wp bit, so until the next reclaim pass protects the chunk
        // (`protect_moved_back`) every write to it shows as written to the tracker's scans.
        // Marked dirty now for the staged content itself.
        self.unprotected[iu / 64].fetch_or(1 << (iu % 64), Ordering::Release);
        self.unprotected_any.store(true, Ordering::Release);
        if let Some(mark) = self.mark.get() {
            mark(ChunkIdx(i));
        }
        Self::staged_to_active(&mut st, i);
        drop(st);
        // Other threads of this chunk may be waiting for it.
        self.region.uffd().wakeups().bump();
        Counters::add(&self.counters.staged_refaults, 1);
        Counters::add(&self.counters.staged_refaults_in_thread, 1);
        InThread::Done
    }

    /// Decides, under the state lock, where a push reads chunk `idx` (`buf` is as long as
    /// the chunk). The rule that keeps pushes from deadlocking with faults: a push never
    /// touches a page of the region that can be missing. A fault on a missing page may have
    /// to wait for room, room for a reclaim, and a reclaim for a write-back, which
    /// waits for this very push.
    /// - staged: copied out of its staging slot now (its pages cannot move while the lock
    ///   is held; a partly staged chunk has the rest of its pages moved into the slot
    ///   first);
    /// - active: pinned (not deactivated until [`unpin`](Self::unpin)), to be read out of
    ///   the region, where all its pages are;
    /// - being fetched: wait until it is active (a fetch never waits for a push);
    /// - remote: every staged copy is written back before it is dropped, so the store holds
    ///   the newest content (and the region none of its pages).
    pub fn read_for_push(&self, idx: ChunkIdx, buf: &mut [u8]) -> PushRead {
        let i = idx.0 as usize;
        let mut st = self.state.lock_yielding();
        self.tr(idx.0, || format!("push read {:?}", st.chunk.get(i)));
        match st.chunk.get(i) {
            Some(St::Active) => {
                st.pins[i] += 1;
                PushRead::Pinned
            }
            Some(St::Staged) => {
                let (off, len) = self.chunk_span(idx.0);
                if self
                    .move_present(&self.region, &self.staging, off, len)
                    .is_err()
                {
                    Counters::add(&self.counters.partial_moves, 1);
                    return PushRead::Busy;
                }
                let base = self.staging.base() + off;
                // Reading a hole of the staging area would fault, and nobody serves staging
                // faults: every page must be there (a staged chunk's pages are in its slot or
                // in the region, and those were just moved).
                if !self
                    .pagemap
                    .all_in_memory(base, base + len)
                    .unwrap_or(false)
                {
                    return PushRead::Busy;
                }
                if self.staging_map.read(off, &mut buf[..len]) {
                    PushRead::Copied
                } else {
                    PushRead::NotLocal
                }
            }
            // Being fetched: its pages may be installed already, and written (the install
            // wakes the faulting thread before the fetch is recorded). A fetch never waits
            // for a push: wait for it.
            Some(St::Fetching { .. }) => PushRead::Busy,
            // Being staged: its pages are moving; read it from its slot once it is staged.
            Some(St::Moving) => PushRead::Busy,
            Some(St::Zero) => PushRead::Zero,
            _ => {
                Counters::add(&self.counters.pushes_from_store, 1);
                PushRead::NotLocal
            }
        }
    }

    /// After thread `tid`'s fault at chunk `idx` was served: moves its sequential stream on
    /// and admits the chunks to prefetch (marked fetching and prefetched; the caller fetches
    /// each and calls [`fetched`](Self::fetched)), as `(chunk, zero)` where `zero` says the
    /// chunk is to be filled with zero pages rather than read. Empty without prefetch.
    ///
    /// A fault at the chunk after the thread's last window doubles the window (up to the
    /// maximum) and counts the last window's chunks still marked prefetched as hits; the
    /// first fault inside the window (the thread caught up with chunks still being fetched)
    /// extends it by as much again, ahead of the thread; any other fault closes it. Chunks already local are skipped; admission stops at the limit
    /// (prefetch never overcommits nor waits for room; it wakes the reclaim thread instead).
    pub fn prefetch_after(&self, tid: u32, idx: ChunkIdx) -> Vec<(ChunkIdx, bool)> {
        let Prefetch::Sequential { max_chunks } = self.prefetch else {
            return Vec::new();
        };
        let count = self.geometry.chunk_count();
        let (confirm, start, window, extend, behind) = {
            let mut streams = self.streams.lock();
            if streams.len() >= MAX_STREAMS && !streams.contains_key(&tid) {
                streams.clear();
            }
            let s = streams.entry(tid).or_default();
            let sequential = s.next == Some(idx.0);
            // A fault inside the window: a prefetched chunk still being fetched (the thread
            // is woken before its window is fetched, and catches up with it). The thread is
            // that close behind: extend the window once by as much again, ahead of it.
            let inside = s
                .next
                .filter(|&next| !sequential && idx.0 < next && idx.0 >= next - s.pending);
            if let Some(next) = inside {
                if s.extended || next >= count {
                    return Vec::new();
                }
                s.extended = true;
                (0..0, next, s.window.min(count - next), true, 0..0)
            } else {
                let confirm = if sequential {
                    idx.0 - s.pending..idx.0
                } else {
                    0..0
                };
                s.window = if sequential {
                    (s.window * 2).clamp(1, u64::from(max_chunks.max(1)))
                } else {
                    0
                };
                s.extended = false;
                // Drop-behind: the chunks more than a maximal window behind the thread.
                let behind = if sequential {
                    let upto = idx.0.saturating_sub(u64::from(max_chunks.max(1)));
                    let from = s.behind.max(upto.saturating_sub(MAX_BEHIND));
                    s.behind = s.behind.max(upto);
                    from..upto
                } else {
                    s.behind = idx.0;
                    0..0
                };
                (
                    confirm,
                    idx.0 + 1,
                    s.window.min(count - 1 - idx.0),
                    false,
                    behind,
                )
            }
        };
        let mut st = self.state.lock();
        let mut used = 0;
        for i in confirm {
            used += u64::from(std::mem::take(&mut st.prefetched[i as usize]));
        }
        Counters::add(&self.counters.prefetch_hits, used);
        if !behind.is_empty() {
            let n = st.chunk.len();
            if st.behind.len() + (behind.end - behind.start) as usize > n {
                st.behind.clear();
            }
            st.behind.extend(behind);
        }
        let limit = self.limit();
        let mut admitted = Vec::new();
        // The chunks after `idx` that are local or admitted now: the window as it stands
        // (it ends early at the limit, and the next fault after it continues the stream).
        let mut covered = 0;
        for i in start..start + window {
            let iu = i as usize;
            let zero = match st.chunk[iu] {
                St::Remote => false,
                St::Zero => true,
                _ => {
                    covered += 1;
                    continue;
                }
            };
            if st.resident >= limit {
                self.kick();
                break;
            }
            st.resident += 1;
            st.chunk[iu] = St::Fetching { new: true, zero };
            st.prefetched[iu] = true;
            self.evict_from_cache(ChunkIdx(i));
            admitted.push((ChunkIdx(i), zero));
            covered += 1;
        }
        if limit.saturating_sub(st.resident) < self.low_water() {
            self.kick();
        }
        drop(st);
        if let Some(s) = self.streams.lock().get_mut(&tid) {
            s.pending = if extend { s.pending + covered } else { covered };
            s.next = Some(start + covered);
        }
        Counters::add(&self.counters.prefetched, admitted.len() as u64);
        admitted
    }

    /// Pages of chunk `i`'s staging slot present in memory.
    fn slot_pages(&self, i: u64) -> usize {
        let (off, len) = self.chunk_span(i);
        let base = self.staging.base() + off;
        let mut n = 0;
        let mut v = Vec::new();
        let _ = self
            .pagemap
            .in_memory(base, base + len, &mut v, |run| n += run.end - run.start);
        n
    }

    /// Fills chunk `idx` (admitted with [`Admit::Zero`]) with the shared zero page and wakes
    /// its waiters: no store read, no page allocated until a write. `Err(EAGAIN)` while an
    /// event is pending (call again once the reader has read it).
    ///
    /// `UFFDIO_ZEROPAGE` has no write-protect mode: the zero pages are protected right after
    /// (so that the scans see later writes), before anyone is woken. A thread that touches a
    /// page for the first time in between may write it unprotected; such a page is no longer
    /// the zero page, which the page tables tell, and the chunk is then marked dirty.
    pub fn fill_zero(&self, idx: ChunkIdx) -> Result<(), i32> {
        let (off, len) = self.chunk_span(idx.0);
        // Empty entries may carry write-protect markers (the scans protect holes), which
        // UFFDIO_ZEROPAGE refuses (EEXIST): unprotecting clears them.
        self.region.write_protect(off, len, false, false)?;
        let mut done = 0;
        while done < len {
            match self.region.zeropage(off + done, len - done, true) {
                Ok(n) | Err(crate::uffd::CopyError::Partial(n)) => done += n,
                // Present already (a racing install cannot happen: the chunk is ours to
                // fill; but never overwrite data): skip the page.
                Err(crate::uffd::CopyError::Exists) => done += self.region.page_size(),
                Err(crate::uffd::CopyError::EventPending) => return Err(libc::EAGAIN),
                Err(crate::uffd::CopyError::Gone) => return Err(libc::ENOENT),
                Err(crate::uffd::CopyError::Os(e)) => return Err(e),
            }
        }
        self.region.write_protect(off, len, true, false)?;
        let base = self.region.base() + off;
        if self
            .pagemap
            .any_not_zero_page(base, base + len)
            .unwrap_or(true)
        {
            if let Some(mark) = self.mark.get() {
                mark(idx);
            }
        }
        Counters::add(&self.counters.zero_fills, 1);
        self.tr(idx.0, || "zero-filled".to_string());
        let _ = self.region.wake(off, len);
        Ok(())
    }

    /// Ends a push's read of an active chunk (see [`read_for_push`](Self::read_for_push)).
    pub fn unpin(&self, idx: ChunkIdx) {
        let mut st = self.state.lock_yielding();
        if let Some(p) = st.pins.get_mut(idx.0 as usize) {
            *p = p.saturating_sub(1);
        }
    }

    /// The store behind the region (for pushes of chunks that are not local).
    pub fn remote_store(&self) -> Option<Arc<dyn farmap_core::Store>> {
        let cache = self.cache.get().and_then(Weak::upgrade)?;
        Some(cache.remote().clone())
    }

    /// Moves up to `n` victims from the active FIFO to staging; returns how many.
    pub fn deactivate(&self, n: u64) -> u64 {
        self.deactivate_inner(n, true)
    }

    /// [`deactivate`](Self::deactivate); `refresh`: scan for written chunks first (once per
    /// reclaim pass is enough: a scan reads the whole region's page tables).
    ///
    /// Victims are taken a group at a time (at most [`GROUP_BYTES`]), and each run of
    /// consecutive chunks in a group moves with one page-table scan and one `UFFDIO_MOVE`
    /// per run of present pages: the kernel flushes the TLB once per move, not once per
    /// page, and a flush is an interrupt of every CPU the application runs on.
    fn deactivate_inner(&self, n: u64, refresh: bool) -> u64 {
        if n == 0 {
            return 0;
        }
        if refresh {
            self.refresh_referenced();
        }
        let per_group = (GROUP_BYTES / u64::from(self.geometry.chunk_size()).max(1)).max(1);
        let mut st = self.state.lock_yielding();
        let mut done = 0;
        let mut budget = 2 * st.active.len() + 1;
        let mut group: Vec<u64> = Vec::with_capacity(per_group as usize);
        let mut outcomes: Vec<(u64, bool)> = Vec::with_capacity(per_group as usize);
        while done < n && budget > 0 {
            group.clear();
            let want = per_group.min(n - done) as usize;
            // Drop-behind first: what sequential streams left behind goes in runs, whatever
            // its referenced flag says (written during the scan, it would get a second chance
            // and the victims of a group would alternate: a move and a TLB flush each).
            while group.len() < want {
                let Some(i) = st.behind.pop_front() else {
                    break;
                };
                let iu = i as usize;
                if st.chunk[iu] == St::Active && !st.slot_busy[iu] && st.pins[iu] == 0 {
                    st.referenced[iu] = false;
                    st.chunk[iu] = St::Moving;
                    group.push(i);
                    Counters::add(&self.counters.dropped_behind, 1);
                }
            }
            let mut popped = 0;
            while group.len() < want && budget > 0 && popped < SCAN_PER_HOLD {
                budget -= 1;
                popped += 1;
                let Some(i) = st.active.pop_front() else {
                    break;
                };
                let iu = i as usize;
                if st.chunk[iu] != St::Active {
                    continue;
                }
                if st.referenced[iu] || st.slot_busy[iu] || st.pins[iu] > 0 {
                    st.referenced[iu] = false;
                    st.active.push_back(i);
                    continue;
                }
                // Moving from here on (also keeps a chunk from being taken twice).
                st.chunk[iu] = St::Moving;
                group.push(i);
            }
            if group.is_empty() {
                if popped == SCAN_PER_HOLD && budget > 0 {
                    // Second chances only so far: let the faults waiting for the lock in
                    // before scanning on.
                    drop(st);
                    st = self.state.lock_yielding();
                    continue;
                }
                break;
            }
            // The moves run outside the lock (a scattered group is one move, and one TLB
            // flush, per chunk: hundreds of µs that every fault would wait for). Meanwhile
            // the group's chunks are `Moving`: a fault on one of their pages waits for the
            // state change below, and a push waits too.
            // Marked dirty now, before the moves: the pages leave the region's write
            // tracking as they move, and a flush that starts meanwhile must see the chunk
            // (its push waits for the chunk to be staged, then reads the slot). Marked after
            // the move, a flush in between finished without it.
            if let Some(mark) = self.mark.get() {
                for &i in &group {
                    mark(ChunkIdx(i));
                }
            }
            let epoch = st.epoch;
            self.moving.fetch_add(1, Ordering::SeqCst);
            drop(st);
            group.sort_unstable();
            outcomes.clear();
            for run in consecutive_runs(&group) {
                let (off, len) = self.run_span(run);
                let r = self.move_present(&self.region, &self.staging, off, len);
                if r.is_err() {
                    Counters::add(&self.counters.partial_moves, 1);
                }
                for &i in run {
                    self.tr(i, || format!("deactivate {r:?} epoch {epoch}"));
                    let staged = match r {
                        Ok(()) => true,
                        Err(e) => self.undo_deactivation(i, e),
                    };
                    outcomes.push((i, staged));
                }
            }
            self.moved.fetch_add(1, Ordering::SeqCst);
            self.moving.fetch_sub(1, Ordering::SeqCst);
            st = self.state.lock_yielding();
            for &(i, staged) in &outcomes {
                if staged {
                    self.active_to_staged(&mut st, i);
                    self.evict_from_cache(ChunkIdx(i));
                    Counters::add(&self.counters.deactivations, 1);
                    done += 1;
                } else {
                    st.chunk[i as usize] = St::Active;
                    st.referenced[i as usize] = true;
                    st.active.push_back(i);
                }
            }
            // Wakes the faults that found a chunk of the group moving (`Admit::Retry`).
            self.events.bump();
        }
        done
    }

    /// After a move of chunk `i`'s run to staging stopped part way (`e`: a busy page, an
    /// event pending), puts back what moved, so that the chunk is wholly active again.
    /// Returns whether the chunk must count as staged all the same (pages left in its slot:
    /// the undo stopped part way too). The region's holes may carry write-protect markers by
    /// now (a scan): unprotect first, protect after, and mark the chunk dirty (moves drop the
    /// write protection).
    fn undo_deactivation(&self, i: u64, e: i32) -> bool {
        let (off, len) = self.chunk_span(i);
        let _ = self.region.write_protect(off, len, false, false);
        let undone = self.move_present(&self.staging, &self.region, off, len);
        let _ = self.region.write_protect(off, len, true, false);
        let _ = self.region.wake(off, len);
        if let Some(mark) = self.mark.get() {
            mark(ChunkIdx(i));
        }
        match undone {
            Ok(()) => false,
            // Pages left in the slot: the chunk is staged (partly), and its next fault, or a
            // push, finishes the move one way or the other.
            Err(e2) => {
                self.region_counters.error(format!(
                    "moving chunk {i} to staging stopped part way ({}), and so did moving it \
                     back ({})",
                    std::io::Error::from_raw_os_error(e),
                    std::io::Error::from_raw_os_error(e2)
                ));
                true
            }
        }
    }

    /// The state change of a deactivation (the chunk's pages are in its staging slot).
    fn active_to_staged(&self, st: &mut State, i: u64) {
        let iu = i as usize;
        if std::mem::take(&mut st.prefetched[iu]) {
            Counters::add(&self.counters.prefetch_wasted, 1);
        }
        st.chunk[iu] = St::Staged;
        st.slot_busy[iu] = true;
        st.staged_epoch[iu] = st.epoch;
        st.stage_seq += 1;
        let id = st.stage_seq;
        st.stage_id[iu] = id;
        st.n_staged += 1;
        st.staged.push_back((i, id));
    }

    /// Write-protects the chunks moved back in their faulting thread since the last pass, so
    /// that their written bits (the eviction score) mean "written since", and marks each
    /// dirty after protecting it, like [`move_back`](Self::move_back) does: a write that
    /// landed unprotected in between is pushed. A chunk staged again meanwhile has no pages
    /// to protect (at most write-protect markers on its holes, which a move back clears).
    fn protect_moved_back(&self) {
        if !self.unprotected_any.swap(false, Ordering::AcqRel) {
            return;
        }
        for (w, word) in self.unprotected.iter().enumerate() {
            let mut bits = word.swap(0, Ordering::AcqRel);
            while bits != 0 {
                let b = bits.trailing_zeros() as u64;
                bits &= bits - 1;
                let i = w as u64 * 64 + b;
                let (off, len) = self.chunk_span(i);
                let _ = self.region.write_protect(off, len, true, false);
                if let Some(mark) = self.mark.get() {
                    mark(ChunkIdx(i));
                }
            }
        }
    }

    /// Sets the referenced flag of chunks with written pages (a look that changes nothing).
    fn refresh_referenced(&self) {
        self.protect_moved_back();
        let base = self.region.base();
        let shift = self.geometry.chunk_shift();
        let mut hits = Vec::new();
        let mut scratch = Vec::new();
        let _ = self
            .pagemap
            .peek_written(base, base + self.region.len(), &mut scratch, |run| {
                if run.has_data {
                    let first = ((run.start - base) as u64) >> shift;
                    let last = ((run.end - base - 1) as u64) >> shift;
                    hits.extend(first..=last);
                }
            });
        if hits.is_empty() {
            return;
        }
        let mut st = self.state.lock_yielding();
        let mut used = 0;
        for i in hits {
            if let Some(r) = st.referenced.get_mut(i as usize) {
                *r = true;
            }
            if let Some(p) = st.prefetched.get_mut(i as usize) {
                used += u64::from(std::mem::take(p));
            }
        }
        Counters::add(&self.counters.prefetch_hits, used);
    }

    /// Drops up to `n` staged chunks already in the store (oldest first); returns how many.
    fn drop_written_back(&self, n: u64, proactive: bool) -> u64 {
        let mut victims = Vec::new();
        {
            let mut st = self.state.lock_yielding();
            let st = &mut *st;
            let (chunk, staged_epoch, written_back, stage_id) = (
                &mut st.chunk,
                &st.staged_epoch,
                &st.written_back,
                &st.stage_id,
            );
            st.staged.retain(|&(i, id)| {
                let iu = i as usize;
                if chunk[iu] != St::Staged || stage_id[iu] != id {
                    return false;
                }
                if victims.len() as u64 >= n || staged_epoch[iu] >= written_back[iu] {
                    return true;
                }
                // Still resident (slot busy) until its pages are gone.
                chunk[iu] = St::Remote;
                victims.push(i);
                false
            });
            st.n_staged -= victims.len() as u64;
        }
        for group in victims.chunks(self.trash_chunks.max(1)) {
            self.discard_slots(group);
            let mut st = self.state.lock_yielding();
            for &i in group {
                st.slot_busy[i as usize] = false;
            }
            st.resident -= group.len() as u64;
            drop(st);
            self.changed.notify_waiters();
        }
        let n = victims.len() as u64;
        if n > 0 {
            let c = if proactive {
                &self.counters.evictions_proactive
            } else {
                &self.counters.evictions_reactive
            };
            Counters::add(c, n);
        }
        n
    }

    /// Frees the staging slots of `victims` (at most `trash_chunks`; dropped chunks, their
    /// slots busy, so nobody else moves their pages) with one `madvise`: their pages are
    /// moved into the trash area first, so that one system call (and one TLB flush) frees
    /// them all. A slot whose pages cannot be moved is discarded where it is. The staging
    /// area's fd raises no events (see the module docs); the event generation is still
    /// bumped after each discard, which only wakes copies that wait for one anyway.
    fn discard_slots(&self, victims: &[u64]) {
        let chunk = self.geometry.chunk_size() as usize;
        let mut sorted = victims.to_vec();
        sorted.sort_unstable();
        let mut in_trash = 0;
        // Each run of consecutive slots goes with one move (one TLB flush, as in
        // `deactivate_inner`).
        for run in consecutive_runs(&sorted) {
            let (off, len) = self.run_span(run);
            let (first, k) = (run[0], run.len());
            let moved = self.trash.as_ref().map(|trash| {
                self.move_present_to(&self.staging, off, trash, in_trash * chunk, len)
                    .is_ok()
            });
            for &i in run {
                self.tr(i, || {
                    format!("drop (written back), to the trash: {moved:?}")
                });
            }
            if moved.is_some() {
                // The run's trash slots are discarded below, whatever landed in them (a move
                // that stopped part way leaves some pages there).
                in_trash += k;
            }
            if moved == Some(true) {
                continue;
            }
            // What is left in the slots goes where it is. Outside the lock.
            let r = self.staging_map.discard(off, len);
            for &i in run {
                self.tr(i, || format!("discarded {r:?}"));
            }
            if let Some(Err(e)) = r {
                self.region_counters.error(format!(
                    "dropping staged chunks {first}..{}: {e}",
                    first + k as u64
                ));
            }
            self.events.bump();
        }
        if in_trash > 0 {
            let r = self
                .staging_map
                .discard(self.trash_offset, in_trash * chunk);
            if let Some(Err(e)) = r {
                self.region_counters
                    .error(format!("dropping {in_trash} staged chunks: {e}"));
            }
            self.events.bump();
        }
    }

    /// Writes back up to `n` staged chunks not yet in the store (oldest first), and only
    /// them; returns how many were written back. On success each is droppable, unless it was
    /// staged again meanwhile.
    async fn write_back_staged(&self, n: u64) -> StoreResult<u64> {
        let Some(write_back) = self.write_back.get() else {
            return Err(StoreError::new(
                farmap_core::ErrorKind::Closed,
                "the region's pusher is gone",
            ));
        };
        let (victims, started) = {
            let mut st = self.state.lock_yielding();
            let victims: Vec<u64> = st
                .staged
                .iter()
                .copied()
                .filter(|&(i, id)| {
                    let iu = i as usize;
                    st.chunk[iu] == St::Staged
                        && st.stage_id[iu] == id
                        && st.staged_epoch[iu] >= st.written_back[iu]
                })
                .map(|(i, _)| i)
                .take(n as usize)
                .collect();
            if victims.is_empty() {
                return Ok(0);
            }
            st.epoch += 1;
            (victims, st.epoch)
        };
        write_back(victims.iter().copied().map(ChunkIdx).collect()).await?;
        let mut st = self.state.lock_yielding();
        for &i in &victims {
            st.written_back[i as usize] = started;
        }
        let n = victims.len() as u64;
        Counters::add(&self.counters.writebacks, n);
        Ok(n)
    }

    /// Frees chunks until `target_free` are free below the limit (or nothing more can be
    /// freed); returns how many were dropped.
    pub async fn reclaim(&self, target_free: u64, proactive: bool) -> u64 {
        let _one = self.reclaim_lock.lock().await;
        self.reclaim_locked(target_free, proactive).await
    }

    /// [`reclaim`](Self::reclaim), `reclaim_lock` held: drop staged chunks already written
    /// back; stage victims and write back just them, in steps of at most `trash_chunks`
    /// (the chunks one `madvise` drops), so that the first room appears after one step
    /// rather than after the whole pass: faults that wait for room wait for a step.
    async fn reclaim_locked(&self, target_free: u64, proactive: bool) -> u64 {
        let step = (self.trash_chunks as u64).max(1);
        let mut total = 0;
        let mut rounds = 0;
        // Each step either drops what it wrote back or finds nothing more to do; the bound
        // only stops a pass that keeps losing its victims (staged and moved back at once).
        let max_rounds = 2 + 2 * target_free.div_ceil(step);
        let mut refreshed = false;
        loop {
            let (need, staged) = {
                let st = self.state.lock_yielding();
                let free = self.limit().saturating_sub(st.resident);
                (target_free.saturating_sub(free), st.n_staged)
            };
            if need == 0 {
                return total;
            }
            let dropped = self.drop_written_back(need, proactive);
            total += dropped;
            if dropped >= need {
                continue;
            }
            let batch = (need - dropped).max(self.min_free()).min(step).max(1);
            let staged = staged.saturating_sub(dropped);
            if staged < batch {
                self.deactivate_inner(batch - staged, !refreshed);
                refreshed = true;
            }
            if rounds >= max_rounds {
                return total;
            }
            rounds += 1;
            match self.write_back_staged(batch).await {
                Ok(0) => {
                    // Nothing left to write back: drop what can be, and stop.
                    return total + self.drop_written_back(need - dropped, proactive);
                }
                Ok(_) => {
                    if proactive {
                        // The reclaim thread's step ran without sleeping (its write-back
                        // copies out of the staging slots on this thread): give the CPU to
                        // an application thread that woke meanwhile (its fault served), or
                        // it waits out the rest of this thread's time slice (p99.9 of
                        // faulting accesses 1.3 -> 3.2 ms without this).
                        std::thread::yield_now();
                    }
                }
                Err(e) => {
                    self.region_counters.error(format!(
                        "writing staged chunks back before dropping them: {}",
                        farmap_core::error_chain(&e)
                    ));
                    return total;
                }
            }
        }
    }

    /// A fault found the region full: reclaim one chunk (a reactive eviction), or wait a
    /// moment for someone else's.
    ///
    /// While a reclaim pass runs (the reclaim thread's, usually), the fault does not queue
    /// behind it: it waits until the pass frees room (woken at once) or 2 ms pass. Returns
    /// whether room appeared; `false` lets the fault go over the limit (by at most
    /// `min_free`).
    pub async fn make_room(&self) -> bool {
        let notified = self.changed.notified();
        if let Ok(_one) = self.reclaim_lock.try_lock() {
            if self.reclaim_locked(1, false).await > 0 {
                return true;
            }
        }
        tokio::time::timeout(Duration::from_millis(2), notified)
            .await
            .is_ok()
    }

    fn kick(&self) {
        let (m, cv) = &self.kick;
        *m.lock() = true;
        cv.notify_one();
    }

    /// Starts the proactive reclaim thread.
    pub fn spawn_reclaimer(self: &Arc<Self>, rt: Handle) -> std::io::Result<Reclaimer> {
        let pager = self.clone();
        let thread = std::thread::Builder::new()
            .name("farmap-uffd-reclaim".into())
            .spawn(move || pager.reclaim_loop(&rt))?;
        Ok(Reclaimer {
            pager: self.clone(),
            thread: Some(thread),
        })
    }

    fn reclaim_loop(&self, rt: &Handle) {
        while !self.stop.load(Ordering::Acquire) {
            {
                let (m, cv) = &self.kick;
                let mut kicked = m.lock();
                if !*kicked {
                    cv.wait_for(&mut kicked, Duration::from_millis(5));
                }
                *kicked = false;
            }
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            let short = {
                let st = self.state.lock_yielding();
                self.limit().saturating_sub(st.resident) < self.low_water()
            };
            if short {
                rt.block_on(self.reclaim(self.min_free(), true));
            }
        }
    }
}

/// Bytes of trash after a region of `geometry`'s staging slots: 64 chunks (address space
/// only, `MAP_NORESERVE`; pages pass through it on their way out).
pub(crate) fn trash_len(geometry: Geometry) -> usize {
    64 * geometry.chunk_size() as usize
}

fn auto_min_free(limit: u64) -> u64 {
    (limit / 32).max(1)
}

impl fmt::Debug for Pager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (resident, staged) = self.resident();
        f.debug_struct("Pager")
            .field("limit", &self.limit())
            .field("resident", &resident)
            .field("staged", &staged)
            .finish()
    }
}

/// The proactive reclaim thread; stopped (and joined) on drop.
pub(crate) struct Reclaimer {
    pager: Arc<Pager>,
    thread: Option<JoinHandle<()>>,
}

impl Reclaimer {
    pub fn stop(&mut self) {
        self.pager.stop.store(true, Ordering::Release);
        self.pager.kick();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Reclaimer {
    fn drop(&mut self) {
        self.stop();
    }
}

impl PushReads for Pager {
    fn read_for_push(&self, idx: ChunkIdx, buf: &mut [u8]) -> PushRead {
        Pager::read_for_push(self, idx, buf)
    }

    fn unpin(&self, idx: ChunkIdx) {
        Pager::unpin(self, idx)
    }

    fn remote_store(&self) -> Option<Arc<dyn farmap_core::Store>> {
        Pager::remote_store(self)
    }

    fn trace_install(&self, idx: ChunkIdx, copied_pages: usize, present_pages: usize) {
        Pager::trace_install(self, idx, copied_pages, present_pages)
    }
}

#[cfg(test)]
mod tests {
    use super::consecutive_runs;

    #[test]
    fn runs_of_consecutive_chunks() {
        let runs: Vec<&[u64]> = consecutive_runs(&[1, 2, 3, 5, 7, 8, 10]).collect();
        assert_eq!(runs, [&[1, 2, 3][..], &[5], &[7, 8], &[10]]);
        assert_eq!(consecutive_runs(&[]).count(), 0);
        assert_eq!(consecutive_runs(&[4]).collect::<Vec<_>>(), [&[4][..]]);
    }
}
