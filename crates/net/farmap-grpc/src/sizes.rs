//! [`Sizes`]: how large each legitimate message of the service can be, and what a call is
//! charged against the server's memory budget for the memory it may hold.
//!
//! A request is one of three kinds ([`Op`]): a write carries one chunk; a read carries chunk
//! indices (at most `max_batch`, each a varint of at most 10 bytes, packed or not); every
//! other call carries a few integers. Each kind has a limit on its message, checked on the
//! length a message announces before any of it is buffered, so that no request is held
//! beyond what it can legitimately be, and a read's indices are never expanded from more
//! bytes than `max_batch` of them take (a packed zero index is one byte on the wire and eight
//! in a `Vec<u64>`).

use farmap_core::{ChunkIdx, Geometry};

/// tonic's two buffers of a call: 8 KiB to decode its request and 8 KiB to encode its reply,
/// whatever their sizes.
const CALL_BUFFERS: usize = 16 << 10;
/// A write's message beside its data: the chunk index and the tags and length of the data
/// (17 bytes at most).
const WRITE_FRAMING: usize = 64;
/// A message of a call without payload: handshake, flush, trim, status (22 bytes at most).
const SMALL_MESSAGE: usize = 64;
/// A read's message beside its indices: the field's tag and length.
const READ_FRAMING: usize = 16;
/// The most bytes one index takes in a read's message: a varint of 10 bytes, and a tag when
/// the field is not packed.
const INDEX_BYTES: usize = 11;
/// A read's reply per chunk beside its data: tags and lengths, or an error and its sentence.
const CHUNK_REPLY: usize = 512;
/// A reply's framing beside its chunks.
const REPLY_FRAMING: usize = 64;
/// Protobuf and gRPC framing around the chunk payloads of one message, at most.
pub(crate) const FRAMING: usize = 64 << 10;
/// A connection's reserve is at least this (it also fits one single-chunk call of any kind).
const MIN_RESERVE: usize = 1 << 20;

/// The kind of a call, from its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    /// `Read`: chunk indices in, chunks out.
    Read,
    /// `Write`: one chunk in.
    Write,
    /// Every other call (and unknown paths): a few integers each way.
    Small,
}

impl Op {
    /// The kind of the call at `path` (`/farmap.v1.Store/Read`).
    pub(crate) fn of(path: &str) -> Op {
        match path.strip_prefix("/farmap.v1.Store/") {
            Some("Read") => Op::Read,
            Some("Write") => Op::Write,
            _ => Op::Small,
        }
    }

    /// What a request of this kind is called in messages.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Small => "small",
        }
    }
}

/// The sizes of one server's messages and charges (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sizes {
    geometry: Geometry,
    max_batch: usize,
    max_message: usize,
}

impl Sizes {
    /// The sizes of a server over `geometry` that reads at most `max_batch` chunks per call
    /// and sends messages of at most `max_message` bytes (raised to fit one chunk).
    pub(crate) fn new(geometry: Geometry, max_batch: u32, max_message: u32) -> Sizes {
        let one_chunk = geometry.chunk_size() as usize + FRAMING;
        Sizes {
            geometry,
            max_batch: (max_batch as usize).max(1),
            max_message: (max_message as usize).max(one_chunk),
        }
    }

    /// The most chunks one read may ask for.
    pub(crate) fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// The largest message the server sends (a read's reply).
    pub(crate) fn max_message(&self) -> usize {
        self.max_message
    }

    /// The most chunks one read's reply may carry: the batch limit, or what fits a message.
    pub(crate) fn max_read(&self) -> usize {
        let chunk = self.geometry.chunk_size() as usize;
        ((self.max_message - FRAMING) / chunk).clamp(1, self.max_batch)
    }

    /// The largest message a request of `op` may be.
    pub(crate) fn request_limit(&self, op: Op) -> usize {
        match op {
            Op::Read => READ_FRAMING.saturating_add(self.max_batch.saturating_mul(INDEX_BYTES)),
            Op::Write => self.geometry.chunk_size() as usize + WRITE_FRAMING,
            Op::Small => SMALL_MESSAGE,
        }
    }

    /// The largest message of any request: tonic's decoding limit.
    pub(crate) fn largest_request(&self) -> usize {
        [Op::Read, Op::Write, Op::Small]
            .into_iter()
            .map(|op| self.request_limit(op))
            .max()
            .unwrap_or(SMALL_MESSAGE)
    }

