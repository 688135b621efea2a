//! `farmap serve`, run for real: copies through it, and a pull that survives the server
//! being killed and restarted.

mod common;
use common::farmap;
use std::path::Path;
use std::process::Output;
use std::sync::Arc;
use std::time::{Duration, Instant};

use farmap::pipeline::{
    Cached, DelayOptions, Delayed, PullOptions, PullOrder, Puller, RetryPolicy,
};
use farmap::store::MemoryStore;
use farmap::Store;
use farmap_net::{ClientOptions, RemoteAddr, RemoteStore};
use farmap_testkit::cli::Listening;
use farmap_testkit::tls::Pki;
use rand::{RngCore, SeedableRng};

/// Starts `farmap serve SPEC --listen LISTEN ARGS...` and waits for its address line.
fn serve(spec: &str, listen: &str, args: &[&str]) -> Listening {
    let mut all = vec!["serve", spec, "--listen", listen];
    all.extend_from_slice(args);
    farmap().listening(&all)
}

fn random_file(path: &Path, len: usize, seed: u64) -> Vec<u8> {
    let mut data = vec![0u8; len];
    rand::rngs::SmallRng::seed_from_u64(seed).fill_bytes(&mut data);
    // Some chunks of zeros, which travel as a flag.
    data[len / 2..len / 2 + 256 * 1024].fill(0);
    std::fs::write(path, &data).unwrap();
    data
}

fn check(o: &Output, what: &str) {
    assert!(
        o.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn serve_then_cp_both_ways_and_stop_cleanly_on_ctrl_c() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    let back = dir.path().join("back.img");
    let data = random_file(&src, 4 << 20, 1);

    let served = serve("memory:4MiB?chunk=16KiB", "127.0.0.1:0", &[]);
    let url = format!("farmap://{}", served.addr());
    check(
        &farmap().run(&["cp", "-q", &format!("file:{}", src.display()), &url]),
        "cp to the server",
    );
    let info = farmap().run(&["info", &url]);
    check(&info, "info");
    assert!(
        String::from_utf8_lossy(&info.stdout).contains("16"),
        "{info:?}"
    );
    check(
        &farmap().run(&["cp", "-q", &url, &format!("file:{}", back.display())]),
        "cp from the server",
    );
    assert!(std::fs::read(&back).unwrap() == data, "round trip differs");

    let (status, log) = served.stop("INT");
    assert!(status.success(), "{status:?}: {log}");
    assert!(log.contains("stopped"), "{log}");
}

/// A parent that stops reading (closes the stderr pipe) must not turn the shutdown status
/// lines into a panic that skips the flush: the copy is in the file after SIGTERM.
#[test]
fn a_server_whose_stderr_is_closed_still_flushes_at_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    let store = dir.path().join("store.img");
    let data = random_file(&src, 1 << 20, 7);
    let spec = format!("file:{}?size=1MiB", store.display());

    let mut served = serve(&spec, "127.0.0.1:0", &[]);
    let url = format!("farmap://{}", served.addr());
    let copied = farmap().run(&["cp", "-q", &format!("file:{}", src.display()), &url]);
    served.close_stderr();
    check(&copied, "cp to the server");
    let (status, _) = served.stop("TERM");
    assert!(
        status.success(),
        "{status:?}: a closed stderr broke the shutdown"
    );
    assert!(
        std::fs::read(&store).unwrap() == data,
        "the copy was not flushed"
    );
}

#[test]
fn serve_grpc_then_cp_both_ways() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    let back = dir.path().join("back.img");
    let data = random_file(&src, 2 << 20, 2);

    let served = serve("memory:2MiB?chunk=16KiB", "127.0.0.1:0", &["--grpc"]);
    let url = format!("farmap+grpc://{}", served.addr());
    check(
        &farmap().run(&["cp", "-q", &format!("file:{}", src.display()), &url]),
        "cp to the gRPC server",
    );
    check(
        &farmap().run(&["cp", "-q", &url, &format!("file:{}", back.display())]),
        "cp from the gRPC server",
    );
    assert!(
        std::fs::read(&back).unwrap() == data,
        "gRPC round trip differs"
    );
    let (status, log) = served.stop("TERM");
    assert!(status.success(), "{status:?}: {log}");

    // gRPC is TCP only, without TLS.
    let o = farmap().run(&[
        "serve",
        "memory:1MiB",
        "--grpc",
        "--listen",
        "unix:/tmp/x.sock",
    ]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("TCP only"));
}

