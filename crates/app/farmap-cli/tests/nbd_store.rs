//! NBD exports as farmap stores, through the CLI: `farmap cp` in and out of nbdkit and
//! qemu-nbd, `farmap serve` of an `nbd+unix://` store, and a server killed mid-copy.
//! nbdkit and qemu-nbd are installed when missing.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use farmap_testkit::pattern_with_zeros;
use farmap_testkit::process::KillOnDrop;
use farmap_testkit::wait::eventually;

mod common;
use common::farmap;

/// Makes sure `bin` (from Debian package `pkg`) is there; false after recording a skip.
fn need(test: &str, bin: &str, pkg: &str) -> bool {
    farmap_testkit::tools::need(test, &[(bin, pkg)])
}

/// Waits until a Unix socket at `path` accepts connections (its file appears at `bind`,
/// before `listen`).
fn wait_for(path: &Path) {
    eventually(
        &format!("{} did not appear", path.display()),
        Duration::from_secs(10),
        || std::os::unix::net::UnixStream::connect(path).is_ok(),
    );
}

/// `nbdkit` in the foreground, listening where `listen` says, with `args` (filters,
/// plugin...); returns once `listening` holds.
fn start_nbdkit(listen: &[&OsStr], args: &[&str], listening: impl FnMut() -> bool) -> KillOnDrop {
    let child = Command::new("nbdkit")
        .args(["-f", "--exit-with-parent"])
        .args(listen)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start nbdkit");
    let c = KillOnDrop(child);
    eventually("nbdkit did not listen", Duration::from_secs(10), listening);
    c
}

/// `nbdkit` on a Unix socket `sock`, with `args`; returns once it listens. The socket file
/// appears at `bind`, before `listen`, so the pidfile nbdkit writes once it listens is what
/// is waited for.
fn nbdkit(sock: &Path, args: &[&str]) -> KillOnDrop {
    let pidfile = sock.with_extension("pid");
    let listen = [
        "-U".as_ref(),
        sock.as_os_str(),
        "-P".as_ref(),
        pidfile.as_os_str(),
    ];
    start_nbdkit(&listen, args, || {
        std::fs::read_to_string(&pidfile).is_ok_and(|p| p.ends_with('\n'))
    })
}

/// `nbdkit` on a free TCP port of 127.0.0.1; the child and the port.
fn nbdkit_tcp(args: &[&str]) -> (KillOnDrop, u16) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let port_arg = port.to_string();
    let listen = [
        "-i".as_ref(),
        "127.0.0.1".as_ref(),
        "-p".as_ref(),
        port_arg.as_ref(),
    ];
    let c = start_nbdkit(&listen, args, || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    (c, port)
}

fn farmap_ok(args: &[&str]) -> String {
    farmap().ok(args)
}

fn file_with(dir: &Path, name: &str, data: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, data).unwrap();
    p
}

fn spec(scheme: &str, path: &Path) -> String {
    format!("{scheme}:{}", path.display())
}

fn need_nbdkit(test: &str) -> bool {
    need(test, "nbdkit", "nbdkit")
}

/// Copies the file `src` into the store `uri`, then the store into the file `back`.
fn copy_in_and_back(src: &Path, uri: &str, back: &Path) {
    farmap_ok(&["cp", "-q", &spec("file", src), uri]);
    farmap_ok(&["cp", "-q", uri, &spec("file", back)]);
}

/// Asserts that the file at `path` holds `data` (`what` says which file it is).
fn assert_holds(path: &Path, data: &[u8], what: &str) {
    assert!(std::fs::read(path).unwrap() == data, "{what}");
}

#[test]
fn cp_in_and_out_of_nbdkit_over_tcp_is_identical() {
    if !need_nbdkit("cp_in_and_out_of_nbdkit_over_tcp_is_identical") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = pattern_with_zeros(21, 8 << 20);
    let src = file_with(dir.path(), "in.img", &data);
    let back = dir.path().join("back.img");
    let (_kit, port) = nbdkit_tcp(&["memory", "8M"]);
    let uri = format!("nbd://127.0.0.1:{port}/");
    copy_in_and_back(&src, &uri, &back);
    assert_holds(&back, &data, "the copy back is identical");
    // `farmap info` sees the export's size and the store's capabilities.
    let info = farmap_ok(&["info", &uri]);
    assert!(info.contains("8MiB") || info.contains("8388608"), "{info}");
}

