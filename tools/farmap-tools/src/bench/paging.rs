//! `farmap bench paging`: a self-checking application in a bounded farmap region, against
//! the same application swapping under the kernel, in the same run (issue 16).
//!
//! The application (`paging_app.rs`) touches one page per access
//! (`--pattern seq|uniform|zipf`, `--writes` percent of them writes, `--threads` threads,
//! `--accesses` in all or `--runtime` each), predicts and checks every word it reads, and
//! times each access alone; it reports the percentiles of *faulting* accesses (the page
//! had no present page-table entry just before the access: one `PAGEMAP_SCAN` outside the
//! timed span, the same test for both systems).
//!
//! Per pattern and `--local` share, two systems, one line each:
//! - `farmap`: the application runs in this process on a userfaultfd region in direct mode
//!   over `--store memory` (a sparse memory store) or `--store remote` (a `farmap serve` of
//!   a memory store in this process, reached through the delay proxy at `--rtt`, directly at
//!   0 ms, as `farmap bench net` does), with `local_max = local%` of the size (paging with
//!   the default `min_free`, proactive reclaim on). `faults` is the region's missing-page
//!   faults in the timed phase; `evictions_*` are the pager's counters over it.
//! - `kernel-swap` (root): the same application as a plain process (`farmap __paging-app`)
//!   in a cgroup v1 memory limit of `local%` of the size plus its own measured overhead,
//!   swapping to a loop device over a file in RAM (`paging_swap.rs` says
//!   how it is set up and torn down). `faults` is the child's minor + major page faults in
//!   the timed phase (`majflt` and `minflt` are given too), `evictions_reactive` the
//!   system's `pswpout` over it (the limit's reclaim runs in the charging task: all of it is
//!   reactive), `prefetch` the kernel's swap readahead window (2^`vm.page-cluster` pages),
//!   `prefetch_hits` / `prefetch_wasted` the system's `swap_ra_hit` and `swap_ra −
//!   swap_ra_hit` over it. The store, `--rtt` and `--chunk` do not apply to it. Without
//!   root or cgroup v1 it is skipped with a line on stderr saying why.
//!
//! Both systems also run once unlimited (farmap: no paging; kernel: limit `-1`);
//! `runtime_ratio` is the limited run's timed phase over the unlimited one's.
//! Timed phase only: init (every page written once) and the final check are untimed.
//!
//! `--plot FILE.svg|png` also draws every limited run's faulting accesses as a tail curve
//! (1 − CDF, log axes, p50/p99/p99.9 marked; `farmap_plot::latency_cdf`) from the
//! application's histogram (64 buckets per power of two; the kernel-swap child sends its
//! buckets in its JSON report).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use farmap::net::{serve, ClientOptions, ListenAddr, Listener, RemoteAddr, RemoteStore};
use farmap::pipeline::PushOptions;
use farmap::store::MemoryStore;
use farmap::{Geometry, Store};
use farmap_plot::{Latencies, LatencySeries};
use farmap_uffd::{
    FaultWait, LocalLimit, PagingOptions, Prefetch, Region, RegionOptions, RegionStats,
};
use serde::Serialize;

use super::common::{parse_duration, parse_size_arg};
use super::net::Link;
use super::paging_app::{interrupted, App, AppConfig, AppReport, Budget, Pattern};
use super::paging_swap::{self, KernelRun, SwapEnv};
use super::uffd_raw::PAGE_SIZE;
use crate::output;

/// Where the farmap region's chunks live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StoreKind {
    /// A sparse memory store in this process.
    Memory,
    /// A `farmap serve` of a memory store (in this process) behind the delay proxy.
    Remote,
}

impl StoreKind {
    fn name(self) -> &'static str {
        match self {
            StoreKind::Memory => "memory",
            StoreKind::Remote => "remote",
        }
    }
}

/// The systems compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum System {
    /// A bounded farmap region.
    Farmap,
    /// A plain process in a memory cgroup, swapping to RAM.
    #[value(name = "kernel-swap")]
    KernelSwap,
}

fn parse_prefetch(s: &str) -> Result<Prefetch, String> {
    s.parse::<Prefetch>().map_err(|e| format!("--prefetch {e}"))
}

/// `30%` or `30`: a share of the size in (0, 100].
pub(super) fn parse_percent(s: &str) -> Result<f64, String> {
    let p: f64 = s
        .trim()
        .trim_end_matches('%')
        .parse()
        .map_err(|_| format!("{s:?}: expected a percentage like 30%"))?;
    if !(p > 0.0 && p <= 100.0) {
        return Err(format!("{s:?}: the percentage must be in (0, 100]"));
    }
    Ok(p)
}

