//! Store specs: how a user names a store on the command line or in configuration.
//!
//! | spec | store |
//! |---|---|
//! | `memory:256MiB` | sparse memory, 256 MiB |
//! | `file:./disk.img` | an existing file; its length is the region size |
//! | `file:./disk.img?size=1GiB` | a file, created sparse if missing (an existing file must be 1 GiB) |
//! | `dir:./chunks?size=1GiB` | a directory with one file per chunk (created if missing) |
//! | `farmap://host:7400` | a region served by `farmap serve` (TCP) |
//! | `farmaps://host:7400?ca=ca.pem` | the same over TLS; `cert=`/`key=` for mutual TLS, `name=` |
//! | `farmap+unix:/run/farmap.sock` | a region served on a Unix socket |
//! | `cql://127.0.0.1:9042/ks?table=t&region=vm1&size=1GiB&create=true` | rows of a Cassandra/ScyllaDB table ([`farmap_cql`]) |
//! | `redis://[user:pass@]host:6379/0?size=1GiB&prefix=vm1` | Redis: one key per chunk (`prefix:N`) |
//! | `rediss://host:6380/0?size=1GiB&ca=ca.pem` | Redis over TLS |
//! | `redis+cluster://h1:7000,h2:7001/?size=1GiB` | a Redis Cluster, from any seed nodes |
//! | `s3://bucket/vm1?endpoint=http://127.0.0.1:9000&size=1GiB` | one object per chunk in an S3 bucket (AWS, MinIO...); see [`farmap_s3`] |
//! | `nbd://host:10809/export` | an NBD server's export (nbdkit, qemu-nbd, `farmap serve --nbd`); see [`farmap_nbd::client`] |
//! | `nbds://host/export?ca=ca.pem` | the same over TLS (STARTTLS); `cert=`/`key=` for client certificates |
//! | `nbd+unix:///export?socket=/run/nbd.sock` | an NBD export on a Unix socket (`nbds+unix://` with TLS) |
//! | `mirror:(PRIMARY)(MIRROR)?policy=both` | every write to both stores; reads fail over to the mirror; a recovered primary is resynced ([`farmap_pipeline::mirrored`]) |
//! | `verified:(SPEC)` | checksums and generations for every chunk of SPEC, kept at its end ([`farmap_pipeline::verified`]); bad chunks are refused |
//!
//! Stage specs name the stores they wrap whole, in parentheses ([`stage`]); the stage's
//! own options follow the last parenthesis.
//!
//! Options go after `?`, separated by `&`: `size=` (region size), `chunk=` (chunk size, a power
//! of two from 4KiB to 4MiB, default 64KiB), `ro` (read-only; file and dir), `max-open=`
//! (open file handles kept by a dir store). Sizes take binary suffixes: KiB, MiB, GiB, TiB, PiB
//! (K, M, G, T, P mean the same); a region has at most
//! [`MAX_CHUNKS`](farmap_core::MAX_CHUNKS) chunks, so `memory:1PiB` is refused (use
//! `chunk=4MiB`). Durations need a unit ([`farmap_core::parse_duration`]).
//!
//! Remote stores take their size and chunk size from the server. Their options:
//! `connections=` (pool size), `timeout=` (per request: `500ms`, `30s`, `2m`), and for
//! `farmaps://`: `ca=` (PEM file of the CA that signed the server's certificate; required),
//! `cert=` and `key=` (the client's certificate and key, for servers that require one), and
//! `name=` (the name the server's certificate must carry; default: the host).
//! Remote stores are opened with [`open_store_async`].
//!
//! `cql://[user[:pass]@]host:port[,host:port]/keyspace` keeps a region in a CQL table, one row
//! per chunk; its options (`table`, `region`, `size`, `chunk` up to 1MiB, `consistency`,
//! `create`, `replication`, `connections`, `timeout`, `ro`) are described in [`farmap_cql`].
//! An existing region's size comes from the table; `size=` is needed only to create one.
//! Redis stores (`redis://`, `rediss://`, `redis+cluster://`) need `size=` only to create a
//! region; its geometry is recorded under `<prefix>:meta` and checked on later opens. Their
//! options: `prefix=` (default `farmap`), `connections=`, `timeout=`, `flush=none|wait|fsync`
//! (`replicas=` for `wait`), and `ca=` for `rediss://`; see [`farmap_redis`].
//! `s3://BUCKET/PREFIX` takes `size=` and `chunk=` (needed only to create a region; checked
//! against the stored one otherwise), `ro`, `endpoint=` (the server's URL; default AWS or
//! `AWS_ENDPOINT_URL`), `region=`, `profile=` (of `~/.aws/credentials`), `connections=`
//! (requests in flight), `timeout=` and `retries=`. Credentials come from the standard AWS
//! environment variables or profile files, never from the spec ([`farmap_s3::config`]).
//! NBD specs use the URI forms of libnbd and qemu (`nbd://HOST[:PORT]/EXPORT`, port 10809 by
//! default; the export name is the path without its leading `/`, percent-decoded). The
//! export's size is the region size; their options: `chunk=` (a multiple of the server's
//! minimum block size), `ro`, `connections=` (used only when the server offers
//! CAN_MULTI_CONN; default 4 then), `timeout=` (per request and per connection attempt),
//! `socket=` (for `+unix`), and for `nbds`: `ca=`, `cert=`, `key=`, `name=` as for
//! `farmaps://`, or libnbd's `tls-certificates=DIR` (`ca-cert.pem`, and `client-cert.pem` +
//! `client-key.pem` when present).

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use farmap_core::{format_size, parse_size, Geometry, SizeError, Store, StoreError};
use farmap_cql::{CqlSpec, CqlStore, CqlTarget};
use farmap_grpc::{GrpcClientOptions, GrpcStore};
use farmap_net::{RemoteAddr, RemoteStore, TlsClientConfig};
use farmap_s3::{S3Location, S3Options, S3Store};
use remote::RemoteOptions;

mod blocking;
mod nbd;
mod remote;
pub mod stage;
mod tier;

pub use blocking::open_store_blocking;
use farmap_store::{DirOptions, DirStore, FileOptions, FileStore, MemoryStore};
pub use tier::{map_path as tier_map_path, TierSpec};

/// The schemes farmap knows, for error messages.
const KNOWN: &str = "memory, file, dir, farmap, farmaps, farmap+unix, farmap+grpc, redis, rediss, \
                     redis+cluster, s3, cql, nbd, nbds, nbd+unix, nbds+unix, tier, verified, mirror";

