//! The NBD protocol with no I/O: what `qemu`, `libnbd`, `nbdkit` and the Linux kernel speak.
//!
//! ```text
//!  server side                                   client side
//!  ServerHandshake ── option replies ──────────▶ ClientHandshake
//!    (fixed newstyle: EXPORT_NAME, GO, INFO,       (STARTTLS?, STRUCTURED_REPLY,
//!     LIST, ABORT, STARTTLS, STRUCTURED_REPLY,      SET_META_CONTEXT base:allocation,
//!     LIST/SET_META_CONTEXT base:allocation)       GO, falling back to EXPORT_NAME)
//!  RequestDecoder ◀──────────── requests ─────── RequestHeader::encode
//!  reply::* encoders ── simple / structured ───▶ ReplyDecoder
//! ```
//!
//! Every machine is driven by its caller: it is handed the bytes read so far (a
//! [`bytes::BytesMut`] it consumes from) and a buffer to append the bytes to send to, and
//! says what the caller must do next (read more, upgrade the stream to TLS, enter
//! transmission). Every length read from the peer is checked against a cap before anything
//! is allocated for it; a write payload over the announced maximum is reported at once and
//! then skipped as it arrives, never buffered.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod client;
pub mod consts;
mod cursor;
mod reply;
mod request;
mod server;

pub use client::{ClientConfig, ClientHandshake, ClientHandshakeError, ClientStep, ExportDetails};
pub use reply::{
    block_status_chunk, chunk_header, error_chunk, error_offset_chunk, none_chunk,
    offset_data_header, offset_hole_chunk, simple_reply, Chunk, Extent, Reply, ReplyDecoder,
    ReplyError,
};
pub use request::{Command, Incoming, RequestDecoder, RequestError, RequestHeader};
pub use server::{
    BlockSize, ExportInfo, HandshakeError, Negotiated, ServerConfig, ServerHandshake, ServerStep,
    TlsMode, MAX_OPTION_LEN,
};
