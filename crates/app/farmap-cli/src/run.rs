//! `farmap run -- PROGRAM ARGS...`: an unmodified program's heap served by farmap, with its
//! local memory bounded (docs/design/farmap-run.md).
//!
//! The program starts with `LD_PRELOAD` naming farmap's interposition library
//! (`libfarmap_preload.so`), which serves its `malloc` family and C++ `new`/`delete` from one
//! region. The library connects back to this process over a private Unix socket, proves who
//! it is (a token in its environment, its credentials, its descent from the program we
//! started), maps and registers the region as told, and hands over its userfaultfds; this
//! process then serves the region's faults, writes back and drops what goes over the bound,
//! and asks a thread of the library (the reaper) to move and discard pages in the program.
//! An exec starts a new session (the library loads again in the new image).

use std::ffi::OsString;
use std::io::Read;
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use farmap::{open_store_async, StoreSpec};
use farmap_cli_kit::args::{parse_local_max, parse_size_arg};
use farmap_cli_kit::metrics::{Metrics, MetricsArgs};
use farmap_migrate::agent::BudgetNote;
use farmap_run_proto::TOKEN_LEN;
use farmap_uffd::foreign::{
    handshake, trash_len, Contact, Expected, ForeignOptions, ForeignRegion, ForkCall, ForkStats,
    FOREIGN_FEATURES,
};
use farmap_uffd::{LocalLimit, PagingOptions, Prefetch, RegionStats};
use parking_lot::Mutex;
use tokio::runtime::Handle;

/// The chunk of a program's heap: one page (a discarded page reads as zeros, page by page).
const HEAP_CHUNK: u64 = 4096;

/// How long a program may take over its handshake, in all.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

const RUN_HELP: &str = "\
HOW IT WORKS:
  PROGRAM starts with LD_PRELOAD naming libfarmap_preload.so, which serves its malloc family
  and C++ new/delete from one region of --heap-max bytes (address space: only what is used
  costs memory). farmap run serves that region's faults from --store and keeps at most
  --local-max of it in memory: the rest is written back and dropped, and fetched again on
  the next touch. A page the program frees back (madvise) reads as zeros.

  The program's exit status is farmap run's (128 + N for a signal N); SIGINT, SIGTERM and
  SIGHUP are passed on to it. An exec starts a new session (the library loads again).

LIMITS:
  Statically linked programs, setuid programs (the loader ignores LD_PRELOAD) and memory a
  program maps itself (mmap) are not served. A child made by fork must exec before it
  touches the heap (the heap is not inherited). Programs must stay in the foreground.";

