//! farmap's local stores: where a region's chunks live when they stay on this machine.
//!
//! | store | keeps chunks in | reads cost | caps |
//! |---|---|---|---|
//! | [`MemoryStore`] | a sparse, sharded map of the written `Bytes` | a refcount increment | write, trim, status, parallel |
//! | [`DenseMemoryStore`] | one pre-allocated, pre-touched buffer per chunk | an allocation and a copy | write, status, parallel |
//! | [`FileStore`] | one sparse file (or an existing one), positional I/O | a `pread` | write, flush, trim, status, parallel |
//! | [`DirStore`] | one file per written chunk in a directory tree | an `open` (cached) and a `pread` | write, flush, trim, status, parallel |
//!
//! [`DirObjects`] and [`MemoryObjects`] hold named objects written once
//! ([`farmap_core::Objects`]), for the versioned layout.
//!
//! Every store implements [`farmap_core::Store`]: whole chunks in and out, chunks never
//! written read as zeros, and a write replaces a chunk whole (a concurrent read sees the old
//! or the new content, never a mix). Each store's documentation states its concurrency
//! contract. Read-only openings of [`FileStore`] and [`DirStore`] report no write or trim
//! capability and refuse both with [`ErrorKind::ReadOnly`](farmap_core::ErrorKind::ReadOnly).
//!
//! File-backed stores do their blocking system calls inside [`tokio::task::spawn_blocking`], so
//! they need a Tokio runtime; the memory stores need none.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod blocking;
mod dense;
mod dir;
mod file;
mod memory;
mod objects;
mod stripes;

pub use dense::DenseMemoryStore;
pub use dir::{fuzz_dir_meta, DirOptions, DirStore};
pub use file::{FileOptions, FileStore};
pub use memory::MemoryStore;
pub use objects::{DirObjects, MemoryObjects};
