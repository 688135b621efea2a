//! [`serve_grpc`]: the `farmap.v1.Store` service over any store.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use farmap_core::{
    is_zero, zero_chunk, Caps, ChunkIdx, ChunkRange, Geometry, Store, StoreError, StoreResult,
};
use farmap_net::budget::Total;
use futures::future::join_all;
use tokio::net::TcpListener;
use tonic::transport::Server;
use tonic::{Request, Response, Status};

use crate::admission::Admission;
use crate::convert::{caps_to_pb, error_to_pb, status_from_error, status_to_pb};
use crate::lease::Lease;
use crate::limits::{limited_incoming, Budgets};
use crate::pb::store_server::StoreServer;
use crate::pb::{self, chunk_reply, write_request};
use crate::sizes::{Sizes, FRAMING};
use crate::{
    DEFAULT_MAX_BATCH, DEFAULT_MAX_MESSAGE, MAX_FRAME, SERVER_CONNECTION_WINDOW, STREAM_WINDOW,
    VERSION,
};

/// How a gRPC server serves its store.
///
/// Memory:
/// - Every call is charged, before its request is read, what it may hold until the last byte
///   of its reply is gone: its request at the largest its kind may be (a write: one chunk and
///   a few bytes; a read: [`max_batch`](Self::max_batch) indices) and, for a read, once its
///   chunks are known, each chunk it reads. The charge comes from its connection's budget
///   (two of the largest calls) and then from the connection's own reserve (a call of one
///   chunk, at least 1 MiB) or from the server's total
///   ([`total_budget`](Self::total_budget)), as in farmap's native server. A call whose charge
///   does not come within [`memory_wait`](Self::memory_wait) fails with `RESOURCE_EXHAUSTED`
///   (kind `Unavailable`: retryable) with its request unread. Clients that hold the whole
///   total (with writes the store keeps pending, or replies they never read) do not starve the
///   others: every connection can still run a call of one chunk.
/// - A request larger than its kind may be is refused on the length its message announces,
///   before it is buffered or decoded.
/// - So the server's memory for calls is at most the total and one reserve per connection
///   (while a reply is encoded, on one thread, its chunks and its encoded bytes exist at
///   once), and beside it, per connection, what HTTP/2 holds outside any call: bytes of
///   requests not yet admitted, up to its receive window (16 MiB), and hyper's send buffers.
///   While a connection's window is full of requests that wait for memory, its admitted
///   requests wait for their bytes with them, until those time out.
///
/// At most [`max_connections`](Self::max_connections) connections are served, each with at
/// most [`max_in_flight`](Self::max_in_flight) calls, and one that moves no bytes for
/// [`idle_timeout`](Self::idle_timeout) (idle, or not reading its replies) is closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GrpcServerOptions {
    /// Refuse writes and trims (with [`ErrorKind::ReadOnly`](farmap_core::ErrorKind)) and
    /// report the store without those capabilities.
    pub read_only: bool,
    /// The most chunks one read request may ask for.
    pub max_batch: u32,
    /// The largest message the server sends (a read's reply), in bytes; raised to fit at least
    /// one chunk. A request is at most a write of one chunk, or a read's indices.
    pub max_message: u32,
    /// Connections served at once; more are closed as soon as they are accepted.
    pub max_connections: usize,
    /// Requests (HTTP/2 streams) worked on at once per connection.
    pub max_in_flight: u32,
    /// Store operations at once over all connections, taken from each connection in turn
    /// ([`farmap_net::fair`]): about the CPU count for a store whose work is this host's
    /// ([`farmap_net::fair::local_limit`]), more for one whose operations wait on other hosts
    /// ([`farmap_net::fair::REMOTE_LIMIT`], the default).
    pub max_running: usize,
    /// A connection that moves no bytes for this long is closed.
    pub idle_timeout: Duration,
    /// Log each connection's coming and going at `info` level (at `debug` when false).
    pub log: bool,
    /// Bytes of requests and replies held at once over all connections (beside each
    /// connection's reserve); raised to fit the largest call. Default 256 MiB, as for
    /// farmap's native server.
    pub total_budget: usize,
    /// How long a call waits for memory before it fails with `RESOURCE_EXHAUSTED`.
    pub memory_wait: Duration,
    /// How long the stop waits for calls in flight before the connections left are dropped.
    pub shutdown_grace: Duration,
}

