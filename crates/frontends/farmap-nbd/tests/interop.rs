//! farmap's NBD server against real clients: libnbd's tools, qemu, nbdkit, fio.
//! Missing tools are installed (apt-get); a test skips only when that fails.

mod common;

use std::process::{Command, Output};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use farmap_core::{ChunkIdx, Store};
use farmap_nbd::NbdServer;
use farmap_testkit::pattern_with_zeros;
use farmap_testkit::tls::Pki;
use farmap_testkit::tools::need;

const LIBNBD: (&str, &str) = ("nbdinfo", "libnbd-bin");
const NBDCOPY: (&str, &str) = ("nbdcopy", "libnbd-bin");
const QEMU_IMG: (&str, &str) = ("qemu-img", "qemu-utils");
const QEMU_IO: (&str, &str) = ("qemu-io", "qemu-utils");
const NBDKIT: (&str, &str) = ("nbdkit", "nbdkit");
const NBDFUSE: (&str, &str) = ("nbdfuse", "libnbd-bin");
const FUSERMOUNT: (&str, &str) = ("fusermount3", "fuse3");
const FIO: (&str, &str) = ("fio", "fio");

fn uri(server: &NbdServer, export: &str) -> String {
    format!("nbd://{}/{export}", tcp(server))
}

/// Runs a command on a blocking thread (the server runs on the test's runtime).
async fn run(cmd: &str, args: &[&str]) -> Output {
    let cmd = cmd.to_owned();
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        Command::new(&cmd)
            .args(&args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {cmd}: {e}"))
    })
    .await
    .unwrap()
}

