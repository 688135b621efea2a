//! farmap's arena, for data structures that migrate between processes without being
//! serialized (Slope; see `docs/design/slope.md`).
//!
//! An [`Arena`] is one farmap region (userfaultfd, asynchronous write tracking) mapped at
//! the same fixed virtual address in every process that takes part
//! ([`ArenaConfig::base`], `MAP_FIXED_NOREPLACE`: refused, naming the mapping in the way, if
//! the range is taken). It is cut into *slots*: aligned ranges that each belong to one
//! object, for as long as that object lives anywhere, so an object's page set is the pages
//! of its slot in memory (one `PAGEMAP_SCAN`) and the owner of an address is
//! `(address - base) >> slot_shift`. Processes share the slots out by *leases* (runs of
//! slots with one holder at a time), so no two processes ever hand out the same slot.
//!
//! The arena's memory lives in the process: its region pushes nothing, and its store
//! ([`ArenaStore`]) reads zeros, except for a slot with an object migrating in, whose
//! faults read through that migration's route.
//!
//! Pointers in an object may point into the executable (hashbrown's empty tables do), so
//! every process of an arena runs the same build ([`BuildId`]) with address-space
//! randomization off ([`ensure_fixed_image`]).

mod alloc;
mod arena;
mod config;
mod error;
mod gate;
mod image;
mod maps;
mod obj;
mod portable;
mod slots;
mod store;

pub use alloc::{context, ArenaAlloc, MAX_CONTEXT_DEPTH};
pub use arena::Arena;
pub use config::{
    ArenaConfig, DEFAULT_BASE, DEFAULT_CHUNK, DEFAULT_LEASE_SLOTS, DEFAULT_SIZE,
    DEFAULT_SLOT_SHIFT, MIN_SLOT_SHIFT,
};
pub use error::ArenaError;
pub use gate::{Closed, Gate, READS_CLOSED, RETIRED, WRITES_CLOSED};
pub use image::{ensure_fixed_image, fixed_image, BuildId};
pub use obj::{Moved, Obj, ObjError, ObjMut, ObjRef};
pub use portable::{type_tag, Portable};
pub use slots::{LeaseBook, Member, SlotState, SlotTable};
pub use store::ArenaStore;

/// The collections and hasher objects use, re-exported so that users get the versions
/// this crate's [`Portable`] impls name.
pub use allocator_api2;
pub use foldhash;
pub use hashbrown;
