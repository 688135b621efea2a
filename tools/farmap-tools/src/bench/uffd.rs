//! `farmap bench uffd`: a userfaultfd region's faults, fills and dirty scans.
//!
//! Each case drives a farmap `Region` in direct mode (no background pull: every chunk comes
//! in through a fault; no periodic push) over a sparse memory store, and measures in the same
//! run, with the same touch loops and the same pages:
//! - the raw baseline (`uffd_raw.rs`): one thread `UFFDIO_COPY`ing the faulted
//!   chunk out of a plain buffer, registered and installing write-protected like the region
//!   (`baseline_*`, the reference the ratios use), and the same handler registered `MISSING`
//!   only (`baseline_missing_*`);
//! - memcpy of the case's chunk size between two pre-touched buffers (fills).
//!
//! Setup, not timed: one buffer of pseudo-random bytes (so that no chunk is zero and no
//! zero-page shortcut flatters a number) the size of the region is the baseline's source and,
//! one slice per chunk, the store's content; regions are mapped and registered, and torn
//! down after the clock stops. One untimed fill warms the kernel's page allocator up first,
//! and the region and the baselines take turns going first from one run to the next.
//!
//! Without `--poll`, the region has a sleeping fault reader per CPU, each kept to its CPU
//! (`fault_readers`; `reader_rests`: how often one whose CPU had no faulting thread rested).
//! With `--poll DURATION` the region's one fault reader polls for that long after each batch
//! before it sleeps, with idle-priority companions keeping the CPUs awake meanwhile
//! (`FaultWait::Poll`, see farmap-uffd's `polling` module); the baselines are unchanged, so
//! the same run still holds the sleeping reference. Every row says `fault_path` (`sleep` or
//! `poll`); fault and fill rows count the faults found by polling and after sleeping
//! (`faults_polled`, `faults_slept`) and the fault path's CPU time (`cpu_ms`: the reader and
//! the companions, from the region's open to the end of the timed touches; also split as
//! `reader_cpu_ms` and `companions_cpu_ms`).
//!
//! Cases:
//! - `fault-4k`: random distinct single-page reads, 4 KiB chunks, each timed alone by the
//!   touching thread: `p50_us`, `p99_us`.
//! - `fill-4k`, `fill-64k`, `fill-1m`: one read per page in order, chunks of the case's size,
//!   timed from the first touch to the last: `mb_per_s`; the region is then compared with
//!   the source (`verified`).
//! - `dirty-scan`: the region (64 KiB chunks) is faulted in whole and scanned once; then 1%
//!   or 100% of its pages (evenly spread) are written and one `take_dirty()` is timed: `ms`
//!   (0%: the cost of scanning a clean, populated range, which an object migration pays in
//!   its no-owner window).
//! - `refault-staged` (not in the default list): the same random pages as `fault-4k`, 4 KiB
//!   chunks, in a bounded region that holds them all (`--local-max` is ignored); they are
//!   faulted in untimed, every chunk is staged (`Region::deactivate`: moved out with
//!   `UFFDIO_MOVE`, still local), and the re-faults are timed one by one: `p50_us`, `p99_us`.
//!   The references in the same run are the raw userfaultfd fault of `fault-4k` (a handler
//!   thread copying the page in) and, for the in-thread path, `baseline_in_thread_p50_us` /
//!   `_p99_us`: the same pages staged in a raw mapping and moved back by a bare `SIGBUS`
//!   handler with one `UFFDIO_MOVE` each (a fault, a signal and a move: the floor of that
//!   path on this machine). With `--in-thread` the region resolves these faults in the
//!   faulting thread (`PagingOptions::in_thread`, SIGBUS); `faults_in_thread` says how many
//!   were served there.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::uffd_raw::{self as baseline, Baseline, BaselineMode, Latencies, PAGE_SIZE};
use anyhow::{bail, Context};
use bytes::Bytes;
use clap::{Args, ValueEnum};
use farmap::pipeline::PushOptions;
use farmap::store::MemoryStore;
use farmap::{format_size, Geometry, Store, DEFAULT_CHUNK_SIZE};
use farmap_uffd::{FaultWait, LocalLimit, PagingOptions, Region, RegionOptions, RegionStats};
use rand::{RngCore, SeedableRng};
use serde::Serialize;

