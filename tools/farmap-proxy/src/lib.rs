//! A userspace TCP proxy that emulates a slow link: a round-trip time and, optionally, a
//! bandwidth (netem is not available on every machine farmap is tested on).
//!
//! ```text
//!            ┌──────────── one task per direction ─────────────┐
//!  client ──▶│ read → (due, bytes) → queue → wait until due → write │──▶ upstream
//!  client ◀──│ write ← wait until due ← queue ← (due, bytes) ← read │◀── upstream
//!            └─────────────────────────────────────────────────┘
//! ```
//!
//! Per connection and per direction, one task reads from the source, timestamps every chunk
//! it reads (`t_read`), computes when the chunk is due at the other end and queues it; the
//! same task waits until the head of the queue is due (with the precise
//! [`timer`](farmap_pipeline::timer), not tokio's millisecond wheel) and writes it. Reading
//! and writing share the task because handing bytes from a reader task to a writer task costs
//! a thread wake-up, which on a VM adds 50–150 µs to every hop; both socket operations are
//! cancel-safe, so the task simply waits for whichever is ready first. The link model of one
//! direction:
//!
//! - **Delay**: every byte is due `rtt / 2` after it was read, so a request and its reply
//!   together take `rtt` more than without the proxy.
//! - **Bandwidth** (optional): a virtual clock serializes the bytes at the link rate, like a
//!   real link's transmitter: a slice of `len` bytes read at `t_read` starts transmitting at
//!   `max(t_read, link_free)`, occupies the link for `len / bandwidth`, and is due `rtt / 2`
//!   after its transmission ends. Reads are cut into slices of about 100 µs of link time, so
//!   bytes are delivered smoothly rather than in bursts of one socket read. There is no burst
//!   allowance: the link is never faster than its rate.
//! - **Order** is preserved: due times never decrease within a direction.
//! - **Memory** is bounded: a direction stops reading (and TCP pushes back on the sender) while
//!   a whole read would take it past [`ProxyOptions::queue_limit`] queued bytes. The default holds twice the one-way
//!   bandwidth-delay product plus 4 MiB, so the link runs at its full rate.
//! - **EOF** (half-close) is forwarded as a `shutdown(Write)`, due like a byte read at the same
//!   moment; the other direction keeps working. A read or write error (a reset, a peer gone)
//!   closes both sides of the connection at once.
//!
//! **Precision.** A timer on a VM wakes its thread 50–200 µs late. A write that is the only
//! one queued (a request or a reply, where latency is what is being measured) asks the timer
//! to wake it early by the timer's average lateness, measured as it runs, and spins for the
//! rest (never more than 250 µs); writes in a stream rely on the timer alone, since their due
//! times are absolute and lateness does not add up. Nothing is ever delivered early. Measured
//! on a 2-core VM: a ping-pong through the proxy takes 20–250 µs more than the emulated round
//! trip, most of it the cost of waking threads that a direct connection pays too.
//!
//! Both sockets of every connection have `TCP_NODELAY` set, so the proxy adds no Nagle delay.
//! The TCP handshake is not delayed: the first round trip of a connection starts with its
//! first bytes.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use farmap_proxy::{Proxy, ProxyOptions};
//! let options = ProxyOptions {
//!     rtt: Duration::from_millis(20),
//!     bandwidth: Some("1Gbit".parse()?),
//!     ..ProxyOptions::default()
//! };
//! let proxy = Proxy::bind("127.0.0.1:0", "127.0.0.1:7400", options).await?.spawn();
//! println!("connect to {}", proxy.local_addr());
//! // ... run the benchmark against proxy.local_addr() ...
//! proxy.shutdown().await;
//! # Ok(()) }
//! ```

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use farmap_pipeline::timer::{sleep, sleep_until};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{lookup_host, TcpListener, TcpStream, ToSocketAddrs};
use tokio::task::{JoinHandle, JoinSet};

mod bandwidth;

pub use bandwidth::{Bandwidth, BandwidthError};

/// The most bytes one socket read takes.
const READ_SIZE: usize = 256 * 1024;
/// Reads up to this size are copied out of the read buffer instead of splitting it off.
const SMALL_READ: usize = 16 * 1024;
/// The most bytes one socket write gathers from due slices.
const WRITE_GATHER: usize = 256 * 1024;
/// Link time per slice when a bandwidth is set.
const SLICE_TIME: Duration = Duration::from_micros(100);
/// Bounds of a slice's length (about one TCP segment up to one read).
const MIN_SLICE: usize = 1460;
/// The link rate assumed for the default queue limit when no bandwidth is set (10 Gbit/s).
const NOMINAL_RATE: u64 = 1_250_000_000;
/// The smallest queue limit (and the slack added to the bandwidth-delay product).
const MIN_QUEUE: usize = 4 << 20;
/// The largest default queue limit.
const MAX_DEFAULT_QUEUE: usize = 1 << 30;

