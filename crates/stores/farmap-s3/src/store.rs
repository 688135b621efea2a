//! [`S3Store`]: one object per chunk.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use farmap_core::{
    zero_chunk, BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, Store,
    StoreError, StoreResult,
};
use futures::stream::{self, StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path;
use object_store::{
    BackoffConfig, GetOptions, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload,
    RetryConfig,
};
use tokio::sync::Semaphore;

use crate::config::{self, Resolved};
use crate::errors::{Describe, Failure};
use crate::http::Connector;
use crate::meta::{self, MAX_META_LEN, META_NAME};
use crate::S3Location;

/// Requests in flight at once (and idle connections kept) when `connections=` is not given.
pub const DEFAULT_CONNECTIONS: usize = 64;
/// Retries of one request when `retries=` is not given.
pub const DEFAULT_RETRIES: u32 = 10;
/// Deadline of one HTTP request when `timeout=` is not given.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest one request is retried for, whatever `retries=` says.
pub const RETRY_TOTAL: Duration = Duration::from_secs(60);
/// Deadline of a TCP (and TLS) connect.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Retries of the first request of [`S3Store::open`], so that a wrong endpoint is reported in
/// a fraction of a second rather than after the whole backoff.
const OPEN_RETRIES: u32 = 2;
/// Most keys in one `DeleteObjects` request (the S3 limit).
const DELETE_BATCH: usize = 1000;
/// A trim of at most this many chunks deletes their keys directly; a larger one lists the
/// objects present first (a whole 1 TiB region is 16 million keys, mostly absent).
const TRIM_BY_KEYS: u64 = 4 * DELETE_BATCH as u64;

/// The backoff between retries: 50 ms, doubling, at most 2 s (with jitter), for at most
/// `retries` retries and [`RETRY_TOTAL`].
fn retry_config(retries: u32) -> RetryConfig {
    RetryConfig {
        backoff: BackoffConfig {
            init_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(2),
            base: 2.0,
        },
        max_retries: retries as usize,
        retry_timeout: RETRY_TOTAL,
    }
}

/// How to open an [`S3Store`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Options {
    /// Bucket, prefix and how to reach them.
    pub location: S3Location,
    /// Region size: required to create a region; checked against the stored description
    /// otherwise.
    pub size: Option<u64>,
    /// Chunk size: used when creating a region (default
    /// [`DEFAULT_CHUNK_SIZE`](farmap_core::DEFAULT_CHUNK_SIZE)); checked otherwise.
    pub chunk_size: Option<u32>,
    /// Refuse writes and trims, and never create the description.
    pub read_only: bool,
}

/// A region in an S3 bucket: chunk `i` is the object `<prefix>/<i as 12 decimal digits>`
/// (`vm/000000000042`), the geometry is in `<prefix>/farmap-meta`. See the
/// [crate docs](crate) for the whole contract.
pub struct S3Store {
    geometry: Geometry,
    read_only: bool,
    client: AmazonS3,
    /// `prefix/` or empty.
    key_base: String,
    /// Requests in flight.
    limit: Semaphore,
    describe: Describe,
}

impl fmt::Debug for S3Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Store")
            .field("location", &self.describe.location)
            .field("endpoint", &self.describe.endpoint)
            .field("geometry", &self.geometry)
            .field("read_only", &self.read_only)
            .finish_non_exhaustive()
    }
}