use super::common::{measure_memcpy, parse_duration, parse_size_arg};
use crate::output;

/// The dirty fractions `dirty-scan` measures, in percent of the region's pages.
const DIRTY_PERCENTS: [u32; 3] = [0, 1, 100];

/// Seed of the random pages `fault-4k` touches (the same for the region and the baselines).
const PAGES_SEED: u64 = 0x05ee_dfa2;

/// One benchmark case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Case {
    /// Random single-page faults, 4 KiB chunks.
    #[value(name = "fault-4k")]
    Fault4k,
    /// Sequential fill in 4 KiB chunks.
    #[value(name = "fill-4k")]
    Fill4k,
    /// Sequential fill in 64 KiB chunks.
    #[value(name = "fill-64k")]
    Fill64k,
    /// Sequential fill in 1 MiB chunks.
    #[value(name = "fill-1m")]
    Fill1m,
    /// `take_dirty()` with 1% and 100% of the pages written.
    #[value(name = "dirty-scan")]
    DirtyScan,
    /// Re-faults of staged chunks (evicted, still local), 4 KiB chunks.
    #[value(name = "refault-staged")]
    RefaultStaged,
}

impl Case {
    fn name(self) -> &'static str {
        match self {
            Case::Fault4k => "fault-4k",
            Case::Fill4k => "fill-4k",
            Case::Fill64k => "fill-64k",
            Case::Fill1m => "fill-1m",
            Case::DirtyScan => "dirty-scan",
            Case::RefaultStaged => "refault-staged",
        }
    }

    fn chunk(self) -> usize {
        match self {
            Case::Fault4k | Case::Fill4k | Case::RefaultStaged => 4 << 10,
            Case::Fill64k => 64 << 10,
            Case::Fill1m => 1 << 20,
            Case::DirtyScan => DEFAULT_CHUNK_SIZE as usize,
        }
    }
}

#[derive(Debug, Args)]
pub struct UffdArgs {
    /// Size of the region (and of the buffer behind it, held in memory).
    #[arg(long, default_value = "1GiB", value_parser = parse_size_arg)]
    size: u64,
    /// The cases to run, comma-separated.
    #[arg(
        long = "case",
        value_enum,
        value_delimiter = ',',
        default_value = "fault-4k,fill-4k,fill-64k,fill-1m,dirty-scan"
    )]
    cases: Vec<Case>,
    /// Pages touched (and timed one by one) in fault-4k; at most the region's pages.
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u32).range(1..))]
    samples: u32,
    /// Repeat every case this many times (one result line each).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    runs: u32,
    /// One JSON object per case, dirty fraction and run on stdout; no progress on stderr.
    #[arg(long)]
    json: bool,
    /// Bound the region's local memory (`SIZE` like 256M, or `N%` of the region): chunks
    /// beyond it are staged and written back to the store (issue 16's bounded regions).
    #[arg(long, value_name = "SIZE|N%")]
    local_max: Option<LocalLimit>,
    /// Let the region's fault reader poll for this long (e.g. 50us) after each batch before
    /// it sleeps, with idle-priority companions keeping the CPUs awake (issue 16's fault
    /// path for VMs); the baselines are unchanged. Default: the reader sleeps.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    poll: Option<Duration>,
    /// refault-staged: the faulting thread moves staged chunks back itself, in a SIGBUS
    /// handler (`PagingOptions::in_thread`), with no other thread woken.
    #[arg(long)]
    in_thread: bool,
}

/// Fields every row has.
#[derive(Debug, Serialize)]
struct Common {
    bench: &'static str,
    case: &'static str,
    run: u32,
    size_bytes: u64,
    chunk_bytes: usize,
    /// The region's write tracking (`wp-async` or `wp-sync`).
    tracking: &'static str,
    /// CPUs this process may run on (wake-ups across CPUs cost more on some VMs).
    cpus: usize,
    /// How the region's reader waits for faults: `sleep` or `poll` (`--poll`).
    fault_path: &'static str,
    /// The poll window in µs (0 with `sleep`).
    poll_us: f64,
    /// Staged chunks moved back in the faulting thread (`--in-thread`, refault-staged only).
    in_thread: bool,
}

