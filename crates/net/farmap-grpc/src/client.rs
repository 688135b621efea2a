//! [`GrpcStore`]: a [`Store`] backed by a `farmap.v1.Store` gRPC server.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use farmap_core::{
    is_zero, zero_chunk, BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry,
    Store, StoreError, StoreResult,
};
use futures::future::{join_all, try_join_all};
use tonic::transport::{Channel, Endpoint};
use tonic::{Response, Status};

use crate::convert::{caps_from_pb, error_from_status, kind_from_pb, status_from_pb};
use crate::pb::store_client::StoreClient;
use crate::pb::{self, chunk_reply, write_request};
use crate::sizes::FRAMING;
use crate::{CONNECTION_WINDOW, DEFAULT_MAX_MESSAGE, MAX_FRAME, STREAM_WINDOW, VERSION};

/// How a [`GrpcStore`] connects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GrpcClientOptions {
    /// HTTP/2 connections, used in turn. Each multiplexes any number of requests; a few
    /// spread the work of framing and flow control over more than one task.
    pub connections: usize,
    /// How long establishing each connection may take.
    pub connect_timeout: Duration,
    /// How long one request may take before it fails with a timeout; `None` for no limit.
    pub request_timeout: Option<Duration>,
}

impl Default for GrpcClientOptions {
    fn default() -> Self {
        Self {
            connections: 4,
            connect_timeout: Duration::from_secs(10),
            request_timeout: Some(Duration::from_secs(60)),
        }
    }
}

/// A [`Store`] whose chunks live on a gRPC server ([`serve_grpc`](crate::serve_grpc) or any
/// other implementation of `farmap.v1.Store`).
///
/// Concurrency contract:
/// - Every method takes `&self` and may be called from any number of tasks; requests go out
///   at once, in turn over the pool's connections, and complete in any order.
/// - A dropped connection is re-established by the next request on it (that request, and
///   those in flight when it dropped, fail with the retryable
///   [`ErrorKind::Unavailable`]); retrying is left to a retry stage.
/// - The geometry and capabilities are those the server announced at connect time.
pub struct GrpcStore {
    url: String,
    clients: Vec<StoreClient<Channel>>,
    next: AtomicUsize,
    geometry: Geometry,
    caps: Caps,
    max_batch: usize,
    max_message: usize,
    request_timeout: Option<Duration>,
}

impl fmt::Debug for GrpcStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GrpcStore")
            .field("url", &self.url)
            .field("connections", &self.clients.len())
            .field("geometry", &self.geometry)
            .field("caps", &self.caps)
            .finish_non_exhaustive()
    }
}

impl GrpcStore {
    /// Connects to `url` (`http://host:port`) with default options and asks for the region's
    /// shape.
    pub async fn connect(url: &str) -> StoreResult<Self> {
        Self::connect_with(url, GrpcClientOptions::default()).await
    }

