//! `farmap serve --grpc` under attack, run for real with tonic clients: connections whose
//! HTTP/2 windows stay at 64 KiB open read calls of two 1 MiB chunks each, read the reply's
//! headers and never its body, and open more as calls are answered or refused. The server's
//! resident memory (`VmRSS`) stays within `--max-memory` plus a fixed overhead, a good
//! client keeps at least half its unloaded rate, and SIGTERM stops the server within seconds.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use farmap::{ChunkIdx, Store};
use farmap_grpc::pb;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Endpoint;
use tonic::Request;

mod common;
use common::hostile::{assert_peak_within, big_file, keeps_half_rate, serve_with_budget};

const MIB: u64 = 1 << 20;
const CHUNK: u64 = MIB;

fn pattern(idx: u64) -> u8 {
    (idx as u8) | 1
}

/// `rounds` of 20 single-chunk reads of the first 16 chunks, each checked; the time of each.
/// (The attackers read chunks 16 to 63: all 64 hold data, as a hole would cost nothing.)
async fn good_rounds(url: &str, rounds: usize) -> Vec<Duration> {
    let good = farmap_grpc::GrpcStore::connect(url)
        .await
        .expect("the good client connects");
    let mut took = Vec::new();
    for round in 0..rounds {
        let t = Instant::now();
        for i in 0..20u64 {
            let idx = (round as u64 * 20 + i) * 7 % 16;
            let chunk = good
                .read(ChunkIdx(idx))
                .await
                .unwrap_or_else(|e| panic!("a good read of chunk {idx} failed: {e}"));
            assert_eq!(chunk.len() as u64, CHUNK);
            assert!(chunk.iter().all(|b| *b == pattern(idx)), "chunk {idx}");
        }
        took.push(t.elapsed());
    }
    took
}