#[derive(Debug, Args)]
#[command(after_help = RUN_HELP)]
pub struct RunArgs {
    /// Where the heap's pages go when they leave memory (default: this process's memory).
    /// Opened anew for each program image; chunks must be 4KiB (the default here), and the
    /// size is --heap-max.
    #[arg(long, value_name = "SPEC")]
    store: Option<String>,
    /// The bound on the heap's local memory: SIZE (e.g. 256MiB) or N% of --heap-max (with
    /// --budget, the budget sets it).
    #[arg(long, value_name = "SIZE|N%", default_value = "25%", value_parser = parse_local_max)]
    local_max: LocalLimit,
    /// The heap's size: the most the program can allocate through farmap.
    #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = parse_size_arg)]
    heap_max: u64,
    /// Sequential prefetch: the largest window, in pages (0 turns it off).
    #[arg(long, value_name = "PAGES", default_value_t = farmap_uffd::DEFAULT_PREFETCH_CHUNKS)]
    prefetch: u32,
    /// The interposition library (default: $FARMAP_PRELOAD, else libfarmap_preload.so next
    /// to the farmap binary).
    #[arg(long, value_name = "PATH")]
    preload: Option<PathBuf>,
    /// When a program ends, print its heap's counters on stderr (one JSON line per
    /// program image).
    #[arg(long)]
    stats: bool,
    /// Answer `farmap region limit --app SOCKET` and `farmap region stats --app SOCKET` on
    /// this Unix socket (mode 0600) while the program runs (its newest program image).
    #[arg(long, value_name = "SOCKET")]
    agent: Option<PathBuf>,
    /// Share local memory with the other programs of a budget (`farmap budget NAME --total
    /// SIZE`, running): the budget sets the bound, in place of --local-max, and changes it
    /// as the programs' needs change. Needs an agent: --agent, or one in a private
    /// directory.
    #[arg(long, value_name = "NAME")]
    budget: Option<String>,
    /// Serve the heap from the region only once the program's heap holds SIZE (0: from the
    /// start). A program that stays below it (a shell, a short tool) runs on plain memory,
    /// unbounded, and starts without a session; what it allocated before the region opens
    /// stays in plain memory (slack outside the bound).
    #[arg(long, value_name = "SIZE", default_value = "1MiB", value_parser = parse_size_arg)]
    region_at: u64,
    /// What a forked child gets of the heap. `copy`: all of it, as memory of its own (the
    /// parent pauses its paging during the fork; what is staged or in the store is copied
    /// into the child, which is not bounded). `none`: nothing; fork + exec, vfork and
    /// posix_spawn work, and a child that touches the heap gets SIGSEGV (no copy for
    /// programs that fork a big heap only to exec). `copy` needs CAP_SYS_PTRACE in the
    /// program (root); without it a program gets `none`.
    #[arg(long, value_enum, value_name = "copy|none", default_value = "copy")]
    forks: Forks,
    #[command(flatten)]
    metrics: MetricsArgs,
    /// The program and its arguments.
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "PROGRAM"
    )]
    command: Vec<OsString>,
}

/// What a forked child gets of the heap (`--forks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Forks {
    /// A whole copy.
    Copy,
    /// Nothing (touching the heap faults).
    None,
}

/// What the program's sessions share.
struct Served {
    heap_max: u64,
    spec: StoreSpec,
    opts: ForeignOptions,
    rt: Handle,
    /// The regions served now (one per program image that connected).
    sessions: Mutex<Vec<Arc<ForeignRegion>>>,
    /// Connections being handled (a handshake, a session, its last report).
    active: std::sync::atomic::AtomicUsize,
    /// Announced forks being served now.
    fork_calls: std::sync::atomic::AtomicUsize,
    stats: bool,
    metrics: Metrics,
    /// The counters of the program images that ended ([`HEAP_COUNTERS`], in order): the
    /// metrics add them to the live sessions' (both read under the `sessions` lock).
    ended: Mutex<[u64; HEAP_COUNTERS.len()]>,
    /// The budget the bound is a share of (`--budget`), as it last said: a new program
    /// image starts at that share.
    budget: Arc<Mutex<Option<BudgetNote>>>,
}

/// A counter of the heap's regions: its name (`_total` is added), help, and how to read it.
type HeapCounter = (&'static str, &'static str, fn(&RegionStats) -> u64);

/// The heap's counters in the metrics, summed over every program image.
const HEAP_COUNTERS: [HeapCounter; 6] = [
    (
        "farmap_region_faults",
        "Page faults the heap's handler resolved.",
        |s| s.faults,
    ),
    (
        "farmap_region_evictions",
        "Pages dropped from local memory (written back first).",
        |s| {
            s.paging
                .as_ref()
                .map_or(0, |p| p.evictions_reactive + p.evictions_proactive)
        },
    ),
    (
        "farmap_region_staged_refaults",
        "Faults served from a page still held locally (no store read).",
        |s| s.paging.as_ref().map_or(0, |p| p.staged_refaults),
    ),
    (
        "farmap_region_prefetched",
        "Pages fetched ahead of their faults.",
        |s| s.paging.as_ref().map_or(0, |p| p.prefetched),
    ),
    (
        "farmap_region_prefetch_hits",
        "Prefetched pages touched before they were dropped.",
        |s| s.paging.as_ref().map_or(0, |p| p.prefetch_hits),
    ),
    (
        "farmap_region_pushed_bytes",
        "Bytes written back to the heap's store.",
        |s| s.pushed_bytes,
    ),
];