#[derive(Debug, Args)]
pub struct PagingArgs {
    /// Size of the application's memory (binary suffixes: 256MiB).
    #[arg(long, default_value = "256MiB", value_parser = parse_size_arg)]
    size: u64,
    /// Access patterns, comma-separated: seq, uniform, zipf (θ = 0.99, hot pages scattered).
    #[arg(
        long = "pattern",
        value_enum,
        value_delimiter = ',',
        default_value = "seq,uniform,zipf"
    )]
    patterns: Vec<Pattern>,
    /// Local memory in percent of the size, comma-separated: farmap's local_max and the
    /// kernel baseline's memory limit (plus the process's own overhead).
    #[arg(long, value_delimiter = ',', default_value = "30%", value_parser = parse_percent)]
    local: Vec<f64>,
    /// farmap's prefetch: `off`, or `seq[:MAX]` (a sequential window doubling up to MAX
    /// chunks). Default: a bounded region's default, `seq` (a window of at most 32 chunks).
    #[arg(long, default_value = "seq", value_parser = parse_prefetch)]
    prefetch: Prefetch,
    /// Application threads (each touches its own block of pages).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=256))]
    threads: u32,
    /// The farmap region's store.
    #[arg(long, value_enum, default_value = "memory")]
    store: StoreKind,
    /// Round-trip time to the remote store (through the delay proxy; none at 0).
    #[arg(long, default_value = "0ms", value_parser = parse_duration)]
    rtt: Duration,
    /// The farmap region's chunk size. Default: what farmap picks for a bounded region over
    /// a memory or file store, the page size (the kernel swaps 4 KiB pages).
    #[arg(long, default_value_t = u64::from(farmap_uffd::PAGING_CHUNK_SIZE),
          value_parser = parse_size_arg)]
    chunk: u64,
    /// Let farmap's fault reader poll for this long (e.g. 50us) after each batch before it
    /// sleeps, with idle-priority companions keeping the CPUs awake (the fault path for VMs;
    /// see `farmap bench uffd --poll`). Default: the reader sleeps.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    poll: Option<Duration>,
    /// farmap: the faulting thread moves staged chunks back itself, in a SIGBUS handler
    /// (`PagingOptions::in_thread`); other faults still go to the reader.
    #[arg(long)]
    in_thread: bool,
    /// Timed accesses in all, split between the threads.
    #[arg(long, default_value_t = 200_000, conflicts_with = "runtime",
          value_parser = clap::value_parser!(u64).range(1..))]
    accesses: u64,
    /// Run every thread this long instead of a number of accesses.
    #[arg(long, value_parser = parse_duration)]
    runtime: Option<Duration>,
    /// Percent of accesses that write.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(0..=100))]
    writes: u32,
    /// The systems to run, comma-separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "farmap,kernel-swap"
    )]
    system: Vec<System>,
    /// Seed of the access sequences (the same for both systems).
    #[arg(long, default_value_t = 0x9a61)]
    seed: u64,
    /// Print every faulting access slower than this (e.g. 300us) on stderr, with the
    /// CLOCK_MONOTONIC time it ended at and its thread id, to line it up with a trace taken
    /// meanwhile (`perf sched record -k CLOCK_MONOTONIC`).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    trace_slow: Option<Duration>,
    /// One JSON object per system, pattern and local share on stdout.
    #[arg(long)]
    json: bool,
    /// Also draw the faulting accesses' latencies, one tail curve (1 − CDF) per system,
    /// pattern and local share, into FILE (`.svg` or `.png`).
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
}

