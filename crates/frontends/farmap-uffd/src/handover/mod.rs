//! Out-of-process fault handling: a region's userfaultfd and layout handed to another process
//! over a Unix socket (`SCM_RIGHTS`), like Firecracker's UFFD handler protocol.
//!
//! ```text
//!  owner process                                   handler process
//!  ─────────────                                   ───────────────
//!  send(&region, sock)
//!   ├ stop own reader thread and puller
//!   ├ hello + [uffd, pagemap] fds ───────────────▶ serve(sock, open_store)
//!   │                                               ├ check hello, open the store by spec
//!   │                                               ├ start reader (+ puller): installs with
//!   │◀─────────────────────────────── reply OK ─────┤ UFFDIO_COPY|WP into the owner's memory
//!   └ watcher thread: poll(sock)                    │
//!        ⋮   app faults are served remotely;        │
//!        ⋮   pushes and dirty scans stay here       ▼
//!     EOF (handler stopped, or died) ◀──────────── exit / crash / reply to `S`
//!      └ take over: own reader (+ puller over chunks not fully present),
//!        then UFFDIO_WAKE of the whole region: a fault the dead handler read but never
//!        served is raised again and served here. Nothing hangs.
//! ```
//!
//! The message layout is in [`message`]. Requirements: asynchronous write tracking (the
//! owner's scans see writes whoever installed the pages), and a store spec that the handler
//! can open to the same data (`file:`, `dir:`, a remote store — not `memory:`).

pub mod message;
pub(crate) mod socket;

use std::fmt;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use farmap_core::{ChunkIdx, Geometry, Store, StoreError};
use farmap_pipeline::{Cached, PullOptions, PullOrder, PullProgress, Puller, RetryPolicy};

use crate::memory::{Events, RegionMemory};
use crate::options::TrackingMode;
use crate::pagemap::Pagemap;
use crate::region::{HandedOver, Inner, Region};
use crate::server::{OwnedRuntime, Reader, Server, ServerParts, StopSignal};
use crate::stats::Counters;
use crate::sys;
use crate::uffd::{Uffd, UffdRange};
use message::{Hello, MessageError, Refusal};

/// Why a hand-over failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandoverError {
    /// Hand-over needs asynchronous write tracking.
    #[error("a region with synchronous write tracking cannot hand its faults over")]
    NeedsAsyncTracking,
    /// The region was opened without a store spec.
    #[error(
        "the region has no store spec for the handler to open (set RegionOptions::store_spec)"
    )]
    NoSpec,
    /// The region's local memory is bounded: its pager (staging area, moves) works only in
    /// the region's own process.
    #[error("a region with bounded local memory cannot hand its faults over")]
    Paged,
    /// The region shares its clean pages with other regions (a shared base's file, minor
    /// faults): only its own process serves them.
    #[error("a region that shares its clean pages (a shared base) cannot hand its faults over; open it with share_clean_pages off")]
    Shared,
    /// Another process already serves the region.
    #[error("the region is already handed over")]
    AlreadyRemote,
    /// The socket failed.
    #[error("the hand-over socket failed while {what}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// A message was malformed.
    #[error("a hand-over message was malformed")]
    Message(#[from] MessageError),
    /// The handler refused the region.
    #[error("the handler refused the region: {0}")]
    Refused(Refusal),
    /// The owner on the socket runs as another user (handler side): the handler would open
    /// the store it names with the handler's own privileges.
    #[error(
        "the owner runs as user {owner}, this handler as user {handler}: a handler serves only \
         its own user's regions (and root's)"
    )]
    Stranger {
        /// The owner's user id.
        owner: u32,
        /// The handler's.
        handler: u32,
    },
    /// The handler did not answer in time.
    #[error("the handler did not reply within {0:?}")]
    Timeout(Duration),
    /// The store could not be opened (handler side).
    #[error("the handler cannot open store {spec:?}")]
    Store {
        /// The spec.
        spec: String,
        /// Why, as the `open_store` callback said.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The store opened has another shape than the region (handler side).
    #[error("store {spec:?} is {store}, the region is {region}")]
    StoreGeometry {
        /// The spec.
        spec: String,
        /// The store's geometry.
        store: Geometry,
        /// The region's.
        region: Geometry,
    },
    /// The handler could not start (handler side), or the owner could not take over.
    #[error("setting up fault handling failed")]
    Setup(#[source] Box<dyn std::error::Error + Send + Sync>),
}

fn io_err(what: &'static str) -> impl FnOnce(io::Error) -> HandoverError {
    move |source| HandoverError::Io { what, source }
}

/// Whether the handler pulls the chunks it does not have in the background.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HandlerPull {
    /// If the region is managed.
    #[default]
    AsRegion,
    /// Never: the handler only serves faults.
    Off,
}

