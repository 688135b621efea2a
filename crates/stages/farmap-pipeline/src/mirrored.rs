//! [`Mirrored`]: every write goes to a primary and a mirror store; reads come from the
//! primary and fall back to the mirror when it fails, and a primary that comes back is
//! resynchronised from the mirror (only the chunks written meanwhile) before it serves reads
//! again.
//!
//! # Policies: what an acknowledged write promises
//! - [`MirrorPolicy::Both`]: a write returns once the primary and the mirror have both
//!   completed it. While the primary is down, once the mirror has it (and the chunk is noted
//!   for the primary's resync). If the mirror fails a write the primary completed, the write
//!   still succeeds, and the chunk is noted as missing from the mirror: a read of it that
//!   would need the mirror fails (`Unavailable`) rather than return an older version, until
//!   the chunk is written again with the mirror up. Both failing is the write's error.
//! - [`MirrorPolicy::PrimaryFirst`]: a write returns once the primary completed it; the
//!   mirror gets it from a backlog of at most [`MirrorOptions::backlog`] chunks (a newer write
//!   of a chunk still queued replaces it; a write that finds the backlog full waits for
//!   room). A failed primary write is sent through the backlog and waited for, so it returns
//!   once the mirror has it. `flush` (and `trim`) first wait for the backlog to drain. Losing
//!   this process loses what the backlog held (the primary has it); losing the primary loses
//!   nothing.
//!
//! # Failover and resync
//! - A primary operation that fails (any kind but `InvalidInput`/`OutOfRange`) or takes longer
//!   than [`MirrorOptions::timeout`] marks the primary **down**; the operation is served by
//!   the mirror, so the caller sees no error. A `Corrupt` read (from a [`Verified`]
//!   primary) is served from the mirror without marking the primary down.
//! - While down, writes go to the mirror only and their chunks are noted.
//! - A background task probes a down primary every [`MirrorOptions::probe`] (a `status`
//!   request); when it answers, the primary is **resyncing**: the noted chunks are copied
//!   from the mirror, while new writes go to both under a per-chunk lock (so a copy never
//!   overwrites a newer write). Reads keep coming from the mirror until no noted chunk is
//!   left; then the primary is **up** again.
//! - A primary write or trim that timed out is not abandoned: it keeps running (a
//!   **straggler**) until the primary answers it, because it may still land (a request in a
//!   partitioned TCP connection is delivered when the link heals). A resync starts copying
//!   only once every straggler has ended, so a late write can never overwrite the newer
//!   version a resync copied.
//! - The mirror is never resynchronised from the primary (chunks it missed are refused
//!   instead, see above).
//! - With a journal ([`Mirrored::with_journal`]), what is owed (chunks to resync into the
//!   primary, chunks the mirror missed) is appended to a file and synced before the write
//!   that made an entry is acknowledged, and the file is rewritten at a flush (and after a
//!   resync) once entries no longer hold: a stage made over the same stores after this
//!   process ended starts with the primary down if it is owed chunks.
//!
//! # Concurrency contract
//! - Writes hold a shared async lock for their duration; switching the primary to resyncing
//!   and back to up takes it exclusively, so no write straddles a switch.
//! - Per-chunk locks (striped) are taken only while resyncing.
//! - State, noted chunks and the backlog are behind short `parking_lot` locks, never held
//!   across an await.
//!
//! [`Verified`]: crate::Verified

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::future::{poll_fn, Future};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use farmap_core::{
    BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, Store, StoreError,
    StoreResult,
};
use parking_lot::Mutex;
use tokio::sync::{Notify, RwLock};

use crate::mirror_journal::{self as journal, Journal};

/// When a write is acknowledged (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MirrorPolicy {
    /// Once both stores completed it.
    Both,
    /// Once the primary completed it; the mirror follows through a bounded backlog.
    PrimaryFirst,
}

impl MirrorPolicy {
    /// `both` or `primary-first`.
    pub fn as_str(self) -> &'static str {
        match self {
            MirrorPolicy::Both => "both",
            MirrorPolicy::PrimaryFirst => "primary-first",
        }
    }
}

/// How a [`Mirrored`] stage behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MirrorOptions {
    /// When writes are acknowledged.
    pub policy: MirrorPolicy,
    /// How long a primary operation may take before the primary is marked down.
    pub timeout: Duration,
    /// Chunks queued for the mirror at most (`PrimaryFirst`).
    pub backlog: usize,
    /// How often a down primary is probed.
    pub probe: Duration,
}

impl Default for MirrorOptions {
    /// `Both`, 2 s, 1024 chunks, 200 ms.
    fn default() -> Self {
        Self {
            policy: MirrorPolicy::Both,
            timeout: Duration::from_secs(2),
            backlog: 1024,
            probe: Duration::from_millis(200),
        }
    }
}

/// Where the primary stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PrimaryState {
    /// Serving reads and taking writes.
    Up,
    /// Failed; writes go to the mirror only.
    Down,
    /// Back, being sent the chunks written while it was down; reads still from the mirror.
    Resyncing,
}

impl PrimaryState {
    /// `up`, `down` or `resyncing`.
    pub fn as_str(self) -> &'static str {
        match self {
            PrimaryState::Up => "up",
            PrimaryState::Down => "down",
            PrimaryState::Resyncing => "resyncing",
        }
    }
}

