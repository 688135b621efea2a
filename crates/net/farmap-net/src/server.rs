//! The server behind `farmap serve`: any [`Store`] to any number of clients.
//!
//! # Concurrency
//! - One task accepts; one task per connection reads and decodes frames; every request runs
//!   in a task of its own, at most [`ServeOptions::max_in_flight_per_conn`] at once per
//!   connection; one writer task per connection sends replies in the order they complete.
//! - A request works on the store only in its connection's turn ([`crate::fair`]): at most
//!   [`ServeOptions::max_running`] at once over the server, a freed turn going to the
//!   connection with the fewest out, so clients that keep many requests queued do not slow
//!   one that asks one at a time.
//!
//! # Memory
//! - Every request is charged its bytes plus the bytes of its largest possible reply against
//!   a per-connection budget ([`ServeOptions::conn_budget`]) and then either the
//!   connection's own reserve (1 MiB, or four chunks if more) or a server-wide budget
//!   ([`ServeOptions::total_budget`]) before it runs ([`crate::budget`]: clients that hold
//!   the whole total do not starve the others); the charge is returned once its reply
//!   has been written to the socket. A client that stops reading its replies therefore stops
//!   the server from reading its requests (they wait in the socket: back-pressure, not
//!   memory). A frame larger than the read-ahead is charged to the server-wide budget as
//!   soon as its header announces it, before its bytes are read, and must arrive whole
//!   within [`ServeOptions::idle_timeout`] of its first bytes: many clients that each send
//!   most of a large frame and then trickle cannot pin `max_frame` bytes apiece.
//! - A client whose replies make no progress for [`ServeOptions::idle_timeout`] is cut off,
//!   and so is a client that sends nothing for that long with nothing in flight; a client
//!   has [`ServeOptions::handshake_timeout`] to finish the handshakes.
//! - Connections over [`ServeOptions::max_connections`] are answered with a refusal by a
//!   bounded pool of tasks; when that pool is busy they are closed at once.
//! - A frame that cannot be decoded (garbage, over the frame limit, a reply op from a
//!   client) ends that connection only: the server sends an error frame with id 0 saying
//!   why, lets the requests in flight finish, and closes it. Other connections go on.
//! - [`Server::shutdown`] stops accepting, stops reading requests, lets those in flight
//!   finish and be answered (for up to [`ServeOptions::shutdown_grace`]), closes every
//!   connection and flushes the store.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use farmap_core::option::{check_range, OutOfRange};
use farmap_core::{
    check_key, is_zero, zero_chunk, BoxFuture, Caps, ChunkIdx, ErrorKind, Geometry, Objects, Store,
    StoreError, StoreResult,
};
use farmap_wire::{
    decode_client_hello, read_reply_overhead, run_reply_overhead, ClientHello, Features, Frame,
    FrameDecoder, Limits, Message, Payload, Refusal, RegionInfo, RemoteError, RunData, ServerHello,
    ServerInfo, WireError, DEFAULT_MAX_BATCH, DEFAULT_MAX_FRAME, HEADER_LEN, MAX_BATCH_LIMIT,
    MAX_FRAME_LIMIT, MAX_IN_FLIGHT_LIMIT, MAX_MESSAGE, MAX_NAMES, MAX_OBJECT, VERSION,
};
use farmap_wire::{CHALLENGE_LABEL, CHALLENGE_LEN};
use futures::future::join_all;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tokio_rustls::TlsAcceptor;

use crate::accept::{accept_connections, check_max_connections, AcceptLoop, Activity};
use crate::addr::{ListenAddr, Listener};
use crate::auth::KeySlot;
use crate::budget::{Charge, Total};
use crate::counted::{Counted, Written, STOP_STALL};
use crate::fair::{self, Fair, Lane};
use crate::running::{Running, Starting};
use crate::stream::{
    describe_foreign_bytes, io_phrase, is_clean_close, make_room, raised, write_frames, BoxStream,
    READ_AHEAD,
};
use crate::tls::{describe_server_tls_failure, TlsConfigError, TlsServerConfig};

/// How a server serves.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Refuse writes and trims (the store itself may be writable).
    pub read_only: bool,
    /// Connections served at once; a client beyond is refused with a clear reason.
    pub max_connections: usize,
    /// Requests worked on at once per connection.
    pub max_in_flight_per_conn: usize,
    /// Store operations at once over all connections, taken from each connection in turn
    /// ([`crate::fair`]): about the CPU count for a store whose work is this host's
    /// ([`fair::local_limit`]: memory, local files; what `farmap serve` picks for them), more
    /// for one whose operations wait on other hosts ([`fair::REMOTE_LIMIT`], the default).
    pub max_running: usize,
    /// TLS (and mutual TLS when a client CA is given).
    pub tls: Option<TlsServerConfig>,
    /// Largest frame accepted and sent, header included.
    pub max_frame: u32,
    /// Most chunks in one read request.
    pub max_batch: u32,
    /// Time a client has to finish the TLS and farmap handshakes.
    pub handshake_timeout: Duration,
    /// A connection that sends nothing for this long while none of its requests is in
    /// flight is closed; so is one whose replies have not moved for this long (the client
    /// stopped reading).
    pub idle_timeout: Duration,
    /// Bytes of requests in flight and replies queued, per connection (raised to at least
    /// two frames of [`max_frame`](Self::max_frame)).
    pub conn_budget: usize,
    /// Bytes of requests in flight and replies queued, over all connections (raised to at
    /// least [`conn_budget`](Self::conn_budget)).
    pub total_budget: usize,
    /// How long [`Server::shutdown`] waits for requests in flight before it cuts connections.
    pub shutdown_grace: Duration,
    /// Clients must prove they hold this key (a challenge in the handshake; see
    /// [`crate::auth`]); while the slot is empty every client is refused. `None`: no key.
    pub auth: Option<KeySlot>,
    /// Log each connection's coming and going at `info` level (at `debug` when false).
    /// Protocol errors and refusals are logged at `warn` level either way.
    pub log: bool,
}

