//! QEMU's machine protocol (QMP): JSON lines over QEMU's `-qmp unix:PATH,server=on` socket.
//!
//! - [`parse_line`] and [`encode_command`]: the line codec, sans I/O, checked on lines
//!   recorded from QEMU 7.2.22.
//! - [`Qmp`]: an async client (tokio) that connects, negotiates, runs commands, matches
//!   replies by `id` and queues the events that arrive meanwhile; and the migration commands
//!   a driver needs ([`Qmp::migrate`], [`Qmp::wait_migration_status`], ...).
//!
//! ```text
//! QEMU:   {"QMP": {"version": {"qemu": {"major": 7, ..}, ..}, "capabilities": ["oob"]}}
//! client: {"execute": "qmp_capabilities", "id": 1}
//! QEMU:   {"return": {}, "id": 1}
//! client: {"execute": "migrate", "arguments": {"uri": "tcp:127.0.0.1:4444"}, "id": 2}
//! QEMU:   {"timestamp": {..}, "event": "MIGRATION", "data": {"status": "setup"}}
//! QEMU:   {"return": {}, "id": 2}
//! ```

mod client;
mod codec;
mod error;
#[cfg(test)]
mod fake;
mod migration;

pub use client::{Qmp, DEFAULT_COMMAND_TIMEOUT, MAX_QUEUED_EVENTS};
pub use codec::{encode_command, parse_line, Event, Greeting, Message, MAX_LINE};
pub use error::{CodecError, QmpError};
pub use migration::{MigrateInfo, MIGRATION_POLL};