/// Why a store spec could not be understood. Each message is one line naming the problem.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SpecError {
    /// A `tier:` spec that does not parse.
    #[error("tiered store spec {spec:?}: {reason}")]
    Tier {
        /// The spec as given.
        spec: String,
        /// What is wrong with it.
        reason: String,
    },
    /// No `scheme:` prefix.
    #[error("store spec {spec:?} has no scheme: write it as memory:SIZE, file:PATH or dir:PATH")]
    NoScheme {
        /// The spec as given.
        spec: String,
    },
    /// A scheme farmap does not know.
    #[error("unknown store scheme {scheme:?} in {spec:?} (known: {KNOWN})")]
    UnknownScheme {
        /// The scheme as given.
        scheme: String,
        /// The spec as given.
        spec: String,
    },
    /// A size or chunk size that does not parse.
    #[error("{what} in {spec:?}: {source}")]
    BadSize {
        /// Which value (`size`, `chunk`...).
        what: &'static str,
        /// The spec as given.
        spec: String,
        /// The parse error.
        #[source]
        source: SizeError,
    },
    /// A chunk size that is not a power of two from 4 KiB to 4 MiB.
    #[error("chunk size {chunk} in {spec:?} is not a power of two from 4KiB to 4MiB")]
    BadChunk {
        /// The chunk size asked for.
        chunk: String,
        /// The spec as given.
        spec: String,
    },
    /// Two different sizes for the same store.
    #[error("conflicting sizes in {spec:?}: {first} and {second}")]
    ConflictingSize {
        /// The spec as given.
        spec: String,
        /// One size.
        first: String,
        /// The other.
        second: String,
    },
    /// A store that needs a size got none.
    #[error("{spec:?} needs a size: write {hint}")]
    MissingSize {
        /// The spec as given.
        spec: String,
        /// How to give one.
        hint: String,
    },
    /// An option the scheme does not take.
    #[error("unknown option {option:?} in {spec:?} (this scheme takes: {takes})")]
    UnknownOption {
        /// The option as given.
        option: String,
        /// The spec as given.
        spec: String,
        /// The options the scheme takes.
        takes: &'static str,
    },
    /// An option given a value it cannot take.
    #[error("bad value for {option} in {spec:?}: {reason}")]
    BadOption {
        /// The option name.
        option: &'static str,
        /// The spec as given.
        spec: String,
        /// What is wrong.
        reason: String,
    },
    /// An empty path.
    #[error("{spec:?} names no path")]
    EmptyPath {
        /// The spec as given.
        spec: String,
    },
    /// A remote spec whose address is not `//host:port`.
    #[error("{spec:?} names no server: write {hint}")]
    BadAddress {
        /// The spec as given.
        spec: String,
        /// How to write it.
        hint: &'static str,
    },
    /// An option the spec cannot do without.
    #[error("{spec:?} needs {option}=: {why}")]
    MissingOption {
        /// The option.
        option: &'static str,
        /// The spec as given.
        spec: String,
        /// What it is for.
        why: &'static str,
    },
    /// A `cql://` spec that does not parse.
    #[error("bad cql spec {spec:?}: {reason}")]
    Cql {
        /// The spec as given.
        spec: String,
        /// What is wrong (a [`farmap_cql::CqlSpecError`]'s message).
        reason: String,
    },
}

/// Why a store could not be opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// The store refused: missing file, conflicting size on disk, permissions...
    #[error("cannot open {spec}")]
    Store {
        /// The spec, displayed.
        spec: String,
        /// What the store said.
        #[source]
        source: StoreError,
    },
    /// A remote spec given to the synchronous [`open_store`].
    #[error("cannot open {spec} without an async runtime: remote stores are opened with open_store_async")]
    NeedsAsync {
        /// The spec, displayed.
        spec: String,
    },
    /// The geometry is invalid.
    #[error("cannot open {spec}: {source}")]
    Geometry {
        /// The spec, displayed.
        spec: String,
        /// What is wrong with it.
        #[source]
        source: farmap_core::GeometryError,
    },
}

/// Which store a spec names, with its scheme-specific settings.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SpecKind {
    /// Sparse memory.
    Memory,
    /// One file.
    File {
        /// Path of the file.
        path: PathBuf,
    },
    /// A directory with one file per chunk.
    Dir {
        /// Path of the directory.
        path: PathBuf,
        /// Open file handles kept, if set.
        max_open_files: Option<usize>,
    },
    /// A region served by a farmap server (`farmap://`, `farmaps://`, `farmap+unix:`).
    Remote {
        /// The server.
        addr: RemoteAddr,
        /// TLS settings (`farmaps://`).
        tls: Option<TlsClientConfig>,
        /// Connections in the pool, if set.
        connections: Option<usize>,
        /// Deadline of each request, if set.
        timeout: Option<Duration>,
    },
    /// A region served over gRPC (`farmap+grpc://HOST:PORT`, `farmap serve --grpc`).
    Grpc {
        /// `host:port` of the server.
        addr: String,
        /// HTTP/2 connections, if set.
        connections: Option<usize>,
        /// Deadline of each request, if set.
        timeout: Option<Duration>,
    },
    /// Rows of a Cassandra or ScyllaDB table (`cql://host:port/keyspace?table=..&region=..`).
    Cql(Box<CqlTarget>),
    /// A region in Redis or a Redis Cluster (`redis://`, `rediss://`, `redis+cluster://`).
    Redis(farmap_redis::RedisConfig),
    /// A region in an S3 bucket (`s3://BUCKET/PREFIX?endpoint=...`), one object per chunk.
    S3 {
        /// Bucket, prefix and how to reach them.
        location: S3Location,
    },
    /// An NBD server's export (`nbd://`, `nbds://`, `nbd+unix://`, `nbds+unix://`).
    Nbd {
        /// Server, export and TLS.
        target: farmap_nbd::NbdTarget,
        /// Connections, if set (used only when the server offers CAN_MULTI_CONN).
        connections: Option<usize>,
        /// Deadline of each request and connection attempt, if set.
        timeout: Option<Duration>,
    },
    /// A tiered store over other stores (`tier:(SPEC?cap=SIZE)(SPEC)...`).
    Tier(Box<TierSpec>),
    /// Checksums for every chunk of another store (`verified:(SPEC)`), kept at its end.
    Verified {
        /// The store holding the data and the checksums.
        inner: Box<StoreSpec>,
    },
    /// A primary and a mirror store (`mirror:(PRIMARY)(MIRROR)?policy=..`).
    Mirror {
        /// Serves reads while it is up.
        primary: Box<StoreSpec>,
        /// Takes every write; serves reads while the primary is down.
        mirror: Box<StoreSpec>,
        /// Policy, timeout, backlog, probe interval.
        options: farmap_pipeline::MirrorOptions,
    },
}

/// A parsed store spec. `Display` gives it back in canonical form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreSpec {
    /// The store.
    pub kind: SpecKind,
    /// Region size, if the spec gives one.
    pub size: Option<u64>,
    /// Chunk size, if the spec gives one.
    pub chunk_size: Option<u32>,
    /// Open read-only.
    pub read_only: bool,
}

impl StoreSpec {
    /// The chunk size this spec will use.
    pub fn chunk_size_or_default(&self) -> u32 {
        self.chunk_size.unwrap_or(farmap_core::DEFAULT_CHUNK_SIZE)
    }

    /// The path of a file or dir store.
    pub fn path(&self) -> Option<&Path> {
        match &self.kind {
            SpecKind::Memory
            | SpecKind::Remote { .. }
            | SpecKind::Grpc { .. }
            | SpecKind::Cql(_)
            | SpecKind::Redis(_)
            | SpecKind::S3 { .. }
            | SpecKind::Nbd { .. }
            | SpecKind::Tier(_) => None,
            SpecKind::Verified { inner } => inner.path(),
            SpecKind::Mirror { primary, .. } => primary.path(),
            SpecKind::File { path } | SpecKind::Dir { path, .. } => Some(path),
        }
    }

    /// Whether opening this spec would create something new (a memory store, or a file or
    /// directory store whose path does not exist yet). A remote store is never created; a
    /// `cql://` region may be, when the spec says `create=true`. A Redis region may be: it is
    /// created when its record is missing (and an existing record must match a size given
    /// anyway), so this says yes. An S3 region may be, but only the server can tell: this
    /// says `false`.
    pub fn creates(&self) -> bool {
        match &self.kind {
            SpecKind::Remote { .. }
            | SpecKind::Grpc { .. }
            | SpecKind::S3 { .. }
            | SpecKind::Nbd { .. } => false,
            SpecKind::Cql(t) => t.create,
            SpecKind::Redis(_) => true,
            SpecKind::Tier(t) => t.tiers.iter().any(|(s, _)| s.creates()),
            SpecKind::Verified { inner } => inner.creates(),
            SpecKind::Mirror {
                primary, mirror, ..
            } => primary.creates() || mirror.creates(),
            _ => self.path().is_none_or(|p| !p.exists()),
        }
    }