/// Which path served the region's faults, and what the fault path's threads cost.
#[derive(Debug, Serialize)]
struct PathCounts {
    /// Fault messages the reader found while polling.
    faults_polled: u64,
    /// Fault messages the reader read after a blocking `poll(2)`.
    faults_slept: u64,
    /// Faults the faulting thread resolved itself in its SIGBUS handler (`--in-thread`).
    faults_in_thread: u64,
    /// Faults its SIGBUS handler posted to the reader (`--in-thread`).
    faults_signalled: u64,
    /// Reader threads (sleeping: one per CPU, each kept to its CPU; `--poll`: one).
    fault_readers: u32,
    /// Times a reader stopped polling because its wake-ups kept finding nothing.
    reader_rests: u64,
    /// CPU time of the region's reader and companions, from open to the end of the touches.
    cpu_ms: f64,
    reader_cpu_ms: f64,
    companions_cpu_ms: f64,
}

impl PathCounts {
    fn of(stats: &RegionStats) -> Self {
        let cpu = stats.handler_cpu;
        Self {
            faults_polled: stats.faults_polled,
            faults_slept: stats.faults_slept,
            faults_in_thread: stats.faults_in_thread,
            faults_signalled: stats.faults_signalled,
            fault_readers: stats.fault_readers,
            reader_rests: stats.reader_rests,
            cpu_ms: round3(cpu.total_ns() as f64 / 1e6),
            reader_cpu_ms: round3(cpu.reader_ns as f64 / 1e6),
            companions_cpu_ms: round3(cpu.companions_ns as f64 / 1e6),
        }
    }
}

#[derive(Debug, Serialize)]
struct FaultRow {
    #[serde(flatten)]
    common: Common,
    samples: usize,
    p50_us: f64,
    p99_us: f64,
    max_us: f64,
    baseline_p50_us: f64,
    baseline_p99_us: f64,
    baseline_missing_p50_us: f64,
    baseline_missing_p99_us: f64,
    /// refault-staged only: the raw in-thread reference (a bare SIGBUS handler's move).
    #[serde(skip_serializing_if = "Option::is_none")]
    baseline_in_thread_p50_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    baseline_in_thread_p99_us: Option<f64>,
    /// Of the region's faults, those served without leaving the handler thread.
    faults: u64,
    faults_inline: u64,
    #[serde(flatten)]
    path: PathCounts,
}

#[derive(Debug, Serialize)]
struct FillRow {
    #[serde(flatten)]
    common: Common,
    elapsed_ms: f64,
    mb_per_s: f64,
    baseline_mb_per_s: f64,
    baseline_missing_mb_per_s: f64,
    memcpy_mb_per_s: f64,
    /// Copying the filled region out in chunks with volatile loads, as a push does.
    read_out_mb_per_s: f64,
    ratio_to_baseline: f64,
    faults: u64,
    faults_inline: u64,
    #[serde(flatten)]
    path: PathCounts,
    verified: bool,
}

#[derive(Debug, Serialize)]
struct ScanRow {
    #[serde(flatten)]
    common: Common,
    dirty_percent: u32,
    /// The timed `take_dirty()`.
    ms: f64,
    /// Pages `take_dirty()` reported written.
    pages: u64,
    /// Pages the benchmark wrote.
    written_pages: u64,
    /// Chunks `take_dirty()` reported dirty.
    dirty_chunks: u64,
    /// One raw `PAGEMAP_SCAN` pass over the same region with the same pages written.
    baseline_ms: f64,
}

/// Rounds to three decimals (latencies in µs, times in ms).
fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

/// The region's content: pseudo-random bytes.
pub(super) fn random_bytes(size: usize) -> Bytes {
    let mut buf = vec![0u8; size];
    rand::rngs::SmallRng::seed_from_u64(0x0fa2_0ffd).fill_bytes(&mut buf);
    Bytes::from(buf)
}

/// A memory store of `data.len()` bytes in `chunk`-sized chunks, each a slice of `data`.
pub(super) async fn store_over(data: &Bytes, chunk: usize) -> anyhow::Result<Arc<dyn Store>> {
    let g = Geometry::new(data.len() as u64, chunk as u64)?;
    let store = MemoryStore::new(g);
    for idx in g.all().iter() {
        let r = g.byte_range(idx);
        store
            .write(idx, data.slice(r.start as usize..r.end as usize))
            .await
            .with_context(|| format!("filling {idx} of the memory store"))?;
    }
    Ok(Arc::new(store))
}

