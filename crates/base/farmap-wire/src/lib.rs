//! farmap's data-plane protocol: a versioned handshake, then length-prefixed frames with
//! request ids, so that many requests are in flight on one connection and replies may come
//! back in any order. This crate only turns messages into bytes and back; it does no I/O (the
//! `farmap-net` crate moves the bytes), so it can be fuzzed and tested in isolation.
//!
//! Every integer is big-endian. Zero is never a valid version, op code or request id (id 0
//! is reserved for a connection-level error from the server). Every length read from the peer
//! is checked against a cap before anything is allocated: the frame length against the
//! receiver's [`Limits::max_frame`], batch counts against [`Limits::max_batch`], chunk payloads
//! against [`MAX_CHUNK_SIZE`](farmap_core::MAX_CHUNK_SIZE), messages against [`MAX_MESSAGE`].
//!
//! # Handshake
//!
//! The client speaks first; the layout of its hello is the same for every version.
//!
//! | offset | bytes | client hello |
//! |---:|---:|---|
//! | 0 | 8 | magic `89 46 41 52 4d 41 50 0a` (`\x89FARMAP\n`) |
//! | 8 | 2 | protocol version (≥ 1; this crate speaks [`VERSION`]) |
//! | 10 | 2 | reserved, sent as 0, ignored |
//! | 12 | 4 | feature bits asked for ([`Features`]) |
//!
//! | offset | bytes | server hello |
//! |---:|---:|---|
//! | 0 | 8 | magic |
//! | 8 | 2 | protocol version of the server (≥ 1) |
//! | 10 | 1 | status: 1 accepted, 2 refused |
//! | 11 | 1 | reserved, 0 |
//! | 12 | 4 | body length *B* (≤ [`MAX_HELLO_BODY`]) |
//! | 16 | *B* | body, below |
//!
//! | accepted body | bytes | |
//! |---|---:|---|
//! | features granted | 4 | a subset of those asked for |
//! | region size | 8 | bytes |
//! | chunk size | 4 | a power of two, 4 KiB..4 MiB |
//! | caps | 4 | bit 0 write, 1 flush, 2 trim, 3 status, 4 parallel |
//! | flags | 4 | bit 0: served read-only |
//! | max frame | 4 | largest frame either side may send, header included |
//! | max in flight | 4 | requests the server works on at once per connection |
//! | max batch | 4 | chunks per read request |
//! | (later fields) | | ignored by this version |
//!
//! | refused body | bytes | |
//! |---|---:|---|
//! | oldest version spoken | 2 | |
//! | newest version spoken | 2 | |
//! | error kind | 1 | code as in error replies |
//! | message | rest | UTF-8, ≤ [`MAX_MESSAGE`] bytes |
//!
//! A server that does not speak the client's version answers with a refusal naming both and
//! closes the connection; so does a server at its connection limit.
//!
//! # Frames
//!
//! | offset | bytes | frame header |
//! |---:|---:|---|
//! | 0 | 4 | length of the rest of the frame (op + id + body); 4 + length ≤ max frame |
//! | 4 | 1 | op code |
//! | 5 | 8 | request id (replies carry their request's id) |
//! | 13 | | body |
//!
//! | op | name | body |
//! |---:|---|---|
//! | `01` | read | count u32 (1..=max batch), then count × chunk index u64 |
//! | `02` | write | chunk index u64, flags u8 (bit 0: zero chunk, no payload), payload (rest) |
//! | `03` | flush | empty |
//! | `04` | trim | start u64, end u64 (start ≤ end; chunks start..end) |
//! | `05` | status | chunk index u64 |
//! | `06` | geometry | empty |
//! | `07` | run read | first chunk u64, count u32 (1..=[`MAX_RUN_LIMIT`]); feature [`Features::RUN_READS`] |
//! | `08` | object get | key (rest; 1..=[`MAX_KEY`] bytes of UTF-8); feature [`Features::OBJECTS`], as `09`..`0c` |
//! | `09` | object exists | key (rest) |
//! | `0a` | object create | key length u16, key, the object's bytes (rest) |
//! | `0b` | object list | folder length u16, folder, the name to list after (rest; empty: from the first) |
//! | `0c` | object delete | key (rest) |
//! | `81` | read reply | count u32, then per chunk in request order: flags u8 (bit 0: zero chunk), and unless zero a length u32 and that many bytes |
//! | `82` | done | empty (reply to write, flush, trim) |
//! | `85` | status reply | status u8: 1 zero, 2 data, 3 unknown |
//! | `86` | geometry reply | size u64, chunk size u32, caps u32, flags u32 (as in the hello) |
//! | `87` | run read reply | count u32, data length *D* u32, zero bitmap ⌈count / 8⌉ bytes (bit *i* % 8 of byte *i* / 8 set: chunk *i* is zero; bits past count are 0), then *D* bytes: the other chunks, in order |
//! | `88` | object data reply | flag u8 (1: the object exists), then its bytes (rest; none when the flag is 0) |
//! | `89` | object yes-or-no reply | u8: 1 yes (exists; created by this request), 0 no |
//! | `8b` | object names reply | more u8 (1: ask again after the last name), count u32 (≤ [`MAX_NAMES`]), then count × (length u16, name) |
//! | `ff` | error reply | error kind u8, message UTF-8 (rest, ≤ [`MAX_MESSAGE`] bytes) |
//!
//! Error kind codes: 1 I/O, 2 not found, 3 out of range, 4 invalid input, 5 timeout,
//! 6 unavailable, 7 corrupt, 8 closed, 9 read-only, 10 unsupported, 11 permission denied,
//! 12 no space, 13 cancelled; a code the receiver does not know means I/O error.
//!
//! Chunks that read as zeros travel as a flag (in read replies, as a bit in run read replies,
//! and in writes when the [`Features::ZERO_WRITES`] feature was granted), never as payload.
//! A client sends a run read only when the server granted [`Features::RUN_READS`]; older
//! servers do not grant it and are read chunk by chunk.
//!
//! A server exports either a region or named objects (a versioned layout's store: `farmap
//! serve --objects`). An objects client asks for [`Features::OBJECTS`] and refuses a server
//! that does not grant it (a region server never does); an objects server refuses a client
//! that did not ask for it. The region in its hello then means nothing. Keys are checked by
//! the server before it touches anything: a peer never names a path.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod codes;
mod error;
mod frame;
mod hello;

pub use codes::{
    caps_from_bits, caps_to_bits, kind_from_code, kind_to_code, status_from_code, status_to_code,
    Features,
};
pub use error::WireError;
pub use frame::{
    op, read_reply_overhead, run_reply_overhead, Frame, FrameDecoder, Limits, Message, Payload,
    RegionInfo, RemoteError, RunData, DEFAULT_MAX_BATCH, DEFAULT_MAX_FRAME, HEADER_LEN,
    MAX_BATCH_LIMIT, MAX_FRAME_LIMIT, MAX_KEY, MAX_MESSAGE, MAX_NAMES, MAX_OBJECT, MAX_RUN_LIMIT,
    ZERO_COPY_MIN,
};
pub use hello::{
    decode_client_hello, decode_server_hello, ClientHello, Refusal, ServerHello, ServerInfo,
    CHALLENGE_LABEL, CHALLENGE_LEN, CLIENT_HELLO_LEN, MAGIC, MAX_HELLO_BODY, MAX_IN_FLIGHT_LIMIT,
    SERVER_HELLO_HEADER_LEN, VERSION,
};
