//! The fault server: what happens to each userfaultfd message, in the region's own process or
//! in a process the region's fd was handed to.
//!
//! ```text
//!   reader thread (one per server)         region runtime (tokio, N workers)
//!   ─────────────────────────────          ─────────────────────────────────
//!   poll(uffd, stop) → read ≤ 64 msgs
//!   1. events first: REMOVE → evict the
//!      chunks, bump the event generation ──▶ copies waiting on EAGAIN retry
//!   2. each fault: build its future, poll
//!      it once right here ── Ready: done (a memory store: no thread hop)
//!                         └─ Pending ──────▶ spawned: fetch (Cached dedups with the
//!                                            puller and other faults) → UFFDIO_COPY|WP
//!                                            wakes the faulting thread; or UFFDIO_POISON
//! ```
//!
//! With [`FaultWait::Sleep`] (the default) there is one reader per CPU the process may run
//! on (at most [`MAX_READERS`]), each kept to its CPU. A fault wakes every reader blocked in
//! `poll(2)`; the one on the faulting thread's CPU runs as soon as that thread sleeps, with no
//! idle CPU to wake, and its copy wakes the faulting thread on the same CPU: on this VM about
//! 10 µs a fault, against about 50 µs for a single reader on another, idle CPU. A reader that
//! has no business on its CPU stops polling for [`DORMANT`], and so stops costing each fault
//! a wake-up of its CPU: when its wake-ups keep finding nothing to read (another reader was
//! first), or when the faulting threads of what it reads run on other CPUs only (looked up
//! in `/proc` at most every [`CPU_CHECK_EVERY`]). One reader always stays. A reader holds
//! the events' order (`Events::order`, exclusively) from its read until it has handled the
//! events among what it read (faults after that), so every message read after an event is
//! handled after the event, as with a single reader (a remove event clears written marks
//! that a later fault may set again).
//!
//! With [`FaultWait::Poll`] one reader, after each batch, goes on reading without blocking
//! for the window before it returns to `poll(2)`, and idle-priority companions keep the CPUs
//! awake meanwhile: see the `polling` module.
//!
//! The reader never blocks on a fetch and never touches region memory, and neither do the
//! runtime's async workers: only blocking threads (pushes) and application threads read the
//! memory, so a fault they take is always served.

use std::fmt;
use std::future::Future;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use farmap_core::{ChunkIdx, Geometry, Store};
use farmap_pipeline::{retry, Puller, RetryPolicy};
use parking_lot::RwLock;
use rustix::event::{eventfd, poll, EventfdFlags, PollFd, PollFlags};
use tokio::runtime::Handle;

use crate::memory::{Events, Landed, RegionCache};
use crate::options::FaultWait;
use crate::pagemap::Pagemap;
use crate::paging::{Admit, Pager};
use crate::polling::{affinity_cpus, keep_to_cpu, Companions, HandlerAccounts, PollWindow};
use crate::signal::SignalPath;
use crate::stats::{Counters, HandlerCpu};
use crate::sys::{self, UffdMsg};
use crate::tracking::PageBits;
use crate::uffd::UffdRange;

type FaultFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Takes a forked child's userfaultfd (see [`Server::fork`]); called by the reader under the
/// events' order, so it must not wait.
pub(crate) type ForkHook = Box<dyn Fn(OwnedFd) + Send + Sync>;

/// Messages read per `read(2)`.
const BATCH: usize = 64;

/// Most readers of a sleeping server (one per CPU, on the first CPUs of the process's
/// affinity).
pub(crate) const MAX_READERS: usize = 8;

/// Wake-ups in a row that found nothing to read after which a reader stops polling for
/// [`DORMANT`] (when another reader still polls).
const SPURIOUS_LIMIT: u32 = 8;

/// How often at most a reader looks up on which CPU the thread of a fault it read runs (a
/// read of `/proc`, a few µs); one on another CPU sends the reader to rest.
const CPU_CHECK_EVERY: Duration = Duration::from_micros(200);

/// How long a resting reader stays out of `poll(2)`. A fault on its CPU meanwhile is served
/// by another CPU's reader, slower (a wake-up of that CPU).
///
/// Measured (`farmap bench uffd --case fault-4k`, one unpinned thread faulting, 2-CPU VM):
/// 1, 2, 5 and 20 ms all gave a p50 of 10-11 µs; at 5 ms the other reader rests about 50
/// times in 20,000 faults. Calling a resting reader back as soon as another saw a fault from
/// its CPU made it worse (12-16 µs): the faulting thread moves between CPUs now and then, and
/// the readers took turns.
pub(crate) const DORMANT: Duration = Duration::from_millis(5);

