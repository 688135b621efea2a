//! One client connection: connect, handshake, then pipelined requests.
//!
//! A writer task sends the frames callers hand it over a channel; a reader task decodes
//! replies and hands each to the caller waiting for its id. When the connection drops, every
//! request still waiting fails at once with [`ErrorKind::Unavailable`] (retryable), and the
//! connection refuses new ones.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use farmap_core::{ErrorKind, StoreError, StoreResult};
use farmap_wire::{
    decode_server_hello, ClientHello, Frame, FrameDecoder, Limits, Message, Refusal, ServerHello,
    ServerInfo, WireError, VERSION,
};
use farmap_wire::{Features, CHALLENGE_LABEL};
use parking_lot::Mutex;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadHalf};
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::{mpsc, oneshot, watch, Semaphore};
use tokio_rustls::TlsConnector;

use crate::addr::RemoteAddr;
use crate::auth::Key;
use crate::stream::{
    io_phrase, is_clean_close, is_http2, is_tls_record, make_room, raised, write_frames, BoxStream,
};
use crate::tls::describe_client_tls_failure;

/// How to wrap a connection in TLS.
#[derive(Clone)]
pub(crate) struct TlsSetup {
    pub(crate) connector: TlsConnector,
    pub(crate) name: ServerName<'static>,
    pub(crate) sent_cert: bool,
}

type Reply = oneshot::Sender<StoreResult<Message>>;

struct State {
    /// Why the connection is closed, once it is.
    closed: Option<String>,
    pending: HashMap<u64, Reply>,
    /// A connection-level error the server sent (frame id 0) before closing.
    server_said: Option<String>,
}

/// A live connection to a server.
pub(crate) struct Conn {
    label: Arc<str>,
    info: ServerInfo,
    tx: mpsc::Sender<(Vec<Bytes>, ())>,
    state: Mutex<State>,
    open: AtomicBool,
    next_id: AtomicU64,
    permits: Semaphore,
    closed: watch::Sender<bool>,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("to", &self.label)
            .field("open", &self.is_open())
            .finish()
    }
}

fn lost(label: &str, reason: &str) -> StoreError {
    StoreError::new(
        ErrorKind::Unavailable,
        format!("the connection to {label} was lost: {reason}"),
    )
}

/// Removes a request's entry when its caller stops waiting (timeout, cancellation).
struct Deregister<'a> {
    conn: &'a Conn,
    id: u64,
}

impl Drop for Deregister<'_> {
    fn drop(&mut self) {
        self.conn.state.lock().pending.remove(&self.id);
    }
}

impl Conn {
    /// What the server announced.
    pub(crate) fn info(&self) -> &ServerInfo {
        &self.info
    }

    /// Whether requests may still be sent.
    pub(crate) fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    /// Resolves once the connection is closed (at once if it already is).
    pub(crate) async fn closed(&self) {
        let mut rx = self.closed.subscribe();
        let _ = rx.wait_for(|c| *c).await;
    }

    /// Sends `msg` and waits for its reply. An error reply from the server is returned as
    /// `Ok(Message::Error(..))`; a lost connection as an `Unavailable` error.
    pub(crate) async fn call(&self, msg: Message) -> StoreResult<Message> {
        let Ok(_permit) = self.permits.acquire().await else {
            return Err(self.lost_error());
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut st = self.state.lock();
            if let Some(reason) = &st.closed {
                return Err(lost(&self.label, reason));
            }
            st.pending.insert(id, tx);
        }
        let _deregister = Deregister { conn: self, id };
        let frame = Frame::new(id, msg);
        let mut parts = Vec::with_capacity(4);
        frame.encode_parts(&mut parts);
        if self.tx.send((parts, ())).await.is_err() {
            return Err(self.lost_error());
        }
        match rx.await {
            Ok(reply) => reply,
            Err(_) => Err(self.lost_error()),
        }
    }

    fn lost_error(&self) -> StoreError {
        let st = self.state.lock();
        lost(
            &self.label,
            st.closed.as_deref().unwrap_or("the connection is closed"),
        )
    }

