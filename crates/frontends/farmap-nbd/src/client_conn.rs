//! One connection of the NBD client: the handshake (farmap-nbd-proto's [`ClientHandshake`],
//! STARTTLS through rustls), then a writer task and a reader task that match replies to
//! requests by cookie, so that any number of requests are in flight at once.
//!
//! - A request holds a permit of the connection's in-flight limit from before it is sent
//!   until its reply is complete (or the connection dies), so the queue to the writer never
//!   holds more than that limit.
//! - Every length the server sends is capped before anything is allocated for it: the reply
//!   decoder refuses chunks larger than the largest request this client sends, data must lie
//!   within the request it answers, and a read may be answered in at most
//!   [`max_pieces`] pieces.
//! - When the server closes the connection, sends something the protocol does not allow, or
//!   does not answer a request within the timeout, the connection dies: every request in
//!   flight on it fails with an error naming the server and the request, and later requests
//!   on it fail at once (the store opens a new connection for them).

use std::collections::{BTreeMap, HashMap};
use std::io::{self, IoSlice};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use farmap_core::{ErrorKind, StoreError, StoreResult};
use farmap_nbd_proto::consts::{errno, SIMPLE_REPLY_MAGIC, STRUCTURED_REPLY_MAGIC};
use farmap_nbd_proto::{
    Chunk, ClientConfig, ClientHandshake, ClientHandshakeError, ClientStep, Command, ExportDetails,
    Extent, Reply, ReplyDecoder, RequestHeader,
};
use farmap_net::{describe_client_tls_failure, BoxStream, RemoteAddr};
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};
use tokio::task::AbortHandle;
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::TlsConnector;

/// What a TLS connection needs: the connector, the name the server's certificate must
/// carry, and whether a client certificate is sent (for error messages).
#[derive(Clone)]
pub(crate) struct TlsSetup {
    pub(crate) connector: TlsConnector,
    pub(crate) name: ServerName<'static>,
    pub(crate) sent_cert: bool,
}

/// Where and how one connection is made.
pub(crate) struct Dial<'a> {
    pub(crate) addr: &'a RemoteAddr,
    pub(crate) export: &'a str,
    pub(crate) tls: Option<&'a TlsSetup>,
    /// How the server is named in messages (`nbd://host:port/export`).
    pub(crate) shown: &'a str,
    pub(crate) connect_timeout: Duration,
    pub(crate) request_timeout: Duration,
    pub(crate) max_in_flight: usize,
    /// The largest payload a request of this client carries or asks for.
    pub(crate) max_payload: u32,
}

/// One request.
#[derive(Debug, Clone)]
pub(crate) struct Request {
    pub(crate) command: Command,
    pub(crate) flags: u16,
    pub(crate) offset: u64,
    pub(crate) length: u32,
    /// A write's data (`length` bytes); empty otherwise.
    pub(crate) payload: Bytes,
    /// For `BLOCK_STATUS`: the metadata context whose extents are wanted.
    pub(crate) context: u32,
}

/// A successful reply.
#[derive(Debug)]
pub(crate) enum Answer {
    /// Not a read or block status.
    Done,
    /// A read's data, exactly the length asked for.
    Data(Bytes),
    /// The extents of the context asked for (at least one).
    Extents(Vec<Extent>),
}

/// The most pieces (data and hole chunks) a read of `len` bytes may come in: one per 512
/// bytes (a sector, the finest granularity servers use) and some slack.
pub(crate) fn max_pieces(len: u32) -> usize {
    len as usize / 512 + 64
}

fn command_name(c: Command) -> &'static str {
    match c {
        Command::Read => "read",
        Command::Write => "write",
        Command::Flush => "flush",
        Command::Trim => "trim",
        Command::WriteZeroes => "write-zeroes",
        Command::BlockStatus => "block-status",
        Command::Cache => "cache",
        Command::Disc => "disconnect",
        Command::Other(_) => "request",
    }
}

fn describe(command: Command, offset: u64, length: u32) -> String {
    match command {
        Command::Flush => "a flush".into(),
        c => format!("a {} of {length} bytes at offset {offset}", command_name(c)),
    }
}

