//! [`serve_grpc`]: the `farmap.v1.Store` service over any store.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use farmap_core::{
    is_zero, zero_chunk, Caps, ChunkIdx, ChunkRange, Geometry, Store, StoreError, StoreResult,
};
use futures::future::join_all;
use tokio::net::TcpListener;
use tonic::transport::Server;
use tonic::{Request, Response, Status};

use crate::convert::{caps_to_pb, error_to_pb, status_from_error, status_to_pb};
use crate::limits::limited_incoming;
use crate::pb::store_server::StoreServer;
use crate::pb::{self, chunk_reply, write_request};
use crate::{
    CONNECTION_WINDOW, DEFAULT_MAX_BATCH, DEFAULT_MAX_MESSAGE, MAX_FRAME, STREAM_WINDOW, VERSION,
};

/// Protobuf and gRPC framing around the chunk payloads of one message, at most.
const FRAMING: usize = 64 << 10;
/// How a gRPC server serves its store.
///
/// Memory: each connection holds at most [`max_in_flight`](Self::max_in_flight) requests and
/// their replies, each at most [`max_message`](Self::max_message) bytes; at most
/// [`max_connections`](Self::max_connections) connections are served, and one that moves no
/// bytes for [`idle_timeout`](Self::idle_timeout) (idle, or not reading its replies) is closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GrpcServerOptions {
    /// Refuse writes and trims (with [`ErrorKind::ReadOnly`](farmap_core::ErrorKind)) and
    /// report the store without those capabilities.
    pub read_only: bool,
    /// The most chunks one read request may ask for.
    pub max_batch: u32,
    /// The largest message either side may send, in bytes; raised to fit at least one chunk.
    pub max_message: u32,
    /// Connections served at once; more are closed as soon as they are accepted.
    pub max_connections: usize,
    /// Requests (HTTP/2 streams) worked on at once per connection.
    pub max_in_flight: u32,
    /// A connection that moves no bytes for this long is closed.
    pub idle_timeout: Duration,
    /// Log each connection's coming and going at `info` level (at `debug` when false).
    pub log: bool,
}

impl Default for GrpcServerOptions {
    fn default() -> Self {
        Self {
            read_only: false,
            max_batch: DEFAULT_MAX_BATCH,
            max_message: DEFAULT_MAX_MESSAGE,
            max_connections: 256,
            max_in_flight: 128,
            idle_timeout: Duration::from_secs(120),
            log: true,
        }
    }
}

