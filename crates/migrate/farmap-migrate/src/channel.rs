//! The control connection: one TCP or Unix stream (optionally TLS / mutual TLS, with the same
//! configuration as `farmap serve`) carrying [`Msg`] frames, separate from the data plane so
//! that control messages never wait behind bulk reads.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use farmap_net::{
    BoxStream, ListenAddr, Listener, RemoteAddr, Stream, TlsClientConfig, TlsServerConfig,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpStream, UnixStream};

use crate::msg::{decode_header, Msg, HEADER_LEN, MAX_LEECHER_PAYLOAD, MAX_PAYLOAD};

/// The first byte of a TLS handshake record.
const TLS_HANDSHAKE: u8 = 0x16;

/// A framed control connection.
pub struct Channel {
    stream: BoxStream,
    /// Largest payload accepted from the peer.
    max_payload: u32,
    /// Bytes of the frames received so far (shared with the reader task after a split).
    received: Arc<AtomicU64>,
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel")
            .field("max_payload", &self.max_payload)
            .finish()
    }
}

impl Channel {
    /// Bytes of the whole frames received so far on this connection (it keeps counting
    /// after a [`split`](Self::split)).
    pub fn received(&self) -> Arc<AtomicU64> {
        self.received.clone()
    }

    /// Accepts payloads up to `cap` (at most [`MAX_PAYLOAD`]) from
    /// now on: for an accepted channel whose peer, once authenticated, sends big messages
    /// (an object migration's destination receives the pages). Never before the peer has
    /// proved its key.
    pub fn accept_payloads_up_to(&mut self, cap: u32) {
        self.max_payload = cap.min(crate::msg::MAX_PAYLOAD);
    }

    /// Sends one frame built with [`put_header`](crate::msg::put_header) (whose payload the
    /// peer decodes as any other).
    pub async fn send_frame(&mut self, frame: &[u8]) -> io::Result<()> {
        self.stream.write_all(frame).await?;
        self.stream.flush().await
    }

    /// Sends one message.
    pub async fn send(&mut self, m: &Msg) -> io::Result<()> {
        self.stream.write_all(&m.encode()).await?;
        self.stream.flush().await
    }

    /// Receives one message; `Ok(None)` at a clean end of stream.
    ///
    /// A payload longer than this side accepts is refused from its header; an accepted one
    /// is read into a buffer that grows with the bytes that really arrive, so a peer that
    /// claims a large payload and sends little makes nothing large.
    pub async fn recv(&mut self) -> io::Result<Option<Msg>> {
        let mut h = [0u8; HEADER_LEN];
        match self.stream.read_exact(&mut h).await {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        }
        let h = decode_header(&h).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        if h.len > self.max_payload {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                crate::msg::DecodeError::TooLong {
                    what: "a message from this side's peer",
                    len: h.len.into(),
                    cap: self.max_payload.into(),
                },
            ));
        }
        let len = h.len as usize;
        let mut p = Vec::with_capacity(len.min(64 * 1024));
        (&mut self.stream)
            .take(len as u64)
            .read_to_end(&mut p)
            .await?;
        if p.len() < len {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the peer closed the control connection in the middle of a message",
            ));
        }
        self.received
            .fetch_add((HEADER_LEN + len) as u64, Ordering::Relaxed);
        if h.kind == crate::msg::OBJECT_KIND {
            // Opaque here: handed over without a copy (its pages can be megabytes).
            return Ok(Some(Msg::Object(bytes::Bytes::from(p))));
        }
        Msg::decode(h.kind, &p)
            .map(Some)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }
}

/// A listening control socket: farmap-net's [`Listener`] (which replaces only a stale Unix
/// socket, never a live one or another file) and the server TLS configuration of `farmap
/// serve`.
pub struct ControlListener {
    inner: Listener,
    tls: Option<tokio_rustls::TlsAcceptor>,
}

