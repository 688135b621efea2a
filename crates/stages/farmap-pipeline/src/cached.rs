//! [`Cached`]: a local store in front of a remote one, with a per-chunk presence map and an
//! optional bound on the chunks held locally; and [`Fill`], what a
//! [`Puller`](crate::puller::Puller) fills.

use std::collections::VecDeque;
use std::fmt;
use std::pin::pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use farmap_core::{
    BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, Store, StoreError,
    StoreResult,
};
use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::dirty::DirtySet;
use crate::pusher::PushHold;

/// Something a [`Puller`](crate::puller::Puller) can fill chunk by chunk: a [`Cached`] store,
/// or a userfaultfd region whose pages are fetched on demand.
pub trait Fill: Send + Sync + 'static {
    /// The shape of the region.
    fn geometry(&self) -> Geometry;

    /// Whether chunk `idx` is already there (a cheap check: the puller asks before fetching).
    fn is_present(&self, idx: ChunkIdx) -> bool;

    /// Makes chunk `idx` present, fetching it if nobody else is; returns once it is present
    /// (or the fetch failed).
    fn fetch(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<()>>;

    /// Most chunks [`fetch_run`](Fill::fetch_run) fetches in one request (1: no gain in
    /// asking for runs).
    fn chunks_per_fetch(&self) -> u32 {
        1
    }

    /// Makes chunk `first` present and, in the same request, as many of the chunks after it
    /// (up to `max` in all) as are absent and nobody fetches: how many chunks from `first`
    /// on it made present (at least 1). The default fetches `first` alone.
    fn fetch_run(&self, first: ChunkIdx, max: u64) -> BoxFuture<'_, StoreResult<u64>> {
        let _ = max;
        Box::pin(async move { self.fetch(first).await.map(|()| 1) })
    }
}

// Per-chunk state word. The low two bits are the state: Busy means one task owns the chunk
// (fetching it, writing or trimming it while it was absent, or evicting it); BusyWaited is
// Busy with at least one task waiting, so that the owner wakes waiters only when there are
// some. A bounded cache also keeps, in a present chunk's word, a referenced bit and a count
// of pins (operations on the local copy in progress, which an eviction must not pull the
// chunk from under). An unbounded cache never sets them: its words are exactly the states.
const ABSENT: u32 = 0;
const BUSY: u32 = 1;
const BUSY_WAITED: u32 = 2;
const PRESENT: u32 = 3;
const STATE_MASK: u32 = 0b11;
/// Set by every pinned access; an eviction pass clears it and passes the chunk over once
/// (second chance).
const REFERENCED: u32 = 0b100;
/// One pin.
const PIN: u32 = 0b1000;

fn state_of(word: u32) -> u32 {
    word & STATE_MASK
}

/// Most wake-up stripes: waiters on chunks that share a stripe wake each other (and go back
/// to sleep), which is harmless and rare with this many.
const MAX_STRIPES: usize = 1024;

/// Longest an eviction that found every present chunk pinned or busy waits before it looks
/// again; it is woken earlier by an unpin, a release or a slot given back (this fallback
/// only covers a wake-up lost between its look and its wait).
const EVICT_RETRY_PAUSE: Duration = Duration::from_millis(1);

/// The bookkeeping of a bounded cache.
struct Bound {
    /// Most chunks held locally.
    max: u64,
    /// Chunks present plus chunks being made present (a slot is reserved before a fetch or a
    /// write of an absent chunk starts, and given back if it does not end present).
    resident: AtomicU64,
    /// Chunks whose local copy may differ from the remote (written or trimmed locally since
    /// they were last written back by an eviction). Marked while the writer still pins the
    /// chunk, so an eviction (which needs no pins) always sees it.
    modified: DirtySet,
    /// Present chunks in the order they became present: the eviction clock.
    clock: Mutex<VecDeque<ChunkIdx>>,
    evicted: AtomicU64,
    written_back: AtomicU64,
    /// Evictions waiting for a chunk to become evictable or a slot to come free, and their
    /// wake-up.
    waiting: AtomicU64,
    room: Notify,
}

impl Bound {
    fn wake_evictors(&self) {
        if self.waiting.load(Ordering::SeqCst) > 0 {
            self.room.notify_waiters();
        }
    }
}

/// What a bounded [`Cached`] store's evictions have done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EvictStats {
    /// Most chunks held locally.
    pub max_chunks: u64,
    /// Chunks dropped from the local store.
    pub evicted_chunks: u64,
    /// Of those, chunks written to the remote first (they had local changes).
    pub written_back_chunks: u64,
}