impl Served {
    /// A heap counter over every program image, ended or running.
    fn total(&self, i: usize) -> u64 {
        let sessions = self.sessions.lock();
        let live: u64 = sessions
            .iter()
            .map(|r| HEAP_COUNTERS[i].2(&r.stats()))
            .sum();
        live + self.ended.lock()[i]
    }

    /// A program image ended: its counters join the ended ones as it leaves the sessions.
    fn end_session(&self, region: &Arc<ForeignRegion>) {
        let mut sessions = self.sessions.lock();
        let stats = region.stats();
        let mut ended = self.ended.lock();
        for (total, (_, _, read)) in ended.iter_mut().zip(HEAP_COUNTERS) {
            *total += read(&stats);
        }
        sessions.retain(|r| !Arc::ptr_eq(r, region));
    }

    /// Resident heap memory and the bound, over the running program images.
    fn paging_sum(&self, read: fn(&farmap_uffd::PagingStats) -> u64) -> u64 {
        let sessions = self.sessions.lock();
        sessions
            .iter()
            .filter_map(|r| r.stats().paging.map(|p| read(&p) * HEAP_CHUNK))
            .sum()
    }
}

/// The heap's metrics (`--metrics-listen`): counters over every program image, gauges of
/// the running ones, read at each scrape through a weak reference.
fn heap_metrics(metrics: &Metrics, served: &Arc<Served>) {
    for (i, (name, help, _)) in HEAP_COUNTERS.iter().enumerate() {
        let weak = Arc::downgrade(served);
        metrics.counter(name, help, Vec::new(), move || {
            weak.upgrade().map_or(0, |s| s.total(i))
        });
    }
    type Gauge = (
        &'static str,
        &'static str,
        fn(&farmap_uffd::PagingStats) -> u64,
    );
    let gauges: [Gauge; 2] = [
        (
            "farmap_region_resident_bytes",
            "Heap memory held locally now (mapped and staged), over the running program images.",
            |p| p.resident_chunks,
        ),
        (
            "farmap_region_limit_bytes",
            "The bound on the heap's local memory, over the running program images.",
            |p| p.limit_chunks,
        ),
    ];
    for (name, help, read) in gauges {
        let weak = Arc::downgrade(served);
        metrics.gauge(name, help, Vec::new(), move || {
            weak.upgrade().map_or(0, |s| s.paging_sum(read))
        });
    }
    let weak = Arc::downgrade(served);
    metrics.gauge(
        "farmap_run_programs",
        "Program images whose heap is served now.",
        Vec::new(),
        move || weak.upgrade().map_or(0, |s| s.sessions.lock().len() as u64),
    );
}

