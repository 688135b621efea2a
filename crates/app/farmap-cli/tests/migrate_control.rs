//! What a user controls of a live migration, and what a seeder refuses, with real processes
//! (`farmap __demo-node` applications, `farmap seed`, `farmap leech`, `farmap proxy` as a
//! slow link): the pull budget (`--max-rate`, `--cpu-share`), Ctrl-C on either command
//! before the hand-over, and a second leecher while one is served. After each, the regions
//! are checked against the image recomputed from the writer's seed and history.

use std::time::{Duration, Instant};

use farmap_testkit::demo::{json_of, proxy, DemoNode, Seeder};
use farmap_testkit::process::Proc;

mod common;
use common::farmap;

const MIB: u64 = 1 << 20;

/// Whether userfaultfd works here; if not, `test` is recorded as skipped.
fn usable(test: &str) -> bool {
    farmap_testkit::skip::unless(test, farmap_uffd::probe()).is_some()
}

/// A source application (holding a region of `size` bytes, written 200 times a second) and
/// a destination one, with their tempdir.
fn apps(size: u64) -> (DemoNode, DemoNode, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let a = DemoNode::start(&farmap(), dir.path(), "a", size, 200, true, &[]);
    let b = DemoNode::start(&farmap(), dir.path(), "b", size, 200, false, &[]);
    (a, b, dir)
}

/// Runs `leech` and `seed` to their ends, which must succeed: the leech's report.
fn both_succeed(leech: Proc, seed: Proc) -> serde_json::Value {
    let (ok, out, err) = leech.finish();
    assert!(ok, "leech failed: {err}");
    let report = json_of(&out);
    let (ok, out, err) = seed.finish();
    assert!(ok, "seed failed: {err}");
    assert_eq!(json_of(&out)["role"], "seed");
    report
}

/// Checks that `from` no longer holds the region and `to` holds it, verified, with more
/// than `ops` writes; returns its op count.
fn moved(from: &mut DemoNode, to: &mut DemoNode, ops: u64) -> u64 {
    assert_eq!(from.verify(), None, "the source no longer holds the region");
    let now = to.verify().expect("the destination holds the region");
    assert!(
        now > ops,
        "the writer went on at the destination ({ops} → {now})"
    );
    now
}

#[test]
fn the_pull_budget_flags_are_honoured_on_both_sides() {
    if !usable("the_pull_budget_flags_are_honoured_on_both_sides") {
        return;
    }
    let size = 32 * MIB;
    let (mut a, mut b, _dir) = apps(size);
    let ops = a.verify().unwrap();

    // The leecher's --max-rate: 32 MiB at 8 MiB/s take 4 s (the first batch goes unpaced).
    let seed = Seeder::start(&farmap(), &a, &[]);
    let t = Instant::now();
    let leech = seed.leech(&farmap(), &b, &["--max-rate", "8MiB", "--cpu-share", "0.5"]);
    let report = both_succeed(leech, seed.proc);
    let took = t.elapsed();
    assert!(
        report["bytes_precopy"].as_u64().unwrap() >= size,
        "{report}"
    );
    assert!(
        took >= Duration::from_secs(3) && report["total_ms"].as_f64().unwrap() >= 3000.0,
        "32 MiB pulled at --max-rate 8MiB in {took:?}: {report}"
    );
    let ops = moved(&mut a, &mut b, ops);

    // The seeder's budget paces what its data plane serves: the same bound, back the other
    // way, counted from the leecher's arrival (the seeder's wait for it is no credit);
    // --cpu-share and --pull-priority are taken on both sides.
    let seed = Seeder::start(
        &farmap(),
        &b,
        &[
            "--max-rate",
            "8MiB",
            "--cpu-share",
            "0.5",
            "--pull-priority",
            "batch",
        ],
    );
    std::thread::sleep(Duration::from_secs(2));
    let t = Instant::now();
    let leech = seed.leech(&farmap(), &a, &["--cpu-share", "0.25"]);
    let report = both_succeed(leech, seed.proc);
    let took = t.elapsed();
    assert!(
        took >= Duration::from_secs(3),
        "32 MiB served at --max-rate 8MiB in {took:?}: {report}"
    );
    let ops = moved(&mut b, &mut a, ops);

    // The budget protects the source's application: once it is suspended, nothing is paced
    // (the post-copy at 1 MiB/s would take 32 s).
    let seed = Seeder::start(&farmap(), &a, &["--max-rate", "1MiB"]);
    let t = Instant::now();
    let leech = seed.leech(&farmap(), &b, &["--mode", "postcopy"]);
    let report = both_succeed(leech, seed.proc);
    let took = t.elapsed();
    assert!(
        report["bytes_postcopy"].as_u64().unwrap() >= size,
        "{report}"
    );
    assert!(
        took < Duration::from_secs(16),
        "a post-copy from a seeder with --max-rate 1MiB took {took:?}: {report}"
    );
    moved(&mut a, &mut b, ops);

    // A budget that is not one is refused before anything starts.
    let err = farmap().fails(&[
        "leech",
        "--app",
        "x",
        "--from",
        "127.0.0.1:1",
        "--cpu-share",
        "0",
    ]);
    assert!(
        err.contains("is not a share between 0 (excluded) and 1"),
        "{err}"
    );
}

