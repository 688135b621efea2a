//! `farmap bench run --budget-pair`: two servers under `farmap run`, one busy (the
//! workload) and one idle after its load, with the same total of local memory: shared
//! through a budget (`farmap budget`, its programs joined with `farmap run --budget`),
//! against a static half each (issue 33: the busy one's throughput ≥ 1.3 × what the static
//! split gives it).
//!
//! Per split, on fresh servers: both load the same records; the static split then sets each
//! bound to half the total through the agents (waiting until resident memory is down), the
//! budget divides by itself (every 2 s). The busy server runs the workload once to warm up
//! (half the operations), and, with a budget, the idle one is given until its share stops
//! shrinking (at most 30 s); then the workload is measured on the busy one. Both splits get
//! the same warm-up.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use farmap_migrate::agent::{LocalMax, PagingReport, Request, SetLocalMaxRequest};

use super::kinds::{Row, System, Workload};
use super::server::{Launch, Program, Server};
use super::session::{Ctx, Reference};

/// How the total is divided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Split {
    /// Half each, set once.
    Static,
    /// A budget that divides by need.
    Shared,
}

impl Split {
    fn name(self) -> &'static str {
        match self {
            Split::Static => "static",
            Split::Shared => "shared",
        }
    }
}

/// How often the budget divides.
const INTERVAL: &str = "2s";
/// Longest wait for the idle server's share to stop shrinking.
const SETTLE_MAX: Duration = Duration::from_secs(30);

/// Runs both splits for `program` with `workload`, a total of twice `local` percent of the
/// working set; emits one row per split (`budget`: `static`, `shared`) and returns the
/// busy server's throughput shared ÷ static.
pub(super) fn budget_pair(
    ctx: &Ctx<'_>,
    program: Program,
    reference: &Reference,
    local: f64,
    workload: Workload,
    emit: &mut impl FnMut(Row) -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    if !matches!(workload, Workload::YcsbA | Workload::YcsbB) {
        bail!("--budget-pair runs a YCSB workload (ycsb-a or ycsb-b)");
    }
    let ws = reference.working_set;
    let half = ((ws as f64 * local / 100.0) as u64 / 4096).max(1) * 4096;
    let total = 2 * half;
    let mut ops = [0.0; 2];
    for (k, split) in [Split::Static, Split::Shared].into_iter().enumerate() {
        let mut row = one_split(ctx, program, ws, total, split, workload)?;
        row.local_percent = local;
        ops[k] = row.ops_per_s;
        emit(row)?;
    }
    let ratio = if ops[0] > 0.0 { ops[1] / ops[0] } else { 0.0 };
    status!(
        "budget pair: the busy {} ran {:.0} ops/s sharing {:.1} MB with an idle one, {:.0} \
         ops/s with a static half: {ratio:.2}x",
        program.name(),
        ops[1],
        total as f64 / 1e6,
        ops[0]
    );
    Ok(ratio)
}

