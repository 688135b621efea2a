//! Write tracking: which pages the application wrote since the last scan, per 4 KiB page,
//! re-protected atomically with respect to concurrent writers; and the region as the
//! [`DirtySource`] of its pusher.
//!
//! - **Asynchronous** ([`TrackingMode::Async`]): one `PAGEMAP_SCAN` with
//!   `PM_SCAN_WP_MATCHING` returns the written pages and write-protects them in the same
//!   walk. Pages without data (never touched, discarded, poisoned) are reported as written
//!   by the kernel and skipped here: only pages that are present or swapped count.
//! - **Synchronous** ([`TrackingMode::SyncFaults`]): the handler records each page whose
//!   write-protect fault it serves in [`PageBits`] (after unprotecting it); a scan takes each
//!   recorded bit (clearing it) and only then protects the page again. A write between the two
//!   steps lands before the protection, hence before the push that follows the scan reads
//!   the page; a write after them faults and is recorded for the next scan.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use farmap_core::{ErrorKind, Geometry, StoreError, StoreResult};
use farmap_pipeline::{DirtySet, DirtySource};
use parking_lot::Mutex;

use crate::error::RegionError;
use crate::memory::Events;
use crate::options::TrackingMode;
use crate::pagemap::Pagemap;
use crate::space::Area;
use crate::stats::{Counters, DirtyReport};
use crate::sys::PageRegion;
use crate::uffd::UffdRange;

/// How long a synchronous scan waits for pending events to be read before it gives up.
const PROTECT_PATIENCE: Duration = Duration::from_secs(5);

/// One bit per page, set by write-protect faults and taken by scans.
#[derive(Debug)]
pub(crate) struct PageBits {
    words: Box<[AtomicU64]>,
}

