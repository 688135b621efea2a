//! A byte stream of any transport (TCP, Unix, TLS over either), boxed, and the loop that
//! writes frames to one.

use std::io::{self, IoSlice};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

/// A bidirectional byte stream: what every transport gives after connecting (and after TLS).
pub trait Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Stream for T {}

/// A boxed [`Stream`].
pub type BoxStream = Box<dyn Stream>;

/// Pieces waiting in the channel are gathered into one vectored write of up to this size...
const BATCH_BYTES: usize = 1 << 20;
/// ... or this many pieces (well under the system's `IOV_MAX`).
const BATCH_PIECES: usize = 256;

/// Writes the frames received on `rx` (each a list of pieces, see
/// [`Frame::encode_parts`](farmap_wire::Frame::encode_parts), and something held until the
/// frame has been written, such as a budget's permit) to `out` until the channel closes
/// (every sender gone) or a write fails. Frames waiting together are written together, in one
/// vectored write, without copying their payloads; the stream is flushed whenever the channel
/// runs dry. Ends with a clean shutdown of the write side.
///
/// With a `stall` limit, a write or flush that makes no progress for that long fails with
/// [`io::ErrorKind::TimedOut`] (the peer stopped reading).
pub(crate) async fn write_frames<W: AsyncWrite + Unpin, H>(
    out: &mut W,
    rx: &mut mpsc::Receiver<(Vec<Bytes>, H)>,
    stall: Option<Duration>,
) -> io::Result<()> {
    let mut batch: Vec<Bytes> = Vec::new();
    let mut held: Vec<H> = Vec::new();
    while let Some(first) = rx.recv().await {
        let mut bytes = 0;
        let mut next = Some(first);
        while let Some((parts, hold)) = next.take() {
            held.push(hold);
            for p in parts {
                bytes += p.len();
                batch.push(p);
            }
            if bytes >= BATCH_BYTES || batch.len() >= BATCH_PIECES {
                write_all_vectored(out, &mut batch, stall).await?;
                held.clear();
                bytes = 0;
            }
            next = rx.try_recv().ok();
        }
        write_all_vectored(out, &mut batch, stall).await?;
        within(stall, out.flush()).await?;
        held.clear();
    }
    within(stall, out.shutdown()).await
}

/// Runs an I/O step, failing with [`io::ErrorKind::TimedOut`] when it takes over `limit`.
pub async fn within<T>(
    limit: Option<Duration>,
    step: impl std::future::Future<Output = io::Result<T>>,
) -> io::Result<T> {
    match limit {
        None => step.await,
        Some(limit) => match tokio::time::timeout(limit, step).await {
            Ok(r) => r,
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the peer has not taken any bytes for {limit:?}"),
            )),
        },
    }
}

/// Pieces handed to one `writev` (well under the system's `IOV_MAX`).
const IOV_PER_WRITE: usize = 64;

/// Writes every piece of `batch` in order, in vectored writes (no copy), and empties it.
/// With a `stall` limit, a write that makes no progress for that long fails with
/// [`io::ErrorKind::TimedOut`].
pub async fn write_all_vectored<W: AsyncWrite + Unpin>(
    out: &mut W,
    batch: &mut Vec<Bytes>,
    stall: Option<Duration>,
) -> io::Result<()> {
    let mut first = 0;
    // Skip empty pieces so that a write of zero bytes is never asked for.
    while first < batch.len() && batch[first].is_empty() {
        first += 1;
    }
    while first < batch.len() {
        let mut slices = [IoSlice::new(&[]); IOV_PER_WRITE];
        let mut k = 0;
        for b in batch[first..].iter().take(IOV_PER_WRITE) {
            slices[k] = IoSlice::new(b);
            k += 1;
        }
        let mut n = within(stall, out.write_vectored(&slices[..k])).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        while n > 0 && first < batch.len() {
            let head = &mut batch[first];
            if n >= head.len() {
                n -= head.len();
                first += 1;
            } else {
                head.advance(n);
                n = 0;
            }
        }
        while first < batch.len() && batch[first].is_empty() {
            first += 1;
        }
    }
    batch.clear();
    Ok(())
}

/// Room kept free in a receive buffer, so that one read takes in many frames.
pub(crate) const READ_AHEAD: usize = 256 * 1024;

/// Makes room for a large read in `buf` (decoded frames are split off it and keep their
/// part of its allocation alive, so it is re-grown rather than reused).
pub(crate) fn make_room(buf: &mut BytesMut) {
    if buf.capacity() - buf.len() < READ_AHEAD / 4 {
        buf.reserve(READ_AHEAD);
    }
}

/// A short lowercase phrase for an I/O error, for sentences like "cannot connect to X: …".
pub(crate) fn io_phrase(err: &io::Error) -> String {
    use io::ErrorKind as K;
    match err.kind() {
        K::ConnectionRefused => "connection refused".into(),
        K::ConnectionReset => "connection reset by the peer".into(),
        K::ConnectionAborted => "connection aborted".into(),
        K::BrokenPipe => "the peer closed the connection".into(),
        K::UnexpectedEof => "the peer closed the connection".into(),
        K::NotFound => "no such socket".into(),
        K::PermissionDenied => "permission denied".into(),
        K::TimedOut => "timed out".into(),
        K::HostUnreachable => "host unreachable".into(),
        K::NetworkUnreachable => "network unreachable".into(),
        K::AddrNotAvailable => "address not available".into(),
        _ => err.to_string(),
    }
}

/// Resolves once `flag` is (or becomes) true, or its sender is gone.
pub async fn raised(flag: &mut tokio::sync::watch::Receiver<bool>) {
    // The guard `wait_for` returns is not `Send`: dropped here, never held across an await.
    let _ = flag.wait_for(|f| *f).await.map(|_| ());
}

/// Whether a read or write error is only the peer going away: a reset, a closed pipe, or a
/// TLS peer that closed without `close_notify` (what most TLS clients do).
pub fn is_clean_close(err: &io::Error) -> bool {
    use io::ErrorKind as K;
    matches!(
        err.kind(),
        K::UnexpectedEof | K::ConnectionReset | K::BrokenPipe | K::ConnectionAborted
    )
}

/// Whether bytes start a TLS record (an alert or a handshake, TLS 1.x).
pub(crate) fn is_tls_record(b: &[u8]) -> bool {
    matches!(b, [0x15 | 0x16, 0x03, ..])
}

/// Whether bytes start an HTTP/2 connection: the client preface, or a server's first frame
/// (SETTINGS, or GOAWAY, on stream 0).
pub(crate) fn is_http2(b: &[u8]) -> bool {
    b.starts_with(b"PRI * HT") || matches!(b, [_, _, _, 0x04 | 0x07, _, 0, 0, 0, ..])
}

/// Names the protocol a peer speaks when its first bytes are not farmap's, for a server
/// (`tls`: whether this server uses TLS, so a TLS record is not the problem).
pub(crate) fn describe_foreign_bytes(found: &[u8], tls: bool) -> Option<&'static str> {
    if is_tls_record(found) && !tls {
        Some("the client started a TLS handshake, but this server does not use TLS (connect with farmap://, or serve with --tls-cert)")
    } else if found.starts_with(b"PRI * HT") {
        Some("the client speaks HTTP/2 (a gRPC client?), but this server speaks farmap's native protocol (connect with farmap://, or serve with --grpc)")
    } else if found.starts_with(b"GET ")
        || found.starts_with(b"POST ")
        || found.starts_with(b"HEAD ")
    {
        Some("the client speaks HTTP, but this server speaks farmap's native protocol")
    } else {
        None
    }
}