#[test]
fn serve_over_a_unix_socket_read_only() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("disk.img");
    let data = random_file(&src, 1 << 20, 2);
    let sock = dir.path().join("farmap.sock");
    let served = serve(
        &format!("file:{}", src.display()),
        &format!("unix:{}", sock.display()),
        &["--read-only", "--quiet"],
    );
    assert_eq!(served.addr(), format!("unix:{}", sock.display()));
    let url = format!("farmap+unix:{}", sock.display());
    let copy = dir.path().join("copy.img");
    check(
        &farmap().run(&["cp", "-q", &url, &format!("file:{}", copy.display())]),
        "cp from the unix socket",
    );
    assert!(std::fs::read(&copy).unwrap() == data);
    let o = farmap().run(&["cp", "-q", &format!("file:{}", copy.display()), &url]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("read-only"), "{err}");
    let (status, _) = served.stop("TERM");
    assert!(status.success());
}

#[test]
fn serve_with_mutual_tls_and_copy_with_url_parameters() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new();
    let [ca, server, server_key, client, client_key] = pki.paths();
    let served = serve(
        "memory:1MiB",
        "127.0.0.1:0",
        &[
            "--tls-cert",
            &server,
            "--tls-key",
            &server_key,
            "--tls-client-ca",
            &ca,
            "--quiet",
        ],
    );
    let src = dir.path().join("src.img");
    let data = random_file(&src, 1 << 20, 4);
    let url = format!(
        "farmaps://{}?ca={ca}&cert={client}&key={client_key}",
        served.addr()
    );
    check(
        &farmap().run(&["cp", "-q", &format!("file:{}", src.display()), &url]),
        "cp over mutual TLS",
    );
    let back = dir.path().join("back.img");
    check(
        &farmap().run(&["cp", "-q", &url, &format!("file:{}", back.display())]),
        "cp back over mutual TLS",
    );
    assert!(std::fs::read(&back).unwrap() == data);

    // Without a client certificate: refused, and the message says why.
    let o = farmap().run(&["info", &format!("farmaps://{}?ca={ca}", served.addr())]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("requires a client certificate"), "{err}");
    let (status, log) = served.stop("TERM");
    assert!(status.success());
    // TLS clients that leave without close_notify (most do) closed normally: a quiet server
    // logs warnings only, and the only one is the refusal.
    let warnings: Vec<&str> = log.lines().filter(|l| l.contains("WARN")).collect();
    assert!(
        warnings.len() == 1 && warnings[0].contains("no certificate"),
        "{log}"
    );
}