/// Default of [`ServeOptions::idle_timeout`].
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(120);
/// Default of [`ServeOptions::conn_budget`]: two default frames.
pub const DEFAULT_CONN_BUDGET: usize = 2 * DEFAULT_MAX_FRAME as usize;
/// Default of [`ServeOptions::total_budget`].
pub const DEFAULT_TOTAL_BUDGET: usize = 256 << 20;
/// Connections over the limit being answered with a refusal at once; more are closed
/// without an answer.
const REFUSAL_POOL: usize = 16;

impl Default for ServeOptions {
    /// Writable, 256 connections, 128 requests in flight each, 64 store operations at once,
    /// no TLS, default frame and
    /// batch limits, 10 s handshake, 120 s idle timeout, 32 MiB per connection and 256 MiB in
    /// all in flight, 10 s shutdown grace, logging on.
    fn default() -> Self {
        Self {
            read_only: false,
            max_connections: 256,
            max_in_flight_per_conn: 128,
            max_running: fair::REMOTE_LIMIT,
            tls: None,
            max_frame: DEFAULT_MAX_FRAME,
            max_batch: DEFAULT_MAX_BATCH,
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            conn_budget: DEFAULT_CONN_BUDGET,
            total_budget: DEFAULT_TOTAL_BUDGET,
            shutdown_grace: Duration::from_secs(10),
            auth: None,
            log: true,
        }
    }
}

/// Why a server could not start or stop cleanly.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The TLS files could not be used.
    #[error("the server's TLS configuration is unusable")]
    Tls(#[from] TlsConfigError),
    /// An option outside what the protocol allows.
    #[error(transparent)]
    BadOption(#[from] OutOfRange),
    /// The listener's address could not be read.
    #[error("cannot tell which address the server listens on")]
    LocalAddr(#[source] std::io::Error),
    /// The final flush of the store failed.
    #[error("flushing the store at shutdown failed")]
    Flush(#[source] StoreError),
}

/// Reads runs of contiguous chunks of a served store in one piece (run reads, op `READ_RUN`):
/// for a store that can copy a run out at once instead of chunk by chunk (a live region's
/// memory). Without one, the server answers run reads with one store read per chunk.
pub trait RunReader: Send + Sync + std::fmt::Debug + 'static {
    /// The bytes of chunks `start..start + count` of the served store, concatenated: exactly
    /// the sum of their lengths. The range has been checked against the store's geometry.
    fn read_run(&self, start: ChunkIdx, count: u32) -> BoxFuture<'_, StoreResult<Bytes>>;
}

struct Ctx {
    store: Arc<dyn Store>,
    runs: Option<Arc<dyn RunReader>>,
    /// Named objects this server exports instead of a region ([`serve_objects`]).
    objects: Option<Arc<dyn Objects>>,
    info: ServerInfo,
    opts: ServeOptions,
    tls: Option<TlsAcceptor>,
    shutdown: watch::Receiver<bool>,
    /// Bytes in flight over all connections (see the module docs).
    total: Total,
    /// The per-connection budget, as raised to fit two frames.
    conn_budget: usize,
    /// What each connection may hold beside the total: a read of a few chunks.
    reserve: usize,
    /// Tasks answering connections over the limit.
    refusals: Arc<Semaphore>,
    /// Turns at the store, shared out between the connections.
    fair: Fair,
}

impl Ctx {
    /// Logs a connection's coming or going: `info` when asked for, `debug` otherwise.
    fn note(&self, msg: std::fmt::Arguments<'_>) {
        if self.opts.log {
            tracing::info!("{msg}");
        } else {
            tracing::debug!("{msg}");
        }
    }
}

/// A running server. Dropping it stops it abruptly; [`shutdown`](Self::shutdown) stops it
/// cleanly.
#[derive(Debug)]
pub struct Server {
    running: Running,
    store: Arc<dyn Store>,
}

/// A budget in bytes as semaphore permits (a semaphore counts at most `u32::MAX` at once).
fn budget_permits(bytes: usize) -> usize {
    bytes.min(u32::MAX as usize)
}

/// Serves `store` on `listener` until [`Server::shutdown`]. Must be called from within a
/// Tokio runtime (the server's tasks are spawned on it).
pub fn serve(
    store: Arc<dyn Store>,
    listener: Listener,
    opts: ServeOptions,
) -> Result<Server, ServeError> {
    serve_with_runs(store, None, listener, opts)
}

/// [`serve`], with run reads answered by `runs` (which must read the same content as
/// `store`) rather than chunk by chunk.
pub fn serve_with_runs(
    store: Arc<dyn Store>,
    runs: Option<Arc<dyn RunReader>>,
    listener: Listener,
    opts: ServeOptions,
) -> Result<Server, ServeError> {
    serve_any(store, runs, None, listener, opts)
}

/// Serves named `objects` (a versioned layout's store: `versioned:(farmap://ADDR)/REGION`
/// on the client) rather than a region, with the same transports, TLS, keys and budgets.
/// Only clients that ask for objects ([`Features::OBJECTS`]) are served; every key a client
/// sends is checked ([`check_key`]) before `objects` sees it.
pub fn serve_objects(
    objects: Arc<dyn Objects>,
    listener: Listener,
    opts: ServeOptions,
) -> Result<Server, ServeError> {
    serve_any(Arc::new(NoRegion), None, Some(objects), listener, opts)
}

/// What an objects server announces as its region in the hello: one chunk, no caps, and
/// every operation refused (an objects client ignores it; a region client is refused).
#[derive(Debug)]
struct NoRegion;

impl NoRegion {
    fn refused<T>() -> StoreResult<T> {
        Err(StoreError::new(
            ErrorKind::Unsupported,
            "this server exports objects, not a region",
        ))
    }
}

impl Store for NoRegion {
    fn geometry(&self) -> Geometry {
        Geometry::new(64 << 10, 64 << 10).expect("a valid geometry")
    }
    fn caps(&self) -> Caps {
        Caps::NONE
    }
    fn read(&self, _: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async { Self::refused() })
    }
    fn write(&self, _: ChunkIdx, _: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async { Self::refused() })
    }
    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async { Ok(()) })
    }
    fn trim(&self, _: farmap_core::ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async { Self::refused() })
    }
    fn status(&self, _: ChunkIdx) -> BoxFuture<'_, StoreResult<farmap_core::ChunkStatus>> {
        Box::pin(async { Self::refused() })
    }
}

