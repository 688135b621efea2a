//! Replies of the transmission phase: the server's encoders and the client's decoder.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::consts::{
    chunk, CHUNK_HEADER_LEN, MAX_STRING, REPLY_FLAG_DONE, SIMPLE_REPLY_LEN, SIMPLE_REPLY_MAGIC,
    STRUCTURED_REPLY_MAGIC,
};
use crate::cursor::{be16, be32, be64, Cursor};

/// One extent of a block status reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Length in bytes (nonzero).
    pub length: u32,
    /// State flags of the metadata context.
    pub flags: u32,
}

fn done_flag(done: bool) -> u16 {
    if done {
        REPLY_FLAG_DONE
    } else {
        0
    }
}

/// A simple reply: 16 bytes (a successful read's data follows it).
pub fn simple_reply(cookie: u64, error: u32) -> [u8; SIMPLE_REPLY_LEN] {
    let mut a = [0u8; SIMPLE_REPLY_LEN];
    a[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    a[4..8].copy_from_slice(&error.to_be_bytes());
    a[8..16].copy_from_slice(&cookie.to_be_bytes());
    a
}

/// The 20-byte header of a structured reply chunk with `len` bytes of payload.
pub fn chunk_header(flags: u16, ty: u16, cookie: u64, len: u32) -> [u8; CHUNK_HEADER_LEN] {
    let mut a = [0u8; CHUNK_HEADER_LEN];
    a[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    a[4..6].copy_from_slice(&flags.to_be_bytes());
    a[6..8].copy_from_slice(&ty.to_be_bytes());
    a[8..16].copy_from_slice(&cookie.to_be_bytes());
    a[16..20].copy_from_slice(&len.to_be_bytes());
    a
}

/// The first 28 bytes of an `OFFSET_DATA` chunk (header and offset); the `data_len` bytes
/// of data follow. `data_len` must be at least 1 and at most `u32::MAX - 8`.
pub fn offset_data_header(cookie: u64, offset: u64, data_len: u32, done: bool) -> [u8; 28] {
    let mut a = [0u8; 28];
    let h = chunk_header(
        done_flag(done),
        chunk::OFFSET_DATA,
        cookie,
        data_len.saturating_add(8),
    );
    a[..20].copy_from_slice(&h);
    a[20..28].copy_from_slice(&offset.to_be_bytes());
    a
}

/// An `OFFSET_HOLE` chunk: `len` (nonzero) bytes of zeros at `offset`.
pub fn offset_hole_chunk(cookie: u64, offset: u64, len: u32, done: bool) -> [u8; 32] {
    let mut a = [0u8; 32];
    a[..20].copy_from_slice(&chunk_header(
        done_flag(done),
        chunk::OFFSET_HOLE,
        cookie,
        12,
    ));
    a[20..28].copy_from_slice(&offset.to_be_bytes());
    a[28..32].copy_from_slice(&len.to_be_bytes());
    a
}

/// A `BLOCK_STATUS` chunk for metadata context `context` (at least one extent).
pub fn block_status_chunk(cookie: u64, context: u32, extents: &[Extent], done: bool) -> Bytes {
    let len = 4 + 8 * extents.len();
    let mut b = BytesMut::with_capacity(CHUNK_HEADER_LEN + len);
    b.put_slice(&chunk_header(
        done_flag(done),
        chunk::BLOCK_STATUS,
        cookie,
        len as u32,
    ));
    b.put_u32(context);
    for e in extents {
        b.put_u32(e.length);
        b.put_u32(e.flags);
    }
    b.freeze()
}

/// `message` cut to the protocol's string limit at a character boundary.
fn cut(message: &str) -> &str {
    if message.len() <= MAX_STRING {
        return message;
    }
    let mut end = MAX_STRING;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    &message[..end]
}

/// An `ERROR` chunk with a message for humans (cut to 4096 bytes).
pub fn error_chunk(cookie: u64, errno: u32, message: &str, done: bool) -> Bytes {
    let m = cut(message);
    let mut b = BytesMut::with_capacity(CHUNK_HEADER_LEN + 6 + m.len());
    b.put_slice(&chunk_header(
        done_flag(done),
        chunk::ERROR,
        cookie,
        (6 + m.len()) as u32,
    ));
    b.put_u32(errno);
    b.put_u16(m.len() as u16);
    b.put_slice(m.as_bytes());
    b.freeze()
}

/// An `ERROR_OFFSET` chunk: an error at `offset`, with a message (cut to 4096 bytes).
pub fn error_offset_chunk(
    cookie: u64,
    errno: u32,
    message: &str,
    offset: u64,
    done: bool,
) -> Bytes {
    let m = cut(message);
    let mut b = BytesMut::with_capacity(CHUNK_HEADER_LEN + 14 + m.len());
    b.put_slice(&chunk_header(
        done_flag(done),
        chunk::ERROR_OFFSET,
        cookie,
        (14 + m.len()) as u32,
    ));
    b.put_u32(errno);
    b.put_u16(m.len() as u16);
    b.put_slice(m.as_bytes());
    b.put_u64(offset);
    b.freeze()
}

/// A `NONE` chunk, which ends a reply.
pub fn none_chunk(cookie: u64) -> [u8; CHUNK_HEADER_LEN] {
    chunk_header(REPLY_FLAG_DONE, chunk::NONE, cookie, 0)
}

/// The content of one structured reply chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Chunk {
    /// `NONE`.
    None,
    /// `OFFSET_DATA`.
    OffsetData {
        /// Where the data belongs.
        offset: u64,
        /// The data.
        data: Bytes,
    },
    /// `OFFSET_HOLE`.
    OffsetHole {
        /// Where the zeros start.
        offset: u64,
        /// How many.
        length: u32,
    },
    /// `BLOCK_STATUS`.
    BlockStatus {
        /// The metadata context.
        context: u32,
        /// The extents, in order.
        extents: Vec<Extent>,
    },
    /// `ERROR`, `ERROR_OFFSET` or an error chunk of an unknown type.
    Error {
        /// The error value.
        errno: u32,
        /// The server's message.
        message: String,
        /// Where, for `ERROR_OFFSET`.
        offset: Option<u64>,
    },
}

/// One reply message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// A simple reply; `data` is a successful read's payload.
    Simple {
        /// The request's cookie.
        cookie: u64,
        /// 0 or an error value.
        error: u32,
        /// The data of a successful read.
        data: Option<Bytes>,
    },
    /// One structured reply chunk.
    Chunk {
        /// The request's cookie.
        cookie: u64,
        /// Whether this chunk ends the reply.
        done: bool,
        /// What it says.
        chunk: Chunk,
    },
}