/// A local store (memory, file, directory) in front of a remote store, with a presence map:
/// chunks are fetched from the remote on first touch and served locally afterwards.
///
/// - A read of a present chunk reads the local store (the presence check is one atomic load).
/// - A read of an absent chunk fetches it: reads the remote, writes the local, marks it
///   present, and returns the data.
/// - A write goes **only** to the local store, and makes the chunk present without fetching
///   it (the write replaces the chunk whole). Writing back to the remote is the job of a
///   [`Pusher`](crate::pusher::Pusher) stacked above this stage.
/// - A trim trims the local store and marks the chunks present (as zeros). The remote is not
///   trimmed: like a write, a trim is a local change; a `Pusher` above this stage tracks it
///   and writes the zero chunks back. Trimming the remote here instead would make it
///   disagree with data not yet pushed, and would bypass the `Pusher`'s ordering.
/// - `status` asks the local store for present chunks, the remote for the others; `flush`
///   flushes the local store only.
///
/// # Bounded ([`Cached::bounded`])
/// At most `max_chunks` chunks are present at any moment. A fetch or a write of an absent
/// chunk first reserves a slot; when none is free it evicts a present chunk: one with local
/// changes is written to the remote first (read locally, written remotely, while the chunk
/// is Busy so nothing changes it meanwhile), then its local copy is trimmed (a sparse memory
/// store frees it) and it becomes absent; its next read fetches it again. Nothing written is
/// lost: an eviction whose write-back fails puts the chunk back, present and modified, and
/// the operation that wanted the slot gets the error.
///
/// - Order: a clock (second chance) over the chunks in the order they became present. A
///   chunk accessed since the clock hand last passed it is passed over once. This
///   approximates least-recently-used at no cost on the hot path: the referenced bit is set
///   by the same atomic operation that pins the chunk for the access.
/// - Trims do not fill the cache: a trimmed chunk that is absent stays absent and is zeroed
///   in the remote at once (trimmed there when it can trim, written with zeros otherwise),
///   while the chunk is Busy.
/// - A [`Pusher`](crate::pusher::Pusher) above a bounded cache must hold each chunk while it
///   pushes it ([`Pusher::with_hold`](crate::pusher::Pusher::with_hold) with this store), so
///   that an eviction cannot write back newer data under a push of older data; an absent
///   chunk needs no push (its eviction wrote it back).
/// - `evict` (for a local copy lost behind the cache's back) is not for bounded caches.
///
/// # Concurrency
/// - Each chunk is Absent, Busy or Present. Absent→Busy is a compare-and-swap: exactly one
///   task fetches a chunk however many miss it at once; the others wait for it.
/// - Waiters sleep on one of up to 1024 striped [`Notify`]s and register before re-checking
///   the state, so no wake-up is lost; nobody spins.
/// - A fetch never overwrites a newer write: a write to a Busy chunk waits for the fetch to
///   finish and then writes over it. A write to an Absent chunk takes the chunk Busy itself,
///   so a fetch cannot start under it.
/// - A failed (or cancelled) fetch returns the chunk to Absent and wakes the waiters, who
///   retry as fetchers; the error goes to the task that fetched.
/// - Unbounded, Present is final unless [`evict`](Cached::evict)ed: once present, a chunk is
///   read and written locally with no lock, and concurrent writes to it are ordered by the
///   local store. Bounded, an access to a present chunk pins it (one compare-and-swap on
///   its state word, unpinned when the local operation ends); an eviction takes only an
///   unpinned chunk (Present→Busy), so no local operation runs under an eviction.
/// - Trims take every absent chunk of their range Busy in ascending order (bounded: and pin
///   the present ones); fetchers and writers never wait while holding a chunk Busy, and
///   evictions never wait for a pin, so this cannot deadlock.
pub struct Cached<L, R> {
    local: L,
    remote: R,
    geometry: Geometry,
    state: Box<[AtomicU32]>,
    present: AtomicU64,
    stripes: Box<[Notify]>,
    bound: Option<Bound>,
}

impl<L: Store, R: Store> Cached<L, R> {
    /// A cache of `remote` kept in `local`, with every chunk absent. The geometries must be
    /// equal. Whatever `local` holds now is ignored and overwritten as chunks are fetched.
    pub fn new(local: L, remote: R) -> StoreResult<Self> {
        Self::build(local, remote, None)
    }

    /// Like [`new`](Self::new), holding at most `max_chunks` chunks locally (see the type's
    /// docs); `max_chunks` must be at least 1.
    pub fn bounded(local: L, remote: R, max_chunks: u64) -> StoreResult<Self> {
        if max_chunks == 0 {
            return Err(StoreError::invalid(
                "a bounded cache must hold at least one chunk",
            ));
        }
        Self::build(local, remote, Some(max_chunks))
    }

    fn build(local: L, remote: R, max_chunks: Option<u64>) -> StoreResult<Self> {
        let geometry = crate::same_geometry(&local, &remote, "a cache")?;
        let chunks = geometry.chunk_count() as usize;
        let stripes = chunks.next_power_of_two().min(MAX_STRIPES);
        Ok(Self {
            local,
            remote,
            geometry,
            state: (0..chunks).map(|_| AtomicU32::new(ABSENT)).collect(),
            present: AtomicU64::new(0),
            stripes: (0..stripes).map(|_| Notify::new()).collect(),
            bound: max_chunks.map(|max| Bound {
                max,
                resident: AtomicU64::new(0),
                modified: DirtySet::new(geometry.chunk_count()),
                clock: Mutex::new(VecDeque::new()),
                evicted: AtomicU64::new(0),
                written_back: AtomicU64::new(0),
                waiting: AtomicU64::new(0),
                room: Notify::new(),
            }),
        })
    }

    /// The shape of the region (inherent, so that callers with both [`Store`] and [`Fill`] in
    /// scope need not say which).
    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    /// The local store.
    pub fn local(&self) -> &L {
        &self.local
    }

    /// The remote store.
    pub fn remote(&self) -> &R {
        &self.remote
    }

    /// Whether chunk `idx` is present locally (false for an index outside the region).
    pub fn is_present(&self, idx: ChunkIdx) -> bool {
        self.state
            .get(idx.as_usize())
            .is_some_and(|s| state_of(s.load(Ordering::Acquire)) == PRESENT)
    }

    /// Number of chunks present locally.
    pub fn present_count(&self) -> u64 {
        self.present.load(Ordering::Acquire)
    }

    /// Whether every chunk is present (the remote is no longer needed for reads).
    pub fn is_complete(&self) -> bool {
        self.present_count() == self.geometry.chunk_count()
    }

    /// The bound and what evictions did (`None` for an unbounded cache).
    pub fn evict_stats(&self) -> Option<EvictStats> {
        self.bound.as_ref().map(|b| EvictStats {
            max_chunks: b.max,
            evicted_chunks: b.evicted.load(Ordering::Relaxed),
            written_back_chunks: b.written_back.load(Ordering::Relaxed),
        })
    }

