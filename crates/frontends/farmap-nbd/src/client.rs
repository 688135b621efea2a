//! NBD as a store: any NBD server's export (nbdkit, qemu-nbd, farmap's own server) as a
//! farmap [`Store`].
//!
//! ```text
//!  NbdStore (&self, Store) ── chunk → requests of at most the server's maximum payload
//!   ├─ connection 1: handshake (OPT_GO, structured replies, base:allocation, STARTTLS)
//!   │                writer task ──▶ server ──▶ reader task (replies matched by cookie)
//!   └─ connection 2..N (only when the server offers CAN_MULTI_CONN)
//! ```
//!
//! - The export's size is the region size; the chunk size is asked for (a power of two from
//!   4 KiB to 4 MiB, default 64 KiB or the server's preferred block size if larger) and must
//!   be a multiple of the server's minimum block size. A chunk larger than the server's
//!   maximum payload is read and written in several requests.
//! - `read` uses structured replies when the server has them (holes arrive as
//!   `OFFSET_HOLE`, never as bytes); `write` is `NBD_CMD_WRITE`.
//! - `flush` is `NBD_CMD_FLUSH` when the server offers `SEND_FLUSH`; when it does not,
//!   `flush` does nothing and the store does not claim [`Caps::FLUSH`] (the server's writes
//!   are as durable as it makes them).
//! - `trim` is `NBD_CMD_WRITE_ZEROES` (which may punch holes) when the server offers it,
//!   else zero chunks are written: either way the chunks read as zeros afterwards, which
//!   `NBD_CMD_TRIM` alone does not promise.
//! - `status` asks `NBD_CMD_BLOCK_STATUS` for `base:allocation` when the server supports
//!   it (then the store claims [`Caps::STATUS`]); otherwise it answers `Unknown`.
//! - Several connections are used only when the server offers `CAN_MULTI_CONN` (a flush on
//!   one then covers writes completed on all); requests go round-robin to them.
//! - A connection that dies (closed by the server, a protocol violation, a request not
//!   answered within the timeout) fails every request in flight on it with an error naming
//!   the server and the request. The store's [`Pool`] opens it again
//!   in the background, with backoff; a new connection must show the same export (size and
//!   flags). While no connection is open and a reconnect has failed, requests fail at once
//!   with that reconnect's error (a retry stage above decides whether to wait).

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use farmap_core::{
    zero_chunk, BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, Store,
    StoreError, StoreResult, DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE,
};
use farmap_nbd_proto::consts::{tflag, DEFAULT_MAX_PAYLOAD, STATE_ZERO};
use farmap_nbd_proto::{Command, ExportDetails, Extent};
use farmap_net::pool::{self, Link, Pool, PoolOptions};
use farmap_net::{reconnect_policy, RemoteAddr, TlsClientConfig};
use futures::future::try_join_all;
use tokio::time::Instant;

use crate::client_conn::{open, Answer, Conn, Dial, Request, TlsSetup};

/// The port NBD servers listen on unless told otherwise.
pub const NBD_PORT: u16 = 10809;

/// Which export of which NBD server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdTarget {
    /// The server: `host:port` or a Unix socket.
    pub addr: RemoteAddr,
    /// The export's name (`""`: the server's default export).
    pub export: String,
    /// TLS by `NBD_OPT_STARTTLS` (`nbds://`): the CA that signed the server's certificate,
    /// and a client certificate and key for servers that ask for one.
    pub tls: Option<TlsClientConfig>,
}

impl NbdTarget {
    /// The target as an NBD URI (`nbd://host:port/export`, `nbds+unix:///export?socket=...`),
    /// for messages.
    pub fn uri(&self) -> String {
        let s = if self.tls.is_some() { "s" } else { "" };
        let export = encode_export(&self.export);
        match &self.addr {
            RemoteAddr::Tcp(hp) => format!("nbd{s}://{hp}/{export}"),
            RemoteAddr::Unix(p) => format!("nbd{s}+unix:///{export}?socket={}", p.display()),
        }
    }
}