#[derive(Debug, Serialize)]
struct Row {
    bench: &'static str,
    system: &'static str,
    pattern: &'static str,
    prefetch: String,
    local_percent: f64,
    p50_us: Option<f64>,
    p95_us: Option<f64>,
    p99_us: Option<f64>,
    p99_9_us: Option<f64>,
    runtime_ms: f64,
    runtime_ratio: f64,
    faults: u64,
    evictions_reactive: u64,
    evictions_proactive: u64,
    /// farmap: faults that found the region at its limit (the reclaim fell behind).
    #[serde(skip_serializing_if = "Option::is_none")]
    full_faults: Option<u64>,
    /// farmap: chunks admitted over the limit (within `min_free`) while a reclaim made room.
    #[serde(skip_serializing_if = "Option::is_none")]
    overcommits: Option<u64>,
    prefetch_hits: u64,
    prefetch_wasted: u64,
    /// farmap: chunks fetched ahead of faults.
    #[serde(skip_serializing_if = "Option::is_none")]
    prefetched: Option<u64>,
    verified: bool,
    /// The farmap region's store (`memory`, `remote`); `none` for kernel-swap.
    store: &'static str,
    rtt_ms: f64,
    size_bytes: u64,
    /// farmap's chunk size; the page size for kernel-swap.
    chunk_bytes: u64,
    threads: u32,
    writes_percent: u32,
    accesses: u64,
    faulting_accesses: u64,
    /// The unlimited run's timed phase.
    unlimited_runtime_ms: f64,
    /// farmap: the pager's limit; kernel-swap: `memory.limit_in_bytes`.
    limit_bytes: u64,
    /// farmap: faults served by moving a staged chunk back.
    staged_refaults: Option<u64>,
    /// farmap: how its fault reader waits (`sleep` or `poll`, `--poll`).
    #[serde(skip_serializing_if = "Option::is_none")]
    fault_path: Option<&'static str>,
    /// farmap: fault messages its reader found while polling, and after sleeping.
    #[serde(skip_serializing_if = "Option::is_none")]
    faults_polled: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    faults_slept: Option<u64>,
    /// farmap with `--in-thread`: faults its threads resolved in their SIGBUS handler.
    #[serde(skip_serializing_if = "Option::is_none")]
    faults_in_thread: Option<u64>,
    majflt: Option<u64>,
    minflt: Option<u64>,
    /// kernel-swap: attempts the OOM killer ended before this one (each run again).
    oom_kills: Option<u32>,
    /// The first wrong word read, if any.
    mismatch: Option<String>,
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

/// The store of one farmap run, and what serves it.
struct FarmapStore {
    store: Arc<dyn Store>,
    remote: Option<(farmap::net::Server, Link)>,
}

impl FarmapStore {
    async fn open(kind: StoreKind, g: Geometry, rtt: Duration) -> anyhow::Result<FarmapStore> {
        let memory: Arc<dyn Store> = Arc::new(MemoryStore::new(g));
        if kind == StoreKind::Memory {
            return Ok(FarmapStore {
                store: memory,
                remote: None,
            });
        }
        let server = serve(
            memory,
            Listener::bind(&ListenAddr::Tcp("127.0.0.1:0".parse()?)).await?,
            farmap::net::ServeOptions {
                log: false,
                ..farmap::net::ServeOptions::default()
            },
        )?;
        let ListenAddr::Tcp(addr) = server.local_addr().clone() else {
            bail!("the server did not listen on TCP");
        };
        let link = Link::to(addr, rtt).await?;
        let to: SocketAddr = link.local_addr();
        let store = RemoteStore::connect(RemoteAddr::Tcp(to.to_string()), ClientOptions::default())
            .await
            .with_context(|| format!("connecting to the benchmark's server at {to}"))?;
        Ok(FarmapStore {
            store: Arc::new(store),
            remote: Some((server, link)),
        })
    }

    async fn close(self) {
        drop(self.store);
        if let Some((server, link)) = self.remote {
            link.shutdown().await;
            let _ = server.shutdown().await;
        }
    }
}

/// One farmap run: the report, the region's counters over the timed phase, its limit.
struct FarmapRun {
    report: AppReport,
    before: RegionStats,
    after: RegionStats,
}

fn run_farmap(
    config: &AppConfig,
    store: Arc<dyn Store>,
    local: Option<f64>,
    poll: Option<Duration>,
    prefetch: Prefetch,
    in_thread: bool,
) -> anyhow::Result<FarmapRun> {
    let opts = RegionOptions {
        fault_wait: poll.map_or(FaultWait::Sleep, FaultWait::Poll),
        push: PushOptions {
            interval: None,
            ..PushOptions::default()
        },
        paging: local.map(|p| PagingOptions {
            prefetch,
            in_thread,
            ..PagingOptions::new(LocalLimit::Percent(p))
        }),
        ..RegionOptions::direct()
    };
    let region = Region::open(store, opts).context("opening the farmap region")?;
    let mut app = App::new(*config)?;
    app.init(region.memory()).context("init")?;
    let before = region.stats();
    let runtime = app.run(region.memory()).context("run")?;
    let after = region.stats();
    app.check(region.memory()).context("check")?;
    Ok(FarmapRun {
        report: app.report(runtime),
        before,
        after,
    })
}

struct Bench {
    args: PagingArgs,
    handle: tokio::runtime::Handle,
    geometry: Geometry,
    kernel_prefetch: String,
}

impl Bench {
    fn config(&self, pattern: Pattern) -> AppConfig {
        AppConfig {
            size: self.args.size as usize,
            pattern,
            threads: self.args.threads as usize,
            budget: match self.args.runtime {
                Some(d) => Budget::Runtime(d),
                None => Budget::Accesses(self.args.accesses),
            },
            writes_percent: self.args.writes,
            seed: self.args.seed,
            trace_slow: self.args.trace_slow,
        }
    }