impl PageBits {
    pub fn new(pages: u64) -> Self {
        Self {
            words: (0..pages.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    pub fn set(&self, page: u64) {
        self.words[(page / 64) as usize].fetch_or(1 << (page % 64), Ordering::AcqRel);
    }

    /// Sets the bits of `pages`, a word at a time.
    fn set_range(&self, pages: Range<u64>) {
        let mut page = pages.start;
        while page < pages.end {
            let in_word = page % 64;
            let n = (64 - in_word).min(pages.end - page);
            let mask = if n == 64 {
                u64::MAX
            } else {
                ((1u64 << n) - 1) << in_word
            };
            self.words[(page / 64) as usize].fetch_or(mask, Ordering::AcqRel);
            page += n;
        }
    }

    /// Clears the bits of `pages` (their pages were discarded: nothing written is left).
    pub fn clear(&self, pages: Range<u64>) {
        for page in pages {
            let bit = 1u64 << (page % 64);
            let word = &self.words[(page / 64) as usize];
            if word.load(Ordering::Relaxed) & bit != 0 {
                word.fetch_and(!bit, Ordering::AcqRel);
            }
        }
    }

    /// Clears every set bit and calls `f` with each run of set pages, in ascending order.
    fn take(
        &self,
        mut f: impl FnMut(Range<u64>) -> Result<(), RegionError>,
    ) -> Result<(), RegionError> {
        let mut run: Option<Range<u64>> = None;
        for (w, word) in self.words.iter().enumerate() {
            if word.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut bits = word.swap(0, Ordering::AcqRel);
            while bits != 0 {
                let page = w as u64 * 64 + u64::from(bits.trailing_zeros());
                bits &= bits - 1;
                match &mut run {
                    Some(r) if r.end == page => r.end += 1,
                    _ => {
                        if let Some(r) = run.replace(page..page + 1) {
                            f(r)?;
                        }
                    }
                }
            }
        }
        if let Some(r) = run {
            f(r)?;
        }
        Ok(())
    }
}

/// The region's write tracker.
pub(crate) struct Tracker {
    mode: TrackingMode,
    range: UffdRange,
    geometry: Geometry,
    pagemap: Pagemap,
    scratch: Mutex<Vec<PageRegion>>,
    written: Option<Arc<PageBits>>,
    events: Arc<Events>,
    counters: Arc<Counters>,
    mapping: Area,
    /// The pages written since the last [`take_observed`](Self::take_observed), whoever
    /// scanned them (a push round, `take_dirty`, or that call): set by every scan once a
    /// second consumer (a migration) asked for them the first time.
    observed: OnceLock<PageBits>,
}

impl Tracker {
    /// A tracker of `range` (the region `mapping`), scanning the page tables of `pagemap`
    /// (the region's process's).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        mode: TrackingMode,
        range: UffdRange,
        geometry: Geometry,
        written: Option<Arc<PageBits>>,
        events: Arc<Events>,
        counters: Arc<Counters>,
        mapping: Area,
        pagemap: Pagemap,
    ) -> Self {
        Self {
            mapping,
            mode,
            range,
            geometry,
            pagemap,
            scratch: Mutex::new(Vec::with_capacity(1024)),
            written,
            events,
            counters,
            observed: OnceLock::new(),
        }
    }

    pub fn mode(&self) -> TrackingMode {
        self.mode
    }

    /// Calls `f` with each run of pages written since the last scan (page indices), and
    /// re-protects them. Only while the region is mapped: once it is unmapped, its addresses
    /// may belong to another mapping (even another region, whose writes a scan would steal).
    fn scan(&self, f: impl FnMut(Range<u64>)) -> Result<(), RegionError> {
        self.mapping
            .while_mapped(|| self.scan_mapped(f))
            .unwrap_or(Err(RegionError::Closed))
    }

    fn scan_mapped(&self, f: impl FnMut(Range<u64>)) -> Result<(), RegionError> {
        let whole = 0..self.range.len();
        self.scan_mapped_within(std::slice::from_ref(&whole), f)
    }

    /// [`scan_mapped`](Self::scan_mapped) over the byte ranges `within` (ascending, within the
    /// region) only, in asynchronous mode; synchronous tracking takes every recorded page
    /// (as cheap as taking some).
    fn scan_mapped_within(
        &self,
        within: &[Range<usize>],
        mut f: impl FnMut(Range<u64>),
    ) -> Result<(), RegionError> {
        let page = self.range.page_size();
        let base = self.range.base();
        let mut pages = 0;
        let mut report = |r: Range<u64>| {
            pages += r.end - r.start;
            f(r);
        };
        match self.mode {
            TrackingMode::Async => {
                let mut scratch = self.scratch.lock();
                for w in within {
                    self.pagemap
                        .collect_written(base + w.start, base + w.end, &mut scratch, |run| {
                            if run.has_data {
                                report(
                                    ((run.start - base) / page) as u64
                                        ..((run.end - base) / page) as u64,
                                );
                            }
                        })
                        .map_err(|e| RegionError::sys("PAGEMAP_SCAN of the region", e))?;
                }
            }
            TrackingMode::SyncFaults => {
                let written = self.written.as_ref().expect("sync tracking records pages");
                written.take(|r| {
                    self.protect(r.start as usize * page, (r.end - r.start) as usize * page)?;
                    report(r);
                    Ok(())
                })?;
            }
        }
        Counters::add(&self.counters.dirty_pages, pages);
        Ok(())
    }

    /// Write-protects `offset..offset+len` again, waiting while a remove event is pending.
    fn protect(&self, offset: usize, len: usize) -> Result<(), RegionError> {
        let deadline = Instant::now() + PROTECT_PATIENCE;
        loop {
            let seen = self.events.current();
            match self.range.write_protect(offset, len, true, false) {
                Ok(()) => return Ok(()),
                Err(libc::EAGAIN) if Instant::now() < deadline => {
                    // The reader thread reads the event; this is a blocking thread (the
                    // application's, or a push's scan, which `collect` runs as blocking work),
                    // so a short sleep is fine.
                    while self.events.current() == seen && Instant::now() < deadline {
                        std::thread::sleep(Duration::from_micros(50));
                    }
                }
                Err(e) => return Err(RegionError::errno("write-protecting scanned pages", e)),
            }
        }
    }

    /// Adds the run of pages `r` (after every run added so far) to `report`.
    fn add_run(&self, report: &mut DirtyReport, r: Range<u64>) {
        let shift = self.geometry.chunk_shift() - self.range.page_size().trailing_zeros();
        let first = r.start >> shift;
        let last = (r.end - 1) >> shift;
        let from = match report.chunks.last() {
            Some(c) if c.0 >= first => c.0 + 1,
            _ => first,
        };
        report
            .chunks
            .extend((from..=last).map(farmap_core::ChunkIdx));
        match report.pages.last_mut() {
            Some(p) if p.end == r.start => p.end = r.end,
            _ => report.pages.push(r),
        }
    }

    /// Like [`take`](Self::take), for the chunks of `runs` (ascending chunk runs) only.
    pub fn take_within(&self, runs: &[Range<u64>]) -> Result<DirtyReport, RegionError> {
        let chunk = u64::from(self.geometry.chunk_size());
        let len = self.range.len() as u64;
        let within: Vec<Range<usize>> = runs
            .iter()
            .map(|r| {
                (r.start.saturating_mul(chunk).min(len)) as usize
                    ..(r.end.saturating_mul(chunk).min(len)) as usize
            })
            .filter(|r| !r.is_empty())
            .collect();
        let mut report = DirtyReport::default();
        let observed = self.observed.get();
        self.mapping
            .while_mapped(|| {
                self.scan_mapped_within(&within, |r| {
                    if let Some(o) = observed {
                        o.set_range(r.clone());
                    }
                    self.add_run(&mut report, r);
                })
            })
            .unwrap_or(Err(RegionError::Closed))?;
        Counters::add(&self.counters.dirty_chunks, report.chunks.len() as u64);
        Ok(report)
    }

    /// The runs of pages (page indices, ascending, merged) of `pages` that are present in
    /// memory, from the page tables; changes nothing. Only while the region is mapped.
    pub fn in_memory_within(&self, pages: Range<u64>) -> Result<Vec<Range<u64>>, RegionError> {
        let page = self.range.page_size();
        let base = self.range.base();
        let total = (self.range.len() / page) as u64;
        let (first, last) = (pages.start.min(total), pages.end.min(total));
        let mut runs: Vec<Range<u64>> = Vec::new();
        if first >= last {
            return Ok(runs);
        }
        self.mapping
            .while_mapped(|| {
                let mut scratch = self.scratch.lock();
                self.pagemap.in_memory(
                    base + first as usize * page,
                    base + last as usize * page,
                    &mut scratch,
                    |run| {
                        let r =
                            ((run.start - base) / page) as u64..((run.end - base) / page) as u64;
                        match runs.last_mut() {
                            Some(p) if p.end == r.start => p.end = r.end,
                            _ => runs.push(r),
                        }
                    },
                )
            })
            .map(|r| r.map_err(|e| RegionError::sys("PAGEMAP_SCAN of pages in memory", e)))
            .unwrap_or(Err(RegionError::Closed))?;
        Ok(runs)
    }

    /// The pages written since the last scan, and their chunks.
    pub fn take(&self) -> Result<DirtyReport, RegionError> {
        let mut report = DirtyReport::default();
        let observed = self.observed.get();
        self.scan(|r| {
            if let Some(o) = observed {
                o.set_range(r.clone());
            }
            self.add_run(&mut report, r);
        })?;
        Counters::add(&self.counters.dirty_chunks, report.chunks.len() as u64);
        Ok(report)
    }

    /// For a second consumer of the writes (a migration), besides the pusher: scans, and
    /// returns `(scanned, observed)`: what this scan found (whose chunks the caller gives
    /// back to the pusher) and every page written since the previous call, including the
    /// pages push rounds and `take_dirty` scanned meanwhile. The first call starts the
    /// record; it returns what its own scan finds.
    pub fn take_observed(&self) -> Result<(DirtyReport, DirtyReport), RegionError> {
        let pages = (self.range.len() / self.range.page_size()) as u64;
        let observed = self.observed.get_or_init(|| PageBits::new(pages));
        let scanned = self.take()?;
        let mut report = DirtyReport::default();
        observed.take(|r| {
            self.add_run(&mut report, r);
            Ok(())
        })?;
        Ok((scanned, report))
    }
}

impl Tracker {
    /// Runs the scan `take` as blocking work and marks the chunks it found in `into`.
    fn collect_by(
        &self,
        into: &DirtySet,
        take: impl FnOnce() -> Result<DirtyReport, RegionError>,
    ) -> StoreResult<()> {
        let on_async_worker = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        // Remove events read under the walk are handled before the chunks are marked (see
        // `Events::settle`).
        let scan = || {
            let taken = take();
            self.events.settle();
            taken
        };
        let taken = if on_async_worker {
            tokio::task::block_in_place(scan)
        } else {
            scan()
        };
        let report = taken.map_err(|e| {
            let message = format!("collecting the region's written pages: {e}");
            self.counters.error(message.clone());
            StoreError::new(ErrorKind::Io, message).with_source(e)
        })?;
        for idx in report.chunks {
            into.mark(idx);
        }
        Ok(())
    }
}

impl DirtySource for Tracker {
    /// Called by the pusher on the region's runtime. A scan is a system call that walks the
    /// page tables (and, with synchronous tracking, may wait for the reader to read pending
    /// events): it runs as blocking work, so that the runtime's other workers keep serving
    /// faults meanwhile (`block_in_place` hands this worker's queue to another thread).
    /// The calling task then finishes its poll on a thread without a worker's core, where a
    /// runtime shutting down meanwhile may already have stopped its timer: a task that makes
    /// a timer after a collect yields first (the pusher's background round does).
    fn collect(&self, into: &DirtySet) -> StoreResult<()> {
        self.collect_by(into, || self.take())
    }

    /// Scans the chunks of `runs` only (what an instant migration's seal looks at inside
    /// the downtime: the chunks written lately, not the whole region).
    fn collect_within(&self, into: &DirtySet, runs: &[Range<u64>]) -> StoreResult<()> {
        self.collect_by(into, || self.take_within(runs))
    }
}