/// An export name as it is written in an NBD URI: `%`, `?`, `#`, `&`, spaces and
/// non-printable or non-ASCII bytes percent-encoded.
pub fn encode_export(name: &str) -> String {
    farmap_core::query::percent_encode(name, |b| {
        b.is_ascii_graphic() && !matches!(b, b'%' | b'?' | b'#' | b'&')
    })
}

/// The export name an NBD URI's path names (without its leading `/`, percent-decoded);
/// `None` when a `%` is not followed by two hex digits or the result is not UTF-8.
pub fn decode_export(path: &str) -> Option<String> {
    farmap_core::query::percent_decode(path)
}

/// How an [`NbdStore`] connects and cuts the region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdClientOptions {
    /// The chunk size; by default 64 KiB, or the server's preferred block size if larger.
    pub chunk_size: Option<u32>,
    /// Connections to open; by default 4 when the server offers `CAN_MULTI_CONN`. Without
    /// that flag only one connection is ever used.
    pub connections: Option<usize>,
    /// Deadline of each request; past it the request fails with `Timeout` and its
    /// connection is closed (the next request opens a new one).
    pub request_timeout: Duration,
    /// Deadline of one connection attempt (TCP, TLS and the NBD handshake).
    pub connect_timeout: Duration,
    /// Requests in flight per connection.
    pub max_in_flight: usize,
    /// Refuse writes even when the export takes them.
    pub read_only: bool,
}

impl Default for NbdClientOptions {
    /// Default chunk, 4 connections if allowed, 30 s requests, 10 s connects, 64 requests
    /// in flight per connection, writable.
    fn default() -> Self {
        Self {
            chunk_size: None,
            connections: None,
            request_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            max_in_flight: 64,
            read_only: false,
        }
    }
}

/// The most bytes one `WRITE_ZEROES` request covers (it carries no payload).
const MAX_ZERO_REQUEST: u64 = 1 << 30;

/// An NBD export as a farmap store (see the [module docs](self)).
pub struct NbdStore {
    shown: String,
    details: ExportDetails,
    geometry: Geometry,
    caps: Caps,
    /// The largest payload of one request (a multiple of the minimum block size).
    piece: u32,
    request_timeout: Duration,
    pool: Arc<Pool<Dialer>>,
}

/// Opens the store's further connections, each checked to show the same export.
struct Dialer {
    target: NbdTarget,
    shown: String,
    tls: Option<TlsSetup>,
    opts: NbdClientOptions,
    /// What the first connection showed.
    details: ExportDetails,
    /// The payload cap of the replies of a new connection.
    max_payload: u32,
}

impl pool::Dial for Dialer {
    type Link = Conn;

    fn dial(&self) -> BoxFuture<'_, StoreResult<Arc<Conn>>> {
        Box::pin(async move {
            let dial = NbdStore::dial(
                &self.target,
                &self.shown,
                self.tls.as_ref(),
                &self.opts,
                self.max_payload,
            );
            let c = open(&dial).await?;
            let (was, now) = (&self.details, &c.details);
            if (was.size, was.flags) != (now.size, now.flags) {
                c.close("the export changed");
                return Err(StoreError::new(
                    ErrorKind::Unavailable,
                    format!(
                        "{} changed: it was {} bytes with flags {:#06x}, it is now {} bytes with flags {:#06x}",
                        self.shown, was.size, was.flags, now.size, now.flags
                    ),
                ));
            }
            Ok(c)
        })
    }

    fn shown(&self) -> String {
        self.shown.clone()
    }
}

impl Link for Conn {
    fn is_open(&self) -> bool {
        self.is_alive()
    }

    fn closed(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.dead())
    }

    fn close(&self, why: &str) {
        Conn::close(self, why);
    }
}

