//! The metrics endpoint: a small HTTP/1.1 server that answers `GET /metrics` (and `HEAD`)
//! with the text exposition format, over TCP or TLS, one request per connection.
//!
//! What a peer sends cannot hurt the process: a request head is read into at most
//! [`MAX_HEAD`] bytes (431 past it), a whole exchange (TLS handshake, request, reply) has
//! [`EXCHANGE_TIMEOUT`], at most [`MAX_SCRAPES`] exchanges run at once (the next
//! connections are closed at once), and every reply says `Connection: close`.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::prometheus_text::CONTENT_TYPE;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;

/// What a scrape answers: the exposition now.
pub(crate) type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// The most bytes of a request head (request line and headers) read.
pub const MAX_HEAD: usize = 8 * 1024;
/// The longest a scrape may take, from the accept to the last byte of the reply.
pub const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(10);
/// Scrapes answered at once.
pub const MAX_SCRAPES: usize = 8;
/// After the reply, what the client still sends is read and dropped, up to this much for
/// up to [`LINGER`] (closing with unread bytes would reset the connection and could lose
/// the reply).
const DRAIN: usize = 64 * 1024;
const LINGER: Duration = Duration::from_secs(1);

/// Accepts scrapes on `listener` until the task is aborted.
pub(crate) async fn serve(listener: TcpListener, tls: Option<TlsAcceptor>, render: Render) {
    let slots = Arc::new(Semaphore::new(MAX_SCRAPES));
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors and the like: pause rather than spin.
                tracing::warn!("metrics endpoint: accepting a connection failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::debug!("metrics endpoint: closed {peer}: {MAX_SCRAPES} scrapes in progress");
            continue;
        };
        let tls = tls.clone();
        let render = render.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let exchange = async {
                match tls {
                    Some(acceptor) => answer(acceptor.accept(tcp).await?, &*render).await,
                    None => answer(tcp, &*render).await,
                }
            };
            match tokio::time::timeout(EXCHANGE_TIMEOUT, exchange).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!("metrics endpoint: {peer}: {e}"),
                Err(_) => tracing::debug!(
                    "metrics endpoint: closed {peer}: no complete exchange in {EXCHANGE_TIMEOUT:?}"
                ),
            }
        });
    }
}

/// What came of reading a request head.
enum Head {
    /// The head, without its blank line.
    Complete(Vec<u8>),
    /// More than [`MAX_HEAD`] bytes without the end of a head.
    TooLarge,
    /// The peer closed before a whole head.
    Closed,
}

/// Reads one request head (up to the blank line), in at most [`MAX_HEAD`] bytes.
async fn read_head<S: AsyncRead + Unpin>(s: &mut S) -> io::Result<Head> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    loop {
        let n = s.read(&mut buf).await?;
        if n == 0 {
            return Ok(Head::Closed);
        }
        let from = head.len().saturating_sub(3);
        head.extend_from_slice(&buf[..n]);
        if let Some(end) = head_end(&head[from..]) {
            head.truncate(from + end);
            return Ok(Head::Complete(head));
        }
        if head.len() > MAX_HEAD {
            return Ok(Head::TooLarge);
        }
    }
}

/// Where the blank line that ends a head starts (CRLF CRLF, or LF LF from lax clients).
fn head_end(bytes: &[u8]) -> Option<usize> {
    let crlf = bytes.windows(4).position(|w| w == b"\r\n\r\n");
    let lf = bytes.windows(2).position(|w| w == b"\n\n");
    crlf.into_iter().chain(lf).min()
}

/// A reply: status, extra header lines, body, and whether the body is sent (not for HEAD).
struct Reply {
    status: &'static str,
    headers: &'static str,
    body: String,
    send_body: bool,
}

