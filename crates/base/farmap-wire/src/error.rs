//! Why bytes from a peer are not a valid farmap message.

use farmap_core::GeometryError;

/// Why a handshake or a frame could not be decoded. Every variant means the peer does not
/// speak this protocol correctly: the connection should be closed (after an error reply where
/// the stream still allows one).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The stream does not start with the farmap magic bytes.
    #[error("the peer does not speak the farmap protocol (it sent {found:02x?} instead of the farmap magic bytes)")]
    BadMagic {
        /// The first eight bytes received.
        found: [u8; 8],
    },
    /// A hello carried protocol version 0, which is never valid.
    #[error("protocol version 0 is invalid")]
    ZeroVersion,
    /// A server hello with a status byte that is neither "accepted" nor "refused".
    #[error("the server's hello has an unknown status {0}")]
    BadHelloStatus(u8),
    /// A server hello whose body is longer than any hello may be.
    #[error("the server's hello announces a body of {len} bytes, more than the limit of {max}")]
    HelloTooLarge {
        /// Body length announced.
        len: u32,
        /// The limit.
        max: u32,
    },
    /// A frame announces more bytes than the receiver accepts.
    #[error("a frame of {len} bytes exceeds the limit of {max} bytes")]
    FrameTooLarge {
        /// Whole frame length announced, header included.
        len: u64,
        /// The receiver's limit.
        max: u32,
    },
    /// A frame length too short to hold the frame header.
    #[error("a frame length of {len} bytes is shorter than the frame header")]
    FrameTooShort {
        /// The length field as received.
        len: u32,
    },
    /// Op code 0, which is never valid.
    #[error("op code 0 is invalid")]
    ZeroOp,
    /// An op code this version does not know.
    #[error("unknown op code {0:#04x}")]
    UnknownOp(u8),
    /// A request (or a reply other than a connection-level error) with id 0.
    #[error("request id 0 is only valid for connection-level errors (op {op:#04x})")]
    ZeroId {
        /// The op code of the frame.
        op: u8,
    },
    /// A read request or reply for no chunk at all.
    #[error("a read batch must name at least one chunk")]
    EmptyBatch,
    /// A read request or reply for more chunks than allowed.
    #[error("a read batch of {count} chunks exceeds the limit of {max}")]
    BatchTooLarge {
        /// Chunks announced.
        count: u32,
        /// The limit.
        max: u32,
    },
    /// A chunk payload longer than any chunk can be.
    #[error("a chunk payload of {len} bytes exceeds the largest chunk size, {max} bytes")]
    ChunkTooLarge {
        /// Payload length announced.
        len: u32,
        /// The largest chunk size.
        max: u32,
    },
    /// A fixed-size body of the wrong length.
    #[error("a {op} frame must have a body of {expected} bytes, not {len}")]
    BodyLength {
        /// The frame's op name.
        op: &'static str,
        /// Body length received.
        len: usize,
        /// Body length required.
        expected: usize,
    },
    /// A variable-size body that ends before its content does.
    #[error("a {op} frame ends in the middle of its content")]
    Truncated {
        /// The frame's op name.
        op: &'static str,
    },
    /// A variable-size body with bytes left after its content.
    #[error("a {op} frame has {extra} bytes after its content")]
    TrailingBytes {
        /// The frame's op name.
        op: &'static str,
        /// Bytes left over.
        extra: usize,
    },
    /// Flag bits this version does not define.
    #[error("unknown flag bits {flags:#04x} in a {op} frame")]
    BadFlags {
        /// The frame's op name.
        op: &'static str,
        /// The flags byte.
        flags: u8,
    },
    /// A chunk status code that is not zero, data or unknown.
    #[error("unknown chunk status code {0}")]
    BadStatus(u8),
    /// A trim range whose start lies after its end.
    #[error("trim range {start}..{end} is inverted")]
    BadRange {
        /// First chunk.
        start: u64,
        /// One past the last chunk.
        end: u64,
    },
    /// A run read whose chunks would pass chunk index 2^64.
    #[error("a run read of {count} chunks from chunk {start} passes the largest chunk index")]
    RunOverflow {
        /// First chunk.
        start: u64,
        /// Chunks asked for.
        count: u32,
    },
    /// An error message longer than allowed.
    #[error("an error message of {len} bytes exceeds the limit of {max}")]
    MessageTooLong {
        /// Message length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// An object key or folder that is empty, longer than [`MAX_KEY`](crate::MAX_KEY) bytes,
    /// or not UTF-8.
    #[error(
        "a {op} frame names an object key of {len} bytes that is empty, too long or not UTF-8"
    )]
    BadKey {
        /// The frame's op name.
        op: &'static str,
        /// The key's length.
        len: usize,
    },
    /// The server announced a region geometry that is not valid.
    #[error("the server announced an invalid region geometry")]
    BadGeometry(#[source] GeometryError),
    /// The server announced a limit outside what this version accepts.
    #[error("the server announced a {what} of {value}, outside {min}..={max}")]
    BadLimit {
        /// Which limit.
        what: &'static str,
        /// Its value.
        value: u64,
        /// The smallest acceptable value.
        min: u64,
        /// The largest acceptable value.
        max: u64,
    },
}