/// One split: the busy server's row.
fn one_split(
    ctx: &Ctx<'_>,
    program: Program,
    ws: u64,
    total: u64,
    split: Split,
    workload: Workload,
) -> anyhow::Result<Row> {
    let dir = tempfile::Builder::new()
        .prefix("farmap-bench-pair-")
        .tempdir()
        .context("making a directory for the pair")?;
    let budget_sock = dir.path().join("budget.sock");
    let _budget = match split {
        Split::Shared => Some(Budget::start(&budget_sock, total, dir.path())?),
        Split::Static => None,
    };
    // Address space only: three times the working set, at least 1 GiB.
    let heap = (ws * 3).div_ceil(1 << 30).max(1) << 30;
    let start = |name: &str| -> anyhow::Result<(Server, PathBuf, tempfile::TempDir)> {
        let sub = tempfile::Builder::new()
            .prefix(&format!("{name}-"))
            .tempdir_in(dir.path())?;
        let agent = sub.path().join("agent.sock");
        let mut opts = vec![
            "--agent".to_owned(),
            agent.to_string_lossy().into_owned(),
            "--heap-max".into(),
            heap.to_string(),
        ];
        match split {
            Split::Static => opts.extend(["--local-max".into(), "100%".into()]),
            Split::Shared => opts.extend([
                "--budget".into(),
                budget_sock.to_string_lossy().into_owned(),
            ]),
        }
        if let Some(p) = ctx.preload {
            opts.extend(["--preload".into(), p.to_string_lossy().into_owned()]);
        }
        let server = Server::start(
            program,
            Launch::Farmap(opts),
            sub.path(),
            ctx.pin.map(|p| p.1),
        )?;
        Ok((server, agent, sub))
    };
    let (busy, busy_agent, busy_dir) = start("busy")?;
    let (idle, idle_agent, _idle_dir) = start("idle")?;
    for (name, server) in [("busy", &busy), ("idle", &idle)] {
        let load = ctx.ycsb(busy_dir.path(), program, server.port, None)?;
        let bad = load.not_ok();
        if !bad.is_empty() {
            bail!(
                "YCSB's load of the {name} {} failed: {}",
                program.name(),
                bad.join(", ")
            );
        }
    }
    if split == Split::Static {
        for agent in [&busy_agent, &idle_agent] {
            set_bound(ctx, agent, total / 2)?;
        }
    }
    let warm = ctx.workload_ops(
        workload,
        program,
        &busy,
        busy_dir.path(),
        ctx.operations / 2,
    )?;
    if !warm.verified {
        bail!("the warm-up run failed: {}", warm.errors.join(", "));
    }
    if split == Split::Shared {
        settle(ctx, &idle_agent)?;
    }
    let before = paging(ctx, &busy_agent)?;
    let mut row = ctx.workload(workload, program, &busy, busy_dir.path())?;
    let after = paging(ctx, &busy_agent)?;
    row.system = System::Farmap.name();
    row.budget = Some(split.name());
    row.local_bytes = after.limit_bytes;
    row.working_set_bytes = ws;
    row.limit_bytes = Some(total);
    row.faults = after.faults.saturating_sub(before.faults);
    row.evictions = (after.evictions_reactive + after.evictions_proactive)
        .saturating_sub(before.evictions_reactive + before.evictions_proactive);
    row.staged_refaults = Some(after.staged_refaults.saturating_sub(before.staged_refaults));
    row.prefetched = Some(after.prefetched.saturating_sub(before.prefetched));
    row.cpu_pinning = ctx.cpu_pinning();
    let idle_state = paging(ctx, &idle_agent)?;
    status!(
        "budget pair, {} split: busy bound {:.1} MB, idle bound {:.1} MB",
        split.name(),
        after.limit_bytes as f64 / 1e6,
        idle_state.limit_bytes as f64 / 1e6
    );
    busy.stop()?;
    idle.stop()?;
    Ok(row)
}

/// The paging state of the server behind `agent`.
fn paging(ctx: &Ctx<'_>, agent: &Path) -> anyhow::Result<PagingReport> {
    ctx.agent(agent, Request::PagingState, Duration::ZERO)
}

/// Sets a bound through `agent` and waits until resident memory is under it.
fn set_bound(ctx: &Ctx<'_>, agent: &Path, bytes: u64) -> anyhow::Result<()> {
    let wait = Duration::from_secs(60);
    let r = ctx.agent(
        agent,
        Request::SetLocalMax(SetLocalMaxRequest {
            local_max: LocalMax::Bytes(bytes),
            wait_ms: wait.as_millis() as u64,
            budget: None,
        }),
        wait,
    )?;
    if !r.within_limit {
        status!("farmap bench run: resident memory still above the bound after {wait:?}");
    }
    Ok(())
}

/// Waits until the idle server's share stops shrinking (the same for three looks a
/// second apart), at most [`SETTLE_MAX`].
fn settle(ctx: &Ctx<'_>, idle_agent: &Path) -> anyhow::Result<()> {
    let start = Instant::now();
    let (mut last, mut same) = (u64::MAX, 0);
    while start.elapsed() < SETTLE_MAX {
        let share = paging(ctx, idle_agent)?.limit_bytes;
        same = if share == last { same + 1 } else { 0 };
        if same >= 3 {
            break;
        }
        last = share;
        std::thread::sleep(Duration::from_secs(1));
    }
    Ok(())
}

/// A `farmap budget` process; stopped (SIGTERM, then killed) on drop.
struct Budget(Child);

impl Budget {
    fn start(sock: &Path, total: u64, dir: &Path) -> anyhow::Result<Budget> {
        let exe = std::env::current_exe().context("finding the farmap binary")?;
        let child = Command::new(exe)
            .arg("budget")
            .arg(sock)
            .args(["--total", &total.to_string(), "--interval", INTERVAL])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("budget.log"))?)
            .spawn()
            .context("starting farmap budget")?;
        let mut budget = Budget(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !sock.exists() {
            if let Some(status) = budget.0.try_wait()? {
                let log = std::fs::read_to_string(dir.join("budget.log")).unwrap_or_default();
                bail!("farmap budget ended ({status}): {}", log.trim());
            }
            if Instant::now() > deadline {
                bail!(
                    "farmap budget did not listen on {} within 10 s",
                    sock.display()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(budget)
    }
}

impl Drop for Budget {
    fn drop(&mut self) {
        farmap_testkit::process::terminate(&mut self.0, Duration::from_secs(5));
    }
}