pub async fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    let preload = find_preload(args.preload.as_deref())?;
    farmap_uffd::probe_paging().context("farmap run needs bounded userfaultfd regions")?;
    if args.heap_max == 0 || !args.heap_max.is_multiple_of(HEAP_CHUNK) {
        bail!("--heap-max must be a positive multiple of 4KiB");
    }
    let spec = heap_spec(args.store.as_deref(), args.heap_max)?;
    let geometry = farmap::Geometry::new(args.heap_max, HEAP_CHUNK)?;
    let mut paging = PagingOptions::new(args.local_max);
    paging.fresh = true;
    paging.prefetch = match args.prefetch {
        0 => Prefetch::Off,
        n => Prefetch::Sequential { max_chunks: n },
    };
    let served = Arc::new(Served {
        heap_max: args.heap_max,
        spec,
        opts: ForeignOptions {
            paging,
            ..ForeignOptions::default()
        },
        rt: Handle::current(),
        sessions: Mutex::new(Vec::new()),
        active: Default::default(),
        fork_calls: Default::default(),
        stats: args.stats,
        metrics: args.metrics.metrics(),
        ended: Mutex::new([0; HEAP_COUNTERS.len()]),
        budget: Arc::new(Mutex::new(None)),
    });
    heap_metrics(&served.metrics, &served);
    let _endpoint = args.metrics.serve("run", &served.metrics).await?;
    let dir = PrivateDir::new()?;
    let _agent = agent_and_budget(&args, &dir, &served).await?;
    let sock_path = dir.path.join("run.sock");
    let listener = UnixListener::bind(&sock_path)
        .with_context(|| format!("listening on {}", sock_path.display()))?;
    let token = new_token()?;
    let mut preload_env = preload.into_os_string();
    if let Some(prev) = std::env::var_os("LD_PRELOAD").filter(|v| !v.is_empty()) {
        preload_env.push(":");
        preload_env.push(prev);
    }
    let mut child = tokio::process::Command::new(&args.command[0])
        .args(&args.command[1..])
        .env("LD_PRELOAD", preload_env)
        .env("FARMAP_RUN_SOCK", &sock_path)
        .env("FARMAP_RUN_TOKEN", hex(&token))
        .env("FARMAP_RUN_OPEN_AT", args.region_at.to_string())
        .spawn()
        .with_context(|| format!("starting {}", args.command[0].to_string_lossy()))?;
    let pid = child.id().context("the program exited at once")?;
    let expected = Expected {
        token,
        config: farmap_run_proto::Config {
            region_len: args.heap_max,
            chunk_size: HEAP_CHUNK as u32,
            trash_len: trash_len(geometry),
            features: region_features(args.forks),
        },
        ancestor: Some(pid),
    };
    let accepting = {
        let served = served.clone();
        std::thread::Builder::new()
            .name("farmap-run-accept".into())
            .spawn(move || accept_loop(listener, expected, served))?
    };
    let status = wait_forwarding_signals(&mut child, pid).await?;
    // A program image that outlives the program we started (its daemon) is served until it
    // ends too; each session's report is written before this returns.
    while served.active.load(std::sync::atomic::Ordering::Acquire) > 0 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    drop(dir);
    drop(accepting);
    Ok(exit_code(status))
}

/// The agent (`--agent`, or one in `dir` for a budget), and the budget joined (`--budget`).
async fn agent_and_budget(
    args: &RunArgs,
    dir: &PrivateDir,
    served: &Arc<Served>,
) -> anyhow::Result<Option<farmap_migrate::agent::Agent>> {
    // A budget needs an agent to reach: the one asked for, or one in the private directory.
    let path = match (&args.agent, &args.budget) {
        (Some(path), _) => path.clone(),
        (None, Some(_)) => dir.path.join("agent.sock"),
        (None, None) => return Ok(None),
    };
    let newest = {
        let served = served.clone();
        move || {
            let sessions = served.sessions.lock();
            sessions
                .last()
                .map(|r| r.clone() as Arc<dyn farmap_uffd::BoundedRegion>)
        }
    };
    let agent = farmap_migrate::agent::serve_bounded(&path, newest, served.budget.clone())
        .await
        .with_context(|| format!("--agent {}", path.display()))?;
    if let Some(name) = &args.budget {
        let note = crate::budget::member::join(name, &path, args.heap_max).await?;
        *served.budget.lock() = Some(note);
    }
    Ok(Some(agent))
}

/// The features the program's region userfaultfd is opened with.
fn region_features(forks: Forks) -> u64 {
    let thread_id = farmap_uffd::sys::UFFD_FEATURE_THREAD_ID;
    // Fork events let a forked child keep the heap; a program without the privilege they
    // need (CAP_SYS_PTRACE) goes without, and its children cannot touch the heap.
    let fork = match forks {
        Forks::Copy => farmap_uffd::sys::UFFD_FEATURE_EVENT_FORK,
        Forks::None => 0,
    };
    let supported = farmap_uffd::probe().map_or(0, |s| s.features);
    FOREIGN_FEATURES | (supported & (thread_id | fork))
}

