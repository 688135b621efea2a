//! [`CqlObjects`]: named objects in a Cassandra or ScyllaDB table, for the versioned layout
//! (content-addressed chunks, manifests, tags); a folder is one partition, so it lists with
//! one partition read in clustering order.

use std::fmt;
use std::ops::ControlFlow;

use bytes::Bytes;
use farmap_core::{check_key, BoxFuture, ErrorKind, Objects, StoreError, StoreResult};
use scylla::client::session::Session;
use scylla::response::PagingState;
use scylla::statement::prepared::PreparedStatement;
use scylla::statement::{Consistency, SerialConsistency};

use crate::config::{CqlConsistency, CqlSpec, CqlTarget};
use crate::schema::Schema;
use crate::{error, session};

/// The largest object created or read. Cassandra refuses a mutation larger than half its
/// commit log segment (`commitlog_segment_size`, 32 MiB by default, so 16 MiB), and a
/// lightweight transaction writes the object into its Paxos state as well: 8 MiB leaves
/// room for both. That is a version manifest of about 200 000 chunks (a 13 GiB region in
/// 64 KiB chunks, 200 GiB in 1 MiB chunks); S3 and Redis take 256 MiB.
pub const MAX_OBJECT_LEN: usize = 8 << 20;

/// Rows asked for per page when a folder is listed.
const LIST_PAGE: i32 = 1000;

/// Locks that keep this process's transactions on one partition one at a time (a folder
/// takes the lock `hash(folder) % STRIPES`).
const STRIPES: usize = 256;

/// The partition of keys with no folder (`gc`, a top-level name): `/` is never a folder
/// ([`check_key`] refuses it), and CQL refuses an empty partition key.
const TOP: &str = "/";