    /// Connects to `url` (`http://host:port`) and asks for the region's shape.
    ///
    /// Fails with `InvalidInput` for a malformed URL, `Unavailable` when the server cannot be
    /// reached, and `Unsupported` when it does not speak protocol version 1.
    pub async fn connect_with(url: &str, options: GrpcClientOptions) -> StoreResult<Self> {
        let endpoint = Endpoint::from_shared(url.to_owned())
            .map_err(|e| StoreError::invalid(format!("invalid gRPC URL {url:?}")).with_source(e))?
            .connect_timeout(options.connect_timeout)
            .tcp_nodelay(true)
            .initial_stream_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .max_frame_size(MAX_FRAME);
        let channels = try_join_all((0..options.connections.max(1)).map(|_| endpoint.connect()))
            .await
            .map_err(|e| {
                StoreError::new(
                    ErrorKind::Unavailable,
                    format!("cannot connect to the gRPC server at {url}"),
                )
                .with_source(e)
            });
        let channels = match channels {
            Ok(c) => c,
            Err(e) => return Err(native_server_named(&endpoint, url, e).await),
        };
        let limit = |c: StoreClient<Channel>, bytes: usize| {
            c.max_decoding_message_size(bytes)
                .max_encoding_message_size(bytes)
        };
        let mut first = limit(
            StoreClient::new(channels[0].clone()),
            DEFAULT_MAX_MESSAGE as usize,
        );
        let hello = match call(
            options.request_timeout,
            || format!("handshake with {url}"),
            first.handshake(pb::HandshakeRequest { version: VERSION }),
        )
        .await
        {
            Ok(hello) => hello,
            Err(e) => return Err(native_server_named(&endpoint, url, e).await),
        };
        if hello.version != VERSION {
            return Err(StoreError::new(
                ErrorKind::Unsupported,
                format!(
                    "{url} answered with protocol version {}, this client speaks {VERSION}",
                    hello.version
                ),
            ));
        }
        let geometry =
            Geometry::new_bounded(hello.size, u64::from(hello.chunk_size)).map_err(|e| {
                StoreError::new(
                    ErrorKind::Corrupt,
                    format!("{url} announced an invalid region"),
                )
                .with_source(e)
            })?;
        let mut caps = hello.caps.as_ref().map_or(Caps::NONE, caps_from_pb);
        if hello.read_only {
            caps = caps.without(Caps::WRITE | Caps::TRIM);
        }
        let max_message =
            (hello.max_message as usize).max(geometry.chunk_size() as usize + FRAMING);
        let clients = channels
            .into_iter()
            .map(|ch| limit(StoreClient::new(ch), max_message))
            .collect();
        Ok(Self {
            url: url.to_owned(),
            clients,
            next: AtomicUsize::new(0),
            geometry,
            caps,
            max_batch: (hello.max_batch as usize).max(1),
            max_message,
            request_timeout: options.request_timeout,
        })
    }

    /// The URL this store was connected to.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Reads several chunks with as few requests as the server's limits allow (sent
    /// concurrently); each chunk succeeds or fails on its own, in the order asked.
    ///
    /// The outer error is for a request that failed as a whole (the server is gone, say).
    pub async fn read_batch(&self, chunks: &[ChunkIdx]) -> StoreResult<Vec<StoreResult<Bytes>>> {
        let per_request = self
            .max_batch
            .min((self.max_message - FRAMING) / self.geometry.chunk_size() as usize)
            .max(1);
        let parts = join_all(
            chunks
                .chunks(per_request)
                .map(|part| self.read_request(part)),
        )
        .await;
        let mut out = Vec::with_capacity(chunks.len());
        for part in parts {
            out.extend(part?);
        }
        Ok(out)
    }

    /// The next connection's client (a cheap clone: clients share their connection).
    fn client(&self) -> StoreClient<Channel> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.clients.len();
        self.clients[i].clone()
    }

    async fn read_request(&self, chunks: &[ChunkIdx]) -> StoreResult<Vec<StoreResult<Bytes>>> {
        let what = || match chunks {
            [one] => format!("reading {one} from {}", self.url),
            _ => format!("reading {} chunks from {}", chunks.len(), self.url),
        };
        let request = pb::ReadRequest {
            chunks: chunks.iter().map(|c| c.0).collect(),
        };
        let mut client = self.client();
        let reply = call(self.request_timeout, what, client.read(request)).await?;
        if reply.chunks.len() != chunks.len() {
            return Err(StoreError::new(
                ErrorKind::Corrupt,
                format!("{}: {} chunks in the reply", what(), reply.chunks.len()),
            ));
        }
        Ok(chunks
            .iter()
            .zip(reply.chunks)
            .map(|(&idx, chunk)| self.chunk_of(idx, chunk))
            .collect())
    }

    /// The content of one chunk of a read reply, checked against the geometry.
    fn chunk_of(&self, idx: ChunkIdx, chunk: pb::ChunkReply) -> StoreResult<Bytes> {
        let corrupt = |what: String| {
            StoreError::new(
                ErrorKind::Corrupt,
                format!("reading {idx} from {}: {what}", self.url),
            )
        };
        let len = self.geometry.chunk_len(idx);
        match chunk.result {
            Some(chunk_reply::Result::Data(data)) if data.len() == len => Ok(data),
            Some(chunk_reply::Result::Data(data)) => {
                Err(corrupt(format!("{} bytes instead of {len}", data.len())))
            }
            Some(chunk_reply::Result::Zero(_)) if self.geometry.contains(idx) => {
                Ok(zero_chunk(len))
            }
            Some(chunk_reply::Result::Zero(_)) => Err(corrupt("zeros past the end".into())),
            Some(chunk_reply::Result::Error(e)) => Err(StoreError::new(
                kind_from_pb(e.kind),
                format!("reading {idx} from {}: {}", self.url, e.message),
            )),
            None => Err(corrupt("an empty reply".into())),
        }
    }

    async fn write_chunk(&self, idx: ChunkIdx, data: Bytes) -> StoreResult<()> {
        self.geometry.check_write(idx, data.len())?;
        let body = if is_zero(&data) {
            write_request::Body::Zero(true)
        } else {
            write_request::Body::Data(data)
        };
        let request = pb::WriteRequest {
            chunk: idx.0,
            body: Some(body),
        };
        let what = || format!("writing {idx} to {}", self.url);
        let mut client = self.client();
        call(self.request_timeout, what, client.write(request)).await?;
        Ok(())
    }
}

