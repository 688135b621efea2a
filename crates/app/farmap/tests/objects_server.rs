//! Named objects exported by a farmap server (`farmap_net::serve_objects`, what
//! `farmap serve --objects` runs) over a real directory and TCP: the objects contract, the
//! versioned layout's folders and a versioned region kept through it (`farmap://` in a
//! `versioned:` spec), a region client and an objects client each told what the other server
//! is, a read-only export, and a peer that sends keys naming paths out of the directory
//! (refused, nothing created).

use std::path::Path;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use farmap::spec::open_objects;
use farmap::StoreSpec;
use farmap_core::{ErrorKind, Objects};
use farmap_net::wire::{
    decode_server_hello, ClientHello, Features, Frame, FrameDecoder, Message, ServerHello,
};
use farmap_net::{ClientOptions, ListenAddr, Listener, RemoteAddr, RemoteStore, ServeOptions};
use farmap_store::DirObjects;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Serves the objects of the directory `dir` on a free loopback port.
async fn served(dir: &Path, read_only: bool) -> (farmap_net::Server, String) {
    let objects: Arc<dyn Objects> = Arc::new(DirObjects::open(dir).unwrap());
    let listener = Listener::bind(&"127.0.0.1:0".parse::<ListenAddr>().unwrap())
        .await
        .unwrap();
    let opts = ServeOptions {
        read_only,
        log: false,
        ..ServeOptions::default()
    };
    let server = farmap_net::serve_objects(objects, listener, opts).unwrap();
    let addr = server.local_addr().to_string();
    (server, addr)
}