/// Objects in a CQL table, `<table>_objects` in the keyspace of a `cql://` spec (the same
/// nodes, credentials and options as [`CqlStore`](crate::CqlStore)), one row per object or
/// folder:
///
/// ```text
/// CREATE TABLE ks.t_objects (folder text, name text, data blob, len bigint, dir boolean,
///                            PRIMARY KEY (folder, name))
///   ("chunks/ab", HASH, bytes, 1234, null)     the object chunks/ab/HASH
///   ("chunks",    "ab", null,  null, true)     chunks/ab is a folder
///   ("/",         NAME, bytes, 5,    null)     an object with no folder: partition "/"
/// ```
///
/// The folder is the partition and the name the clustering key, so
/// [`list`](Objects::list) is one partition read in clustering order: ascending by the
/// bytes of the name (CQL `text` sorts by its UTF-8 bytes, and keys are ASCII).
///
/// # Atomicity
/// - [`create`](Objects::create) is a lightweight transaction (Paxos):
///   `UPDATE ... SET data = ?, len = ? IF len = null`. Of racing creators exactly one sees
///   `[applied]`, and only that call returns `true`. The condition is on `len`, so a
///   loser is sent the 8-byte length, never the object; and it is a condition on a
///   column, not `IF NOT EXISTS`, so a name that is already a folder can still become an
///   object.
/// - Enclosing folders are marked (`dir = true` in the row of each one in its parent) by
///   plain upserts, acknowledged before the transaction runs: a crash in between leaves an
///   empty folder listed, never an object whose folder is missing from its parent's list
///   (as farmap-redis's `RedisObjects` does in a cluster). Markers are
///   never deleted (a listed folder may be empty, as a directory stays), and they only
///   touch the `dir` cell, which no transaction writes.
/// - [`delete`](Objects::delete) is a lightweight transaction too
///   (`DELETE data, len ... IF EXISTS`): Cassandra orders a transaction's writes by its
///   Paxos ballot and a plain write by its client timestamp, so a plain delete from a
///   client whose clock runs ahead could hide an object created again afterwards (as the
///   collector does when it restores a chunk from the trash). A row left with neither
///   object nor marker is gone; one that is also a folder stays listed.
/// - A [`get`](Objects::get) sees an object absent or whole: the row's cells are written
///   by one mutation.
///
/// # Concurrency
/// - Every method takes `&self`; any number of tasks share the session's connections.
/// - Paxos rounds on one partition that overlap make each other start over, and past the
///   server's `cas_contention_timeout` (1 s by default) fail with an unknown outcome (2 500
///   creates at once in one folder did, in a test). So the transactions of one
///   `CqlObjects` on one folder run one at a time: a striped lock (256 stripes, by the
///   folder's hash) is held across each `create` and `delete` transaction. Folders of other
///   stripes go on at once (the versioned layout spreads chunks over 256 folders);
///   reads, listings and folder markers take no lock. Creators in other processes still
///   contend, and a contended create may then fail with [`Timeout`](ErrorKind::Timeout).
///
/// # Consistency
/// Transactions run their Paxos rounds at `SERIAL` (a majority of all replicas, in every
/// data center: `LOCAL_SERIAL` would let one writer win in each data center) and commit at
/// the spec's `consistency`, which must be a quorum (`quorum`, `local_quorum`,
/// `each_quorum` or `all`; a weaker one is refused at opening). Reads run at that level
/// too, not at `SERIAL`: a committed transaction is on a quorum, so a quorum read sees it,
/// and a create that reported `false` has seen the winner's commit (a Paxos round first
/// finishes any round in progress). `SERIAL` reads (a Paxos round each, about four
/// round trips) would only add the proposals still in flight, which no caller needs; reads
/// at `local_quorum` see what was committed at `local_quorum` in the same data center.
///
/// A transaction that times out (`WriteTimeout` of type CAS) has an unknown outcome: the
/// object may or may not be there, now or once a later round finishes the proposal. It is
/// returned as an error ([`Timeout`](ErrorKind::Timeout)), never as `true`; the statement
/// is not idempotent, so the driver never retries it. Creating the key again settles it:
/// its Paxos round first finishes the pending proposal, then answers `false` if it landed
/// (the versioned layout does that: it retries its pending version at the next flush and
/// compares the bytes there).
///
/// # Durability
/// `create` returns once the replicas of the commit level have the object in their commit
/// logs; what survives their power loss is the server's `commitlog_sync` (see the crate's
/// notes): `periodic` (the default) may lose the last period's writes with the machines,
/// `batch` or `group` waits for the disk.
///
/// # Limits
/// Keys are checked with [`check_key`]. An object is at most [`MAX_OBJECT_LEN`] bytes: a
/// larger `create` is refused before anything is sent, and a row holding more (written
/// behind farmap's back) is refused as corrupt. The server's own cell limit bounds what
/// one read can bring. A folder is listed in pages of 1000 names, names that are
/// not valid keys skipped.
pub struct CqlObjects {
    session: Session,
    /// `cql://nodes/keyspace?table=T` without the password, for messages.
    location: String,
    /// `ks.T_objects`.
    table: String,
    st: Statements,
    /// One transaction at a time per stripe of folders (see Concurrency).
    stripes: Box<[tokio::sync::Mutex<()>]>,
}

