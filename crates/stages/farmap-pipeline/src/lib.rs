//! farmap's stages: each one a [`Store`](farmap_core::Store) that owns an inner store.
//!
//! ```text
//!   frontend (uffd / fuse / nbd / ublk / CLI)
//!        │ byte ranges
//!   ┌────▼─────┐
//!   │Unaligned │  byte ranges → whole chunks; partial chunks read-modify-written
//!   └────┬─────┘  under a per-chunk lock
//!   ┌────▼─────┐
//!   │  Gated   │  holds all I/O while closed (migration finalize)
//!   └────┬─────┘
//!   ┌────▼─────┐
//!   │ Tracked  │  records dirty chunks after each write; take_dirty()
//!   └────┬─────┘
//!   ┌────▼─────┐        ┌────────┐
//!   │  Pusher  │───────▶│ remote │  write-back of dirty chunks: N workers, interval,
//!   └────┬─────┘        └───▲────┘  retries; flush() = everything pushed
//!   ┌────▼─────┐            │
//!   │  Cached  │────────────┘  local store + presence map; a miss fetches from the
//!   └────┬─────┘  ▲            remote once, however many wait for it
//!        │        │ Puller: background prefetch, N async workers, order policy,
//!     local       │ prioritize(), progress, cancel
//!
//!   Tiered: a store over several stores (memory, disk, remote) with capacities; chunks
//!   placed on first write, cold ones demoted in the background.
//!   Delayed · Faulty · Counting: latency/bandwidth, injected errors and data faults,
//!   statistics; stack them anywhere (benchmarks and tests use them).
//!   Mirrored: writes to a primary and a mirror; reads fail over, a recovered primary is
//!   resynced. Verified: checksums and generations in a side table; bad chunks refused as Corrupt.
//! ```
//!
//! Every stage decides for every [`Store`](farmap_core::Store) method what it does; none
//! forwards by default. Each stage documents its concurrency contract.
#![forbid(unsafe_code)]

pub mod cached;
pub mod counting;
pub mod delayed;
pub mod dirty;
pub mod faulty;
pub mod gated;
mod mirror_journal;
pub mod mirrored;
pub mod puller;
pub mod pusher;
pub mod retry;
pub mod tiered;
pub mod timer;
pub mod tracked;
pub mod unaligned;
pub mod verified;

pub use cached::{Cached, EvictStats, Fill};
pub use counting::{Counting, Counts};
pub use delayed::{DelayOptions, Delayed};
pub use dirty::DirtySet;
pub use faulty::{DataFaultCounts, DataFaults, FaultPlan, FaultTrigger, Faulty, OpSet};
pub use gated::{GateState, Gated};
pub use mirrored::{MirrorOptions, MirrorPolicy, MirrorStatus, Mirrored, PrimaryState};
pub use puller::{
    PullFailure, PullOptions, PullOrder, PullProgress, PullReport, Puller, PULL_BYTES_IN_FLIGHT,
};
pub use pusher::{
    DirtySource, PushDraft, PushHold, PushLedger, PushOptions, PushStats, Pusher, Seal, SealDelta,
    DRAFT_PATIENCE,
};
pub use retry::{retry, RetryPolicy};
pub use tiered::{Tier, TierOptions, Tiered};
pub use tracked::Tracked;
pub use unaligned::Unaligned;
pub use verified::{Verified, VerifiedLayout, VerifyStats};

/// The geometry of `local`, which `remote` must share: a stage between the two (`what`, "a
/// cache") is refused otherwise.
fn same_geometry(
    local: &impl farmap_core::Store,
    remote: &impl farmap_core::Store,
    what: &str,
) -> farmap_core::StoreResult<farmap_core::Geometry> {
    let geometry = local.geometry();
    if remote.geometry() != geometry {
        return Err(farmap_core::StoreError::invalid(format!(
            "the local store ({geometry}) and the remote store ({}) of {what} must have the \
             same geometry",
            remote.geometry()
        )));
    }
    Ok(geometry)
}
