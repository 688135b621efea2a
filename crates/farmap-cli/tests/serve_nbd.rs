//! `farmap serve --nbd`, run for real: named exports over a Unix socket and TCP, seen by
//! libnbd's tools (installed when missing).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

fn have(bin: &str) -> bool {
    Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {bin}"))
        .output()
        .is_ok_and(|o| o.status.success())
}

fn need_libnbd(test: &str) -> bool {
    if !have("nbdinfo") || !have("nbdcopy") {
        let _ = Command::new("sh")
            .arg("-c")
            .arg(
                "flock /tmp/farmap-apt.lock sh -c 'apt-get update -qq && \
                 DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
                 --no-install-recommends libnbd-bin'",
            )
            .output();
    }
    if have("nbdinfo") && have("nbdcopy") {
        return true;
    }
    farmap_testkit::skip(
        test,
        "libnbd-bin (nbdinfo, nbdcopy) missing and not installable",
    );
    false
}

struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `farmap serve --nbd ARGS...`; the child and its banner line.
fn serve(args: &[&str]) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_farmap"))
        .args(["serve", "--nbd", "-q"])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start farmap serve --nbd");
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    stderr.read_line(&mut line).unwrap();
    (Child(child), line)
}

#[test]
fn serve_nbd_exports_named_stores_over_a_unix_socket_and_tcp() {
    if !need_libnbd("serve_nbd_exports_named_stores_over_a_unix_socket_and_tcp") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nbd.sock");
    let listen = format!("unix:{}", sock.display());
    let (_child, banner) = serve(&[
        "memory:4MiB",
        "--export",
        "small=memory:1MiB",
        "--listen",
        &listen,
    ]);
    assert!(
        banner.contains("NBD") && banner.contains("\"small\""),
        "{banner}"
    );
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    let out = Command::new("nbdinfo")
        .args(["--list", &uri])
        .output()
        .unwrap();
    let list = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(list.contains("export-size: 4194304"), "{list}");
    assert!(
        list.contains("export=\"small\"") && list.contains("export-size: 1048576"),
        "{list}"
    );
    // Data in and out of the named export.
    let src = dir.path().join("src");
    let back = dir.path().join("back");
    let data: Vec<u8> = (0..1u32 << 20)
        .map(|i| (i.wrapping_mul(2654435761) >> 24) as u8)
        .collect();
    std::fs::write(&src, &data).unwrap();
    let small = format!("nbd+unix:///small?socket={}", sock.display());
    for (from, to) in [
        (src.to_str().unwrap(), small.as_str()),
        (small.as_str(), back.to_str().unwrap()),
    ] {
        let o = Command::new("nbdcopy").args([from, to]).output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    assert!(std::fs::read(&back).unwrap() == data);

    // Read-only over TCP: writes are refused.
    let (_ro, banner) = serve(&["memory:1MiB", "--listen", "127.0.0.1:0", "--read-only"]);
    let addr = banner
        .split("listening on ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("{banner}"))
        .to_owned();
    let info = Command::new("nbdinfo")
        .arg(format!("nbd://{addr}/"))
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&info.stdout).contains("is_read_only: true"));
    let o = Command::new("nbdcopy")
        .args([src.to_str().unwrap(), &format!("nbd://{addr}/")])
        .output()
        .unwrap();
    assert!(!o.status.success(), "a read-only export refuses writes");
}

#[test]
fn serve_nbd_rejects_a_malformed_export() {
    let out = Command::new(env!("CARGO_BIN_EXE_farmap"))
        .args(["serve", "--nbd", "memory:1MiB", "--export", "nospec"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("NAME=SPEC"), "{err}");
}
