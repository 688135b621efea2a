//! [`RemoteStore`]: a farmap server's region as a [`Store`].
//!
//! # Concurrency
//! - A pool of [`ClientOptions::connections`] connections; requests go round-robin to the
//!   open ones, each connection carrying up to the server's in-flight limit at once
//!   (pipelined: replies come back in any order and are matched by id).
//! - Each connection has a supervisor task. When the connection drops, the requests in
//!   flight on it fail at once with `Unavailable` (retryable: `Cached`, `Puller` and `Pusher`
//!   retry them) — except reads and status queries, which change nothing and are sent again
//!   on another connection within their deadline — and the supervisor reconnects with
//!   exponential backoff. New requests wait
//!   for an open connection, up to [`ClientOptions::request_timeout`].
//! - Every request has a deadline, [`ClientOptions::request_timeout`], covering the wait for
//!   a connection and the round trip; past it the request fails with `Timeout`.
//! - After a reconnect the server must serve the same region (geometry and read-only flag);
//!   a server that now serves another region is not used.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use farmap_core::{
    is_zero, zero_chunk, BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry,
    RetryPolicy, Store, StoreError, StoreResult,
};
use farmap_wire::{
    read_reply_overhead, run_reply_overhead, Features, Message, Payload, RunData, ServerInfo,
    MAX_RUN_LIMIT,
};
use futures::future::try_join_all;
use parking_lot::Mutex;
use tokio::time::Instant;

use crate::addr::RemoteAddr;
use crate::auth::Key;
use crate::conn::{open, Conn, TlsSetup};
use crate::pool::{Dial, Link, Pool, PoolOptions};
use crate::tls::TlsClientConfig;

/// The pauses between reconnect attempts: 50 ms doubling up to 2 s, with jitter, for as long
/// as the store is open.
pub fn reconnect_policy() -> RetryPolicy {
    RetryPolicy {
        attempts: u32::MAX,
        initial_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_secs(2),
    }
}

/// How a [`RemoteStore`] connects.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Connections in the pool (at least 1).
    pub connections: usize,
    /// Deadline of every request, from the call to the reply, including any wait for a
    /// (re)connection.
    pub request_timeout: Duration,
    /// Deadline of one connection attempt (TCP, TLS and farmap handshakes).
    pub connect_timeout: Duration,
    /// TLS; `None` for plain TCP or Unix sockets.
    pub tls: Option<TlsClientConfig>,
    /// Pauses between reconnect attempts (its `attempts` are ignored: a slot reconnects
    /// until the store closes).
    pub reconnect: RetryPolicy,
    /// A key to prove to a server that requires one (see [`crate::auth`]); a client with a
    /// key also refuses a server that does not ask for it.
    pub key: Option<Key>,
}

impl Default for ClientOptions {
    /// 4 connections, 30 s requests, 10 s connects, no TLS, default backoff.
    fn default() -> Self {
        Self {
            connections: 4,
            request_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            tls: None,
            reconnect: reconnect_policy(),
            key: None,
        }
    }
}

/// Opens the pool's connections, each checked to serve the region the store was opened on.
struct Dialer {
    addr: RemoteAddr,
    /// Features asked for beside the defaults.
    ask: Features,
    tls: Option<TlsSetup>,
    key: Option<Key>,
    connect_timeout: Duration,
    info: ServerInfo,
    restarts: Arc<Restarts>,
}

/// What a server's restart may have cost this client.
#[derive(Debug, Default)]
struct Restarts {
    /// The server instance last connected to (0: one that does not say).
    instance: AtomicU64,
    /// Writes and trims acknowledged, counted.
    writes: AtomicU64,
    /// Set when a restart lost acknowledged writes: every later request fails.
    lost: Mutex<Option<StoreError>>,
}

