//! farmap's store operations as a gRPC service (tonic), for other languages and tools.
//!
//! The service (`farmap.v1.Store`, defined in `proto/farmap/v1/store.proto`) carries the same
//! operations as farmap's native protocol: a handshake that agrees on a version and returns
//! the region's geometry and capabilities, batched reads whose chunks come back as data, as a
//! zero flag (no payload), or as a per-chunk error, writes (all-zero chunks as a flag), flush,
//! trim and status. Errors carry the exact [`ErrorKind`](farmap_core::ErrorKind): in the
//! `farmap-error-kind` metadata of a failed call, or in a failed chunk of a read.
//!
//! - [`serve_grpc`] serves any `Arc<dyn Store>` on a TCP listener.
//! - [`GrpcStore`] is a [`Store`](farmap_core::Store) backed by such a server: a small pool of
//!   HTTP/2 connections, each multiplexing many requests in flight.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use farmap_core::{ChunkIdx, Geometry, Store};
//! use farmap_grpc::{serve_grpc, GrpcServerOptions, GrpcStore};
//!
//! let store = Arc::new(farmap_store::MemoryStore::new(Geometry::new(1 << 30, 1 << 16)?));
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let addr = listener.local_addr()?;
//! tokio::spawn(serve_grpc(store, listener, GrpcServerOptions::default()));
//!
//! let remote = GrpcStore::connect(&format!("http://{addr}")).await?;
//! let chunk = remote.read(ChunkIdx(0)).await?;
//! # Ok(()) }
//! ```
//!
//! Message size limits fit the largest chunk (4 MiB) and batches of chunks; the HTTP/2
//! flow-control windows are large enough (8 MiB per stream; per connection, 64 MiB for the
//! client's replies, 16 MiB for the server's requests) for links with tens of milliseconds
//! of round trip. The server holds every call to a memory budget (see
//! [`GrpcServerOptions`]).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod admission;
mod client;
mod codec;
mod convert;
mod lease;
mod limits;
mod server;
mod sizes;

pub use client::{GrpcClientOptions, GrpcStore};
pub use convert::ERROR_KIND_METADATA;
pub use server::{serve_grpc, serve_grpc_with_shutdown, GrpcServeError, GrpcServerOptions};

/// The protocol version this crate speaks.
pub const VERSION: u32 = 1;

/// The messages, client and server generated from `proto/farmap/v1/store.proto`.
#[allow(
    missing_docs,
    missing_debug_implementations,
    clippy::all,
    clippy::pedantic
)]
pub mod pb {
    tonic::include_proto!("farmap.v1");
}

// Unit tests measure what the codec allocates.
#[cfg(test)]
#[global_allocator]
static GLOBAL: farmap_testkit::alloc::CountingAlloc = farmap_testkit::alloc::CountingAlloc;

/// HTTP/2 stream window: a whole 4 MiB chunk and then some.
pub(crate) const STREAM_WINDOW: u32 = 8 << 20;
/// The largest HTTP/2 frame either side accepts (the default is 16 KiB: four frames per chunk).
pub(crate) const MAX_FRAME: u32 = 1 << 20;
/// HTTP/2 connection window of a client (for replies).
pub(crate) const CONNECTION_WINDOW: u32 = 64 << 20;
/// HTTP/2 connection window of the server (for requests): four writes of the largest chunk.
/// Requests the server has not admitted yet wait in it, outside the memory budget, so it is
/// smaller than a client's.
pub(crate) const SERVER_CONNECTION_WINDOW: u32 = 16 << 20;
/// The default largest message: 16 chunks of 4 MiB plus framing.
pub(crate) const DEFAULT_MAX_MESSAGE: u32 = (64 << 20) + (64 << 10);
/// The default most chunks per read.
pub(crate) const DEFAULT_MAX_BATCH: u32 = 256;
