//! The raw reference for `farmap bench uffd`: the least a userfaultfd handler can do.
//!
//! The one file of the CLI with `unsafe` code: its own mapping (mmap, munmap), registering
//! it with a userfaultfd, unregistering it, and the volatile view of it the touch loops use.
//! Its plain anonymous mapping ([`AnonMapping`]) is also the memory of `farmap bench
//! paging`'s kernel-swap application (`paging_app.rs`).
//!
//! A [`Baseline`] uses nothing of farmap's pipeline — no store, no stages, no chunk map, no
//! async runtime. It maps an anonymous region, registers it with a fresh userfaultfd and
//! serves every fault from one handler thread by `UFFDIO_COPY`ing the chunk that contains the
//! faulting address straight out of a plain source buffer. Whatever a
//! `farmap_uffd::Region` spends on top of this (store reads, bookkeeping, hand-offs
//! between threads) is what the benchmark shows.
//!
//! Two modes, because write tracking changes the kernel's work:
//! - [`BaselineMode::WriteProtect`], the like-for-like reference: `UFFD_FEATURE_WP_ASYNC |
//!   UFFD_FEATURE_WP_UNPOPULATED`, registered `MISSING | WP`, pages installed with
//!   `UFFDIO_COPY_MODE_WP` — what a region that tracks writes does.
//! - [`BaselineMode::Missing`]: registered `MISSING` only, plain `UFFDIO_COPY`: the cheapest
//!   handler there is, for comparison.
//!
//! And one reference for re-faults of staged pages ([`Baseline::refault_in_thread`]): the
//! pages wait in a staging area (a second mapping, as a bounded region's), and the faulting
//! thread's own `SIGBUS` handler moves each back with one `UFFDIO_MOVE` — the least the
//! in-thread path (`UFFD_FEATURE_SIGBUS`) can cost: a fault, a signal and a move.
//!
//! The touch loops ([`touch_each`], [`touch_all`], [`write_each`]) and the page choices
//! ([`random_pages`], [`spread_pages`]) are public so that the benchmark drives a region with
//! exactly the code it drives the baseline with.
//!
//! # Concurrency
//! - One handler thread per measurement, scoped to it; the measuring thread is the only one
//!   touching the region. The in-thread reference has no handler thread: its `SIGBUS` handler
//!   is installed for the measurement and the one before it put back afterwards, so it must
//!   not overlap a farmap region resolving faults in its threads (the benchmark runs one
//!   measurement at a time; a second in-thread reference at once is refused).
//! - If the handler meets an error it cannot serve around, it unregisters the region, which
//!   wakes every blocked touch (they then read zero pages): the measurement ends with an
//!   error, never with a hung thread.

use std::hint::black_box;
use std::io;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use farmap_memory::RegionSlice;
use farmap_uffd::pagemap::Pagemap;
use farmap_uffd::sys;
use farmap_uffd::uffd::{InstallError, Uffd, UffdRange};
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::mm::{self, MapFlags, ProtFlags};

/// The reference's own `ioctl(2)` (`farmap-uffd` keeps its wrapper private): the result, or
/// the `errno`.
///
/// # Safety
/// As for any `ioctl`: `arg` points to a live value of the type `req` expects, and every
/// range it names belongs to this reference's own mappings.
unsafe fn raw_ioctl<T>(fd: std::os::fd::RawFd, req: u64, arg: *mut T) -> Result<i32, i32> {
    // SAFETY: forwarded to the caller's contract above.
    match unsafe { libc::ioctl(fd, req as libc::c_ulong, arg) } {
        r if r < 0 => Err(farmap_memory::sys::errno()),
        r => Ok(r),
    }
}

/// The page size the baseline works in (and the one its page indices count in): 4 KiB.
pub const PAGE_SIZE: usize = 4096;

/// How the baseline registers its region and installs pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BaselineMode {
    /// Registered `MISSING` only; pages installed with a plain `UFFDIO_COPY`.
    Missing,
    /// `UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED`, registered `MISSING | WP`, pages
    /// installed with `UFFDIO_COPY_MODE_WP`: the like-for-like reference for a region that
    /// tracks writes.
    WriteProtect,
}