fn errno_name(e: u32) -> &'static str {
    match e {
        errno::EPERM => "EPERM",
        errno::EIO => "EIO",
        errno::ENOMEM => "ENOMEM",
        errno::EINVAL => "EINVAL",
        errno::ENOSPC => "ENOSPC",
        errno::EOVERFLOW => "EOVERFLOW",
        errno::ENOTSUP => "ENOTSUP",
        errno::ESHUTDOWN => "ESHUTDOWN",
        _ => "an unknown error",
    }
}

/// The store error for an NBD error reply.
fn errno_error(shown: &str, what: &str, e: u32, message: &str) -> StoreError {
    let kind = match e {
        errno::EPERM => ErrorKind::ReadOnly,
        errno::EINVAL | errno::EOVERFLOW => ErrorKind::InvalidInput,
        errno::ENOSPC => ErrorKind::NoSpace,
        errno::ENOTSUP => ErrorKind::Unsupported,
        errno::ESHUTDOWN => ErrorKind::Unavailable,
        _ => ErrorKind::Io,
    };
    let tail = if message.is_empty() {
        String::new()
    } else {
        format!(": {message}")
    };
    StoreError::new(
        kind,
        format!(
            "the NBD server at {shown} failed {what} with {} ({e}){tail}",
            errno_name(e)
        ),
    )
}

enum Expect {
    Read,
    Status(u32),
    Plain,
}

/// A request waiting for (the rest of) its reply.
struct Pending {
    command: Command,
    offset: u64,
    length: u32,
    expect: Expect,
    tx: Option<oneshot::Sender<StoreResult<Answer>>>,
    _permit: OwnedSemaphorePermit,
    /// A read's data chunks, by offset.
    parts: Vec<(u64, Bytes)>,
    /// The byte ranges a read's chunks covered so far (start → end), to refuse overlaps.
    covered: BTreeMap<u64, u64>,
    covered_bytes: u64,
    extents: Option<Vec<Extent>>,
    /// The first error chunk, or what was wrong with the reply.
    error: Option<StoreError>,
}

impl Pending {
    fn what(&self) -> String {
        describe(self.command, self.offset, self.length)
    }

    /// Records that `offset..offset+len` of a read was answered; an error (for the request)
    /// if it lies outside the request or overlaps an earlier piece.
    fn cover(&mut self, offset: u64, len: u64) -> Result<(), String> {
        let end = offset.checked_add(len).ok_or("an offset past 2^64")?;
        if offset < self.offset || end > self.offset + u64::from(self.length) {
            return Err(format!(
                "a reply piece at {offset}..{end} lies outside the request"
            ));
        }
        if self.covered.len() >= max_pieces(self.length) {
            return Err(format!(
                "the reply came in more than {} pieces",
                max_pieces(self.length)
            ));
        }
        let before = self.covered.range(..=offset).next_back();
        let after = self.covered.range(offset..).next();
        if before.is_some_and(|(_, e)| *e > offset) || after.is_some_and(|(s, _)| *s < end) {
            return Err(format!("a reply piece at {offset}..{end} overlaps another"));
        }
        self.covered.insert(offset, end);
        self.covered_bytes += len;
        Ok(())
    }

    /// The result once the reply is complete.
    fn finish(mut self, shown: &str) -> StoreResult<Answer> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        let what = self.what();
        let corrupt = |why: String| {
            StoreError::new(
                ErrorKind::Corrupt,
                format!("the NBD server at {shown} answered {what} wrongly: {why}"),
            )
        };
        match self.expect {
            Expect::Plain => Ok(Answer::Done),
            Expect::Status(_) => match self.extents.take() {
                Some(e) => Ok(Answer::Extents(e)),
                None => Err(corrupt("no extents of base:allocation".into())),
            },
            Expect::Read => {
                if self.covered_bytes != u64::from(self.length) {
                    return Err(corrupt(format!(
                        "it covered {} of the {} bytes",
                        self.covered_bytes, self.length
                    )));
                }
                if self.parts.len() == 1 && self.parts[0].1.len() == self.length as usize {
                    return Ok(Answer::Data(self.parts.pop().expect("one part").1));
                }
                let mut out = BytesMut::zeroed(self.length as usize);
                for (at, data) in &self.parts {
                    let at = (at - self.offset) as usize;
                    out[at..at + data.len()].copy_from_slice(data);
                }
                Ok(Answer::Data(out.freeze()))
            }
        }
    }
}

