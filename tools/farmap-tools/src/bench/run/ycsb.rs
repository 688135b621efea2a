//! YCSB as `farmap bench run` drives it: the classpath (`scripts/ycsb/build.sh`: YCSB core
//! from Maven Central and farmap's own bindings for redis and memcached), the command lines
//! of the load and run phases, and the parser of what YCSB prints.
//!
//! Every record is written with YCSB's `dataintegrity` values (a deterministic function of
//! the key and the field), and every read is checked against them by YCSB itself: a value
//! that came back wrong is a non-OK return. Updates write the same values, so a redis
//! keyspace after any run phase is the one the load made (its `DEBUG DIGEST` is the same).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context};

/// The record shape: 10 fields of 100 bytes (YCSB's defaults), constant lengths (which
/// `dataintegrity` needs).
pub const FIELDS: u32 = 10;
pub const FIELD_LENGTH: u32 = 100;

/// Keys are `user` + the record's number padded to this many digits, in insertion order,
/// so that redis-benchmark's `__rand_int__` (12 digits) names the same records.
pub const ZERO_PADDING: u32 = 12;

/// A YCSB workload: the mix of the run phase (YCSB's core workloads A and B, zipfian).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mix {
    /// Workload A: 50% reads, 50% updates.
    A,
    /// Workload B: 95% reads, 5% updates.
    B,
}

impl Mix {
    fn proportions(self) -> (&'static str, &'static str) {
        match self {
            Mix::A => ("0.5", "0.5"),
            Mix::B => ("0.95", "0.05"),
        }
    }
}

/// The YCSB binding (`-db`) of a program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Binding {
    Redis,
    Memcached,
}

impl Binding {
    fn class(self) -> &'static str {
        match self {
            Binding::Redis => "farmap.ycsb.RedisClient",
            Binding::Memcached => "farmap.ycsb.MemcachedClient",
        }
    }

    fn port_property(self) -> &'static str {
        match self {
            Binding::Redis => "redis.port",
            Binding::Memcached => "memcached.port",
        }
    }

    fn host_property(self) -> &'static str {
        match self {
            Binding::Redis => "redis.host",
            Binding::Memcached => "memcached.host",
        }
    }
}

/// What one YCSB invocation is asked to do.
#[derive(Debug, Clone)]
pub struct Invocation {
    pub binding: Binding,
    pub port: u16,
    pub records: u64,
    /// `None`: the load phase; `Some`: the run phase with this mix and operation count.
    pub run: Option<(Mix, u64)>,
    pub threads: u32,
}

impl Invocation {
    /// YCSB's arguments after the classpath (`site.ycsb.Client ...`).
    pub fn args(&self) -> Vec<String> {
        let mut a: Vec<String> = vec!["site.ycsb.Client".into()];
        a.push(if self.run.is_some() { "-t" } else { "-load" }.into());
        a.extend(["-db".into(), self.binding.class().into()]);
        let mut p = |k: &str, v: String| {
            a.push("-p".into());
            a.push(format!("{k}={v}"));
        };
        p("workload", "site.ycsb.workloads.CoreWorkload".into());
        p(self.binding.host_property(), "127.0.0.1".into());
        p(self.binding.port_property(), self.port.to_string());
        p("recordcount", self.records.to_string());
        p("fieldcount", FIELDS.to_string());
        p("fieldlength", FIELD_LENGTH.to_string());
        p("fieldlengthdistribution", "constant".into());
        p("dataintegrity", "true".into());
        p("insertorder", "ordered".into());
        p("zeropadding", ZERO_PADDING.to_string());
        p("readallfields", "true".into());
        p("measurementtype", "hdrhistogram".into());
        p("hdrhistogram.percentiles", "50,99,99.9".into());
        if let Some((mix, ops)) = self.run {
            let (read, update) = mix.proportions();
            p("operationcount", ops.to_string());
            p("requestdistribution", "zipfian".into());
            p("readproportion", read.into());
            p("updateproportion", update.into());
            p("scanproportion", "0".into());
            p("insertproportion", "0".into());
        }
        a.extend(["-threads".into(), self.threads.to_string()]);
        a
    }
}