impl BaselineMode {
    fn features(self) -> u64 {
        match self {
            Self::Missing => 0,
            Self::WriteProtect => sys::UFFD_FEATURE_WP_ASYNC | sys::UFFD_FEATURE_WP_UNPOPULATED,
        }
    }

    fn register_mode(self) -> u64 {
        match self {
            Self::Missing => sys::UFFDIO_REGISTER_MODE_MISSING,
            Self::WriteProtect => sys::UFFDIO_REGISTER_MODE_MISSING | sys::UFFDIO_REGISTER_MODE_WP,
        }
    }

    fn write_protect(self) -> bool {
        self == Self::WriteProtect
    }
}

/// Latency percentiles of individually timed touches.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Latencies {
    /// Median, in microseconds.
    pub p50_us: f64,
    /// 99th percentile, in microseconds.
    pub p99_us: f64,
    /// The slowest touch, in microseconds.
    pub max_us: f64,
    /// How many touches were timed.
    pub samples: usize,
}

impl Latencies {
    /// Percentiles (nearest rank) of `samples`; all zero when there are none.
    pub fn from_samples(mut samples: Vec<Duration>) -> Self {
        if samples.is_empty() {
            return Self {
                p50_us: 0.0,
                p99_us: 0.0,
                max_us: 0.0,
                samples: 0,
            };
        }
        samples.sort_unstable();
        let at = |p: f64| {
            let i = ((samples.len() - 1) as f64 * p).round() as usize;
            samples[i].as_secs_f64() * 1e6
        };
        Self {
            p50_us: at(0.5),
            p99_us: at(0.99),
            max_us: at(1.0),
            samples: samples.len(),
        }
    }
}

/// What a sequential fill did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fill {
    /// Bytes filled (the region's size).
    pub bytes: u64,
    /// From the first touch to the end of the last.
    pub elapsed: Duration,
    /// Faults the handler served.
    pub faults: u64,
}

impl Fill {
    /// Throughput in MB/s (10^6 bytes).
    pub fn mb_per_s(&self) -> f64 {
        let secs = self.elapsed.as_secs_f64();
        if secs == 0.0 {
            return 0.0;
        }
        self.bytes as f64 / secs / 1e6
    }
}

/// What a timed scan for written pages found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirtyScan {
    /// The scan: every `PAGEMAP_SCAN` call from the start of the region to its end.
    pub elapsed: Duration,
    /// Pages written before the scan.
    pub written_pages: u64,
    /// Pages the scan reported as written (and re-protected).
    pub reported_pages: u64,
}

/// What went wrong in a baseline measurement.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BaselineError {
    /// The parameters do not describe a measurement the baseline can make.
    #[error("invalid baseline parameters: {0}")]
    Invalid(String),
    /// A system call needed to set up or scan the region failed.
    #[error("{what} failed")]
    Sys {
        /// What was being done, e.g. `registering the region`.
        what: &'static str,
        /// The system's error.
        #[source]
        source: io::Error,
    },
    /// The handler could not install a chunk; the touches after it read zero pages.
    #[error("the baseline handler could not install the chunk at offset {offset:#x}")]
    Serve {
        /// Offset of the chunk in the region.
        offset: usize,
        /// The system's error.
        #[source]
        source: io::Error,
    },
    /// The handler thread panicked.
    #[error("the baseline handler thread panicked")]
    HandlerPanicked,
}

fn sys_err(what: &'static str) -> impl FnOnce(io::Error) -> BaselineError {
    move |source| BaselineError::Sys { what, source }
}

/// A raw userfaultfd handler serving a region whose content is a plain buffer.
#[derive(Debug, Clone, Copy)]
pub struct Baseline<'a> {
    source: &'a [u8],
    mode: BaselineMode,
}

impl<'a> Baseline<'a> {
    /// A baseline whose region is `source.len()` bytes and reads as `source`.
    ///
    /// The length must be a non-zero multiple of [`PAGE_SIZE`] (which must be the system's
    /// page size).
    pub fn new(source: &'a [u8], mode: BaselineMode) -> Result<Self, BaselineError> {
        if farmap_memory::sys::page_size() != PAGE_SIZE {
            return Err(BaselineError::Invalid(format!(
                "the system's page size is {}, the baseline assumes {PAGE_SIZE}",
                farmap_memory::sys::page_size()
            )));
        }
        if source.is_empty() || !source.len().is_multiple_of(PAGE_SIZE) {
            return Err(BaselineError::Invalid(format!(
                "a region of {} bytes is not a non-zero multiple of {PAGE_SIZE}",
                source.len()
            )));
        }
        Ok(Self { source, mode })
    }