impl fmt::Debug for CqlObjects {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CqlObjects")
            .field("location", &self.location)
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
struct Statements {
    mark: PreparedStatement,
    create: PreparedStatement,
    get: PreparedStatement,
    exists: PreparedStatement,
    list: PreparedStatement,
    delete: PreparedStatement,
}

/// `(folder, name)` of a key: `("chunks/ab", "HASH")`, or `("/", "NAME")` at the top.
fn split(key: &str) -> (&str, &str) {
    key.rsplit_once('/').unwrap_or((TOP, key))
}

/// The folder markers that make `folder` listable in its parents, as `(parent, name)`: for
/// `a/b/c`, `(a/b, c)` and `(a, b)`. The top is never listed ([`check_key`] refuses an
/// empty folder), so top-level folders are not marked.
fn markers(folder: &str) -> Vec<(&str, &str)> {
    let mut out = Vec::new();
    let mut f = folder;
    while let Some((parent, last)) = f.rsplit_once('/').filter(|_| f != TOP) {
        out.push((parent, last));
        f = parent;
    }
    out
}

/// Whether `c` makes reads see every acknowledged write of the same level.
fn is_quorum(c: CqlConsistency) -> bool {
    matches!(
        c,
        CqlConsistency::Quorum
            | CqlConsistency::LocalQuorum
            | CqlConsistency::EachQuorum
            | CqlConsistency::All
    )
}

impl CqlObjects {
    /// Connects to the cluster `target` names (as [`CqlStore`](crate::CqlStore) does) and
    /// checks (or, with `create=true`, makes) the keyspace and the table `<table>_objects`.
    /// The target's `region` is not used; a consistency below a quorum is refused.
    pub async fn open(target: &CqlTarget) -> StoreResult<CqlObjects> {
        let server = target.redacted();
        if !is_quorum(target.consistency) {
            return Err(StoreError::invalid(format!(
                "objects on {server} need reads that see every created object: give \
                 consistency=quorum or local_quorum (or each_quorum, all), not {}",
                target.consistency
            )));
        }
        let session = session::connect(target).await?;
        let spec = CqlSpec {
            target: target.clone(),
            size: None,
            chunk_size: None,
            read_only: false,
        };
        Schema {
            session: &session,
            spec: &spec,
            server: server.clone(),
        }
        .ensure_objects_table()
        .await?;
        let table = target.objects_table_name();
        let level = target.consistency.to_driver();
        let prepare = |cql: String, idempotent: bool| {
            let (session, table, server) = (&session, &table, &server);
            async move {
                let mut st = session.prepare(cql.as_str()).await.map_err(|e| {
                    error::prepare(format!("preparing {cql:?} for {table} on {server}"), e)
                })?;
                st.set_is_idempotent(idempotent);
                st.set_consistency(level);
                Ok::<_, StoreError>(st)
            }
        };
        let key = "WHERE folder = ? AND name = ?";
        let mut create = prepare(
            format!("UPDATE {table} SET data = ?, len = ? {key} IF len = null"),
            false,
        )
        .await?;
        create.set_serial_consistency(Some(SerialConsistency::Serial));
        let mut delete = prepare(
            format!("DELETE data, len FROM {table} {key} IF EXISTS"),
            false,
        )
        .await?;
        delete.set_serial_consistency(Some(SerialConsistency::Serial));
        let mut list = prepare(format!("SELECT name FROM {table} WHERE folder = ?"), true).await?;
        list.set_page_size(LIST_PAGE);
        let st = Statements {
            mark: prepare(format!("UPDATE {table} SET dir = true {key}"), true).await?,
            create,
            get: prepare(format!("SELECT data, len FROM {table} {key}"), true).await?,
            exists: prepare(format!("SELECT len FROM {table} {key}"), true).await?,
            list,
            delete,
        };
        debug_assert!(!matches!(
            level,
            Consistency::Serial | Consistency::LocalSerial
        ));
        let location = format!("{}?table={}", target.shown(), target.table);
        tracing::debug!(%location, %table, "opened cql objects");
        Ok(CqlObjects {
            session,
            location,
            table,
            st,
            stripes: (0..STRIPES).map(|_| tokio::sync::Mutex::new(())).collect(),
        })
    }

    /// `ks.T_objects`, the table holding the objects.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The lock of `folder`'s stripe, held across a transaction on its partition.
    fn stripe(&self, folder: &str) -> &tokio::sync::Mutex<()> {
        use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
        let h = BuildHasherDefault::<DefaultHasher>::default().hash_one(folder);
        &self.stripes[(h % STRIPES as u64) as usize]
    }

