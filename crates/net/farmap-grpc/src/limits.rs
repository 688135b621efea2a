//! What bounds a gRPC server's connections: a cap on how many are served at once, a deadline
//! on connections that move no bytes, and a memory budget each.
//!
//! - [`limited_incoming`] accepts from a listener; a connection beyond the cap is closed at
//!   once (and logged), never queued or spawned for.
//! - [`Limited`] is an accepted connection: it holds its slot until dropped, and a read or
//!   write that makes no progress for the idle timeout fails (`TimedOut`), which ends the
//!   connection: a client that sends nothing for that long with nothing in flight, or that
//!   stops reading its replies, or that never finishes its handshake, is cut off.
//! - Each connection has a [`Budget`] drawn from the server's [`Total`], which every one of
//!   its calls finds in its request's extensions ([`ConnInfo`]) and is charged to (see
//!   [`crate::admission`]).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use farmap_net::budget::{Budget, Total};
use farmap_net::fair::{Fair, Lane};
use futures::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tonic::transport::server::Connected;

/// How much memory each connection may hold, and all of them together.
#[derive(Debug, Clone)]
pub(crate) struct Budgets {
    /// The server's total.
    pub(crate) total: Total,
    /// Each connection's budget, drawn from the total.
    pub(crate) conn: usize,
    /// Each connection's reserve, outside the total.
    pub(crate) reserve: usize,
    /// Turns at the store, shared out between the connections.
    pub(crate) fair: Fair,
    /// Raised when the server is told to stop: a connection whose bytes do not move for
    /// [`farmap_net::counted::STOP_STALL`] is then closed, not waited for.
    pub(crate) stopping: Arc<std::sync::atomic::AtomicBool>,
    /// The connections being served.
    pub(crate) live: Arc<std::sync::Mutex<Vec<std::sync::Weak<Live>>>>,
}

impl Budgets {
    /// The server is stopping: every connection looks again at whether its bytes move.
    pub(crate) fn stop(&self) {
        self.stopping
            .store(true, std::sync::atomic::Ordering::Release);
        let live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        for l in live.iter().filter_map(std::sync::Weak::upgrade) {
            l.wake();
        }
    }
}

/// What every call of a connection finds in its request's extensions.
#[derive(Debug, Clone)]
pub(crate) struct ConnInfo {
    /// The connection's memory budget.
    pub(crate) budget: Budget,
    /// The connection's turns at the store.
    pub(crate) lane: Lane,
    peer: Arc<str>,
}

impl ConnInfo {
    /// The client's address.
    pub(crate) fn peer(&self) -> &str {
        &self.peer
    }
}

/// What the accept loop knows of a connection being served: at the connection limit, the
/// one idle longest (no call holding memory, no byte from the client for
/// [`farmap_net::IDLE_TO_EVICT`]) is closed for a new one.
#[derive(Debug)]
pub(crate) struct Live {
    budget: Budget,
    /// When bytes last came from the client.
    last_read: std::sync::Mutex<std::time::Instant>,
    /// Closed for a newcomer: its next read fails.
    evicted: std::sync::atomic::AtomicBool,
    /// The task waiting to read, woken to find it evicted.
    reader: std::sync::Mutex<Option<std::task::Waker>>,
    /// The task waiting to write, woken when the server stops.
    writer: std::sync::Mutex<Option<std::task::Waker>>,
}

impl Live {
    /// Closed for a newcomer, and not yet gone.
    fn is_evicted(&self) -> bool {
        self.evicted.load(std::sync::atomic::Ordering::Acquire)
    }

    /// How long it has been idle, when no call holds memory.
    fn idle_for(&self) -> Option<Duration> {
        if !self.budget.is_idle() {
            return None;
        }
        Some(
            self.last_read
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .elapsed(),
        )
    }

    fn evict(&self) {
        self.evicted
            .store(true, std::sync::atomic::Ordering::Release);
        self.wake();
    }

    fn wake(&self) {
        for waker in [&self.reader, &self.writer] {
            if let Some(w) = waker.lock().unwrap_or_else(|e| e.into_inner()).take() {
                w.wake();
            }
        }
    }
}

/// Whom to close for a newcomer: a connection already closed for one and not yet gone (its
/// slot is on its way back: closing another would be one too many), else the live
/// connection idle longest (at least [`farmap_net::IDLE_TO_EVICT`]), if any.
fn evictee(live: &[std::sync::Weak<Live>]) -> Option<Arc<Live>> {
    let live: Vec<_> = live.iter().filter_map(std::sync::Weak::upgrade).collect();
    if let Some(going) = live.iter().find(|l| l.is_evicted()) {
        return Some(going.clone());
    }
    live.into_iter()
        .filter_map(|l| Some((l.idle_for()?, l)))
        .filter(|(idle, _)| *idle >= farmap_net::IDLE_TO_EVICT)
        .max_by_key(|(idle, _)| *idle)
        .map(|(_, l)| l)
}

