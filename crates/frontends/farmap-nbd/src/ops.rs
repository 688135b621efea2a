//! What the server does for each request: the store operations and the reply bytes.

use std::sync::Arc;

use bytes::Bytes;
use farmap_core::{zero_chunk, Caps, ChunkStatus, ErrorKind, Store, StoreError};
use farmap_nbd_proto::consts::{cflag, errno, STATE_HOLE, STATE_ZERO};
use farmap_nbd_proto::{
    block_status_chunk, error_chunk, none_chunk, offset_data_header, offset_hole_chunk,
    simple_reply, Command, Extent, RequestHeader,
};
use farmap_pipeline::Unaligned;
use futures::{StreamExt, TryStreamExt};

/// Chunks of one request worked on at once.
const PER_REQUEST: usize = 64;
/// Most chunks a block status request examines (the client asks again for the rest).
const MAX_STATUS_CHUNKS: u64 = 1 << 16;

/// One export as the transmission phase sees it.
#[derive(Debug)]
pub(crate) struct ExportCtx {
    pub(crate) name: String,
    pub(crate) store: Arc<Unaligned<Arc<dyn Store>>>,
    pub(crate) size: u64,
    pub(crate) chunk: u64,
    pub(crate) read_only: bool,
    pub(crate) caps: Caps,
    pub(crate) max_payload: u32,
}

/// What was negotiated on one connection.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Session {
    pub(crate) structured: bool,
    pub(crate) allocation: Option<u32>,
}

/// An NBD error: the errno and a sentence for structured replies.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) errno: u32,
    pub(crate) message: String,
}

impl Failure {
    fn new(errno: u32, message: impl Into<String>) -> Self {
        Self {
            errno,
            message: message.into(),
        }
    }
}

/// The NBD errno of a store error.
pub(crate) fn nbd_errno(kind: ErrorKind) -> u32 {
    match kind {
        ErrorKind::ReadOnly | ErrorKind::PermissionDenied => errno::EPERM,
        ErrorKind::NoSpace => errno::ENOSPC,
        ErrorKind::OutOfRange | ErrorKind::InvalidInput | ErrorKind::Unsupported => errno::EINVAL,
        ErrorKind::Closed => errno::ESHUTDOWN,
        _ => errno::EIO,
    }
}

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Self {
        Failure::new(nbd_errno(e.kind()), farmap_core::error_chain(&e))
    }
}

/// The reply to a request that failed.
pub(crate) fn error_reply(h: &RequestHeader, s: Session, f: &Failure) -> Vec<Bytes> {
    if s.structured {
        vec![error_chunk(h.cookie, f.errno, &f.message, true)]
    } else {
        vec![Bytes::copy_from_slice(&simple_reply(h.cookie, f.errno))]
    }
}

fn ok_reply(h: &RequestHeader) -> Vec<Bytes> {
    vec![Bytes::copy_from_slice(&simple_reply(h.cookie, 0))]
}

/// The flags each command accepts (FUA is accepted everywhere, as the protocol asks).
fn allowed_flags(c: Command) -> u16 {
    cflag::FUA
        | match c {
            Command::WriteZeroes => cflag::NO_HOLE | cflag::FAST_ZERO,
            Command::BlockStatus => cflag::REQ_ONE,
            _ => 0,
        }
}

impl ExportCtx {
    fn check_range(&self, h: &RequestHeader) -> Result<(), Failure> {
        let end = h.offset.checked_add(h.length.into());
        if end.is_some_and(|e| e <= self.size) {
            return Ok(());
        }
        let errno = match h.command {
            Command::Write | Command::WriteZeroes => errno::ENOSPC,
            _ => errno::EINVAL,
        };
        Err(Failure::new(
            errno,
            format!(
                "{} bytes at offset {} reach past the end of export {:?} ({} bytes)",
                h.length, h.offset, self.name, self.size
            ),
        ))
    }

