//! The server survives bad clients; the client survives bad servers, silent servers and
//! servers that go away.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use common::{addr_of, client, connect, memory_server, quiet, raw_session, start, tcp};
use farmap_core::{Caps, ChunkIdx, ChunkRange, ErrorKind, Geometry, Store};
use farmap_net::wire::{
    decode_server_hello, ClientHello, Features, Frame, FrameDecoder, Limits, Message, RegionInfo,
    ServerHello, ServerInfo, VERSION,
};
use farmap_net::{ClientOptions, RemoteAddr, RemoteStore, ServeOptions};
use farmap_store::MemoryStore;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn geometry() -> Geometry {
    Geometry::new(1 << 20, 4096).unwrap()
}

fn chunk(b: u8) -> Bytes {
    Bytes::from(vec![b; 4096])
}

/// Everything the server sends until it closes the connection (or 5 s pass).
async fn read_to_end(s: &mut TcpStream) -> BytesMut {
    let mut buf = BytesMut::new();
    tokio::time::timeout(Duration::from_secs(5), async {
        while s.read_buf(&mut buf).await.unwrap_or(0) > 0 {}
    })
    .await
    .expect("the server closes the connection");
    buf
}

/// The connection-level error frame the server sent before closing.
fn closing_reason(mut bytes: BytesMut) -> String {
    let mut d = FrameDecoder::new(Limits::default());
    while let Some(f) = d.decode(&mut bytes).unwrap() {
        if let (0, Message::Error(e)) = (f.id, &f.msg) {
            assert_eq!(e.kind, ErrorKind::InvalidInput);
            return e.message.clone();
        }
    }
    panic!("no connection-level error frame")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_oversized_frames_and_bad_versions_close_only_their_connection() {
    let server = memory_server(geometry(), quiet()).await;
    let good = connect(addr_of(&server), client()).await;
    good.write(ChunkIdx(1), chunk(1)).await.unwrap();

    // Garbage after a valid handshake.
    let mut s = raw_session(tcp(&server)).await;
    s.write_all(&[0, 0, 0, 20, 0x42, 1, 2, 3, 4, 5, 6, 7, 8, 9])
        .await
        .unwrap();
    let reason = closing_reason(read_to_end(&mut s).await);
    assert!(reason.contains("unknown op code 0x42"), "{reason}");
    assert_eq!(good.read(ChunkIdx(1)).await.unwrap(), chunk(1));

    // A frame claiming a gigabyte: refused from its length alone.
    let mut s = raw_session(tcp(&server)).await;
    s.write_all(&(1u32 << 30).to_be_bytes()).await.unwrap();
    let reason = closing_reason(read_to_end(&mut s).await);
    assert!(reason.contains("exceeds the limit"), "{reason}");

    // A client sending a reply frame instead of a request.
    let mut s = raw_session(tcp(&server)).await;
    let mut out = BytesMut::new();
    Frame::new(5, Message::Done).encode(&mut out);
    s.write_all(&out).await.unwrap();
    let reason = closing_reason(read_to_end(&mut s).await);
    assert!(reason.contains("not a request"), "{reason}");

    // Not farmap at all: refused in the handshake.
    let mut s = TcpStream::connect(tcp(&server)).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut answer = read_to_end(&mut s).await;
    match decode_server_hello(&mut answer).unwrap() {
        Some(ServerHello::Refused(r)) => {
            assert!(r.message.contains("not a farmap client"), "{r:?}")
        }
        other => panic!("{other:?}"),
    }

    // Another protocol version: refused with both versions named.
    let mut s = TcpStream::connect(tcp(&server)).await.unwrap();
    let mut out = BytesMut::new();
    ClientHello {
        version: VERSION + 1,
        features: Features::NONE,
    }
    .encode(&mut out);
    s.write_all(&out).await.unwrap();
    let mut answer = read_to_end(&mut s).await;
    match decode_server_hello(&mut answer).unwrap() {
        Some(ServerHello::Refused(r)) => {
            assert_eq!(r.kind, ErrorKind::Unsupported);
            assert!(
                r.message.contains(&format!("version {VERSION}"))
                    && r.message.contains(&format!("version {}", VERSION + 1)),
                "{r:?}"
            );
        }
        other => panic!("{other:?}"),
    }

    // Through all of it, the well-behaved client was served without a hitch.
    for i in 0..16 {
        good.write(ChunkIdx(i), chunk(i as u8)).await.unwrap();
    }
    for i in 0..16 {
        assert_eq!(good.read(ChunkIdx(i)).await.unwrap(), chunk(i as u8));
    }
    drop(good);
    server.shutdown().await.unwrap();
}

/// A peer that speaks just enough farmap: it accepts the handshake with `hello`, then runs
/// `after` on the connection.
async fn fake_server<F, Fut>(hello: ServerHello, after: F) -> SocketAddr
where
    F: Fn(TcpStream) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let after = Arc::new(after);
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            let (hello, after) = (hello.clone(), after.clone());
            tokio::spawn(async move {
                let mut hi = [0u8; 16];
                if s.read_exact(&mut hi).await.is_err() {
                    return;
                }
                let mut out = BytesMut::new();
                hello.encode(&mut out);
                let _ = s.write_all(&out).await;
                after(s).await;
            });
        }
    });
    addr
}

