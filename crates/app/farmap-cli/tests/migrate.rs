//! `farmap seed` and `farmap leech` with real processes: two applications holding (or about
//! to hold) a region with a live, deterministic writer (`farmap __demo-node`, the demo's
//! application, with its migration agent), the two commands driving them, and `farmap proxy`
//! processes as the link. Failures are real: processes are SIGKILLed, proxies die and come
//! back. After each, the regions are checked against content recomputed from the writer's
//! seed and history.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use farmap_testkit::demo::{self, json_of, DemoNode as App, Seeder};
use farmap_testkit::process::Proc;

mod common;
use common::farmap;

const MIB: u64 = 1 << 20;

/// Whether userfaultfd works here; if not, `test` is recorded as skipped.
fn usable(test: &str) -> bool {
    farmap_testkit::skip::unless(test, farmap_uffd::probe()).is_some()
}

/// An application named `name` with a region of `size` bytes written `ops_per_sec` times a
/// second (`init`: it holds the region; else it waits for one).
fn app(dir: &Path, name: &str, size: u64, ops_per_sec: u64, init: bool) -> App {
    App::start(&farmap(), dir, name, size, ops_per_sec, init, &[])
}

fn seed_cmd(app: &App) -> (Proc, String, String) {
    seed_cmd_with(app, &[])
}

fn seed_cmd_with(app: &App, extra: &[&str]) -> (Proc, String, String) {
    let s = Seeder::start(&farmap(), app, extra);
    (s.proc, s.control, s.data)
}

fn leech_cmd(app: &App, from: &str, data: &str, extra: &[&str]) -> Proc {
    demo::leech(&farmap(), app, from, data, extra)
}

/// A `farmap proxy` process; `port` 0 picks one.
fn proxy(to: &str, port: u16, bandwidth: Option<&str>) -> (Proc, String) {
    demo::proxy(&farmap(), to, port, bandwidth)
}

fn port_of(addr: &str) -> u16 {
    addr.rsplit(':').next().unwrap().parse().unwrap()
}

#[test]
fn seed_and_leech_move_a_live_region_there_and_back() {
    if !usable("seed_and_leech_move_a_live_region_there_and_back") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let size = 64 * MIB;
    let rate = size / 4096 / 20; // 5% of the pages per second
    let mut a = app(dir.path(), "a", size, rate, true);
    let mut b = app(dir.path(), "b", size, rate, false);
    assert!(a.verify().is_some());
    assert_eq!(b.verify(), None, "the destination holds nothing yet");

    let mut ops_before = 0;
    for there in [true, false] {
        let (src, dst) = if there {
            (&mut a, &mut b)
        } else {
            (&mut b, &mut a)
        };
        let (seed, control, data) = seed_cmd(src);
        let leech = leech_cmd(dst, &control, &data, &["--max-downtime", "10ms"]);
        let (ok, out, err) = leech.finish();
        assert!(ok, "leech failed: {err}");
        let m = json_of(&out);
        assert_eq!(m["role"], "leech");
        assert_eq!(m["region_bytes"], size);
        for key in [
            "downtime_ms",
            "effective_downtime_ms",
            "app_max_gap_ms",
            "total_ms",
            "dirty_rate_mb_per_s",
        ] {
            assert!(m[key].as_f64().is_some(), "{key} missing in {m}");
        }
        assert!(m["converged"].is_boolean(), "converged missing in {m}");
        assert!(m["max_downtime_ms"].as_f64().is_some(), "{m}");
        let moved = m["bytes_precopy"].as_u64().unwrap() + m["bytes_postcopy"].as_u64().unwrap();
        assert!(
            moved >= size,
            "{moved} bytes moved for a {size}-byte region"
        );
        let (ok, out, err) = seed.finish();
        assert!(ok, "seed failed: {err}");
        assert_eq!(json_of(&out)["role"], "seed");
        assert!(err.contains("handed over"), "{err}");

        assert_eq!(src.verify(), None, "the source no longer holds the region");
        let ops = dst.verify().expect("the destination holds the region");
        assert!(ops > ops_before, "the writer went on at the destination");
        ops_before = ops;
    }
}