    fn context(&self, doing: &str, key: &str) -> String {
        format!(
            "{doing} object {key} in {} on {}",
            self.table, self.location
        )
    }

    async fn create_checked(&self, key: &str, data: Bytes) -> StoreResult<bool> {
        if data.len() > MAX_OBJECT_LEN {
            return Err(StoreError::invalid(format!(
                "object {key} would be {} bytes, more than the {MAX_OBJECT_LEN} a CQL object \
                 may have",
                data.len()
            )));
        }
        let (folder, name) = split(key);
        let marks = markers(folder).into_iter().map(|(parent, dir)| async move {
            self.session
                .execute_unpaged(&self.st.mark, (parent, dir))
                .await
                .map_err(|e| error::execution(self.context("marking the folders of", key), e))
        });
        futures::future::try_join_all(marks).await?;
        let len = data.len() as i64;
        let result = {
            let _one_at_a_time = self.stripe(folder).lock().await;
            self.session
                .execute_unpaged(&self.st.create, (data, len, folder, name))
                .await
                .map_err(|e| error::execution(self.context("creating", key), e))?
        };
        let context = || self.context("creating", key);
        let rows = result
            .into_rows_result()
            .map_err(|e| StoreError::new(ErrorKind::Io, context()).with_source(e))?;
        // `[applied]` first, then (when not applied) the `len` the condition saw.
        let applied = rows
            .maybe_first_row::<(bool, Option<i64>)>()
            .map(|row| row.map(|(applied, _)| applied))
            .or_else(|_| {
                rows.maybe_first_row::<(bool,)>()
                    .map(|row| row.map(|(applied,)| applied))
            })
            .map_err(|e| {
                StoreError::new(
                    ErrorKind::Io,
                    format!("{}: the answer has no [applied] column", context()),
                )
                .with_source(e)
            })?;
        applied.ok_or_else(|| {
            StoreError::new(
                ErrorKind::Io,
                format!("{}: the server's answer has no row", context()),
            )
        })
    }

    async fn get_checked(&self, key: &str) -> StoreResult<Option<Bytes>> {
        let context = || self.context("reading", key);
        let result = self
            .session
            .execute_unpaged(&self.st.get, split(key))
            .await
            .map_err(|e| error::execution(context(), e))?;
        let rows = result
            .into_rows_result()
            .map_err(|e| StoreError::new(ErrorKind::Io, context()).with_source(e))?;
        let row = rows
            .maybe_first_row::<(Option<Bytes>, Option<i64>)>()
            .map_err(|e| {
                StoreError::new(
                    ErrorKind::Corrupt,
                    format!("{}: the row has unexpected columns", context()),
                )
                .with_source(e)
            })?;
        let corrupt = |why: String| {
            StoreError::new(
                ErrorKind::Corrupt,
                format!(
                    "the row of object {key} in {} on {} {why}; refusing to read it",
                    self.table, self.location
                ),
            )
        };
        match row {
            // No row, or only a folder marker.
            None | Some((None, None)) => Ok(None),
            Some((data, Some(len))) => {
                let data = data.unwrap_or_default();
                if data.len() > MAX_OBJECT_LEN {
                    Err(corrupt(format!(
                        "holds {} bytes, more than the {MAX_OBJECT_LEN} an object may have",
                        data.len()
                    )))
                } else if i64::try_from(data.len()) != Ok(len) {
                    Err(corrupt(format!(
                        "holds {} bytes but records {len}",
                        data.len()
                    )))
                } else {
                    Ok(Some(data))
                }
            }
            Some((Some(_), None)) => Err(corrupt("holds bytes but no length".into())),
        }
    }

