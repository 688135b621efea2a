//! [`RegionMemory`]: the region's memory seen as a [`Store`], so that the pipeline's
//! [`Cached`](farmap_pipeline::Cached) fills it and its [`Pusher`](farmap_pipeline::Pusher)
//! reads it.

use std::fmt;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use farmap_core::{
    BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, Store, StoreError,
    StoreResult,
};
use farmap_pipeline::Cached;
use parking_lot::RwLock;
use tokio::sync::Notify;

use crate::shared::SharedBase;
use crate::space::Area;
use crate::stats::Counters;
use crate::uffd::{InstallError, UffdRange};

/// How long a copy waits for the handler to read a pending event before trying again (the
/// remover may take a moment to finish after its event was read: copies fail until it has
/// returned; the pager's own discards bump the generation again once they return).
const EVENT_RETRY: Duration = Duration::from_millis(1);

/// The cache over a region: its memory in front of the store.
pub(crate) type RegionCache = Cached<Arc<RegionMemory>, Arc<dyn Store>>;

/// Where a push finds a chunk's content (see [`PushReads::read_for_push`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PushRead {
    /// Copied out of the staging slot.
    Copied,
    /// Active and pinned: read the region, then [`PushReads::unpin`].
    Pinned,
    /// Remote: the store holds its newest content.
    NotLocal,
    /// Never written, or removed (its pages discarded, which means zeros): zeros.
    Zero,
    /// Being fetched, or its pages are being moved (a move met a busy page): ask again in a
    /// moment.
    Busy,
}

/// What bounded local memory (the region's pager) decides for the reads of a push (a chunk
/// that is staged, remote or never written is not read out of the region, whose pages may
/// be missing) and for installs (nothing goes into a removed chunk). Implemented by the
/// pager, which sits above this memory.
pub(crate) trait PushReads: Send + Sync {
    /// Where chunk `idx`'s content is (copied into `buf` when staged or zero).
    fn read_for_push(&self, idx: ChunkIdx, buf: &mut [u8]) -> PushRead;
    /// Ends the pin of [`PushRead::Pinned`].
    fn unpin(&self, idx: ChunkIdx);
    /// The store behind the region, for chunks that are not local.
    fn remote_store(&self) -> Option<Arc<dyn Store>>;
    /// Records an installed chunk in the pager's trace.
    fn trace_install(&self, idx: ChunkIdx, copied_pages: usize, present_pages: usize);
    /// Whether installs pass the remove gate ([`install_refused`](Self::install_refused)).
    fn gates_installs(&self) -> bool;
    /// Whether chunk `idx` was removed, so that nothing may be installed into it; asked with
    /// the events' order held shared across the question and the copy.
    fn install_refused(&self, idx: ChunkIdx) -> bool;
}

/// What an install of a chunk came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Landed {
    /// Its missing pages were filled.
    Installed,
    /// Refused: the application discarded the chunk's pages meanwhile, which means zeros
    /// (the pager's remove gate); nothing was installed.
    Removed,
}

/// A generation counter the handler bumps after reading events, for copies that must wait
/// for pending events to be read (`EAGAIN`), and the order of the readers' batches.
#[derive(Debug, Default)]
pub(crate) struct Events {
    generation: AtomicU64,
    notify: Notify,
    /// Held exclusively by a fault reader from its read of messages to the end of its
    /// handling of the events among them (the server module's docs).
    order: RwLock<()>,
    /// Remove events mark chunks dirty (a pager whose removed chunks read as zeros): a scan
    /// for written pages must not miss both a write and the mark of the remove that zapped
    /// its page ([`settle`](Self::settle)).
    removes_mark: AtomicBool,
}

impl Events {
    /// The readers' order: see the field.
    pub fn order(&self) -> &RwLock<()> {
        &self.order
    }

    /// Remove events mark the chunks they cover dirty from now on (see
    /// [`settle`](Self::settle)).
    pub fn removes_mark(&self) {
        self.removes_mark.store(true, Ordering::Release);
    }

    /// When remove events mark chunks dirty: waits until the events read so far are
    /// handled. A scan for written pages calls it after its walk: the remover zaps its range
    /// as soon as its event is read, before the reader handles it, so a page written and
    /// then zapped under the walk is missing from it, and its chunk's mark must be in before
    /// the scan's caller takes the marks.
    pub fn settle(&self) {
        if self.removes_mark.load(Ordering::Acquire) {
            drop(self.order.read());
        }
    }

