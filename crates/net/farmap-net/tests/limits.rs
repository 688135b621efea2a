//! The server's limits hold against clients that misbehave slowly: clients that stop reading
//! their replies, stay idle, never finish the handshake, or come in crowds.

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use common::{addr_of, client, connect, quiet, raw_session, start, tcp};
use farmap_core::{ChunkIdx, Geometry, Store};
use farmap_net::wire::{ClientHello, Frame, Message};
use farmap_net::{RemoteStore, ServeOptions, Server};
use farmap_pipeline::Counting;
use farmap_store::MemoryStore;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const CHUNK: u64 = 64 << 10;
const CHUNKS: u64 = 256;
/// Chunks in one read: as many as fit the default frame limit with the reply's framing.
const BATCH: u64 = 255;

/// Reads until the server closes the connection; panics if it has not within `limit`.
async fn closed_within(s: &mut TcpStream, limit: Duration) -> usize {
    let mut total = 0;
    let mut buf = vec![0u8; 1 << 20];
    tokio::time::timeout(limit, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => total += n,
            }
        }
    })
    .await
    .expect("the server closes the connection");
    total
}

/// One read request for most chunks of the region: a reply of almost 16 MiB.
fn big_read(id: u64) -> Bytes {
    let mut out = BytesMut::new();
    Frame::new(id, Message::Read((0..BATCH).map(ChunkIdx).collect())).encode(&mut out);
    out.freeze()
}