/// How [`send`] hands a region over.
#[derive(Debug, Clone)]
pub struct SendOptions {
    /// How long to wait for the handler's reply before taking the region back.
    pub reply_timeout: Duration,
    /// Background pull in the handler.
    pub pull: HandlerPull,
}

impl Default for SendOptions {
    /// 10 s to reply; the handler pulls if the region is managed.
    fn default() -> Self {
        Self {
            reply_timeout: Duration::from_secs(10),
            pull: HandlerPull::AsRegion,
        }
    }
}

/// The owner's side of a hand-over in progress: the watcher thread and the socket.
pub(crate) struct Remote {
    sock: Arc<UnixStream>,
    stop: Arc<StopSignal>,
    thread: Option<JoinHandle<()>>,
}

impl Remote {
    /// Stops the watcher (it will not take over) and returns the socket, which the caller
    /// closes once the region is unmapped.
    pub fn detach(mut self) -> Arc<UnixStream> {
        self.stop.signal();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.sock.clone()
    }
}

impl HandedOver for Remote {
    fn detach(self: Box<Self>) -> Arc<UnixStream> {
        Remote::detach(*self)
    }

    fn socket(&self) -> Arc<UnixStream> {
        self.sock.clone()
    }

    fn forget_watcher(&mut self) {
        self.thread = None;
    }
}

impl fmt::Debug for Remote {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Remote").field("sock", &self.sock).finish()
    }
}

/// Hands `region`'s fault handling to the process at the other end of `sock`, which runs
/// [`serve`]. Returns once that process serves faults; if it refuses, fails to answer in
/// time, or later stops or dies, this process serves the region again.
pub fn send(region: &Region, sock: UnixStream, opts: SendOptions) -> Result<(), HandoverError> {
    let inner = region.inner();
    if region.tracking_mode() != TrackingMode::Async {
        return Err(HandoverError::NeedsAsyncTracking);
    }
    if region.is_paged() {
        return Err(HandoverError::Paged);
    }
    if region.shared_base().is_some() {
        return Err(HandoverError::Shared);
    }
    let spec = inner.spec.clone().ok_or(HandoverError::NoSpec)?;
    let mut remote = inner.remote.lock();
    if remote.is_some() {
        return Err(HandoverError::AlreadyRemote);
    }
    let range = inner.range();
    let pull = match opts.pull {
        HandlerPull::AsRegion => inner.pull.is_some(),
        HandlerPull::Off => false,
    };
    let pagemap = Pagemap::open_self().map_err(io_err("opening pagemap"))?;
    inner.pause_local();
    let result = (|| {
        let present = inner
            .present_bitmap()
            .map_err(|e| HandoverError::Setup(Box::new(e)))?;
        let hello = Hello {
            flags: if pull { message::FLAG_PULL } else { 0 },
            base: range.base() as u64,
            len: range.len() as u64,
            page_size: range.page_size() as u32,
            chunk_size: inner.geometry.chunk_size(),
            features: range.uffd().features(),
            spec,
            present,
        };
        let fds = [range.uffd().as_fd(), pagemap.fd().as_fd()];
        socket::send_with_fds(&sock, &hello.encode(), &fds).map_err(io_err("sending the hello"))?;
        let (ready, _) = socket::wait_readable(&sock, None, Some(opts.reply_timeout))
            .map_err(io_err("waiting for the reply"))?;
        if !ready {
            return Err(HandoverError::Timeout(opts.reply_timeout));
        }
        let mut reply = [0u8; message::REPLY_LEN];
        (&sock)
            .read_exact(&mut reply)
            .map_err(io_err("reading the reply"))?;
        match message::decode_reply(&reply)? {
            None => Ok(()),
            Some(refusal) => Err(HandoverError::Refused(refusal)),
        }
    })();
    if let Err(e) = result {
        inner
            .take_over()
            .map_err(|t| HandoverError::Setup(Box::new(t)))?;
        return Err(e);
    }
    let sock = Arc::new(sock);
    let stop = match StopSignal::new() {
        Ok(s) => Arc::new(s),
        Err(e) => {
            let _ = inner.take_over();
            return Err(HandoverError::Io {
                what: "creating the watcher's eventfd",
                source: e,
            });
        }
    };
    let (w_inner, w_sock, w_stop) = (inner.clone(), sock.clone(), stop.clone());
    let thread = std::thread::Builder::new()
        .name("farmap-uffd-watch".into())
        .spawn(move || watch(&w_inner, &w_sock, &w_stop));
    let thread = match thread {
        Ok(t) => t,
        Err(e) => {
            let _ = inner.take_over();
            return Err(io_err("starting the watcher thread")(e));
        }
    };
    *remote = Some(Box::new(Remote {
        sock,
        stop,
        thread: Some(thread),
    }));
    Ok(())
}