/// A reader that saw a fault from its own CPU this recently does not rest, whatever else it
/// sees (the faults of a process whose threads run on several CPUs). Measured as above: 0 and
/// 1 ms gave 10-12 µs, 5 ms 12-17 µs (a faulting thread that moved kept both readers up).
const HOME_WINDOW: Duration = Duration::from_millis(1);

/// Everything a fault needs, shared by the reader thread and the tasks it spawns.
pub(crate) struct Server {
    pub range: UffdRange,
    pub geometry: Geometry,
    pub cache: Arc<RegionCache>,
    /// The page tables of the region's process (to check whether a faulted page is really
    /// missing when its chunk is thought present).
    pub pagemap: Pagemap,
    pub puller: RwLock<Option<Arc<Puller>>>,
    pub readahead: u64,
    pub fetch_retry: RetryPolicy,
    /// Pages written, recorded by write-protect faults (synchronous tracking only).
    pub written: Option<Arc<PageBits>>,
    pub events: Arc<Events>,
    pub counters: Arc<Counters>,
    /// Bounded local memory, when the region has a limit.
    pub pager: Option<Arc<Pager>>,
    /// Test hook for hand-over: exit the process upon reading this many faults, without
    /// serving the last one (a handler that dies at the worst moment).
    pub exit_after_faults: Option<u64>,
    /// How the reader waits for faults.
    pub fault_wait: FaultWait,
    /// In-thread mode: faults the faulting threads' SIGBUS handlers post to the reader.
    pub signal: Option<Arc<SignalPath>>,
    /// The process whose region this is, when it is another one (`farmap run`): where the
    /// faulting threads are looked up, and whose CPUs the readers sit on.
    pub program: Option<u32>,
    /// What becomes of a forked child's userfaultfd (`UFFD_EVENT_FORK`, a program's region
    /// only); without it, the fd is closed (the child's copy of the region is no longer
    /// registered, and reads as it was mapped, zeros where pages were missing).
    pub fork: std::sync::OnceLock<ForkHook>,
    /// CPU time of the reader threads and companions.
    handler_cpu: HandlerAccounts,
    faults_read: AtomicU64,
    poison_unsupported: AtomicBool,
    /// Reader threads of the last start.
    readers: AtomicUsize,
}

/// What a [`Server`] is made of.
pub(crate) struct ServerParts {
    pub range: UffdRange,
    pub geometry: Geometry,
    pub cache: Arc<RegionCache>,
    pub pagemap: Pagemap,
    pub readahead: u64,
    pub fetch_retry: RetryPolicy,
    pub written: Option<Arc<PageBits>>,
    pub events: Arc<Events>,
    pub counters: Arc<Counters>,
    pub pager: Option<Arc<Pager>>,
    pub fault_wait: FaultWait,
    pub signal: Option<Arc<SignalPath>>,
    /// The region's process, when it is not this one.
    pub program: Option<u32>,
}

/// Where a reader reads fault messages from.
#[derive(Debug, Clone, Copy)]
enum ReadFrom {
    /// The posts of the SIGBUS handlers (in-thread mode).
    Posts,
    /// The userfaultfd itself.
    Uffd,
}

/// How a reader came upon a batch, for the counters.
#[derive(Debug, Clone, Copy)]
enum Found {
    /// Looking again within the polling window, without sleeping (`faults_polled`).
    Polling,
    /// Outside the polling window: after `poll(2)`, or the posts read before it (the
    /// `faults_slept` counter).
    AfterSleep,
}

impl Server {
    pub fn new(p: ServerParts) -> Self {
        Self {
            range: p.range,
            geometry: p.geometry,
            cache: p.cache,
            pagemap: p.pagemap,
            puller: RwLock::new(None),
            readahead: p.readahead,
            fetch_retry: p.fetch_retry,
            written: p.written,
            events: p.events,
            counters: p.counters,
            pager: p.pager,
            exit_after_faults: None,
            fault_wait: p.fault_wait,
            signal: p.signal,
            program: p.program,
            fork: std::sync::OnceLock::new(),
            handler_cpu: HandlerAccounts::default(),
            faults_read: AtomicU64::new(0),
            poison_unsupported: AtomicBool::new(false),
            readers: AtomicUsize::new(0),
        }
    }

    fn page(&self) -> usize {
        self.range.page_size()
    }

    /// Reader threads of this server's last start.
    pub fn readers(&self) -> usize {
        self.readers.load(Ordering::Relaxed)
    }

    /// CPU time of the reader threads and companions so far.
    pub fn handler_cpu(&self) -> HandlerCpu {
        let (reader_ns, _) = self.handler_cpu.reader.total();
        let (companions_ns, companions) = self.handler_cpu.companions.total();
        HandlerCpu {
            reader_ns,
            companions_ns,
            companions,
        }
    }

