//! `farmap bench run`: real servers (redis-server, memcached) driven by real load generators
//! (YCSB workloads A and B, redis-benchmark), with their memory bounded by `farmap run`
//! against the same server swapping under the kernel, and unlimited, in the same run
//! (issue 33).
//!
//! Per program, the systems run one after the other, each on a fresh server:
//! 1. `unlimited`: the server as it is. YCSB loads `--records` records (10 fields of 100
//!    bytes, `dataintegrity` values); the server's resident memory grown by the load is the
//!    **working set**. Then each workload runs once. For redis, `DEBUG DIGEST` of the loaded
//!    keyspace is kept: every other system must end with the same digest.
//! 2. `kernel-swap` (root, cgroup v1): the server in a memory cgroup (set up as `bench
//!    paging` does: swap on a loop device over a file in RAM), unlimited while YCSB loads;
//!    then, per `--local` share from the largest, `memory.limit_in_bytes` = the cgroup's
//!    usage at start-up + share × working set + 2 MiB, and each workload runs.
//! 3. `farmap`: the server under `farmap run --local-max 100%` (its heap served from a
//!    memory store in `farmap run`), loaded the same way; then per share the bound is set to
//!    share × working set through the agent (`farmap region limit`), waiting until resident
//!    memory is down, and each workload runs.
//!
//! `--budget-pair` measures a budget instead (`pair.rs`).
//!
//! The load generator runs on CPU 0 and the server on CPU 1 when there are two CPUs or more
//! (`--no-pin` leaves placement to the kernel). `farmap run`'s own threads are not pinned,
//! as the kernel's reclaim thread (kswapd) is not: its fault readers follow the program's
//! CPUs by themselves, its reclaim goes where the kernel puts it. Every row is
//! `verified` when each of the load generator's operations returned OK (YCSB checks every
//! value it reads) and, for redis, the keyspace's digest at the end equals the unlimited
//! run's.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::Args;

use super::paging::parse_percent;
use super::paging_swap;
use crate::output;

mod kinds;
mod pair;
mod redis_benchmark;
mod server;
mod session;
mod ycsb;

use kinds::{kill_clients, Row, System, Workload};
use server::Program;
use session::{Ctx, Reference};

#[derive(Debug, Args)]
pub struct RunArgs {
    /// The programs, comma-separated: redis, memcached.
    #[arg(
        long = "program",
        value_enum,
        value_delimiter = ',',
        default_value = "redis,memcached"
    )]
    programs: Vec<Program>,
    /// The workloads, comma-separated: ycsb-b, ycsb-a, redis-benchmark (redis only).
    #[arg(
        long = "workload",
        value_enum,
        value_delimiter = ',',
        default_value = "ycsb-b,ycsb-a,redis-benchmark"
    )]
    workloads: Vec<Workload>,
    /// The systems, comma-separated (unlimited runs in any case: it measures the working
    /// set; its rows are printed when it is listed).
    #[arg(
        long = "system",
        value_enum,
        value_delimiter = ',',
        default_value = "unlimited,kernel-swap,farmap"
    )]
    systems: Vec<System>,
    /// Local memory in percent of the working set, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "30%,50%", value_parser = parse_percent)]
    local: Vec<f64>,
    /// Records YCSB loads (10 fields of 100 bytes each).
    #[arg(long, default_value_t = 200_000, value_parser = clap::value_parser!(u64).range(100..))]
    records: u64,
    /// Operations per workload.
    #[arg(long, default_value_t = 200_000, value_parser = clap::value_parser!(u64).range(100..))]
    operations: u64,
    /// Client threads of YCSB (redis-benchmark uses 50 connections).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=256))]
    threads: u32,
    /// A small run, for a smoke test: 5,000 records and operations.
    #[arg(long)]
    quick: bool,
    /// Leave the placement of the load generator and the server to the kernel.
    #[arg(long)]
    no_pin: bool,
    /// The interposition library `farmap run` loads (default: its own default).
    #[arg(long, value_name = "PATH")]
    preload: Option<PathBuf>,
    /// YCSB's classpath (default: $FARMAP_YCSB_CLASSPATH, else what
    /// scripts/ycsb/build.sh of this checkout prints; it fetches YCSB once).
    #[arg(long, value_name = "CP")]
    ycsb_classpath: Option<String>,
    /// Instead of the systems: two servers under `farmap run`, one busy (the first YCSB
    /// workload) and one idle after its load, with twice the smallest --local share of
    /// local memory between them: shared by a budget (`farmap budget`) against a static
    /// half each. One row per split (`budget`: static, shared) and the ratio on stderr.
    #[arg(long)]
    budget_pair: bool,
    /// One JSON object per program, workload, system and local share on stdout.
    #[arg(long)]
    json: bool,
}

