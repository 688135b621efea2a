//! farmap's FUSE frontend: a region as one file on a FUSE mount, so that any program can
//! read, write and `mmap(MAP_SHARED)` it.
//!
//! ```text
//!   programs: read/write/mmap DIR/region           this crate
//!   ─────────────────────────────────────          ──────────
//!   page cache (kept: no direct_io, so mmap   ─▶  /dev/fuse ─▶ session thread (fuser): parses a
//!   works; a page is read from the server          request, hands it to a task, goes back to
//!   once; dirty pages come back at msync,           reading at once
//!   fsync, close or writeback)                         │
//!                                                      ▼
//!                                       mount runtime (tokio, own threads): byte ranges
//!                                       through Unaligned → any Store; fsync/flush = store
//!                                       flush (managed: everything pushed to the remote)
//! ```
//!
//! - [`FuseMount::mount`] mounts a directory holding one file (default name `region`) of the
//!   store's size. Requests are up to 1 MiB (`max_read`, `max_write`; as root the kernel's
//!   `max_pages_limit` and the mount's read-ahead are raised to match) and are served
//!   concurrently: the session thread never waits for the store.
//! - Three ways in (r3map's path / file / slice mounts): [`FuseMount::path`],
//!   [`FuseMount::open`] (a `std::fs::File`), and [`FuseMount::map`], a shared mapping whose
//!   memory is a [`RegionSlice`](farmap_memory::RegionSlice), the same volatile slice type as a
//!   userfaultfd region's.
//! - The file's size is fixed: truncation to another size is refused (`EPERM`).
//! - [`FuseMount::unmount`] (and drop) write back the page cache, flush the store, and
//!   unmount; if programs still hold the file, the mount is detached and served until they
//!   let go, so nothing they write is lost.
//! - Write payloads are copied out of fuser's request buffer into a fresh allocation, or,
//!   with [`MountOptions::write_buffers`], into a [`WritePool`] of buffers allocated at mount
//!   (a swap server's write path must not allocate).
//! - A store that knows its working set ([`Store::working_set`], a versioned region) has it
//!   read through the file once the file is first read, so that the kernel's page cache
//!   holds it before the application touches it ([`MountOptions::warm_page_cache`], off by
//!   default).
//! - A mount point whose server died (`ENOTCONN`) is detected and lazily unmounted before
//!   mounting again.
//!
//! - Live migration of a mount (`farmap mount --agent`) is `farmap_migrate::mount`, above this
//!   crate: writes are tracked as they reach the server ([`MountControl`]), the programs
//!   holding the file are suspended at the hand-over, and the destination mount serves at once.
//!
//! [`Store::working_set`]: farmap_core::Store::working_set
//!
//! Serving a mapping of the mount from the same process works (the mount has its own runtime
//! and session thread), but a thread of the mount's runtime must never touch the mapping.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod control;
mod error;
mod fs;
mod mapping;
mod mount;
mod pool;
mod sys;
mod warm;

pub use control::{Access, MountControl};
pub use error::MountError;
pub use mapping::MappedRegion;
pub use mount::{find_mount, FuseMount, MountInfo, MountOptions, DEFAULT_FILE_NAME};
pub use pool::WritePool;
pub use sys::{cleanup_stale, is_stale};
pub use warm::WarmStats;
