//! Helpers shared by the userfaultfd tests (the generic ones are in farmap-testkit).

#[allow(dead_code)] // the foreign tests' helpers
pub mod foreign;
#[allow(dead_code)] // the paging tests' helpers
pub mod paging;

use farmap_pipeline::PushOptions;
use farmap_uffd::{RegionOptions, WriteTracking};

/// Whether userfaultfd works here. Records a skip (`farmap_testkit::skip`) when it does not;
/// under CI=true that fails the test instead (CI machines support everything).
#[allow(dead_code)] // not used by the paging tests
pub fn uffd_available(test: &str) -> bool {
    farmap_testkit::skip::unless(test, farmap_uffd::probe()).is_some()
}

/// Direct mode, no background push, the given tracking.
#[allow(dead_code)] // not used by the paging tests
pub fn direct(tracking: WriteTracking) -> RegionOptions {
    RegionOptions {
        tracking,
        push: PushOptions {
            interval: None,
            ..PushOptions::default()
        },
        ..RegionOptions::direct()
    }
}

/// Both tracking modes this kernel offers (synchronous always; asynchronous if present).
#[allow(dead_code)] // not every test binary runs its checks in both modes
pub fn tracking_modes() -> Vec<WriteTracking> {
    let mut modes = vec![WriteTracking::SyncFaults];
    if farmap_uffd::probe().is_ok_and(|s| s.tracking == farmap_uffd::TrackingMode::Async) {
        modes.insert(0, WriteTracking::Async);
    }
    modes
}