/// The figures of one YCSB invocation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    /// `[OVERALL], Throughput(ops/sec)`.
    pub ops_per_s: f64,
    /// `[OVERALL], RunTime(ms)`.
    pub runtime_ms: f64,
    /// Per operation (`READ`, `UPDATE`, `INSERT`, ...): its metrics by name
    /// (`Operations`, `50thPercentileLatency(us)`, `Return=OK`, ...).
    pub ops: BTreeMap<String, BTreeMap<String, f64>>,
}

impl Report {
    /// Parses YCSB's summary (`[SECTION], metric, value` lines; anything else is skipped).
    pub fn parse(out: &str) -> anyhow::Result<Report> {
        let mut r = Report::default();
        for line in out.lines() {
            let Some(rest) = line.strip_prefix('[') else {
                continue;
            };
            let Some((section, rest)) = rest.split_once("], ") else {
                continue;
            };
            let Some((metric, value)) = rest.rsplit_once(", ") else {
                continue;
            };
            let Ok(value) = value.trim().parse::<f64>() else {
                continue;
            };
            match (section, metric.trim()) {
                ("OVERALL", "Throughput(ops/sec)") => r.ops_per_s = value,
                ("OVERALL", "RunTime(ms)") => r.runtime_ms = value,
                (s, m) => {
                    r.ops
                        .entry(s.to_owned())
                        .or_default()
                        .insert(m.to_owned(), value);
                }
            }
        }
        if r.ops_per_s <= 0.0 || r.ops.is_empty() {
            bail!("YCSB printed no [OVERALL] throughput or no operations");
        }
        Ok(r)
    }

    /// A metric of an operation (`READ`, `50thPercentileLatency(us)`).
    pub fn metric(&self, op: &str, metric: &str) -> Option<f64> {
        self.ops.get(op)?.get(metric).copied()
    }

    /// A latency percentile of an operation, in µs (`pct`: "50th", "99th", "99.9").
    pub fn percentile_us(&self, op: &str, pct: &str) -> Option<f64> {
        self.metric(op, &format!("{pct}PercentileLatency(us)"))
    }

    /// Operations that returned anything but OK, by operation and return code (YCSB's
    /// `Return=` lines; `dataintegrity` failures are among them).
    pub fn not_ok(&self) -> Vec<String> {
        let mut bad = Vec::new();
        for (op, metrics) in &self.ops {
            for (m, v) in metrics {
                if let Some(code) = m.strip_prefix("Return=") {
                    if code != "OK" && *v > 0.0 {
                        bad.push(format!("{op} {code}: {v}"));
                    }
                }
            }
        }
        bad
    }

    /// Operations that returned OK, over every operation kind except the checks YCSB's
    /// `dataintegrity` adds (`VERIFY`).
    pub fn ok(&self) -> f64 {
        self.ops
            .iter()
            .filter(|(op, _)| op.as_str() != "VERIFY" && !op.ends_with("-FAILED"))
            .filter_map(|(_, m)| m.get("Return=OK"))
            .sum()
    }
}