/// The watcher: waits for the handler's end of the socket to close, then takes over.
fn watch(inner: &Arc<Inner>, sock: &UnixStream, stop: &StopSignal) {
    loop {
        match socket::wait_readable(sock, Some(stop.fd()), None) {
            Ok((_, true)) => return,
            Ok((true, _)) => {
                let mut b = [0u8; 64];
                match (&*sock).read(&mut b) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {} // nothing is expected; ignore
                }
            }
            Ok(_) => {}
            Err(_) => break,
        }
    }
    // Detached meanwhile (the region is closing)? Then it is not ours to take back.
    let Some(mut mine) = inner.remote.lock().take() else {
        return;
    };
    mine.forget_watcher(); // that is this thread: do not join it
    if let Err(e) = inner.take_over() {
        inner
            .server
            .counters
            .error(format!("taking the region back: {e}"));
    }
}

/// Asks the handler to stop and waits (up to `timeout`) until this process serves the
/// region again. A no-op if the region is served locally.
pub fn reclaim(region: &Region, timeout: Duration) -> Result<(), HandoverError> {
    let inner = region.inner();
    let sock = match inner.remote.lock().as_ref() {
        Some(r) => r.socket(),
        None => return Ok(()),
    };
    // A handler that already died cannot read it; the watcher takes over all the same.
    let _ = (&*sock).write_all(&[message::STOP]);
    let deadline = Instant::now() + timeout;
    while inner.remote.lock().is_some() {
        if Instant::now() >= deadline {
            return Err(HandoverError::Timeout(timeout));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

/// How [`serve`] serves a region.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Worker threads of the handler's runtime.
    pub worker_threads: usize,
    /// Retries of a fault's fetch before the faulting thread gets SIGBUS.
    pub fetch_retry: RetryPolicy,
    /// Chunks after a faulted one that jump the puller's queue.
    pub readahead_chunks: u32,
    /// The background pull, when the hello asks for one (its order is replaced by the chunks
    /// the owner does not have).
    pub pull: PullOptions,
    /// Test hook: exit the process upon reading this many faults, leaving the last one
    /// unserved (a handler dying at the worst moment).
    #[doc(hidden)]
    pub exit_after_faults: Option<u64>,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            worker_threads: 2,
            fetch_retry: RetryPolicy::default(),
            readahead_chunks: 4,
            pull: PullOptions::default(),
            exit_after_faults: None,
        }
    }
}