    /// Returns present chunk `idx` to absent, so that its next read or fetch fetches it from
    /// the remote again; returns whether it was present (false for a chunk absent, being
    /// fetched, or outside the region). For a local store that lost a chunk behind the
    /// cache's back: a userfaultfd region whose pages the application discarded. Always
    /// false for a bounded cache (whose evictions are its own).
    ///
    /// A read or write of the chunk that is already past its presence check completes
    /// against the local store.
    pub fn evict(&self, idx: ChunkIdx) -> bool {
        if self.bound.is_some() {
            return false;
        }
        let Some(st) = self.state.get(idx.as_usize()) else {
            return false;
        };
        let evicted = st
            .compare_exchange(PRESENT, ABSENT, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if evicted {
            self.present.fetch_sub(1, Ordering::AcqRel);
        }
        evicted
    }

    /// Makes chunk `idx` present: returns at once if it is, waits if another task fetches it,
    /// fetches it otherwise.
    pub async fn fetch(&self, idx: ChunkIdx) -> StoreResult<()> {
        self.geometry.check_idx(idx)?;
        if self.is_present(idx) {
            return Ok(());
        }
        self.ensure(idx).await.map(|_| ())
    }

    /// Makes chunk `first` present and, in one read of the remote, the absent chunks right
    /// after it that nobody holds (up to `max` chunks in all): how many it made present.
    /// A bounded cache fetches `first` alone (each chunk needs its slot).
    pub async fn fetch_run(&self, first: ChunkIdx, max: u64) -> StoreResult<u64> {
        self.geometry.check_idx(first)?;
        let end = first
            .0
            .saturating_add(max.max(1))
            .min(self.geometry.chunk_count());
        if self.bound.is_some() || end - first.0 == 1 {
            return self.fetch(first).await.map(|()| 1);
        }
        let mut claims = Vec::new();
        for at in first.0..end {
            let st = &self.state[at as usize];
            if st
                .compare_exchange(ABSENT, BUSY, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                break;
            }
            claims.push(Claim {
                cached: self,
                idx: ChunkIdx(at),
                armed: true,
                slot: false,
            });
        }
        if claims.is_empty() {
            // Present, or another task holds it: wait for that as a single fetch does.
            return self.fetch(first).await.map(|()| 1);
        }
        let range = ChunkRange::new(first, ChunkIdx(first.0 + claims.len() as u64));
        // On an error (or if this future is dropped), the claims left return their chunks
        // to Absent.
        let data = self.remote.read_chunks(range).await.map_err(|e| {
            StoreError::new(
                e.kind(),
                format!(
                    "fetching chunks {}..{} from the remote store",
                    range.start.0, range.end.0
                ),
            )
            .with_source(e)
        })?;
        if data.len() != claims.len() {
            return Err(StoreError::new(
                ErrorKind::Corrupt,
                format!(
                    "the remote store answered a read of {} chunks with {}",
                    claims.len(),
                    data.len()
                ),
            ));
        }
        let n = claims.len() as u64;
        for (claim, data) in claims.into_iter().zip(data) {
            let idx = claim.idx;
            self.local.write(idx, data).await.map_err(|e| {
                StoreError::new(e.kind(), format!("storing fetched {idx} locally")).with_source(e)
            })?;
            claim.release(PRESENT);
        }
        Ok(n)
    }

    fn stripe(&self, idx: ChunkIdx) -> &Notify {
        &self.stripes[idx.as_usize() & (self.stripes.len() - 1)]
    }

    /// Pins present chunk `idx` (bounded caches only): `None` if it is not present.
    fn try_pin(&self, idx: ChunkIdx) -> Option<Pinned<'_, L, R>> {
        let st = self.state.get(idx.as_usize())?;
        let mut word = st.load(Ordering::Acquire);
        loop {
            if state_of(word) != PRESENT {
                return None;
            }
            match st.compare_exchange_weak(
                word,
                (word + PIN) | REFERENCED,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(Pinned { cached: self, idx }),
                Err(now) => word = now,
            }
        }
    }

    /// Takes chunk `idx` Busy if it is absent (waiting while another task holds it Busy);
    /// `None` if it is present. With `slot` (bounded caches), a slot is reserved first (the
    /// chunk will be present) and the claim gives it back unless released Present. `idx`
    /// must be in range.
    async fn claim(&self, idx: ChunkIdx, slot: bool) -> StoreResult<Option<Claim<'_, L, R>>> {
        let st = &self.state[idx.as_usize()];
        let slot = slot && self.bound.is_some();
        loop {
            match state_of(st.load(Ordering::Acquire)) {
                PRESENT => return Ok(None),
                ABSENT => {
                    if slot {
                        self.reserve().await?;
                    }
                    if st
                        .compare_exchange(ABSENT, BUSY, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                    {
                        return Ok(Some(Claim {
                            cached: self,
                            idx,
                            armed: true,
                            slot,
                        }));
                    }
                    if slot {
                        self.unreserve();
                    }
                }
                _ => self.wait_while_busy(idx).await,
            }
        }
    }

