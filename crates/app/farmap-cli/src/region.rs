//! `farmap region limit` and `farmap region stats`: change and show the bound on the local
//! memory of the region an application holds, through its agent (the same Unix socket as
//! `farmap seed --app`), while it runs.
//!
//! Also the `--local-max` flags of the commands that open a region for an application.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use farmap_migrate::agent::{
    Controller, LocalMax, PagingReport, Reply, Request, SetLocalMaxRequest,
};
use farmap_uffd::LocalLimit;

use crate::output;
use farmap_cli_kit::args::{parse_duration, parse_local_max};

const REGION_HELP: &str = "\
THE AGENT:
  --app names the Unix socket of the application's agent (farmap_migrate::agent::serve in
  Rust), the one `farmap seed --app` uses. Only a region opened with a bound (--local-max,
  or RegionOptions::paging in Rust) can be paged: a bound cannot be added at run time.

  Resident memory (mapped, staged and in-flight chunks) stays at most the limit plus
  min_free chunks; after the limit is lowered, written chunks are written back to the
  store before their local copies are dropped, so nothing written is lost.";

#[derive(Debug, Subcommand)]
pub enum RegionCommand {
    /// Change the bound on the local memory of the region an application holds, while it
    /// runs; waits (--wait) for resident memory to come down, then prints the region's
    /// paging state.
    #[command(after_help = REGION_HELP)]
    Limit(LimitArgs),
    /// Show the paging state of the region an application holds: limit, resident and staged
    /// memory, min_free, evictions.
    #[command(after_help = REGION_HELP)]
    Stats(StatsArgs),
}

#[derive(Debug, Args)]
pub struct LimitArgs {
    /// The application's agent (a Unix socket path).
    #[arg(long, value_name = "SOCKET")]
    app: PathBuf,
    /// The new bound: SIZE (e.g. 256MiB; rounded down to whole chunks, at least one) or N%
    /// of the region, N in (0, 100].
    #[arg(value_name = "SIZE|N%", value_parser = parse_local_max)]
    limit: LocalLimit,
    /// How long to wait for resident memory to come down to the new limit (plus min_free)
    /// before printing; 0s prints at once (at most 60s).
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    wait: Duration,
    /// Print the result as one JSON line.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
pub struct StatsArgs {
    /// The application's agent (a Unix socket path).
    #[arg(long, value_name = "SOCKET")]
    app: PathBuf,
    /// Print the result as one JSON line.
    #[arg(long)]
    json: bool,
}

pub async fn run(cmd: RegionCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        RegionCommand::Limit(a) => {
            if a.wait > farmap_migrate::agent::paging::MAX_SETTLE_WAIT {
                bail!("--wait is at most 60s");
            }
            let req = Request::SetLocalMax(SetLocalMaxRequest {
                local_max: LocalMax::from(a.limit),
                wait_ms: a.wait.as_millis() as u64,
                budget: None,
            });
            let r = ask(&a.app, &req, a.wait).await?;
            print(&r, a.json)?;
            if !a.json && !r.within_limit {
                status!(
                    "farmap region limit: resident memory is still above the limit after {:?}; \
                     reclaim goes on",
                    a.wait
                );
            }
        }
        RegionCommand::Stats(a) => {
            let r = ask(&a.app, &Request::PagingState, Duration::ZERO).await?;
            print(&r, a.json)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Sends `req` to the agent at `app` and returns its paging report; the agent's refusal is
/// an error.
async fn ask(app: &std::path::Path, req: &Request, wait: Duration) -> anyhow::Result<PagingReport> {
    let mut c = Controller::connect(app).await?;
    c.send(req)
        .await
        .context("sending the request to the agent")?;
    // The agent answers at once, or after `wait`; an agent that says nothing is stuck.
    let reply = tokio::time::timeout(wait + Duration::from_secs(10), c.next())
        .await
        .map_err(|_| anyhow::anyhow!("the agent on {} did not answer", app.display()))?
        .context("reading the agent's answer")?;
    match reply {
        Some(Reply::Paging(r)) => Ok(r),
        Some(Reply::Error { message, .. }) => bail!("the agent refused: {message}"),
        Some(other) => bail!("the agent answered with an unexpected {other:?}"),
        None => bail!(
            "the agent closed the connection without an answer (is it an older farmap that \
             does not know local-memory requests?)"
        ),
    }
}

fn print(r: &PagingReport, json: bool) -> anyhow::Result<()> {
    if json {
        return output::json_line(r);
    }
    let chunks = |b: u64| b / r.chunk_bytes.max(1);
    println!(
        "local memory: limit {} ({} chunks of {}, {:.1}% of {}), resident {} (staged {}), \
         min_free {}; in memory {}; evictions {} reactive, {} proactive; faults {}; \
         prefetched {} ({} touched, {} dropped untouched)",
        bytes(r.limit_bytes),
        chunks(r.limit_bytes),
        bytes(r.chunk_bytes),
        r.limit_bytes as f64 * 100.0 / r.region_bytes.max(1) as f64,
        bytes(r.region_bytes),
        bytes(r.resident_bytes),
        bytes(r.staged_bytes),
        bytes(r.min_free_bytes),
        r.local_bytes.map_or_else(|| "unknown".into(), bytes),
        r.evictions_reactive,
        r.evictions_proactive,
        r.faults,
        r.prefetched,
        r.prefetch_hits,
        r.prefetch_wasted,
    );
    if let Some(b) = &r.budget {
        println!(
            "budget {}: share {} of {} ({})",
            b.name,
            bytes(b.share_bytes),
            bytes(b.total_bytes),
            b.reason
        );
    }
    Ok(())
}

/// Bytes in binary units (KiB, MiB, GiB), one decimal where it matters.
pub(crate) fn bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 || v.fract() == 0.0 {
        format!("{v:.0} {}", UNITS[u])
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_max_takes_sizes_and_percentages() {
        assert_eq!(parse_local_max("30%"), Ok(LocalLimit::Percent(30.0)));
        assert_eq!(parse_local_max("100%"), Ok(LocalLimit::Percent(100.0)));
        assert_eq!(parse_local_max("64KiB"), Ok(LocalLimit::Bytes(65536)));
        assert_eq!(parse_local_max("2M"), Ok(LocalLimit::Bytes(2 << 20)));
        assert_eq!(parse_local_max("4096"), Ok(LocalLimit::Bytes(4096)));
        for (bad, says) in [
            ("0", "0 bytes"),
            ("0KiB", "0 bytes"),
            ("150%", "(0, 100]"),
            ("0%", "(0, 100]"),
            ("-5%", "(0, 100]"),
            ("lots", ""),
            ("%", "not a percentage"),
        ] {
            let e = parse_local_max(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn bytes_are_printed_in_binary_units() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(65536), "64 KiB");
        assert_eq!(bytes(3 << 19), "1.5 MiB");
        assert_eq!(bytes(1 << 30), "1 GiB");
    }
}
