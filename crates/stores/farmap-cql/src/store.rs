//! [`CqlStore`]: a region's chunks as rows of a CQL table.

use std::sync::Arc;

use bytes::Bytes;
use farmap_core::{
    zero_chunk, BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, Store,
    StoreError, StoreResult,
};
use futures::stream::{self, StreamExt, TryStreamExt};
use scylla::client::session::Session;
use scylla::statement::prepared::PreparedStatement;

use crate::config::CqlSpec;
use crate::schema::{RegionRow, Schema};
use crate::{error, session};

/// Partition deletes in flight at once during a trim.
const TRIM_IN_FLIGHT: usize = 32;

/// A region kept in a Cassandra or ScyllaDB table: one row per chunk that holds data.
///
/// # Concurrency
/// - Every method takes `&self`; requests from any number of tasks run at once, multiplexed by
///   the driver over its connections (many streams per connection).
/// - A write replaces its row whole, so a read sees the old or the new chunk, never a mix.
/// - Writes and deletes carry client-side timestamps from one monotonic clock per store, so
///   that of two requests of this store the later one wins on the server (Cassandra orders a
///   row's versions by timestamp, not by arrival). Stores on other hosts writing the same
///   region rely on their clocks being in step, as every Cassandra client does.
#[derive(Debug)]
pub struct CqlStore {
    session: Session,
    geometry: Geometry,
    part_chunks: u64,
    read_only: bool,
    region: String,
    /// `region R of ks.t on cql://nodes/ks`, for messages.
    name: Arc<str>,
    st: Statements,
    /// The node asked syncs its commit log before it acknowledges a write (see
    /// [`commitlog_sync`]): only then does this store claim [`Caps::FLUSH`].
    durable: bool,
}

/// What `commitlog_sync` says of a write a node acknowledged: durable (on disk) only with
/// `batch` or `group`; `periodic` (the default) syncs every period, so the last period's
/// acknowledged writes may be lost with the machine.
pub fn commitlog_sync_is_durable(setting: &str) -> bool {
    matches!(
        setting.trim().to_ascii_lowercase().as_str(),
        "batch" | "group"
    )
}

/// Whether the node `session` asks syncs its commit log before it acknowledges a write (said
/// in a log line when not).
async fn durable(session: &Session, name: &str) -> bool {
    let sync = commitlog_sync(session).await;
    let durable = sync.as_deref().is_some_and(commitlog_sync_is_durable);
    if !durable {
        tracing::info!(
            %name,
            commitlog_sync = sync.as_deref().unwrap_or("unknown"),
            "the server's commit log is not synced before it acknowledges a write: this store \
             does not claim that a flush makes writes durable (no FLUSH capability; NBD \
             clients are not offered FLUSH/FUA)"
        );
    }
    durable
}

/// The `commitlog_sync` setting of the node `session` asks (Cassandra 4.0 and later have it
/// in `system_views.settings`); `None` when it cannot tell (another server, no such table).
async fn commitlog_sync(session: &Session) -> Option<String> {
    let rows = session
        .query_unpaged(
            "SELECT value FROM system_views.settings WHERE name = 'commitlog_sync'",
            (),
        )
        .await
        .ok()?
        .into_rows_result()
        .ok()?;
    let (value,) = rows.maybe_first_row::<(Option<String>,)>().ok()??;
    value
}

#[derive(Debug)]
struct Statements {
    read: PreparedStatement,
    status: PreparedStatement,
    write: PreparedStatement,
    delete_partition: PreparedStatement,
    delete_range: PreparedStatement,
}

impl CqlStore {
    /// Connects to the cluster a spec names and opens its region: checks (or, with
    /// `create=true`, makes) the keyspace, the tables and the region's row, checks the spec's
    /// size and chunk size against the row, and prepares every statement.
    pub async fn open(spec: &CqlSpec) -> StoreResult<CqlStore> {
        let t = &spec.target;
        let server = t.redacted();
        let session = session::connect(t).await?;
        let schema = Schema {
            session: &session,
            spec,
            server: server.clone(),
        };
        schema.ensure_tables().await?;
        let RegionRow {
            geometry,
            part_chunks,
        } = schema.region().await?;
        let table = t.table_name();
        let name: Arc<str> = format!("region {} of {table} on {server}", t.region).into();
        let prepare = |cql: String| {
            let session = &session;
            let name = name.clone();
            async move {
                let mut st = session
                    .prepare(cql.as_str())
                    .await
                    .map_err(|e| error::prepare(format!("preparing {cql:?} for {name}"), e))?;
                st.set_is_idempotent(true);
                Ok::<_, StoreError>(st)
            }
        };
        let key = "WHERE region = ? AND part = ?";
        let st = Statements {
            read: prepare(format!("SELECT data FROM {table} {key} AND chunk = ?")).await?,
            status: prepare(format!("SELECT chunk FROM {table} {key} AND chunk = ?")).await?,
            write: prepare(format!(
                "INSERT INTO {table} (region, part, chunk, data) VALUES (?, ?, ?, ?)"
            ))
            .await?,
            delete_partition: prepare(format!("DELETE FROM {table} {key}")).await?,
            delete_range: prepare(format!(
                "DELETE FROM {table} {key} AND chunk >= ? AND chunk < ?"
            ))
            .await?,
        };
        let durable = durable(&session, &name).await;
        tracing::debug!(%name, size = geometry.size(), chunk = geometry.chunk_size(), part_chunks, "opened");
        Ok(CqlStore {
            session,
            geometry,
            part_chunks,
            read_only: spec.read_only,
            region: t.region.clone(),
            name,
            st,
            durable,
        })
    }

