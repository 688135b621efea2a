//! [`RedisStore`]: one key per chunk on a Redis server or a Redis Cluster.

use std::future::Future;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use farmap_core::{
    zero_chunk, BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, Store,
    StoreError, StoreResult,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
use redis::{Cmd, FromRedisValue, IntoConnectionInfo, RedisConnectionInfo, RedisError, Value};

use crate::config::{FlushPolicy, RedisConfig, Target};
use crate::meta;

/// Keys per `UNLINK` when a range is trimmed.
const TRIM_BATCH: usize = 1024;

/// The connections of a store: a pool of multiplexed connections to one server, or of
/// cluster connections (each multiplexed to every node).
enum Pool {
    Single(Vec<ConnectionManager>),
    Cluster(Vec<ClusterConnection>),
}

/// A region kept in Redis: chunk `i` is the key `<prefix>:<i>` holding exactly the chunk's
/// bytes; a missing key reads as zeros; `<prefix>:meta` records the geometry.
///
/// # Concurrency
/// - Every method takes `&self`; requests from any number of tasks go out on a pool of
///   multiplexed connections (round robin), each of which pipelines the requests in flight
///   on it: N concurrent reads cost about one round trip, not N.
/// - A write is one `SET` and a read one `GET`: Redis runs each atomically, so a concurrent
///   read of a chunk sees the old or the new value whole.
/// - Two writes of the same chunk from different tasks may go out on different connections;
///   the one the server runs last wins (as with any store, callers order their own writes).
///
/// # Errors
/// A value of the wrong length (or type) is refused as [`ErrorKind::Corrupt`] naming its
/// key, never served. A lost connection is [`ErrorKind::Unavailable`] (the pool reconnects
/// in the background for single servers; the cluster client follows `MOVED`/`ASK` and
/// refreshes its slot map), a request that gets no answer within the timeout is
/// [`ErrorKind::Timeout`], refused credentials are [`ErrorKind::PermissionDenied`].
pub struct RedisStore {
    geometry: Geometry,
    caps: Caps,
    pool: Pool,
    next: AtomicUsize,
    prefix: String,
    flush: FlushPolicy,
    timeout: Duration,
    server: String,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("server", &self.server)
            .field("prefix", &self.prefix)
            .field("geometry", &self.geometry)
            .field("flush", &self.flush)
            .finish_non_exhaustive()
    }
}

/// The store kind that best describes a Redis client error.
fn kind_of(e: &RedisError) -> ErrorKind {
    use redis::{ErrorKind as K, ServerErrorKind as S};
    let code = e.code().unwrap_or("");
    if e.is_timeout() {
        ErrorKind::Timeout
    } else if matches!(e.kind(), K::AuthenticationFailed | K::Server(S::NoPerm))
        || matches!(code, "NOAUTH" | "WRONGPASS" | "NOPERM")
    {
        ErrorKind::PermissionDenied
    } else if e.is_connection_refusal()
        || e.is_connection_dropped()
        || e.is_io_error()
        || matches!(
            e.kind(),
            // A cluster client that lost a node's connection reports a client error, or the
            // MOVED/ASK redirection it could not follow (the slot's owner is the lost node,
            // which the other nodes still name): either way the key's node is unavailable.
            K::ClusterConnectionNotFound
                | K::Io
                | K::Client
                | K::Server(
                    S::ClusterDown
                        | S::MasterDown
                        | S::TryAgain
                        | S::BusyLoading
                        | S::Moved
                        | S::Ask
                )
        )
    {
        ErrorKind::Unavailable
    } else if matches!(code, "WRONGTYPE") {
        ErrorKind::Corrupt
    } else {
        ErrorKind::Io
    }
}

fn open_err(server: &str, what: &str, e: RedisError) -> StoreError {
    let kind = kind_of(&e);
    let mut text = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        text.push_str(&s.to_string());
        source = s.source();
    }
    if text.contains("certificate") || text.contains("UnknownIssuer") {
        return StoreError::new(
            ErrorKind::PermissionDenied,
            format!(
                "{what} {server}: its TLS certificate is not trusted (check that ca= names the \
                 PEM file of the CA that signed it, and that it names this host)"
            ),
        )
        .with_source(e);
    }
    let why = match kind {
        ErrorKind::PermissionDenied => " (the user name or password was refused)",
        ErrorKind::Unavailable => " (the server cannot be reached)",
        ErrorKind::Timeout => " (no answer in time)",
        _ => "",
    };
    StoreError::new(kind, format!("{what} {server}{why}")).with_source(e)
}

