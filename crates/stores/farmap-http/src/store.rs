//! [`HttpStore`]: a file on a web server, one range request per chunk.

use std::fmt;
use std::future::Future;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use farmap_core::{
    BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, RetryPolicy, Store,
    StoreError, StoreResult,
};
use reqwest::header::RANGE;
use reqwest::{Response, Url};
use tokio::sync::Semaphore;

use crate::answer::{self, Asked, Refusal, Validator};
use crate::client;
use crate::HttpLocation;

/// Requests in flight at once (and idle connections kept) when `connections=` is not given.
pub const DEFAULT_CONNECTIONS: usize = 64;
/// Retries of one request when `retries=` is not given.
pub const DEFAULT_RETRIES: u32 = 10;
/// Deadline of one request (body included) when `timeout=` is not given.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest one request is retried for, whatever `retries=` says.
pub const RETRY_TOTAL: Duration = Duration::from_secs(60);
/// Retries of the probe of [`HttpStore::open`], so that a wrong address fails fast.
const OPEN_RETRIES: u32 = 2;

/// The backoff between retries: 50 ms, doubling, at most 2 s (with jitter).
fn policy(retries: u32) -> RetryPolicy {
    RetryPolicy {
        attempts: retries.saturating_add(1),
        initial_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_secs(2),
    }
}

/// How to open an [`HttpStore`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpOptions {
    /// The file and how to reach it.
    pub location: HttpLocation,
    /// The size the file must have, if the spec says (it is read from the server anyway).
    pub size: Option<u64>,
    /// Chunk size (default [`DEFAULT_CHUNK_SIZE`](farmap_core::DEFAULT_CHUNK_SIZE)).
    pub chunk_size: Option<u32>,
}

/// A file on a web server as a read-only region. See the [crate docs](crate) for the whole
/// contract.
pub struct HttpStore {
    url: Url,
    client: reqwest::Client,
    geometry: Geometry,
    validator: Validator,
    /// Requests in flight.
    limit: Semaphore,
    policy: RetryPolicy,
}

impl fmt::Debug for HttpStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpStore")
            .field("url", &self.url.as_str())
            .field("geometry", &self.geometry)
            .field("validator", &self.validator)
            .finish_non_exhaustive()
    }
}

/// Why one attempt failed.
#[derive(Debug)]
struct Failure {
    kind: ErrorKind,
    why: String,
    source: Option<reqwest::Error>,
}

impl From<Refusal> for Failure {
    fn from(r: Refusal) -> Failure {
        Failure {
            kind: r.kind,
            why: r.why,
            source: None,
        }
    }
}

impl Failure {
    /// A request that got no (complete) answer.
    fn transport(url: &Url, e: reqwest::Error) -> Failure {
        let host = url.host_str().unwrap_or("the server");
        let (kind, why) = if e.is_timeout() {
            (ErrorKind::Timeout, format!("{host} did not answer in time"))
        } else if e.is_connect() {
            (ErrorKind::Unavailable, format!("cannot reach {host}"))
        } else if e.is_redirect() {
            (ErrorKind::Io, "too many redirects".to_owned())
        } else if e.is_builder() {
            (
                ErrorKind::InvalidInput,
                "cannot make the request".to_owned(),
            )
        } else {
            // The connection closed or broke before the answer was whole.
            (
                ErrorKind::Unavailable,
                format!("the connection to {host} broke"),
            )
        };
        Failure {
            kind,
            why,
            source: Some(e),
        }
    }

    fn into_error(self, doing: &str, retries: u32) -> StoreError {
        let after = if retries > 0 {
            format!(" (still after {retries} retries)")
        } else {
            String::new()
        };
        let e = StoreError::new(self.kind, format!("{doing}: {}{after}", self.why));
        match self.source {
            Some(s) => e.with_source(s),
            None => e,
        }
    }
}

/// Runs `op` until it succeeds, fails for good, or `policy` and [`RETRY_TOTAL`] are spent;
/// the error says what was being done (`doing`).
async fn retrying<T, F, Fut>(policy: RetryPolicy, doing: &str, mut op: F) -> StoreResult<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Failure>>,
{
    let began = Instant::now();
    let mut attempt = 1;
    loop {
        match op().await {
            Ok(v) => return Ok(v),
            Err(f)
                if f.kind.is_retryable()
                    && policy.allows_another(attempt)
                    && began.elapsed() < RETRY_TOTAL =>
            {
                tracing::debug!(attempt, why = %f.why, "{doing}: retrying");
                tokio::time::sleep(policy.backoff(attempt)).await;
                attempt += 1;
            }
            Err(f) => return Err(f.into_error(doing, attempt - 1)),
        }
    }
}

/// Reads the body of `resp`: exactly `len` bytes, never holding more (a server that sends
/// more is refused as soon as it does).
async fn read_body(url: &Url, mut resp: Response, len: usize) -> Result<Bytes, Failure> {
    let mut buf = BytesMut::with_capacity(len);
    while let Some(piece) = resp.chunk().await.map_err(|e| Failure::transport(url, e))? {
        if piece.len() > len - buf.len() {
            return Err(Refusal {
                kind: ErrorKind::Corrupt,
                why: format!("the server sent more than the {len} bytes asked for"),
            }
            .into());
        }
        buf.extend_from_slice(&piece);
    }
    if buf.len() != len {
        return Err(Refusal {
            kind: ErrorKind::Unavailable,
            why: format!("the answer ended after {} of {len} bytes", buf.len()),
        }
        .into());
    }
    Ok(buf.freeze())
}

