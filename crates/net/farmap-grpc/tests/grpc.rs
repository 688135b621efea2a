//! `GrpcStore` against `serve_grpc` over real TCP: conformance, error kinds, large chunks,
//! read-only serving, version and address errors.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use farmap_core::{
    ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, Store, StoreError, StoreResult,
};
use farmap_grpc::{pb, serve_grpc, GrpcClientOptions, GrpcServerOptions, GrpcStore};
use farmap_store::MemoryStore;
use farmap_testkit::conformance::chunk_content;
use farmap_testkit::{run_conformance, run_read_only_conformance};
use tokio::net::TcpListener;
use tonic::{Request, Response, Status};

/// Serves `store` on a fresh loopback port; returns its URL.
async fn serve(store: Arc<dyn Store>, options: GrpcServerOptions) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(serve_grpc(store, listener, options));
    format!("http://{addr}")
}

async fn remote(store: Arc<dyn Store>) -> GrpcStore {
    let url = serve(store, GrpcServerOptions::default()).await;
    GrpcStore::connect(&url).await.expect("connect")
}

fn expect_kind<T: std::fmt::Debug>(what: &str, r: StoreResult<T>, kind: ErrorKind) -> StoreError {
    match r {
        Err(e) if e.kind() == kind => e,
        other => panic!("{what}: expected {kind:?}, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_store_conforms() {
    run_conformance(|g| async move {
        Arc::new(remote(Arc::new(MemoryStore::new(g))).await) as Arc<dyn Store>
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn geometry_caps_and_status_come_from_the_server() {
    let g = Geometry::new(10 * 4096 + 100, 4096).expect("geometry");
    let local = Arc::new(MemoryStore::new(g));
    let store = remote(local.clone()).await;
    assert_eq!(store.geometry(), g);
    assert_eq!(store.caps(), local.caps());
    assert_eq!(
        store.status(ChunkIdx(3)).await.expect("status"),
        ChunkStatus::Zero
    );
    store
        .write(ChunkIdx(3), chunk_content(g, ChunkIdx(3), 1))
        .await
        .expect("write");
    assert_eq!(
        store.status(ChunkIdx(3)).await.expect("status"),
        ChunkStatus::Data
    );
    // The last chunk is short.
    let last = store.read(ChunkIdx(10)).await.expect("read");
    assert_eq!(last.len(), 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_keep_their_kind() {
    let g = Geometry::new(8 * 4096, 4096).expect("geometry");
    let store = remote(Arc::new(MemoryStore::new(g))).await;
    // Checked by the client before anything is sent...
    expect_kind(
        "read past the end",
        store.read(ChunkIdx(8)).await,
        ErrorKind::OutOfRange,
    );
    expect_kind(
        "short write",
        store.write(ChunkIdx(0), Bytes::from_static(b"abc")).await,
        ErrorKind::InvalidInput,
    );
    // ...and by the server: per chunk in a batch, and for whole calls.
    let batch = store
        .read_batch(&[ChunkIdx(1), ChunkIdx(99), ChunkIdx(2)])
        .await
        .expect("batch");
    assert!(batch[0].is_ok() && batch[2].is_ok());
    let e = expect_kind(
        "chunk 99 of a batch",
        batch[1].clone_result(),
        ErrorKind::OutOfRange,
    );
    assert!(e.to_string().contains("chunk 99"), "{e}");
    expect_kind(
        "trim past the end",
        store.trim(ChunkRange::new(ChunkIdx(4), ChunkIdx(20))).await,
        ErrorKind::OutOfRange,
    );
    expect_kind(
        "status past the end",
        store.status(ChunkIdx(8)).await,
        ErrorKind::OutOfRange,
    );
}

/// `StoreResult` is not `Clone`; compare through a lossy copy.
trait CloneResult {
    fn clone_result(&self) -> StoreResult<Bytes>;
}

impl CloneResult for StoreResult<Bytes> {
    fn clone_result(&self) -> StoreResult<Bytes> {
        match self {
            Ok(b) => Ok(b.clone()),
            Err(e) => Err(e.to_owned_lossy()),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_chunks_and_batches_cross_intact() {
    let g = Geometry::new(12 * (4 << 20), 4 << 20).expect("geometry");
    let store = remote(Arc::new(MemoryStore::new(g))).await;
    let writes = g.all().iter().map(|idx| {
        let store = &store;
        async move { store.write(idx, chunk_content(g, idx, 7)).await }
    });
    for r in futures::future::join_all(writes).await {
        r.expect("4 MiB write");
    }
    // 12 chunks of 4 MiB: more than one message holds, so the batch is split.
    let all: Vec<ChunkIdx> = g.all().iter().collect();
    let chunks = store.read_batch(&all).await.expect("batch");
    for (idx, chunk) in all.iter().zip(chunks) {
        assert!(chunk.expect("chunk") == chunk_content(g, *idx, 7), "{idx}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_server_refuses_changes() {
    let g = Geometry::new(4 * 65536, 65536).expect("geometry");
    let local = Arc::new(MemoryStore::new(g));
    for idx in g.all().iter() {
        local
            .write(idx, chunk_content(g, idx, 1))
            .await
            .expect("fill");
    }
    let url = serve(
        local,
        GrpcServerOptions {
            read_only: true,
            ..GrpcServerOptions::default()
        },
    )
    .await;
    let store = Arc::new(GrpcStore::connect(&url).await.expect("connect"));
    expect_kind(
        "trim on a read-only server",
        store.trim(ChunkRange::single(ChunkIdx(0))).await,
        ErrorKind::ReadOnly,
    );
    run_read_only_conformance(store, |idx| chunk_content(g, idx, 1).to_vec()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_errors_are_clear() {
    // Nothing listens there.
    let gone = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", gone.local_addr().expect("addr"));
    drop(gone);
    let e = GrpcStore::connect(&url).await.expect_err("nothing listens");
    assert_eq!(e.kind(), ErrorKind::Unavailable);
    assert!(e.to_string().contains(&url), "{e}");
    let e = GrpcStore::connect("not a url").await.expect_err("bad URL");
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    // A server that is not gRPC at all (it closes every connection at once).
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            drop(conn);
        }
    });
    let e = GrpcStore::connect(&url).await.expect_err("not gRPC");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e:?}");
    // One that accepts and never answers: the request timeout applies.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = listener.accept().await {
            held.push(conn);
        }
    });
    let options = GrpcClientOptions {
        request_timeout: Some(Duration::from_millis(300)),
        ..GrpcClientOptions::default()
    };
    let e = GrpcStore::connect_with(&url, options)
        .await
        .expect_err("silent server");
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e:?}");
    assert!(e.to_string().contains("no reply within"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_is_reached_again() {
    let g = Geometry::new(4 * 4096, 4096).expect("geometry");
    let local: Arc<dyn Store> = Arc::new(MemoryStore::new(g));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(farmap_grpc::serve_grpc_with_shutdown(
        local.clone(),
        listener,
        GrpcServerOptions::default(),
        async move {
            let _ = stopped.await;
        },
    ));
    let store = GrpcStore::connect(&format!("http://{addr}"))
        .await
        .expect("connect");
    store
        .write(ChunkIdx(1), chunk_content(g, ChunkIdx(1), 3))
        .await
        .expect("write");
    // Stop the server; requests fail as retryable while it is gone.
    drop(stop);
    let _ = server.await;
    let e = store.read(ChunkIdx(1)).await.expect_err("server gone");
    assert!(e.is_retryable(), "{e:?}");
    // Start it again on the same port: the client reconnects on its own.
    let listener = TcpListener::bind(addr).await.expect("rebind");
    tokio::spawn(serve_grpc(local, listener, GrpcServerOptions::default()));
    let mut last = None;
    for _ in 0..50 {
        match store.read(ChunkIdx(1)).await {
            Ok(data) => {
                assert!(data == chunk_content(g, ChunkIdx(1), 3));
                return;
            }
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("never reconnected: {last:?}");
}

/// A server from the future: it speaks only protocol version 2.
#[derive(Debug)]
struct FutureServer;

#[tonic::async_trait]
impl pb::store_server::Store for FutureServer {
    async fn handshake(
        &self,
        _: Request<pb::HandshakeRequest>,
    ) -> Result<Response<pb::HandshakeReply>, Status> {
        Ok(Response::new(pb::HandshakeReply {
            version: 2,
            size: 1 << 20,
            chunk_size: 4096,
            ..Default::default()
        }))
    }
    async fn read(&self, _: Request<pb::ReadRequest>) -> Result<Response<pb::ReadReply>, Status> {
        Err(Status::unimplemented("v2 only"))
    }
    async fn write(
        &self,
        _: Request<pb::WriteRequest>,
    ) -> Result<Response<pb::WriteReply>, Status> {
        Err(Status::unimplemented("v2 only"))
    }
    async fn flush(
        &self,
        _: Request<pb::FlushRequest>,
    ) -> Result<Response<pb::FlushReply>, Status> {
        Err(Status::unimplemented("v2 only"))
    }
    async fn trim(&self, _: Request<pb::TrimRequest>) -> Result<Response<pb::TrimReply>, Status> {
        Err(Status::unimplemented("v2 only"))
    }
    async fn status(
        &self,
        _: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusReply>, Status> {
        Err(Status::unimplemented("v2 only"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_are_agreed_or_refused_clearly() {
    // A client that does not speak the server's version is told so.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(tonic::transport::Server::builder().serve_with_incoming(
        pb::store_server::StoreServer::new(FutureServer),
        tonic::transport::server::TcpIncoming::from(listener),
    ));
    let e = GrpcStore::connect(&url).await.expect_err("version 2");
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    assert!(e.to_string().contains("protocol version 2"), "{e}");

    // Our server answers a newer client with the version it speaks, and refuses version 0
    // with the kind in the metadata.
    let g = Geometry::new(1 << 20, 4096).expect("geometry");
    let url = serve(Arc::new(MemoryStore::new(g)), GrpcServerOptions::default()).await;
    let channel = tonic::transport::Endpoint::from_shared(url)
        .expect("url")
        .connect()
        .await
        .expect("connect");
    let mut raw = pb::store_client::StoreClient::new(channel);
    let hello = raw
        .handshake(pb::HandshakeRequest { version: 7 })
        .await
        .expect("handshake")
        .into_inner();
    assert_eq!(
        (hello.version, hello.size, hello.chunk_size),
        (1, 1 << 20, 4096)
    );
    let refused = raw
        .handshake(pb::HandshakeRequest { version: 0 })
        .await
        .expect_err("version 0");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    let kind = refused.metadata().get(farmap_grpc::ERROR_KIND_METADATA);
    assert_eq!(
        kind.and_then(|v| v.to_str().ok()),
        Some("ERROR_KIND_INVALID_INPUT")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_excess_connections_are_closed_and_clients_still_served() {
    use tokio::io::AsyncReadExt;
    let g = Geometry::new(1 << 20, 1 << 12).unwrap();
    let url = serve(
        Arc::new(MemoryStore::new(g)),
        GrpcServerOptions {
            idle_timeout: Duration::from_millis(300),
            max_connections: 8,
            ..GrpcServerOptions::default()
        },
    )
    .await;
    let addr = url.trim_start_matches("http://").to_owned();
    // Connections that never speak: each closed, at once when over the limit, or after
    // the idle timeout.
    let mut silent = Vec::new();
    for _ in 0..20 {
        silent.push(tokio::net::TcpStream::connect(&addr).await.unwrap());
    }
    for s in &mut silent {
        let mut sink = [0u8; 1024];
        tokio::time::timeout(Duration::from_secs(5), async {
            while matches!(s.read(&mut sink).await, Ok(n) if n > 0) {}
        })
        .await
        .expect("the server closes a silent connection");
    }
    let store = GrpcStore::connect(&url).await.unwrap();
    store.read(ChunkIdx(0)).await.unwrap();
}