impl Default for GrpcServerOptions {
    fn default() -> Self {
        Self {
            read_only: false,
            max_batch: DEFAULT_MAX_BATCH,
            max_message: DEFAULT_MAX_MESSAGE,
            max_connections: 256,
            max_in_flight: 128,
            max_running: farmap_net::fair::REMOTE_LIMIT,
            idle_timeout: Duration::from_secs(120),
            log: true,
            total_budget: farmap_net::DEFAULT_TOTAL_BUDGET,
            memory_wait: Duration::from_secs(10),
            shutdown_grace: Duration::from_secs(10),
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
    let sizes = service.sizes;
    let server = StoreServer::new(service)
        .max_decoding_message_size(sizes.largest_request())
        .max_encoding_message_size(sizes.max_message());
    let largest = sizes.largest_charge();
    let budgets = Budgets {
        total: Total::new(options.total_budget.max(largest)),
        conn: largest.saturating_mul(2),
        reserve: sizes.reserve(),
        fair: farmap_net::fair::Fair::new(options.max_running),
        stopping: Arc::default(),
        live: Arc::default(),
    };
    // At shutdown, calls that have not reached the store are answered with an error, and
    // connections whose bytes do not move for a second are closed, not waited for.
    let stopping = budgets.clone();
    let (stopped_tx, mut stopped) = tokio::sync::watch::channel(false);
    let signal = async move {
        signal.await;
        stopping.stop();
        stopping.fair.close();
        let _ = stopped_tx.send(true);
    };
    let incoming = limited_incoming(
        listener,
        options.max_connections.max(1),
        options.idle_timeout,
        options.log,
        budgets,
    );
    let in_flight = options.max_in_flight.max(1);
    let serving = Server::builder()
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(SERVER_CONNECTION_WINDOW)
        .max_concurrent_streams(in_flight)
        .concurrency_limit_per_connection(in_flight as usize)
        .max_frame_size(MAX_FRAME)
        .serve_with_incoming_shutdown(
            Admission::new(server, sizes, options.memory_wait),
            incoming,
            signal,
        );
    // A client that stops reading can hold its call (and so the graceful stop) on HTTP/2
    // flow control for as long as it likes: after the grace, what is left is dropped.
    let grace = options.shutdown_grace;
    tokio::select! {
        served = serving => served.map_err(GrpcServeError),
        () = async {
            farmap_net::raised(&mut stopped).await;
            tokio::time::sleep(grace).await;
        } => {
            tracing::warn!("gRPC connections still open {grace:?} after the stop: closing them");
            Ok(())
        }
    }
}

/// The service implementation: every call goes straight to the store; nothing is held
/// between calls, so calls run concurrently as far as the store allows.
#[derive(Debug)]
struct StoreService {
    store: Arc<dyn Store>,
    geometry: Geometry,
    caps: Caps,
    read_only: bool,
    sizes: Sizes,
}

impl StoreService {
    fn new(store: Arc<dyn Store>, options: GrpcServerOptions) -> Self {
        let geometry = store.geometry();
        let mut caps = store.caps();
        if options.read_only {
            caps = caps.without(Caps::WRITE | Caps::TRIM);
        }
        Self {
            // Each store operation takes its connection's turn.
            store: Arc::new(farmap_net::fair::InTurn::new(store)),
            geometry,
            caps,
            read_only: options.read_only,
            sizes: Sizes::new(geometry, options.max_batch, options.max_message),
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
            max_batch: u32::try_from(self.sizes.max_batch()).unwrap_or(u32::MAX),
            max_message: u32::try_from(self.sizes.max_message()).unwrap_or(u32::MAX),
        }))
    }

    async fn read(
        &self,
        request: Request<pb::ReadRequest>,
    ) -> Result<Response<pb::ReadReply>, Status> {
        let lease = request.extensions().get::<Lease>().cloned();
        let chunks = request.into_inner().chunks;
        let payload = chunks.len() * self.geometry.chunk_size() as usize;
        if chunks.len() > self.sizes.max_batch() || payload + FRAMING > self.sizes.max_message() {
            return reply(Err(StoreError::invalid(format!(
                "a read of {} chunks exceeds this server's limits ({} chunks, {} bytes)",
                chunks.len(),
                self.sizes.max_batch(),
                self.sizes.max_message()
            ))));
        }
        // Every call comes through `Admission`, which gives it its lease.
        let Some(lease) = lease else {
            return Err(Status::internal("a read without its memory lease"));
        };
        let what = || format!("a read of {} chunks", chunks.len());
        lease.add(self.sizes.reply_charge(&chunks), what).await?;
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