    /// Marks the connection closed and fails every request waiting on it.
    pub(crate) fn fail(&self, reason: &str) {
        let pending = {
            let mut st = self.state.lock();
            if st.closed.is_some() {
                return;
            }
            let reason = match &st.server_said {
                Some(said) => format!("{reason} (the server said: {said})"),
                None => reason.to_owned(),
            };
            st.closed = Some(reason);
            self.open.store(false, Ordering::Release);
            std::mem::take(&mut st.pending)
        };
        self.permits.close();
        let _ = self.closed.send(true);
        let err = self.lost_error();
        for (_, reply) in pending {
            let _ = reply.send(Err(err.to_owned_lossy()));
        }
    }

    fn complete(&self, frame: Frame) {
        if frame.id == 0 {
            if let Message::Error(e) = frame.msg {
                self.state.lock().server_said = Some(e.message);
            }
            return;
        }
        // A reply to a request that timed out meanwhile finds no one waiting: dropped.
        let reply = self.state.lock().pending.remove(&frame.id);
        if let Some(reply) = reply {
            let _ = reply.send(Ok(frame.msg));
        }
    }
}

/// Connects, shakes hands, and starts the connection's reader and writer tasks.
pub(crate) async fn open(
    addr: &RemoteAddr,
    tls: Option<&TlsSetup>,
    key: Option<&Key>,
    timeout: Duration,
    ask: Features,
) -> StoreResult<Arc<Conn>> {
    match tokio::time::timeout(timeout, open_inner(addr, tls, key, ask)).await {
        Ok(r) => r,
        Err(_) => Err(StoreError::new(
            ErrorKind::Timeout,
            format!("cannot connect to {addr}: no answer within {timeout:?}"),
        )),
    }
}

/// `ask`: features asked for beside the default ones ([`Features::OBJECTS`]: named objects,
/// refused from a server that does not grant it).
async fn open_inner(
    addr: &RemoteAddr,
    tls: Option<&TlsSetup>,
    key: Option<&Key>,
    ask: Features,
) -> StoreResult<Arc<Conn>> {
    let mut stream = connect_stream(addr, tls).await?;
    let sent_cert = tls.is_some_and(|t| t.sent_cert);
    let mut out = BytesMut::new();
    let mut hello = ClientHello::current();
    hello.features = hello.features | ask;
    if key.is_some() {
        hello.features = hello.features | Features::AUTH;
    }
    hello.encode(&mut out);
    let io_err = |e: std::io::Error| match tls {
        Some(_) => handshake_error(addr, &e, sent_cert),
        None => StoreError::new(
            ErrorKind::from_io(e.kind()),
            format!(
                "the server at {addr} closed the connection during the handshake: {}",
                io_phrase(&e)
            ),
        ),
    };
    stream.write_all(&out).await.map_err(io_err)?;
    stream.flush().await.map_err(io_err)?;
    let mut buf = BytesMut::with_capacity(4096);
    let info = loop {
        match decode_server_hello(&mut buf) {
            Ok(Some(ServerHello::Accepted(info))) => {
                if key.is_some() && !info.features.contains(Features::AUTH) {
                    return Err(StoreError::new(
                        ErrorKind::PermissionDenied,
                        format!(
                            "the server at {addr} did not ask for this client's key: it is \
                             not the server this client was told to trust"
                        ),
                    ));
                }
                if ask.contains(Features::OBJECTS) && !info.features.contains(Features::OBJECTS) {
                    return Err(StoreError::new(
                        ErrorKind::Unsupported,
                        format!(
                            "the server at {addr} exports a region, not objects: open it as \
                             farmap://{addr}, or serve objects with `farmap serve --objects`"
                        ),
                    ));
                }
                break info;
            }
            Ok(Some(ServerHello::Refused(r))) => return Err(refused(addr, &r)),
            Ok(Some(ServerHello::Challenge(nonce))) => {
                let Some(key) = key else {
                    return Err(StoreError::new(
                        ErrorKind::PermissionDenied,
                        format!("the server at {addr} requires a key, and none was given"),
                    ));
                };
                let proof = key.prove(CHALLENGE_LABEL, &[&nonce]);
                stream.write_all(&proof).await.map_err(io_err)?;
                stream.flush().await.map_err(io_err)?;
                continue;
            }
            Ok(None) => {}
            Err(e) => return Err(not_farmap(addr, tls.is_some(), e)),
        }
        match stream.read_buf(&mut buf).await {
            Ok(0) => {
                let hint = if tls.is_some() && !sent_cert {
                    " (it may require a client certificate)"
                } else {
                    ""
                };
                return Err(StoreError::new(
                    ErrorKind::Unavailable,
                    format!(
                        "the server at {addr} closed the connection during the handshake{hint}"
                    ),
                ));
            }
            Ok(_) => {}
            Err(e) => return Err(io_err(e)),
        }
    };
    if info.version != VERSION {
        return Err(StoreError::new(
            ErrorKind::Unsupported,
            format!(
                "protocol version mismatch: the server at {addr} answered with farmap protocol version {}; this client speaks version {VERSION}",
                info.version
            ),
        ));
    }
    Ok(start(addr.to_string().into(), info, stream, buf))
}