/// A direct-mode region over `store` that pushes nothing on its own.
pub(super) fn open_region(
    store: Arc<dyn Store>,
    local_max: Option<LocalLimit>,
    fault_wait: FaultWait,
) -> anyhow::Result<Region> {
    let opts = RegionOptions {
        push: PushOptions {
            interval: None,
            ..PushOptions::default()
        },
        paging: local_max.map(PagingOptions::new),
        fault_wait,
        ..RegionOptions::direct()
    };
    Region::open(store, opts).context("opening a userfaultfd region")
}

/// Runs `a` then `b` on odd runs, `b` then `a` on even ones, so that neither side always
/// inherits the state (freed pages, caches) the other leaves behind.
fn in_turn<A, B>(
    run: u32,
    a: impl FnOnce() -> anyhow::Result<A>,
    b: impl FnOnce() -> anyhow::Result<B>,
) -> anyhow::Result<(A, B)> {
    if run % 2 == 1 {
        let a = a()?;
        Ok((a, b()?))
    } else {
        let b = b()?;
        Ok((a()?, b))
    }
}

fn ms(d: Duration) -> f64 {
    round3(d.as_secs_f64() * 1e3)
}

struct Bench {
    local_max: Option<LocalLimit>,
    fault_wait: FaultWait,
    data: Bytes,
    samples: usize,
    cpus: usize,
    json: bool,
    in_thread: bool,
}

impl Bench {
    fn common(&self, case: Case, run: u32, tracking: &'static str) -> Common {
        Common {
            bench: "uffd",
            case: case.name(),
            run,
            size_bytes: self.data.len() as u64,
            chunk_bytes: case.chunk(),
            tracking,
            cpus: self.cpus,
            fault_path: match self.fault_wait {
                FaultWait::Sleep => "sleep",
                FaultWait::Poll(_) => "poll",
            },
            poll_us: match self.fault_wait {
                FaultWait::Sleep => 0.0,
                FaultWait::Poll(d) => round3(d.as_secs_f64() * 1e6),
            },
            in_thread: self.in_thread && case == Case::RefaultStaged,
        }
    }

