//! The application `farmap bench paging` runs: a self-checking synthetic workload over a
//! block of memory, the same code whether the memory is a farmap region or a plain anonymous
//! mapping of a process under a memory cgroup limit (`farmap __paging-app`, the kernel-swap
//! baseline).
//!
//! # What it does
//! The memory is split into one contiguous block of pages per thread; a thread only touches
//! its own block, so that it can predict every byte it reads. Each page carries a tag, a
//! word at its start and one at its end: `(page << 32 | version) ^ TAG_SALT` (the salt makes
//! a zero page wrong for every page and version). Phases:
//! 1. *init* (untimed): every thread writes version 0 into each of its pages, in order: the
//!    application's data exists, and what does not fit the limit is in the store (farmap)
//!    or in swap (kernel).
//! 2. *run* (timed): each access picks a page of the thread's block by the pattern, and
//!    writes it (`--writes` percent of accesses: version + 1, both words) or reads it (both
//!    words, compared with the version the thread last wrote). Each access is timed alone
//!    with `Instant` (the vDSO clock, tens of ns).
//! 3. *check* (untimed): every page is read and compared with its last version.
//!
//! `verified` is true when no read of the run and no page of the check differed.
//!
//! # Faulting accesses
//! An access is *faulting* when its page had no present page-table entry just before it:
//! one `PAGEMAP_SCAN` ioctl asking for `PAGE_IS_PRESENT` on the page, outside the timed
//! span. That is the same test for both systems: a farmap page not in the region (remote, or
//! staged: moved out with `UFFDIO_MOVE`) and a kernel page that was swapped out (on the swap
//! device or still in the swap cache) both make the access enter the kernel's fault path.
//! Writes to a present, write-protected farmap page (write tracking, resolved by the kernel
//! in about a µs) are not faulting accesses. The percentiles are those of faulting accesses
//! only; the check costs about a µs per access, which `runtime_ms` includes for both systems.
//!
//! # Patterns
//! - `seq`: each thread walks its block in order, wrapping around (starting where init
//!   started, so at a limit below 100% the pages it needs first are the ones init pushed
//!   out first).
//! - `uniform`: a page of the block uniformly at random.
//! - `zipf`: Zipf's law with skew θ = 0.99 (YCSB's default) over the block's pages, drawn
//!   with Gray et al.'s method; rank `r` is then placed at page `(r × m + o) mod n` (`m`
//!   coprime with `n`): the hot pages are scattered over the block like YCSB's scrambled
//!   zipfian, not packed at its start.
//!
//! Percentiles come from a log-linear histogram (64 buckets per power of two: a value is
//! reported as its bucket's midpoint, within 0.8%), so that no sample is stored and a run
//! can last as long as wanted.

use std::io::{BufRead, Write as _};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use farmap_memory::RegionSlice;
use farmap_uffd::pagemap::Pagemap;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::common::parse_duration;
use super::uffd_raw::{AnonMapping, PAGE_SIZE};

/// Makes a zero page wrong for every page and version.
const TAG_SALT: u64 = 0x5eed_fa2a_c0ff_ee17;

/// The skew of the `zipf` pattern (YCSB's default).
pub const ZIPF_THETA: f64 = 0.99;

/// Set by Ctrl-C: every thread of the application stops at its next access.
pub static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Sets [`INTERRUPTED`] and calls `kill` (which ends the benchmark's children) on Ctrl-C
/// or SIGTERM; the runs then end with an error and tear down what they set up. Abort the
/// task when the benchmark is done.
pub(super) fn on_interrupt(kill: fn()) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    INTERRUPTED.store(false, Ordering::Relaxed);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("catching SIGTERM")?;
    Ok(tokio::spawn(async move {
        tokio::select! {
            r = tokio::signal::ctrl_c() => if r.is_err() { return },
            _ = term.recv() => {}
        }
        INTERRUPTED.store(true, Ordering::Relaxed);
        kill();
    }))
}

/// Fails once Ctrl-C has come ([`INTERRUPTED`]).
pub(super) fn interrupted() -> anyhow::Result<()> {
    if INTERRUPTED.load(Ordering::Relaxed) {
        bail!("interrupted");
    }
    Ok(())
}