    /// Counts the fault messages of a batch as found `how` (before handling them, so that a
    /// woken thread already sees them counted).
    fn count_found(&self, msgs: &[UffdMsg], how: Found) {
        let n = msgs
            .iter()
            .filter(|m| {
                m.event == sys::UFFD_EVENT_PAGEFAULT && self.range.contains(m.arg1 as usize)
            })
            .count() as u64;
        let counter = match how {
            Found::Polling => &self.counters.faults_polled,
            Found::AfterSleep => &self.counters.faults_slept,
        };
        Counters::add(counter, n);
    }

    /// Reads a batch from `from` into `msgs`, counts its faults as found `how`, handles its
    /// events and then its faults; returns how many messages it read. The events are handled
    /// under the events' order, held exclusively (see the module doc).
    fn read_and_handle(
        self: &Arc<Self>,
        msgs: &mut [UffdMsg],
        rt: &Handle,
        from: ReadFrom,
        how: Found,
    ) -> io::Result<usize> {
        let n = {
            let _order = self.events.order().write();
            let n = match (from, &self.signal) {
                (ReadFrom::Posts, Some(s)) => s.read_posted(msgs),
                (ReadFrom::Posts, None) => 0,
                (ReadFrom::Uffd, _) => self.range.uffd().read_messages(msgs)?,
            };
            if n > 0 {
                self.count_found(&msgs[..n], how);
                self.handle_events(&msgs[..n]);
            }
            n
        };
        self.handle_faults(&msgs[..n], rt);
        Ok(n)
    }

    /// Handles the events of a batch (its faults are left to [`handle_faults`](Self::handle_faults)).
    fn handle_events(&self, msgs: &[UffdMsg]) {
        let mut events = false;
        for m in msgs.iter().filter(|m| m.event != sys::UFFD_EVENT_PAGEFAULT) {
            events = true;
            if m.event == sys::UFFD_EVENT_REMOVE {
                self.removed(m.arg0 as usize, m.arg1 as usize);
            } else if let Some(child) = crate::uffd::fork_event_fd(m) {
                match self.fork.get() {
                    Some(hook) => hook(child),
                    None => drop(child),
                }
            }
        }
        if events {
            self.events.bump();
        }
    }

    /// Handles the faults of a batch whose events were handled.
    fn handle_faults(self: &Arc<Self>, msgs: &[UffdMsg], rt: &Handle) {
        for m in msgs.iter().filter(|m| m.event == sys::UFFD_EVENT_PAGEFAULT) {
            let addr = m.arg1 as usize;
            if !self.range.contains(addr) {
                continue;
            }
            if let Some(limit) = self.exit_after_faults {
                if self.faults_read.fetch_add(1, Ordering::Relaxed) + 1 >= limit {
                    // The test hook: die holding a fault that nobody will serve.
                    std::process::exit(0);
                }
            }
            let page = (addr - self.range.base()) & !(self.page() - 1);
            let fut: FaultFuture = if m.arg0 & sys::UFFD_PAGEFAULT_FLAG_WP != 0 {
                Box::pin(self.clone().write_fault(page))
            } else {
                // The faulting thread's id (0 unless UFFD_FEATURE_THREAD_ID is on).
                Box::pin(self.clone().missing_fault(page, m.arg2 as u32))
            };
            run_inline_or_spawn(fut, rt, &self.counters);
        }
    }

    /// `UFFD_EVENT_REMOVE` of `start..end`: every chunk it touches becomes absent, so that its
    /// next touch fetches it again (pages of a partly removed chunk that are still there keep
    /// their content: the copy skips them); or zero, if the pager says that is what a
    /// discard means ([`Pager::removed`], told here, under the events' order).
    fn removed(&self, start: usize, end: usize) {
        Counters::add(&self.counters.remove_events, 1);
        if let Some(pager) = &self.pager {
            pager.removed(start, end);
        }
        self.forget(start, end);
    }

    /// Makes the chunks of `start..end` (addresses) absent and clears the written marks of
    /// its pages: what a remove event of that range means. Idempotent. Called by the reader
    /// for every remove event, and by [`Region::discard_pages`](crate::Region::discard_pages)
    /// itself once its `madvise` has returned: the kernel lets `madvise` go on as soon as the
    /// reader has *read* the event, which may be long before the reader handles it, and a
    /// chunk still marked present meanwhile would never be fetched again.
    pub(crate) fn forget(&self, start: usize, end: usize) {
        let base = self.range.base();
        let start = start.clamp(base, base + self.range.len()) - base;
        let end = end.clamp(base, base + self.range.len()) - base;
        if start >= end {
            return;
        }
        if let Some(written) = &self.written {
            // The discarded pages hold nothing written any more (the remover waits for this
            // event to be read before it discards, and a later write faults again).
            let page = self.page();
            written.clear((start.div_ceil(page) as u64)..((end / page) as u64));
        }
        for idx in self
            .geometry
            .chunks_for(start as u64, (end - start) as u64)
            .iter()
        {
            if self.cache.evict(idx) {
                Counters::add(&self.counters.removed_chunks, 1);
            }
        }
    }