    fn baseline(&self, mode: BaselineMode) -> anyhow::Result<Baseline<'_>> {
        Baseline::new(&self.data, mode).context("setting up the baseline")
    }

    /// The raw userfaultfd's fault latencies on `pages`: write-protect mode (the reference)
    /// and missing only.
    fn fault_baselines(
        &self,
        chunk: usize,
        pages: &[usize],
    ) -> anyhow::Result<(Latencies, Latencies)> {
        let wp = self
            .baseline(BaselineMode::WriteProtect)?
            .fault_latency(chunk, pages)
            .context("baseline fault latency")?;
        let missing = self
            .baseline(BaselineMode::Missing)?
            .fault_latency(chunk, pages)
            .context("baseline (missing only) fault latency")?;
        Ok((wp, missing))
    }

    /// A fault row: the region's latencies, the baselines', and the counts of the faults
    /// timed (`faults`, `faults_inline` and the paths).
    fn fault_row(
        &self,
        (case, run, tracking): (Case, u32, &'static str),
        lat: &Latencies,
        (wp, missing): &(Latencies, Latencies),
        (faults, faults_inline): (u64, u64),
        path: PathCounts,
    ) -> FaultRow {
        FaultRow {
            common: self.common(case, run, tracking),
            samples: lat.samples,
            p50_us: round3(lat.p50_us),
            p99_us: round3(lat.p99_us),
            max_us: round3(lat.max_us),
            baseline_p50_us: round3(wp.p50_us),
            baseline_p99_us: round3(wp.p99_us),
            baseline_missing_p50_us: round3(missing.p50_us),
            baseline_missing_p99_us: round3(missing.p99_us),
            baseline_in_thread_p50_us: None,
            baseline_in_thread_p99_us: None,
            faults,
            faults_inline,
            path,
        }
    }

    fn fault(&self, store: Arc<dyn Store>, run: u32) -> anyhow::Result<FaultRow> {
        let case = Case::Fault4k;
        let pages = baseline::random_pages(self.data.len() / PAGE_SIZE, self.samples, PAGES_SEED);
        let baselines = || self.fault_baselines(case.chunk(), &pages);
        let farmap = || -> anyhow::Result<_> {
            let region = open_region(store, self.local_max, self.fault_wait)?;
            let lat = Latencies::from_samples(baseline::touch_each(region.memory(), &pages));
            Ok((lat, region.stats(), region.tracking_mode().as_str()))
        };
        let (base, (lat, stats, tracking)) = in_turn(run, baselines, farmap)?;
        Ok(self.fault_row(
            (case, run, tracking),
            &lat,
            &base,
            (stats.faults, stats.faults_inline),
            PathCounts::of(&stats),
        ))
    }

    fn refault_staged(&self, store: Arc<dyn Store>, run: u32) -> anyhow::Result<FaultRow> {
        let case = Case::RefaultStaged;
        let pages = baseline::random_pages(self.data.len() / PAGE_SIZE, self.samples, PAGES_SEED);
        let baselines = || -> anyhow::Result<_> {
            let raw = self.fault_baselines(case.chunk(), &pages)?;
            let in_thread = self
                .baseline(BaselineMode::Missing)?
                .refault_in_thread(&pages)
                .context("baseline in-thread re-faults")?;
            Ok((raw, in_thread))
        };
        let farmap = || -> anyhow::Result<_> {
            let opts = RegionOptions {
                push: PushOptions {
                    interval: None,
                    ..PushOptions::default()
                },
                paging: Some(PagingOptions {
                    // Everything fits, and no reclaim drops what is staged.
                    proactive: false,
                    in_thread: self.in_thread,
                    ..PagingOptions::new(LocalLimit::Percent(100.0))
                }),
                fault_wait: self.fault_wait,
                ..RegionOptions::direct()
            };
            let region = Region::open(store, opts).context("opening a userfaultfd region")?;
            let mem = region.memory();
            baseline::touch_each(mem, &pages);
            // A chunk whose fetch woke its thread may become active a moment later.
            let mut staged = 0;
            let deadline = Instant::now() + Duration::from_secs(5);
            while staged < pages.len() as u64 && Instant::now() < deadline {
                staged += region.deactivate(pages.len() as u64).unwrap_or(0);
                std::thread::sleep(Duration::from_millis(1));
            }
            if staged < pages.len() as u64 {
                bail!("only {staged} of {} chunks could be staged", pages.len());
            }
            let before = region.stats();
            let lat = Latencies::from_samples(baseline::touch_each(mem, &pages));
            let after = region.stats();
            let moved_back = after.paging.as_ref().map_or(0, |p| p.staged_refaults)
                - before.paging.as_ref().map_or(0, |p| p.staged_refaults);
            if moved_back < pages.len() as u64 {
                bail!(
                    "{moved_back} of {} re-faults moved a staged chunk back",
                    pages.len()
                );
            }
            Ok((lat, after, before, region.tracking_mode().as_str()))
        };
        let ((base, in_thread), (lat, stats, before, tracking)) = in_turn(run, baselines, farmap)?;
        let mut path = PathCounts::of(&stats);
        // Only the timed re-faults.
        path.faults_polled -= before.faults_polled;
        path.faults_slept -= before.faults_slept;
        path.faults_in_thread -= before.faults_in_thread;
        path.faults_signalled -= before.faults_signalled;
        path.reader_rests -= before.reader_rests;
        let mut row = self.fault_row(
            (case, run, tracking),
            &lat,
            &base,
            (
                stats.faults - before.faults,
                stats.faults_inline - before.faults_inline,
            ),
            path,
        );
        row.baseline_in_thread_p50_us = Some(round3(in_thread.p50_us));
        row.baseline_in_thread_p99_us = Some(round3(in_thread.p99_us));
        Ok(row)
    }

    fn fill(&self, case: Case, store: Arc<dyn Store>, run: u32) -> anyhow::Result<FillRow> {
        let chunk = case.chunk();
        let baselines = || -> anyhow::Result<_> {
            let wp = self
                .baseline(BaselineMode::WriteProtect)?
                .fill(chunk)
                .context("baseline fill")?;
            let missing = self
                .baseline(BaselineMode::Missing)?
                .fill(chunk)
                .context("baseline (missing only) fill")?;
            Ok((wp, missing))
        };
        let farmap = || -> anyhow::Result<_> {
            let region = open_region(store, self.local_max, self.fault_wait)?;
            let elapsed = baseline::touch_all(region.memory());
            // Every page is present now: this times the copy alone.
            let mut buf = vec![0u8; chunk];
            let started = Instant::now();
            for offset in (0..region.len()).step_by(chunk) {
                let n = chunk.min(region.len() - offset);
                region.read_at(offset, &mut buf[..n])?;
                std::hint::black_box(&buf);
            }
            let read_out = started.elapsed();
            let verified = region.memory().to_vec() == self.data;
            Ok((
                (elapsed, read_out),
                verified,
                region.stats(),
                region.tracking_mode().as_str(),
            ))
        };
        let ((wp, missing), ((elapsed, read_out), verified, stats, tracking)) =
            in_turn(run, baselines, farmap)?;
        let read_out_mb = self.data.len() as f64 / read_out.as_secs_f64().max(1e-9) / 1e6;
        let memcpy = measure_memcpy(&self.data, chunk);
        let mb = self.data.len() as f64 / elapsed.as_secs_f64().max(1e-9) / 1e6;
        Ok(FillRow {
            common: self.common(case, run, tracking),
            elapsed_ms: ms(elapsed),
            mb_per_s: output::round1(mb),
            baseline_mb_per_s: output::round1(wp.mb_per_s()),
            baseline_missing_mb_per_s: output::round1(missing.mb_per_s()),
            memcpy_mb_per_s: output::round1(memcpy),
            read_out_mb_per_s: output::round1(read_out_mb),
            ratio_to_baseline: round3(mb / wp.mb_per_s().max(1e-9)),
            faults: stats.faults,
            faults_inline: stats.faults_inline,
            path: PathCounts::of(&stats),
            verified,
        })
    }

    fn dirty_scan(&self, store: Arc<dyn Store>, run: u32) -> anyhow::Result<Vec<ScanRow>> {
        let case = Case::DirtyScan;
        let npages = self.data.len() / PAGE_SIZE;
        let raw = self.baseline(BaselineMode::WriteProtect)?;
        let region = open_region(store, self.local_max, self.fault_wait)?;
        baseline::touch_all(region.memory());
        region.take_dirty().context("the first take_dirty")?;
        let tracking = region.tracking_mode().as_str();
        let mut rows = Vec::new();
        for percent in DIRTY_PERCENTS {
            let pages = baseline::spread_pages(npages, percent);
            let base = raw.dirty_scan(&pages).context("baseline PAGEMAP_SCAN")?;
            baseline::write_each(region.memory(), &pages);
            let started = Instant::now();
            let report = region.take_dirty().context("take_dirty")?;
            let elapsed = started.elapsed();
            rows.push(ScanRow {
                common: self.common(case, run, tracking),
                dirty_percent: percent,
                ms: ms(elapsed),
                pages: report.page_count(),
                written_pages: pages.len() as u64,
                dirty_chunks: report.chunks.len() as u64,
                baseline_ms: ms(base.elapsed),
            });
        }
        Ok(rows)
    }
}