#[derive(Default)]
struct Table {
    pending: HashMap<u64, Pending>,
    /// Why the connection is dead, once it is.
    dead: Option<(ErrorKind, String)>,
}

struct Shared {
    shown: String,
    table: Mutex<Table>,
    permits: Arc<Semaphore>,
    tasks: Mutex<Vec<AbortHandle>>,
    /// Raised once the connection is dead.
    dead: tokio::sync::watch::Sender<bool>,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Ends the connection: every request in flight fails with `why`, later ones at once.
    fn kill(&self, kind: ErrorKind, why: String) {
        let drained = {
            let mut t = self.lock();
            if t.dead.is_none() {
                t.dead = Some((kind, why.clone()));
            }
            std::mem::take(&mut t.pending)
        };
        if !drained.is_empty() {
            tracing::debug!("{why}: failing {} NBD requests in flight", drained.len());
        }
        for (_, mut p) in drained {
            let msg = format!("{why} ({} was in flight)", p.what());
            if let Some(tx) = p.tx.take() {
                let _ = tx.send(Err(StoreError::new(kind, msg)));
            }
        }
        self.permits.close();
        self.dead.send_replace(true);
        for t in self
            .tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            t.abort();
        }
    }

    fn dead_error(&self) -> Option<StoreError> {
        self.lock()
            .dead
            .as_ref()
            .map(|(k, m)| StoreError::new(*k, m.clone()))
    }

    /// Handles one decoded reply message (under the table's lock); an error ends the
    /// connection.
    fn on_reply(&self, t: &mut Table, reply: Reply) -> Result<(), String> {
        let shown = &self.shown;
        match reply {
            Reply::Simple {
                cookie,
                error,
                data,
            } => {
                let mut p = t
                    .pending
                    .remove(&cookie)
                    .ok_or_else(|| format!("it answered a request never sent (cookie {cookie})"))?;
                let tx = p.tx.take();
                let result = if error != 0 {
                    Err(errno_error(shown, &p.what(), error, ""))
                } else {
                    match (&p.expect, data) {
                        (Expect::Read, Some(d)) => {
                            p.covered_bytes = d.len() as u64;
                            p.parts.push((p.offset, d));
                            p.finish(shown)
                        }
                        (Expect::Read, None) => unreachable!("the decoder reads a read's data"),
                        (Expect::Status(_), _) => Err(StoreError::new(
                            ErrorKind::Corrupt,
                            format!(
                                "the NBD server at {shown} answered {} without extents",
                                p.what()
                            ),
                        )),
                        (Expect::Plain, _) => Ok(Answer::Done),
                    }
                };
                if let Some(tx) = tx {
                    let _ = tx.send(result);
                }
            }
            Reply::Chunk {
                cookie,
                done,
                chunk,
            } => {
                let p = t
                    .pending
                    .get_mut(&cookie)
                    .ok_or_else(|| format!("it answered a request never sent (cookie {cookie})"))?;
                let bad = match chunk {
                    Chunk::None => None,
                    Chunk::OffsetData { offset, data } => match p.expect {
                        Expect::Read => match p.cover(offset, data.len() as u64) {
                            Ok(()) => {
                                p.parts.push((offset, data));
                                None
                            }
                            Err(why) => Some(why),
                        },
                        _ => Some("data in the reply to a command that is not a read".into()),
                    },
                    Chunk::OffsetHole { offset, length } => match p.expect {
                        Expect::Read => p.cover(offset, length.into()).err(),
                        _ => Some("a hole in the reply to a command that is not a read".into()),
                    },
                    Chunk::BlockStatus { context, extents } => match p.expect {
                        Expect::Status(want) if want == context => {
                            if p.extents.is_none() {
                                p.extents = Some(extents);
                            }
                            None
                        }
                        Expect::Status(_) => None,
                        _ => Some("block status in the reply to another command".into()),
                    },
                    Chunk::Error {
                        errno: e,
                        message,
                        offset,
                    } => {
                        if p.error.is_none() {
                            let e = if e == 0 { errno::EIO } else { e };
                            let what = match offset {
                                Some(o) => format!("{} (at offset {o})", p.what()),
                                None => p.what(),
                            };
                            p.error = Some(errno_error(shown, &what, e, &message));
                        }
                        None
                    }
                };
                if let Some(why) = bad {
                    if p.error.is_none() {
                        p.error = Some(StoreError::new(
                            ErrorKind::Corrupt,
                            format!(
                                "the NBD server at {shown} answered {} wrongly: {why}",
                                p.what()
                            ),
                        ));
                    }
                }
                if done {
                    let mut p = t.pending.remove(&cookie).expect("found above");
                    let tx = p.tx.take();
                    let result = p.finish(shown);
                    if let Some(tx) = tx {
                        let _ = tx.send(result);
                    }
                }
            }
        }
        Ok(())
    }
}

