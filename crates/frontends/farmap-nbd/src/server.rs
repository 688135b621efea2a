//! The accept loop, the options, and the running server.

use std::sync::Arc;

use farmap_core::option::{check_range, OutOfRange};
use farmap_core::{Caps, Store, StoreError};
use farmap_nbd_proto::consts::tflag;
use farmap_nbd_proto::{BlockSize, ExportInfo, ServerConfig, TlsMode};
use farmap_net::{
    accept_connections, check_max_connections, AcceptLoop, ListenAddr, Listener, Running, Starting,
    TlsConfigError,
};
use farmap_pipeline::Unaligned;
use tokio_rustls::TlsAcceptor;

use crate::conn::connection;
use crate::ctx::Ctx;
use crate::ops::ExportCtx;
use crate::options::{Export, NbdServeOptions};

/// Why the server could not start or stop cleanly.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NbdServeError {
    /// The TLS files could not be used.
    #[error("the NBD server's TLS configuration is unusable")]
    Tls(#[from] TlsConfigError),
    /// Two exports with one name, or none at all.
    #[error("{0}")]
    Exports(String),
    /// An option out of range.
    #[error(transparent)]
    BadOption(#[from] OutOfRange),
    /// The listener's address could not be read.
    #[error("cannot tell which address the NBD server listens on")]
    LocalAddr(#[source] std::io::Error),
    /// The final flush of an export failed.
    #[error("flushing export {name:?} at shutdown failed")]
    Flush {
        /// The export.
        name: String,
        /// Why.
        #[source]
        source: StoreError,
    },
}

/// A running NBD server. Dropping it stops it abruptly; [`shutdown`](Self::shutdown) stops
/// it cleanly.
#[derive(Debug)]
pub struct NbdServer {
    running: Running,
    exports: Vec<Export>,
}

/// The least each connection may hold beside the server's total: a few small requests.
const RESERVE: usize = 1 << 20;

/// The transmission flags of an export.
///
/// Only what the store does: `FLUSH`/`FUA` when its flush makes writes durable
/// ([`Caps::FLUSH`]), `TRIM` when it trims; `WRITE_ZEROES` on any writable export (zeros
/// are written where the store cannot trim), with `FAST_ZERO` (answered at once with
/// `ENOTSUP` where zeroing would be no faster than writing).
fn flags_for(caps: Caps, read_only: bool) -> u16 {
    let mut f = tflag::HAS_FLAGS | tflag::SEND_CACHE | tflag::CAN_MULTI_CONN;
    if caps.contains(Caps::FLUSH) {
        f |= tflag::SEND_FLUSH | tflag::SEND_FUA;
    }
    if read_only {
        f |= tflag::READ_ONLY;
    } else {
        f |= tflag::SEND_WRITE_ZEROES | tflag::SEND_FAST_ZERO;
        if caps.contains(Caps::TRIM) {
            f |= tflag::SEND_TRIM;
        }
    }
    f
}

/// What the handshake announces of export `e`, and what its connections serve it with.
fn export_ctx(e: &Export, max_payload: u32) -> (ExportInfo, Arc<ExportCtx>) {
    let g = e.store.geometry();
    let caps = e.store.caps();
    let read_only = e.read_only || !caps.contains(Caps::WRITE);
    let flags = flags_for(caps, read_only);
    // What is announced is what is served: writes and simple-reply reads up to `max` bytes
    // (longer ones fail with EINVAL), structured reads of any length (sent in chunks of at
    // most `max` bytes of data). A chunk (a power of two) is the preferred size, and never
    // over the maximum.
    let preferred = g.chunk_size().max(512);
    let max_payload = max_payload.max(preferred);
    let block = BlockSize {
        min: 1,
        preferred,
        max: max_payload,
    };
    let info = ExportInfo {
        name: e.name.clone(),
        description: e.description.clone(),
        size: g.size(),
        flags,
        block,
    };
    let ctx = Arc::new(ExportCtx {
        name: e.name.clone(),
        // Each store operation takes its connection's turn.
        store: Arc::new(Unaligned::new(
            Arc::new(farmap_net::fair::InTurn::new(e.store.clone())) as Arc<dyn Store>,
        )),
        size: g.size(),
        chunk: g.chunk_size().into(),
        read_only,
        caps,
        max_payload,
    });
    (info, ctx)
}

/// Refuses options out of range.
fn check_options(opts: &NbdServeOptions) -> Result<(), NbdServeError> {
    check_range(
        "the maximum payload",
        opts.max_payload.into(),
        64 * 1024,
        256 << 20,
    )?;
    check_range(
        "the limit of requests in flight per connection",
        opts.max_in_flight_per_conn as u64,
        1,
        65536,
    )?;
    check_max_connections(opts.max_connections)?;
    check_range(
        "the limit of requests working on the stores at once",
        opts.max_running as u64,
        1,
        65536,
    )?;
    Ok(())
}

/// Serves `exports` on `listener` until [`NbdServer::shutdown`]. Must be called from within
/// a Tokio runtime.
///
/// Every connection to an export shares one byte-range stage over its store, so a flush on
/// any connection covers the writes completed on all of them (`NBD_FLAG_CAN_MULTI_CONN`).
pub fn serve_nbd(
    exports: Vec<Export>,
    listener: Listener,
    opts: NbdServeOptions,
) -> Result<NbdServer, NbdServeError> {
    if exports.is_empty() {
        return Err(NbdServeError::Exports("there is no export to serve".into()));
    }
    for (i, e) in exports.iter().enumerate() {
        if exports[..i].iter().any(|o| o.name == e.name) {
            return Err(NbdServeError::Exports(format!(
                "export {:?} is named twice",
                e.name
            )));
        }
        if e.name.len() > farmap_nbd_proto::consts::MAX_STRING {
            return Err(NbdServeError::Exports(
                "export names are limited to 4096 bytes".into(),
            ));
        }
    }
    check_options(&opts)?;
    let tls = match &opts.tls {
        Some(t) => Some(TlsAcceptor::from(t.build()?)),
        None => None,
    };
    let addr = listener.local_addr().map_err(NbdServeError::LocalAddr)?;
    let (infos, ctxs): (Vec<_>, Vec<_>) = exports
        .iter()
        .map(|e| export_ctx(e, opts.max_payload))
        .unzip();
    let starting = Starting::new();
    let shutdown = starting.shutdown.clone();
    let accept = starting.accept_loop(opts.max_connections, opts.shutdown_grace, "NBD server");
    let largest = ctxs
        .iter()
        .map(|e| e.max_payload)
        .max()
        .unwrap_or(opts.max_payload);
    let conn_budget = opts
        .conn_budget
        .max(2 * largest as usize + 4096)
        .min(u32::MAX as usize);
    let total = farmap_net::budget::Total::new(opts.total_budget.max(conn_budget));
    // A connection's reserve runs a read of one chunk (of the export with the largest) and
    // small requests, whoever else holds the total.
    let largest_chunk = ctxs.iter().map(|e| e.chunk as usize).max().unwrap_or(0);
    let reserve = RESERVE.max(largest_chunk + 4096);
    let fair = farmap_net::fair::Fair::new(opts.max_running);
    // At shutdown, requests that have not reached the stores are answered with an error.
    fair.close_on(shutdown.clone());
    let ctx = Arc::new(Ctx {
        fair,
        exports: ctxs,
        handshake: ServerConfig {
            exports: infos,
            tls: if tls.is_some() {
                TlsMode::Required
            } else {
                TlsMode::Off
            },
        },
        opts,
        tls,
        shutdown,
        conn_budget,
        total,
        reserve,
    });
    Ok(NbdServer {
        running: starting.spawn(addr, accept_loop(listener, ctx, accept)),
        exports,
    })
}

impl NbdServer {
    /// The address the server listens on (with the real port when port 0 was asked for).
    pub fn local_addr(&self) -> &ListenAddr {
        self.running.local_addr()
    }

    /// Connections being served right now.
    pub fn connections(&self) -> usize {
        self.running.connections()
    }

    /// Its connections, counted while it runs (being served, accepted, refused).
    pub fn connection_stats(&self) -> std::sync::Arc<farmap_net::ConnectionStats> {
        self.running.connection_stats()
    }

    /// Stops accepting, lets the requests in flight be answered, closes every connection,
    /// and flushes every export.
    pub async fn shutdown(mut self) -> Result<(), NbdServeError> {
        self.running.stop().await;
        for e in &self.exports {
            e.store
                .flush()
                .await
                .map_err(|source| NbdServeError::Flush {
                    name: e.name.clone(),
                    source,
                })?;
        }
        Ok(())
    }
}

async fn accept_loop(listener: Listener, ctx: Arc<Ctx>, cfg: AcceptLoop) {
    let serving = ctx.clone();
    accept_connections(
        listener,
        cfg,
        |stream, peer, activity| connection(stream, peer, serving.clone(), activity),
        |stream, peer, n| {
            tracing::warn!(
                "refused NBD client {peer}: {n} connections are being served already (the limit)"
            );
            drop(stream);
        },
    )
    .await;
}