/// What a handler did, from [`serve`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServeReport {
    /// Faults served.
    pub faults: u64,
    /// Chunks installed (faults and pull).
    pub chunks_fetched: u64,
    /// The pull's progress when serving ended, if there was one.
    pub pull: Option<PullProgress>,
}

/// Whether an owner running as user `owner` may hand a region to a handler running as
/// `handler`: the same user, or root (whose handler opens the store with less privilege).
fn owner_may_hand_over(owner: u32, handler: u32) -> bool {
    owner == handler || owner == 0
}

/// Serves the faults of a region handed over on `sock` (see [`send`]) until the owner asks
/// it to stop or closes the socket. An owner of another user (but root) is refused before
/// anything is read: the store it names would be opened with this process's privileges. `open_store` opens the store named by the spec in the
/// hello.
pub fn serve<E>(
    sock: UnixStream,
    open_store: impl FnOnce(&str) -> Result<Arc<dyn Store>, E>,
    opts: ServeOptions,
) -> Result<ServeReport, HandoverError>
where
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let refuse = |sock: &UnixStream, r: Refusal| {
        let _ = (&*sock).write_all(&message::encode_reply(Some(r)));
    };
    // Before a byte is read: the spec the owner sends is opened with this process's
    // privileges, so only its own user (or root) may send one.
    let owner = rustix::net::sockopt::socket_peercred(&sock)
        .map_err(|e| io_err("asking who the owner is")(e.into()))?
        .uid
        .as_raw();
    let handler = rustix::process::geteuid().as_raw();
    if !owner_may_hand_over(owner, handler) {
        refuse(&sock, Refusal::Stranger);
        return Err(HandoverError::Stranger { owner, handler });
    }
    let mut header = [0u8; message::HEADER_LEN];
    let fds = socket::recv_with_fds(&sock, &mut header).map_err(io_err("receiving the hello"))?;
    let (hello, fds) = match read_hello(&sock, &header, &fds) {
        Ok(h) => (h, fds),
        Err(e) => {
            refuse(&sock, Refusal::BadHello);
            return Err(e);
        }
    };
    let mut fds = fds.into_iter();
    let (Some(uffd_fd), Some(pagemap_fd)) = (fds.next(), fds.next()) else {
        refuse(&sock, Refusal::BadHello);
        return Err(MessageError::BadField {
            field: "fd count",
            value: 0,
        }
        .into());
    };
    if hello.page_size as usize != sys::page_size() {
        refuse(&sock, Refusal::BadHello);
        return Err(MessageError::BadField {
            field: "page size",
            value: u64::from(hello.page_size),
        }
        .into());
    }
    let store = match open_store(&hello.spec) {
        Ok(s) => s,
        Err(e) => {
            refuse(&sock, Refusal::Store);
            return Err(HandoverError::Store {
                spec: hello.spec,
                source: e.into(),
            });
        }
    };
    let geometry = Geometry::new(hello.len, u64::from(hello.chunk_size)).map_err(|e| {
        refuse(&sock, Refusal::BadHello);
        HandoverError::Setup(Box::new(e))
    })?;
    if store.geometry() != geometry {
        refuse(&sock, Refusal::Store);
        return Err(HandoverError::StoreGeometry {
            spec: hello.spec,
            store: store.geometry(),
            region: geometry,
        });
    }
    let served = Served::start(&hello, geometry, store, uffd_fd, pagemap_fd, &opts)
        .inspect_err(|_| refuse(&sock, Refusal::Setup))?;
    (&sock)
        .write_all(&message::encode_reply(None))
        .map_err(io_err("replying"))?;
    // Serve until the owner says stop or goes away.
    let mut b = [0u8; 64];
    loop {
        match (&sock).read(&mut b) {
            Ok(0) | Err(_) => break,
            Ok(n) if b[..n].contains(&message::STOP) => break,
            Ok(_) => {}
        }
    }
    Ok(served.stop())
}