impl RedisStore {
    /// Connects to the server or cluster `config` names and opens the region at its prefix.
    ///
    /// A new region (no `<prefix>:meta` key) needs `size`; its geometry is recorded. An
    /// existing one takes its geometry from the record, and `size` or `chunk`, when given,
    /// must match it (a mismatch is an [`ErrorKind::InvalidInput`] error naming both).
    pub async fn open(
        config: &RedisConfig,
        size: Option<u64>,
        chunk: Option<u32>,
    ) -> StoreResult<RedisStore> {
        let server = config.server_name();
        let timeout = config.timeout_or_default();
        let n = config.connections_or_default();
        let deadline = |what: &'static str| {
            let server = server.clone();
            move |_| {
                StoreError::new(
                    ErrorKind::Timeout,
                    format!("{what} {server}: no answer within {timeout:?}"),
                )
            }
        };
        let pool = tokio::time::timeout(timeout, connect(config, n, timeout, &server))
            .await
            .map_err(deadline("connecting to"))??;
        let mut store = RedisStore {
            // Replaced below once the record is read.
            geometry: Geometry::new(4096, 4096).expect("valid"),
            caps: Caps::WRITE | Caps::TRIM | Caps::STATUS | Caps::PARALLEL,
            pool,
            next: AtomicUsize::new(0),
            prefix: config.prefix.clone(),
            flush: config.flush,
            timeout,
            server,
        };
        if config.flush != FlushPolicy::None {
            store.caps = store.caps | Caps::FLUSH;
        }
        if config.flush == FlushPolicy::Fsync {
            store.check_fsync().await?;
        }
        store.geometry = store.open_region(size, chunk).await?;
        tracing::debug!(server = %store.server, prefix = %store.prefix, geometry = %meta::describe(store.geometry), "opened a redis region");
        Ok(store)
    }

    /// The key of chunk `idx`.
    pub fn key(&self, idx: ChunkIdx) -> String {
        format!("{}:{}", self.prefix, idx.0)
    }

    /// The key holding the geometry record.
    pub fn meta_key(&self) -> String {
        format!("{}:meta", self.prefix)
    }

    /// The server's name as used in messages (`redis 127.0.0.1:6379/0`).
    pub fn server(&self) -> &str {
        &self.server
    }

    /// Runs one command on the next connection of the pool, within the timeout.
    async fn run<T: FromRedisValue>(&self, cmd: &Cmd) -> Result<T, RunError> {
        self.run_on(self.next.fetch_add(1, Ordering::Relaxed), cmd)
            .await
    }

    /// Connections in the pool.
    fn connections(&self) -> usize {
        match &self.pool {
            Pool::Single(v) => v.len(),
            Pool::Cluster(v) => v.len(),
        }
    }

    /// Runs one command on connection `i` (modulo the pool's size), within the timeout.
    async fn run_on<T: FromRedisValue>(&self, i: usize, cmd: &Cmd) -> Result<T, RunError> {
        let fut = async {
            match &self.pool {
                Pool::Single(v) => {
                    let mut c = v[i % v.len()].clone();
                    cmd.query_async::<T>(&mut c).await
                }
                Pool::Cluster(v) => {
                    let mut c = v[i % v.len()].clone();
                    cmd.query_async::<T>(&mut c).await
                }
            }
        };
        match tokio::time::timeout(self.timeout, fut).await {
            Ok(r) => r.map_err(RunError::Redis),
            Err(_) => Err(RunError::Deadline(self.timeout)),
        }
    }

    /// A store error for a failed `what` (e.g. "reading chunk 3 (key x:3)").
    fn err(&self, what: impl std::fmt::Display, e: RunError) -> StoreError {
        match e {
            RunError::Deadline(t) => StoreError::new(
                ErrorKind::Timeout,
                format!("{what} from {}: no answer within {t:?}", self.server),
            ),
            RunError::Redis(e) => {
                let kind = kind_of(&e);
                let why = match kind {
                    ErrorKind::Unavailable => {
                        " (unavailable: the server or the node holding the key cannot be reached)"
                    }
                    ErrorKind::Corrupt => " (the key holds a value of another type)",
                    _ => "",
                };
                StoreError::new(kind, format!("{what} on {}{why}", self.server)).with_source(e)
            }
        }
    }

    async fn open_region(&self, size: Option<u64>, chunk: Option<u32>) -> StoreResult<Geometry> {
        let key = self.meta_key();
        let read = || async {
            self.run::<Option<Vec<u8>>>(redis::cmd("GET").arg(&key))
                .await
                .map_err(|e| self.err(format_args!("reading the region record {key}"), e))
        };
        let check = |raw: Vec<u8>| -> StoreResult<Geometry> {
            let g = meta::decode(&raw).map_err(|why| {
                StoreError::new(
                    ErrorKind::Corrupt,
                    format!(
                        "key {key} on {} is not a farmap region record: {why}",
                        self.server
                    ),
                )
            })?;
            let size_ok = size.is_none_or(|s| s == g.size());
            let chunk_ok = chunk.is_none_or(|c| c == g.chunk_size());
            if !(size_ok && chunk_ok) {
                let asked = match (size, chunk) {
                    (Some(s), Some(c)) => {
                        meta::describe(Geometry::new(s, u64::from(c)).unwrap_or(g))
                    }
                    (Some(s), None) => format!("size {}", farmap_core::format_size(s)),
                    (None, Some(c)) => format!("chunk {}", farmap_core::format_size(u64::from(c))),
                    (None, None) => unreachable!("nothing asked cannot mismatch"),
                };
                return Err(StoreError::invalid(format!(
                    "the region at {key} on {} is {}, but the spec asks for {asked} (drop size=/chunk= to use the region as it is, or choose another prefix=)",
                    self.server,
                    meta::describe(g)
                )));
            }
            Ok(g)
        };
        if let Some(raw) = read().await? {
            return check(raw);
        }
        let Some(size) = size else {
            return Err(StoreError::new(
                ErrorKind::NotFound,
                format!(
                    "no farmap region at prefix {:?} on {} (no key {key}); give size= to create one",
                    self.prefix, self.server
                ),
            ));
        };
        let chunk = chunk.unwrap_or(farmap_core::DEFAULT_CHUNK_SIZE);
        let g = Geometry::new_bounded(size, u64::from(chunk))
            .map_err(|e| StoreError::invalid(format!("cannot create a region at {key}: {e}")))?;
        // SET NX: of two openers creating the same region at once, one record wins and the
        // other is checked against it.
        let created: Option<String> = self
            .run(redis::cmd("SET").arg(&key).arg(meta::encode(g)).arg("NX"))
            .await
            .map_err(|e| self.err(format_args!("writing the region record {key}"), e))?;
        if created.is_some() {
            tracing::info!(key = %key, server = %self.server, geometry = %meta::describe(g), "created a redis region");
            return Ok(g);
        }
        match read().await? {
            Some(raw) => check(raw),
            None => Err(StoreError::new(
                ErrorKind::Io,
                format!(
                    "the region record {key} on {} vanished while it was created",
                    self.server
                ),
            )),
        }
    }

    async fn check_fsync(&self) -> StoreResult<()> {
        let mut words = Vec::new();
        for param in ["appendonly", "appendfsync"] {
            let mut cmd = redis::cmd("CONFIG");
            cmd.arg("GET").arg(param);
            let value: Value = match &self.pool {
                Pool::Single(_) => self.run(&cmd).await,
                Pool::Cluster(v) => {
                    let mut c = v[0].clone();
                    let routing =
                        RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                    match tokio::time::timeout(self.timeout, c.route_command(cmd, routing)).await {
                        Ok(r) => r.map_err(RunError::Redis),
                        Err(_) => Err(RunError::Deadline(self.timeout)),
                    }
                }
            }
            .map_err(|e| {
                self.err(
                    "checking the server's persistence (CONFIG GET) for flush=fsync",
                    e,
                )
            })?;
            flatten(&value, &mut words);
        }
        let after = |name: &str| -> Vec<&str> {
            words
                .windows(2)
                .filter(|w| w[0].eq_ignore_ascii_case(name))
                .map(|w| w[1].as_str())
                .collect()
        };
        let (on, sync) = (after("appendonly"), after("appendfsync"));
        let good = !on.is_empty()
            && !sync.is_empty()
            && on.iter().all(|v| *v == "yes")
            && sync.iter().all(|v| *v == "always");
        if good {
            Ok(())
        } else {
            Err(StoreError::new(
                ErrorKind::Unsupported,
                format!(
                    "flush=fsync needs {} to run with appendonly yes and appendfsync always, but it has appendonly {on:?}, appendfsync {sync:?}",
                    self.server
                ),
            ))
        }
    }
}