#[test]
fn clear_errors_for_wrong_addresses_and_bad_listen_addresses() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let o = farmap().run(&["info", &format!("farmap://127.0.0.1:{port}")]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(&format!(
            "cannot connect to 127.0.0.1:{port}: connection refused"
        )),
        "{err}"
    );
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");

    let o = farmap().run(&["serve", "memory:1MiB", "--listen", "localhost"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("IP:PORT"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_survives_the_server_being_killed_and_restarted() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.img");
    let data = random_file(&path, 16 << 20, 3);
    let spec = format!("file:{}?chunk=64KiB", path.display());
    // A fixed port, so that the restarted server is found at the same address.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = format!("127.0.0.1:{port}");
    let served = serve(&spec, &listen, &["--quiet"]);

    let opts = ClientOptions {
        connections: 4,
        request_timeout: Duration::from_secs(20),
        ..ClientOptions::default()
    };
    let remote = RemoteStore::connect(RemoteAddr::Tcp(listen.clone()), opts)
        .await
        .expect("connect");
    let g = remote.geometry();
    // An emulated 5 ms round trip keeps the pull going long enough to kill the server in it.
    let slow = Delayed::new(
        remote,
        DelayOptions {
            latency: Duration::from_millis(5),
            bandwidth: None,
        },
    );
    let cached = Arc::new(Cached::new(MemoryStore::new(g), slow).unwrap());
    let puller = Puller::start(
        cached.clone(),
        PullOptions {
            workers: 8,
            order: PullOrder::Sequential,
            retry: RetryPolicy {
                attempts: 20,
                initial_backoff: Duration::from_millis(20),
                max_backoff: Duration::from_millis(500),
            },
        },
    );

    // Kill the server (SIGKILL: no clean shutdown) once a part of the region has arrived.
    let deadline = Instant::now() + Duration::from_secs(10);
    while puller.progress().done_chunks < g.chunk_count() / 5 {
        assert!(Instant::now() < deadline, "the pull does not progress");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (_, _) = served.stop("KILL");
    let at_kill = puller.progress().done_chunks;
    assert!(
        at_kill < g.chunk_count(),
        "the pull finished before the kill"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let restarted = serve(&spec, &listen, &["--quiet"]);

    let report = tokio::time::timeout(Duration::from_secs(60), puller.wait())
        .await
        .expect("the pull finishes after the restart");
    assert!(report.is_complete(), "{report:?}");
    eprintln!(
        "killed at {at_kill}/{} chunks; pull took {:?}",
        g.chunk_count(),
        report.elapsed
    );
    // The pull waited out the outage rather than finishing without the server.
    assert!(report.elapsed >= Duration::from_millis(300), "{report:?}");
    for idx in g.all().iter() {
        let got = cached.read(idx).await.unwrap();
        let range = g.byte_range(idx);
        assert!(
            got[..] == data[range.start as usize..range.end as usize],
            "{idx} differs from the file"
        );
    }
    assert!(cached.is_complete());
    drop(restarted);
}

#[test]
fn a_read_only_banner_lists_no_write_or_trim() {
    let served = serve("memory:1MiB", "127.0.0.1:0", &["--read-only"]);
    assert!(served.banner().contains("read-only"), "{}", served.banner());
    let caps = served.banner().rsplit('(').next().unwrap();
    assert!(
        !caps.contains("write") && !caps.contains("trim"),
        "the served caps: {}",
        served.banner()
    );
    let served = serve("memory:1MiB", "127.0.0.1:0", &["--read-only", "--grpc"]);
    let caps = served.banner().rsplit('(').next().unwrap();
    assert!(
        !caps.contains("write") && !caps.contains("trim"),
        "the served caps: {}",
        served.banner()
    );
}

#[test]
fn native_and_grpc_clients_are_told_about_each_others_servers() {
    let grpc = serve("memory:1MiB", "127.0.0.1:0", &["--grpc", "-q"]);
    let o = farmap().run(&["info", &format!("farmap://{}", grpc.addr())]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("HTTP/2") && err.contains("farmap+grpc://"),
        "a native client against a gRPC server: {err}"
    );
    let native = serve("memory:1MiB", "127.0.0.1:0", &["-q"]);
    let o = farmap().run(&["info", &format!("farmap+grpc://{}", native.addr())]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("native protocol") && err.contains("farmap://"),
        "a gRPC client against a native server: {err}"
    );
    let (_, log) = native.stop("TERM");
    assert!(log.contains("HTTP/2"), "the server names the client: {log}");
}

#[test]
fn grpc_honours_the_connection_limit_and_refuses_native_only_options() {
    // A gRPC client opens a pool of 4 connections.
    let served = serve(
        "memory:1MiB",
        "127.0.0.1:0",
        &["--grpc", "--max-connections", "4"],
    );
    // One connection holds one of the 4 slots.
    let held = std::net::TcpStream::connect(served.addr()).unwrap();
    let o = farmap().run(&["info", &format!("farmap+grpc://{}", served.addr())]);
    assert!(!o.status.success(), "a second connection is not served");
    drop(held);
    std::thread::sleep(Duration::from_millis(200));
    check(
        &farmap().run(&["info", &format!("farmap+grpc://{}", served.addr())]),
        "info once the slot is free",
    );
    let (_, log) = served.stop("TERM");
    assert!(log.contains("already serving 4 connections"), "{log}");

    // --max-memory applies to gRPC too; --handshake-timeout does not.
    let served = serve(
        "memory:1MiB",
        "127.0.0.1:0",
        &["--grpc", "--max-memory", "64MiB"],
    );
    check(
        &farmap().run(&["info", &format!("farmap+grpc://{}", served.addr())]),
        "info with --max-memory",
    );
    served.stop("TERM");
    let o = farmap().run(&[
        "serve",
        "memory:1MiB",
        "--grpc",
        "--listen",
        "127.0.0.1:0",
        "--handshake-timeout",
        "5s",
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--handshake-timeout applies to farmap's native protocol only"),
        "{err}"
    );
}

#[test]
fn quiet_servers_do_not_log_connections() {
    for (args, logged) in [(&[][..], true), (&["-q"][..], false)] {
        let served = serve("memory:1MiB", "127.0.0.1:0", args);
        check(
            &farmap().run(&["info", &format!("farmap://{}", served.addr())]),
            "info",
        );
        std::thread::sleep(Duration::from_millis(200));
        let (_, log) = served.stop("TERM");
        assert_eq!(log.contains("connected"), logged, "{args:?}: {log}");
    }
}

#[test]
fn idle_connections_are_closed_after_the_idle_timeout() {
    use std::io::{Read, Write};
    let served = serve("memory:1MiB", "127.0.0.1:0", &["--idle-timeout", "300ms"]);
    let mut s = std::net::TcpStream::connect(served.addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut hello = bytes::BytesMut::new();
    farmap_net::wire::ClientHello::current().encode(&mut hello);
    s.write_all(&hello).unwrap();
    let mut got = Vec::new();
    // The server's hello, then a close once the connection has been idle.
    let n = s
        .read_to_end(&mut got)
        .expect("the server closes the idle connection");
    assert!(
        n > 0 && got.starts_with(&farmap_net::wire::MAGIC),
        "{got:?}"
    );
    let (_, log) = served.stop("TERM");
    assert!(log.contains("idle for"), "{log}");
}

/// The parameters of the first frame an HTTP/2 server at `addr` sends (its SETTINGS), read on
/// a raw connection after the client preface.
fn http2_settings(addr: &str) -> Vec<(u16, u32)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").unwrap();
    // An empty SETTINGS frame: length 0, type 4, no flags, stream 0.
    s.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).unwrap();
    let mut header = [0u8; 9];
    s.read_exact(&mut header).unwrap();
    assert_eq!(
        header[3], 4,
        "the server's first frame is SETTINGS: {header:?}"
    );
    let len = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload).unwrap();
    payload
        .chunks_exact(6)
        .map(|p| {
            (
                u16::from_be_bytes([p[0], p[1]]),
                u32::from_be_bytes([p[2], p[3], p[4], p[5]]),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_max_in_flight_is_announced_and_more_calls_are_answered_in_turn() {
    // The gRPC server relays to a native server 100 ms away: each call takes a round trip.
    let backend = serve("memory:1MiB", "127.0.0.1:0", &["-q"]).drained();
    let proxy = farmap()
        .listening(&[
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--to",
            backend.addr(),
            "--rtt",
            "100ms",
        ])
        .drained();
    let relay = format!("farmap://{}", proxy.addr());
    let grpc = serve(
        &relay,
        "127.0.0.1:0",
        &["--grpc", "-q", "--max-in-flight", "2"],
    )
    .drained();
    let addr = grpc.addr().to_owned();
    // SETTINGS_MAX_CONCURRENT_STREAMS (0x3): what HTTP/2 clients keep to.
    let settings = tokio::task::spawn_blocking(move || http2_settings(&addr))
        .await
        .unwrap();
    assert!(
        settings.contains(&(3, 2)),
        "the limit is announced: {settings:?}"
    );

    let opts = farmap_grpc::GrpcClientOptions {
        connections: 1,
        ..farmap_grpc::GrpcClientOptions::default()
    };
    let url = format!("http://{}", grpc.addr());
    let client = farmap_grpc::GrpcStore::connect_with(&url, opts)
        .await
        .expect("connect");
    // The relay's own connection is made by the first call.
    client.read(farmap::ChunkIdx(0)).await.unwrap();
    // 16 calls at once on one connection: all answered, two at a time (8 x 100 ms).
    let t = Instant::now();
    let reads = futures::future::join_all((0..16).map(|i| client.read(farmap::ChunkIdx(i)))).await;
    let took = t.elapsed();
    for (i, r) in reads.into_iter().enumerate() {
        let chunk = r.unwrap_or_else(|e| panic!("call {i} was not answered: {e}"));
        assert_eq!(chunk.len(), 64 << 10);
    }
    eprintln!("16 calls with --max-in-flight 2 over a 100 ms relay took {took:?}");
    assert!(
        took >= Duration::from_millis(700),
        "16 calls of 100 ms, 2 at a time, took {took:?}: the limit is not kept"
    );
}

/// `verified:(file:)` served, written by a client, and killed before any flush: the next
/// process reads the chunks written since the last flush as lost writes (an error that
/// says so), and the ones flushed before as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verified_file_killed_before_a_flush_reads_its_last_writes_as_lost() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("v.img");
    let spec = format!("verified:(file:{}?size=1MiB&chunk=4KiB)", img.display());
    let listen = "127.0.0.1:0";
    let served = serve(&spec, listen, &["--quiet"]);
    let remote = RemoteStore::connect(
        RemoteAddr::Tcp(served.addr().to_owned()),
        ClientOptions::default(),
    )
    .await
    .expect("connect");
    let (a, b) = (
        bytes::Bytes::from(vec![7u8; 4096]),
        bytes::Bytes::from(vec![9u8; 4096]),
    );
    remote.write(farmap::ChunkIdx(3), a.clone()).await.unwrap();
    remote.flush().await.unwrap();
    remote.write(farmap::ChunkIdx(4), b.clone()).await.unwrap();
    // Acknowledged, not flushed: then SIGKILL.
    drop(remote);
    let (_, _) = served.stop("KILL");

    let out = dir.path().join("out.img");
    let o = farmap().run(&["cp", "-q", &spec, &format!("file:{}", out.display())]);
    assert!(!o.status.success(), "a lost write is an error, never data");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("lost") && err.contains("chunk 4"), "{err}");
    assert!(!err.contains("chunk 3"), "{err}");
}

/// A gRPC client that stops reading in the middle of a copy (SIGSTOP) does not hold the
/// server's stop: its connection is closed once no reply has moved for a second after the
/// stop (it waited for the 120 s idle timeout before, then the 10 s grace).
#[test]
fn a_grpc_server_stops_within_its_grace_when_a_client_stops_reading() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    random_file(&src, 256 << 20, 9);
    let served = serve("memory:256MiB", "127.0.0.1:0", &["--grpc", "--quiet"]);
    let url = format!("farmap+grpc://{}", served.addr());
    check(
        &farmap().run(&["cp", "-q", &format!("file:{}", src.display()), &url]),
        "cp into the gRPC server",
    );
    let out = dir.path().join("out.img");
    let mut reader = farmap()
        .command()
        .args([
            "cp",
            "-q",
            &url,
            &format!("file:{}?size=256MiB", out.display()),
        ])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let signal = |sig: &str, pid: u32| {
        let ok = std::process::Command::new("kill")
            .args([&format!("-{sig}"), &pid.to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{sig}");
    };
    signal("STOP", reader.id());
    std::thread::sleep(Duration::from_secs(1));
    let t = Instant::now();
    let (status, _) = served.stop("TERM");
    let took = t.elapsed();
    signal("CONT", reader.id());
    let _ = reader.kill();
    let _ = reader.wait();
    assert!(status.success(), "{status}");
    eprintln!("the stop took {took:?} with a stopped reader");
    assert!(took < Duration::from_secs(5), "the stop took {took:?}");
}