    fn progress(&self, msg: std::fmt::Arguments<'_>) {
        if !self.args.json {
            status!("{msg}");
        }
    }

    fn farmap(&self, config: &AppConfig, local: Option<f64>) -> anyhow::Result<FarmapRun> {
        let (kind, g, rtt) = (self.args.store, self.geometry, self.args.rtt);
        let store = self
            .handle
            .block_on(FarmapStore::open(kind, g, rtt))
            .context("setting up the store")?;
        let run = run_farmap(
            config,
            store.store.clone(),
            local,
            self.args.poll,
            self.args.prefetch,
            self.args.in_thread,
        );
        self.handle.block_on(store.close());
        run
    }

    #[allow(clippy::too_many_arguments)]
    fn row(
        &self,
        system: System,
        pattern: Pattern,
        local: f64,
        report: &AppReport,
        unlimited_ms: f64,
        limit_bytes: u64,
    ) -> Row {
        let (store, rtt_ms, chunk) = match system {
            System::Farmap => (
                self.args.store.name(),
                self.args.rtt.as_secs_f64() * 1e3,
                self.args.chunk,
            ),
            System::KernelSwap => ("none", 0.0, PAGE_SIZE as u64),
        };
        Row {
            bench: "paging",
            system: match system {
                System::Farmap => "farmap",
                System::KernelSwap => "kernel-swap",
            },
            pattern: pattern.name(),
            prefetch: match system {
                System::Farmap => self.args.prefetch.name(),
                System::KernelSwap => self.kernel_prefetch.clone(),
            },
            local_percent: local,
            p50_us: report.p50_us,
            p95_us: report.p95_us,
            p99_us: report.p99_us,
            p99_9_us: report.p99_9_us,
            runtime_ms: report.runtime_ms,
            runtime_ratio: round3(report.runtime_ms / unlimited_ms.max(1e-3)),
            faults: 0,
            evictions_reactive: 0,
            evictions_proactive: 0,
            full_faults: None,
            overcommits: None,
            prefetch_hits: 0,
            prefetch_wasted: 0,
            prefetched: None,
            verified: report.verified,
            store,
            rtt_ms,
            size_bytes: self.args.size,
            chunk_bytes: chunk,
            threads: self.args.threads,
            writes_percent: self.args.writes,
            accesses: report.accesses,
            faulting_accesses: report.faulting_accesses,
            unlimited_runtime_ms: unlimited_ms,
            limit_bytes,
            staged_refaults: None,
            fault_path: None,
            faults_polled: None,
            faults_slept: None,
            faults_in_thread: None,
            majflt: None,
            minflt: None,
            oom_kills: None,
            mismatch: report.first_mismatch.clone(),
        }
    }

    fn farmap_row(&self, pattern: Pattern, local: f64, run: &FarmapRun, unlimited_ms: f64) -> Row {
        let paging = |s: &RegionStats| s.paging.clone().unwrap_or_default();
        let (b, a) = (paging(&run.before), paging(&run.after));
        let mut row = self.row(
            System::Farmap,
            pattern,
            local,
            &run.report,
            unlimited_ms,
            a.limit_chunks * self.args.chunk,
        );
        row.faults = run.after.faults - run.before.faults;
        row.evictions_reactive = a.evictions_reactive - b.evictions_reactive;
        row.evictions_proactive = a.evictions_proactive - b.evictions_proactive;
        row.full_faults = Some(a.full_faults - b.full_faults);
        row.overcommits = Some(a.overcommits - b.overcommits);
        row.staged_refaults = Some(a.staged_refaults - b.staged_refaults);
        row.prefetch_hits = a.prefetch_hits - b.prefetch_hits;
        row.prefetch_wasted = a.prefetch_wasted - b.prefetch_wasted;
        row.prefetched = Some(a.prefetched - b.prefetched);
        row.fault_path = Some(if self.args.poll.is_some() {
            "poll"
        } else {
            "sleep"
        });
        row.faults_polled = Some(run.after.faults_polled - run.before.faults_polled);
        row.faults_slept = Some(run.after.faults_slept - run.before.faults_slept);
        if self.args.in_thread {
            row.faults_in_thread = Some(run.after.faults_in_thread - run.before.faults_in_thread);
        }
        row
    }