    /// Times a read of each page in `pages` (page indices), each alone; every fault is served
    /// by copying the `chunk`-sized chunk around it. Setup and teardown are not timed.
    pub fn fault_latency(&self, chunk: usize, pages: &[usize]) -> Result<Latencies, BaselineError> {
        self.check_pages(pages)?;
        let (samples, _) = self.with_handler(chunk, |mem| touch_each(mem, pages))?;
        Ok(Latencies::from_samples(samples))
    }

    /// Reads every page in order, each fault served by copying a `chunk`-sized chunk; timed
    /// from the first touch to the end of the last.
    pub fn fill(&self, chunk: usize) -> Result<Fill, BaselineError> {
        let (elapsed, faults) = self.with_handler(chunk, touch_all)?;
        Ok(Fill {
            bytes: self.source.len() as u64,
            elapsed,
            faults,
        })
    }

    /// Times one scan for written pages — `PAGEMAP_SCAN` with `PM_SCAN_WP_MATCHING |
    /// PM_SCAN_CHECK_WPASYNC`, the call a region's `take_dirty` makes — after writing one byte
    /// of each page in `pages`. Untimed before that: the whole region is installed
    /// write-protected (1 MiB copies, no faults) and scanned once. Always in the
    /// [`BaselineMode::WriteProtect`] setup, whatever this baseline's mode.
    pub fn dirty_scan(&self, pages: &[usize]) -> Result<DirtyScan, BaselineError> {
        self.check_pages(pages)?;
        let region = Registered::new(self.source.len(), BaselineMode::WriteProtect)?;
        const STEP: usize = 1 << 20;
        for offset in (0..self.source.len()).step_by(STEP) {
            let end = (offset + STEP).min(self.source.len());
            install(&region.range, offset, &self.source[offset..end], true)?;
        }
        let pagemap = Pagemap::open_self().map_err(sys_err("opening /proc/self/pagemap"))?;
        let mut scratch = Vec::with_capacity(4096);
        let (start, end) = (
            region.range.base(),
            region.range.base() + region.range.len(),
        );
        scan_written(&pagemap, start, end, &mut scratch)?;
        // Every page is present (installed above), so no write blocks on the handler-less fd.
        write_each(region.slice(), pages);
        let started = Instant::now();
        let reported = scan_written(&pagemap, start, end, &mut scratch)?;
        let elapsed = started.elapsed();
        Ok(DirtyScan {
            elapsed,
            written_pages: pages.len() as u64,
            reported_pages: reported,
        })
    }

    /// Times a read of each page in `pages` (page indices), each alone, where every page
    /// waits in a staging area and the faulting thread moves it back itself: the region's
    /// userfaultfd has `UFFD_FEATURE_SIGBUS` (and a write-tracking region's features, like a
    /// farmap region's), and a `SIGBUS` handler issues one `UFFDIO_MOVE` of the page from the
    /// staging area (registered write-protect-only with a second userfaultfd, as a bounded
    /// region's is) and returns. Setup (staging the pages) and teardown are not timed.
    pub fn refault_in_thread(&self, pages: &[usize]) -> Result<Latencies, BaselineError> {
        self.check_pages(pages)?;
        let len = self.source.len();
        let features = sys::UFFD_FEATURE_SIGBUS
            | sys::UFFD_FEATURE_MOVE
            | BaselineMode::WriteProtect.features();
        let region =
            Registered::with_features(len, features, BaselineMode::WriteProtect.register_mode())?;
        let staging = AnonMapping::new(len).map_err(sys_err("mapping the staging area"))?;
        for &p in pages {
            let at = p * PAGE_SIZE;
            staging
                .slice()
                .write_from(at, &self.source[at..at + PAGE_SIZE])
                .expect("pages are checked");
        }
        let quiet = Uffd::open(sys::UFFD_FEATURE_MOVE)
            .map_err(sys_err("opening the staging area's userfaultfd"))?;
        // SAFETY: the staging mapping is ours, anonymous, private and page-aligned; write-protect
        // mode only changes nothing until a page is protected, which nothing here does.
        unsafe { quiet.register(staging.addr(), len, sys::UFFDIO_REGISTER_MODE_WP) }
            .map_err(sys_err("registering the staging area"))?;
        let handler = InThreadHandler::install(
            region.range.base(),
            len,
            staging.addr(),
            region.range.uffd().as_raw_fd(),
        )?;
        let samples = touch_each(region.slice(), pages);
        let (moved, failed) = handler.uninstall();
        if failed > 0 || moved < pages.len() as u64 {
            return Err(BaselineError::Serve {
                offset: 0,
                source: io::Error::other(format!(
                    "the in-thread handler moved {moved} of {} pages back ({failed} moves failed)",
                    pages.len()
                )),
            });
        }
        Ok(Latencies::from_samples(samples))
    }

