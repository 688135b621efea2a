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
//! - *unstaging*: staged, and a fault is copying its slot back into the region (see *Staged
//!   refaults by copy* below).
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
//! Resident = active + staged + stale slots (+ fetches in flight + slots being dropped). A
//! fault admits a
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
//! For a program's region (`farmap run`), whose moves and discards its reaper thread issues
//! (a socket round trip each, two context switches on a CPU the program shares), a group's
//! moves go to the reaper together, and so do a reclaim step's discards: the slots are
//! discarded where they are, without the trash (moving them there would cost a scan and a
//! move per run). `farmap bench run --program redis --workload ycsb-b --local 30% --records
//! 50000 --operations 100000 --system farmap`, release, alternating builds, 2 runs each on
//! 2026-11-30: 6,633 and 5,438 → 8,576 and 8,254 ops/s.
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

//! # Staged refaults by copy
//! When this process cannot move pages (a program's region, whose moves go through its
//! reaper: a socket round trip, docs/design/foreign-region.md §1.3), a fault on a staged
//! chunk copies it back instead. Under the state lock the chunk becomes *unstaging* and
//! takes one more unit of the limit (at the limit the fault reclaims first, as for a fetch);
//! outside it, the slot is read ([`Area::read`]) and installed with `UFFDIO_COPY|WP`
//! (present pages of the region, left by a move that stopped part way, are skipped); then
//! the chunk is active, marked dirty, and its slot *stale*: still busy, so that nothing
//! moves into it, and dropped by the next reclaim without a write-back (the region holds
//! the newest copy). Its extra unit is freed then. A push of an unstaging chunk waits (the
//! newest content is in the slot, not in the store); a failed copy puts the chunk back as it
//! was and wakes the faulting thread, which faults again. `FARMAP_PAGER_REFAULT=copy`
//! (read once, when the pager is made) makes a pager of this process's region copy too,
//! for the tests.
//!
//! # Removed pages read as zeros ([`RemoveMeans::Zero`])
//! For a program's heap, pages it discards (`madvise(MADV_DONTNEED)`) must read as zeros
//! afterwards, not as the store's copy. The reader calls [`Pager::removed`] for each remove
//! event, under the events' order (held exclusively from its read of the event), before the
//! event generation moves on: every chunk of the range becomes *zero* (an active one frees
//! its unit; a staged one's slot goes stale), is marked dirty, so that its next push writes
//! zeros, and gets its *removed* bit. A chunk with an operation in flight (fetching,
//! unstaging, moving) keeps its state, and the operation ends in the zero state.
//!
//! The kernel raises `mmap_changing` before it queues the event (copies and moves into the
//! region fail with `EAGAIN` meanwhile), drops it once the event is read, and zaps the range
//! after that: after our read, and maybe before or after our handling. A copy issued between
//! our read of the event and our handling of it, or after the zap, would bring the old
//! content back. So each copy into the region (a fetch's, a copy back's) and each move that
//! undoes a deactivation takes the events' order shared and checks the bit first (the
//! *gate*): a chunk removed meanwhile gets nothing installed, and its faulting threads fault
//! again. Zero fills pass it too: zeros are right either way, but a fault task that asks the
//! pager again (after waiting for room) can find a page zapped before the event is handled
//! and fill it, and that chunk would then be made zero with a page mapped that no zap will
//! ever take away. (Staged chunks come back by copy in this mode: a move back runs under
//! the state lock, which cannot wait for the events' order.) The bit also says that the zap
//! may be pending: prefetch leaves the chunk alone, and a fault on it that finds its page
//! present just wakes the thread (an access racing the discard, which may see the old
//! content); a fault on a missing page clears it. What was installed may be zapped after
//! it: a finished fetch wakes the chunk's range (threads that faulted meanwhile were told it
//! would), and an active chunk whose page is missing is filled again, never fetched.
//!
//! A scan for written pages can miss a write whose page was zapped under it before the
//! remove was handled (and the chunk marked): in this mode the tracker's scans wait for the
//! events read so far to be handled ([`Events::settle`]). Needs chunks of one page.
//! `FARMAP_PAGER_REMOVE=zero` (read once, for regions of one-page chunks) sets it for a
//! region of this process, for the tests.
//!
//! # Eviction policy
//! RackMem keeps an active FIFO with a recency score. With no accessed bits from userspace
//! on this kernel, the score here is a referenced flag per chunk, set (a) when the chunk
//! becomes active (its fault: fetch or move back) and (b) when a non-destructive
//! `PAGEMAP_SCAN` (which takes nothing from the write tracking) finds written pages in it;
//! the scan runs at most once per reclaim pass and every 20 ms (it reads the page tables of
//! the whole region, and passes come hundreds of times a second under a tight limit; a
//! deactivation asked for directly always scans). Victims are picked from the FIFO's head with a
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
//!
//! # Files
//! One concept a file. `state.rs` (the chunk states, in one [`State`]), `lock.rs` (the
//! [`SleepLock`] around it) and `stream.rs` (a thread's sequential [`Stream`]) know nothing
//! of the pager. This file has the [`Pager`], its limits and what it tells the region. The
//! others add the pager's methods, each using only this file and the ones listed before it:
//! - `trace.rs`: the per-chunk trace (`FARMAP_PAGER_TRACE`, for the tests' diagnostics);
//! - `moves.rs`: moving pages between the region and the staging area, run by run;
//! - `remove.rs`: remove events that mean zeros, and the gate of copies into the region;
//! - `fault.rs`: a fault's admission, the end of its fetch, zero fills, moves back (in the
//!   reader or in the faulting thread);
//! - `copy.rs`: staged refaults by copy, stale slots;
//! - `push.rs`: where a push reads a chunk;
//! - `prefetch.rs`: sequential prefetch after a fault;
//! - `deactivate.rs`: active → staged, the eviction policy's victims;
//! - `reclaim.rs`: write-back and drop of staged chunks, room for faults, the reclaim thread;
//! - `fork.rs`: the fork fence (nothing moves while a program forks) and where each chunk's
//!   content is under it.

