//! Test kit for farmap stores and stages.
//!
//! - [`conformance`]: the suite every [`Store`](farmap_core::Store) runs: round trips, zeros
//!   for chunks never written, exact lengths, out-of-range errors, trim, status, and concurrent
//!   readers and writers that must never see a torn chunk.
//! - [`PatternStore`]: a read-only store whose every byte is a function of its offset, with
//!   [`pattern_bytes`] as the oracle to compare against; [`versioned_chunk`] and
//!   [`chunk_content`](conformance::chunk_content) for chunks written in versions.
//! - [`contents`]: a whole store's bytes, read or written.
//! - [`Hooked`]: a store wrapper that runs a hook before each read, write and flush (to
//!   count, record, delay, block or fail it), and can see the data written or change the
//!   data read.
//! - [`wait`]: bounded waits ([`block_on`], a closure within a time limit, a condition that
//!   must come true).
//! - [`mod@skip`]: how a test that cannot run here says so (counted by `scripts/test.sh`), and
//!   the checks that decide it.
//! - [`service`]: real servers (Redis, MinIO, Cassandra...) started for a test by a script.
//! - [`vm`]: a qemu VM with a kernel that has nbd and ublk, for kernel frontend tests.
//! - [`cli`]: the `farmap` binary run by the CLI's tests; [`process`]: child processes whose
//!   output is read as it comes; [`tools`]: programs installed when missing; [`demo`]:
//!   applications with a live region and the `farmap seed` / `farmap leech` that move it.
//! - [`tls`]: certificates made at run time.
//! - [`alloc`](mod@alloc): a global allocator that counts, for tests that measure allocations.
//! - [`printed`]: checks on figures a command printed rounded.
//! - [`strategies`]: proptest strategies for operation sequences run against a plain `Vec<u8>`.
// `unsafe` only in `alloc` (a global allocator cannot be written without it).
#![deny(unsafe_code)]

#[allow(unsafe_code)]
pub mod alloc;
pub mod cli;
pub mod conformance;
pub mod contents;
pub mod demo;
pub mod fds;
mod hooked;
mod model;
mod objects;
mod pattern;
pub mod printed;
pub mod process;
pub mod service;
pub mod skip;
pub mod strategies;
pub mod tls;
pub mod tools;
#[cfg(feature = "versions")]
pub mod versioned;
pub mod vm;
pub mod wait;

pub use conformance::{run_conformance, run_conformance_with, run_read_only_conformance};
pub use hooked::{Hook, Hooked, Op, ReadMap, WriteHook};
pub use model::ModelStore;
pub use objects::check_objects_contract;
pub use pattern::{
    pattern_byte, pattern_bytes, pattern_with_zeros, versioned_chunk, PatternStore, XorShift,
};
pub use service::{unique_name, Service, ServiceError};
pub use skip::{is_ci, skip};
pub use wait::block_on;
