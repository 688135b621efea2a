//! How a [`Region`](crate::Region) is opened: [`RegionOptions`] and its enums.

use farmap_pipeline::{PullOptions, PushOptions, RetryPolicy};

/// Where a region's chunks come from besides faults.
#[derive(Debug, Clone)]
pub enum RegionMode {
    /// A background [`Puller`](farmap_pipeline::Puller) fills the region ahead of the
    /// application (faulted chunks and the chunks after them jump its queue); written chunks
    /// are pushed on the push interval and at [`sync`](crate::Region::sync).
    Managed(PullOptions),
    /// No background pull: each fault fetches its chunk from the store. Written chunks are
    /// pushed on the push interval and at [`sync`](crate::Region::sync).
    Direct,
}

/// Which write tracking a region asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WriteTracking {
    /// Asynchronous write protection (`UFFD_FEATURE_WP_ASYNC` + `PAGEMAP_SCAN`) where the
    /// kernel has it, synchronous write-protect faults otherwise.
    #[default]
    Auto,
    /// Asynchronous write protection, or fail to open.
    Async,
    /// Synchronous write-protect faults even where asynchronous protection exists (each first
    /// write after a scan costs a round trip through the handler; for tests and old kernels).
    SyncFaults,
}

/// The write tracking a region uses (see [`Region::tracking_mode`](crate::Region::tracking_mode)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TrackingMode {
    /// Pages are installed write-protected; the kernel resolves the first write to a page by
    /// itself (≈ 1 µs) and `PAGEMAP_SCAN` collects and re-protects written pages at once.
    Async,
    /// Pages are installed write-protected; the first write to a page faults to the handler,
    /// which records the page and unprotects it; a scan re-protects recorded pages.
    SyncFaults,
}

impl TrackingMode {
    /// A short name for logs and benchmark output.
    pub fn as_str(self) -> &'static str {
        match self {
            TrackingMode::Async => "wp-async",
            TrackingMode::SyncFaults => "wp-sync",
        }
    }
}

/// How to open a [`Region`](crate::Region).
#[derive(Debug, Clone)]
pub struct RegionOptions {
    /// Managed (background pull) or direct (fetch on fault only).
    pub mode: RegionMode,
    /// Write tracking to use.
    pub tracking: WriteTracking,
    /// Write-back of written chunks: workers, interval (`None`: only at `sync`), retries.
    pub push: PushOptions,
    /// Retries of a fault's fetch that fails with a retryable error; when they run out (or
    /// the error is permanent) the faulting thread gets SIGBUS.
    pub fetch_retry: RetryPolicy,
    /// Map the region at this address (page-aligned); fails if anything is mapped there.
    pub address: Option<usize>,
    /// Worker threads of the region's own runtime (fetches in flight, pushes, pull).
    pub worker_threads: usize,
    /// In managed mode, how many chunks after a faulted one jump the puller's queue with it.
    pub readahead_chunks: u32,
    /// How another process can open the same store (a store spec such as
    /// `file:/data/disk.img`); needed to hand the region's fault handling over. Set by
    /// `farmap::open_region`.
    pub store_spec: Option<String>,
}

impl Default for RegionOptions {
    /// Managed with the default pull options, automatic tracking, default push options
    /// (every second), default retries, any address, 2 worker threads, 4 chunks of readahead.
    fn default() -> Self {
        Self {
            mode: RegionMode::Managed(PullOptions::default()),
            tracking: WriteTracking::Auto,
            push: PushOptions::default(),
            fetch_retry: RetryPolicy::default(),
            address: None,
            worker_threads: 2,
            readahead_chunks: 4,
            store_spec: None,
        }
    }
}

impl RegionOptions {
    /// Direct mode, everything else default.
    pub fn direct() -> Self {
        Self {
            mode: RegionMode::Direct,
            ..Self::default()
        }
    }
}