fn read_hello(
    sock: &UnixStream,
    header: &[u8; message::HEADER_LEN],
    fds: &[OwnedFd],
) -> Result<Hello, HandoverError> {
    let h = Hello::decode_header(header)?;
    if fds.len() != usize::from(message::FD_COUNT) {
        return Err(MessageError::BadField {
            field: "fd count",
            value: fds.len() as u64,
        }
        .into());
    }
    // Lengths are capped by decode_header before anything is allocated.
    let mut skip = vec![0u8; h.header_len - message::HEADER_LEN];
    (&*sock)
        .read_exact(&mut skip)
        .map_err(io_err("reading the hello"))?;
    let mut rest = vec![0u8; h.spec_len + h.bitmap_len];
    (&*sock)
        .read_exact(&mut rest)
        .map_err(io_err("reading the hello"))?;
    Ok(Hello::from_parts(&h, &rest)?)
}

/// A handler process's serving state.
struct Served {
    runtime: OwnedRuntime,
    reader: Reader,
    server: Arc<Server>,
}

impl Served {
    fn start(
        hello: &Hello,
        geometry: Geometry,
        store: Arc<dyn Store>,
        uffd_fd: OwnedFd,
        pagemap_fd: OwnedFd,
        opts: &ServeOptions,
    ) -> Result<Served, HandoverError> {
        let setup = |e: io::Error| HandoverError::Setup(Box::new(e));
        let uffd = Arc::new(Uffd::from_owned(uffd_fd, hello.features));
        // The owner registered base..base+len with this userfaultfd in its own address space,
        // as the hello says (if it lied, the kernel refuses the copies).
        let range = UffdRange::new(uffd, hello.base as usize, hello.len as usize);
        let runtime =
            OwnedRuntime::new(opts.worker_threads, "farmap-uffd-handler").map_err(setup)?;
        let counters = Arc::new(Counters::default());
        let events = Arc::new(Events::default());
        let memory = Arc::new(RegionMemory::new(
            range.clone(),
            geometry,
            true,
            None,
            events.clone(),
            counters.clone(),
            None,
        ));
        let cache =
            Arc::new(Cached::new(memory, store).map_err(|e| HandoverError::Setup(Box::new(e)))?);
        let mut server = Server::new(ServerParts {
            range,
            geometry,
            cache,
            pagemap: Pagemap::from_owned(pagemap_fd),
            readahead: u64::from(opts.readahead_chunks),
            fetch_retry: opts.fetch_retry,
            written: None,
            events,
            counters,
            pager: None,
            // The serving process sleeps between faults (it has no poll option yet).
            fault_wait: crate::FaultWait::Sleep,
            signal: None,
            program: None,
        });
        server.exit_after_faults = opts.exit_after_faults;
        let server = Arc::new(server);
        let reader = Reader::spawn(server.clone(), runtime.handle().clone()).map_err(setup)?;
        if hello.flags & message::FLAG_PULL != 0 {
            let missing: Vec<ChunkIdx> = geometry
                .all()
                .iter()
                .filter(|i| !hello.is_present(i.0))
                .collect();
            let _enter = runtime.handle().enter();
            let puller = Puller::start(
                server.cache.clone(),
                PullOptions {
                    order: PullOrder::List(missing),
                    ..opts.pull.clone()
                },
            );
            *server.puller.write() = Some(Arc::new(puller));
        }
        Ok(Served {
            runtime,
            reader,
            server,
        })
    }

    /// Stops reading faults and pulling; fetches in flight are abandoned (their threads are
    /// woken by the owner's take-over and fault again there).
    fn stop(self) -> ServeReport {
        let Served {
            runtime,
            mut reader,
            server,
        } = self;
        reader.stop();
        let pull = server.puller.write().take().map(|p| {
            p.cancel();
            p.progress()
        });
        // Abandon the fetches in flight.
        drop(runtime);
        let c = &server.counters;
        ServeReport {
            faults: Counters::get(&c.faults),
            chunks_fetched: Counters::get(&c.chunks_fetched),
            pull,
        }
    }
}

impl From<StoreError> for HandoverError {
    fn from(e: StoreError) -> Self {
        HandoverError::Setup(Box::new(e))
    }
}