impl Reply {
    /// The cookie of the request answered.
    pub fn cookie(&self) -> u64 {
        match self {
            Reply::Simple { cookie, .. } | Reply::Chunk { cookie, .. } => *cookie,
        }
    }

    /// Whether the request is fully answered by this message.
    pub fn is_final(&self) -> bool {
        match self {
            Reply::Simple { .. } => true,
            Reply::Chunk { done, .. } => *done,
        }
    }
}

/// Why the reply stream cannot be decoded any further (the connection must close).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReplyError {
    /// A reply did not start with either reply magic.
    #[error("the server sent {found:#010x} where a reply's magic belongs")]
    BadMagic {
        /// The four bytes found.
        found: u32,
    },
    /// A chunk longer than the client accepts.
    #[error("the server sent a reply chunk of {len} bytes, more than the {max} accepted")]
    TooLarge {
        /// Its length.
        len: u32,
        /// The limit.
        max: u32,
    },
    /// A chunk whose length does not fit its type, or a type that is not known.
    #[error("the server sent a malformed reply chunk of type {ty} ({why})")]
    Malformed {
        /// The chunk type.
        ty: u16,
        /// What is wrong.
        why: &'static str,
    },
}

/// Decodes replies for a client, incrementally.
///
/// Simple replies do not carry their length: the decoder asks the caller how many data
/// bytes follow a successful simple reply to a given cookie (the length of the read it
/// sent, or `None` for other commands).
#[derive(Debug)]
pub struct ReplyDecoder {
    max_chunk: u32,
}

impl ReplyDecoder {
    /// A decoder that refuses chunks (and simple read replies) with more than `max_chunk`
    /// bytes of payload.
    pub fn new(max_chunk: u32) -> Self {
        Self { max_chunk }
    }

