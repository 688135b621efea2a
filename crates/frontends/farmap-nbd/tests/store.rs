//! NBD as a store ([`NbdStore`]) against real servers: farmap's own NBD server, nbdkit
//! (memory plugin, TLS), and hostile servers on raw sockets.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use common::*;
use farmap_core::{Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, Store};
use farmap_nbd::{NbdClientOptions, NbdServer, NbdStore, NbdTarget};
use farmap_nbd_proto::consts::tflag;
use farmap_nbd_proto::{
    offset_data_header, BlockSize, ExportInfo, RequestDecoder, ServerConfig, ServerHandshake,
    ServerStep, TlsMode,
};
use farmap_net::{ListenAddr, RemoteAddr, TlsClientConfig};
use farmap_testkit::pattern_with_zeros;
use farmap_testkit::process::KillOnDrop;
use farmap_testkit::tls::Pki;
use farmap_testkit::tools::need;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const NBDKIT: (&str, &str) = ("nbdkit", "nbdkit");

fn opts(chunk: u32) -> NbdClientOptions {
    NbdClientOptions {
        chunk_size: Some(chunk),
        ..NbdClientOptions::default()
    }
}

fn tcp_target(addr: std::net::SocketAddr, export: &str) -> NbdTarget {
    NbdTarget {
        addr: RemoteAddr::Tcp(addr.to_string()),
        export: export.into(),
        tls: None,
    }
}

