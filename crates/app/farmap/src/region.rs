//! Regions: plain memory whose content lives in a store. Touching a chunk for the first time
//! fetches it; written pages are tracked (per 4 KiB page) and pushed back in the background
//! and at [`Region::sync`]. Built on userfaultfd: see [`farmap_uffd`] for the design, the
//! kernel behaviour it relies on, the aliasing contract of region memory ([`RegionSlice`]) and
//! `fork()`.
//!
//! ```no_run
//! # fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use farmap::{open_region, RegionOptions, StoreSpec};
//! let spec: StoreSpec = "file:./disk.img?size=256MiB".parse()?;
//! let region = open_region(&spec, RegionOptions::default())?;
//! region.memory().write_from(0, b"hello")?;
//! region.sync()?; // the store has it
//! println!("{:?}", region.stats());
//! region.close()?;
//! # Ok(()) }
//! ```
//!
//! Any spec works, network stores too (`farmap://`, `redis://`, `s3://`, `cql://`): they are
//! opened on a runtime of their own ([`open_store_blocking`]). An application that already
//! holds an opened store gives it to [`Region::open`] with [`RegionOptions::store_spec`] set.

use thiserror::Error;

use crate::spec::{open_store_blocking, OpenError, SpecKind, StoreSpec};

pub use farmap_uffd::{
    probe, DirtyReport, HandlerLocation, MemoryUse, Region, RegionError, RegionMode, RegionOptions,
    RegionSlice, RegionStats, SharedStats, SliceError, Support, TrackingMode, WriteTracking,
};

/// Why [`open_region`] failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum OpenRegionError {
    /// The store could not be opened.
    #[error("cannot open the region's store")]
    Store(#[from] OpenError),
    /// The region could not be set up.
    #[error("cannot set up the region")]
    Region(#[from] RegionError),
}

/// Opens the store `spec` names and maps a region over it (see [`Region::open`]). The spec is
/// remembered, so that the region's fault handling can be handed to another process.
///
/// A bounded region ([`RegionOptions::paging`]) over a `memory:` or `file:` spec without
/// `chunk=` gets chunks of [`farmap_uffd::PAGING_CHUNK_SIZE`] (the page size): those stores'
/// layout does not depend on the chunk size, and a fault then moves what kernel swap would.
/// [`Region::stats`] says which chunk size the region has.
pub fn open_region(spec: &StoreSpec, mut opts: RegionOptions) -> Result<Region, OpenRegionError> {
    let spec = &paging_spec(spec, &opts);
    let store = open_store_blocking(spec)?;
    if opts.store_spec.is_none() {
        // With its password: the process the region is handed to logs in with it.
        opts.store_spec = Some(spec.to_secret_string());
    }
    Ok(Region::open(store, opts)?)
}

/// `spec`, with the paging chunk size when the region is bounded and the chunk size is the
/// store's free choice (see [`open_region`]).
fn paging_spec(spec: &StoreSpec, opts: &RegionOptions) -> StoreSpec {
    let mut spec = spec.clone();
    let layout_free = matches!(spec.kind, SpecKind::Memory | SpecKind::File { .. });
    if opts.paging.is_some() && spec.chunk_size.is_none() && layout_free {
        spec.chunk_size = Some(farmap_uffd::PAGING_CHUNK_SIZE);
    }
    spec
}

/// Handing a region's fault handling to another process (see [`farmap_uffd::handover`] for
/// the protocol and its message layout).
pub mod handover {
    use std::os::unix::net::UnixStream;
    use std::sync::Arc;

    pub use farmap_uffd::handover::{
        message, reclaim, send, HandlerPull, HandoverError, SendOptions, ServeOptions, ServeReport,
    };

    use super::*;

    /// Serves the faults of a region handed over on `sock` until the owner stops it or goes
    /// away, opening the store from the spec the owner sent, read-only (the owner keeps
    /// writing it back). A `memory:` store exists only in the process that made it, so it is
    /// refused.
    pub fn serve(sock: UnixStream, opts: ServeOptions) -> Result<ServeReport, HandoverError> {
        farmap_uffd::handover::serve(sock, open_for_handler, opts)
    }

    fn open_for_handler(spec: &str) -> Result<Arc<dyn farmap_core::Store>, String> {
        let mut spec: StoreSpec = spec.parse().map_err(|e| format!("{e}"))?;
        // The handler only reads (pushes stay with the owner), and the owner holds the
        // writer's lock of a file: or dir: store.
        spec.read_only = true;
        if matches!(spec.kind, SpecKind::Memory) {
            return Err("a memory store lives only in the process that made it".into());
        }
        open_store_blocking(&spec).map_err(|e| {
            let mut message = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                message = format!("{message}: {s}");
                source = s.source();
            }
            message
        })
    }
}
