//! [`MountError`]: why a mount, a mapping or an unmount failed.

use std::io;
use std::path::PathBuf;

use farmap_core::StoreError;

/// Why mounting, mapping or unmounting failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MountError {
    /// The mount point is not a usable directory.
    #[error("cannot mount at {dir}: {reason}")]
    BadMountPoint {
        /// The mount point.
        dir: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// Something is mounted at the mount point already.
    #[error("{dir} is busy: {what} is mounted there already; unmount it first")]
    Busy {
        /// The mount point.
        dir: PathBuf,
        /// What is mounted there (file system type and source).
        what: String,
    },
    /// The file name is not a single path component.
    #[error("the file name {name:?} must be one path component (no '/', not '.' or '..')")]
    BadName {
        /// The name asked for.
        name: String,
    },
    /// The store's size does not fit this machine's address space (for a mapping).
    #[error("a region of {size} bytes does not fit this machine's address space")]
    TooLarge {
        /// The region's size.
        size: u64,
    },
    /// A system call failed.
    #[error("{what}")]
    Sys {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// Flushing the store (at sync or unmount) failed; the data may not be in the store.
    #[error("flushing the store behind {path} failed")]
    Flush {
        /// The mounted file.
        path: PathBuf,
        /// The store's error.
        #[source]
        source: StoreError,
    },
}

impl MountError {
    pub(crate) fn sys(what: impl Into<String>, source: io::Error) -> Self {
        MountError::Sys {
            what: what.into(),
            source,
        }
    }
}