/// An accepted connection that holds one of the server's connection slots.
#[derive(Debug)]
pub(crate) struct Limited {
    io: TcpStream,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
    info: ConnInfo,
    log: bool,
    live: Arc<Live>,
    stopping: Arc<std::sync::atomic::AtomicBool>,
    /// The deadline was shortened for the stop.
    stop_armed: bool,
    /// Declared last, so dropped last: the slot comes back after the connection is gone.
    _slot: OwnedSemaphorePermit,
}

impl Limited {
    fn new(
        io: TcpStream,
        slot: OwnedSemaphorePermit,
        idle: Duration,
        info: ConnInfo,
        log: bool,
        stopping: Arc<std::sync::atomic::AtomicBool>,
    ) -> Self {
        let live = Arc::new(Live {
            budget: info.budget.clone(),
            last_read: std::sync::Mutex::new(std::time::Instant::now()),
            evicted: std::sync::atomic::AtomicBool::new(false),
            reader: std::sync::Mutex::new(None),
            writer: std::sync::Mutex::new(None),
        });
        Self {
            io,
            _slot: slot,
            idle,
            deadline: Box::pin(tokio::time::sleep(idle)),
            info,
            log,
            live,
            stopping,
            stop_armed: false,
        }
    }

    /// Moves the deadline on after progress (by the idle timeout, or by
    /// [`farmap_net::counted::STOP_STALL`] once the server is stopping).
    fn progressed(&mut self) {
        let after = if self.stop_armed {
            farmap_net::counted::STOP_STALL
        } else {
            self.idle
        };
        let next = Instant::now() + after;
        self.deadline.as_mut().reset(next);
    }

    /// A write that made no progress: noted for a wake at the stop, then [`stalled`].
    ///
    /// [`stalled`]: Self::stalled
    fn write_stalled<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        *self.live.writer.lock().unwrap_or_else(|e| e.into_inner()) = Some(cx.waker().clone());
        self.stalled(cx).map(Err)
    }

    /// After a step that made no progress: fails once the deadline has passed (the idle
    /// timeout, or [`farmap_net::counted::STOP_STALL`] once the server is stopping).
    fn stalled(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        if !self.stop_armed && self.stopping.load(std::sync::atomic::Ordering::Acquire) {
            self.stop_armed = true;
            let soon = Instant::now() + farmap_net::counted::STOP_STALL;
            if soon < self.deadline.deadline() {
                self.deadline.as_mut().reset(soon);
            }
        }
        ready!(self.deadline.as_mut().poll(cx));
        let why = if self.stop_armed {
            format!(
                "the server is stopping and no reply moved for {:?}",
                farmap_net::counted::STOP_STALL
            )
        } else {
            format!("no bytes moved for {:?}", self.idle)
        };
        tracing::warn!("closing gRPC connection from {}: {why}", self.info.peer);
        Poll::Ready(io::Error::new(io::ErrorKind::TimedOut, why))
    }
}

impl Drop for Limited {
    fn drop(&mut self) {
        if self.log {
            tracing::info!("gRPC connection from {} closed", self.info.peer);
        } else {
            tracing::debug!("gRPC connection from {} closed", self.info.peer);
        }
    }
}

impl AsyncRead for Limited {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.live.is_evicted() {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "closed for a new connection: idle at the connection limit",
            )));
        }
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(r) => {
                // Once the server is stopping, only replies that move count: a client that
                // keeps sending (new calls, resets) but takes none of its replies is not
                // waited for.
                if !this.stopping.load(std::sync::atomic::Ordering::Acquire) {
                    this.progressed();
                }
                *this
                    .live
                    .last_read
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()) = std::time::Instant::now();
                Poll::Ready(r)
            }
            Poll::Pending => {
                *this.live.reader.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some(cx.waker().clone());
                this.stalled(cx).map(Err)
            }
        }
    }
}