/// A snapshot of a [`Mirrored`] stage's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MirrorStatus {
    /// The policy.
    pub policy: MirrorPolicy,
    /// The primary.
    pub primary: PrimaryState,
    /// Chunks the primary must be sent before it is up.
    pub to_resync: u64,
    /// Chunks the mirror missed (a failed mirror write): refused when the primary is down.
    pub mirror_missing: u64,
    /// Chunks queued for the mirror.
    pub backlog: usize,
    /// Times the primary was marked down.
    pub failovers: u64,
    /// Operations served by the mirror because the primary failed them.
    pub fallbacks: u64,
    /// Chunks copied to a recovered primary.
    pub resynced: u64,
    /// Primary writes and trims that timed out and are still running (see the module docs).
    pub stragglers: u64,
}

#[derive(Debug)]
struct State {
    primary: PrimaryState,
    /// Chunks written while the primary was down.
    to_resync: BTreeSet<u64>,
    /// Chunks whose last write the mirror failed.
    mirror_missing: BTreeSet<u64>,
    /// With a journal: entries noted and not yet appended to it, and the sequence number of
    /// the last one noted.
    unjournaled: Vec<(u8, u64)>,
    noted_seq: u64,
    /// With a journal: entries dropped from the sets since it was last rewritten.
    journal_stale: bool,
    journaled: bool,
}

impl State {
    fn note(&mut self, tag: u8, idx: u64) {
        let new = match tag {
            journal::PRIMARY => self.to_resync.insert(idx),
            _ => self.mirror_missing.insert(idx),
        };
        if new && self.journaled {
            self.unjournaled.push((tag, idx));
            self.noted_seq += 1;
        }
    }

    fn note_resync(&mut self, chunks: impl IntoIterator<Item = u64>) {
        for idx in chunks {
            self.note(journal::PRIMARY, idx);
        }
    }

    fn owed(&self) -> journal::Owed {
        journal::Owed {
            to_resync: self.to_resync.clone(),
            mirror_missing: self.mirror_missing.clone(),
        }
    }
}

#[derive(Debug, Default)]
struct Backlog {
    /// The newest queued version of each chunk: (sequence number, data).
    pending: HashMap<u64, (u64, Bytes)>,
    queue: VecDeque<u64>,
    /// Chunks being written to the mirror now.
    busy: BTreeSet<u64>,
    seq: u64,
}

const STRIPES: usize = 256;
const MIRROR_WORKERS: usize = 4;

#[derive(Debug)]
struct Shared {
    primary: Arc<dyn Store>,
    mirror: Arc<dyn Store>,
    opts: MirrorOptions,
    state: Mutex<State>,
    switch: RwLock<()>,
    stripes: Vec<tokio::sync::Mutex<()>>,
    backlog: Mutex<Backlog>,
    /// Wakes the mirror workers.
    work: Notify,
    /// Wakes writers waiting for room, for their write, or for the backlog to drain.
    progress: Notify,
    failovers: AtomicU64,
    fallbacks: AtomicU64,
    resynced: AtomicU64,
    /// Whether `state.mirror_missing` may be non-empty (written under the state lock).
    any_missing: AtomicBool,
    /// Primary changes that timed out and still run.
    stragglers: Arc<Stragglers>,
    /// Where what is owed is kept across processes, if anywhere.
    journal: Option<Arc<Mutex<Journal>>>,
    /// Serializes journal writes; holds the sequence number of the last entry appended.
    journal_io: tokio::sync::Mutex<u64>,
}

/// Counts the primary changes that timed out but still run (see the module docs).
#[derive(Debug, Default)]
struct Stragglers {
    running: Mutex<u64>,
    ended: Notify,
}

impl Stragglers {
    fn count(&self) -> u64 {
        *self.running.lock()
    }