impl Restarts {
    /// Notes the instance of a new connection. A server whose store keeps nothing across a
    /// restart (no durable flush: `memory:`) that restarted after this client wrote to it
    /// has lost those writes: the store fails from now on, rather than read zeros for them.
    /// (A restarted server over a file keeps what it acknowledged: a process that dies leaves
    /// its writes in the kernel's page cache.)
    fn connected(&self, addr: &RemoteAddr, info: &ServerInfo) {
        let was = self.instance.swap(info.instance, Ordering::SeqCst);
        if was == 0 || info.instance == 0 || was == info.instance {
            return;
        }
        let volatile = !info.region.caps.contains(Caps::FLUSH);
        if !volatile || self.writes.load(Ordering::SeqCst) == 0 {
            return;
        }
        self.lost.lock().get_or_insert_with(|| {
            StoreError::new(
                ErrorKind::Corrupt,
                format!(
                    "the server at {addr} restarted, and its store keeps nothing across a \
                     restart: what this client wrote to it is gone; this store refuses every \
                     request from now on"
                ),
            )
        });
    }
}

impl Dialer {
    /// Whether a (re)connected server still serves what this store was opened on.
    fn check_same(&self, conn: &Conn) -> StoreResult<()> {
        let (now, was) = (conn.info(), &self.info);
        if now.region != was.region
            || now.max_frame < was.max_frame
            || now.max_batch < was.max_batch
        {
            return Err(StoreError::new(
                ErrorKind::Corrupt,
                format!(
                    "the server at {} now serves a different region ({}, caps {}) than when this store was opened ({}, caps {})",
                    self.addr,
                    now.region.geometry,
                    now.region.caps,
                    was.region.geometry,
                    was.region.caps
                ),
            ));
        }
        Ok(())
    }
}

impl Dial for Dialer {
    type Link = Conn;

    fn dial(&self) -> BoxFuture<'_, StoreResult<Arc<Conn>>> {
        Box::pin(async move {
            let key = self.key.as_ref();
            let c = open(
                &self.addr,
                self.tls.as_ref(),
                key,
                self.connect_timeout,
                self.ask,
            )
            .await?;
            match self.check_same(&c) {
                Ok(()) => {
                    self.restarts.connected(&self.addr, c.info());
                    Ok(c)
                }
                Err(e) => {
                    c.fail("it serves another region");
                    Err(e)
                }
            }
        })
    }

    fn shown(&self) -> String {
        self.addr.to_string()
    }
}

impl Link for Conn {
    fn is_open(&self) -> bool {
        Conn::is_open(self)
    }

    fn closed(&self) -> BoxFuture<'_, ()> {
        Box::pin(Conn::closed(self))
    }

    fn close(&self, why: &str) {
        self.fail(why);
    }
}

pub(crate) struct Client {
    addr: RemoteAddr,
    opts: ClientOptions,
    info: ServerInfo,
    links: Arc<Pool<Dialer>>,
    restarts: Arc<Restarts>,
}

/// A region served by a farmap server (`farmap serve`), used as a [`Store`].
pub struct RemoteStore {
    pool: Arc<Client>,
}

impl std::fmt::Debug for RemoteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteStore")
            .field("addr", &self.pool.addr)
            .field("geometry", &self.pool.info.region.geometry)
            .field("open_connections", &self.open_connections())
            .finish()
    }
}

fn tls_setup(addr: &RemoteAddr, cfg: &TlsClientConfig) -> StoreResult<TlsSetup> {
    let (connector, name) = cfg.connector(addr.host()).map_err(|e| {
        StoreError::new(
            ErrorKind::InvalidInput,
            format!("cannot set up TLS for {addr}"),
        )
        .with_source(e)
    })?;
    Ok(TlsSetup {
        connector,
        name,
        sent_cert: cfg.has_client_cert(),
    })
}

impl RemoteStore {
    /// Connects to the server at `addr`: the first connection is made now (its failure is
    /// the error, in a sentence: refused, TLS refused and why, version mismatch...), the rest
    /// of the pool in the background.
    pub async fn connect(addr: RemoteAddr, opts: ClientOptions) -> StoreResult<RemoteStore> {
        let pool = Arc::new(Client::connect(addr, opts, Features::NONE).await?);
        Ok(RemoteStore { pool })
    }

    /// The server's address.
    pub fn addr(&self) -> &RemoteAddr {
        &self.pool.addr
    }

    /// What the server announced in the first handshake.
    pub fn server_info(&self) -> &ServerInfo {
        &self.pool.info
    }

    /// Connections of the pool that are open right now.
    pub fn open_connections(&self) -> usize {
        self.pool.links.open_count()
    }