/// The link a [`Proxy`] emulates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ProxyOptions {
    /// Added to every round trip: each direction delays its bytes by half of it.
    pub rtt: Duration,
    /// The rate of each direction of each connection; `None` for no limit beyond the host's.
    pub bandwidth: Option<Bandwidth>,
    /// The most bytes queued in one direction of one connection before the proxy stops reading
    /// from its sender; `None` for twice the one-way bandwidth-delay product plus 4 MiB
    /// (computed for 10 Gbit/s when there is no bandwidth), at most 1 GiB. Values below 4 MiB
    /// are raised to 4 MiB.
    pub queue_limit: Option<usize>,
}

impl ProxyOptions {
    /// The queue limit in effect (see [`ProxyOptions::queue_limit`]).
    pub fn effective_queue_limit(&self) -> usize {
        let limit = self.queue_limit.unwrap_or_else(|| {
            let rate = self
                .bandwidth
                .map_or(NOMINAL_RATE, Bandwidth::bytes_per_sec);
            let bdp = u128::from(rate) * (self.rtt / 2).as_nanos() / 1_000_000_000;
            let bdp = usize::try_from(bdp).unwrap_or(usize::MAX);
            bdp.saturating_mul(2)
                .saturating_add(MIN_QUEUE)
                .min(MAX_DEFAULT_QUEUE)
        });
        limit.max(MIN_QUEUE)
    }
}

