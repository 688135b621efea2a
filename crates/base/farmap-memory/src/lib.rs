//! farmap's memory layer: what the frontends share to reach memory that another thread, the
//! kernel or a peer may change at any time, and the plain system calls around it.
//!
//! - [`RegionSlice`]: a bounds-checked, volatile view of such memory (the only way farmap
//!   hands region memory out; plain `&[u8]` views are `unsafe fn`s with a written contract).
//! - [`SharedMapping`]: a `MAP_SHARED` mapping of a file (a FUSE file, a block device),
//!   reached through [`RegionSlice`]s; [`MappingOf`] ties one to the mount that serves it.
//! - [`sched`]: a thread's scheduling class (`SCHED_IDLE`/`SCHED_BATCH` for work that gives way).
//! - [`heap`]: glibc malloc settings for processes that must not fault fresh heap pages in.
//! - [`sys`]: `sync_file_range` write-back, `errno`, the page size.
//!
//! Together with `farmap-uffd` (userfaultfd) and the ioctl wrappers of the kernel block
//! frontends, this is one of the few crates with `unsafe` code; every block names its
//! invariant in a `// SAFETY:` comment.
#![warn(missing_docs)]

mod borrowed;
pub mod heap;
pub mod sched;
mod shared_map;
mod slice;
pub mod sys;

pub use borrowed::MappingOf;
pub use shared_map::SharedMapping;
pub use slice::{RegionSlice, SliceError};
