//! [`NbdKernelError`]: why a kernel NBD device could not be set up, used or torn down.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use farmap_core::option::OutOfRange;
use farmap_nbd::NbdServeError;
use rustix::io::Errno;

use crate::netlink::NetlinkError;

/// Why a kernel NBD device could not be set up, used or torn down.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NbdKernelError {
    /// The kernel does not know the "nbd" generic netlink family.
    #[error("the kernel has no nbd driver (modprobe nbd)")]
    NoDriver,
    /// Talking to the kernel over generic netlink failed.
    #[error("{what} failed")]
    Netlink {
        /// The request.
        what: &'static str,
        /// Why.
        #[source]
        source: NetlinkError,
    },
    /// The kernel refused a request.
    #[error("the kernel refused {what}: {errno}{}", hint(*errno))]
    Refused {
        /// The request.
        what: &'static str,
        /// The kernel's error.
        errno: Errno,
    },
    /// An option is out of range.
    #[error(transparent)]
    BadOption(#[from] OutOfRange),
    /// The in-process NBD server could not start.
    #[error("the in-process NBD server could not start")]
    Serve(#[source] NbdServeError),
    /// A socket to the in-process server could not be set up.
    #[error("NBD connection {conn} of {total} to the in-process server: {what}")]
    Connection {
        /// Which connection (from 1).
        conn: usize,
        /// How many were asked for.
        total: usize,
        /// What went wrong.
        what: String,
        /// Why.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// The device did not show up in time.
    #[error("{device} was not ready within {waited:?}: {state}")]
    NotReady {
        /// The device node.
        device: PathBuf,
        /// How long it was waited for.
        waited: Duration,
        /// What was missing.
        state: String,
    },
    /// The device could not be opened, flushed or mapped.
    #[error("{what} {}", device.display())]
    Device {
        /// What was being done.
        what: &'static str,
        /// The device node.
        device: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The device is larger than this process's address space allows to map.
    #[error("the device ({size} bytes) is too large to map in this process")]
    TooLarge {
        /// Its size.
        size: u64,
    },
    /// The in-process server failed to stop (its final flush).
    #[error("stopping the in-process NBD server failed")]
    Stop(#[source] NbdServeError),
    /// A helper thread of the set-up or teardown died.
    #[error("a helper thread ({0}) panicked or was cancelled")]
    Thread(&'static str),
}

fn hint(errno: Errno) -> &'static str {
    match errno {
        Errno::PERM | Errno::ACCESS => {
            " (configuring NBD devices needs CAP_SYS_ADMIN: run as root)"
        }
        Errno::BUSY => " (the device is in use)",
        _ => "",
    }
}

impl NbdKernelError {
    pub(crate) fn netlink(what: &'static str, source: NetlinkError) -> Self {
        match source {
            NetlinkError::Kernel(errno) => NbdKernelError::Refused { what, errno },
            source => NbdKernelError::Netlink { what, source },
        }
    }
}
