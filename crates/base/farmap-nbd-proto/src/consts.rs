//! The protocol's numbers, as `doc/proto.md` of the NBD project defines them.

/// `NBDMAGIC`: the first eight bytes a newstyle server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: the second eight bytes a newstyle server sends, and the start of every option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Start of every option reply.
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Start of every request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Start of every simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Start of every structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Handshake flag: the server speaks fixed newstyle.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag: the server can leave out the 124 zeros after `NBD_OPT_EXPORT_NAME`.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: the client speaks fixed newstyle.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: leave out the 124 zeros.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Options of the handshake phase.
pub mod opt {
    /// Pick an export and enter transmission (no error reply possible).
    pub const EXPORT_NAME: u32 = 1;
    /// End the session.
    pub const ABORT: u32 = 2;
    /// List the exports.
    pub const LIST: u32 = 3;
    /// Upgrade the connection to TLS.
    pub const STARTTLS: u32 = 5;
    /// Describe an export.
    pub const INFO: u32 = 6;
    /// Describe an export and enter transmission.
    pub const GO: u32 = 7;
    /// Use structured replies.
    pub const STRUCTURED_REPLY: u32 = 8;
    /// List metadata contexts.
    pub const LIST_META_CONTEXT: u32 = 9;
    /// Select metadata contexts.
    pub const SET_META_CONTEXT: u32 = 10;
}

/// Option reply types.
pub mod rep {
    /// Accepted (or: end of a list).
    pub const ACK: u32 = 1;
    /// One export of a list.
    pub const SERVER: u32 = 2;
    /// One piece of information about an export.
    pub const INFO: u32 = 3;
    /// One metadata context.
    pub const META_CONTEXT: u32 = 4;
    /// Errors have the high bit set.
    pub const ERR: u32 = 1 << 31;
    /// Unknown option.
    pub const ERR_UNSUP: u32 = ERR + 1;
    /// Refused by policy.
    pub const ERR_POLICY: u32 = ERR + 2;
    /// Malformed or not allowed now.
    pub const ERR_INVALID: u32 = ERR + 3;
    /// Not on this platform.
    pub const ERR_PLATFORM: u32 = ERR + 4;
    /// TLS must be started first.
    pub const ERR_TLS_REQD: u32 = ERR + 5;
    /// No such export.
    pub const ERR_UNKNOWN: u32 = ERR + 6;
    /// The server is shutting down.
    pub const ERR_SHUTDOWN: u32 = ERR + 7;
    /// The client must ask for block sizes.
    pub const ERR_BLOCK_SIZE_REQD: u32 = ERR + 8;
    /// Too large.
    pub const ERR_TOO_BIG: u32 = ERR + 9;
}

/// Information types of `NBD_REP_INFO`.
pub mod info {
    /// Size and transmission flags.
    pub const EXPORT: u16 = 0;
    /// Canonical name.
    pub const NAME: u16 = 1;
    /// Description for humans.
    pub const DESCRIPTION: u16 = 2;
    /// Minimum, preferred and maximum block sizes.
    pub const BLOCK_SIZE: u16 = 3;
}

/// Transmission flags (sent with the export's size).
pub mod tflag {
    /// Always set.
    pub const HAS_FLAGS: u16 = 1 << 0;
    /// Writes are refused.
    pub const READ_ONLY: u16 = 1 << 1;
    /// `NBD_CMD_FLUSH` is understood.
    pub const SEND_FLUSH: u16 = 1 << 2;
    /// `NBD_CMD_FLAG_FUA` is understood.
    pub const SEND_FUA: u16 = 1 << 3;
    /// The medium is rotational.
    pub const ROTATIONAL: u16 = 1 << 4;
    /// `NBD_CMD_TRIM` is understood.
    pub const SEND_TRIM: u16 = 1 << 5;
    /// `NBD_CMD_WRITE_ZEROES` (and `NO_HOLE`) is understood.
    pub const SEND_WRITE_ZEROES: u16 = 1 << 6;
    /// `NBD_CMD_FLAG_DF` is understood.
    pub const SEND_DF: u16 = 1 << 7;
    /// Flushes cover writes made on any connection.
    pub const CAN_MULTI_CONN: u16 = 1 << 8;
    /// `NBD_CMD_CACHE` is understood.
    pub const SEND_CACHE: u16 = 1 << 10;
    /// `NBD_CMD_FLAG_FAST_ZERO` is understood.
    pub const SEND_FAST_ZERO: u16 = 1 << 11;
}