    fn check_pages(&self, pages: &[usize]) -> Result<(), BaselineError> {
        let npages = self.source.len() / PAGE_SIZE;
        match pages.iter().find(|&&p| p >= npages) {
            Some(p) => Err(BaselineError::Invalid(format!(
                "page {p} is past the end of a region of {npages} pages"
            ))),
            None => Ok(()),
        }
    }

    /// Maps and registers a region, serves its faults from a scoped handler thread while `f`
    /// touches it, then stops the handler. Returns `f`'s result and the faults served.
    fn with_handler<R>(
        &self,
        chunk: usize,
        f: impl FnOnce(RegionSlice<'_>) -> R,
    ) -> Result<(R, u64), BaselineError> {
        if !chunk.is_power_of_two() || chunk < PAGE_SIZE {
            return Err(BaselineError::Invalid(format!(
                "chunk {chunk} is not a power of two of at least {PAGE_SIZE}"
            )));
        }
        let region = Registered::new(self.source.len(), self.mode)?;
        let stop = AtomicBool::new(false);
        let faults = AtomicU64::new(0);
        let ready = Barrier::new(2);
        let handler = Handler {
            region: &region,
            source: self.source,
            chunk,
            write_protect: self.mode.write_protect(),
            stop: &stop,
            faults: &faults,
            ready: &ready,
        };
        std::thread::scope(|s| {
            let thread = std::thread::Builder::new()
                .name("uffd-baseline".into())
                .spawn_scoped(s, move || handler.run())
                .map_err(sys_err("spawning the handler thread"))?;
            // Stops the handler even if `f` panics, so that the scope can join it.
            struct StopOnDrop<'s>(&'s AtomicBool);
            impl Drop for StopOnDrop<'_> {
                fn drop(&mut self) {
                    self.0.store(true, Ordering::Release);
                }
            }
            let guard = StopOnDrop(&stop);
            // The handler thread is up before the touches (and any clock) start.
            ready.wait();
            // A page not yet present blocks the reader until the handler installs it, or —
            // after a handler error — until the region is unregistered and reads as zeros.
            let result = f(region.slice());
            drop(guard);
            thread
                .join()
                .map_err(|_| BaselineError::HandlerPanicked)??;
            Ok((result, faults.load(Ordering::Relaxed)))
        })
    }
}

/// Reads one byte of each page in `pages` (page indices into `mem`, which must lie in it),
/// timing each read alone.
pub fn touch_each(mem: RegionSlice<'_>, pages: &[usize]) -> Vec<Duration> {
    let mut out = Vec::with_capacity(pages.len());
    for &p in pages {
        let started = Instant::now();
        black_box(mem.load_u8(p * PAGE_SIZE).expect("pages are checked"));
        out.push(started.elapsed());
    }
    out
}

/// Reads one byte of every page of `mem` in order; returns the time from the first read to
/// the end of the last.
pub fn touch_all(mem: RegionSlice<'_>) -> Duration {
    let started = Instant::now();
    for offset in (0..mem.len()).step_by(PAGE_SIZE) {
        black_box(mem.load_u8(offset).expect("in range"));
    }
    started.elapsed()
}