    /// A missing-page fault at `page` (offset in the region).
    async fn missing_fault(self: Arc<Self>, page: usize, tid: u32) {
        Counters::add(&self.counters.faults, 1);
        let idx = self.geometry.chunk_of(page as u64);
        if let Some(pager) = self.pager.clone() {
            self.paged_fault(&pager, idx, page).await;
            // The faulting thread is woken: fetch what its stream will touch next.
            let ahead = pager.prefetch_after(tid, idx);
            if !ahead.is_empty() {
                tokio::spawn(self.clone().prefetch(pager, ahead));
            }
            return;
        }
        if let Some(puller) = self.puller.read().as_ref() {
            let last = (idx.0 + self.readahead).min(self.geometry.chunk_count() - 1);
            puller.prioritize((idx.0..=last).map(ChunkIdx));
        }
        if self.cache.is_present(idx) {
            // Either another fault's copy already installed the page (and woke us), or the
            // page went away behind the cache's back (a remove we did not see: in another
            // process, or while the chunk was being fetched). Ask the page tables.
            let addr = self.range.base() + page;
            if self
                .pagemap
                .all_present(addr, addr + self.page())
                .unwrap_or(false)
            {
                let _ = self.range.wake(page, self.page());
                return;
            }
            if self.cache.evict(idx) {
                Counters::add(&self.counters.refetched_chunks, 1);
            }
        }
        let cache = &self.cache;
        match retry(self.fetch_retry, || cache.fetch(idx)).await {
            // The copy woke the faulting thread (ours, or that of whoever fetched it).
            Ok(()) => {}
            Err(e) => {
                self.counters.error(farmap_core::error_chain(&e));
                self.poison(page).await;
            }
        }
    }

    /// A missing fault in a region with bounded local memory: the pager decides (move back a
    /// staged chunk, fetch a remote one once there is room).
    async fn paged_fault(&self, pager: &Pager, idx: ChunkIdx, page: usize) {
        let mut overcommit = false;
        let mut yielded = false;
        loop {
            // The session ended (a program's region): nobody is left to serve.
            if pager.stopped() {
                return;
            }
            let seen = self.events.current();
            match pager.on_fault(idx, page, overcommit) {
                Admit::Done | Admit::InFlight => return,
                Admit::Retry => self.events.wait_past(seen).await,
                Admit::Full => {
                    // Reclaiming discards staging pages (madvise), which waits for this
                    // reader to read the remove event: never on the reader thread. Yielding
                    // once makes the reader spawn this fault onto the runtime.
                    if !yielded {
                        yielded = true;
                        Counters::add(&pager.counters.full_faults, 1);
                        tokio::task::yield_now().await;
                        continue;
                    }
                    // Nothing could be reclaimed (everything resident is in flight): go
                    // over the limit by at most `min_free` rather than wait for ever.
                    overcommit = !pager.make_room(overcommit).await;
                }
                Admit::Zero => {
                    if let Err(e) = self.zero_fill(pager, idx).await {
                        self.counters.error(format!(
                            "filling never-written chunk {idx} with zero pages: {}",
                            io::Error::from_raw_os_error(e)
                        ));
                    }
                    return;
                }
                Admit::Fetch => {
                    if let Err(e) = self.fetch_paged(pager, idx).await {
                        self.counters.error(farmap_core::error_chain(&e));
                        self.poison(page).await;
                    }
                    return;
                }
                Admit::FromSlot => return pager.copy_back(idx).await,
            }
        }
    }

    /// Fills chunk `idx`, admitted as zero by the pager, with zero pages, and tells the
    /// pager. On an error its waiters are woken: they fault again and try again.
    async fn zero_fill(&self, pager: &Pager, idx: ChunkIdx) -> Result<(), i32> {
        let filled = loop {
            let seen = self.events.current();
            match pager.fill_zero(idx) {
                Err(libc::EAGAIN) if pager.stopped() => break Err(libc::ESRCH),
                Err(libc::EAGAIN) => self.events.wait_past(seen).await,
                r => break r,
            }
        };
        let installed = matches!(filled, Ok(Landed::Installed));
        pager.fetched(idx, installed);
        if !installed {
            let off = self.geometry.offset_of(idx) as usize;
            let _ = self.range.wake(off, self.geometry.chunk_len(idx));
        }
        filled.map(|_| ())
    }