fn serve_any(
    store: Arc<dyn Store>,
    runs: Option<Arc<dyn RunReader>>,
    objects: Option<Arc<dyn Objects>>,
    listener: Listener,
    opts: ServeOptions,
) -> Result<Server, ServeError> {
    let g = store.geometry();
    let min_frame = read_reply_overhead(1) as u64 + u64::from(g.chunk_size());
    check_range(
        "the frame limit",
        opts.max_frame.into(),
        min_frame,
        MAX_FRAME_LIMIT.into(),
    )?;
    check_range(
        "the read batch limit",
        opts.max_batch.into(),
        1,
        MAX_BATCH_LIMIT.into(),
    )?;
    check_range(
        "the limit of requests in flight per connection",
        opts.max_in_flight_per_conn as u64,
        1,
        MAX_IN_FLIGHT_LIMIT.into(),
    )?;
    check_max_connections(opts.max_connections)?;
    check_range(
        "the limit of requests working on the store at once",
        opts.max_running as u64,
        1,
        65536,
    )?;
    let tls = match &opts.tls {
        Some(t) => Some(TlsAcceptor::from(t.build()?)),
        None => None,
    };
    let addr = listener.local_addr().map_err(ServeError::LocalAddr)?;
    let mut caps = store.caps();
    if opts.read_only {
        caps = caps.without(Caps::WRITE | Caps::TRIM);
    }
    let info = ServerInfo {
        version: VERSION,
        features: if objects.is_some() {
            Features::ALL | Features::OBJECTS
        } else {
            Features::ALL
        },
        region: RegionInfo {
            geometry: g,
            caps,
            read_only: opts.read_only,
        },
        max_frame: opts.max_frame,
        max_in_flight: opts.max_in_flight_per_conn as u32,
        max_batch: opts.max_batch,
        // Never 0 (0 means "not said").
        instance: rand::random::<u64>() | 1,
    };
    let starting = Starting::new();
    let shutdown = starting.shutdown.clone();
    let accept = starting.accept_loop(opts.max_connections, opts.shutdown_grace, "farmap server");
    let conn_budget = budget_permits(opts.conn_budget.max(2 * opts.max_frame as usize));
    let total_budget = budget_permits(opts.total_budget.max(conn_budget));
    let fair = Fair::new(opts.max_running);
    // At shutdown, requests that have not reached the store are answered with an error.
    fair.close_on(starting.shutdown.clone());
    let ctx = Arc::new(Ctx {
        // Each store operation takes its connection's turn.
        store: Arc::new(fair::InTurn::new(store.clone())),
        runs,
        objects,
        info,
        opts,
        tls,
        shutdown,
        total: Total::new(total_budget),
        conn_budget,
        reserve: RESERVE.max(4 * info.region.geometry.chunk_size() as usize),
        refusals: Arc::new(Semaphore::new(REFUSAL_POOL)),
        fair,
    });
    Ok(Server {
        running: starting.spawn(addr, accept_loop(listener, ctx, accept)),
        store,
    })
}

impl Server {
    /// The address the server listens on (with the real port when port 0 was asked for).
    pub fn local_addr(&self) -> &ListenAddr {
        self.running.local_addr()
    }

    /// Connections being served right now.
    pub fn connections(&self) -> usize {
        self.running.connections()
    }

    /// Its connections, counted while it runs (being served, accepted, refused).
    pub fn connection_stats(&self) -> std::sync::Arc<crate::ConnectionStats> {
        self.running.connection_stats()
    }

    /// Stops accepting, answers the requests in flight, closes every connection, and flushes
    /// the store.
    pub async fn shutdown(mut self) -> Result<(), ServeError> {
        self.running.stop().await;
        self.store.flush().await.map_err(ServeError::Flush)
    }
}

async fn accept_loop(listener: Listener, ctx: Arc<Ctx>, cfg: AcceptLoop) {
    let serving = ctx.clone();
    accept_connections(
        listener,
        cfg,
        |stream, peer, activity| connection(stream, peer, serving.clone(), activity),
        |stream, peer, n| refuse_full(stream, peer, &ctx, n),
    )
    .await;
}

/// The TLS handshake (if configured), then the client's hello: the stream and the hello, or
/// `None` after logging why not (and answering where the stream allows).
async fn handshake(
    stream: BoxStream,
    peer: &str,
    ctx: &Ctx,
) -> Option<(BoxStream, ClientHello, BytesMut)> {
    let mut stream: BoxStream = match &ctx.tls {
        Some(acceptor) => match acceptor.accept(stream).await {
            Ok(s) => Box::new(s),
            // A client that hangs up mid-handshake (a pool connection its owner no longer
            // needs, a port probe) is not a refusal worth a warning.
            Err(e) if crate::stream::is_clean_close(&e) => {
                tracing::info!("{peer} left during the TLS handshake");
                return None;
            }
            Err(e) => {
                tracing::warn!("refused {peer}: {}", describe_server_tls_failure(&e));
                return None;
            }
        },
        None => stream,
    };
    let mut buf = BytesMut::with_capacity(64);
    loop {
        match decode_client_hello(&mut buf) {
            Ok(Some(hello)) => return Some((stream, hello, buf)),
            Ok(None) => {}
            Err(e) => {
                let why = match &e {
                    WireError::BadMagic { found } => {
                        describe_foreign_bytes(found, ctx.tls.is_some())
                            .map_or_else(|| e.to_string(), str::to_owned)
                    }
                    _ => e.to_string(),
                };
                tracing::warn!("refused {peer}: {why}");
                let kind = ErrorKind::InvalidInput;
                let _ =
                    send_refusal(&mut stream, kind, format!("not a farmap client: {why}")).await;
                return None;
            }
        }
        match stream.read_buf(&mut buf).await {
            Ok(0) => return None,
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(
                    "{peer}: read failed during the handshake: {}",
                    io_phrase(&e)
                );
                return None;
            }
        }
    }
}