#[test]
fn a_post_copy_hands_over_at_once_and_the_region_arrives_whole() {
    if !usable("a_post_copy_hands_over_at_once_and_the_region_arrives_whole") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let size = 32 * MIB;
    let rate = size / 4096 / 20; // 5% of the pages per second
    let mut a = app(dir.path(), "a", size, rate, true);
    let mut b = app(dir.path(), "b", size, rate, false);
    let before = a.verify().expect("the source holds the region");
    let (seed, control, data) = seed_cmd(&a);
    let leech = leech_cmd(&b, &control, &data, &["--mode", "postcopy"]);
    let (ok, out, err) = leech.finish();
    assert!(ok, "leech failed: {err}");
    let m = json_of(&out);
    assert_eq!(m["role"], "leech");
    assert_eq!(m["mode"], "postcopy", "{m}");
    assert_eq!(m["region_bytes"], size, "{m}");
    // Nothing moved before the hand-over: every page came afterwards, from the source.
    assert_eq!(m["rounds"], 0, "{m}");
    assert_eq!(m["bytes_precopy"], 0, "{m}");
    assert!(m["bytes_postcopy"].as_u64().unwrap() >= size, "{m}");
    let before_resume = m["bytes_before_resume"].as_u64().unwrap();
    assert!(
        before_resume < size / 4,
        "{before_resume} bytes moved before resuming: {m}"
    );
    let handed_over_at = m["resumed_at_op"].as_u64().unwrap();
    assert!(handed_over_at >= before, "{handed_over_at} < {before}");
    let (ok, out, err) = seed.finish();
    assert!(ok, "seed failed: {err}");
    assert_eq!(json_of(&out)["role"], "seed");

    assert_eq!(a.verify(), None, "the source no longer holds the region");
    // The whole region matches its history at the destination, and the writer goes on.
    std::thread::sleep(Duration::from_millis(200));
    let ops = b.verify().expect("the destination holds the region");
    assert!(
        ops > handed_over_at,
        "{ops} ops <= {handed_over_at} at the hand-over"
    );
}

#[test]
fn only_a_leecher_with_the_seeders_key_file_takes_the_region() {
    if !usable("only_a_leecher_with_the_seeders_key_file_takes_the_region") {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let size = 8 * MIB;
    let mut a = app(dir.path(), "a", size, 200, true);
    let mut b = app(dir.path(), "b", size, 200, false);
    let key = dir.path().join("keys/migration.key");
    let key_arg = key.to_str().unwrap();
    let (mut seed, control, data) = seed_cmd_with(&a, &["--key-file", key_arg]);
    seed.stderr_line("created the migration key");
    let mode = std::fs::metadata(&key).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "the key file is private");

    // No key file at the destination: a clear error, nothing sent.
    let other = dir.path().join("other.key");
    let other_arg = other.to_str().unwrap();
    let leech = leech_cmd(&b, &control, &data, &["--key-file", other_arg]);
    let (ok, _, err) = leech.finish();
    assert!(!ok);
    assert!(err.contains("no key file at"), "{err}");
    // Another secret: refused by both sides' proofs; the source runs on.
    std::fs::write(&other, "a secret that is not the seeder's\n").unwrap();
    std::fs::set_permissions(&other, std::fs::Permissions::from_mode(0o600)).unwrap();
    let leech = leech_cmd(&b, &control, &data, &["--key-file", other_arg]);
    let (ok, _, err) = leech.finish();
    assert!(!ok);
    assert!(err.contains("keys differ"), "{err}");
    // The right secret in a file other users can read: refused before connecting.
    std::fs::copy(&key, &other).unwrap();
    std::fs::set_permissions(&other, std::fs::Permissions::from_mode(0o644)).unwrap();
    let leech = leech_cmd(&b, &control, &data, &["--key-file", other_arg]);
    let (ok, _, err) = leech.finish();
    assert!(!ok);
    assert!(err.contains("can be read by other users"), "{err}");
    assert!(seed.running(), "the seeder waits for its leecher");
    let ops = a.verify().expect("the source is intact");

    std::fs::set_permissions(&other, std::fs::Permissions::from_mode(0o600)).unwrap();
    let leech = leech_cmd(&b, &control, &data, &["--key-file", other_arg]);
    let (ok, _, err) = leech.finish();
    assert!(ok, "leech failed: {err}");
    let (ok, _, err) = seed.finish();
    assert!(ok, "seed failed: {err}");
    assert_eq!(a.verify(), None);
    assert!(b.verify().unwrap() > ops, "verified at the destination");
}

