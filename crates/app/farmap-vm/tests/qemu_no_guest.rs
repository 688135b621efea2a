//! The installed QEMU accepts the builder's command line, and the QMP client drives it:
//! VMs without a guest (no kernel; `-S` keeps the firmware from running where it matters).
//!
//! Needs `qemu-system-x86_64` (TCG; no KVM, no root). Without it each test prints
//! "skipped: ..." and returns.

use std::io;
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use farmap_vm::qemu::DEFAULT_QEMU;
use farmap_vm::{
    qemu_version, Console, HeartbeatListener, Incoming, QemuConfig, QemuError, Qmp, Ram,
};

const LONG: Duration = Duration::from_secs(20);

/// A QEMU killed (if still running) when the test ends, however it ends.
struct Running(Child);

impl Running {
    fn spawn(mut command: Command) -> Self {
        Self(command.spawn().expect("start QEMU"))
    }

    /// Waits for QEMU to exit on its own; panics unless it exits successfully.
    fn wait_exit(&mut self) {
        let deadline = Instant::now() + LONG;
        loop {
            if let Some(status) = self.0.try_wait().unwrap() {
                assert!(status.success(), "QEMU exited with {status}");
                return;
            }
            assert!(Instant::now() < deadline, "QEMU did not exit after quit");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Whether QEMU is installed; prints why not.
fn have_qemu() -> bool {
    match qemu_version(DEFAULT_QEMU) {
        Ok(_) => true,
        Err(QemuError::Spawn { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
            eprintln!("skipped: {DEFAULT_QEMU} is not installed");
            false
        }
        Err(e) => panic!("{e}"),
    }
}

/// A temporary folder on tmpfs when there is one (guest RAM files).
fn shm_dir() -> tempfile::TempDir {
    if Path::new("/dev/shm").is_dir() {
        tempfile::tempdir_in("/dev/shm").unwrap()
    } else {
        tempfile::tempdir().unwrap()
    }
}

#[tokio::test]
async fn shared_ram_migrates_with_x_ignore_shared() {
    if !have_qemu() {
        return;
    }
    let shm = shm_dir();
    let ram = shm.path().join("ram");
    std::fs::File::create(&ram)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let (src_dir, dst_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let share = Ram::File {
        path: ram,
        share: true,
    };
    let source = QemuConfig::new(64, share, src_dir.path());
    let dest = source.with_sockets_in(dst_dir.path());
    let src_beats = HeartbeatListener::bind(&source.heartbeat)
        .unwrap()
        .start()
        .unwrap();
    let dst_beats = HeartbeatListener::bind_continued(&dest.heartbeat)
        .unwrap()
        .start()
        .unwrap();
    let mut src_command = source.command(None);
    src_command.arg("-S");
    let mut src_qemu = Running::spawn(src_command);
    let mut dst_qemu = Running::spawn(dest.command(Some(Incoming::Defer)));

    let mut src = Qmp::connect(&source.qmp, LONG).await.unwrap();
    let mut dst = Qmp::connect(&dest.qmp, LONG).await.unwrap();
    assert_eq!(src.version(), qemu_version(DEFAULT_QEMU).unwrap());
    assert_eq!(src.status().await.unwrap(), "prelaunch");
    assert_eq!(dst.status().await.unwrap(), "inmigrate");
    assert_eq!(src.query_migrate().await.unwrap().status, None);
    let console = Console::connect(&source.serial, LONG).unwrap();
    assert!(wait_until(
        || src_beats.is_connected() && dst_beats.is_connected()
    ));

    // The destination without MIGRATION events (its wait polls), the source with them.
    dst.set_capabilities(&[("x-ignore-shared", true)])
        .await
        .unwrap();
    let uri = format!("unix:{}", dst_dir.path().join("migrate.sock").display());
    dst.migrate_incoming(&uri).await.unwrap();
    let caps = [
        ("x-ignore-shared", true),
        ("events", true),
        ("pause-before-switchover", true),
    ];
    src.set_capabilities(&caps).await.unwrap();
    src.migrate(&uri).await.unwrap();
    src.wait_migration_status(LONG, "pre-switchover")
        .await
        .unwrap();
    let paused = src.query_migrate().await.unwrap();
    assert_eq!(paused.status.as_deref(), Some("pre-switchover"));
    src.migrate_continue("pre-switchover").await.unwrap();
    src.wait_migration_status(LONG, "completed").await.unwrap();
    dst.wait_migration_status(LONG, "completed").await.unwrap();

    let done = src.query_migrate().await.unwrap();
    eprintln!("query-migrate at the source: {}", done.raw);
    let transferred = done.ram_transferred.unwrap();
    assert!(
        transferred < 1 << 20,
        "x-ignore-shared left {transferred} bytes"
    );
    assert!(done.downtime_ms.is_some() && done.total_time_ms.is_some());
    assert!(done.setup_time_ms.is_some());
    // QEMU sets the run state after the migration status: `finish-migrate` for a moment.
    src.wait_status(LONG, "postmigrate").await.unwrap();
    // The run state migrates: a VM that never ran stays in prelaunch at the destination.
    assert_eq!(dst.status().await.unwrap(), "prelaunch");
    let err = src.migrate_continue("pre-switchover").await.unwrap_err();
    assert_eq!(err.qemu_class(), Some("GenericError"), "{err}");

    src.quit().await.unwrap();
    dst.quit().await.unwrap();
    src_qemu.wait_exit();
    dst_qemu.wait_exit();
    assert!(wait_until(|| src_beats.is_closed() && dst_beats.is_closed()));
    assert_eq!(
        src_beats.count() + dst_beats.count(),
        0,
        "no guest, no heartbeats"
    );
    assert!(
        console.wait_line(LONG, |_| true).is_err(),
        "the console closed"
    );
}

#[tokio::test]
async fn anonymous_ram_starts_and_stops() {
    if !have_qemu() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let config = QemuConfig::new(32, Ram::Anonymous, dir.path());
    let beats = HeartbeatListener::bind(&config.heartbeat)
        .unwrap()
        .start()
        .unwrap();
    let mut qemu = Running::spawn(config.command(Some(Incoming::DeferPaused)));
    let mut qmp = Qmp::connect(&config.qmp, LONG).await.unwrap();
    assert_eq!(qmp.status().await.unwrap(), "inmigrate");
    let err = qmp.migrate("unix:/nonexistent/x.sock").await;
    let failed = match err {
        Err(e) => e.qemu_class().is_some(),
        Ok(()) => false,
    };
    assert!(failed, "an incoming VM refuses to migrate out");
    qmp.quit().await.unwrap();
    qemu.wait_exit();
    drop(beats);

    // Each QEMU needs its own listener: a collector takes one connection.
    let _beats = HeartbeatListener::bind(&config.heartbeat)
        .unwrap()
        .start()
        .unwrap();
    let mut qemu = Running::spawn({
        let mut c = config.command(None);
        c.arg("-S");
        c
    });
    let mut qmp = Qmp::connect(&config.qmp, LONG).await.unwrap();
    assert_eq!(qmp.status().await.unwrap(), "prelaunch");
    qmp.cont().await.unwrap();
    qmp.wait_event(LONG, |e| e.name == "RESUME").await.unwrap();
    assert_eq!(qmp.status().await.unwrap(), "running");
    qmp.stop().await.unwrap();
    let stop = qmp.wait_event(LONG, |e| e.name == "STOP").await.unwrap();
    assert!(stop.timestamp.0 > 0);
    assert_eq!(qmp.status().await.unwrap(), "paused");
    qmp.quit().await.unwrap();
    qemu.wait_exit();
}

/// Polls `cond` for up to [`LONG`].
fn wait_until(mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + LONG;
    while !cond() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}