pub async fn run(mut args: RunArgs) -> anyhow::Result<ExitCode> {
    if args.quick {
        args.records = 5_000;
        args.operations = 5_000;
    }
    if args.json {
        output::set_json_status();
    }
    if server::which("java").is_none() {
        bail!("YCSB needs java (Debian: apt-get install openjdk-17-jre-headless)");
    }
    let explicit = args.ycsb_classpath.clone();
    let classpath = tokio::task::spawn_blocking(move || ycsb::classpath(explicit.as_deref()))
        .await
        .context("the classpath thread panicked")??;
    // Ctrl-C and SIGTERM kill the load generator; the servers and the kernel-swap
    // environment are torn down as the session ends with an error.
    let ctrl_c = super::paging_app::on_interrupt(kill_clients)?;
    let handle = tokio::runtime::Handle::current();
    let result = tokio::task::spawn_blocking(move || run_all(&args, &handle, &classpath)).await;
    ctrl_c.abort();
    let verified = result.context("the benchmark thread panicked")??;
    if !verified {
        bail!("a program did not keep its data under some system (see `errors`)");
    }
    Ok(ExitCode::SUCCESS)
}

/// Every program under every system; whether every row was verified.
fn run_all(
    args: &RunArgs,
    handle: &tokio::runtime::Handle,
    classpath: &str,
) -> anyhow::Result<bool> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut locals = args.local.clone();
    locals.sort_by(|a, b| b.total_cmp(a));
    locals.dedup();
    let ctx = Ctx {
        handle,
        classpath,
        pin: (!args.no_pin && cpus >= 2).then_some((0, 1)),
        records: args.records,
        operations: args.operations,
        threads: args.threads,
        workloads: &args.workloads,
        locals: &locals,
        preload: args.preload.as_deref(),
    };
    let mut verified = true;
    let mut emit = |row: Row| -> anyhow::Result<()> {
        verified &= row.verified;
        row.print(args.json)
    };
    for &program in &args.programs {
        if !program.installed() {
            status!(
                "skipped {}: it is not installed (Debian: apt-get install {})",
                program.name(),
                match program {
                    Program::Redis => "redis-server redis-tools",
                    Program::Memcached => "memcached",
                }
            );
            continue;
        }
        if args.budget_pair {
            let reference = ctx.session(program, System::Unlimited, None, None, |_| Ok(()))?;
            let workload = args
                .workloads
                .iter()
                .copied()
                .find(|w| matches!(w, Workload::YcsbA | Workload::YcsbB))
                .unwrap_or(Workload::YcsbB);
            let local = locals.last().copied().unwrap_or(30.0);
            pair::budget_pair(&ctx, program, &reference, local, workload, &mut emit)?;
            continue;
        }
        let show = args.systems.contains(&System::Unlimited);
        let reference: Reference = ctx.session(program, System::Unlimited, None, None, |row| {
            if show {
                emit(row)
            } else {
                Ok(())
            }
        })?;
        if !args.json {
            status!(
                "{}: working set {:.1} MB (resident memory grown by the load)",
                program.name(),
                reference.working_set as f64 / 1e6
            );
        }
        if args.systems.contains(&System::KernelSwap) {
            match paging_swap::SwapEnv::setup(reference.working_set * 2) {
                Ok(env) => kernel_swap(&ctx, program, &env, &reference, &mut emit)?,
                Err(e) => status!("skipped kernel-swap: {}", output::error_chain(&e)),
            }
        }
        if args.systems.contains(&System::Farmap) {
            ctx.session(program, System::Farmap, None, Some(&reference), &mut emit)?;
        }
    }
    Ok(verified)
}

/// The kernel-swap session; one the OOM killer ended (the cgroup's limit is tight at small
/// working sets: swap-cache pages count against it) is run again, up to
/// [`paging_swap::OOM_RETRIES`] times.
fn kernel_swap(
    ctx: &Ctx<'_>,
    program: Program,
    env: &paging_swap::SwapEnv,
    reference: &Reference,
    emit: &mut impl FnMut(Row) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let mut kills = 0;
    loop {
        let before = env.oom_kills();
        match ctx.session(
            program,
            System::KernelSwap,
            Some(env),
            Some(reference),
            &mut *emit,
        ) {
            Ok(_) => return Ok(()),
            Err(e) if env.oom_kills() > before && kills < paging_swap::OOM_RETRIES => {
                kills += 1;
                status!(
                    "farmap bench run: the OOM killer ended {} under kernel-swap (attempt \
                     {kills}); running the session again: {}",
                    program.name(),
                    output::error_chain(&e)
                );
            }
            Err(e) => return Err(e),
        }
    }
}