/// Why a proxy could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProxyError {
    /// A listen or upstream address could not be resolved.
    #[error("cannot resolve the address {addr}")]
    Resolve {
        /// The address as given.
        addr: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// An address resolved to nothing.
    #[error("the address {addr} resolves to no address")]
    NoAddress {
        /// The address as given.
        addr: String,
    },
    /// The listening socket could not be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address as given.
        addr: String,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// Something that went wrong with one connection (the proxy keeps serving the others).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectionError {
    /// Accepting a connection failed (for example, out of file descriptors).
    #[error("cannot accept a connection")]
    Accept(#[source] io::Error),
    /// The upstream could not be reached for a new client; the client was disconnected.
    #[error("connection from {peer}: cannot connect to {upstream}")]
    Connect {
        /// The client.
        peer: SocketAddr,
        /// The first upstream address.
        upstream: SocketAddr,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A read or write failed mid-connection; both sides were closed.
    #[error("connection from {peer} failed")]
    Transfer {
        /// The client.
        peer: SocketAddr,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// Called with every [`ConnectionError`] (from the proxy's tasks: keep it short).
pub type ErrorHook = Arc<dyn Fn(&ConnectionError) + Send + Sync>;

/// Counters of a running proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProxyStats {
    /// Connections accepted so far.
    pub accepted: u64,
    /// Connections open now.
    pub active: u64,
    /// Connections that ended with an error (including failed upstream connects).
    pub failed: u64,
    /// Bytes delivered from clients to the upstream.
    pub bytes_up: u64,
    /// Bytes delivered from the upstream to clients.
    pub bytes_down: u64,
}

#[derive(Debug, Default)]
struct Counters {
    accepted: AtomicU64,
    active: AtomicU64,
    failed: AtomicU64,
    bytes_up: AtomicU64,
    bytes_down: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> ProxyStats {
        ProxyStats {
            accepted: self.accepted.load(Ordering::Relaxed),
            active: self.active.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            bytes_up: self.bytes_up.load(Ordering::Relaxed),
            bytes_down: self.bytes_down.load(Ordering::Relaxed),
        }
    }
}

/// A delaying TCP proxy, bound and ready to run (see the [module docs](self)).
///
/// Concurrency contract:
/// - Connections are independent: each has one task per direction with its own queue, so a
///   slow or stalled connection (or direction) never delays another.
/// - [`run_until`](Proxy::run_until)'s future owns every connection: when it returns (or is
///   dropped), all connections are closed at once.
pub struct Proxy {
    listener: TcpListener,
    local_addr: SocketAddr,
    upstream: Arc<[SocketAddr]>,
    options: ProxyOptions,
    counters: Arc<Counters>,
    on_error: Option<ErrorHook>,
}

impl fmt::Debug for Proxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Proxy")
            .field("local_addr", &self.local_addr)
            .field("upstream", &self.upstream)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl Proxy {
    /// Listens on `listen` and resolves `to` (once, now: an address that does not resolve
    /// fails here rather than on every connection). Port 0 picks a free port; see
    /// [`local_addr`](Proxy::local_addr).
    pub async fn bind<L, T>(listen: L, to: T, options: ProxyOptions) -> Result<Self, ProxyError>
    where
        L: ToSocketAddrs + fmt::Display,
        T: ToSocketAddrs + fmt::Display,
    {
        let upstream: Vec<SocketAddr> = lookup_host(&to)
            .await
            .map_err(|source| ProxyError::Resolve {
                addr: to.to_string(),
                source,
            })?
            .collect();
        if upstream.is_empty() {
            return Err(ProxyError::NoAddress {
                addr: to.to_string(),
            });
        }
        let listener = TcpListener::bind(&listen)
            .await
            .map_err(|source| ProxyError::Bind {
                addr: listen.to_string(),
                source,
            })?;
        let local_addr = listener.local_addr().map_err(|source| ProxyError::Bind {
            addr: listen.to_string(),
            source,
        })?;
        Ok(Self {
            listener,
            local_addr,
            upstream: upstream.into(),
            options,
            counters: Arc::default(),
            on_error: None,
        })
    }

    /// Calls `hook` with every connection error (by default they are only counted).
    pub fn on_error(mut self, hook: impl Fn(&ConnectionError) + Send + Sync + 'static) -> Self {
        self.on_error = Some(Arc::new(hook));
        self
    }

    /// The address clients connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The addresses `to` resolved to; each connection uses the first that accepts.
    pub fn upstream(&self) -> &[SocketAddr] {
        &self.upstream
    }

    /// The emulated link.
    pub fn options(&self) -> ProxyOptions {
        self.options
    }

    /// The counters so far.
    pub fn stats(&self) -> ProxyStats {
        self.counters.snapshot()
    }

    /// Accepts and proxies connections until `shutdown` completes, then closes every
    /// connection and returns.
    pub async fn run_until(&self, shutdown: impl Future<Output = ()>) {
        let link = Link::new(self.options);
        let mut connections = JoinSet::new();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
                accepted = self.listener.accept() => match accepted {
                    Ok((client, peer)) => {
                        self.counters.accepted.fetch_add(1, Ordering::Relaxed);
                        connections.spawn(connection(
                            client,
                            peer,
                            self.upstream.clone(),
                            link,
                            self.counters.clone(),
                            self.on_error.clone(),
                        ));
                    }
                    Err(e) => {
                        report(&self.on_error, &ConnectionError::Accept(e));
                        // Out of descriptors or memory: give closing connections a moment.
                        sleep(Duration::from_millis(10)).await;
                    }
                },
            }
        }
        // Dropping the set aborts every connection task, which drops (closes) its sockets.
        drop(connections);
    }

    /// Runs the proxy on a new task until [`ProxyHandle::shutdown`] (or the handle is dropped).
    pub fn spawn(self) -> ProxyHandle {
        let local_addr = self.local_addr;
        let counters = self.counters.clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            self.run_until(async move {
                let _ = stopped.await;
            })
            .await;
        });
        ProxyHandle {
            local_addr,
            counters,
            stop: Some(stop),
            task,
        }
    }
}

/// A proxy running on its own task. Dropping the handle stops it and closes its connections.
#[derive(Debug)]
pub struct ProxyHandle {
    local_addr: SocketAddr,
    counters: Arc<Counters>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl ProxyHandle {
    /// The address clients connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The counters so far.
    pub fn stats(&self) -> ProxyStats {
        self.counters.snapshot()
    }

    /// Stops accepting, closes every connection, and waits until that is done.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.task).await;
    }
}

impl Drop for ProxyHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn report(hook: &Option<ErrorHook>, err: &ConnectionError) {
    if let Some(hook) = hook {
        hook(err);
    }
}

/// One direction's link model, shared by every connection of a proxy.
#[derive(Debug, Clone, Copy)]
struct Link {
    one_way: Duration,
    bandwidth: Option<Bandwidth>,
    slice: usize,
    queue_limit: usize,
}

impl Link {
    fn new(options: ProxyOptions) -> Self {
        let slice = options.bandwidth.map_or(READ_SIZE, |bw| {
            usize::try_from(bw.bytes_in(SLICE_TIME))
                .unwrap_or(READ_SIZE)
                .clamp(MIN_SLICE, READ_SIZE)
        });
        Self {
            one_way: options.rtt / 2,
            bandwidth: options.bandwidth,
            slice,
            queue_limit: options.effective_queue_limit(),
        }
    }
}