/// Every string in a reply, depth first (a cluster's per-node replies included).
fn flatten(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::BulkString(b) => out.push(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => out.push(s.clone()),
        Value::Array(items) | Value::Set(items) => items.iter().for_each(|i| flatten(i, out)),
        Value::Map(pairs) => pairs.iter().for_each(|(k, v)| {
            flatten(k, out);
            flatten(v, out);
        }),
        _ => {}
    }
}

enum RunError {
    Redis(RedisError),
    Deadline(Duration),
}

async fn connect(
    config: &RedisConfig,
    n: usize,
    timeout: Duration,
    server: &str,
) -> StoreResult<Pool> {
    let mut redis_info = RedisConnectionInfo::default();
    if let Some(u) = &config.user {
        redis_info = redis_info.set_username(u);
    }
    if let Some(p) = &config.password {
        redis_info = redis_info.set_password(p);
    }
    match &config.target {
        Target::Single { addr, db, tls } => {
            let url = match tls {
                Some(_) => format!("rediss://{addr}"),
                None => format!("redis://{addr}"),
            };
            let info = url
                .as_str()
                .into_connection_info()
                .map_err(|e| open_err(server, "cannot address", e))?
                .set_redis_settings(redis_info.set_db(i64::from(*db)));
            let client = match tls {
                Some(ca) => redis::Client::build_with_tls(info, certificates(ca.as_deref())?),
                None => redis::Client::open(info),
            }
            .map_err(|e| open_err(server, "cannot set up a client for", e))?;
            let cfg = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(timeout))
                .set_response_timeout(Some(timeout))
                .set_number_of_retries(1)
                .set_min_delay(Duration::from_millis(50));
            let first = ConnectionManager::new_with_config(client.clone(), cfg.clone())
                .await
                .map_err(|e| connect_err(server, e))?;
            let mut conns = vec![first];
            for _ in 1..n {
                conns.push(
                    ConnectionManager::new_with_config(client.clone(), cfg.clone())
                        .await
                        .map_err(|e| connect_err(server, e))?,
                );
            }
            Ok(Pool::Single(conns))
        }
        Target::Cluster { nodes } => {
            let urls: Vec<String> = nodes.iter().map(|n| format!("redis://{n}")).collect();
            let mut b = ClusterClientBuilder::new(urls)
                .connection_timeout(timeout)
                .response_timeout(timeout)
                .retries(2);
            if let Some(u) = &config.user {
                b = b.username(u);
            }
            if let Some(p) = &config.password {
                b = b.password(p);
            }
            let client = b
                .build()
                .map_err(|e| open_err(server, "cannot set up a client for", e))?;
            let mut conns = Vec::with_capacity(n);
            for _ in 0..n {
                conns.push(
                    client
                        .get_async_connection()
                        .await
                        .map_err(|e| connect_err(server, e))?,
                );
            }
            Ok(Pool::Cluster(conns))
        }
    }
}