#[test]
fn cp_in_and_out_of_qemu_nbd_over_a_unix_socket_is_identical() {
    let test = "cp_in_and_out_of_qemu_nbd_over_a_unix_socket_is_identical";
    if !need(test, "qemu-nbd", "qemu-utils") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = pattern_with_zeros(22, 6 << 20);
    let src = file_with(dir.path(), "in.img", &data);
    let disk = file_with(dir.path(), "disk.raw", &vec![0u8; 6 << 20]);
    let back = dir.path().join("back.img");
    let sock = dir.path().join("q.sock");
    let _q = KillOnDrop(
        Command::new("qemu-nbd")
            .args(["-f", "raw", "-t", "--shared=8", "-k"])
            .arg(&sock)
            .arg(&disk)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start qemu-nbd"),
    );
    wait_for(&sock);
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    copy_in_and_back(&src, &uri, &back);
    assert_holds(&back, &data, "the copy back is identical");
    assert_holds(&disk, &data, "qemu-nbd's file holds what was copied in");
}

#[test]
fn serve_of_an_nbd_store_carries_reads_and_writes_to_nbdkit() {
    if !need_nbdkit("serve_of_an_nbd_store_carries_reads_and_writes_to_nbdkit") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("kit.sock");
    let _kit = nbdkit(&sock, &["memory", "4M"]);
    let nbd = format!("nbd+unix:///?socket={}&chunk=256KiB", sock.display());
    let serve = farmap()
        .listening(&["serve", "-q", &nbd, "--listen", "127.0.0.1:0"])
        .drained();
    let banner = serve.banner();
    assert!(banner.contains("256KiB"), "{banner}");
    let remote = format!("farmap://{}", serve.addr());
    let data = pattern_with_zeros(23, 4 << 20);
    let src = file_with(dir.path(), "in.img", &data);
    farmap_ok(&["cp", "-q", &spec("file", &src), &remote]);
    // What farmap's server wrote went to nbdkit: read it straight from there.
    let direct = dir.path().join("direct.img");
    farmap_ok(&["cp", "-q", &nbd, &spec("file", &direct)]);
    assert_holds(&direct, &data, "nbdkit holds the data");
    let back = dir.path().join("back.img");
    farmap_ok(&["cp", "-q", &remote, &spec("file", &back)]);
    assert_holds(&back, &data, "read back through the server");
}

#[test]
fn a_server_killed_mid_copy_fails_the_copy_instead_of_hanging() {
    if !need_nbdkit("a_server_killed_mid_copy_fails_the_copy_instead_of_hanging") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("slow.sock");
    // Every write takes 50 ms: 64 MiB in 64 KiB chunks with 16 workers takes ~13 s.
    let mut kit = nbdkit(&sock, &["--filter=delay", "memory", "64M", "wdelay=50ms"]);
    let data = pattern_with_zeros(24, 64 << 20);
    let src = file_with(dir.path(), "in.img", &data);
    let uri = format!("nbd+unix:///?socket={}&timeout=20s", sock.display());
    let cp = farmap()
        .command()
        .args(["cp", "-q", &spec("file", &src), &uri])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start farmap cp");
    let mut cp = KillOnDrop(cp);
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        cp.0.try_wait().unwrap().is_none(),
        "the copy is still running when the server dies"
    );
    kit.0.kill().unwrap();
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = cp.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "farmap cp still runs 15 s after its server died (a hang)"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!status.success(), "the copy cannot succeed");
    let mut err = String::new();
    std::io::Read::read_to_string(cp.0.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(
        err.contains("NBD server") && err.contains(&sock.display().to_string()),
        "the error names the server: {err}"
    );
}
