//! Live migration of a mount (`farmap mount --agent`, `farmap seed` / `farmap leech`), run for
//! real: programs write the source file while it moves; the destination file must hold
//! everything they wrote, and the source must refuse them afterwards. Needs root, /dev/fuse
//! and python3 (with its sqlite3 module); without them the tests say "skipped" and why.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use farmap_testkit::process::{stdout_of, terminate};
use farmap_testkit::skip;
use serde_json::Value;

mod common;
use common::farmap;

const WRITER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/mount_writer.py");
const SQL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/mount_sqlite.py");

/// Whether this machine can run these tests; records a skip when not.
fn can_run(test: &str) -> bool {
    skip::fuse_mountable(test) && skip::program(test, "python3", &["-V"])
}

/// A child process, killed (and reaped) when dropped.
struct Proc {
    name: &'static str,
    child: Child,
    out: Option<BufReader<ChildStdout>>,
}

impl Proc {
    fn spawn(name: &'static str, cmd: &mut Command) -> Proc {
        let mut child = cmd
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name}: {e}"));
        let out = child.stdout.take().map(BufReader::new);
        Proc { name, child, out }
    }

    fn farmap(name: &'static str, args: &[&str]) -> Proc {
        Proc::spawn(name, farmap().command().args(args))
    }

    fn line(&mut self) -> String {
        let mut l = String::new();
        self.out.as_mut().unwrap().read_line(&mut l).unwrap();
        assert!(
            !l.is_empty(),
            "{} printed nothing (see its stderr)",
            self.name
        );
        l.trim().to_owned()
    }

    /// Waits for the exit; asserts success; returns what is left on stdout.
    fn finish(mut self) -> String {
        let mut rest = String::new();
        if let Some(o) = self.out.as_mut() {
            o.read_to_string(&mut rest).unwrap();
        }
        let status = self.child.wait().unwrap();
        assert!(status.success(), "{} exited with {status}", self.name);
        rest
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // SIGTERM first: a mount flushes and unmounts.
        terminate(&mut self.child, Duration::from_secs(5));
    }
}

/// A source mount with an agent, and an empty destination one.
struct Pair {
    _src: Proc,
    _dst: Proc,
    src_file: PathBuf,
    dst_file: PathBuf,
    src_sock: String,
    dst_sock: String,
}

fn pair(tmp: &Path, store: &str, extra: &[&str]) -> Pair {
    let (sd, dd) = (tmp.join("src"), tmp.join("dst"));
    std::fs::create_dir_all(&sd).unwrap();
    std::fs::create_dir_all(&dd).unwrap();
    let src_sock = tmp.join("src.sock").to_str().unwrap().to_owned();
    let dst_sock = tmp.join("dst.sock").to_str().unwrap().to_owned();
    let mut args = vec!["mount", sd.to_str().unwrap(), store, "--agent", &src_sock];
    args.extend_from_slice(extra);
    let mut src = Proc::farmap("source mount", &args);
    let src_file = PathBuf::from(src.line());
    let dst = Proc::farmap(
        "destination mount",
        &["mount", dd.to_str().unwrap(), "--agent", &dst_sock],
    );
    // The destination prints nothing until a file arrives: wait for its socket.
    let t0 = Instant::now();
    while !Path::new(&dst_sock).exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "no destination agent"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    Pair {
        _src: src,
        _dst: dst,
        src_file,
        dst_file: dd.join("region"),
        src_sock,
        dst_sock,
    }
}

/// `farmap seed` + `farmap leech` between the pair's agents; the leech's JSON report.
fn migrate(p: &Pair) -> Value {
    migrate_with(p, &[])
}