/// Changes one byte of each page in `pages` (page indices into `mem`, which must lie in it).
pub fn write_each(mem: RegionSlice<'_>, pages: &[usize]) {
    for &p in pages {
        let off = p * PAGE_SIZE;
        let b = mem.load_u8(off).expect("pages are checked");
        mem.store_u8(off, b.wrapping_add(1))
            .expect("pages are checked");
    }
}

/// `count` distinct page indices below `npages` (`count` is capped at `npages`), in a random
/// order fixed by `seed`.
pub fn random_pages(npages: usize, count: usize, seed: u64) -> Vec<usize> {
    let count = count.min(npages);
    let mut all: Vec<usize> = (0..npages).collect();
    // xorshift64*; any non-zero state works.
    let mut x = seed | 1;
    let mut next = move || {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    // A partial Fisher–Yates shuffle: the first `count` entries are the sample.
    for i in 0..count {
        let j = i + (next() % (npages - i) as u64) as usize;
        all.swap(i, j);
    }
    all.truncate(count);
    all
}

/// `percent`% of `npages` pages (at least one when `percent > 0`; `percent` is capped at
/// 100), evenly spread: 1% is every 100th page, 100% is every page.
pub fn spread_pages(npages: usize, percent: u32) -> Vec<usize> {
    let count = (npages as u128 * u128::from(percent.min(100)) / 100) as usize;
    let count = if percent > 0 { count.max(1) } else { 0 };
    (0..count)
        .map(|i| (i as u128 * npages as u128 / count as u128) as usize)
        .collect()
}

/// An anonymous private mapping of the baseline's own (and of `farmap bench paging`'s
/// kernel-swap application), unmapped on drop.
#[derive(Debug)]
pub struct AnonMapping {
    /// The first byte (an address, so that the handler thread may share the value).
    addr: usize,
    len: usize,
}

impl AnonMapping {
    /// A fresh mapping of `len` bytes (its pages appear on first touch).
    pub fn new(len: usize) -> io::Result<AnonMapping> {
        // SAFETY: a fresh anonymous mapping at an address the kernel picks: no existing memory
        // is touched.
        let p = unsafe {
            mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE | MapFlags::NORESERVE,
            )
        }?;
        Ok(AnonMapping {
            addr: p as usize,
            len,
        })
    }

    fn addr(&self) -> usize {
        self.addr
    }

    /// The memory, as a volatile slice borrowed from `self`.
    pub fn slice(&self) -> RegionSlice<'_> {
        let ptr = NonNull::new(self.addr as *mut u8).expect("mmap never maps at 0");
        // SAFETY: the mapping stays mapped while `self` is borrowed (it is unmapped only when
        // `self` drops), and no Rust reference into it is ever made: this file and
        // `paging_app.rs` reach it only through volatile `RegionSlice` accesses.
        unsafe { RegionSlice::new(ptr, self.len) }
    }
}

impl Drop for AnonMapping {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once; every `RegionSlice` of it borrows this
        // value (or the `Registered` that owns it), so none outlives it.
        let _ = unsafe { mm::munmap(self.addr as *mut std::ffi::c_void, self.len) };
    }
}

/// An anonymous mapping registered with its own userfaultfd.
#[derive(Debug)]
struct Registered {
    /// Declared first, so dropped first: the memory is unmapped before its userfaultfd is
    /// closed (as the region does), never left registered to nobody.
    mapping: AnonMapping,
    range: UffdRange,
}

impl Registered {
    fn new(len: usize, mode: BaselineMode) -> Result<Self, BaselineError> {
        Self::with_features(len, mode.features(), mode.register_mode())
    }

    fn with_features(len: usize, features: u64, register_mode: u64) -> Result<Self, BaselineError> {
        let mapping = AnonMapping::new(len).map_err(sys_err("mapping the region"))?;
        let uffd = Uffd::open(features).map_err(sys_err("opening a userfaultfd"))?;
        // SAFETY: the mapping is ours, anonymous, private and page-aligned (mmap), and no Rust
        // reference ever covers its memory: it is only reached through `slice()`, whose
        // volatile accesses accept pages being filled, protected or read as zeros.
        unsafe { uffd.register(mapping.addr(), len, register_mode) }
            .map_err(sys_err("registering the region"))?;
        let range = UffdRange::new(Arc::new(uffd), mapping.addr(), len);
        Ok(Self { mapping, range })
    }