    /// Whether this spec names a store on another host (opened with [`open_store_async`]).
    pub fn is_remote(&self) -> bool {
        match &self.kind {
            SpecKind::Verified { inner } => inner.is_remote(),
            SpecKind::Tier(t) => t.tiers.iter().any(|(s, _)| s.is_remote()),
            SpecKind::Mirror {
                primary, mirror, ..
            } => primary.is_remote() || mirror.is_remote(),
            kind => matches!(
                kind,
                SpecKind::Remote { .. }
                    | SpecKind::Grpc { .. }
                    | SpecKind::Cql(_)
                    | SpecKind::Redis(_)
                    | SpecKind::S3 { .. }
                    | SpecKind::Nbd { .. }
            ),
        }
    }

    /// Whether this spec is a stage over other specs (`verified:(SPEC)`).
    pub fn is_stage(&self) -> bool {
        matches!(
            self.kind,
            SpecKind::Verified { .. } | SpecKind::Mirror { .. }
        )
    }

    /// Whether opening this spec needs an async runtime ([`open_store_async`]): remote
    /// stores and stages (which read their metadata when opened).
    pub fn needs_async(&self) -> bool {
        self.is_remote() || self.is_stage() || matches!(self.kind, SpecKind::Tier(_))
    }

    /// Opens the spec read-only where that means something (file and dir stores, also under
    /// stages), for commands that only look.
    pub fn set_read_only_where_possible(&mut self) {
        match &mut self.kind {
            SpecKind::Verified { inner } => inner.set_read_only_where_possible(),
            // A mirror's stores take writes from resync; left as they are.
            SpecKind::Mirror { .. } => {}
            _ => {
                if self.path().is_some() {
                    self.read_only = true;
                }
            }
        }
    }

    /// Sets the size when the spec has none and would create its store (used by `cp` so that
    /// `farmap cp SRC file:./new.img` takes the source's size).
    pub fn default_size_for_new(&mut self, size: u64) {
        if self.size.is_none() && self.creates() {
            self.size = Some(size);
        }
    }
}

fn parse_chunk(value: &str, spec: &str) -> Result<u32, SpecError> {
    let bytes = parse_size(value).map_err(|source| SpecError::BadSize {
        what: "chunk size",
        spec: spec.to_owned(),
        source,
    })?;
    let ok = bytes.is_power_of_two()
        && (u64::from(farmap_core::MIN_CHUNK_SIZE)..=u64::from(farmap_core::MAX_CHUNK_SIZE))
            .contains(&bytes);
    if !ok {
        return Err(SpecError::BadChunk {
            chunk: value.to_owned(),
            spec: spec.to_owned(),
        });
    }
    Ok(bytes as u32)
}

fn set_size(slot: &mut Option<u64>, value: &str, spec: &str) -> Result<(), SpecError> {
    let bytes = parse_size(value).map_err(|source| SpecError::BadSize {
        what: "size",
        spec: spec.to_owned(),
        source,
    })?;
    if bytes == 0 {
        return Err(SpecError::BadOption {
            option: "size",
            spec: spec.to_owned(),
            reason: "a region cannot be empty".into(),
        });
    }
    match *slot {
        Some(prev) if prev != bytes => Err(SpecError::ConflictingSize {
            spec: spec.to_owned(),
            first: format_size(prev),
            second: format_size(bytes),
        }),
        _ => {
            *slot = Some(bytes);
            Ok(())
        }
    }
}

impl FromStr for StoreSpec {
    type Err = SpecError;

    fn from_str(spec: &str) -> Result<Self, SpecError> {
        Self::parse_nested(spec, 0)
    }
}

impl StoreSpec {
    /// Parses a spec found `depth` stages deep.
    fn parse_nested(spec: &str, depth: usize) -> Result<Self, SpecError> {
        let (scheme, rest) = spec.split_once(':').ok_or_else(|| SpecError::NoScheme {
            spec: spec.to_owned(),
        })?;
        if scheme.eq_ignore_ascii_case("tier") {
            return tier::parse(spec, rest);
        }
        if stage::is_stage(&scheme.to_ascii_lowercase()) {
            return stage::parse(&scheme.to_ascii_lowercase(), rest, spec, depth);
        }
        if scheme.eq_ignore_ascii_case("cql") {
            let cql: CqlSpec =
                spec.parse()
                    .map_err(|e: farmap_cql::CqlSpecError| SpecError::Cql {
                        spec: spec.to_owned(),
                        reason: e.to_string(),
                    })?;
            return Ok(StoreSpec {
                kind: SpecKind::Cql(Box::new(cql.target)),
                size: cql.size,
                chunk_size: cql.chunk_size,
                read_only: cql.read_only,
            });
        }
        let (body, query) = match rest.split_once('?') {
            Some((b, q)) => (b, Some(q)),
            None => (rest, None),
        };
        let mut size = None;
        let mut chunk_size = None;
        let mut read_only = false;
        let mut max_open_files = None;
        let mut remote = RemoteOptions::default();
        let mut redis_opts: Vec<(&str, &str)> = Vec::new();
        let mut s3_options = Vec::new();
        let mut nbd_opts = nbd::NbdOptions::default();
        let scheme_lc = scheme.to_ascii_lowercase();
        let takes = match scheme_lc.as_str() {
            s if nbd::takes(s).is_some() => nbd::takes(s).expect("checked"),
            "memory" | "mem" => "size, chunk",
            "file" => "size, chunk, ro",
            "dir" => "size, chunk, ro, max-open",
            "farmap" | "farmap+unix" | "farmap+grpc" => "connections, timeout",
            "farmaps" => "ca, cert, key, name, connections, timeout",
            "redis" | "redis+cluster" => {
                "size, chunk, prefix, connections, timeout, flush, replicas"
            }
            "rediss" => "size, chunk, prefix, connections, timeout, flush, replicas, ca",
            "s3" => "size, chunk, ro, endpoint, region, profile, connections, timeout, retries",
            _ => {
                return Err(SpecError::UnknownScheme {
                    scheme: scheme.to_owned(),
                    spec: spec.to_owned(),
                })
            }
        };
        for pair in query
            .into_iter()
            .flat_map(|q| q.split('&'))
            .filter(|p| !p.is_empty())
        {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let allowed = takes.split(", ").any(|k| k == key);
            if !allowed {
                return Err(SpecError::UnknownOption {
                    option: key.to_owned(),
                    spec: spec.to_owned(),
                    takes,
                });
            }
            if scheme_lc.starts_with("redis") && key != "size" && key != "chunk" {
                redis_opts.push((key, value));
                continue;
            }
            if scheme_lc == "s3" && farmap_s3::OPTIONS.split(", ").any(|k| k == key) {
                s3_options.push((key, value));
                continue;
            }
            match key {
                "size" => set_size(&mut size, value, spec)?,
                "chunk" => chunk_size = Some(parse_chunk(value, spec)?),
                "ro" => {
                    read_only = match value {
                        "" | "1" | "true" | "yes" => true,
                        "0" | "false" | "no" => false,
                        _ => {
                            return Err(SpecError::BadOption {
                                option: "ro",
                                spec: spec.to_owned(),
                                reason: format!("{value:?} is not true or false"),
                            })
                        }
                    }
                }
                "max-open" => {
                    let n: usize = value.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
                        SpecError::BadOption {
                            option: "max-open",
                            spec: spec.to_owned(),
                            reason: format!("{value:?} is not a positive whole number"),
                        }
                    })?;
                    max_open_files = Some(n);
                }
                "connections" | "timeout" | "ca" | "cert" | "key" | "name" => {
                    remote.set(key, value, spec)?
                }
                "socket" | "tls-certificates" => nbd_opts.set(key, value, spec)?,
                _ => unreachable!("checked against the scheme's options"),
            }
        }
        let path = || {
            if body.is_empty() {
                Err(SpecError::EmptyPath {
                    spec: spec.to_owned(),
                })
            } else {
                Ok(PathBuf::from(body))
            }
        };
        let kind = match scheme_lc.as_str() {
            "memory" | "mem" => {
                if !body.is_empty() {
                    set_size(&mut size, body, spec)?;
                }
                if size.is_none() {
                    return Err(SpecError::MissingSize {
                        spec: spec.to_owned(),
                        hint: "memory:256MiB".into(),
                    });
                }
                SpecKind::Memory
            }
            "file" => SpecKind::File { path: path()? },
            "farmap" | "farmaps" | "farmap+unix" => remote.into_kind(&scheme_lc, body, spec)?,
            "nbd" | "nbds" | "nbd+unix" | "nbds+unix" => {
                nbd::into_kind(&scheme_lc, body, remote, nbd_opts, spec)?
            }
            "farmap+grpc" => match remote.into_kind("farmap", body, spec)? {
                SpecKind::Remote {
                    addr: RemoteAddr::Tcp(addr),
                    connections,
                    timeout,
                    ..
                } => SpecKind::Grpc {
                    addr,
                    connections,
                    timeout,
                },
                _ => unreachable!("farmap:// always parses to a TCP address"),
            },
            "redis" | "rediss" | "redis+cluster" => SpecKind::Redis(
                farmap_redis::RedisConfig::parse(&scheme_lc, body, &redis_opts).map_err(
                    |e| match e {
                        farmap_redis::RedisSpecError::BadAddress { hint, .. } => {
                            SpecError::BadAddress {
                                spec: spec.to_owned(),
                                hint,
                            }
                        }
                        farmap_redis::RedisSpecError::BadOption { option, reason } => {
                            SpecError::BadOption {
                                option,
                                spec: spec.to_owned(),
                                reason,
                            }
                        }
                        other => SpecError::BadOption {
                            option: "spec",
                            spec: spec.to_owned(),
                            reason: other.to_string(),
                        },
                    },
                )?,
            ),
            "s3" => {
                let bad = |e: farmap_s3::S3SpecError| SpecError::BadOption {
                    option: e.option,
                    spec: spec.to_owned(),
                    reason: e.reason,
                };
                let mut location = S3Location::parse(body).map_err(bad)?;
                for (key, value) in s3_options {
                    location.set(key, value).map_err(bad)?;
                }
                SpecKind::S3 { location }
            }
            _ => SpecKind::Dir {
                path: path()?,
                max_open_files,
            },
        };
        if let Some(size) = size {
            // Refuse an impossible region now, with the reason (too many chunks: memory:1PiB),
            // rather than when it is opened.
            let chunk = u64::from(chunk_size.unwrap_or(farmap_core::DEFAULT_CHUNK_SIZE));
            Geometry::new_bounded(size, chunk).map_err(|e| SpecError::BadOption {
                option: "size",
                spec: spec.to_owned(),
                reason: e.to_string(),
            })?;
        }
        Ok(StoreSpec {
            kind,
            size,
            chunk_size,
            read_only,
        })
    }
}