fn print_fault(r: &FaultRow) {
    let in_thread = match (r.baseline_in_thread_p50_us, r.baseline_in_thread_p99_us) {
        (Some(p50), Some(p99)) => format!(", raw in-thread {p50:.1} / {p99:.1} µs"),
        _ => String::new(),
    };
    println!(
        "{:<14} {} random faults in {}: p50 {:.1} µs, p99 {:.1} µs \
         (baseline {:.1} / {:.1} µs, missing-only {:.1} / {:.1} µs{}; {} of {} faults inline; \
         {}: {} faults found polling, {} after sleeping, {} in the faulting thread; fault path \
         CPU {:.1} ms)",
        r.common.case,
        r.samples,
        format_size(r.common.size_bytes),
        r.p50_us,
        r.p99_us,
        r.baseline_p50_us,
        r.baseline_p99_us,
        r.baseline_missing_p50_us,
        r.baseline_missing_p99_us,
        in_thread,
        r.faults_inline,
        r.faults,
        r.common.fault_path,
        r.path.faults_polled,
        r.path.faults_slept,
        r.path.faults_in_thread,
        r.path.cpu_ms,
    );
}

fn print_fill(r: &FillRow) {
    println!(
        "{:<10} {} in {} chunks: {:.1} MB/s = {:.2} × baseline {:.1} MB/s \
         (missing-only {:.1}, memcpy {:.1} MB/s; read out {:.1} MB/s){}",
        r.common.case,
        format_size(r.common.size_bytes),
        format_size(r.common.chunk_bytes as u64),
        r.mb_per_s,
        r.ratio_to_baseline,
        r.baseline_mb_per_s,
        r.baseline_missing_mb_per_s,
        r.memcpy_mb_per_s,
        r.read_out_mb_per_s,
        if r.verified { "" } else { ", CONTENT DIFFERS" },
    );
}

