//! `farmap vm migrate`: a running QEMU guest whose RAM is a farmap mount moves to a second
//! QEMU (issue 32, docs/design/vm.md §12). QEMU moves the device state (`x-ignore-shared`),
//! farmap the RAM. One boot, three moves, and the self-checking guest
//! (`scripts/vm/vmcheck.c`) must find every byte it wrote after each:
//! 0. `farmap vm save` (device state only) and `farmap vm restore` in a new QEMU over a new
//!    mount of the store; a second restore is refused;
//! 1. instant, over a shared store (a `farmap serve` of a memory store);
//! 2. to a destination QEMU that dies at `pre-switchover`: the command fails, nothing is
//!    handed over, and the source VM runs on;
//! 3. pre-copy, to a third mount.
//!
//! Needs root, /dev/fuse, QEMU and the VM kernel (scripts/vm/): a missing one is a skip with
//! its reason (never under CI=true).

use std::path::{Path, PathBuf};
use std::process::{Child, Output, Stdio};
use std::time::{Duration, Instant};

use farmap_testkit::vm::VmcheckImage;
use farmap_vm::qemu::DEFAULT_APPEND;
use farmap_vm::{
    analyse, Console, HeartbeatListener, Heartbeats, Incoming, QemuConfig, Qmp, Ram, VmcheckLine,
};
use serde_json::Value;

mod common;
use common::farmap;

const GUEST_MIB: u64 = 256;
const LONG: Duration = Duration::from_secs(60);
const BOOT: Duration = Duration::from_secs(180);

/// A child process killed when dropped (SIGTERM first, so that a mount unmounts).
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        farmap_testkit::process::terminate(&mut self.0, Duration::from_secs(5));
    }
}