fn accepted() -> ServerHello {
    ServerHello::Accepted(ServerInfo {
        version: VERSION,
        features: Features::NONE,
        region: RegionInfo {
            geometry: geometry(),
            caps: Caps::WRITE,
            read_only: false,
        },
        max_frame: 1 << 20,
        max_in_flight: 8,
        max_batch: 8,
        instance: 1,
    })
}

#[tokio::test]
async fn a_version_mismatch_names_both_versions() {
    let hello = ServerHello::Refused(farmap_net::wire::Refusal {
        version: 7,
        min_version: 7,
        max_version: 9,
        kind: ErrorKind::Unsupported,
        message: "whatever".into(),
    });
    let addr = fake_server(hello, |_| async {}).await;
    let err = RemoteStore::connect(RemoteAddr::Tcp(addr.to_string()), client())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unsupported);
    let msg = err.to_string();
    assert!(
        msg.contains("protocol version mismatch")
            && msg.contains("versions 7 to 9")
            && msg.contains(&format!("this client speaks version {VERSION}")),
        "{msg}"
    );
}

#[tokio::test]
async fn requests_time_out_against_a_server_that_never_answers() {
    // Accepts the handshake, then reads requests and never replies.
    let addr = fake_server(accepted(), |mut s| async move {
        let mut sink = vec![0u8; 4096];
        while s.read(&mut sink).await.unwrap_or(0) > 0 {}
    })
    .await;
    let opts = ClientOptions {
        request_timeout: Duration::from_millis(300),
        ..client()
    };
    let store = connect(RemoteAddr::Tcp(addr.to_string()), opts).await;
    let started = std::time::Instant::now();
    let err = store.read(ChunkIdx(0)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert!(err.to_string().contains("no reply from"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(3));

    // A listener that accepts and never says anything: the connect deadline fires.
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            held.push(s);
        }
    });
    let opts = ClientOptions {
        connect_timeout: Duration::from_millis(300),
        ..client()
    };
    let err = RemoteStore::connect(RemoteAddr::Tcp(silent_addr.to_string()), opts)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert!(err.to_string().contains("no answer within"), "{err}");
}

