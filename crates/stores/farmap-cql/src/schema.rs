//! The keyspace, the tables, and each region's row in the region table.
//!
//! ```text
//! CREATE TABLE ks.t (                      -- one row per chunk that holds data
//!     region text, part bigint, chunk bigint, data blob,
//!     PRIMARY KEY ((region, part), chunk))  -- part = chunk / part_chunks
//! CREATE TABLE ks.t_regions (               -- one row per region: its geometry
//!     region text PRIMARY KEY, size bigint, chunk_size int, part_chunks int, format int)
//! CREATE TABLE ks.t_objects (               -- CqlObjects: one row per object or folder
//!     folder text, name text, data blob, len bigint, dir boolean,
//!     PRIMARY KEY (folder, name))
//! ```

use farmap_core::{ErrorKind, Geometry, StoreError, StoreResult};
use scylla::client::session::Session;
use scylla::statement::{Consistency, SerialConsistency, Statement};

use crate::config::CqlSpec;
use crate::error;

/// The layout version written in each region's row; a reader refuses others.
pub(crate) const FORMAT: i32 = 1;

/// Bytes of chunk data per partition: partitions of a few MiB to tens of MiB are what
/// Cassandra and ScyllaDB handle best (one per region would grow to GiBs and millions of rows).
pub(crate) const PARTITION_BYTES: u64 = 16 << 20;

/// Rows per partition at most, whatever the chunk size (keeps 4 KiB-chunk partitions short).
pub(crate) const MAX_PART_CHUNKS: u64 = 1024;

/// Chunks per partition for a new region of `chunk_size`.
pub(crate) fn part_chunks_for(chunk_size: u32) -> u64 {
    (PARTITION_BYTES / u64::from(chunk_size)).clamp(1, MAX_PART_CHUNKS)
}

/// A region's row: its geometry and how it is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RegionRow {
    pub geometry: Geometry,
    pub part_chunks: u64,
}

/// What opening needs from the server, with the spec for messages.
pub(crate) struct Schema<'a> {
    pub session: &'a Session,
    pub spec: &'a CqlSpec,
    /// `cql://nodes/keyspace` without the password.
    pub server: String,
}

/// How long a table that exists may take to be served after it was created.
const SCHEMA_SETTLE: std::time::Duration = std::time::Duration::from_secs(10);

