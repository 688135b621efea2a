//! Hostile peers against `serve_grpc`, with real tonic clients over loopback: a read request
//! that would expand eightfold when decoded, writes the store keeps pending, and replies a
//! client never reads. The server's memory stays within its budget, and a good client on
//! another connection is still served.
//!
//! Memory is measured, not assumed: the test kit's counting allocator is this binary's global
//! allocator, and the tests read the process's peak of live bytes (server and clients run in
//! this process), one test at a time.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use farmap_core::{ChunkIdx, Geometry, Store};
use farmap_grpc::pb::store_client::StoreClient;
use farmap_grpc::pb::{self, write_request};
use farmap_grpc::{serve_grpc, GrpcServerOptions, GrpcStore};
use farmap_store::MemoryStore;
use farmap_testkit::alloc::{process_peak_bytes, reset_process_peak, CountingAlloc};
use farmap_testkit::wait::runtime;
use farmap_testkit::{Hooked, Op};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request, Status};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

const MIB: usize = 1 << 20;

/// The tests measure the whole process: one at a time.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Serves `store` on a fresh loopback port; returns its URL.
async fn serve(store: Arc<dyn Store>, options: GrpcServerOptions) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(serve_grpc(store, listener, options));
    format!("http://{addr}")
}

/// One HTTP/2 connection of its own.
async fn connect(endpoint: Endpoint) -> Channel {
    endpoint.connect().await.expect("connect")
}

/// A raw client that sends whatever it is given (no size limit of its own).
fn raw(channel: Channel) -> StoreClient<Channel> {
    StoreClient::new(channel)
        .max_encoding_message_size(usize::MAX)
        .max_decoding_message_size(usize::MAX)
}

/// The server's options in these tests: a small total, so that attacks reach it quickly, and
/// messages of two 1 MiB chunks at most.
fn small_server() -> GrpcServerOptions {
    GrpcServerOptions {
        total_budget: 8 * MIB,
        max_message: (2 * MIB + (64 << 10)) as u32,
        memory_wait: Duration::from_secs(1),
        ..GrpcServerOptions::default()
    }
}

/// What a request refused for want of memory looks like.
fn assert_busy(status: &Status) {
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("memory"), "{status:?}");
    let kind = status.metadata().get(farmap_grpc::ERROR_KIND_METADATA);
    assert_eq!(
        kind.and_then(|v| v.to_str().ok()),
        Some("ERROR_KIND_UNAVAILABLE"),
        "retryable: {status:?}"
    );
}

/// A `ReadRequest` as the wire sees it: field 1 as one length-delimited run, which is what a
/// packed `repeated uint64` is. `n` zero bytes are `n` zero indices.
#[derive(Clone, PartialEq, prost::Message)]
struct PackedRead {
    #[prost(bytes = "bytes", tag = "1")]
    chunks: Bytes,
}

#[test]
fn a_huge_packed_read_is_refused_before_it_is_expanded() {
    let _serial = serial();
    runtime().block_on(async {
        let g = Geometry::new(64 << 20, 64 << 10).expect("geometry");
        let url = serve(Arc::new(MemoryStore::new(g)), GrpcServerOptions::default()).await;
        let channel = connect(Endpoint::from_shared(url).expect("url")).await;
        let mut grpc = tonic::client::Grpc::new(channel).max_encoding_message_size(usize::MAX);
        // 16 MiB of zero bytes: 16 Mi indices, 128 MiB as a decoded `Vec<u64>`.
        const LEN: usize = 16 * MIB;
        let request = PackedRead {
            chunks: Bytes::from(vec![0u8; LEN]),
        };
        let before = reset_process_peak();
        grpc.ready().await.expect("ready");
        let reply: Result<tonic::Response<pb::ReadReply>, Status> = grpc
            .unary(
                Request::new(request),
                PathAndQuery::from_static("/farmap.v1.Store/Read"),
                tonic_prost::ProstCodec::default(),
            )
            .await;
        let grown = process_peak_bytes() - before;
        // The client encodes its 16 MiB once; the server may hold what its HTTP/2 windows
        // let in before it refuses. Decoding the indices would have taken 128 MiB more.
        assert!(
            grown < 3 * LEN,
            "memory grew by {} MiB for a {} MiB read request",
            grown / MIB,
            LEN / MIB
        );
        let status = reply.expect_err("refused");
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains("limit"), "{status:?}");
    });
}

/// How many writes a [`held_writes`] store holds now, and the most it held at once.
#[derive(Debug, Default)]
struct Pending {
    now: AtomicUsize,
    most: AtomicUsize,
}