/// The store spec of a heap of `heap_max` bytes: `spec` (its size, if any, must be
/// `heap_max`; its chunks 4KiB), or memory.
fn heap_spec(spec: Option<&str>, heap_max: u64) -> anyhow::Result<StoreSpec> {
    let mut spec: StoreSpec = match spec {
        Some(s) => s.parse().with_context(|| format!("--store {s}"))?,
        None => format!("memory:{heap_max}").parse()?,
    };
    match spec.size {
        Some(size) if size != heap_max => bail!(
            "--store's size ({}) is not --heap-max ({}): leave it out of the spec",
            farmap::format_size(size),
            farmap::format_size(heap_max)
        ),
        _ => spec.size = Some(heap_max),
    }
    match spec.chunk_size {
        Some(c) if u64::from(c) != HEAP_CHUNK => bail!(
            "--store's chunks are {}: a program's heap is served in chunks of 4KiB",
            farmap::format_size(u64::from(c))
        ),
        _ => spec.chunk_size = Some(HEAP_CHUNK as u32),
    }
    Ok(spec)
}

/// The interposition library: `explicit`, `$FARMAP_PRELOAD`, or next to this binary.
fn find_preload(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    let candidate = match explicit {
        Some(p) => p.to_owned(),
        None => match std::env::var_os("FARMAP_PRELOAD") {
            Some(p) => PathBuf::from(p),
            None => {
                // Beside the binary (an install, or `cargo build -p farmap-preload`), or in
                // the build's `deps` (a workspace build, its tests).
                let exe = std::env::current_exe().context("finding the farmap binary")?;
                let beside = exe.with_file_name("libfarmap_preload.so");
                let deps = exe.with_file_name("deps").join("libfarmap_preload.so");
                if !beside.is_file() && deps.is_file() {
                    deps
                } else {
                    beside
                }
            }
        },
    };
    if !candidate.is_file() {
        bail!(
            "the interposition library {} does not exist (build it with `cargo build -p \
             farmap-preload`, or name it with --preload or $FARMAP_PRELOAD)",
            candidate.display()
        );
    }
    // The loader needs an absolute path (the program may change its directory).
    std::fs::canonicalize(&candidate).with_context(|| format!("{}", candidate.display()))
}

/// Accepts programs' connections until the process ends: each handshake on a thread of
/// its own (a slow program does not hold up another), then its region served.
///
/// At most [`MAX_HANDSHAKES`] handshakes run at once: a connection past that is closed at
/// once (a process of the program that floods the socket gets no thread per connection).
fn accept_loop(listener: UnixListener, expected: Expected, served: Arc<Served>) {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let handshaking = Arc::new(AtomicUsize::new(0));
    let mut said = false;
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        if handshaking.load(Ordering::Acquire) >= MAX_HANDSHAKES {
            if !std::mem::replace(&mut said, true) {
                status!(
                    "farmap run: more than {MAX_HANDSHAKES} connections at once in their \
                     handshake: closing the others"
                );
            }
            continue;
        }
        let (expected, served) = (expected.clone(), served.clone());
        served.active.fetch_add(1, Ordering::AcqRel);
        handshaking.fetch_add(1, Ordering::AcqRel);
        let counted = (served.clone(), handshaking.clone());
        let pending = handshaking.clone();
        let spawned = std::thread::Builder::new()
            .name("farmap-run-session".into())
            .spawn(move || {
                let shaken = AtomicBool::new(false);
                let done_shaking = || {
                    if !shaken.swap(true, Ordering::AcqRel) {
                        pending.fetch_sub(1, Ordering::AcqRel);
                    }
                };
                if let Err(e) = serve_program(conn, &expected, &served, &done_shaking) {
                    status!("farmap run: {}", farmap_cli_kit::output::error_chain(&e));
                }
                done_shaking();
                served.active.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            counted.0.active.fetch_sub(1, Ordering::AcqRel);
            counted.1.fetch_sub(1, Ordering::AcqRel);
            status!("farmap run: cannot start a session thread: {e}");
        }
    }
}

/// Most handshakes running at once (see [`accept_loop`]).
const MAX_HANDSHAKES: usize = 16;