#[test]
fn seeder_dying_before_finalize_aborts_the_leecher_and_the_source_runs_on() {
    if !usable("seeder_dying_before_finalize_aborts_the_leecher_and_the_source_runs_on") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let size = 16 * MIB;
    let mut a = app(dir.path(), "a", size, 200, true);
    let mut b = app(dir.path(), "b", size, 200, false);

    // 1. The seed command dies (SIGKILL) during the pre-copy: its agent connection closes,
    //    the source's agent abandons the seeding and tells the leecher.
    let (mut seed, control, data) = seed_cmd(&a);
    let (_slow, slow_data) = proxy(&data, 0, Some("4MB/s"));
    let mut leech = leech_cmd(&b, &control, &slow_data, &[]);
    leech.stderr_line("while the source runs");
    seed.kill();
    let (ok, _, err) = leech.finish();
    assert!(!ok, "the leech must fail");
    assert!(
        err.contains("migration aborted") && err.contains("the source keeps running"),
        "the leecher says what happened: {err}"
    );
    assert_eq!(b.verify(), None, "the destination took nothing");
    let ops1 = a
        .verify()
        .expect("the source still holds its region, intact");
    std::thread::sleep(Duration::from_millis(300));
    let ops2 = a.verify().expect("and keeps running");
    assert!(ops2 > ops1, "the source's writer goes on ({ops1} → {ops2})");

    // 2. The source's whole seeding process dies (SIGKILL of the application itself, data
    //    plane and all): the leecher aborts cleanly and holds nothing.
    let (_seed, control, data) = seed_cmd(&a);
    let (_slow, slow_data) = proxy(&data, 0, Some("4MB/s"));
    let mut leech = leech_cmd(&b, &control, &slow_data, &[]);
    leech.stderr_line("while the source runs");
    a.proc.kill();
    let (ok, _, err) = leech.finish();
    assert!(!ok, "the leech must fail");
    assert!(
        err.contains("migration aborted") && err.contains("before the hand-over"),
        "the leecher says what happened: {err}"
    );
    assert_eq!(b.verify(), None, "the destination took nothing");
}