    /// Fetches chunk `idx`, admitted by the pager, straight from the store into the region's
    /// missing pages (the pager's state already makes this the only fetch of the chunk, and
    /// the cache's presence map does not know about moves), and tells the pager. On an error
    /// the threads waiting on its pages (told the fetch was in flight) are woken, so that
    /// they fault again and fetch it themselves.
    /// A chunk removed meanwhile gets nothing installed (not an error): its waiters fault
    /// again, and find it zero.
    async fn fetch_paged(&self, pager: &Pager, idx: ChunkIdx) -> farmap_core::StoreResult<()> {
        let (store, memory) = (self.cache.remote(), self.cache.local());
        let fetched = retry(self.fetch_retry, || async {
            let data = store.read(idx).await?;
            memory.install(idx, data).await
        })
        .await;
        let installed = matches!(fetched, Ok(Landed::Installed));
        pager.fetched(idx, installed);
        if !installed {
            let off = self.geometry.offset_of(idx) as usize;
            let _ = self.range.wake(off, self.geometry.chunk_len(idx));
        }
        fetched.map(|_| ())
    }

    /// Fetches (or zero-fills) the chunks [`Pager::prefetch_after`] admitted, all at once.
    /// A failure only counts an error: a thread that touches the chunk later faults and
    /// fetches it again.
    async fn prefetch(self: Arc<Self>, pager: Arc<Pager>, chunks: Vec<(ChunkIdx, bool)>) {
        let mut tasks = tokio::task::JoinSet::new();
        for (idx, zero) in chunks {
            let (me, pager) = (self.clone(), pager.clone());
            tasks.spawn(async move {
                if zero {
                    if let Err(e) = me.zero_fill(&pager, idx).await {
                        me.counters.error(format!(
                            "prefetching never-written chunk {idx} (zero pages): {}",
                            io::Error::from_raw_os_error(e)
                        ));
                    }
                } else if let Err(e) = me.fetch_paged(&pager, idx).await {
                    me.counters.error(format!(
                        "prefetching {idx}: {}",
                        farmap_core::error_chain(&e)
                    ));
                }
            });
        }
        while tasks.join_next().await.is_some() {}
    }

    /// The fetch for a fault failed for good: poison the page, so that the faulting thread
    /// gets SIGBUS instead of waiting forever or reading zeros.
    async fn poison(&self, page: usize) {
        loop {
            let seen = self.events.current();
            match self.range.poison(page, self.page()) {
                Ok(()) => {
                    Counters::add(&self.counters.poisoned_pages, 1);
                    return;
                }
                // Installed after all (the puller got it): wake the thread.
                Err(libc::EEXIST) => {
                    let _ = self.range.wake(page, self.page());
                    return;
                }
                Err(libc::EAGAIN) => self.events.wait_past(seen).await,
                // The region is gone (closing): nobody is left to signal.
                Err(libc::ENOENT | libc::ESRCH) => return,
                Err(e) => {
                    if !self.poison_unsupported.swap(true, Ordering::Relaxed) {
                        tracing::error!(
                            error = %io::Error::from_raw_os_error(e),
                            "cannot poison a page whose fetch failed; the faulting thread \
                             keeps waiting"
                        );
                    }
                    return;
                }
            }
        }
    }

    /// A write-protect fault (synchronous tracking): unprotect the page, record it, wake the
    /// writer. Unprotecting before recording is what keeps a concurrent scan (which clears
    /// the record, then protects) from losing the write: see [`PageBits`].
    async fn write_fault(self: Arc<Self>, page: usize) {
        Counters::add(&self.counters.wp_faults, 1);
        let size = self.page();
        loop {
            let seen = self.events.current();
            match self.range.write_protect(page, size, false, false) {
                Ok(()) => break,
                Err(libc::EAGAIN) => self.events.wait_past(seen).await,
                Err(e) => {
                    self.counters.error(format!(
                        "unprotecting a written page: {}",
                        io::Error::from_raw_os_error(e)
                    ));
                    break;
                }
            }
        }
        if let Some(written) = &self.written {
            written.set((page / size) as u64);
        }
        let _ = self.range.wake(page, size);
    }
}

/// Polls `fut` once on this thread; spawns it on `rt` if it has to wait.
fn run_inline_or_spawn(mut fut: FaultFuture, rt: &Handle, counters: &Counters) {
    let mut cx = Context::from_waker(Waker::noop());
    match fut.as_mut().poll(&mut cx) {
        Poll::Ready(()) => Counters::add(&counters.faults_inline, 1),
        // Polled again by the runtime at once, which registers its own waker.
        Poll::Pending => drop(rt.spawn(fut)),
    }
}