mod copy;
mod deactivate;
mod fault;
mod fork;
mod lock;
mod moves;
mod prefetch;
mod push;
mod reclaim;
mod remove;
mod state;
mod stream;
#[cfg(test)]
mod testing;
mod trace;

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::thread::JoinHandle;

use farmap_core::{ChunkIdx, Geometry, StoreResult};
use parking_lot::{Condvar, Mutex};
use tokio::sync::Notify;

use crate::memory::{Events, RegionCache};
use crate::options::{Prefetch, RemoveMeans};
use crate::pagemap::Pagemap;
use crate::space::{Area, Moves};
use crate::stats::Counters;
use crate::uffd::UffdRange;
use lock::SleepLock;
pub(crate) use state::{ForkSnapshot, Source};
use state::{St, State};
use stream::Stream;

/// Writes back the given chunks through the region's pusher, ordered with its rounds and
/// flushes ([`farmap_pipeline::Pusher::write_back`]; set once the pusher exists).
pub(crate) type WriteBackFn =
    Box<dyn Fn(Vec<ChunkIdx>) -> farmap_core::BoxFuture<'static, StoreResult<()>> + Send + Sync>;
/// Marks a chunk dirty in the region's pusher.
pub(crate) type MarkFn = Box<dyn Fn(ChunkIdx) + Send + Sync>;

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
    /// The chunk is staged and marked unstaging: copy its slot into the region
    /// ([`Pager::copy_back`], outside the lock).
    FromSlot,
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
    pub full_faults: AtomicU64,
    pub partial_moves: AtomicU64,
    pub pushes_from_store: AtomicU64,
    pub zero_fills: AtomicU64,
    pub prefetched: AtomicU64,
    pub prefetch_hits: AtomicU64,
    pub prefetch_wasted: AtomicU64,
    pub dropped_behind: AtomicU64,
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
    staging_map: Area,
    /// Who moves the pages (this process, for a region of its own).
    moves: Moves,
    /// Staged chunks come back by copy, not by a move (see the module docs).
    copy_refault: bool,
    /// What a remove event makes of a chunk.
    remove: RemoveMeans,
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
    /// Serializes reclaim passes (one write-back at a time); a fork fence holds it.
    reclaim_lock: Arc<tokio::sync::Mutex<()>>,
    /// A fork fence holds ([`ForkFence`]): deactivations do nothing.
    paused: AtomicBool,
    /// The fork fence that holds now, if any.
    fence: Mutex<Weak<ForkFence>>,
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
    /// When the pager was made, and µs after that (+1) of the last scan for written chunks
    /// (0: none yet).
    born: std::time::Instant,
    refreshed_at: AtomicU64,
    pub(crate) counters: PagingCounters,
    region_counters: Arc<Counters>,
    trace: Option<Mutex<Vec<(u64, String)>>>,
}