/// An access pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pattern {
    /// Each thread walks its pages in order, wrapping around.
    Seq,
    /// Uniformly random pages.
    Uniform,
    /// Zipf-distributed pages (θ = 0.99, hot pages scattered).
    Zipf,
}

impl Pattern {
    pub fn name(self) -> &'static str {
        match self {
            Pattern::Seq => "seq",
            Pattern::Uniform => "uniform",
            Pattern::Zipf => "zipf",
        }
    }
}

/// How long the timed phase runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Budget {
    /// This many accesses in all, split evenly between the threads.
    Accesses(u64),
    /// Every thread runs this long.
    Runtime(Duration),
}

/// What the application does; the same for both systems of a case.
#[derive(Debug, Clone, Copy)]
pub struct AppConfig {
    /// Bytes of memory (a multiple of the page size, at least one page per thread).
    pub size: usize,
    pub pattern: Pattern,
    pub threads: usize,
    pub budget: Budget,
    /// Percent of accesses that write.
    pub writes_percent: u32,
    pub seed: u64,
    /// Print every faulting access slower than this on stderr (see [`Worker::trace`]).
    pub trace_slow: Option<Duration>,
}

/// The tag of `page` at `version`.
fn tag(page: usize, version: u32) -> u64 {
    ((page as u64) << 32 | u64::from(version)) ^ TAG_SALT
}

/// Zipf's law over `0..n` by Gray et al.'s method ("Quickly generating billion-record
/// synthetic databases", 1994), as YCSB draws it: O(n) set-up, O(1) per draw.
#[derive(Debug, Clone)]
struct Zipf {
    n: f64,
    alpha: f64,
    zetan: f64,
    eta: f64,
    /// `1 + 0.5^θ`: below it, rank 1.
    two: f64,
}

impl Zipf {
    fn new(n: usize, theta: f64) -> Zipf {
        let zeta = |k: usize| (1..=k).map(|i| 1.0 / (i as f64).powf(theta)).sum::<f64>();
        let zetan = zeta(n);
        let zeta2 = zeta(2.min(n));
        let nf = n as f64;
        let eta = if n <= 2 {
            0.0
        } else {
            (1.0 - (2.0 / nf).powf(1.0 - theta)) / (1.0 - zeta2 / zetan)
        };
        Zipf {
            n: nf,
            alpha: 1.0 / (1.0 - theta),
            zetan,
            eta,
            two: 1.0 + 0.5f64.powf(theta),
        }
    }

    /// A rank in `0..n` (0 the most likely).
    fn draw(&self, rng: &mut SmallRng) -> usize {
        let u: f64 = rng.gen();
        let uz = u * self.zetan;
        let r = if uz < 1.0 {
            0
        } else if uz < self.two || self.n <= 2.0 {
            1
        } else {
            (self.n * (self.eta * u - self.eta + 1.0).powf(self.alpha)) as usize
        };
        r.min(self.n as usize - 1)
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Picks the next page (an index into the thread's block).
#[derive(Debug, Clone)]
enum PageGen {
    Seq { next: usize },
    Uniform,
    Zipf { zipf: Zipf, mult: u64, offset: u64 },
}

impl PageGen {
    fn new(pattern: Pattern, n: usize, rng: &mut SmallRng) -> PageGen {
        match pattern {
            Pattern::Seq => PageGen::Seq { next: 0 },
            Pattern::Uniform => PageGen::Uniform,
            Pattern::Zipf => {
                let mut mult = 0x9e37_79b1u64 % n as u64;
                while gcd(mult.max(1), n as u64) != 1 {
                    mult += 1;
                }
                PageGen::Zipf {
                    zipf: Zipf::new(n, ZIPF_THETA),
                    mult: mult.max(1),
                    offset: rng.gen_range(0..n as u64),
                }
            }
        }
    }

    fn next(&mut self, n: usize, rng: &mut SmallRng) -> usize {
        match self {
            PageGen::Seq { next } => {
                let p = *next;
                *next = (p + 1) % n;
                p
            }
            PageGen::Uniform => rng.gen_range(0..n),
            PageGen::Zipf { zipf, mult, offset } => {
                let r = zipf.draw(rng) as u64;
                ((r * *mult + *offset) % n as u64) as usize
            }
        }
    }
}

/// Buckets per power of two of the [`Histogram`].
const SUB_BITS: u32 = 6;
const SUB: u64 = 1 << SUB_BITS;

/// A log-linear histogram of nanoseconds: values below 64 exactly, then 64 buckets per
/// power of two.
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self {
            counts: vec![0; Self::index(u64::MAX) + 1],
            total: 0,
        }
    }
}

impl Histogram {
    fn index(v: u64) -> usize {
        if v < SUB {
            return v as usize;
        }
        let e = 63 - v.leading_zeros(); // ≥ SUB_BITS
        let sub = (v >> (e - SUB_BITS)) & (SUB - 1);
        ((e - SUB_BITS + 1) as u64 * SUB + sub) as usize
    }

