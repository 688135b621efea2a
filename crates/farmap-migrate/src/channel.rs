//! The control connection: one TCP or Unix stream (optionally TLS / mutual TLS, with the same
//! configuration as `farmap serve`) carrying [`Msg`] frames, separate from the data plane so
//! that control messages never wait behind bulk reads.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use farmap_net::{ListenAddr, RemoteAddr, TlsClientConfig, TlsServerConfig};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};

use crate::msg::{decode_header, Msg, HEADER_LEN};

/// A byte stream of any transport.
pub trait Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Stream for T {}

/// A framed control connection.
pub struct Channel {
    stream: Box<dyn Stream>,
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Channel")
    }
}

impl Channel {
    /// Sends one message.
    pub async fn send(&mut self, m: &Msg) -> io::Result<()> {
        self.stream.write_all(&m.encode()).await?;
        self.stream.flush().await
    }

    /// Receives one message; `Ok(None)` at a clean end of stream.
    pub async fn recv(&mut self) -> io::Result<Option<Msg>> {
        let mut h = [0u8; HEADER_LEN];
        match self.stream.read_exact(&mut h).await {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        }
        let h = decode_header(&h).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        let mut p = vec![0u8; h.len as usize];
        self.stream.read_exact(&mut p).await?;
        Msg::decode(h.kind, &p)
            .map(Some)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }
}

/// A listening control socket.
pub struct ControlListener {
    inner: Inner,
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

#[derive(Debug)]
enum Inner {
    Tcp(TcpListener),
    Unix(UnixListener),
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
        let inner = match addr {
            ListenAddr::Tcp(a) => Inner::Tcp(TcpListener::bind(a).await?),
            ListenAddr::Unix(p) => {
                let _ = std::fs::remove_file(p);
                Inner::Unix(UnixListener::bind(p)?)
            }
        };
        Ok(Self { inner, tls })
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<ListenAddr> {
        match &self.inner {
            Inner::Tcp(l) => l.local_addr().map(ListenAddr::Tcp),
            Inner::Unix(l) => l
                .local_addr()?
                .as_pathname()
                .map(|p| ListenAddr::Unix(p.to_owned()))
                .ok_or_else(|| io::Error::other("unnamed Unix socket")),
        }
    }

    /// Accepts one control connection (and its TLS handshake).
    pub async fn accept(&self) -> io::Result<Channel> {
        let stream: Box<dyn Stream> = match &self.inner {
            Inner::Tcp(l) => {
                let (s, _) = l.accept().await?;
                s.set_nodelay(true)?;
                match &self.tls {
                    Some(t) => Box::new(t.accept(s).await?),
                    None => Box::new(s),
                }
            }
            Inner::Unix(l) => {
                let (s, _) = l.accept().await?;
                match &self.tls {
                    Some(t) => Box::new(t.accept(s).await?),
                    None => Box::new(s),
                }
            }
        };
        Ok(Channel { stream })
    }
}

/// Connects a control channel to `addr`, with TLS if `tls` is given, within `timeout`.
pub async fn connect(
    addr: &RemoteAddr,
    tls: Option<&TlsClientConfig>,
    timeout: Duration,
) -> io::Result<Channel> {
    let fut = async {
        let stream: Box<dyn Stream> = match addr {
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
        Ok::<_, io::Error>(Channel { stream })
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
    let config: Arc<rustls::ClientConfig> = t
        .build()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let name = t
        .server_name
        .clone()
        .unwrap_or_else(|| addr.host().to_owned());
    let name = rustls::pki_types::ServerName::try_from(name)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    tokio_rustls::TlsConnector::from(config)
        .connect(name, s)
        .await
}

/// The sending half of a split [`Channel`].
pub struct Sender {
    w: tokio::io::WriteHalf<Box<dyn Stream>>,
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
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        tokio::spawn(async move {
            let mut reader = Channel {
                stream: Box::new(ReadOnly(r)),
            };
            loop {
                let m = match reader.recv().await {
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
struct ReadOnly(tokio::io::ReadHalf<Box<dyn Stream>>);

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