/// One program image: its handshake, its region, its end.
fn serve_program(
    conn: std::os::unix::net::UnixStream,
    expected: &Expected,
    served: &Served,
    handshake_done: &dyn Fn(),
) -> anyhow::Result<()> {
    let contact = handshake(conn, expected, HANDSHAKE_TIMEOUT);
    handshake_done();
    let applicant = match contact? {
        Contact::Program(applicant) => applicant,
        Contact::Fork(call) => return serve_fork(call, served),
    };
    let pid = applicant.pid();
    let _span = tracing::info_span!("run", pid).entered();
    let spec = served.spec.clone();
    let store = served
        .rt
        .block_on(async move { open_store_async(&spec).await });
    let store = match store {
        Ok(s) => served.metrics.meter("heap", &served.spec, s),
        Err(e) => {
            let why = format!("opening the heap's store: {e}");
            return Err(applicant.refuse(&why).into());
        }
    };
    if served.spec.kind != farmap::SpecKind::Memory && !served.sessions.lock().is_empty() {
        return Err(applicant
            .refuse("a --store serves one program image at a time")
            .into());
    }
    let mut opts = served.opts.clone();
    if let Some(note) = served.budget.lock().as_ref() {
        opts.paging.local_max = LocalLimit::Bytes(note.share_bytes.max(HEAP_CHUNK));
    }
    let region = applicant
        .accept(store, opts, served.rt.clone())
        .with_context(|| format!("serving process {pid}'s heap"))?;
    let region = Arc::new(region);
    served.sessions.lock().push(region.clone());
    let end = loop {
        if let Some(end) = region.wait_end(Duration::from_secs(3600)) {
            break end;
        }
    };
    if served.stats {
        status!(
            "{}",
            stats_line(
                pid,
                served.heap_max,
                &end,
                &region.stats(),
                &region.fork_stats()
            )
        );
    }
    served.end_session(&region);
    Ok(())
}

/// Most forks served at once (each holds a thread until its child is whole, or 10 s when
/// no fork follows): a program that announces more forks its children unannounced.
const MAX_FORK_CALLS: usize = 16;

/// A program image about to fork: its pager paused until the child's heap is whole.
fn serve_fork(call: ForkCall, served: &Served) -> anyhow::Result<()> {
    use std::sync::atomic::Ordering;
    if served.fork_calls.fetch_add(1, Ordering::AcqRel) >= MAX_FORK_CALLS {
        served.fork_calls.fetch_sub(1, Ordering::AcqRel);
        return Err(call
            .refuse(&format!(
                "more than {MAX_FORK_CALLS} forks announced at once"
            ))
            .into());
    }
    let r = serve_fork_counted(call, served);
    served.fork_calls.fetch_sub(1, Ordering::AcqRel);
    r
}

fn serve_fork_counted(call: ForkCall, served: &Served) -> anyhow::Result<()> {
    let (pid, base) = (call.pid(), call.region());
    // The program runs as soon as it has its verdict, which may be a moment before its
    // session is listed here.
    let find = || {
        served
            .sessions
            .lock()
            .iter()
            .find(|r| r.pid() == pid && r.base() as u64 == base)
            .cloned()
    };
    let mut region = find();
    let start = std::time::Instant::now();
    while region.is_none() && start.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(1));
        region = find();
    }
    let Some(region) = region else {
        return Err(call
            .refuse(&format!(
                "process {pid} announced a fork but has no heap served"
            ))
            .into());
    };
    let copied = call
        .serve(&region)
        .with_context(|| format!("the fork of process {pid}"))?;
    if let Some(c) = copied {
        tracing::debug!(
            pid,
            from_slots = c.from_slots,
            from_store = c.from_store,
            "a forked child's heap is whole"
        );
    }
    Ok(())
}

