//! farmap's kernel NBD client: any store as `/dev/nbdN`, the way `nbd-client -C N` does it,
//! with farmap's own NBD server in this process.
//!
//! ```text
//!   programs: read/write/mmap /dev/nbdN, mkfs, mount
//!        │ block layer (page cache, FLUSH, DISCARD)
//!        ▼
//!   kernel nbd client ── N Unix sockets (handed over by NBD_CMD_CONNECT) ──┐
//!                                                                          ▼
//!   this process: farmap-nbd server (one export) → Unaligned → any Store (or Managed stack)
//! ```
//!
//! - [`NbdMount::start`] resolves the kernel's `nbd` generic netlink family (none: "the kernel
//!   has no nbd driver (modprobe nbd)"), starts the server on a Unix socket in a private
//!   directory, connects N sockets and does the client handshake on each, then sends
//!   `NBD_CMD_CONNECT` with the size, block size, I/O timeout, the server's transmission
//!   flags, `DESTROY_ON_DISCONNECT` and the sockets. It returns once `/sys/block/nbdN/size`
//!   shows the size and the device node exists.
//! - Three ways in (r3map's path / file / slice mounts): [`NbdMount::path`],
//!   [`NbdMount::open`] (a `File`), [`NbdMount::map`] (a shared mapping whose memory is a
//!   [`RegionSlice`](farmap_memory::RegionSlice), the type userfaultfd regions and FUSE mounts
//!   hand out).
//! - [`NbdMount::shutdown`] flushes first (`fsync` of the device), then disconnects, then
//!   stops the server (which flushes the store again).
//! - [`genl`] is the generic netlink codec with no I/O (fuzzed: it decodes kernel replies);
//!   the socket itself is rustix's and the mapping `farmap_memory::SharedMapping`, so the
//!   crate has no `unsafe` code.
//!
//! Linux only. Configuring NBD devices needs `CAP_SYS_ADMIN`.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod genl;

#[cfg(target_os = "linux")]
mod device;
#[cfg(target_os = "linux")]
mod error;
#[cfg(target_os = "linux")]
mod mapping;
#[cfg(target_os = "linux")]
mod netlink;

#[cfg(target_os = "linux")]
pub use device::{genl_family_id, kernel_has_nbd, NbdMount, NbdMountOptions, MAX_CONNECTIONS};
#[cfg(target_os = "linux")]
pub use error::NbdKernelError;
#[cfg(target_os = "linux")]
pub use mapping::MappedDevice;
#[cfg(target_os = "linux")]
pub use netlink::NetlinkError;