impl fmt::Display for StoreSpec {
    /// The spec as people see it: passwords as `***` (see [`StoreSpec::to_secret_string`]).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write(f, false)
    }
}

impl StoreSpec {
    /// The spec with its passwords, so that it opens the store again where it is parsed (a
    /// region handed to another process). Keep it out of logs and messages: `Display` shows
    /// passwords as `***`.
    pub fn to_secret_string(&self) -> String {
        struct Secret<'a>(&'a StoreSpec);
        impl fmt::Display for Secret<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.write(f, true)
            }
        }
        Secret(self).to_string()
    }

    fn write(&self, f: &mut fmt::Formatter<'_>, secrets: bool) -> fmt::Result {
        let mut opts = Vec::new();
        match &self.kind {
            SpecKind::Tier(t) => return tier::write(t, f, secrets),
            SpecKind::Memory => write!(f, "memory:{}", format_size(self.size.unwrap_or(0)))?,
            SpecKind::File { path } => {
                write!(f, "file:{}", path.display())?;
                if let Some(s) = self.size {
                    opts.push(format!("size={}", format_size(s)));
                }
            }
            SpecKind::Dir {
                path,
                max_open_files,
            } => {
                write!(f, "dir:{}", path.display())?;
                if let Some(s) = self.size {
                    opts.push(format!("size={}", format_size(s)));
                }
                if let Some(n) = max_open_files {
                    opts.push(format!("max-open={n}"));
                }
            }
            SpecKind::Remote {
                addr,
                tls,
                connections,
                timeout,
            } => {
                let (head, remote_opts) = remote::display_parts(addr, tls, *connections, *timeout);
                f.write_str(&head)?;
                opts = remote_opts;
            }
            SpecKind::Grpc {
                addr,
                connections,
                timeout,
            } => {
                let tcp = RemoteAddr::Tcp(addr.clone());
                let (_, remote_opts) = remote::display_parts(&tcp, &None, *connections, *timeout);
                write!(f, "farmap+grpc://{addr}")?;
                opts = remote_opts;
            }
            SpecKind::Cql(target) => {
                // The password as `***` unless asked for, as for Redis.
                f.write_str(&if secrets {
                    target.base()
                } else {
                    target.shown()
                })?;
                opts = target.options();
                if let Some(s) = self.size {
                    opts.push(format!("size={}", format_size(s)));
                }
            }
            SpecKind::Redis(config) => {
                let (head, redis_opts) = if secrets {
                    config.display_parts_with_password()
                } else {
                    config.display_parts()
                };
                f.write_str(&head)?;
                if let Some(s) = self.size {
                    opts.push(format!("size={}", format_size(s)));
                }
                opts.extend(redis_opts);
            }
            SpecKind::Nbd {
                target,
                connections,
                timeout,
            } => {
                let (head, nbd_opts) = nbd::display_parts(target, *connections, *timeout);
                f.write_str(&head)?;
                opts = nbd_opts;
            }
            SpecKind::Verified { inner } => {
                f.write_str("verified:(")?;
                inner.write(f, secrets)?;
                f.write_str(")")?;
            }
            SpecKind::Mirror {
                primary,
                mirror,
                options,
            } => {
                f.write_str("mirror:(")?;
                primary.write(f, secrets)?;
                f.write_str(")(")?;
                mirror.write(f, secrets)?;
                f.write_str(")")?;
                opts = stage::mirror_options(options);
            }
            SpecKind::S3 { location } => {
                let (head, s3_opts) = location.display_parts();
                f.write_str(&head)?;
                opts = s3_opts;
                if let Some(s) = self.size {
                    opts.push(format!("size={}", format_size(s)));
                }
            }
        }
        if let Some(c) = self.chunk_size {
            opts.push(format!("chunk={}", format_size(u64::from(c))));
        }
        if self.read_only {
            opts.push("ro".into());
        }
        if !opts.is_empty() {
            write!(f, "?{}", opts.join("&"))?;
        }
        Ok(())
    }
}

