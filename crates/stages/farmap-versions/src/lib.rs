//! farmap's versioned layout: a region kept as versions over any [`Objects`] (a directory,
//! an S3 prefix, Redis), with content-addressed chunks shared by every version and every
//! region, and one writer at a time.
//!
//! ```text
//!   chunks/HH/HASH                       a chunk's bytes, compressed (HASH: SHA-256 of them),
//!                                        or a page of a whole version's chunk map
//!   regions/NAME/versions/SEQ            a version's manifest (SEQ: 20 decimal digits)
//!   regions/NAME/tags/TAG                the SEQ a snapshot's name stands for
//!   regions/NAME/bases/TAG               where that version's chain starts (a hint)
//! ```
//!
//! - **Chunks are immutable** and named by the SHA-256 of their content: writing the same
//!   bytes twice, in one region or in two, stores them once. A chunk of zeros is not stored
//!   at all. Chunks are zstd-compressed when that saves space ([`chunk`]); every read checks
//!   the hash, so nothing unverified is served.
//! - **A version is a manifest** ([`Manifest`]): the chunks that changed since the version
//!   before it, or, every [`MAX_CHAIN`] versions (and when more than [`MAX_DELTA`] chunks
//!   changed), every chunk that holds data, listed in
//!   [`page`]s of 4096 chunks that are stored like chunks and shared by every version that
//!   holds them. Opening a version reads its manifest and the deltas since the whole one, 16
//!   at a time (with its manifest when a snapshot's name says where the chain starts: one
//!   round trip to the store), never the pages: those are read when a chunk in them is first looked up, so an open
//!   costs the same whatever the region's size. Versions are numbered from 0 without gaps;
//!   a flush that has something to save writes the next one.
//! - **One writer, fenced**: writing version `N + 1` is the object store's one atomic step,
//!   a create that fails when the name exists. A writer that did not write version `N` (a
//!   second writer, or the old host after a migration) finds `N + 1` taken at its next flush
//!   and gets [`ErrorKind::Fenced`](farmap_core::ErrorKind::Fenced), never a silent
//!   overwrite. [`Versioned::claim`] takes a region over explicitly (the next epoch).
//! - **Snapshots** name a version ([`Versioned::snapshot`]); a region opens at its latest
//!   version, at a number, or at a name, read-only for anything but the latest.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod base;
pub mod chunk;
pub mod gc;
mod history;
mod manifest;
pub mod page;
mod store;
pub mod touched;

use std::fmt;

pub use gc::{gc, GcOptions, GcReport};
pub use history::{fork, history, resolve, VersionInfo};
pub use manifest::{Manifest, Parent, MAX_DEPTH};
pub use store::{Versioned, VersionedOptions, READ_AHEAD_BYTES};

pub use farmap_core::Objects;

/// Deltas after a whole manifest before the next version is written whole again: opening a
/// region reads at most this many manifests after the whole one.
pub const MAX_CHAIN: u64 = 32;

/// Chunks a delta lists at most: a version that changes more is written whole (in pages), so
/// that no manifest is big (a delta is at most 160 KiB; a whole manifest 36 bytes a page, at
/// most 2.3 MiB for the largest region farmap allows; every object fits a CQL object).
pub const MAX_DELTA: usize = page::PAGE_CHUNKS as usize;

/// Which version to open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum At {
    /// The latest (the only one that opens writable).
    Latest,
    /// Version number `n`.
    Seq(u64),
    /// The version a snapshot name stands for.
    Tag(String),
}

/// The SHA-256 of a chunk's content (or of a manifest's body).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Hash(pub [u8; 32]);

impl Hash {
    /// What stands for a chunk of zeros (never stored).
    pub const ZERO: Hash = Hash([0; 32]);

    /// The SHA-256 of `data`.
    pub fn of(data: &[u8]) -> Hash {
        let d = ring::digest::digest(&ring::digest::SHA256, data);
        Hash(d.as_ref().try_into().expect("SHA-256 is 32 bytes"))
    }

    /// Lowercase hex.
    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl fmt::Debug for Hash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", &self.hex()[..16])
    }
}

/// Checks a region or snapshot name: 1 to 128 of `[A-Za-z0-9._-]`, not starting with `.`.
/// The error is the reason.
pub fn check_name(what: &str, name: &str) -> Result<(), String> {
    let ok = (1..=128).contains(&name.len())
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{what} {name:?}: use 1 to 128 of A-Z a-z 0-9 . _ - (not starting with '.')"
        ))
    }
}

/// The key of a region's version `seq`.
fn version_key(region: &str, seq: u64) -> String {
    format!("regions/{region}/versions/{seq:020}")
}

/// The folder of a region's versions.
fn versions_dir(region: &str) -> String {
    format!("regions/{region}/versions")
}

/// The folder of a region's snapshot names.
fn tags_dir(region: &str) -> String {
    format!("regions/{region}/tags")
}

/// The folder of where the versions that snapshot names stand for start their chains: a
/// hint beside each name, which older readers of the layout do not look at.
fn bases_dir(region: &str) -> String {
    format!("regions/{region}/bases")
}

/// Milliseconds since the Unix epoch.
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