/// The virtual clock of one direction: when each slice is due at the far end.
#[derive(Debug)]
struct LinkClock {
    link: Link,
    /// When the emulated transmitter finishes what it was given so far.
    free_at: Instant,
}

impl LinkClock {
    fn new(link: Link) -> Self {
        Self {
            link,
            free_at: Instant::now(),
        }
    }

    /// When `len` bytes read at `t_read` are due (after everything handed over before them).
    fn due(&mut self, t_read: Instant, len: usize) -> Instant {
        match self.link.bandwidth {
            None => t_read + self.link.one_way,
            Some(bw) => {
                let start = self.free_at.max(t_read);
                self.free_at = start + bw.transmit_time(len);
                self.free_at + self.link.one_way
            }
        }
    }
}

/// Proxies one client connection until both directions have ended or one of them failed.
async fn connection(
    client: TcpStream,
    peer: SocketAddr,
    upstream: Arc<[SocketAddr]>,
    link: Link,
    counters: Arc<Counters>,
    on_error: Option<ErrorHook>,
) {
    counters.active.fetch_add(1, Ordering::Relaxed);
    let result = match TcpStream::connect(&upstream[..]).await {
        Ok(server) => relay(client, server, link, &counters)
            .await
            .map_err(|source| ConnectionError::Transfer { peer, source }),
        Err(source) => Err(ConnectionError::Connect {
            peer,
            upstream: upstream[0],
            source,
        }),
    };
    counters.active.fetch_sub(1, Ordering::Relaxed);
    if let Err(e) = result {
        counters.failed.fetch_add(1, Ordering::Relaxed);
        report(&on_error, &e);
    }
}

async fn relay(
    client: TcpStream,
    server: TcpStream,
    link: Link,
    counters: &Arc<Counters>,
) -> io::Result<()> {
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let (client_rd, client_wr) = client.into_split();
    let (server_rd, server_wr) = server.into_split();
    let mut tasks = JoinSet::new();
    let up = counters.clone();
    spawn_direction(&mut tasks, client_rd, server_wr, link, move |n| {
        up.bytes_up.fetch_add(n, Ordering::Relaxed);
    });
    let down = counters.clone();
    spawn_direction(&mut tasks, server_rd, client_wr, link, move |n| {
        down.bytes_down.fetch_add(n, Ordering::Relaxed);
    });
    while let Some(joined) = tasks.join_next().await {
        // On an error, dropping the set aborts the other tasks and closes both sockets.
        joined.unwrap_or_else(|e| Err(io::Error::other(e)))?;
    }
    Ok(())
}

fn spawn_direction(
    tasks: &mut JoinSet<io::Result<()>>,
    rd: OwnedReadHalf,
    wr: OwnedWriteHalf,
    link: Link,
    delivered: impl Fn(u64) + Send + 'static,
) {
    tasks.spawn(async move {
        let mut direction = Direction {
            clock: LinkClock::new(link),
            queue: VecDeque::new(),
            queued: 0,
            eof: None,
        };
        direction.run(rd, wr, delivered).await
    });
}

/// One direction of one connection: what was read and is not yet due, and the EOF if read.
///
/// Reading and writing share one task (no hand-over between tasks on the way through the
/// proxy, which costs tens of microseconds on a VM); both socket operations are cancel-safe,
/// so whichever is ready first runs and the other is simply polled again.
#[derive(Debug)]
struct Direction {
    clock: LinkClock,
    /// Slices in order, each with the instant it is due at the far end.
    queue: VecDeque<(Instant, Bytes)>,
    /// Bytes in `queue`.
    queued: usize,
    /// When the EOF read from the source is due, once it has been read.
    eof: Option<Instant>,
}

impl Direction {
    async fn run(
        &mut self,
        mut rd: OwnedReadHalf,
        mut wr: OwnedWriteHalf,
        delivered: impl Fn(u64),
    ) -> io::Result<()> {
        let limit = self.clock.link.queue_limit;
        let mut buf = BytesMut::new();
        loop {
            if self.queue.is_empty() {
                if let Some(due) = self.eof {
                    wait_until(due, Precision::Exact).await;
                    wr.shutdown().await?;
                    return Ok(());
                }
            }
            let can_read = self.eof.is_none() && self.queued + READ_SIZE <= limit;
            if can_read {
                buf.reserve(READ_SIZE);
            }
            // Either a read or a write happens; both are cancel-safe, so the other one is
            // simply started again on the next turn.
            let read = {
                let mut room = (&mut buf).limit(READ_SIZE);
                tokio::select! {
                    read = rd.read_buf(&mut room), if can_read => Some(read?),
                    written = send_due(&mut wr, &self.queue), if !self.queue.is_empty() => {
                        let n = written?;
                        self.pop(n);
                        delivered(n as u64);
                        None
                    }
                }
            };
            if let Some(n) = read {
                let t_read = Instant::now();
                if n == 0 {
                    self.eof = Some(self.clock.due(t_read, 0));
                } else if n <= SMALL_READ {
                    // Copied out, so that the read buffer is reused rather than reallocated
                    // while a few bytes of it wait in the queue.
                    self.push(t_read, Bytes::copy_from_slice(&buf));
                    buf.clear();
                } else {
                    self.push(t_read, buf.split().freeze());
                }
            }
        }
    }

