//! `farmap mount` / `farmap umount`, run for real with Python programs using the file (root,
//! /dev/fuse and python3 are needed; without them the tests say "skipped" and why).

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Duration;

use farmap_testkit::cli::Listening;
use farmap_testkit::process::{stdout_of, terminate};
use farmap_testkit::skip;

mod common;
use common::farmap;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/mmap_pattern.py");

/// Whether this machine can run these tests; records a skip when not.
fn can_run(test: &str) -> bool {
    skip::fuse_mountable(test) && skip::program(test, "python3", &["-V"])
}

/// A `farmap mount` child process; stopped with SIGTERM when dropped.
struct Mounted {
    child: Child,
    path: PathBuf,
    dir: PathBuf,
}

impl Mounted {
    fn start(dir: &Path, store: &str, args: &[&str]) -> Mounted {
        let mut child = farmap()
            .command()
            .arg("mount")
            .arg(dir)
            .arg(store)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start farmap mount");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(
            !line.is_empty(),
            "farmap mount printed no path (see its stderr)"
        );
        Mounted {
            child,
            path: PathBuf::from(line.trim()),
            dir: dir.to_path_buf(),
        }
    }

    /// `farmap umount DIR`; returns once the mount process has exited successfully.
    fn umount(mut self) {
        let out = farmap().run(&["umount", self.dir.to_str().unwrap()]);
        assert!(
            out.status.success(),
            "umount: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let status = self.child.wait().unwrap();
        assert!(status.success(), "farmap mount exited with {status}");
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        terminate(&mut self.child, Duration::from_secs(60));
    }
}

fn python(args: &[&str]) -> String {
    stdout_of(Command::new("python3").arg(SCRIPT).args(args))
}

/// A Python program left running until its stdin closes.
struct Lingering {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl Lingering {
    fn start(args: &[&str], ready: &str) -> Lingering {
        let mut child = Command::new("python3")
            .arg(SCRIPT)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("run python3");
        let stdin = child.stdin.take();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), ready);
        Lingering { child, stdin }
    }

    fn finish(mut self) {
        drop(self.stdin.take());
        assert!(self.child.wait().unwrap().success());
    }
}

