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
    // Keep reading its stderr: a closed pipe would make its shutdown messages fail.
    std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
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

/// `farmap serve --nbd --managed farmap://...`: a local caching NBD front of a remote region.
/// What nbdcopy writes through it (nbdcopy flushes at the end) is in the remote's store once
/// the front has stopped, and what the remote held is read through it.
#[test]
fn serve_nbd_managed_is_a_caching_front_of_a_remote_region() {
    if !need_libnbd("serve_nbd_managed_is_a_caching_front_of_a_remote_region") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("far.img");
    // The remote region starts with data in its first MiB.
    let first: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
    let mut content = first.clone();
    content.resize(8 << 20, 0);
    std::fs::write(&image, &content).unwrap();
    let far_spec = format!("file:{}", image.display());
    let mut far = Command::new(env!("CARGO_BIN_EXE_farmap"))
        .args(["serve", "-q", &far_spec, "--listen", "127.0.0.1:0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start farmap serve");
    let mut far_err = BufReader::new(far.stderr.take().unwrap());
    let mut line = String::new();
    far_err.read_line(&mut line).unwrap();
    let far_addr = line
        .split("listening on ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .trim_end_matches(',')
        .to_owned();
    std::thread::spawn(move || std::io::copy(&mut far_err, &mut std::io::sink()));
    let far = Child(far);

    let sock = dir.path().join("front.sock");
    let listen = format!("unix:{}", sock.display());
    let remote = format!("farmap://{far_addr}");
    let (front, banner) = serve(&["--managed", &remote, "--listen", &listen]);
    assert!(banner.contains("managed"), "{banner}");
    let uri = format!("nbd+unix:///?socket={}", sock.display());

    // Read through the front: the remote's data.
    let read_back = dir.path().join("read.img");
    let out = Command::new("nbdcopy")
        .args([uri.as_str(), read_back.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(std::fs::read(&read_back).unwrap(), content);

    // Write through the front: 2 MiB at 3 MiB.
    let patch: Vec<u8> = (0..2 << 20).map(|i| (i % 253) as u8 ^ 0x5a).collect();
    let mut new_content = content.clone();
    new_content[3 << 20..5 << 20].copy_from_slice(&patch);
    let src = dir.path().join("new.img");
    std::fs::write(&src, &new_content).unwrap();
    let out = Command::new("nbdcopy")
        .args([src.to_str().unwrap(), uri.as_str()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");

    // Stop the front (SIGTERM: it pushes what is left), then the remote (flushes its file).
    let mut front = front;
    let _ = Command::new("kill")
        .args(["-TERM", &front.0.id().to_string()])
        .status();
    let status = front.0.wait().unwrap();
    assert!(status.success(), "the managed front exited with {status}");
    let mut far = far;
    let _ = Command::new("kill")
        .args(["-TERM", &far.0.id().to_string()])
        .status();
    let _ = far.0.wait();
    assert_eq!(
        std::fs::read(&image).unwrap(),
        new_content,
        "what was written through the managed front reached the remote store"
    );
}