/// Challenges a client to prove it holds the key in `slot`: a fresh nonce out, its HMAC
/// back. `Err` says why not, in words for both logs and the client.
async fn challenge(
    stream: &mut BoxStream,
    buf: &mut BytesMut,
    asked: Features,
    slot: &KeySlot,
) -> Result<(), &'static str> {
    if !asked.contains(Features::AUTH) {
        return Err("this server requires a key, and the client has none");
    }
    let Some(key) = slot.get() else {
        return Err("this server takes no client yet");
    };
    let nonce = crate::auth::random_nonce();
    let mut out = BytesMut::new();
    ServerHello::Challenge(nonce).encode(&mut out);
    let io = |_| "the connection failed during the challenge";
    stream.write_all(&out).await.map_err(io)?;
    stream.flush().await.map_err(io)?;
    while buf.len() < CHALLENGE_LEN {
        if stream.read_buf(buf).await.map_err(io)? == 0 {
            return Err("the client left during the challenge");
        }
    }
    let answer = buf.split_to(CHALLENGE_LEN);
    let mut proof = [0u8; CHALLENGE_LEN];
    proof.copy_from_slice(&answer);
    if key.check(CHALLENGE_LABEL, &[&nonce], &proof) {
        Ok(())
    } else {
        Err("the client's key is not this server's")
    }
}

async fn send_refusal(
    stream: &mut BoxStream,
    kind: ErrorKind,
    message: String,
) -> std::io::Result<()> {
    let mut out = BytesMut::new();
    ServerHello::Refused(Refusal {
        version: VERSION,
        min_version: VERSION,
        max_version: VERSION,
        kind,
        message,
    })
    .encode(&mut out);
    stream.write_all(&out).await?;
    stream.shutdown().await
}

/// Answers a connection over the limit with a refusal, on a task of a bounded pool; when the
/// pool is busy the connection is closed without an answer.
fn refuse_full(stream: BoxStream, peer: String, ctx: &Arc<Ctx>, serving: usize) {
    let Ok(slot) = ctx.refusals.clone().try_acquire_owned() else {
        tracing::warn!("closed {peer}: already serving {serving} connections and answering {REFUSAL_POOL} more");
        return;
    };
    tracing::warn!("refusing {peer}: already serving {serving} connections");
    let ctx = ctx.clone();
    tokio::spawn(async move {
        let timeout = ctx.opts.handshake_timeout;
        let _ = tokio::time::timeout(timeout, async {
            if let Some((mut stream, _, _)) = handshake(stream, &peer, &ctx).await {
                let msg = format!(
                    "the server is already serving its limit of {} connections",
                    ctx.opts.max_connections
                );
                let _ = send_refusal(&mut stream, ErrorKind::Unavailable, msg).await;
            }
        })
        .await;
        drop(slot);
    });
}

async fn connection(stream: BoxStream, peer: String, ctx: Arc<Ctx>, activity: Arc<Activity>) {
    let timeout = ctx.opts.handshake_timeout;
    let Ok(accepted) = tokio::time::timeout(timeout, handshake(stream, &peer, &ctx)).await else {
        tracing::warn!("closed {peer}: no handshake within {timeout:?}");
        return;
    };
    let Some((mut stream, hello, buf)) = accepted else {
        return;
    };
    if hello.version != VERSION {
        let msg = format!(
            "this server speaks farmap protocol version {VERSION}; the client speaks version {}",
            hello.version
        );
        tracing::warn!("refused {peer}: {msg}");
        let _ = send_refusal(&mut stream, ErrorKind::Unsupported, msg).await;
        return;
    }
    let wants_objects = hello.features.contains(Features::OBJECTS);
    if wants_objects != ctx.objects.is_some() {
        let msg = if wants_objects {
            "this server exports a region, not objects: open its spec (farmap://HOST:PORT) \
             as a region, not inside versioned:(...)"
        } else {
            "this server exports objects (a versioned layout), not a region: open a region in \
             it as versioned:(SPEC)/REGION, SPEC being this server's farmap:// spec"
        };
        tracing::warn!("refused {peer}: {msg}");
        let _ = send_refusal(&mut stream, ErrorKind::Unsupported, msg.to_owned()).await;
        return;
    }
    let mut info = ctx.info;
    info.features = info.features & hello.features;
    let mut buf = buf;
    if let Some(slot) = &ctx.opts.auth {
        let proven = tokio::time::timeout(
            timeout,
            challenge(&mut stream, &mut buf, hello.features, slot),
        )
        .await
        .unwrap_or(Err("no answer to the challenge in time"));
        if let Err(why) = proven {
            tracing::warn!("refused {peer}: {why}");
            let msg = format!("authentication failed: {why}");
            let _ = send_refusal(&mut stream, ErrorKind::PermissionDenied, msg).await;
            return;
        }
        info.features = info.features | Features::AUTH;
    }
    let mut out = BytesMut::new();
    ServerHello::Accepted(info).encode(&mut out);
    let sent = tokio::time::timeout(timeout, async {
        stream.write_all(&out).await?;
        stream.flush().await
    })
    .await;
    if !matches!(sent, Ok(Ok(()))) {
        return;
    }
    ctx.note(format_args!("{peer} connected"));
    match serve_frames(stream, buf, &ctx, &activity).await {
        Ended::Normally(reason) => ctx.note(format_args!("{peer} closed: {reason}")),
        Ended::Badly(reason) => tracing::warn!("{peer} closed: {reason}"),
    }
}

/// Why a connection ended.
enum Ended {
    /// The client left, was idle, or the server is shutting down.
    Normally(String),
    /// A protocol error, a failed read or write, or a client that stopped reading.
    Badly(String),
}

impl Ended {
    fn reason(&self) -> &str {
        match self {
            Ended::Normally(r) | Ended::Badly(r) => r,
        }
    }
}