    /// Sleeps until chunk `idx` is (probably) no longer Busy; the caller re-checks.
    async fn wait_while_busy(&self, idx: ChunkIdx) {
        let st = &self.state[idx.as_usize()];
        let mut notified = pin!(self.stripe(idx).notified());
        // Register first: a release after this point wakes us even before we poll.
        notified.as_mut().enable();
        loop {
            match st.load(Ordering::Acquire) {
                BUSY_WAITED => break,
                BUSY => {
                    if st
                        .compare_exchange(BUSY, BUSY_WAITED, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                    {
                        break;
                    }
                }
                _ => return,
            }
        }
        notified.await;
    }

    /// Fetches absent chunk `idx` (or waits for whoever does); returns the data if this call
    /// fetched it, `None` if the chunk turned out present. `idx` must be in range.
    async fn ensure(&self, idx: ChunkIdx) -> StoreResult<Option<Bytes>> {
        let Some(claim) = self.claim(idx, true).await? else {
            return Ok(None);
        };
        // On an error (or if this future is dropped), `claim` returns the chunk to Absent.
        let data = self.remote.read(idx).await.map_err(|e| {
            StoreError::new(e.kind(), format!("fetching {idx} from the remote store"))
                .with_source(e)
        })?;
        self.local.write(idx, data.clone()).await.map_err(|e| {
            StoreError::new(e.kind(), format!("storing fetched {idx} locally")).with_source(e)
        })?;
        claim.release(PRESENT);
        Ok(Some(data))
    }

    /// Reserves a slot for a chunk about to become present, evicting until one is free.
    async fn reserve(&self) -> StoreResult<()> {
        let Some(b) = &self.bound else {
            return Ok(());
        };
        loop {
            let used = b.resident.load(Ordering::Acquire);
            if used < b.max {
                if b.resident
                    .compare_exchange(used, used + 1, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    return Ok(());
                }
                continue;
            }
            self.evict_one().await?;
        }
    }

    fn unreserve(&self) {
        if let Some(b) = &self.bound {
            b.resident.fetch_sub(1, Ordering::SeqCst);
            b.wake_evictors();
        }
    }

    /// Evicts one present chunk (writing it back first if it has local changes), or waits a
    /// moment if every present chunk is pinned or busy.
    async fn evict_one(&self) -> StoreResult<()> {
        let Some(b) = &self.bound else {
            return Ok(());
        };
        // Register for a wake-up before looking, so that an unpin after the look wakes us.
        let mut room = pin!(b.room.notified());
        room.as_mut().enable();
        b.waiting.fetch_add(1, Ordering::SeqCst);
        let result = self.evict_pass(b).await;
        if let Ok(false) = result {
            tokio::select! {
                _ = room => {}
                _ = tokio::time::sleep(EVICT_RETRY_PAUSE) => {}
            }
        }
        b.waiting.fetch_sub(1, Ordering::SeqCst);
        result.map(|_| ())
    }

    /// One pass of the clock: `Ok(true)` if it evicted a chunk, `Ok(false)` if every chunk
    /// it looked at was pinned, busy or referenced.
    async fn evict_pass(&self, b: &Bound) -> StoreResult<bool> {
        // Two rounds: the first may only clear referenced bits.
        let budget = 2 * b.clock.lock().len() + 1;
        for _ in 0..budget {
            let Some(idx) = b.clock.lock().pop_front() else {
                break;
            };
            let st = &self.state[idx.as_usize()];
            let word = st.load(Ordering::Acquire);
            if state_of(word) != PRESENT {
                // Not ours to keep track of any more (it went absent some other way).
                continue;
            }
            if word & !(STATE_MASK | REFERENCED) != 0 || word & REFERENCED != 0 {
                if word & REFERENCED != 0 {
                    // Second chance; a failure means it was touched again, which is fine.
                    let _ = st.compare_exchange(
                        word,
                        word & !REFERENCED,
                        Ordering::AcqRel,
                        Ordering::Relaxed,
                    );
                }
                b.clock.lock().push_back(idx);
                continue;
            }
            if st
                .compare_exchange(word, BUSY, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                b.clock.lock().push_back(idx);
                continue;
            }
            self.present.fetch_sub(1, Ordering::AcqRel);
            // The chunk is Busy: nothing reads, writes, pushes or fetches it until released.
            // If this future is dropped half-way, the guard puts it back (see `Evicting`).
            let evicting = Evicting {
                cached: self,
                bound: b,
                idx,
                armed: true,
            };
            if let Err(e) = self.write_back_and_drop(b, idx).await {
                drop(evicting);
                return Err(e);
            }
            evicting.finish();
            return Ok(true);
        }
        Ok(false)
    }

    /// The body of an eviction of Busy chunk `idx`: write-back if modified, local trim.
    async fn write_back_and_drop(&self, b: &Bound, idx: ChunkIdx) -> StoreResult<()> {
        if b.modified.is_dirty(idx) {
            let data = self.local.read(idx).await.map_err(|e| {
                StoreError::new(e.kind(), format!("evicting {idx}: reading it locally"))
                    .with_source(e)
            })?;
            self.remote.write(idx, data).await.map_err(|e| {
                StoreError::new(
                    e.kind(),
                    format!("evicting {idx}: writing it back to the remote store"),
                )
                .with_source(e)
            })?;
            b.modified.clear(idx);
            b.written_back.fetch_add(1, Ordering::Relaxed);
        }
        self.local.trim(ChunkRange::single(idx)).await.map_err(|e| {
            StoreError::new(e.kind(), format!("evicting {idx}: dropping it locally")).with_source(e)
        })
    }

    fn mark_modified(&self, idx: ChunkIdx) {
        if let Some(b) = &self.bound {
            b.modified.mark(idx);
        }
    }

    async fn read_bounded(&self, idx: ChunkIdx) -> StoreResult<Bytes> {
        self.geometry.check_idx(idx)?;
        loop {
            if let Some(pinned) = self.try_pin(idx) {
                let data = self.local.read(idx).await;
                drop(pinned);
                return data;
            }
            if let Some(data) = self.ensure(idx).await? {
                return Ok(data);
            }
        }
    }

    async fn write_bounded(&self, idx: ChunkIdx, data: Bytes) -> StoreResult<()> {
        self.geometry.check_write(idx, data.len())?;
        loop {
            // Modified is marked before the local write: a write that fails or is cancelled
            // may have landed in part, and an eviction must then write back what is there.
            if let Some(pinned) = self.try_pin(idx) {
                self.mark_modified(idx);
                let result = self.local.write(idx, data).await;
                drop(pinned);
                return result;
            }
            if let Some(claim) = self.claim(idx, true).await? {
                self.mark_modified(idx);
                self.local.write(idx, data).await?;
                claim.release(PRESENT);
                return Ok(());
            }
        }
    }

    async fn trim_bounded(&self, range: ChunkRange) -> StoreResult<()> {
        self.geometry.check_range(range)?;
        let mut pins = Vec::new();
        let mut held = RangeClaim {
            cached: self,
            held: Vec::new(),
        };
        for idx in range.iter() {
            loop {
                if let Some(pinned) = self.try_pin(idx) {
                    pins.push(pinned);
                    break;
                }
                if let Some(claim) = self.claim(idx, false).await? {
                    claim.disarm();
                    held.held.push(idx);
                    break;
                }
            }
        }
        for p in &pins {
            self.mark_modified(p.idx);
        }
        self.local.trim(range).await?;
        // The absent ones stay absent: zero them in the remote now, while they are Busy.
        let can_trim = self.remote.caps().contains(Caps::TRIM);
        let mut i = 0;
        while i < held.held.len() {
            let start = held.held[i];
            let mut end = start.0 + 1;
            while i + 1 < held.held.len() && held.held[i + 1].0 == end {
                end += 1;
                i += 1;
            }
            i += 1;
            let run = ChunkRange::new(start, ChunkIdx(end));
            let zeroed = if can_trim {
                self.remote.trim(run).await
            } else {
                let mut r = Ok(());
                for idx in run.iter() {
                    let zeros = farmap_core::zero_chunk(self.geometry.chunk_len(idx));
                    r = self.remote.write(idx, zeros).await;
                    if r.is_err() {
                        break;
                    }
                }
                r
            };
            zeroed.map_err(|e| {
                StoreError::new(
                    e.kind(),
                    format!("trimming absent {run} in the remote store"),
                )
                .with_source(e)
            })?;
        }
        held.release(ABSENT);
        drop(pins);
        Ok(())
    }

    async fn status_bounded(&self, idx: ChunkIdx) -> StoreResult<ChunkStatus> {
        match self.try_pin(idx) {
            Some(pinned) => {
                let status = self.local.status(idx).await;
                drop(pinned);
                status
            }
            None => self.remote.status(idx).await,
        }
    }

    /// Holds chunk `idx` present (pinned) while `push` runs; skips it if absent (see
    /// [`PushHold`]).
    async fn hold_for_push<'a>(
        &'a self,
        idx: ChunkIdx,
        push: BoxFuture<'a, StoreResult<()>>,
    ) -> StoreResult<bool> {
        if self.bound.is_none() || !self.geometry.contains(idx) {
            return push.await.map(|()| true);
        }
        loop {
            if let Some(pinned) = self.try_pin(idx) {
                let result = push.await;
                drop(pinned);
                return result.map(|()| true);
            }
            match state_of(self.state[idx.as_usize()].load(Ordering::Acquire)) {
                // Absent in a bounded cache: never written, or written back by its eviction.
                ABSENT => return Ok(false),
                PRESENT => {}
                _ => self.wait_while_busy(idx).await,
            }
        }
    }
}

