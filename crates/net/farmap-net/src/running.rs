//! [`Running`]: the lifecycle every server shares (native, NBD): where it listens, how many
//! connections it serves, the stop signal its tasks watch, and the accept loop's task.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::accept::{AcceptLoop, ConnectionStats};
use crate::addr::ListenAddr;

/// A server's accept loop while it runs. Dropping it raises the stop signal (the loop and
/// its connections end without waiting); [`stop`](Self::stop) raises it and waits.
#[derive(Debug)]
pub struct Running {
    addr: ListenAddr,
    stop: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
    connections: Arc<ConnectionStats>,
}

/// What a server's tasks share before its accept loop starts: the stop signal they watch and
/// the count of connections being served.
#[derive(Debug)]
pub struct Starting {
    stop: watch::Sender<bool>,
    /// Raised when the server stops: connections and the accept loop end.
    pub shutdown: watch::Receiver<bool>,
    /// Connections being served, accepted and refused (the accept loop counts them).
    pub connections: Arc<ConnectionStats>,
}

impl Starting {
    /// A stop signal, not raised, and no connection.
    pub fn new() -> Self {
        let (stop, shutdown) = watch::channel(false);
        Self {
            stop,
            shutdown,
            connections: Arc::default(),
        }
    }

    /// How the accept loop of a server named `server` (in the logs) runs: it stops on this
    /// stop signal and keeps this count of connections.
    pub fn accept_loop(
        &self,
        max_connections: usize,
        grace: Duration,
        server: &'static str,
    ) -> AcceptLoop {
        AcceptLoop {
            shutdown: self.shutdown.clone(),
            max_connections,
            grace,
            connections: self.connections.clone(),
            server,
        }
    }

    /// Spawns the accept loop of a server listening on `addr`.
    pub fn spawn(
        self,
        addr: ListenAddr,
        accept: impl Future<Output = ()> + Send + 'static,
    ) -> Running {
        Running {
            addr,
            stop: self.stop,
            task: Some(tokio::spawn(accept)),
            connections: self.connections,
        }
    }
}

impl Default for Starting {
    fn default() -> Self {
        Self::new()
    }
}

impl Running {
    /// The address the server listens on (with the real port when port 0 was asked for).
    pub fn local_addr(&self) -> &ListenAddr {
        &self.addr
    }

    /// Connections being served right now.
    pub fn connections(&self) -> usize {
        self.connections.open()
    }

    /// What the accept loop counts, shared: it goes on counting while the server runs.
    pub fn connection_stats(&self) -> Arc<ConnectionStats> {
        self.connections.clone()
    }

    /// Stops accepting and waits for the accept loop, which lets the requests in flight be
    /// answered and closes every connection (within the server's grace).
    pub async fn stop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}