    async fn exists_checked(&self, key: &str) -> StoreResult<bool> {
        let context = || self.context("looking up", key);
        let result = self
            .session
            .execute_unpaged(&self.st.exists, split(key))
            .await
            .map_err(|e| error::execution(context(), e))?;
        let rows = result
            .into_rows_result()
            .map_err(|e| StoreError::new(ErrorKind::Io, context()).with_source(e))?;
        let row = rows.maybe_first_row::<(Option<i64>,)>().map_err(|e| {
            StoreError::new(
                ErrorKind::Corrupt,
                format!("{}: the row has unexpected columns", context()),
            )
            .with_source(e)
        })?;
        Ok(matches!(row, Some((Some(_),))))
    }

    async fn list_checked(&self, dir: &str) -> StoreResult<Vec<String>> {
        let context = || {
            format!(
                "listing folder {dir} in {} on {}",
                self.table, self.location
            )
        };
        let mut names = Vec::new();
        let mut paging = PagingState::start();
        loop {
            let (result, next) = self
                .session
                .execute_single_page(&self.st.list, (dir,), paging)
                .await
                .map_err(|e| error::execution(context(), e))?;
            let rows = result
                .into_rows_result()
                .map_err(|e| StoreError::new(ErrorKind::Io, context()).with_source(e))?;
            let page = rows
                .rows::<(String,)>()
                .map_err(|e| StoreError::new(ErrorKind::Corrupt, context()).with_source(e))?;
            for row in page {
                let (name,) =
                    row.map_err(|e| StoreError::new(ErrorKind::Corrupt, context()).with_source(e))?;
                if !name.contains('/') && check_key(&name).is_ok() {
                    names.push(name);
                }
            }
            match next.into_paging_control_flow() {
                ControlFlow::Continue(state) => paging = state,
                ControlFlow::Break(()) => break,
            }
        }
        Ok(names)
    }

    async fn delete_checked(&self, key: &str) -> StoreResult<()> {
        let (folder, name) = split(key);
        let _one_at_a_time = self.stripe(folder).lock().await;
        self.session
            .execute_unpaged(&self.st.delete, (folder, name))
            .await
            .map_err(|e| error::execution(self.context("deleting", key), e))?;
        Ok(())
    }
}

impl Objects for CqlObjects {
    fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, StoreResult<Option<Bytes>>> {
        Box::pin(async move {
            check_key(key)?;
            self.get_checked(key).await
        })
    }

    fn exists<'a>(&'a self, key: &'a str) -> BoxFuture<'a, StoreResult<bool>> {
        Box::pin(async move {
            check_key(key)?;
            self.exists_checked(key).await
        })
    }

    fn create<'a>(&'a self, key: &'a str, data: Bytes) -> BoxFuture<'a, StoreResult<bool>> {
        Box::pin(async move {
            check_key(key)?;
            self.create_checked(key, data).await
        })
    }

    fn list<'a>(&'a self, dir: &'a str) -> BoxFuture<'a, StoreResult<Vec<String>>> {
        Box::pin(async move {
            check_key(dir)?;
            self.list_checked(dir).await
        })
    }

    fn delete<'a>(&'a self, key: &'a str) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(async move {
            check_key(key)?;
            self.delete_checked(key).await
        })
    }

    fn location(&self) -> String {
        self.location.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_a_folder_and_a_name() {
        assert_eq!(split("chunks/ab/0123"), ("chunks/ab", "0123"));
        assert_eq!(split("gc"), (TOP, "gc"));
    }

    #[test]
    fn every_enclosing_folder_is_marked_in_its_parent() {
        assert_eq!(markers("a/b/c"), [("a/b", "c"), ("a", "b")]);
        assert!(markers("a").is_empty());
        assert!(markers(TOP).is_empty());
    }

    #[test]
    fn only_quorum_levels_hold_objects() {
        assert!(is_quorum(CqlConsistency::LocalQuorum));
        assert!(is_quorum(CqlConsistency::All));
        assert!(!is_quorum(CqlConsistency::One));
        assert!(!is_quorum(CqlConsistency::LocalOne));
    }
}