    /// Queues `data` read at `t_read`, cut into slices.
    fn push(&mut self, t_read: Instant, mut data: Bytes) {
        while !data.is_empty() {
            let bytes = data.split_to(data.len().min(self.clock.link.slice));
            let due = self.clock.due(t_read, bytes.len());
            self.queued += bytes.len();
            self.queue.push_back((due, bytes));
        }
    }

    /// Drops the first `n` queued bytes (written).
    fn pop(&mut self, mut n: usize) {
        self.queued -= n;
        while n > 0 {
            let Some((_, head)) = self.queue.front_mut() else {
                return;
            };
            if n >= head.len() {
                n -= head.len();
                self.queue.pop_front();
            } else {
                let _ = head.split_to(n);
                n = 0;
            }
        }
    }
}

/// Waits until the first slice of `queue` is due, then writes it with every slice due by then
/// (up to [`WRITE_GATHER`] bytes) in one call; returns how many bytes were written.
async fn send_due(
    wr: &mut OwnedWriteHalf,
    queue: &VecDeque<(Instant, Bytes)>,
) -> io::Result<usize> {
    let Some(&(due, _)) = queue.front() else {
        return Ok(0);
    };
    // Only the last slice queued (a request, a reply, the end of a burst) is worth a few
    // microseconds of spinning; in a stream, due times are absolute and lateness does not add up.
    let precision = if queue.len() == 1 {
        Precision::Exact
    } else {
        Precision::Timer
    };
    wait_until(due, precision).await;
    let now = Instant::now();
    let mut total = 0;
    let slices: Vec<IoSlice<'_>> = queue
        .iter()
        .take_while(|(due, bytes)| {
            let take = *due <= now && total < WRITE_GATHER;
            total += bytes.len();
            take
        })
        .map(|(_, bytes)| IoSlice::new(bytes))
        .collect();
    match wr.write_vectored(&slices).await? {
        0 => Err(io::ErrorKind::WriteZero.into()),
        n => Ok(n),
    }
}

/// How closely [`wait_until`] meets its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Precision {
    /// The timer alone: tens to a few hundreds of microseconds late (a VM wakes threads late).
    Timer,
    /// Ask the timer to wake us early by its usual lateness, then spin to the deadline.
    Exact,
}

/// The timer's average lateness in nanoseconds, over the whole process since it is a property
/// of the machine: how early [`Precision::Exact`] waits ask to be woken.
static TIMER_LATENESS_NS: AtomicU64 = AtomicU64::new(0);
/// The most one lateness sample counts for (a preempted thread is not the timer's fault), and
/// so the most an exact wait spins.
const MAX_LATENESS: Duration = Duration::from_micros(250);

/// Completes at `due`, never before it.
///
/// An exact wait spins only after a real sleep, for at most the timer's average lateness
/// (≤ 250 µs), and only when the sleep ended early: a stream of segments due in quick
/// succession never spins, and a sparse one (requests and replies) spins about half of its
/// waits for a few tens of microseconds.
async fn wait_until(due: Instant, precision: Precision) {
    let early = match precision {
        Precision::Timer => Duration::ZERO,
        Precision::Exact => Duration::from_nanos(TIMER_LATENESS_NS.load(Ordering::Relaxed)),
    };
    let target = due.checked_sub(early).unwrap_or(due);
    if precision == Precision::Timer || target <= Instant::now() {
        sleep_until(due).await;
        return;
    }
    sleep_until(target).await;
    let late = Instant::now()
        .saturating_duration_since(target)
        .min(MAX_LATENESS);
    let old = TIMER_LATENESS_NS.load(Ordering::Relaxed);
    let sample = u64::try_from(late.as_nanos()).unwrap_or(u64::MAX);
    TIMER_LATENESS_NS.store((old * 7 + sample) / 8, Ordering::Relaxed);
    while Instant::now() < due {
        std::hint::spin_loop();
    }
}

#[cfg(test)]
mod tests;
