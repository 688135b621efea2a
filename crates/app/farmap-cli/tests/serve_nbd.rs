//! `farmap serve --nbd`, run for real: named exports over a Unix socket and TCP, seen by
//! libnbd's tools (installed when missing).

use std::path::{Path, PathBuf};
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

/// Unix socket `name` in `dir`, and the `--listen` value that serves on it.
fn unix_listen(dir: &Path, name: &str) -> (PathBuf, String) {
    let sock = dir.join(name);
    let listen = format!("unix:{}", sock.display());
    (sock, listen)
}

#[test]
fn serve_nbd_exports_named_stores_over_a_unix_socket_and_tcp() {
    if !need_libnbd("serve_nbd_exports_named_stores_over_a_unix_socket_and_tcp") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (sock, listen) = unix_listen(dir.path(), "nbd.sock");
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

    let (sock, listen) = unix_listen(dir.path(), "front.sock");
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

/// Writes `len` pseudo-random bytes (from `seed`) to `path`; returns them.
fn random_file(path: &Path, len: usize, seed: u64) -> Vec<u8> {
    let data: Vec<u8> = farmap_testkit::XorShift(seed | 1)
        .take(len)
        .map(|x| x as u8)
        .collect();
    std::fs::write(path, &data).unwrap();
    data
}

/// `farmap serve --nbd` with TLS from the CLI's flags: plain NBD is refused (the server
/// requires TLS), `nbds://` with the CA is served both ways; with `--tls-client-ca`, a
/// client without a certificate is refused and one with a certificate is served.
#[test]
fn serve_nbd_over_tls_refuses_plain_clients_and_serves_tls_ones() {
    let dir = tempfile::tempdir().unwrap();
    let pki = farmap_testkit::tls::Pki::new();
    let [ca, cert, key, client, client_key] = pki.paths();
    let src = dir.path().join("src.img");
    let back = dir.path().join("back.img");
    let data = random_file(&src, 2 << 20, 5);
    let (src, back) = (
        format!("file:{}", src.display()),
        format!("file:{}", back.display()),
    );

    let tls = serve(&[
        "memory:2MiB",
        "--listen",
        "127.0.0.1:0",
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
    ]);
    assert!(tls.banner().contains("TLS required"), "{}", tls.banner());
    let addr = tls.addr();
    let err = farmap().fails(&["cp", "-q", &src, &format!("nbd://{addr}/")]);
    assert!(err.contains("the server requires TLS"), "{err}");
    let url = format!("nbds://{addr}/?ca={ca}");
    farmap().ok(&["cp", "-q", &src, &url]);
    farmap().ok(&["cp", "-q", &url, &back]);
    assert!(
        std::fs::read(&back[5..]).unwrap() == data,
        "the round trip over TLS differs"
    );
    // A CA that did not sign the server's certificate: refused.
    let other = farmap_testkit::tls::Ca::new(dir.path(), "other");
    let err = farmap().fails(&[
        "info",
        &format!("nbds://{addr}/?ca={}", other.pem.display()),
    ]);
    assert!(err.contains("certificate"), "{err}");

    let mutual = serve(&[
        "memory:2MiB",
        "--listen",
        "127.0.0.1:0",
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
        "--tls-client-ca",
        &ca,
    ]);
    assert!(
        mutual.banner().contains("mutual TLS required"),
        "{}",
        mutual.banner()
    );
    let addr = mutual.addr();
    let o = farmap().run(&["info", &format!("nbds://{addr}/?ca={ca}")]);
    assert!(
        !o.status.success(),
        "a client without a certificate is refused"
    );
    let url = format!("nbds://{addr}/?ca={ca}&cert={client}&key={client_key}");
    farmap().ok(&["cp", "-q", &src, &url]);
    std::fs::remove_file(&back[5..]).unwrap();
    farmap().ok(&["cp", "-q", &url, &back]);
    assert!(
        std::fs::read(&back[5..]).unwrap() == data,
        "the round trip over mutual TLS differs"
    );
}

/// A process's `VmHWM` (peak resident memory), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmHWM in /proc/PID/status")
        * 1024
}

/// `farmap serve --nbd --managed --cache-max 4MiB` in front of a 128 MiB remote region:
/// 128 MiB written and read back through it round-trip, the front's peak memory grows by far
/// less than the region, it says at shutdown that it evicted (and pushed) chunks within
/// its bound, and the remote holds what was written.
#[test]
fn serve_nbd_managed_with_a_cache_max_stays_bounded_and_round_trips() {
    const SIZE: usize = 128 << 20;
    let dir = tempfile::tempdir().unwrap();
    let far = farmap()
        .listening(&["serve", "-q", "memory:128MiB", "--listen", "127.0.0.1:0"])
        .drained();
    let (sock, listen) = unix_listen(dir.path(), "front.sock");
    let remote = format!("farmap://{}", far.addr());
    let mut front = farmap().listening(&[
        "serve",
        "--nbd",
        "-q",
        "--managed",
        &remote,
        "--cache-max",
        "4MiB",
        "--max-memory",
        "8MiB",
        "--listen",
        &listen,
    ]);
    let log = front.log_stderr();
    let base = farmap_testkit::process::rss_bytes(front.id());
    let uri = format!("nbd+unix:///?socket={}", sock.display());

    let src = dir.path().join("src.img");
    let back = dir.path().join("back.img");
    let data = random_file(&src, SIZE, 9);
    farmap().ok(&["cp", "-q", &format!("file:{}", src.display()), &uri]);
    farmap().ok(&["cp", "-q", &uri, &format!("file:{}", back.display())]);
    assert!(
        std::fs::read(&back).unwrap() == data,
        "the round trip through the front differs"
    );
    let growth = peak_rss(front.id()).saturating_sub(base);
    eprintln!(
        "managed NBD front: RSS {} MiB at start, peak {} MiB more after 2 x 128 MiB",
        base >> 20,
        growth >> 20
    );
    // An unbounded cache would hold the whole region (128 MiB).
    assert!(
        growth < 32 << 20,
        "the front's peak memory grew by {} MiB with --cache-max 4MiB",
        growth >> 20
    );

    let (status, _) = front.stop("TERM");
    assert!(status.success(), "the front exited with {status}");
    let log = log.lock().unwrap().clone();
    assert!(
        log.contains("the managed cache holds at most 4194304 bytes"),
        "{log}"
    );
    let stats = log
        .lines()
        .find_map(|l| l.split("managed cache: at most ").nth(1))
        .unwrap_or_else(|| panic!("no eviction report at shutdown: {log}"));
    let numbers: Vec<u64> = stats
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse().ok())
        .collect();
    let [held, evicted, pushed] = numbers[..] else {
        panic!("{stats}")
    };
    assert_eq!(held, 64, "4 MiB of 64 KiB chunks: {stats}");
    assert!(evicted >= (SIZE as u64 >> 16) - held, "{stats}");
    assert!(
        pushed > 0,
        "modified chunks were pushed before they were dropped: {stats}"
    );
    // The remote holds what was written.
    std::fs::remove_file(&back).unwrap();
    farmap().ok(&["cp", "-q", &remote, &format!("file:{}", back.display())]);
    assert!(std::fs::read(&back).unwrap() == data, "the remote differs");
}