fn connect_err(server: &str, e: RedisError) -> StoreError {
    // A wrong database number is refused by SELECT: say so rather than "i/o error".
    if e.to_string().contains("DB index is out of range") {
        return StoreError::new(
            ErrorKind::NotFound,
            format!("cannot connect to {server}: the server has no such database (see its `databases` setting)"),
        )
        .with_source(e);
    }
    open_err(server, "cannot connect to", e)
}

fn certificates(ca: Option<&Path>) -> StoreResult<redis::TlsCertificates> {
    // The redis client builds its TLS config with the process's default crypto provider;
    // with both of rustls's providers compiled in (other dependencies enable aws-lc-rs),
    // rustls cannot pick one and panics. Install ring, as the rest of farmap uses, unless
    // the application installed one already (then this does nothing).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let root_cert =
        match ca {
            Some(path) => Some(std::fs::read(path).map_err(|e| {
                StoreError::io(format!("reading the CA file {}", path.display()), e)
            })?),
            None => None,
        };
    Ok(redis::TlsCertificates {
        client_tls: None,
        root_cert,
    })
}

/// Runs `f` only after `idx` is checked.
fn checked<'a, T: Send + 'a>(
    check: StoreResult<()>,
    f: impl Future<Output = StoreResult<T>> + Send + 'a,
) -> BoxFuture<'a, StoreResult<T>> {
    Box::pin(async move {
        check?;
        f.await
    })
}