    /// The midpoint of bucket `i`.
    fn value(i: usize) -> f64 {
        let i = i as u64;
        if i < SUB {
            return i as f64;
        }
        let e = (i / SUB - 1) as u32 + SUB_BITS;
        let sub = i % SUB;
        let lo = (SUB + sub) << (e - SUB_BITS);
        let width = 1u64 << (e - SUB_BITS);
        lo as f64 + (width as f64 - 1.0) / 2.0
    }

    pub fn record(&mut self, ns: u64) {
        self.counts[Self::index(ns)] += 1;
        self.total += 1;
    }

    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.total += other.total;
    }

    /// The upper bound of bucket `i`, ns (inclusive).
    fn upper(i: usize) -> u64 {
        let i = i as u64;
        if i < SUB {
            return i;
        }
        let e = (i / SUB - 1) as u32 + SUB_BITS;
        let sub = i % SUB;
        let lo = (SUB + sub) << (e - SUB_BITS);
        lo + ((1u64 << (e - SUB_BITS)) - 1)
    }

    /// The non-empty buckets as `(upper bound µs, count)`, ascending, each run of them led
    /// by its empty neighbour below (count 0), which gives the run's lower bound: the shape
    /// `farmap_plot::Latencies::Buckets` takes.
    pub fn buckets_us(&self) -> Vec<(f64, u64)> {
        let mut out = Vec::new();
        for (i, &c) in self.counts.iter().enumerate() {
            if c == 0 {
                continue;
            }
            if i > 0 && self.counts[i - 1] == 0 {
                out.push((Self::upper(i - 1) as f64 / 1e3, 0));
            }
            out.push((Self::upper(i) as f64 / 1e3, c));
        }
        out
    }

    /// The `q` quantile (0 < q ≤ 1) in ns; `None` when empty.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.total == 0 {
            return None;
        }
        let rank = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Some(Self::value(i));
            }
        }
        None
    }
}

/// What the timed phase and the check found.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct AppReport {
    pub accesses: u64,
    pub faulting_accesses: u64,
    pub p50_us: Option<f64>,
    pub p95_us: Option<f64>,
    pub p99_us: Option<f64>,
    pub p99_9_us: Option<f64>,
    pub runtime_ms: f64,
    /// Reads (in the run and in the check) that did not find the version last written.
    pub mismatches: u64,
    /// The first of them.
    pub first_mismatch: Option<String>,
    pub verified: bool,
    /// The faulting accesses' histogram ([`Histogram::buckets_us`]), for `--plot`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub latency_buckets_us: Vec<(f64, u64)>,
    /// Kernel-swap children only: page faults of the process during the run
    /// (`/proc/self/stat`), and the system's swap counters (`/proc/vmstat`) over it.
    #[serde(default)]
    pub kernel: Option<KernelCounters>,
}

/// Kernel counters over the timed phase (deltas).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct KernelCounters {
    pub majflt: u64,
    pub minflt: u64,
    /// Pages swapped out (`pswpout`, system-wide).
    pub pswpout: u64,
    /// Pages read ahead by swap-in (`swap_ra`) and, of those, used (`swap_ra_hit`).
    pub swap_ra: u64,
    pub swap_ra_hit: u64,
}