    /// Closes every connection; requests in flight fail and later ones fail with `Closed`.
    /// Dropping the store does the same.
    pub fn close(&self) {
        self.pool.links.close("the client closed the store");
    }

    /// Reads several chunks, in batches as large as the server allows (sent concurrently):
    /// the chunks in the order asked for.
    pub async fn read_many(&self, chunks: &[ChunkIdx]) -> StoreResult<Vec<Bytes>> {
        let g = self.pool.info.region.geometry;
        let max_frame = self.pool.info.max_frame as usize;
        let max_batch = self.pool.info.max_batch as usize;
        let mut batches: Vec<&[ChunkIdx]> = Vec::new();
        let (mut start, mut bytes) = (0, 0usize);
        for (i, idx) in chunks.iter().enumerate() {
            let len = g.chunk_len(*idx);
            let n = i - start;
            if n > 0 && (n == max_batch || read_reply_overhead(n + 1) + bytes + len > max_frame) {
                batches.push(&chunks[start..i]);
                (start, bytes) = (i, 0);
            }
            bytes += len;
        }
        if start < chunks.len() {
            batches.push(&chunks[start..]);
        }
        let parts = try_join_all(batches.into_iter().map(|b| self.read_batch(b))).await?;
        Ok(parts.into_iter().flatten().collect())
    }

    async fn read_batch(&self, chunks: &[ChunkIdx]) -> StoreResult<Vec<Bytes>> {
        for idx in chunks {
            self.pool.info.region.geometry.check_idx(*idx)?;
        }
        match self.pool.call(Message::Read(chunks.to_vec())).await? {
            Message::ReadOk(payloads) if payloads.len() == chunks.len() => chunks
                .iter()
                .zip(payloads)
                .map(|(idx, p)| self.chunk(*idx, p))
                .collect(),
            other => Err(self.pool.unexpected("read", &other)),
        }
    }

    /// Whether the server reads runs of chunks in one request (it granted
    /// [`Features::RUN_READS`]); otherwise [`read_run`](Self::read_run) reads chunk by chunk.
    pub fn reads_runs(&self) -> bool {
        self.pool.info.features.contains(Features::RUN_READS)
    }

    /// Most chunks one [`read_run`](Self::read_run) may ask for: what fits the server's frame
    /// limit (and, with a server that does not read runs, its batch limit).
    pub fn max_run(&self) -> u32 {
        let info = &self.pool.info;
        let chunk = u64::from(info.region.geometry.chunk_size()).max(1);
        if !self.reads_runs() {
            return info.max_batch.max(1);
        }
        let room = u64::from(info.max_frame)
            .saturating_sub(run_reply_overhead(MAX_RUN_LIMIT as usize) as u64);
        u32::try_from(room / chunk)
            .unwrap_or(u32::MAX)
            .clamp(1, MAX_RUN_LIMIT)
    }

    /// Reads chunks `start..start + count` (`count` from 1 to [`max_run`](Self::max_run)) in
    /// one request: which are zero (no bytes travel for them) and the bytes of the others,
    /// concatenated, in one piece. With a server that does not read runs, the chunks are read
    /// in one batch and zero ones found here.
    pub async fn read_run(&self, start: ChunkIdx, count: u32) -> StoreResult<RunData> {
        let g = self.pool.info.region.geometry;
        let end = start.0.saturating_add(u64::from(count));
        if count == 0 || count > self.max_run() || end > g.chunk_count() {
            return Err(StoreError::new(
                ErrorKind::OutOfRange,
                format!(
                    "a run read of chunks {}..{end} from {}: runs have 1 to {} chunks within \
                     the region's {}",
                    start.0,
                    self.pool.addr,
                    self.max_run(),
                    g.chunk_count()
                ),
            ));
        }
        let chunks: Vec<ChunkIdx> = (start.0..end).map(ChunkIdx).collect();
        if !self.reads_runs() {
            let data = self.read_batch(&chunks).await?;
            let zero: Vec<bool> = data.iter().map(|d| is_zero(d)).collect();
            let pieces = data.into_iter().filter(|d| !is_zero(d)).collect();
            return Ok(RunData::new(&zero, pieces));
        }
        let run = match self.pool.call(Message::ReadRun { start, count }).await? {
            Message::ReadRunOk(run) if run.count() == count as usize => run,
            other => return Err(self.pool.unexpected("run read", &other)),
        };
        let want: usize = chunks
            .iter()
            .enumerate()
            .filter(|(i, _)| !run.is_zero(*i))
            .map(|(_, c)| g.chunk_len(*c))
            .sum();
        if run.data_len() != want {
            return Err(StoreError::new(
                ErrorKind::Corrupt,
                format!(
                    "{} answered a run read of chunks {}..{end} with {} bytes of data; its \
                     chunks that are not zero hold {want}",
                    self.pool.addr,
                    start.0,
                    run.data_len()
                ),
            ));
        }
        Ok(run)
    }

