//! NBD for farmap: any [`Store`](farmap_core::Store) served to `qemu`, `libnbd`, `nbdkit`'s
//! `nbd` plugin or the Linux kernel; and any NBD server's export used as a store
//! ([`NbdStore`], the `nbd://`, `nbds://` and `nbd+unix://` specs; see [`client`]).
//!
//! ```text
//!  accept loop (connection cap) ── per connection ───────────────────────────────────┐
//!   handshake: ServerHandshake (farmap-nbd-proto) ─ STARTTLS → rustls (mTLS) ─┐      │
//!   transmission: reader → RequestDecoder → answered in the reader when the     │      │
//!                 store does not wait, else a task (≤ in-flight cap, byte       │      │
//!                 budget) → Unaligned<Arc<dyn Store>> (shared by all            │      │
//!                 connections of an export) → reply written by whoever has it   │      │
//!                 when the socket is free, else queued for the writer task     │      │
//!                 (vectored, any order)                                         │      │
//!  ─────────────────────────────────────────────────────────────────────────────┴──────┘
//! ```
//!
//! - READ: structured replies with `OFFSET_HOLE` for chunks the store reports as zero
//!   (`Store::status`), `OFFSET_DATA` for the rest (slices of the chunks, no copy); simple
//!   replies for clients that did not negotiate structured replies. A structured read
//!   longer than the maximum payload is served in pieces of at most that size, each read
//!   and sent before the next (nothing is allocated for the whole length); a simple-reply
//!   read that long is refused with `EINVAL`.
//! - WRITE (with FUA: flushed before the reply), FLUSH, TRIM, WRITE_ZEROES (trim unless
//!   `NO_HOLE`; `FAST_ZERO` fails with `ENOTSUP` unless the store trims), CACHE (read and
//!   drop), BLOCK_STATUS for `base:allocation`, DISC (requests in flight are answered first).
//! - Errors: past the end is `EINVAL` (`ENOSPC` for writes), writes to a read-only export
//!   `EPERM`, unknown commands and flags `EINVAL`, store failures by kind. A write longer than
//!   the maximum payload is refused before its bytes are read (they are skipped) and the
//!   connection goes on; bad request magic ends the connection.
//! - Memory: a byte budget per connection charged before a request runs (a write's payload
//!   before it is read), released when its reply has been written.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod client;
mod client_conn;
mod conn;
mod ctx;
mod ops;
mod options;
mod server;

pub use client::{NbdClientOptions, NbdStore, NbdTarget, NBD_PORT};

pub use options::{Export, NbdServeOptions};
pub use server::{serve_nbd, NbdServeError, NbdServer};