/// A server over a counted memory store whose every chunk holds data (so that replies are
/// as large as they can be: zero chunks travel as a flag).
async fn full_server(opts: ServeOptions) -> (Server, Arc<Counting<MemoryStore>>) {
    let g = Geometry::new(CHUNK * CHUNKS, CHUNK).unwrap();
    let store = Arc::new(Counting::new(MemoryStore::new(g)));
    for i in 0..CHUNKS {
        store
            .write(ChunkIdx(i), Bytes::from(vec![i as u8 | 1; CHUNK as usize]))
            .await
            .unwrap();
    }
    store.reset();
    let server = start(store.clone(), "127.0.0.1:0", opts).await;
    (server, store)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_stops_the_server_reading_its_requests() {
    let opts = ServeOptions {
        idle_timeout: Duration::from_secs(2),
        ..quiet()
    };
    let budget = opts.conn_budget;
    let (server, store) = full_server(opts).await;
    // Pipelines 200 reads of 16 MiB each (3.2 GB of replies) and never reads one.
    let mut attacker = raw_session(tcp(&server)).await;
    let (_rd, mut wr) = attacker.split();
    let requests: usize = 200;
    let send = async {
        for id in 1..=requests as u64 {
            if wr.write_all(&big_read(id)).await.is_err() {
                break;
            }
        }
        std::future::pending::<()>().await
    };
    let watch = async {
        tokio::time::sleep(Duration::from_millis(800)).await;
        // A good client is served meanwhile.
        let good = connect(addr_of(&server), client()).await;
        assert_eq!(good.read(ChunkIdx(5)).await.unwrap()[0], 5 | 1);
        store.counts()
    };
    let counts = tokio::select! {
        c = watch => c,
        _ = send => unreachable!(),
    };
    let reply = CHUNK * BATCH;
    // What the budget lets run: replies in flight or queued, those the socket buffers took,
    // and the good client's one chunk.
    let most = (budget as u64 / reply + 4) * BATCH + 1;
    println!(
        "{} chunk reads ran for {requests} pipelined reads of {reply} bytes (budget {budget} bytes: at most {most})",
        counts.reads
    );
    assert!(
        counts.reads <= most,
        "{} chunk reads ran: the server kept reading requests",
        counts.reads
    );
    drop(attacker);
    let good = connect(addr_of(&server), client()).await;
    assert_eq!(good.read(ChunkIdx(7)).await.unwrap()[0], 7 | 1);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_cut_off_after_the_idle_timeout() {
    let (server, _store) = full_server(ServeOptions {
        idle_timeout: Duration::from_millis(500),
        ..quiet()
    })
    .await;
    let mut attacker = raw_session(tcp(&server)).await;
    for id in 1..=4 {
        attacker.write_all(&big_read(id)).await.unwrap();
    }
    // Not reading for a while: the server's writes stall, then it gives up.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let received = closed_within(&mut attacker, Duration::from_secs(10)).await;
    assert!(
        (received as u64) < 4 * CHUNK * BATCH,
        "the connection was closed before all replies went out ({received} bytes came)"
    );
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_closed_and_busy_ones_are_not() {
    let g = Geometry::new(1 << 20, 4096).unwrap();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(g));
    let server = start(
        store,
        "127.0.0.1:0",
        ServeOptions {
            idle_timeout: Duration::from_millis(300),
            ..quiet()
        },
    )
    .await;
    let mut idle = raw_session(tcp(&server)).await;
    assert_eq!(closed_within(&mut idle, Duration::from_secs(5)).await, 0);
    // A client busy for longer than the idle timeout keeps its connection.
    let busy = connect(addr_of(&server), client()).await;
    for i in 0..20u64 {
        busy.write(ChunkIdx(i), Bytes::from(vec![1; 4096]))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_finishes_the_handshake_is_closed_at_the_deadline() {
    let g = Geometry::new(1 << 20, 4096).unwrap();
    let server = start(
        Arc::new(MemoryStore::new(g)),
        "127.0.0.1:0",
        ServeOptions {
            handshake_timeout: Duration::from_millis(300),
            ..quiet()
        },
    )
    .await;
    let mut silent = TcpStream::connect(tcp(&server)).await.unwrap();
    assert_eq!(closed_within(&mut silent, Duration::from_secs(5)).await, 0);
    // Half a hello, then nothing.
    let mut half = TcpStream::connect(tcp(&server)).await.unwrap();
    let mut out = BytesMut::new();
    ClientHello::current().encode(&mut out);
    half.write_all(&out[..7]).await.unwrap();
    assert_eq!(closed_within(&mut half, Duration::from_secs(5)).await, 0);
    let good = connect(addr_of(&server), client()).await;
    good.read(ChunkIdx(0)).await.unwrap();
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crowds_over_the_connection_limit_are_refused_without_piling_up() {
    let (server, held) = four_held(ServeOptions {
        max_connections: 4,
        handshake_timeout: Duration::from_millis(500),
        ..quiet()
    })
    .await;
    // A crowd that never speaks: each is closed, answered or not.
    let mut crowd = Vec::new();
    for _ in 0..200 {
        crowd.push(TcpStream::connect(tcp(&server)).await.unwrap());
    }
    for s in &mut crowd {
        closed_within(s, Duration::from_secs(10)).await;
    }
    drop(held);
    // Once the slots are free, a good client is served.
    let mut served = None;
    for _ in 0..50 {
        match RemoteStore::connect(addr_of(&server), client()).await {
            Ok(s) => {
                served = Some(s);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let good = served.expect("a good client is served once the crowd is gone");
    good.read(ChunkIdx(1)).await.unwrap();
    server.shutdown().await.unwrap();
}

/// A server of at most four connections, all four taken by fresh sessions; a fifth client is
/// refused (they are too fresh to be closed for it), and told why.
async fn four_held(opts: ServeOptions) -> (Server, Vec<TcpStream>) {
    let g = Geometry::new(1 << 20, 4096).unwrap();
    let server = start(Arc::new(MemoryStore::new(g)), "127.0.0.1:0", opts).await;
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(raw_session(tcp(&server)).await);
    }
    let err = RemoteStore::connect(addr_of(&server), client())
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("limit of 4 connections"),
        "a client over the limit is told why: {err}"
    );
    (server, held)
}

/// Clients that hold every connection slot with an idle connection (a request every few
/// minutes keeps one open) do not keep a new client out: at the limit, the connection idle
/// longest is closed for it. Only when every connection is busy is a newcomer refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_limit_a_new_client_takes_the_place_of_the_connection_idle_longest() {
    let (server, mut held) = four_held(ServeOptions {
        max_connections: 4,
        ..quiet()
    })
    .await;
    tokio::time::sleep(farmap_net::IDLE_TO_EVICT + Duration::from_millis(300)).await;
    let good = RemoteStore::connect(addr_of(&server), client())
        .await
        .expect("a new client takes an idle connection's place");
    good.read(ChunkIdx(1)).await.unwrap();
    // The oldest of the held connections was the one closed.
    let first = &mut held[0];
    closed_within(first, Duration::from_secs(5)).await;
    server.shutdown().await.unwrap();
}