/// A reply and the budget its request holds until the reply has been written.
type Outgoing = (Vec<Bytes>, Option<Charge>);

/// The least each connection may hold beside the server's total (see [`crate::budget`]).
const RESERVE: usize = 1 << 20;

/// A frame that has started to arrive.
struct Partial {
    since: tokio::time::Instant,
    /// Its bytes beyond the read-ahead, charged to the server-wide budget.
    charge: Option<OwnedSemaphorePermit>,
}

/// The whole length of the frame whose start is in `buf` (0 before its length prefix is in;
/// the decoder has already refused lengths over the frame limit).
fn announced_len(buf: &[u8]) -> usize {
    match buf {
        [a, b, c, d, ..] => 4 + u32::from_be_bytes([*a, *b, *c, *d]) as usize,
        _ => 0,
    }
}

/// Bytes a request may hold: its own and those of its largest possible reply.
fn cost(ctx: &Ctx, msg: &Message, frame_len: usize) -> usize {
    let g = ctx.info.region.geometry;
    let reply = match msg {
        Message::Read(chunks) => {
            let payload: u64 = chunks.iter().map(|c| g.chunk_len(*c) as u64).sum();
            usize::try_from(read_reply_overhead(chunks.len()) as u64 + payload)
                .unwrap_or(usize::MAX)
        }
        Message::ReadRun { count, .. } => usize::try_from(
            run_reply_overhead(*count as usize) as u64
                + u64::from(*count) * u64::from(g.chunk_size()),
        )
        .unwrap_or(usize::MAX),
        // An object or a page of names: at most the largest object.
        Message::ObjGet(_) | Message::ObjList { .. } => HEADER_LEN + 1 + MAX_OBJECT,
        _ => HEADER_LEN + 1 + MAX_MESSAGE,
    };
    // Never more than a whole budget, so that every request can run.
    frame_len.saturating_add(reply).min(ctx.conn_budget)
}

/// Reads and answers requests until the peer leaves, a frame is bad, the peer is idle or stops
/// reading, or shutdown; returns why the connection ended.
async fn serve_frames(
    stream: BoxStream,
    mut buf: BytesMut,
    ctx: &Arc<Ctx>,
    activity: &Activity,
) -> Ended {
    let (mut rd, wr) = tokio::io::split(stream);
    let (mut wr, written) = Counted::new(wr);
    let in_flight = ctx.info.max_in_flight as usize;
    let idle_timeout = ctx.opts.idle_timeout;
    let (tx, mut rx) = mpsc::channel::<Outgoing>(in_flight + 1);
    let writer =
        tokio::spawn(async move { write_frames(&mut wr, &mut rx, Some(idle_timeout)).await });
    let permits = Arc::new(Semaphore::new(in_flight));
    activity.watch_slots(permits.clone(), in_flight);
    let mut c = Frames {
        ctx,
        activity,
        budget: ctx.total.connection(ctx.conn_budget, ctx.reserve),
        lane: ctx.fair.lane(),
        permits,
        in_flight,
        tasks: tokio::task::JoinSet::new(),
        decoder: FrameDecoder::new(Limits {
            max_frame: ctx.info.max_frame,
            max_batch: ctx.info.max_batch,
        }),
        shutdown: ctx.shutdown.clone(),
        idle: Box::pin(tokio::time::sleep(idle_timeout)),
        idle_timeout,
        writer,
        writer_done: false,
        tx,
        partial: None,
    };
    let ended = loop {
        if let Some(end) = c.start_buffered(&mut buf).await {
            break end;
        }
        if let Some(end) = c.hold_partial(&buf).await {
            break end;
        }
        make_room(&mut buf);
        if let Some(end) = c.read_more(&mut rd, &mut buf).await {
            break end;
        }
    };
    let Frames {
        writer,
        writer_done,
        tasks,
        tx,
        ..
    } = c;
    drop(tx);
    if writer_done {
        return ended;
    }
    let ending = Ending {
        writer,
        tasks,
        written,
    };
    ending.finish(ended).await
}

/// One connection's reading side: the requests it started, what they hold, and how its
/// input is coming.
struct Frames<'a> {
    ctx: &'a Arc<Ctx>,
    activity: &'a Activity,
    budget: crate::budget::Budget,
    /// The connection's turns at the store.
    lane: Lane,
    /// Slots of the requests in flight.
    permits: Arc<Semaphore>,
    in_flight: usize,
    /// The requests being answered: cancelled when the connection ends badly.
    tasks: tokio::task::JoinSet<()>,
    decoder: FrameDecoder,
    shutdown: watch::Receiver<bool>,
    idle: Pin<Box<tokio::time::Sleep>>,
    idle_timeout: Duration,
    writer: tokio::task::JoinHandle<std::io::Result<()>>,
    /// The writer has ended (and been awaited).
    writer_done: bool,
    tx: mpsc::Sender<Outgoing>,
    /// The frame still arriving: when its first bytes came, and its charge to the server's
    /// budget once it is larger than the read-ahead.
    partial: Option<Partial>,
}