impl Drop for Lingering {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn python_mmap_pattern_reaches_a_file_store_and_reads_back() {
    if !can_run("python_mmap_pattern_reaches_a_file_store_and_reads_back") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (dir, img, expected) = (
        tmp.path().join("mnt"),
        tmp.path().join("disk.img"),
        tmp.path().join("expected"),
    );
    std::fs::create_dir(&dir).unwrap();
    let store = format!("file:{}?size=8MiB", s(&img));
    let m = Mounted::start(&dir, &store, &[]);
    assert_eq!(m.path, dir.join("region"));
    assert_eq!(
        python(&["write", s(&m.path), s(&expected), "11"]).trim(),
        "ok"
    );
    m.umount();
    let want = std::fs::read(&expected).unwrap();
    assert!(want.iter().any(|&b| b != 0), "the pattern wrote something");
    assert_eq!(
        std::fs::read(&img).unwrap(),
        want,
        "the store equals the pattern"
    );
    // Remount: the data reads back (mmap and pread, 4 threads).
    let m = Mounted::start(&dir, &store, &["--name", "data.bin"]);
    assert_eq!(m.path, dir.join("data.bin"));
    assert_eq!(python(&["read", s(&m.path), s(&expected)]).trim(), "ok");
    m.umount();
}

#[test]
fn python_mmap_pattern_over_a_remote_store_in_managed_mode() {
    if !can_run("python_mmap_pattern_over_a_remote_store_in_managed_mode") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (dir, chunks, expected) = (
        tmp.path().join("mnt"),
        tmp.path().join("chunks"),
        tmp.path().join("expected"),
    );
    std::fs::create_dir(&dir).unwrap();
    let dir_store = format!("dir:{}?size=8MiB", s(&chunks));
    let serve = |spec: &str| {
        farmap()
            .listening(&["serve", spec, "--listen", "127.0.0.1:0", "--quiet"])
            .drained()
    };
    let stop = |server: Listening| {
        let (status, _) = server.stop("TERM");
        assert!(status.success());
    };
    let server = serve(&dir_store);
    let remote = format!("farmap://{}", server.addr());
    let m = Mounted::start(
        &dir,
        &remote,
        &["--managed", "--workers", "8", "--push-interval", "50ms"],
    );
    assert_eq!(
        python(&["write", s(&m.path), s(&expected), "23"]).trim(),
        "ok"
    );
    m.umount();
    stop(server);
    // The directory store now holds the pattern: read it back through a plain mount.
    let m = Mounted::start(&dir, &dir_store, &["--read-only"]);
    assert_eq!(python(&["read", s(&m.path), s(&expected)]).trim(), "ok");
    m.umount();
    // And through the server again, managed, pulled in reverse.
    let server = serve(&dir_store);
    let m = Mounted::start(
        &dir,
        &format!("farmap://{}", server.addr()),
        &["--managed", "--pull-order", "reverse"],
    );
    assert_eq!(python(&["read", s(&m.path), s(&expected)]).trim(), "ok");
    m.umount();
    stop(server);
}

#[test]
fn fsync_reaches_the_store_and_umount_with_a_dirty_mapping_loses_nothing() {
    if !can_run("fsync_reaches_the_store_and_umount_with_a_dirty_mapping_loses_nothing") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (dir, img) = (tmp.path().join("mnt"), tmp.path().join("disk.img"));
    std::fs::create_dir(&dir).unwrap();
    let store = format!("file:{}?size=4MiB", s(&img));
    let m = Mounted::start(&dir, &store, &[]);
    let synced = Lingering::start(&["fsync", s(&m.path), "5000", "fsynced!"], "synced");
    // Still mounted and open: the store file already has it.
    let disk = std::fs::read(&img).unwrap();
    assert_eq!(&disk[5000..5008], b"fsynced!");
    synced.finish();

    // A program keeps a dirty mapping (no msync) while `farmap umount` runs.
    let dirty = Lingering::start(&["dirty", s(&m.path), "1048577", "dirty page"], "ready");
    let dir2 = dir.clone();
    let umount = std::thread::spawn(move || farmap().run(&["umount", s(&dir2)]));
    std::thread::sleep(Duration::from_millis(500));
    // The unmount flushed the page cache first: the write is in the store before the
    // program has even let go of the file.
    let disk = std::fs::read(&img).unwrap();
    assert_eq!(&disk[1048577..1048587], b"dirty page");
    dirty.finish();
    let out = umount.join().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut m = m;
    assert!(m.child.wait().unwrap().success());
    let disk = std::fs::read(&img).unwrap();
    assert_eq!(&disk[1048577..1048587], b"dirty page");
    assert_eq!(&disk[5000..5008], b"fsynced!");
}

#[test]
fn a_mount_whose_server_died_is_cleaned_up_by_the_next_mount() {
    if !can_run("a_mount_whose_server_died_is_cleaned_up_by_the_next_mount") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (dir, img) = (tmp.path().join("mnt"), tmp.path().join("disk.img"));
    std::fs::create_dir(&dir).unwrap();
    let store = format!("file:{}?size=1MiB", s(&img));
    let mut m = Mounted::start(&dir, &store, &[]);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(&m.path)
        .unwrap();
    f.write_all(b"before the crash").unwrap();
    drop(f);
    m.child.kill().unwrap();
    m.child.wait().unwrap();
    let e = std::fs::read_dir(&dir).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENOTCONN), "{e}");
    // Not a live farmap mount any more: umount says so and cleans it up too.
    let m2 = Mounted::start(&dir, &store, &[]);
    let data = std::fs::read(&m2.path).unwrap();
    assert_eq!(&data[..16], b"before the crash");
    m2.umount();
    assert!(std::fs::read_dir(&dir).unwrap().next().is_none());
    // umount of something that is not a farmap mount says what it is.
    let out = farmap().run(&["umount", s(&dir)]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not a mount point"));
    let out = farmap().run(&["umount", "/proc"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("is not a farmap mount"),
        "{err}"
    );
}

#[test]
fn ublk_names_what_it_needs() {
    // (--nbd: tests/mount_nbd.rs.) --ublk takes a store only.
    let out = farmap().run(&["mount", "--ublk", "memory:1MiB", "/mnt"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("takes only a store"),
        "{err}"
    );
    // Where the kernel has no ublk driver (this machine; the VM test covers the device), the
    // error names it.
    if !std::path::Path::new("/dev/ublk-control").exists() {
        let out = farmap().run(&["mount", "--ublk", "memory:1MiB"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("ublk_drv"), "{err}");
    }
}

#[test]
fn bench_fuse_prints_one_verified_json_line_per_case_and_frontend() {
    if !can_run("bench_fuse_prints_one_verified_json_line_per_case_and_frontend") {
        return;
    }
    let rows = farmap().json_lines(&[
        "bench",
        "fuse",
        "--json",
        "--size",
        "8MiB",
        "--samples",
        "200",
    ]);
    let mut seen = Vec::new();
    for r in &rows {
        assert_eq!(r["bench"], "fuse");
        assert_eq!(r["verified"], true, "{r}");
        assert!(r["mb_per_s"].as_f64().unwrap() > 0.0, "{r}");
        for field in ["p50_us", "p99_us"] {
            assert!(r[field].as_f64().unwrap() >= 0.0, "{field} in {r}");
        }
        seen.push(format!(
            "{}/{}",
            r["case"].as_str().unwrap(),
            r["frontend"].as_str().unwrap()
        ));
    }
    seen.sort();
    assert_eq!(
        seen,
        [
            "rand-read-4k/fuse",
            "rand-read-4k/memcpy",
            "rand-read-4k/uffd",
            "seq-read/fuse",
            "seq-read/memcpy",
            "seq-read/uffd"
        ]
    );
}

/// A process's resident set (`VmRSS`) or its peak (`VmHWM`), in bytes.
fn proc_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
        * 1024
}

#[test]
fn a_managed_mount_with_a_cache_max_stays_bounded() {
    if !can_run("a_managed_mount_with_a_cache_max_stays_bounded") {
        return;
    }
    const SIZE: u64 = 64 << 20;
    const BLOCK: usize = 1 << 20;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("mnt");
    std::fs::create_dir(&dir).unwrap();
    let server = farmap()
        .listening(&[
            "serve",
            "memory:64MiB",
            "--listen",
            "127.0.0.1:0",
            "--quiet",
        ])
        .drained();
    let addr = server.addr();

    let m = Mounted::start(
        &dir,
        &format!("farmap://{addr}"),
        &[
            "--managed",
            "--cache-max",
            "4MiB",
            "--push-interval",
            "50ms",
        ],
    );
    let pid = m.child.id();
    let base = proc_kib(pid, "VmRSS:");
    let mut peak_rss = base;
    let sample = |peak: &mut u64| *peak = (*peak).max(proc_kib(pid, "VmRSS:"));
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&m.path)
            .unwrap();
        assert_eq!(f.metadata().unwrap().len(), SIZE);
        for off in (0..SIZE).step_by(BLOCK) {
            f.write_all_at(&farmap_testkit::pattern_bytes(5, off, BLOCK), off)
                .unwrap();
            sample(&mut peak_rss);
        }
        f.sync_all().unwrap();
        let mut buf = vec![0; BLOCK];
        for off in (0..SIZE).step_by(BLOCK) {
            f.read_exact_at(&mut buf, off).unwrap();
            assert!(
                buf == farmap_testkit::pattern_bytes(5, off, BLOCK),
                "the MiB at {off} reads back"
            );
            sample(&mut peak_rss);
        }
    }
    let hwm = proc_kib(pid, "VmHWM:");
    // The whole 64 MiB went through the mount; an unbounded cache would hold all of it.
    let growth = hwm.saturating_sub(base);
    eprintln!(
        "mount process: RSS {} MiB at start, sampled peak {} MiB, VmHWM {} MiB",
        base >> 20,
        peak_rss >> 20,
        hwm >> 20
    );
    assert!(
        growth < 32 << 20,
        "the mount's peak RSS grew by {} MiB over {} MiB at start, with a 4 MiB cache",
        growth >> 20,
        base >> 20
    );
    m.umount();
    // A new mount (nothing cached) reads everything back from the server.
    let m = Mounted::start(
        &dir,
        &format!("farmap://{addr}"),
        &["--managed", "--cache-max", "10%"],
    );
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::open(&m.path).unwrap();
        let mut buf = vec![0; BLOCK];
        for off in (0..SIZE).step_by(BLOCK) {
            f.read_exact_at(&mut buf, off).unwrap();
            assert!(
                buf == farmap_testkit::pattern_bytes(5, off, BLOCK),
                "the MiB at {off} is in the remote"
            );
        }
    }
    m.umount();
}