impl std::fmt::Debug for NbdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NbdStore")
            .field("server", &self.shown)
            .field("geometry", &self.geometry)
            .field("caps", &self.caps)
            .field("connections", &self.pool.size())
            .finish()
    }
}

fn invalid(shown: &str, why: String) -> StoreError {
    StoreError::new(ErrorKind::InvalidInput, format!("{why} (export {shown})"))
}

/// The chunk size and the largest request payload for an export.
fn cut(shown: &str, details: &ExportDetails, asked: Option<u32>) -> StoreResult<(Geometry, u32)> {
    let (min, preferred, max) = match details.block {
        Some(b) => (b.min.max(1), b.preferred.max(1), b.max),
        None => (1, 4096, DEFAULT_MAX_PAYLOAD),
    };
    if !min.is_power_of_two() || min > 64 * 1024 {
        return Err(StoreError::new(
            ErrorKind::Unsupported,
            format!("the NBD server's minimum block size {min} is not a power of two up to 64KiB (export {shown})"),
        ));
    }
    let chunk = match asked {
        Some(c) => {
            if c % min != 0 {
                return Err(invalid(
                    shown,
                    format!("chunk={c} is not a multiple of the server's minimum block size {min}"),
                ));
            }
            c
        }
        None => DEFAULT_CHUNK_SIZE
            .max(
                preferred
                    .checked_next_power_of_two()
                    .unwrap_or(MAX_CHUNK_SIZE),
            )
            .max(min)
            .clamp(MIN_CHUNK_SIZE, MAX_CHUNK_SIZE),
    };
    let piece = max.min(DEFAULT_MAX_PAYLOAD).min(chunk) / min * min;
    if piece == 0 {
        return Err(StoreError::new(
            ErrorKind::Unsupported,
            format!("the NBD server's maximum block size {max} is below its minimum {min} (export {shown})"),
        ));
    }
    let g = Geometry::new_bounded(details.size, chunk.into()).map_err(|e| {
        invalid(
            shown,
            format!(
                "the export of {} bytes cannot be a region: {e}",
                details.size
            ),
        )
    })?;
    Ok((g, piece))
}

impl NbdStore {
    /// Connects to `target`: the first connection now (its failure is the error), the
    /// others (when the server allows several) as well, before this returns.
    pub async fn connect(target: NbdTarget, opts: NbdClientOptions) -> StoreResult<NbdStore> {
        let shown = target.uri();
        let tls = match &target.tls {
            Some(cfg) => {
                let (connector, name) = cfg.connector(target.addr.host()).map_err(|e| {
                    StoreError::new(
                        ErrorKind::InvalidInput,
                        format!(
                            "the TLS settings for {shown} are unusable: {}",
                            farmap_core::error_chain(&e)
                        ),
                    )
                })?;
                Some(TlsSetup {
                    connector,
                    name,
                    sent_cert: cfg.has_client_cert(),
                })
            }
            None => None,
        };
        let first = open(&Self::dial(
            &target,
            &shown,
            tls.as_ref(),
            &opts,
            DEFAULT_MAX_PAYLOAD,
        ))
        .await?;
        let details = first.details.clone();
        let (geometry, piece) = cut(&shown, &details, opts.chunk_size)?;
        let multi = details.flags & tflag::CAN_MULTI_CONN != 0;
        let n = match opts.connections {
            Some(n) if n > 1 && !multi => {
                tracing::warn!(
                    "{shown} does not offer CAN_MULTI_CONN: one connection is used, not {n}"
                );
                1
            }
            Some(n) => n.max(1),
            None if multi => 4,
            None => 1,
        };
        let writable = details.flags & tflag::READ_ONLY == 0 && !opts.read_only;
        let mut caps = Caps::PARALLEL;
        if writable {
            caps = caps | Caps::WRITE;
            if details.flags & tflag::SEND_FLUSH != 0 {
                caps = caps | Caps::FLUSH;
            }
            let zeroes = tflag::SEND_WRITE_ZEROES | tflag::SEND_TRIM;
            if details.flags & zeroes == zeroes {
                caps = caps | Caps::TRIM;
            }
        }
        if details.structured && details.allocation_context.is_some() {
            caps = caps | Caps::STATUS;
        }
        // Requests never ask for more than `piece` bytes; replies are capped to that.
        // The first connection was opened before `piece` was known: its cap is the protocol's
        // default payload, itself a bound.
        let dialer = Dialer {
            target,
            shown: shown.clone(),
            tls,
            opts,
            details: details.clone(),
            max_payload: piece.max(64 * 1024),
        };
        let others = try_join_all((1..n).map(|_| pool::Dial::dial(&dialer))).await?;
        let initial = std::iter::once(first).chain(others).map(Some).collect();
        let request_timeout = dialer.opts.request_timeout;
        let pool = Pool::start(
            dialer,
            PoolOptions {
                reconnect: reconnect_policy(),
                fail_fast: true,
            },
            initial,
        );
        let store = NbdStore {
            shown,
            details,
            geometry,
            caps,
            piece,
            request_timeout,
            pool,
        };
        tracing::debug!(
            "opened {} ({}, {}, {} connection(s), requests up to {} bytes)",
            store.shown,
            store.geometry,
            store.caps,
            n,
            store.piece
        );
        Ok(store)
    }