/// Starts `farmap mount ARGS`; with a store, waits for the file's path on stdout.
fn mount(args: &[&str], agent: &Path, has_store: bool) -> Proc {
    let mut child = farmap()
        .command()
        .arg("mount")
        .args(args)
        .arg("--agent")
        .arg(agent)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    if has_store {
        use std::io::BufRead;
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(line.trim().ends_with("/region"), "mount printed {line:?}");
    }
    while !agent.exists() {
        assert!(
            t0.elapsed() < LONG,
            "no agent socket at {}",
            agent.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    Proc(child)
}

/// One end: a mount with its agent, and the QEMU that maps its file.
struct End {
    _mount: Proc,
    agent: PathBuf,
    file: PathBuf,
    config: QemuConfig,
    beats: Heartbeats,
}

/// What every end shares.
struct Setup {
    tmp: tempfile::TempDir,
    base: QemuConfig,
    spec: String,
    control: PathBuf,
}

impl Setup {
    /// `farmap vm WORD --control ...`: a mount's hook that reaches `farmap vm migrate`.
    fn hook(&self, word: &str) -> String {
        format!(
            "{} vm {word} --control {}",
            env!("CARGO_BIN_EXE_farmap"),
            self.control.display()
        )
    }

    fn dir(&self, name: &str) -> PathBuf {
        let d = self.tmp.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// A mount named `name` (over the shared store when `source`, else empty and waiting for
    /// a file), whose suspend hook reaches `farmap vm migrate`; its VM's heartbeats listened to
    /// (a guest that boots there when `fresh`, else one that continues there).
    fn end(&self, name: &str, source: bool, fresh: bool) -> End {
        let dir = self.dir(name);
        let agent = self.tmp.path().join(format!("{name}.agent"));
        let mut args = vec![dir.to_str().unwrap()];
        if source {
            args.extend([self.spec.as_str(), "--managed"]);
        }
        // The prepare hook has the destination QEMU started before the last pushes.
        let (suspend, prepare) = (self.hook("suspend"), self.hook("prepare"));
        args.extend(["--suspend", &suspend, "--prepare", &prepare]);
        let mount = mount(&args, &agent, source);
        let mut config = self
            .base
            .with_sockets_in(&self.dir(&format!("{name}.qemu")));
        let file = dir.join("region");
        config.ram = Ram::File {
            path: file.clone(),
            share: true,
        };
        let listener = if fresh {
            HeartbeatListener::bind(&config.heartbeat)
        } else {
            HeartbeatListener::bind_continued(&config.heartbeat)
        };
        End {
            _mount: mount,
            agent,
            file,
            config,
            beats: listener.unwrap().start().unwrap(),
        }
    }

    /// `farmap vm migrate` from `from` to `to`.
    fn migrate(&self, from: &End, to: &End, mode: &str, kill: Option<&str>) -> Output {
        let mut cmd = farmap().command();
        cmd.args(["vm", "migrate", "--mode", mode, "--json"])
            .arg("--src-qmp")
            .arg(&from.config.qmp)
            .arg("--src-agent")
            .arg(&from.agent)
            .arg("--dst-agent")
            .arg(&to.agent)
            .arg("--dst-ram")
            .arg(&to.file)
            .arg("--dst-qmp")
            .arg(&to.config.qmp)
            .arg("--dst-launch")
            .arg(to.config.shell_command(Some(Incoming::Defer)))
            .arg("--control")
            .arg(&self.control)
            .arg("--key-file")
            .arg(self.tmp.path().join("key"));
        // Into a file, not a pipe: the destination QEMU it starts inherits its stderr and
        // outlives it.
        static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let log = self.tmp.path().join(format!("migrate-{n}.err"));
        cmd.stderr(std::fs::File::create(&log).unwrap());
        if mode == "instant" {
            cmd.arg("--store").arg(&self.spec);
        }
        if let Some(kill) = kill {
            cmd.env("FARMAP_VM_TEST_KILL", kill);
        }
        let mut out = cmd.output().unwrap();
        out.stderr = std::fs::read(&log).unwrap();
        eprint!("{}", String::from_utf8_lossy(&out.stderr));
        out
    }
}

/// The report of a migration that must have succeeded.
fn report(out: &Output) -> Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "farmap vm migrate failed: {stdout}");
    let report: Value = serde_json::from_str(stdout.trim()).unwrap();
    eprintln!("{report}");
    assert!(report["qemu_bytes"].as_u64().unwrap() < 1 << 20, "{report}");
    assert!(report["paused_ms"].as_f64().unwrap() > 0.0, "{report}");
    report
}

/// The guest runs on `end` and finds every byte it wrote.
fn verify(end: &End, console: &Console) {
    let before = end.beats.count();
    assert!(
        end.beats.wait_for(before + 100, LONG),
        "the guest does not run at {}",
        end.file.display()
    );
    console.skip_to_end();
    console.send_line("check").unwrap();
    let verdict = console
        .wait_vmcheck(LONG, |l| matches!(l, VmcheckLine::Done { .. }))
        .unwrap();
    assert!(
        matches!(verdict, VmcheckLine::Done { mismatches: 0, .. }),
        "{verdict:?}\n{}",
        console.tail(30)
    );
}

/// Waits for a QEMU started by `farmap vm migrate` to exit (it quits the source).
fn wait_gone(qmp: &Path) {
    let t0 = Instant::now();
    while std::os::unix::net::UnixStream::connect(qmp).is_ok() {
        assert!(
            t0.elapsed() < LONG,
            "the QEMU of {} still runs",
            qmp.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_guest_moves_between_qemus_instantly_and_by_precopy_and_survives_a_lost_destination() {
    let test =
        "a_guest_moves_between_qemus_instantly_and_by_precopy_and_survives_a_lost_destination";
    let Some(image) = VmcheckImage::for_test(test) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let served = farmap().listening(&[
        "serve",
        &format!("memory:{GUEST_MIB}MiB"),
        "--listen",
        "127.0.0.1:0",
    ]);
    let control = tmp.path().join("vm.ctl");
    let mut base = QemuConfig::new(GUEST_MIB, Ram::Anonymous, tmp.path());
    base.kernel = Some(image.kernel.clone());
    base.initrd = Some(image.initrd.clone());
    base.append =
        format!("{DEFAULT_APPEND} vmcheck.ws-mib=16 vmcheck.rate-mibs=32 vmcheck.report-ms=200");
    let setup = Setup {
        spec: format!("farmap://{}", served.addr()),
        tmp,
        base,
        control,
    };
    let a = setup.end("a", true, true);
    let mut qemu_a = Proc(a.config.command(None).spawn().unwrap());
    let console = Console::connect(&a.config.serial, LONG).unwrap();
    console
        .wait_vmcheck(BOOT, |l| matches!(l, VmcheckLine::Ready { .. }))
        .unwrap_or_else(|e| panic!("the guest did not start vmcheck: {e}"));
    assert!(a.beats.wait_for(100, LONG));

    // 0. Saved (device state only: the RAM stays in the store) and started again by a new
    // QEMU over a new mount of the store.
    let state = setup.tmp.path().join("vm.state");
    let out = farmap()
        .command()
        .args(["vm", "save", "--json", "--qmp"])
        .arg(&a.config.qmp)
        .arg("--ram")
        .arg(&a.file)
        .arg("--state")
        .arg(&state)
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "farmap vm save failed: {stdout}");
    let saved: Value = serde_json::from_str(stdout.trim()).unwrap();
    eprintln!("{saved}");
    let state_bytes = saved["state_bytes"].as_u64().unwrap();
    assert!(
        state_bytes > 0 && state_bytes < 1 << 20,
        "the state holds no RAM: {saved}"
    );
    assert_eq!(std::fs::metadata(&state).unwrap().len(), state_bytes);
    let t0 = Instant::now();
    while qemu_a.0.try_wait().unwrap().is_none() {
        assert!(t0.elapsed() < LONG, "QEMU still runs after the save");
        std::thread::sleep(Duration::from_millis(20));
    }
    let End {
        _mount: mount_a,
        beats: a_beats,
        ..
    } = a;
    drop(mount_a); // flushes and unmounts
    let a = setup.end("a2", true, false);
    let _qemu_a = Proc(a.config.command(Some(Incoming::Defer)).spawn().unwrap());
    let restore = |qmp: &Path| {
        farmap()
            .command()
            .args(["vm", "restore", "--json", "--qmp"])
            .arg(qmp)
            .arg("--state")
            .arg(&state)
            .stderr(Stdio::piped())
            .output()
            .unwrap()
    };
    let t0 = Instant::now();
    while std::os::unix::net::UnixStream::connect(&a.config.qmp).is_err() {
        assert!(t0.elapsed() < LONG, "no QMP for the restored QEMU");
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = restore(&a.config.qmp);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "farmap vm restore failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let restored: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert!(restored["restore_ms"].as_f64().unwrap() > 0.0, "{restored}");
    let console = Console::connect(&a.config.serial, LONG).unwrap();
    verify(&a, &console);
    // A restore into a QEMU whose guest already runs is refused, and the guest runs on.
    let out = restore(&a.config.qmp);
    assert!(!out.status.success(), "a second restore succeeded");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("running, not inmigrate"), "{err}");
    let before = a.beats.count();
    assert!(a.beats.wait_for(before + 50, LONG), "the guest runs on");

    // 1. Instant, while other callers of the driver's control socket stay silent, send an
    // endless line or a word it does not know: none of them holds the migration.
    let b = setup.end("b", false, false);
    let control = setup.control.clone();
    let pests = std::thread::spawn(move || {
        use std::io::Write;
        let t0 = Instant::now();
        let mut held = Vec::new();
        while held.len() < 3 && t0.elapsed() < LONG {
            match std::os::unix::net::UnixStream::connect(&control) {
                Ok(mut c) => {
                    match held.len() {
                        0 => {}
                        1 => {
                            let _ = c.write_all(&[b'x'; 4096]);
                        }
                        _ => {
                            let _ = c.write_all(b"resume\n");
                        }
                    }
                    held.push(c);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
        held
    });
    let t0 = Instant::now();
    let out = setup.migrate(&a, &b, "instant", None);
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("farmap vm migrate: created the migration key"),
        "the new key is announced by the command that made it"
    );
    let r = report(&out);
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "the migration took {:?}",
        t0.elapsed()
    );
    assert_eq!(pests.join().unwrap().len(), 3, "the callers were heard");
    assert_eq!(r["mode"], "instant", "{r}");
    assert_eq!(r["leech"]["verify_failures"], 0, "{r}");
    wait_gone(&a.config.qmp);
    let console = Console::connect(&b.config.serial, LONG).unwrap();
    verify(&b, &console);

    // 2. The destination QEMU dies at pre-switchover: nothing is handed over.
    let c = setup.end("c", false, false);
    let out = setup.migrate(&b, &c, "precopy", Some("dst-at-pre-switchover"));
    assert!(
        !out.status.success(),
        "a migration to a dead QEMU succeeded"
    );
    assert!(
        out.stdout.is_empty(),
        "no result line for a failed migration"
    );
    let before = b.beats.count();
    assert!(
        b.beats.wait_for(before + 50, Duration::from_secs(2)),
        "the source VM runs on within 2 s"
    );
    verify(&b, &console);
    drop(c);

    // 3. Pre-copy, to a third mount.
    let d = setup.end("d", false, false);
    let r = report(&setup.migrate(&b, &d, "precopy", None));
    assert_eq!(r["mode"], "precopy", "{r}");
    wait_gone(&b.config.qmp);
    let console = Console::connect(&d.config.serial, LONG).unwrap();
    verify(&d, &console);

    let seen = analyse(&[
        &a_beats.beats(),
        &a.beats.beats(),
        &b.beats.beats(),
        &d.beats.beats(),
    ]);
    eprintln!("heartbeats: {seen:?}");
    assert_eq!(seen.holes, 0, "the heartbeats continue across every move");

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let qmp = Qmp::connect(&d.config.qmp, LONG).await.unwrap();
        qmp.quit().await.unwrap();
    });
}