/// A tokio runtime that is shut down in the background when dropped, so that dropping it
/// never blocks, nor panics inside another runtime's async context.
pub(crate) struct OwnedRuntime(Option<tokio::runtime::Runtime>);

impl OwnedRuntime {
    /// A multi-threaded runtime with timers, I/O and `workers` threads named `name`. A
    /// store's futures run on it, and some clients open their sockets in the runtime that
    /// polls them (the S3 store's HTTP pool connects lazily, on the first request).
    pub fn new(workers: usize, name: &str) -> io::Result<Self> {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers.max(1))
            .enable_all()
            .thread_name(name)
            .build()
            .map(|rt| Self(Some(rt)))
    }

    pub fn handle(&self) -> &Handle {
        self.0.as_ref().expect("present until dropped").handle()
    }
}

impl Drop for OwnedRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

impl fmt::Debug for OwnedRuntime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("OwnedRuntime")
    }
}

/// The reader thread of a [`Server`]: reads messages until stopped.
pub(crate) struct Reader {
    stop: Arc<StopSignal>,
    threads: Vec<JoinHandle<()>>,
    /// Stopped after the thread that opens their windows.
    companions: Option<Arc<PollWindow>>,
}

impl Reader {
    /// Starts reading `server`'s userfaultfd; fault tasks run on `rt`.
    pub fn spawn(server: Arc<Server>, rt: Handle) -> io::Result<Reader> {
        let stop = Arc::new(StopSignal::new()?);
        let window = match server.fault_wait {
            FaultWait::Sleep => None,
            FaultWait::Poll(window) => Some(Arc::new(PollWindow {
                window,
                companions: Companions::per_cpu(server.handler_cpu.companions.clone())?,
            })),
        };
        // Sleeping: a reader per CPU, each kept to it (see the module doc); polling, or when
        // the affinity cannot be read: one reader, anywhere.
        let cpus: Vec<Option<usize>> = match (&window, affinity_cpus(server.program)) {
            (None, Some(cpus)) if !cpus.is_empty() => {
                cpus.into_iter().take(MAX_READERS).map(Some).collect()
            }
            _ => vec![None],
        };
        let set = match cpus.as_slice() {
            [_, _, ..] => Some(Arc::new(ReaderSet::new(
                cpus.iter().map(|c| c.unwrap_or(0)).collect(),
            ))),
            _ => None,
        };
        // Set, not added: a hand-over's take-over starts the readers again.
        server.readers.store(cpus.len(), Ordering::Relaxed);
        let mut reader = Reader {
            stop,
            threads: Vec::with_capacity(cpus.len()),
            companions: window,
        };
        for (me, on) in cpus.into_iter().enumerate() {
            let (server, rt, set) = (server.clone(), rt.clone(), set.clone());
            let (stop, window) = (reader.stop.clone(), reader.companions.clone());
            // On an error, dropping `reader` stops the threads already started.
            let thread = std::thread::Builder::new()
                .name("farmap-uffd-reader".into())
                .spawn(move || {
                    if let Some(cpu) = on {
                        if let Err(e) = keep_to_cpu(cpu) {
                            // Still a reader, wherever the scheduler puts it.
                            tracing::debug!(error = %e, cpu, "a fault reader cannot keep to its CPU");
                        }
                    }
                    let _cpu = server.handler_cpu.reader.enter();
                    let seat = set.as_deref().map(|set| Seat { set, me });
                    read_loop(&server, &rt, &stop, window.as_deref(), seat)
                })?;
            reader.threads.push(thread);
        }
        Ok(reader)
    }

    /// Stops the thread (it finishes the batch in hand; spawned fault tasks go on) and waits
    /// for it.
    pub fn stop(&mut self) {
        self.stop.signal();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        // The threads held the other reference: the companions stop and are joined here.
        drop(self.companions.take());
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.stop();
    }
}

impl fmt::Debug for Reader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reader")
            .field("threads", &self.threads.len())
            .finish()
    }
}

/// An eventfd that tells a thread blocked in `poll` to stop, and a flag that tells one
/// that polls without blocking.
#[derive(Debug)]
pub(crate) struct StopSignal(OwnedFd, AtomicBool);

impl StopSignal {
    pub fn new() -> io::Result<StopSignal> {
        let fd = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
        Ok(StopSignal(fd, AtomicBool::new(false)))
    }

    /// Raises the flag and makes the eventfd readable (for good: nothing reads it).
    pub fn signal(&self) {
        self.1.store(true, Ordering::Release);
        // Only fails if the counter would overflow, which one add per stop never reaches.
        let _ = rustix::io::write(&self.0, &1u64.to_ne_bytes());
    }

