//! The mirror options shared by `farmap bench push` and `farmap bench pull`: with
//! `--mirror-delay`, every run measures its case twice, without a mirror and through a
//! [`Mirrored`](farmap::pipeline::Mirrored) stage whose mirror is that much slower, and
//! reports the cost of the mirror (`mirror_cost = 1 − mirrored ÷ unmirrored`) per run and
//! for the medians of all runs.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use farmap::pipeline::{MirrorOptions, MirrorPolicy, Mirrored};
use farmap::store::MemoryStore;
use farmap::{open_store_async, Geometry, Store, StoreSpec};
use serde::Serialize;

use super::common::{delayed, parse_duration};

#[derive(Debug, Clone, Args)]
pub struct MirrorArgs {
    /// Also measure every run through a mirrored store whose mirror is this much slower than
    /// the primary (e.g. 20us), and report the mirror's cost against the unmirrored case
    /// measured in the same run.
    #[arg(long, value_parser = parse_duration)]
    pub mirror_delay: Option<Duration>,
    /// The mirror's policy (with --mirror-delay): both or primary-first.
    #[arg(long, default_value = "both", value_parser = parse_policy, requires = "mirror_delay")]
    pub mirror_policy: MirrorPolicy,
    /// The mirror store (with --mirror-delay), opened anew for every run. Default: a memory
    /// store of the primary's geometry, which keeps the written buffers without copying them
    /// (a mirror on another host costs this one no copy of its own).
    #[arg(long, requires = "mirror_delay")]
    pub mirror_store: Option<StoreSpec>,
}

fn parse_policy(s: &str) -> Result<MirrorPolicy, String> {
    match s {
        "both" => Ok(MirrorPolicy::Both),
        "primary-first" => Ok(MirrorPolicy::PrimaryFirst),
        _ => Err(format!("{s:?} is not both or primary-first")),
    }
}

impl MirrorArgs {
    /// The cases of one run: unmirrored, then mirrored when a delay is given.
    pub fn cases(&self) -> Vec<Option<MirrorPolicy>> {
        match self.mirror_delay {
            None => vec![None],
            Some(_) => vec![None, Some(self.mirror_policy)],
        }
    }

    /// The mirror delay in µs, for the result lines.
    pub fn delay_us(&self) -> Option<f64> {
        self.mirror_delay
            .map(|d| crate::output::round1(d.as_secs_f64() * 1e6))
    }

    /// The store one case writes through: `primary` itself, or (a mirrored case) `primary`
    /// in a [`Mirrored`] stage, also returned (see [`mirrored`](Self::mirrored)).
    pub async fn case_store(
        &self,
        case: Option<MirrorPolicy>,
        primary: Arc<dyn Store>,
        primary_latency: Duration,
    ) -> anyhow::Result<(Arc<dyn Store>, Option<Arc<Mirrored>>)> {
        Ok(match case {
            None => (primary, None),
            Some(policy) => {
                let m = self.mirrored(policy, primary, primary_latency).await?;
                (m.clone() as Arc<dyn Store>, Some(m))
            }
        })
    }

    /// Puts `primary` (already as slow as it should be; `primary_latency` is its added
    /// latency) in a [`Mirrored`] stage with `policy` whose mirror is the mirror store behind
    /// a [`Delayed`](farmap::pipeline::Delayed) of `primary_latency` + the mirror delay.
    pub async fn mirrored(
        &self,
        policy: MirrorPolicy,
        primary: Arc<dyn Store>,
        primary_latency: Duration,
    ) -> anyhow::Result<Arc<Mirrored>> {
        let g = primary.geometry();
        let mirror = self.open_mirror(g).await?;
        let latency = primary_latency + self.mirror_delay.unwrap_or_default();
        let mirror: Arc<dyn Store> = Arc::new(delayed(mirror, latency));
        let m = Mirrored::new(
            primary,
            mirror,
            MirrorOptions {
                policy,
                ..MirrorOptions::default()
            },
        )
        .context("making the mirrored store")?;
        Ok(Arc::new(m))
    }