#[test]
fn leecher_dying_before_the_hand_over_leaves_the_source_untouched() {
    if !usable("leecher_dying_before_the_hand_over_leaves_the_source_untouched") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let size = 16 * MIB;
    let mut a = app(dir.path(), "a", size, 200, true);
    let (mut seed, control, data) = seed_cmd(&a);
    let (_slow, slow_data) = proxy(&data, 0, Some("4MB/s"));

    // 1. The leech command dies: its agent cancels and tells the seeder.
    let mut b = app(dir.path(), "b", size, 200, false);
    let mut leech = leech_cmd(&b, &control, &slow_data, &[]);
    leech.stderr_line("while the source runs");
    leech.kill();
    seed.stderr_line("the leecher went away before the hand-over; the source runs on");
    assert!(seed.running(), "the seeder waits for another leecher");
    assert_eq!(b.verify(), None, "the destination took nothing");
    let ops1 = a.verify().expect("the source is intact");

    // 2. The destination application itself dies during the pre-copy.
    let mut c = app(dir.path(), "c", size, 200, false);
    let mut leech = leech_cmd(&c, &control, &slow_data, &[]);
    leech.stderr_line("while the source runs");
    c.proc.kill();
    let (ok, _, _) = leech.finish();
    assert!(!ok, "the leech command reports the failure");
    let ops2 = a.verify().expect("the source is intact");
    assert!(ops2 > ops1, "and its writer went on ({ops1} → {ops2})");
    assert!(seed.running(), "the seeder waits for another leecher");

    // 3. A third destination takes the region over from the same, untouched source.
    let (_fast, fast_data) = proxy(&data, 0, None);
    let leech = leech_cmd(&b, &control, &fast_data, &[]);
    let (ok, _, err) = leech.finish();
    assert!(ok, "leech failed: {err}");
    let (ok, out, err) = seed.finish();
    assert!(ok, "seed failed: {err}");
    assert_eq!(
        json_of(&out)["abandoned_leechers"],
        2,
        "the seeder saw both leechers go"
    );
    assert_eq!(a.verify(), None);
    assert!(b.verify().unwrap() > ops2, "verified at the destination");
}

