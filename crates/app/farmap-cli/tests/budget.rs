//! `farmap budget NAME --total SIZE` and `farmap run --budget NAME`: programs share a total
//! of local memory, divided by their faults and active memory; an idle program gives
//! memory back; a hostile member does not bring the coordinator down.

mod common;
use common::farmap;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use farmap_testkit::process::KillOnDrop;
use farmap_testkit::skip::skip;
use serde_json::Value;

const PYTHON: &str = "/usr/bin/python3";
const MIB: u64 = 1 << 20;

/// The interposition library of this build, or `None` (a recorded skip) when it, bounded
/// userfaultfd regions or python3 are missing.
fn preload(test: &str) -> Option<PathBuf> {
    let so = common::preload_library(test)?;
    if !Path::new(PYTHON).is_file() {
        skip(test, format!("{PYTHON} is missing"));
        return None;
    }
    Some(so)
}

/// `farmap budget SOCKET --total TOTAL --interval INTERVAL`, once its socket answers.
fn coordinator(sock: &Path, total: &str, interval: &str) -> KillOnDrop {
    let mut cmd = farmap().command();
    cmd.arg("budget")
        .arg(sock)
        .args(["--total", total, "--interval", interval])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    let mut child = KillOnDrop(cmd.spawn().unwrap());
    let deadline = Instant::now() + Duration::from_secs(20);
    while UnixStream::connect(sock).is_err() {
        assert!(child.0.try_wait().unwrap().is_none(), "farmap budget ended");
        assert!(Instant::now() < deadline, "farmap budget never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

/// `farmap budget SOCKET --status --json`.
fn status(sock: &Path) -> Value {
    farmap().json(&["budget", sock.to_str().unwrap(), "--status", "--json"])
}

/// The member whose agent is `agent`, in a status.
fn member<'a>(status: &'a Value, agent: &Path) -> Option<&'a Value> {
    status["members"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["agent"].as_str() == Some(agent.to_str().unwrap()))
}

/// The sum of the shares in a status, checked against the total.
fn shares_within_total(status: &Value) -> u64 {
    let sum: u64 = status["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["share_bytes"].as_u64().unwrap())
        .sum();
    let total = status["total_bytes"].as_u64().unwrap();
    assert!(sum <= total, "shares add up to {sum} > {total}: {status}");
    sum
}

/// Python: 96 MiB of tagged buffers (1,536 × 64 KiB), every page written again and again
/// (with its own tag) until FILE exists; then every byte verified.
const BUSY: &str = r#"
import os, sys
N, SIZE, STOP = 1536, 64 * 1024, sys.argv[1]
bufs = [bytearray(bytes([i % 251]) * SIZE) for i in range(N)]
print("allocated", flush=True)
rounds = 0
while not os.path.exists(STOP):
    for i in range(N):
        b, t = bufs[i], i % 251
        for j in range(0, SIZE, 4096):
            b[j] = t
    rounds += 1
bad = [i for i in range(N) if bufs[i].count(i % 251) != SIZE]
print("rounds", rounds, "verified", N - len(bad), "bad", len(bad), flush=True)
sys.exit(1 if bad else 0)
"#;

/// Python: 16 MiB of tagged buffers, then nothing until FILE exists; then verified.
const IDLE: &str = r#"
import os, sys, time
N, SIZE, STOP = 256, 64 * 1024, sys.argv[1]
bufs = [bytearray(bytes([(i * 7) % 251]) * SIZE) for i in range(N)]
print("allocated", flush=True)
while not os.path.exists(STOP):
    time.sleep(0.05)
bad = [i for i in range(N) if bufs[i].count((i * 7) % 251) != SIZE]
print("verified", N - len(bad), "bad", len(bad), flush=True)
sys.exit(1 if bad else 0)
"#;

/// `farmap run --budget SOCK --agent AGENT -- python3 -c SCRIPT STOP`.
fn member_run(so: &Path, budget: &Path, agent: &Path, script: &str, stop: &Path) -> KillOnDrop {
    let mut cmd = farmap().command();
    cmd.args([
        "run",
        "--preload",
        so.to_str().unwrap(),
        "--heap-max",
        "512MiB",
    ])
    .arg("--budget")
    .arg(budget)
    .arg("--agent")
    .arg(agent)
    .args(["--", PYTHON, "-c", script])
    .arg(stop)
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    KillOnDrop(cmd.spawn().unwrap())
}

/// Two programs in a 64 MiB budget divided every 300 ms: one writes every page of a 96 MiB
/// heap again and again, the other allocates 16 MiB and sleeps. Within a few intervals the
/// busy one's share is well above the idle one's (which is down to the floor), the shares
/// add up to at most the total at every look, `farmap region stats` shows the budget, the
/// busy program's data verifies, and members that end are dropped.
#[test]
fn a_busy_program_gets_the_memory_an_idle_one_gives_back() {
    let test = "a_busy_program_gets_the_memory_an_idle_one_gives_back";
    let Some(so) = preload(test) else { return };
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("web.sock");
    let stop = dir.path().join("stop");
    let _coordinator = coordinator(&sock, "64MiB", "300ms");
    let (busy_agent, idle_agent) = (dir.path().join("busy.sock"), dir.path().join("idle.sock"));
    let mut busy = member_run(&so, &sock, &busy_agent, BUSY, &stop);
    let mut idle = member_run(&so, &sock, &idle_agent, IDLE, &stop);
    let deadline = Instant::now() + Duration::from_secs(40);
    let mut looks = 0;
    let (busy_share, idle_share) = loop {
        assert!(
            Instant::now() < deadline,
            "the shares never parted: {}",
            status(&sock)
        );
        for (name, p) in [("busy", &mut busy), ("idle", &mut idle)] {
            if let Some(s) = p.0.try_wait().unwrap() {
                let mut err = String::new();
                p.0.stderr.take().unwrap().read_to_string(&mut err).unwrap();
                panic!("the {name} program ended early ({s}): {err}");
            }
        }
        std::thread::sleep(Duration::from_millis(300));
        let st = status(&sock);
        shares_within_total(&st);
        looks += 1;
        let (Some(b), Some(i)) = (member(&st, &busy_agent), member(&st, &idle_agent)) else {
            continue;
        };
        let (bs, is) = (
            b["share_bytes"].as_u64().unwrap(),
            i["share_bytes"].as_u64().unwrap(),
        );
        // Well apart: the idle one at the floor (5% of 64 MiB), the busy one at 3/4 of
        // the total or more.
        let served = b["limit_bytes"].as_u64().is_some() && i["limit_bytes"].as_u64().is_some();
        if served && i["reason"] == "idle" && is <= 4 * MIB && bs >= 48 * MIB {
            eprintln!("after {looks} looks: {st}");
            break (bs, is);
        }
    };
    assert!(
        busy_share >= 12 * idle_share,
        "busy {busy_share}, idle {idle_share}"
    );
    // The run shows its budget (the share set last: it may have moved since the status).
    let stats = farmap().json(&[
        "region",
        "stats",
        "--app",
        busy_agent.to_str().unwrap(),
        "--json",
    ]);
    let b = &stats["budget"];
    assert_eq!(b["name"], "web", "{stats}");
    assert_eq!(b["total_bytes"], 64 * MIB, "{stats}");
    assert_eq!(b["share_bytes"], stats["limit_bytes"], "{stats}");
    assert!(b["reason"].is_string(), "{stats}");
    assert!(stats["referenced_bytes"].is_u64(), "{stats}");
    // A share is applied without waiting for reclaim (`wait_ms` 0): the idle program
    // comes down to it within moments.
    let settle = Instant::now();
    let idle_stats = loop {
        let idle_stats = farmap().json(&[
            "region",
            "stats",
            "--app",
            idle_agent.to_str().unwrap(),
            "--json",
        ]);
        let within = idle_stats["resident_bytes"].as_u64().unwrap()
            <= idle_stats["limit_bytes"].as_u64().unwrap()
                + idle_stats["min_free_bytes"].as_u64().unwrap();
        if within || settle.elapsed() > Duration::from_secs(2) {
            eprintln!(
                "the idle program within its share after {:?}",
                settle.elapsed()
            );
            break idle_stats;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(idle_stats["budget"]["reason"], "idle", "{idle_stats}");
    assert!(
        idle_stats["resident_bytes"].as_u64().unwrap()
            <= idle_stats["limit_bytes"].as_u64().unwrap()
                + idle_stats["min_free_bytes"].as_u64().unwrap(),
        "the idle program holds more than its share 2 s after the status said so: {idle_stats}"
    );
    // Both verify their data, and leave the budget as they end.
    std::fs::write(&stop, b"").unwrap();
    for (name, mut p) in [("busy", busy), ("idle", idle)] {
        let (status, stdout, stderr) = finish(&mut p);
        assert!(status.success(), "{name}: {status:?}\n{stdout}\n{stderr}");
        assert!(stdout.contains("bad 0"), "{name}: {stdout}");
        eprintln!("{name}: {}", stdout.trim());
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while !status(&sock)["members"].as_array().unwrap().is_empty() {
        assert!(Instant::now() < deadline, "members that ended were kept");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits for a program: its status, stdout and stderr.
fn finish(p: &mut KillOnDrop) -> (std::process::ExitStatus, String, String) {
    let mut err = p.0.stderr.take().unwrap();
    let errs = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let mut stdout = String::new();
    p.0.stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    let status = p.0.wait().unwrap();
    (status, stdout, errs.join().unwrap())
}

/// A status line from the coordinator at `sock`, asked over a raw connection.
fn raw_status(sock: &Path) -> Value {
    let mut s = UnixStream::connect(sock).unwrap();
    s.write_all(b"{\"op\":\"status\"}\n").unwrap();
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).unwrap();
    serde_json::from_str(&line).unwrap()
}

/// Peers that send garbage, lines too long, joins naming what is not theirs or not a
/// socket, that say nothing, or whose agent answers junk or never answers: each is refused
/// or dropped, and the coordinator goes on answering.
#[test]
fn a_hostile_member_does_not_bring_the_coordinator_down() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("b.sock");
    let mut coordinator = coordinator(&sock, "64MiB", "100ms");
    let ask = |line: &[u8]| -> String {
        let mut s = UnixStream::connect(&sock).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = s.write_all(line);
        let mut answer = String::new();
        let _ = BufReader::new(s).read_line(&mut answer);
        answer
    };
    for (line, says) in [
        (&b"not json\n"[..], "a bad request"),
        (b"{\"op\":\"join\"}\n", "a bad request"),
        (
            b"{\"op\":\"join\",\"agent\":\"relative.sock\"}\n",
            "absolute",
        ),
        (
            b"{\"op\":\"join\",\"agent\":\"/etc/passwd\"}\n",
            "not a socket",
        ),
        (
            b"{\"op\":\"join\",\"agent\":\"/nonexistent/a.sock\"}\n",
            "not a socket",
        ),
    ] {
        let answer = ask(line);
        assert!(answer.contains(says), "{line:?}: {answer}");
    }
    let long = vec![b'x'; 1 << 20];
    let answer = ask(&long);
    assert!(answer.contains("longer"), "{answer}");
    // Connections that say nothing hold a slot for a while (5 s), no more.
    let silent: Vec<UnixStream> = (0..40)
        .map(|_| UnixStream::connect(&sock).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(5500));
    assert_eq!(raw_status(&sock)["event"], "status");
    // Agents that answer junk, a huge line, or nothing at all.
    let mut joined = Vec::new();
    let answers: [Vec<u8>; 3] = [
        b"{\"event\":\"paging\",\"region_bytes\":\"x\"}\n".to_vec(),
        vec![b'{'; 100_000],
        Vec::new(),
    ];
    for (i, answer) in answers.into_iter().enumerate() {
        let path = dir.path().join(format!("agent{i}.sock"));
        let listener = UnixListener::bind(&path).unwrap();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                let _ = conn.write_all(&answer);
                // Never closes: keep the connection open.
                std::mem::forget(conn);
            }
        });
        let mut s = UnixStream::connect(&sock).unwrap();
        let join = format!(
            "{{\"op\":\"join\",\"agent\":\"{}\",\"region_bytes\":18446744073709551615}}\n",
            path.display()
        );
        s.write_all(join.as_bytes()).unwrap();
        joined.push(s);
    }
    // Every join answered, with a share within the total.
    for s in &joined {
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line).unwrap();
        let v: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["event"], "joined", "{line}");
        assert!(
            v["note"]["share_bytes"].as_u64().unwrap() <= 64 * MIB,
            "{line}"
        );
    }
    // Their agents never answer properly: they are dropped after a few intervals.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let st = raw_status(&sock);
        assert_eq!(st["event"], "status", "{st}");
        shares_within_total(&st);
        if st["members"].as_array().unwrap().is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "hostile members kept: {st}");
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(silent);
    drop(joined);
    assert!(
        coordinator.0.try_wait().unwrap().is_none(),
        "the coordinator ended"
    );
    assert_eq!(raw_status(&sock)["event"], "status");
}