/// Turns a store's error while opening `spec` into an [`OpenError`] naming the spec.
fn store_error(spec: &StoreSpec) -> impl Fn(farmap_core::StoreError) -> OpenError + Copy + '_ {
    move |source| OpenError::Store {
        spec: spec.to_string(),
        source,
    }
}

/// Opens (or creates) the store a spec names: any spec, local or remote (a remote store
/// connects now; its failure to connect is the error).
pub async fn open_store_async(spec: &StoreSpec) -> Result<Arc<dyn Store>, OpenError> {
    match &spec.kind {
        SpecKind::Remote {
            addr,
            tls,
            connections,
            timeout,
        } => {
            let opts = remote::client_options(tls, *connections, *timeout);
            let store = RemoteStore::connect(addr.clone(), opts)
                .await
                .map_err(store_error(spec))?;
            Ok(Arc::new(store))
        }
        SpecKind::Grpc {
            addr,
            connections,
            timeout,
        } => {
            let mut opts = GrpcClientOptions::default();
            if let Some(n) = connections {
                opts.connections = *n;
            }
            if let Some(t) = timeout {
                opts.request_timeout = Some(*t);
            }
            let store = GrpcStore::connect_with(&format!("http://{addr}"), opts)
                .await
                .map_err(store_error(spec))?;
            Ok(Arc::new(store))
        }
        SpecKind::Cql(target) => {
            let cql = CqlSpec {
                target: (**target).clone(),
                size: spec.size,
                chunk_size: spec.chunk_size,
                read_only: spec.read_only,
            };
            // The password stays out of the message.
            let shown = StoreSpec {
                kind: SpecKind::Cql(Box::new(CqlTarget {
                    password: None,
                    ..(**target).clone()
                })),
                ..spec.clone()
            };
            let store = CqlStore::open(&cql)
                .await
                .map_err(|source| OpenError::Store {
                    spec: shown.to_string(),
                    source,
                })?;
            Ok(Arc::new(store))
        }
        SpecKind::Redis(config) => {
            let store = farmap_redis::RedisStore::open(config, spec.size, spec.chunk_size)
                .await
                .map_err(store_error(spec))?;
            Ok(Arc::new(store))
        }
        SpecKind::S3 { location } => {
            let store = S3Store::open(S3Options {
                location: location.clone(),
                size: spec.size,
                chunk_size: spec.chunk_size,
                read_only: spec.read_only,
            })
            .await
            .map_err(store_error(spec))?;
            Ok(Arc::new(store))
        }
        SpecKind::Nbd {
            target,
            connections,
            timeout,
        } => {
            let opts = nbd::client_options(spec.chunk_size, spec.read_only, *connections, *timeout);
            let store = farmap_nbd::NbdStore::connect(target.clone(), opts)
                .await
                .map_err(store_error(spec))?;
            Ok(Arc::new(store))
        }
        SpecKind::Tier(t) => tier::open(spec, t).await,
        SpecKind::Verified { inner } => {
            let store = Box::pin(open_store_async(inner)).await?;
            let verified = farmap_pipeline::Verified::open(store, None)
                .await
                .map_err(store_error(spec))?;
            Ok(Arc::new(verified))
        }
        SpecKind::Mirror {
            primary,
            mirror,
            options,
        } => Ok(Arc::new(
            open_mirror(spec, primary, mirror, *options).await?,
        )),
        _ => open_store(spec),
    }
}

/// Opens both stores of a `mirror:` spec and the stage over them (on the current runtime,
/// which runs its resync and backlog tasks).
pub async fn open_mirror(
    spec: &StoreSpec,
    primary: &StoreSpec,
    mirror: &StoreSpec,
    options: farmap_pipeline::MirrorOptions,
) -> Result<farmap_pipeline::Mirrored, OpenError> {
    let p = Box::pin(open_store_async(primary)).await?;
    let m = Box::pin(open_store_async(mirror)).await?;
    farmap_pipeline::Mirrored::new(p, m, options).map_err(store_error(spec))
}

