//! `farmap bench versions --json`, run for real and small: one checked row per case, with
//! the sizes that must hold whatever the machine's speed (a snapshot writes about what it
//! rewrote, forks copy no chunk), over a directory and over a real Redis. No speed is
//! asserted.

mod common;
use common::farmap;
use farmap_testkit::cli::number;
use farmap_testkit::{unique_name, Service};

#[test]
fn bench_versions_prints_a_checked_row_per_case() {
    let dir = tempfile::tempdir().unwrap();
    let objects = dir.path().join("objects");
    check(&["--dir", objects.to_str().unwrap()], "dir");
}

/// The same cases over a real Redis (`--objects`): the bytes are counted by listing and
/// reading the objects, and the same sizes hold.
#[test]
fn bench_versions_runs_over_another_object_store() {
    let svc = match Service::shared("redis") {
        Ok(s) => s,
        Err(e) => return farmap_testkit::skip("bench_versions_runs_over_another_object_store", e),
    };
    let spec = format!(
        "redis://127.0.0.1:{}/0?prefix={}",
        svc.var("PORT"),
        unique_name("bench-versions")
    );
    check(&["--objects", &spec], "redis");
}

/// The same cases over a farmap host that exports a directory's objects
/// (`farmap serve --objects`, another process).
#[test]
fn bench_versions_runs_over_a_farmap_objects_server() {
    let dir = tempfile::tempdir().unwrap();
    let served = format!("dir:{}", dir.path().display());
    let server = farmap()
        .listening(&[
            "serve",
            "--objects",
            &served,
            "--listen",
            "127.0.0.1:0",
            "-q",
        ])
        .drained();
    check(
        &["--objects", &format!("farmap://{}", server.addr())],
        "farmap",
    );
    assert!(dir.path().join("chunks").is_dir());
}

/// Runs the bench small with `extra` and checks its rows; `objects` is the store's kind.
fn check(extra: &[&str], objects: &str) {
    let mut args = vec![
        "bench", "versions", "--size", "8MiB", "--clones", "3", "--json",
    ];
    args.extend_from_slice(extra);
    let rows = farmap().json_lines(&args);
    let cases: Vec<&str> = rows.iter().map(|r| r["case"].as_str().unwrap()).collect();
    // The clones case maps regions: userfaultfd (CI machines have it).
    let uffd = farmap_uffd::probe().is_ok();
    let expect: &[&str] = if uffd {
        &[
            "create", "snapshot", "restore", "warm", "fork", "gc", "clones",
        ]
    } else {
        &["create", "snapshot", "restore", "warm", "fork", "gc"]
    };
    assert_eq!(cases, expect, "{rows:?}");
    for row in &rows {
        assert_eq!(row["bench"], "versions", "{row}");
        assert_eq!(row["objects"], objects, "{row}");
        assert_eq!(row["region_bytes"], 8u64 << 20, "{row}");
        assert_eq!(row["verified"], true, "{row}");
        assert!(number(row, "ms") >= 0.0, "{row}");
    }
    let create = &rows[0];
    assert!(
        number(create, "compression_ratio") > 1.0,
        "text chunks compress: {create}"
    );
    let snap = &rows[1];
    let (dirty, stored, written) = (
        number(snap, "dirty_bytes"),
        number(snap, "dirty_stored_bytes"),
        number(snap, "bytes_written"),
    );
    assert_eq!(dirty, 2.0 * 65536.0, "1% of 128 chunks, rounded up: {snap}");
    assert!(stored > 0.0 && written >= stored, "{snap}");
    assert!(
        written <= 1.2 * stored + 4096.0,
        "a snapshot writes what changed: {snap}"
    );
    let restore = &rows[2];
    assert!(number(restore, "time_to_first_access_ms") <= number(restore, "time_to_warm_ms"));
    let warm = &rows[3];
    assert!(number(warm, "cold_warm_ms") > 0.0, "{warm}");
    assert_eq!(
        warm["working_set_bytes"],
        32 * 65536,
        "a quarter of 128 chunks: {warm}"
    );
    let fork = &rows[4];
    assert_eq!(fork["clones"], 3);
    assert!(
        number(fork, "dedup_ratio") > 2.0,
        "forks share their base: {fork}"
    );
    assert!(
        number(fork, "store_ratio") <= 1.2,
        "forks store only what they rewrote: {fork}"
    );
    if uffd {
        let clones = &rows[6];
        assert_eq!(clones["clones"], 3, "{clones}");
        let one = number(clones, "one_clone_bytes");
        assert!(
            one >= 32.0 * 65536.0,
            "one clone holds its working set: {clones}"
        );
        assert!(
            number(clones, "host_memory_bytes") <= 1.3 * one,
            "three clones sharing clean pages cost about one: {clones}"
        );
        assert!(
            number(clones, "unshared_host_memory_bytes") >= 2.9 * one,
            "without sharing, three: {clones}"
        );
    }
    let gc = &rows[5];
    // 1% of 128 chunks from chunk 50: one chunk (text-like), stored, then freed.
    assert_eq!(gc["dirty_bytes"], 65536, "{gc}");
    assert!(number(gc, "bytes_freed") > 0.0, "{gc}");
    assert_eq!(
        gc["store_bytes"], fork["store_bytes"],
        "the store is back to what versions list"
    );
}