impl KernelCounters {
    /// The counters now (absolute).
    pub fn now() -> anyhow::Result<KernelCounters> {
        let faults = super::common::self_faults()?;
        let vmstat = std::fs::read_to_string("/proc/vmstat").context("reading /proc/vmstat")?;
        let vm = |key: &str| -> u64 {
            vmstat
                .lines()
                .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
                .unwrap_or(0)
        };
        Ok(KernelCounters {
            minflt: faults.minor,
            majflt: faults.major,
            pswpout: vm("pswpout"),
            swap_ra: vm("swap_ra"),
            swap_ra_hit: vm("swap_ra_hit"),
        })
    }

    pub fn since(self, before: KernelCounters) -> KernelCounters {
        KernelCounters {
            majflt: self.majflt.saturating_sub(before.majflt),
            minflt: self.minflt.saturating_sub(before.minflt),
            pswpout: self.pswpout.saturating_sub(before.pswpout),
            swap_ra: self.swap_ra.saturating_sub(before.swap_ra),
            swap_ra_hit: self.swap_ra_hit.saturating_sub(before.swap_ra_hit),
        }
    }
}

/// One thread's share.
struct Worker {
    /// Its first page (in the whole memory) and its page count.
    first: usize,
    pages: usize,
    versions: Vec<u32>,
    rng: SmallRng,
    gen: PageGen,
    hist: Histogram,
    accesses: u64,
    faulting: u64,
    mismatches: u64,
    first_mismatch: Option<String>,
    /// Scratch space of the pagemap scans.
    scan: Vec<farmap_uffd::sys::PageRegion>,
    trace_slow: Option<Duration>,
}

impl Worker {
    /// Prints a faulting access that took `elapsed` (at least `--trace-slow`) on stderr, with
    /// the `CLOCK_MONOTONIC` time it ended at and the thread's id: the times `perf record -k
    /// CLOCK_MONOTONIC` (and `perf sched record`) stamp their events with, so that a trace
    /// taken during the run shows what the access waited for.
    fn trace(&self, elapsed: Duration, write: bool, page: usize) {
        let end = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
        eprintln!(
            "slow access: end={}.{:09} us={} write={write} page={page} tid={}",
            end.tv_sec,
            end.tv_nsec,
            elapsed.as_micros(),
            rustix::thread::gettid().as_raw_nonzero()
        );
    }

    fn mismatch(&mut self, page: usize, what: &str, got: u64, want: u64) {
        self.mismatches += 1;
        if self.first_mismatch.is_none() {
            self.first_mismatch = Some(format!(
                "page {page} ({what}): found {got:#018x}, expected {want:#018x}"
            ));
        }
    }

    fn init(&mut self, mem: RegionSlice<'_>) -> anyhow::Result<()> {
        for i in 0..self.pages {
            let page = self.first + i;
            let t = tag(page, 0);
            mem.store_u64(page * PAGE_SIZE, t)?;
            mem.store_u64(page * PAGE_SIZE + PAGE_SIZE - 8, t)?;
        }
        Ok(())
    }

    fn present(&mut self, pagemap: &Pagemap, addr: usize) -> anyhow::Result<bool> {
        let mut covered = 0;
        pagemap
            .in_memory(addr, addr + PAGE_SIZE, &mut self.scan, |run| {
                covered += run.end - run.start
            })
            .context("PAGEMAP_SCAN of an accessed page")?;
        Ok(covered == PAGE_SIZE)
    }

