//! `farmap region limit` and `farmap region stats` against a real application: the demo's
//! node (`farmap __demo-node --init --local-max …`) holds a bounded userfaultfd region that
//! a deterministic writer keeps changing, with its agent on a Unix socket. The limit is
//! lowered while the writer runs; resident memory (the pager's count and the page tables)
//! must come down to it and stay there, and the region must still hold exactly what the
//! writer wrote. Bad input is refused with a clear message and a non-zero exit.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use farmap_testkit::process::{lines, next_event, wait_or_kill};
use serde_json::Value;

mod common;
use common::farmap;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const WAIT: Duration = Duration::from_secs(60);

/// Whether bounded regions work here (userfaultfd with WP_ASYNC and UFFDIO_MOVE); if not,
/// `test` is recorded as skipped.
fn paging_usable(test: &str) -> bool {
    let Some(s) = farmap_testkit::skip::unless(test, farmap_uffd::probe()) else {
        return false;
    };
    if s.tracking == farmap_uffd::TrackingMode::Async
        && s.features & farmap_uffd::sys::UFFD_FEATURE_MOVE != 0
    {
        return true;
    }
    farmap_testkit::skip(
        test,
        format_args!(
            "bounded regions need WP_ASYNC and UFFDIO_MOVE; this kernel offers {:#x}",
            s.features
        ),
    );
    false
}

/// Runs farmap with `--json` and returns its one JSON line.
fn farmap_json(args: &[&str]) -> Value {
    farmap().json(args)
}

/// Runs farmap expecting it to fail; returns its stderr, which must say `says`.
fn farmap_fails(args: &[&str], says: &str) -> String {
    let out = farmap().run(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "farmap {args:?} succeeded: {stderr}");
    assert!(
        out.stdout.is_empty(),
        "nothing on stdout when it fails: {:?}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(
        stderr.contains(says),
        "farmap {args:?}: stderr lacks {says:?}: {stderr}"
    );
    stderr
}

/// A demo node: its stdout lines as they come, its stdin for `verify`.
struct Node {
    child: Child,
    stdin: ChildStdin,
    out: mpsc::Receiver<String>,
    agent: PathBuf,
}

impl Node {
    fn start(dir: &Path, name: &str, size: u64, extra: &[&str]) -> Node {
        let agent = dir.join(format!("{name}.agent"));
        let mut child = farmap()
            .command()
            .args(["__demo-node", "--size", &size.to_string(), "--seed", "7"])
            .args(["--ops-per-sec", "20000", "--agent"])
            .arg(&agent)
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start farmap __demo-node");
        let out = lines(child.stdout.take().unwrap(), None);
        let mut node = Node {
            stdin: child.stdin.take().unwrap(),
            child,
            out,
            agent,
        };
        node.event("ready");
        node
    }

    fn agent(&self) -> &str {
        self.agent.to_str().unwrap()
    }

    fn event(&mut self, event: &str) -> Value {
        next_event(&self.out, event, "the node", WAIT)
    }

    /// Pauses the writer and compares the whole region with the image recomputed from its
    /// history; returns the writer's op count.
    fn verify(&mut self) -> u64 {
        writeln!(self.stdin, "verify").unwrap();
        self.stdin.flush().unwrap();
        let v = self.event("verified");
        assert_eq!(v["ok"], true, "the region lost writes: {v}");
        v["ops"].as_u64().unwrap()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.stdin.flush();
        wait_or_kill(&mut self.child, Duration::from_secs(10));
    }
}

fn u(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("no number {key} in {v}"))
}

/// The bound holds in `r`: the pager's count and the page tables.
fn assert_within(r: &Value, limit: u64) {
    let bound = limit + u(r, "min_free_bytes");
    assert_eq!(u(r, "limit_bytes"), limit, "{r}");
    assert!(
        u(r, "resident_bytes") <= bound,
        "resident over the bound: {r}"
    );
    assert!(u(r, "staged_bytes") <= u(r, "resident_bytes"), "{r}");
    assert!(
        u(r, "local_bytes") <= bound,
        "pages in memory over the bound: {r}"
    );
    assert_eq!(r["within_limit"], true, "{r}");
}

