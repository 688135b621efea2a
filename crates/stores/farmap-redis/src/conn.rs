//! [`Conn`]: the connections to one Redis server or cluster, shared by
//! [`RedisStore`](crate::RedisStore) and [`RedisObjects`](crate::RedisObjects): the pool of
//! multiplexed connections, the deadline of each request, the flush policy (checked at open
//! for `flush=fsync`, carried out with `WAIT` for `flush=wait`) and errors that name the
//! server.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use farmap_core::{ErrorKind, StoreError, StoreResult};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
use redis::{Cmd, FromRedisValue, IntoConnectionInfo, RedisConnectionInfo, RedisError, Value};

use crate::config::{FlushPolicy, RedisConfig, Target};

/// The connections of a pool: a pool of multiplexed connections to one server, or of
/// cluster connections (each multiplexed to every node).
enum Pool {
    Single(Vec<ConnectionManager>),
    Cluster(Vec<ClusterConnection>),
}

/// An open pool of connections to the server or cluster a [`RedisConfig`] names.
pub(crate) struct Conn {
    pool: Pool,
    next: AtomicUsize,
    /// What a flush (and an object's create) promises.
    pub(crate) flush: FlushPolicy,
    timeout: Duration,
    /// The server's name for messages (`redis 127.0.0.1:6379/0`).
    pub(crate) server: String,
}

impl Conn {
    /// Connects to what `config` names, within its timeout, and for `flush=fsync` checks
    /// that the server (every primary of a cluster) fsyncs each write before acknowledging.
    pub(crate) async fn open(config: &RedisConfig) -> StoreResult<Conn> {
        let server = config.server_name();
        let timeout = config.timeout_or_default();
        let n = config.connections_or_default();
        let pool = tokio::time::timeout(timeout, connect(config, n, timeout, &server))
            .await
            .map_err(|_| {
                StoreError::new(
                    ErrorKind::Timeout,
                    format!("connecting to {server}: no answer within {timeout:?}"),
                )
            })??;
        let conn = Conn {
            pool,
            next: AtomicUsize::new(0),
            flush: config.flush,
            timeout,
            server,
        };
        if conn.flush == FlushPolicy::Fsync {
            conn.check_fsync().await?;
        }
        Ok(conn)
    }

    /// Whether this is a Redis Cluster (a script may then touch keys of one slot only).
    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self.pool, Pool::Cluster(_))
    }

    /// Connections in the pool.
    pub(crate) fn connections(&self) -> usize {
        match &self.pool {
            Pool::Single(v) => v.len(),
            Pool::Cluster(v) => v.len(),
        }
    }

    /// The index of the next connection, round robin.
    pub(crate) fn pick(&self) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// Runs one command on the next connection of the pool, within the timeout.
    pub(crate) async fn run<T: FromRedisValue>(&self, cmd: &Cmd) -> Result<T, RunError> {
        self.run_on(self.pick(), cmd).await
    }

    /// Runs one command on connection `i` (modulo the pool's size), within the timeout.
    /// Commands sent on one connection run in the order they were sent.
    pub(crate) async fn run_on<T: FromRedisValue>(
        &self,
        i: usize,
        cmd: &Cmd,
    ) -> Result<T, RunError> {
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
    pub(crate) fn err(&self, what: impl std::fmt::Display, e: RunError) -> StoreError {
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

    /// For `flush=wait`: sends `WAIT replicas` on each connection in `conns` (all at once) and
    /// succeeds when every one of them was acknowledged by enough replicas, which covers
    /// every write that completed on those connections before. Does nothing for other
    /// policies. `what` names the operation in the error (`flush`).
    pub(crate) async fn wait_for_replicas(
        &self,
        what: &str,
        conns: impl Iterator<Item = usize>,
    ) -> StoreResult<()> {
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
        let waits = conns.map(|i| self.run_on::<u64>(i, &cmd));
        for acked in futures::future::join_all(waits).await {
            let acked = acked.map_err(|e| self.err("waiting for replicas (WAIT)", e))?;
            if acked < u64::from(replicas) {
                return Err(StoreError::new(
                    ErrorKind::Timeout,
                    format!(
                        "{what} on {}: {acked} of the {replicas} replicas asked for acknowledged the writes within {wait:?}",
                        self.server
                    ),
                ));
            }
        }
        Ok(())
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

/// Why a command failed: the client's error, or no answer within the deadline.
pub(crate) enum RunError {
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
