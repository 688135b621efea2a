//! Flag parsers and flag groups that several commands share: one grammar for every size and
//! duration a user types, the pull budget of migrations and the local-memory bound of regions.

use std::time::Duration;

use anyhow::bail;
use clap::Args;
use farmap_uffd::{LocalLimit, PagingOptions};

/// Parses a duration flag for clap: a number and a unit (`10ms`, `250us`, `1.5s`, `2m`), one
/// parser for every flag ([`farmap::parse_duration`]: a bare number is refused), at most a day.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let d = farmap::parse_duration(s).map_err(|e| e.to_string())?;
    if d > Duration::from_secs(86_400) {
        return Err(format!("invalid duration {s:?}: at most 24h"));
    }
    Ok(d)
}

/// Parses a size (binary suffixes) for clap.
pub fn parse_size_arg(s: &str) -> Result<u64, String> {
    farmap::parse_size(s).map_err(|e| e.to_string())
}

/// A share of the machine's CPUs, in (0, 1].
pub fn parse_share(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 1.0 => Ok(v),
        _ => Err(format!("{s:?} is not a share between 0 (excluded) and 1")),
    }
}

/// What a migration's pull may take from the application (seed, leech, demo).
#[derive(Debug, Clone, Args)]
pub struct PullArgs {
    /// Scheduling priority of the threads that pull: idle (SCHED_IDLE, only when the
    /// application leaves a CPU free), batch (SCHED_BATCH at nice 19), nice (nice 19) or
    /// normal. The leecher's whole process takes it until the hand-over.
    #[arg(long, default_value = "idle")]
    pub pull_priority: farmap_migrate::PullPriority,
    /// Most bytes per second the pull moves, e.g. 200MB (default: no limit).
    #[arg(long, value_name = "BYTES", value_parser = parse_size_arg)]
    pub max_rate: Option<u64>,
    /// Most CPU this side's process spends while pulling, as a share of the machine's CPUs
    /// (0 to 1; default: no limit).
    #[arg(long, value_name = "SHARE", value_parser = parse_share)]
    pub cpu_share: Option<f64>,
}

impl PullArgs {
    /// The pull's budget, as the migration runners take it.
    pub fn budget(&self) -> farmap_migrate::PullBudget {
        farmap_migrate::PullBudget {
            priority: self.pull_priority,
            max_rate: self.max_rate,
            cpu_share: self.cpu_share,
        }
    }
}

/// Bounded local memory for a region an application opens (see `farmap region limit`).
#[derive(Debug, Clone, Args)]
pub struct LocalMaxArgs {
    /// Bound the region's local memory: at most SIZE (e.g. 256MiB) or N% of the region is
    /// held locally (mapped plus staged chunks); the rest lives in the store, written back
    /// before it is dropped, and is fetched again on its next touch. Change it while the
    /// application runs with `farmap region limit --app SOCKET SIZE|N%`. Needs
    /// userfaultfd's UFFDIO_MOVE and WP_ASYNC; not with a region that migrates (a migration
    /// destination, or `farmap seed` of this region) or that is pulled in the background.
    #[arg(long, value_name = "SIZE|N%", value_parser = parse_local_max)]
    pub local_max: Option<LocalLimit>,
    /// With --local-max: chunks the reclaim thread keeps free below the limit, so that a
    /// fault rarely has to evict (default: 1/32 of the limit, at least one). Resident
    /// memory stays at most the limit plus these chunks.
    #[arg(long, value_name = "CHUNKS", requires = "local_max")]
    pub min_free: Option<u64>,
}

impl LocalMaxArgs {
    /// The paging options, if a bound was asked for; `fresh`: the store holds nothing for
    /// the region yet (its chunks start as zeros with no store read).
    pub fn paging(&self, fresh: bool) -> anyhow::Result<Option<PagingOptions>> {
        let Some(local_max) = self.local_max else {
            return Ok(None);
        };
        if self.min_free == Some(0) {
            bail!("--min-free must be at least 1 chunk");
        }
        Ok(Some(PagingOptions {
            min_free: self.min_free,
            fresh,
            ..PagingOptions::new(local_max)
        }))
    }
}

/// `SIZE` (binary suffixes, as everywhere: 64KiB, 512M, 2GiB) or `N%` of the region, with
/// N in (0, 100].
pub fn parse_local_max(s: &str) -> Result<LocalLimit, String> {
    s.parse()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10ms").unwrap(), Duration::from_millis(10));
        assert_eq!(parse_duration("0ms").unwrap(), Duration::ZERO);
        assert_eq!(parse_duration("250us").unwrap(), Duration::from_micros(250));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("5h").unwrap(), Duration::from_secs(5 * 3600));
        assert!(parse_duration("ten").is_err());
        assert!(parse_duration("10 parsecs").is_err());
        assert!(parse_duration("25h").unwrap_err().contains("at most 24h"));
        // `--reconnect-wait 30` once meant 30 ms here and `timeout=30` 30 s in a spec.
        let e = parse_duration("30").unwrap_err();
        assert!(e.contains("unit is required") && e.contains("ms"), "{e}");
    }
}