/// One JSON line of a program image's heap counters.
fn stats_line(
    pid: u32,
    heap_max: u64,
    end: &farmap_uffd::foreign::End,
    s: &RegionStats,
    forks: &ForkStats,
) -> String {
    let p = s.paging.clone().unwrap_or_default();
    serde_json::json!({
        "pid": pid,
        "end": format!("{end:?}"),
        "heap_max_bytes": heap_max,
        "limit_bytes": p.limit_chunks * HEAP_CHUNK,
        "faults": s.faults,
        "zero_fills": p.zero_fills,
        "evictions": p.evictions_reactive + p.evictions_proactive,
        "staged_refaults": p.staged_refaults,
        "partial_moves": p.partial_moves,
        "overcommits": p.overcommits,
        "prefetched": p.prefetched,
        "prefetch_hits": p.prefetch_hits,
        "pushed_bytes": s.pushed_bytes,
        "remove_events": s.remove_events,
        "forks": forks.forks,
        "forks_unpaused": forks.unpaused,
        "forks_failed": forks.failed,
        "fork_copied_bytes": forks.copied_bytes,
        "fork_unshared_bytes": forks.unshared_bytes,
    })
    .to_string()
}

/// Waits for the program, passing SIGINT, SIGTERM and SIGHUP on to it.
async fn wait_forwarding_signals(
    child: &mut tokio::process::Child,
    pid: u32,
) -> anyhow::Result<std::process::ExitStatus> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut int = signal(SignalKind::interrupt())?;
    let mut term = signal(SignalKind::terminate())?;
    let mut hup = signal(SignalKind::hangup())?;
    let forward = |sig: rustix::process::Signal| {
        if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
            let _ = rustix::process::kill_process(p, sig);
        }
    };
    loop {
        tokio::select! {
            status = child.wait() => return Ok(status?),
            _ = int.recv() => forward(rustix::process::Signal::INT),
            _ = term.recv() => forward(rustix::process::Signal::TERM),
            _ = hup.recv() => forward(rustix::process::Signal::HUP),
        }
    }
}

/// The program's status as ours: its code, or 128 + the signal that ended it.
fn exit_code(status: std::process::ExitStatus) -> ExitCode {
    use std::os::unix::process::ExitStatusExt;
    let code = status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(1);
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

/// A new random token.
fn new_token() -> anyhow::Result<[u8; TOKEN_LEN]> {
    let mut token = [0u8; TOKEN_LEN];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut token))
        .context("reading /dev/urandom")?;
    Ok(token)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A directory only this user can enter (the control socket's), removed on drop.
struct PrivateDir {
    path: PathBuf,
}

impl PrivateDir {
    fn new() -> anyhow::Result<PrivateDir> {
        let base = std::env::var_os("XDG_RUNTIME_DIR")
            .map(PathBuf::from)
            .filter(|p| p.is_dir())
            .unwrap_or_else(std::env::temp_dir);
        let token = new_token()?;
        let path = base.join(format!(
            "farmap-run-{}-{}",
            std::process::id(),
            hex(&token[..6])
        ));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .with_context(|| format!("creating {}", path.display()))?;
        Ok(PrivateDir { path })
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_heap_store_takes_the_heaps_size_and_page_chunks() {
        let s = heap_spec(None, 1 << 30).unwrap();
        assert_eq!((s.size, s.chunk_size), (Some(1 << 30), Some(4096)));
        let s = heap_spec(Some("dir:/tmp/x"), 1 << 20).unwrap();
        assert_eq!((s.size, s.chunk_size), (Some(1 << 20), Some(4096)));
        let e = heap_spec(Some("memory:2MiB"), 1 << 20).unwrap_err();
        assert!(e.to_string().contains("--heap-max"), "{e}");
        let e = heap_spec(Some("dir:/tmp/x?chunk=64KiB"), 1 << 20).unwrap_err();
        assert!(e.to_string().contains("4KiB"), "{e}");
    }

    #[test]
    fn exit_codes_follow_the_program() {
        use std::os::unix::process::ExitStatusExt;
        let code = |raw| exit_code(std::process::ExitStatus::from_raw(raw));
        assert_eq!(code(3 << 8), ExitCode::from(3));
        assert_eq!(code(9), ExitCode::from(137));
    }
}