/// Connects to `addr` (TCP without Nagle's delay, or a Unix socket), then starts TLS if
/// `tls` asks for it.
async fn connect_stream(addr: &RemoteAddr, tls: Option<&TlsSetup>) -> StoreResult<BoxStream> {
    let connect_err = |e: std::io::Error| {
        StoreError::new(
            ErrorKind::from_io(e.kind()),
            format!("cannot connect to {addr}: {}", io_phrase(&e)),
        )
    };
    let stream: BoxStream = match addr {
        RemoteAddr::Tcp(hp) => {
            let s = TcpStream::connect(hp.as_str()).await.map_err(connect_err)?;
            s.set_nodelay(true).map_err(connect_err)?;
            Box::new(s)
        }
        RemoteAddr::Unix(p) => Box::new(UnixStream::connect(p).await.map_err(connect_err)?),
    };
    match tls {
        Some(t) => match t.connector.connect(t.name.clone(), stream).await {
            Ok(s) => Ok(Box::new(s)),
            Err(e) => Err(handshake_error(addr, &e, t.sent_cert)),
        },
        None => Ok(stream),
    }
}

/// What the server's first bytes say when they are not a farmap hello: a TLS server (when
/// this client did not start TLS), an HTTP/2 one, or something else.
fn not_farmap(addr: &RemoteAddr, tls: bool, e: WireError) -> StoreError {
    match e {
        WireError::BadMagic { found } if !tls && is_tls_record(&found) => StoreError::new(
            ErrorKind::Unsupported,
            format!("the server at {addr} expects TLS: connect with farmaps:// (and ca=)"),
        ),
        WireError::BadMagic { found } if is_http2(&found) => StoreError::new(
            ErrorKind::Unsupported,
            format!(
                "the server at {addr} speaks HTTP/2 (a gRPC server?), not farmap's native protocol: connect with farmap+grpc://"
            ),
        ),
        e => StoreError::new(
            ErrorKind::Unsupported,
            format!("{addr} does not answer as a farmap server: {e}"),
        ),
    }
}

fn handshake_error(addr: &RemoteAddr, e: &std::io::Error, sent_cert: bool) -> StoreError {
    match describe_client_tls_failure(e, sent_cert) {
        Some(why) => StoreError::new(
            ErrorKind::PermissionDenied,
            format!("TLS with {addr} failed: {why}"),
        ),
        None => StoreError::new(
            ErrorKind::from_io(e.kind()),
            format!("TLS with {addr} failed: {}", io_phrase(e)),
        ),
    }
}

fn refused(addr: &RemoteAddr, r: &Refusal) -> StoreError {
    // A server refuses for other reasons too (a region client at an objects server): only
    // a range of versions without this one is a mismatch.
    let mismatch = r.min_version > VERSION || r.max_version < VERSION;
    if mismatch {
        let theirs = if r.min_version == r.max_version {
            format!("version {}", r.max_version)
        } else {
            format!("versions {} to {}", r.min_version, r.max_version)
        };
        StoreError::new(
            ErrorKind::Unsupported,
            format!(
                "protocol version mismatch: the server at {addr} speaks farmap protocol {theirs}; this client speaks version {VERSION}"
            ),
        )
    } else {
        StoreError::new(
            r.kind,
            format!("the server at {addr} refused the connection: {}", r.message),
        )
    }
}