/// A pin of a present chunk of a bounded cache; unpins on drop.
struct Pinned<'a, L: Store, R: Store> {
    cached: &'a Cached<L, R>,
    idx: ChunkIdx,
}

impl<L: Store, R: Store> Drop for Pinned<'_, L, R> {
    fn drop(&mut self) {
        self.cached.state[self.idx.as_usize()].fetch_sub(PIN, Ordering::SeqCst);
        if let Some(b) = &self.cached.bound {
            b.wake_evictors();
        }
    }
}

/// A chunk being evicted (Busy). Dropped unfinished (a failed write-back, or a cancelled
/// eviction), it goes back to Present if it still has local changes (the local copy is
/// only trimmed after the write-back) and to Absent if the remote already has them.
struct Evicting<'a, L: Store, R: Store> {
    cached: &'a Cached<L, R>,
    bound: &'a Bound,
    idx: ChunkIdx,
    armed: bool,
}

impl<L: Store, R: Store> Evicting<'_, L, R> {
    fn finish(mut self) {
        self.armed = false;
        self.bound.evicted.fetch_add(1, Ordering::Relaxed);
        release(self.cached, self.idx, ABSENT);
        self.cached.unreserve();
    }
}

impl<L: Store, R: Store> Drop for Evicting<'_, L, R> {
    fn drop(&mut self) {
        if self.armed {
            if self.bound.modified.is_dirty(self.idx) {
                release(self.cached, self.idx, PRESENT);
            } else {
                release(self.cached, self.idx, ABSENT);
                self.cached.unreserve();
            }
        }
    }
}

/// Ownership of a Busy chunk; returns it to Absent (waking waiters, giving back its slot)
/// unless released.
struct Claim<'a, L: Store, R: Store> {
    cached: &'a Cached<L, R>,
    idx: ChunkIdx,
    armed: bool,
    slot: bool,
}

impl<L: Store, R: Store> Claim<'_, L, R> {
    fn release(mut self, to: u32) {
        self.armed = false;
        release(self.cached, self.idx, to);
        if self.slot && to != PRESENT {
            self.cached.unreserve();
        }
    }

    /// Forgets the claim without releasing: the caller releases `idx` itself.
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl<L: Store, R: Store> Drop for Claim<'_, L, R> {
    fn drop(&mut self) {
        if self.armed {
            release(self.cached, self.idx, ABSENT);
            if self.slot {
                self.cached.unreserve();
            }
        }
    }
}

