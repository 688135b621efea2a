//! `farmap bench net` runs every case (through the delay proxy, or directly at an RTT of 0)
//! and prints one JSON line each.

mod common;
use common::farmap;

/// Runs `farmap bench net --json ARGS` and returns its rows.
fn bench_net_rows(args: &[&str]) -> Vec<serde_json::Value> {
    let mut all = vec!["bench", "net", "--json"];
    all.extend_from_slice(args);
    farmap().json_lines(&all)
}

#[test]
fn bench_net_prints_every_case_per_rtt() {
    let rows = bench_net_rows(&[
        "--size",
        "8MiB",
        "--rtt",
        "0ms,2ms",
        "--workers",
        "64",
        "--connections",
        "2",
        "--direct-time",
        "100ms",
    ]);
    let cases = [
        "tcp-raw",
        "tcp-region",
        "direct-native",
        "managed-native",
        "managed-grpc",
    ];
    assert_eq!(rows.len(), 2 * cases.len(), "{rows:?}");
    for (i, row) in rows.iter().enumerate() {
        assert_eq!(row["bench"], "net");
        assert_eq!(row["case"], cases[i % cases.len()]);
        let rtt = row["rtt_ms"].as_f64().unwrap();
        assert_eq!(rtt, if i < cases.len() { 0.0 } else { 2.0 });
        assert!(row["mb_per_s"].as_f64().unwrap() > 0.0, "{row}");
        assert_eq!(row["verified"], true, "{row}");
        // At 0 ms the clients connect directly, through the proxy otherwise.
        assert_eq!(row["proxied"], rtt > 0.0, "{row}");
        // The proxy adds the round trip: no reply can come back sooner.
        let first_us = row["first_chunk_us"].as_f64().unwrap();
        assert!(first_us >= rtt * 1000.0, "{row}");
        assert!(row["cpu_ms"].as_f64().unwrap() > 0.0, "{row}");
        // Every case after tcp-region is read against it (the bar's reference); the two
        // rates are printed rounded, hence the relative tolerance.
        let ratio = &row["ratio_to_tcp_region"];
        if i % cases.len() > 1 {
            let region = rows[i - i % cases.len() + 1]["mb_per_s"].as_f64().unwrap();
            let want = row["mb_per_s"].as_f64().unwrap() / region;
            let got = ratio
                .as_f64()
                .unwrap_or_else(|| panic!("no ratio in {row}"));
            assert!(
                (got - want).abs() <= 0.01 * want + 0.001,
                "{got} vs {want}: {row}"
            );
        } else {
            assert!(ratio.is_null(), "{row}");
        }
    }
}

#[test]
fn bench_net_streams_into_a_region_and_through_the_proxy_at_zero_rtt() {
    let rows = bench_net_rows(&[
        "--size",
        "8MiB",
        "--rtt",
        "0ms",
        "--case",
        "tcp-raw,tcp-region,tcp-proxied",
    ]);
    let cases: Vec<&str> = rows.iter().map(|r| r["case"].as_str().unwrap()).collect();
    assert_eq!(cases, ["tcp-raw", "tcp-region", "tcp-proxied"], "{rows:?}");
    for row in &rows {
        assert_eq!(row["size_bytes"], 8 << 20, "{row}");
        assert!(row["mb_per_s"].as_f64().unwrap() > 0.0, "{row}");
        assert!(row["cpu_ms"].as_f64().unwrap() > 0.0, "{row}");
        // tcp-region checks what it received against the region.
        assert_eq!(row["verified"], true, "{row}");
        // Only tcp-proxied goes through the proxy at an RTT of 0.
        assert_eq!(row["proxied"], row["case"] == "tcp-proxied", "{row}");
    }
}
