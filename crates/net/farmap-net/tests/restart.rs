//! A server that restarts under a client: what it may have lost is an error, never zeros or
//! old data read as if nothing happened.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use farmap_core::{ChunkIdx, ErrorKind, Geometry, Store, StoreError};
use farmap_net::{ClientOptions, ListenAddr, Listener, RemoteAddr, RemoteStore, ServeOptions};
use farmap_store::{FileOptions, FileStore, MemoryStore};

async fn serve_at(addr: &ListenAddr, store: Arc<dyn Store>) -> farmap_net::Server {
    let listener = Listener::bind(addr).await.unwrap();
    farmap_net::serve(
        store,
        listener,
        ServeOptions {
            log: false,
            ..ServeOptions::default()
        },
    )
    .unwrap()
}

fn client() -> ClientOptions {
    ClientOptions {
        connections: 2,
        request_timeout: Duration::from_secs(5),
        ..ClientOptions::default()
    }
}

/// Runs `op` until it no longer fails for want of a connection (the pool reconnects in the
/// background): its first other outcome.
async fn once_reconnected<T, F, Fut>(op: F) -> Result<T, StoreError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let start = Instant::now();
    loop {
        match op().await {
            Err(e)
                if matches!(
                    e.kind(),
                    farmap_core::ErrorKind::Unavailable | farmap_core::ErrorKind::Timeout
                ) && start.elapsed() < Duration::from_secs(20) =>
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => return other,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_memory_server_is_an_error_not_zeros() {
    let dir = tempfile::tempdir().unwrap();
    let addr: ListenAddr = format!("unix:{}", dir.path().join("s.sock").display())
        .parse()
        .unwrap();
    let g = Geometry::new(1 << 20, 4096).unwrap();
    let server = serve_at(&addr, Arc::new(MemoryStore::new(g))).await;
    let store = RemoteStore::connect(RemoteAddr::Unix(dir.path().join("s.sock")), client())
        .await
        .unwrap();
    store
        .write(ChunkIdx(1), Bytes::from(vec![7u8; 4096]))
        .await
        .unwrap();
    server.shutdown().await.unwrap();
    // Same place, same shape, a new memory store: what was written is gone.
    let _again = serve_at(&addr, Arc::new(MemoryStore::new(g))).await;
    let e = match once_reconnected(|| store.read(ChunkIdx(1))).await {
        Ok(b) => panic!(
            "read {} bytes (zeros: {}) of a chunk the restart lost: an error was due",
            b.len(),
            b.iter().all(|x| *x == 0)
        ),
        Err(e) => e,
    };
    assert!(e.context().contains("restarted"), "{e}");
    let e = store.flush().await.unwrap_err();
    assert!(
        e.context().contains("restarted"),
        "and it stays failed: {e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_file_server_keeps_what_it_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("region.img");
    let sock = dir.path().join("s.sock");
    let addr: ListenAddr = format!("unix:{}", sock.display()).parse().unwrap();
    // The file's writer lock goes with the last connection task of a dropped server: a
    // restarted one waits for it, as a restarted process would for the old one's exit.
    let file = |size: Option<u64>| -> Arc<dyn Store> {
        let start = Instant::now();
        loop {
            let opts = FileOptions {
                size,
                chunk_size: 4096,
                read_only: false,
            };
            match FileStore::open(&path, opts) {
                Ok(f) => return Arc::new(f),
                Err(e) if e.kind() == ErrorKind::Unavailable && start.elapsed().as_secs() < 5 => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => panic!("{e}"),
            }
        }
    };
    let server = serve_at(&addr, file(Some(1 << 20))).await;
    let store = RemoteStore::connect(RemoteAddr::Unix(sock.clone()), client())
        .await
        .unwrap();
    store
        .write(ChunkIdx(2), Bytes::from(vec![2u8; 4096]))
        .await
        .unwrap();
    drop(server);
    let _again = serve_at(&addr, file(None)).await;
    let back = once_reconnected(|| store.read(ChunkIdx(2))).await.unwrap();
    assert_eq!(back[..], [2u8; 4096][..]);
    store.flush().await.unwrap();
}