/// The same, with `extra` arguments for `farmap leech`.
fn migrate_with(p: &Pair, extra: &[&str]) -> Value {
    let mut seed = Proc::spawn(
        "seed",
        farmap()
            .command()
            .args(["seed", "--app", &p.src_sock, "--listen", "127.0.0.1:0"])
            .args(["--json"])
            .stderr(Stdio::piped()),
    );
    let mut err = BufReader::new(seed.child.stderr.take().unwrap());
    let (control, data) = loop {
        let mut l = String::new();
        assert!(err.read_line(&mut l).unwrap() > 0, "seed said nothing");
        if let Some(rest) = l.split("control on ").nth(1) {
            let (c, d) = rest.split_once(", data plane on ").unwrap();
            break (c.trim().to_owned(), d.trim().to_owned());
        }
    };
    std::thread::spawn(move || {
        for l in err.lines().map_while(Result::ok) {
            eprintln!("{l}");
        }
    });
    let leech = Proc::farmap(
        "leech",
        &[
            "leech",
            "--app",
            &p.dst_sock,
            "--from",
            &control,
            "--data",
            &data,
            "--json",
        ]
        .into_iter()
        .chain(extra.iter().copied())
        .collect::<Vec<_>>(),
    );
    let out = leech.finish();
    let report: Value = serde_json::from_str(out.lines().last().expect("a JSON line"))
        .unwrap_or_else(|e| panic!("{e}: {out}"));
    let seeded = seed.finish();
    assert!(seeded.contains("\"role\":\"seed\""), "{seeded}");
    report
}

/// Starts the writer on the pair's source file (it saves what it wrote to `expected`).
fn start_writer(p: &Pair, expected: &Path) -> Proc {
    // It maps the file and writes pages at random until it is told (SIGTERM, the source's
    // default --after) that the file moved; then it saves what it wrote.
    let mut writer = Proc::spawn(
        "writer",
        Command::new("python3").args([
            WRITER,
            "writer",
            p.src_file.to_str().unwrap(),
            expected.to_str().unwrap(),
            "2000",
        ]),
    );
    assert_eq!(writer.line(), "writing");
    writer
}

/// A [`pair`] over `spec` in `tmp` whose source file the writer has been writing for
/// `ms` milliseconds; returns the pair, the file the writer saves what it wrote to, and the
/// writer.
fn pair_being_written(
    tmp: &Path,
    spec: &str,
    mount_args: &[&str],
    ms: u64,
) -> (Pair, PathBuf, Proc) {
    let p = pair(tmp, spec, mount_args);
    let expected = tmp.join("expected");
    let writer = start_writer(&p, &expected);
    std::thread::sleep(Duration::from_millis(ms));
    (p, expected, writer)
}

/// The report of a writer that was told its file moved; it wrote something.
fn writer_done(writer: Proc) -> Value {
    let done: Value = serde_json::from_str(&writer.finish()).unwrap();
    assert!(done["writes"].as_u64().unwrap() > 0, "{done}");
    done
}

/// Everything the writer wrote before it was stopped (`done`: its report) is at the
/// destination (the page it was in the middle of may be torn: it is excused), and the
/// source refuses writes (EROFS) and reads that reach it (EIO).
fn check_moved(p: &Pair, expected: &Path, done: &Value) {
    let last = done["last"].to_string();
    assert_eq!(
        python(&[
            WRITER,
            "check",
            p.dst_file.to_str().unwrap(),
            expected.to_str().unwrap(),
            &last
        ]),
        "ok"
    );
    assert_eq!(
        python(&[WRITER, "refused", p.src_file.to_str().unwrap()]),
        "refused"
    );
}

fn python(args: &[&str]) -> String {
    run("python3", args)
}

#[test]
fn a_mount_moves_while_a_program_writes_it_and_the_source_refuses_it_afterwards() {
    let test = "a_mount_moves_while_a_program_writes_it_and_the_source_refuses_it_afterwards";
    if !can_run(test) {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (p, expected, writer) = pair_being_written(tmp.path(), "memory:32MiB", &[], 300);
    let report = migrate(&p);
    assert_eq!(report["role"], "leech");
    assert_eq!(report["region_bytes"], 32 << 20);
    assert!(report["downtime_ms"].as_f64().is_some(), "{report}");
    assert!(report["app_freeze_ms"].as_f64().is_some(), "{report}");
    let pid = writer.pid();
    let done = writer_done(writer);
    // The writer was found through /proc (it maps the file) and stopped, then told.
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "the writer exited"
    );
    check_moved(&p, &expected, &done);
    // The destination file is a normal read-write file now.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p.dst_file)
        .unwrap();
}

