//! The store against a tiny in-test HTTP server that answers canned responses (a raw
//! `TcpListener`): servers that ignore `Range`, send more than asked, change the file, fail
//! for a while.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use farmap_core::{ChunkIdx, ErrorKind, Store};
use farmap_http::{HttpLocation, HttpOptions, HttpStore};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// What the server answers to the request numbered `n` (from 0) with headers `req`: the
/// head (status line and headers, without the blank line) and how many body bytes follow
/// (pattern bytes `i as u8`).
type Answer = Box<dyn Fn(usize, &str) -> (String, usize) + Send + Sync>;

/// Serves `answer` on a fresh port; returns the file's URL and the bytes of body written.
async fn serve(answer: Answer) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let sent = Arc::new(AtomicUsize::new(0));
    let counter = Arc::new(AtomicUsize::new(0));
    let answer = Arc::new(answer);
    let total = sent.clone();
    tokio::spawn(async move {
        loop {
            let (mut conn, _) = listener.accept().await.unwrap();
            let (answer, counter, total) = (answer.clone(), counter.clone(), total.clone());
            tokio::spawn(async move {
                let mut req = Vec::new();
                let mut buf = [0u8; 4096];
                while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => req.extend_from_slice(&buf[..n]),
                    }
                }
                let n = counter.fetch_add(1, Ordering::SeqCst);
                let (head, body) = answer(n, &String::from_utf8_lossy(&req).to_lowercase());
                let head = format!("{head}\r\nConnection: close\r\n\r\n");
                if conn.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let block: Vec<u8> = (0..65536u32).map(|i| i as u8).collect();
                let mut left = body;
                while left > 0 {
                    let k = left.min(block.len());
                    if conn.write_all(&block[..k]).await.is_err() {
                        return;
                    }
                    total.fetch_add(k, Ordering::SeqCst);
                    left -= k;
                }
            });
        }
    });
    (format!("http://{addr}/file.img"), sent)
}

fn options(url: &str) -> HttpOptions {
    let mut location = HttpLocation::parse("http", url.strip_prefix("http:").unwrap()).unwrap();
    location.set("retries", "3").unwrap();
    location.set("timeout", "5s").unwrap();
    HttpOptions {
        location,
        size: None,
        chunk_size: Some(4096),
    }
}

/// `bytes=a-b` of a request.
fn range_of(req: &str) -> (u64, u64) {
    let at = req.find("range: bytes=").unwrap() + "range: bytes=".len();
    let end = req[at..].find('\r').unwrap();
    let (a, b) = req[at..at + end].split_once('-').unwrap();
    (a.parse().unwrap(), b.parse().unwrap())
}

/// A well-behaved answer for a file of `size` bytes with ETag `"v1"`.
fn partial(req: &str, size: u64) -> (String, usize) {
    let (a, b) = range_of(req);
    let b = b.min(size - 1);
    (
        format!(
            "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {a}-{b}/{size}\r\n\
             Content-Length: {}\r\nETag: \"v1\"",
            b - a + 1
        ),
        (b - a + 1) as usize,
    )
}

#[tokio::test]
async fn a_server_that_ignores_range_is_refused_without_downloading_the_file() {
    // A 1 GiB file, answered whole to every request.
    let size: u64 = 1 << 30;
    let (url, sent) = serve(Box::new(move |_, _| {
        (
            format!("HTTP/1.1 200 OK\r\nContent-Length: {size}\r\nETag: \"v1\""),
            size as usize,
        )
    }))
    .await;
    let began = Instant::now();
    let err = HttpStore::open(options(&url)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
    assert!(err.to_string().contains("ignores Range"), "{err}");
    assert!(
        began.elapsed() < Duration::from_secs(5),
        "it took {:?}",
        began.elapsed()
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    let sent = sent.load(Ordering::SeqCst);
    assert!(sent < 64 << 20, "the server got to send {sent} bytes");
}

#[tokio::test]
async fn a_file_of_one_chunk_is_read_from_a_server_that_ignores_range() {
    let size = 3000;
    let (url, _) = serve(Box::new(move |_, _| {
        (
            format!("HTTP/1.1 200 OK\r\nContent-Length: {size}\r\nETag: \"v1\""),
            size,
        )
    }))
    .await;
    let store = HttpStore::open(options(&url)).await.unwrap();
    assert_eq!(store.geometry().size(), 3000);
    let data = store.read(ChunkIdx(0)).await.unwrap();
    let want: Vec<u8> = (0..3000u32).map(|i| i as u8).collect();
    assert!(data[..] == want[..]);
}

#[tokio::test]
async fn a_body_longer_than_the_range_is_refused_at_the_cap() {
    let size = 1 << 20;
    // Honest headers at open; then 206s that announce no length and send 1 MiB for 4 KiB.
    let (url, _) = serve(Box::new(move |n, req| {
        if n == 0 {
            return partial(req, size);
        }
        let (a, b) = range_of(req);
        (
            format!("HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {a}-{b}/{size}"),
            1 << 20,
        )
    }))
    .await;
    let store = HttpStore::open(options(&url)).await.unwrap();
    let err = store.read(ChunkIdx(1)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    assert!(
        err.to_string().contains("more than the 4096 bytes"),
        "{err}"
    );
}

#[tokio::test]
async fn a_changed_file_and_a_missing_file_are_errors_that_say_so() {
    let size = 100_000;
    let (url, _) = serve(Box::new(move |n, req| {
        if req.contains("get /missing") {
            return ("HTTP/1.1 404 Not Found\r\nContent-Length: 0".into(), 0);
        }
        if n < 2 {
            return partial(req, size);
        }
        // From the third request on, the file has a new version.
        let (head, len) = partial(req, size);
        (head.replace("\"v1\"", "\"v2\""), len)
    }))
    .await;
    let store = HttpStore::open(options(&url)).await.unwrap();
    assert_eq!(store.read(ChunkIdx(0)).await.unwrap().len(), 4096);
    let err = store.read(ChunkIdx(1)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    assert!(err.to_string().contains("changed on the server"), "{err}");
    let missing = url.replace("file.img", "missing");
    let err = HttpStore::open(options(&missing)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    assert!(err.to_string().contains("no such file"), "{err}");
}

#[tokio::test]
async fn a_server_that_fails_for_a_while_is_retried() {
    let size = 50_000;
    let (url, _) = serve(Box::new(move |n, req| {
        if n == 1 || n == 2 {
            return (
                "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0".into(),
                0,
            );
        }
        partial(req, size)
    }))
    .await;
    let store = HttpStore::open(options(&url)).await.unwrap();
    let data = store.read(ChunkIdx(12)).await.unwrap();
    assert_eq!(data.len(), 50_000 - 12 * 4096, "the short last chunk");
}