impl std::fmt::Debug for ControlListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlListener")
            .field("inner", &self.inner)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl Drop for ControlListener {
    fn drop(&mut self) {
        if let Listener::Unix(_, p) = &self.inner {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// An accepted control connection before its handshake (no byte read from it yet).
pub struct Accepted {
    stream: Raw,
    tls: Option<tokio_rustls::TlsAcceptor>,
    /// The peer, for logs.
    pub peer: String,
}

impl std::fmt::Debug for Accepted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accepted")
            .field("peer", &self.peer)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

#[derive(Debug)]
enum Raw {
    Tcp(TcpStream),
    Unix(UnixStream),
}

/// Why an accepted control connection did not become a channel.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// A client without TLS reached a TLS listener (it was told, in plain text).
    #[error("a client without TLS connected to this TLS listener")]
    PlainClient,
    /// The TLS handshake failed.
    #[error("{reason}")]
    Tls {
        /// Why, as farmap-net words it.
        reason: String,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// The stream failed or ended.
    #[error("the connection failed during its handshake")]
    Io(#[source] io::Error),
}

impl ControlListener {
    /// Binds `addr`, with TLS if `tls` is given.
    pub async fn bind(addr: &ListenAddr, tls: Option<&TlsServerConfig>) -> io::Result<Self> {
        let tls = match tls {
            Some(t) => {
                Some(tokio_rustls::TlsAcceptor::from(t.build().map_err(|e| {
                    io::Error::new(io::ErrorKind::InvalidInput, e)
                })?))
            }
            None => None,
        };
        let inner = Listener::bind(addr).await?;
        Ok(Self { inner, tls })
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<ListenAddr> {
        self.inner.local_addr()
    }

    /// Accepts one connection without reading from it: its handshake
    /// ([`Accepted::handshake`]) runs elsewhere, under a deadline, so that a silent peer
    /// holds up nobody.
    pub async fn accept_raw(&self) -> io::Result<Accepted> {
        let (stream, peer) = match &self.inner {
            Listener::Tcp(l) => {
                let (s, peer) = l.accept().await?;
                s.set_nodelay(true)?;
                (Raw::Tcp(s), peer.to_string())
            }
            Listener::Unix(l, p) => {
                let (s, _) = l.accept().await?;
                (Raw::Unix(s), format!("unix:{}", p.display()))
            }
        };
        Ok(Accepted {
            stream,
            tls: self.tls.clone(),
            peer,
        })
    }

    /// Accepts one control connection and completes its handshake (no deadline: see
    /// [`accept_raw`](Self::accept_raw)).
    pub async fn accept(&self) -> Result<Channel, HandshakeError> {
        self.accept_raw()
            .await
            .map_err(HandshakeError::Io)?
            .handshake()
            .await
    }
}

impl Accepted {
    /// The TLS handshake if the listener has TLS (a plain client is told, in plain text,
    /// that TLS is needed); the channel accepts only messages a leecher sends.
    pub async fn handshake(self) -> Result<Channel, HandshakeError> {
        let stream: BoxStream = match self.stream {
            Raw::Tcp(s) => with_tls(s, self.tls).await?,
            Raw::Unix(s) => with_tls(s, self.tls).await?,
        };
        Ok(Channel {
            stream,
            max_payload: MAX_LEECHER_PAYLOAD,
            received: Arc::default(),
        })
    }

    /// Refuses the connection without waiting on the peer: a plain `Abort` if it fits in the
    /// socket's buffer (TLS listeners just close).
    pub fn refuse(self, reason: &str) {
        if self.tls.is_some() {
            return;
        }
        let frame = Msg::Abort {
            reason: reason.into(),
        }
        .encode();
        let _ = match &self.stream {
            Raw::Tcp(s) => s.try_write(&frame),
            Raw::Unix(s) => s.try_write(&frame),
        };
    }
}

async fn with_tls<S: Stream>(
    mut s: S,
    tls: Option<tokio_rustls::TlsAcceptor>,
) -> Result<BoxStream, HandshakeError> {
    let Some(tls) = tls else {
        return Ok(Box::new(s));
    };
    let mut first = [0u8; 1];
    s.read_exact(&mut first).await.map_err(HandshakeError::Io)?;
    if first[0] != TLS_HANDSHAKE {
        let frame = Msg::Abort {
            reason: "this seeder requires TLS: connect with --tls-ca (and, for mutual TLS, \
                     --tls-cert and --tls-key)"
                .into(),
        }
        .encode();
        let _ = s.write_all(&frame).await;
        let _ = s.shutdown().await;
        return Err(HandshakeError::PlainClient);
    }
    let s = Prefixed {
        first: Some(first[0]),
        inner: s,
    };
    match tls.accept(s).await {
        Ok(t) => Ok(Box::new(t)),
        Err(source) => Err(HandshakeError::Tls {
            reason: farmap_net::describe_server_tls_failure(&source),
            source,
        }),
    }
}

/// A stream whose first byte was already read (and is given back first).
struct Prefixed<S> {
    first: Option<u8>,
    inner: S,
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if buf.remaining() > 0 {
            if let Some(b) = self.first.take() {
                buf.put_slice(&[b]);
                return Poll::Ready(Ok(()));
            }
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        b: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, b)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Connects a control channel to `addr`, with TLS if `tls` is given, within `timeout`.
pub async fn connect(
    addr: &RemoteAddr,
    tls: Option<&TlsClientConfig>,
    timeout: Duration,
) -> io::Result<Channel> {
    let fut = async {
        let stream: BoxStream = match addr {
            RemoteAddr::Tcp(hp) => {
                let s = TcpStream::connect(hp.as_str()).await?;
                s.set_nodelay(true)?;
                match tls {
                    Some(t) => Box::new(tls_connect(t, addr, s).await?),
                    None => Box::new(s),
                }
            }
            RemoteAddr::Unix(p) => {
                let s = UnixStream::connect(p).await?;
                match tls {
                    Some(t) => Box::new(tls_connect(t, addr, s).await?),
                    None => Box::new(s),
                }
            }
        };
        Ok::<_, io::Error>(Channel {
            stream,
            max_payload: MAX_PAYLOAD,
            received: Arc::default(),
        })
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connecting timed out"))?
}

async fn tls_connect<S: Stream>(
    t: &TlsClientConfig,
    addr: &RemoteAddr,
    s: S,
) -> io::Result<tokio_rustls::client::TlsStream<S>> {
    let (connector, name) = t
        .connector(addr.host())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    connector.connect(name, s).await
}

/// The sending half of a split [`Channel`].
pub struct Sender {
    w: tokio::io::WriteHalf<BoxStream>,
}

impl std::fmt::Debug for Sender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sender")
    }
}

impl Sender {
    /// Sends one message.
    pub async fn send(&mut self, m: &Msg) -> io::Result<()> {
        self.w.write_all(&m.encode()).await?;
        self.w.flush().await
    }
}

impl Channel {
    /// Splits into a sender and a task that reads messages into a queue (so that waiting for
    /// a message can be cancelled without losing bytes); the queue ends with an error at the
    /// end of the connection.
    pub fn split(self) -> (Sender, tokio::sync::mpsc::Receiver<io::Result<Msg>>) {
        let (r, w) = tokio::io::split(self.stream);
        // One message waits in the queue, one in the reader: what a connection can make this
        // side hold is two messages, however fast the peer sends.
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let (max_payload, received) = (self.max_payload, self.received);
        tokio::spawn(async move {
            let mut reader = Channel {
                stream: Box::new(ReadOnly(r)),
                max_payload,
                received,
            };
            loop {
                // The reader ends with its receiver: a dropped connection is closed even if
                // its peer stays silent.
                let got = tokio::select! {
                    m = reader.recv() => m,
                    _ = tx.closed() => return,
                };
                let m = match got {
                    Ok(Some(m)) => Ok(m),
                    Ok(None) => Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the peer closed the control connection",
                    )),
                    Err(e) => Err(e),
                };
                let end = m.is_err();
                if tx.send(m).await.is_err() || end {
                    return;
                }
            }
        });
        (Sender { w }, rx)
    }
}

/// A read half as a stream whose writes fail.
struct ReadOnly(tokio::io::ReadHalf<BoxStream>);

impl AsyncRead for ReadOnly {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for ReadOnly {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        _: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        std::task::Poll::Ready(Err(io::Error::other("read half")))
    }
    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}
