//! `farmap swap on` / `farmap swap off`, run for real: a process in a memory cgroup (v1)
//! limited to a quarter of its working set swaps into a store — memory, and a remote
//! `farmap serve` behind a 10 ms proxy in managed mode — and its data checks out afterwards,
//! and the swap server took (almost) no new pages while serving it.
//!
//! Needs root, /dev/fuse, loop devices, util-linux (losetup, mkswap, swapon), the cgroup v1
//! memory controller and python3; without them the tests say "skipped" and why. The swap
//! tests run one at a time (a lock in this binary): each one's device has the highest
//! priority, and the assertions are on that device's own line of /proc/swaps.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use farmap_testkit::process::terminate;

mod common;
use common::farmap;

const WORKLOAD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/swap_workload.py");
const CGROUP_ROOT: &str = "/sys/fs/cgroup/memory";
/// The working set and the cgroup's limit: a quarter of it.
const WORKING_SET_MIB: u64 = 256;
const LIMIT_MIB: u64 = 64;
/// The workload is killed (and the test fails) if it takes longer.
const WORKLOAD_TIMEOUT: Duration = Duration::from_secs(50);

/// One swap test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn runs(tool: &str, args: &[&str]) -> bool {
    Command::new(tool)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether this machine can run the swap tests; records a skip when not.
fn can_run(test: &str) -> bool {
    if !rustix::process::geteuid().is_root() {
        farmap_testkit::skip(test, "swapon, losetup and memory cgroups need root");
        return false;
    }
    if !Path::new("/dev/fuse").exists() {
        farmap_testkit::skip(test, "/dev/fuse is missing (no FUSE in this kernel)");
        return false;
    }
    if !Path::new("/dev/loop-control").exists() {
        let _ = runs("modprobe", &["loop"]);
        if !Path::new("/dev/loop-control").exists() {
            farmap_testkit::skip(
                test,
                "no loop devices (/dev/loop-control; modprobe loop failed)",
            );
            return false;
        }
    }
    for tool in ["losetup", "mkswap", "swapon", "swapoff"] {
        if !runs(tool, &["--version"]) {
            farmap_testkit::skip(test, format!("{tool} (util-linux) is missing"));
            return false;
        }
    }
    if !Path::new(CGROUP_ROOT)
        .join("memory.limit_in_bytes")
        .exists()
    {
        farmap_testkit::skip(
            test,
            format!("no cgroup v1 memory controller at {CGROUP_ROOT}"),
        );
        return false;
    }
    if !runs("python3", &["-V"]) {
        farmap_testkit::skip(test, "python3 is missing");
        return false;
    }
    true
}

/// A line of /proc/swaps: (device, used KiB, priority).
fn swaps() -> Vec<(String, u64, i64)> {
    std::fs::read_to_string("/proc/swaps")
        .unwrap()
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some((
                f.first()?.to_string(),
                f.get(3)?.parse().ok()?,
                f.get(4)?.parse().ok()?,
            ))
        })
        .collect()
}

fn loop_attached(device: &str) -> bool {
    let name = device.trim_start_matches("/dev/");
    Path::new(&format!("/sys/block/{name}/loop/backing_file")).exists()
}

/// A `farmap swap on` process; `swap off` and SIGTERM when dropped (also after a failure).
struct SwapOn {
    child: Child,
    device: String,
    dir: PathBuf,
    done: bool,
}