    /// Whether [`signal`](Self::signal) was called.
    pub fn is_raised(&self) -> bool {
        self.1.load(Ordering::Acquire)
    }

    /// The fd to poll.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// Reads and handles messages until stopped: blocks in `poll(2)`, then (with a poll window)
/// keeps reading without blocking while batches keep coming within the window. `seat`: this
/// reader's place among the per-CPU readers of a sleeping server (see the module doc).
fn read_loop(
    server: &Arc<Server>,
    rt: &Handle,
    stop: &StopSignal,
    window: Option<&PollWindow>,
    seat: Option<Seat<'_>>,
) {
    // Futures polled inline may create timers or spawn: give them the runtime's context.
    let _enter = rt.enter();
    let mut msgs = [UffdMsg::default(); BATCH];
    let signal = server.signal.as_deref();
    // Wake-ups in a row that found nothing to read.
    let mut empty_wakes = 0u32;
    let mut home = HomeWatch {
        program: server.program,
        checked: Instant::now(),
        home_seen: None,
    };
    loop {
        if signal.is_some() {
            // Faults posted by SIGBUS handlers (in-thread mode).
            // Reading posts does not fail (a failed read reads as no post).
            match server.read_and_handle(&mut msgs, rt, ReadFrom::Posts, Found::AfterSleep) {
                Ok(0) | Err(_) => {}
                Ok(_) => {
                    empty_wakes = 0;
                    if let Some(w) = window {
                        if poll_window(server, rt, stop, w, &mut msgs).is_err() {
                            return;
                        }
                    }
                    continue;
                }
            }
        }
        if let Some(seat) = &seat {
            if empty_wakes >= SPURIOUS_LIMIT {
                empty_wakes = 0;
                if seat.rest(server, stop).is_err() {
                    return;
                }
                continue;
            }
        }
        let posted = match wait_readable(server, stop, signal) {
            Woken::Readable { posted } => posted,
            Woken::Interrupted => continue,
            Woken::Stop => return,
        };
        match server.read_and_handle(&mut msgs, rt, ReadFrom::Uffd, Found::AfterSleep) {
            Ok(0) => {
                // Another reader took what woke this one (a posted fault is no sign either
                // way: the next turn reads it).
                if !posted {
                    empty_wakes += 1;
                }
            }
            Ok(n) => {
                empty_wakes = 0;
                if let Some(w) = window {
                    if poll_window(server, rt, stop, w, &mut msgs).is_err() {
                        return;
                    }
                }
                if let Some(seat) = &seat {
                    if home.away(seat, &msgs[..n]) && seat.rest(server, stop).is_err() {
                        return;
                    }
                }
            }
            Err(e) => {
                server
                    .counters
                    .error(format!("reading the userfaultfd: {e}"));
                return;
            }
        }
    }
}

/// What `poll(2)` on a reader's fds said.
enum Woken {
    /// The userfaultfd may have messages; `posted`: a SIGBUS handler posted a fault too.
    Readable { posted: bool },
    /// Interrupted by a signal: poll again.
    Interrupted,
    /// Stopped, or the userfaultfd failed (counted as an error).
    Stop,
}

/// Blocks until the userfaultfd, the stop signal or (in-thread mode) the posted faults'
/// pipe is readable.
fn wait_readable(server: &Server, stop: &StopSignal, signal: Option<&SignalPath>) -> Woken {
    let uffd = server.range.uffd();
    // Without in-thread mode the third entry polls the stop signal twice.
    let posted = signal.map_or(stop.fd(), SignalPath::posted);
    let mut fds = [
        PollFd::new(&**uffd, PollFlags::IN),
        PollFd::from_borrowed_fd(stop.fd(), PollFlags::IN),
        PollFd::from_borrowed_fd(posted, PollFlags::IN),
    ];
    match poll(&mut fds, None) {
        Ok(_) => {}
        Err(rustix::io::Errno::INTR) => return Woken::Interrupted,
        Err(e) => {
            server
                .counters
                .error(format!("poll on the userfaultfd: {}", io::Error::from(e)));
            return Woken::Stop;
        }
    }
    if !fds[1].revents().is_empty() {
        return Woken::Stop;
    }
    if fds[0]
        .revents()
        .intersects(PollFlags::ERR | PollFlags::NVAL)
    {
        server
            .counters
            .error("the userfaultfd reported an error".to_string());
        return Woken::Stop;
    }
    Woken::Readable {
        posted: !fds[2].revents().is_empty(),
    }
}

/// Where a seated reader's faulting threads run: when it last looked, and when a look last
/// found one on its CPU.
struct HomeWatch {
    /// The faulting threads' process, when it is not this one.
    program: Option<u32>,
    checked: Instant,
    home_seen: Option<Instant>,
}

impl HomeWatch {
    /// Whether the faults just read (`msgs`) come from other CPUs only, lately: this CPU's
    /// reader is not needed (with faults on several, each reader stays for its own). Looks
    /// at most every [`CPU_CHECK_EVERY`].
    fn away(&mut self, seat: &Seat<'_>, msgs: &[UffdMsg]) -> bool {
        if self.checked.elapsed() < CPU_CHECK_EVERY {
            return false;
        }
        self.checked = Instant::now();
        let cpu = msgs
            .iter()
            .find(|m| m.event == sys::UFFD_EVENT_PAGEFAULT && m.arg2 != 0)
            .and_then(|m| task_cpu(self.program, m.arg2 as u32));
        match cpu {
            Some(cpu) if cpu == seat.home() => {
                self.home_seen = Some(self.checked);
                false
            }
            Some(_) => self.home_seen.is_none_or(|t| t.elapsed() >= HOME_WINDOW),
            None => false,
        }
    }
}

/// The CPU thread `tid` of `program` (`None`: this process) last ran on (field 39 of its
/// `stat`), if readable.
fn task_cpu(program: Option<u32>, tid: u32) -> Option<usize> {
    use std::io::Read;
    let mut buf = [0u8; 1024];
    let path = match program {
        Some(pid) => format!("/proc/{pid}/task/{tid}/stat"),
        None => format!("/proc/self/task/{tid}/stat"),
    };
    let mut f = std::fs::File::open(path).ok()?;
    let mut len = 0;
    while len < buf.len() {
        match f.read(&mut buf[len..]) {
            Ok(0) => break,
            Ok(k) => len += k,
            Err(_) => return None,
        }
    }
    let line = std::str::from_utf8(&buf[..len]).ok()?;
    // The command name (field 2) is in parentheses and may hold anything: count from the
    // last ')'; field 3 comes right after it.
    let rest = &line[line.rfind(')')? + 1..];
    rest.split_ascii_whitespace().nth(39 - 3)?.parse().ok()
}

/// The per-CPU readers of a sleeping server: their CPUs, and how many poll now.
struct ReaderSet {
    cpus: Vec<usize>,
    polling: AtomicUsize,
}

impl ReaderSet {
    fn new(cpus: Vec<usize>) -> ReaderSet {
        ReaderSet {
            polling: AtomicUsize::new(cpus.len()),
            cpus,
        }
    }
}

/// One reader's place in a [`ReaderSet`].
struct Seat<'a> {
    set: &'a ReaderSet,
    me: usize,
}