    fn check_writable(&self) -> Result<(), Failure> {
        if self.read_only {
            Err(Failure::new(
                errno::EPERM,
                format!("export {:?} is read-only", self.name),
            ))
        } else {
            Ok(())
        }
    }

    /// Answers one request (never `DISC`, which the connection handles).
    pub(crate) async fn handle(&self, h: RequestHeader, payload: Bytes, s: Session) -> Vec<Bytes> {
        match self.run(&h, payload, s).await {
            Ok(reply) => reply,
            Err(f) => error_reply(&h, s, &f),
        }
    }

    async fn run(
        &self,
        h: &RequestHeader,
        payload: Bytes,
        s: Session,
    ) -> Result<Vec<Bytes>, Failure> {
        if h.flags & !allowed_flags(h.command) != 0 {
            return Err(Failure::new(
                errno::EINVAL,
                format!("flags {:#x} are not valid for {:?}", h.flags, h.command),
            ));
        }
        let fua = h.flags & cflag::FUA != 0;
        match h.command {
            Command::Read => {
                self.check_read(h, s)?;
                if h.length > self.max_payload {
                    // The connection serves these in pieces; refusing is what the protocol
                    // allows otherwise.
                    return Err(Failure::new(
                        errno::EOVERFLOW,
                        format!("reads are limited to {} bytes", self.max_payload),
                    ));
                }
                self.read_range(h.cookie, h.offset, h.length, true, s).await
            }
            Command::Write => {
                self.check_writable()?;
                self.check_range(h)?;
                self.store.write_bytes(h.offset, payload).await?;
                if fua {
                    self.store.flush().await?;
                }
                Ok(ok_reply(h))
            }
            Command::Flush => {
                self.store.flush().await?;
                Ok(ok_reply(h))
            }
            Command::Trim => {
                self.check_writable()?;
                self.check_range(h)?;
                self.store.trim_at(h.offset, h.length.into()).await?;
                if fua {
                    self.store.flush().await?;
                }
                Ok(ok_reply(h))
            }
            Command::WriteZeroes => {
                self.check_writable()?;
                self.check_range(h)?;
                let no_hole = h.flags & cflag::NO_HOLE != 0;
                if h.flags & cflag::FAST_ZERO != 0 && (no_hole || !self.caps.contains(Caps::TRIM)) {
                    return Err(Failure::new(
                        errno::ENOTSUP,
                        "zeroing here is no faster than writing zeros",
                    ));
                }
                if no_hole || !self.caps.contains(Caps::TRIM) {
                    self.write_zeros(h.offset, h.length.into()).await?;
                } else {
                    // A trim makes chunks read as zeros (the Store contract).
                    self.store.trim_at(h.offset, h.length.into()).await?;
                }
                if fua {
                    self.store.flush().await?;
                }
                Ok(ok_reply(h))
            }
            Command::Cache => {
                self.check_range(h)?;
                // A hint, passed on chunk by chunk: a managed (cached) export fetches each
                // chunk (one at a time, each dropped: a 28-byte request asking for 4 GiB
                // holds one chunk, what it is charged), a file asks the kernel to read
                // ahead, other stores do nothing.
                self.store.prefetch_bytes(h.offset, h.length.into()).await?;
                Ok(ok_reply(h))
            }
            Command::BlockStatus => {
                let Some(ctx) = s.allocation else {
                    return Err(Failure::new(
                        errno::EINVAL,
                        "no metadata context was selected (SET_META_CONTEXT base:allocation)",
                    ));
                };
                self.check_range(h)?;
                if h.length == 0 {
                    return Err(Failure::new(errno::EINVAL, "block status of 0 bytes"));
                }
                let extents = self.extents(h).await?;
                Ok(vec![block_status_chunk(h.cookie, ctx, &extents, true)])
            }
            Command::Disc | Command::Other(_) => Err(Failure::new(
                errno::EINVAL,
                format!("unknown command {}", h.command.code()),
            )),
        }
    }