    async fn open_mirror(&self, g: Geometry) -> anyhow::Result<Arc<dyn Store>> {
        let Some(spec) = &self.mirror_store else {
            return Ok(Arc::new(MemoryStore::new(g)));
        };
        let m = open_store_async(spec)
            .await
            .with_context(|| format!("opening the mirror store {spec}"))?;
        anyhow::ensure!(
            m.geometry() == g,
            "the mirror store {spec} ({}) must have the primary's geometry ({g})",
            m.geometry()
        );
        Ok(m)
    }
}

/// Minor page faults of this process so far, 0 where unreadable: the result lines report
/// those of the timed phase, since fresh memory faulted in can cost more than the case
/// measured.
pub fn minor_faults() -> u64 {
    super::common::self_faults().map_or(0, |f| f.minor)
}

/// The leading fields of a `push` or `pull` result line: what ran, over what, and how fast.
#[derive(Debug, Clone, Serialize)]
pub struct RunHead {
    pub bench: &'static str,
    pub case: &'static str,
    pub mirror: &'static str,
    pub store: String,
    pub size_bytes: u64,
    pub chunk_bytes: u32,
    pub rtt_ms: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mirror_delay_us: Option<f64>,
    pub workers: u32,
    pub run: u32,
    pub elapsed_ms: f64,
    pub mb_per_s: f64,
}

impl RunHead {
    /// The start of a human result line: `BENCH SIZE in CHUNK chunks, rtt R ms, N WORKERS,
    /// mirror M: X MB/s in T ms`, with `workers` naming what the count counts.
    pub fn summary(&self, workers: &str) -> String {
        format!(
            "{} {} in {} chunks, rtt {} ms, {} {workers}, mirror {}: {:.1} MB/s in {:.1} ms",
            self.bench,
            farmap::format_size(self.size_bytes),
            farmap::format_size(u64::from(self.chunk_bytes)),
            self.rtt_ms,
            self.workers,
            self.mirror,
            self.mb_per_s,
            self.elapsed_ms,
        )
    }

    /// What every line of `bench` over `store` (of geometry `g`, `rtt` away, with
    /// `workers`) repeats; [`measured`](Self::measured) adds each line's own fields.
    pub fn new(
        bench: &'static str,
        store: &StoreSpec,
        g: Geometry,
        rtt: Duration,
        workers: u32,
        mirror: &MirrorArgs,
    ) -> Self {
        Self {
            bench,
            case: "",
            mirror: mirror_name(None),
            store: store.to_string(),
            size_bytes: g.size(),
            chunk_bytes: g.chunk_size(),
            rtt_ms: rtt.as_secs_f64() * 1e3,
            mirror_delay_us: mirror.delay_us(),
            workers,
            run: 0,
            elapsed_ms: 0.0,
            mb_per_s: 0.0,
        }
    }

    /// The head of run `run` of `case` (mirrored with `policy`, if any), which moved the
    /// whole region in `elapsed`.
    pub fn measured(
        &self,
        case: &'static str,
        policy: Option<MirrorPolicy>,
        run: u32,
        elapsed: Duration,
    ) -> Self {
        Self {
            case,
            mirror: mirror_name(policy),
            run,
            elapsed_ms: crate::output::round1(elapsed.as_secs_f64() * 1e3),
            mb_per_s: crate::output::mb_per_s(self.size_bytes, elapsed),
            ..self.clone()
        }
    }
}

/// The cases of a benchmark's runs: the mirror's cost for each mirrored case against the
/// unmirrored case measured just before it (each run measures unmirrored first), and the
/// medians of all runs at the end.
#[derive(Debug, Default)]
pub struct MirrorTally {
    unmirrored: Option<f64>,
    measured: Vec<(bool, f64)>,
}

