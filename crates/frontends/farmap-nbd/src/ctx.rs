//! What every connection of a server shares: the exports, the handshake configuration, the
//! options, TLS and the shutdown signal.

use std::sync::Arc;

use farmap_nbd_proto::ServerConfig;
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;

use crate::ops::ExportCtx;
use crate::options::NbdServeOptions;

/// The server's state that its connections read.
pub(crate) struct Ctx {
    pub(crate) exports: Vec<Arc<ExportCtx>>,
    pub(crate) handshake: ServerConfig,
    pub(crate) opts: NbdServeOptions,
    pub(crate) tls: Option<TlsAcceptor>,
    pub(crate) shutdown: watch::Receiver<bool>,
    pub(crate) conn_budget: usize,
    /// The budget every connection's draws from.
    pub(crate) total: farmap_net::budget::Total,
    /// What each connection may hold beside the total (see [`farmap_net::budget`]).
    pub(crate) reserve: usize,
    /// Turns at the stores, shared out between the connections.
    pub(crate) fair: farmap_net::fair::Fair,
}

impl Ctx {
    pub(crate) fn note(&self, msg: std::fmt::Arguments<'_>) {
        if self.opts.log {
            tracing::info!("{msg}");
        } else {
            tracing::debug!("{msg}");
        }
    }
}
