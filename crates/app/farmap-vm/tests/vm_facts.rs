//! The facts a QEMU guest on farmap rests on (docs/design/vm.md §13 step 1), one boot:
//!
//! 1. A guest boots with its RAM on a farmap FUSE mount (`memory-backend-file`, `share=on`)
//!    and the self-checking guest program (`scripts/vm/vmcheck.c`) runs on it.
//! 2. With `x-ignore-shared`, a second QEMU on the same file takes the running VM over: the
//!    stream holds device state and the few unshared ROM blocks only (< 1 MiB), the
//!    destination maps no page of guest RAM before `migrate-continue`, the heartbeats
//!    continue without a hole, and a 300 ms pause at `pre-switchover` shows on the host's
//!    clock and in QEMU's `downtime` but not on the guest's clock (under TCG the guest's
//!    clocks stop with the VM).
//! 3. A destination killed at `pre-switchover`, then `migrate_cancel`: the source VM runs on.
//! 4. The guest's check catches a flipped bit (so "no mismatch" above means something).
//!
//! Needs root, /dev/fuse, QEMU and the VM kernel (scripts/vm/): a missing one is a skip with
//! its reason (never under CI=true).

use std::sync::Arc;
use std::time::{Duration, Instant};

use farmap_core::Geometry;
use farmap_fuse::{FuseMount, MountOptions};
use farmap_store::MemoryStore;
use farmap_testkit::vm::VmcheckImage;
use farmap_vm::qemu::{DEFAULT_APPEND, DEFAULT_QEMU};
use farmap_vm::{
    analyse, qemu_version, Console, HeartbeatListener, Heartbeats, Incoming, QemuConfig, Qmp, Ram,
    VmcheckLine,
};

const TEST: &str = "guest_ram_on_a_farmap_mount_migrates_with_x_ignore_shared";
const MIB: u64 = 1 << 20;
const GUEST_MIB: u64 = 256;
const LONG: Duration = Duration::from_secs(60);
const BOOT: Duration = Duration::from_secs(180);

/// A QEMU killed when dropped.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One QEMU with its heartbeats and console.
struct Guest {
    config: QemuConfig,
    qemu: Running,
    beats: Heartbeats,
    console: Console,
    _dir: tempfile::TempDir,
}

impl Guest {
    /// Starts `base`'s VM with its sockets in a new folder; `incoming` for a destination.
    fn start(base: &QemuConfig, incoming: Option<Incoming>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let config = base.with_sockets_in(dir.path());
        let listener = if incoming.is_some() {
            HeartbeatListener::bind_continued(&config.heartbeat)
        } else {
            HeartbeatListener::bind(&config.heartbeat)
        };
        let beats = listener.unwrap().start().unwrap();
        let qemu = Running(config.command(incoming).spawn().expect("start QEMU"));
        let console = Console::connect(&config.serial, LONG).unwrap();
        Self {
            config,
            qemu,
            beats,
            console,
            _dir: dir,
        }
    }

    async fn qmp(&self) -> Qmp {
        Qmp::connect(&self.config.qmp, LONG).await.unwrap()
    }

    /// The next vmcheck report, with the console's tail when it does not come.
    fn report(&self) -> (u64, u64) {
        match self
            .console
            .wait_vmcheck(LONG, |l| matches!(l, VmcheckLine::Report { .. }))
        {
            Ok(VmcheckLine::Report {
                max_gap_us,
                mismatches,
                ..
            }) => (max_gap_us, mismatches),
            other => panic!("no vmcheck report: {other:?}\n{}", self.console.tail(40)),
        }
    }

    /// Asks the guest to check its whole working set; the mismatches it counted in all.
    fn check(&self) -> u64 {
        self.console.skip_to_end();
        self.console.send_line("check").unwrap();
        match self
            .console
            .wait_vmcheck(LONG, |l| matches!(l, VmcheckLine::Done { .. }))
        {
            Ok(VmcheckLine::Done { mismatches, .. }) => mismatches,
            other => panic!("no vmcheck verdict: {other:?}\n{}", self.console.tail(40)),
        }
    }

    /// Resident kB of the process's mappings of `path` (from /proc/PID/smaps).
    fn resident_kb(&self, path: &std::path::Path) -> u64 {
        let smaps = std::fs::read_to_string(format!("/proc/{}/smaps", self.qemu.0.id())).unwrap();
        let name = path.to_str().unwrap();
        let mut inside = false;
        let mut kb = 0;
        for line in smaps.lines() {
            let header = line.split_once(' ').is_some_and(|(range, _)| {
                range.contains('-') && range.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
            });
            if header {
                inside = line.ends_with(name);
            } else if inside {
                if let Some(v) = line.strip_prefix("Rss:") {
                    kb += v
                        .trim()
                        .trim_end_matches(" kB")
                        .trim()
                        .parse::<u64>()
                        .unwrap();
                }
            }
        }
        kb
    }
}