    /// Waits until none is left.
    async fn none_left(&self) {
        loop {
            let notified = self.ended.notified();
            if self.count() == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// Where one primary change stands, shared by its caller and the task that runs it.
#[derive(Debug, Default)]
struct Change {
    /// The caller gave up waiting: the change counts as a straggler until it ends.
    abandoned: bool,
    ended: bool,
}

/// A primary and a mirror store as one; see the [module docs](self).
#[derive(Debug)]
pub struct Mirrored {
    shared: Arc<Shared>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Mirrored {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn passes_through(e: &StoreError) -> bool {
    matches!(e.kind(), ErrorKind::InvalidInput | ErrorKind::OutOfRange)
}

impl Shared {
    async fn on_primary<T>(
        &self,
        what: impl FnOnce() -> String,
        fut: impl Future<Output = StoreResult<T>>,
    ) -> StoreResult<T> {
        let mut fut = std::pin::pin!(fut);
        // A primary that answers on the first poll (an in-process store) needs no timer.
        if let Poll::Ready(r) = poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await {
            return r;
        }
        match tokio::time::timeout(self.opts.timeout, fut).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::new(
                ErrorKind::Timeout,
                format!(
                    "the primary took more than {:?} for {}",
                    self.opts.timeout,
                    what()
                ),
            )),
        }
    }

    /// A write or trim of the primary (`fut`), under the timeout as [`on_primary`]; one that
    /// times out keeps running on a task of its own, counted as a straggler until it ends
    /// (a resync waits for it: it may still land).
    ///
    /// [`on_primary`]: Self::on_primary
    async fn change_primary(
        &self,
        what: impl FnOnce() -> String,
        fut: BoxFuture<'static, StoreResult<()>>,
    ) -> StoreResult<()> {
        let mut fut = fut;
        if let Poll::Ready(r) = poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await {
            return r;
        }
        let change = Arc::new(Mutex::new(Change::default()));
        let stragglers = self.stragglers.clone();
        let task = {
            let change = change.clone();
            tokio::spawn(async move {
                let r = fut.await;
                let mut c = change.lock();
                c.ended = true;
                if c.abandoned {
                    *stragglers.running.lock() -= 1;
                    stragglers.ended.notify_waiters();
                }
                r
            })
        };
        match tokio::time::timeout(self.opts.timeout, task).await {
            Ok(Ok(r)) => r,
            Ok(Err(join)) => Err(StoreError::new(
                ErrorKind::Io,
                format!("the primary's task for {} failed: {join}", what()),
            )),
            Err(_) => {
                let mut c = change.lock();
                if !c.ended {
                    c.abandoned = true;
                    *self.stragglers.running.lock() += 1;
                }
                Err(StoreError::new(
                    ErrorKind::Timeout,
                    format!(
                        "the primary took more than {:?} for {}",
                        self.opts.timeout,
                        what()
                    ),
                ))
            }
        }
    }

    /// Appends what was noted to the journal (if there is one), with what other writes noted
    /// meanwhile, and returns once every entry noted before the call is on disk.
    async fn persist(&self) -> StoreResult<()> {
        let Some(journal) = &self.journal else {
            return Ok(());
        };
        let want = self.state.lock().noted_seq;
        let mut appended = self.journal_io.lock().await;
        if *appended >= want {
            return Ok(());
        }
        let (entries, upto) = {
            let mut st = self.state.lock();
            (std::mem::take(&mut st.unjournaled), st.noted_seq)
        };
        if !entries.is_empty() {
            let journal = journal.clone();
            let appending = entries.clone();
            let r = tokio::task::spawn_blocking(move || journal.lock().append(&appending))
                .await
                .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
            if let Err(e) = r {
                // Tried again by the next write or flush; this one fails.
                let mut st = self.state.lock();
                let later = std::mem::replace(&mut st.unjournaled, entries);
                st.unjournaled.extend(later);
                return Err(e);
            }
        }
        *appended = upto;
        Ok(())
    }

    /// Rewrites the journal with what is owed now (dropping what no longer is).
    async fn rewrite_journal(&self) -> StoreResult<()> {
        let Some(journal) = &self.journal else {
            return Ok(());
        };
        let mut appended = self.journal_io.lock().await;
        let (owed, upto) = {
            let mut st = self.state.lock();
            st.unjournaled.clear();
            st.journal_stale = false;
            (st.owed(), st.noted_seq)
        };
        let journal = journal.clone();
        let r = tokio::task::spawn_blocking(move || journal.lock().rewrite(&owed))
            .await
            .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
        match r {
            Ok(()) => {
                *appended = upto;
                Ok(())
            }
            Err(e) => {
                // The old file still holds everything it held; what was noted since is
                // appended by the next write.
                let mut st = self.state.lock();
                st.journal_stale = true;
                let owed = st.owed();
                st.unjournaled = owed
                    .to_resync
                    .iter()
                    .map(|i| (journal::PRIMARY, *i))
                    .chain(owed.mirror_missing.iter().map(|i| (journal::MIRROR, *i)))
                    .collect();
                Err(e)
            }
        }
    }

    fn primary_state(&self) -> PrimaryState {
        self.state.lock().primary
    }

    /// Marks the primary down after `err`, noting `chunks` for its resync.
    fn mark_down(&self, err: &StoreError, chunks: impl IntoIterator<Item = u64>) {
        let mut st = self.state.lock();
        st.note_resync(chunks);
        if st.primary != PrimaryState::Down {
            st.primary = PrimaryState::Down;
            self.failovers.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(error = %err, "mirrored store: the primary is down; serving from the mirror");
        }
    }

    fn note_mirror(&self, idx: u64, ok: bool) {
        // The common case, a mirror write that succeeded with no chunk missing, takes no lock.
        // `any_missing` is only set under the state lock, before a chunk is added, so a write
        // that sees it clear cannot have a missing mark to remove, unless a concurrent write
        // of the same chunk adds one after this check: as if that failure came after this
        // success, which it may have.
        if ok && !self.any_missing.load(Ordering::Acquire) {
            return;
        }
        let mut st = self.state.lock();
        if ok {
            if st.mirror_missing.remove(&idx) {
                st.journal_stale = true;
            }
            if st.mirror_missing.is_empty() {
                self.any_missing.store(false, Ordering::Release);
            }
        } else {
            self.any_missing.store(true, Ordering::Release);
            st.note(journal::MIRROR, idx);
        }
    }

    fn stripe(&self, idx: ChunkIdx) -> &tokio::sync::Mutex<()> {
        &self.stripes[(idx.0 as usize) % STRIPES]
    }

    /// Reads `idx` from the mirror side: the backlog first, then the mirror.
    async fn read_mirror(&self, idx: ChunkIdx, why: Option<StoreError>) -> StoreResult<Bytes> {
        if let Some((_, data)) = self.backlog.lock().pending.get(&idx.0) {
            return Ok(data.clone());
        }
        if self.state.lock().mirror_missing.contains(&idx.0) {
            let why = why.map_or(String::new(), |e| format!(" ({e})"));
            return Err(StoreError::new(
                ErrorKind::Unavailable,
                format!(
                    "{idx} is only on the primary, which cannot serve it{why}: the mirror missed its last write"
                ),
            ));
        }
        self.mirror.read(idx).await
    }

    /// Queues `data` for the mirror; returns its sequence number.
    async fn enqueue(&self, idx: ChunkIdx, data: Bytes) -> u64 {
        loop {
            let notified = self.progress.notified();
            {
                let mut b = self.backlog.lock();
                if b.pending.len() < self.opts.backlog.max(1) || b.pending.contains_key(&idx.0) {
                    b.seq += 1;
                    let seq = b.seq;
                    if b.pending.insert(idx.0, (seq, data)).is_none() && !b.busy.contains(&idx.0) {
                        b.queue.push_back(idx.0);
                    }
                    drop(b);
                    self.work.notify_one();
                    return seq;
                }
            }
            notified.await;
        }
    }

    /// Waits until the mirror has version `seq` of `idx` (or a newer one is queued).
    async fn wait_mirrored(&self, idx: ChunkIdx, seq: u64) -> StoreResult<()> {
        loop {
            let notified = self.progress.notified();
            {
                let b = self.backlog.lock();
                let queued = b.pending.get(&idx.0).is_some_and(|(s, _)| *s <= seq);
                if !queued {
                    drop(b);
                    if self.state.lock().mirror_missing.contains(&idx.0) {
                        return Err(StoreError::new(
                            ErrorKind::Unavailable,
                            format!("neither the primary nor the mirror took the write of {idx}"),
                        ));
                    }
                    return Ok(());
                }
            }
            notified.await;
        }
    }

    async fn drain_backlog(&self) {
        loop {
            let notified = self.progress.notified();
            if self.backlog.lock().pending.is_empty() {
                return;
            }
            notified.await;
        }
    }

    /// One mirror worker of the backlog.
    async fn mirror_worker(self: Arc<Self>) {
        loop {
            let notified = self.work.notified();
            let job = {
                let mut b = self.backlog.lock();
                let pos = b.queue.iter().position(|i| !b.busy.contains(i));
                pos.and_then(|p| b.queue.remove(p)).and_then(|idx| {
                    let (seq, data) = b.pending.get(&idx)?.clone();
                    b.busy.insert(idx);
                    Some((idx, seq, data))
                })
            };
            let Some((idx, seq, data)) = job else {
                notified.await;
                continue;
            };
            let res = self.mirror.write(ChunkIdx(idx), data).await;
            if let Err(e) = &res {
                tracing::warn!(error = %e, chunk = idx, "mirrored store: the mirror failed a write");
            }
            self.note_mirror(idx, res.is_ok());
            {
                let mut b = self.backlog.lock();
                b.busy.remove(&idx);
                match b.pending.get(&idx) {
                    Some((s, _)) if *s == seq => {
                        b.pending.remove(&idx);
                    }
                    // A newer version came meanwhile: it goes next.
                    Some(_) => b.queue.push_back(idx),
                    None => {}
                }
            }
            self.work.notify_one();
            self.progress.notify_waiters();
        }
    }

    /// Writes `data` to the mirror per the policy: directly (`Both`), or through the backlog,
    /// waiting for it only when `wait`.
    async fn write_mirror(&self, idx: ChunkIdx, data: Bytes, wait: bool) -> StoreResult<()> {
        match self.opts.policy {
            MirrorPolicy::Both => {
                let res = self.mirror.write(idx, data).await;
                self.note_mirror(idx.0, res.is_ok());
                res
            }
            MirrorPolicy::PrimaryFirst => {
                let seq = self.enqueue(idx, data).await;
                if wait {
                    self.wait_mirrored(idx, seq).await
                } else {
                    Ok(())
                }
            }
        }
    }

    async fn write(&self, idx: ChunkIdx, data: Bytes) -> StoreResult<()> {
        self.primary.geometry().check_write(idx, data.len())?;
        let _switch = self.switch.read().await;
        match self.primary_state() {
            PrimaryState::Down => {
                self.write_mirror(idx, data, true).await?;
                self.state.lock().note_resync([idx.0]);
                self.fallbacks.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            PrimaryState::Up => self.write_both(idx, data).await,
            PrimaryState::Resyncing => {
                let _chunk = self.stripe(idx).lock().await;
                self.write_both(idx, data).await
            }
        }
    }

    async fn write_both(&self, idx: ChunkIdx, data: Bytes) -> StoreResult<()> {
        let primary = self.primary.clone();
        let copy = data.clone();
        let on_primary = self.change_primary(
            || format!("a write of {idx}"),
            Box::pin(async move { primary.write(idx, copy).await }),
        );
        match self.opts.policy {
            MirrorPolicy::Both => {
                let (p, m) = tokio::join!(on_primary, self.write_mirror(idx, data, true));
                match (p, m) {
                    (Ok(()), _) => Ok(()),
                    (Err(e), _) if passes_through(&e) => Err(e),
                    (Err(e), Ok(())) => {
                        self.mark_down(&e, [idx.0]);
                        self.fallbacks.fetch_add(1, Ordering::Relaxed);
                        Ok(())
                    }
                    (Err(e), Err(m)) => Err(StoreError::new(
                        m.kind(),
                        format!("writing {idx}: the primary failed ({e}) and so did the mirror"),
                    )
                    .with_source(m)),
                }
            }
            MirrorPolicy::PrimaryFirst => match on_primary.await {
                Ok(()) => self.write_mirror(idx, data, false).await,
                Err(e) if passes_through(&e) => Err(e),
                Err(e) => {
                    self.mark_down(&e, [idx.0]);
                    self.fallbacks.fetch_add(1, Ordering::Relaxed);
                    self.write_mirror(idx, data, true).await
                }
            },
        }
    }

    async fn read(&self, idx: ChunkIdx) -> StoreResult<Bytes> {
        self.primary.geometry().check_idx(idx)?;
        if self.primary_state() != PrimaryState::Up {
            return self.read_mirror(idx, None).await;
        }
        match self
            .on_primary(|| format!("a read of {idx}"), self.primary.read(idx))
            .await
        {
            Ok(d) => Ok(d),
            Err(e) if passes_through(&e) => Err(e),
            Err(e) => {
                if e.kind() != ErrorKind::Corrupt {
                    self.mark_down(&e, []);
                }
                self.fallbacks.fetch_add(1, Ordering::Relaxed);
                self.read_mirror(idx, Some(e)).await
            }
        }
    }

    /// Probes a down primary and resyncs it; runs until the stage is dropped.
    async fn resync_loop(weak: Weak<Shared>, probe: Duration) {
        loop {
            tokio::time::sleep(probe).await;
            let Some(me) = weak.upgrade() else { return };
            if me.primary_state() != PrimaryState::Down {
                continue;
            }
            let alive = me
                .on_primary(|| "a probe".into(), me.primary.status(ChunkIdx(0)))
                .await;
            if alive.is_err() {
                continue;
            }
            if me.stragglers.count() > 0 {
                // A write that timed out may still land: copying before it ends could let it
                // overwrite the newer version copied. Writes go on to the mirror meanwhile.
                tracing::info!(
                    stragglers = me.stragglers.count(),
                    "mirrored store: the primary answers again; waiting for the writes it \
                     had not answered before resyncing it"
                );
                me.stragglers.none_left().await;
            }
            {
                let _all = me.switch.write().await;
                me.state.lock().primary = PrimaryState::Resyncing;
            }
            tracing::info!("mirrored store: the primary answers again; resyncing it");
            me.resync().await;
        }
    }

    async fn resync(&self) {
        loop {
            let next = {
                let st = self.state.lock();
                if st.primary != PrimaryState::Resyncing {
                    return;
                }
                st.to_resync.iter().next().copied()
            };
            let Some(idx) = next else {
                let up = {
                    let _all = self.switch.write().await;
                    let mut st = self.state.lock();
                    let done = st.to_resync.is_empty() && st.primary == PrimaryState::Resyncing;
                    if done {
                        st.primary = PrimaryState::Up;
                    }
                    done
                };
                if up {
                    tracing::info!("mirrored store: the primary is resynchronised and up");
                    if let Err(e) = self.rewrite_journal().await {
                        tracing::warn!(error = %e, "mirrored store: the journal keeps chunks already resynced (they are sent again next time)");
                    }
                    return;
                }
                continue;
            };
            let idx = ChunkIdx(idx);
            let _chunk = self.stripe(idx).lock().await;
            {
                let mut st = self.state.lock();
                st.to_resync.remove(&idx.0);
                st.journal_stale = true;
            }
            let copied = match self.read_mirror(idx, None).await {
                Ok(data) => {
                    let primary = self.primary.clone();
                    self.change_primary(
                        || format!("resyncing {idx}"),
                        Box::pin(async move { primary.write(idx, data).await }),
                    )
                    .await
                }
                Err(e) => Err(e),
            };
            match copied {
                Ok(()) => {
                    self.resynced.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    self.mark_down(&e, [idx.0]);
                    return;
                }
            }
        }
    }
}

impl Mirrored {
    /// Mirrors `primary` onto `mirror` (same geometry). Starts the background tasks on the
    /// current Tokio runtime (panics outside one).
    pub fn new(
        primary: Arc<dyn Store>,
        mirror: Arc<dyn Store>,
        opts: MirrorOptions,
    ) -> StoreResult<Self> {
        Self::with_journal(primary, mirror, opts, None)
    }

    /// [`new`](Self::new), keeping what is owed (chunks the primary must be resynced, chunks
    /// the mirror missed) in the journal file at `journal`, so that it outlives this
    /// process: a journal that owes the primary chunks starts it down (resynced once it
    /// answers). Blocking: reads the journal.
    pub fn with_journal(
        primary: Arc<dyn Store>,
        mirror: Arc<dyn Store>,
        opts: MirrorOptions,
        journal: Option<&std::path::Path>,
    ) -> StoreResult<Self> {
        if primary.geometry() != mirror.geometry() {
            return Err(StoreError::invalid(format!(
                "a mirror must have the primary's geometry: {} and {}",
                primary.geometry(),
                mirror.geometry()
            )));
        }
        let (journal, owed) = match journal {
            Some(path) => {
                let (j, owed) = Journal::open(path)?;
                (Some(Arc::new(Mutex::new(j))), owed)
            }
            None => (None, journal::Owed::default()),
        };
        let chunks = primary.geometry().chunk_count();
        if let Some(bad) = owed
            .to_resync
            .iter()
            .chain(&owed.mirror_missing)
            .find(|i| **i >= chunks)
        {
            return Err(StoreError::new(
                ErrorKind::InvalidInput,
                format!(
                    "the mirror journal names chunk {bad}, past this region's {chunks}: it \
                     belongs to another region"
                ),
            ));
        }
        let primary_state = if owed.to_resync.is_empty() {
            PrimaryState::Up
        } else {
            tracing::warn!(
                chunks = owed.to_resync.len(),
                "mirrored store: the primary missed writes made while it was down (the journal \
                 says so); serving from the mirror until it is resynced"
            );
            PrimaryState::Down
        };
        let any_missing = !owed.mirror_missing.is_empty();
        let shared = Arc::new(Shared {
            primary,
            mirror,
            opts,
            state: Mutex::new(State {
                primary: primary_state,
                to_resync: owed.to_resync,
                mirror_missing: owed.mirror_missing,
                unjournaled: Vec::new(),
                noted_seq: 0,
                journal_stale: false,
                journaled: journal.is_some(),
            }),
            journal,
            journal_io: tokio::sync::Mutex::new(0),
            switch: RwLock::new(()),
            stripes: (0..STRIPES).map(|_| tokio::sync::Mutex::new(())).collect(),
            backlog: Mutex::new(Backlog::default()),
            work: Notify::new(),
            progress: Notify::new(),
            failovers: AtomicU64::new(0),
            fallbacks: AtomicU64::new(0),
            resynced: AtomicU64::new(0),
            any_missing: AtomicBool::new(any_missing),
            stragglers: Arc::default(),
        });
        let mut tasks = vec![tokio::spawn(Shared::resync_loop(
            Arc::downgrade(&shared),
            opts.probe,
        ))];
        if opts.policy == MirrorPolicy::PrimaryFirst {
            for _ in 0..MIRROR_WORKERS {
                tasks.push(tokio::spawn(shared.clone().mirror_worker()));
            }
        }
        Ok(Self { shared, tasks })
    }

    /// The state now.
    pub fn mirror_status(&self) -> MirrorStatus {
        let s = &self.shared;
        let st = s.state.lock();
        MirrorStatus {
            policy: s.opts.policy,
            primary: st.primary,
            to_resync: st.to_resync.len() as u64,
            mirror_missing: st.mirror_missing.len() as u64,
            backlog: s.backlog.lock().pending.len(),
            failovers: s.failovers.load(Ordering::Relaxed),
            fallbacks: s.fallbacks.load(Ordering::Relaxed),
            resynced: s.resynced.load(Ordering::Relaxed),
            stragglers: s.stragglers.count(),
        }
    }

    /// The primary store.
    pub fn primary(&self) -> &Arc<dyn Store> {
        &self.shared.primary
    }

    /// The mirror store.
    pub fn mirror(&self) -> &Arc<dyn Store> {
        &self.shared.mirror
    }
}

impl Store for Mirrored {
    fn geometry(&self) -> Geometry {
        self.shared.primary.geometry()
    }

    fn caps(&self) -> Caps {
        // What both can do: the mirror must be able to stand in for the primary.
        let (p, m) = (self.shared.primary.caps(), self.shared.mirror.caps());
        let mut caps = Caps::NONE;
        for c in [
            Caps::WRITE,
            Caps::FLUSH,
            Caps::TRIM,
            Caps::STATUS,
            Caps::PARALLEL,
        ] {
            if p.contains(c) && m.contains(c) {
                caps = caps | c;
            }
        }
        caps
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(self.shared.read(idx))
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            self.shared.write(idx, data).await?;
            // What the write left owed is on disk before it is acknowledged.
            self.shared.persist().await
        })
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            let s = &self.shared;
            s.drain_backlog().await;
            s.persist().await?;
            if s.state.lock().journal_stale {
                s.rewrite_journal().await?;
            }
            let mirror = s.mirror.flush();
            if s.primary_state() == PrimaryState::Up {
                let (p, m) =
                    tokio::join!(s.on_primary(|| "a flush".into(), s.primary.flush()), mirror);
                if let Err(e) = p {
                    s.mark_down(&e, []);
                }
                m
            } else {
                mirror.await
            }
        })
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            let s = &self.shared;
            s.primary.geometry().check_range(range)?;
            s.drain_backlog().await;
            let _switch = s.switch.read().await;
            let state = s.primary_state();
            let mirror = s.mirror.trim(range);
            if state == PrimaryState::Down {
                mirror.await?;
                s.state.lock().note_resync(range.iter().map(|i| i.0));
                return s.persist().await;
            }
            // Resyncing: a copy of a chunk of the range may be running; the chunks are
            // noted again so that it is redone after the trim.
            let primary = s.primary.clone();
            let (p, m) = tokio::join!(
                s.change_primary(
                    || format!("a trim of {range}"),
                    Box::pin(async move { primary.trim(range).await }),
                ),
                mirror
            );
            m?;
            for idx in range.iter() {
                s.note_mirror(idx.0, true);
            }
            if let Err(e) = p {
                if passes_through(&e) {
                    return Err(e);
                }
                s.mark_down(&e, range.iter().map(|i| i.0));
            } else if state == PrimaryState::Resyncing {
                s.state.lock().note_resync(range.iter().map(|i| i.0));
            }
            s.persist().await
        })
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        Box::pin(async move {
            let s = &self.shared;
            s.primary.geometry().check_idx(idx)?;
            if s.backlog.lock().pending.contains_key(&idx.0) {
                return Ok(ChunkStatus::Data);
            }
            if s.primary_state() == PrimaryState::Up {
                match s
                    .on_primary(|| format!("the status of {idx}"), s.primary.status(idx))
                    .await
                {
                    Ok(st) => return Ok(st),
                    Err(e) if passes_through(&e) => return Err(e),
                    Err(e) => s.mark_down(&e, []),
                }
            }
            s.mirror.status(idx).await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FaultPlan, FaultTrigger, Faulty, OpSet};
    use farmap_testkit::ModelStore;

    fn g() -> Geometry {
        Geometry::new(64 * 4096, 4096).unwrap()
    }

    /// Every operation fails as if the store's server were down.
    fn down() -> FaultPlan {
        FaultPlan {
            ops: OpSet::ALL,
            trigger: FaultTrigger::Always,
            kind: ErrorKind::Unavailable,
        }
    }

    fn opts(policy: MirrorPolicy) -> MirrorOptions {
        MirrorOptions {
            policy,
            timeout: Duration::from_secs(1),
            backlog: 8,
            probe: Duration::from_millis(10),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mirror_of_two_memory_stores_conforms() {
        for policy in [MirrorPolicy::Both, MirrorPolicy::PrimaryFirst] {
            farmap_testkit::run_conformance(|g| async move {
                Arc::new(
                    Mirrored::new(
                        Arc::new(ModelStore::new(g)),
                        Arc::new(ModelStore::new(g)),
                        opts(policy),
                    )
                    .unwrap(),
                ) as Arc<dyn Store>
            })
            .await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn what_the_primary_missed_outlives_the_process_in_the_journal() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state/mirror.journal");
        let primary = Arc::new(Faulty::new(ModelStore::new(g()), FaultPlan::never()));
        let mirror = Arc::new(ModelStore::new(g()));
        let chunk = |v: u8| Bytes::from(vec![v; 4096]);
        let open = || {
            Mirrored::with_journal(
                primary.clone(),
                mirror.clone(),
                MirrorOptions {
                    probe: Duration::from_secs(3600),
                    ..opts(MirrorPolicy::Both)
                },
                Some(&path),
            )
            .unwrap()
        };
        let m = open();
        m.write(ChunkIdx(2), chunk(2)).await.unwrap();
        assert!(!path.exists(), "nothing owed, no journal");
        primary.set_plan(down());
        m.write(ChunkIdx(2), chunk(22)).await.unwrap();
        m.write(ChunkIdx(3), chunk(3)).await.unwrap();
        assert_eq!(m.mirror_status().to_resync, 2);
        // The process ends before the primary is back; the primary comes back, stale.
        drop(m);
        primary.set_plan(FaultPlan::never());
        assert_eq!(primary.read(ChunkIdx(2)).await.unwrap(), chunk(2), "stale");
        // The next process does not read the stale primary: it starts it down and owes it
        // the two chunks.
        let m = open();
        let st = m.mirror_status();
        assert_eq!(
            (st.primary, st.to_resync),
            (PrimaryState::Down, 2),
            "{st:?}"
        );
        assert_eq!(m.read(ChunkIdx(2)).await.unwrap(), chunk(22));
        drop(m);
        // With probes, it is resynced, and the journal goes.
        let m = Mirrored::with_journal(
            primary.clone(),
            mirror.clone(),
            opts(MirrorPolicy::Both),
            Some(&path),
        )
        .unwrap();
        for _ in 0..500 {
            if m.mirror_status().primary == PrimaryState::Up {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(m.mirror_status().primary, PrimaryState::Up);
        assert_eq!(primary.read(ChunkIdx(2)).await.unwrap(), chunk(22));
        assert_eq!(primary.read(ChunkIdx(3)).await.unwrap(), chunk(3));
        // (Rewritten just after the switch to up.)
        for _ in 0..500 {
            if !path.exists() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!path.exists(), "nothing owed: the journal is removed");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_primary_is_served_around_then_resynced() {
        for policy in [MirrorPolicy::Both, MirrorPolicy::PrimaryFirst] {
            let primary = Arc::new(Faulty::new(ModelStore::new(g()), FaultPlan::never()));
            let mirror = Arc::new(ModelStore::new(g()));
            let m = Mirrored::new(primary.clone(), mirror.clone(), opts(policy)).unwrap();
            let chunk = |v: u8| Bytes::from(vec![v; 4096]);
            m.write(ChunkIdx(1), chunk(1)).await.unwrap();
            m.write(ChunkIdx(2), chunk(2)).await.unwrap();
            primary.set_plan(down());
            // No error reaches the caller.
            m.write(ChunkIdx(2), chunk(22)).await.unwrap();
            m.write(ChunkIdx(3), chunk(3)).await.unwrap();
            assert_eq!(m.mirror_status().primary, PrimaryState::Down);
            assert_eq!(m.read(ChunkIdx(1)).await.unwrap(), chunk(1));
            assert_eq!(m.read(ChunkIdx(2)).await.unwrap(), chunk(22));
            assert_eq!(m.mirror_status().to_resync, 2, "{policy:?}");
            // The primary comes back: only the chunks written meanwhile are copied.
            primary.set_plan(FaultPlan::never());
            for _ in 0..500 {
                if m.mirror_status().primary == PrimaryState::Up {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let st = m.mirror_status();
            assert_eq!(st.primary, PrimaryState::Up, "{st:?}");
            assert_eq!(st.resynced, 2, "{st:?}");
            assert_eq!(primary.inner().read(ChunkIdx(2)).await.unwrap(), chunk(22));
            assert_eq!(primary.inner().read(ChunkIdx(3)).await.unwrap(), chunk(3));
            m.flush().await.unwrap();
            assert_eq!(mirror.read(ChunkIdx(1)).await.unwrap(), chunk(1));
        }
    }

    /// A primary whose writes, while `held`, wait until released (a request stuck in a
    /// partitioned connection), and then land: like a request already sent, a write goes on
    /// when its caller stops waiting for it.
    #[derive(Debug)]
    struct Held {
        inner: Arc<ModelStore>,
        held: std::sync::atomic::AtomicBool,
        release: tokio::sync::watch::Sender<bool>,
    }

    impl Store for Held {
        fn geometry(&self) -> Geometry {
            self.inner.geometry()
        }
        fn caps(&self) -> Caps {
            self.inner.caps()
        }
        fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
            self.inner.read(idx)
        }
        fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
            let held = self.held.load(Ordering::SeqCst);
            let mut released = self.release.subscribe();
            let inner = self.inner.clone();
            let sent = tokio::spawn(async move {
                if held {
                    let _ = released.wait_for(|r| *r).await;
                }
                inner.write(idx, data).await
            });
            Box::pin(async move { sent.await.expect("the write task") })
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

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_that_timed_out_cannot_land_after_the_resync() {
        let primary = Arc::new(Held {
            inner: Arc::new(ModelStore::new(g())),
            held: std::sync::atomic::AtomicBool::new(true),
            release: tokio::sync::watch::channel(false).0,
        });
        let mirror = Arc::new(ModelStore::new(g()));
        let options = MirrorOptions {
            timeout: Duration::from_millis(100),
            ..opts(MirrorPolicy::Both)
        };
        let m = Mirrored::new(primary.clone(), mirror.clone(), options).unwrap();
        let chunk = |v: u8| Bytes::from(vec![v; 4096]);
        // Version 1 times out on the primary (the mirror has it): the primary is down, and
        // the write is still on its way.
        m.write(ChunkIdx(5), chunk(1)).await.unwrap();
        assert_eq!(m.mirror_status().primary, PrimaryState::Down);
        assert_eq!(m.mirror_status().stragglers, 1);
        // Version 2 goes to the mirror only, noted for the resync.
        m.write(ChunkIdx(5), chunk(2)).await.unwrap();
        // The primary answers probes again, but version 1 has not landed yet: no resync.
        primary.held.store(false, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let st = m.mirror_status();
        assert_eq!(st.primary, PrimaryState::Down, "{st:?}");
        assert_eq!(st.resynced, 0, "{st:?}");
        // Version 1 lands; then the resync copies version 2 over it.
        primary.release.send_replace(true);
        for _ in 0..500 {
            if m.mirror_status().primary == PrimaryState::Up {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let st = m.mirror_status();
        assert_eq!(st.primary, PrimaryState::Up, "{st:?}");
        assert_eq!(st.stragglers, 0, "{st:?}");
        assert_eq!(
            primary.inner.read(ChunkIdx(5)).await.unwrap(),
            chunk(2),
            "the primary holds the newest version, not the late one"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn chunks_the_mirror_missed_are_noted_until_written_again() {
        // Exercises the lock-free path of `note_mirror`: a missing mark must be set by a
        // failed mirror write, cleared by the next successful one, and set again after that.
        let mirror = Arc::new(Faulty::new(ModelStore::new(g()), FaultPlan::never()));
        let m = Mirrored::new(
            Arc::new(ModelStore::new(g())),
            mirror.clone(),
            opts(MirrorPolicy::Both),
        )
        .unwrap();
        let chunk = |v: u8| Bytes::from(vec![v; 4096]);
        let fail_writes = || FaultPlan {
            ops: OpSet::WRITE,
            trigger: FaultTrigger::Always,
            kind: ErrorKind::Unavailable,
        };
        m.write(ChunkIdx(1), chunk(1)).await.unwrap();
        assert_eq!(m.mirror_status().mirror_missing, 0);
        for round in 0..2u8 {
            mirror.set_plan(fail_writes());
            // The primary took them: the writes succeed, the mirror's misses are noted.
            m.write(ChunkIdx(1), chunk(10 + round)).await.unwrap();
            m.write(ChunkIdx(2), chunk(20 + round)).await.unwrap();
            assert_eq!(m.mirror_status().mirror_missing, 2, "round {round}");
            mirror.set_plan(FaultPlan::never());
            m.write(ChunkIdx(1), chunk(30 + round)).await.unwrap();
            assert_eq!(m.mirror_status().mirror_missing, 1, "round {round}");
            m.write(ChunkIdx(2), chunk(40 + round)).await.unwrap();
            assert_eq!(m.mirror_status().mirror_missing, 0, "round {round}");
            assert_eq!(
                mirror.inner().read(ChunkIdx(2)).await.unwrap(),
                chunk(40 + round)
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_corrupt_primary_chunk_is_served_from_the_mirror() {
        let inner = ModelStore::new(crate::VerifiedLayout::inner_geometry_for(g()));
        let faulty = Arc::new(Faulty::new(inner, FaultPlan::never()));
        let verified = Arc::new(
            crate::Verified::open(faulty.clone(), Some(g().size()))
                .await
                .unwrap(),
        );
        let m = Mirrored::new(
            verified,
            Arc::new(ModelStore::new(g())),
            opts(MirrorPolicy::Both),
        )
        .unwrap();
        let data = Bytes::from(vec![9u8; 4096]);
        m.write(ChunkIdx(5), data.clone()).await.unwrap();
        faulty.set_data_faults(crate::DataFaults {
            corrupt_reads: 1_000_000,
            ..crate::DataFaults::none()
        });
        assert_eq!(m.read(ChunkIdx(5)).await.unwrap(), data);
        let st = m.mirror_status();
        assert_eq!((st.primary, st.fallbacks), (PrimaryState::Up, 1));
    }
}
