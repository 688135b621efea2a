//! Live migration of a region whose store is a shared network store (a real Redis, MinIO or
//! Cassandra): the source application (`farmap __demo-node --store SPEC`) writes while its
//! region is pushed to the store in the background every 50 ms, `farmap seed` and
//! `farmap leech` move it to a second application, and then:
//! - the destination's region equals the image recomputed from the writer's seed and op
//!   count (no write lost to the push rounds that ran during the migration's dirty rounds);
//! - after a pre-copy, the source, released after the hand-over, synced its region to the
//!   store, and a fresh client reads from it exactly the image at the hand-over's op count;
//! - an instant migration takes from the source only what the store lacks, over each store
//!   (`redis://`, `s3://`, `cql://`), with or without a push budget.

use std::time::Duration;

mod common;
use common::farmap;

use farmap_testkit::cli::Cli;
use farmap_testkit::demo::{self, json_of, DemoNode, Seeder};
use farmap_testkit::{skip, unique_name, Service};
use serde_json::Value;

/// Two demo nodes over one region in a shared store (`a` holds it and writes, `b` waits),
/// the `farmap` they run with, the service kept alive, and the tempdir of their agents.
struct Pair {
    a: DemoNode,
    b: DemoNode,
    farmap: Cli,
    size: u64,
    /// The versioned region's spec (`versioned` pairs only).
    spec: String,
    _svc: Option<&'static Service>,
    _dir: tempfile::TempDir,
}

/// A new region of `size` bytes in `service` for `test`: its spec, and `farmap` with what
/// it needs in its environment to open it.
fn shared_region(
    test: &str,
    service: &str,
    svc: Option<&Service>,
    size: u64,
    dir: &std::path::Path,
) -> (String, Cli) {
    let name = unique_name("migrate");
    if service == "versioned" {
        let objects = dir.join("objects");
        return (
            format!("versioned:(dir:{})/r?size={size}", objects.display()),
            farmap(),
        );
    }
    let svc = svc.unwrap_or_else(|| panic!("{test}: {service} needs its service"));
    match service {
        "redis" => (
            format!("{}/0?size={size}&prefix={name}", svc.var("SPEC_BASE")),
            farmap(),
        ),
        "minio" => (
            format!(
                "s3://{}/{name}?endpoint={}&size={size}",
                svc.var("BUCKET"),
                svc.var("ENDPOINT")
            ),
            farmap()
                .env("AWS_ACCESS_KEY_ID", svc.var("ACCESS_KEY"))
                .env("AWS_SECRET_ACCESS_KEY", svc.var("SECRET_KEY"))
                .env_remove("AWS_PROFILE")
                .env_remove("AWS_ENDPOINT_URL")
                .env_remove("AWS_ENDPOINT_URL_S3"),
        ),
        "cassandra" => (
            format!(
                "{}/farmap_test?table=migrate&region={name}&size={size}&create=true",
                svc.var("SPEC_BASE")
            ),
            farmap(),
        ),
        other => panic!("{test}: no shared region in service {other}"),
    }
}

fn pair(test: &str, service: &'static str) -> Option<Pair> {
    skip::unless(test, farmap_uffd::probe())?;
    let svc = match service {
        "versioned" => None,
        _ => Some(skip::unless(test, Service::shared(service))?),
    };
    let dir = tempfile::tempdir().unwrap();
    let size: u64 = 16 << 20;
    let (spec, farmap) = shared_region(test, service, svc, size, dir.path());
    // 10% of the pages per second; 2% over the slower stores, whose last push before the
    // hand-over takes long enough for such a writer to dirty most of these 256 chunks.
    let rate = match service {
        "redis" | "versioned" => size / 4096 / 10,
        _ => size / 4096 / 50,
    };
    let node = |name: &str, init: bool| {
        DemoNode::start(
            &farmap,
            dir.path(),
            name,
            size,
            rate,
            init,
            &["--store", &spec],
        )
    };
    let a = node("a", true);
    let b = node("b", false);
    Some(Pair {
        a,
        b,
        farmap,
        size,
        spec,
        _svc: svc,
        _dir: dir,
    })
}

/// `farmap seed` on `a` with `seed_extra` arguments, `farmap leech` on `b` with
/// `leech_extra`: the leech report, and the seed's stderr.
fn migrate(p: &mut Pair, seed_extra: &[&str], leech_extra: &[&str]) -> (Value, String) {
    let seed = Seeder::start(&p.farmap, &p.a, seed_extra);
    let mut args = vec!["--max-downtime", "10ms"];
    args.extend_from_slice(leech_extra);
    let leech = seed.leech(&p.farmap, &p.b, &args);
    let (ok, out, err) = leech.finish();
    assert!(ok, "leech failed: {err}");
    let report = json_of(&out);
    let (ok, out, seed_err) = seed.proc.finish();
    if !ok {
        // Whether the source application is still there says whose end failed.
        std::thread::sleep(Duration::from_millis(500));
        let source = p.a.proc.child().try_wait();
        panic!("seed failed: {seed_err}\nthe source node: {source:?} (None: running)");
    }
    assert_eq!(json_of(&out)["role"], "seed");
    (report, seed_err)
}

