//! [`RedisStore`]: one key per chunk on a Redis server or a Redis Cluster.

use std::future::Future;

use bytes::Bytes;
use farmap_core::{
    zero_chunk, BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, Store,
    StoreError, StoreResult,
};

use crate::config::{FlushPolicy, RedisConfig};
use crate::conn::Conn;
use crate::meta;

/// Keys per `UNLINK` when a range is trimmed.
const TRIM_BATCH: usize = 1024;

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
    conn: Conn,
    prefix: String,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("server", &self.conn.server)
            .field("prefix", &self.prefix)
            .field("geometry", &self.geometry)
            .field("flush", &self.conn.flush)
            .finish_non_exhaustive()
    }
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
        let conn = Conn::open(config).await?;
        let mut caps = Caps::WRITE | Caps::TRIM | Caps::STATUS | Caps::PARALLEL;
        if config.flush != FlushPolicy::None {
            caps = caps | Caps::FLUSH;
        }
        let mut store = RedisStore {
            // Replaced below once the record is read.
            geometry: Geometry::new(4096, 4096).expect("valid"),
            caps,
            conn,
            prefix: config.prefix.clone(),
        };
        store.geometry = store.open_region(size, chunk).await?;
        tracing::debug!(server = %store.conn.server, prefix = %store.prefix, geometry = %meta::describe(store.geometry), "opened a redis region");
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
        &self.conn.server
    }

    async fn open_region(&self, size: Option<u64>, chunk: Option<u32>) -> StoreResult<Geometry> {
        let key = self.meta_key();
        let read = || async {
            self.conn
                .run::<Option<Vec<u8>>>(redis::cmd("GET").arg(&key))
                .await
                .map_err(|e| {
                    self.conn
                        .err(format_args!("reading the region record {key}"), e)
                })
        };
        let check = |raw: Vec<u8>| -> StoreResult<Geometry> {
            let g = meta::decode(&raw).map_err(|why| {
                StoreError::new(
                    ErrorKind::Corrupt,
                    format!(
                        "key {key} on {} is not a farmap region record: {why}",
                        self.conn.server
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
                    self.conn.server,
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
                    self.prefix, self.conn.server
                ),
            ));
        };
        let chunk = chunk.unwrap_or(farmap_core::DEFAULT_CHUNK_SIZE);
        let g = Geometry::new_bounded(size, u64::from(chunk))
            .map_err(|e| StoreError::invalid(format!("cannot create a region at {key}: {e}")))?;
        // SET NX: of two openers creating the same region at once, one record wins and the
        // other is checked against it.
        let created: Option<String> = self
            .conn
            .run(redis::cmd("SET").arg(&key).arg(meta::encode(g)).arg("NX"))
            .await
            .map_err(|e| {
                self.conn
                    .err(format_args!("writing the region record {key}"), e)
            })?;
        if created.is_some() {
            tracing::info!(key = %key, server = %self.conn.server, geometry = %meta::describe(g), "created a redis region");
            return Ok(g);
        }
        match read().await? {
            Some(raw) => check(raw),
            None => Err(StoreError::new(
                ErrorKind::Io,
                format!(
                    "the region record {key} on {} vanished while it was created",
                    self.conn.server
                ),
            )),
        }
    }
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
                .conn
                .run(redis::cmd("GET").arg(&key))
                .await
                .map_err(|e| self.conn.err(format_args!("reading {idx} (key {key})"), e))?;
            match value {
                None => Ok(zero_chunk(len)),
                Some(b) if b.len() == len => Ok(b),
                Some(b) => Err(StoreError::new(
                    ErrorKind::Corrupt,
                    format!(
                        "key {key} on {} holds {} bytes but {idx} is {len} bytes long; refusing to serve it",
                        self.conn.server,
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
                .conn
                .run(redis::cmd("SET").arg(&key).arg(&data[..]))
                .await
                .map_err(|e| self.conn.err(format_args!("writing {idx} (key {key})"), e))?;
            Ok(())
        })
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            // WAIT covers the writes sent on the connection it is sent on: send it on every
            // connection of the pool, by index (the round-robin counter is shared with data
            // traffic, which would skip some), all at once.
            self.conn
                .wait_for_replicas("flush", 0..self.conn.connections())
                .await
        })
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        checked(self.geometry.check_range(range), async move {
            let keys: Vec<String> = range.iter().map(|i| self.key(i)).collect();
            for batch in keys.chunks(TRIM_BATCH) {
                let _: u64 = self
                    .conn
                    .run(redis::cmd("UNLINK").arg(batch))
                    .await
                    .map_err(|e| self.conn.err(format_args!("trimming {range}"), e))?;
            }
            Ok(())
        })
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        checked(self.geometry.check_idx(idx), async move {
            let key = self.key(idx);
            let n: u64 = self
                .conn
                .run(redis::cmd("EXISTS").arg(&key))
                .await
                .map_err(|e| {
                    self.conn
                        .err(format_args!("asking for {idx} (key {key})"), e)
                })?;
            Ok(ChunkStatus::data_if(n > 0))
        })
    }
}