    /// The current generation.
    pub fn current(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Events were read: wake the waiting copies.
    pub fn bump(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.notify.notify_waiters();
    }

    /// Waits until the generation moves past `seen`, or [`EVENT_RETRY`] passes.
    pub async fn wait_past(&self, seen: u64) {
        let mut notified = pin!(self.notify.notified());
        notified.as_mut().enable();
        if self.current() != seen {
            return;
        }
        let _ = tokio::time::timeout(EVENT_RETRY, notified).await;
    }
}

/// The region's memory as a store over the region's geometry.
///
/// - `write` installs a chunk with `UFFDIO_COPY` (write-protected when tracking writes): only
///   missing pages are filled, present ones keep their (newer) content. It is what a fetch of
///   [`Cached`](farmap_pipeline::Cached) calls; nothing else writes.
/// - `read` copies the chunk out of the mapping on a blocking thread (a missing page faults
///   and waits for the handler, which runs elsewhere). In a process that serves another
///   process's region there is no mapping, and `read` fails with `Unsupported`.
/// - `flush` does nothing; `trim` is unsupported; `status` is unknown.
pub(crate) struct RegionMemory {
    range: UffdRange,
    geometry: Geometry,
    write_protect: bool,
    mapping: Option<Area>,
    events: Arc<Events>,
    counters: Arc<Counters>,
    /// Bounded local memory: staged chunks are read out of their staging slot.
    pager: Option<Arc<dyn PushReads>>,
    /// Clean pages shared with other regions: chunks of the base are mapped from its file.
    shared: Option<Arc<SharedBase>>,
}

impl RegionMemory {
    pub fn new(
        range: UffdRange,
        geometry: Geometry,
        write_protect: bool,
        mapping: Option<Area>,
        events: Arc<Events>,
        counters: Arc<Counters>,
        pager: Option<Arc<dyn PushReads>>,
    ) -> Self {
        Self {
            range,
            geometry,
            write_protect,
            mapping,
            events,
            counters,
            pager,
            shared: None,
        }
    }

    /// Maps the chunks of `shared`'s base from its file (see the `shared` module).
    pub fn with_shared(mut self, shared: Option<Arc<SharedBase>>) -> Self {
        self.shared = shared;
        self
    }

    /// Copies chunk `idx` out of the mapping on the calling thread (which must not be one the
    /// handler depends on).
    pub fn read_now(&self, idx: ChunkIdx) -> StoreResult<Bytes> {
        self.geometry.check_idx(idx)?;
        let Some(mapping) = &self.mapping else {
            return Err(StoreError::new(
                ErrorKind::Unsupported,
                "this process serves another process's region and cannot read its memory",
            ));
        };
        let mut buf = vec![0u8; self.geometry.chunk_len(idx)];
        if !mapping.read(self.geometry.offset_of(idx) as usize, &mut buf) {
            return Err(StoreError::new(ErrorKind::Closed, "the region is unmapped"));
        }
        Ok(Bytes::from(buf))
    }

    /// Installs chunk `idx` from `data` (see the type's docs), unless the pager's remove
    /// gate refuses it.
    pub async fn install(&self, idx: ChunkIdx, data: Bytes) -> StoreResult<Landed> {
        self.geometry.check_write(idx, data.len())?;
        let offset = self.geometry.offset_of(idx) as usize;
        // A chunk of the base goes through the shared file (filled once, checked), and is
        // mapped from it; anything else is a private copy.
        let from_base = self
            .shared
            .as_ref()
            .is_some_and(|s| s.is_base(idx) && s.fill(idx, &data));
        if from_base {
            Counters::add(&self.counters.base_mapped, 1);
        }
        let gate = self.pager.as_ref().filter(|p| p.gates_installs());
        let mut from = 0;
        loop {
            let seen = self.events.current();
            let done = {
                // The gate: no remove event is handled from the question to the copy.
                let _order = gate.map(|_| self.events.order().read());
                if gate.is_some_and(|p| p.install_refused(idx)) {
                    return Ok(Landed::Removed);
                }
                if from_base {
                    self.range
                        .map_cached(offset, data.len(), from, self.write_protect)
                } else {
                    self.range.install(offset, &data, from, self.write_protect)
                }
            };
            match done {
                Ok(done) => {
                    if let Some(p) = &self.pager {
                        p.trace_install(idx, done.copied_pages, done.present_pages);
                    }
                    let bytes = (done.copied_pages * self.range.page_size()) as u64;
                    Counters::add(&self.counters.chunks_fetched, 1);
                    Counters::add(&self.counters.bytes_fetched, bytes);
                    return Ok(Landed::Installed);
                }
                Err(InstallError::EventPending { done }) => {
                    from = done;
                    self.events.wait_past(seen).await;
                }
                Err(InstallError::Gone) => {
                    return Err(StoreError::new(
                        ErrorKind::Closed,
                        format!("installing {idx}: the region is gone"),
                    ))
                }
                Err(InstallError::Os(e)) => {
                    let how = if from_base {
                        "UFFDIO_CONTINUE"
                    } else {
                        "UFFDIO_COPY"
                    };
                    return Err(StoreError::io(
                        format!("installing {idx} with {how}"),
                        std::io::Error::from_raw_os_error(e),
                    ));
                }
            }
        }
    }
}

impl fmt::Debug for RegionMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegionMemory")
            .field("range", &self.range)
            .field("geometry", &self.geometry)
            .field("write_protect", &self.write_protect)
            .field("local", &self.mapping.is_some())
            .finish()
    }
}

