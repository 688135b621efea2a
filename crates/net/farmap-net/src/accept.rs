//! The accept loop farmap's servers share: a cap on connections, a clean stop, a grace
//! period for the connections being served.
//!
//! At the cap, a new connection takes the place of the one that has been idle longest (no
//! request in flight, none received for [`IDLE_TO_EVICT`] at least): clients that hold
//! connections open with a request every few minutes cannot keep others out. Only when every
//! connection is busy is a newcomer refused.

use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use farmap_core::option::{check_range, OutOfRange};
use tokio::sync::{watch, Semaphore};
use tokio::task::{AbortHandle, JoinSet};

use crate::addr::Listener;
use crate::stream::{raised, BoxStream};

/// How [`accept_connections`] runs.
#[derive(Debug)]
pub struct AcceptLoop {
    /// Accepting stops once this is raised (or its sender is gone).
    pub shutdown: watch::Receiver<bool>,
    /// Connections served at once; the ones past it go to the refusal callback.
    pub max_connections: usize,
    /// How long the connections being served may take to finish after the stop; the
    /// ones still running then are aborted.
    pub grace: Duration,
    /// What the loop counts: connections being served (0 once the loop ends), accepted
    /// and refused.
    pub connections: Arc<ConnectionStats>,
    /// The server, as the logs name it (`"NBD server"`).
    pub server: &'static str,
}

/// What a server's accept loop counts, for reports (a metrics endpoint reads it while the
/// server runs): relaxed atomics, each read on its own.
#[derive(Debug, Default)]
pub struct ConnectionStats {
    open: AtomicUsize,
    accepted: AtomicU64,
    refused: AtomicU64,
}

impl ConnectionStats {
    /// Connections being served now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// Connections accepted and served since the start (those closed for a newcomer too).
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    /// Connections refused at the limit since the start.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    fn set_open(&self, n: usize) {
        self.open.store(n, Ordering::Relaxed);
    }
}

/// Checks a server's connection limit ([`AcceptLoop::max_connections`]): from 1 to 2^20 for
/// every farmap server.
pub fn check_max_connections(max_connections: usize) -> Result<(), OutOfRange> {
    check_range("the connection limit", max_connections as u64, 1, 1 << 20)
}

/// A connection that has had no request in flight and received none for this long may be
/// closed to make room for a new one at the cap.
pub const IDLE_TO_EVICT: Duration = Duration::from_secs(1);

/// What a connection tells the accept loop: when it last received a request, and whether
/// requests are in flight (through its semaphore of request slots).
#[derive(Debug)]
pub struct Activity {
    origin: Instant,
    /// Milliseconds after `origin` of the last request (or of the accept).
    last: AtomicU64,
    slots: OnceLock<(Arc<Semaphore>, usize)>,
}

impl Activity {
    fn new(origin: Instant) -> Activity {
        let a = Activity {
            origin,
            last: AtomicU64::new(0),
            slots: OnceLock::new(),
        };
        a.touch();
        a
    }

    /// A request came.
    pub fn touch(&self) {
        let now = self.origin.elapsed().as_millis() as u64;
        self.last.store(now, Ordering::Relaxed);
    }

    /// The connection's request slots: `max` permits, one held per request in flight.
    pub fn watch_slots(&self, slots: Arc<Semaphore>, max: usize) {
        let _ = self.slots.set((slots, max));
    }

    fn busy(&self) -> bool {
        self.slots
            .get()
            .is_some_and(|(s, max)| s.available_permits() < *max)
    }

    /// How long since the last request, when none is in flight.
    fn idle_for(&self) -> Option<Duration> {
        if self.busy() {
            return None;
        }
        let now = self.origin.elapsed().as_millis() as u64;
        Some(Duration::from_millis(
            now.saturating_sub(self.last.load(Ordering::Relaxed)),
        ))
    }
}

/// The connection idle longest (at least [`IDLE_TO_EVICT`]), if any.
fn evictee(live: &[(AbortHandle, Arc<Activity>, String)]) -> Option<usize> {
    live.iter()
        .enumerate()
        .filter_map(|(i, (h, a, _))| Some((i, a.idle_for()?)).filter(|_| !h.is_finished()))
        .filter(|(_, idle)| *idle >= IDLE_TO_EVICT)
        // The longest idle; the oldest connection among equals.
        .max_by_key(|(i, idle)| (*idle, std::cmp::Reverse(*i)))
        .map(|(i, _)| i)
}

/// Accepts connections on `listener` and runs `serve(stream, peer, activity)` as a task for
/// each, until [`AcceptLoop::shutdown`] is raised; at the cap, the connection idle longest
/// is closed for a new one (see the module docs), and when none is idle the new one is
/// handed to `refuse(stream, peer, serving)` instead. Then it removes the listener's socket file,
/// lets the connections finish within the grace period, and aborts the rest.
pub async fn accept_connections<S, F, R>(
    listener: Listener,
    cfg: AcceptLoop,
    mut serve: S,
    mut refuse: R,
) where
    S: FnMut(BoxStream, String, Arc<Activity>) -> F,
    F: Future<Output = ()> + Send + 'static,
    R: FnMut(BoxStream, String, usize),
{
    let AcceptLoop {
        mut shutdown,
        max_connections,
        grace,
        connections,
        server,
    } = cfg;
    let mut conns = JoinSet::new();
    let origin = Instant::now();
    // Every connection's task, activity and peer (finished ones pruned at the cap).
    let mut live: Vec<(AbortHandle, Arc<Activity>, String)> = Vec::new();
    loop {
        tokio::select! {
            _ = raised(&mut shutdown) => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {
                connections.set_open(conns.len());
            }
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    if conns.len() >= max_connections {
                        live.retain(|(h, _, _)| !h.is_finished());
                        match evictee(&live) {
                            Some(i) => {
                                let (h, a, old) = live.remove(i);
                                tracing::warn!(
                                    "{server}: {} connections (the limit): closing {old}'s, idle for {:?}, for {peer}",
                                    conns.len(),
                                    a.idle_for().unwrap_or_default()
                                );
                                h.abort();
                                // Its slot is free once the task has ended.
                                while conns.len() >= max_connections {
                                    if conns.join_next().await.is_none() {
                                        break;
                                    }
                                }
                            }
                            None => {
                                connections.refused.fetch_add(1, Ordering::Relaxed);
                                refuse(stream, peer, conns.len());
                                continue;
                            }
                        }
                    }
                    let activity = Arc::new(Activity::new(origin));
                    // Every log line of the connection names its server and peer.
                    let span = tracing::info_span!("connection", server, peer = %peer);
                    let handle = conns.spawn(
                        tracing::Instrument::instrument(
                            serve(stream, peer.clone(), activity.clone()),
                            span,
                        ),
                    );
                    live.push((handle, activity, peer));
                    if live.len() > 2 * max_connections {
                        live.retain(|(h, _, _)| !h.is_finished());
                    }
                    connections.accepted.fetch_add(1, Ordering::Relaxed);
                    connections.set_open(conns.len());
                }
                Err(e) => {
                    // Out of file descriptors and the like: pause rather than spin.
                    tracing::warn!("{server}: accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
    listener.cleanup();
    drop(listener);
    let drained =
        tokio::time::timeout(grace, async { while conns.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        tracing::warn!(
            "{server}: {} connections still busy after {grace:?}; closing them",
            conns.len()
        );
        conns.shutdown().await;
    }
    connections.set_open(0);
}
