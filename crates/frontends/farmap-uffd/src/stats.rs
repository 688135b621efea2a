//! What a region has done: [`RegionStats`], [`DirtyReport`], and the counters behind them.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use farmap_core::ChunkIdx;
use farmap_pipeline::PullProgress;
use parking_lot::Mutex;

use crate::options::TrackingMode;

/// Which process serves a region's faults.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HandlerLocation {
    /// This process (the region's own handler thread).
    Local,
    /// Another process, which received the userfaultfd (see [`handover`](crate::handover)).
    Remote,
}

/// A snapshot of a region's counters. Counters are read one by one and may be a moment apart.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RegionStats {
    /// The write tracking in use.
    pub tracking: TrackingMode,
    /// Who serves faults now.
    pub handler: HandlerLocation,
    /// Missing-page faults served by this process.
    pub faults: u64,
    /// Of those, the ones served on the handler thread without waiting (the fetch completed
    /// at once); the others waited for a fetch on the region's runtime.
    pub faults_inline: u64,
    /// Write-protect faults served (synchronous tracking only).
    pub wp_faults: u64,
    /// Fault messages (missing and write-protect: `faults + wp_faults` in all) that the
    /// reader found by reading the userfaultfd without sleeping, in the poll window of
    /// [`FaultWait::Poll`](crate::FaultWait::Poll).
    pub faults_polled: u64,
    /// Fault messages read after a blocking `poll(2)` (every fault with
    /// [`FaultWait::Sleep`](crate::FaultWait::Sleep); with `Poll`, the first fault after a
    /// pause longer than the window). The reader may not really have slept: a message
    /// queued before `poll(2)` was called returns at once.
    pub faults_slept: u64,
    /// Fault reader threads ([`FaultWait::Sleep`](crate::FaultWait::Sleep): one per CPU,
    /// each kept to its CPU; `Poll`: one).
    pub fault_readers: u32,
    /// Times a reader stopped polling for a while because its wake-ups kept finding nothing
    /// to read (the faults came from another CPU; see `src/server.rs`).
    pub reader_rests: u64,
    /// Missing faults resolved in the faulting thread's own `SIGBUS` handler, with no other
    /// thread involved ([`PagingOptions::in_thread`](crate::PagingOptions): a staged chunk
    /// moved back).
    pub faults_in_thread: u64,
    /// Missing faults the faulting thread's `SIGBUS` handler posted to the reader (in-thread
    /// mode: anything but a staged chunk); a thread woken early posts again, so this can
    /// exceed the faults.
    pub faults_signalled: u64,
    /// CPU time of this process's fault reader threads, and of the companions of
    /// [`FaultWait::Poll`](crate::FaultWait::Poll), since the region was opened.
    pub handler_cpu: HandlerCpu,
    /// Chunks installed by this process (on faults and by the puller).
    pub chunks_fetched: u64,
    /// Bytes copied in for them (pages found present are not counted).
    pub bytes_fetched: u64,
    /// Chunks the region holds as far as this process knows.
    pub present_chunks: u64,
    /// Faults on chunks thought present whose page was gone (fetched again).
    pub refetched_chunks: u64,
    /// `UFFD_EVENT_REMOVE` events (madvise `DONTNEED`/`FREE` of part of the region).
    pub remove_events: u64,
    /// Chunks those events made absent (fetched again on their next touch).
    pub removed_chunks: u64,
    /// Pages poisoned because their fetch failed (the faulting thread got SIGBUS).
    pub poisoned_pages: u64,
    /// Written pages found by scans (for pushes and [`take_dirty`](crate::Region::take_dirty)).
    pub dirty_pages: u64,
    /// Chunks those pages made dirty.
    pub dirty_chunks: u64,
    /// Chunks pushed to the store.
    pub pushed_chunks: u64,
    /// Bytes pushed.
    pub pushed_bytes: u64,
    /// Pushes that failed after their retries (the chunk stays dirty).
    pub failed_pushes: u64,
    /// The background pull's progress (managed mode).
    pub pull: Option<PullProgress>,
    /// Bounded local memory (regions with a limit).
    pub paging: Option<PagingStats>,
    /// Clean pages shared with other regions over the same base (see
    /// [`RegionOptions::share_clean_pages`](crate::RegionOptions::share_clean_pages)).
    pub shared: Option<SharedStats>,
    /// The most recent error of a fault's fetch, a push or a scan.
    pub last_error: Option<String>,
}

