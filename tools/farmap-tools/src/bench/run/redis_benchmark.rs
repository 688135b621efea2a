//! redis-benchmark as `farmap bench run` drives it: `HGETALL` of the records YCSB loaded
//! (`user` + 12 digits, which is what `__rand_int__` expands to), uniformly over the
//! keyspace, and the parser of its summary.

use anyhow::{bail, Context};

/// redis-benchmark's arguments for `requests` `HGETALL`s over `records` records.
pub fn args(port: u16, records: u64, requests: u64, clients: u32) -> Vec<String> {
    [
        "-h",
        "127.0.0.1",
        "-p",
        &port.to_string(),
        "-n",
        &requests.to_string(),
        "-r",
        &records.to_string(),
        "-c",
        &clients.to_string(),
        "HGETALL",
        "user__rand_int__",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// The figures of one redis-benchmark test.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Report {
    /// `throughput summary: X requests per second`.
    pub ops_per_s: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// The first percentile at or above 99.9 in "Latency by percentile distribution".
    pub p99_9_us: Option<f64>,
}

impl Report {
    /// Parses redis-benchmark's full output (not `--csv` or `-q`: those have no
    /// percentile distribution, hence no p99.9).
    pub fn parse(out: &str) -> anyhow::Result<Report> {
        // Progress is written with carriage returns on the same lines.
        let lines: Vec<&str> = out
            .split(['\n', '\r'])
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        let ops_per_s = lines
            .iter()
            .find_map(|l| {
                l.strip_prefix("throughput summary:")?
                    .trim()
                    .strip_suffix("requests per second")?
                    .trim()
                    .parse::<f64>()
                    .ok()
            })
            .context("redis-benchmark printed no throughput summary")?;
        let at = lines
            .iter()
            .position(|l| l.starts_with("latency summary (msec):"))
            .context("redis-benchmark printed no latency summary")?;
        let (Some(names), Some(values)) = (lines.get(at + 1), lines.get(at + 2)) else {
            bail!("redis-benchmark's latency summary is cut short");
        };
        let summary: Vec<(&str, f64)> = names
            .split_whitespace()
            .zip(values.split_whitespace().map(|v| v.parse::<f64>()))
            .filter_map(|(n, v)| Some((n, v.ok()?)))
            .collect();
        let ms = |name: &str| -> anyhow::Result<f64> {
            summary
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v * 1e3)
                .with_context(|| format!("redis-benchmark's latency summary has no {name}"))
        };
        // "99.902% <= 1.207 milliseconds (cumulative count 19981)"
        let p99_9_us = lines
            .iter()
            .skip_while(|l| !l.starts_with("Latency by percentile distribution"))
            .filter_map(|l| {
                let (pct, rest) = l.split_once("% <= ")?;
                let ms = rest.split_whitespace().next()?.parse::<f64>().ok()?;
                Some((pct.parse::<f64>().ok()?, ms))
            })
            .find(|(pct, _)| *pct >= 99.9)
            .map(|(_, ms)| ms * 1e3);
        Ok(Report {
            ops_per_s,
            p50_us: ms("p50")?,
            p99_us: ms("p99")?,
            p99_9_us,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUT: &str = "HGETALL user__rand_int__: rps=0.0 (overall: nan) avg_msec=nan\r\
HGETALL user__rand_int__: rps=40112.0 (overall: 40112.0) avg_msec=1.1\r\
====== HGETALL user__rand_int__ ======
  20000 requests completed in 0.47 seconds
  50 parallel clients

Latency by percentile distribution:
0.000% <= 0.231 milliseconds (cumulative count 1)
50.000% <= 0.951 milliseconds (cumulative count 10133)
99.000% <= 1.647 milliseconds (cumulative count 19800)
99.804% <= 1.999 milliseconds (cumulative count 19961)
99.902% <= 2.207 milliseconds (cumulative count 19981)
100.000% <= 2.535 milliseconds (cumulative count 20000)

Cumulative distribution of latencies:
0.010% <= 0.303 milliseconds (cumulative count 2)

Summary:
  throughput summary: 42553.19 requests per second
  latency summary (msec):
          avg       min       p50       p95       p99       max
        0.970     0.224     0.951     1.383     1.647     2.535
";

    #[test]
    fn the_summary_and_the_distribution_give_the_figures() {
        let r = Report::parse(OUT).unwrap();
        assert!((r.ops_per_s - 42553.19).abs() < 1e-6);
        assert!((r.p50_us - 951.0).abs() < 1e-6);
        assert!((r.p99_us - 1647.0).abs() < 1e-6);
        assert!((r.p99_9_us.unwrap() - 2207.0).abs() < 1e-6);
    }

    #[test]
    fn real_output_parses() {
        let r = Report::parse(include_str!("testdata/redis-benchmark-get.txt")).unwrap();
        assert!(r.ops_per_s > 1000.0);
        assert!(r.p50_us > 0.0 && r.p99_us >= r.p50_us);
        assert!(r.p99_9_us.unwrap() >= r.p99_us);
    }

    #[test]
    fn csv_or_quiet_output_is_an_error() {
        assert!(Report::parse(include_str!("testdata/redis-benchmark-get.csv")).is_err());
    }
}