#[test]
fn region_limit_lowers_a_running_applications_local_memory() {
    let test = "region_limit_lowers_a_running_applications_local_memory";
    if !paging_usable(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // 8 MiB in 64 KiB chunks: 128 chunks, half of them local, 2 kept free.
    let size = 8 * MIB;
    let mut node = Node::start(
        dir.path(),
        "bounded",
        size,
        &["--init", "--local-max", "50%", "--min-free", "2"],
    );
    let sock = node.agent().to_owned();

    let r = farmap_json(&["region", "stats", "--app", &sock, "--json"]);
    assert_eq!(u(&r, "region_bytes"), size, "{r}");
    assert_eq!(u(&r, "chunk_bytes"), 64 * KIB, "{r}");
    assert_eq!(u(&r, "min_free_bytes"), 2 * 64 * KIB, "{r}");
    assert_within(&r, 4 * MIB);
    // Writing the initial image through a half-size bound had to evict.
    assert!(
        u(&r, "evictions_reactive") + u(&r, "evictions_proactive") > 0,
        "{r}"
    );

    // Lowered while the writer runs: the reply comes once resident memory is down.
    let r = farmap_json(&["region", "limit", "--app", &sock, "1MiB", "--json"]);
    assert_within(&r, MIB);
    assert_eq!(
        u(&r, "min_free_bytes"),
        2 * 64 * KIB,
        "min_free stays as asked: {r}"
    );
    // And stays down while the writer keeps faulting chunks back in.
    let deadline = Instant::now() + Duration::from_secs(1);
    let mut samples = 0;
    while Instant::now() < deadline {
        assert_within(
            &farmap_json(&["region", "stats", "--app", &sock, "--json"]),
            MIB,
        );
        samples += 1;
    }
    assert!(samples >= 3, "only {samples} samples in a second");
    let ops = node.verify();
    assert!(ops > 0, "the writer ran");
    // Under a 1 MiB bound, the writer's chunks came back through faults.
    let r = farmap_json(&["region", "stats", "--app", &sock, "--json"]);
    assert!(u(&r, "faults") > 0, "{r}");
    assert!(u(&r, "prefetch_hits") <= u(&r, "prefetched"), "{r}");

    // A percentage, printed for people this time.
    let out = farmap().run(&["region", "limit", "--app", &sock, "25%"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.starts_with("local memory: limit 2 MiB (32 chunks of 64 KiB, 25.0% of 8 MiB)")
            && stdout.contains("; faults ")
            && stdout.contains(" touched, "),
        "{stdout}"
    );
    assert_within(
        &farmap_json(&["region", "stats", "--app", &sock, "--json"]),
        2 * MIB,
    );

    // Refused: nothing changes.
    farmap_fails(&["region", "limit", "--app", &sock, "0"], "0 bytes");
    farmap_fails(&["region", "limit", "--app", &sock, "150%"], "(0, 100]");
    farmap_fails(
        &["region", "limit", "--app", &sock, "1MiB", "--wait", "2m"],
        "--wait is at most 60s",
    );
    let r = farmap_json(&["region", "stats", "--app", &sock, "--json"]);
    assert_eq!(u(&r, "limit_bytes"), 2 * MIB, "{r}");
    // A bounded region cannot be seeded (its tracking does not see staged chunks' writes).
    farmap_fails(
        &["seed", "--app", &sock, "--listen", "127.0.0.1:0"],
        "bounded local memory",
    );
    // The whole region, read back through the bound, is still what the writer wrote.
    assert!(node.verify() > ops);
}

#[test]
fn region_limit_refuses_regions_without_a_bound_and_processes_without_a_region() {
    let test = "region_limit_refuses_regions_without_a_bound_and_processes_without_a_region";
    if !paging_usable(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let plain = Node::start(dir.path(), "plain", 2 * MIB, &["--init"]);
    for args in [
        &["region", "limit", "--app", plain.agent(), "1MiB"][..],
        &["region", "stats", "--app", plain.agent()][..],
    ] {
        farmap_fails(args, "opened without a local-memory limit");
    }
    let empty = Node::start(dir.path(), "empty", 2 * MIB, &[]);
    farmap_fails(
        &["region", "limit", "--app", empty.agent(), "50%", "--json"],
        "holds no userfaultfd region",
    );
    farmap_fails(
        &["region", "stats", "--app", empty.agent(), "--json"],
        "holds no userfaultfd region",
    );
}

#[test]
fn region_commands_and_local_max_refuse_bad_input_clearly() {
    let dir = tempfile::tempdir().unwrap();
    // Nobody listens: no such socket, and a stale one.
    let missing = dir.path().join("nobody.agent");
    let missing = missing.to_str().unwrap();
    farmap_fails(
        &["region", "limit", "--app", missing, "1MiB"],
        "no migration agent answers",
    );
    let stale = dir.path().join("stale.agent");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    farmap_fails(
        &["region", "stats", "--app", stale.to_str().unwrap()],
        "no migration agent answers",
    );
    // Checked before anything is sent.
    farmap_fails(&["region", "limit", "--app", missing, "0"], "0 bytes");
    farmap_fails(&["region", "limit", "--app", missing, "150%"], "(0, 100]");
    farmap_fails(&["region", "limit", "--app", missing, "lots"], "lots");
    // --local-max where a bound cannot work is refused, not ignored.
    let agent = dir.path().join("n.agent");
    let agent = agent.to_str().unwrap();
    let node = |extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = [
            "__demo-node",
            "--size",
            "1048576",
            "--seed",
            "1",
            "--ops-per-sec",
            "1",
            "--agent",
            agent,
        ]
        .map(String::from)
        .to_vec();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let run = |extra: &[&str], says: &str| {
        let args = node(extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let stderr = farmap_fails(&args, says);
        assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
    };
    run(&["--local-max", "50%"], "--local-max needs --init");
    run(
        &["--init", "--local-max", "50%", "--store", "memory:1MiB"],
        "--local-max cannot be used with --store",
    );
    run(
        &["--init", "--local-max", "50%", "--min-free", "0"],
        "--min-free",
    );
    let args = node(&["--init", "--min-free", "3"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    farmap_fails(&args, "--local-max");
    // The help explains the flags.
    let help = farmap().run(&["region", "limit", "--help"]);
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        help.contains("SIZE|N%") && help.contains("min_free"),
        "{help}"
    );
    let help = farmap().run(&["__demo-node", "--help"]);
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        help.contains("--local-max <SIZE|N%>") && help.contains("farmap region limit"),
        "{help}"
    );
}
