//! `farmap bench migrate` runs every mode on one workload for every size, prints one JSON
//! line each with the issue's keys, and checks every destination byte for byte.

mod common;
use common::farmap;

#[test]
fn bench_migrate_runs_every_mode_for_every_size_and_verifies() {
    let test = "bench_migrate_runs_every_mode_for_every_size_and_verifies";
    if farmap_testkit::skip::unless(test, farmap_uffd::probe()).is_none() {
        return;
    }
    let rows = farmap().json_lines(&[
        "bench",
        "migrate",
        "--modes",
        "instant,precopy,postcopy",
        "--sizes",
        "8MiB,16MiB",
        "--working-set",
        "2MiB",
        "--warmup",
        "200ms",
        "--settle",
        "3s",
        "--json",
    ]);
    assert_eq!(rows.len(), 6, "{rows:?}");
    for (i, row) in rows.iter().enumerate() {
        let mode = ["instant", "precopy", "postcopy"][i % 3];
        let size: u64 = if i < 3 { 8 << 20 } else { 16 << 20 };
        assert_eq!(row["bench"], "migrate");
        assert_eq!(row["mode"], mode, "{row}");
        assert_eq!(row["region_bytes"], size, "{row}");
        assert_eq!(row["working_set_bytes"], 2 << 20, "{row}");
        assert_eq!(row["verified"], true, "{row}");
        for key in [
            "downtime_ms",
            "bytes_before_resume",
            "effective_downtime_ms",
            "bytes_precopy",
            "bytes_postcopy",
            "chunks_from_store",
            "chunks_from_source",
            "verify_failures",
        ] {
            assert!(row[key].is_number(), "{key} in {row}");
        }
        assert!(row.get("ttr80_ms").is_some(), "{row}");
        let chunks = size / (64 << 10);
        let before = row["bytes_before_resume"].as_u64().unwrap();
        match mode {
            "instant" => {
                assert_eq!(row["bytes_precopy"], 0, "{row}");
                assert!(before <= 32 * chunks + 65536, "{row}");
                let (store, source) = (
                    row["chunks_from_store"].as_u64().unwrap(),
                    row["chunks_from_source"].as_u64().unwrap(),
                );
                assert_eq!(store + source, chunks, "{row}");
                assert!(
                    store >= chunks - 32,
                    "the chunks outside the working set: {row}"
                );
                assert_eq!(row["verify_failures"], 0, "{row}");
            }
            // Pre-copy pulls the whole region before resuming.
            "precopy" => assert!(before >= size, "{row}"),
            _ => {
                assert_eq!(row["bytes_precopy"], 0, "{row}");
                assert!(row["bytes_postcopy"].as_u64().unwrap() >= size, "{row}");
            }
        }
    }
}

#[test]
fn bench_migrate_refuses_bad_sizes_clearly() {
    let err = farmap().fails(&[
        "bench",
        "migrate",
        "--sizes",
        "1MiB",
        "--working-set",
        "4MiB",
    ]);
    assert!(err.contains("working set"), "{err}");
    let err = farmap().fails(&["bench", "migrate", "--modes", "teleport"]);
    assert!(err.contains("precopy, postcopy or instant"), "{err}");
}