/// One open connection.
pub(crate) struct Conn {
    shared: Arc<Shared>,
    tx: mpsc::Sender<(Bytes, Bytes)>,
    cookie: AtomicU64,
    timeout: Duration,
    pub(crate) details: ExportDetails,
}

impl Drop for Conn {
    fn drop(&mut self) {
        // The writer sends NBD_CMD_DISC and ends once every sender (this one) is gone; no
        // one waits for replies any more.
        if let Some(reader) = self
            .shared
            .tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .first()
        {
            reader.abort();
        }
    }
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("server", &self.shared.shown)
            .field("alive", &self.is_alive())
            .finish()
    }
}

impl Conn {
    /// Whether the connection can still carry requests.
    pub(crate) fn is_alive(&self) -> bool {
        self.shared.lock().dead.is_none()
    }

    /// Resolves once the connection is dead (at once if it already is).
    pub(crate) async fn dead(&self) {
        let mut rx = self.shared.dead.subscribe();
        let _ = rx.wait_for(|d| *d).await;
    }

    /// Closes the connection at once: requests in flight fail with `Closed`.
    pub(crate) fn close(&self, why: &str) {
        self.shared.kill(ErrorKind::Closed, why.to_owned());
    }

    /// Sends `req` and waits for its whole reply (up to the request timeout, after which
    /// the connection is closed).
    pub(crate) async fn call(&self, req: Request) -> StoreResult<Answer> {
        let dead = || {
            self.shared.dead_error().unwrap_or_else(|| {
                StoreError::new(
                    ErrorKind::Closed,
                    format!("the connection to {} is closed", self.shared.shown),
                )
            })
        };
        let permit = self
            .shared
            .permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| dead())?;
        let cookie = self.cookie.fetch_add(1, Ordering::Relaxed);
        let expect = match req.command {
            Command::Read => Expect::Read,
            Command::BlockStatus => Expect::Status(req.context),
            _ => Expect::Plain,
        };
        let (tx, rx) = oneshot::channel();
        {
            let mut t = self.shared.lock();
            if let Some((k, m)) = &t.dead {
                return Err(StoreError::new(*k, m.clone()));
            }
            t.pending.insert(
                cookie,
                Pending {
                    command: req.command,
                    offset: req.offset,
                    length: req.length,
                    expect,
                    tx: Some(tx),
                    _permit: permit,
                    parts: Vec::new(),
                    covered: BTreeMap::new(),
                    covered_bytes: 0,
                    extents: None,
                    error: None,
                },
            );
        }
        let header = RequestHeader {
            flags: req.flags,
            command: req.command,
            cookie,
            offset: req.offset,
            length: req.length,
        };
        // No await between registering and queueing: a caller that gives up cannot leave a
        // request registered but unsent. The queue holds at most the in-flight limit.
        if self
            .tx
            .try_send((Bytes::copy_from_slice(&header.to_bytes()), req.payload))
            .is_err()
        {
            self.shared.lock().pending.remove(&cookie);
            return Err(dead());
        }
        match tokio::time::timeout(self.timeout, rx).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(dead()),
            Err(_) => {
                let why = format!(
                    "the NBD server at {} did not answer {} within {:?}; its connection was closed",
                    self.shared.shown,
                    describe(req.command, req.offset, req.length),
                    self.timeout
                );
                self.shared.kill(ErrorKind::Timeout, why.clone());
                Err(StoreError::new(ErrorKind::Timeout, why))
            }
        }
    }
}