    fn run(
        &mut self,
        mem: RegionSlice<'_>,
        pagemap: &Pagemap,
        writes_percent: u32,
        budget: Budget,
        share: u64,
    ) -> anyhow::Result<()> {
        let base = mem.as_ptr() as usize;
        let started = Instant::now();
        loop {
            match budget {
                Budget::Accesses(_) if self.accesses >= share => break,
                Budget::Runtime(d) if started.elapsed() >= d => break,
                _ => {}
            }
            if INTERRUPTED.load(Ordering::Relaxed) {
                break;
            }
            let i = self.gen.next(self.pages, &mut self.rng);
            let write = self.rng.gen_range(0..100) < writes_percent;
            let page = self.first + i;
            let off = page * PAGE_SIZE;
            let faulting = !self.present(pagemap, base + off)?;
            let t0 = Instant::now();
            let (a, b, want, elapsed) = if write {
                let v = self.versions[i].wrapping_add(1);
                let t = tag(page, v);
                mem.store_u64(off, t)?;
                mem.store_u64(off + PAGE_SIZE - 8, t)?;
                let elapsed = t0.elapsed();
                self.versions[i] = v;
                (t, t, t, elapsed)
            } else {
                let a = mem.load_u64(off)?;
                let b = mem.load_u64(off + PAGE_SIZE - 8)?;
                let elapsed = t0.elapsed();
                (a, b, tag(page, self.versions[i]), elapsed)
            };
            if a != want {
                self.mismatch(page, "first word", a, want);
            } else if b != want {
                self.mismatch(page, "last word", b, want);
            }
            if faulting {
                if self.trace_slow.is_some_and(|t| elapsed >= t) {
                    self.trace(elapsed, write, page);
                }
                self.faulting += 1;
                self.hist.record(elapsed.as_nanos() as u64);
            }
            self.accesses += 1;
        }
        Ok(())
    }

    fn check(&mut self, mem: RegionSlice<'_>) -> anyhow::Result<()> {
        for i in 0..self.pages {
            let page = self.first + i;
            let want = tag(page, self.versions[i]);
            let a = mem.load_u64(page * PAGE_SIZE)?;
            let b = mem.load_u64(page * PAGE_SIZE + PAGE_SIZE - 8)?;
            if a != want {
                self.mismatch(page, "check, first word", a, want);
            } else if b != want {
                self.mismatch(page, "check, last word", b, want);
            }
        }
        Ok(())
    }
}

/// The application: its threads' state, allocated up front.
pub struct App {
    config: AppConfig,
    workers: Vec<Worker>,
    pagemap: Pagemap,
}

impl App {
    pub fn new(config: AppConfig) -> anyhow::Result<App> {
        let npages = config.size / PAGE_SIZE;
        if config.threads == 0 || npages < config.threads {
            bail!(
                "{} threads need at least as many pages ({npages} in {} bytes)",
                config.threads,
                config.size
            );
        }
        let per = npages / config.threads;
        let workers = (0..config.threads)
            .map(|t| {
                let first = t * per;
                let pages = if t + 1 == config.threads {
                    npages - first
                } else {
                    per
                };
                let mut rng = SmallRng::seed_from_u64(config.seed ^ ((t as u64 + 1) * 0x9e37));
                let gen = PageGen::new(config.pattern, pages, &mut rng);
                Worker {
                    first,
                    pages,
                    versions: vec![0; pages],
                    rng,
                    gen,
                    hist: Histogram::default(),
                    accesses: 0,
                    faulting: 0,
                    mismatches: 0,
                    first_mismatch: None,
                    scan: Vec::with_capacity(16),
                    trace_slow: config.trace_slow,
                }
            })
            .collect();
        Ok(App {
            config,
            workers,
            pagemap: Pagemap::open_self().context("opening /proc/self/pagemap")?,
        })
    }