    fn dial<'a>(
        target: &'a NbdTarget,
        shown: &'a str,
        tls: Option<&'a TlsSetup>,
        opts: &NbdClientOptions,
        max_payload: u32,
    ) -> Dial<'a> {
        Dial {
            addr: &target.addr,
            export: &target.export,
            tls,
            shown,
            connect_timeout: opts.connect_timeout,
            request_timeout: opts.request_timeout,
            max_in_flight: opts.max_in_flight,
            max_payload,
        }
    }

    /// The target, as given.
    pub fn target(&self) -> &NbdTarget {
        &self.pool.dialer().target
    }

    /// The transmission flags the server sent ([`tflag`]).
    pub fn flags(&self) -> u16 {
        self.details.flags
    }

    /// Connections in use (open or to be reopened).
    pub fn connections(&self) -> usize {
        self.pool.size()
    }

    /// The largest payload of one request this store sends.
    pub fn max_request(&self) -> u32 {
        self.piece
    }

    /// Closes every connection: requests in flight and later ones fail with `Closed`.
    /// Dropping the store does the same.
    pub async fn close(&self) {
        self.pool
            .close(&format!("the store of {} was closed", self.shown));
    }

    async fn call(&self, req: Request) -> StoreResult<Answer> {
        let conn = self.pool.get(Instant::now() + self.request_timeout).await?;
        conn.call(req).await
    }

    fn request(command: Command, offset: u64, length: u32, payload: Bytes) -> Request {
        Request {
            command,
            flags: 0,
            offset,
            length,
            payload,
            context: 0,
        }
    }

    /// The byte ranges (offset within the chunk, length) of the requests for `len` bytes.
    fn pieces(&self, len: usize) -> impl Iterator<Item = (usize, usize)> {
        let piece = self.piece as usize;
        (0..len)
            .step_by(piece)
            .map(move |at| (at, piece.min(len - at)))
    }

    async fn read_chunk(&self, idx: ChunkIdx) -> StoreResult<Bytes> {
        self.geometry.check_idx(idx)?;
        let base = self.geometry.offset_of(idx);
        let len = self.geometry.chunk_len(idx);
        let reads = self.pieces(len).map(|(at, n)| async move {
            match self
                .call(Self::request(
                    Command::Read,
                    base + at as u64,
                    n as u32,
                    Bytes::new(),
                ))
                .await?
            {
                Answer::Data(d) if d.len() == n => Ok(d),
                other => Err(self.odd_answer("a read", &other)),
            }
        });
        let mut parts = try_join_all(reads).await?;
        if parts.len() == 1 {
            return Ok(parts.pop().expect("one part"));
        }
        let mut out = BytesMut::with_capacity(len);
        for p in parts {
            out.extend_from_slice(&p);
        }
        Ok(out.freeze())
    }

    fn odd_answer(&self, what: &str, answer: &Answer) -> StoreError {
        StoreError::new(
            ErrorKind::Corrupt,
            format!(
                "the NBD server at {} answered {what} with {answer:?}",
                self.shown
            ),
        )
    }

    fn refuse_write(&self) -> StoreResult<()> {
        if self.caps.contains(Caps::WRITE) {
            Ok(())
        } else {
            Err(StoreError::new(
                ErrorKind::ReadOnly,
                format!(
                    "{} is read-only ({})",
                    self.shown,
                    if self.details.flags & tflag::READ_ONLY != 0 {
                        "the server exports it read-only"
                    } else {
                        "opened with ro"
                    }
                ),
            ))
        }
    }

    async fn write_chunk(&self, idx: ChunkIdx, data: Bytes) -> StoreResult<()> {
        self.geometry.check_write(idx, data.len())?;
        self.refuse_write()?;
        let base = self.geometry.offset_of(idx);
        let writes = self.pieces(data.len()).map(|(at, n)| {
            let payload = data.slice(at..at + n);
            async move {
                self.call(Self::request(
                    Command::Write,
                    base + at as u64,
                    n as u32,
                    payload,
                ))
                .await
                .map(|_| ())
            }
        });
        try_join_all(writes).await.map(|_| ())
    }

    async fn trim_range(&self, range: ChunkRange) -> StoreResult<()> {
        self.geometry.check_range(range)?;
        if range.is_empty() {
            return Ok(());
        }
        self.refuse_write()?;
        if self.details.flags & tflag::SEND_WRITE_ZEROES == 0 {
            for idx in range.iter() {
                self.write_chunk(idx, zero_chunk(self.geometry.chunk_len(idx)))
                    .await?;
            }
            return Ok(());
        }
        let start = self.geometry.offset_of(range.start);
        let end = self.geometry.offset_of(range.end).min(self.geometry.size());
        let step = MAX_ZERO_REQUEST / u64::from(self.geometry.chunk_size())
            * u64::from(self.geometry.chunk_size());
        let zeroes = (start..end).step_by(step as usize).map(|at| {
            let n = step.min(end - at) as u32;
            self.call(Self::request(Command::WriteZeroes, at, n, Bytes::new()))
        });
        try_join_all(zeroes).await.map(|_| ())
    }

    async fn chunk_status(&self, idx: ChunkIdx) -> StoreResult<ChunkStatus> {
        self.geometry.check_idx(idx)?;
        let context = match self.details.allocation_context {
            Some(c) if self.details.structured => c,
            _ => return Ok(ChunkStatus::Unknown),
        };
        let len = self.geometry.chunk_len(idx) as u64;
        let mut req = Self::request(
            Command::BlockStatus,
            self.geometry.offset_of(idx),
            len as u32,
            Bytes::new(),
        );
        req.context = context;
        let extents = match self.call(req).await? {
            Answer::Extents(e) => e,
            other => return Err(self.odd_answer("a block status request", &other)),
        };
        Ok(status_of(&extents, len))
    }

    async fn flush_all(&self) -> StoreResult<()> {
        if self.details.flags & tflag::SEND_FLUSH == 0 || !self.caps.contains(Caps::WRITE) {
            return Ok(());
        }
        // One connection, or several with CAN_MULTI_CONN: then a flush on any of them
        // covers the writes completed on all.
        self.call(Self::request(Command::Flush, 0, 0, Bytes::new()))
            .await
            .map(|_| ())
    }
}