impl Store for RegionMemory {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn caps(&self) -> Caps {
        Caps::WRITE | Caps::PARALLEL
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            self.geometry.check_idx(idx)?;
            let (Some(mapping), geometry) = (self.mapping.clone(), self.geometry) else {
                return self.read_now(idx);
            };
            let pager = self.pager.clone();
            let paged = pager.clone();
            if let Some(pager) = &pager {
                // A bounded region's chunk that is staged, remote or never written is
                // decided (and a staged one copied out of its slot) under the pager's lock
                // without touching a page of the region that can be missing: here, with no
                // blocking thread (a hand-off per chunk cost more than the copy; the
                // write-backs of a paging run are mostly such chunks).
                let mut buf = vec![0u8; geometry.chunk_len(idx)];
                match pager.read_for_push(idx, &mut buf) {
                    PushRead::Copied | PushRead::Zero => return Ok(Bytes::from(buf)),
                    PushRead::NotLocal => {
                        return match pager.remote_store() {
                            Some(store) => store.read(idx).await,
                            None => Err(StoreError::new(ErrorKind::Closed, "the region is closed")),
                        }
                    }
                    // An active chunk is read out of the region, which goes to a blocking
                    // thread (below, where it is pinned again); being fetched or moved: waited
                    // for there.
                    PushRead::Pinned => pager.unpin(idx),
                    PushRead::Busy => {}
                }
            }
            let copy = tokio::task::spawn_blocking(move || {
                let mut buf = vec![0u8; geometry.chunk_len(idx)];
                let offset = geometry.offset_of(idx) as usize;
                let Some(pager) = pager else {
                    return Some(mapping.read(offset, &mut buf).then(|| Bytes::from(buf)));
                };
                // A bounded region: never read a page of the region that can be missing
                // (see `PushReads::read_for_push`).
                loop {
                    match pager.read_for_push(idx, &mut buf) {
                        PushRead::Copied => return Some(Some(Bytes::from(buf))),
                        PushRead::Pinned => {
                            let ok = mapping.read(offset, &mut buf);
                            pager.unpin(idx);
                            // A program's page read from here is missing (EIO) when the
                            // program discarded it and the reader has not handled the
                            // remove yet: ask again once it has (the chunk is zero then).
                            if !ok && mapping.is_foreign() && mapping.while_mapped(|| ()).is_some()
                            {
                                std::thread::sleep(EVENT_RETRY);
                                continue;
                            }
                            return Some(ok.then(|| Bytes::from(buf)));
                        }
                        PushRead::NotLocal => return None,
                        PushRead::Zero => return Some(Some(Bytes::from(buf))),
                        // A fetch or a move in progress. Once the region is unmapped (it
                        // is closing, and its fetches may never finish), give up.
                        PushRead::Busy => {
                            if mapping.while_mapped(|| ()).is_none() {
                                return Some(None);
                            }
                            std::thread::sleep(EVENT_RETRY)
                        }
                    }
                }
            });
            match copy.await {
                Ok(Some(Some(data))) => Ok(data),
                Ok(Some(None)) => Err(StoreError::new(ErrorKind::Closed, "the region is unmapped")),
                // Not local: the store holds the newest content; writing it back is a no-op.
                Ok(None) => match paged.and_then(|p| p.remote_store()) {
                    Some(store) => store.read(idx).await,
                    None => Err(StoreError::new(ErrorKind::Closed, "the region is closed")),
                },
                Err(e) => Err(StoreError::new(
                    ErrorKind::Cancelled,
                    format!("reading {idx} out of the region: {e}"),
                )),
            }
        })
    }

    /// Installs the chunk; a chunk removed meanwhile gets nothing, which is not an error
    /// (its pages read as zeros).
    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move { self.install(idx, data).await.map(|_| ()) })
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async { Ok(()) })
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            self.geometry.check_range(range)?;
            Err(StoreError::new(
                ErrorKind::Unsupported,
                "region memory is not trimmed through the store interface",
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