    /// The next reply, `None` when more bytes are needed. `read_len(cookie)` gives the
    /// payload length of a successful simple reply to `cookie`.
    pub fn decode(
        &mut self,
        buf: &mut BytesMut,
        mut read_len: impl FnMut(u64) -> Option<u32>,
    ) -> Result<Option<Reply>, ReplyError> {
        if buf.len() < 4 {
            return Ok(None);
        }
        match be32(buf, 0) {
            SIMPLE_REPLY_MAGIC => {
                if buf.len() < SIMPLE_REPLY_LEN {
                    return Ok(None);
                }
                let error = be32(buf, 4);
                let cookie = be64(buf, 8);
                let len = if error == 0 { read_len(cookie) } else { None };
                if let Some(len) = len {
                    if len > self.max_chunk {
                        return Err(ReplyError::TooLarge {
                            len,
                            max: self.max_chunk,
                        });
                    }
                    if buf.len() < SIMPLE_REPLY_LEN + len as usize {
                        return Ok(None);
                    }
                }
                buf.advance(SIMPLE_REPLY_LEN);
                let data = len.map(|l| buf.split_to(l as usize).freeze());
                Ok(Some(Reply::Simple {
                    cookie,
                    error,
                    data,
                }))
            }
            STRUCTURED_REPLY_MAGIC => {
                if buf.len() < CHUNK_HEADER_LEN {
                    return Ok(None);
                }
                let flags = be16(buf, 4);
                let ty = be16(buf, 6);
                let cookie = be64(buf, 8);
                let len = be32(buf, 16);
                if len > self.max_chunk.saturating_add(32) {
                    return Err(ReplyError::TooLarge {
                        len,
                        max: self.max_chunk,
                    });
                }
                if buf.len() < CHUNK_HEADER_LEN + len as usize {
                    return Ok(None);
                }
                buf.advance(CHUNK_HEADER_LEN);
                let payload = buf.split_to(len as usize).freeze();
                let done = flags & REPLY_FLAG_DONE != 0;
                let chunk = parse_chunk(ty, done, payload)?;
                Ok(Some(Reply::Chunk {
                    cookie,
                    done,
                    chunk,
                }))
            }
            found => Err(ReplyError::BadMagic { found }),
        }
    }
}

fn parse_chunk(ty: u16, done: bool, payload: Bytes) -> Result<Chunk, ReplyError> {
    let bad = |why| ReplyError::Malformed { ty, why };
    let len = payload.len();
    match ty {
        chunk::NONE if len != 0 => Err(bad("NONE carries no payload")),
        chunk::NONE if !done => Err(bad("NONE must end the reply")),
        chunk::NONE => Ok(Chunk::None),
        chunk::OFFSET_DATA if len < 9 => Err(bad("OFFSET_DATA needs an offset and data")),
        chunk::OFFSET_DATA => Ok(Chunk::OffsetData {
            offset: be64(&payload, 0),
            data: payload.slice(8..),
        }),
        chunk::OFFSET_HOLE if len != 12 => Err(bad("OFFSET_HOLE is 12 bytes")),
        chunk::OFFSET_HOLE => {
            let length = be32(&payload, 8);
            if length == 0 {
                return Err(bad("an empty hole"));
            }
            Ok(Chunk::OffsetHole {
                offset: be64(&payload, 0),
                length,
            })
        }
        chunk::BLOCK_STATUS if len < 12 || !(len - 4).is_multiple_of(8) => {
            Err(bad("BLOCK_STATUS is a context id and 8-byte extents"))
        }
        chunk::BLOCK_STATUS => {
            let extents = payload[4..]
                .chunks_exact(8)
                .map(|e| Extent {
                    length: be32(e, 0),
                    flags: be32(e, 4),
                })
                .collect();
            Ok(Chunk::BlockStatus {
                context: be32(&payload, 0),
                extents,
            })
        }
        t if t & (1 << 15) != 0 => {
            let mut c = Cursor(&payload);
            let errno = c.u32().ok_or_else(|| bad("an error chunk needs 6 bytes"))?;
            let mlen = c.u16().ok_or_else(|| bad("an error chunk needs 6 bytes"))? as usize;
            let msg = c
                .take(mlen)
                .ok_or_else(|| bad("the message is longer than the chunk"))?;
            let message = String::from_utf8_lossy(msg).into_owned();
            let offset = if t == chunk::ERROR_OFFSET {
                if c.rest() != 8 {
                    return Err(bad("ERROR_OFFSET ends with an 8-byte offset"));
                }
                c.u64()
            } else {
                None
            };
            Ok(Chunk::Error {
                errno,
                message,
                offset,
            })
        }
        _ => Err(bad("unknown chunk type")),
    }
}