impl Store for RedisStore {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn caps(&self) -> Caps {
        self.caps
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        checked(self.geometry.check_idx(idx), async move {
            let key = self.key(idx);
            let len = self.geometry.chunk_len(idx);
            let value: Option<Bytes> = self
                .run(redis::cmd("GET").arg(&key))
                .await
                .map_err(|e| self.err(format_args!("reading {idx} (key {key})"), e))?;
            match value {
                None => Ok(zero_chunk(len)),
                Some(b) if b.len() == len => Ok(b),
                Some(b) => Err(StoreError::new(
                    ErrorKind::Corrupt,
                    format!(
                        "key {key} on {} holds {} bytes but {idx} is {len} bytes long; refusing to serve it",
                        self.server,
                        b.len()
                    ),
                )),
            }
        })
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        checked(self.geometry.check_write(idx, data.len()), async move {
            let key = self.key(idx);
            let () = self
                .run(redis::cmd("SET").arg(&key).arg(&data[..]))
                .await
                .map_err(|e| self.err(format_args!("writing {idx} (key {key})"), e))?;
            Ok(())
        })
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            let FlushPolicy::Wait { replicas } = self.flush else {
                return Ok(());
            };
            // The server gives up before the client would, so that its answer (how many
            // replicas acknowledged) arrives rather than a client-side timeout. Redis checks
            // a blocked client's timeout from its event loop, which may sleep until the next
            // cron tick (100 ms at the default hz 10): WAIT can answer that much late, so the
            // margin is at least 150 ms.
            let margin = (self.timeout / 4).max(Duration::from_millis(150));
            let wait = self.timeout.saturating_sub(margin);
            let ms = wait.as_millis().max(1) as u64;
            let mut cmd = redis::cmd("WAIT");
            cmd.arg(replicas).arg(ms);
            // WAIT covers the writes sent on the connection it is sent on: send it on every
            // connection of the pool, by index (the round-robin counter is shared with data
            // traffic, which would skip some), all at once.
            let waits = (0..self.connections()).map(|i| self.run_on::<u64>(i, &cmd));
            for acked in futures::future::join_all(waits).await {
                let acked = acked.map_err(|e| self.err("waiting for replicas (WAIT)", e))?;
                if acked < u64::from(replicas) {
                    return Err(StoreError::new(
                        ErrorKind::Timeout,
                        format!(
                            "flush on {}: {acked} of the {replicas} replicas asked for acknowledged the writes within {wait:?}",
                            self.server
                        ),
                    ));
                }
            }
            Ok(())
        })
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        checked(self.geometry.check_range(range), async move {
            let keys: Vec<String> = range.iter().map(|i| self.key(i)).collect();
            for batch in keys.chunks(TRIM_BATCH) {
                let _: u64 = self
                    .run(redis::cmd("UNLINK").arg(batch))
                    .await
                    .map_err(|e| self.err(format_args!("trimming {range}"), e))?;
            }
            Ok(())
        })
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        checked(self.geometry.check_idx(idx), async move {
            let key = self.key(idx);
            let n: u64 = self
                .run(redis::cmd("EXISTS").arg(&key))
                .await
                .map_err(|e| self.err(format_args!("asking for {idx} (key {key})"), e))?;
            Ok(ChunkStatus::data_if(n > 0))
        })
    }
}