impl AsyncWrite for Limited {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        match Pin::new(&mut this.io).poll_write(cx, buf) {
            Poll::Ready(r) => {
                this.progressed();
                Poll::Ready(r)
            }
            Poll::Pending => this.write_stalled(cx),
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        match Pin::new(&mut this.io).poll_write_vectored(cx, bufs) {
            Poll::Ready(r) => {
                this.progressed();
                Poll::Ready(r)
            }
            Poll::Pending => this.write_stalled(cx),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        match Pin::new(&mut this.io).poll_flush(cx) {
            Poll::Ready(r) => Poll::Ready(r),
            Poll::Pending => this.write_stalled(cx),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl Connected for Limited {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        self.info.clone()
    }
}

/// Accepts connections from `listener`, at most `max` served at once; each gets `idle` as
/// its deadline for making progress and a budget from `budgets`. Accept errors (out of file
/// descriptors and the like) are logged and followed by a short pause, never passed on (they
/// would stop the server).
pub(crate) fn limited_incoming(
    listener: TcpListener,
    max: usize,
    idle: Duration,
    log: bool,
    budgets: Budgets,
) -> impl Stream<Item = io::Result<Limited>> {
    let slots = Arc::new(Semaphore::new(max));
    let live = budgets.live.clone();
    let state = (listener, slots, budgets, live);
    futures::stream::unfold(state, move |(listener, slots, budgets, live)| async move {
        loop {
            let (io, peer) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!("accepting a gRPC connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let slot = match slots.clone().try_acquire_owned() {
                Ok(slot) => slot,
                Err(_) => {
                    let old = {
                        let mut live = live.lock().unwrap_or_else(|e| e.into_inner());
                        live.retain(|l| l.strong_count() > 0);
                        evictee(&live)
                    };
                    let freed = match old {
                        Some(old) => {
                            if !old.is_evicted() {
                                tracing::warn!(
                                    "{max} gRPC connections (the limit): closing the one idle longest for {peer}"
                                );
                                old.evict();
                            }
                            drop(old);
                            let wait = slots.clone().acquire_owned();
                            tokio::time::timeout(Duration::from_secs(2), wait)
                                .await
                                .ok()
                                .and_then(Result::ok)
                        }
                        None => None,
                    };
                    match freed {
                        Some(slot) => slot,
                        None => {
                            tracing::warn!(
                                "refusing gRPC connection from {peer}: already serving {max} connections, none idle"
                            );
                            drop(io);
                            continue;
                        }
                    }
                }
            };
            let _ = io.set_nodelay(true);
            let peer = peer.to_string();
            if log {
                tracing::info!("gRPC connection from {peer}");
            } else {
                tracing::debug!("gRPC connection from {peer}");
            }
            let info = ConnInfo {
                budget: budgets.total.connection(budgets.conn, budgets.reserve),
                lane: budgets.fair.lane(),
                peer: peer.into(),
            };
            let conn = Limited::new(io, slot, idle, info, log, budgets.stopping.clone());
            {
                let mut all = live.lock().unwrap_or_else(|e| e.into_inner());
                if all.len() >= 2 * max {
                    all.retain(|l| l.strong_count() > 0);
                }
                all.push(Arc::downgrade(&conn.live));
            }
            return Some((Ok(conn), (listener, slots, budgets, live)));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(total: &Total, idle: Duration) -> Arc<Live> {
        Arc::new(Live {
            budget: total.connection(1 << 20, 1 << 16),
            last_read: std::sync::Mutex::new(std::time::Instant::now() - idle),
            evicted: std::sync::atomic::AtomicBool::new(false),
            reader: std::sync::Mutex::new(None),
            writer: std::sync::Mutex::new(None),
        })
    }

    /// A connection closed for one newcomer and not yet gone is what the next one waits
    /// for: closing another would close one connection too many (the next newcomer would
    /// then find no slot and be refused).
    #[test]
    fn a_connection_on_its_way_out_is_waited_for_not_a_second_one_closed() {
        let total = Total::new(64 << 20);
        let (long, longer, fresh) = (
            live(&total, Duration::from_secs(5)),
            live(&total, Duration::from_secs(9)),
            live(&total, Duration::ZERO),
        );
        let all: Vec<_> = [&long, &longer, &fresh].map(Arc::downgrade).into();
        let first = evictee(&all).expect("one idle long enough");
        assert!(Arc::ptr_eq(&first, &longer), "the one idle longest");
        first.evict();
        let second = evictee(&all).expect("the one on its way out");
        assert!(Arc::ptr_eq(&second, &longer), "not a second one");
        drop((first, second, longer));
        let third = evictee(&all).expect("once it is gone, the next idle one");
        assert!(Arc::ptr_eq(&third, &long));
        drop((third, long));
        assert!(evictee(&all).is_none(), "a fresh connection is not closed");
    }
}