    fn kernel_row(&self, pattern: Pattern, local: f64, run: &KernelRun, unlimited_ms: f64) -> Row {
        let report = &run.report;
        let mut row = self.row(
            System::KernelSwap,
            pattern,
            local,
            report,
            unlimited_ms,
            run.limit.unwrap_or(0),
        );
        row.oom_kills = Some(run.oom_kills);
        let k = report.kernel.unwrap_or_default();
        row.faults = k.majflt + k.minflt;
        row.majflt = Some(k.majflt);
        row.minflt = Some(k.minflt);
        row.evictions_reactive = k.pswpout;
        row.prefetch_hits = k.swap_ra_hit;
        row.prefetch_wasted = k.swap_ra.saturating_sub(k.swap_ra_hit);
        row
    }

    fn emit(&self, row: &Row) -> anyhow::Result<()> {
        if self.args.json {
            return output::json_line(row);
        }
        let us = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"));
        println!(
            "{:<11} {:<7} {:>5.0}% {:<16} {:>8} {:>8} {:>8} {:>9} {:>10.1} {:>6.2} {:>8} {:>8}/{:<8} {}",
            row.system,
            row.pattern,
            row.local_percent,
            row.prefetch,
            us(row.p50_us),
            us(row.p95_us),
            us(row.p99_us),
            us(row.p99_9_us),
            row.runtime_ms,
            row.runtime_ratio,
            row.faults,
            row.evictions_reactive,
            row.evictions_proactive,
            if row.verified { "yes" } else { "NO" },
        );
        Ok(())
    }