    /// The memory, as a volatile slice borrowed from `self`.
    fn slice(&self) -> RegionSlice<'_> {
        self.mapping.slice()
    }

    /// Unregisters the whole region: blocked touches wake up, missing pages read as zeros.
    fn unregister(&self) {
        let mut r = sys::UffdioRange {
            start: self.range.base() as u64,
            len: self.range.len() as u64,
        };
        // SAFETY: `r` is a live UffdioRange, the type UFFDIO_UNREGISTER takes, naming exactly
        // our registered mapping; afterwards missing pages fault in as zeros, which only the
        // failing measurement sees through its volatile slice (its result is discarded).
        let _ = unsafe {
            raw_ioctl(
                self.range.uffd().as_raw_fd(),
                sys::UFFDIO_UNREGISTER,
                &mut r,
            )
        };
    }
}

/// What the in-thread reference's `SIGBUS` handler serves: one region at a time, set while
/// its handler is installed (a `base` of 0 means none).
struct InThreadTarget {
    base: AtomicUsize,
    len: AtomicUsize,
    staging: AtomicUsize,
    fd: AtomicI32,
    moved: AtomicU64,
    failed: AtomicU64,
    /// Set while an in-thread reference measures: a second one is refused.
    busy: AtomicBool,
}

static IN_THREAD: InThreadTarget = InThreadTarget {
    base: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    staging: AtomicUsize::new(0),
    fd: AtomicI32::new(-1),
    moved: AtomicU64::new(0),
    failed: AtomicU64::new(0),
    busy: AtomicBool::new(false),
};

/// The in-thread reference's `SIGBUS` handler, installed until [`uninstall`]
/// (or drop), which puts the previous action back.
///
/// [`uninstall`]: InThreadHandler::uninstall
struct InThreadHandler {
    previous: libc::sigaction,
    installed: bool,
}

impl InThreadHandler {
    fn install(
        base: usize,
        len: usize,
        staging: usize,
        fd: i32,
    ) -> Result<InThreadHandler, BaselineError> {
        if IN_THREAD.busy.swap(true, Ordering::SeqCst) {
            return Err(BaselineError::Invalid(
                "another in-thread reference is measuring".into(),
            ));
        }
        IN_THREAD.len.store(len, Ordering::SeqCst);
        IN_THREAD.staging.store(staging, Ordering::SeqCst);
        IN_THREAD.fd.store(fd, Ordering::SeqCst);
        IN_THREAD.moved.store(0, Ordering::SeqCst);
        IN_THREAD.failed.store(0, Ordering::SeqCst);
        IN_THREAD.base.store(base, Ordering::SeqCst);
        // SAFETY: plain-old-data structs filled before use; the handler only does
        // async-signal-safe work (atomics, one or two ioctls, errno).
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = in_thread_sigbus as *const () as usize;
            // As a farmap region's handler (the signal module): SA_NODEFER, empty mask.
            act.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART | libc::SA_NODEFER;
            libc::sigemptyset(&mut act.sa_mask);
            let mut previous: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGBUS, &act, &mut previous) != 0 {
                let e = io::Error::last_os_error();
                IN_THREAD.base.store(0, Ordering::SeqCst);
                IN_THREAD.busy.store(false, Ordering::SeqCst);
                return Err(sys_err("installing the SIGBUS handler")(e));
            }
            Ok(InThreadHandler {
                previous,
                installed: true,
            })
        }
    }

    /// Puts the previous action back; returns the pages moved and the moves that failed.
    fn uninstall(mut self) -> (u64, u64) {
        self.restore();
        (
            IN_THREAD.moved.load(Ordering::SeqCst),
            IN_THREAD.failed.load(Ordering::SeqCst),
        )
    }

    fn restore(&mut self) {
        if std::mem::take(&mut self.installed) {
            // SAFETY: puts back the action `install` replaced.
            unsafe { libc::sigaction(libc::SIGBUS, &self.previous, std::ptr::null_mut()) };
            IN_THREAD.base.store(0, Ordering::SeqCst);
            IN_THREAD.busy.store(false, Ordering::SeqCst);
        }
    }
}

impl Drop for InThreadHandler {
    fn drop(&mut self) {
        self.restore();
    }
}