/// What a region's memory costs now (see [`Region::memory_use`](crate::Region::memory_use)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemoryUse {
    /// Bytes of the region mapped in this process (`Rss` of its mapping).
    pub resident_bytes: u64,
    /// Of those, the region's own pages (`Anonymous`: copied in, or written); the rest are
    /// a shared base's pages, which every region over that base maps (counted once, in the
    /// base's file).
    pub private_bytes: u64,
}

impl MemoryUse {
    /// The mapping that starts at `addr`, from `/proc/self/smaps`.
    pub(crate) fn of_mapping(addr: usize) -> std::io::Result<MemoryUse> {
        let smaps = std::fs::read_to_string("/proc/self/smaps")?;
        let head = format!("{addr:x}-");
        let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&head));
        if lines.next().is_none() {
            return Err(std::io::Error::other(format!(
                "no mapping at {addr:#x} in /proc/self/smaps"
            )));
        }
        let kb = |l: &str| -> u64 {
            l.split_whitespace()
                .nth(1)
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
                * 1024
        };
        let mut out = MemoryUse::default();
        // The mapping's fields, up to the next mapping's header (which has no colon-ended
        // first word).
        for l in lines.take_while(|l| {
            l.split_whitespace()
                .next()
                .is_some_and(|w| w.ends_with(':'))
        }) {
            if l.starts_with("Rss:") {
                out.resident_bytes = kb(l);
            } else if l.starts_with("Anonymous:") {
                out.private_bytes = kb(l);
            }
        }
        Ok(out)
    }
}

/// The counters of a region that shares its clean pages with other regions over the same
/// base.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SharedStats {
    /// The base's file (its name is the base's key).
    pub path: std::path::PathBuf,
    /// Chunks mapped from the shared file (not copies of their own).
    pub mapped_chunks: u64,
    /// Of those, chunks this region put into the file (fetched, checked against the base);
    /// the others were there already (another region fetched them).
    pub filled_chunks: u64,
}

/// CPU time spent by a region's fault path in this process, from the kernel's accounting
/// (`/proc/self/task/TID/schedstat`) of the threads running now, plus the final time of the
/// ones that have exited (a reader stopped for a hand-over, say).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct HandlerCpu {
    /// The fault reader: serving faults inline, `poll(2)`, and the poll window's reads.
    pub reader_ns: u64,
    /// The idle-priority companions of [`FaultWait::Poll`](crate::FaultWait::Poll), all
    /// together (CPU time no other thread wanted).
    pub companions_ns: u64,
    /// How many companions are running now (one per CPU while the reader runs with
    /// `Poll`; 0 otherwise).
    pub companions: u32,
}

impl HandlerCpu {
    /// Reader and companions together.
    pub fn total_ns(&self) -> u64 {
        self.reader_ns + self.companions_ns
    }
}