    /// What a call of `op` is charged before its request is read: tonic's buffers, its
    /// message at its limit and, for a read, the indices decoded from it (eight bytes each,
    /// at most one per byte of the message).
    pub(crate) fn request_charge(&self, op: Op) -> usize {
        let limit = self.request_limit(op);
        let decoded = match op {
            Op::Read => limit.saturating_mul(8),
            Op::Write | Op::Small => 0,
        };
        CALL_BUFFERS.saturating_add(limit).saturating_add(decoded)
    }

    /// What a read of `chunks` is charged once they are known, for its reply: every chunk
    /// it reads, whole (a chunk read is held whatever its reply carries), and the reply's
    /// framing.
    pub(crate) fn reply_charge(&self, chunks: &[u64]) -> usize {
        chunks.iter().fold(REPLY_FRAMING, |sum, &c| {
            let idx = ChunkIdx(c);
            let data = if self.geometry.contains(idx) {
                self.geometry.chunk_len(idx)
            } else {
                0
            };
            sum.saturating_add(data + CHUNK_REPLY)
        })
    }

    /// The most one call can be charged: a write, or a read of the most chunks a reply
    /// carries.
    pub(crate) fn largest_charge(&self) -> usize {
        let chunk = self.geometry.chunk_size() as usize;
        let read =
            self.request_charge(Op::Read) + REPLY_FRAMING + self.max_read() * (chunk + CHUNK_REPLY);
        read.max(self.request_charge(Op::Write))
    }

    /// A connection's own reserve: enough for any call of one chunk, and at least 1 MiB.
    pub(crate) fn reserve(&self) -> usize {
        let chunk = self.geometry.chunk_size() as usize;
        let one_read = self.request_charge(Op::Read) + REPLY_FRAMING + chunk + CHUNK_REPLY;
        MIN_RESERVE
            .max(one_read)
            .max(self.request_charge(Op::Write))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes(chunk: u64, max_batch: u32, max_message: u32) -> Sizes {
        let g = Geometry::new(64 * chunk + 100, chunk).expect("geometry");
        Sizes::new(g, max_batch, max_message)
    }

    #[test]
    fn calls_are_known_by_their_path() {
        assert_eq!(Op::of("/farmap.v1.Store/Read"), Op::Read);
        assert_eq!(Op::of("/farmap.v1.Store/Write"), Op::Write);
        assert_eq!(Op::of("/farmap.v1.Store/Trim"), Op::Small);
        assert_eq!(Op::of("/other.Service/Read"), Op::Small);
    }

    #[test]
    fn limits_fit_legitimate_messages_and_nothing_larger() {
        use prost::Message;

        use crate::pb;
        let s = sizes(4 << 20, 256, 64 << 20);
        // The largest of each request, encoded, fits its limit.
        let read = pb::ReadRequest {
            chunks: vec![u64::MAX; 256],
        };
        assert!(read.encoded_len() <= s.request_limit(Op::Read));
        let write = pb::WriteRequest {
            chunk: u64::MAX,
            body: Some(pb::write_request::Body::Data(vec![1; 4 << 20].into())),
        };
        assert!(write.encoded_len() <= s.request_limit(Op::Write));
        let trim = pb::TrimRequest {
            start: u64::MAX,
            end: u64::MAX,
        };
        assert!(trim.encoded_len() <= s.request_limit(Op::Small));
        // Reads are small: tonic's limit is one write.
        assert_eq!(s.largest_request(), (4 << 20) + WRITE_FRAMING);
        // A read is charged its indices decoded (at most 8 bytes per byte of its limit): a
        // few tens of KiB.
        assert!(s.request_charge(Op::Read) < 64 << 10);
    }

    #[test]
    fn charges_cover_replies_and_reserves_cover_one_chunk() {
        let s = sizes(1 << 20, 256, (2 << 20) + FRAMING as u32);
        assert_eq!(s.max_read(), 2);
        // The short last chunk is charged its length; a chunk past the end its error.
        let last = 64;
        assert_eq!(
            s.reply_charge(&[0, last, 1000]),
            REPLY_FRAMING + (1 << 20) + 100 + 3 * CHUNK_REPLY
        );
        let two = s.request_charge(Op::Read) + s.reply_charge(&[0, 1]);
        assert!(two <= s.largest_charge());
        let one = s.request_charge(Op::Read) + s.reply_charge(&[0]);
        assert!(one <= s.reserve() && s.request_charge(Op::Write) <= s.reserve());
        assert!(s.reserve() < two, "a reserve is one chunk's call, not more");
        // Small chunks: the reserve is 1 MiB.
        assert_eq!(sizes(4096, 256, 64 << 20).reserve(), MIN_RESERVE);
    }
}
