//! farmap's live migration: move a region that an application is writing from one host to
//! another with a pause of milliseconds, and lose nothing.
//!
//! ```text
//!   source host (seeder)                         destination host (leecher)
//!   ┌──────────────────────────┐   control      ┌──────────────────────────────────┐
//!   │ Seeder (state machine)   │◀──────────────▶│ Leecher (state machine)          │
//!   │ take_written() per 4 KiB │  own connection│  Region (managed) over           │
//!   │  Suspend hook            │                │   MigrationStore ── RemoteStore ─┼─┐
//!   │ farmap_net::serve(       │   data plane   │  discard_pages + fetch_chunks    │ │
//!   │   LiveView of region) ◀──┼────────────────┼──────────────────────────────────┼─┘
//!   └──────────────────────────┘  (pages)       └──────────────────────────────────┘
//! ```
//!
//! - [`msg`]: versioned control messages with capped lengths (no I/O).
//! - [`machine`]: [`Seeder`] and [`Leecher`] as state machines (no I/O), tested step by step.
//! - [`view`]: [`LiveView`] (the live region as a read-only store of pages, served with
//!   `farmap_net::serve`) and [`MigrationStore`] (the leecher region's store).
//! - [`suspend`]: [`Suspend`], [`WriterGate`] (in-process), [`ProcessSuspend`] (SIGSTOP).
//! - [`mount`]: the adapters that migrate a mounted file (`farmap mount --agent`), beside the
//!   region's in [`agent`].
//! - [`mod@seed`] and [`mod@leech`]: the runners, over TCP, Unix sockets, TLS and mutual TLS.
//!
//! Pre-copy pulls the region while the application runs at the source; dirty rounds discard
//! and re-fetch the pages written meanwhile while the sets shrink; the hand-over suspends
//! the source, sends the last dirty set, and the destination discards those pages and
//! resumes at once: a fault on them fetches its chunk first, the rest arrive in the
//! background (post-copy).
//!
//! The other [`Mode`]s hand over at once. Post-copy: every chunk comes from the source
//! afterwards. Instant, when the region lives in a store both hosts reach: the source pushes
//! what the store lacks for a bounded time, suspends, stops pushing for good and sends a
//! [`Manifest`] (per chunk: in the store, with the generation and XXH3-64 of its last push,
//! or only at the source); the destination reads the store, checks each chunk against the
//! manifest, and fetches from the source only what the store does not hold (or holds
//! wrong), then pushes those chunks to the store before releasing the source.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod agent;
pub mod auth;
pub mod budget;
pub mod channel;
pub mod endpoint;
pub mod event;
pub mod leech;
pub mod machine;
pub mod mount;
pub mod msg;
pub mod seed;
pub mod suspend;
pub mod view;

pub use budget::{PullBudget, PullPriority};
pub use endpoint::{Destination, EndpointError, Source};
pub use event::{Event, Observer};
pub use leech::{
    leech, leech_into, region_opener, LeechError, LeechOptions, LeechReport, OpenContext, Opener,
    Resumer, SharedOpener,
};
pub use machine::{Confirm, Convergence, Finalization, Leecher, LeecherLimits, Manifest, Seeder};
pub use msg::Mode;
pub use seed::{seed, SeedError, SeedOptions, SeedReport};
pub use suspend::{ProcessSuspend, Suspend, SuspendError, WriterGate};
pub use view::{InstantCounts, LiveView, MigrationStore};

/// CLOCK_MONOTONIC now, in ns (comparable between processes of one boot).
pub fn monotonic_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// This host's boot id (zeros if unknown).
pub fn boot_id() -> [u8; 16] {
    let mut id = [0u8; 16];
    if let Ok(s) = std::fs::read_to_string("/proc/sys/kernel/random/boot_id") {
        let hex: Vec<u8> = s.bytes().filter(u8::is_ascii_hexdigit).collect();
        for (i, pair) in hex.chunks(2).take(16).enumerate() {
            let s = std::str::from_utf8(pair).unwrap_or("0");
            id[i] = u8::from_str_radix(s, 16).unwrap_or(0);
        }
    }
    id
}