/// What `base:allocation` extents say about a chunk of `len` bytes: zero when the extents
/// cover it and all read as zeros, data when any part holds data, unknown when the server
/// described only part of it (all zeros so far).
fn status_of(extents: &[Extent], len: u64) -> ChunkStatus {
    let mut covered = 0u64;
    for e in extents {
        if covered >= len {
            break;
        }
        if e.flags & STATE_ZERO == 0 {
            return ChunkStatus::Data;
        }
        covered += u64::from(e.length);
    }
    if covered >= len {
        ChunkStatus::Zero
    } else {
        ChunkStatus::Unknown
    }
}

impl Drop for NbdStore {
    fn drop(&mut self) {
        self.pool
            .close(&format!("the store of {} was closed", self.shown));
    }
}

impl Store for NbdStore {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn caps(&self) -> Caps {
        self.caps
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(self.read_chunk(idx))
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(self.write_chunk(idx, data))
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(self.flush_all())
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(self.trim_range(range))
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        Box::pin(self.chunk_status(idx))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use farmap_nbd_proto::BlockSize;

    fn details(size: u64, block: Option<BlockSize>) -> ExportDetails {
        ExportDetails {
            size,
            flags: tflag::HAS_FLAGS,
            block,
            structured: true,
            allocation_context: Some(1),
        }
    }