/// Awaits one call, within `timeout`, and turns a failure into a store error saying `what`.
async fn call<T>(
    timeout: Option<Duration>,
    what: impl FnOnce() -> String,
    call: impl Future<Output = Result<Response<T>, Status>>,
) -> StoreResult<T> {
    let result = match timeout {
        None => call.await,
        Some(limit) => match tokio::time::timeout(limit, call).await {
            Ok(result) => result,
            Err(_) => {
                return Err(StoreError::new(
                    ErrorKind::Timeout,
                    format!("{}: no reply within {limit:?}", what()),
                ))
            }
        },
    };
    result
        .map(Response::into_inner)
        .map_err(|s| error_from_status(&s, what))
}

impl Store for GrpcStore {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn caps(&self) -> Caps {
        self.caps
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            self.geometry.check_idx(idx)?;
            let mut chunks = self.read_request(&[idx]).await?;
            chunks
                .pop()
                .unwrap_or_else(|| Err(StoreError::new(ErrorKind::Corrupt, "an empty read reply")))
        })
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(self.write_chunk(idx, data))
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            let what = || format!("flushing {}", self.url);
            let mut client = self.client();
            call(
                self.request_timeout,
                what,
                client.flush(pb::FlushRequest {}),
            )
            .await?;
            Ok(())
        })
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            let request = pb::TrimRequest {
                start: range.start.0,
                end: range.end.0,
            };
            let what = || format!("trimming {range} of {}", self.url);
            let mut client = self.client();
            call(self.request_timeout, what, client.trim(request)).await?;
            Ok(())
        })
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        Box::pin(async move {
            let what = || format!("status of {idx} from {}", self.url);
            let mut client = self.client();
            let request = pb::StatusRequest { chunk: idx.0 };
            let reply = call(self.request_timeout, what, client.status(request)).await?;
            status_from_pb(reply.status).ok_or_else(|| {
                StoreError::new(
                    ErrorKind::Corrupt,
                    format!("{}: invalid status {}", what(), reply.status),
                )
            })
        })
    }
}

/// `err`, or, when the server at `endpoint` turns out to speak farmap's native protocol
/// rather than gRPC, an error that says so.
async fn native_server_named(endpoint: &Endpoint, url: &str, err: StoreError) -> StoreError {
    let Some(authority) = endpoint.uri().authority() else {
        return err;
    };
    if speaks_native(authority.as_str()).await {
        StoreError::new(
            ErrorKind::Unsupported,
            format!(
                "the server at {url} speaks farmap's native protocol, not gRPC: connect with farmap://{authority}"
            ),
        )
    } else {
        err
    }
}

/// Whether a farmap native server answers at `authority`: it answers an HTTP/2 preface with
/// a refusal that starts with farmap's magic bytes.
async fn speaks_native(authority: &str) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const MAGIC: &[u8; 8] = b"\x89FARMAP\n";
    let probe = async {
        let mut s = tokio::net::TcpStream::connect(authority).await.ok()?;
        s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .ok()?;
        let mut head = [0u8; 8];
        s.read_exact(&mut head).await.ok()?;
        Some(&head == MAGIC)
    };
    tokio::time::timeout(Duration::from_secs(2), probe)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
}
