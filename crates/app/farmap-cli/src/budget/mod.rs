//! `farmap budget NAME --total SIZE`: several programs under `farmap run --budget NAME`
//! share a total of local memory, divided by their recent faults and active memory and
//! divided again every interval (docs/design/farmap-run.md §6).
//!
//! - [`policy`]: the division, a pure function with table tests;
//! - [`proto`]: the socket's place and its lines;
//! - [`coordinator`]: the process that divides (this command);
//! - [`member`]: the side of `farmap run --budget`.

pub mod coordinator;
pub mod member;
pub mod policy;
pub mod proto;

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use farmap_cli_kit::args::{parse_duration, parse_size_arg};
use tokio::io::{AsyncWriteExt, BufReader};

use crate::output;
use crate::region::bytes;
use proto::{Answer, Hello, Status};

const BUDGET_HELP: &str = "\
HOW IT WORKS:
  farmap budget NAME --total SIZE runs until Ctrl-C and listens on a private socket
  ($XDG_RUNTIME_DIR/farmap/budget/NAME.sock, or /run/farmap/budget/NAME.sock for root; a
  NAME with a '/' is the socket's path). Programs join with `farmap run --budget NAME --
  PROGRAM`: each gets a share of the total as the bound on its heap's local memory, and
  leaves when it ends. Every --interval the shares are divided again:

  - a program's weight is its recent faults (per second, smoothed) plus its active memory
    (what the pager saw touched since its clock last passed);
  - a program with no faults for 3 intervals is idle and shrinks to the floor (5% of the
    total, within 1 MiB and 8 MiB, or less with many programs): it gives memory back;
  - the others share what is left by weight, each capped at its working set plus a
    quarter (at least the floor) and at its heap's size;
  - a new program starts at an equal split (the others make room at once);
  - a share moves at most 25% of itself or of an equal split per interval, and a change
    under 1/64 of the total is not made;
  - the shares add up to at most the total; lowered bounds are sent first.

  `farmap budget NAME --status` lists the programs and their shares, and `farmap region
  stats --app SOCKET` shows a program's (farmap run --agent SOCKET) as budget {name,
  total, share, reason}. Reasons: new, idle, demand, working_set, step, held, floor.

LIMITS:
  Without accessed bits, a program whose working set fits its share and that does not
  fault looks idle: it shrinks until it faults, then grows again. Only the heap farmap run
  serves is counted (not the program's code, stacks or own mappings).";

#[derive(Debug, Args)]
#[command(after_help = BUDGET_HELP)]
pub struct BudgetArgs {
    /// The budget's name (letters, digits, '.', '_', '-'), or its socket's path (with a
    /// '/').
    #[arg(value_name = "NAME")]
    name: String,
    /// The local memory the programs share (e.g. 512MiB).
    #[arg(long, value_name = "SIZE", value_parser = parse_size_arg, required_unless_present = "status")]
    total: Option<u64>,
    /// How often the shares are divided again.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    interval: Duration,
    /// The least share (default: 5% of the total, within 1MiB and 8MiB).
    #[arg(long, value_name = "SIZE", value_parser = parse_size_arg)]
    floor: Option<u64>,
    /// List the programs of a running budget and their shares, then exit.
    #[arg(long, conflicts_with_all = ["total", "floor"])]
    status: bool,
    /// Print --status as one JSON line.
    #[arg(long, requires = "status")]
    json: bool,
}

/// Shares are whole pages of a program's heap.
const UNIT: u64 = 4096;

pub async fn run(args: BudgetArgs) -> anyhow::Result<ExitCode> {
    let path = proto::socket_path(&args.name)?;
    if args.status {
        let status = ask_status(&path).await?;
        print_status(&status, args.json)?;
        return Ok(ExitCode::SUCCESS);
    }
    let total = args.total.context("--total is needed")?;
    if total < 1 << 20 {
        bail!("--total must be at least 1MiB");
    }
    if args.interval < Duration::from_millis(50) {
        bail!("--interval must be at least 50ms");
    }
    let mut policy = policy::Policy::new(total - total % UNIT, UNIT);
    if let Some(floor) = args.floor {
        if floor < UNIT || floor > total / 2 {
            bail!("--floor must be between 4KiB and half the total");
        }
        policy.floor = floor - floor % UNIT;
    }
    if let Some(dir) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        proto::private_dir(dir)?;
    }
    let listener = bind(&path).await?;
    let _socket = RemoveOnDrop(path.clone());
    let name = proto::display_name(&args.name);
    status!(
        "farmap budget {name}: {} shared, divided every {:?}, on {}",
        bytes(policy.total),
        args.interval,
        path.display()
    );
    let coordinator = coordinator::Coordinator::new(name, policy, args.interval);
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    tokio::select! {
        _ = coordinator.run(listener) => {}
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    Ok(ExitCode::SUCCESS)
}

/// Listens on `path` (mode 0600): a stale socket is replaced, a live one is an error.
async fn bind(path: &std::path::Path) -> anyhow::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::FileTypeExt;
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            bail!("{} exists and is not a socket", path.display());
        }
        if tokio::net::UnixStream::connect(path).await.is_ok() {
            bail!("another farmap budget answers on {}", path.display());
        }
        std::fs::remove_file(path)?;
    }
    farmap_net::bind_private_unix(path).with_context(|| format!("listening on {}", path.display()))
}

struct RemoveOnDrop(std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

async fn ask_status(path: &std::path::Path) -> anyhow::Result<Status> {
    let s = tokio::net::UnixStream::connect(path)
        .await
        .with_context(|| {
            format!(
                "no farmap budget answers on {} (is `farmap budget NAME --total SIZE` running?)",
                path.display()
            )
        })?;
    let (rd, mut wr) = s.into_split();
    wr.write_all(&proto::line(&Hello::Status)).await?;
    let mut rd = BufReader::new(rd);
    let line = tokio::time::timeout(Duration::from_secs(10), proto::read_line(&mut rd))
        .await
        .context("the budget did not answer")??
        .context("the budget closed the connection")?;
    match serde_json::from_str::<Answer>(&line)? {
        Answer::Status(s) => Ok(s),
        Answer::Error { message } => bail!("the budget refused: {message}"),
        other => bail!("the budget answered with an unexpected {other:?}"),
    }
}

fn print_status(s: &Status, json: bool) -> anyhow::Result<()> {
    if json {
        return output::json_line(s);
    }
    let shared: u64 = s.members.iter().map(|m| m.share_bytes).sum();
    println!(
        "budget {}: {} total, {} given, floor {}, every {} ms; {} program(s)",
        s.name,
        bytes(s.total_bytes),
        bytes(shared),
        bytes(s.floor_bytes),
        s.interval_ms,
        s.members.len()
    );
    for m in &s.members {
        println!(
            "  pid {}: share {} ({}), resident {}, active {}, {:.0} faults/s, idle for {} \
             interval(s); agent {}",
            m.pid.map_or_else(|| "?".into(), |p| p.to_string()),
            bytes(m.share_bytes),
            m.reason,
            bytes(m.resident_bytes),
            bytes(m.referenced_bytes),
            m.faults_per_sec,
            m.idle_intervals,
            m.agent.display()
        );
    }
    Ok(())
}