/// Asks a demo node to compare its region with the recomputed image: the op count.
fn verify(node: &mut DemoNode) -> u64 {
    node.verify().expect("the node holds the region")
}

#[test]
fn a_region_over_redis_migrates_live_and_redis_holds_the_hand_over_image() {
    let test = "a_region_over_redis_migrates_live_and_redis_holds_the_hand_over_image";
    let Some(mut p) = pair(test, "redis") else {
        return;
    };
    // Let a few push rounds run with the writer going.
    std::thread::sleep(Duration::from_millis(300));
    let before = verify(&mut p.a);
    let (report, _) = migrate(&mut p, &[], &[]);
    let handed_over_at = report["resumed_at_op"]
        .as_u64()
        .unwrap_or_else(|| panic!("resumed_at_op missing in {report}"));
    assert!(handed_over_at >= before, "{handed_over_at} < {before}");

    // The source synced what it held at the hand-over, and holds nothing now.
    let released = p.a.proc.event("released");
    assert_eq!(released["synced"], true, "{released}");
    assert_eq!(p.a.verify(), None, "the source holds no region");

    // The destination runs on with every write, and the writer goes on there.
    std::thread::sleep(Duration::from_millis(200));
    let after = verify(&mut p.b);
    assert!(
        after > handed_over_at,
        "{after} ops <= {handed_over_at} at the hand-over"
    );

    // Redis, read by a fresh client, holds the image at the hand-over.
    p.b.proc.send(&format!("check-store {handed_over_at}"));
    let checked = p.b.proc.event("store-checked");
    assert_eq!(checked["ok"], true, "{checked}");
}

/// An instant migration over `service` (with `seed_extra` for `farmap seed`): the chunks
/// come from the store and the source, all verified; most from the store (pushed there in
/// the background before); the source handed the store over; every write is at the
/// destination. The seed's stderr.
fn instant(test: &str, service: &'static str, seed_extra: &[&str]) -> Option<(String, Pair)> {
    let mut p = pair(test, service)?;
    std::thread::sleep(Duration::from_millis(300));
    let before = verify(&mut p.a);
    let (report, seed_err) = migrate(&mut p, seed_extra, &["--mode", "instant"]);
    assert_eq!(report["mode"], "instant", "{report}");
    let chunks = p.size / (64 << 10);
    let (from_store, from_source) = (
        report["chunks_from_store"].as_u64().unwrap(),
        report["chunks_from_source"].as_u64().unwrap(),
    );
    assert_eq!(report["verify_failures"], 0, "{report}");
    assert_eq!(from_store + from_source, chunks, "{report}");
    assert!(
        from_store > chunks / 2,
        "most chunks come from {service}: {report}"
    );
    assert_eq!(report["bytes_precopy"], 0, "{report}");
    let before_resume = report["bytes_before_resume"].as_u64().unwrap();
    assert!(
        before_resume <= 32 * chunks + 65536,
        "{before_resume} bytes before resuming: {report}"
    );
    let handed_over_at = report["resumed_at_op"].as_u64().unwrap();
    assert!(handed_over_at >= before, "{handed_over_at} < {before}");
    // The source handed the store over and pushed nothing after.
    let released = p.a.proc.event("released");
    assert_eq!(released["handed_store_over"], true, "{released}");
    // Every write is there, and the writer goes on at the destination.
    std::thread::sleep(Duration::from_millis(200));
    let after = verify(&mut p.b);
    assert!(after > handed_over_at, "{after} <= {handed_over_at}");
    Some((seed_err, p))
}

#[test]
fn an_instant_migration_over_redis_takes_only_what_redis_lacks() {
    let test = "an_instant_migration_over_redis_takes_only_what_redis_lacks";
    if let Some((seed_err, _)) = instant(test, "redis", &[]) {
        assert!(
            seed_err.contains("pushing what the shared store lacks (at most 2s)")
                && seed_err.contains("instant: pushed for "),
            "the default push budget: {seed_err}"
        );
    }
}

#[test]
fn an_instant_migration_with_no_push_budget_fetches_the_rest_from_the_source() {
    let test = "an_instant_migration_with_no_push_budget_fetches_the_rest_from_the_source";
    if let Some((seed_err, _)) = instant(test, "redis", &["--push-budget", "0s"]) {
        assert!(
            !seed_err.contains("pushing what the shared store lacks")
                && !seed_err.contains("instant: pushed for "),
            "no push before the hand-over: {seed_err}"
        );
    }
}