/// A memory store whose writes to chunks below `held` wait until `gate` opens, counted in
/// the [`Pending`] returned with it.
fn held_writes(
    inner: MemoryStore,
    held: u64,
    gate: watch::Receiver<bool>,
) -> (Hooked<MemoryStore>, Arc<Pending>) {
    let pending = Arc::new(Pending::default());
    let counts = pending.clone();
    let store = Hooked::new(inner, move |op, idx| {
        if op != Op::Write || idx.0 >= held {
            return Box::pin(async { Ok(()) });
        }
        let (pending, mut gate) = (counts.clone(), gate.clone());
        Box::pin(async move {
            let now = pending.now.fetch_add(1, Ordering::SeqCst) + 1;
            pending.most.fetch_max(now, Ordering::SeqCst);
            let _ = gate.wait_for(|open| *open).await;
            pending.now.fetch_sub(1, Ordering::SeqCst);
            Ok(())
        })
    });
    (store, pending)
}

/// A good client's single-chunk requests, each of which fits a connection's own reserve.
async fn good_client_is_served(url: &str, g: Geometry) {
    let good = GrpcStore::connect(url).await.expect("good client connects");
    let data = Bytes::from(vec![7u8; g.chunk_size() as usize]);
    good.write(ChunkIdx(40), data.clone())
        .await
        .expect("good write");
    assert!(good.read(ChunkIdx(40)).await.expect("good read") == data);
    good.read(ChunkIdx(41)).await.expect("good read of zeros");
}