    /// The bytes a request may hold while it runs and until its reply is written, beyond
    /// its write payload (charged as it arrives): what the connection's and the server's
    /// budgets are charged for it.
    ///
    /// - a read: every chunk it touches, whole (the store returns whole chunks; the parts
    ///   of the chunks at either end are copied out of them before the reply waits);
    /// - `CACHE`: one chunk (it reads one at a time);
    /// - a write: the chunks at either end it covers in part (read, changed, written back);
    /// - `TRIM`/`WRITE_ZEROES`: the chunks at either end (and, with `NO_HOLE`, the zero
    ///   writes in flight);
    /// - `BLOCK_STATUS`: its list of chunk states and extents.
    pub(crate) fn working_set(&self, h: &RequestHeader) -> usize {
        let len = u64::from(h.length);
        let touched = if len == 0 {
            0
        } else {
            // Saturating: the range is checked later, and a peer chooses the offset.
            (h.offset.saturating_add(len - 1) / self.chunk + 1)
                .saturating_sub(h.offset / self.chunk)
        };
        let chunk = self.chunk as usize;
        match h.command {
            Command::Read => touched.saturating_mul(self.chunk) as usize,
            Command::Cache => chunk.min((touched as usize).saturating_mul(chunk)),
            Command::WriteZeroes if h.flags & cflag::NO_HOLE != 0 => (2 + PER_REQUEST) * chunk,
            Command::Write | Command::Trim | Command::WriteZeroes => 2 * chunk,
            Command::BlockStatus => touched.min(MAX_STATUS_CHUNKS) as usize * 24,
            Command::Flush | Command::Disc | Command::Other(_) => 0,
        }
    }

