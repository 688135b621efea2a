//! Test kit for farmap stores and stages.
//!
//! - [`conformance`]: the suite every [`Store`](farmap_core::Store) runs: round trips, zeros
//!   for chunks never written, exact lengths, out-of-range errors, trim, status, and concurrent
//!   readers and writers that must never see a torn chunk.
//! - [`PatternStore`]: a read-only store whose every byte is a function of its offset, with
//!   [`pattern_bytes`] as the oracle to compare against.
//! - [`mod@skip`]: how a test that cannot run here says so (counted by `scripts/test.sh`).
//! - [`service`]: real servers (Redis, MinIO, Cassandra...) started for a test by a script.
//! - [`vm`]: a qemu VM with a kernel that has nbd and ublk, for kernel frontend tests.
//! - [`printed`]: checks on figures a command printed rounded.
//! - [`strategies`]: proptest strategies for operation sequences run against a plain `Vec<u8>`.
#![forbid(unsafe_code)]

pub mod conformance;
mod model;
mod pattern;
pub mod printed;
pub mod service;
pub mod skip;
pub mod strategies;
pub mod vm;

pub use conformance::{run_conformance, run_conformance_with, run_read_only_conformance};
pub use model::ModelStore;
pub use pattern::{pattern_byte, pattern_bytes, PatternStore};
pub use service::{Service, ServiceError};
pub use skip::{is_ci, skip};
