//! What an NBD server serves ([`Export`]) and how ([`NbdServeOptions`]).

use std::sync::Arc;
use std::time::Duration;

use farmap_core::Store;
use farmap_nbd_proto::consts::DEFAULT_MAX_PAYLOAD;
use farmap_net::TlsServerConfig;

/// One export: a name and the store behind it.
#[derive(Debug, Clone)]
pub struct Export {
    /// The name clients ask for (`""` is the default export).
    pub name: String,
    /// A description shown by `nbdinfo --list`.
    pub description: String,
    /// The store.
    pub store: Arc<dyn Store>,
    /// Refuse writes, trims and zeroing on this export.
    pub read_only: bool,
}

/// How the NBD server serves.
#[derive(Debug, Clone)]
pub struct NbdServeOptions {
    /// Connections served at once; more are closed at once.
    pub max_connections: usize,
    /// Requests worked on at once per connection.
    pub max_in_flight_per_conn: usize,
    /// Store operations at once over all connections, taken from each connection in turn
    /// ([`farmap_net::fair`]): about the CPU count for stores whose work is this host's
    /// ([`farmap_net::fair::local_limit`]), more for stores whose operations wait on other
    /// hosts ([`farmap_net::fair::REMOTE_LIMIT`], the default).
    pub max_running: usize,
    /// TLS by `NBD_OPT_STARTTLS` (required of every client when set); with a client CA,
    /// mutual TLS.
    pub tls: Option<TlsServerConfig>,
    /// Largest payload of one write or simple-reply read, and largest data chunk of a
    /// structured read (announced in `NBD_INFO_BLOCK_SIZE`; raised to the chunk size of an
    /// export with larger chunks). Structured reads longer than this are served in pieces.
    pub max_payload: u32,
    /// Time a client has to finish the handshake (TLS included).
    pub handshake_timeout: Duration,
    /// A connection that sends nothing for this long with nothing in flight is closed; so
    /// is one that does not read its replies for this long.
    pub idle_timeout: Duration,
    /// Bytes of requests in flight and replies queued per connection (raised to at least
    /// two maximum payloads).
    pub conn_budget: usize,
    /// Bytes of requests in flight and replies queued over all connections together
    /// (raised to at least one connection's budget); a request waits for its share.
    pub total_budget: usize,
    /// How long [`NbdServer::shutdown`](crate::NbdServer::shutdown) waits for connections to finish.
    pub shutdown_grace: Duration,
    /// Log connections at `info` (else `debug`).
    pub log: bool,
}

impl Default for NbdServeOptions {
    /// 256 connections, 128 requests in flight each, 64 store operations at once, no TLS, 32 MiB payloads, 10 s
    /// handshake, 120 s idle, 64 MiB per connection and 256 MiB in all, 10 s grace, logging on.
    fn default() -> Self {
        Self {
            max_connections: 256,
            max_in_flight_per_conn: 128,
            max_running: farmap_net::fair::REMOTE_LIMIT,
            tls: None,
            max_payload: DEFAULT_MAX_PAYLOAD,
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(120),
            conn_budget: 2 * DEFAULT_MAX_PAYLOAD as usize,
            total_budget: farmap_net::DEFAULT_TOTAL_BUDGET,
            shutdown_grace: Duration::from_secs(10),
            log: true,
        }
    }
}