    fn header(&self) {
        if !self.args.json {
            println!(
                "{:<11} {:<7} {:>6} {:<16} {:>8} {:>8} {:>8} {:>9} {:>10} {:>6} {:>8} {:>17} verified",
                "system",
                "pattern",
                "local",
                "prefetch",
                "p50 µs",
                "p95 µs",
                "p99 µs",
                "p99.9 µs",
                "runtime ms",
                "ratio",
                "faults",
                "evictions r/p",
            );
        }
    }
}

/// A row's latencies for `--plot`, named after its system, pattern and local share.
fn plot_series(row: &Row, report: &AppReport) -> LatencySeries {
    LatencySeries {
        name: format!(
            "{} {} {}% local",
            row.system, row.pattern, row.local_percent
        ),
        latencies: Latencies::Buckets(report.latency_buckets_us.clone()),
    }
}

/// The blocking part: every run, in order, one line per system, pattern and share; the
/// limited runs' latencies go to `plotted`.
fn run_all(
    bench: &Bench,
    env: Option<&SwapEnv>,
    plotted: &mut Vec<LatencySeries>,
) -> anyhow::Result<bool> {
    let args = &bench.args;
    let farmap = args.system.contains(&System::Farmap);
    let mut all_verified = true;
    bench.header();
    for &pattern in &args.patterns {
        let config = bench.config(pattern);
        let farmap_unlimited = if farmap {
            bench.progress(format_args!("farmap {}: unlimited run", pattern.name()));
            let run = bench.farmap(&config, None)?;
            all_verified &= run.report.verified;
            interrupted()?;
            Some(run.report.runtime_ms)
        } else {
            None
        };
        let kernel_unlimited = match env {
            Some(env) => {
                bench.progress(format_args!(
                    "kernel-swap {}: unlimited run",
                    pattern.name()
                ));
                let run = env.run(&config, None)?;
                all_verified &= run.report.verified;
                interrupted()?;
                Some(run.report.runtime_ms)
            }
            None => None,
        };
        for &local in &args.local {
            if let Some(unlimited) = farmap_unlimited {
                bench.progress(format_args!("farmap {} at {local}%", pattern.name()));
                let run = bench.farmap(&config, Some(local))?;
                interrupted()?;
                all_verified &= run.report.verified;
                let row = bench.farmap_row(pattern, local, &run, unlimited);
                plotted.push(plot_series(&row, &run.report));
                bench.emit(&row)?;
            }
            if let (Some(env), Some(unlimited)) = (env, kernel_unlimited) {
                bench.progress(format_args!("kernel-swap {} at {local}%", pattern.name()));
                let bytes = (args.size as f64 * local / 100.0) as u64;
                let run = env.run(&config, Some(bytes))?;
                interrupted()?;
                all_verified &= run.report.verified;
                let row = bench.kernel_row(pattern, local, &run, unlimited);
                plotted.push(plot_series(&row, &run.report));
                bench.emit(&row)?;
            }
        }
    }
    Ok(all_verified)
}

pub async fn run(args: PagingArgs) -> anyhow::Result<ExitCode> {
    let size = usize::try_from(args.size).context("the size does not fit in memory")?;
    let geometry = Geometry::new(args.size, args.chunk)
        .with_context(|| format!("--size {} with --chunk {}", args.size, args.chunk))?;
    if !size.is_multiple_of(PAGE_SIZE)
        || !args.size.is_multiple_of(args.chunk)
        || args.chunk < PAGE_SIZE as u64
    {
        bail!("--size must be a multiple of --chunk, which must be at least 4KiB");
    }
    if (size / PAGE_SIZE) < args.threads as usize {
        bail!("--size must give every thread at least one page");
    }
    if let Some(path) = &args.plot {
        // A wrong extension is found before minutes of runs, not after.
        farmap_plot::Format::from_path(path)?;
    }
    if args.system.contains(&System::Farmap) {
        farmap_uffd::probe().context("userfaultfd is needed for farmap's side")?;
    }
    let page_cluster: u32 = std::fs::read_to_string("/proc/sys/vm/page-cluster")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(3);
    let kernel_prefetch = if page_cluster == 0 {
        "off".to_owned()
    } else {
        format!("swap-readahead:{}", 1u64 << page_cluster.min(20))
    };
    // Ctrl-C and SIGTERM stop the application and kill the kernel-swap child.
    let ctrl_c = super::paging_app::on_interrupt(paging_swap::kill_child)?;
    let want_kernel = args.system.contains(&System::KernelSwap);
    let bench = Bench {
        args,
        handle: tokio::runtime::Handle::current(),
        geometry,
        kernel_prefetch,
    };
    let plot = bench.args.plot.clone();
    let title = format!(
        "farmap bench paging: faulting accesses ({} MiB, {} {}, {}% writes)",
        bench.args.size >> 20,
        bench.args.threads,
        if bench.args.threads == 1 {
            "thread"
        } else {
            "threads"
        },
        bench.args.writes
    );
    let result = tokio::task::spawn_blocking(move || -> anyhow::Result<(bool, Vec<_>)> {
        let env = if want_kernel {
            match SwapEnv::setup(bench.args.size) {
                Ok(env) => {
                    bench.progress(format_args!(
                        "kernel-swap: swapping to {} (a file in a tmpfs)",
                        env.device()
                    ));
                    Some(env)
                }
                Err(e) => {
                    status!("skipped kernel-swap: {}", output::error_chain(&e));
                    None
                }
            }
        } else {
            None
        };
        // `env` drops (swapoff, losetup -d, rmdir) whatever happens.
        let mut plotted = Vec::new();
        let verified = run_all(&bench, env.as_ref(), &mut plotted)?;
        Ok((verified, plotted))
    })
    .await;
    ctrl_c.abort();
    let (verified, plotted) = result.context("the benchmark thread panicked")??;
    if let Some(path) = plot {
        farmap_plot::latency_cdf(&path, &title, &plotted)
            .with_context(|| format!("drawing --plot {}", path.display()))?;
        status!("drew {}", path.display());
    }
    if !verified {
        bail!("the application read a word it did not write (see `mismatch`)");
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_parse() {
        assert_eq!(parse_percent("30%").unwrap(), 30.0);
        assert_eq!(parse_percent("100").unwrap(), 100.0);
        assert!(parse_percent("0%").is_err());
        assert!(parse_percent("120%").is_err());
        assert_eq!(parse_prefetch("off").unwrap(), Prefetch::Off);
        assert_eq!(
            parse_prefetch("seq:8").unwrap(),
            Prefetch::Sequential { max_chunks: 8 }
        );
        assert_eq!(parse_prefetch("seq").unwrap().name(), "seq:32");
        assert!(parse_prefetch("seq:0")
            .unwrap_err()
            .contains("from 1 to 4096"));
        assert!(parse_prefetch("bogus")
            .unwrap_err()
            .contains("is not off, seq or seq:MAX"));
    }
}