#[test]
fn writes_the_store_keeps_pending_stay_within_the_budget() {
    let _serial = serial();
    runtime().block_on(async {
        let g = Geometry::new(64 << 20, 1 << 20).expect("geometry");
        let (open, gate) = watch::channel(false);
        let (store, pending) = held_writes(MemoryStore::new(g), 32, gate);
        let options = small_server();
        let url = serve(Arc::new(store), options).await;
        // Three connections, 32 writes of a whole chunk each, all held by the store.
        const CONNS: usize = 3;
        const WRITES: usize = 32;
        let data = Bytes::from(vec![0xA5u8; g.chunk_size() as usize]);
        let mut calls = Vec::new();
        for _ in 0..CONNS {
            let client = raw(connect(Endpoint::from_shared(url.clone()).expect("url")).await);
            for i in 0..WRITES {
                let mut client = client.clone();
                let request = pb::WriteRequest {
                    chunk: i as u64,
                    body: Some(write_request::Body::Data(data.clone())),
                };
                calls.push((
                    i as u64,
                    tokio::spawn(async move { client.write(request).await }),
                ));
            }
        }
        // Every write is either held by the store or refused once it has waited for memory.
        let total = CONNS * WRITES;
        let settled = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                let refused = calls.iter().filter(|(_, c)| c.is_finished()).count();
                if refused + pending.now.load(Ordering::SeqCst) == total {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        let most = pending.most.load(Ordering::SeqCst);
        // The total, and one chunk's write per connection from its own reserve (2 MiB is
        // generous for a reserve).
        let bound = options.total_budget + (CONNS + 1) * 2 * MIB;
        assert!(
            most * g.chunk_size() as usize <= bound,
            "{most} writes of {} bytes held at once (bound {} MiB)",
            g.chunk_size(),
            bound / MIB
        );
        assert!(settled.is_ok(), "writes neither held nor refused");
        assert!(most > 0, "no write reached the store");

        good_client_is_served(&url, g).await;

        let _ = open.send(true);
        let (mut done, mut refused) = (0, 0);
        let mut written = std::collections::BTreeSet::new();
        for (chunk, call) in calls {
            match call.await.expect("task") {
                Ok(_) => {
                    done += 1;
                    written.insert(chunk);
                }
                Err(status) => {
                    assert_busy(&status);
                    refused += 1;
                }
            }
        }
        assert_eq!(done, most, "every held write completes");
        assert_eq!(done + refused, total);
        // The budget has come back: a read of two chunks (from the total) is served. Which
        // chunks' writes were held rather than refused is up to the scheduling: two of them.
        let two: Vec<ChunkIdx> = written.iter().take(2).map(|c| ChunkIdx(*c)).collect();
        assert_eq!(
            two.len(),
            2,
            "at least two chunks were written: {written:?}"
        );
        let good = GrpcStore::connect(&url).await.expect("connect");
        let both = good.read_batch(&two).await.expect("read of two chunks");
        assert!(both.iter().all(|c| c.as_ref().is_ok_and(|c| *c == data)));
    });
}

#[test]
fn replies_a_client_never_reads_stay_within_the_budget() {
    let _serial = serial();
    runtime().block_on(async {
        let g = Geometry::new(64 << 20, 1 << 20).expect("geometry");
        let local = Arc::new(MemoryStore::new(g));
        let data = Bytes::from(vec![0x5Au8; g.chunk_size() as usize]);
        for idx in 0..8 {
            local
                .write(ChunkIdx(idx), data.clone())
                .await
                .expect("fill");
        }
        let options = small_server();
        let url = serve(local, options).await;
        // Clients whose HTTP/2 windows take 64 KiB: they read the headers of their replies
        // and never the bodies.
        const CONNS: usize = 4;
        const READS: usize = 16;
        let stingy = Endpoint::from_shared(url.clone())
            .expect("url")
            .initial_stream_window_size(65_535)
            .initial_connection_window_size(65_535);
        let before = reset_process_peak();
        let mut calls = Vec::new();
        for _ in 0..CONNS {
            let channel = connect(stingy.clone()).await;
            for i in 0..READS {
                let mut grpc = tonic::client::Grpc::new(channel.clone());
                let first = (i % 4) as u64 * 2;
                let request = pb::ReadRequest {
                    chunks: vec![first, first + 1],
                };
                calls.push(tokio::spawn(async move {
                    grpc.ready().await.expect("ready");
                    // The unary method, called as a stream: the reply's body stays unread.
                    grpc.server_streaming::<_, pb::ReadReply, _>(
                        Request::new(request),
                        PathAndQuery::from_static("/farmap.v1.Store/Read"),
                        tonic_prost::ProstCodec::default(),
                    )
                    .await
                }));
            }
        }
        let mut unread = Vec::new();
        let mut refused = 0;
        for call in calls {
            let answered = tokio::time::timeout(Duration::from_secs(10), call)
                .await
                .expect("every read is answered or refused")
                .expect("task");
            match answered {
                Ok(reply) => unread.push(reply),
                Err(status) => {
                    assert_busy(&status);
                    refused += 1;
                }
            }
        }
        let grown = process_peak_bytes() - before;
        let bound = options.total_budget + (CONNS + 1) * 2 * MIB + 8 * MIB;
        assert!(
            grown <= bound,
            "memory grew by {} MiB for {} unread replies of 2 MiB (bound {} MiB)",
            grown / MIB,
            unread.len(),
            bound / MIB
        );
        assert!(!unread.is_empty() && refused > 0, "{} unread", unread.len());

        good_client_is_served(&url, g).await;

        // Once the hostile client goes, its replies' memory comes back.
        drop(unread);
        let good = GrpcStore::connect(&url).await.expect("connect");
        let mut last = None;
        for _ in 0..50 {
            match good.read_batch(&[ChunkIdx(0), ChunkIdx(1)]).await {
                Ok(both) => match both.into_iter().find_map(Result::err) {
                    None => return,
                    Some(e) => last = Some(e),
                },
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("the budget never came back: {last:?}");
    });
}

/// Connections held open and idle (a call every few minutes keeps one open) do not keep a
/// new client out at `max_connections`: the one idle longest is closed for it.
#[test]
fn at_the_connection_limit_a_new_client_takes_an_idle_connections_place() {
    let _serial = serial();
    runtime().block_on(async {
        let g = Geometry::new(64 << 20, 1 << 20).expect("geometry");
        let options = GrpcServerOptions {
            max_connections: 4,
            ..small_server()
        };
        let url = serve(Arc::new(MemoryStore::new(g)), options).await;
        let addr = url.trim_start_matches("http://").to_owned();
        // Four connections that say nothing hold every slot.
        let mut held = Vec::new();
        for _ in 0..4 {
            held.push(
                tokio::net::TcpStream::connect(&addr)
                    .await
                    .expect("connect"),
            );
        }
        tokio::time::sleep(farmap_net::IDLE_TO_EVICT + Duration::from_millis(300)).await;
        // A client with a pool of four connections takes their places, and is served.
        tokio::time::timeout(Duration::from_secs(20), good_client_is_served(&url, g))
            .await
            .expect("the good client was served");
        let mut closed = 0;
        for s in &mut held {
            let mut buf = [0u8; 1024];
            let read = tokio::time::timeout(Duration::from_secs(5), async {
                loop {
                    match tokio::io::AsyncReadExt::read(s, &mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(_) => {}
                    }
                }
            });
            if read.await.is_ok() {
                closed += 1;
            }
        }
        assert_eq!(closed, 4, "every idle connection gave its place");
    });
}