/// Starts `nbdkit` in the foreground on a Unix socket in `dir` with `args` (plugin and its
/// parameters); returns when it accepts connections. The socket file appears at `bind`,
/// before `listen`: a connection in between is refused. nbdkit writes its pidfile once it
/// listens, so that is what is waited for.
async fn nbdkit(dir: &Path, name: &str, extra: &[&str], plugin: &[&str]) -> (KillOnDrop, PathBuf) {
    let sock = dir.join(format!("{name}.sock"));
    let pidfile = dir.join(format!("{name}.pid"));
    let child = Command::new("nbdkit")
        .args(["-f", "--exit-with-parent", "-U"])
        .arg(&sock)
        .arg("-P")
        .arg(&pidfile)
        .args(extra)
        .args(plugin)
        .stdout(Stdio::null())
        .spawn()
        .expect("nbdkit starts");
    let guard = KillOnDrop(child);
    for _ in 0..400 {
        if std::fs::read_to_string(&pidfile).is_ok_and(|p| p.ends_with('\n')) {
            return (guard, sock);
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("nbdkit did not create {}", sock.display());
}

fn unix_target(sock: &Path) -> NbdTarget {
    NbdTarget {
        addr: RemoteAddr::Unix(sock.to_owned()),
        export: String::new(),
        tls: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conforms_against_farmaps_own_nbd_server() {
    let servers: Arc<Mutex<Vec<NbdServer>>> = Arc::default();
    farmap_testkit::run_conformance(|g: Geometry| {
        let servers = servers.clone();
        async move {
            let server = start(
                vec![export("disk", memory(g.size(), g.chunk_size().into()))],
                quiet(),
            )
            .await;
            let store = NbdStore::connect(tcp_target(tcp(&server), "disk"), opts(g.chunk_size()))
                .await
                .unwrap();
            servers.lock().unwrap().push(server);
            assert_eq!(store.geometry(), g);
            assert!(store
                .caps()
                .contains(Caps::WRITE | Caps::TRIM | Caps::STATUS));
            assert!(
                !store.caps().contains(Caps::FLUSH),
                "a memory export's flush makes nothing durable: not announced"
            );
            assert_eq!(store.connections(), 4, "the server offers CAN_MULTI_CONN");
            Arc::new(store) as Arc<dyn Store>
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conforms_against_nbdkit_memory() {
    if !need("conforms_against_nbdkit_memory", &[NBDKIT]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let kits: Arc<Mutex<Vec<KillOnDrop>>> = Arc::default();
    let n = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    // nbdkit's memory plugin keeps its allocation map in 32 KiB pages: a zeroed 4 KiB chunk
    // next to data stays "allocated" (no STATE_ZERO), which the suite's exact status check
    // (for stores with Caps::STATUS) refuses. Chunks of 32 KiB and more.
    let geometries = farmap_testkit::conformance::geometries()
        .into_iter()
        .filter(|g| g.chunk_size() >= 32 * 1024);
    farmap_testkit::run_conformance_with(geometries, |g: Geometry| {
        let (kits, n) = (kits.clone(), n.clone());
        let dir = dir.path().to_owned();
        async move {
            let i = n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let size = g.size().to_string();
            let (kit, sock) = nbdkit(&dir, &format!("m{i}"), &[], &["memory", &size]).await;
            kits.lock().unwrap().push(kit);
            let store = NbdStore::connect(unix_target(&sock), opts(g.chunk_size()))
                .await
                .unwrap();
            assert_eq!(store.geometry(), g);
            Arc::new(store) as Arc<dyn Store>
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn big_chunks_are_split_into_the_servers_maximum_payload() {
    // farmap's server announces its maximum payload (64 KiB here); 1 MiB chunks travel as 16
    // requests each way.
    let backing = memory(4 << 20, 65536);
    let o = farmap_nbd::NbdServeOptions {
        max_payload: 64 * 1024,
        ..quiet()
    };
    let server = start(vec![export("", backing.clone())], o).await;
    let store = NbdStore::connect(tcp_target(tcp(&server), ""), opts(1 << 20))
        .await
        .unwrap();
    assert_eq!(store.max_request(), 64 * 1024);
    let data = Bytes::from(pattern_with_zeros(3, 1 << 20));
    store.write(ChunkIdx(2), data.clone()).await.unwrap();
    assert!(store_bytes(&backing, 2 << 20, 1 << 20).await == data[..]);
    assert!(store.read(ChunkIdx(2)).await.unwrap() == data);
    assert_eq!(store.status(ChunkIdx(2)).await.unwrap(), ChunkStatus::Data);
    assert_eq!(store.status(ChunkIdx(3)).await.unwrap(), ChunkStatus::Zero);
    store.trim(ChunkRange::single(ChunkIdx(2))).await.unwrap();
    assert!(farmap_core::is_zero(
        &store.read(ChunkIdx(2)).await.unwrap()
    ));
    store.flush().await.unwrap();
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_export_and_ro_refuse_writes_before_sending() {
    let mut e = export("ro", memory(1 << 20, 65536));
    e.read_only = true;
    let server = start(vec![e, export("rw", memory(1 << 20, 65536))], quiet()).await;
    let ro = NbdStore::connect(tcp_target(tcp(&server), "ro"), opts(65536))
        .await
        .unwrap();
    assert!(!ro.caps().contains(Caps::WRITE));
    let err = ro
        .write(ChunkIdx(0), Bytes::from(vec![1u8; 65536]))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ReadOnly);
    assert!(err.context().contains("exports it read-only"), "{err}");
    let asked = NbdStore::connect(
        tcp_target(tcp(&server), "rw"),
        NbdClientOptions {
            read_only: true,
            ..opts(65536)
        },
    )
    .await
    .unwrap();
    let err = asked
        .trim(ChunkRange::single(ChunkIdx(0)))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ReadOnly);
    // A missing export is NotFound, named.
    let err = NbdStore::connect(tcp_target(tcp(&server), "nope"), opts(65536))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    assert!(
        err.context().contains("127.0.0.1") && err.context().contains("\"nope\""),
        "{err}"
    );
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_against_farmaps_server_with_client_certificates_and_refusals() {
    let pki = Pki::new();
    let backing = memory(1 << 20, 65536);
    let server = start(vec![export("", backing.clone())], tls_options(&pki, true)).await;
    let with_cert = TlsClientConfig {
        ca: pki.ca.pem.clone(),
        cert: Some(pki.client.cert.clone()),
        key: Some(pki.client.key.clone()),
        server_name: Some("localhost".into()),
    };
    let mut t = tcp_target(tcp(&server), "");
    t.tls = Some(with_cert.clone());
    let store = NbdStore::connect(t.clone(), opts(65536)).await.unwrap();
    store
        .write(ChunkIdx(1), Bytes::from(vec![9u8; 65536]))
        .await
        .unwrap();
    assert_eq!(store_bytes(&backing, 65536, 4).await, [9u8; 4]);
    // Without a client certificate: refused, saying why.
    t.tls = Some(TlsClientConfig {
        cert: None,
        key: None,
        ..with_cert.clone()
    });
    let err = NbdStore::connect(t.clone(), opts(65536)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::PermissionDenied, "{err}");
    assert!(err.context().contains("certificate"), "{err}");
    // Without TLS: the server requires it, and the error says how to connect.
    t.tls = None;
    let err = NbdStore::connect(t, opts(65536)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::PermissionDenied, "{err}");
    assert!(err.context().contains("nbds://"), "{err}");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbds_against_nbdkit_with_certificates_and_a_refusal() {
    let test = "nbds_against_nbdkit_with_certificates_and_a_refusal";
    if !need(test, &[NBDKIT]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new();
    // nbdkit's --tls-certificates directory: ca-cert.pem, server-cert.pem, server-key.pem.
    let sdir = pki.gnutls_server_dir();
    let certs = format!("--tls-certificates={}", sdir.display());
    let (_kit, sock) = nbdkit(
        dir.path(),
        "tls",
        &["--tls=require", "--tls-verify-peer", &certs],
        &["memory", "4M"],
    )
    .await;
    let with_cert = TlsClientConfig {
        ca: pki.ca.pem.clone(),
        cert: Some(pki.client.cert.clone()),
        key: Some(pki.client.key.clone()),
        server_name: None,
    };
    let mut t = unix_target(&sock);
    t.tls = Some(with_cert.clone());
    let store = NbdStore::connect(t.clone(), opts(65536)).await.unwrap();
    let data = Bytes::from(pattern_with_zeros(4, 65536));
    store.write(ChunkIdx(5), data.clone()).await.unwrap();
    store.flush().await.unwrap();
    assert!(store.read(ChunkIdx(5)).await.unwrap() == data);
    drop(store);
    // A second client reads it back over TLS.
    let again = NbdStore::connect(t.clone(), opts(65536)).await.unwrap();
    assert!(again.read(ChunkIdx(5)).await.unwrap() == data);
    // No client certificate: nbdkit verifies peers, so it refuses.
    t.tls = Some(TlsClientConfig {
        cert: None,
        key: None,
        ..with_cert
    });
    let refused = NbdStore::connect(t.clone(), opts(65536)).await;
    let err = refused.map(|_| ()).unwrap_err();
    assert!(
        matches!(
            err.kind(),
            ErrorKind::PermissionDenied | ErrorKind::Unavailable
        ),
        "{:?}: {err}",
        err.kind()
    );
    // Plain NBD to a TLS-only server: refused with the way out.
    t.tls = None;
    let err = NbdStore::connect(t, opts(65536)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::PermissionDenied, "{err}");
    assert!(err.context().contains("requires TLS"), "{err}");
}

/// A fake NBD server on a raw socket: it shakes hands (one export of `size` bytes with the
/// given flags) and then hands the connection to `then`.
async fn fake_server<F, Fut>(size: u64, flags: u16, then: F) -> std::net::SocketAddr
where
    F: FnOnce(TcpStream, BytesMut) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut hs = ServerHandshake::new(ServerConfig {
            exports: vec![ExportInfo {
                name: String::new(),
                description: String::new(),
                size,
                flags,
                block: BlockSize {
                    min: 1,
                    preferred: 4096,
                    max: 1 << 20,
                },
            }],
            tls: TlsMode::Off,
        });
        let mut out = BytesMut::new();
        hs.greeting(&mut out);
        let mut input = BytesMut::new();
        loop {
            let step = hs.step(&mut input, &mut out).unwrap();
            s.write_all(&out).await.unwrap();
            out.clear();
            match step {
                ServerStep::NeedMore => {
                    if s.read_buf(&mut input).await.unwrap() == 0 {
                        return;
                    }
                }
                ServerStep::Done(_) => break,
                other => panic!("{other:?}"),
            }
        }
        then(s, input).await;
    });
    addr
}

/// Reads one request header from the fake server's client.
async fn next_request(s: &mut TcpStream, input: &mut BytesMut) -> farmap_nbd_proto::RequestHeader {
    let mut dec = RequestDecoder::new(64 << 20);
    loop {
        if let Some(farmap_nbd_proto::Incoming::Request { header, .. }) = dec.decode(input).unwrap()
        {
            return header;
        }
        assert!(s.read_buf(input).await.unwrap() > 0, "the client went away");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_oversized_reply_is_refused_before_allocation() {
    let addr = fake_server(1 << 20, tflag::SEND_FLUSH, |mut s, mut input| async move {
        let h = next_request(&mut s, &mut input).await;
        // A data chunk claiming 4 GiB - 1 of payload: the client must refuse it from the
        // header alone (nothing more is sent; waiting for it would hang).
        let mut hdr = offset_data_header(h.cookie, h.offset, u32::MAX - 8, true);
        hdr[16..20].copy_from_slice(&u32::MAX.to_be_bytes());
        s.write_all(&hdr).await.unwrap();
        tokio::time::sleep(Duration::from_secs(30)).await;
    })
    .await;
    let store = NbdStore::connect(tcp_target(addr, ""), opts(65536))
        .await
        .unwrap();
    let t0 = std::time::Instant::now();
    let err = store.read(ChunkIdx(0)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    assert!(
        err.context().contains("broke the protocol") && err.context().contains("more than"),
        "{err}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(25),
        "refused from the header, not after a timeout"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_vanishes_fails_every_request_in_flight() {
    let addr = fake_server(1 << 20, 0, |mut s, mut input| async move {
        // Take four requests, answer none, and hang up.
        for _ in 0..4 {
            next_request(&mut s, &mut input).await;
        }
        drop(s);
    })
    .await;
    let store = Arc::new(
        NbdStore::connect(tcp_target(addr, ""), opts(65536))
            .await
            .unwrap(),
    );
    assert_eq!(store.connections(), 1, "no CAN_MULTI_CONN: one connection");
    let reads = (0..4).map(|i| {
        let s = store.clone();
        tokio::spawn(async move { s.read(ChunkIdx(i)).await })
    });
    let results = tokio::time::timeout(Duration::from_secs(20), futures::future::join_all(reads))
        .await
        .expect("every request ends: no hang");
    for r in results {
        let err = r.unwrap().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
        assert!(
            err.context().contains("closed the connection")
                && err.context().contains("was in flight"),
            "{err}"
        );
    }
    // The next request tries a new connection, which is refused (the fake serves once).
    let err = store.read(ChunkIdx(0)).await.unwrap_err();
    assert!(err.context().contains("connection refused"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_server_times_out_instead_of_hanging() {
    let addr = fake_server(1 << 20, 0, |mut s, mut input| async move {
        next_request(&mut s, &mut input).await;
        tokio::time::sleep(Duration::from_secs(60)).await;
    })
    .await;
    let store = NbdStore::connect(
        tcp_target(addr, ""),
        NbdClientOptions {
            request_timeout: Duration::from_millis(300),
            ..opts(65536)
        },
    )
    .await
    .unwrap();
    let err = store.read(ChunkIdx(3)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert!(
        err.context()
            .contains("did not answer a read of 65536 bytes at offset 196608"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_answered_outside_its_range_is_corrupt() {
    let addr = fake_server(1 << 20, 0, |mut s, mut input| async move {
        let h = next_request(&mut s, &mut input).await;
        // Data for an offset the request did not ask for.
        let data = vec![1u8; h.length as usize];
        let hdr = offset_data_header(h.cookie, h.offset + 1, h.length, true);
        s.write_all(&hdr).await.unwrap();
        s.write_all(&data).await.unwrap();
        tokio::time::sleep(Duration::from_secs(30)).await;
    })
    .await;
    let store = NbdStore::connect(tcp_target(addr, ""), opts(65536))
        .await
        .unwrap();
    let err = store.read(ChunkIdx(0)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    assert!(err.context().contains("outside the request"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unix_socket_server_of_farmap_is_a_store() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nbd.sock");
    let addr: ListenAddr = format!("unix:{}", sock.display()).parse().unwrap();
    let listener = farmap_net::Listener::bind(&addr).await.unwrap();
    let backing = memory(1 << 20, 4096);
    let server =
        farmap_nbd::serve_nbd(vec![export("x", backing.clone())], listener, quiet()).unwrap();
    let mut t = unix_target(&sock);
    t.export = "x".into();
    assert_eq!(
        t.uri(),
        format!("nbd+unix:///x?socket={}", sock.display()),
        "the URI libnbd and qemu use"
    );
    let store = NbdStore::connect(t, opts(4096)).await.unwrap();
    store
        .write(ChunkIdx(7), Bytes::from(vec![7u8; 4096]))
        .await
        .unwrap();
    assert_eq!(store_bytes(&backing, 7 * 4096, 2).await, [7, 7]);
    server.shutdown().await.unwrap();
}

/// Reads chunk `idx` until it succeeds (the pool reconnects in the background; until it has,
/// a request fails at once with the latest reconnect error), or panics after 10 s.
async fn read_once_reconnected(store: &NbdStore, idx: ChunkIdx) -> Bytes {
    let start = std::time::Instant::now();
    loop {
        match store.read(idx).await {
            Ok(b) => return b,
            Err(e) if start.elapsed() < Duration::from_secs(10) => {
                assert!(
                    e.context().contains("nbd.sock") || e.kind() == ErrorKind::Closed,
                    "while the server is away: {e}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("no reconnect within 10 s: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_is_reconnected_and_a_changed_export_refused() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nbd.sock");
    let addr: ListenAddr = format!("unix:{}", sock.display()).parse().unwrap();
    let backing = memory(1 << 20, 4096);
    let serve = |store: Arc<dyn Store>| {
        let addr = addr.clone();
        async move {
            let _ = std::fs::remove_file(match &addr {
                ListenAddr::Unix(p) => p.clone(),
                other => panic!("{other}"),
            });
            let listener = farmap_net::Listener::bind(&addr).await.unwrap();
            farmap_nbd::serve_nbd(vec![export("", store)], listener, quiet()).unwrap()
        }
    };
    let server = serve(backing.clone()).await;
    let store = NbdStore::connect(unix_target(&sock), opts(4096))
        .await
        .unwrap();
    let n = store.connections();
    assert!(n > 1, "farmap's server offers CAN_MULTI_CONN");
    store
        .write(ChunkIdx(3), Bytes::from(vec![3u8; 4096]))
        .await
        .unwrap();
    server.shutdown().await.unwrap();

    // The same export again: every connection comes back, the data is there.
    let server = serve(backing.clone()).await;
    assert_eq!(
        read_once_reconnected(&store, ChunkIdx(3)).await[..],
        [3u8; 4096][..]
    );
    let start = std::time::Instant::now();
    while server.connections() < n {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "all {n} reconnect"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.shutdown().await.unwrap();

    // Another export at the same place: never used, and the error says why.
    let _server = serve(memory(2 << 20, 4096)).await;
    let start = std::time::Instant::now();
    let err = loop {
        let err = store.read(ChunkIdx(3)).await.unwrap_err();
        if err.context().contains("changed") || start.elapsed() > Duration::from_secs(10) {
            break err;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        err.context().contains("changed: it was 1048576 bytes"),
        "{err}"
    );
}
