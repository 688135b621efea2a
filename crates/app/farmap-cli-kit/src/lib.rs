//! The command-line kit that the `farmap` binary and its tools (`farmap bench`, `farmap
//! demo`, in `tools/farmap-tools`) share, so that both print, parse and drive alike:
//!
//! - [`output`]: results on stdout (one JSON object per line with `--json`), progress and
//!   logs on stderr ([`status!`]), errors as one line with their causes, MB = 10^6 bytes.
//! - [`args`]: one parser for every size and duration a user types, and the flag groups
//!   several commands take (a migration's pull budget, a region's local-memory bound).
//! - [`drive`]: following a live migration through an application's agent to its end.
//! - [`metrics`]: Prometheus metrics of long-running commands (`--metrics-listen`).
#![forbid(unsafe_code)]

pub mod args;
pub mod drive;
pub mod metrics;
pub mod output;

/// For [`status!`]: its lines are log events with `--log-format json`.
#[doc(hidden)]
pub use tracing;