fn handshake_error(dial: &Dial<'_>, e: &ClientHandshakeError, tls: bool) -> StoreError {
    let (kind, hint) = match e {
        ClientHandshakeError::Refused { reply, option, .. } => {
            if reply.contains("TLS_REQD") {
                (
                    ErrorKind::PermissionDenied,
                    " (the server requires TLS: connect with nbds:// and ca=)",
                )
            } else if reply.contains("ERR_UNKNOWN") {
                (ErrorKind::NotFound, "")
            } else if option.contains("STARTTLS") {
                (
                    ErrorKind::Unsupported,
                    " (the server does not offer TLS: connect with nbd://)",
                )
            } else if reply.contains("ERR_POLICY") || reply.contains("ERR_TLS") {
                (ErrorKind::PermissionDenied, "")
            } else {
                (ErrorKind::Unsupported, "")
            }
        }
        ClientHandshakeError::NotNbd { found } if tls && (found >> 56) as u8 == 0x16 => (
            ErrorKind::Unsupported,
            " (it answered in TLS right away: NBD over TLS starts in plain text)",
        ),
        _ => (ErrorKind::Unsupported, ""),
    };
    StoreError::new(
        kind,
        format!("{e}{hint} (server {}, export {:?})", dial.addr, dial.export),
    )
}

fn io_error(addr: &RemoteAddr, during: &str, e: &io::Error, tls: Option<&TlsSetup>) -> StoreError {
    if let Some(t) = tls {
        if let Some(why) = describe_client_tls_failure(e, t.sent_cert) {
            return StoreError::new(
                ErrorKind::PermissionDenied,
                format!("TLS with the NBD server at {addr} failed: {why}"),
            );
        }
    }
    let why = match e.kind() {
        io::ErrorKind::UnexpectedEof => "the server closed the connection".to_owned(),
        io::ErrorKind::ConnectionRefused => "connection refused".to_owned(),
        _ => e.to_string(),
    };
    StoreError::new(
        ErrorKind::from_io(e.kind()),
        format!("cannot talk to the NBD server at {addr}: {why} {during}"),
    )
}

/// Connects, runs the handshake, and starts the connection's tasks.
pub(crate) async fn open(dial: &Dial<'_>) -> StoreResult<Arc<Conn>> {
    match tokio::time::timeout(dial.connect_timeout, open_inner(dial)).await {
        Ok(r) => r,
        Err(_) => Err(StoreError::new(
            ErrorKind::Timeout,
            format!(
                "no NBD handshake with the server at {} within {:?}",
                dial.addr, dial.connect_timeout
            ),
        )),
    }
}