/// The good client's median round over 8 s, noting the server's VmRSS in `peak`.
async fn attacked_window(url: &str, server: u32, peak: &mut u64) -> Duration {
    let start = Instant::now();
    let mut rounds = Vec::new();
    while start.elapsed() < Duration::from_secs(8) {
        rounds.extend(good_rounds(url, 1).await);
        *peak = (*peak).max(farmap_testkit::process::rss_bytes(server));
    }
    median(rounds)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// One attacking connection: `calls` loops, each opening read calls one after the other and
/// keeping every answered one unread. Counts the calls answered and refused.
async fn attacker(url: String, calls: usize, stop: Arc<AtomicBool>, counts: Arc<[AtomicU64; 2]>) {
    let stingy = Endpoint::from_shared(url)
        .expect("url")
        .initial_stream_window_size(65_535)
        .initial_connection_window_size(65_535);
    let channel = stingy.connect().await.expect("an attacker connects");
    let mut loops = Vec::new();
    for l in 0..calls {
        let (channel, stop, counts) = (channel.clone(), stop.clone(), counts.clone());
        loops.push(tokio::spawn(async move {
            let mut unread = Vec::new();
            let mut n = l as u64;
            while !stop.load(Ordering::Relaxed) {
                let mut grpc = tonic::client::Grpc::new(channel.clone());
                if grpc.ready().await.is_err() {
                    return unread.len();
                }
                let first = 16 + n % 24 * 2;
                n += 1;
                let request = pb::ReadRequest {
                    chunks: vec![first, first + 1],
                };
                // The unary method, called as a stream: the reply's body stays unread.
                let call = grpc.server_streaming::<_, pb::ReadReply, _>(
                    Request::new(request),
                    PathAndQuery::from_static("/farmap.v1.Store/Read"),
                    tonic_prost::ProstCodec::default(),
                );
                match tokio::time::timeout(Duration::from_secs(1), call).await {
                    Ok(Ok(reply)) => {
                        counts[0].fetch_add(1, Ordering::Relaxed);
                        unread.push(reply);
                    }
                    Ok(Err(_)) => {
                        counts[1].fetch_add(1, Ordering::Relaxed);
                    }
                    // Waiting for memory: ask again (the call is dropped, as a client would).
                    Err(_) => {}
                }
            }
            unread.len()
        }));
    }
    for l in loops {
        let _ = l.await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_never_read_keep_the_grpc_server_in_its_budget_and_the_good_client_at_half_its_rate(
) {
    // Allowance beside --max-memory: the process itself (runtime, threads, the binary) and
    // one reserve per connection (a read of two 1 MiB chunks each, about eight connections).
    const MAX_MEMORY: u64 = 64 * MIB;
    const OVERHEAD: u64 = 96 * MIB;
    const ATTACKERS: usize = 4;
    let dir = tempfile::tempdir().unwrap();
    let path = big_file(dir.path(), 1024 * MIB, 64 * CHUNK, CHUNK as usize, |at| {
        pattern(at / CHUNK)
    });
    let spec = format!("file:{}?chunk=1MiB", path.display());
    let server = serve_with_budget("--grpc", &spec, MAX_MEMORY);
    let url = format!("http://{}", server.addr());
    let base = farmap_testkit::process::rss_bytes(server.id());
    // The good client's rate alone: the median of five rounds of 20 reads.
    let alone = median(good_rounds(&url, 5).await);

    let stop = Arc::new(AtomicBool::new(false));
    let counts = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
    let attackers: Vec<_> = (0..ATTACKERS)
        .map(|_| tokio::spawn(attacker(url.clone(), 64, stop.clone(), counts.clone())))
        .collect();
    // Let the attack fill the budget first.
    let start = Instant::now();
    while counts[0].load(Ordering::Relaxed) < MAX_MEMORY / (2 * CHUNK)
        && start.elapsed() < Duration::from_secs(10)
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut peak = farmap_testkit::process::rss_bytes(server.id());
    let mut attacked = attacked_window(&url, server.id(), &mut peak).await;
    if !keeps_half_rate(alone, attacked) {
        // One more window: a busy host can slow a window down; a server that starves the
        // good client slows both.
        println!("the first window's median was {attacked:?} ({alone:?} alone): once more");
        attacked = attacked.min(attacked_window(&url, server.id(), &mut peak).await);
    }
    peak = peak.max(farmap_testkit::process::rss_bytes(server.id()));
    let (answered, refused) = (
        counts[0].load(Ordering::Relaxed),
        counts[1].load(Ordering::Relaxed),
    );
    println!(
        "farmap serve --grpc VmRSS {} MiB at start, peak {} MiB under {ATTACKERS} clients that \
         never read (--max-memory {} MiB); {answered} of their calls answered (2 MiB each, \
         unread), {refused} refused; 20 good reads took {alone:?} alone, {attacked:?} under \
         attack",
        base / MIB,
        peak / MIB,
        MAX_MEMORY / MIB,
    );
    assert!(
        answered * 2 * CHUNK >= MAX_MEMORY / 2,
        "the attackers held memory: {answered} calls answered"
    );
    assert_peak_within(peak, MAX_MEMORY, OVERHEAD);
    // At least half its unloaded rate (the bar): a connection's own reserve serves
    // its single-chunk calls whatever the others hold, and the store's work is shared out
    // between connections. (20 ms of slack: a round takes milliseconds, and hosts are noisy.)
    assert!(
        keeps_half_rate(alone, attacked),
        "20 good reads took {attacked:?} under attack, {alone:?} alone"
    );

    // Told to stop with the attackers still connected and unread: their connections are
    // closed once no reply has moved for a second (it took the whole 10 s grace before).
    let t = Instant::now();
    let (status, _) = server.stop("TERM");
    let took = t.elapsed();
    stop.store(true, Ordering::Relaxed);
    for a in attackers {
        let _ = tokio::time::timeout(Duration::from_secs(5), a).await;
    }
    println!("stopped in {took:?} ({status})");
    assert!(
        took < Duration::from_secs(5),
        "SIGTERM took {took:?} to stop the server"
    );
}