/// The S3 client for `resolved`, retrying each request up to `retries` times.
fn build_client(
    loc: &S3Location,
    resolved: &Resolved,
    retries: u32,
    connections: usize,
    timeout: Duration,
) -> StoreResult<AmazonS3> {
    let c = &resolved.credentials;
    let mut b = AmazonS3Builder::new()
        .with_bucket_name(&loc.bucket)
        .with_region(&resolved.region)
        .with_access_key_id(&c.key_id)
        .with_secret_access_key(&c.secret)
        .with_retry(retry_config(retries))
        .with_http_connector(Connector {
            pool: connections,
            timeout,
            connect_timeout: CONNECT_TIMEOUT,
        });
    if let Some(token) = &c.token {
        b = b.with_token(token);
    }
    if let Some(e) = &resolved.endpoint {
        b = b.with_endpoint(e).with_allow_http(e.starts_with("http://"));
    }
    b.build().map_err(|e| {
        StoreError::new(
            ErrorKind::InvalidInput,
            format!("cannot set up the S3 client for {loc}"),
        )
        .with_source(e)
    })
}

/// A client for `loc`, with what describes it in errors.
pub(crate) struct Connection {
    pub resolved: Resolved,
    pub client: AmazonS3,
    pub describe: Describe,
    pub retries: u32,
    pub connections: usize,
    pub timeout: Duration,
}

/// Resolves `loc`'s endpoint, region and credentials (through `env`) and builds its client.
pub(crate) fn connect(
    loc: &S3Location,
    env: &(dyn Fn(&str) -> Option<String> + Sync),
) -> StoreResult<Connection> {
    let resolved = config::resolve(loc, env)?;
    let connections = loc.connections.unwrap_or(DEFAULT_CONNECTIONS);
    let retries = loc.retries.unwrap_or(DEFAULT_RETRIES);
    let timeout = loc.timeout.unwrap_or(DEFAULT_TIMEOUT);
    let describe = Describe {
        location: loc.to_string(),
        bucket: loc.bucket.clone(),
        endpoint: match &resolved.endpoint {
            Some(e) => e.clone(),
            None => format!("AWS S3 ({})", resolved.region),
        },
        key_id: resolved.credentials.key_id.clone(),
        key_from: resolved.credentials_from.clone(),
        retries,
    };
    let client = build_client(loc, &resolved, retries, connections, timeout)?;
    Ok(Connection {
        resolved,
        client,
        describe,
        retries,
        connections,
        timeout,
    })
}

impl S3Store {
    /// Opens the region at `opts.location`, taking endpoint, region and credentials from the
    /// spec, the process environment and the AWS profile files (see [`crate::config`]).
    ///
    /// Reads `<prefix>/farmap-meta`: if it exists, its geometry is the region's (a `size=` or
    /// `chunk=` that differs is an error); if not, the region is created with `size=` (an
    /// error without one, or when read-only). A missing bucket, refused credentials or an
    /// unreachable endpoint fail here, with the reason.
    pub async fn open(opts: S3Options) -> StoreResult<S3Store> {
        Self::open_with_env(opts, &|k| std::env::var(k).ok()).await
    }

