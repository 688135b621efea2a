//! [`Counted`]: a connection's write side that tells whether its client still reads, so that
//! a stopping server waits for the replies of clients that read them and cuts the others at
//! once ([`Written::unless_stalled`]).

use std::future::Future;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::AsyncWrite;

/// How long a stopping server's connection may have a write that moves no byte before it is
/// cut: its client has stopped reading.
pub const STOP_STALL: Duration = Duration::from_secs(1);

/// A writer that counts what it writes and whether a write is waiting for the peer.
#[derive(Debug)]
pub struct Counted<W> {
    inner: W,
    written: Written,
}

/// What a [`Counted`] writer has done; cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct Written(Arc<State>);

#[derive(Debug, Default)]
struct State {
    bytes: AtomicU64,
    /// A write or flush returned `Pending` and has not completed since.
    waiting: AtomicBool,
}

impl<W> Counted<W> {
    /// `inner`, counted; the counts are read through the [`Written`].
    pub fn new(inner: W) -> (Counted<W>, Written) {
        let written = Written::default();
        (
            Counted {
                inner,
                written: written.clone(),
            },
            written,
        )
    }

    fn note<T>(&self, r: &Poll<io::Result<T>>, bytes: impl FnOnce(&T) -> usize) {
        let s = &self.written.0;
        match r {
            Poll::Pending => s.waiting.store(true, Ordering::Relaxed),
            Poll::Ready(r) => {
                if let Ok(v) = r {
                    s.bytes.fetch_add(bytes(v) as u64, Ordering::Relaxed);
                }
                s.waiting.store(false, Ordering::Relaxed);
            }
        }
    }
}

impl Written {
    /// Bytes written so far.
    pub fn bytes(&self) -> u64 {
        self.0.bytes.load(Ordering::Relaxed)
    }

    /// Whether a write is waiting for the peer to make room.
    pub fn waiting(&self) -> bool {
        self.0.waiting.load(Ordering::Relaxed)
    }

    /// Runs `work` (the end of a connection: its requests' replies written) to its end,
    /// unless the writes stall: a write waits for the peer and no byte has moved for
    /// `stall`. `None` when it stalled (`work` is dropped).
    pub async fn unless_stalled<T>(
        &self,
        work: impl Future<Output = T>,
        stall: Duration,
    ) -> Option<T> {
        tokio::pin!(work);
        let mut seen = self.bytes();
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + stall, stall);
        loop {
            tokio::select! {
                done = &mut work => return Some(done),
                _ = tick.tick() => {
                    let now = self.bytes();
                    if now == seen && self.waiting() {
                        return None;
                    }
                    seen = now;
                }
            }
        }
    }
}

impl<W: AsyncWrite + Unpin> AsyncWrite for Counted<W> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.note(&r, |n| *n);
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.note(&r, |n| *n);
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.note(&r, |_| 0);
        r
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.note(&r, |_| 0);
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[tokio::test]
    async fn a_writer_whose_peer_reads_finishes_and_one_whose_peer_does_not_is_cut() {
        let (a, mut b) = tokio::io::duplex(1024);
        let (mut w, written) = Counted::new(a);
        // The peer reads, slowly: the write finishes.
        let reader = tokio::spawn(async move {
            let mut buf = vec![0; 256];
            let mut got = 0;
            while got < 8192 {
                tokio::time::sleep(Duration::from_millis(5)).await;
                got += tokio::io::AsyncReadExt::read(&mut b, &mut buf)
                    .await
                    .unwrap();
            }
            b
        });
        let stall = Duration::from_millis(100);
        // Slow work that writes nothing is not a stall.
        let slow = written
            .unless_stalled(tokio::time::sleep(3 * stall), stall)
            .await;
        assert!(slow.is_some(), "only a waiting write stalls");
        let done = written
            .unless_stalled(w.write_all(&[1; 8192]), stall)
            .await
            .expect("not stalled");
        done.unwrap();
        assert_eq!(written.bytes(), 8192);
        let _b = reader.await.unwrap();
        // Nobody reads now: cut once the buffer is full and nothing moves.
        let t = std::time::Instant::now();
        let cut = written.unless_stalled(w.write_all(&[2; 8192]), stall).await;
        assert!(cut.is_none(), "stalled");
        assert!(t.elapsed() < Duration::from_secs(2));
    }
}