/// Moves the faulting page back from the staging area. A fault it cannot serve that way
/// (not the measured region, or a move that fails) gets a zero page when it is in the
/// region, so the access completes and the measurement reports the failure, and otherwise
/// the default action (the access faults again and the process dies, as without a handler).
extern "C" fn in_thread_sigbus(
    _sig: libc::c_int,
    info: *mut libc::siginfo_t,
    _: *mut libc::c_void,
) {
    // SAFETY: errno is this thread's; restored before returning.
    let errno = unsafe { *libc::__errno_location() };
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler; SIGBUS's carries
    // si_addr.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    let base = IN_THREAD.base.load(Ordering::Acquire);
    let len = IN_THREAD.len.load(Ordering::Relaxed);
    if code != libc::BUS_ADRERR || base == 0 || addr < base || addr >= base + len {
        // SAFETY: restores the default action; async-signal-safe.
        unsafe {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut());
        }
        return;
    }
    let page = addr & !(PAGE_SIZE - 1);
    let fd = IN_THREAD.fd.load(Ordering::Relaxed);
    let mut m = sys::UffdioMove {
        dst: page as u64,
        src: (IN_THREAD.staging.load(Ordering::Relaxed) + (page - base)) as u64,
        len: PAGE_SIZE as u64,
        mode: sys::UFFDIO_MOVE_MODE_DONTWAKE,
        moved: 0,
    };
    // SAFETY: `m` is a live UffdioMove naming one page of the measured region (registered
    // with `fd`) and the same page of its staging area: the move only fills the region's
    // missing page with the staged one.
    if unsafe { raw_ioctl(fd, sys::UFFDIO_MOVE, &mut m) }.is_ok() {
        IN_THREAD.moved.fetch_add(1, Ordering::Relaxed);
    } else {
        IN_THREAD.failed.fetch_add(1, Ordering::Relaxed);
        let mut z = sys::UffdioZeropage {
            range: sys::UffdioRange {
                start: page as u64,
                len: PAGE_SIZE as u64,
            },
            mode: 0,
            zeropage: 0,
        };
        // SAFETY: `z` is a live UffdioZeropage naming one missing page of the measured region,
        // whose volatile readers accept zeros.
        let _ = unsafe { raw_ioctl(fd, sys::UFFDIO_ZEROPAGE, &mut z) };
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

/// Installs `data` at `offset`, reading no events: the baseline enables none, so an
/// `EventPending` answer (which would mean a remove) only gets a retry.
fn install(
    range: &UffdRange,
    offset: usize,
    data: &[u8],
    write_protect: bool,
) -> Result<(), BaselineError> {
    let mut from = 0;
    loop {
        return match range.install(offset, data, from, write_protect) {
            Ok(_) => Ok(()),
            Err(InstallError::EventPending { done }) => {
                from = done;
                std::thread::yield_now();
                continue;
            }
            Err(InstallError::Gone) => Err(BaselineError::Serve {
                offset,
                source: io::Error::from_raw_os_error(libc::ENOENT),
            }),
            Err(InstallError::Os(e)) => Err(BaselineError::Serve {
                offset,
                source: io::Error::from_raw_os_error(e),
            }),
        };
    }
}

/// Collects (and re-protects) the written pages of `start..end`; returns how many hold data.
fn scan_written(
    pagemap: &Pagemap,
    start: usize,
    end: usize,
    scratch: &mut Vec<sys::PageRegion>,
) -> Result<u64, BaselineError> {
    let mut pages = 0;
    pagemap
        .collect_written(start, end, scratch, |run| {
            if run.has_data {
                pages += ((run.end - run.start) / PAGE_SIZE) as u64;
            }
        })
        .map_err(sys_err("PAGEMAP_SCAN"))?;
    Ok(pages)
}

/// The handler thread's state.
struct Handler<'s> {
    region: &'s Registered,
    source: &'s [u8],
    chunk: usize,
    write_protect: bool,
    stop: &'s AtomicBool,
    faults: &'s AtomicU64,
    /// Passed once the thread runs, so that its start-up is not measured.
    ready: &'s Barrier,
}