    /// [`S3Store::open`] reading the environment through `env` instead of the process's.
    pub async fn open_with_env(
        opts: S3Options,
        env: &(dyn Fn(&str) -> Option<String> + Sync),
    ) -> StoreResult<S3Store> {
        let loc = &opts.location;
        let conn = connect(loc, env)?;
        let key_base = if loc.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", loc.prefix)
        };
        let mut store = S3Store {
            // Replaced below by the stored or created geometry.
            geometry: Geometry::new(4096, 4096).expect("a valid placeholder"),
            read_only: opts.read_only,
            client: conn.client,
            key_base,
            limit: Semaphore::new(conn.connections),
            describe: conn.describe,
        };
        // The first request with few retries: a wrong endpoint fails fast.
        let retries = conn.retries.min(OPEN_RETRIES);
        let probe = build_client(loc, &conn.resolved, retries, 1, conn.timeout)?;
        store.geometry = store.open_meta(&probe, &opts).await?;
        tracing::debug!(store = ?store, "opened an S3 region");
        Ok(store)
    }

    /// Reads (or creates) the region description and returns the region's geometry.
    async fn open_meta(&self, probe: &AmazonS3, opts: &S3Options) -> StoreResult<Geometry> {
        let path = Path::from(self.meta_key());
        let location = &self.describe.location;
        for _attempt in 0..2 {
            match self.read_meta(probe, &path).await? {
                Some(g) => {
                    let mismatch = |what: &str, asked: String, stored: String| {
                        StoreError::new(
                            ErrorKind::InvalidInput,
                            format!(
                                "{location} holds a region of {} in chunks of {} (its {META_NAME} \
                                 says so), but the spec asks for {what} {asked} (stored: {stored}); \
                                 leave {what}= out to use the region as it is",
                                farmap_core::format_size(g.size()),
                                farmap_core::format_size(u64::from(g.chunk_size())),
                            ),
                        )
                    };
                    if let Some(size) = opts.size.filter(|s| *s != g.size()) {
                        return Err(mismatch(
                            "size",
                            farmap_core::format_size(size),
                            farmap_core::format_size(g.size()),
                        ));
                    }
                    if let Some(chunk) = opts.chunk_size.filter(|c| *c != g.chunk_size()) {
                        return Err(mismatch(
                            "chunk",
                            farmap_core::format_size(u64::from(chunk)),
                            farmap_core::format_size(u64::from(g.chunk_size())),
                        ));
                    }
                    return Ok(g);
                }
                None if opts.read_only => {
                    return Err(StoreError::new(
                        ErrorKind::NotFound,
                        format!(
                            "no farmap region at {location} (no object {}), and a read-only \
                             store does not create one",
                            self.meta_key()
                        ),
                    ))
                }
                None => {
                    let Some(size) = opts.size else {
                        return Err(StoreError::new(
                            ErrorKind::NotFound,
                            format!(
                                "no farmap region at {location} yet (no object {}): give size= \
                                 to create one",
                                self.meta_key()
                            ),
                        ));
                    };
                    let chunk = opts.chunk_size.unwrap_or(farmap_core::DEFAULT_CHUNK_SIZE);
                    let g = Geometry::new_bounded(size, u64::from(chunk)).map_err(|e| {
                        StoreError::invalid(format!("cannot create a region at {location}: {e}"))
                    })?;
                    let put = PutOptions {
                        mode: PutMode::Create,
                        ..PutOptions::default()
                    };
                    let body = PutPayload::from(meta::encode(g));
                    match probe.put_opts(&path, body.clone(), put).await {
                        Ok(_) => {
                            tracing::info!(%location, size, chunk, "created an S3 region");
                            return Ok(g);
                        }
                        // Another process created it meanwhile: read theirs and check it.
                        Err(object_store::Error::AlreadyExists { .. }) => continue,
                        // A server without conditional PUT: a plain one.
                        Err(object_store::Error::NotImplemented { .. }) => {
                            probe
                                .put(&path, body)
                                .await
                                .map_err(|e| self.describe.error("creating the region", e))?;
                            return Ok(g);
                        }
                        Err(e) => return Err(self.describe.error("creating the region", e)),
                    }
                }
            }
        }
        Err(StoreError::new(
            ErrorKind::Unavailable,
            format!(
                "{location}: {} was created by someone else but cannot be read back",
                self.meta_key()
            ),
        ))
    }

    /// The stored geometry, or `None` when there is no description object.
    async fn read_meta(&self, client: &AmazonS3, path: &Path) -> StoreResult<Option<Geometry>> {
        let doing = "reading the region description";
        let got = match client.get_opts(path, GetOptions::default()).await {
            Ok(got) => got,
            Err(e) if Failure::of(&e).is_missing_object() => return Ok(None),
            Err(e) => return Err(self.describe.error(doing, e)),
        };
        let corrupt = |why: String| {
            StoreError::new(
                ErrorKind::Corrupt,
                format!(
                    "{} is not a farmap region description: {why}",
                    self.object_url(path.as_ref())
                ),
            )
        };
        if got.meta.size > MAX_META_LEN {
            return Err(corrupt(format!(
                "it is {} bytes long (a description is under {MAX_META_LEN})",
                got.meta.size
            )));
        }
        let bytes = got
            .bytes()
            .await
            .map_err(|e| self.describe.error(doing, e))?;
        meta::decode(&bytes).map(Some).map_err(corrupt)
    }

    /// `s3://bucket/key`.
    fn object_url(&self, key: &str) -> String {
        format!("s3://{}/{key}", self.describe.bucket)
    }

    /// The key of chunk `idx`: the prefix, `/`, and the index as 12 decimal digits, so that
    /// keys list in chunk order.
    pub fn chunk_key(&self, idx: ChunkIdx) -> String {
        format!("{}{:012}", self.key_base, idx.0)
    }

    /// The key of the region description.
    pub fn meta_key(&self) -> String {
        format!("{}{META_NAME}", self.key_base)
    }

    /// The chunk a key names, if it is a chunk key of this region.
    fn chunk_of_key(&self, key: &str) -> Option<ChunkIdx> {
        let digits = key.strip_prefix(&self.key_base)?;
        if digits.len() != 12 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        digits.parse().ok().map(ChunkIdx)
    }

    /// Where the region is: `s3://bucket/prefix`.
    pub fn location(&self) -> &str {
        &self.describe.location
    }

    /// The server: its URL, or `AWS S3 (region)`.
    pub fn endpoint(&self) -> &str {
        &self.describe.endpoint
    }

    async fn permit(&self) -> StoreResult<tokio::sync::SemaphorePermit<'_>> {
        self.limit
            .acquire()
            .await
            .map_err(|_| StoreError::new(ErrorKind::Closed, "the S3 store is closed"))
    }

    fn check_writable(&self, what: &str) -> StoreResult<()> {
        if self.read_only {
            Err(StoreError::new(
                ErrorKind::ReadOnly,
                format!("{what} {}: opened read-only", self.describe.location),
            ))
        } else {
            Ok(())
        }
    }

    fn wrong_size(&self, key: &str, idx: ChunkIdx, got: u64) -> StoreError {
        StoreError::new(
            ErrorKind::Corrupt,
            format!(
                "object {} is {got} bytes but {idx} of the region is {} bytes: refusing it",
                self.object_url(key),
                self.geometry.chunk_len(idx)
            ),
        )
    }

    async fn read_chunk(&self, idx: ChunkIdx) -> StoreResult<Bytes> {
        self.geometry.check_idx(idx)?;
        let want = self.geometry.chunk_len(idx);
        let key = self.chunk_key(idx);
        let doing = || format!("reading {idx} (object {key})");
        let _permit = self.permit().await?;
        let got = match self
            .client
            .get_opts(&Path::from(key.as_str()), GetOptions::default())
            .await
        {
            Ok(got) => got,
            Err(e) if Failure::of(&e).is_missing_object() => return Ok(zero_chunk(want)),
            Err(e) => return Err(self.describe.error(&doing(), e)),
        };
        // Checked before the body is read: a wrong object is never downloaded whole.
        if got.meta.size != want as u64 {
            return Err(self.wrong_size(&key, idx, got.meta.size));
        }
        let data = got
            .bytes()
            .await
            .map_err(|e| self.describe.error(&doing(), e))?;
        if data.len() != want {
            return Err(self.wrong_size(&key, idx, data.len() as u64));
        }
        Ok(data)
    }

    async fn write_chunk(&self, idx: ChunkIdx, data: Bytes) -> StoreResult<()> {
        self.check_writable("writing to")?;
        self.geometry.check_write(idx, data.len())?;
        let key = self.chunk_key(idx);
        let _permit = self.permit().await?;
        self.client
            .put(&Path::from(key.as_str()), PutPayload::from(data))
            .await
            .map_err(|e| {
                self.describe
                    .error(&format!("writing {idx} (object {key})"), e)
            })?;
        Ok(())
    }

    async fn chunk_status(&self, idx: ChunkIdx) -> StoreResult<ChunkStatus> {
        self.geometry.check_idx(idx)?;
        let key = self.chunk_key(idx);
        let _permit = self.permit().await?;
        match self.client.head(&Path::from(key.as_str())).await {
            Ok(m) if m.size == self.geometry.chunk_len(idx) as u64 => Ok(ChunkStatus::Data),
            Ok(m) => Err(self.wrong_size(&key, idx, m.size)),
            Err(e) if Failure::of(&e).is_missing_object() => Ok(ChunkStatus::Zero),
            Err(e) => Err(self
                .describe
                .error(&format!("looking up {idx} (object {key})"), e)),
        }
    }

    /// Deletes `keys` in `DeleteObjects` batches of up to 1000 keys, a few batches at once.
    async fn delete_keys(&self, keys: Vec<String>, doing: &str) -> StoreResult<()> {
        if keys.is_empty() {
            return Ok(());
        }
        let _permit = self.permit().await?;
        let locations = stream::iter(keys.into_iter().map(|k| Ok(Path::from(k)))).boxed();
        self.client
            .delete_stream(locations)
            .try_for_each(|_| async { Ok(()) })
            .await
            .map_err(|e| self.describe.error(doing, e))
    }

    async fn trim_range(&self, range: ChunkRange) -> StoreResult<()> {
        self.check_writable("trimming")?;
        self.geometry.check_range(range)?;
        if range.is_empty() {
            return Ok(());
        }
        let doing = format!("trimming {range}");
        if range.len() <= TRIM_BY_KEYS {
            let keys = range.iter().map(|i| self.chunk_key(i)).collect();
            return self.delete_keys(keys, &doing).await;
        }
        // A large range: list the chunk objects from its start (keys list in chunk order)
        // and delete those inside it, a batch at a time.
        let last = self.chunk_key(ChunkIdx(range.end.0 - 1));
        let prefix = Path::from(self.key_base.trim_end_matches('/'));
        let prefix = (!self.key_base.is_empty()).then_some(&prefix);
        let listing = if range.start.0 == 0 {
            self.client.list(prefix)
        } else {
            let before = Path::from(self.chunk_key(ChunkIdx(range.start.0 - 1)));
            self.client.list_with_offset(prefix, &before)
        };
        let mut listing = std::pin::pin!(listing.try_take_while(|m| {
            let inside = m.location.as_ref() <= last.as_str();
            std::future::ready(Ok(inside))
        }));
        let mut batch = Vec::with_capacity(DELETE_BATCH);
        while let Some(m) = listing
            .try_next()
            .await
            .map_err(|e| self.describe.error(&doing, e))?
        {
            let key = m.location.as_ref();
            if self.chunk_of_key(key).is_some_and(|i| range.contains(i)) {
                batch.push(key.to_owned());
            }
            if batch.len() == DELETE_BATCH {
                self.delete_keys(std::mem::take(&mut batch), &doing).await?;
            }
        }
        self.delete_keys(batch, &doing).await
    }
}

impl Store for S3Store {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    /// Write, flush (a PUT is durable once S3 acknowledges it), trim (deletes the objects),
    /// status (a HEAD request) and parallel requests; no write or trim when read-only.
    fn caps(&self) -> Caps {
        let all = Caps::WRITE | Caps::FLUSH | Caps::TRIM | Caps::STATUS | Caps::PARALLEL;
        if self.read_only {
            all.without(Caps::WRITE | Caps::TRIM)
        } else {
            all
        }
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(self.read_chunk(idx))
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(self.write_chunk(idx, data))
    }

    /// Nothing to do: every write returned only once S3 acknowledged its PUT, and S3 (like
    /// MinIO) acknowledges a PUT once the object is stored durably.
    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async { Ok(()) })
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(self.trim_range(range))
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        Box::pin(self.chunk_status(idx))
    }
}
