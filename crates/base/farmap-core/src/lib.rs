//! The vocabulary every farmap crate speaks.
//!
//! A farmap region is a byte range cut into equally sized *chunks* (the last one may be
//! shorter). Everything that holds or moves a region is a [`Store`]: an async, chunk-addressed
//! object that reads and writes whole chunks as owned [`bytes::Bytes`], with `&self` methods so
//! that any number of tasks can use one store at once through an `Arc<dyn Store>`.
//!
//! - [`Geometry`], [`ChunkIdx`], [`ChunkRange`]: the shape of a region and how to name parts of it.
//! - [`Caps`]: what a store can do, reported separately from its data operations.
//! - [`StoreError`] and [`ErrorKind`]: one error type for every store, mapped to an errno for
//!   kernel-facing frontends and classified as retryable or not.
//! - [`Objects`]: named objects written once (a directory, an S3 prefix), for layouts that
//!   keep versions of a region.
//! - [`ChunkStatus`]: what a store knows about a chunk without reading it (zero or data).
//! - [`size`]: parsing and printing of sizes (binary suffixes in, MB = 10^6 bytes out).
//! - [`duration`]: parsing and printing of durations (a unit is always required).
//! - [`split_quantity`]: the number and the unit of any number with a unit, as both read them.
//! - [`SizeOrPercent`]: "SIZE or N%", for bounds given in bytes or as a share of a region.
//! - [`RetryPolicy`]: attempts, exponential backoff and jitter, for every retry and reconnect.
//! - [`pattern`]: the deterministic bytes writers and checkers in different processes agree on.
//! - [`query`] and [`option`]: the grammar of a store spec's `?key=value&...` and its values.
//!
//! This crate has no runtime dependency and no `unsafe`.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod caps;
pub mod duration;
mod error;
mod geometry;
mod objects;
pub mod option;
pub mod pattern;
mod quantity;
pub mod query;
mod retry;
mod share;
pub mod size;
mod store;
mod zeros;

pub use caps::Caps;
pub use duration::{format_duration, parse_duration, DurationError, DURATION_UNITS};
pub use error::{error_chain, ErrorKind, StoreError, StoreResult};
pub use geometry::{
    ChunkIdx, ChunkRange, Geometry, GeometryError, DEFAULT_CHUNK_SIZE, MAX_CHUNKS, MAX_CHUNK_SIZE,
    MIN_CHUNK_SIZE,
};
pub use objects::{check_key, Objects};
pub use quantity::split_quantity;
pub use retry::RetryPolicy;
pub use share::SizeOrPercent;
pub use size::{format_size, parse_size, MbPerSec, SizeError};
pub use store::{part_range, BoxFuture, ChunkStatus, MemoryBase, Store};
pub use zeros::{is_zero, zero_chunk};