/// One probe: `GET` of byte 0.
async fn probe(client: &reqwest::Client, url: &Url) -> Result<answer::Probe, Failure> {
    let resp = client
        .get(url.clone())
        .header(RANGE, "bytes=0-0")
        .send()
        .await
        .map_err(|e| Failure::transport(url, e))?;
    let found = answer::judge_probe(resp.status(), resp.headers())?;
    if found.ranges {
        read_body(url, resp, 1).await?;
    }
    // Otherwise the body (the whole file) is dropped unread, with its connection.
    Ok(found)
}

impl HttpStore {
    /// Opens the file at `opts.location`: one request finds its size (the region's size) and
    /// its version. A file that is missing, empty, refused or larger than one chunk on a
    /// server that ignores `Range`, and a `size=` that is not the file's, fail here with the
    /// reason.
    pub async fn open(opts: HttpOptions) -> StoreResult<HttpStore> {
        let loc = &opts.location;
        let url = loc.url.clone();
        let connections = loc.connections.unwrap_or(DEFAULT_CONNECTIONS);
        let retries = loc.retries.unwrap_or(DEFAULT_RETRIES);
        let client = client::build(connections, loc.timeout.unwrap_or(DEFAULT_TIMEOUT))?;
        let doing = format!("opening {url}");
        let found = retrying(policy(retries.min(OPEN_RETRIES)), &doing, || {
            probe(&client, &url)
        })
        .await?;
        let chunk = opts.chunk_size.unwrap_or(farmap_core::DEFAULT_CHUNK_SIZE);
        let size = found.size;
        if let Some(asked) = opts.size.filter(|s| *s != size) {
            return Err(StoreError::invalid(format!(
                "{doing}: the file is {size} bytes ({}) on the server, but the spec says \
                 size={}; leave size= out to use the file as it is",
                farmap_core::format_size(size),
                farmap_core::format_size(asked)
            )));
        }
        if !found.ranges && size > u64::from(chunk) {
            return Err(StoreError::new(
                ErrorKind::Unsupported,
                format!(
                    "{doing}: the server ignores Range requests (it answered 200 with the \
                     whole file, {size} bytes); farmap reads a file over HTTP only from a \
                     server that honours Range, or a file of one chunk"
                ),
            ));
        }
        let geometry = Geometry::new_bounded(size, u64::from(chunk)).map_err(|e| {
            StoreError::invalid(format!(
                "{doing}: a file of {size} bytes cannot be a region in chunks of {chunk} bytes"
            ))
            .with_source(e)
        })?;
        if found.validator == Validator::None {
            tracing::warn!(
                %url,
                "the server sends neither a strong ETag nor Last-Modified: a change of the file \
                 on the server cannot be detected, only a change of its size"
            );
        }
        let store = HttpStore {
            url,
            client,
            geometry,
            validator: found.validator,
            limit: Semaphore::new(connections),
            policy: policy(retries),
        };
        tracing::debug!(store = ?store, "opened an HTTP file");
        Ok(store)
    }

    /// The file's URL.
    pub fn url(&self) -> &Url {
        &self.url
    }

    /// One attempt at `asked`.
    async fn get_once(&self, asked: Asked) -> Result<Bytes, Failure> {
        let _permit = self.limit.acquire().await.map_err(|_| Failure {
            kind: ErrorKind::Closed,
            why: "the store is closed".to_owned(),
            source: None,
        })?;
        let mut req = self
            .client
            .get(self.url.clone())
            .header(RANGE, asked.range_header());
        if let Some((name, value)) = self.validator.condition() {
            req = req.header(name, value);
        }
        let resp = req
            .send()
            .await
            .map_err(|e| Failure::transport(&self.url, e))?;
        answer::judge_read(asked, &self.validator, resp.status(), resp.headers())?;
        // `len` is at most a chunk (4 MiB): it fits.
        read_body(&self.url, resp, asked.len as usize).await
    }

    /// Reads `len` bytes at byte `start` of the file (within it).
    async fn get(&self, start: u64, len: usize) -> StoreResult<Bytes> {
        if len == 0 {
            return Ok(Bytes::new());
        }
        let asked = Asked {
            start,
            len: len as u64,
            size: self.geometry.size(),
        };
        let doing = format!(
            "reading bytes {start}..{} of {}",
            start + len as u64,
            self.url
        );
        retrying(self.policy, &doing, || self.get_once(asked)).await
    }

    fn read_only(&self, what: &str) -> StoreError {
        StoreError::new(
            ErrorKind::ReadOnly,
            format!(
                "cannot {what} {}: an HTTP store is read-only (farmap reads it with range \
                 requests and never writes it)",
                self.url
            ),
        )
    }
}

impl Store for HttpStore {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn caps(&self) -> Caps {
        Caps::PARALLEL
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            let g = self.geometry;
            g.check_idx(idx)?;
            self.get(g.offset_of(idx), g.chunk_len(idx)).await
        })
    }

    fn read_part(
        &self,
        idx: ChunkIdx,
        offset: usize,
        len: usize,
    ) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            let g = self.geometry;
            g.check_idx(idx)?;
            let range = farmap_core::part_range(idx, g.chunk_len(idx), offset, len)?;
            self.get(g.offset_of(idx) + range.start as u64, range.len())
                .await
        })
    }

    fn write(&self, idx: ChunkIdx, _data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move { Err(self.read_only(&format!("write {idx} of"))) })
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async { Ok(()) })
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            Err(self.read_only(&format!(
                "trim chunks {}..{} of",
                range.start.0, range.end.0
            )))
        })
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        Box::pin(async move {
            self.geometry.check_idx(idx)?;
            // Every byte of the file is there; whether it is zero only a read tells.
            Ok(ChunkStatus::Data)
        })
    }
}
