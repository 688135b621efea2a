//! How a [`Region`](crate::Region) is opened: [`RegionOptions`] and its enums.

use std::time::Duration;

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

/// A bound on a region's local memory: bytes, or a share of the region's size (`SIZE|N%`,
/// the grammar of every such bound).
pub type LocalLimit = farmap_core::SizeOrPercent;

/// The chunk size farmap picks for a bounded region whose store layout is its own choice
/// (a `memory:` or `file:` spec without `chunk=`): the kernel's page size, so that a fault
/// moves what kernel swap would move. Chosen by `farmap bench paging`: with 64 KiB chunks
/// its zipf case misses the bars against kernel swap, with 4 KiB chunks it meets them
/// (`docs/benchmarks.md`).
pub const PAGING_CHUNK_SIZE: u32 = 4096;

/// The prefetch window a bounded region gets by default, in chunks.
pub const DEFAULT_PREFETCH_CHUNKS: u32 = 32;

/// Bounded local memory for a region (see [`paging`](crate#bounded-local-memory)).
#[derive(Debug, Clone, PartialEq)]
pub struct PagingOptions {
    /// The most memory the region holds locally (mapped plus staged chunks).
    pub local_max: LocalLimit,
    /// Chunks the proactive reclaim keeps free below the limit (`None`: 1/32 of the limit,
    /// at least one).
    pub min_free: Option<u64>,
    /// Whether a reclaim thread keeps `min_free` chunks free ahead of faults; without it,
    /// every eviction is made by a fault that found the region full.
    pub proactive: bool,
    /// The store holds nothing for this region yet (it was created fresh): every chunk
    /// starts in the zero state, and its first touch maps zero pages (`UFFDIO_ZEROPAGE`)
    /// instead of reading the store. A chunk leaves the zero state for good once it has
    /// been written back.
    pub fresh: bool,
    /// Per-thread sequential prefetch.
    pub prefetch: Prefetch,
    /// Resolve faults on staged chunks in the faulting thread (`UFFD_FEATURE_SIGBUS`: its
    /// `SIGBUS` handler moves the chunk back, no other thread is woken); other faults are
    /// posted to the reader. Plain loads and stores only: a system call that touches a
    /// missing page of the region fails with `EFAULT` instead of waiting. See the `signal`
    /// module (`src/signal.rs`) for what else it implies.
    pub in_thread: bool,
}

/// Prefetch of a bounded region (see the paging module's documentation). The default is a
/// sequential window of [`DEFAULT_PREFETCH_CHUNKS`]: it opens only on faults at
/// consecutive chunks, so other patterns pay next to nothing for it (`farmap bench paging
/// --pattern seq` and `uniform`, `docs/benchmarks.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prefetch {
    /// Only what faults asks for is fetched.
    Off,
    /// Each faulting thread (told apart by `UFFD_FEATURE_THREAD_ID`) has a window that
    /// doubles on every fault at the chunk after its previous fault's window, up to
    /// `max_chunks`, and closes on any other fault; the window's chunks after the faulting
    /// one are fetched once the faulting thread is woken, while there is room below the limit.
    Sequential {
        /// The largest window, in chunks (at least 1).
        max_chunks: u32,
    },
}

impl Default for Prefetch {
    fn default() -> Self {
        Prefetch::Sequential {
            max_chunks: DEFAULT_PREFETCH_CHUNKS,
        }
    }
}

impl Prefetch {
    /// `off`, or `seq:MAX`.
    pub fn name(self) -> String {
        match self {
            Prefetch::Off => "off".to_string(),
            Prefetch::Sequential { max_chunks } => format!("seq:{max_chunks}"),
        }
    }
}

impl std::str::FromStr for Prefetch {
    type Err = String;

    /// `off`, `seq` (a window of at most [`DEFAULT_PREFETCH_CHUNKS`]) or `seq:MAX`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once(':') {
            None if s == "off" => Ok(Prefetch::Off),
            None if s == "seq" => Ok(Prefetch::default()),
            Some(("seq", max)) => match max.parse::<u32>() {
                Ok(m) if (1..=4096).contains(&m) => Ok(Prefetch::Sequential { max_chunks: m }),
                _ => Err(format!(
                    "{s:?}: the window is a number of chunks from 1 to 4096 (seq:32)"
                )),
            },
            _ => Err(format!("{s:?} is not off, seq or seq:MAX")),
        }
    }
}

impl PagingOptions {
    /// A limit, the default `min_free`, proactive reclaim on, the default prefetch.
    pub fn new(local_max: LocalLimit) -> Self {
        Self {
            local_max,
            min_free: None,
            proactive: true,
            fresh: false,
            prefetch: Prefetch::default(),
            in_thread: false,
        }
    }
}

/// What a bounded region's chunk holds once the application has discarded its pages (a
/// remove event: `madvise(MADV_DONTNEED)` and the like).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RemoveMeans {
    /// The store's copy: the next touch fetches the chunk again (a region's memory is the
    /// store's content).
    #[default]
    Refetch,
    /// Zeros, as anonymous memory would hold (a program's heap): the store's old copy is
    /// never read again, and the chunk's next push writes zeros. Needs chunks of one page,
    /// so that a remove covers whole chunks.
    Zero,
}

/// How a region's fault reader waits for the next fault (see the `polling` module:
/// `src/polling.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FaultWait {
    /// Block in `poll(2)` as soon as no message is queued: no CPU spent while idle. One
    /// reader per CPU (at most 8), each kept to its CPU, so that the reader of the faulting
    /// thread's CPU serves the fault without waking an idle virtual CPU, for itself or for the
    /// faulting thread (a single reader on another CPU paid both: tens of µs here). A reader
    /// whose CPU has no faulting thread rests for a few ms at a time.
    #[default]
    Sleep,
    /// One reader, which after each batch keeps reading the userfaultfd without sleeping for
    /// up to this long before blocking in `poll(2)` again; while that window is open, one
    /// `SCHED_IDLE` companion thread per CPU spins so that no CPU halts (any other thread
    /// preempts them at once). Back-to-back faults then pay neither wake-up, at the cost of the reader's
    /// spinning (a CPU for up to the window after each fault) and of otherwise idle CPU
    /// time (see [`RegionStats::handler_cpu`](crate::RegionStats::handler_cpu)).
    Poll(Duration),
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
    /// Bounded local memory (`None`: every chunk touched stays local). Needs asynchronous
    /// write tracking and `UFFDIO_MOVE`; a managed region's background pull is off with it
    /// (it would fill the region past the limit).
    pub paging: Option<PagingOptions>,
    /// How the fault reader waits for faults (sleeping by default).
    pub fault_wait: FaultWait,
    /// Keep one copy in memory of each clean chunk that this region shares with other regions
    /// of this host over the same base (forks of one version, openings of one version: a
    /// store that says so, see [`farmap_core::MemoryBase`]); written pages become private
    /// copies. On by default; off, or without such a store, bounded memory or minor faults on
    /// shmem, every page is the region's own.
    pub share_clean_pages: bool,
    /// Where shared bases go: a private directory on tmpfs (made if missing; refused, and
    /// nothing shared, unless ours, mode 0700 and on tmpfs); `None`: `/dev/shm/farmap-UID`.
    pub shared_dir: Option<std::path::PathBuf>,
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
            paging: None,
            fault_wait: FaultWait::Sleep,
            share_clean_pages: true,
            shared_dir: None,
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