    fn each(
        &mut self,
        mem: RegionSlice<'_>,
        what: &str,
        f: impl Fn(&mut Worker, RegionSlice<'_>) -> anyhow::Result<()> + Sync,
    ) -> anyhow::Result<()> {
        std::thread::scope(|s| {
            let handles: Vec<_> = self
                .workers
                .iter_mut()
                .map(|w| {
                    let f = &f;
                    s.spawn(move || f(w, mem))
                })
                .collect();
            for h in handles {
                h.join()
                    .map_err(|_| anyhow::anyhow!("an application thread panicked ({what})"))??;
            }
            Ok(())
        })
    }

    /// Writes version 0 into every page (untimed). `mem` must be `config.size` bytes.
    pub fn init(&mut self, mem: RegionSlice<'_>) -> anyhow::Result<()> {
        if mem.len() < self.config.size {
            bail!("the memory is smaller than the application's size");
        }
        self.each(mem, "init", |w, mem| w.init(mem))
    }

    /// The timed phase: returns its wall time (from all threads released to the last done).
    pub fn run(&mut self, mem: RegionSlice<'_>) -> anyhow::Result<Duration> {
        let threads = self.workers.len();
        let (writes, budget) = (self.config.writes_percent, self.config.budget);
        let share = match budget {
            Budget::Accesses(n) => n.div_ceil(threads as u64),
            Budget::Runtime(_) => u64::MAX,
        };
        let barrier = Barrier::new(threads + 1);
        let pagemap = &self.pagemap;
        std::thread::scope(|s| {
            let handles: Vec<_> = self
                .workers
                .iter_mut()
                .map(|w| {
                    let barrier = &barrier;
                    s.spawn(move || {
                        barrier.wait();
                        w.run(mem, pagemap, writes, budget, share)
                    })
                })
                .collect();
            barrier.wait();
            let started = Instant::now();
            for h in handles {
                h.join()
                    .map_err(|_| anyhow::anyhow!("an application thread panicked (run)"))??;
            }
            Ok(started.elapsed())
        })
    }

    /// Reads every page back (untimed).
    pub fn check(&mut self, mem: RegionSlice<'_>) -> anyhow::Result<()> {
        self.each(mem, "check", |w, mem| w.check(mem))
    }

    /// The report of the run (and the check, if made).
    pub fn report(&self, runtime: Duration) -> AppReport {
        let mut hist = Histogram::default();
        for w in &self.workers {
            hist.merge(&w.hist);
        }
        let us = |q| {
            hist.quantile(q)
                .map(|ns| (ns / 1e3 * 1000.0).round() / 1000.0)
        };
        let mismatches = self.workers.iter().map(|w| w.mismatches).sum();
        AppReport {
            accesses: self.workers.iter().map(|w| w.accesses).sum(),
            faulting_accesses: self.workers.iter().map(|w| w.faulting).sum(),
            p50_us: us(0.5),
            p95_us: us(0.95),
            p99_us: us(0.99),
            p99_9_us: us(0.999),
            latency_buckets_us: hist.buckets_us(),
            runtime_ms: (runtime.as_secs_f64() * 1e6).round() / 1e3,
            mismatches,
            first_mismatch: self.workers.iter().find_map(|w| w.first_mismatch.clone()),
            verified: mismatches == 0,
            kernel: None,
        }
    }
}

/// `farmap __paging-app`: the application as a plain process, for the kernel-swap baseline
/// of `farmap bench paging` (internal).
#[derive(Debug, Clone, Args)]
pub struct AppArgs {
    /// Join this memory cgroup (v1 directory) before allocating anything.
    #[arg(long)]
    cgroup: Option<PathBuf>,
    #[arg(long, value_parser = super::common::parse_size_arg)]
    size: u64,
    #[arg(long, value_enum)]
    pattern: Pattern,
    #[arg(long)]
    threads: usize,
    #[arg(long, conflicts_with = "runtime")]
    accesses: Option<u64>,
    #[arg(long, value_parser = parse_duration)]
    runtime: Option<Duration>,
    #[arg(long)]
    writes: u32,
    #[arg(long)]
    seed: u64,
    #[arg(long, value_parser = parse_duration)]
    trace_slow: Option<Duration>,
}

impl AppArgs {
    /// The arguments that run `config` in `cgroup`.
    pub fn command_line(config: &AppConfig, cgroup: &std::path::Path) -> Vec<String> {
        let mut v = vec![
            "__paging-app".to_owned(),
            "--cgroup".to_owned(),
            cgroup.display().to_string(),
            "--size".to_owned(),
            config.size.to_string(),
            "--pattern".to_owned(),
            config.pattern.name().to_owned(),
            "--threads".to_owned(),
            config.threads.to_string(),
            "--writes".to_owned(),
            config.writes_percent.to_string(),
            "--seed".to_owned(),
            config.seed.to_string(),
        ];
        if let Some(t) = config.trace_slow {
            v.extend(["--trace-slow".to_owned(), format!("{}us", t.as_micros())]);
        }
        match config.budget {
            Budget::Accesses(n) => v.extend(["--accesses".to_owned(), n.to_string()]),
            Budget::Runtime(d) => {
                v.extend(["--runtime".to_owned(), format!("{}us", d.as_micros())])
            }
        }
        v
    }
}

/// The child's side: join the cgroup, allocate everything, say `ready` on stdout, wait for
/// `go` on stdin, run, print the `AppReport` as one JSON line.
pub fn run_child(args: AppArgs) -> anyhow::Result<std::process::ExitCode> {
    // Die with the benchmark: an orphan would keep its cgroup (and the swap) busy.
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))
        .context("PR_SET_PDEATHSIG")?;
    if let Some(cg) = &args.cgroup {
        std::fs::write(cg.join("cgroup.procs"), std::process::id().to_string())
            .with_context(|| format!("joining the memory cgroup {}", cg.display()))?;
    }
    let size = usize::try_from(args.size).context("the size does not fit in memory")?;
    let config = AppConfig {
        size,
        pattern: args.pattern,
        threads: args.threads,
        budget: match (args.accesses, args.runtime) {
            (_, Some(d)) => Budget::Runtime(d),
            (n, None) => Budget::Accesses(n.unwrap_or(100_000)),
        },
        writes_percent: args.writes,
        seed: args.seed,
        trace_slow: args.trace_slow,
    };
    let mut app = App::new(config)?;
    let mapping = AnonMapping::new(size).context("mapping the application's memory")?;
    let mem = mapping.slice();
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready")?;
    out.flush()?;
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    if line.trim() != "go" {
        bail!("expected `go` on stdin, got {line:?}");
    }
    app.init(mem)?;
    let before = KernelCounters::now()?;
    let runtime = app.run(mem)?;
    let kernel = KernelCounters::now()?.since(before);
    app.check(mem)?;
    let mut report = app.report(runtime);
    report.kernel = Some(kernel);
    serde_json::to_writer(&mut out, &report)?;
    writeln!(out)?;
    out.flush()?;
    Ok(std::process::ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_quantiles_are_within_a_bucket() {
        let mut h = Histogram::default();
        assert_eq!(h.quantile(0.5), None);
        for v in 1..=10_000u64 {
            h.record(v * 1000);
        }
        for (q, want) in [
            (0.5, 5_000_000.0),
            (0.99, 9_900_000.0),
            (0.999, 9_990_000.0),
        ] {
            let got = h.quantile(q).unwrap();
            assert!((got - want).abs() / want < 0.01, "q {q}: {got} vs {want}");
        }
        // Exact below 64.
        let mut h = Histogram::default();
        h.record(7);
        assert_eq!(h.quantile(1.0), Some(7.0));
        // Index and value agree on every bucket's bounds.
        for v in [64u64, 65, 127, 128, 1 << 20, (1 << 20) + 12345, u64::MAX] {
            let mid = Histogram::value(Histogram::index(v));
            assert!((mid - v as f64).abs() / (v as f64) < 0.01, "{v} → {mid}");
        }
    }

    #[test]
    fn histogram_buckets_bound_their_values() {
        let mut h = Histogram::default();
        assert!(h.buckets_us().is_empty());
        for ns in [5, 5, 1000, 1001, 2_000_000] {
            h.record(ns);
        }
        let b = h.buckets_us();
        let total: u64 = b.iter().map(|&(_, c)| c).sum();
        assert_eq!(total, 5);
        assert!(b.windows(2).all(|w| w[0].0 < w[1].0), "{b:?}");
        // Each value lies above the previous bound and up to its bucket's own.
        for ns in [5u64, 1000, 1001, 2_000_000] {
            let us = ns as f64 / 1e3;
            let k = b
                .iter()
                .position(|&(upper, c)| c > 0 && us <= upper)
                .unwrap();
            assert!(k > 0 && b[k - 1].0 < us, "{ns} ns in {b:?}");
        }
        // Bucket 4 (exactly 4 ns) is empty and bounds the bucket of 5 ns from below.
        assert_eq!(b[0], (0.004, 0));
        assert_eq!(b[1], (0.005, 2));
    }

    #[test]
    fn zipf_is_skewed_and_in_range() {
        let n = 10_000;
        let z = Zipf::new(n, ZIPF_THETA);
        let mut rng = SmallRng::seed_from_u64(1);
        let mut counts = vec![0u32; n];
        for _ in 0..200_000 {
            counts[z.draw(&mut rng)] += 1;
        }
        // Rank 0 about twice rank 1, and the top 1% of ranks take a large share.
        assert!(
            counts[0] > counts[1] && counts[1] > counts[10],
            "{:?}",
            &counts[..12]
        );
        let top: u32 = counts[..n / 100].iter().sum();
        assert!(top > 200_000 / 3, "top 1% drew {top}");
        assert!(counts[n / 2..].iter().any(|&c| c > 0));
    }

    #[test]
    fn zipf_pages_are_a_permutation_of_ranks() {
        let mut rng = SmallRng::seed_from_u64(2);
        for n in [1usize, 2, 3, 4096, 6000] {
            let gen = PageGen::new(Pattern::Zipf, n, &mut rng);
            let PageGen::Zipf { mult, offset, .. } = gen else {
                unreachable!()
            };
            let mut seen = vec![false; n];
            for r in 0..n as u64 {
                seen[((r * mult + offset) % n as u64) as usize] = true;
            }
            assert!(seen.iter().all(|&s| s), "n = {n}");
        }
    }

    #[test]
    fn the_app_verifies_plain_memory_and_sees_a_corruption() {
        let size = 64 * PAGE_SIZE;
        let mapping = AnonMapping::new(size).unwrap();
        for pattern in [Pattern::Seq, Pattern::Uniform, Pattern::Zipf] {
            let mut app = App::new(AppConfig {
                size,
                pattern,
                threads: 2,
                budget: Budget::Accesses(2000),
                writes_percent: 50,
                seed: 3,
                trace_slow: None,
            })
            .unwrap();
            app.init(mapping.slice()).unwrap();
            let t = app.run(mapping.slice()).unwrap();
            app.check(mapping.slice()).unwrap();
            let r = app.report(t);
            assert!(r.verified, "{pattern:?}: {r:?}");
            assert_eq!(r.accesses, 2000);
            // Everything was present after init: no faulting access.
            assert_eq!(r.faulting_accesses, 0, "{pattern:?}");
            // A flipped word is found by the check.
            mapping.slice().store_u64(5 * PAGE_SIZE, 0).unwrap();
            app.check(mapping.slice()).unwrap();
            let r = app.report(t);
            assert!(!r.verified && r.mismatches == 1, "{r:?}");
            assert!(r.first_mismatch.unwrap().starts_with("page 5 "));
        }
    }

    #[test]
    fn child_command_lines_parse_back() {
        #[derive(Debug, clap::Parser)]
        struct Cli {
            #[command(subcommand)]
            cmd: Sub,
        }
        #[derive(Debug, clap::Subcommand)]
        enum Sub {
            #[command(name = "__paging-app")]
            App(AppArgs),
        }
        use clap::Parser as _;
        let config = AppConfig {
            size: 1 << 20,
            pattern: Pattern::Zipf,
            threads: 3,
            budget: Budget::Runtime(Duration::from_millis(1500)),
            writes_percent: 20,
            seed: 9,
            trace_slow: Some(Duration::from_micros(300)),
        };
        let mut argv = vec!["farmap".to_owned()];
        argv.extend(AppArgs::command_line(&config, std::path::Path::new("/cg")));
        let Sub::App(a) = Cli::try_parse_from(argv).unwrap().cmd;
        assert_eq!(a.size, 1 << 20);
        assert_eq!(a.pattern, Pattern::Zipf);
        assert_eq!(a.runtime, Some(Duration::from_millis(1500)));
        assert_eq!(a.cgroup.as_deref(), Some(std::path::Path::new("/cg")));
        assert_eq!((a.threads, a.writes, a.seed), (3, 20, 9));
        assert_eq!(a.trace_slow, Some(Duration::from_micros(300)));
    }
}