#[test]
fn guest_ram_on_a_farmap_mount_migrates_with_x_ignore_shared() {
    let Some(image) = VmcheckImage::for_test(TEST) else {
        return;
    };
    let version = qemu_version(DEFAULT_QEMU).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(MemoryStore::new(
        Geometry::new(GUEST_MIB * MIB, 64 << 10).unwrap(),
    ));
    let mount = FuseMount::mount(store, dir.path(), MountOptions::default()).unwrap();
    let ram = Ram::File {
        path: mount.path().to_path_buf(),
        share: true,
    };
    let work = tempfile::tempdir().unwrap();
    let mut base = QemuConfig::new(GUEST_MIB, ram, work.path());
    base.kernel = Some(image.kernel.clone());
    base.initrd = Some(image.initrd.clone());
    base.append =
        format!("{DEFAULT_APPEND} vmcheck.ws-mib=16 vmcheck.rate-mibs=32 vmcheck.report-ms=200");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mount_path = mount.path().to_path_buf();
    rt.block_on(async move {
        // 1. Boot on the mount.
        let src = Guest::start(&base, None);
        let mut src_qmp = src.qmp().await;
        let started = Instant::now();
        src.console
            .wait_vmcheck(BOOT, |l| matches!(l, VmcheckLine::Ready { .. }))
            .unwrap_or_else(|e| panic!("the guest did not start vmcheck: {e}"));
        eprintln!(
            "QEMU {version}: vmcheck ready {:?} after start",
            started.elapsed()
        );
        assert_eq!(src.report().1, 0, "{}", src.console.tail(20));
        assert!(src.beats.wait_for(50, LONG), "heartbeats flow");

        // 2. Take it over from a second QEMU on the same file, pausing 300 ms at the switch.
        let dst = Guest::start(&base, Some(Incoming::Defer));
        let mut dst_qmp = dst.qmp().await;
        let uri = format!("unix:{}", work.path().join("migrate.sock").display());
        dst_qmp
            .set_capabilities(&[("x-ignore-shared", true), ("events", true)])
            .await
            .unwrap();
        dst_qmp.migrate_incoming(&uri).await.unwrap();
        let caps = [
            ("x-ignore-shared", true),
            ("events", true),
            ("pause-before-switchover", true),
        ];
        src_qmp.set_capabilities(&caps).await.unwrap();
        src_qmp.migrate(&uri).await.unwrap();
        src_qmp
            .wait_migration_status(LONG, "pre-switchover")
            .await
            .unwrap();
        assert_eq!(
            dst.resident_kb(&mount_path),
            0,
            "the destination touched guest RAM before migrate-continue"
        );
        assert!(
            src.resident_kb(&mount_path) > 16 * 1024,
            "the source's RAM is mapped"
        );
        std::thread::sleep(Duration::from_millis(300));
        src_qmp.migrate_continue("pre-switchover").await.unwrap();
        src_qmp
            .wait_migration_status(LONG, "completed")
            .await
            .unwrap();
        dst_qmp.wait_status(LONG, "running").await.unwrap();
        let info = src_qmp.query_migrate().await.unwrap();
        eprintln!("query-migrate: {}", info.raw);
        // QEMU's own downtime counts from the stop: the pause (farmap's hand-over) is in it.
        assert!(info.downtime_ms.unwrap() >= 300, "{}", info.raw);
        let sent = info.ram_transferred.unwrap();
        assert!(sent < MIB, "x-ignore-shared still sent {sent} bytes of RAM");
        dst.console.skip_to_end();
        let (guest_gap_us, mismatches) = dst.report();
        assert_eq!(mismatches, 0, "{}", dst.console.tail(20));
        assert_eq!(dst.check(), 0, "{}", dst.console.tail(20));
        assert!(dst.beats.count() > 0);
        let seen = analyse(&[&src.beats.beats(), &dst.beats.beats()]);
        eprintln!("heartbeats: {seen:?}; the guest's largest gap {guest_gap_us} µs");
        assert_eq!(
            seen.holes, 0,
            "the heartbeat sequence continues across the move"
        );
        assert!(seen.max_gap >= Duration::from_millis(300), "{seen:?}");
        assert!(
            guest_gap_us < 150_000,
            "the guest's clock saw the stop ({guest_gap_us} µs): the gap must be timed on the host"
        );
        src_qmp.quit().await.unwrap();
        drop(src);

        // 3. A destination killed at pre-switchover: cancel, and the VM runs on.
        let doomed = Guest::start(&base, Some(Incoming::Defer));
        let mut doomed_qmp = doomed.qmp().await;
        let uri = format!("unix:{}", work.path().join("migrate2.sock").display());
        doomed_qmp
            .set_capabilities(&[("x-ignore-shared", true)])
            .await
            .unwrap();
        doomed_qmp.migrate_incoming(&uri).await.unwrap();
        dst_qmp.set_capabilities(&caps).await.unwrap();
        dst_qmp.migrate(&uri).await.unwrap();
        dst_qmp
            .wait_migration_status(LONG, "pre-switchover")
            .await
            .unwrap();
        drop(doomed_qmp);
        drop(doomed);
        dst_qmp.execute("migrate_cancel", None).await.unwrap();
        dst_qmp.wait_status(LONG, "running").await.unwrap();
        let before = dst.beats.count();
        assert!(
            dst.beats.wait_for(before + 50, Duration::from_secs(2)),
            "the source VM runs on after the cancel"
        );
        assert_eq!(dst.check(), 0, "{}", dst.console.tail(20));

        // 4. The check catches a flipped bit.
        dst.console.send_line("corrupt").unwrap();
        let flipped = dst
            .console
            .wait_vmcheck(LONG, |l| matches!(l, VmcheckLine::Mismatch { .. }))
            .unwrap();
        assert!(
            matches!(flipped, VmcheckLine::Mismatch { word: 7, .. }),
            "{flipped:?}"
        );
        assert_eq!(dst.report().1, 1, "{}", dst.console.tail(20));
        dst_qmp.quit().await.unwrap();
    });
    mount.unmount().unwrap();
}