impl SwapOn {
    fn start(store: &str, args: &[&str]) -> SwapOn {
        let mut child = farmap()
            .command()
            .args(["swap", "on", store, "--priority", "32767", "--json"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start farmap swap on");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        if line.is_empty() {
            let status = child.wait().unwrap();
            panic!("farmap swap on printed nothing and exited with {status} (see its stderr)");
        }
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        let device = v["device"].as_str().unwrap().to_owned();
        let dir = PathBuf::from(v["mountpoint"].as_str().unwrap());
        assert_eq!(v["pid"], child.id(), "{line}");
        assert_eq!(
            v["direct_io"], true,
            "direct I/O over the FUSE file works here: {line}"
        );
        assert!(device.starts_with("/dev/loop"), "{line}");
        assert!(dir.join("swap").exists(), "{line}");
        let mine = swaps().into_iter().find(|s| s.0 == device);
        assert_eq!(
            mine.map(|s| s.2),
            Some(32767),
            "{device} is swap, priority 32767"
        );
        SwapOn {
            child,
            device,
            dir,
            done: false,
        }
    }

    fn used_kib(&self) -> u64 {
        swaps()
            .into_iter()
            .find(|s| s.0 == self.device)
            .map_or(0, |s| s.1)
    }

    /// `farmap swap off DEVICE`; asserts that everything is gone afterwards.
    fn off(mut self) {
        self.done = true;
        let out = farmap().run(&["swap", "off", &self.device]);
        assert!(
            out.status.success(),
            "swap off: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let status = self.child.wait().unwrap();
        assert!(status.success(), "farmap swap on exited with {status}");
        assert!(swaps().iter().all(|s| s.0 != self.device), "swap is off");
        assert!(!loop_attached(&self.device), "the loop device is detached");
        assert!(!self.dir.exists(), "the private directory is gone");
    }
}

impl Drop for SwapOn {
    fn drop(&mut self) {
        if !self.done {
            let _ = farmap().run(&["swap", "off", &self.device]);
        }
        terminate(&mut self.child, Duration::from_secs(60));
    }
}

/// A memory cgroup (v1) of its own; its processes are killed and it is removed when dropped.
struct Cgroup {
    path: PathBuf,
}

impl Cgroup {
    fn new(name: &str, limit_mib: u64) -> Cgroup {
        let path =
            Path::new(CGROUP_ROOT).join(format!("farmap-test-{name}-{}", std::process::id()));
        if !path.exists() {
            std::fs::create_dir(&path).unwrap();
        }
        std::fs::write(
            path.join("memory.limit_in_bytes"),
            format!("{}", limit_mib << 20),
        )
        .unwrap();
        Cgroup { path }
    }

    fn procs(&self) -> Vec<String> {
        std::fs::read_to_string(self.path.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        for _ in 0..100 {
            let procs = self.procs();
            for pid in &procs {
                let _ = Command::new("kill").args(["-KILL", pid]).status();
            }
            if procs.is_empty() && std::fs::remove_dir(&self.path).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The workload's process; killed when dropped, or when it runs past the time box.
struct Workload {
    child: Child,
    stdin: Option<ChildStdin>,
    out: BufReader<std::process::ChildStdout>,
    finished: Arc<AtomicBool>,
}

impl Workload {
    /// Starts the Python working set inside `cg` (it moves itself in before exec).
    fn start(cg: &Cgroup, mib: u64) -> Workload {
        let script = format!(
            "echo $$ > {}/cgroup.procs && exec python3 {WORKLOAD} {mib}",
            cg.path.display()
        );
        let mut child = Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let finished = Arc::new(AtomicBool::new(false));
        let (watch, pid) = (finished.clone(), child.id());
        std::thread::spawn(move || {
            let start = Instant::now();
            while !watch.load(Ordering::Relaxed) {
                if start.elapsed() > WORKLOAD_TIMEOUT {
                    eprintln!("the workload ran past {WORKLOAD_TIMEOUT:?}: killing it");
                    let _ = Command::new("kill")
                        .args(["-KILL", &pid.to_string()])
                        .status();
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        Workload {
            stdin: child.stdin.take(),
            out: BufReader::new(child.stdout.take().unwrap()),
            child,
            finished,
        }
    }

    /// The next line: (word, VmSwap KiB, seconds).
    fn line(&mut self) -> (String, u64, f64) {
        let mut line = String::new();
        self.out.read_line(&mut line).unwrap();
        let f: Vec<&str> = line.split_whitespace().collect();
        assert!(
            f.len() == 3,
            "the workload said {line:?} (killed by the OOM killer or the time box?)"
        );
        (
            f[0].to_owned(),
            f[1].parse().unwrap(),
            f[2].parse().unwrap(),
        )
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        self.finished.store(true, Ordering::Relaxed);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A process's page faults so far (minor + major, every thread's: `/proc/PID/stat`) and
/// its resident memory in KiB (`VmRSS`).
fn faults_and_rss(pid: u32) -> (u64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command's closing parenthesis start at field 3 (state).
    let rest: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    let (minflt, majflt): (u64, u64) = (rest[7].parse().unwrap(), rest[9].parse().unwrap());
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    (minflt + majflt, rss)
}

/// Most page faults (4 KiB each) the swap server may take while the workload swaps through
/// it: its memory, locked and allocated up front, must not grow with the swapped pages (a
/// page it needed would come from reclaim, which may be waiting for this very swap-out).
const SERVER_FAULTS_MAX: u64 = 1024;

/// Runs the working set in a cgroup limited to a quarter of it, with `swap` the only swap it
/// can use (the highest priority); asserts that it swapped into it and that its data checks
/// out, and that the server took (almost) no new pages meanwhile. Prints the swap-in figure.
fn swap_through(swap: &SwapOn, name: &str) {
    let server = swap.child.id();
    let (faults0, rss0) = faults_and_rss(server);
    let others: Vec<_> = swaps().into_iter().filter(|s| s.0 != swap.device).collect();
    if !others.is_empty() {
        println!("other swap on this host (lower priority than ours): {others:?}");
    }
    let cg = Cgroup::new(name, LIMIT_MIB);
    let mut w = Workload::start(&cg, WORKING_SET_MIB);
    let (word, swapped_kib, write_s) = w.line();
    assert_eq!(word, "written");
    assert!(
        swapped_kib > 0,
        "the workload's VmSwap is 0: its pages did not go to swap"
    );
    let used = swap.used_kib();
    assert!(
        used >= swapped_kib / 2,
        "{} holds {used} KiB but the workload has {swapped_kib} KiB swapped out: another \
         swap took them",
        swap.device
    );
    // The cgroup held at most its limit: the rest of the working set was in swap.
    assert!(
        swapped_kib >= (WORKING_SET_MIB - LIMIT_MIB) * 1024 / 2,
        "only {swapped_kib} KiB swapped out of a {WORKING_SET_MIB} MiB working set in \
         {LIMIT_MIB} MiB"
    );
    let stdin = w.stdin.as_mut().unwrap();
    stdin.write_all(b"check\n").unwrap();
    stdin.flush().unwrap();
    let (word, _, read_s) = w.line();
    assert_eq!(word, "verified", "the data read back from swap is wrong");
    drop(w.stdin.take());
    let status = w.child.wait().unwrap();
    assert!(status.success(), "the workload exited with {status}");
    w.finished.store(true, Ordering::Relaxed);
    let (faults1, rss1) = faults_and_rss(server);
    println!(
        "{name}: the server took {} page faults and its RSS went from {} to {} MiB while \
         {} MiB were swapped through it",
        faults1 - faults0,
        rss0 / 1024,
        rss1 / 1024,
        swapped_kib / 1024
    );
    assert!(
        faults1 - faults0 <= SERVER_FAULTS_MAX,
        "the swap server took {} page faults (RSS {} -> {} KiB) while serving the swap: its \
         swap-out path allocates new memory",
        faults1 - faults0,
        rss0,
        rss1
    );
    println!(
        "{name}: {WORKING_SET_MIB} MiB written in {write_s:.2} s with {} MiB swapped out \
         (device: {} MiB used); read back and verified in {read_s:.2} s: swap-in about {:.0} \
         MB/s (debug build, shared machine)",
        swapped_kib / 1024,
        used / 1024,
        (swapped_kib * 1024) as f64 / read_s / 1e6,
    );
}

#[test]
fn a_cgroup_limited_to_a_quarter_swaps_into_a_memory_store() {
    if !can_run("a_cgroup_limited_to_a_quarter_swaps_into_a_memory_store") {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let swap = SwapOn::start("memory:512MiB", &[]);
    swap_through(&swap, "memory");
    swap.off();
}

#[test]
fn a_cgroup_limited_to_a_quarter_swaps_into_a_remote_store_behind_10ms_managed() {
    let test = "a_cgroup_limited_to_a_quarter_swaps_into_a_remote_store_behind_10ms_managed";
    if !can_run(test) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Their stderr drained: a closed pipe would fail their logging.
    let server = farmap()
        .listening(&[
            "serve",
            "memory:512MiB",
            "--listen",
            "127.0.0.1:0",
            "--quiet",
        ])
        .drained();
    let proxy = farmap()
        .listening(&[
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--to",
            server.addr(),
            "--rtt",
            "10ms",
        ])
        .drained();
    let swap = SwapOn::start(
        &format!("farmap://{}", proxy.addr()),
        &["--managed", "--push-interval", "200ms"],
    );
    swap_through(&swap, "remote");
    swap.off();
    // swap off flushed the managed store: the remote holds the swap area — its signature and
    // the pages swapped out (swapoff leaves them in place).
    let tmp = tempfile::tempdir().unwrap();
    let copy = tmp.path().join("remote.img");
    let out = farmap().run(&[
        "cp",
        &format!("farmap://{}", server.addr()),
        &format!("file:{}", copy.display()),
    ]);
    assert!(
        out.status.success(),
        "cp: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let data = std::fs::read(&copy).unwrap();
    assert_eq!(&data[4086..4096], b"SWAPSPACE2", "mkswap's signature");
    let written_pages = data[4096..]
        .chunks(4096)
        .filter(|p| p.iter().any(|&b| b != 0))
        .count() as u64;
    assert!(
        written_pages * 4 >= (WORKING_SET_MIB - LIMIT_MIB) * 1024 / 2,
        "the remote store holds only {written_pages} written pages"
    );
}

#[test]
fn swap_off_and_the_next_swap_on_clean_up_after_a_killed_server() {
    let test = "swap_off_and_the_next_swap_on_clean_up_after_a_killed_server";
    if !can_run(test) {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // The server is killed with the swap already off by hand: killing it while the swap is on
    // would poison whatever other processes of this host had swapped into it.
    let kill_server = |swap: &mut SwapOn| {
        assert!(runs("swapoff", &[&swap.device]));
        swap.child.kill().unwrap();
        swap.child.wait().unwrap();
        swap.done = true;
        assert!(
            loop_attached(&swap.device),
            "a killed server leaves its loop device"
        );
        assert!(swap.dir.exists());
    };
    let mut first = SwapOn::start("memory:64MiB", &[]);
    kill_server(&mut first);
    let out = farmap().run(&["swap", "off", &first.device]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "swap off: {err}");
    assert!(err.contains("cleaned up after the dead server"), "{err}");
    assert!(!loop_attached(&first.device));
    assert!(!first.dir.exists());

    let mut second = SwapOn::start("memory:64MiB", &[]);
    kill_server(&mut second);
    let third = SwapOn::start("memory:64MiB", &[]);
    assert!(
        !second.dir.exists(),
        "the next swap on removed the dead one's directory"
    );
    assert!(
        !loop_attached(&second.device) || second.device == third.device,
        "the next swap on detached the dead one's loop device"
    );
    third.off();

    // What swap off does not know, it says.
    let out = farmap().run(&["swap", "off", "/dev/loop-nonexistent"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("is not a farmap swap"),
        "{err}"
    );
}

#[test]
fn swap_on_help_says_why_a_loop_device() {
    let out = farmap().run(&["swap", "on", "--help"]);
    let help = String::from_utf8_lossy(&out.stdout);
    for words in [
        "refuses swap directly on a FUSE file",
        "loop device",
        "--priority",
        "--managed",
        "mlockall",
        "PR_SET_IO_FLUSHER",
    ] {
        assert!(
            help.contains(words),
            "swap on --help lacks {words:?}:\n{help}"
        );
    }
}

#[test]
fn sigterm_turns_it_off_and_a_held_device_is_named() {
    if !can_run("sigterm_turns_it_off_and_a_held_device_is_named") {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // SIGTERM to the server: swapoff, losetup -d, flush, unmount, exit 0.
    let mut swap = SwapOn::start("memory:64MiB", &[]);
    swap.done = true;
    assert!(runs("kill", &["-TERM", &swap.child.id().to_string()]));
    let status = swap.child.wait().unwrap();
    assert!(status.success(), "farmap swap on exited with {status}");
    assert!(swaps().iter().all(|s| s.0 != swap.device));
    assert!(!loop_attached(&swap.device));
    assert!(!swap.dir.exists());

    // A program holds the loop device open: swap off turns the swap off, says who holds the
    // device, and fails; once it lets go, swap off finishes.
    let swap = SwapOn::start("memory:64MiB", &[]);
    let held = std::fs::File::open(&swap.device).unwrap();
    let out = farmap().run(&["swap", "off", &swap.device]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("still open") && err.contains(&std::process::id().to_string()),
        "{err}"
    );
    assert!(
        swaps().iter().all(|s| s.0 != swap.device),
        "the swap is off"
    );
    drop(held);
    swap.off();
}