impl Schema<'_> {
    async fn run(&self, what: &str, cql: String) -> StoreResult<()> {
        let mut st = Statement::new(cql);
        st.set_consistency(self.spec.target.consistency.to_driver());
        self.session
            .query_unpaged(st, ())
            .await
            .map_err(|e| error::execution(format!("{what} on {}", self.server), e))?;
        Ok(())
    }

    async fn keyspace_exists(&self) -> StoreResult<bool> {
        let t = &self.spec.target;
        let rows = self
            .session
            .query_unpaged(
                "SELECT keyspace_name FROM system_schema.keyspaces WHERE keyspace_name = ?",
                (t.keyspace.as_str(),),
            )
            .await
            .map_err(|e| {
                error::execution(
                    format!("looking up keyspace {} on {}", t.keyspace, self.server),
                    e,
                )
            })?;
        Ok(rows.into_rows_result().is_ok_and(|r| r.rows_num() > 0))
    }

    async fn table_exists(&self, table: &str) -> StoreResult<bool> {
        let t = &self.spec.target;
        let rows = self
            .session
            .query_unpaged(
                "SELECT table_name FROM system_schema.tables WHERE keyspace_name = ? AND table_name = ?",
                (t.keyspace.as_str(), table),
            )
            .await
            .map_err(|e| {
                error::execution(
                    format!("looking up table {}.{table} on {}", t.keyspace, self.server),
                    e,
                )
            })?;
        Ok(rows.into_rows_result().is_ok_and(|r| r.rows_num() > 0))
    }

    /// Makes sure the keyspace and the chunk and region tables exist, creating them when
    /// the spec says `create=true`; otherwise a missing one is a `NotFound` error saying so.
    pub(crate) async fn ensure_tables(&self) -> StoreResult<()> {
        let t = &self.spec.target;
        self.ensure(&[
            (
                t.table.clone(),
                format!(
                    "CREATE TABLE IF NOT EXISTS {} (region text, part bigint, chunk bigint, \
                     data blob, PRIMARY KEY ((region, part), chunk)) \
                     WITH comment = 'farmap chunks: one row per chunk, see {}' \
                     AND compression = {{'enabled': 'false'}}",
                    t.table_name(),
                    t.regions_table_name()
                ),
            ),
            (
                format!("{}_regions", t.table),
                format!(
                    "CREATE TABLE IF NOT EXISTS {} (region text PRIMARY KEY, size bigint, \
                     chunk_size int, part_chunks int, format int) \
                     WITH comment = 'farmap regions: the geometry of each region in {}'",
                    t.regions_table_name(),
                    t.table_name()
                ),
            ),
        ])
        .await
    }

    /// Makes sure the keyspace and the objects table (`T_objects`, see
    /// [`CqlObjects`](crate::CqlObjects)) exist, as [`ensure_tables`](Self::ensure_tables)
    /// does for a region's tables.
    pub(crate) async fn ensure_objects_table(&self) -> StoreResult<()> {
        let t = &self.spec.target;
        self.ensure(&[(
            format!("{}_objects", t.table),
            format!(
                "CREATE TABLE IF NOT EXISTS {} (folder text, name text, data blob, len bigint, \
                 dir boolean, PRIMARY KEY (folder, name)) \
                 WITH comment = 'farmap objects: versioned regions, one row per object or folder'",
                t.objects_table_name()
            ),
        )])
        .await
    }

    /// Makes sure the keyspace and `tables` (`(name, CREATE TABLE ...)`) exist, creating them
    /// when the spec says `create=true`; otherwise a missing one is a `NotFound` error.
    async fn ensure(&self, tables: &[(String, String)]) -> StoreResult<()> {
        // Two sessions creating one table at once can each get a table id of its own, and
        // requests then fail with "Unknown CF" until the schema settles: the stores of this
        // process create tables one at a time (the driver waits for schema agreement after
        // each creation).
        static CREATING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
        let _one_at_a_time = CREATING.lock().await;
        let t = &self.spec.target;
        let missing = |what: String| {
            StoreError::new(
                ErrorKind::NotFound,
                format!(
                    "{what} does not exist on {}; add create=true to the spec to create it",
                    self.server
                ),
            )
        };
        if !self.keyspace_exists().await? {
            if !t.create {
                return Err(missing(format!("keyspace {}", t.keyspace)));
            }
            tracing::info!(keyspace = %t.keyspace, replication = t.replication, "creating keyspace");
            self.run(
                &format!("creating keyspace {}", t.keyspace),
                format!(
                    "CREATE KEYSPACE IF NOT EXISTS {} WITH replication = \
                     {{'class': 'SimpleStrategy', 'replication_factor': {}}}",
                    t.keyspace, t.replication
                ),
            )
            .await?;
        }
        for (table, ddl) in tables {
            if self.table_exists(table).await? {
                continue;
            }
            if !t.create {
                return Err(missing(format!("table {}.{table}", t.keyspace)));
            }
            tracing::info!(table = %format!("{}.{table}", t.keyspace), "creating table");
            self.run(
                &format!("creating table {}.{table}", t.keyspace),
                ddl.clone(),
            )
            .await?;
        }
        Ok(())
    }

    async fn read_region(&self) -> StoreResult<Option<RegionRow>> {
        let t = &self.spec.target;
        let mut st = Statement::new(format!(
            "SELECT size, chunk_size, part_chunks, format FROM {} WHERE region = ?",
            t.regions_table_name()
        ));
        // A region row is written with a lightweight transaction: read it linearizably.
        st.set_consistency(Consistency::Serial);
        let context = || {
            format!(
                "reading region {} from {} on {}",
                t.region,
                t.regions_table_name(),
                self.server
            )
        };
        // The tables exist (`ensure_tables` ran first), but a table another client has
        // just created can be listed in the schema before the node serves it ("table ...
        // does not exist"): tests creating regions at once on a fresh node met it. Such
        // a read is tried again for a moment.
        let settle = std::time::Instant::now() + SCHEMA_SETTLE;
        let result = loop {
            match self
                .session
                .query_unpaged(st.clone(), (t.region.as_str(),))
                .await
            {
                Err(e)
                    if error::execution_kind(&e) == ErrorKind::NotFound
                        && std::time::Instant::now() < settle =>
                {
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await
                }
                r => break r.map_err(|e| error::execution(context(), e))?,
            }
        };
        let rows = result
            .into_rows_result()
            .map_err(|e| StoreError::new(ErrorKind::Io, context()).with_source(e))?;
        let row = rows
            .maybe_first_row::<(Option<i64>, Option<i32>, Option<i32>, Option<i32>)>()
            .map_err(|e| {
                StoreError::new(
                    ErrorKind::Corrupt,
                    format!("{}: the row has unexpected columns", context()),
                )
                .with_source(e)
            })?;
        let Some((size, chunk_size, part_chunks, format)) = row else {
            return Ok(None);
        };
        let corrupt = |why: String| {
            StoreError::new(
                ErrorKind::Corrupt,
                format!(
                    "the row of region {} in {} {why}",
                    t.region,
                    t.regions_table_name()
                ),
            )
        };
        let (Some(size), Some(chunk_size), Some(part_chunks), Some(format)) =
            (size, chunk_size, part_chunks, format)
        else {
            return Err(corrupt("lacks a value".into()));
        };
        if format != FORMAT {
            return Err(StoreError::new(
                ErrorKind::Unsupported,
                format!(
                    "region {} in {} has layout version {format}; this farmap reads version {FORMAT}",
                    t.region,
                    t.regions_table_name()
                ),
            ));
        }
        let chunk_ok = u32::try_from(chunk_size).is_ok_and(|c| {
            c.is_power_of_two() && (farmap_core::MIN_CHUNK_SIZE..=crate::MAX_CQL_CHUNK).contains(&c)
        });
        if !chunk_ok {
            return Err(corrupt(format!("has chunk size {chunk_size}")));
        }
        let geometry = u64::try_from(size)
            .ok()
            .and_then(|s| Geometry::new_bounded(s, chunk_size as u64).ok())
            .ok_or_else(|| corrupt(format!("has size {size} (chunk size {chunk_size})")))?;
        let part_chunks = u64::try_from(part_chunks)
            .ok()
            .filter(|p| (1..=MAX_PART_CHUNKS).contains(p))
            .ok_or_else(|| corrupt(format!("has {part_chunks} chunks per partition")))?;
        Ok(Some(RegionRow {
            geometry,
            part_chunks,
        }))
    }

    /// The region's row, made (with a lightweight transaction, so that two processes creating
    /// the same region agree on one geometry) when missing and the spec says `create=true`.
    /// The spec's size and chunk size, when given, must match the row's.
    pub(crate) async fn region(&self) -> StoreResult<RegionRow> {
        let t = &self.spec.target;
        let row = match self.read_region().await? {
            Some(row) => row,
            None if !t.create => {
                return Err(StoreError::new(
                    ErrorKind::NotFound,
                    format!(
                        "region {} is not in {} on {}; add create=true (and size=) to the spec to \
                         create it",
                        t.region,
                        t.regions_table_name(),
                        self.server
                    ),
                ))
            }
            None => {
                let Some(size) = self.spec.size else {
                    return Err(StoreError::new(
                        ErrorKind::InvalidInput,
                        format!(
                            "region {} does not exist yet in {} on {}: give its size (size=) to \
                             create it",
                            t.region,
                            t.regions_table_name(),
                            self.server
                        ),
                    ));
                };
                let chunk = self
                    .spec
                    .chunk_size
                    .unwrap_or(farmap_core::DEFAULT_CHUNK_SIZE);
                let part_chunks = part_chunks_for(chunk);
                tracing::info!(region = %t.region, size, chunk, part_chunks, "creating region");
                let mut st = Statement::new(format!(
                    "INSERT INTO {} (region, size, chunk_size, part_chunks, format) \
                     VALUES (?, ?, ?, ?, ?) IF NOT EXISTS",
                    t.regions_table_name(),
                ));
                st.set_consistency(t.consistency.to_driver());
                st.set_serial_consistency(Some(SerialConsistency::Serial));
                let values = (
                    t.region.as_str(),
                    size as i64,
                    chunk as i32,
                    part_chunks as i32,
                    FORMAT,
                );
                self.session.query_unpaged(st, values).await.map_err(|e| {
                    error::execution(
                        format!(
                            "creating region {} in {} on {}",
                            t.region,
                            t.regions_table_name(),
                            self.server
                        ),
                        e,
                    )
                })?;
                self.read_region().await?.ok_or_else(|| {
                    StoreError::new(
                        ErrorKind::Io,
                        format!(
                            "region {} was created in {} on {} but does not read back",
                            t.region,
                            t.regions_table_name(),
                            self.server
                        ),
                    )
                })?
            }
        };
        let g = row.geometry;
        let differs = |what: &str, asked: String, has: String| {
            StoreError::new(
                ErrorKind::InvalidInput,
                format!(
                    "region {} in {} has {what} {has}, not the {asked} the spec asks for",
                    t.region,
                    t.regions_table_name()
                ),
            )
        };
        if let Some(size) = self.spec.size.filter(|s| *s != g.size()) {
            return Err(differs(
                "size",
                farmap_core::format_size(size),
                farmap_core::format_size(g.size()),
            ));
        }
        if let Some(chunk) = self.spec.chunk_size.filter(|c| *c != g.chunk_size()) {
            return Err(differs(
                "chunk size",
                farmap_core::format_size(chunk.into()),
                farmap_core::format_size(g.chunk_size().into()),
            ));
        }
        Ok(row)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_hold_about_16_mib() {
        assert_eq!(part_chunks_for(4096), 1024);
        assert_eq!(part_chunks_for(64 << 10), 256);
        assert_eq!(part_chunks_for(1 << 20), 16);
    }
}