impl Handler<'_> {
    /// Waits for faults and installs the chunk around each from the source, until stopped.
    fn run(self) -> Result<(), BaselineError> {
        self.ready.wait();
        let result = self.serve();
        if result.is_err() {
            self.region.unregister();
        }
        result
    }

    fn serve(&self) -> Result<(), BaselineError> {
        let range = &self.region.range;
        let mut msgs = [sys::UffdMsg::default(); 16];
        // The timeout only bounds how late the stop flag is seen: a fault wakes poll at once.
        let tick = Timespec {
            tv_sec: 0,
            tv_nsec: 10_000_000,
        };
        while !self.stop.load(Ordering::Acquire) {
            let mut pfd = [PollFd::new(&**range.uffd(), PollFlags::IN)];
            if !matches!(poll(&mut pfd, Some(&tick)), Ok(n) if n > 0) {
                continue;
            }
            let n = range
                .uffd()
                .read_messages(&mut msgs)
                .map_err(sys_err("reading the userfaultfd"))?;
            for m in &msgs[..n] {
                if m.event != sys::UFFD_EVENT_PAGEFAULT {
                    continue;
                }
                let offset = (m.arg1 as usize - range.base()) & !(self.chunk - 1);
                let end = (offset + self.chunk).min(range.len());
                install(range, offset, &self.source[offset..end], self.write_protect)?;
                self.faults.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8 + 1).collect()
    }

    #[test]
    fn random_pages_are_distinct_in_range_and_repeatable() {
        let p = random_pages(1000, 300, 7);
        assert_eq!(p.len(), 300);
        let mut s = p.clone();
        s.sort_unstable();
        s.dedup();
        assert_eq!(s.len(), 300);
        assert!(p.iter().all(|&x| x < 1000));
        assert_eq!(random_pages(10, 50, 1).len(), 10);
        assert_eq!(p, random_pages(1000, 300, 7));
    }

    #[test]
    fn spread_pages_are_evenly_spaced() {
        assert_eq!(
            spread_pages(1000, 1),
            (0..10).map(|i| i * 100).collect::<Vec<_>>()
        );
        assert_eq!(spread_pages(1000, 100), (0..1000).collect::<Vec<_>>());
        assert_eq!(spread_pages(50, 1), vec![0]);
        assert!(spread_pages(50, 0).is_empty());
    }

    #[test]
    fn both_modes_serve_the_source_bytes() {
        let src = pattern(4 << 20);
        for mode in [BaselineMode::Missing, BaselineMode::WriteProtect] {
            let b = Baseline::new(&src, mode).unwrap();
            let pages = random_pages(src.len() / PAGE_SIZE, 100, 3);
            let lat = b.fault_latency(PAGE_SIZE, &pages).unwrap();
            assert_eq!(lat.samples, 100);
            assert!(lat.p50_us > 0.0 && lat.p50_us <= lat.p99_us && lat.p99_us <= lat.max_us);
            for chunk in [PAGE_SIZE, 64 << 10, 1 << 20] {
                let f = b.fill(chunk).unwrap();
                assert_eq!(f.faults, (src.len() / chunk) as u64, "{mode:?} {chunk}");
                assert!(f.mb_per_s() > 0.0);
            }
            let (same, faults) = b.with_handler(64 << 10, |mem| mem.to_vec() == src).unwrap();
            assert!(same, "{mode:?}: the region must read as the source");
            assert_eq!(faults, 64);
        }
    }

    #[test]
    fn dirty_scan_reports_exactly_the_written_pages() {
        let src = pattern(8 << 20);
        let b = Baseline::new(&src, BaselineMode::Missing).unwrap();
        for pct in [1, 100] {
            let pages = spread_pages(src.len() / PAGE_SIZE, pct);
            let d = b.dirty_scan(&pages).unwrap();
            assert_eq!(d.written_pages, pages.len() as u64);
            assert_eq!(d.reported_pages, pages.len() as u64, "{pct}%");
        }
    }

    #[test]
    fn bad_parameters_are_refused() {
        assert!(Baseline::new(&[1u8; 100], BaselineMode::Missing).is_err());
        let src = pattern(1 << 20);
        let b = Baseline::new(&src, BaselineMode::Missing).unwrap();
        assert!(b.fill(3000).is_err());
        assert!(b.fault_latency(PAGE_SIZE, &[256]).is_err());
    }
}
