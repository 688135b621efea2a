//! farmap's ublk frontend: a `/dev/ublkbN` block device whose I/O goes to any
//! [`Store`](farmap_core::Store), through [`Unaligned`](farmap_pipeline::Unaligned).
//!
//! ```text
//!  application ── /dev/ublkbN ── ublk_drv (kernel)
//!                                    │ io_uring commands, one ring per queue
//!                      queue threads (libublk, a smol executor each: one task per tag)
//!                                    │ each request handed to the tokio runtime,
//!                                    │ completion kicks the queue's ring (eventfd)
//!                      Unaligned ── Arc<dyn Store> (memory, file, dir, remote...)
//! ```
//!
//! - READ and WRITE are byte ranges of [`Unaligned`](farmap_pipeline::Unaligned); FLUSH is
//!   the store's `flush`; DISCARD and WRITE_ZEROES make the range read as zeros (`trim_at`:
//!   whole chunks trimmed, partial ones zero-filled). A store error becomes its errno.
//! - The device is write-through: a write is acknowledged once the store acknowledged it, so
//!   nothing acknowledged lives only in this process. It advertises a volatile cache so that
//!   the kernel sends FLUSH, which the store makes durable.
//! - [`UblkDevice::shutdown`] stops the device (the kernel flushes its page cache and fails
//!   nothing acknowledged), waits for the queues, flushes the store, then deletes the device.
//!
//! Needs the `ublk_drv` kernel module (Linux ≥ 6.0); without it, [`UblkDevice::start`] fails
//! with [`UblkDeviceError::NoDriver`].
#![forbid(unsafe_code)]

mod device;
mod queue;

pub use device::{UblkDevice, UblkDeviceError, UblkOptions, UBLK_CONTROL};

/// Whether this process can set up an io_uring (what every ublk queue needs): a ring of two
/// entries is made and dropped.
pub fn io_uring_works() -> std::io::Result<()> {
    io_uring::IoUring::new(2).map(drop)
}
