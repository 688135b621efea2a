//! `farmap run -- PROGRAM`: real programs (Python, sh) with their heap served by farmap
//! through the interposition library (`libfarmap_preload.so`), at a bound well under what
//! they allocate. Each test checks what the program itself verified, what farmap run
//! reports, and what the kernel says of the program's memory.

mod common;
use common::farmap;

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use farmap_testkit::skip::skip;
use serde_json::Value;

const PYTHON: &str = "/usr/bin/python3";

/// The interposition library of this build, or `None` (a recorded skip) when it, bounded
/// userfaultfd regions or python3 are missing.
fn preload(test: &str) -> Option<PathBuf> {
    let so = common::preload_library(test)?;
    if !std::path::Path::new(PYTHON).is_file() {
        skip(test, format!("{PYTHON} is missing"));
        return None;
    }
    Some(so)
}

/// `farmap run --preload SO ARGS...`, its output.
fn run(so: &std::path::Path, args: &[&str]) -> std::process::Output {
    let mut all = vec!["run", "--preload", so.to_str().unwrap()];
    all.extend_from_slice(args);
    farmap().run(&all)
}

/// The `--stats` lines farmap run printed on stderr.
fn stats_lines(stderr: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(stderr)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Python: 96 MiB of tagged buffers (1,536 × 64 KiB, each byte its buffer's tag), written
/// and verified from 4 threads, freed and allocated again, verified again.
const TAGGED: &str = r#"
import threading, sys
N, SIZE = 1536, 64 * 1024
bufs = [None] * N
def fill(k):
    for i in range(k, N, 4):
        bufs[i] = bytearray(bytes([i % 251]) * SIZE)
def check(k, bad):
    for i in range(k, N, 4):
        b = bufs[i]
        if len(b) != SIZE or b.count(i % 251) != SIZE:
            bad.append(i)
for step in (fill, None):
    if step:
        ts = [threading.Thread(target=fill, args=(k,)) for k in range(4)]
        [t.start() for t in ts]; [t.join() for t in ts]
    bad = []
    ts = [threading.Thread(target=check, args=(k, bad)) for k in range(4)]
    [t.start() for t in ts]; [t.join() for t in ts]
    if bad:
        print("bad", bad[:5]); sys.exit(1)
# Free every other buffer and allocate new ones with other tags: freed memory is reused.
for i in range(0, N, 2):
    bufs[i] = None
for i in range(0, N, 2):
    bufs[i] = bytearray(bytes([(i + 7) % 251]) * SIZE)
bad = [i for i in range(N) if bufs[i].count(((i + 7) if i % 2 == 0 else i) % 251) != SIZE]
print("verified", N - len(bad), "bad", len(bad))
sys.exit(1 if bad else 0)
"#;

#[test]
fn python_verifies_its_heap_at_a_third_of_what_it_allocates() {
    let test = "python_verifies_its_heap_at_a_third_of_what_it_allocates";
    let Some(so) = preload(test) else { return };
    let mut cmd = farmap().command();
    cmd.args([
        "run",
        "--preload",
        so.to_str().unwrap(),
        "--heap-max",
        "512MiB",
        "--local-max",
        "32MiB",
        "--stats",
        "--",
        PYTHON,
        "-c",
        TAGGED,
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let child = cmd.spawn().unwrap();
    let runner = child.id();
    // The program's resident set, sampled while it runs.
    let (done, max_rss) = (AtomicBool::new(false), AtomicU64::new(0));
    let out = std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                if let Some(rss) = children_of(runner).into_iter().filter_map(rss).max() {
                    max_rss.fetch_max(rss, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        let out = child.wait_with_output().unwrap();
        done.store(true, Ordering::Relaxed);
        out
    });
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "farmap run: {:?}\n{stdout}\n{stderr}",
        out.status
    );
    assert!(stdout.contains("verified 1536 bad 0"), "{stdout}");
    let stats = stats_lines(&out.stderr);
    assert_eq!(stats.len(), 1, "one program image: {stderr}");
    let s = &stats[0];
    eprintln!(
        "{s}; the program's largest resident set: {} bytes",
        max_rss.load(Ordering::Relaxed)
    );
    assert_eq!(s["limit_bytes"], 32 << 20);
    assert!(s["faults"].as_u64().unwrap() > 0, "{s}");
    assert!(
        s["evictions"].as_u64().unwrap() > 0,
        "96 MiB in 32 MiB and nothing evicted: {s}"
    );
    assert!(s["pushed_bytes"].as_u64().unwrap() > 0, "{s}");
    assert_eq!(s["end"], "Exited");
    // The bound plus Python itself (its code, libraries and interpreter state: about
    // 10 MB here) and the library's bootstrap heap.
    let max = max_rss.load(Ordering::Relaxed);
    assert!(max > 0, "the program's resident set was never sampled");
    assert!(
        max <= (32 + 32) << 20,
        "the program's resident set reached {max} bytes"
    );
}

#[test]
fn programs_that_allocate_little_start_and_end_cleanly_with_their_status() {
    let test = "programs_that_allocate_little_start_and_end_cleanly_with_their_status";
    let Some(so) = preload(test) else { return };
    let out = run(&so, &["--", "/bin/true"]);
    assert!(out.status.success(), "{out:?}");
    let out = run(&so, &["--", PYTHON, "-c", "pass"]);
    assert!(out.status.success(), "{out:?}");
    let out = run(&so, &["--", "/bin/sh", "-c", "exit 7"]);
    assert_eq!(out.status.code(), Some(7), "{out:?}");
    let out = run(&so, &["--", "/bin/sh", "-c", "kill -TERM $$"]);
    assert_eq!(out.status.code(), Some(128 + 15), "{out:?}");
    let out = run(&so, &["--", "/nonexistent/program"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("/nonexistent/program"),
        "{out:?}"
    );
}

#[test]
fn an_exec_starts_a_new_session() {
    let test = "an_exec_starts_a_new_session";
    let Some(so) = preload(test) else { return };
    let script = format!(
        "exec {PYTHON} -c 'b = [bytearray(65536) for _ in range(256)]; print(\"python\", len(b))'"
    );
    // The shell's heap is small: it gets a session only when regions open at start.
    let out = run(
        &so,
        &[
            "--stats",
            "--region-at",
            "0",
            "--",
            "/bin/sh",
            "-c",
            &script,
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("python 256"));
    let stats = stats_lines(&out.stderr);
    let ends: Vec<&str> = stats.iter().map(|s| s["end"].as_str().unwrap()).collect();
    assert_eq!(ends, ["Replaced", "Exited"], "{stderr}");
    // By default the shell, which holds less than 1 MiB, runs on plain memory: only
    // Python's image has a session.
    let out = run(&so, &["--stats", "--", "/bin/sh", "-c", &script]);
    assert!(out.status.success(), "{out:?}");
    let stats = stats_lines(&out.stderr);
    let ends: Vec<&str> = stats.iter().map(|s| s["end"].as_str().unwrap()).collect();
    assert_eq!(ends, ["Exited"], "{out:?}");
}

/// Python: 48 MiB of random 1 MiB blocks; three forked children each hash the whole heap
/// while the parent flips a byte of a third of the blocks and flips it back, and report
/// whether they saw what the parent had at the fork.
const FORKS: &str = r#"
import os, sys, hashlib
blocks = [bytearray(os.urandom(16)) * 65536 for _ in range(48)]
digest = hashlib.sha256(b"".join(blocks)).hexdigest()
pids = []
for k in range(3):
    pid = os.fork()
    if pid == 0:
        os._exit(0 if hashlib.sha256(b"".join(blocks)).hexdigest() == digest else 3)
    pids.append(pid)
    for b in blocks[k::3]:
        b[0] ^= 0xff
    for b in blocks[k::3]:
        b[0] ^= 0xff
bad = [pid for pid in pids if os.waitpid(pid, 0)[1] != 0]
same = hashlib.sha256(b"".join(blocks)).hexdigest() == digest
print("children bad", len(bad), "parent same", same)
sys.exit(0 if not bad and same else 1)
"#;

/// A forked child keeps its parent's heap (fork events: `farmap run` is root here): three
/// Python children read the whole heap, most of it written back to the store or staged at
/// an 8 MiB bound, while the parent changes it; a shell's pipelines and command
/// substitutions (children that fork before they exec) work.
#[test]
fn forked_children_read_their_parents_whole_heap_while_it_changes() {
    let test = "forked_children_read_their_parents_whole_heap_while_it_changes";
    let Some(so) = preload(test) else { return };
    if !rustix::process::geteuid().is_root() {
        // Fork events need CAP_SYS_PTRACE in the program.
        return skip(test, "fork events need root (CAP_SYS_PTRACE)");
    }
    let out = run(
        &so,
        &["--local-max", "8MiB", "--stats", "--", PYTHON, "-c", FORKS],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "children bad 0 parent same True",
        "{stderr}"
    );
    let stats = stats_lines(&out.stderr);
    assert_eq!(stats.len(), 1, "{stderr}");
    let s = &stats[0];
    assert_eq!(s["forks"], 3, "{s}");
    assert_eq!(s["forks_failed"], 0, "{s}");
    assert_eq!(s["forks_unpaused"], 0, "{s}");
    // Most of the 48 MiB was away from the region at each fork (the bound is 8 MiB).
    assert!(
        s["fork_copied_bytes"].as_u64().unwrap() > 3 * (32 << 20),
        "{s}"
    );
    assert!(s["evictions"].as_u64().unwrap() > 0, "{s}");
    let shell = "ls / >/dev/null; x=$(echo hi | tr a-z A-Z); for i in 1 2 3; do echo $i; done | wc -l; echo $x";
    let out = run(&so, &["--", "/bin/bash", "-c", shell]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "3\nHI\n", "{out:?}");
}

/// `--forks none` (and what a program without CAP_SYS_PTRACE gets): the heap is not
/// inherited, so a forked child that touches it is killed (SIGSEGV), loudly, rather than
/// reading zeros; fork + exec works.
#[test]
fn without_fork_copies_a_child_that_touches_the_heap_dies_loudly() {
    let test = "without_fork_copies_a_child_that_touches_the_heap_dies_loudly";
    let Some(so) = preload(test) else { return };
    let script = "import os, subprocess\n\
        b = bytearray(b'x' * (1 << 20))\n\
        pid = os.fork()\n\
        if pid == 0:\n    os._exit(b.count(b'x') == (1 << 20))\n\
        st = os.waitpid(pid, 0)[1]\n\
        print('signal', os.WTERMSIG(st) if os.WIFSIGNALED(st) else 0)\n\
        print(subprocess.run(['/bin/echo', 'exec ok'], capture_output=True).stdout.decode().strip())\n";
    let out = run(
        &so,
        &["--forks", "none", "--stats", "--", PYTHON, "-c", script],
    );
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "signal 11\nexec ok\n",
        "{out:?}"
    );
    // Python's image only: the echo (the child's exec) holds too little for a session.
    let stats = stats_lines(&out.stderr);
    assert_eq!(stats.len(), 1, "{out:?}");
    assert_eq!(stats[0]["forks"], 0, "{out:?}");
}

/// A process of the program that connects with a wrong token, or speaks nonsense, is
/// refused and changes nothing: the program's own session goes on.
#[test]
fn strangers_on_the_control_socket_are_refused() {
    let test = "strangers_on_the_control_socket_are_refused";
    let Some(so) = preload(test) else { return };
    let script = r#"
import os, socket, struct
path = os.environ["FARMAP_RUN_SOCK"]
def hello(token):
    body = token + struct.pack("<II", os.getpid(), 0)
    return b"FMRN" + struct.pack("<HHII", 1, 1, len(body), 0) + body
s = socket.socket(socket.AF_UNIX); s.connect(path)
s.sendall(hello(b"\x00" * 32))
verdict = s.recv(64)
status = struct.unpack("<H", verdict[16:18])[0] if len(verdict) >= 18 else None
s2 = socket.socket(socket.AF_UNIX); s2.connect(path)
s2.sendall(b"GET / HTTP/1.1\r\n\r\n" * 4)
try:
    rest = s2.recv(64)
except ConnectionResetError:
    rest = b""

data = [bytearray(b"x" * 100000) for _ in range(64)]
def fork_prepare(token, region):
    body = token + struct.pack("<IIQ", os.getpid(), 0, region)
    return b"FMRN" + struct.pack("<HHII", 1, 7, len(body), 0) + body
def verdict_of(msg):
    s = socket.socket(socket.AF_UNIX); s.connect(path)
    s.sendall(msg)
    v = s.recv(64)
    return struct.unpack("<H", v[16:18])[0] if len(v) >= 18 else None
token = bytes.fromhex(os.environ["FARMAP_RUN_TOKEN"])
# A fork announced with a wrong token, or for a region this process does not have, is
# refused (its pager is not paused); the heap goes on.
forks = (verdict_of(fork_prepare(b"\x00" * 32, 0x1000)), verdict_of(fork_prepare(token, 0x1000)))
print("status", status, "garbage answered", len(rest), "forks", forks,
      "ok", all(d.count(b"x") == 100000 for d in data))
"#;
    let out = run(&so, &["--", PYTHON, "-c", script]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        stdout.contains("status 1 garbage answered 0 forks (1, 5) ok True"),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Processes of the program that connect and say nothing, trickle a hello a byte a second,
/// or say hello with the right token and are killed before they register: none of them
/// holds `farmap run` past its handshake deadline (10 s) once the program is done, and the
/// program's own session goes on.
#[test]
fn silent_trickling_or_killed_peers_do_not_hold_farmap_run() {
    let test = "silent_trickling_or_killed_peers_do_not_hold_farmap_run";
    let Some(so) = preload(test) else { return };
    // The peers are other processes of the program, without the library (which would open
    // sessions of their own): fork + exec, as `subprocess` does.
    let script = r#"
import os, subprocess, sys
PEER = r"""
import os, signal, socket, struct, sys, time
s = socket.socket(socket.AF_UNIX); s.connect(os.environ["FARMAP_RUN_SOCK"])
open(os.path.join(os.environ["PEERS_READY"], str(os.getpid())), "w").close()
token = bytes.fromhex(os.environ["FARMAP_RUN_TOKEN"])
body = token + struct.pack("<II", os.getpid(), 0)
hello = b"FMRN" + struct.pack("<HHII", 1, 1, len(body), 0) + body
how = sys.argv[1]
if how == "silent":
    time.sleep(120)
elif how == "trickle":
    for b in hello * 4:
        try:
            s.send(bytes([b]))
        except OSError:
            sys.exit(3)
        time.sleep(1)
else:
    s.sendall(hello)
    s.recv(64)
    os.kill(os.getpid(), signal.SIGKILL)
"""
import tempfile, time
env = dict(os.environ)
env.pop("LD_PRELOAD", None)
env["PEERS_READY"] = tempfile.mkdtemp()
null = subprocess.DEVNULL
daemons = [subprocess.Popen([sys.executable, "-c", PEER, how], env=env, stdin=null,
                            stdout=null, stderr=null, start_new_session=True)
           for how in ("silent", "trickle")]
# Both connected before this program may end (on a loaded machine they could come after
# farmap run is done, and never meet its handshake deadline).
deadline = time.monotonic() + 20
while len(os.listdir(env["PEERS_READY"])) < 2 and time.monotonic() < deadline:
    time.sleep(0.01)
killed = subprocess.run([sys.executable, "-c", PEER, "killed"], env=env)
data = [bytearray(b"y" * 100000) for _ in range(64)]
print("daemons", *[d.pid for d in daemons], "killed", killed.returncode == -9,
      "ok", all(d.count(b"y") == 100000 for d in data), flush=True)
"#;
    let t = std::time::Instant::now();
    let out = run(&so, &["--", PYTHON, "-c", script]);
    let took = t.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr);
    // The daemons go, whatever the asserts say.
    for pid in stdout
        .split_whitespace()
        .skip_while(|w| *w != "daemons")
        .skip(1)
        .take(2)
        .filter_map(|w| w.parse::<i32>().ok())
    {
        // SAFETY: kill(2) of a pid this test's program started.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    assert!(out.status.success(), "{out:?}");
    assert!(stdout.contains("killed True ok True"), "{stdout} {stderr}");
    assert!(
        took < Duration::from_secs(30),
        "farmap run took {took:?}: {stderr}"
    );
    assert!(stderr.contains("handshake took longer"), "{stderr}");
}

/// Another user cannot reach the control socket (its directory is private to this user):
/// a process of the program that drops to `nobody` is refused by the kernel.
#[test]
fn another_user_cannot_reach_the_control_socket() {
    let test = "another_user_cannot_reach_the_control_socket";
    let Some(so) = preload(test) else { return };
    if !rustix::process::geteuid().is_root() {
        return skip(test, "switching to another user needs root");
    }
    let Some(setpriv) = ["/usr/bin/setpriv", "/bin/setpriv"]
        .into_iter()
        .find(|p| std::path::Path::new(p).is_file())
    else {
        return skip(test, "setpriv is missing (util-linux)");
    };
    let connect = "import os, socket\n\
        s = socket.socket(socket.AF_UNIX)\n\
        try:\n    s.connect(os.environ['FARMAP_RUN_SOCK']); print('connected')\n\
        except PermissionError:\n    print('refused')\n";
    let script = format!(
        "env -u LD_PRELOAD {setpriv} --reuid=65534 --regid=65534 --clear-groups \
         {PYTHON} -c \"{connect}\""
    );
    let out = run(&so, &["--", "/bin/sh", "-c", &script]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(stdout.trim(), "refused", "{out:?}");
}

/// redis-server under `farmap run` at a 16 MiB bound keeps 40,000 keys of 1 KiB (about
/// 45 MB with redis's overhead): every key reads back with its value; `farmap region stats`
/// and `limit` reach the running program through `--agent`; a `BGSAVE` (a fork) saves
/// every key as it was at the fork.
#[test]
fn redis_keeps_its_keys_under_farmap_run_at_a_small_bound() {
    let test = "redis_keeps_its_keys_under_farmap_run_at_a_small_bound";
    let Some(so) = preload(test) else { return };
    if !installed(test, "redis-server") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (redis_sock, agent) = (dir.path().join("redis.sock"), dir.path().join("agent.sock"));
    let mut cmd = farmap().command();
    cmd.args(["run", "--preload", so.to_str().unwrap()])
        .args([
            "--heap-max",
            "1GiB",
            "--local-max",
            "16MiB",
            "--stats",
            "--agent",
        ])
        .arg(&agent)
        .args([
            "--",
            "redis-server",
            "--port",
            "0",
            "--save",
            "",
            "--appendonly",
            "no",
            "--enable-debug-command",
            "yes",
        ])
        .arg("--unixsocket")
        .arg(&redis_sock)
        .current_dir(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut runner = farmap_testkit::process::KillOnDrop(cmd.spawn().unwrap());
    let cli = |args: &[&str]| redis_cli(&redis_sock, args);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while cli(&["PING"]) != "PONG" {
        assert!(
            runner.0.try_wait().unwrap().is_none(),
            "farmap run ended before redis answered"
        );
        assert!(std::time::Instant::now() < deadline, "redis never answered");
        std::thread::sleep(Duration::from_millis(20));
    }
    let value = "string.rep(string.char(65 + i % 26), 1000) .. i";
    let fill = format!(
        "for i=1,40000 do redis.call('SET', 'k'..i, {value}) end return redis.call('DBSIZE')"
    );
    assert_eq!(cli(&["EVAL", &fill, "0"]), "40000");
    let check = format!(
        "for i=1,40000 do if redis.call('GET', 'k'..i) ~= {value} then return i end end return 0"
    );
    assert_eq!(cli(&["EVAL", &check, "0"]), "0", "a key read back wrong");
    // The agent: the bound and the counters of the running program; then a lower bound.
    let agent = agent.to_str().unwrap();
    let state = farmap().json(&["region", "stats", "--app", agent, "--json"]);
    assert_eq!(state["limit_bytes"], 16 << 20, "{state}");
    assert!(state["faults"].as_u64().unwrap() > 0, "{state}");
    assert_eq!(state["within_limit"], true, "{state}");
    let lowered = farmap().json(&["region", "limit", "--app", agent, "8MiB", "--json"]);
    assert_eq!(lowered["limit_bytes"], 8 << 20, "{lowered}");
    assert_eq!(lowered["within_limit"], true, "{lowered}");
    assert_eq!(
        cli(&["EVAL", &check, "0"]),
        "0",
        "a key read back wrong at 8 MiB"
    );
    // BGSAVE: redis forks, and the child writes every key from its copy of the heap (most
    // of which was staged or in the store at the fork) while the parent takes writes.
    let digest = cli(&["DEBUG", "DIGEST"]);
    assert_eq!(digest.len(), 40, "{digest}");
    assert_eq!(cli(&["BGSAVE"]), "Background saving started");
    assert_eq!(cli(&["SET", "during", "the save"]), "OK");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while cli(&["INFO", "persistence"]).contains("rdb_bgsave_in_progress:1") {
        assert!(std::time::Instant::now() < deadline, "BGSAVE never ended");
        std::thread::sleep(Duration::from_millis(20));
    }
    let info = cli(&["INFO", "persistence"]);
    assert!(info.contains("rdb_last_bgsave_status:ok"), "{info}");
    let _ = cli(&["SHUTDOWN", "NOSAVE"]);
    let stats = ended_with_evictions(runner);
    assert_eq!(stats["forks"], 1, "{stats}");
    assert_eq!(stats["forks_failed"], 0, "{stats}");
    assert_eq!(stats["forks_unpaused"], 0, "{stats}");
    // The pages the fork shared were made redis's own again (the kernel moves no shared
    // page), so no eviction failed on them.
    assert!(
        stats["fork_unshared_bytes"].as_u64().unwrap() > 0,
        "{stats}"
    );
    assert_eq!(stats["partial_moves"], 0, "{stats}");
    // The saved keys, loaded by a redis of its own, have the digest of the keys at the fork.
    let plain_sock = dir.path().join("plain.sock");
    let mut plain = std::process::Command::new("redis-server");
    plain
        .args(["--port", "0", "--save", "", "--appendonly", "no"])
        .args(["--enable-debug-command", "yes", "--unixsocket"])
        .arg(&plain_sock)
        .current_dir(dir.path())
        .stdout(Stdio::null());
    let _plain = farmap_testkit::process::KillOnDrop(plain.spawn().unwrap());
    let plain_cli = |args: &[&str]| redis_cli(&plain_sock, args);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while plain_cli(&["PING"]) != "PONG" {
        assert!(
            std::time::Instant::now() < deadline,
            "the plain redis never answered"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(plain_cli(&["DBSIZE"]), "40000");
    assert_eq!(plain_cli(&["DEBUG", "DIGEST"]), digest);
    let _ = plain_cli(&["SHUTDOWN", "NOSAVE"]);
}

/// memcached under `farmap run` at a 16 MiB bound keeps 20,000 items of 2 KB (41 MB of
/// items): every one reads back with its value, through the text protocol on a Unix socket.
#[test]
fn memcached_keeps_its_items_under_farmap_run_at_a_small_bound() {
    let test = "memcached_keeps_its_items_under_farmap_run_at_a_small_bound";
    let Some(so) = preload(test) else { return };
    if !installed(test, "memcached") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("memcached.sock");
    let script = format!(
        r#"
import socket, sys, time
deadline = time.time() + 30
while True:
    try:
        s = socket.socket(socket.AF_UNIX); s.connect({sock:?}); break
    except OSError:
        if time.time() > deadline: sys.exit("memcached never answered")
        time.sleep(0.02)
f = s.makefile("rwb")
N = 20000
val = lambda i: bytes([65 + i % 26]) * 2000 + str(i).encode()
for i in range(N):
    v = val(i)
    f.write(b"set k%d 0 0 %d noreply\r\n%s\r\n" % (i, len(v), v))
f.flush()
bad = 0
for i in range(N):
    f.write(b"get k%d\r\n" % i); f.flush()
    line = f.readline()
    if not line.startswith(b"VALUE"):
        bad += 1; continue
    v = f.read(int(line.split()[3]) + 2)[:-2]; f.readline()
    bad += v != val(i)
f.write(b"shutdown\r\n"); f.flush()
print("bad", bad)
"#,
        sock = sock.to_str().unwrap()
    );
    let mut cmd = farmap().command();
    cmd.args(["run", "--preload", so.to_str().unwrap()])
        .args([
            "--heap-max",
            "1GiB",
            "--local-max",
            "16MiB",
            "--stats",
            "--",
        ])
        .args([
            "memcached",
            "-u",
            "root",
            "-m",
            "128",
            "-U",
            "0",
            "-t",
            "2",
            "-A",
            "-s",
        ])
        .arg(&sock)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let runner = farmap_testkit::process::KillOnDrop(cmd.spawn().unwrap());
    let client = std::process::Command::new(PYTHON)
        .args(["-c", &script])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&client.stdout);
    assert!(
        out.contains("bad 0"),
        "{out} {}",
        String::from_utf8_lossy(&client.stderr)
    );
    ended_with_evictions(runner);
}

/// Whether `program` can be run here (a recorded skip otherwise).
fn installed(test: &str, program: &str) -> bool {
    let found = std::process::Command::new(program)
        .arg("--version")
        .output()
        .is_ok();
    if !found {
        skip(test, format!("{program} is not installed"));
    }
    found
}

/// A successful `--json` command's rows (one JSON object per stdout line), and its stderr.
fn json_rows(out: &std::process::Output) -> (Vec<Value>, String) {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    let rows = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (rows, stderr)
}

/// `redis-cli -s SOCK ARGS...`: its answer, trimmed.
fn redis_cli(sock: &std::path::Path, args: &[&str]) -> String {
    let out = std::process::Command::new("redis-cli")
        .arg("-s")
        .arg(sock)
        .args(args)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Waits for a `farmap run --stats` started with its stderr piped: it succeeded, printed
/// one program image's report, and that image's heap evicted something. Returns the report.
fn ended_with_evictions(mut runner: farmap_testkit::process::KillOnDrop) -> Value {
    let status = runner.0.wait().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(runner.0.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert!(status.success(), "farmap run: {status:?}\n{stderr}");
    let stats = stats_lines(stderr.as_bytes());
    assert_eq!(stats.len(), 1, "{stderr}");
    eprintln!("{}", stats[0]);
    assert!(stats[0]["evictions"].as_u64().unwrap() > 0, "{stderr}");
    stats[0].clone()
}

/// The pids of `pid`'s children.
fn children_of(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("children")).ok())
        .flat_map(|c| {
            c.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

/// A process's resident set (`VmRSS`), bytes.
fn rss(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// `farmap bench run --quick` (the benchmark's smoke test, not a measurement): redis and
/// memcached under YCSB and redis-benchmark, unlimited and under `farmap run` at 30% of the
/// working set. Every row has the columns other tools read, every value YCSB read back was
/// right (and redis's keyspace digest matched the unlimited run's), and the bounded runs
/// faulted and evicted.
#[test]
fn bench_run_rows_are_verified_for_redis_and_memcached() {
    let test = "bench_run_rows_are_verified_for_redis_and_memcached";
    let Some(so) = preload(test) else { return };
    if !installed(test, "redis-server") || !installed(test, "memcached") {
        return;
    }
    if !installed(test, "java") || !installed(test, "mvn") {
        return;
    }
    let out = farmap().run(&[
        "bench",
        "run",
        "--quick",
        "--system",
        "unlimited,farmap",
        "--workload",
        "ycsb-b,redis-benchmark",
        "--local",
        "30%",
        "--preload",
        so.to_str().unwrap(),
        "--json",
    ]);
    let (rows, _) = json_rows(&out);
    let want = [
        ("redis", "ycsb-b"),
        ("redis", "redis-benchmark-hgetall"),
        ("memcached", "ycsb-b"),
    ];
    assert_eq!(rows.len(), want.len() * 2, "{rows:#?}");
    for (program, workload) in want {
        for system in ["unlimited", "farmap"] {
            let row = rows
                .iter()
                .find(|r| {
                    r["program"] == program && r["workload"] == workload && r["system"] == system
                })
                .unwrap_or_else(|| panic!("no row for {program} {workload} {system}: {rows:#?}"));
            for key in [
                "bench",
                "local_percent",
                "ops_per_s",
                "p50_us",
                "p99_us",
                "p99_9_us",
                "faults",
                "evictions",
                "rss_max_bytes",
                "verified",
            ] {
                assert!(row.get(key).is_some(), "{key} missing: {row}");
            }
            assert_eq!(row["bench"], "run");
            assert_eq!(row["verified"], true, "{row}");
            assert!(row["ops_per_s"].as_f64().unwrap() > 0.0, "{row}");
            assert!(row["rss_max_bytes"].as_u64().unwrap() > 0, "{row}");
            if system == "farmap" {
                assert_eq!(row["local_percent"], 30.0, "{row}");
                assert!(row["faults"].as_u64().unwrap() > 0, "{row}");
                assert!(row["evictions"].as_u64().unwrap() > 0, "{row}");
            }
        }
    }
}

/// `farmap bench run --budget-pair --quick` (a smoke test, not a measurement): a row per
/// split of the pair's memory, each verified, the static one at half the total, and the
/// ratio said. (Whether the budget moves memory is `tests/budget.rs`'s question.)
#[test]
fn bench_run_budget_pair_prints_a_verified_row_per_split() {
    let test = "bench_run_budget_pair_prints_a_verified_row_per_split";
    let Some(so) = preload(test) else { return };
    if !installed(test, "redis-server") || !installed(test, "java") || !installed(test, "mvn") {
        return;
    }
    let out = farmap().run(&[
        "bench",
        "run",
        "--quick",
        "--program",
        "redis",
        "--budget-pair",
        "--local",
        "30%",
        "--preload",
        so.to_str().unwrap(),
        "--json",
    ]);
    let (rows, stderr) = json_rows(&out);
    let splits: Vec<&str> = rows.iter().map(|r| r["budget"].as_str().unwrap()).collect();
    assert_eq!(splits, ["static", "shared"], "{rows:#?}");
    for row in &rows {
        assert_eq!(row["system"], "farmap", "{row}");
        assert_eq!(row["verified"], true, "{row}");
        assert!(row["ops_per_s"].as_f64().unwrap() > 0.0, "{row}");
        let total = row["limit_bytes"].as_u64().unwrap();
        assert!(row["local_bytes"].as_u64().unwrap() <= total, "{row}");
    }
    assert_eq!(
        rows[0]["local_bytes"].as_u64().unwrap(),
        rows[0]["limit_bytes"].as_u64().unwrap() / 2,
        "the static split is half each: {}",
        rows[0]
    );
    assert!(
        stderr.contains("budget pair: the busy redis ran"),
        "{stderr}"
    );
}
