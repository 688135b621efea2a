//! `farmap bench paging --json`, run for real and small: one line per system and pattern,
//! every key the benchmark promises with a sane type, the application's own check passed,
//! the farmap limit applied (evictions at 30%) and the kernel baseline swapping (faults).
//! No speed is asserted: benchmarks are not correctness tests.

use serde_json::Value;

mod common;
use common::farmap;

const PATTERNS: [&str; 3] = ["seq", "uniform", "zipf"];

/// Why the kernel-swap baseline cannot run here, if it cannot (the benchmark then skips it).
fn kernel_swap_unavailable() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("not root".into());
    }
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let v1_memory = mounts.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.len() >= 4 && f[2] == "cgroup" && f[3].split(',').any(|o| o == "memory")
    });
    let controllers = std::fs::read_to_string("/proc/cgroups").unwrap_or_default();
    let memory_enabled = controllers.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.first() == Some(&"memory") && f.get(3) == Some(&"1")
    });
    if !v1_memory && !memory_enabled {
        return Some("no memory cgroup controller".into());
    }
    if !std::path::Path::new("/dev/loop-control").exists() {
        return Some("no loop devices (/dev/loop-control)".into());
    }
    for tool in ["losetup", "mkswap", "swapon", "swapoff"] {
        let found = ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
            .iter()
            .any(|d| std::path::Path::new(d).join(tool).exists());
        if !found {
            return Some(format!("{tool} (util-linux) is not installed"));
        }
    }
    None
}

/// The number `key` of `row`.
fn num(row: &Value, key: &str) -> f64 {
    farmap_testkit::cli::number(row, key)
}

#[test]
fn bench_paging_prints_one_sane_line_per_system_and_pattern() {
    let test = "bench_paging_prints_one_sane_line_per_system_and_pattern";
    if farmap_testkit::skip::unless(test, farmap_uffd::probe()).is_none() {
        return;
    }
    let no_kernel = kernel_swap_unavailable();
    let mut args = vec![
        "bench",
        "paging",
        "--json",
        "--size",
        "32MiB",
        "--accesses",
        "4000",
        "--local",
        "30%",
        "--threads",
        "2",
        // Every faulting access is "slow" at 0: each must be printed on stderr.
        "--trace-slow",
        "0us",
    ];
    if no_kernel.is_some() {
        args.extend(["--system", "farmap"]);
    }
    let child = farmap()
        .command()
        .args(&args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run farmap");
    let pid = child.id();
    let out = child.wait_with_output().expect("run farmap");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "farmap bench paging failed: {stderr}");
    assert!(
        !stderr.contains("skipped kernel-swap"),
        "the kernel-swap baseline was skipped although it should run here: {stderr}"
    );
    let rows: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?} is not JSON")))
        .collect();

    let mut expected = Vec::new();
    for p in PATTERNS {
        expected.push(("farmap", p));
        if no_kernel.is_none() {
            expected.push(("kernel-swap", p));
        }
    }
    let got: Vec<(&str, &str)> = rows
        .iter()
        .map(|r| {
            (
                r["system"].as_str().unwrap_or("?"),
                r["pattern"].as_str().unwrap_or("?"),
            )
        })
        .collect();
    assert_eq!(got, expected, "one line per system and pattern, in order");

    // `--trace-slow 0us`: one line per faulting access of every run (the unlimited runs
    // that the runtimes are normalised to included), of both systems.
    let traced: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("slow access: "))
        .collect();
    let faulting: f64 = rows.iter().map(|r| num(r, "faulting_accesses")).sum();
    assert!(
        traced.len() as f64 >= faulting,
        "{} traced accesses, {faulting} faulting ones in the results",
        traced.len()
    );
    for l in &traced {
        let f: Vec<&str> = l["slow access: ".len()..].split(' ').collect();
        let keys: Vec<&str> = f.iter().map(|kv| kv.split('=').next().unwrap()).collect();
        assert_eq!(keys, ["end", "us", "write", "page", "tid"], "{l}");
        let value = |i: usize| f[i].split_once('=').unwrap().1;
        assert!(value(0).parse::<f64>().unwrap() > 0.0, "{l}");
        assert!(value(3).parse::<u64>().unwrap() < (32 << 20) / 4096, "{l}");
        assert!(value(4).parse::<u32>().unwrap() > 0, "{l}");
    }

    for row in &rows {
        assert_eq!(row["bench"], "paging", "{row}");
        assert_eq!(row["local_percent"], 30.0, "{row}");
        assert!(row["prefetch"].is_string(), "{row}");
        assert_eq!(
            row["verified"], true,
            "the application's check failed: {row}"
        );
        assert_eq!(row["accesses"], 4000, "{row}");
        for key in [
            "faults",
            "evictions_reactive",
            "evictions_proactive",
            "prefetch_hits",
            "prefetch_wasted",
        ] {
            assert!(row[key].is_u64(), "{key} is not a count in {row}");
        }
        assert!(num(row, "runtime_ms") > 0.0, "{row}");
        assert!(num(row, "runtime_ratio") > 0.0, "{row}");
        // At 30% local memory the application faults, so the percentiles exist and are
        // ordered.
        assert!(num(row, "faulting_accesses") > 0.0, "{row}");
        let ps: Vec<f64> = ["p50_us", "p95_us", "p99_us", "p99_9_us"]
            .iter()
            .map(|k| num(row, k))
            .collect();
        assert!(ps[0] > 0.0 && ps.windows(2).all(|w| w[0] <= w[1]), "{row}");
        match row["system"].as_str().unwrap() {
            "farmap" => {
                // The defaults: sequential prefetch, page-sized chunks.
                assert_eq!(row["prefetch"], "seq:32", "{row}");
                assert_eq!(row["chunk_bytes"], 4096, "{row}");
                assert!(num(row, "faults") > 0.0, "{row}");
                // The limit is applied: chunks were evicted in the timed phase.
                assert!(
                    num(row, "evictions_reactive") + num(row, "evictions_proactive") > 0.0,
                    "no eviction at 30%: the limit was not applied: {row}"
                );
                // 30% of 32 MiB, in whole 4 KiB chunks.
                assert_eq!(row["limit_bytes"], 2457 * 4096, "{row}");
                // Faults that found the region full go over the limit (within `min_free`)
                // while a reclaim makes room: never more overcommits than such faults.
                let (full, over) = (num(row, "full_faults"), num(row, "overcommits"));
                assert!(
                    over <= full,
                    "{over} overcommits, {full} full faults: {row}"
                );
            }
            "kernel-swap" => {
                assert!(
                    num(row, "faults") > 0.0,
                    "the kernel baseline did not fault: {row}"
                );
                assert!(row["majflt"].is_u64() && row["minflt"].is_u64(), "{row}");
                // The memory limit: 30% of the size plus the child's small overhead.
                let limit = num(row, "limit_bytes");
                let local = 0.3 * (32u64 << 20) as f64;
                assert!(limit > local && limit < local + (16 << 20) as f64, "{row}");
            }
            other => panic!("unknown system {other}"),
        }
    }
    // Nothing left behind: the run's directory (the swap file's tmpfs, unmounted only after
    // swapoff and losetup -d) is gone.
    let dir = format!("/run/farmap-bench-paging-{pid}");
    assert!(
        !std::path::Path::new(&dir).exists(),
        "{dir} was left behind"
    );
    if let Some(why) = no_kernel {
        farmap_testkit::skip(test, format_args!("kernel-swap baseline: {why}"));
    }
}
