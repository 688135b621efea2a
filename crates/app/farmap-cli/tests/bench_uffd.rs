//! `farmap bench uffd --json`, run for real on a small region: every row has the keys the
//! benchmark promises and values that make sense. No speed is asserted: benchmarks are not
//! correctness tests.

use serde_json::Value;

mod common;
use common::farmap;

/// The number `key` of `row`.
fn num(row: &Value, key: &str) -> f64 {
    farmap_testkit::cli::number(row, key)
}

#[test]
fn bench_uffd_prints_one_sane_json_row_per_case() {
    let test = "bench_uffd_prints_one_sane_json_row_per_case";
    if farmap_testkit::skip::unless(test, farmap_uffd::probe()).is_none() {
        return;
    }
    let rows = farmap().json_lines(&[
        "bench",
        "uffd",
        "--json",
        "--size",
        "64MiB",
        "--samples",
        "2000",
    ]);

    let cases: Vec<(&str, Option<u64>)> = rows
        .iter()
        .map(|r| {
            (
                r["case"].as_str().unwrap_or("?"),
                r["dirty_percent"].as_u64(),
            )
        })
        .collect();
    assert_eq!(
        cases,
        [
            ("fault-4k", None),
            ("fill-4k", None),
            ("fill-64k", None),
            ("fill-1m", None),
            ("dirty-scan", Some(0)),
            ("dirty-scan", Some(1)),
            ("dirty-scan", Some(100)),
        ],
        "one row per case and dirty fraction, in order"
    );

    for row in &rows {
        assert_eq!(row["bench"], "uffd", "{row}");
        assert_eq!(row["size_bytes"], 64u64 << 20, "{row}");
        assert!(num(row, "chunk_bytes") >= 4096.0, "{row}");
        let positive: &[&str] = match row["case"].as_str().unwrap() {
            "fault-4k" => {
                assert_eq!(row["chunk_bytes"], 4096, "{row}");
                assert_eq!(row["samples"], 2000, "{row}");
                assert!(num(row, "p50_us") <= num(row, "p99_us"), "{row}");
                assert!(
                    num(row, "baseline_p50_us") <= num(row, "baseline_p99_us"),
                    "{row}"
                );
                &[
                    "p50_us",
                    "p99_us",
                    "baseline_p50_us",
                    "baseline_p99_us",
                    "baseline_missing_p50_us",
                    "faults",
                ]
            }
            case @ ("fill-4k" | "fill-64k" | "fill-1m") => {
                let chunk = match case {
                    "fill-4k" => 4096,
                    "fill-64k" => 65536,
                    _ => 1 << 20,
                };
                assert_eq!(row["chunk_bytes"], chunk, "{row}");
                assert_eq!(
                    row["verified"], true,
                    "the region must read as its store: {row}"
                );
                // Rates are printed to 0.1 MB/s, the ratio to 0.001 from unrounded rates.
                assert!(
                    farmap_testkit::printed::ratio_agrees(
                        num(row, "ratio_to_baseline"),
                        0.001,
                        num(row, "mb_per_s"),
                        num(row, "baseline_mb_per_s"),
                        0.1,
                    ),
                    "ratio_to_baseline must be mb_per_s / baseline_mb_per_s: {row}"
                );
                &[
                    "mb_per_s",
                    "baseline_mb_per_s",
                    "baseline_missing_mb_per_s",
                    "memcpy_mb_per_s",
                    "ratio_to_baseline",
                    "faults",
                ]
            }
            "dirty-scan" => {
                // Every written page is reported (a page is in one chunk at most); the 0%
                // row times a scan of a clean range, which finds nothing.
                assert_eq!(row["pages"], row["written_pages"], "{row}");
                assert!(num(row, "dirty_chunks") <= num(row, "pages"), "{row}");
                if row["dirty_percent"] == 0 {
                    assert_eq!(row["pages"], 0, "{row}");
                    &["ms", "baseline_ms"]
                } else {
                    &["ms", "pages", "dirty_chunks", "baseline_ms"]
                }
            }
            other => panic!("unexpected case {other}"),
        };
        for key in positive {
            assert!(num(row, key) > 0.0, "{key} must be positive: {row}");
        }
    }
}

#[test]
fn bench_uffd_refuses_a_region_too_small_to_measure() {
    let err = farmap().fails(&["bench", "uffd", "--size", "64KiB"]);
    assert!(err.contains("at least 1MiB"), "{err}");
}

/// `refault-staged`, served by the reader and then in the faulting thread: one row each,
/// every timed re-fault counted on the path the flag chose, with the raw in-thread reference.
#[test]
fn bench_uffd_refault_staged_says_which_path_served() {
    let test = "bench_uffd_refault_staged_says_which_path_served";
    let Some(support) = farmap_testkit::skip::unless(test, farmap_uffd::probe()) else {
        return;
    };
    if support.features & farmap_uffd::sys::UFFD_FEATURE_MOVE == 0 {
        farmap_testkit::skip(test, "the kernel lacks UFFDIO_MOVE");
        return;
    }
    for in_thread in [false, true] {
        let mut args = vec![
            "bench",
            "uffd",
            "--json",
            "--size",
            "16MiB",
            "--samples",
            "500",
            "--case",
            "refault-staged",
        ];
        if in_thread {
            args.push("--in-thread");
        }
        let row = &farmap().json(&args);
        assert_eq!(row["case"], "refault-staged", "{row}");
        assert_eq!(row["in_thread"], in_thread, "{row}");
        assert_eq!(row["samples"], 500, "{row}");
        assert!(num(row, "p50_us") > 0.0 && num(row, "p50_us") <= num(row, "p99_us"));
        // The raw in-thread reference ran (it fails the run if a page was not moved back).
        let raw = num(row, "baseline_in_thread_p50_us");
        assert!(
            raw > 0.0 && raw <= num(row, "baseline_in_thread_p99_us"),
            "{row}"
        );
        let (served_in_thread, posted) =
            (num(row, "faults_in_thread"), num(row, "faults_signalled"));
        let by_reader = num(row, "faults_polled") + num(row, "faults_slept");
        if in_thread {
            assert_eq!(
                (served_in_thread, posted, by_reader),
                (500.0, 0.0, 0.0),
                "{row}"
            );
        } else {
            assert_eq!((served_in_thread, by_reader), (0.0, 500.0), "{row}");
        }
    }
}