async fn open_inner(dial: &Dial<'_>) -> StoreResult<Arc<Conn>> {
    let shown = dial.shown;
    let addr = dial.addr;
    let connect_err = |e: io::Error| io_error(addr, "(connecting)", &e, None);
    let mut stream: BoxStream = match dial.addr {
        RemoteAddr::Tcp(hp) => {
            let s = TcpStream::connect(hp.as_str()).await.map_err(connect_err)?;
            s.set_nodelay(true).map_err(connect_err)?;
            Box::new(s)
        }
        RemoteAddr::Unix(p) => Box::new(UnixStream::connect(p).await.map_err(connect_err)?),
    };
    let mut machine = ClientHandshake::new(ClientConfig {
        export: dial.export.to_owned(),
        tls: dial.tls.is_some(),
        structured: true,
        allocation: true,
    });
    let mut input = BytesMut::with_capacity(4096);
    let mut out = BytesMut::new();
    let mut in_tls = false;
    let details = loop {
        let step = machine
            .step(&mut input, &mut out)
            .map_err(|e| handshake_error(dial, &e, dial.tls.is_some()))?;
        let tls_now = if in_tls { dial.tls } else { None };
        if !out.is_empty() {
            stream
                .write_all(&out)
                .await
                .map_err(|e| io_error(addr, "during the handshake", &e, tls_now))?;
            stream
                .flush()
                .await
                .map_err(|e| io_error(addr, "during the handshake", &e, tls_now))?;
            out.clear();
        }
        match step {
            ClientStep::NeedMore => {
                let n = stream
                    .read_buf(&mut input)
                    .await
                    .map_err(|e| io_error(addr, "during the handshake", &e, tls_now))?;
                if n == 0 {
                    let e = io::Error::from(io::ErrorKind::UnexpectedEof);
                    return Err(io_error(addr, "during the handshake", &e, tls_now));
                }
            }
            ClientStep::StartTls => {
                let t = dial.tls.expect("TLS is asked for only with a TLS setup");
                if !input.is_empty() {
                    return Err(StoreError::new(
                        ErrorKind::Corrupt,
                        format!("the NBD server at {addr} sent data before the TLS handshake"),
                    ));
                }
                let tls = t
                    .connector
                    .connect(t.name.clone(), stream)
                    .await
                    .map_err(|e| io_error(addr, "during the TLS handshake", &e, Some(t)))?;
                stream = Box::new(tls);
                in_tls = true;
                machine.tls_started(&mut out);
            }
            ClientStep::Done(details) => break details,
        }
    };
    let (rd, wr) = tokio::io::split(stream);
    let max_in_flight = dial.max_in_flight.max(1);
    let shared = Arc::new(Shared {
        shown: shown.to_owned(),
        table: Mutex::new(Table::default()),
        permits: Arc::new(Semaphore::new(max_in_flight)),
        tasks: Mutex::new(Vec::new()),
        dead: tokio::sync::watch::channel(false).0,
    });
    let (tx, rx) = mpsc::channel(max_in_flight);
    let reader = tokio::spawn(read_replies(rd, shared.clone(), input, dial.max_payload));
    let writer = tokio::spawn(write_requests(wr, rx, shared.clone()));
    {
        let mut tasks = shared.tasks.lock().unwrap_or_else(|p| p.into_inner());
        tasks.push(reader.abort_handle());
        tasks.push(writer.abort_handle());
    }
    Ok(Arc::new(Conn {
        shared,
        tx,
        cookie: AtomicU64::new(1),
        timeout: dial.request_timeout,
        details,
    }))
}

/// How many bytes the reply at the front of `buf` needs in all, when that is known (its
/// length was checked by the decoder, which has seen the same header).
fn reply_len(buf: &[u8], t: &Table) -> Option<usize> {
    if buf.len() < 4 {
        return None;
    }
    let be32 = |at: usize| u32::from_be_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]);
    match be32(0) {
        SIMPLE_REPLY_MAGIC if buf.len() >= 16 => {
            let mut c = [0u8; 8];
            c.copy_from_slice(&buf[8..16]);
            let cookie = u64::from_be_bytes(c);
            let data = match t.pending.get(&cookie) {
                Some(p) if be32(4) == 0 && matches!(p.expect, Expect::Read) => p.length as usize,
                _ => 0,
            };
            Some(16 + data)
        }
        STRUCTURED_REPLY_MAGIC if buf.len() >= 20 => Some(20 + be32(16) as usize),
        _ => None,
    }
}

