//! `farmap bench slope` moves an object between two of its node processes for every case,
//! size and chunk, prints one JSON line each with the keys, and checks the
//! destination's copy.

mod common;
use common::farmap;

#[test]
fn bench_slope_moves_both_vectors_at_both_chunks_and_verifies() {
    let test = "bench_slope_moves_both_vectors_at_both_chunks_and_verifies";
    if farmap_testkit::skip::unless(test, farmap_uffd::probe()).is_none() {
        return;
    }
    let rows = farmap().json_lines(&[
        "bench",
        "slope",
        "--pages",
        "200",
        "--page",
        "4KiB,64KiB",
        "--runs",
        "1",
        "--json",
    ]);
    assert_eq!(rows.len(), 4, "{rows:?}");
    for (i, row) in rows.iter().enumerate() {
        let object = ["vector-clean", "vector-dirty"][i % 2];
        let page: u64 = if i < 2 { 4096 } else { 65536 };
        assert_eq!(row["bench"], "slope");
        assert_eq!(row["object"], object, "{row}");
        assert_eq!(row["page_bytes"], page, "{row}");
        assert_eq!(row["pages_asked"], 200, "{row}");
        assert_eq!(row["verified"], true, "{row}");
        // The vector's 200 pages, its header and heap metadata, in whole chunks (a fault
        // installs its chunk).
        let pages = row["pages"].as_u64().unwrap();
        assert!((200..=320).contains(&pages), "{row}");
        for key in [
            "prefill_ms",
            "prefill_mb_per_s",
            "tcp_raw_mb_per_s",
            "no_owner_us",
            "read_unavailable_ms",
            "write_unavailable_ms",
            "end_to_end_ms",
            "bytes_moved",
            "bytes_ratio",
        ] {
            assert!(row[key].as_f64().is_some_and(|v| v > 0.0), "{key} in {row}");
        }
        // Every page went at least once; the frames' overhead is small.
        let ratio = row["bytes_ratio"].as_f64().unwrap();
        assert!((1.0..1.05).contains(&ratio), "{row}");
        match object {
            "vector-clean" => assert!(row["writer_ops_ratio_during_prefill"].is_null(), "{row}"),
            _ => assert!(
                row["writer_ops_ratio_during_prefill"].as_f64().unwrap() > 0.0,
                "{row}"
            ),
        }
    }
}
