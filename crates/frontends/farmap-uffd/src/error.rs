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
        reason: Unsupported,
        /// The system's error, when a system call said so.
        #[source]
        source: Option<io::Error>,
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
    /// An access through a [`RegionSlice`](crate::RegionSlice) was out of range.
    #[error("an access to the region's memory was refused")]
    Slice(#[from] crate::SliceError),
    /// A chunk could not be read out of the region.
    #[error("reading a chunk of the region failed")]
    Read(#[source] StoreError),
    /// The region is closed, or its handler is gone.
    #[error("the region is closed")]
    Closed,
    /// A program's region (`farmap run`) is not one this side can serve.
    #[error("the program's region cannot be served: {reason}")]
    Foreign {
        /// Why.
        reason: String,
    },
}

/// What this system lacks for a region ([`RegionError::Unsupported`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Unsupported {
    /// The `userfaultfd` system call does not exist.
    #[error("the kernel has no userfaultfd")]
    NoUserfaultfd,
    /// The system call and `/dev/userfaultfd` are both refused.
    #[error(
        "userfaultfd is refused: vm.unprivileged_userfaultfd is 0, and /dev/userfaultfd is \
         not accessible"
    )]
    Refused,
    /// Opening a userfaultfd failed for another reason.
    #[error("a userfaultfd could not be opened")]
    Open,
    /// `UFFD_FEATURE_EVENT_REMOVE` is missing.
    #[error("the kernel's userfaultfd lacks UFFD_FEATURE_EVENT_REMOVE")]
    EventRemove,
    /// Asynchronous write protection was asked for and is missing.
    #[error("asynchronous write protection (UFFD_FEATURE_WP_ASYNC) is missing")]
    WpAsync,
    /// `UFFDIO_MOVE` (`UFFD_FEATURE_MOVE`, Linux 6.8+) is missing: bounded local memory
    /// needs it.
    #[error("UFFDIO_MOVE (UFFD_FEATURE_MOVE) is missing; bounded local memory needs it")]
    Move,
    /// Bounded local memory needs asynchronous write tracking (a chunk moved back from
    /// staging is unprotected; only WP_ASYNC scans see its later writes).
    #[error("bounded local memory needs asynchronous write tracking (WP_ASYNC)")]
    PagingNeedsAsync,
    /// `UFFD_FEATURE_SIGBUS` is missing: in-thread fault resolution needs it.
    #[error("UFFD_FEATURE_SIGBUS is missing; in-thread fault resolution needs it")]
    Sigbus,
    /// `UFFDIO_WRITEPROTECT` is not available on anonymous memory.
    #[error("UFFDIO_WRITEPROTECT is not available on anonymous memory")]
    WriteProtect,
}

impl RegionError {
    pub(crate) fn unsupported(reason: Unsupported) -> Self {
        RegionError::Unsupported {
            reason,
            source: None,
        }
    }

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
