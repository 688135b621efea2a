//! Live migration of a region whose store is a shared network store (a real Redis): the
//! source application (`farmap __demo-node --store redis://...`) writes while its region is
//! pushed to Redis in the background every 50 ms, `farmap seed` and `farmap leech` move it to
//! a second application, and then:
//! - the destination's region equals the image recomputed from the writer's seed and op
//!   count (no write lost to the push rounds that ran during the migration's dirty rounds);
//! - the source, released after the hand-over, synced its region to Redis, and a fresh
//!   client reads from Redis exactly the image at the hand-over's op count.

use std::time::Duration;

mod common;
use common::farmap;

use farmap_testkit::process::Proc;
use farmap_testkit::{skip, Service};
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(120);

/// `farmap ARGS` as a [`Proc`] named `name`: its stdout (JSON lines) and stderr lines
/// collected as they come.
fn spawn(name: &str, args: &[&str]) -> Proc {
    farmap().proc(name, args, WAIT)
}

/// Waits for `p`'s exit: its success, the last stdout line as JSON (`Null` if none), and its
/// stderr.
fn finish(p: Proc) -> (bool, Value, String) {
    let (ok, out, err) = p.finish();
    let last = out
        .last()
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or(Value::Null);
    (ok, last, err)
}

/// Asks a demo node to compare its region with the recomputed image: the op count.
fn verify(node: &mut Proc) -> u64 {
    node.send("verify");
    let v = node.event("verified");
    assert_eq!(
        v["ok"],
        true,
        "{}: region differs from its history: {v}",
        node.name()
    );
    v["ops"].as_u64().unwrap()
}

/// Two demo nodes over one Redis region (`a` holds it and writes, `b` waits), the service
/// kept alive, and the tempdir of their agents.
struct Pair {
    a: Proc,
    b: Proc,
    agent_a: String,
    agent_b: String,
    size: u64,
    _svc: &'static Service,
    _dir: tempfile::TempDir,
}

fn pair(test: &str) -> Option<Pair> {
    skip::unless(test, farmap_uffd::probe())?;
    let svc = skip::unless(test, Service::shared("redis"))?;
    let dir = tempfile::tempdir().unwrap();
    let size: u64 = 16 << 20;
    let spec = format!(
        "{}/0?size={size}&prefix=migrate-{}-{test}",
        svc.var("SPEC_BASE"),
        std::process::id()
    );
    let rate = (size / 4096 / 10).to_string(); // 10% of the pages per second
    let size_arg = size.to_string();
    let agent = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let (agent_a, agent_b) = (agent("a.agent"), agent("b.agent"));
    let node = |name: &'static str, agent: &str, init: bool| {
        let mut args = vec![
            "__demo-node",
            "--size",
            &size_arg,
            "--seed",
            "11",
            "--ops-per-sec",
            &rate,
            "--agent",
            agent,
            "--store",
            &spec,
        ];
        if init {
            args.push("--init");
        }
        let mut p = spawn(name, &args);
        p.event("ready");
        p
    };
    let a = node("a", &agent_a, true);
    let b = node("b", &agent_b, false);
    Some(Pair {
        a,
        b,
        agent_a,
        agent_b,
        size,
        _svc: svc,
        _dir: dir,
    })
}

/// `farmap seed` on `a`, `farmap leech` on `b` with `extra` arguments: the leech report.
fn migrate(p: &Pair, extra: &[&str]) -> Value {
    let mut seed = spawn(
        "seed",
        &[
            "seed",
            "--app",
            &p.agent_a,
            "--listen",
            "127.0.0.1:0",
            "--json",
        ],
    );
    let l = seed.stderr_line("waiting for a leecher: control on ");
    let rest = l.split("control on ").nth(1).unwrap();
    let (control, data) = rest.split_once(", data plane on ").unwrap();
    let mut args = vec![
        "leech",
        "--app",
        &p.agent_b,
        "--from",
        control.trim(),
        "--data",
        data.trim(),
        "--max-downtime",
        "10ms",
        "--json",
    ];
    args.extend_from_slice(extra);
    let leech = spawn("leech", &args);
    let (ok, report, err) = finish(leech);
    assert!(ok, "leech failed: {err}");
    let (ok, _, err) = finish(seed);
    assert!(ok, "seed failed: {err}");
    report
}

#[test]
fn a_region_over_redis_migrates_live_and_redis_holds_the_hand_over_image() {
    let Some(mut p) = pair("a_region_over_redis_migrates_live_and_redis_holds_the_hand_over_image")
    else {
        return;
    };
    // Let a few push rounds run with the writer going.
    std::thread::sleep(Duration::from_millis(300));
    let before = verify(&mut p.a);
    let report = migrate(&p, &[]);
    let handed_over_at = report["resumed_at_op"]
        .as_u64()
        .unwrap_or_else(|| panic!("resumed_at_op missing in {report}"));
    assert!(handed_over_at >= before, "{handed_over_at} < {before}");

    // The source synced what it held at the hand-over, and holds nothing now.
    let released = p.a.event("released");
    assert_eq!(released["synced"], true, "{released}");
    p.a.send("verify");
    assert_eq!(p.a.event("verified")["error"], "no region here");

    // The destination runs on with every write, and the writer goes on there.
    std::thread::sleep(Duration::from_millis(200));
    let after = verify(&mut p.b);
    assert!(
        after > handed_over_at,
        "{after} ops <= {handed_over_at} at the hand-over"
    );

    // Redis, read by a fresh client, holds the image at the hand-over.
    p.b.send(&format!("check-store {handed_over_at}"));
    let checked = p.b.event("store-checked");
    assert_eq!(checked["ok"], true, "{checked}");
}

#[test]
fn an_instant_migration_over_redis_takes_only_what_redis_lacks() {
    let Some(mut p) = pair("an_instant_migration_over_redis_takes_only_what_redis_lacks") else {
        return;
    };
    std::thread::sleep(Duration::from_millis(300));
    let before = verify(&mut p.a);
    let report = migrate(&p, &["--mode", "instant"]);
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
        "most chunks come from Redis: {report}"
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
    let released = p.a.event("released");
    assert_eq!(released["handed_store_over"], true, "{released}");
    // Every write is there, and the writer goes on at the destination.
    std::thread::sleep(Duration::from_millis(200));
    let after = verify(&mut p.b);
    assert!(after > handed_over_at, "{after} <= {handed_over_at}");
}