#[test]
fn a_mount_moves_in_post_copy_while_a_program_writes_it() {
    let test = "a_mount_moves_in_post_copy_while_a_program_writes_it";
    if !can_run(test) {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (p, expected, writer) = pair_being_written(tmp.path(), "memory:32MiB", &[], 300);
    let report = migrate_with(&p, &["--mode", "postcopy"]);
    assert_eq!(report["mode"], "postcopy", "{report}");
    assert_eq!(report["region_bytes"], 32 << 20, "{report}");
    // Handed over at once: what the file holds (the chunks written; the rest of a memory
    // store is holes) came from the source afterwards.
    assert_eq!(report["rounds"], 0, "{report}");
    assert_eq!(report["bytes_precopy"], 0, "{report}");
    assert!(report["bytes_postcopy"].as_u64().unwrap() > 0, "{report}");
    let done = writer_done(writer);
    check_moved(&p, &expected, &done);
}

/// Runs `cmd ARGS`, which must succeed: its stdout, trimmed.
fn run(cmd: &str, args: &[&str]) -> String {
    stdout_of(Command::new(cmd).args(args)).trim().to_owned()
}

/// Unmounts the ext4 file systems and detaches their loop devices (before the farmap mounts
/// under them stop).
#[derive(Default)]
struct Ext4Cleanup {
    mounts: Vec<PathBuf>,
    loops: Vec<String>,
}

impl Drop for Ext4Cleanup {
    fn drop(&mut self) {
        for m in self.mounts.iter().rev() {
            // Lazily: the source's file system sits on a file that now refuses writes.
            let _ = Command::new("umount").arg("-l").arg(m).status();
        }
        for l in &self.loops {
            let _ = Command::new("losetup").args(["-d", l]).status();
        }
    }
}

/// An ext4 file system on `file` (through a new loop device), mounted at `dir`.
fn mount_ext4(file: &Path, dir: &Path, clean: &mut Ext4Cleanup) {
    std::fs::create_dir_all(dir).unwrap();
    let dev = run("losetup", &["-f", "--show", file.to_str().unwrap()]);
    clean.loops.push(dev.clone());
    run("mount", &[&dev, dir.to_str().unwrap()]);
    clean.mounts.push(dir.to_path_buf());
}

#[test]
fn sqlite_in_wal_mode_keeps_every_committed_transaction_across_a_mount_migration() {
    let test = "sqlite_in_wal_mode_keeps_every_committed_transaction_across_a_mount_migration";
    if !can_run(test) {
        return;
    }
    for tool in ["mkfs.ext4", "losetup", "fsfreeze"] {
        if Command::new(tool).arg("-V").output().is_err() {
            farmap_testkit::skip(test, format!("{tool} is missing (e2fsprogs, util-linux)"));
            return;
        }
    }
    if Command::new("python3")
        .args(["-c", "import sqlite3"])
        .status()
        .map_or(true, |s| !s.success())
    {
        farmap_testkit::skip(test, "python3 has no sqlite3 module");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (fs_src, fs_dst) = (tmp.path().join("fs-src"), tmp.path().join("fs-dst"));
    let pidfile = tmp.path().join("writer.pid");
    let log = tmp.path().join("committed.log");
    let (fs, pf) = (fs_src.to_str().unwrap(), pidfile.to_str().unwrap());
    // The writer's suspension: freeze its file system (ext4 writes everything back and
    // blocks new writes), which the agent then writes back from the page cache. After the
    // hand-over, the writer is killed and the (now refused) file system thawed.
    let suspend = format!("fsfreeze -f {fs}");
    let resume = format!("fsfreeze -u {fs}");
    let after = format!("kill -9 $(cat {pf}); fsfreeze -u {fs}");
    let p = pair(
        tmp.path(),
        "memory:64MiB",
        &[
            "--suspend",
            &suspend,
            "--resume",
            &resume,
            "--after",
            &after,
        ],
    );
    let mut clean = Ext4Cleanup::default();
    run("mkfs.ext4", &["-q", p.src_file.to_str().unwrap()]);
    mount_ext4(&p.src_file, &fs_src, &mut clean);
    let db = fs_src.join("db");
    let mut writer = Proc::spawn(
        "sqlite writer",
        Command::new("python3").args([
            SQL,
            "write",
            db.to_str().unwrap(),
            log.to_str().unwrap(),
            "0",
        ]),
    );
    std::fs::write(&pidfile, writer.pid().to_string()).unwrap();
    assert_eq!(writer.line(), "writing");
    std::thread::sleep(Duration::from_millis(500));
    let report = migrate(&p);
    assert_eq!(report["role"], "leech");
    // The --after hook killed the writer at the source.
    let t0 = Instant::now();
    while writer.child.try_wait().unwrap().is_none() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the source's writer was not stopped"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let committed = std::fs::read_to_string(&log).unwrap().lines().count();
    assert!(committed > 0, "the writer committed nothing at the source");
    // The database, its WAL and its shared-memory index arrived in the file system image.
    mount_ext4(&p.dst_file, &fs_dst, &mut clean);
    for f in ["db", "db-wal", "db-shm"] {
        assert!(fs_dst.join(f).exists(), "{f} is missing at the destination");
    }
    let db2 = fs_dst.join("db");
    let (db2, log_s) = (db2.to_str().unwrap(), log.to_str().unwrap());
    // A new writer continues at the destination.
    assert_eq!(
        python(&[SQL, "write", db2, log_s, "200"]),
        "writing\nwrote 200"
    );
    let checked = python(&[SQL, "check", db2, log_s]);
    let rows: usize = checked
        .strip_prefix("ok ")
        .unwrap_or_else(|| panic!("{checked}"))
        .parse()
        .unwrap();
    assert!(
        rows >= committed + 200,
        "{rows} rows for {committed} + 200 commits"
    );
    drop(clean);
}

#[test]
fn a_managed_mount_over_redis_moves_instantly_and_redis_holds_the_file_afterwards() {
    // Pushed to Redis every 100 ms while the writer runs: most chunks are there already.
    instant_over_redis(
        "a_managed_mount_over_redis_moves_instantly_and_redis_holds_the_file_afterwards",
        &["--managed", "--push-interval", "100ms"],
    );
}

#[test]
fn a_direct_mount_over_redis_moves_instantly() {
    // Every write goes to Redis as it is made: every chunk is there.
    instant_over_redis("a_direct_mount_over_redis_moves_instantly", &[]);
}

/// A mount of a Redis region (with `mount_args`) moves with `--mode instant` while a program
/// writes it: the destination has every write, Redis holds the destination's file.
fn instant_over_redis(test: &str, mount_args: &[&str]) {
    if !can_run(test) {
        return;
    }
    let svc = match farmap_testkit::Service::shared("redis") {
        Ok(s) => s,
        Err(e) => {
            farmap_testkit::skip(test, e);
            return;
        }
    };
    let size: u64 = 32 << 20;
    let spec = format!(
        "{}/0?size={size}&prefix=mount-instant-{}-{}",
        svc.var("SPEC_BASE"),
        std::process::id(),
        mount_args.len()
    );
    let tmp = tempfile::tempdir().unwrap();
    let (p, expected, writer) = pair_being_written(tmp.path(), &spec, mount_args, 600);
    // The destination mount was started without a store: it opens the shared store only
    // when told here which (a seeder's announcement alone is not enough).
    let report = migrate_with(&p, &["--mode", "instant", "--store", &spec]);
    assert_eq!(report["mode"], "instant", "{report}");
    assert_eq!(report["region_bytes"], size, "{report}");
    assert_eq!(report["verify_failures"], 0, "{report}");
    assert_eq!(report["bytes_precopy"], 0, "{report}");
    let (from_store, from_source) = (
        report["chunks_from_store"].as_u64().unwrap(),
        report["chunks_from_source"].as_u64().unwrap(),
    );
    assert!(from_store > 0, "chunks came from Redis: {report}");
    let chunks = from_store + from_source;
    let before = report["bytes_before_resume"].as_u64().unwrap();
    assert!(
        before <= 32 * chunks + 65536,
        "{before} bytes before resuming: {report}"
    );
    let done = writer_done(writer);
    check_moved(&p, &expected, &done);
    // The destination writes through to Redis, and the source's last chunks were pushed
    // there before it was released: a fresh reader of Redis sees the destination's file.
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&p.dst_file)
        .unwrap();
    std::io::Write::write_all(&mut f, b"written at the destination").unwrap();
    f.sync_all().unwrap();
    drop(f);
    let copy = tmp.path().join("copy");
    farmap().ok(&["cp", &spec, &format!("file:{}", copy.display())]);
    let (a, b) = (
        std::fs::read(&p.dst_file).unwrap(),
        std::fs::read(&copy).unwrap(),
    );
    assert_eq!(a.len(), b.len());
    assert!(a == b, "Redis holds the destination's file byte for byte");
    assert!(a.starts_with(b"written at the destination"));
}
