//! farmap makes a Linux memory region live somewhere else — a file, a directory of chunks,
//! Redis, S3, Cassandra/ScyllaDB or another farmap host — while applications use it as plain
//! memory.
//!
//! This crate is the public face: it maps [regions](region) (memory that fetches from a store
//! on touch and writes changes back: [`open_region`]), re-exports what applications use, and
//! turns store specs (`memory:256MiB`, `file:./disk.img?size=1GiB`,
//! `dir:./chunks?size=1GiB&chunk=1MiB`) into stores.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use farmap::{open_store, StoreSpec};
//! let spec: StoreSpec = "memory:64MiB?chunk=4KiB".parse()?;
//! let store = open_store(&spec)?;
//! let chunk = store.read(farmap::ChunkIdx(0)).await?;
//! assert!(farmap::is_zero(&chunk));
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod managed;
pub mod region;
pub mod spec;

pub use farmap_core::pattern;
pub use farmap_core::{
    error_chain, format_duration, format_size, is_zero, parse_duration, parse_size, zero_chunk,
    BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, MbPerSec,
    SizeOrPercent, Store, StoreError, StoreResult, DEFAULT_CHUNK_SIZE,
};
pub use managed::{Managed, ManagedOptions};
pub use region::{
    open_region, OpenRegionError, Region, RegionError, RegionMode, RegionOptions, RegionStats,
    TrackingMode, WriteTracking,
};
pub use spec::{open_store, open_store_async, OpenError, SpecError, SpecKind, StoreSpec};

/// Serving stores over the network and using remote ones (`farmap://`, `farmaps://`,
/// `farmap+unix:`).
pub mod net {
    pub use farmap_net::*;
}

/// The local stores.
pub mod store {
    pub use farmap_store::*;
}

/// The stages that wrap stores.
pub mod pipeline {
    pub use farmap_pipeline::*;
}

/// Regions kept as versions of content-addressed chunks (`versioned:` specs).
pub mod versions {
    pub use farmap_versions::*;
}