fn start(label: Arc<str>, info: ServerInfo, stream: BoxStream, buf: BytesMut) -> Arc<Conn> {
    let (rd, mut wr) = tokio::io::split(stream);
    let (tx, mut rx) = mpsc::channel::<(Vec<Bytes>, ())>(info.max_in_flight as usize + 1);
    let (closed, _) = watch::channel(false);
    let conn = Arc::new(Conn {
        label,
        info,
        tx,
        state: Mutex::new(State {
            closed: None,
            pending: HashMap::new(),
            server_said: None,
        }),
        open: AtomicBool::new(true),
        next_id: AtomicU64::new(1),
        permits: Semaphore::new(info.max_in_flight as usize),
        closed,
    });
    let weak: Weak<Conn> = Arc::downgrade(&conn);
    let mut stop = conn.closed.subscribe();
    tokio::spawn(async move {
        let result = tokio::select! {
            r = write_frames(&mut wr, &mut rx, None) => r,
            _ = raised(&mut stop) => Ok(()),
        };
        if let (Err(e), Some(conn)) = (result, weak.upgrade()) {
            conn.fail(&format!("sending failed: {}", io_phrase(&e)));
        }
    });
    tokio::spawn(read_loop(conn.clone(), rd, buf));
    conn
}

/// Frames at least this long are read into a buffer of their own, whose payloads are then
/// handed out as slices of it (no copy per chunk; a kept chunk keeps only its own frame).
const OWN_BUFFER_MIN: usize = 32 * 1024;
/// After a frame of at least [`PEEK_AFTER`] bytes, the next read takes at most this much (the
/// next frame's header and a little of its body), so that a large frame following it is read
/// into its own buffer too and little of it is copied.
const PEEK: usize = 4096;
/// Frames from this size on are followed by a small read ([`PEEK`]); after smaller ones the
/// next read fills the read-ahead (several frames per system call).
const PEEK_AFTER: usize = 256 * 1024;

async fn read_loop(conn: Arc<Conn>, mut rd: ReadHalf<BoxStream>, mut buf: BytesMut) {
    let mut decoder = FrameDecoder::new(Limits {
        max_frame: conn.info.max_frame,
        max_batch: conn.info.max_batch,
    });
    let mut stop = conn.closed.subscribe();
    let closed = || "the server closed the connection (server gone?)".to_owned();
    // Whether the last frame was at least PEEK_AFTER long (large replies come in streams).
    let mut large = false;
    let reason = 'conn: loop {
        loop {
            let before = buf.len();
            match decoder.decode(&mut buf) {
                Ok(Some(frame)) => {
                    large = before - buf.len() >= PEEK_AFTER;
                    conn.complete(frame)
                }
                Ok(None) => break,
                Err(e) => break 'conn format!("the server sent a bad frame: {e}"),
            }
        }
        // The decoder has checked the announced length against the frame limit.
        let total = match &buf[..] {
            [a, b, c, d, ..] => 4 + u32::from_be_bytes([*a, *b, *c, *d]) as usize,
            _ => 0,
        };
        if total >= OWN_BUFFER_MIN {
            let mut frame = BytesMut::with_capacity(total);
            frame.extend_from_slice(&buf);
            buf.clear();
            while frame.len() < total {
                let want = total - frame.len();
                let mut room = (&mut frame).limit(want);
                tokio::select! {
                    r = rd.read_buf(&mut room) => match r {
                        Ok(0) => break 'conn closed(),
                        Ok(_) => {}
                        Err(e) if is_clean_close(&e) => break 'conn closed(),
                        Err(e) => break 'conn io_phrase(&e),
                    },
                    _ = raised(&mut stop) => break 'conn "the connection was closed".to_owned(),
                }
            }
            match decoder.decode_own(frame.freeze()) {
                Ok(frame) => conn.complete(frame),
                Err(e) => break 'conn format!("the server sent a bad frame: {e}"),
            }
            large = total >= PEEK_AFTER;
            continue;
        }
        make_room(&mut buf);
        let limit = if large { PEEK } else { usize::MAX };
        let mut room = (&mut buf).limit(limit);
        tokio::select! {
            r = rd.read_buf(&mut room) => match r {
                Ok(0) => break closed(),
                Ok(_) => {}
                Err(e) if is_clean_close(&e) => break closed(),
                Err(e) => break io_phrase(&e),
            },
            _ = raised(&mut stop) => break "the connection was closed".to_owned(),
        }
    };
    conn.fail(&reason);
}