fn release<L: Store, R: Store>(cached: &Cached<L, R>, idx: ChunkIdx, to: u32) {
    let prev = cached.state[idx.as_usize()].swap(to, Ordering::AcqRel);
    debug_assert!(
        prev == BUSY || prev == BUSY_WAITED,
        "released a chunk not Busy"
    );
    if to == PRESENT {
        cached.present.fetch_add(1, Ordering::AcqRel);
        if let Some(b) = &cached.bound {
            b.clock.lock().push_back(idx);
            b.wake_evictors();
        }
    }
    if prev == BUSY_WAITED {
        cached.stripe(idx).notify_waiters();
    }
}

/// The chunks of a range a trim holds Busy; returned to Absent unless released.
struct RangeClaim<'a, L: Store, R: Store> {
    cached: &'a Cached<L, R>,
    held: Vec<ChunkIdx>,
}

impl<L: Store, R: Store> RangeClaim<'_, L, R> {
    fn release(mut self, to: u32) {
        for idx in std::mem::take(&mut self.held) {
            release(self.cached, idx, to);
        }
    }
}

impl<L: Store, R: Store> Drop for RangeClaim<'_, L, R> {
    fn drop(&mut self) {
        for idx in std::mem::take(&mut self.held) {
            release(self.cached, idx, ABSENT);
        }
    }
}

impl<L: Store, R: Store> Store for Cached<L, R> {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn caps(&self) -> Caps {
        let (l, r) = (self.local.caps(), self.remote.caps());
        let mut caps = l & (Caps::WRITE | Caps::FLUSH | Caps::TRIM);
        for both in [Caps::STATUS, Caps::PARALLEL] {
            if l.contains(both) && r.contains(both) {
                caps = caps | both;
            }
        }
        caps
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        if self.bound.is_some() {
            return Box::pin(self.read_bounded(idx));
        }
        // Hot path: a present chunk is the local store's business, with no future of ours
        // around its future (`is_present` is false outside the region).
        if self.is_present(idx) {
            return self.local.read(idx);
        }
        Box::pin(async move {
            self.geometry.check_idx(idx)?;
            match self.ensure(idx).await? {
                Some(data) => Ok(data),
                None => self.local.read(idx).await,
            }
        })
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        if self.bound.is_some() {
            return Box::pin(self.write_bounded(idx, data));
        }
        if self.is_present(idx) {
            // Present is final: the local store checks the length and orders racing writes.
            return self.local.write(idx, data);
        }
        Box::pin(async move {
            self.geometry.check_write(idx, data.len())?;
            match self.claim(idx, false).await? {
                None => self.local.write(idx, data).await,
                Some(claim) => {
                    self.local.write(idx, data).await?;
                    claim.release(PRESENT);
                    Ok(())
                }
            }
        })
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        self.local.flush()
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        if self.bound.is_some() {
            return Box::pin(self.trim_bounded(range));
        }
        Box::pin(async move {
            self.geometry.check_range(range)?;
            let mut held = RangeClaim {
                cached: self,
                held: Vec::new(),
            };
            for idx in range.iter() {
                if let Some(claim) = self.claim(idx, false).await? {
                    claim.disarm();
                    held.held.push(idx);
                }
            }
            self.local.trim(range).await?;
            held.release(PRESENT);
            Ok(())
        })
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        if self.bound.is_some() {
            return Box::pin(self.status_bounded(idx));
        }
        if self.is_present(idx) {
            self.local.status(idx)
        } else {
            // Absent, Busy, or outside the region (the remote says so).
            self.remote.status(idx)
        }
    }

    /// Fetches the chunk into the local store.
    fn prefetch(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move { self.read(idx).await.map(drop) })
    }
}

impl<L: Store, R: Store> PushHold for Cached<L, R> {
    fn hold<'a>(
        &'a self,
        idx: ChunkIdx,
        push: BoxFuture<'a, StoreResult<()>>,
    ) -> BoxFuture<'a, StoreResult<bool>> {
        Box::pin(self.hold_for_push(idx, push))
    }
}

impl<L: Store, R: Store> Fill for Cached<L, R> {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn is_present(&self, idx: ChunkIdx) -> bool {
        Cached::is_present(self, idx)
    }

    fn fetch(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(Cached::fetch(self, idx))
    }

    fn chunks_per_fetch(&self) -> u32 {
        if self.bound.is_some() {
            1
        } else {
            self.remote.chunks_per_read()
        }
    }

    fn fetch_run(&self, first: ChunkIdx, max: u64) -> BoxFuture<'_, StoreResult<u64>> {
        Box::pin(Cached::fetch_run(self, first, max))
    }
}

