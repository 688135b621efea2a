//! `farmap bench vm`: a QEMU guest (TCG) moved live between two QEMU processes on this host,
//! by farmap and by QEMU itself, in the same run (issue 32, docs/design/vm.md §11).
//!
//! The guest runs `vmcheck` (`scripts/vm/vmcheck.c`): it rewrites `--working-set` at
//! `--rate` and checks every byte it reads back; it sends a heartbeat byte every 16 pages,
//! which this bench stamps on arrival. Systems (one boot each, one JSON line each):
//! - `shared-floor`: the guest's RAM on one tmpfs file both QEMUs map (`x-ignore-shared`):
//!   QEMU moves device state only, nothing else moves. The cost of the mechanism itself.
//! - `farmap-instant`, `farmap-precopy`: the RAM on a farmap mount (managed, over a memory
//!   store that `farmap serve` holds on loopback), moved by `farmap vm migrate`.
//! - `qemu-precopy` (`case` `default`, and `downtime-limit-30ms`), `qemu-postcopy` (one
//!   pre-copy pass, then post-copy): anonymous RAM, QEMU's own migration.
//! - `farmap-lazy-start` (`case` `lazy-start`): the guest's RAM on a farmap mount of a
//!   `versioned:` region on /dev/shm, saved with `farmap vm save` (device state only) and
//!   started by a new QEMU over a new mount of the saved version (`farmap vm restore`): its
//!   pages come on touch, the recorded working set read ahead. `qemu-restore`: the same guest
//!   on anonymous RAM, saved whole and restored by QEMU (`migrate exec:`), its file on
//!   /dev/shm too.
//!
//! Keys: `bench` (`vm`), `system`, `case`, `guest_mib`, `working_set_mib`, `downtime_ms`
//! (QEMU's figure at the source), `guest_max_gap_ms` (the largest gap between heartbeats from
//! the migration's start to 2 s after the destination runs, timed on the host: the pause the
//! guest felt), `guest_clock_max_gap_ms` (the guest's own figure: under TCG its clocks stop
//! with the VM, so it does not see the stop), `total_ms`, `bytes_moved` (QEMU's stream plus
//! what farmap moved), `bytes_before_resume`, `handover_ms`, `converged`,
//! `time_to_first_instruction_ms` (lazy starts: from `migrate-incoming` until QEMU reports
//! the guest running, its vCPUs started; a full restore has every page in by then),
//! `first_beat_ms` (from the same start to the guest's first heartbeat: 16 pages of its
//! working set checked and rewritten) and `time_to_warm_ms` (to the first 100 ms whose
//! heartbeats reach 90 % of the rate before the save), `save_ms`, `prepare_ms` (the mount and QEMU started, before the
//! clock of the two above starts),
//! `qemu_version`, `steal_ms` (the host's steal time during the row), `verified` (the guest
//! checked its whole working set at the destination with no mismatch, and the heartbeats
//! continued without a hole), `run`, `error` (why a row has no figures).
//!
//! The command fails when a farmap or floor row is not verified; QEMU's rows report it.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use farmap_testkit::vm::VmcheckImage;
use farmap_vm::qemu::{DEFAULT_APPEND, DEFAULT_QEMU};
use farmap_vm::{
    analyse, qemu_version, Beat, Console, HeartbeatListener, Heartbeats, Incoming, QemuConfig, Qmp,
    Ram, VmcheckLine,
};
use serde::Serialize;
use serde_json::Value;

use super::common::parse_size_arg;

const SYSTEMS: &[&str] = &[
    "shared-floor",
    "farmap-instant",
    "farmap-precopy",
    "qemu-precopy",
    "qemu-precopy-limit",
    "qemu-postcopy",
    "farmap-lazy-start",
    "qemu-restore",
];