#[test]
fn an_instant_migration_over_s3_takes_only_what_s3_lacks() {
    instant(
        "an_instant_migration_over_s3_takes_only_what_s3_lacks",
        "minio",
        &[],
    );
}

#[test]
fn an_instant_migration_over_cql_takes_only_what_cassandra_lacks() {
    instant(
        "an_instant_migration_over_cql_takes_only_what_cassandra_lacks",
        "cassandra",
        &[],
    );
}

#[test]
fn an_instant_migration_of_a_versioned_region_hands_its_writer_over() {
    let test = "an_instant_migration_of_a_versioned_region_hands_its_writer_over";
    let Some((_, p)) = instant(test, "versioned", &[]) else {
        return;
    };
    // The source saved its last pushes as a version before the hand-over (the destination
    // read them there: most chunks came from the store), and the destination then took the
    // region over with the next epoch: the old host's next flush is fenced.
    let spec = p.spec.split('?').next().unwrap().to_owned();
    let rows = p.farmap.json_lines(&["versions", &spec, "--json"]);
    let epochs: Vec<u64> = rows.iter().map(|r| r["epoch"].as_u64().unwrap()).collect();
    assert_eq!(epochs.first(), Some(&1), "{rows:?}");
    assert!(epochs.windows(2).all(|w| w[0] <= w[1]), "{epochs:?}");
    assert!(epochs.contains(&2), "the destination's epoch: {rows:?}");
    assert!(epochs.iter().filter(|e| **e == 1).count() >= 2, "{rows:?}");
}

/// The source host dies in the middle of an instant migration's post-copy (its data plane
/// slowed to 64 KB/s, so the chunks only it holds are still coming when the application
/// resumes at the destination): the destination finishes from the shared store, says which
/// chunks rolled back to the store's version, and every other byte is what the source held
/// at the hand-over or what was written here since.
#[test]
fn an_instant_migration_finishes_from_redis_when_the_source_dies_during_the_post_copy() {
    let test = "an_instant_migration_finishes_from_redis_when_the_source_dies_during_the_post_copy";
    let Some(mut p) = pair(test, "redis") else {
        return;
    };
    std::thread::sleep(Duration::from_millis(300));
    // No push before the suspension: what the writer wrote since the last background push
    // is at the source alone.
    let mut seed = Seeder::start(&p.farmap, &p.a, &["--push-budget", "0s"]);
    let (mut slow, slow_data) = demo::proxy(&p.farmap, &seed.data, 0, Some("64KB/s"));
    let mut leech = demo::leech(
        &p.farmap,
        &p.b,
        &seed.control,
        &slow_data,
        &[
            "--mode",
            "instant",
            "--max-downtime",
            "10ms",
            "--reconnect-for",
            "1s",
        ],
    );
    let resumed = leech.stderr_line("resumed here after");
    let from_source: u64 = resumed
        .split(" chunks come from the source")
        .next()
        .and_then(|s| s.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no source chunk count in {resumed:?}"));
    assert!(
        from_source > 0,
        "a writer left chunks at the source: {resumed}"
    );
    // The source host dies: its application, the seed command and the way to its data plane.
    p.a.proc.kill();
    seed.proc.kill();
    slow.kill();
    let (ok, out, err) = leech.finish();
    assert!(ok, "the destination finishes without its source: {err}");
    assert!(
        err.contains("the seeder is gone: finishing from the shared store"),
        "{err}"
    );
    let report = json_of(&out);
    let chunk = 64u64 << 10;
    let rolled: Vec<std::ops::Range<u64>> = report["rolled_back"]
        .as_array()
        .unwrap_or_else(|| panic!("rolled_back missing in {report}"))
        .iter()
        // `[start, end)` runs of chunks.
        .map(|r| r[0].as_u64().unwrap() * chunk..r[1].as_u64().unwrap() * chunk)
        .collect();
    let count: u64 = rolled.iter().map(|r| (r.end - r.start) / chunk).sum();
    assert_eq!(report["chunks_rolled_back"], count, "{report}");
    assert!(
        count > 0 && count <= from_source,
        "the source died with chunks on their way: {count} rolled back of {from_source}: {report}"
    );
    // Everything else is the history's image: nothing the destination received was lost,
    // and the writer goes on here.
    let ops =
        p.b.verify_except(&rolled)
            .expect("the destination holds the region");
    let handed_over_at = report["resumed_at_op"].as_u64().unwrap();
    assert!(ops >= handed_over_at, "{ops} < {handed_over_at}");
}