#[tokio::test]
async fn requests_in_flight_on_a_dropped_connection_fail_as_unavailable() {
    // Reads one request, then hangs up.
    let addr = fake_server(accepted(), |mut s| async move {
        let mut b = [0u8; 13];
        let _ = s.read_exact(&mut b).await;
    })
    .await;
    let opts = ClientOptions {
        connections: 1,
        request_timeout: Duration::from_secs(5),
        ..client()
    };
    let store = connect(RemoteAddr::Tcp(addr.to_string()), opts).await;
    let err = store.read(ChunkIdx(0)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(err.is_retryable());
    assert!(err.to_string().contains("was lost"), "{err}");
}

#[tokio::test]
async fn wrong_addresses_are_one_clear_sentence() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let err = RemoteStore::connect(RemoteAddr::Tcp(format!("127.0.0.1:{port}")), client())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable);
    assert_eq!(
        err.to_string(),
        format!("cannot connect to 127.0.0.1:{port}: connection refused (unavailable)")
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nobody.sock");
    let err = RemoteStore::connect(RemoteAddr::Unix(path.clone()), client())
        .await
        .unwrap_err();
    assert!(
        err.to_string().starts_with(&format!(
            "cannot connect to unix:{}: no such socket",
            path.display()
        )),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_reconnects_after_the_server_restarts() {
    // A store that keeps what it acknowledged across the restart (a restarted `memory:`
    // server loses it, which the client reports: see restart.rs).
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> = Arc::new(
        farmap_store::FileStore::open(
            &dir.path().join("region.img"),
            farmap_store::FileOptions {
                size: Some(geometry().size()),
                chunk_size: 4096,
                read_only: false,
            },
        )
        .unwrap(),
    );
    let server = start(store.clone(), "127.0.0.1:0", quiet()).await;
    let addr = server.local_addr().to_string();
    let opts = ClientOptions {
        request_timeout: Duration::from_secs(10),
        ..client()
    };
    let remote = connect(addr_of(&server), opts).await;
    remote.write(ChunkIdx(2), chunk(2)).await.unwrap();
    server.shutdown().await.unwrap();
    // Requests sent before the client sees the connections close fail as Unavailable
    // (another test covers that); wait until it has seen them close.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while remote.open_connections() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the client never noticed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    // While the server is away, a request waits (its deadline is long); the server comes back
    // on the same address and the request completes on a new connection.
    let pending = tokio::spawn(async move {
        let data = remote.read(ChunkIdx(2)).await;
        (remote, data)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let server = start(store, &addr, quiet()).await;
    let (remote, data) = pending.await.unwrap();
    assert_eq!(data.unwrap(), chunk(2));
    remote.write(ChunkIdx(3), chunk(3)).await.unwrap();
    assert_eq!(remote.read(ChunkIdx(3)).await.unwrap(), chunk(3));
    drop(remote);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_read_only_batches_and_error_replies() {
    let opts = ServeOptions {
        read_only: true,
        max_connections: 1,
        max_batch: 4,
        ..quiet()
    };
    let backing = Arc::new(MemoryStore::new(geometry()));
    backing.write(ChunkIdx(5), chunk(5)).await.unwrap();
    let server = start(backing, "127.0.0.1:0", opts).await;
    let remote = connect(
        addr_of(&server),
        ClientOptions {
            connections: 1,
            ..client()
        },
    )
    .await;
    assert!(!remote.caps().contains(Caps::WRITE));
    assert!(remote.server_info().region.read_only);
    let err = remote.write(ChunkIdx(0), chunk(1)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ReadOnly, "{err}");
    let err = remote
        .trim(ChunkRange::new(ChunkIdx(0), ChunkIdx(1)))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ReadOnly, "{err}");

    // Ten chunks in batches of at most four, in order, zeros as zeros.
    let idx: Vec<ChunkIdx> = (0..10).map(ChunkIdx).collect();
    let got = remote.read_many(&idx).await.unwrap();
    assert_eq!(got.len(), 10);
    for (i, c) in got.iter().enumerate() {
        let want = if i == 5 {
            chunk(5)
        } else {
            Bytes::from(vec![0u8; 4096])
        };
        assert_eq!(*c, want, "chunk {i}");
    }
    let err = remote.read(ChunkIdx(1 << 40)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfRange);

    // One connection only: a second client is refused, saying why.
    let err = RemoteStore::connect(addr_of(&server), client())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("limit of 1 connections"), "{err}");
    assert_eq!(err.kind(), ErrorKind::Unavailable);
    drop(remote);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_requests_in_flight_on_few_connections() {
    let server = memory_server(Geometry::new(8 << 20, 4096).unwrap(), quiet()).await;
    let remote = Arc::new(connect(addr_of(&server), client()).await);
    let writes = (0..2048u64).map(|i| {
        let r = remote.clone();
        tokio::spawn(async move { r.write(ChunkIdx(i), chunk((i % 251) as u8)).await })
    });
    for w in futures::future::join_all(writes).await {
        w.unwrap().unwrap();
    }
    let reads = (0..2048u64).map(|i| {
        let r = remote.clone();
        tokio::spawn(async move { (i, r.read(ChunkIdx(i)).await) })
    });
    for r in futures::future::join_all(reads).await {
        let (i, data) = r.unwrap();
        assert_eq!(data.unwrap(), chunk((i % 251) as u8));
    }
    remote.flush().await.unwrap();
}