impl<L: fmt::Debug, R: fmt::Debug> fmt::Debug for Cached<L, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cached")
            .field("geometry", &self.geometry)
            .field("present", &self.present.load(Ordering::Relaxed))
            .field("local", &self.local)
            .field("remote", &self.remote)
            .finish()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use farmap_core::is_zero;
    use farmap_testkit::{Hooked, ModelStore, Op, PatternStore};
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;
    use std::time::Duration;

    fn geometry() -> Geometry {
        Geometry::new(32 * 4096, 4096).unwrap()
    }

    fn pattern(idx: ChunkIdx) -> Vec<u8> {
        farmap_testkit::pattern_bytes(7, idx.0 * 4096, 4096)
    }

    #[test]
    fn geometries_must_match() {
        let a = Geometry::new(8 * 4096, 4096).unwrap();
        let b = Geometry::new(8 * 4096, 8192).unwrap();
        let err = Cached::new(ModelStore::new(a), ModelStore::new(b)).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput);
        assert!(err.context().contains(&a.to_string()), "{err}");
        assert!(err.context().contains(&b.to_string()), "{err}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_misses_fetch_once() {
        let g = geometry();
        let reads = Arc::new(AtomicUsize::new(0));
        let counter = reads.clone();
        let remote = Hooked::new(PatternStore::new(g, 7), move |op, _| {
            if op == Op::Read {
                counter.fetch_add(1, Ordering::SeqCst);
            }
            Box::pin(async {
                tokio::time::sleep(Duration::from_millis(20)).await;
                Ok(())
            })
        });
        let c = Arc::new(Cached::new(ModelStore::new(g), remote).unwrap());
        let tasks: Vec<_> = (0..64)
            .map(|i| {
                let c = c.clone();
                tokio::spawn(async move {
                    if i % 2 == 0 {
                        c.read(ChunkIdx(3)).await.unwrap()
                    } else {
                        c.fetch(ChunkIdx(3)).await.unwrap();
                        c.local().read(ChunkIdx(3)).await.unwrap()
                    }
                })
            })
            .collect();
        for t in tasks {
            assert!(t.await.unwrap()[..] == pattern(ChunkIdx(3))[..]);
        }
        assert_eq!(
            reads.load(Ordering::SeqCst),
            1,
            "one remote read for 64 misses"
        );
        assert!(c.is_present(ChunkIdx(3)));
        assert_eq!(c.present_count(), 1);
        c.read(ChunkIdx(3)).await.unwrap();
        assert_eq!(
            reads.load(Ordering::SeqCst),
            1,
            "a present chunk is read locally"
        );
    }

    /// A remote whose reads block until `release` is notified, announcing `entered` first.
    fn blocking_remote(
        g: Geometry,
    ) -> (
        Hooked<PatternStore>,
        Arc<Notify>,
        Arc<tokio::sync::Semaphore>,
    ) {
        let entered = Arc::new(Notify::new());
        let release = Arc::new(tokio::sync::Semaphore::new(0));
        let (e, r) = (entered.clone(), release.clone());
        let remote = Hooked::new(PatternStore::new(g, 7), move |_, _| {
            let (e, r) = (e.clone(), r.clone());
            Box::pin(async move {
                e.notify_one();
                r.acquire().await.expect("open").forget();
                Ok(())
            })
        });
        (remote, entered, release)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_during_a_slow_fetch_is_not_overwritten() {
        let g = geometry();
        let (remote, entered, release) = blocking_remote(g);
        let c = Arc::new(Cached::new(ModelStore::new(g), remote).unwrap());
        let idx = ChunkIdx(5);
        let reader = tokio::spawn({
            let c = c.clone();
            async move { c.read(idx).await.unwrap() }
        });
        entered.notified().await;
        let new = Bytes::from(vec![0xAB; 4096]);
        let writer = tokio::spawn({
            let (c, new) = (c.clone(), new.clone());
            async move { c.write(idx, new).await.unwrap() }
        });
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(
            !writer.is_finished(),
            "the write waits for the fetch in progress"
        );
        release.add_permits(1);
        assert!(
            reader.await.unwrap()[..] == pattern(idx)[..],
            "the fetch saw the remote"
        );
        writer.await.unwrap();
        assert!(
            c.read(idx).await.unwrap() == new,
            "the write survives the fetch"
        );
        assert!(c.local().read(idx).await.unwrap() == new);
    }

    /// A cache over a pattern remote, and the count of operations that reached the remote.
    fn counting_remote() -> (Arc<AtomicUsize>, Cached<ModelStore, Hooked<PatternStore>>) {
        let g = geometry();
        let calls = Arc::new(AtomicUsize::new(0));
        let counter = calls.clone();
        let remote = Hooked::new(PatternStore::new(g, 7), move |_, _| {
            counter.fetch_add(1, Ordering::SeqCst);
            Box::pin(async { Ok(()) })
        });
        (calls, Cached::new(ModelStore::new(g), remote).unwrap())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn writes_to_absent_chunks_do_not_fetch() {
        let (reads, c) = counting_remote();
        c.write(ChunkIdx(1), Bytes::from(vec![9; 4096]))
            .await
            .unwrap();
        c.trim(ChunkRange::new(ChunkIdx(2), ChunkIdx(4)))
            .await
            .unwrap();
        assert_eq!(reads.load(Ordering::SeqCst), 0);
        assert_eq!(c.present_count(), 3);
        assert!(
            is_zero(&c.read(ChunkIdx(3)).await.unwrap()),
            "trimmed reads zero"
        );
        assert_eq!(c.status(ChunkIdx(3)).await.unwrap(), ChunkStatus::Zero);
        assert_eq!(
            c.status(ChunkIdx(9)).await.unwrap(),
            ChunkStatus::Data,
            "remote's"
        );
        assert!(c.read(ChunkIdx(9)).await.unwrap()[..] == pattern(ChunkIdx(9))[..]);
        assert_eq!(reads.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_fetch_surfaces_and_a_later_read_retries() {
        let g = geometry();
        let calls = Arc::new(AtomicUsize::new(0));
        let counter = calls.clone();
        let remote = Hooked::new(PatternStore::new(g, 7), move |_, _| {
            let n = counter.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(10)).await;
                if n == 0 {
                    Err(StoreError::new(ErrorKind::Io, "injected"))
                } else {
                    Ok(())
                }
            })
        });
        let c = Arc::new(Cached::new(ModelStore::new(g), remote).unwrap());
        let idx = ChunkIdx(7);
        // Two readers miss together: the fetcher fails, the waiter retries and succeeds.
        let a = tokio::spawn({
            let c = c.clone();
            async move { c.read(idx).await }
        });
        let b = tokio::spawn({
            let c = c.clone();
            async move { c.read(idx).await }
        });
        let (a, b) = (a.await.unwrap(), b.await.unwrap());
        let (errs, oks): (Vec<_>, Vec<_>) = [a, b].into_iter().partition(|r| r.is_err());
        assert_eq!(errs.len(), 1, "exactly the failed fetcher sees the error");
        let err = errs.into_iter().next().unwrap().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Io);
        assert!(err.context().contains("fetching chunk 7"), "{err}");
        assert!(oks[0].as_ref().unwrap()[..] == pattern(idx)[..]);
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        assert!(c.is_present(idx));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_evicted_chunk_is_fetched_again() {
        let (reads, c) = counting_remote();
        assert!(!c.evict(ChunkIdx(4)), "an absent chunk is not evicted");
        assert!(!c.evict(ChunkIdx(99)), "nor one outside the region");
        c.fetch(ChunkIdx(4)).await.unwrap();
        assert!(c.evict(ChunkIdx(4)));
        assert!(!c.is_present(ChunkIdx(4)));
        assert_eq!(c.present_count(), 0);
        c.fetch(ChunkIdx(4)).await.unwrap();
        assert_eq!(
            reads.load(Ordering::SeqCst),
            2,
            "fetched again from the remote"
        );
        assert_eq!(c.present_count(), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cancelled_fetch_leaves_the_chunk_absent() {
        let g = geometry();
        let (remote, entered, release) = blocking_remote(g);
        let c = Arc::new(Cached::new(ModelStore::new(g), remote).unwrap());
        let idx = ChunkIdx(2);
        let fetch = tokio::spawn({
            let c = c.clone();
            async move { c.fetch(idx).await }
        });
        entered.notified().await;
        let waiter = tokio::spawn({
            let c = c.clone();
            async move { c.read(idx).await.unwrap() }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        fetch.abort();
        assert!(fetch.await.unwrap_err().is_cancelled());
        // The waiter becomes the fetcher: it needs one more permit.
        entered.notified().await;
        assert!(!c.is_present(idx));
        release.add_permits(1);
        assert!(waiter.await.unwrap()[..] == pattern(idx)[..]);
        assert!(c.is_present(idx));
    }

    /// A store that reads runs of up to `per_read` chunks in one request: the runs it was
    /// asked for are recorded (chunk by chunk reads as runs of 1).
    #[derive(Debug)]
    pub(crate) struct RunReads<S> {
        pub(crate) inner: S,
        pub(crate) per_read: u32,
        pub(crate) runs: parking_lot::Mutex<Vec<ChunkRange>>,
    }

    impl<S: Store> RunReads<S> {
        pub(crate) fn new(inner: S, per_read: u32) -> Self {
            Self {
                inner,
                per_read,
                runs: parking_lot::Mutex::new(Vec::new()),
            }
        }
    }

    impl<S: Store> Store for RunReads<S> {
        fn geometry(&self) -> Geometry {
            self.inner.geometry()
        }
        fn caps(&self) -> Caps {
            self.inner.caps()
        }
        fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
            self.runs.lock().push(ChunkRange::single(idx));
            self.inner.read(idx)
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
        fn chunks_per_read(&self) -> u32 {
            self.per_read
        }
        fn read_chunks(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<Vec<Bytes>>> {
            assert!(
                range.len() <= u64::from(self.per_read),
                "{range:?} is too long"
            );
            self.runs.lock().push(range);
            Box::pin(async move {
                let mut out = Vec::new();
                for idx in range.iter() {
                    out.push(self.inner.read(idx).await?);
                }
                Ok(out)
            })
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_run_fetch_reads_the_absent_chunks_after_the_first_in_one_request() {
        let g = geometry();
        let c = Cached::new(
            ModelStore::new(g),
            RunReads::new(PatternStore::new(g, 7), 8),
        )
        .unwrap();
        assert_eq!(Fill::chunks_per_fetch(&c), 8);
        c.fetch(ChunkIdx(5)).await.unwrap();
        // 2, 3, 4 in one request; 5 is present and ends the run.
        assert_eq!(c.fetch_run(ChunkIdx(2), 8).await.unwrap(), 3);
        // A run is cut at `max` and at the region's end.
        assert_eq!(c.fetch_run(ChunkIdx(6), 4).await.unwrap(), 4);
        assert_eq!(c.fetch_run(ChunkIdx(30), 8).await.unwrap(), 2);
        // A present first chunk: nothing to fetch, one chunk accounted for.
        assert_eq!(c.fetch_run(ChunkIdx(2), 8).await.unwrap(), 1);
        let runs = c.remote().runs.lock().clone();
        let want = [(5, 6), (2, 5), (6, 10), (30, 32)]
            .map(|(a, b)| ChunkRange::new(ChunkIdx(a), ChunkIdx(b)));
        assert_eq!(runs, want, "the remote reads");
        for idx in [2, 3, 4, 5, 6, 7, 8, 9, 30, 31].map(ChunkIdx) {
            assert!(c.is_present(idx), "{idx}");
            assert!(c.local().read(idx).await.unwrap()[..] == pattern(idx)[..]);
        }
        assert!(!c.is_present(ChunkIdx(10)) && !c.is_present(ChunkIdx(1)));
        assert_eq!(c.present_count(), 10);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_run_fetch_leaves_its_chunks_absent() {
        let g = geometry();
        let failing = Hooked::new(PatternStore::new(g, 7), |_, idx| {
            Box::pin(async move {
                if idx == ChunkIdx(3) {
                    Err(StoreError::new(ErrorKind::Io, "injected"))
                } else {
                    Ok(())
                }
            })
        });
        let c = Cached::new(ModelStore::new(g), RunReads::new(failing, 8)).unwrap();
        let err = c.fetch_run(ChunkIdx(0), 8).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Io, "{err}");
        assert_eq!(c.present_count(), 0, "nothing of the failed run is present");
        // The chunks are absent, not held: a later fetch of each works (or fails alone).
        assert_eq!(c.fetch_run(ChunkIdx(0), 3).await.unwrap(), 3);
        assert!(c.fetch(ChunkIdx(3)).await.is_err());
        assert_eq!(c.fetch_run(ChunkIdx(4), 8).await.unwrap(), 8);
    }
}