    #[test]
    fn export_names_round_trip_through_uris() {
        for name in ["", "disk", "a b/c?d&e#f%g", "ümlaut"] {
            let enc = encode_export(name);
            assert!(!enc.contains(['?', '&', '#', ' ']), "{enc}");
            assert_eq!(decode_export(&enc).as_deref(), Some(name));
        }
        assert_eq!(decode_export("%4"), None);
        assert_eq!(decode_export("%zz"), None);
        assert_eq!(decode_export("%FF"), None, "not UTF-8");
    }

    #[test]
    fn chunks_respect_the_servers_block_sizes() {
        let (g, piece) = cut("x", &details(1 << 20, None), None).unwrap();
        assert_eq!(
            (g.chunk_size(), piece),
            (DEFAULT_CHUNK_SIZE, DEFAULT_CHUNK_SIZE)
        );
        // A preferred size above the default is taken; a small maximum splits requests.
        let b = BlockSize {
            min: 512,
            preferred: 256 * 1024,
            max: 100_000,
        };
        let (g, piece) = cut("x", &details(1 << 20, Some(b)), None).unwrap();
        assert_eq!(g.chunk_size(), 256 * 1024);
        assert_eq!(piece, 100_000 / 512 * 512);
        // A chunk that is not a multiple of the minimum is refused, naming both.
        let b = BlockSize {
            min: 64 * 1024,
            preferred: 64 * 1024,
            max: 1 << 20,
        };
        let e = cut("x", &details(1 << 20, Some(b)), Some(4096)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
        assert!(e.context().contains("65536"), "{e}");
        let e = cut("x", &details(0, None), None).unwrap_err();
        assert!(e.context().contains("cannot be a region"), "{e}");
        let odd = BlockSize {
            min: 3,
            preferred: 4096,
            max: 1 << 20,
        };
        assert!(cut("x", &details(1 << 20, Some(odd)), None).is_err());
    }

    #[test]
    fn status_from_extents() {
        let z = |length| Extent { length, flags: 3 };
        let d = |length| Extent { length, flags: 0 };
        assert_eq!(status_of(&[z(65536)], 65536), ChunkStatus::Zero);
        assert_eq!(status_of(&[z(1 << 30)], 65536), ChunkStatus::Zero);
        assert_eq!(status_of(&[z(4096), d(4096)], 65536), ChunkStatus::Data);
        assert_eq!(status_of(&[z(4096)], 65536), ChunkStatus::Unknown);
        // Extents past the chunk do not count.
        assert_eq!(status_of(&[z(65536), d(1)], 65536), ChunkStatus::Zero);
        assert_eq!(status_of(&[], 65536), ChunkStatus::Unknown);
    }
}