/// What a [`Pager`] is made of.
pub(crate) struct PagerParts {
    /// The region, on its userfaultfd.
    pub region: UffdRange,
    /// The staging slots (as large as the region), on the quiet userfaultfd.
    pub staging: UffdRange,
    /// The whole staging area: the slots, then the trash (see [`trash_len`]).
    pub staging_map: Area,
    /// Who moves pages between the region and the staging area.
    pub moves: Moves,
    pub events: Arc<Events>,
    pub geometry: Geometry,
    /// The limit, in chunks (at least 1).
    pub limit: u64,
    /// Chunks kept free by proactive reclaim; `None`: a share of the limit.
    pub min_free: Option<u64>,
    /// A fresh region: its chunks were never written (zero, not remote).
    pub fresh: bool,
    pub prefetch: Prefetch,
    pub region_counters: Arc<Counters>,
    /// The page tables of the region's process.
    pub pagemap: Pagemap,
    /// What a remove event makes of a chunk ([`RemoveMeans::Zero`]: one-page chunks only).
    pub remove: RemoveMeans,
}

impl Pager {
    pub(crate) fn new(p: PagerParts) -> Pager {
        let n = p.geometry.chunk_count() as usize;
        let remove = remove_means(p.remove, &p.geometry, p.region.page_size());
        if remove == RemoveMeans::Zero {
            p.events.removes_mark();
        }
        let limit = p.limit.max(1);
        // The staging mapping's tail past the slots (see `trash_len`) is the trash.
        let trash_offset = p.staging.len();
        let trash_len = p.staging_map.len().saturating_sub(trash_offset);
        let trash_chunks = trash_len / p.geometry.chunk_size() as usize;
        let trash = (trash_chunks > 0).then(|| {
            UffdRange::new(
                p.staging.uffd().clone(),
                p.staging.base() + trash_offset,
                trash_len,
            )
        });
        Pager {
            region: p.region,
            staging: p.staging,
            trash,
            trash_offset,
            trash_chunks,
            events: p.events,
            staging_map: p.staging_map,
            // Moves back are not gated for removes (they run under the state lock, which
            // the reader takes inside the events' order): zero mode copies.
            copy_refault: !p.moves.in_process()
                || remove == RemoveMeans::Zero
                || std::env::var_os("FARMAP_PAGER_REFAULT").is_some_and(|v| v == "copy"),
            moves: p.moves,
            geometry: p.geometry,
            pagemap: p.pagemap,
            state: SleepLock::new(State::new(n, p.fresh, remove == RemoveMeans::Zero)),
            remove,
            limit: AtomicU64::new(limit),
            min_free: AtomicU64::new(p.min_free.unwrap_or_else(|| auto_min_free(limit))),
            min_free_auto: p.min_free.is_none(),
            prefetch: p.prefetch,
            streams: Mutex::new(HashMap::new()),
            cache: OnceLock::new(),
            write_back: OnceLock::new(),
            mark: OnceLock::new(),
            reclaim_lock: Arc::new(tokio::sync::Mutex::new(())),
            paused: AtomicBool::new(false),
            fence: Mutex::new(Weak::new()),
            changed: Notify::new(),
            kick: (Mutex::new(false), Condvar::new()),
            stop: AtomicBool::new(false),
            moving: AtomicU64::new(0),
            moved: AtomicU64::new(0),
            unprotected: (0..n.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            unprotected_any: AtomicBool::new(false),
            born: std::time::Instant::now(),
            refreshed_at: AtomicU64::new(0),
            counters: PagingCounters::default(),
            region_counters: p.region_counters,
            trace: std::env::var_os("FARMAP_PAGER_TRACE").map(|_| Mutex::new(Vec::new())),
        }
    }

    /// Connects the cache and the pusher (made after the pager).
    pub(crate) fn connect(&self, cache: Weak<RegionCache>, write_back: WriteBackFn, mark: MarkFn) {
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

    /// The limit, in chunks.
    pub(crate) fn limit(&self) -> u64 {
        self.limit.load(Ordering::Relaxed)
    }

    /// Chunks kept free by proactive reclaim.
    pub(crate) fn min_free(&self) -> u64 {
        self.min_free.load(Ordering::Relaxed)
    }

    /// The free chunks below which the reclaim thread starts a pass (which frees up to
    /// `min_free`): half of `min_free`, so that a pass drops batches of chunks, one write-back
    /// and one `madvise` each, rather than one chunk each time a fault takes one.
    fn low_water(&self) -> u64 {
        self.min_free().div_ceil(2)
    }

    /// Changes the limit (in chunks, at least 1); reclaim brings resident memory under it.
    pub(crate) fn set_limit(&self, chunks: u64) {
        let chunks = chunks.clamp(1, self.geometry.chunk_count().max(1));
        self.limit.store(chunks, Ordering::Relaxed);
        if self.min_free_auto {
            self.min_free
                .store(auto_min_free(chunks), Ordering::Relaxed);
        }
        self.changed.notify_waiters();
        self.kick();
    }

    /// Pages present in the region and in the staging area (slots and trash) now, from the
    /// page tables. A page moving between two of the scans could be counted twice: the
    /// scans run under the state lock (which the moves back and a push's moves take) while
    /// no deactivation moves pages (it moves outside the lock; the count is taken again if
    /// one ran meanwhile, up to a few times). The other moves go from the staging slots to
    /// the trash, scanned first: a page moving meanwhile is missed, never counted twice.
    pub(crate) fn local_pages(&self) -> std::io::Result<(u64, u64)> {
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
    pub(crate) fn resident(&self) -> (u64, u64) {
        let st = self.state.lock();
        (st.resident, st.n_staged)
    }

    /// Mapped chunks whose referenced flag is set now: touched (faulted in, moved back,
    /// found written) since the clock hand last passed them, the pager's view of the
    /// working set (there is no accessed bit to read here). The flags are counted in
    /// blocks, the state lock taken once per block: faults wait for one block at most, and
    /// the count is not a snapshot of one instant.
    pub(crate) fn referenced_chunks(&self) -> u64 {
        const BLOCK: usize = 16 * 1024;
        let n = self.geometry.chunk_count() as usize;
        let mut count = 0u64;
        let mut start = 0;
        while start < n {
            let end = (start + BLOCK).min(n);
            let st = self.state.lock();
            count += (start..end)
                .filter(|&i| st.referenced[i] && st.chunk[i] == St::Active)
                .count() as u64;
            drop(st);
            start = end;
        }
        count
    }

    fn evict_from_cache(&self, idx: ChunkIdx) {
        if let Some(cache) = self.cache.get().and_then(Weak::upgrade) {
            cache.evict(idx);
        }
    }

    fn kick(&self) {
        let (m, cv) = &self.kick;
        *m.lock() = true;
        cv.notify_one();
    }

    /// Ends the pager's work: the reclaim thread returns, and fault tasks that wait for
    /// room or for an event give up ([`stopped`](Self::stopped)). For a program's region
    /// whose session ended (nothing else drops those tasks on a runtime shared by
    /// sessions); a local region's pager stops as its region drops.
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.kick();
        self.changed.notify_waiters();
    }

    /// Whether [`stop`](Self::stop) was called.
    pub(crate) fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }
}

/// A pause of the pager's data movement while a program forks (see `fork.rs`); ends when the
/// last clone is dropped.
pub(crate) struct ForkFence {
    pager: Arc<Pager>,
    _reclaim: tokio::sync::OwnedMutexGuard<()>,
}

impl Drop for ForkFence {
    fn drop(&mut self) {
        self.pager.paused.store(false, Ordering::SeqCst);
        self.pager.kick();
        self.pager.changed.notify_waiters();
    }
}

/// Bytes of trash after a region of `geometry`'s staging slots: 64 chunks (address space
/// only, `MAP_NORESERVE`; pages pass through it on their way out).
pub(crate) fn trash_len(geometry: Geometry) -> usize {
    64 * geometry.chunk_size() as usize
}

/// What a remove event makes of a chunk: `asked`, or zeros when `FARMAP_PAGER_REMOVE=zero`
/// and the chunks are one page (the tests' switch).
///
/// # Panics
/// If zeros are asked for chunks larger than a page.
fn remove_means(asked: RemoveMeans, geometry: &Geometry, page: usize) -> RemoveMeans {
    let one_page = geometry.chunk_size() as usize == page;
    assert!(
        asked == RemoveMeans::Refetch || one_page,
        "removed chunks read as zeros only with chunks of one page"
    );
    let switch = std::env::var_os("FARMAP_PAGER_REMOVE").is_some_and(|v| v == "zero");
    if switch && one_page {
        RemoveMeans::Zero
    } else {
        asked
    }
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
    pub(crate) fn stop(&mut self) {
        self.pager.stop();
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
