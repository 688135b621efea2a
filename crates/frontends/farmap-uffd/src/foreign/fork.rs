//! A program's fork (docs/design/farmap-run.md §3.6): its child gets a whole copy of the
//! heap, as plain memory, served by nobody.
//!
//! ```text
//!  program, before fork()           ForkPrepare ──▶  fence: the pager's data holds still;
//!                                   ◀── Verdict{0}   where each chunk's content is, noted
//!  fork(): the kernel copies the region's mapped pages (copy-on-write) and queues
//!  UFFD_EVENT_FORK with the child's userfaultfd ──▶ the reader hands it here: a thread
//!  copies every chunk the child lacks (staged: from its slot; written back: from the
//!  store) with UFFDIO_COPY on the child's fd, then closes that fd (the child's region is
//!  then unregistered: never-written pages fill with zeros as in any private mapping)
//!  the parent's reaper writes nothing to each of its present pages (a compare-and-swap of a
//!  word with itself):
//!  they are its own again (UFFDIO_MOVE refuses a page a fork shared, and reclaim could not
//!  move them until the parent wrote them)
//!  child (waits in its atfork handler) ◀── Verdict{0}: runs on; the fence ends
//! ```
//!
//! The child is not bounded: it holds its whole heap, as a child of a program with no swap
//! would once it had touched every page. A fork that no `ForkPrepare` announced (the raw
//! system call, glibc's `_Fork`) is copied all the same, from a fence taken when its event
//! arrives: chunks the parent moved meanwhile may reach the child as newer content, and
//! the child may run before its copy is whole (counted in `forks_unpaused`).

use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};

use farmap_core::{ChunkIdx, ChunkRange, Geometry, Store};
use parking_lot::Mutex;
use tokio::runtime::Handle;

use crate::paging::{ForkFence, ForkSnapshot, Pager, Source};
use crate::uffd::{CopyError, Uffd, UffdRange};

/// Chunks read at once (one store read, one slot read).
const RUN: usize = 64;

/// What a child's copy came to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ForkCopy {
    /// Bytes copied from staging slots.
    pub from_slots: u64,
    /// Bytes copied from the store.
    pub from_store: u64,
}

/// The fork counters of a program's region.
#[derive(Debug, Default)]
pub(crate) struct ForkCounters {
    pub forks: AtomicU64,
    pub unpaused: AtomicU64,
    pub failed: AtomicU64,
    pub bytes: AtomicU64,
    /// Bytes of the parent's pages made its own again after forks.
    pub unshared: AtomicU64,
}

/// A fork announced and paused for, waiting for its event.
struct Prepared {
    id: u64,
    fence: Arc<ForkFence>,
    snapshot: Arc<ForkSnapshot>,
    done: mpsc::Sender<Result<ForkCopy, String>>,
}

/// The forks of one program's region.
pub(crate) struct Forks {
    pager: Arc<Pager>,
    store: Arc<dyn Store>,
    geometry: Geometry,
    base: usize,
    features: u64,
    rt: Handle,
    prepared: Mutex<Option<Prepared>>,
    next_id: AtomicU64,
    pub(crate) counters: ForkCounters,
}

impl Forks {
    pub(crate) fn new(
        pager: Arc<Pager>,
        store: Arc<dyn Store>,
        base: usize,
        features: u64,
        rt: Handle,
    ) -> Forks {
        Forks {
            geometry: store.geometry(),
            pager,
            store,
            base,
            features,
            rt,
            prepared: Mutex::new(None),
            next_id: AtomicU64::new(1),
            counters: ForkCounters::default(),
        }
    }

    /// Pauses the pager for a fork the program announced: returns once nothing moves, with
    /// the id of this preparation and the channel that says how the child's copy went.
    /// Blocks (not on a runtime thread).
    pub(crate) fn prepare(&self) -> (u64, mpsc::Receiver<Result<ForkCopy, String>>) {
        let (fence, snapshot) = self.pager.fork_fence();
        let (tx, rx) = mpsc::channel();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        *self.prepared.lock() = Some(Prepared {
            id,
            fence,
            snapshot: Arc::new(snapshot),
            done: tx,
        });
        (id, rx)
    }

    /// Whether preparation `id` still waits for its fork's event.
    pub(crate) fn waiting(&self, id: u64) -> bool {
        self.prepared.lock().as_ref().is_some_and(|p| p.id == id)
    }

    /// Preparation `id` is over: if no fork event took it, its pause ends.
    pub(crate) fn unprepare(&self, id: u64) {
        let mut p = self.prepared.lock();
        if p.as_ref().is_some_and(|p| p.id == id) {
            *p = None;
        }
    }