/// The objects at `addr`, opened from a spec as a `versioned:` spec would.
async fn remote(addr: &str) -> Arc<dyn Objects> {
    let spec: StoreSpec = format!("farmap://{addr}").parse().unwrap();
    open_objects(&spec).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn served_objects_keep_the_contract_and_hold_versioned_regions() {
    let dir = tempfile::tempdir().unwrap();
    // (A directory cannot hold an object and a folder of one name: the nested folders Redis
    // and CQL are checked with are not asked of it.)
    for (sub, check) in [("contract", 0), ("versioned", 1)] {
        let d = dir.path().join(sub);
        std::fs::create_dir_all(&d).unwrap();
        let (server, addr) = served(&d, false).await;
        let o = remote(&addr).await;
        assert_eq!(o.location(), format!("farmap://{addr}"));
        match check {
            0 => farmap_testkit::check_objects_contract(o).await,
            _ => farmap_testkit::versioned::check_versioned(o).await,
        }
        server.shutdown().await.unwrap();
    }
    // The versioned region's objects are files in the served directory.
    assert!(dir.path().join("versioned/regions").is_dir());
    assert!(dir.path().join("versioned/chunks").is_dir());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_versioned_spec_over_farmap_writes_reads_and_fences() {
    let dir = tempfile::tempdir().unwrap();
    let (server, addr) = served(dir.path(), false).await;
    let spec: StoreSpec = format!("versioned:(farmap://{addr})/r?size=1MiB")
        .parse()
        .unwrap();
    assert_eq!(
        spec.to_string(),
        format!("versioned:(farmap://{addr})/r?size=1MiB")
    );
    let a = farmap::spec::open_store_async(&spec).await.unwrap();
    let b = farmap::spec::open_store_async(&spec).await.unwrap();
    let chunk = |byte: u8| Bytes::from(vec![byte; a.geometry().chunk_size() as usize]);
    a.write(farmap_core::ChunkIdx(3), chunk(7)).await.unwrap();
    a.flush().await.unwrap();
    b.write(farmap_core::ChunkIdx(3), chunk(9)).await.unwrap();
    let e = b.flush().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Fenced, "{e}");
    // A new opening reads what the first writer saved.
    let c = farmap::spec::open_store_async(&spec).await.unwrap();
    assert_eq!(c.read(farmap_core::ChunkIdx(3)).await.unwrap(), chunk(7));
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn region_and_objects_clients_are_told_what_the_server_exports() {
    let dir = tempfile::tempdir().unwrap();
    let (objects_server, addr) = served(dir.path(), false).await;
    let e = RemoteStore::connect(
        addr.parse::<RemoteAddr>().unwrap(),
        ClientOptions::default(),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
    assert!(e.to_string().contains("exports objects"), "{e}");

    let mem = Arc::new(farmap::store::MemoryStore::new(
        farmap_core::Geometry::new(1 << 20, 4096).unwrap(),
    ));
    let listener = Listener::bind(&"127.0.0.1:0".parse::<ListenAddr>().unwrap())
        .await
        .unwrap();
    let region_server = farmap_net::serve(mem, listener, ServeOptions::default()).unwrap();
    let spec: StoreSpec = format!("farmap://{}", region_server.local_addr())
        .parse()
        .unwrap();
    let e = open_objects(&spec).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
    assert!(e.to_string().contains("exports a region"), "{e}");
    region_server.shutdown().await.unwrap();
    objects_server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_object_over_the_limit_is_refused_before_it_is_sent() {
    let dir = tempfile::tempdir().unwrap();
    let (server, addr) = served(dir.path(), false).await;
    let o = remote(&addr).await;
    let big = Bytes::from(vec![1u8; farmap_net::wire::MAX_OBJECT + 1]);
    let e = o.create("a/big", big).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    // The connection was not lost over it: the next requests are answered.
    assert!(o.create("a/ok", Bytes::from_static(b"ok")).await.unwrap());
    assert_eq!(o.list("a").await.unwrap(), ["ok"]);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_export_reads_and_refuses_changes() {
    let dir = tempfile::tempdir().unwrap();
    let local = DirObjects::open(dir.path()).unwrap();
    assert!(local.create("a/b", Bytes::from_static(b"x")).await.unwrap());
    let (server, addr) = served(dir.path(), true).await;
    let o = remote(&addr).await;
    assert_eq!(o.get("a/b").await.unwrap().unwrap(), &b"x"[..]);
    assert_eq!(o.list("a").await.unwrap(), ["b"]);
    let e = o.create("a/c", Bytes::new()).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ReadOnly, "{e}");
    let e = o.delete("a/b").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ReadOnly, "{e}");
    assert!(local.exists("a/b").await.unwrap());
    server.shutdown().await.unwrap();
}

/// A peer speaking the protocol by hand: keys that name paths out of the directory, or
/// anything but plain names, are refused by the server, and nothing is created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_naming_paths_are_refused_by_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let served_dir = dir.path().join("served");
    std::fs::create_dir_all(&served_dir).unwrap();
    let (server, addr) = served(&served_dir, false).await;
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let mut out = BytesMut::new();
    let mut hello = ClientHello::current();
    hello.features = hello.features | Features::OBJECTS;
    hello.encode(&mut out);
    s.write_all(&out).await.unwrap();
    let mut buf = BytesMut::new();
    let info = loop {
        if let Some(h) = decode_server_hello(&mut buf).unwrap() {
            break h;
        }
        assert!(s.read_buf(&mut buf).await.unwrap() > 0, "the server left");
    };
    let ServerHello::Accepted(info) = info else {
        panic!("refused: {info:?}");
    };
    assert!(info.features.contains(Features::OBJECTS));
    let bad = [
        "../escape",
        "chunks/../../escape",
        "/tmp/escape",
        "a//b",
        ".hidden",
        "a/./b",
        "a b",
    ];
    let mut decoder = FrameDecoder::default();
    // Bad keys, and a good key with more bytes than an object may hold (a frame holds them).
    let big = Bytes::from(vec![1u8; farmap_net::wire::MAX_OBJECT + 1]);
    let requests = bad
        .iter()
        .map(|k| ((*k).to_owned(), Bytes::from_static(b"owned")))
        .chain(std::iter::once(("a/big".to_owned(), big)));
    for (i, (key, data)) in requests.enumerate() {
        let frame = Frame::new(
            i as u64 + 1,
            Message::ObjCreate {
                key: key.clone(),
                data,
            },
        );
        let mut out = BytesMut::new();
        frame.encode(&mut out);
        s.write_all(&out).await.unwrap();
        let reply = loop {
            if let Some(f) = decoder.decode(&mut buf).unwrap() {
                break f;
            }
            assert!(s.read_buf(&mut buf).await.unwrap() > 0, "the server left");
        };
        assert_eq!(reply.id, i as u64 + 1);
        match reply.msg {
            Message::Error(e) => assert_eq!(e.kind, ErrorKind::InvalidInput, "{key}: {e:?}"),
            other => panic!("{key}: {other:?}"),
        }
    }
    assert!(!dir.path().join("escape").exists());
    assert!(!Path::new("/tmp/escape").exists());
    let made: Vec<_> = walk(&served_dir);
    assert!(made.is_empty(), "{made:?}");
    server.shutdown().await.unwrap();
}

/// The files under `dir` (not directories).
fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}
