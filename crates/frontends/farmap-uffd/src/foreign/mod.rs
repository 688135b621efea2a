//! Regions in another process's address space (`farmap run`, docs/design/farmap-run.md):
//! the program maps and registers its heap and sends the fds; this side serves its faults.
//!
//! What the kernel lets this side do to the program's memory, and what it does not, is
//! tested with two real processes in `tests/foreign_kernel.rs`: copies, write protection,
//! `PAGEMAP_SCAN` and reads through the program's `/proc/self/mem` work from here; page
//! moves (`UFFDIO_MOVE`) and discards (`madvise`) do not, so a thread of the program (its
//! *reaper*) does them on request: [`Reaper`] is this side of that conversation.
//!
//! - [`Reaper`]: the client of the program's reaper (`reaper.rs`);
//! - the program's address space as the pager reaches it: its mem fd, its reaper, the watch
//!   for its end (`space.rs`);
//! - [`ForeignRegion`]: bounded local memory for the program's region, served from here
//!   (`region.rs`; design: docs/design/foreign-region.md);
//! - a program's forks: its child's copy of the heap made whole (`fork.rs`);
//! - [`handshake`]: the handler's side of a program's handshake, checked in full before the
//!   region is served ([`Applicant::accept`]; `accept.rs`).

mod accept;
mod fork;
pub(crate) mod reaper;
mod region;
pub(crate) mod space;

pub use accept::{
    handshake, Applicant, Contact, Expected, ForkCall, HandshakeError, FORK_WAIT, REAPER_DEADLINE,
};
pub use fork::ForkCopy;
pub use reaper::{Reaper, ReaperError};
pub use region::{
    trash_len, ForeignFds, ForeignOptions, ForeignRegion, ForkPause, ForkStats, Program,
    FOREIGN_FEATURES, FOREIGN_REFUSED_FEATURES,
};
#[cfg(test)]
pub(crate) use space::testing;
pub use space::End;