/// The gRPC server stopped with an error (the listener failed).
#[derive(Debug, thiserror::Error)]
#[error("the gRPC server stopped")]
pub struct GrpcServeError(#[source] tonic::transport::Error);

/// Serves `store` on `listener` until the listener fails.
///
/// Every accepted connection has `TCP_NODELAY` set; see [`GrpcServerOptions`] for the limits.
pub async fn serve_grpc(
    store: Arc<dyn Store>,
    listener: TcpListener,
    options: GrpcServerOptions,
) -> Result<(), GrpcServeError> {
    serve_grpc_with_shutdown(store, listener, options, std::future::pending()).await
}

/// Serves `store` on `listener` until `signal` completes; then stops accepting and returns
/// once the open connections have closed.
pub async fn serve_grpc_with_shutdown(
    store: Arc<dyn Store>,
    listener: TcpListener,
    options: GrpcServerOptions,
    signal: impl Future<Output = ()>,
) -> Result<(), GrpcServeError> {
    let service = StoreService::new(store, options);
    let max_message = service.max_message as usize;
    let server = StoreServer::new(service)
        .max_decoding_message_size(max_message)
        .max_encoding_message_size(max_message);
    let incoming = limited_incoming(
        listener,
        options.max_connections.max(1),
        options.idle_timeout,
        options.log,
    );
    let in_flight = options.max_in_flight.max(1);
    Server::builder()
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_concurrent_streams(in_flight)
        .concurrency_limit_per_connection(in_flight as usize)
        .max_frame_size(MAX_FRAME)
        .serve_with_incoming_shutdown(server, incoming, signal)
        .await
        .map_err(GrpcServeError)
}

/// The service implementation: every call goes straight to the store; nothing is held
/// between calls, so calls run concurrently as far as the store allows.
#[derive(Debug)]
struct StoreService {
    store: Arc<dyn Store>,
    geometry: Geometry,
    caps: Caps,
    read_only: bool,
    max_batch: u32,
    max_message: u32,
}

impl StoreService {
    fn new(store: Arc<dyn Store>, options: GrpcServerOptions) -> Self {
        let geometry = store.geometry();
        let mut caps = store.caps();
        if options.read_only {
            caps = caps.without(Caps::WRITE | Caps::TRIM);
        }
        let one_chunk = u32::try_from(geometry.chunk_size() as usize + FRAMING).unwrap_or(u32::MAX);
        Self {
            store,
            geometry,
            caps,
            read_only: options.read_only,
            max_batch: options.max_batch.max(1),
            max_message: options.max_message.max(one_chunk),
        }
    }

    fn check_writable(&self, what: &str) -> Result<(), Status> {
        if self.read_only {
            return Err(status_from_error(&StoreError::new(
                farmap_core::ErrorKind::ReadOnly,
                format!("{what}: this server is read-only"),
            )));
        }
        Ok(())
    }

    async fn read_one(&self, idx: ChunkIdx) -> pb::ChunkReply {
        let result = match self.store.read(idx).await {
            Ok(data) if is_zero(&data) => chunk_reply::Result::Zero(true),
            Ok(data) => chunk_reply::Result::Data(data),
            Err(e) => chunk_reply::Result::Error(error_to_pb(&e)),
        };
        pb::ChunkReply {
            result: Some(result),
        }
    }
}

fn reply<T>(result: StoreResult<T>) -> Result<Response<T>, Status> {
    result.map(Response::new).map_err(|e| status_from_error(&e))
}

#[tonic::async_trait]
impl pb::store_server::Store for StoreService {
    async fn handshake(
        &self,
        request: Request<pb::HandshakeRequest>,
    ) -> Result<Response<pb::HandshakeReply>, Status> {
        let version = request.into_inner().version;
        if version == 0 {
            return reply(Err(StoreError::invalid("protocol version 0 is invalid")));
        }
        reply(Ok(pb::HandshakeReply {
            version: version.min(VERSION),
            size: self.geometry.size(),
            chunk_size: self.geometry.chunk_size(),
            caps: Some(caps_to_pb(self.caps)),
            read_only: self.read_only,
            max_batch: self.max_batch,
            max_message: self.max_message,
        }))
    }

    async fn read(
        &self,
        request: Request<pb::ReadRequest>,
    ) -> Result<Response<pb::ReadReply>, Status> {
        let chunks = request.into_inner().chunks;
        let payload = chunks.len() * self.geometry.chunk_size() as usize;
        if chunks.len() > self.max_batch as usize || payload + FRAMING > self.max_message as usize {
            return reply(Err(StoreError::invalid(format!(
                "a read of {} chunks exceeds this server's limits ({} chunks, {} bytes)",
                chunks.len(),
                self.max_batch,
                self.max_message
            ))));
        }
        let replies = join_all(chunks.into_iter().map(|c| self.read_one(ChunkIdx(c)))).await;
        reply(Ok(pb::ReadReply { chunks: replies }))
    }

    async fn write(
        &self,
        request: Request<pb::WriteRequest>,
    ) -> Result<Response<pb::WriteReply>, Status> {
        let request = request.into_inner();
        let idx = ChunkIdx(request.chunk);
        self.check_writable(&format!("writing {idx}"))?;
        let data = match request.body {
            Some(write_request::Body::Data(data)) => data,
            Some(write_request::Body::Zero(_)) => {
                self.geometry
                    .check_idx(idx)
                    .map_err(|e| status_from_error(&e))?;
                zero_chunk(self.geometry.chunk_len(idx))
            }
            None => {
                return reply(Err(StoreError::invalid(format!(
                    "a write of {idx} without content"
                ))))
            }
        };
        reply(
            self.store
                .write(idx, data)
                .await
                .map(|()| pb::WriteReply {}),
        )
    }

    async fn flush(
        &self,
        _request: Request<pb::FlushRequest>,
    ) -> Result<Response<pb::FlushReply>, Status> {
        reply(self.store.flush().await.map(|()| pb::FlushReply {}))
    }

    async fn trim(
        &self,
        request: Request<pb::TrimRequest>,
    ) -> Result<Response<pb::TrimReply>, Status> {
        let request = request.into_inner();
        let range = ChunkRange::new(ChunkIdx(request.start), ChunkIdx(request.end));
        self.check_writable(&format!("trimming {range}"))?;
        reply(self.store.trim(range).await.map(|()| pb::TrimReply {}))
    }

    async fn status(
        &self,
        request: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusReply>, Status> {
        let idx = ChunkIdx(request.into_inner().chunk);
        reply(self.store.status(idx).await.map(|s| pb::StatusReply {
            status: status_to_pb(s) as i32,
        }))
    }
}