/// The counters of a region with bounded local memory (see
/// [`PagingOptions`](crate::PagingOptions)).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PagingStats {
    /// The limit now, in chunks.
    pub limit_chunks: u64,
    /// Chunks proactive reclaim keeps free below the limit.
    pub min_free_chunks: u64,
    /// Chunks counted against the limit now (mapped, staged, in flight).
    pub resident_chunks: u64,
    /// Of those, staged ones (moved out of the region, still local).
    pub staged_chunks: u64,
    /// Staged chunks dropped (after their write-back) by a fault that found the region full.
    pub evictions_reactive: u64,
    /// Staged chunks dropped by the reclaim thread, ahead of need.
    pub evictions_proactive: u64,
    /// Chunks moved from the region into staging.
    pub deactivations: u64,
    /// Faults served by moving a staged chunk back (no I/O), or, in a program's region
    /// (which this process cannot move pages of), by copying it back.
    pub staged_refaults: u64,
    /// Of those, the ones the faulting thread served itself (in-thread mode).
    pub staged_refaults_in_thread: u64,
    /// Chunks admitted over the limit (within `min_free`): a reclaim pass was making room,
    /// or nothing could be reclaimed.
    pub overcommits: u64,
    /// Faults that found the region at its limit (they go over it while a reclaim pass
    /// makes room, or reclaim a chunk themselves): how often the proactive reclaim fell
    /// behind.
    pub full_faults: u64,
    /// Active chunks whose pages were found in their staging slot and moved back: a bug
    /// that the fault path repairs and reports (see the paging module's documentation);
    /// always 0 unless something is wrong.
    pub recovered: u64,
    /// Moves between the region and staging that stopped part way (a busy page, an event
    /// pending) and were finished or undone.
    pub partial_moves: u64,
    /// Pushes of chunks that were not local (a stale dirty mark): read from the store,
    /// never through the region.
    pub pushes_from_store: u64,
    /// Never-written chunks filled with zero pages on their first touch (no store read).
    pub zero_fills: u64,
    /// Chunks fetched ahead of a thread's sequential faults (`Prefetch::Sequential`).
    pub prefetched: u64,
    /// Prefetched chunks that were used: the thread's next sequential fault went past them,
    /// or they were found written.
    pub prefetch_hits: u64,
    /// Prefetched chunks evicted without having been found used (a chunk only read, and
    /// not followed by a sequential fault, counts here too: reads leave no trace).
    pub prefetch_wasted: u64,
    /// Chunks a sequential stream had left behind, taken as victims before the clock's
    /// (drop-behind, with `Prefetch::Sequential`).
    pub dropped_behind: u64,
}

/// What [`Region::take_dirty`](crate::Region::take_dirty) found: the pages written since the
/// previous scan, and the chunks they lie in.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DirtyReport {
    /// The chunks holding written pages, ascending.
    pub chunks: Vec<ChunkIdx>,
    /// The written pages, as ascending, disjoint ranges of page indices (page `i` covers
    /// bytes `i * page_size .. (i + 1) * page_size` of the region).
    pub pages: Vec<Range<u64>>,
}

impl DirtyReport {
    /// Number of written pages.
    pub fn page_count(&self) -> u64 {
        self.pages.iter().map(|r| r.end - r.start).sum()
    }

    /// Whether nothing was written.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty() && self.chunks.is_empty()
    }
}

/// The counters a region's threads bump.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub faults: AtomicU64,
    pub faults_inline: AtomicU64,
    pub wp_faults: AtomicU64,
    pub faults_polled: AtomicU64,
    pub faults_slept: AtomicU64,
    pub reader_rests: AtomicU64,
    pub faults_in_thread: AtomicU64,
    pub faults_signalled: AtomicU64,
    pub chunks_fetched: AtomicU64,
    pub bytes_fetched: AtomicU64,
    pub refetched_chunks: AtomicU64,
    pub remove_events: AtomicU64,
    pub removed_chunks: AtomicU64,
    pub poisoned_pages: AtomicU64,
    pub dirty_pages: AtomicU64,
    pub dirty_chunks: AtomicU64,
    pub base_mapped: AtomicU64,
    pub base_filled: AtomicU64,
    pub last_error: Mutex<Option<String>>,
}

impl Counters {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }

    pub fn error(&self, message: String) {
        *self.last_error.lock() = Some(message);
    }
}