/// A leecher's arguments over the slow link: one data connection (4 s for 16 MiB), so that
/// it is still pulling when the test acts.
const SLOW: &[&str] = &["--connections", "1"];

/// Waits for `leech` to be pulling the region while the source runs.
fn pulling(leech: &mut Proc) {
    leech.stderr_line("while the source runs");
}

#[test]
fn ctrl_c_before_the_hand_over_exits_130_and_the_source_runs_on() {
    if !usable("ctrl_c_before_the_hand_over_exits_130_and_the_source_runs_on") {
        return;
    }
    let size = 16 * MIB;
    let (mut a, mut b, _dir) = apps(size);

    // 1. Ctrl-C to the leech command during the pre-copy (16 MiB over a 4 MB/s link).
    let seed = Seeder::start(&farmap(), &a, &[]);
    let mut seed_proc = seed.proc;
    let (_slow, slow_data) = proxy(&farmap(), &seed.data, 0, Some("4MB/s"));
    let mut leech = farmap_testkit::demo::leech(&farmap(), &b, &seed.control, &slow_data, SLOW);
    pulling(&mut leech);
    let ops1 = a.verify().expect("the source holds the region");
    leech.signal("INT");
    let (status, _, err) = leech.finish_status();
    assert_eq!(status.code(), Some(130), "{status}: {err}");
    assert!(
        err.contains("cancelling: the source keeps running"),
        "{err}"
    );
    seed_proc.stderr_line("the leecher went away before the hand-over; the source runs on");
    assert!(seed_proc.running(), "the seeder waits for another leecher");
    assert_eq!(b.verify(), None, "the destination took nothing");
    std::thread::sleep(Duration::from_millis(200));
    let ops2 = a.verify().expect("the source is intact");
    assert!(ops2 > ops1, "and its writer goes on ({ops1} → {ops2})");
    // A later leecher takes the region from the same seeder.
    let leech = farmap_testkit::demo::leech(&farmap(), &b, &seed.control, &seed.data, &[]);
    both_succeed(leech, seed_proc);
    let ops3 = moved(&mut a, &mut b, ops2);

    // 2. Ctrl-C to the seed command during the pre-copy, back the other way.
    let seed = Seeder::start(&farmap(), &b, &[]);
    let seed_proc = seed.proc;
    let (_slow, slow_data) = proxy(&farmap(), &seed.data, 0, Some("4MB/s"));
    let mut leech = farmap_testkit::demo::leech(&farmap(), &a, &seed.control, &slow_data, SLOW);
    pulling(&mut leech);
    seed_proc.signal("INT");
    let (status, _, err) = seed_proc.finish_status();
    assert_eq!(status.code(), Some(130), "{status}: {err}");
    assert!(
        err.contains("cancelling: the source keeps running"),
        "{err}"
    );
    let (ok, _, err) = leech.finish();
    assert!(!ok, "the leech must fail");
    assert!(
        err.contains("migration aborted") && err.contains("the source keeps running"),
        "the leecher says what happened: {err}"
    );
    assert_eq!(a.verify(), None, "the destination took nothing");
    std::thread::sleep(Duration::from_millis(200));
    let ops4 = b.verify().expect("the source is intact");
    assert!(ops4 > ops3, "and its writer goes on ({ops3} → {ops4})");
    // A later migration succeeds.
    let seed = Seeder::start(&farmap(), &b, &[]);
    let leech = seed.leech(&farmap(), &a, &[]);
    both_succeed(leech, seed.proc);
    moved(&mut b, &mut a, ops4);
}

#[test]
fn a_second_leecher_is_refused_as_busy_and_the_first_completes() {
    if !usable("a_second_leecher_is_refused_as_busy_and_the_first_completes") {
        return;
    }
    let size = 16 * MIB;
    let (mut a, mut b, dir) = apps(size);
    let mut c = DemoNode::start(&farmap(), dir.path(), "c", size, 200, false, &[]);
    let seed = Seeder::start(&farmap(), &a, &[]);
    let (_slow, slow_data) = proxy(&farmap(), &seed.data, 0, Some("4MB/s"));
    let mut first = farmap_testkit::demo::leech(&farmap(), &b, &seed.control, &slow_data, SLOW);
    pulling(&mut first);

    let second = seed.leech(&farmap(), &c, &[]);
    let (ok, _, err) = second.finish();
    assert!(!ok, "a second leecher must be refused");
    assert!(
        err.contains("the seeder is busy with another leecher"),
        "the refusal says why: {err}"
    );
    assert!(first.running(), "the first leecher goes on");
    assert_eq!(c.verify(), None, "the refused destination took nothing");

    let ops = a.verify().expect("the source still holds the region");
    let report = both_succeed(first, seed.proc);
    assert_eq!(report["region_bytes"], size, "{report}");
    moved(&mut a, &mut b, ops);
    assert_eq!(c.verify(), None);
}
