//! farmap's HTTP store: a file on any web server as a read-only region, one range request
//! per chunk (r3map's "remote file via HTTP range requests").
//!
//! ```text
//! https://HOST[:PORT]/PATH?chunk=1MiB&size=SIZE&connections=N&timeout=DURATION&retries=N
//! ```
//!
//! # Reads
//! - [`HttpStore::open`] sends one `GET` with `Range: bytes=0-0`: the answer's
//!   `Content-Range` gives the file's size (the region's size; a `size=` in the spec must be
//!   the same), and its validator (a strong `ETag`, else `Last-Modified`) is remembered.
//! - Chunk `i` is one `GET` with `Range: bytes=START-END`. The last chunk is shorter when the
//!   size is not a multiple of the chunk size (as for a `file:` store); `read_part` asks for
//!   the part only.
//! - Every answer is checked before its body is read: status `206`, a `Content-Range` that is
//!   exactly the range asked for within a file of the size seen at open, a `Content-Length`
//!   (if any) of the range's length. The body is read up to that length: a server that sends
//!   more (or less) is refused, so a peer never makes the store hold more than one chunk.
//! - A server that ignores `Range` (it answers `200` with the whole file) is refused
//!   ([`Unsupported`](farmap_core::ErrorKind::Unsupported)) unless the whole file is what was
//!   asked for (a file of one chunk): the body is never read, so a gigabyte file is not
//!   downloaded to find out.
//!
//! # Consistency
//! Every request carries `If-Match: ETAG` (or `If-Unmodified-Since: LAST-MODIFIED` when the
//! server gives no strong `ETag`), and the answer's own validator must match the one seen at
//! open. A file that changed on the server is therefore an error
//! ([`Corrupt`](farmap_core::ErrorKind::Corrupt), "changed on the server since it was
//! opened"), never a chunk of new data next to chunks of old data. A server that sends neither
//! validator cannot be checked: the store opens with a warning, and only the size is checked.
//!
//! # Writes
//! None: `write` and `trim` fail with [`ReadOnly`](farmap_core::ErrorKind::ReadOnly);
//! `flush` has nothing to do.
//!
//! # Connections, retries, timeouts
//! - At most `connections=` requests (default [`DEFAULT_CONNECTIONS`]) are in flight, over an
//!   HTTP/1.1 connection pool of as many idle connections (TCP_NODELAY on).
//! - A request that fails with a 5xx status, 429, a connection error, a body cut short or a
//!   timeout is retried with exponential backoff (50 ms, doubling, at most 2 s, with jitter),
//!   at most `retries=` times (default [`DEFAULT_RETRIES`]) and for at most [`RETRY_TOTAL`];
//!   the first request of [`HttpStore::open`] at most twice, so that a wrong address is
//!   reported quickly.
//! - `timeout=` bounds each request, body included (default [`DEFAULT_TIMEOUT`]); connecting
//!   is bounded by 5 s.
//! - No HTTP proxy (`HTTP_PROXY` is ignored); no compression (`Accept-Encoding: identity`);
//!   at most 5 redirects. `https://` uses rustls (ring) and the system's root certificates.
//! - Credentials in the URL (`http://user:pass@host/`) are refused: a spec is printed and
//!   logged.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod answer;
mod client;
mod location;
mod store;

pub use location::{HttpLocation, HttpSpecError, MAX_CONNECTIONS, MAX_RETRIES, OPTIONS};
pub use store::{
    HttpOptions, HttpStore, DEFAULT_CONNECTIONS, DEFAULT_RETRIES, DEFAULT_TIMEOUT, RETRY_TOTAL,
};