/// Command types.
pub mod cmd {
    /// Read.
    pub const READ: u16 = 0;
    /// Write (a payload follows the header).
    pub const WRITE: u16 = 1;
    /// Disconnect (no reply).
    pub const DISC: u16 = 2;
    /// Make completed writes durable.
    pub const FLUSH: u16 = 3;
    /// Discard.
    pub const TRIM: u16 = 4;
    /// Prefetch.
    pub const CACHE: u16 = 5;
    /// Write zeros without a payload.
    pub const WRITE_ZEROES: u16 = 6;
    /// Query metadata (`base:allocation`).
    pub const BLOCK_STATUS: u16 = 7;
}

/// Command flags.
pub mod cflag {
    /// Force unit access: persisted before the reply.
    pub const FUA: u16 = 1 << 0;
    /// `WRITE_ZEROES`: do not punch a hole.
    pub const NO_HOLE: u16 = 1 << 1;
    /// `READ`: one content chunk only.
    pub const DF: u16 = 1 << 2;
    /// `BLOCK_STATUS`: one extent only.
    pub const REQ_ONE: u16 = 1 << 3;
    /// `WRITE_ZEROES`: fail with `ENOTSUP` unless fast.
    pub const FAST_ZERO: u16 = 1 << 4;
}

/// Structured reply flag: the last chunk of a reply.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;

/// Structured reply chunk types.
pub mod chunk {
    /// No payload; ends a reply.
    pub const NONE: u16 = 0;
    /// Data at an offset.
    pub const OFFSET_DATA: u16 = 1;
    /// Zeros at an offset.
    pub const OFFSET_HOLE: u16 = 2;
    /// Extents of one metadata context.
    pub const BLOCK_STATUS: u16 = 5;
    /// An error.
    pub const ERROR: u16 = (1 << 15) + 1;
    /// An error at an offset.
    pub const ERROR_OFFSET: u16 = (1 << 15) + 2;
}

/// Error values of replies.
pub mod errno {
    /// Operation not permitted (a write to a read-only export).
    pub const EPERM: u32 = 1;
    /// I/O error.
    pub const EIO: u32 = 5;
    /// Out of memory.
    pub const ENOMEM: u32 = 12;
    /// Invalid argument (bad range, unknown command or flag).
    pub const EINVAL: u32 = 22;
    /// No space left (a write past the end).
    pub const ENOSPC: u32 = 28;
    /// Value too large.
    pub const EOVERFLOW: u32 = 75;
    /// Not supported (a fast zero that cannot be fast).
    pub const ENOTSUP: u32 = 95;
    /// The server is shutting down.
    pub const ESHUTDOWN: u32 = 108;
}

/// `base:allocation` state flag: not allocated.
pub const STATE_HOLE: u32 = 1 << 0;
/// `base:allocation` state flag: reads as zeros.
pub const STATE_ZERO: u32 = 1 << 1;

/// The one metadata context this implementation knows.
pub const BASE_ALLOCATION: &str = "base:allocation";

/// The longest string (export name, description, message) the protocol allows.
pub const MAX_STRING: usize = 4096;
/// The payload size every server should accept and every client may send (32 MiB).
pub const DEFAULT_MAX_PAYLOAD: u32 = 1 << 25;
/// Bytes of a request header.
pub const REQUEST_LEN: usize = 28;
/// Bytes of a simple reply header.
pub const SIMPLE_REPLY_LEN: usize = 16;
/// Bytes of a structured reply chunk header.
pub const CHUNK_HEADER_LEN: usize = 20;
