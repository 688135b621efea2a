//! `farmap serve --nbd`, run for real: named exports over a Unix socket and TCP, seen by
//! libnbd's tools (installed when missing).

use std::process::Command;

use farmap_testkit::cli::Listening;

mod common;
use common::farmap;

/// Makes sure libnbd's tools are installed; false after recording a skip.
fn need_libnbd(test: &str) -> bool {
    farmap_testkit::tools::need(
        test,
        &[("nbdinfo", "libnbd-bin"), ("nbdcopy", "libnbd-bin")],
    )
}

/// Starts `farmap serve --nbd -q ARGS...`, its banner read and the rest of its stderr drained
/// (a closed pipe would make its shutdown messages fail).
fn serve(args: &[&str]) -> Listening {
    let mut all = vec!["serve", "--nbd", "-q"];
    all.extend_from_slice(args);
    farmap().listening(&all).drained()
}

#[test]
fn serve_nbd_exports_named_stores_over_a_unix_socket_and_tcp() {
    if !need_libnbd("serve_nbd_exports_named_stores_over_a_unix_socket_and_tcp") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nbd.sock");
    let listen = format!("unix:{}", sock.display());
    let served = serve(&[
        "memory:4MiB",
        "--export",
        "small=memory:1MiB",
        "--listen",
        &listen,
    ]);
    let banner = served.banner();
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
    let ro = serve(&["memory:1MiB", "--listen", "127.0.0.1:0", "--read-only"]);
    let addr = ro.addr();
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
    let err = farmap().fails(&["serve", "--nbd", "memory:1MiB", "--export", "nospec"]);
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
    let far = farmap()
        .listening(&["serve", "-q", &far_spec, "--listen", "127.0.0.1:0"])
        .drained();

    let sock = dir.path().join("front.sock");
    let listen = format!("unix:{}", sock.display());
    let remote = format!("farmap://{}", far.addr());
    let front = serve(&["--managed", &remote, "--listen", &listen]);
    assert!(front.banner().contains("managed"), "{}", front.banner());
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
    let (status, _) = front.stop("TERM");
    assert!(status.success(), "the managed front exited with {status}");
    let _ = far.stop("TERM");
    assert_eq!(
        std::fs::read(&image).unwrap(),
        new_content,
        "what was written through the managed front reached the remote store"
    );
}