impl MirrorTally {
    /// Records a case's throughput; returns the cost of the mirror for a mirrored case.
    pub fn record(&mut self, case: Option<MirrorPolicy>, mb_per_s: f64) -> Option<f64> {
        self.measured.push((case.is_some(), mb_per_s));
        match case {
            None => {
                self.unmirrored = Some(mb_per_s);
                None
            }
            Some(_) => self.unmirrored.map(|u| cost(u, mb_per_s)),
        }
    }

    /// Prints the summary line of `bench` (nothing without `--mirror-delay`).
    pub fn finish(
        &self,
        bench: &'static str,
        args: &MirrorArgs,
        runs: u32,
        json: bool,
    ) -> anyhow::Result<()> {
        if let Some(summary) = MirrorSummary::new(bench, args, runs, &self.measured) {
            if json {
                crate::output::json_line(&summary)?;
            } else {
                summary.print();
            }
        }
        Ok(())
    }
}

/// `, mirror cost N%` for a human result line; empty without a cost.
pub fn cost_suffix(cost: Option<f64>) -> String {
    cost.map_or(String::new(), |c| {
        format!(", mirror cost {:.1}%", c * 100.0)
    })
}

/// `none`, `both` or `primary-first`.
pub fn mirror_name(case: Option<MirrorPolicy>) -> &'static str {
    case.map_or("none", MirrorPolicy::as_str)
}

/// 1 − mirrored ÷ unmirrored, rounded to 0.001.
pub fn cost(unmirrored: f64, mirrored: f64) -> f64 {
    if unmirrored <= 0.0 {
        return 0.0;
    }
    ((1.0 - mirrored / unmirrored) * 1000.0).round() / 1000.0
}

/// The median of `v` (the mean of the middle two for an even count); 0 when empty.
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The last line of a mirrored benchmark: the medians of its runs.
#[derive(Debug, Serialize)]
pub struct MirrorSummary {
    pub bench: &'static str,
    pub case: &'static str,
    pub mirror: &'static str,
    pub mirror_delay_us: f64,
    pub runs: u32,
    pub unmirrored_median_mb_per_s: f64,
    pub mirrored_median_mb_per_s: f64,
    /// 1 − mirrored median ÷ unmirrored median.
    pub mirror_cost: f64,
}

impl MirrorSummary {
    /// The summary of `results`: (mirrored?, MB/s) per measurement.
    pub fn new(
        bench: &'static str,
        args: &MirrorArgs,
        runs: u32,
        results: &[(bool, f64)],
    ) -> Option<Self> {
        let delay = args.delay_us()?;
        let pick = |m: bool| -> Vec<f64> {
            results
                .iter()
                .filter(|(mirrored, _)| *mirrored == m)
                .map(|(_, v)| *v)
                .collect()
        };
        let (u, m) = (median(&pick(false)), median(&pick(true)));
        Some(Self {
            bench,
            case: "summary",
            mirror: args.mirror_policy.as_str(),
            mirror_delay_us: delay,
            runs,
            unmirrored_median_mb_per_s: crate::output::round1(u),
            mirrored_median_mb_per_s: crate::output::round1(m),
            mirror_cost: cost(u, m),
        })
    }

    /// The human form.
    pub fn print(&self) {
        println!(
            "{}: median of {} runs: {:.1} MB/s without a mirror, {:.1} MB/s with a {} µs slower mirror ({}): the mirror costs {:.1}%",
            self.bench,
            self.runs,
            self.unmirrored_median_mb_per_s,
            self.mirrored_median_mb_per_s,
            self.mirror_delay_us,
            self.mirror,
            self.mirror_cost * 100.0
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_costs() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
        assert_eq!(cost(100.0, 91.0), 0.09);
        assert_eq!(cost(100.0, 110.0), -0.1);
        assert_eq!(cost(0.0, 5.0), 0.0);
        assert_eq!(mirror_name(None), "none");
        assert_eq!(
            mirror_name(Some(MirrorPolicy::PrimaryFirst)),
            "primary-first"
        );
        assert!(minor_faults() > 0);
        assert!(parse_policy("later")
            .unwrap_err()
            .contains("both or primary-first"));
    }
}