    fn chunk(&self, idx: ChunkIdx, p: Payload) -> StoreResult<Bytes> {
        let len = self.pool.info.region.geometry.chunk_len(idx);
        match p {
            Payload::Zero => Ok(zero_chunk(len)),
            Payload::Data(d) if d.len() == len => Ok(d),
            Payload::Data(d) => Err(StoreError::new(
                ErrorKind::Corrupt,
                format!(
                    "{} sent {} bytes for {idx}, which is {len} bytes long",
                    self.pool.addr,
                    d.len()
                ),
            )),
        }
    }

    async fn done(&self, what: &str, msg: Message) -> StoreResult<()> {
        match self.pool.call(msg).await? {
            Message::Done => Ok(()),
            other => Err(self.pool.unexpected(what, &other)),
        }
    }
}

impl Drop for RemoteStore {
    fn drop(&mut self) {
        self.close();
    }
}

impl Client {
    /// Connects to the server at `addr`, asking for `ask` beside the default features: the
    /// first connection now, the rest of the pool in the background.
    pub(crate) async fn connect(
        addr: RemoteAddr,
        opts: ClientOptions,
        ask: Features,
    ) -> StoreResult<Client> {
        let tls = opts.tls.as_ref().map(|t| tls_setup(&addr, t)).transpose()?;
        let first = open(
            &addr,
            tls.as_ref(),
            opts.key.as_ref(),
            opts.connect_timeout,
            ask,
        )
        .await?;
        let n = opts.connections.max(1);
        let mut initial = vec![Some(first.clone())];
        initial.resize(n, None);
        let restarts = Arc::new(Restarts::default());
        restarts.connected(&addr, first.info());
        let dialer = Dialer {
            addr: addr.clone(),
            ask,
            tls,
            key: opts.key.clone(),
            connect_timeout: opts.connect_timeout,
            info: *first.info(),
            restarts: restarts.clone(),
        };
        let links = Pool::start(
            dialer,
            PoolOptions {
                reconnect: opts.reconnect,
                fail_fast: false,
            },
            initial,
        );
        Ok(Client {
            info: *first.info(),
            addr,
            opts,
            links,
            restarts,
        })
    }

    /// The server's address.
    pub(crate) fn addr(&self) -> &RemoteAddr {
        &self.addr
    }

    /// The largest frame the server takes, in bytes.
    pub(crate) fn max_frame(&self) -> usize {
        self.info.max_frame as usize
    }

    /// Closes every connection.
    pub(crate) fn close(&self, why: &str) {
        self.links.close(why);
    }

    /// One request with the request deadline; error replies become errors.
    /// Fails once a server restart may have lost acknowledged writes ([`Restarts`]).
    fn check_not_lost(&self) -> StoreResult<()> {
        match &*self.restarts.lost.lock() {
            Some(e) => Err(e.to_owned_lossy()),
            None => Ok(()),
        }
    }

    /// An open connection: checked after it is had, since a restart is noticed when the
    /// connection that shows it is made.
    async fn link(&self, deadline: Instant) -> StoreResult<Arc<Conn>> {
        self.check_not_lost()?;
        let conn = self.links.get(deadline).await?;
        self.check_not_lost()?;
        Ok(conn)
    }