impl Frames<'_> {
    /// Why the connection ends when its writer stopped with `r`.
    fn stopped_reading(&mut self, r: Result<std::io::Result<()>, tokio::task::JoinError>) -> Ended {
        self.writer_done = true;
        match r {
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::TimedOut => Ended::Badly(format!(
                "the client has not read its replies for {:?}",
                self.idle_timeout
            )),
            Ok(Err(e)) if is_clean_close(&e) => {
                Ended::Normally("the client closed the connection".to_owned())
            }
            Ok(Err(e)) => Ended::Badly(format!("sending failed: {}", io_phrase(&e))),
            _ => Ended::Badly("the connection's writer stopped".to_owned()),
        }
    }

    /// Starts every whole request in `buf`, each once it has a slot and its charge.
    async fn start_buffered(&mut self, buf: &mut BytesMut) -> Option<Ended> {
        loop {
            let before = buf.len();
            let frame = match self.decoder.decode(buf) {
                Ok(Some(f)) if f.msg.is_request() => f,
                Ok(Some(f)) => return Some(close_with(&self.tx, not_a_request(&f)).await),
                Ok(None) => return None,
                Err(e) => return Some(close_with(&self.tx, e.to_string()).await),
            };
            // Whole now: its receive charge is returned before the request is charged.
            self.partial = None;
            self.activity.touch();
            let frame_len = before - buf.len();
            let charge = cost(self.ctx, &frame.msg, frame_len);
            let (permits, budget) = (self.permits.clone(), &self.budget);
            let acquired = tokio::select! {
                p = async {
                    let slot = permits.acquire_owned().await.expect("never closed");
                    (slot, budget.charge(charge).await)
                } => p,
                _ = raised(&mut self.shutdown) => {
                    return Some(Ended::Normally("server shutting down".to_owned()));
                }
                r = &mut self.writer => return Some(self.stopped_reading(r)),
            };
            while self.tasks.try_join_next().is_some() {}
            self.tasks.spawn(answer(
                frame,
                self.ctx.clone(),
                self.lane.clone(),
                acquired,
                self.tx.clone(),
            ));
        }
    }

    /// Notes a frame that has begun to arrive in `buf`, and charges the server's budget for
    /// what of it does not fit the read-ahead, before it is read in.
    async fn hold_partial(&mut self, buf: &[u8]) -> Option<Ended> {
        if buf.is_empty() {
            self.partial = None;
            return None;
        }
        let p = self.partial.get_or_insert_with(|| Partial {
            since: tokio::time::Instant::now(),
            charge: None,
        });
        let need = announced_len(buf).saturating_sub(READ_AHEAD);
        if need == 0 || p.charge.is_some() {
            return None;
        }
        let held = tokio::select! {
            c = self.ctx.total.hold(need) => c,
            _ = &mut self.idle => {
                return Some(Ended::Badly(format!(
                    "no memory for a frame of {} bytes within {:?}",
                    announced_len(buf),
                    self.idle_timeout
                )));
            }
            _ = raised(&mut self.shutdown) => {
                return Some(Ended::Normally("server shutting down".to_owned()));
            }
            r = &mut self.writer => return Some(self.stopped_reading(r)),
        };
        if let Some(p) = &mut self.partial {
            p.charge = Some(held);
        }
        None
    }

    /// Reads more of the client's input into `buf`, or finds why the connection ends: the
    /// client left, a frame trickles in too slowly, the connection is idle, the server
    /// stops, or the client stopped reading its replies.
    async fn read_more(
        &mut self,
        rd: &mut tokio::io::ReadHalf<BoxStream>,
        buf: &mut BytesMut,
    ) -> Option<Ended> {
        let idle_timeout = self.idle_timeout;
        tokio::select! {
            r = rd.read_buf(buf) => match r {
                Ok(0) => Some(Ended::Normally("the client closed the connection".to_owned())),
                Ok(_) => {
                    // A trickle does not keep a frame alive: it has the idle timeout from its
                    // first bytes.
                    let mut deadline = tokio::time::Instant::now() + idle_timeout;
                    if let Some(p) = &self.partial {
                        deadline = deadline.min(p.since + idle_timeout);
                    }
                    self.idle.as_mut().reset(deadline);
                    None
                }
                Err(e) if is_clean_close(&e) => {
                    Some(Ended::Normally("the client closed the connection".to_owned()))
                }
                Err(e) => Some(Ended::Badly(format!("read failed: {}", io_phrase(&e)))),
            },
            _ = &mut self.idle => {
                if let Some(p) = &self.partial {
                    if p.since + idle_timeout <= tokio::time::Instant::now() {
                        return Some(Ended::Badly(format!(
                            "a frame of {} bytes did not arrive whole within {idle_timeout:?}",
                            announced_len(buf)
                        )));
                    }
                }
                if self.permits.available_permits() == self.in_flight && self.budget.is_idle() {
                    return Some(Ended::Normally(format!("idle for {idle_timeout:?}")));
                }
                self.idle.as_mut().reset(tokio::time::Instant::now() + idle_timeout);
                None
            }
            _ = raised(&mut self.shutdown) => {
                Some(Ended::Normally("server shutting down".to_owned()))
            }
            r = &mut self.writer => Some(self.stopped_reading(r)),
        }
    }
}

/// A connection's last steps: its requests' replies sent, or not.
struct Ending {
    writer: tokio::task::JoinHandle<std::io::Result<()>>,
    tasks: tokio::task::JoinSet<()>,
    written: Written,
}

impl Ending {
    /// Requests in flight hold their own senders: the writer ends after their replies, unless
    /// the connection ended badly (nobody reads them) or its client stopped reading them.
    async fn finish(mut self, ended: Ended) -> Ended {
        if matches!(ended, Ended::Badly(_)) {
            self.tasks.abort_all();
        }
        let (writer, tasks) = (&mut self.writer, &mut self.tasks);
        let finish = async {
            let _ = writer.await;
            // The writer failed: nobody will read what the requests answer.
            tasks.abort_all();
        };
        if self
            .written
            .unless_stalled(finish, STOP_STALL)
            .await
            .is_none()
        {
            self.writer.abort();
            self.tasks.abort_all();
            return Ended::Badly(format!(
                "{}; the client does not read its replies",
                ended.reason()
            ));
        }
        ended
    }
}

/// Works on one request and queues its reply (with the charge it keeps until written).
async fn answer(
    frame: Frame,
    ctx: Arc<Ctx>,
    lane: Lane,
    (slot, charge): (OwnedSemaphorePermit, Charge),
    tx: mpsc::Sender<Outgoing>,
) {
    // Its store operations take this connection's turns; the reply does not.
    let reply = Frame::new(frame.id, lane.run(execute(&ctx, frame.msg)).await);
    let mut parts = Vec::with_capacity(4);
    reply.encode_parts(&mut parts);
    drop(slot);
    let _ = tx.send((parts, Some(charge))).await;
}