/// Where YCSB's classpath comes from: `FARMAP_YCSB_CLASSPATH`, else what
/// `scripts/ycsb/build.sh` prints (found in the current directory or above the farmap
/// binary: a checkout's `target/<profile>/farmap`).
pub fn classpath(explicit: Option<&str>) -> anyhow::Result<String> {
    if let Some(cp) = explicit {
        return Ok(cp.to_owned());
    }
    if let Ok(cp) = std::env::var("FARMAP_YCSB_CLASSPATH") {
        if !cp.is_empty() {
            return Ok(cp);
        }
    }
    let script = build_script().context(
        "YCSB's classpath: set FARMAP_YCSB_CLASSPATH or --ycsb-classpath, or run from a farmap \
         checkout (scripts/ycsb/build.sh fetches and builds it)",
    )?;
    let out = Command::new("bash")
        .arg(&script)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !out.status.success() {
        bail!("{} failed ({})", script.display(), out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("CLASSPATH="))
        .map(str::to_owned)
        .with_context(|| format!("{} printed no CLASSPATH= line", script.display()))
}

fn build_script() -> Option<PathBuf> {
    let rel = Path::new("scripts/ycsb/build.sh");
    let mut starts = vec![];
    if let Ok(d) = std::env::current_dir() {
        starts.push(d);
    }
    if let Ok(exe) = std::env::current_exe() {
        starts.push(exe);
    }
    starts
        .iter()
        .flat_map(|s| s.ancestors())
        .map(|d| d.join(rel))
        .find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    const RUN_B: &str = "\
YCSB Client 0.17.0
Loading workload...
Starting test.
[OVERALL], RunTime(ms), 4210
[OVERALL], Throughput(ops/sec), 11876.484560570072
[READ], Operations, 47512
[READ], AverageLatency(us), 310.5
[READ], 50thPercentileLatency(us), 251
[READ], 99thPercentileLatency(us), 1203
[READ], 99.9PercentileLatency(us), 4311
[READ], Return=OK, 47512
[UPDATE], Operations, 2488
[UPDATE], 99thPercentileLatency(us), 1500
[UPDATE], Return=OK, 2488
[VERIFY], Operations, 47512
[VERIFY], Return=OK, 47512
";

    #[test]
    fn a_run_phase_gives_throughput_percentiles_and_returns() {
        let r = Report::parse(RUN_B).unwrap();
        assert!((r.ops_per_s - 11876.48).abs() < 0.01);
        assert_eq!(r.runtime_ms, 4210.0);
        assert_eq!(r.percentile_us("READ", "50th"), Some(251.0));
        assert_eq!(r.percentile_us("READ", "99th"), Some(1203.0));
        assert_eq!(r.percentile_us("READ", "99.9"), Some(4311.0));
        assert_eq!(r.percentile_us("UPDATE", "99th"), Some(1500.0));
        assert!(r.not_ok().is_empty());
        assert_eq!(r.ok(), 50_000.0);
    }

    #[test]
    fn a_failed_check_or_error_is_not_ok() {
        let bad = RUN_B.replace(
            "[VERIFY], Return=OK, 47512",
            "[VERIFY], Return=OK, 47511\n[VERIFY], Return=UNEXPECTED_STATE, 1",
        );
        let r = Report::parse(&bad).unwrap();
        assert_eq!(r.not_ok(), vec!["VERIFY UNEXPECTED_STATE: 1".to_owned()]);
    }

    #[test]
    fn real_outputs_parse() {
        let b = Report::parse(include_str!("testdata/ycsb-redis-b.txt")).unwrap();
        assert!(b.ops_per_s > 1000.0);
        for pct in ["50th", "99th", "99.9"] {
            assert!(b.percentile_us("READ", pct).is_some(), "{pct}");
        }
        assert!(b.not_ok().is_empty(), "{:?}", b.not_ok());
        let mc = Report::parse(include_str!("testdata/ycsb-memcached-b.txt")).unwrap();
        assert!(mc.not_ok().is_empty() && mc.percentile_us("UPDATE", "99th").is_some());
        let load = Report::parse(include_str!("testdata/ycsb-redis-load.txt")).unwrap();
        assert!(load.metric("INSERT", "Return=OK").unwrap() > 0.0);
        // One corrupted field and one deleted key, caught by YCSB's own checks.
        let bad = Report::parse(include_str!("testdata/ycsb-redis-verify-failed.txt")).unwrap();
        let not_ok = bad.not_ok().join(", ");
        assert!(not_ok.contains("VERIFY UNEXPECTED_STATE"), "{not_ok}");
        assert!(not_ok.contains("READ NOT_FOUND"), "{not_ok}");
    }

    #[test]
    fn output_without_a_summary_is_an_error() {
        assert!(Report::parse("Error: could not connect\n").is_err());
    }

    #[test]
    fn the_run_phase_asks_for_the_mix_and_checks_values() {
        let a = Invocation {
            binding: Binding::Redis,
            port: 7000,
            records: 1000,
            run: Some((Mix::B, 5000)),
            threads: 4,
        }
        .args();
        for want in [
            "-t",
            "farmap.ycsb.RedisClient",
            "redis.port=7000",
            "readproportion=0.95",
            "updateproportion=0.05",
            "requestdistribution=zipfian",
            "dataintegrity=true",
            "operationcount=5000",
        ] {
            assert!(a.iter().any(|x| x == want), "{want} missing in {a:?}");
        }
        let load = Invocation {
            binding: Binding::Memcached,
            port: 7001,
            records: 1000,
            run: None,
            threads: 4,
        }
        .args();
        assert!(load.iter().any(|x| x == "-load"));
        assert!(load.iter().any(|x| x == "memcached.port=7001"));
        assert!(!load.iter().any(|x| x.starts_with("operationcount")));
    }
}