#[test]
fn a_connection_lost_during_the_post_copy_is_reconnected_and_the_migration_completes() {
    if !usable("a_connection_lost_during_the_post_copy_is_reconnected_and_the_migration_completes")
    {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let size = 8 * MIB;
    // A writer changing half the pages per second and one pre-copy round over a slow link
    // (one connection at 4 MB/s): the hand-over leaves about 4 MB to fetch afterwards (about
    // a second), so the link is cut in the middle of it.
    let rate = size / 4096 / 2;
    let mut a = app(dir.path(), "a", size, rate, true);
    let mut b = app(dir.path(), "b", size, rate, false);
    let (seed, control, data) = seed_cmd(&a);
    let (mut pc, control_p) = proxy(&control, 0, None);
    let (mut pd, data_p) = proxy(&data, 0, Some("4MB/s"));
    let mut leech = leech_cmd(
        &b,
        &control_p,
        &data_p,
        &["--max-rounds", "1", "--connections", "1"],
    );
    leech.stderr_line("handed over");
    pc.kill();
    pd.kill();
    leech.stderr_line("reconnecting");
    std::thread::sleep(Duration::from_millis(500));
    let (_pc, _) = proxy(&control, port_of(&control_p), None);
    let (pd2, _) = proxy(&data, port_of(&data_p), Some("4MB/s"));
    let (ok, out, err) = leech.finish();
    assert!(ok, "leech failed: {err}");
    // The data plane carried pages after it came back: the cut hit the post-copy's fetches
    // (had the post-copy been over, nothing would be left to fetch).
    let status = Command::new("kill")
        .args(["-INT", &pd2.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let (_, _, perr) = pd2.finish();
    let down: u64 = perr
        .split(" bytes down")
        .next()
        .and_then(|s| s.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no byte count in the proxy's last words: {perr}"));
    assert!(down > 64 * 1024, "{down} bytes fetched after the cut");
    let m = json_of(&out);
    assert!(
        m["bytes_postcopy"].as_u64().unwrap() > MIB,
        "the link was cut during a real post-copy: {m}"
    );
    // One round against a writer this fast is not convergence: the result and stderr say so.
    assert_eq!(m["converged"], false, "{m}");
    assert!(err.contains("did not converge"), "{err}");
    let (ok, _, err) = seed.finish();
    assert!(ok, "seed failed: {err}");
    assert_eq!(a.verify(), None);
    assert!(b.verify().is_some(), "verified at the destination");
}

#[test]
fn demo_migrates_there_and_back_and_verifies() {
    if !usable("demo_migrates_there_and_back_and_verifies") {
        return;
    }
    let rows = farmap().json_lines(&["demo", "--size", "32MiB", "--json"]);
    assert_eq!(rows.len(), 2, "one line per direction: {rows:?}");
    for (row, dir) in rows.iter().zip(["there", "back"]) {
        assert_eq!(row["direction"], dir);
        assert_eq!(row["verified"], true, "{row}");
        assert_eq!(row["region_bytes"], 32 * MIB);
        for key in [
            "downtime_ms",
            "effective_downtime_ms",
            "app_max_gap_ms",
            "wire_mb_per_s",
            "steal_ms",
            "total_ms",
            "bytes_precopy",
            "bytes_postcopy",
            "rounds",
            "dirty_rate_mb_per_s",
        ] {
            assert!(row[key].as_f64().is_some(), "{key} missing in {row}");
        }
        // The old name stays an alias of the new one; a stream of 64 MiB moved something.
        assert_eq!(row["app_max_gap_ms"], row["effective_downtime_ms"], "{row}");
        assert!(row["wire_mb_per_s"].as_f64().unwrap() > 0.0, "{row}");
    }
}

#[test]
fn demo_instant_over_each_store_it_starts_moves_there_and_back() {
    if !usable("demo_instant_over_each_store_it_starts_moves_there_and_back") {
        return;
    }
    let mut stores = vec!["farmap"];
    match farmap_testkit::Service::shared("redis") {
        // The demo starts a redis-server of its own: the service proves one is installed.
        Ok(_) => stores.push("redis"),
        Err(e) => farmap_testkit::skip(
            "demo_instant_over_each_store_it_starts_moves_there_and_back (redis)",
            e,
        ),
    }
    for store in stores {
        let rows = farmap().json_lines(&[
            "demo", "--size", "16MiB", "--json", "--mode", "instant", "--store", store,
        ]);
        assert_eq!(rows.len(), 2, "{store}: {rows:?}");
        for row in &rows {
            assert_eq!(row["verified"], true, "{store}: {row}");
            assert_eq!(row["mode"], "instant", "{row}");
            assert_eq!(row["bytes_precopy"], 0, "{row}");
            let (from_store, from_source) = (
                row["chunks_from_store"].as_u64().unwrap(),
                row["chunks_from_source"].as_u64().unwrap(),
            );
            assert_eq!(from_store + from_source, 16 * MIB / (64 << 10), "{row}");
            assert!(from_store > 0, "{row}");
            assert_eq!(row["verify_failures"], 0, "{row}");
        }
    }
}

#[test]
fn migration_over_mutual_tls_refuses_a_leecher_without_a_certificate() {
    if !usable("migration_over_mutual_tls_refuses_a_leecher_without_a_certificate") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let pki = farmap_testkit::tls::Pki::new();
    let [ca, server, server_key, client, client_key] = pki.paths();
    let size = 16 * MIB;
    let mut a = app(dir.path(), "a", size, 200, true);
    let mut b = app(dir.path(), "b", size, 200, false);
    let (seed, control, data) = seed_cmd_with(
        &a,
        &[
            "--tls-cert",
            &server,
            "--tls-key",
            &server_key,
            "--tls-client-ca",
            &ca,
        ],
    );

    let leech = leech_cmd(&b, &control, &data, &["--tls-ca", &ca]);
    let (ok, _, err) = leech.finish();
    assert!(
        !ok,
        "a leecher without a client certificate must be refused"
    );
    assert!(err.contains("certificate"), "the refusal says why: {err}");
    assert_eq!(b.verify(), None);
    assert!(a.verify().is_some(), "the source is untouched");

    let leech = leech_cmd(
        &b,
        &control,
        &data,
        &[
            "--tls-ca",
            &ca,
            "--tls-cert",
            &client,
            "--tls-key",
            &client_key,
        ],
    );
    let (ok, _, err) = leech.finish();
    assert!(ok, "leech over mutual TLS failed: {err}");
    let (ok, _, err) = seed.finish();
    assert!(ok, "seed failed: {err}");
    assert_eq!(a.verify(), None);
    assert!(b.verify().is_some(), "verified at the destination");
}