#[derive(Debug, Args)]
pub struct VmArgs {
    /// Guest sizes (binary suffixes), comma-separated.
    #[arg(long, default_value = "512MiB,1GiB,2GiB", value_delimiter = ',', value_parser = parse_size_arg)]
    sizes: Vec<u64>,
    /// The working set the guest rewrites.
    #[arg(long, default_value = "64MiB", value_parser = parse_size_arg)]
    working_set: u64,
    /// How fast the guest rewrites it, MiB/s (0: as fast as it can).
    #[arg(long, default_value_t = 64)]
    rate_mibs: u64,
    /// Runs of every system and size.
    #[arg(long, default_value_t = 3)]
    runs: u32,
    /// The systems, comma-separated (default: all): shared-floor, farmap-instant,
    /// farmap-precopy, qemu-precopy, qemu-precopy-limit, qemu-postcopy, farmap-lazy-start,
    /// qemu-restore.
    #[arg(long, value_delimiter = ',')]
    systems: Vec<String>,
    /// A smoke run: one run of a 128 MiB guest with a 16 MiB working set at 32 MiB/s.
    #[arg(long)]
    quick: bool,
    /// How long QEMU's own pre-copy may take before it counts as not converged.
    #[arg(long, default_value = "60s", value_parser = farmap_cli_kit::args::parse_duration)]
    qemu_timeout: Duration,
    /// One JSON object per line.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize, Default)]
struct Row {
    bench: &'static str,
    system: String,
    case: String,
    guest_mib: u64,
    working_set_mib: u64,
    downtime_ms: Option<f64>,
    guest_max_gap_ms: Option<f64>,
    guest_clock_max_gap_ms: Option<f64>,
    total_ms: Option<f64>,
    bytes_moved: Option<u64>,
    bytes_before_resume: Option<u64>,
    handover_ms: Option<f64>,
    converged: bool,
    time_to_first_instruction_ms: Option<f64>,
    time_to_warm_ms: Option<f64>,
    first_beat_ms: Option<f64>,
    save_ms: Option<f64>,
    prepare_ms: Option<f64>,
    qemu_version: String,
    steal_ms: Option<u64>,
    verified: bool,
    run: u32,
    error: Option<String>,
}

/// What every row of a run shares.
struct Ctx {
    image: VmcheckImage,
    exe: PathBuf,
    version: String,
    ws_mib: u64,
    rate_mibs: u64,
    qemu_timeout: Duration,
    tmp: tempfile::TempDir,
}

pub async fn run(mut args: VmArgs) -> anyhow::Result<ExitCode> {
    if args.quick {
        args.sizes = vec![128 << 20];
        args.working_set = 16 << 20;
        args.rate_mibs = 32;
        args.runs = 1;
    }
    let systems: Vec<String> = if args.systems.is_empty() {
        SYSTEMS.iter().map(|s| s.to_string()).collect()
    } else {
        args.systems.clone()
    };
    for s in &systems {
        if !SYSTEMS.contains(&s.as_str()) {
            bail!("unknown system {s:?}: one of {}", SYSTEMS.join(", "));
        }
    }
    let version = qemu_version(DEFAULT_QEMU)
        .with_context(|| format!("{DEFAULT_QEMU} is needed (apt-get install qemu-system-x86)"))?;
    status!("farmap bench vm: building the guest (scripts/vm/initramfs.sh)");
    let image = VmcheckImage::build().map_err(|e| anyhow::anyhow!("{e}"))?;
    let ctx = Ctx {
        image,
        exe: std::env::current_exe().context("finding the farmap binary")?,
        version: version.to_string(),
        ws_mib: args.working_set >> 20,
        rate_mibs: args.rate_mibs,
        qemu_timeout: args.qemu_timeout,
        tmp: tempfile::tempdir()?,
    };
    let mut failed = false;
    for run in 0..args.runs {
        for &size in &args.sizes {
            for system in &systems {
                let mib = size >> 20;
                status!("farmap bench vm: {system}, {mib} MiB, run {}", run + 1);
                let steal = steal_ms();
                let mut row = match one(&ctx, system, mib).await {
                    Ok(row) => row,
                    Err(e) => Row {
                        error: Some(format!("{e:#}")),
                        ..Row::default()
                    },
                };
                row.bench = "vm";
                row.system = system.clone();
                if row.case.is_empty() {
                    row.case = "migrate".into();
                }
                row.guest_mib = mib;
                row.working_set_mib = ctx.ws_mib;
                row.qemu_version = ctx.version.clone();
                row.run = run;
                row.steal_ms = steal.zip(steal_ms()).map(|(a, b)| b.saturating_sub(a));
                // QEMU's own migrations are anchors: their guests' fate is data, not a
                // failure of this command.
                failed |= !row.verified && !system.starts_with("qemu-");
                emit(&row, args.json)?;
            }
        }
    }
    Ok(if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

fn emit(row: &Row, json: bool) -> anyhow::Result<()> {
    if json {
        return farmap_cli_kit::output::json_line(row);
    }
    let f = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1}"));
    println!(
        "{:<20} {:>5} MiB  gap {:>8} ms  qemu downtime {:>6} ms  total {:>8} ms  moved {:>10} B  verified {}{}",
        row.system,
        row.guest_mib,
        f(row.guest_max_gap_ms),
        f(row.downtime_ms),
        f(row.total_ms),
        row.bytes_moved.map_or("-".into(), |b| b.to_string()),
        row.verified,
        row.error.as_deref().map_or(String::new(), |e| format!("  ({e})")),
    );
    Ok(())
}

/// The host's steal time so far, in ms (`/proc/stat`, USER_HZ 100).
fn steal_ms() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let cpu = stat.lines().next()?;
    cpu.split_whitespace()
        .nth(8)?
        .parse::<u64>()
        .ok()
        .map(|t| t * 10)
}

/// One QEMU, its heartbeats and console; killed when dropped.
struct Guest {
    config: QemuConfig,
    qemu: Option<Child>,
    beats: Heartbeats,
    console: Console,
}

impl Drop for Guest {
    fn drop(&mut self) {
        if let Some(mut c) = self.qemu.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Guest {
    /// Listens for `config`'s heartbeats and, unless another command starts it, starts it.
    fn prepare(config: QemuConfig, destination: bool) -> anyhow::Result<(QemuConfig, Heartbeats)> {
        let listener = if destination {
            HeartbeatListener::bind_continued(&config.heartbeat)
        } else {
            HeartbeatListener::bind(&config.heartbeat)
        };
        Ok((config, listener?.start()?))
    }

    fn start(config: QemuConfig, incoming: Option<Incoming>) -> anyhow::Result<Self> {
        let (config, beats) = Self::prepare(config, incoming.is_some())?;
        let qemu = config
            .command(incoming)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .context("starting QEMU")?;
        let console = Console::connect(&config.serial, Duration::from_secs(30))?;
        Ok(Self {
            config,
            qemu: Some(qemu),
            beats,
            console,
        })
    }

    /// Boots to vmcheck running, then lets it run a second.
    fn boot(&self) -> anyhow::Result<()> {
        self.console
            .wait_vmcheck(Duration::from_secs(300), |l| {
                matches!(l, VmcheckLine::Ready { .. })
            })
            .context("the guest did not start vmcheck")?;
        std::thread::sleep(Duration::from_secs(1));
        Ok(())
    }

    /// Whether the guest, here, finds its whole working set intact; its own largest gap.
    fn verify(&self) -> (bool, Option<f64>) {
        self.console.skip_to_end();
        let mut gap = None;
        if let Ok(VmcheckLine::Report { max_gap_us, .. }) =
            self.console.wait_vmcheck(Duration::from_secs(10), |l| {
                matches!(l, VmcheckLine::Report { .. })
            })
        {
            gap = Some(max_gap_us as f64 / 1e3);
        }
        if self.console.send_line("check").is_err() {
            return (false, gap);
        }
        let done = self.console.wait_vmcheck(Duration::from_secs(60), |l| {
            matches!(l, VmcheckLine::Done { .. })
        });
        (
            matches!(done, Ok(VmcheckLine::Done { mismatches: 0, .. })),
            gap,
        )
    }
}

impl Ctx {
    fn config(&self, name: &str, mib: u64, ram: Ram) -> anyhow::Result<QemuConfig> {
        let dir = self.tmp.path().join(name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let mut c = QemuConfig::new(mib, ram, &dir);
        c.kernel = Some(self.image.kernel.clone());
        c.initrd = Some(self.image.initrd.clone());
        c.append = format!(
            "{DEFAULT_APPEND} vmcheck.ws-mib={} vmcheck.rate-mibs={}",
            self.ws_mib, self.rate_mibs
        );
        Ok(c)
    }
}

async fn one(ctx: &Ctx, system: &str, mib: u64) -> anyhow::Result<Row> {
    match system {
        "shared-floor" => floor(ctx, mib).await,
        "farmap-instant" => farmap_row(ctx, mib, "instant").await,
        "farmap-precopy" => farmap_row(ctx, mib, "precopy").await,
        "farmap-lazy-start" => lazy_row(ctx, mib, true).await,
        "qemu-restore" => lazy_row(ctx, mib, false).await,
        _ => qemu_row(ctx, system, mib).await,
    }
}

/// The guest's largest heartbeat gap from `from` on, and whether the sequence has no hole.
fn gap(streams: &[&Heartbeats], from: Instant) -> (Option<f64>, bool) {
    let kept: Vec<Vec<Beat>> = streams
        .iter()
        .map(|h| h.beats().into_iter().filter(|b| b.at >= from).collect())
        .collect();
    let refs: Vec<&[Beat]> = kept.iter().map(Vec::as_slice).collect();
    if trace() {
        let mut all: Vec<Instant> = kept.iter().flatten().map(|b| b.at).collect();
        all.sort();
        let mut gaps: Vec<(Duration, Duration)> =
            all.windows(2).map(|w| (w[1] - w[0], w[0] - from)).collect();
        gaps.sort_by(|a, b| b.cmp(a));
        let shown: Vec<String> = gaps
            .iter()
            .take(8)
            .map(|(g, at)| {
                format!(
                    "{:.1} ms at +{:.0} ms",
                    g.as_secs_f64() * 1e3,
                    at.as_secs_f64() * 1e3
                )
            })
            .collect();
        eprintln!("bench vm: largest heartbeat gaps: {}", shown.join(", "));
    }
    let a = analyse(&refs);
    (
        (a.beats > 1).then_some(a.max_gap.as_secs_f64() * 1e3),
        a.holes == 0,
    )
}

/// `FARMAP_BENCH_VM_TRACE=1`: the largest gaps and `farmap vm migrate`'s log and report go
/// to stderr (to see where a gap comes from).
fn trace() -> bool {
    std::env::var_os("FARMAP_BENCH_VM_TRACE").is_some()
}

/// A QEMU-driven move of `src` to `dst` (both started), through `uri`; `caps` on both.
async fn qemu_move(
    src: &Guest,
    dst: &Guest,
    caps: &[(&str, bool)],
    limit_ms: Option<u64>,
    postcopy: bool,
    timeout: Duration,
) -> anyhow::Result<(Row, Instant)> {
    let t = Duration::from_secs(30);
    let mut s = Qmp::connect(&src.config.qmp, t).await?;
    let mut d = Qmp::connect(&dst.config.qmp, t).await?;
    d.set_capabilities(caps).await?;
    s.set_capabilities(caps).await?;
    if let Some(ms) = limit_ms {
        s.set_parameters(serde_json::json!({ "downtime-limit": ms }))
            .await?;
    }
    let uri = format!("unix:{}.mig", dst.config.qmp.display());
    d.migrate_incoming(&uri).await?;
    let t0 = Instant::now();
    s.migrate(&uri).await?;
    if postcopy {
        loop {
            let info = s.query_migrate().await?;
            if info.ram_dirty_sync_count.unwrap_or(0) >= 2 || t0.elapsed() > timeout {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        s.execute("migrate-start-postcopy", None).await?;
    }
    let mut row = Row::default();
    match s.wait_migration_status(timeout, "completed").await {
        Ok(()) => row.converged = true,
        Err(e) => {
            let _ = s.execute("migrate_cancel", None).await;
            row.error = Some(format!("{e}"));
            return Ok((row, t0));
        }
    }
    d.wait_status(t, "running").await?;
    row.total_ms = Some(t0.elapsed().as_secs_f64() * 1e3);
    let info = s.query_migrate().await?;
    row.downtime_ms = info.downtime_ms.map(|v| v as f64);
    row.bytes_moved = info.ram_transferred;
    let _ = s.quit().await;
    Ok((row, t0))
}

/// Fills in the guest's view after a move: gap, holes, the check at the destination.
fn finish_row(row: &mut Row, streams: &[&Heartbeats], dst: &Guest, from: Instant) {
    std::thread::sleep(Duration::from_secs(2));
    let (gap_ms, no_hole) = gap(streams, from);
    row.guest_max_gap_ms = gap_ms;
    let (intact, clock_gap) = dst.verify();
    row.guest_clock_max_gap_ms = clock_gap;
    row.verified = intact && no_hole && dst.beats.count() > 0;
}

async fn floor(ctx: &Ctx, mib: u64) -> anyhow::Result<Row> {
    let shm = tempfile::tempdir_in("/dev/shm").or_else(|_| tempfile::tempdir())?;
    let file = shm.path().join("ram");
    std::fs::File::create(&file)?.set_len(mib << 20)?;
    let ram = Ram::File {
        path: file,
        share: true,
    };
    let src = Guest::start(ctx.config("floor-s", mib, ram.clone())?, None)?;
    src.boot()?;
    let dst = Guest::start(ctx.config("floor-d", mib, ram)?, Some(Incoming::Defer))?;
    let caps = [("x-ignore-shared", true), ("events", true)];
    let (mut row, t0) = qemu_move(&src, &dst, &caps, None, false, ctx.qemu_timeout).await?;
    row.bytes_before_resume = row.bytes_moved;
    finish_row(&mut row, &[&src.beats, &dst.beats], &dst, t0);
    Ok(row)
}

async fn qemu_row(ctx: &Ctx, system: &str, mib: u64) -> anyhow::Result<Row> {
    let src = Guest::start(ctx.config("q-s", mib, Ram::Anonymous)?, None)?;
    src.boot()?;
    let dst = Guest::start(
        ctx.config("q-d", mib, Ram::Anonymous)?,
        Some(Incoming::Defer),
    )?;
    let postcopy = system == "qemu-postcopy";
    let mut caps = vec![("events", true)];
    if postcopy {
        caps.push(("postcopy-ram", true));
    }
    let limit = (system == "qemu-precopy-limit").then_some(30);
    let (mut row, t0) = qemu_move(&src, &dst, &caps, limit, postcopy, ctx.qemu_timeout).await?;
    row.case = match system {
        "qemu-precopy-limit" => "downtime-limit-30ms".into(),
        "qemu-precopy" => "default".into(),
        _ => "migrate".into(),
    };
    if row.converged {
        finish_row(&mut row, &[&src.beats, &dst.beats], &dst, t0);
    }
    Ok(row)
}

/// A child process stopped with SIGTERM (a mount flushes and unmounts) when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        farmap_testkit::process::terminate(&mut self.0, Duration::from_secs(10));
    }
}

/// `farmap serve SPEC` on loopback; its address.
fn serve(exe: &Path, spec: &str) -> anyhow::Result<(Proc, String)> {
    let mut child = Command::new(exe)
        .args(["serve", spec, "--listen", "127.0.0.1:0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut lines = std::io::BufReader::new(child.stderr.take().expect("piped")).lines();
    let proc = Proc(child);
    for line in lines.by_ref().take(64) {
        let line = line?;
        if let Some(rest) = line.split("listening on ").nth(1) {
            let addr = rest.split(|c: char| c.is_whitespace() || c == ',').next();
            let addr = addr.unwrap_or_default().to_string();
            // Keep draining its log so that it never blocks on a full pipe.
            std::thread::spawn(move || lines.for_each(drop));
            return Ok((proc, addr));
        }
    }
    bail!("farmap serve printed no address")
}

/// `farmap mount DIR [SPEC --managed] [--agent AGENT --suspend HOOK --prepare HOOK]`, the
/// hooks reaching `farmap vm migrate --control CONTROL`.
fn mount(
    exe: &Path,
    dir: &Path,
    spec: Option<&str>,
    agent: Option<(&Path, &Path)>,
) -> anyhow::Result<Proc> {
    std::fs::create_dir_all(dir)?;
    let mut cmd = Command::new(exe);
    cmd.arg("mount").arg(dir);
    if let Some(spec) = spec {
        cmd.args([spec, "--managed"]);
    }
    if let Some((agent, control)) = agent {
        // The hooks reach `farmap vm migrate --control`; the prepare hook has the destination
        // QEMU started before the last pushes.
        let hook = |word| {
            format!(
                "{} vm {word} --control {}",
                exe.display(),
                control.display()
            )
        };
        cmd.arg("--agent").arg(agent).args([
            "--suspend",
            &hook("suspend"),
            "--prepare",
            &hook("prepare"),
        ]);
    }
    let proc = Proc(cmd.stdout(Stdio::null()).spawn()?);
    let t0 = Instant::now();
    while agent.is_some_and(|(a, _)| !a.exists())
        || (spec.is_some() && !dir.join("region").exists())
    {
        if t0.elapsed() > Duration::from_secs(30) {
            bail!("farmap mount {} did not start", dir.display());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(proc)
}

async fn farmap_row(ctx: &Ctx, mib: u64, mode: &str) -> anyhow::Result<Row> {
    let root = ctx.tmp.path().join(format!("farmap-{mode}-{mib}"));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root)?;
    let (_server, addr) = serve(&ctx.exe, &format!("memory:{mib}MiB"))?;
    let spec = format!("farmap://{addr}");
    let control = root.join("vm.ctl");
    let (src_dir, dst_dir) = (root.join("src"), root.join("dst"));
    let (src_agent, dst_agent) = (root.join("src.agent"), root.join("dst.agent"));
    let _src_mount = mount(
        &ctx.exe,
        &src_dir,
        Some(&spec),
        Some((&src_agent, &control)),
    )?;
    let _dst_mount = mount(&ctx.exe, &dst_dir, None, Some((&dst_agent, &control)))?;
    let ram = |dir: &Path| Ram::File {
        path: dir.join("region"),
        share: true,
    };
    let src = Guest::start(ctx.config("f-s", mib, ram(&src_dir))?, None)?;
    src.boot()?;
    let (dst_config, dst_beats) = Guest::prepare(ctx.config("f-d", mib, ram(&dst_dir))?, true)?;
    let t0 = Instant::now();
    let mut cmd = Command::new(&ctx.exe);
    cmd.args(["vm", "migrate", "--json", "--mode", mode])
        .arg("--src-qmp")
        .arg(&src.config.qmp)
        .arg("--src-agent")
        .arg(&src_agent)
        .arg("--dst-agent")
        .arg(&dst_agent)
        .arg("--dst-ram")
        .arg(dst_dir.join("region"))
        .arg("--dst-qmp")
        .arg(&dst_config.qmp)
        .arg("--dst-launch")
        .arg(dst_config.shell_command(Some(Incoming::Defer)))
        .arg("--control")
        .arg(&control)
        .arg("--key-file")
        .arg(root.join("key"))
        .stderr(if trace() {
            Stdio::inherit()
        } else {
            Stdio::null()
        });
    if mode == "instant" {
        cmd.arg("--store").arg(&spec);
    }
    let out = tokio::task::spawn_blocking(move || cmd.output()).await??;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("farmap vm migrate failed ({})", out.status);
    }
    let report: Value = serde_json::from_str(stdout.trim()).context("farmap vm migrate's JSON")?;
    if trace() {
        eprintln!("bench vm: farmap vm migrate: {}", stdout.trim());
    }
    let console = Console::connect(&dst_config.serial, Duration::from_secs(30))?;
    let dst = Guest {
        config: dst_config,
        qemu: None,
        beats: dst_beats,
        console,
    };
    let f = |k: &str| report[k].as_f64();
    let u = |k: &str| report[k].as_u64();
    let mut row = Row {
        downtime_ms: f("qemu_downtime_ms"),
        total_ms: f("total_ms"),
        bytes_moved: Some(u("qemu_bytes").unwrap_or(0) + u("farmap_bytes").unwrap_or(0)),
        bytes_before_resume: Some(
            u("qemu_bytes").unwrap_or(0) + u("bytes_before_resume").unwrap_or(0),
        ),
        handover_ms: f("handover_ms"),
        converged: report["leech"]["converged"].as_bool().unwrap_or(true),
        ..Row::default()
    };
    finish_row(&mut row, &[&src.beats, &dst.beats], &dst, t0);
    // The destination QEMU was started by `farmap vm migrate`: stop it.
    if let Ok(qmp) = Qmp::connect(&dst.config.qmp, Duration::from_secs(5)).await {
        let _ = qmp.quit().await;
    }
    Ok(row)
}

/// The heartbeat rate (per second) over the `span` before `at`.
fn rate_before(beats: &[Beat], at: Instant, span: Duration) -> f64 {
    let from = at - span;
    let n = beats.iter().filter(|b| b.at >= from && b.at < at).count();
    n as f64 / span.as_secs_f64()
}

/// After a start at `t0`: the first heartbeat's time, and the start of the first
/// [`WARM_WINDOW`] whose heartbeats reach [`WARM_SHARE`] of `rate` (per second), both from
/// `t0`.
fn first_and_warm(beats: &[Beat], t0: Instant, rate: f64) -> (Option<Duration>, Option<Duration>) {
    let after: Vec<Instant> = beats.iter().map(|b| b.at).filter(|&at| at >= t0).collect();
    let first = after.first().map(|&at| at - t0);
    let want = WARM_SHARE * rate * WARM_WINDOW.as_secs_f64();
    let warm = (0..after.len()).find_map(|i| {
        let end = after[i] + WARM_WINDOW;
        let n = after[i..].iter().take_while(|&&at| at < end).count();
        (n as f64 >= want && want > 0.0).then(|| after[i] - t0)
    });
    (first, warm)
}

/// The window the warm rate is measured over, and the share of the rate before the save it
/// must reach (docs/design/vm.md §10).
const WARM_WINDOW: Duration = Duration::from_millis(100);
const WARM_SHARE: f64 = 0.9;

/// A lazy start: the guest saved and started again in a new QEMU. `farmap`: its RAM on a
/// farmap mount of a `versioned:` region (the device state only in the saved file; the new
/// mount reads the working set ahead); otherwise QEMU's own full save and restore
/// (anonymous RAM). Both keep their files on /dev/shm.
async fn lazy_row(ctx: &Ctx, mib: u64, farmap: bool) -> anyhow::Result<Row> {
    let name = if farmap { "lazy" } else { "restore" };
    let root = ctx.tmp.path().join(format!("{name}-{mib}"));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root)?;
    let shm = tempfile::tempdir_in("/dev/shm").or_else(|_| tempfile::tempdir())?;
    let spec = format!(
        "versioned:(dir:{})/vm?size={mib}MiB",
        shm.path().join("objects").display()
    );
    let state = shm.path().join("vm.state");
    let (src_dir, dst_dir) = (root.join("src"), root.join("dst"));
    let ram = |dir: &Path| {
        if farmap {
            Ram::File {
                path: dir.join("region"),
                share: true,
            }
        } else {
            Ram::Anonymous
        }
    };
    let t = Duration::from_secs(30);
    let mut row = Row::default();
    // Run and save.
    let (src_beats, rate) = {
        let src_mount = if farmap {
            Some(mount(&ctx.exe, &src_dir, Some(&spec), None)?)
        } else {
            None
        };
        let mut src = Guest::start(ctx.config(&format!("{name}-s"), mib, ram(&src_dir))?, None)?;
        src.boot()?;
        std::thread::sleep(Duration::from_secs(1));
        let mut qmp = Qmp::connect(&src.config.qmp, t).await?;
        let at = Instant::now();
        let rate = rate_before(&src.beats.beats(), at, Duration::from_secs(1));
        let ram_file = src_dir.join("region");
        let saved = farmap_vm::save(
            &mut qmp,
            &state,
            farmap.then_some(ram_file.as_path()),
            ctx.qemu_timeout,
        )
        .await
        .context("saving the guest")?;
        row.save_ms = Some(
            saved.save.as_secs_f64() * 1e3 + saved.flush.map_or(0.0, |f| f.as_secs_f64() * 1e3),
        );
        row.bytes_moved = Some(saved.state_bytes);
        qmp.quit().await?;
        if let Some(mut c) = src.qemu.take() {
            let _ = c.wait();
        }
        // The mount flushes and unmounts.
        drop(src_mount);
        (src.beats.beats(), rate)
    };
    // Start again, on a new mount of the saved region.
    let t_prepare = Instant::now();
    let _dst_mount = if farmap {
        Some(mount(
            &ctx.exe,
            &dst_dir,
            Some(&spec.replace(&format!("?size={mib}MiB"), "")),
            None,
        )?)
    } else {
        None
    };
    let dst = Guest::start(
        ctx.config(&format!("{name}-d"), mib, ram(&dst_dir))?,
        Some(Incoming::Defer),
    )?;
    let mut qmp = Qmp::connect(&dst.config.qmp, t).await?;
    row.prepare_ms = Some(t_prepare.elapsed().as_secs_f64() * 1e3);
    let t0 = Instant::now();
    let running = farmap_vm::restore(&mut qmp, &state, farmap, ctx.qemu_timeout)
        .await
        .context("restoring the guest")?;
    // Until it is warm, or 30 s.
    let (mut first, mut warm) = (None, None);
    while t0.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(200));
        (first, warm) = first_and_warm(&dst.beats.beats(), t0, rate);
        if warm.is_some() {
            break;
        }
    }
    let ms = |d: Option<Duration>| d.map(|d| d.as_secs_f64() * 1e3);
    row.time_to_first_instruction_ms = ms(Some(running));
    row.first_beat_ms = ms(first);
    row.time_to_warm_ms = ms(warm);
    row.converged = warm.is_some();
    row.case = "lazy-start".into();
    let dst_beats = dst.beats.beats();
    let holes = analyse(&[&src_beats, &dst_beats]).holes;
    let (intact, clock_gap) = dst.verify();
    row.guest_clock_max_gap_ms = clock_gap;
    row.verified = intact && holes == 0 && first.is_some();
    if trace() {
        eprintln!(
            "bench vm: {name}: rate before the save {rate:.0}/s, running {running:?}, first beat {:?}, warm {:?}, {} beats after",
            first, warm, dst_beats.len()
        );
    }
    let _ = qmp.quit().await;
    Ok(row)
}