/// Runs a command that must succeed; its stdout.
async fn ok(cmd: &str, args: &[&str]) -> String {
    let out = run(cmd, args).await;
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdinfo_lists_exports_and_maps_holes() {
    if !need("nbdinfo_lists_exports_and_maps_holes", &[LIBNBD]) {
        return;
    }
    let disk = memory(8 << 20, 65536);
    disk.write(ChunkIdx(2), Bytes::from(vec![7u8; 65536]))
        .await
        .unwrap();
    let server = start(
        vec![export("", disk), export("second", memory(1 << 20, 4096))],
        quiet(),
    )
    .await;
    let list = ok("nbdinfo", &["--list", &uri(&server, "")]).await;
    assert!(
        list.contains("export=\"\"") && list.contains("export=\"second\""),
        "{list}"
    );
    assert!(
        list.contains("export-size: 8388608") && list.contains("export-size: 1048576"),
        "{list}"
    );
    assert!(
        list.contains("base:allocation") && list.contains("can_multi_conn: true"),
        "{list}"
    );
    let size = ok("nbdinfo", &["--size", &uri(&server, "second")]).await;
    assert_eq!(size.trim(), "1048576");
    // The map: a hole, 64 KiB of data at 128 KiB, a hole to the end.
    let map = ok("nbdinfo", &["--map", &uri(&server, "")]).await;
    let rows: Vec<Vec<&str>> = map
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 3, "{map}");
    assert_eq!(&rows[0][..3], ["0", "131072", "3"], "{map}");
    assert_eq!(&rows[1][..3], ["131072", "65536", "0"], "{map}");
    assert_eq!(&rows[2][..3], ["196608", "8192000", "3"], "{map}");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdcopy_both_ways_keeps_every_byte() {
    if !need("nbdcopy_both_ways_keeps_every_byte", &[NBDCOPY]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let store = memory(16 << 20, 65536);
    let server = start(vec![export("", store.clone())], quiet()).await;
    let data = pattern_with_zeros(11, 16 << 20);
    let src = dir.path().join("src.img");
    let back = dir.path().join("back.img");
    std::fs::write(&src, &data).unwrap();
    let u = uri(&server, "");
    ok("nbdcopy", &["--connections=4", src.to_str().unwrap(), &u]).await;
    assert!(
        store_bytes(&store, 0, data.len()).await == data,
        "the store holds the file"
    );
    ok("nbdcopy", &[&u, back.to_str().unwrap()]).await;
    assert!(
        std::fs::read(&back).unwrap() == data,
        "the copy back is the same"
    );
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_img_converts_compares_and_makes_a_qcow2_on_an_export() {
    if !need(
        "qemu_img_converts_compares_and_makes_a_qcow2_on_an_export",
        &[QEMU_IMG, QEMU_IO],
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let raw = memory(8 << 20, 65536);
    let q = memory(32 << 20, 65536);
    let server = start(vec![export("", raw.clone()), export("q", q)], quiet()).await;
    let data = pattern_with_zeros(5, 8 << 20);
    let src = dir.path().join("src.img");
    let out = dir.path().join("out.img");
    std::fs::write(&src, &data).unwrap();
    let (s, o) = (src.to_str().unwrap(), out.to_str().unwrap());
    let u = uri(&server, "");
    ok(
        "qemu-img",
        &["convert", "-n", "-f", "raw", "-O", "raw", s, &u],
    )
    .await;
    ok("qemu-img", &["compare", "-f", "raw", "-F", "raw", s, &u]).await;
    assert!(store_bytes(&raw, 0, data.len()).await == data);
    ok("qemu-img", &["convert", "-f", "raw", "-O", "raw", &u, o]).await;
    assert!(std::fs::read(&out).unwrap() == data);
    // A different byte makes compare fail.
    let mut changed = data.clone();
    changed[5_000_001] ^= 0xff;
    std::fs::write(&src, &changed).unwrap();
    let cmp = run("qemu-img", &["compare", "-f", "raw", "-F", "raw", s, &u]).await;
    assert_eq!(
        cmp.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&cmp.stdout)
    );
    // qcow2 on an export: create, write through it, check, read back.
    let qu = uri(&server, "q");
    ok("qemu-img", &["create", "-f", "qcow2", &qu, "16M"]).await;
    ok(
        "qemu-io",
        &["-f", "qcow2", "-c", "write -P 0x5a 1M 3M", &qu],
    )
    .await;
    let check = ok("qemu-img", &["check", "-f", "qcow2", &qu]).await;
    assert!(check.contains("No errors"), "{check}");
    ok(
        "qemu-io",
        &[
            "-f",
            "qcow2",
            "-c",
            "read -P 0x5a 1M 3M",
            "-c",
            "read -P 0 0 1M",
            &qu,
        ],
    )
    .await;
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_io_patterns_at_odd_offsets_discard_and_write_zeroes() {
    if !need(
        "qemu_io_patterns_at_odd_offsets_discard_and_write_zeroes",
        &[QEMU_IO],
    ) {
        return;
    }
    let store = memory(4 << 20, 65536);
    let server = start(vec![export("", store.clone())], quiet()).await;
    let u = uri(&server, "");
    let cmds = [
        "write -P 0xa1 1 65537",
        "write -P 0xb2 100001 333333",
        "write -P 0xc3 4194303 1",
        "read -P 0xa1 1 65537",
        "read -P 0xb2 100001 333333",
        "read -P 0xc3 4194303 1",
        "discard 131072 131072",
        "read -P 0 131072 131072",
        "write -z 300001 99999",
        "read -P 0 300001 99999",
        "read -P 0xb2 400000 33334",
        "write -z -u 1048576 1048576",
        "read -P 0 1048576 1048576",
        "flush",
    ];
    let mut args: Vec<&str> = vec!["-f", "raw"];
    for c in &cmds {
        args.extend(["-c", c]);
    }
    args.push(&u);
    let out = ok("qemu-io", &args).await;
    assert!(!out.contains("Pattern verification failed"), "{out}");
    // The store agrees.
    let b = store_bytes(&store, 0, 4 << 20).await;
    assert_eq!(b[0], 0);
    assert!(b[1..65538].iter().all(|&x| x == 0xa1));
    assert!(b[100001..131072].iter().all(|&x| x == 0xb2));
    assert!(b[131072..262144].iter().all(|&x| x == 0));
    assert!(b[300001..400000].iter().all(|&x| x == 0));
    assert!(b[400000..433334].iter().all(|&x| x == 0xb2));
    assert_eq!(b[4194303], 0xc3);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdfuse_mounts_an_export_as_a_file_that_mmap_reads_and_writes() {
    let test = "nbdfuse_mounts_an_export_as_a_file_that_mmap_reads_and_writes";
    if !need(test, &[NBDFUSE, FUSERMOUNT, ("python3", "python3")]) {
        return;
    }
    if !std::path::Path::new("/dev/fuse").exists() {
        farmap_testkit::skip(test, "no /dev/fuse");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let store = memory(4 << 20, 65536);
    let server = start(vec![export("", store.clone())], quiet()).await;
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let pidfile = dir.path().join("pid");
    let mut child = std::process::Command::new("nbdfuse")
        .arg("-P")
        .arg(&pidfile)
        .arg(mnt.join("disk"))
        .arg(uri(&server, ""))
        .spawn()
        .unwrap();
    let mut ready = false;
    for _ in 0..200 {
        if pidfile.exists() && std::fs::metadata(&pidfile).unwrap().len() > 0 {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ready, "nbdfuse did not come up");
    let file = mnt.join("disk");
    let script = format!(
        "import mmap, os\n\
         fd = os.open({file:?}, os.O_RDWR)\n\
         m = mmap.mmap(fd, 4 << 20)\n\
         m[12345:12345 + 11] = b'hello farmap'[:11]\n\
         m[3 << 20:(3 << 20) + 4] = b'tail'\n\
         m.flush()\n\
         assert m[12345:12356] == b'hello farma'\n\
         print(m[0:4].hex())\n\
         m.close(); os.fsync(fd); os.close(fd)\n",
        file = file.to_str().unwrap()
    );
    let py = run("python3", &["-c", &script]).await;
    let unmount = run("fusermount3", &["-u", mnt.to_str().unwrap()]).await;
    let _ = tokio::task::spawn_blocking(move || child.wait()).await;
    assert!(
        py.status.success(),
        "python: {}",
        String::from_utf8_lossy(&py.stderr)
    );
    assert!(unmount.status.success());
    assert_eq!(String::from_utf8_lossy(&py.stdout).trim(), "00000000");
    assert_eq!(store_bytes(&store, 12345, 11).await, b"hello farma");
    assert_eq!(store_bytes(&store, 3 << 20, 4).await, b"tail");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdkit_as_a_peer_copies_to_farmap_and_back() {
    if !need(
        "nbdkit_as_a_peer_copies_to_farmap_and_back",
        &[NBDKIT, NBDCOPY],
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let store = memory(8 << 20, 65536);
    let server = start(vec![export("", store.clone())], quiet()).await;
    let u = uri(&server, "");
    // nbdkit's pattern plugin (every 8 bytes: their offset, big-endian) into farmap.
    ok(
        "nbdkit",
        &[
            "-U",
            "-",
            "pattern",
            "8M",
            "--run",
            &format!("nbdcopy \"$uri\" {u}"),
        ],
    )
    .await;
    let b = store_bytes(&store, 0, 8 << 20).await;
    for at in [0usize, 8, 4096, (8 << 20) - 8] {
        assert_eq!(b[at..at + 8], (at as u64).to_be_bytes(), "at {at}");
    }
    // farmap into nbdkit's memory plugin, and out of it into a file.
    let out = dir.path().join("out.img");
    ok(
        "nbdkit",
        &[
            "-U",
            "-",
            "memory",
            "8M",
            "--run",
            &format!("nbdcopy {u} \"$uri\" && nbdcopy \"$uri\" {}", out.display()),
        ],
    )
    .await;
    assert!(std::fs::read(&out).unwrap() == b);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libnbd_over_tls_with_client_certificates() {
    if !need(
        "libnbd_over_tls_with_client_certificates",
        &[LIBNBD, NBDCOPY],
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new();
    let store = memory(4 << 20, 65536);
    let opts = tls_options(&pki, true);
    let server = start(vec![export("", store.clone())], opts).await;
    let addr = tcp(&server);
    let with = format!(
        "nbds://127.0.0.1:{}/?tls-certificates={}",
        addr.port(),
        pki.gnutls_client_dir(true).display()
    );
    let info = ok("nbdinfo", &[&with]).await;
    assert!(info.contains("using TLS") || info.contains("TLS"), "{info}");
    let data = pattern_with_zeros(9, 4 << 20);
    let src = dir.path().join("src.img");
    std::fs::write(&src, &data).unwrap();
    ok("nbdcopy", &[src.to_str().unwrap(), &with]).await;
    assert!(store_bytes(&store, 0, data.len()).await == data);
    // Without a client certificate: refused.
    let without = format!(
        "nbds://127.0.0.1:{}/?tls-certificates={}",
        addr.port(),
        pki.gnutls_client_dir(false).display()
    );
    let r = run("nbdinfo", &[&without]).await;
    assert!(
        !r.status.success(),
        "a client without a certificate must be refused"
    );
    // Without TLS at all: refused (TLS is required).
    let r = run("nbdinfo", &[&uri(&server, "")]).await;
    assert!(!r.status.success(), "a plain client must be refused");
    let _ = Arc::clone(&store);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fio_with_its_nbd_engine_verifies_random_writes() {
    if !need("fio_with_its_nbd_engine_verifies_random_writes", &[FIO]) {
        return;
    }
    let engines = ok("fio", &["--enghelp"]).await;
    if !engines.contains("nbd") {
        farmap_testkit::skip(
            "fio_with_its_nbd_engine_verifies_random_writes",
            "this fio has no nbd engine",
        );
        return;
    }
    let store = memory(16 << 20, 65536);
    let server = start(vec![export("", store.clone())], quiet()).await;
    let out = ok(
        "fio",
        &[
            "--name=farmap",
            "--ioengine=nbd",
            &format!("--uri={}", uri(&server, "")),
            "--rw=randwrite",
            "--bs=4k",
            "--size=16M",
            "--iodepth=16",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            // No local-*-verify.state file left in the working directory.
            "--verify_state_save=0",
            "--output-format=terse",
        ],
    )
    .await;
    assert!(!out.is_empty());
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_io_requests_over_the_maximum_payload_follow_the_announced_limit() {
    if !need(
        "qemu_io_requests_over_the_maximum_payload_follow_the_announced_limit",
        &[QEMU_IO],
    ) {
        return;
    }
    // 48 MiB at an odd offset: over the default maximum (32 MiB) and far over a 1 MiB one.
    // qemu splits by the announced maximum; a write over it would fail with EINVAL.
    for max in [farmap_nbd_proto::consts::DEFAULT_MAX_PAYLOAD, 1 << 20] {
        let store = memory(64 << 20, 65536);
        let opts = farmap_nbd::NbdServeOptions {
            max_payload: max,
            ..quiet()
        };
        let server = start(vec![export("", store.clone())], opts).await;
        let u = uri(&server, "");
        let out = ok(
            "qemu-io",
            &[
                "-f",
                "raw",
                "-c",
                "write -P 0x5a 1 50331648",
                "-c",
                "read -P 0x5a 1 50331648",
                "-c",
                "read -P 0 50331649 1000",
                &u,
            ],
        )
        .await;
        assert!(
            !out.contains("failed") && out.matches("bytes at offset").count() == 3,
            "max {max}: {out}"
        );
        let b = store_bytes(&store, 0, 48 << 20 | 2).await;
        assert_eq!(b[0], 0);
        assert!(b[1..=48 << 20].iter().all(|&x| x == 0x5a), "max {max}");
        assert_eq!(b[(48 << 20) + 1], 0);
        server.shutdown().await.unwrap();
    }
}