/// Opens (or creates) the local store a spec names; remote and stage specs need
/// [`open_store_async`] (or [`open_store_blocking`]).
pub fn open_store(spec: &StoreSpec) -> Result<Arc<dyn Store>, OpenError> {
    let chunk = spec.chunk_size_or_default();
    let store_err = store_error(spec);
    Ok(match &spec.kind {
        SpecKind::Memory => {
            let size = spec.size.expect("memory specs always carry a size");
            let g =
                Geometry::new(size, u64::from(chunk)).map_err(|source| OpenError::Geometry {
                    spec: spec.to_string(),
                    source,
                })?;
            Arc::new(MemoryStore::new(g))
        }
        SpecKind::File { path } => Arc::new(
            FileStore::open(
                path,
                FileOptions {
                    size: spec.size,
                    chunk_size: chunk,
                    read_only: spec.read_only,
                },
            )
            .map_err(store_err)?,
        ),
        SpecKind::Dir {
            path,
            max_open_files,
        } => {
            let mut opts = DirOptions {
                size: spec.size,
                chunk_size: spec.chunk_size,
                read_only: spec.read_only,
                ..DirOptions::default()
            };
            if let Some(n) = max_open_files {
                opts.max_open_files = *n;
            }
            Arc::new(DirStore::open(path, opts).map_err(store_err)?)
        }
        SpecKind::Remote { .. }
        | SpecKind::Grpc { .. }
        | SpecKind::Cql(_)
        | SpecKind::Redis(_)
        | SpecKind::S3 { .. }
        | SpecKind::Nbd { .. }
        | SpecKind::Tier(_)
        | SpecKind::Verified { .. }
        | SpecKind::Mirror { .. } => {
            return Err(OpenError::NeedsAsync {
                spec: spec.to_string(),
            })
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<StoreSpec, SpecError> {
        s.parse()
    }

    /// The property the `store_spec` fuzz target checks, on inputs picked to be awkward.
    #[test]
    fn the_secret_form_keeps_passwords_and_display_hides_them() {
        for (text, password) in [
            ("redis://u:pa@ss:w@127.0.0.1:6379/2?size=1MiB", "pa@ss:w"),
            ("rediss://:pw@h:1/0?size=1MiB&prefix=p", "pw"),
            ("redis+cluster://:pw@h:1,h:2/?size=1MiB", "pw"),
            ("cql://u:p%3Aw@h:1/ks?table=t&size=1MiB", "p:w"),
        ] {
            let spec: StoreSpec = text.parse().unwrap();
            let shown = spec.to_string();
            assert!(
                !shown.contains(password) && shown.contains("***"),
                "{text} shown as {shown}"
            );
            let secret = spec.to_secret_string();
            let again: StoreSpec = secret.parse().unwrap();
            assert_eq!(again, spec, "{text} → {secret}");
            assert_eq!(again.to_secret_string(), secret);
            assert_eq!(again.to_string(), shown);
        }
        // Without a password, both forms are the same.
        let plain: StoreSpec = "redis://h:1/0?size=1MiB".parse().unwrap();
        assert_eq!(plain.to_secret_string(), plain.to_string());
    }

    #[test]
    fn canonical_forms_read_back() {
        for text in [
            "memory:1G?chunk=4K",
            "mem:?size=3.5MiB",
            "file:./a&b.img?size=1GiB&ro=yes",
            "dir:/x?size=1PiB&chunk=4MiB&max-open=3&ro",
            "dir:./x?&&size=5000",
            "farmaps://h:1?ca=a&cert=c&key=k&name=n&timeout=1500ms&connections=2",
            "farmap+unix:/s?timeout=0.5s",
            "farmap+grpc://h:2?timeout=90s",
            "cql://u@h:1,h2/ks?table=t&region=r&size=3MiB&chunk=1MiB&create=true&ro",
            "cql://h/ks?consistency=one&timeout=2s&connections=3&replication=2",
            "s3://bucket/a/b?endpoint=http://127.0.0.1:9000&region=eu-west-1&profile=p&connections=8&timeout=2s&retries=3&size=64MiB&chunk=1MiB&ro",
            "s3://my.bucket?size=1GiB",
            "s3://bucket/x/?retries=0&endpoint=https://s3.example:443/",
            "nbd://h/disk%20one?chunk=1MiB&ro&connections=2&timeout=5s",
            "nbd://[::1]:7/",
            "nbds+unix:///e?socket=/s&ca=a&cert=c&key=k&name=n",
        ] {
            let spec = parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            let shown = spec.to_string();
            assert_eq!(parse(&shown), Ok(spec), "{text} -> {shown}");
        }
    }

    #[test]
    fn cql_specs() {
        let c = parse("cql://127.0.0.1:9042/ks?table=t&region=vm1&size=64MiB&create=true").unwrap();
        let SpecKind::Cql(t) = &c.kind else {
            panic!("{c:?}")
        };
        assert_eq!((t.keyspace.as_str(), t.table.as_str()), ("ks", "t"));
        assert_eq!(t.region, "vm1");
        assert_eq!(c.size, Some(64 << 20));
        assert!(c.is_remote() && c.creates() && c.path().is_none());
        assert!(matches!(open_store(&c), Err(OpenError::NeedsAsync { .. })));
        let mut without = parse("cql://h/ks?create=true").unwrap();
        without.default_size_for_new(1 << 20);
        assert_eq!(
            without.size,
            Some(1 << 20),
            "cp gives a new region the source's size"
        );
        assert!(!parse("cql://h/ks").unwrap().creates());
        // The password is not shown (as for Redis).
        let p = parse("cql://u:hunter2@h/ks?size=1MiB").unwrap();
        assert!(
            p.to_string().starts_with("cql://u:***@h:9042/ks?")
                && !p.to_string().contains("hunter2"),
            "{p}"
        );
        for (spec, want) in [
            ("cql://h/ks?chunk=4MiB", "from 4KiB to 1MiB"),
            ("cql://h/ks?ca=x", "unknown option \"ca\""),
            ("cql://h", "no keyspace"),
        ] {
            let err = parse(spec).expect_err(spec).to_string();
            assert!(
                err.contains(want) && err.contains("bad cql spec"),
                "{spec}: {err}"
            );
            assert!(!err.contains('\n'), "one-line errors: {err:?}");
        }
    }

    #[test]
    fn redis_specs() {
        let r =
            parse("redis://127.0.0.1:6379/2?size=64MiB&prefix=x&chunk=4KiB&flush=wait").unwrap();
        let SpecKind::Redis(c) = &r.kind else {
            panic!("{r:?}")
        };
        assert_eq!(c.prefix, "x");
        assert_eq!(c.flush, farmap_redis::FlushPolicy::Wait { replicas: 1 });
        assert_eq!((r.size, r.chunk_size), (Some(64 << 20), Some(4096)));
        assert!(r.is_remote() && r.creates() && r.path().is_none());
        assert_eq!(parse(&r.to_string()).unwrap(), r, "display round-trips");
        assert!(matches!(open_store(&r), Err(OpenError::NeedsAsync { .. })));
        let c = parse("redis+cluster://a:1,b:2/?size=1GiB&connections=2").unwrap();
        assert_eq!(parse(&c.to_string()).unwrap(), c);
        let t = parse("rediss://h:1/0?ca=ca.pem").unwrap();
        assert_eq!(parse(&t.to_string()).unwrap(), t);
        // The password is not shown.
        let p = parse("redis://u:hunter2@h:1/0?size=1MiB").unwrap();
        assert!(!p.to_string().contains("hunter2"), "{p}");
        for (spec, want) in [
            ("redis://h:1?ca=x", "unknown option \"ca\""),
            ("redis://h?size=1G", "names no server"),
            ("redis://h:1?flush=sometimes", "bad value for flush"),
            ("redis+cluster://a:1,b/", "names no server"),
            ("redis://h:1?bogus=1", "unknown option \"bogus\""),
        ] {
            let err = parse(spec).expect_err(spec).to_string();
            assert!(
                err.contains(want),
                "{spec}: {err:?} should contain {want:?}"
            );
        }
    }

    #[test]
    fn s3_specs() {
        let s = parse("s3://farmap-test/vm1?endpoint=http://127.0.0.1:9000&size=64MiB").unwrap();
        let SpecKind::S3 { location } = &s.kind else {
            panic!("{s:?}")
        };
        assert_eq!(location.bucket, "farmap-test");
        assert_eq!(location.prefix, "vm1");
        assert_eq!(location.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
        assert_eq!(s.size, Some(64 << 20));
        assert!(s.is_remote() && !s.creates() && s.path().is_none());
        assert_eq!(
            s.to_string(),
            "s3://farmap-test/vm1?endpoint=http://127.0.0.1:9000&size=64MiB"
        );
        assert!(matches!(open_store(&s), Err(OpenError::NeedsAsync { .. })));
        for (spec, want) in [
            ("s3:bucket/x", "write s3://BUCKET/PREFIX"),
            ("s3://", "names no bucket"),
            ("s3://B/x", "not a bucket name"),
            ("s3://bucket/a//b", "bad value for prefix"),
            ("s3://bucket/x?endpoint=ftp://h", "bad value for endpoint"),
            ("s3://bucket/x?connections=0", "bad value for connections"),
            ("s3://bucket/x?retries=many", "bad value for retries"),
            ("s3://bucket/x?secret=abc", "unknown option \"secret\""),
            ("s3://bucket/x?max-open=3", "unknown option \"max-open\""),
            ("s3://bucket/x?size=0", "cannot be empty"),
        ] {
            let err = parse(spec).expect_err(spec).to_string();
            assert!(
                err.contains(want),
                "{spec}: {err:?} should contain {want:?}"
            );
            assert!(!err.contains('\n'), "one-line errors: {err:?}");
        }
    }

    #[test]
    fn nbd_specs() {
        let n = parse("nbd://127.0.0.1:10810/disk?chunk=256KiB&connections=2&timeout=3s").unwrap();
        let SpecKind::Nbd {
            target,
            connections,
            timeout,
        } = &n.kind
        else {
            panic!("{n:?}")
        };
        assert_eq!(target.addr, RemoteAddr::Tcp("127.0.0.1:10810".into()));
        assert_eq!(target.export, "disk");
        assert!(target.tls.is_none());
        assert_eq!(
            (*connections, *timeout, n.chunk_size),
            (Some(2), Some(Duration::from_secs(3)), Some(256 << 10))
        );
        assert!(n.is_remote() && !n.creates() && n.path().is_none());
        assert!(matches!(open_store(&n), Err(OpenError::NeedsAsync { .. })));
        assert_eq!(
            n.to_string(),
            "nbd://127.0.0.1:10810/disk?connections=2&timeout=3s&chunk=256KiB"
        );
        // The default port and the default export, as libnbd writes them.
        let d = parse("nbd://example.com").unwrap();
        assert_eq!(d.to_string(), "nbd://example.com:10809/");
        let SpecKind::Nbd { target, .. } = &d.kind else {
            panic!()
        };
        assert_eq!(target.export, "");
        // Unix sockets: the export is the path, the socket an option.
        let u = parse("nbd+unix:///foo?socket=/tmp/nbd.sock").unwrap();
        let SpecKind::Nbd { target, .. } = &u.kind else {
            panic!()
        };
        assert_eq!(target.addr, RemoteAddr::Unix("/tmp/nbd.sock".into()));
        assert_eq!(target.export, "foo");
        assert_eq!(u.to_string(), "nbd+unix:///foo?socket=/tmp/nbd.sock");
        // TLS: ca= like farmaps://, or libnbd's tls-certificates=DIR.
        let t = parse("nbds://h/e?ca=ca.pem&cert=c.pem&key=k.pem").unwrap();
        let SpecKind::Nbd { target, .. } = &t.kind else {
            panic!()
        };
        let tls = target.tls.as_ref().unwrap();
        assert_eq!(
            (tls.ca.to_str(), tls.cert.as_deref(), tls.key.as_deref()),
            (
                Some("ca.pem"),
                Some(Path::new("c.pem")),
                Some(Path::new("k.pem"))
            )
        );
        let dir = tempfile::tempdir().unwrap();
        for f in ["ca-cert.pem", "client-cert.pem", "client-key.pem"] {
            std::fs::write(dir.path().join(f), "x").unwrap();
        }
        let l = parse(&format!(
            "nbds+unix:///?socket=/s&tls-certificates={}",
            dir.path().display()
        ))
        .unwrap();
        let SpecKind::Nbd { target, .. } = &l.kind else {
            panic!()
        };
        let tls = target.tls.as_ref().unwrap();
        assert_eq!(tls.ca, dir.path().join("ca-cert.pem"));
        assert_eq!(
            tls.key.as_deref(),
            Some(&*dir.path().join("client-key.pem"))
        );
        assert_eq!(parse(&l.to_string()).unwrap(), l, "display round-trips");
        for (spec, want) in [
            ("nbd:host/x", "write nbd://HOST[:PORT]/EXPORT"),
            ("nbd://:1/x", "names no server"),
            ("nbd://h:0/x", "names no server"),
            ("nbd://h/x?size=1G", "unknown option \"size\""),
            ("nbd://h/x?socket=/s", "unknown option \"socket\""),
            ("nbd://h/x?ca=a", "unknown option \"ca\""),
            ("nbds://h/x", "needs ca="),
            ("nbds://h/x?ca=a&cert=c", "needs key="),
            ("nbd+unix:///x", "needs socket="),
            (
                "nbd+unix://host/x?socket=/s",
                "write nbd+unix:///EXPORT?socket=/PATH",
            ),
            ("nbd://h/%zz", "bad value for export"),
            ("nbd://h/x?connections=0", "bad value for connections"),
            ("nbd://h/x?timeout=5", "bad value for timeout"),
            ("nbd://h/x?chunk=3KiB", "not a power of two"),
        ] {
            let err = parse(spec).expect_err(spec).to_string();
            assert!(
                err.contains(want),
                "{spec}: {err:?} should contain {want:?}"
            );
            assert!(!err.contains('\n'), "one-line errors: {err:?}");
        }
    }

    #[test]
    fn stage_specs() {
        let v = parse("verified:(file:./x.img?size=1GiB&chunk=4KiB)").unwrap();
        let SpecKind::Verified { inner } = &v.kind else {
            panic!("{v:?}")
        };
        assert_eq!(inner.size, Some(1 << 30));
        assert_eq!(inner.chunk_size, Some(4096));
        assert_eq!(v.path(), Some(Path::new("./x.img")));
        assert!(v.is_stage() && v.needs_async() && !v.is_remote());
        assert_eq!(
            v.to_string(),
            "verified:(file:./x.img?size=1GiB&chunk=4KiB)"
        );
        assert_eq!(parse(&v.to_string()).unwrap(), v, "display round-trips");
        assert!(matches!(open_store(&v), Err(OpenError::NeedsAsync { .. })));
        let nested = parse("VERIFIED:(verified:(farmap://h:1))").unwrap();
        assert!(nested.is_remote());
        assert_eq!(nested.to_string(), "verified:(verified:(farmap://h:1))");
        let m = parse("mirror:(file:a.img?size=1MiB)(farmap://h:1?timeout=1s)?policy=primary-first&backlog=64&timeout=500ms").unwrap();
        let SpecKind::Mirror {
            primary, options, ..
        } = &m.kind
        else {
            panic!("{m:?}")
        };
        assert_eq!(primary.size, Some(1 << 20));
        assert_eq!(options.policy, farmap_pipeline::MirrorPolicy::PrimaryFirst);
        assert_eq!(
            (options.backlog, options.timeout),
            (64, Duration::from_millis(500))
        );
        assert!(m.is_remote() && m.is_stage());
        assert_eq!(parse(&m.to_string()).unwrap(), m, "display round-trips");
        assert_eq!(
            parse("mirror:(memory:1MiB)(memory:1MiB)")
                .unwrap()
                .to_string(),
            "mirror:(memory:1MiB)(memory:1MiB)"
        );
        for (spec, want) in [
            ("mirror:(memory:1MiB)", "takes 2 stores"),
            (
                "mirror:(memory:1MiB)(memory:1MiB)?policy=later",
                "bad value for policy",
            ),
            (
                "mirror:(memory:1MiB)(memory:1MiB)?backlog=0",
                "bad value for backlog",
            ),
            (
                "mirror:(memory:1MiB)(memory:1MiB)?ro",
                "unknown option \"ro\"",
            ),
        ] {
            let err = parse(spec).expect_err(spec).to_string();
            assert!(
                err.contains(want),
                "{spec}: {err:?} should contain {want:?}"
            );
        }
        let deep = format!("{}memory:1MiB{}", "verified:(".repeat(9), ")".repeat(9));
        for (spec, want) in [
            ("verified:", "takes 1 store"),
            ("verified:(memory:1MiB)(memory:1MiB)", "takes 1 store"),
            ("verified:(memory:1MiB", "not closed"),
            ("verified:(memory:1MiB)x", "options go after"),
            ("verified:(memory:1MiB)?size=1G", "unknown option \"size\""),
            ("verified:(nope:1)", "unknown store scheme"),
            (deep.as_str(), "nest at most"),
        ] {
            let err = parse(spec).expect_err(spec).to_string();
            assert!(
                err.contains(want),
                "{spec}: {err:?} should contain {want:?}"
            );
        }
    }

    #[tokio::test]
    async fn opens_verified_specs() {
        let v = open_store_async(&parse("verified:(memory:64MiB)").unwrap())
            .await
            .unwrap();
        // One chunk of checksums for up to 4094 chunks of 64 KiB: the region says so.
        assert_eq!(v.geometry().chunk_count(), 1023);
        let small = open_store_async(&parse("verified:(memory:64KiB)").unwrap())
            .await
            .map(|_| ())
            .unwrap_err();
        assert!(
            small.to_string().contains("verified:(memory:64KiB)"),
            "{small}"
        );
    }

    #[test]
    fn grpc_specs() {
        let g = parse("farmap+grpc://127.0.0.1:7401?connections=2&timeout=5s").unwrap();
        assert_eq!(
            g.kind,
            SpecKind::Grpc {
                addr: "127.0.0.1:7401".into(),
                connections: Some(2),
                timeout: Some(Duration::from_secs(5)),
            }
        );
        assert!(g.is_remote());
        assert!(!g.creates());
        assert_eq!(parse(&g.to_string()).unwrap(), g, "display round-trips");
        assert!(parse("farmap+grpc://nohost").is_err());
        let err = parse("farmap+grpc://h:1?ca=x").unwrap_err().to_string();
        assert!(err.contains("unknown option"), "{err}");
    }

    #[test]
    fn good_specs() {
        let m = parse("memory:256MiB").unwrap();
        assert_eq!(m.kind, SpecKind::Memory);
        assert_eq!(m.size, Some(256 << 20));
        assert_eq!(m.chunk_size, None);
        assert_eq!(m.to_string(), "memory:256MiB");

        let e = parse("memory:1PiB").unwrap_err().to_string();
        assert!(
            e.contains("more than the 268435456") && e.contains("larger chunk size"),
            "{e}"
        );
        assert!(parse("dir:/x?size=17TiB").is_err());
        let big = parse("memory:1PiB?chunk=4MiB").unwrap();
        assert_eq!(big.size, Some(1 << 50));
        let m = parse("memory:1G?chunk=4K").unwrap();
        assert_eq!(m.size, Some(1 << 30));
        assert_eq!(m.chunk_size, Some(4096));
        assert_eq!(m.to_string(), "memory:1GiB?chunk=4KiB");

        let f = parse("file:./disk.img").unwrap();
        assert_eq!(
            f.kind,
            SpecKind::File {
                path: "./disk.img".into()
            }
        );
        assert_eq!(f.size, None);

        let f = parse("file:./disk.img?size=1GiB&chunk=1MiB&ro").unwrap();
        assert_eq!(f.size, Some(1 << 30));
        assert_eq!(f.chunk_size, Some(1 << 20));
        assert!(f.read_only);

        let d = parse("dir:/tmp/chunks?size=1GiB&max-open=32").unwrap();
        assert_eq!(
            d.kind,
            SpecKind::Dir {
                path: "/tmp/chunks".into(),
                max_open_files: Some(32)
            }
        );
        assert_eq!(parse(&d.to_string()).unwrap(), d, "display round-trips");
        assert_eq!(
            parse("memory:1GiB?size=1024MiB").unwrap().size,
            Some(1 << 30)
        );
    }

    #[test]
    fn bad_specs_name_the_problem() {
        let cases = [
            ("nope:1G", "unknown store scheme \"nope\""),
            ("./disk.img", "has no scheme"),
            ("memory:", "needs a size"),
            ("memory:12XB", "unknown suffix"),
            ("memory:1GiB?size=2GiB", "conflicting sizes"),
            ("memory:1GiB?chunk=3KiB", "not a power of two"),
            ("memory:1GiB?chunk=8MiB", "not a power of two"),
            ("memory:1GiB?ro", "unknown option \"ro\""),
            ("file:?size=1G", "names no path"),
            ("file:x?bogus=1", "unknown option \"bogus\""),
            ("dir:x?max-open=0", "bad value for max-open"),
            ("file:x?size=0", "cannot be empty"),
        ];
        for (spec, want) in cases {
            let err = parse(spec).expect_err(spec).to_string();
            assert!(
                err.contains(want),
                "{spec}: {err:?} should contain {want:?}"
            );
            assert!(!err.contains('\n'), "one-line errors: {err:?}");
        }
    }

    #[test]
    fn remote_specs() {
        let r = parse("farmap://127.0.0.1:7400").unwrap();
        assert_eq!(
            r.kind,
            SpecKind::Remote {
                addr: RemoteAddr::Tcp("127.0.0.1:7400".into()),
                tls: None,
                connections: None,
                timeout: None,
            }
        );
        assert!(r.is_remote() && !r.creates() && r.path().is_none());
        assert_eq!(r.to_string(), "farmap://127.0.0.1:7400");

        let t = parse("farmaps://db.example:7400?ca=ca.pem&cert=c.pem&key=k.pem&name=srv&timeout=5s&connections=2").unwrap();
        let SpecKind::Remote {
            addr,
            tls,
            connections,
            timeout,
        } = &t.kind
        else {
            panic!("{t:?}")
        };
        assert_eq!(addr.host(), "db.example");
        let tls = tls.as_ref().unwrap();
        assert_eq!(tls.ca, PathBuf::from("ca.pem"));
        assert_eq!(tls.server_name.as_deref(), Some("srv"));
        assert_eq!(
            (*connections, *timeout),
            (Some(2), Some(Duration::from_secs(5)))
        );
        assert_eq!(parse(&t.to_string()).unwrap(), t, "display round-trips");

        let u = parse("farmap+unix:/run/farmap.sock?timeout=250ms").unwrap();
        assert_eq!(u.to_string(), "farmap+unix:/run/farmap.sock?timeout=250ms");
        assert_eq!(parse(&u.to_string()).unwrap(), u);
        assert!(matches!(open_store(&u), Err(OpenError::NeedsAsync { .. })));

        for (spec, want) in [
            ("farmap:127.0.0.1:7400", "names no server"),
            ("farmap://127.0.0.1", "names no server"),
            ("farmap://:7400", "names no server"),
            ("farmap://h:99999", "names no server"),
            ("farmaps://h:7400", "needs ca="),
            ("farmaps://h:7400?ca=a.pem&cert=c.pem", "needs key="),
            ("farmap://h:7400?ca=a.pem", "unknown option \"ca\""),
            ("farmap://h:7400?size=1G", "unknown option \"size\""),
            ("farmap://h:7400?timeout=soon", "bad value for timeout"),
            ("farmap://h:7400?connections=0", "bad value for connections"),
            ("farmap+unix:", "names no path"),
        ] {
            let err = parse(spec).expect_err(spec).to_string();
            assert!(
                err.contains(want),
                "{spec}: {err:?} should contain {want:?}"
            );
            assert!(!err.contains('\n'), "one-line errors: {err:?}");
        }
    }

    #[tokio::test]
    async fn remote_open_errors_are_one_sentence() {
        // A port nothing listens on (bound, then released).
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let spec = parse(&format!("farmap://127.0.0.1:{port}")).unwrap();
        let err = open_store_async(&spec).await.map(|_| ()).unwrap_err();
        let chain = format!("{err}: {}", std::error::Error::source(&err).unwrap());
        assert!(
            chain.contains(&format!(
                "cannot connect to 127.0.0.1:{port}: connection refused"
            )),
            "{chain}"
        );
        assert!(!chain.contains('\n'));
        // Local specs open through the async entry point too.
        let m = open_store_async(&parse("memory:1MiB").unwrap())
            .await
            .unwrap();
        assert_eq!(m.geometry().size(), 1 << 20);
    }

    #[tokio::test]
    async fn opens_file_and_dir_specs() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("disk.img");
        let spec = parse(&format!("file:{}?size=1MiB&chunk=4KiB", file.display())).unwrap();
        assert!(spec.creates());
        let s = open_store(&spec).unwrap();
        assert_eq!(s.geometry().size(), 1 << 20);
        assert_eq!(s.geometry().chunk_size(), 4096);
        // Reopening without a size takes the file's length.
        let again = open_store(&parse(&format!("file:{}", file.display())).unwrap()).unwrap();
        assert_eq!(again.geometry().size(), 1 << 20);
        // A missing file without size is a clear error naming the path.
        let missing = dir.path().join("missing.img");
        let err = open_store(&parse(&format!("file:{}", missing.display())).unwrap())
            .map(|_| ())
            .unwrap_err();
        let chain = format!("{err}: {}", std::error::Error::source(&err).unwrap());
        assert!(chain.contains("missing.img"), "{chain}");

        let chunks = dir.path().join("chunks");
        let d =
            open_store(&parse(&format!("dir:{}?size=1MiB", chunks.display())).unwrap()).unwrap();
        assert_eq!(d.geometry().size(), 1 << 20);
    }
}