fn print_scan(r: &ScanRow) {
    println!(
        "dirty-scan {}% of {}: take_dirty {:.2} ms, {} pages in {} chunks \
         (raw PAGEMAP_SCAN {:.2} ms)",
        r.dirty_percent,
        format_size(r.common.size_bytes),
        r.ms,
        r.pages,
        r.dirty_chunks,
        r.baseline_ms,
    );
}

fn emit<T: Serialize>(json: bool, row: &T, human: impl FnOnce(&T)) -> anyhow::Result<()> {
    if json {
        output::json_line(row)
    } else {
        human(row);
        Ok(())
    }
}

pub async fn run(args: UffdArgs) -> anyhow::Result<ExitCode> {
    let size = usize::try_from(args.size).context("the size does not fit in memory")?;
    if size < (1 << 20) || !size.is_multiple_of(PAGE_SIZE) {
        bail!(
            "--size {} must be at least 1MiB and a multiple of 4KiB",
            format_size(args.size)
        );
    }
    farmap_uffd::probe().context("userfaultfd is needed for this benchmark")?;
    let mut cases: Vec<Case> = Vec::new();
    for case in &args.cases {
        if !cases.contains(case) {
            cases.push(*case);
        }
    }
    let progress = |msg: String| {
        if !args.json {
            eprintln!("{msg}");
        }
    };
    progress(format!(
        "preparing {} of random data",
        format_size(args.size)
    ));
    let bench = Arc::new(Bench {
        local_max: args.local_max,
        fault_wait: args.poll.map_or(FaultWait::Sleep, FaultWait::Poll),
        data: tokio::task::spawn_blocking(move || random_bytes(size)).await?,
        samples: args.samples as usize,
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        json: args.json,
        in_thread: args.in_thread,
    });
    // The first region a process maps fills slower than the next ones (fresh pages from the
    // kernel's allocator): warm up, untimed, so that the first measurement is not penalized.
    {
        let b = bench.clone();
        tokio::task::spawn_blocking(move || {
            Baseline::new(&b.data, BaselineMode::WriteProtect)?.fill(1 << 20)
        })
        .await?
        .context("warming up")?;
    }
    let mut failed = false;
    for case in cases {
        let store = store_over(&bench.data, case.chunk()).await?;
        for run in 1..=args.runs {
            progress(format!("{} run {run}/{}", case.name(), args.runs));
            let (b, s) = (bench.clone(), store.clone());
            tokio::task::spawn_blocking(move || -> anyhow::Result<bool> {
                match case {
                    Case::Fault4k => {
                        let row = b.fault(s, run)?;
                        emit(b.json, &row, print_fault)?;
                    }
                    Case::RefaultStaged => {
                        let row = b.refault_staged(s, run)?;
                        emit(b.json, &row, print_fault)?;
                    }
                    Case::Fill4k | Case::Fill64k | Case::Fill1m => {
                        let row = b.fill(case, s, run)?;
                        emit(b.json, &row, print_fill)?;
                        return Ok(row.verified);
                    }
                    Case::DirtyScan => {
                        for row in b.dirty_scan(s, run)? {
                            emit(b.json, &row, print_scan)?;
                        }
                    }
                }
                Ok(true)
            })
            .await
            .context("the benchmark thread panicked")?
            .map(|ok| failed |= !ok)
            .with_context(|| format!("case {}", case.name()))?;
        }
    }
    if failed {
        bail!("a region's content differed from its store after a fill");
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn case_names_parse_back() {
        for case in Case::value_variants() {
            assert_eq!(Case::from_str(case.name(), false).unwrap(), *case);
        }
    }

    #[test]
    fn memcpy_is_measured() {
        assert!(measure_memcpy(&[1u8; 1 << 20], 4096) > 0.0);
    }
}
