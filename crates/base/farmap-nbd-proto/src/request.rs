//! Requests of the transmission phase: the header, its encoder, and the server's decoder.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::consts::{cmd, REQUEST_LEN, REQUEST_MAGIC};
use crate::cursor::{be16, be32, be64};

/// A command type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Command {
    /// `NBD_CMD_READ`.
    Read,
    /// `NBD_CMD_WRITE` (a payload of `length` bytes follows).
    Write,
    /// `NBD_CMD_DISC`.
    Disc,
    /// `NBD_CMD_FLUSH`.
    Flush,
    /// `NBD_CMD_TRIM`.
    Trim,
    /// `NBD_CMD_CACHE`.
    Cache,
    /// `NBD_CMD_WRITE_ZEROES`.
    WriteZeroes,
    /// `NBD_CMD_BLOCK_STATUS`.
    BlockStatus,
    /// Anything else (answered with `EINVAL`).
    Other(u16),
}

impl Command {
    /// The command of a type number.
    pub fn from_code(code: u16) -> Self {
        match code {
            cmd::READ => Command::Read,
            cmd::WRITE => Command::Write,
            cmd::DISC => Command::Disc,
            cmd::FLUSH => Command::Flush,
            cmd::TRIM => Command::Trim,
            cmd::CACHE => Command::Cache,
            cmd::WRITE_ZEROES => Command::WriteZeroes,
            cmd::BLOCK_STATUS => Command::BlockStatus,
            other => Command::Other(other),
        }
    }

    /// Its type number.
    pub fn code(self) -> u16 {
        match self {
            Command::Read => cmd::READ,
            Command::Write => cmd::WRITE,
            Command::Disc => cmd::DISC,
            Command::Flush => cmd::FLUSH,
            Command::Trim => cmd::TRIM,
            Command::Cache => cmd::CACHE,
            Command::WriteZeroes => cmd::WRITE_ZEROES,
            Command::BlockStatus => cmd::BLOCK_STATUS,
            Command::Other(c) => c,
        }
    }
}

/// The 28-byte header of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    /// Command flags ([`cflag`](crate::consts::cflag)).
    pub flags: u16,
    /// The command.
    pub command: Command,
    /// The client's opaque identifier, echoed in the reply.
    pub cookie: u64,
    /// Byte offset in the export.
    pub offset: u64,
    /// Length in bytes (of the payload, for a write).
    pub length: u32,
}

impl RequestHeader {
    /// Appends the header's 28 bytes.
    pub fn encode(&self, out: &mut BytesMut) {
        out.put_u32(REQUEST_MAGIC);
        out.put_u16(self.flags);
        out.put_u16(self.command.code());
        out.put_u64(self.cookie);
        out.put_u64(self.offset);
        out.put_u32(self.length);
    }

    /// The header's 28 bytes.
    pub fn to_bytes(&self) -> [u8; REQUEST_LEN] {
        let mut b = BytesMut::with_capacity(REQUEST_LEN);
        self.encode(&mut b);
        let mut a = [0u8; REQUEST_LEN];
        a.copy_from_slice(&b);
        a
    }
}

/// One request as the server's decoder delivers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Incoming {
    /// A complete request; `payload` holds a write's bytes and is empty for every other
    /// command.
    Request {
        /// The header.
        header: RequestHeader,
        /// The write payload.
        payload: Bytes,
    },
    /// A write whose payload is longer than the maximum: the payload is being skipped as
    /// it arrives (never buffered); the request must be answered with an error.
    Oversized(RequestHeader),
}

/// Why the request stream cannot be decoded any further (the connection must close).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RequestError {
    /// A request did not start with the request magic.
    #[error("the client sent {found:#010x} where a request's magic 0x25609513 belongs")]
    BadMagic {
        /// The four bytes found.
        found: u32,
    },
}

#[derive(Debug)]
enum State {
    Header,
    Payload(RequestHeader),
    Discard(u64),
}

/// Decodes the requests a client sends, incrementally.
///
/// A write's payload up to `max_payload` bytes is delivered with its header once it has all
/// arrived; a longer one is reported as [`Incoming::Oversized`] as soon as its header is
/// read, and its bytes are then dropped as they come in.
#[derive(Debug)]
pub struct RequestDecoder {
    max_payload: u32,
    state: State,
}

impl RequestDecoder {
    /// A decoder that accepts write payloads of up to `max_payload` bytes.
    pub fn new(max_payload: u32) -> Self {
        Self {
            max_payload,
            state: State::Header,
        }
    }

    /// The length of a write payload whose header has been decoded and whose bytes have not
    /// all arrived yet (what the input buffer must grow to hold).
    pub fn awaiting_payload(&self) -> Option<u32> {
        match self.state {
            State::Payload(h) => Some(h.length),
            _ => None,
        }
    }

    /// The next request, `None` when more bytes are needed.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Incoming>, RequestError> {
        loop {
            match self.state {
                State::Discard(remaining) => {
                    let n = remaining.min(buf.len() as u64);
                    buf.advance(n as usize);
                    if n < remaining {
                        self.state = State::Discard(remaining - n);
                        return Ok(None);
                    }
                    self.state = State::Header;
                }
                State::Payload(header) => {
                    let len = header.length as usize;
                    if buf.len() < len {
                        return Ok(None);
                    }
                    self.state = State::Header;
                    let payload = buf.split_to(len).freeze();
                    return Ok(Some(Incoming::Request { header, payload }));
                }
                State::Header => {
                    if buf.len() < REQUEST_LEN {
                        return Ok(None);
                    }
                    let magic = be32(buf, 0);
                    if magic != REQUEST_MAGIC {
                        return Err(RequestError::BadMagic { found: magic });
                    }
                    let header = RequestHeader {
                        flags: be16(buf, 4),
                        command: Command::from_code(be16(buf, 6)),
                        cookie: be64(buf, 8),
                        offset: be64(buf, 16),
                        length: be32(buf, 24),
                    };
                    buf.advance(REQUEST_LEN);
                    if header.command != Command::Write {
                        return Ok(Some(Incoming::Request {
                            header,
                            payload: Bytes::new(),
                        }));
                    }
                    if header.length > self.max_payload {
                        self.state = State::Discard(header.length.into());
                        return Ok(Some(Incoming::Oversized(header)));
                    }
                    self.state = State::Payload(header);
                }
            }
        }
    }
}
