//! `farmap bench timer` and `farmap bench proxy --json`, each run once at a tiny size: every
//! row has the keys the benchmark promises, and the checks the benchmark itself makes (never
//! early, data intact) hold. No figure is asserted: precision and throughput are measured by
//! these benchmarks, not by tests.

use serde_json::Value;

mod common;
use common::farmap;

/// Runs `farmap bench ARGS --json` and returns its rows.
fn bench(args: &[&str]) -> Vec<Value> {
    let mut all = vec!["bench"];
    all.extend_from_slice(args);
    all.push("--json");
    farmap().json_lines(&all)
}

/// `row` is an object with exactly `keys`, and `numbers` of them are numbers.
fn has_keys(row: &Value, keys: &[&str], numbers: &[&str]) {
    let obj = row
        .as_object()
        .unwrap_or_else(|| panic!("{row} is not an object"));
    let mut got: Vec<&str> = obj.keys().map(String::as_str).collect();
    let mut want = keys.to_vec();
    got.sort_unstable();
    want.sort_unstable();
    assert_eq!(got, want, "keys of {row}");
    for k in numbers {
        assert!(row[k].is_number(), "{k} is not a number in {row}");
    }
}

#[test]
fn bench_timer_prints_one_row_per_case() {
    let rows = bench(&[
        "timer",
        "--sleep",
        "1ms",
        "--tasks",
        "10",
        "--sleeps",
        "5",
        "--bytes",
        "256KiB",
        "--bandwidth",
        "64MiB",
    ]);
    let cases: Vec<&str> = rows
        .iter()
        .map(|r| r["case"].as_str().unwrap_or("?"))
        .collect();
    assert_eq!(
        cases,
        [
            "timer",
            "tokio-sleep",
            "delayed-concurrent",
            "delayed-bandwidth-write",
            "delayed-bandwidth-read"
        ]
    );
    let sleep_keys = [
        "bench",
        "case",
        "sleep_us",
        "tasks",
        "sleeps",
        "early",
        "mean_late_us",
        "p50_late_us",
        "p99_late_us",
        "max_late_us",
        "sleeps_per_s",
        "elapsed_ms",
    ];
    for row in &rows[..2] {
        has_keys(row, &sleep_keys, &sleep_keys[2..]);
        assert_eq!(row["sleeps"], 50, "{row}");
    }
    // The farmap timer is never early (tokio's sleep is the reference, not under test).
    assert_eq!(rows[0]["early"], 0, "{}", rows[0]);
    let delayed_keys = [
        "bench",
        "case",
        "latency_us",
        "tasks",
        "bytes",
        "ideal_ms",
        "elapsed_ms",
        "ratio_to_ideal",
        "mb_per_s",
        "bandwidth_mb_per_s",
        "verified",
    ];
    for row in &rows[2..] {
        has_keys(row, &delayed_keys, &delayed_keys[2..9]);
        assert_eq!(row["verified"], true, "{row}");
    }
    assert!(rows[2]["bandwidth_mb_per_s"].is_null());
    assert!(rows[3]["bandwidth_mb_per_s"].is_number());
    for row in &rows {
        assert_eq!(row["bench"], "timer");
    }
}

#[test]
fn bench_proxy_prints_a_row_per_rtt_a_bulk_row_and_a_relay_row() {
    let rows = bench(&[
        "proxy",
        "--rtt",
        "0ms,1ms",
        "--pings",
        "5",
        "--bytes",
        "256KiB",
        "--bandwidth",
        "1Gbit",
        "--relay-bytes",
        "1000KiB",
    ]);
    let cases: Vec<&str> = rows
        .iter()
        .map(|r| r["case"].as_str().unwrap_or("?"))
        .collect();
    assert_eq!(cases, ["round-trip", "round-trip", "bulk", "relay"]);
    let rt_keys = [
        "bench",
        "case",
        "rtt_ms",
        "pings",
        "median_us",
        "min_us",
        "direct_median_us",
        "added_us",
        "early",
    ];
    for (row, rtt) in rows[..2].iter().zip([0.0, 1.0]) {
        has_keys(row, &rt_keys, &rt_keys[2..]);
        assert_eq!(row["rtt_ms"].as_f64(), Some(rtt), "{row}");
        // Never early: no round trip shorter than the rtt.
        assert_eq!(row["early"], 0, "{row}");
    }
    let bulk_keys = [
        "bench",
        "case",
        "bytes",
        "link_mb_per_s",
        "mb_per_s",
        "ratio_to_link",
        "elapsed_ms",
        "verified",
    ];
    has_keys(&rows[2], &bulk_keys, &bulk_keys[2..7]);
    assert_eq!(rows[2]["bytes"], 256 << 10);
    assert_eq!(rows[2]["verified"], true, "{}", rows[2]);
    let relay_keys = [
        "bench",
        "case",
        "bytes",
        "mb_per_s",
        "cpu_ns_per_byte",
        "relay_mb_per_s",
        "relay_cpu_ns_per_byte",
        "cpu_ratio",
        "verified",
    ];
    has_keys(&rows[3], &relay_keys, &relay_keys[2..8]);
    // A short last block (1000 KiB is 15.6 blocks of 64 KiB), every byte checked.
    assert_eq!(rows[3]["bytes"], 1000 << 10);
    assert_eq!(rows[3]["verified"], true, "{}", rows[3]);
    for row in &rows {
        assert_eq!(row["bench"], "proxy");
    }
}