fn not_a_request(f: &Frame) -> String {
    format!(
        "a client sent a reply frame (op {:#04x}), not a request",
        f.msg.op()
    )
}

/// Tells the client why its connection is being closed (frame id 0), returns the reason.
async fn close_with(tx: &mpsc::Sender<Outgoing>, reason: String) -> Ended {
    let frame = Frame::new(
        0,
        Message::Error(RemoteError {
            kind: ErrorKind::InvalidInput,
            message: format!("closing the connection: {reason}"),
        }),
    );
    let mut parts = Vec::new();
    frame.encode_parts(&mut parts);
    let _ = tx.send((parts, None)).await;
    Ended::Badly(format!("protocol error: {reason}"))
}

fn error_reply(e: &StoreError) -> Message {
    let lossy = e.to_owned_lossy();
    Message::Error(RemoteError {
        kind: e.kind(),
        message: lossy.context().to_owned(),
    })
}

fn read_only_reply() -> Message {
    Message::Error(RemoteError {
        kind: ErrorKind::ReadOnly,
        message: "this server is read-only".into(),
    })
}

fn payload(data: Bytes) -> Payload {
    if is_zero(&data) {
        Payload::Zero
    } else {
        Payload::Data(data)
    }
}

async fn execute(ctx: &Ctx, msg: Message) -> Message {
    let store = &ctx.store;
    let g = ctx.info.region.geometry;
    let result = match msg {
        Message::Read(chunks) => {
            let payload_bytes: u64 = chunks.iter().map(|c| g.chunk_len(*c) as u64).sum();
            let reply_bytes = read_reply_overhead(chunks.len()) as u64 + payload_bytes;
            if reply_bytes > u64::from(ctx.info.max_frame) {
                return Message::Error(RemoteError {
                    kind: ErrorKind::InvalidInput,
                    message: format!(
                        "a read of {} chunks needs a reply of {reply_bytes} bytes, over the frame limit of {}",
                        chunks.len(),
                        ctx.info.max_frame
                    ),
                });
            }
            if let [one] = chunks[..] {
                store
                    .read(one)
                    .await
                    .map(|d| Message::ReadOk(vec![payload(d)]))
            } else {
                join_all(chunks.iter().map(|c| store.read(*c)))
                    .await
                    .into_iter()
                    .map(|r| r.map(payload))
                    .collect::<Result<Vec<_>, _>>()
                    .map(Message::ReadOk)
            }
        }
        Message::ReadRun { start, count } => read_run(ctx, start, count).await,
        Message::Write { .. } | Message::Trim(_) if ctx.opts.read_only => return read_only_reply(),
        Message::Write { idx, data } => {
            let data = match data {
                Payload::Zero => zero_chunk(g.chunk_len(idx)),
                Payload::Data(d) => d,
            };
            store.write(idx, data).await.map(|()| Message::Done)
        }
        Message::Flush => store.flush().await.map(|()| Message::Done),
        Message::Trim(range) => store.trim(range).await.map(|()| Message::Done),
        Message::Status(idx) => store.status(idx).await.map(Message::StatusOk),
        Message::Geometry => Ok(Message::GeometryOk(ctx.info.region)),
        m @ (Message::ObjGet(_)
        | Message::ObjExists(_)
        | Message::ObjCreate { .. }
        | Message::ObjList { .. }
        | Message::ObjDelete(_)) => objects_op(ctx, m).await,
        other => {
            // The read loop only hands requests over.
            return Message::Error(RemoteError {
                kind: ErrorKind::InvalidInput,
                message: format!("op {:#04x} is not a request", other.op()),
            });
        }
    };
    result.unwrap_or_else(|e| error_reply(&e))
}

/// An objects request, in the connection's turn: every key checked before the objects see
/// it, and no reply larger than a frame.
async fn objects_op(ctx: &Ctx, msg: Message) -> StoreResult<Message> {
    let Some(objects) = &ctx.objects else {
        return Err(StoreError::new(
            ErrorKind::Unsupported,
            "this server exports a region, not objects",
        ));
    };
    let writes = matches!(msg, Message::ObjCreate { .. } | Message::ObjDelete(_));
    if writes && ctx.opts.read_only {
        return Err(StoreError::new(
            ErrorKind::ReadOnly,
            "this server is read-only",
        ));
    }
    // What a reply may hold: a frame, and no more than the request was charged.
    let max_reply = (ctx.info.max_frame as usize).min(HEADER_LEN + 1 + MAX_OBJECT);
    let _turn = fair::current_turn().await?;
    match msg {
        Message::ObjGet(key) => {
            check_key(&key)?;
            let data = objects.get(&key).await?;
            if let Some(d) = &data {
                if HEADER_LEN + 1 + d.len() > max_reply {
                    return Err(StoreError::new(
                        ErrorKind::InvalidInput,
                        format!(
                            "object {key} is {} bytes, more than a reply of {max_reply} holds",
                            d.len()
                        ),
                    ));
                }
            }
            Ok(Message::ObjData(data))
        }
        Message::ObjExists(key) => {
            check_key(&key)?;
            Ok(Message::ObjBool(objects.exists(&key).await?))
        }
        Message::ObjCreate { key, data } => {
            check_key(&key)?;
            if data.len() > MAX_OBJECT {
                return Err(StoreError::invalid(format!(
                    "object {key} is {} bytes, more than the {MAX_OBJECT} an object may be",
                    data.len()
                )));
            }
            Ok(Message::ObjBool(objects.create(&key, data).await?))
        }
        Message::ObjDelete(key) => {
            check_key(&key)?;
            objects.delete(&key).await?;
            Ok(Message::Done)
        }
        Message::ObjList { dir, after } => {
            check_key(&dir)?;
            let names = objects.list(&dir).await?;
            Ok(names_page(names, &after, max_reply))
        }
        other => Err(StoreError::invalid(format!(
            "op {:#04x} is not an objects request",
            other.op()
        ))),
    }
}

