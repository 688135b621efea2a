//! What a parsed store spec is: [`StoreSpec`], the [`SpecKind`] of store it names with that
//! store's settings, and why a spec cannot be parsed ([`SpecError`]) or opened
//! ([`OpenError`]).

use std::path::PathBuf;
use std::time::Duration;

use farmap_core::{SizeError, StoreError};
use farmap_net::{RemoteAddr, TlsClientConfig};

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
    #[error("unknown store scheme {scheme:?} in {spec:?} (known: {known})")]
    UnknownScheme {
        /// The scheme as given.
        scheme: String,
        /// The spec as given.
        spec: String,
        /// The schemes farmap knows.
        known: String,
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
    /// A remote spec given to the synchronous [`open_store`](super::open_store).
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

/// The settings of a `tier:` spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierSpec {
    /// The tiers, highest priority first, each with its capacity in bytes (`None`: the
    /// whole region).
    pub tiers: Vec<(StoreSpec, Option<u64>)>,
    /// Where the placement map is kept, if the spec says.
    pub map: Option<PathBuf>,
    /// How often cold chunks are demoted, if the spec says (zero: never).
    pub demote: Option<Duration>,
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
    #[cfg(feature = "grpc")]
    /// A region served over gRPC (`farmap+grpc://HOST:PORT`, `farmap serve --grpc`).
    Grpc {
        /// `host:port` of the server.
        addr: String,
        /// HTTP/2 connections, if set.
        connections: Option<usize>,
        /// Deadline of each request, if set.
        timeout: Option<Duration>,
    },
    #[cfg(feature = "cql")]
    /// Rows of a Cassandra or ScyllaDB table (`cql://host:port/keyspace?table=..&region=..`).
    Cql(Box<farmap_cql::CqlTarget>),
    #[cfg(feature = "redis")]
    /// A region in Redis or a Redis Cluster (`redis://`, `rediss://`, `redis+cluster://`).
    Redis(farmap_redis::RedisConfig),
    #[cfg(feature = "s3")]
    /// A region in an S3 bucket (`s3://BUCKET/PREFIX?endpoint=...`), one object per chunk.
    S3 {
        /// Bucket, prefix and how to reach them.
        location: farmap_s3::S3Location,
    },
    #[cfg(feature = "http")]
    /// A file on a web server, read-only (`http://HOST/PATH`, `https://`), one range request
    /// per chunk.
    Http {
        /// The file's URL and how to read it.
        location: farmap_http::HttpLocation,
    },
    #[cfg(feature = "nbd")]
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
    /// A region kept as versions of content-addressed chunks in an object store
    /// (`versioned:(dir:PATH)/REGION[@VERSION]`; also `(s3://...)`, `(redis://...)`).
    Versioned {
        /// Where the objects live.
        objects: Box<StoreSpec>,
        /// The region's name there.
        region: String,
        /// Which version.
        at: farmap_versions::At,
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
}

/// Turns a store's error while opening `spec` into an [`OpenError`] naming the spec.
pub(super) fn store_error(
    spec: &StoreSpec,
) -> impl Fn(farmap_core::StoreError) -> OpenError + Copy + '_ {
    move |source| OpenError::Store {
        spec: spec.to_string(),
        source,
    }
}
