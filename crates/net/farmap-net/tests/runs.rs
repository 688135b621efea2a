//! Run reads: a run of contiguous chunks in one request, zero chunks as bits (no bytes), the
//! others in one piece; with a run reader on the server or chunk by chunk; checked against
//! the region on both sides.

mod common;

use std::sync::Arc;

use bytes::Bytes;
use common::{addr_of, client, quiet};
use farmap_core::{BoxFuture, ChunkIdx, ErrorKind, Geometry, Store, StoreResult};
use farmap_net::{serve_with_runs, Listener, RemoteStore, RunReader};
use farmap_store::MemoryStore;

const CHUNK: u64 = 4096;
const CHUNKS: u64 = 64;

/// Reads runs from a memory store by concatenating its chunks (what a live region does with
/// one copy), counting the runs it was asked for.
#[derive(Debug)]
struct Concat {
    store: Arc<MemoryStore>,
    runs: std::sync::atomic::AtomicU64,
}

impl RunReader for Concat {
    fn read_run(&self, start: ChunkIdx, count: u32) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            self.runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mut out = Vec::new();
            for i in start.0..start.0 + u64::from(count) {
                out.extend_from_slice(&self.store.read(ChunkIdx(i)).await?);
            }
            Ok(Bytes::from(out))
        })
    }
}

/// Chunk `i`: zero when `i % 5 == 1` or `i` in 20..30, else a pattern.
fn content(i: u64) -> Vec<u8> {
    if i % 5 == 1 || (20..30).contains(&i) {
        vec![0; CHUNK as usize]
    } else {
        (0..CHUNK).map(|b| (b as u8) ^ (i as u8) | 1).collect()
    }
}

async fn server(with_reader: bool) -> (farmap_net::Server, Arc<Concat>) {
    let g = Geometry::new(CHUNK * CHUNKS, CHUNK).unwrap();
    let store = Arc::new(MemoryStore::new(g));
    for i in 0..CHUNKS {
        store
            .write(ChunkIdx(i), Bytes::from(content(i)))
            .await
            .unwrap();
    }
    let reader = Arc::new(Concat {
        store: store.clone(),
        runs: Default::default(),
    });
    let listener = Listener::bind(&"127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let runs: Option<Arc<dyn RunReader>> = with_reader.then(|| reader.clone() as _);
    let server = serve_with_runs(store, runs, listener, quiet()).unwrap();
    (server, reader)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_reads_send_zero_chunks_as_bits_and_match_the_region() {
    for with_reader in [true, false] {
        let (server, reader) = server(with_reader).await;
        let remote = RemoteStore::connect(addr_of(&server), client())
            .await
            .unwrap();
        assert!(remote.reads_runs());
        assert!(remote.max_run() >= 1024, "a 16 MiB frame holds 1024+ pages");
        for (start, count) in [(0u64, 64u32), (1, 1), (19, 12), (63, 1), (5, 40)] {
            let run = remote.read_run(ChunkIdx(start), count).await.unwrap();
            assert_eq!(run.count(), count as usize);
            let data = run.data();
            assert_eq!(run.pieces().len(), usize::from(run.data_len() > 0));
            let mut at = 0;
            let mut zeros = 0;
            for k in 0..u64::from(count) {
                let want = content(start + k);
                if run.is_zero(k as usize) {
                    assert!(
                        want.iter().all(|b| *b == 0),
                        "chunk {} is not zero",
                        start + k
                    );
                    zeros += 1;
                } else {
                    assert_eq!(
                        &data[at..at + CHUNK as usize],
                        &want[..],
                        "chunk {}",
                        start + k
                    );
                    at += CHUNK as usize;
                }
            }
            assert_eq!(
                at,
                data.len(),
                "no bytes beyond the chunks that are not zero"
            );
            assert_eq!(
                run.data_len() as u64,
                (u64::from(count) - zeros) * CHUNK,
                "zero chunks cost no bytes"
            );
        }
        let used = reader.runs.load(std::sync::atomic::Ordering::Relaxed);
        if with_reader {
            assert_eq!(used, 5, "every run was read by the run reader in one call");
        } else {
            assert_eq!(used, 0);
        }
        // Past the end, or empty: refused before anything is sent.
        for (start, count) in [(60u64, 5u32), (0, 0), (64, 1)] {
            let e = remote.read_run(ChunkIdx(start), count).await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::OutOfRange, "{start}+{count}: {e}");
        }
        remote.close();
        server.shutdown().await.unwrap();
    }
}

/// `Store::read_chunks` of a remote store: runs in one request each, every chunk whole (zero
/// ones as zeros), the same bytes as chunk-by-chunk reads; a range past the end is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_chunks_reads_a_range_in_runs_and_matches_single_reads() {
    use farmap_core::ChunkRange;
    let (server, reader) = server(true).await;
    let remote = RemoteStore::connect(addr_of(&server), client())
        .await
        .unwrap();
    assert_eq!(Store::chunks_per_read(&remote), remote.max_run());
    for (start, end) in [(0u64, 64u64), (19, 31), (63, 64)] {
        let range = ChunkRange::new(ChunkIdx(start), ChunkIdx(end));
        let got = Store::read_chunks(&remote, range).await.unwrap();
        assert_eq!(got.len() as u64, end - start);
        for (k, data) in got.iter().enumerate() {
            let i = start + k as u64;
            assert_eq!(&data[..], &content(i)[..], "chunk {i}");
            assert_eq!(data[..], remote.read(ChunkIdx(i)).await.unwrap()[..]);
        }
    }
    assert_eq!(
        reader.runs.load(std::sync::atomic::Ordering::Relaxed),
        3,
        "one request a range"
    );
    let past = ChunkRange::new(ChunkIdx(60), ChunkIdx(65));
    let e = Store::read_chunks(&remote, past).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfRange, "{e}");
    remote.close();
    server.shutdown().await.unwrap();
}