/// The names of a folder after `after` that fit one reply of at most `max_frame` bytes
/// ([`MAX_NAMES`] at most), and whether more follow. Names no key could hold (and names
/// with a `/`) are left out. The folder is listed whole at every page: its memory is the
/// store's listing, not charged to the connection (see `docs/limits.md`).
fn names_page(names: Vec<String>, after: &str, max_frame: usize) -> Message {
    let from = if after.is_empty() {
        0
    } else {
        names.partition_point(|n| n.as_str() <= after)
    };
    let mut room = max_frame.saturating_sub(HEADER_LEN + 5);
    let mut page = Vec::new();
    let mut more = false;
    for n in names.into_iter().skip(from) {
        // What a client takes as a name (no key could hold the others).
        if n.contains('/') || check_key(&n).is_err() {
            continue;
        }
        if page.len() == MAX_NAMES as usize || 2 + n.len() > room {
            more = true;
            break;
        }
        room -= 2 + n.len();
        page.push(n);
    }
    Message::ObjNames { names: page, more }
}

/// Chunks `start..start + count`, checked against the geometry: their total length.
fn run_len(g: Geometry, start: ChunkIdx, count: u32) -> StoreResult<usize> {
    let end = start.0.saturating_add(u64::from(count));
    if count == 0 || end > g.chunk_count() {
        return Err(StoreError::new(
            ErrorKind::OutOfRange,
            format!(
                "a run read of chunks {}..{end} reaches past the region's {} chunks",
                start.0,
                g.chunk_count()
            ),
        ));
    }
    let last = ChunkIdx(end - 1);
    Ok((g.offset_of(last) + g.chunk_len(last) as u64 - g.offset_of(start)) as usize)
}

/// A run read: the chunks' bytes (in one piece from the run reader, or chunk by chunk), zero
/// chunks found and left out, the others sent as slices of what was read (no copy).
async fn read_run(ctx: &Ctx, start: ChunkIdx, count: u32) -> StoreResult<Message> {
    let g = ctx.info.region.geometry;
    let len = run_len(g, start, count)?;
    let reply_bytes = run_reply_overhead(count as usize) + len;
    if reply_bytes > ctx.info.max_frame as usize {
        return Err(StoreError::new(
            ErrorKind::InvalidInput,
            format!(
                "a run read of {count} chunks needs a reply of {reply_bytes} bytes, over the \
                 frame limit of {}",
                ctx.info.max_frame
            ),
        ));
    }
    let chunks = (start.0..start.0 + u64::from(count)).map(ChunkIdx);
    let mut zero = Vec::with_capacity(count as usize);
    let mut pieces = Vec::new();
    match &ctx.runs {
        Some(runs) => {
            let turn = fair::current_turn().await?;
            let data = runs.read_run(start, count).await?;
            drop(turn);
            if data.len() != len {
                return Err(StoreError::new(
                    ErrorKind::Corrupt,
                    format!(
                        "reading chunks {}..{} gave {} bytes, not {len}",
                        start.0,
                        start.0 + u64::from(count),
                        data.len()
                    ),
                ));
            }
            // Adjacent chunks that are not zero travel as one slice of the buffer.
            let (mut at, mut from) = (0usize, 0usize);
            for idx in chunks {
                let n = g.chunk_len(idx);
                let z = is_zero(&data[at..at + n]);
                if z {
                    if from < at {
                        pieces.push(data.slice(from..at));
                    }
                    from = at + n;
                }
                zero.push(z);
                at += n;
            }
            if from < at {
                pieces.push(data.slice(from..at));
            }
        }
        None => {
            let read = join_all(chunks.map(|c| ctx.store.read(c))).await;
            for d in read {
                let d = d?;
                let z = is_zero(&d);
                zero.push(z);
                if !z {
                    pieces.push(d);
                }
            }
        }
    }
    Ok(Message::ReadRunOk(RunData::new(&zero, pieces)))
}

#[cfg(test)]
mod names_tests {
    use super::*;

    fn page(names: &[&str], after: &str, max_frame: usize) -> (Vec<String>, bool) {
        let names = names.iter().map(|n| (*n).to_owned()).collect();
        match names_page(names, after, max_frame) {
            Message::ObjNames { names, more } => (names, more),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_page_of_names_fits_its_frame_and_says_whether_more_follow() {
        let all = ["a", "bb", "ccc", "dddd"];
        assert_eq!(
            page(&all, "", 1 << 20),
            (
                vec!["a".into(), "bb".into(), "ccc".into(), "dddd".into()],
                false
            )
        );
        assert_eq!(
            page(&all, "bb", 1 << 20),
            (vec!["ccc".into(), "dddd".into()], false)
        );
        // After a name that is not listed: from the next one up.
        assert_eq!(
            page(&all, "b", 1 << 20),
            (vec!["bb".into(), "ccc".into(), "dddd".into()], false)
        );
        assert_eq!(page(&all, "dddd", 1 << 20), (Vec::new(), false));
        // Room for "a" (3 bytes) and "bb" (4) only.
        let small = HEADER_LEN + 5 + 7;
        assert_eq!(page(&all, "", small), (vec!["a".into(), "bb".into()], true));
        assert_eq!(page(&all, "bb", small), (vec!["ccc".into()], true));
        // Every reply fits the frame it was made for.
        let msg = names_page(all.iter().map(|n| (*n).to_owned()).collect(), "", small);
        assert!(Frame::new(1, msg).encoded_len() <= small);
        // At most MAX_NAMES names a reply, and never an empty or oversized name.
        let many: Vec<String> = (0..MAX_NAMES + 3).map(|i| format!("{i:08}")).collect();
        match names_page(many, "", 64 << 20) {
            Message::ObjNames { names, more } => {
                assert_eq!(names.len(), MAX_NAMES as usize);
                assert!(more);
            }
            other => panic!("{other:?}"),
        }
        let long = "x".repeat(farmap_wire::MAX_KEY + 1);
        // Nor a name a client would refuse.
        assert_eq!(
            page(&["", &long, "a/b", ".tmp", "ok"], "", 1 << 20),
            (vec!["ok".into()], false)
        );
    }
}
