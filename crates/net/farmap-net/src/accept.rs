//! The accept loop farmap's servers share: a cap on connections, a clean stop, a grace
//! period for the connections being served.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinSet;

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
    /// Kept equal to the number of connections being served (0 once the loop ends).
    pub connections: Arc<AtomicUsize>,
    /// The server, as the logs name it (`"NBD server"`).
    pub server: &'static str,
}

/// Accepts connections on `listener` and runs `serve(stream, peer)` as a task for each,
/// until [`AcceptLoop::shutdown`] is raised; a connection past the cap is handed to
/// `refuse(stream, peer, serving)` instead. Then it removes the listener's socket file,
/// lets the connections finish within the grace period, and aborts the rest.
pub async fn accept_connections<S, F, R>(
    listener: Listener,
    cfg: AcceptLoop,
    mut serve: S,
    mut refuse: R,
) where
    S: FnMut(BoxStream, String) -> F,
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
    loop {
        tokio::select! {
            _ = raised(&mut shutdown) => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {
                connections.store(conns.len(), Ordering::Relaxed);
            }
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    if conns.len() >= max_connections {
                        refuse(stream, peer, conns.len());
                        continue;
                    }
                    conns.spawn(serve(stream, peer));
                    connections.store(conns.len(), Ordering::Relaxed);
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
    connections.store(0, Ordering::Relaxed);
}