    pub(crate) async fn call(&self, msg: Message) -> StoreResult<Message> {
        let timeout = self.opts.request_timeout;
        let deadline = Instant::now() + timeout;
        // A read that changes nothing is sent again on another connection if its own was
        // lost under it (a server restart racing the request): once, within the same deadline.
        // Writes, trims and flushes are not: their outcome is unknown, the caller decides.
        let resend = matches!(
            msg,
            Message::Read(_)
                | Message::ReadRun { .. }
                | Message::Status(_)
                | Message::Geometry
                | Message::ObjGet(_)
                | Message::ObjExists(_)
                | Message::ObjList { .. }
        )
        .then(|| msg.clone());
        let conn = self.link(deadline).await?;
        let mut reply = tokio::time::timeout_at(deadline, conn.call(msg)).await;
        if let (Ok(Err(e)), Some(again)) = (&reply, resend) {
            if e.kind() == ErrorKind::Unavailable {
                let conn = self.link(deadline).await?;
                reply = tokio::time::timeout_at(deadline, conn.call(again)).await;
            }
        }
        match reply {
            Ok(Ok(Message::Error(e))) => Err(StoreError::new(
                e.kind,
                format!("{}: {}", self.addr, e.message),
            )),
            Ok(r) => r,
            Err(_) => Err(StoreError::new(
                ErrorKind::Timeout,
                format!("no reply from {} within {timeout:?}", self.addr),
            )),
        }
    }

    pub(crate) fn unexpected(&self, what: &str, reply: &Message) -> StoreError {
        StoreError::new(
            ErrorKind::Corrupt,
            format!(
                "{} answered a {what} request with op {:#04x}",
                self.addr,
                reply.op()
            ),
        )
    }
}

impl Store for RemoteStore {
    fn geometry(&self) -> Geometry {
        self.pool.info.region.geometry
    }

    fn caps(&self) -> Caps {
        self.pool.info.region.caps
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            let mut chunks = self.read_batch(&[idx]).await?;
            Ok(chunks.pop().expect("one chunk asked, one returned"))
        })
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            // Checked here: a wrong length could make a frame the server refuses outright.
            self.pool
                .info
                .region
                .geometry
                .check_write(idx, data.len())?;
            let zero_writes = self.pool.info.features.contains(Features::ZERO_WRITES);
            let data = if zero_writes && is_zero(&data) {
                Payload::Zero
            } else {
                Payload::Data(data)
            };
            self.done("write", Message::Write { idx, data }).await?;
            self.pool.restarts.writes.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(self.done("flush", Message::Flush))
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            self.pool.info.region.geometry.check_range(range)?;
            self.done("trim", Message::Trim(range)).await?;
            self.pool.restarts.writes.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        Box::pin(async move {
            match self.pool.call(Message::Status(idx)).await? {
                Message::StatusOk(s) => Ok(s),
                other => Err(self.pool.unexpected("status", &other)),
            }
        })
    }

    fn chunks_per_read(&self) -> u32 {
        self.max_run()
    }

    /// Runs of up to [`max_run`](Self::max_run) chunks, one request each (sent
    /// concurrently); a zero chunk costs no bytes on the wire.
    fn read_chunks(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<Vec<Bytes>>> {
        Box::pin(async move {
            let g = self.pool.info.region.geometry;
            g.check_range(range)?;
            let max = u64::from(self.max_run());
            let runs = (range.start.0..range.end.0)
                .step_by(usize::try_from(max).unwrap_or(usize::MAX))
                .map(|at| (ChunkIdx(at), (range.end.0 - at).min(max) as u32));
            let parts =
                try_join_all(runs.map(|(start, count)| self.run_chunks(start, count))).await?;
            Ok(parts.into_iter().flatten().collect())
        })
    }
}

impl RemoteStore {
    /// The chunks of one [`read_run`](Self::read_run), each whole (slices of the reply's
    /// buffer; zero chunks shared zeros).
    async fn run_chunks(&self, start: ChunkIdx, count: u32) -> StoreResult<Vec<Bytes>> {
        let g = self.pool.info.region.geometry;
        let run = self.read_run(start, count).await?;
        let data = run.data();
        let mut at = 0;
        Ok((0..count as usize)
            .map(|i| {
                let len = g.chunk_len(ChunkIdx(start.0 + i as u64));
                if run.is_zero(i) {
                    zero_chunk(len)
                } else {
                    at += len;
                    data.slice(at - len..at)
                }
            })
            .collect())
    }
}