async fn read_replies(
    mut rd: ReadHalf<BoxStream>,
    shared: Arc<Shared>,
    mut buf: BytesMut,
    max_payload: u32,
) {
    let mut decoder = ReplyDecoder::new(max_payload);
    let shown = shared.shown.clone();
    let (kind, why) = 'conn: loop {
        let want = {
            let mut t = shared.lock();
            loop {
                let decoded = {
                    let t = &*t;
                    decoder.decode(&mut buf, |cookie| match t.pending.get(&cookie) {
                        Some(p) if matches!(p.expect, Expect::Read) => Some(p.length),
                        _ => None,
                    })
                };
                match decoded {
                    Ok(Some(reply)) => {
                        if let Err(why) = shared.on_reply(&mut t, reply) {
                            break 'conn (
                                ErrorKind::Corrupt,
                                format!("the NBD server at {shown} broke the protocol: {why}"),
                            );
                        }
                    }
                    Ok(None) => break reply_len(&buf, &t),
                    Err(e) => {
                        break 'conn (
                            ErrorKind::Corrupt,
                            format!("the NBD server at {shown} broke the protocol: {e}"),
                        )
                    }
                }
            }
        };
        // Room for the whole reply at the front (its length is capped by the decoder), and
        // for reading in large pieces.
        let need = want.unwrap_or(0).saturating_sub(buf.len()).max(64 * 1024);
        buf.reserve(need);
        match rd.read_buf(&mut buf).await {
            Ok(0) => {
                break (
                    ErrorKind::Unavailable,
                    format!("the NBD server at {shown} closed the connection"),
                )
            }
            Ok(_) => {}
            Err(e) => {
                break (
                    ErrorKind::from_io(e.kind()),
                    format!("the connection to the NBD server at {shown} failed: {e}"),
                )
            }
        }
    };
    shared.kill(kind, why);
}

/// Most bytes gathered into one write.
const BATCH_BYTES: usize = 1 << 20;
/// Payloads up to this size are copied next to their header; larger ones are written from
/// where they are.
const COPY_MAX: usize = 16 * 1024;

async fn write_requests(
    mut wr: WriteHalf<BoxStream>,
    mut rx: mpsc::Receiver<(Bytes, Bytes)>,
    shared: Arc<Shared>,
) {
    let result: io::Result<()> = async {
        let mut pieces: Vec<Bytes> = Vec::new();
        while let Some(first) = rx.recv().await {
            let mut small = BytesMut::new();
            let mut total = 0;
            let mut next = Some(first);
            while let Some((header, payload)) = next.take() {
                total += header.len() + payload.len();
                small.extend_from_slice(&header);
                if payload.len() <= COPY_MAX {
                    small.extend_from_slice(&payload);
                } else {
                    pieces.push(small.split().freeze());
                    pieces.push(payload);
                }
                if total >= BATCH_BYTES {
                    break;
                }
                next = rx.try_recv().ok();
            }
            if !small.is_empty() {
                pieces.push(small.freeze());
            }
            write_all_pieces(&mut wr, &mut pieces).await?;
            wr.flush().await?;
        }
        // Every sender is gone (the store let the connection go): say goodbye.
        let disc = RequestHeader {
            flags: 0,
            command: Command::Disc,
            cookie: 0,
            offset: 0,
            length: 0,
        };
        wr.write_all(&disc.to_bytes()).await?;
        wr.flush().await?;
        wr.shutdown().await
    }
    .await;
    if let Err(e) = result {
        shared.kill(
            ErrorKind::from_io(e.kind()),
            format!("writing to the NBD server at {} failed: {e}", shared.shown),
        );
    }
}

/// Writes every piece in order (vectored, without copying) and empties the list.
async fn write_all_pieces<W: AsyncWrite + Unpin>(
    out: &mut W,
    pieces: &mut Vec<Bytes>,
) -> io::Result<()> {
    let mut first = 0;
    while first < pieces.len() {
        let slices: Vec<IoSlice<'_>> = pieces[first..]
            .iter()
            .take(64)
            .map(|p| IoSlice::new(p))
            .collect();
        let mut n = out.write_vectored(&slices).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        while n > 0 {
            let p = &mut pieces[first];
            let take = n.min(p.len());
            p.advance(take);
            n -= take;
            if p.is_empty() {
                first += 1;
            }
        }
        while first < pieces.len() && pieces[first].is_empty() {
            first += 1;
        }
    }
    pieces.clear();
    Ok(())
}
