//! Virtual machines on farmap: what a driver of QEMU needs, whatever holds the guest's RAM.
//!
//! - [`qmp`]: QEMU's machine protocol, a sans-I/O line codec and an async client with the
//!   migration commands.
//! - [`qemu`]: the QEMU command line, built from one [`QemuConfig`] so that a migration's
//!   source and destination cannot differ.
//! - [`heartbeat`]: the guest's heartbeat bytes (I/O port 0xe9, `isa-debugcon`), stamped on
//!   the host as they arrive, and their analysis (holes, the largest gap).
//! - [`console`]: the guest's serial console, read line by line.
//! - [`snapshot`]: a guest saved into a file and started from it again (its RAM left on a
//!   shared file, or the whole guest).
//! - [`vmcheck`]: the `VMCHECK` lines of the self-checking guest program.
//!
//! The design is docs/design/vm.md (§7 the guest, §8 the flags, §11 the figures).
#![forbid(unsafe_code)]

pub mod console;
pub mod heartbeat;
pub mod qemu;
pub mod qmp;
pub mod snapshot;
mod version;
pub mod vmcheck;

pub use console::{Console, ConsoleError};
pub use heartbeat::{analyse, Analysis, Beat, HeartbeatListener, Heartbeats};
pub use qemu::{qemu_version, Incoming, QemuConfig, QemuError, Ram};
pub use qmp::{MigrateInfo, Qmp, QmpError};
pub use snapshot::{restore, save, Saved, SnapshotError};
pub use version::QemuVersion;
pub use vmcheck::{Rate, VmcheckLine};