impl Reply {
    fn plain(status: &'static str, headers: &'static str, body: &str) -> Reply {
        Reply {
            status,
            headers,
            body: format!("{body}\n"),
            send_body: true,
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let content_type = if self.status.starts_with("200") {
            CONTENT_TYPE
        } else {
            "text/plain; charset=utf-8"
        };
        let mut out = format!(
            "HTTP/1.1 {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
             Connection: close\r\n{}\r\n",
            self.status,
            self.body.len(),
            self.headers,
        )
        .into_bytes();
        if self.send_body {
            out.extend_from_slice(self.body.as_bytes());
        }
        out
    }
}

/// The reply to a request whose head is `head`.
fn route(head: &[u8], render: &(dyn Fn() -> String + Send + Sync)) -> Reply {
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_ascii_whitespace();
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Reply::plain("400 Bad Request", "", "not an HTTP request line");
    };
    if !version.starts_with("HTTP/1.") {
        return Reply::plain("400 Bad Request", "", "HTTP/1.x only");
    }
    let path = target.split('?').next().unwrap_or_default();
    if path != "/metrics" {
        return Reply::plain("404 Not Found", "", "metrics are at /metrics");
    }
    if method != "GET" && method != "HEAD" {
        return Reply::plain(
            "405 Method Not Allowed",
            "Allow: GET, HEAD\r\n",
            "GET /metrics",
        );
    }
    Reply {
        status: "200 OK",
        headers: "",
        body: render(),
        send_body: method == "GET",
    }
}

/// Reads one request on `s` and answers it, then closes.
async fn answer<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    render: &(dyn Fn() -> String + Send + Sync),
) -> io::Result<()> {
    let reply = match read_head(&mut s).await? {
        Head::Closed => return Ok(()),
        Head::TooLarge => Reply::plain(
            "431 Request Header Fields Too Large",
            "",
            "the request head is over 8 KiB",
        ),
        Head::Complete(head) => route(&head, render),
    };
    s.write_all(&reply.bytes()).await?;
    s.shutdown().await?;
    let mut left = DRAIN;
    let mut sink = [0u8; 4096];
    let _ = tokio::time::timeout(LINGER, async {
        while left > 0 {
            match s.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    })
    .await;
    Ok(())
}

/// The URL scrapers use for an endpoint on `addr`.
pub(crate) fn url(addr: SocketAddr, tls: bool) -> String {
    format!("{}://{addr}/metrics", if tls { "https" } else { "http" })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply_to(request: &str) -> String {
        String::from_utf8(route(request.as_bytes(), &|| "x 1\n".to_owned()).bytes()).unwrap()
    }

    #[test]
    fn routes_by_path_then_method() {
        assert!(reply_to("GET /metrics HTTP/1.1\r\nHost: x").starts_with("HTTP/1.1 200 OK"));
        assert!(reply_to("GET /metrics?x=1 HTTP/1.0").starts_with("HTTP/1.1 200 OK"));
        let head = reply_to("HEAD /metrics HTTP/1.1");
        assert!(
            head.starts_with("HTTP/1.1 200 OK") && head.ends_with("\r\n\r\n"),
            "{head}"
        );
        assert!(reply_to("GET / HTTP/1.1").starts_with("HTTP/1.1 404"));
        assert!(reply_to("POST /metrics HTTP/1.1").starts_with("HTTP/1.1 405"));
        assert!(reply_to("POST /metrics HTTP/1.1").contains("Allow: GET, HEAD\r\n"));
        assert!(reply_to("GET /metrics SPDY/3").starts_with("HTTP/1.1 400"));
        assert!(reply_to("\u{0}\u{1}garbage").starts_with("HTTP/1.1 400"));
        assert!(reply_to("GET /metrics HTTP/1.1").contains("Connection: close\r\n"));
    }

    #[test]
    fn a_head_ends_at_its_blank_line() {
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nA: b\r\n\r\nbody"), Some(20));
        assert_eq!(head_end(b"GET / HTTP/1.1\n\n"), Some(14));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nA: b\r\n"), None);
    }

    #[tokio::test]
    async fn an_endless_head_is_cut_at_the_cap() {
        let (mut client, mut server) = tokio::io::duplex(64 * 1024);
        let writer = tokio::spawn(async move {
            let line = b"X-Filler: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n";
            for _ in 0..1000 {
                if client.write_all(line).await.is_err() {
                    break;
                }
            }
        });
        assert!(matches!(
            read_head(&mut server).await.unwrap(),
            Head::TooLarge
        ));
        drop(server);
        writer.await.unwrap();
    }
}
