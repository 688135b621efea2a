//! farmap over the network: transports, the server behind `farmap serve`, and the remote
//! store client. The bytes on the wire are those of `farmap-wire`.
//!
//! ```text
//!   RemoteStore (a Store)                                  serve(store, listener, opts)
//!   ┌──────────────────────────────┐                       ┌──────────────────────────────┐
//!   │ pool of N connections        │   TCP / Unix socket   │ accept loop (connection cap) │
//!   │  each: writer task ◀─ mpsc   │ ─── [TLS / mTLS] ───▶ │  per connection: handshake,  │
//!   │        reader task ─▶ id map │   hello, then frames  │  reader → task per request   │
//!   │  supervisor: reconnect with  │ ◀──────────────────── │  (≤ in-flight cap) → writer  │
//!   │  backoff; per-request timeout│  replies in any order │  → any Arc<dyn Store>        │
//!   └──────────────────────────────┘                       └──────────────────────────────┘
//! ```
//!
//! - [`serve`] / [`Server`]: serves any [`Store`](farmap_core::Store); graceful
//!   [`Server::shutdown`] answers the requests in flight and flushes the store. Memory is a
//!   byte budget per connection and in all (a client that stops reading its replies stops
//!   the server reading its requests); idle, stalled and silent connections time out.
//! - [`RemoteStore`]: a served region as a store, with pipelining, a connection pool,
//!   reconnection and deadlines; errors are sentences (refused, TLS refused and why,
//!   version mismatch, server gone).
//! - [`TlsServerConfig`], [`TlsClientConfig`]: TLS and mutual TLS from PEM files (rustls,
//!   ring provider).
//! - [`ListenAddr`], [`RemoteAddr`], [`Listener`]: `IP:PORT` or `unix:/path`.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod accept;
mod addr;
pub mod auth;
pub mod budget;
mod conn;
pub mod counted;
pub mod fair;
mod objects;
pub mod pool;
mod remote;
mod running;
mod server;
mod stream;
mod tls;

pub use accept::{
    accept_connections, check_max_connections, AcceptLoop, Activity, ConnectionStats, IDLE_TO_EVICT,
};
pub use addr::{bind_private_unix, AddrError, ListenAddr, Listener, RemoteAddr, RemoteAddrError};
pub use objects::RemoteObjects;
pub use remote::{reconnect_policy, ClientOptions, RemoteStore};
pub use running::{Running, Starting};
pub use server::{
    serve, serve_objects, serve_with_runs, RunReader, ServeError, ServeOptions, Server,
    DEFAULT_CONN_BUDGET, DEFAULT_IDLE_TIMEOUT, DEFAULT_TOTAL_BUDGET,
};
pub use stream::{is_clean_close, raised, within, write_all_vectored, BoxStream, Stream};
pub use tls::{
    describe_client_tls_failure, describe_server_tls_failure, TlsClientConfig, TlsConfigError,
    TlsServerConfig,
};

/// The wire protocol, re-exported for callers that inspect server limits.
pub use farmap_wire as wire;