    /// A fork's event: copies what the child lacks on a thread of its own (the reader must
    /// not wait), then closes `child` (the child's userfaultfd).
    pub(crate) fn on_fork(self: &Arc<Self>, child: OwnedFd) {
        Counters::add(&self.counters.forks);
        let prepared = self.prepared.lock().take();
        let me = self.clone();
        let spawned = std::thread::Builder::new()
            .name("farmap-run-fork".into())
            .spawn(move || {
                let (fence, snapshot, done) = match prepared {
                    Some(p) => (p.fence, p.snapshot, Some(p.done)),
                    None => {
                        Counters::add(&me.counters.unpaused);
                        let (fence, snapshot) = me.pager.fork_fence();
                        (fence, Arc::new(snapshot), None)
                    }
                };
                let copied = me.copy(child, &snapshot).map_err(|e| e.to_string());
                match &copied {
                    Ok(c) => {
                        me.counters
                            .bytes
                            .fetch_add(c.from_slots + c.from_store, Ordering::Relaxed);
                    }
                    Err(e) => {
                        Counters::add(&me.counters.failed);
                        tracing::warn!("copying a forked child's heap: {e}");
                    }
                }
                // The child may run on.
                if let Some(done) = done {
                    let _ = done.send(copied);
                }
                // The pages the fork shared stay the parent's to move: still under the fence
                // (the reaper's faults, if any, need no reaper then).
                match me.pager.unshare_present() {
                    Ok(n) => {
                        me.counters.unshared.fetch_add(n, Ordering::Relaxed);
                    }
                    Err(e) => tracing::warn!("making the parent's pages its own again: {e}"),
                }
                drop(fence);
            });
        if let Err(e) = spawned {
            Counters::add(&self.counters.failed);
            tracing::warn!("cannot start a thread for a forked child's heap: {e}");
        }
    }

    /// Copies every chunk the child lacks into its region (see the module docs), then
    /// closes its userfaultfd.
    fn copy(&self, child: OwnedFd, snapshot: &ForkSnapshot) -> io::Result<ForkCopy> {
        let uffd = Arc::new(Uffd::from_owned(child, self.features));
        let range = UffdRange::new(uffd, self.base, self.geometry.size() as usize);
        let chunk = self.geometry.chunk_size() as usize;
        let mut out = ForkCopy::default();
        let mut buf = vec![0u8; RUN * chunk];
        let mut run: Vec<u64> = Vec::with_capacity(RUN);
        let mut kind = Source::Region;
        let mut pending = snapshot.elsewhere().peekable();
        while let Some((i, source)) = pending.next() {
            if run.is_empty() {
                kind = source;
            }
            run.push(i);
            let next_joins = pending
                .peek()
                .is_some_and(|&(j, s)| s == kind && j == i + 1 && run.len() < RUN);
            if next_joins {
                continue;
            }
            let bytes = run.len() * chunk;
            let data = &mut buf[..bytes];
            match kind {
                Source::Slot => {
                    if !self.pager.read_slots(run[0], data) {
                        return Err(io::Error::other(format!(
                            "reading staged chunks {}..{} of the parent",
                            run[0],
                            run[0] + run.len() as u64
                        )));
                    }
                    out.from_slots += bytes as u64;
                }
                Source::Store => {
                    let r = ChunkRange::new(ChunkIdx(run[0]), ChunkIdx(run[0] + run.len() as u64));
                    let chunks = self
                        .rt
                        .block_on(self.store.read_chunks(r))
                        .map_err(|e| io::Error::other(farmap_core::error_chain(&e)))?;
                    for (k, c) in chunks.iter().enumerate() {
                        let at = k * chunk;
                        let n = c.len().min(chunk);
                        data[at..at + n].copy_from_slice(&c[..n]);
                        data[at + n..at + chunk].fill(0);
                    }
                    out.from_store += bytes as u64;
                }
                Source::Region => unreachable!("only chunks elsewhere are listed"),
            }
            for (k, &i) in run.iter().enumerate() {
                let off = self.geometry.offset_of(ChunkIdx(i)) as usize;
                install(&range, off, &data[k * chunk..(k + 1) * chunk])?;
            }
            run.clear();
        }
        // `range` (the child's fd) closes here: its region is unregistered, and threads
        // that faulted on never-written pages fault again and get zeros.
        Ok(out)
    }
}

/// Copies `data` to `off` in the child's region; a page it has already is left alone.
fn install(range: &UffdRange, off: usize, data: &[u8]) -> io::Result<()> {
    let page = range.page_size();
    let mut at = 0;
    while at < data.len() {
        match range.copy(off + at, &data[at..], 0) {
            Ok(_) => return Ok(()),
            Err(CopyError::Exists) => at += page,
            Err(CopyError::Partial(n)) => at += n,
            // An event of the child's (its own discard, its own fork) holds its copies
            // back until it is read: nobody else reads this fd.
            Err(CopyError::EventPending) => drain_events(range)?,
            Err(CopyError::Gone) => {
                return Err(io::Error::other("the forked child is gone"));
            }
            Err(CopyError::Os(e)) => return Err(io::Error::from_raw_os_error(e)),
        }
    }
    Ok(())
}

/// Reads the child's pending events so that copies go on: a discard's range is zapped once
/// its event is read (zeros, as the child asked); a grandchild's userfaultfd is closed (its
/// copy of the region reads zeros where pages are missing: the child forked from an atfork
/// handler that ran before ours, counted as failed).
fn drain_events(range: &UffdRange) -> io::Result<()> {
    let mut msgs = [crate::sys::UffdMsg::default(); 16];
    let n = match range.uffd().read_messages(&mut msgs) {
        Ok(n) => n,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
        Err(e) => return Err(e),
    };
    for m in &msgs[..n] {
        if let Some(grandchild) = crate::uffd::fork_event_fd(m) {
            drop(grandchild);
            return Err(io::Error::other(
                "the forked child forked again before its heap was whole",
            ));
        }
    }
    if n == 0 {
        std::thread::yield_now();
    }
    Ok(())
}

/// Adds one to a counter.
struct Counters;

impl Counters {
    fn add(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}