    /// The chunk-aligned pieces of `offset..offset+len`: (offset, length, chunk index).
    fn pieces(&self, offset: u64, len: u64) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        let end = offset + len;
        let chunk = self.chunk;
        let mut at = offset;
        std::iter::from_fn(move || {
            if at >= end {
                return None;
            }
            let idx = at / chunk;
            let stop = ((idx + 1) * chunk).min(end);
            let p = (at, stop - at, idx);
            at = stop;
            Some(p)
        })
    }

    /// Whether a read is served in pieces of at most the maximum payload (each piece one
    /// round of [`read_range`](Self::read_range)) rather than in one reply: a structured
    /// read longer than the maximum payload (the protocol allows splitting it in chunks).
    pub(crate) fn read_in_pieces(&self, h: &RequestHeader, s: Session) -> bool {
        h.command == Command::Read && s.structured && h.length > self.max_payload
    }

    /// Checks a read's flags and range, and its length unless it can be served in pieces:
    /// a read longer than the maximum payload is refused with `EINVAL` under simple
    /// replies (its data could only be one payload).
    pub(crate) fn check_read(&self, h: &RequestHeader, s: Session) -> Result<(), Failure> {
        if h.flags & !allowed_flags(h.command) != 0 {
            return Err(Failure::new(
                errno::EINVAL,
                format!("flags {:#x} are not valid for {:?}", h.flags, h.command),
            ));
        }
        self.check_range(h)?;
        if h.length > self.max_payload && !s.structured {
            return Err(Failure::new(
                errno::EINVAL,
                format!(
                    "a read of {} bytes is over the maximum payload of {} (without \
                     structured replies it cannot be split)",
                    h.length, self.max_payload
                ),
            ));
        }
        Ok(())
    }

    /// The reply messages for `len` bytes at `offset` of a read with `cookie`: one simple
    /// reply, or structured chunks, the last one flagged done when `last`.
    pub(crate) async fn read_range(
        &self,
        cookie: u64,
        offset: u64,
        len: u32,
        last: bool,
        s: Session,
    ) -> Result<Vec<Bytes>, Failure> {
        let holes = s.structured && self.caps.contains(Caps::STATUS);
        let store = &self.store;
        let chunk = self.chunk;
        let one = |at: u64, len: u64, idx: u64| async move {
            if holes && store.status(farmap_core::ChunkIdx(idx)).await? == ChunkStatus::Zero {
                return Ok::<_, StoreError>((at, len, None));
            }
            let data = store.read_bytes(at, len as usize).await?;
            // A slice of a chunk would keep the whole chunk alive until the reply is written
            // (a 1-byte read pinning 4 MiB): a part of a chunk gets bytes of its own.
            let data = if len < chunk {
                Bytes::copy_from_slice(&data)
            } else {
                data
            };
            Ok((at, len, Some(data)))
        };
        // Each piece: `None` for a hole, `Some(bytes)` for data (a slice of the chunk).
        let mut it = self.pieces(offset, len.into());
        let pieces: Vec<(u64, u64, Option<Bytes>)> = match (it.next(), it.next()) {
            (None, _) => Vec::new(),
            // Within one chunk (a 4 KiB random read): no stream machinery.
            (Some((at, n, idx)), None) => vec![one(at, n, idx).await?],
            (Some(a), Some(b)) => {
                futures::stream::iter([a, b].into_iter().chain(it))
                    .map(|(at, n, idx)| one(at, n, idx))
                    .buffered(PER_REQUEST)
                    .try_collect()
                    .await?
            }
        };
        if !s.structured {
            let mut out = Vec::with_capacity(1 + pieces.len());
            out.push(Bytes::copy_from_slice(&simple_reply(cookie, 0)));
            out.extend(pieces.into_iter().filter_map(|p| p.2));
            return Ok(out);
        }
        if len == 0 {
            return Ok(vec![Bytes::copy_from_slice(&none_chunk(cookie))]);
        }
        // Runs of data become one OFFSET_DATA chunk each, runs of holes one OFFSET_HOLE.
        let mut out = Vec::with_capacity(1 + pieces.len());
        let mut i = 0;
        while i < pieces.len() {
            let start = pieces[i].0;
            let data = pieces[i].2.is_some();
            let mut j = i;
            let mut len = 0u64;
            while j < pieces.len() && pieces[j].2.is_some() == data {
                len += pieces[j].1;
                j += 1;
            }
            let done = last && j == pieces.len();
            if data {
                out.push(Bytes::copy_from_slice(&offset_data_header(
                    cookie, start, len as u32, done,
                )));
                out.extend(pieces[i..j].iter().filter_map(|p| p.2.clone()));
            } else {
                out.push(Bytes::copy_from_slice(&offset_hole_chunk(
                    cookie, start, len as u32, done,
                )));
            }
            i = j;
        }
        Ok(out)
    }

    async fn write_zeros(&self, offset: u64, len: u64) -> Result<(), StoreError> {
        let store = &self.store;
        futures::stream::iter(self.pieces(offset, len))
            .map(|(at, n, _)| async move { store.write_bytes(at, zero_chunk(n as usize)).await })
            .buffer_unordered(PER_REQUEST)
            .try_collect::<Vec<()>>()
            .await?;
        Ok(())
    }

    async fn extents(&self, h: &RequestHeader) -> Result<Vec<Extent>, StoreError> {
        let req_one = h.flags & cflag::REQ_ONE != 0;
        let store = &self.store;
        let pieces = self
            .pieces(h.offset, h.length.into())
            .take(MAX_STATUS_CHUNKS as usize);
        let states: Vec<(u64, u32)> = futures::stream::iter(pieces)
            .map(|(_, len, idx)| async move {
                let st = store.status(farmap_core::ChunkIdx(idx)).await?;
                let flags = if st == ChunkStatus::Zero {
                    STATE_HOLE | STATE_ZERO
                } else {
                    0
                };
                Ok::<_, StoreError>((len, flags))
            })
            .buffered(PER_REQUEST)
            .try_collect()
            .await?;
        let mut extents: Vec<Extent> = Vec::new();
        for (len, flags) in states {
            match extents.last_mut() {
                Some(e) if e.flags == flags => e.length += len as u32,
                _ => {
                    if req_one && !extents.is_empty() {
                        break;
                    }
                    extents.push(Extent {
                        length: len as u32,
                        flags,
                    });
                }
            }
        }
        Ok(extents)
    }
}
