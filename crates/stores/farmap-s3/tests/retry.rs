//! Retries against a real MinIO behind a shim that answers chosen requests with an error
//! status (503 SlowDown, 500 InternalError...) and forwards the others unchanged.

mod common;

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use common::{env_of, fresh_prefix, location, minio, open_with};
use farmap_core::{error_chain, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, Store};
use tokio::io::{
    AsyncBufRead, AsyncBufReadExt, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader,
};
use tokio::net::{TcpListener, TcpStream};

/// Largest request or response head the shim reads.
const MAX_HEAD: usize = 64 * 1024;

/// An HTTP/1.1 shim in front of `upstream`: each request takes the next failure queued (if
/// any) and is answered with it; the others are forwarded byte for byte (so signatures stay
/// valid) over one upstream connection per client connection.
struct Shim {
    addr: SocketAddr,
    failures: Arc<Mutex<VecDeque<(u16, &'static str)>>>,
    refused: Arc<AtomicUsize>,
    forwarded: Arc<AtomicUsize>,
}

impl Shim {
    async fn start(upstream: SocketAddr) -> Shim {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let shim = Shim {
            addr: listener.local_addr().unwrap(),
            failures: Default::default(),
            refused: Default::default(),
            forwarded: Default::default(),
        };
        let (failures, refused, forwarded) = (
            shim.failures.clone(),
            shim.refused.clone(),
            shim.forwarded.clone(),
        );
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let (failures, refused, forwarded) =
                    (failures.clone(), refused.clone(), forwarded.clone());
                tokio::spawn(async move {
                    // A connection the client drops ends here; nothing to report.
                    let _ = serve(conn, upstream, failures, refused, forwarded).await;
                });
            }
        });
        shim
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn fail_next(&self, failures: &[(u16, &'static str)]) {
        self.failures
            .lock()
            .unwrap()
            .extend(failures.iter().copied());
    }

    fn refused(&self) -> usize {
        self.refused.load(Ordering::SeqCst)
    }

    /// The refusal count once it has reached `n` (the shim counts a refusal after writing
    /// it, so the client can see the answer first), or what it is after 2 s.
    async fn refused_reaching(&self, n: usize) -> usize {
        for _ in 0..200 {
            if self.refused() >= n {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        self.refused()
    }
}

/// Reads one message head (through the empty line), or `None` at a clean end of stream.
async fn read_head<R: AsyncBufRead + Unpin>(r: &mut R) -> io::Result<Option<Vec<u8>>> {
    let mut head = Vec::new();
    loop {
        let n = r.read_until(b'\n', &mut head).await?;
        if n == 0 {
            return if head.is_empty() {
                Ok(None)
            } else {
                Err(io::ErrorKind::UnexpectedEof.into())
            };
        }
        if head.len() > MAX_HEAD {
            return Err(io::Error::other("head too long"));
        }
        if head.ends_with(b"\r\n\r\n") || head == b"\r\n" {
            return Ok(Some(head));
        }
    }
}

fn header(head: &[u8], name: &str) -> Option<String> {
    String::from_utf8_lossy(head).lines().skip(1).find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case(name)
            .then(|| v.trim().to_owned())
    })
}

/// Copies the body that follows `head`: Content-Length, chunked, or else none for a request
/// and up to the end of the stream for a response.
async fn copy_body<R, W>(r: &mut R, w: &mut W, head: &[u8], no_body: bool) -> io::Result<()>
where
    R: AsyncBufRead + Unpin,
    W: AsyncWrite + Unpin,
{
    if no_body {
        return Ok(());
    }
    if let Some(len) = header(head, "content-length") {
        let len: u64 = len.parse().map_err(io::Error::other)?;
        let copied = tokio::io::copy(&mut r.take(len), w).await?;
        if copied != len {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        return Ok(());
    }
    if header(head, "transfer-encoding").is_some_and(|t| t.eq_ignore_ascii_case("chunked")) {
        loop {
            let mut line = Vec::new();
            r.read_until(b'\n', &mut line).await?;
            w.write_all(&line).await?;
            let text = String::from_utf8_lossy(&line);
            let size = u64::from_str_radix(text.trim().split(';').next().unwrap_or(""), 16)
                .map_err(io::Error::other)?;
            if size == 0 {
                // Trailers, through the empty line.
                loop {
                    let mut t = Vec::new();
                    if r.read_until(b'\n', &mut t).await? == 0 {
                        return Err(io::ErrorKind::UnexpectedEof.into());
                    }
                    w.write_all(&t).await?;
                    if t == b"\r\n" {
                        return Ok(());
                    }
                }
            }
            tokio::io::copy(&mut r.take(size + 2), w).await?;
        }
    }
    if head.starts_with(b"HTTP/") {
        tokio::io::copy(r, w).await?;
    }
    Ok(())
}

async fn serve(
    conn: TcpStream,
    upstream: SocketAddr,
    failures: Arc<Mutex<VecDeque<(u16, &'static str)>>>,
    refused: Arc<AtomicUsize>,
    forwarded: Arc<AtomicUsize>,
) -> io::Result<()> {
    conn.set_nodelay(true)?;
    let (cr, mut cw) = conn.into_split();
    let mut cr = BufReader::new(cr);
    let mut up: Option<(BufReader<tokio::net::tcp::OwnedReadHalf>, _)> = None;
    while let Some(head) = read_head(&mut cr).await? {
        let is_head = head.starts_with(b"HEAD ");
        let failure = failures.lock().unwrap().pop_front();
        if let Some((status, code)) = failure {
            copy_body(&mut cr, &mut tokio::io::sink(), &head, false).await?;
            let body = format!(
                "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code>\
                 <Message>injected by the test shim</Message><RequestId>1</RequestId></Error>"
            );
            let reply = format!(
                "HTTP/1.1 {status} Injected\r\nContent-Type: application/xml\r\n\
                 Content-Length: {}\r\n\r\n{}",
                if is_head { 0 } else { body.len() },
                if is_head { "" } else { body.as_str() }
            );
            // Counted before the client can see it, so a test that saw the error sees the count.
            refused.fetch_add(1, Ordering::SeqCst);
            cw.write_all(reply.as_bytes()).await?;
            continue;
        }
        if up.is_none() {
            let s = TcpStream::connect(upstream).await?;
            s.set_nodelay(true)?;
            let (r, w) = s.into_split();
            up = Some((BufReader::new(r), w));
        }
        let (ur, uw) = up.as_mut().expect("connected");
        uw.write_all(&head).await?;
        copy_body(&mut cr, uw, &head, false).await?;
        let reply = read_head(ur).await?.ok_or(io::ErrorKind::UnexpectedEof)?;
        cw.write_all(&reply).await?;
        let status: u16 = String::from_utf8_lossy(&reply)
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let no_body = is_head || status == 204 || status == 304 || (100..200).contains(&status);
        copy_body(ur, &mut cw, &reply, no_body).await?;
        forwarded.fetch_add(1, Ordering::SeqCst);
    }
    Ok(())
}

fn upstream_of(svc: &farmap_testkit::Service) -> SocketAddr {
    format!("127.0.0.1:{}", svc.var("PORT")).parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttling_and_server_errors_are_retried() {
    let Some(svc) = minio("throttling_and_server_errors_are_retried") else {
        return;
    };
    let shim = Shim::start(upstream_of(svc)).await;
    let g = Geometry::new(8 * 4096, 4096).unwrap();
    let loc = location(svc, &shim.endpoint(), &fresh_prefix("retry"));
    let s = open_with(loc, Some(g), false, &env_of(svc)).await.unwrap();
    assert!(
        shim.forwarded.load(Ordering::SeqCst) >= 1,
        "the open went through the shim"
    );

    let data = Bytes::from(vec![5u8; 4096]);
    shim.fail_next(&[(503, "SlowDown"), (500, "InternalError"), (503, "SlowDown")]);
    s.write(ChunkIdx(3), data.clone())
        .await
        .expect("a write retried past 3 failures");
    assert_eq!(shim.refused_reaching(3).await, 3);
    shim.fail_next(&[(503, "SlowDown"), (502, "BadGateway")]);
    assert_eq!(s.read(ChunkIdx(3)).await.expect("read"), data);
    assert_eq!(shim.refused(), 5);
    shim.fail_next(&[(503, "SlowDown")]);
    assert_eq!(
        s.status(ChunkIdx(3)).await.expect("status"),
        ChunkStatus::Data
    );
    shim.fail_next(&[(429, "SlowDown"), (503, "SlowDown")]);
    s.trim(ChunkRange::new(ChunkIdx(2), ChunkIdx(4)))
        .await
        .expect("trim");
    assert_eq!(shim.refused(), 8);
    assert_eq!(s.status(ChunkIdx(3)).await.unwrap(), ChunkStatus::Zero);
    assert!(shim.failures.lock().unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_are_bounded_and_the_error_says_what_the_server_answered() {
    let Some(svc) = minio("retries_are_bounded_and_the_error_says_what_the_server_answered") else {
        return;
    };
    let shim = Shim::start(upstream_of(svc)).await;
    let g = Geometry::new(8 * 4096, 4096).unwrap();
    let mut loc = location(svc, &shim.endpoint(), &fresh_prefix("bounded"));
    loc.set("retries", "2").unwrap();
    let s = open_with(loc, Some(g), false, &env_of(svc)).await.unwrap();
    shim.fail_next(&[(503, "SlowDown"); 10]);
    let e = s.read(ChunkIdx(0)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{}", error_chain(&e));
    let msg = e.to_string();
    assert!(
        msg.contains("reading chunk 0")
            && msg.contains("answered 503 SlowDown and still did after 2 retries"),
        "{msg}"
    );
    assert!(e.is_retryable());
    // The first try and exactly two retries.
    assert_eq!(shim.refused(), 3);
    // Once the server recovers the store works again.
    shim.failures.lock().unwrap().clear();
    s.write(ChunkIdx(0), Bytes::from(vec![1u8; 4096]))
        .await
        .unwrap();
    assert_eq!(s.read(ChunkIdx(0)).await.unwrap()[0], 1);
    // A client error is not retried.
    shim.fail_next(&[(400, "InvalidRequest"), (503, "SlowDown")]);
    let e = s.read(ChunkIdx(0)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Io, "{}", error_chain(&e));
    assert_eq!(shim.refused_reaching(4).await, 4);
    shim.failures.lock().unwrap().clear();
}
