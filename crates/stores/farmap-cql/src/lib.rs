//! farmap's CQL store: a region's chunks as rows of an Apache Cassandra (4, 5) or ScyllaDB
//! table, through the `scylla` driver.
//!
//! ```text
//! cql://[user[:password]@]host:port[,host:port...]/keyspace?table=T&region=R
//!       [&size=SIZE][&chunk=SIZE][&consistency=LEVEL][&create=true][&replication=N]
//!       [&connections=N][&timeout=DURATION][&ro]
//! ```
//!
//! | option | meaning | default |
//! |---|---|---|
//! | `table` | the table of chunks (its region table is `T_regions`) | `farmap_chunks` |
//! | `region` | the region's name: many regions share one table | `default` |
//! | `size` | region size: needed to create a region, checked against an existing one | the region's |
//! | `chunk` | chunk size, a power of two from 4 KiB to 1 MiB | 64 KiB, or the region's |
//! | `consistency` | `one`, `two`, `three`, `quorum`, `local_quorum`, `each_quorum`, `all`, `local_one` | `local_quorum` |
//! | `create` | create the keyspace, the tables and the region when missing | false |
//! | `replication` | replication factor of a keyspace this store creates (SimpleStrategy) | 1 |
//! | `connections` | connections per node (per shard on ScyllaDB) | 1 |
//! | `timeout` | deadline of each request | 30s |
//! | `ro` | refuse writes and trims | off |
//!
//! A port left out is 9042. A user without a password (`cql://alice@host/ks`) takes it from
//! the environment variable `FARMAP_CQL_PASSWORD`, which keeps it off the command line.
//!
//! # Layout
//! ```text
//! ks.T          (region text, part bigint, chunk bigint, data blob,
//!                PRIMARY KEY ((region, part), chunk))        one row per chunk holding data
//! ks.T_regions  (region text PRIMARY KEY, size bigint, chunk_size int, part_chunks int,
//!                format int)                                 one row per region: its geometry
//! ```
//! - A chunk is one row whose blob is exactly the chunk's length (the last chunk may be
//!   shorter). A missing row reads as zeros; a blob of any other length (or none) is refused
//!   as [`Corrupt`](farmap_core::ErrorKind::Corrupt), naming the row, and never served.
//! - **Partitions.** Chunk `i` lives in partition `(region, i / part_chunks)`, clustered by
//!   `i`. One partition per region would grow to millions of rows and GiBs (a hot, unbounded
//!   partition: slow compaction and repair, one replica set serving the whole region); one per
//!   chunk would make a trim one tombstone per chunk. `part_chunks` is chosen at creation so
//!   that a partition holds 16 MiB (at most 1024 rows): 256 rows of 64 KiB, 16 of 1 MiB, 1024
//!   of 4 KiB. A region of 1 GiB is thus 64 partitions spread over the ring, and reads of
//!   neighbouring chunks still go to one replica set. `part_chunks` is recorded in the region
//!   row, so a later choice never reinterprets an existing region.
//! - The region row records the geometry when the region is created (with a lightweight
//!   transaction, so that two processes creating one region agree); opening checks it, so
//!   `farmap info cql://...` needs no `size=`, and a spec whose size or chunk size differs is
//!   refused.
//! - **Trim** deletes: a partition tombstone for each partition the range covers whole, one
//!   range tombstone (`chunk >= a AND chunk < b`) for a partly covered one; never one
//!   tombstone per chunk. **Status** asks whether the row exists, without its blob.
//!
//! # Consistency and durability
//! Every data request runs at the `consistency` level (default `LOCAL_QUORUM`, a majority of
//! the replicas in the coordinator's data center, which is `QUORUM` in a one-data-center
//! cluster): reads and writes at a quorum see each other for any replication factor. Writes and
//! deletes carry client-side timestamps from a monotonic clock, so that of two requests of one
//! store the later always wins (Cassandra orders versions by timestamp, not by arrival).
//!
//! A write returns once the replicas its level requires have it in their commit logs, so
//! [`flush`](farmap_core::Store::flush) has nothing left to do. What survives a crash of
//! those replicas is the server's promise: with `commitlog_sync: periodic` (the default, every
//! 10 s) an acknowledged write may be lost if every replica that took it loses power within
//! the period; `commitlog_sync: batch` or `group` makes the acknowledgement wait for the disk.
//! So the store claims [`Caps::FLUSH`](farmap_core::Caps::FLUSH) (a flush makes writes
//! durable) only when the node it asks at opening reports `batch` or `group` in
//! `system_views.settings` (Cassandra 4.0 and later); otherwise it does not (an NBD export of
//! it offers no FLUSH/FUA), and says why in an `info` log line.
//! Replication (`replication=3` with quorum) is what keeps data through the loss of one node.
//!
//! # Performance
//! Requests are prepared once, routed to a replica of their partition (token-aware), and many
//! run at once over each connection: a store is meant to be read by a Puller's many workers.
//! Chunks are at most 1 MiB (`chunk=` larger is refused when the spec is parsed): larger
//! cells hurt Cassandra's heap and latency. The chunk table is created without compression:
//! a read then costs the server no decompression and checksum pass over the blob (managed
//! reads of a 256 MiB region on one Cassandra 5 node, 2 shared cores: ≈ 430–510 MB/s without,
//! ≈ 340–410 MB/s with LZ4; direct reads ≈ 115–155 MB/s either way). Chunks that are all
//! zeros after a trim take no space at all; `ALTER TABLE ... WITH compression` turns it on
//! for data that compresses well.
//!
//! Measured here with `examples/read_bench.rs` (release build; the machine shared with other
//! work, so ±30%): 64 KiB chunks, direct read (one request at a time, in order) 115–155
//! MB/s, managed read (`Cached` + `Puller`, 32–128 workers) 430–510 MB/s: 3.2–4×. With 1 MiB
//! chunks: direct ≈ 250–290 MB/s, managed ≈ 430–520 MB/s.
//!
//! # Errors
//! An unreachable node is [`Unavailable`](farmap_core::ErrorKind::Unavailable) ("cannot
//! connect to 127.0.0.1:9042 (no node answers)"); refused credentials are `PermissionDenied`;
//! a missing keyspace, table or region is `NotFound`, saying to add `create=true`.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod config;
mod error;
mod objects;
mod schema;
mod session;
mod store;

pub use config::{
    CqlConsistency, CqlSpec, CqlSpecError, CqlTarget, DEFAULT_PORT, DEFAULT_REGION, DEFAULT_TABLE,
    MAX_CQL_CHUNK, OPTIONS, PASSWORD_ENV,
};
pub use objects::{CqlObjects, MAX_OBJECT_LEN};
pub use store::{commitlog_sync_is_durable, CqlStore};