    /// Chunks per partition: chunk `i` lives in partition `(region, i / part_chunks)`.
    pub fn part_chunks(&self) -> u64 {
        self.part_chunks
    }

    /// The partition key and clustering key of chunk `idx`.
    fn key(&self, idx: ChunkIdx) -> (&str, i64, i64) {
        (
            self.region.as_str(),
            (idx.0 / self.part_chunks) as i64,
            idx.0 as i64,
        )
    }

    fn check_writable(&self) -> StoreResult<()> {
        if self.read_only {
            Err(StoreError::new(
                ErrorKind::ReadOnly,
                format!("{} was opened read-only (ro)", self.name),
            ))
        } else {
            Ok(())
        }
    }

    async fn do_read(&self, idx: ChunkIdx) -> StoreResult<Bytes> {
        self.geometry.check_idx(idx)?;
        let context = || format!("reading {idx} of {}", self.name);
        let result = self
            .session
            .execute_unpaged(&self.st.read, self.key(idx))
            .await
            .map_err(|e| error::execution(context(), e))?;
        let rows = result
            .into_rows_result()
            .map_err(|e| StoreError::new(ErrorKind::Io, context()).with_source(e))?;
        let row = rows.maybe_first_row::<(Option<Bytes>,)>().map_err(|e| {
            StoreError::new(
                ErrorKind::Corrupt,
                format!("{}: the row is not a blob", context()),
            )
            .with_source(e)
        })?;
        let want = self.geometry.chunk_len(idx);
        match row {
            None => Ok(zero_chunk(want)),
            Some((Some(data),)) if data.len() == want => Ok(data),
            Some((Some(data),)) => Err(StoreError::new(
                ErrorKind::Corrupt,
                format!(
                    "the row of {idx} (region {}, partition {}) of {} holds {} bytes, not the \
                     chunk's {want}: refused",
                    self.region,
                    idx.0 / self.part_chunks,
                    self.name,
                    data.len()
                ),
            )),
            Some((None,)) => Err(StoreError::new(
                ErrorKind::Corrupt,
                format!(
                    "the row of {idx} (region {}, partition {}) of {} holds no blob",
                    self.region,
                    idx.0 / self.part_chunks,
                    self.name
                ),
            )),
        }
    }

    async fn do_write(&self, idx: ChunkIdx, data: Bytes) -> StoreResult<()> {
        self.geometry.check_write(idx, data.len())?;
        self.check_writable()?;
        let (region, part, chunk) = self.key(idx);
        self.session
            .execute_unpaged(&self.st.write, (region, part, chunk, data))
            .await
            .map_err(|e| error::execution(format!("writing {idx} of {}", self.name), e))?;
        Ok(())
    }

    async fn do_status(&self, idx: ChunkIdx) -> StoreResult<ChunkStatus> {
        self.geometry.check_idx(idx)?;
        let context = || format!("looking up {idx} of {}", self.name);
        let result = self
            .session
            .execute_unpaged(&self.st.status, self.key(idx))
            .await
            .map_err(|e| error::execution(context(), e))?;
        let rows = result
            .into_rows_result()
            .map_err(|e| StoreError::new(ErrorKind::Io, context()).with_source(e))?;
        Ok(ChunkStatus::data_if(rows.rows_num() > 0))
    }

    /// One delete per partition the range touches: the whole partition when the range covers
    /// every chunk of it, a range of clustering keys otherwise (a single range tombstone).
    async fn do_trim(&self, range: ChunkRange) -> StoreResult<()> {
        self.geometry.check_range(range)?;
        self.check_writable()?;
        if range.is_empty() {
            return Ok(());
        }
        let pc = self.part_chunks;
        let count = self.geometry.chunk_count();
        let parts = range.start.0 / pc..=(range.end.0 - 1) / pc;
        stream::iter(parts)
            .map(|part| async move {
                let first = part * pc;
                let end = ((part + 1) * pc).min(count);
                let (lo, hi) = (range.start.0.max(first), range.end.0.min(end));
                let region = self.region.as_str();
                let result = if lo == first && hi == end {
                    self.session
                        .execute_unpaged(&self.st.delete_partition, (region, part as i64))
                        .await
                } else {
                    self.session
                        .execute_unpaged(
                            &self.st.delete_range,
                            (region, part as i64, lo as i64, hi as i64),
                        )
                        .await
                };
                result.map(|_| ()).map_err(|e| {
                    error::execution(
                        format!(
                            "trimming chunks {lo}..{hi} (partition {part}) of {}",
                            self.name
                        ),
                        e,
                    )
                })
            })
            .buffer_unordered(TRIM_IN_FLIGHT)
            .try_collect::<()>()
            .await
    }
}

impl Store for CqlStore {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn caps(&self) -> Caps {
        let mut caps = Caps::STATUS | Caps::PARALLEL;
        if self.durable {
            caps = caps | Caps::FLUSH;
        }
        if self.read_only {
            caps
        } else {
            caps | Caps::WRITE | Caps::TRIM
        }
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(self.do_read(idx))
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(self.do_write(idx, data))
    }

    /// Nothing to do: a write returns once the replicas of its consistency level have it in
    /// their commit logs (see the crate's notes on durability; the store claims
    /// [`Caps::FLUSH`] only when those logs are synced before the acknowledgement).
    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async { Ok(()) })
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(self.do_trim(range))
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        Box::pin(self.do_status(idx))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_commit_log_synced_before_the_acknowledgement_is_durable() {
        for (setting, durable) in [
            ("batch", true),
            ("group", true),
            (" Batch ", true),
            ("periodic", false),
            ("", false),
            ("fsync", false),
        ] {
            assert_eq!(commitlog_sync_is_durable(setting), durable, "{setting:?}");
        }
    }
}
