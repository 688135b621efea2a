//! A byte stream of any transport (TCP, Unix, TLS over either), boxed, and the loop that
//! writes frames to one.

use std::io::{self, IoSlice};

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

/// A bidirectional byte stream: what every transport gives after connecting (and after TLS).
pub(crate) trait Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Stream for T {}

/// A boxed [`Stream`].
pub(crate) type BoxStream = Box<dyn Stream>;

/// Pieces waiting in the channel are gathered into one vectored write of up to this size...
const BATCH_BYTES: usize = 1 << 20;
/// ... or this many pieces (well under the system's `IOV_MAX`).
const BATCH_PIECES: usize = 256;

/// Writes the frames received on `rx` (each a list of pieces, see
/// [`Frame::encode_parts`](farmap_wire::Frame::encode_parts)) to `out` until the channel
/// closes (every sender gone) or a write fails. Frames waiting together are written together,
/// in one vectored write, without copying their payloads; the stream is flushed whenever the
/// channel runs dry. Ends with a clean shutdown of the write side.
pub(crate) async fn write_frames<W: AsyncWrite + Unpin>(
    out: &mut W,
    rx: &mut mpsc::Receiver<Vec<Bytes>>,
) -> io::Result<()> {
    let mut batch: Vec<Bytes> = Vec::new();
    while let Some(first) = rx.recv().await {
        let mut bytes = 0;
        let mut next = Some(first);
        while let Some(parts) = next.take() {
            for p in parts {
                bytes += p.len();
                batch.push(p);
            }
            if bytes >= BATCH_BYTES || batch.len() >= BATCH_PIECES {
                write_all_vectored(out, &mut batch).await?;
                bytes = 0;
            }
            next = rx.try_recv().ok();
        }
        write_all_vectored(out, &mut batch).await?;
        out.flush().await?;
    }
    out.shutdown().await
}

/// Writes every piece of `batch` in order and empties it.
async fn write_all_vectored<W: AsyncWrite + Unpin>(
    out: &mut W,
    batch: &mut Vec<Bytes>,
) -> io::Result<()> {
    let mut first = 0;
    while first < batch.len() {
        let slices: Vec<IoSlice<'_>> = batch[first..].iter().map(|b| IoSlice::new(b)).collect();
        let mut n = out.write_vectored(&slices).await?;
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
        // Skip empty pieces so that a write of zero bytes is never asked for.
        while first < batch.len() && batch[first].is_empty() {
            first += 1;
        }
    }
    batch.clear();
    Ok(())
}

/// Room kept free in a receive buffer, so that one read takes in many frames.
const READ_AHEAD: usize = 256 * 1024;

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
pub(crate) async fn raised(flag: &mut tokio::sync::watch::Receiver<bool>) {
    // The guard `wait_for` returns is not `Send`: dropped here, never held across an await.
    let _ = flag.wait_for(|f| *f).await.map(|_| ());
}