impl Seat<'_> {
    /// The CPU this reader is kept to.
    fn home(&self) -> usize {
        self.set.cpus[self.me]
    }

    /// Stays out of `poll(2)` for [`DORMANT`], unless this is the last reader polling.
    /// Err: stop.
    fn rest(&self, server: &Server, stop: &StopSignal) -> Result<(), StopReading> {
        let set = self.set;
        let left = set
            .polling
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n > 1).then(|| n - 1)
            });
        if left.is_err() {
            return Ok(());
        }
        Counters::add(&server.counters.reader_rests, 1);
        let mut fds = [PollFd::from_borrowed_fd(stop.fd(), PollFlags::IN)];
        let timeout = rustix::event::Timespec::try_from(DORMANT).ok();
        let _ = poll(&mut fds, timeout.as_ref());
        set.polling.fetch_add(1, Ordering::SeqCst);
        if stop.is_raised() {
            return Err(StopReading);
        }
        Ok(())
    }
}

/// The reader must stop (signalled, or the userfaultfd failed).
struct StopReading;

/// Reads the userfaultfd without blocking until a whole window passes with no message; each
/// batch found is handled and opens the window again.
fn poll_window(
    server: &Arc<Server>,
    rt: &Handle,
    stop: &StopSignal,
    window: &PollWindow,
    msgs: &mut [UffdMsg],
) -> Result<(), StopReading> {
    let mut until = window.open();
    loop {
        if stop.is_raised() {
            return Err(StopReading);
        }
        if server.signal.is_some()
            && matches!(server.read_and_handle(msgs, rt, ReadFrom::Posts, Found::Polling), Ok(n) if n > 0)
        {
            until = window.open();
            continue;
        }
        // The fd is non-blocking: no message reads as 0.
        match server.read_and_handle(msgs, rt, ReadFrom::Uffd, Found::Polling) {
            Ok(0) => {
                if Instant::now() >= until {
                    return Ok(());
                }
                std::hint::spin_loop();
            }
            Ok(_) => until = window.open(),
            Err(e) => {
                server
                    .counters
                    .error(format!("reading the userfaultfd: {e}"));
                return Err(StopReading);
            }
        }
    }
}
