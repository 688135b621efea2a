//! [`RegionError`]: why a region could not be opened, synced or scanned.

use std::io;

use farmap_core::StoreError;

/// What went wrong with a [`Region`](crate::Region).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegionError {
    /// The kernel (or its configuration) refuses userfaultfd, or lacks a feature asked for.
    #[error("userfaultfd is not usable here: {reason}")]
    Unsupported {
        /// What is missing.
        reason: String,
    },
    /// The store's shape does not fit a memory mapping.
    #[error("a region of {size} bytes in chunks of {chunk_size} cannot be mapped: {reason}")]
    Geometry {
        /// Region size.
        size: u64,
        /// Chunk size.
        chunk_size: u32,
        /// Why.
        reason: &'static str,
    },
    /// A system call failed.
    #[error("{what} failed")]
    Sys {
        /// What was being done.
        what: &'static str,
        /// The system's error.
        #[source]
        source: io::Error,
    },
    /// Pushing written chunks to the store failed (they stay dirty for the next try).
    #[error("pushing written chunks to the store failed")]
    Push(#[source] StoreError),
    /// A chunk could not be read out of the region.
    #[error("reading a chunk of the region failed")]
    Read(#[source] StoreError),
    /// The region is closed, or its handler is gone.
    #[error("the region is closed")]
    Closed,
}

impl RegionError {
    pub(crate) fn sys(what: &'static str, source: io::Error) -> Self {
        RegionError::Sys { what, source }
    }

    pub(crate) fn errno(what: &'static str, errno: i32) -> Self {
        RegionError::Sys {
            what,
            source: io::Error::from_raw_os_error(errno),
        }
    }
}
