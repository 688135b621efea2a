//! `farmap bench fuse --json`, run for real and small: for each case, one row per frontend
//! (memcpy, fuse, uffd) with the data checked, and the FUSE rows naming the mount's request
//! size, which `--max-request` sets. No speed is asserted: benchmarks are not correctness
//! tests.

mod common;
use common::farmap;

#[test]
fn bench_fuse_prints_a_checked_row_per_case_and_frontend() {
    let test = "bench_fuse_prints_a_checked_row_per_case_and_frontend";
    if !farmap_testkit::skip::fuse_mountable(test)
        || farmap_testkit::skip::unless(test, farmap_uffd::probe()).is_none()
    {
        return;
    }
    for (max, want) in [(None, 1u64 << 20), (Some("256KiB"), 256 << 10)] {
        let mut args = vec![
            "bench",
            "fuse",
            "--size",
            "8MiB",
            "--samples",
            "200",
            "--json",
        ];
        if let Some(m) = max {
            args.extend(["--max-request", m]);
        }
        let rows = farmap().json_lines(&args);
        for case in ["seq-read", "rand-read-4k"] {
            for frontend in ["memcpy", "fuse", "uffd"] {
                let row = rows
                    .iter()
                    .find(|r| r["case"] == case && r["frontend"] == frontend)
                    .unwrap_or_else(|| panic!("no {case} row for {frontend}: {rows:?}"));
                assert_eq!(row["verified"], true, "{row}");
                assert!(farmap_testkit::cli::number(row, "mb_per_s") > 0.0, "{row}");
                if frontend == "fuse" {
                    assert_eq!(row["max_request_bytes"], want, "{row}");
                } else {
                    assert!(row.get("max_request_bytes").is_none(), "{row}");
                }
            }
        }
    }
    let err = farmap().fails(&["bench", "fuse", "--max-request", "3KiB", "--json"]);
    assert!(
        err.contains("--max-request must be a power of two"),
        "{err}"
    );
}
