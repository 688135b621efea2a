//! Frames: requests and replies after the handshake, their encoder and incremental decoder.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use farmap_core::{Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, MAX_CHUNK_SIZE};

use crate::codes::{
    caps_from_bits, caps_to_bits, kind_from_code, kind_to_code, status_from_code, status_to_code,
};
use crate::WireError;

/// Bytes of the frame header: length (4), op (1), id (8).
pub const HEADER_LEN: usize = 13;
/// Longest error message carried by an error reply, in bytes (longer ones are cut).
pub const MAX_MESSAGE: usize = 1024;
/// Default frame limit: room for a batch of 4 MiB chunks, or 256 chunks of 64 KiB.
pub const DEFAULT_MAX_FRAME: u32 = 16 << 20;
/// The largest frame limit any peer may announce.
pub const MAX_FRAME_LIMIT: u32 = 64 << 20;
/// Default number of chunks in one read batch.
pub const DEFAULT_MAX_BATCH: u32 = 256;
/// The largest read batch any peer may announce.
pub const MAX_BATCH_LIMIT: u32 = 4096;

/// Most chunks in one run read ([`Message::ReadRun`]): a run of the smallest chunks (4 KiB)
/// that fills the largest frame any peer may announce.
pub const MAX_RUN_LIMIT: u32 = MAX_FRAME_LIMIT / 4096;

/// Longest object key (or folder) in an objects request, in bytes (as `check_key` allows).
pub const MAX_KEY: usize = 1024;
/// Largest object an objects export stores or serves: every object of the versioned layout
/// fits (as it fits a CQL object: chunks, pages, manifests, working sets).
pub const MAX_OBJECT: usize = 8 << 20;
/// Most names in one list reply ([`Message::ObjNames`]); a longer folder takes more replies.
pub const MAX_NAMES: u32 = 65536;

/// Payloads of at least this many bytes are separate pieces in [`Frame::encode_parts`].
pub const ZERO_COPY_MIN: usize = 8 * 1024;

/// Flag of a chunk in a write request or a read reply: the chunk reads as zeros and carries
/// no payload.
const FLAG_ZERO: u8 = 1;

/// Op codes. `0` is never valid; replies have the high bit set.
pub mod op {
    /// Read a batch of chunks.
    pub const READ: u8 = 0x01;
    /// Write one chunk.
    pub const WRITE: u8 = 0x02;
    /// Make completed writes durable.
    pub const FLUSH: u8 = 0x03;
    /// Make a range of chunks read as zeros.
    pub const TRIM: u8 = 0x04;
    /// What the store knows about a chunk.
    pub const STATUS: u8 = 0x05;
    /// The region's geometry and capabilities.
    pub const GEOMETRY: u8 = 0x06;
    /// Read a run of contiguous chunks (feature [`RUN_READS`](crate::Features::RUN_READS)).
    pub const READ_RUN: u8 = 0x07;
    /// Read an object (feature [`OBJECTS`](crate::Features::OBJECTS), as the next four).
    pub const OBJ_GET: u8 = 0x08;
    /// Whether an object exists.
    pub const OBJ_EXISTS: u8 = 0x09;
    /// Create an object unless it exists.
    pub const OBJ_CREATE: u8 = 0x0a;
    /// The names in a folder of objects.
    pub const OBJ_LIST: u8 = 0x0b;
    /// Remove an object.
    pub const OBJ_DELETE: u8 = 0x0c;
    /// Reply to `READ`: the chunks, in request order.
    pub const READ_OK: u8 = 0x81;
    /// Reply to `WRITE`, `FLUSH` and `TRIM`: done.
    pub const DONE: u8 = 0x82;
    /// Reply to `STATUS`.
    pub const STATUS_OK: u8 = 0x85;
    /// Reply to `GEOMETRY`.
    pub const GEOMETRY_OK: u8 = 0x86;
    /// Reply to `READ_RUN`: a bitmap of zero chunks and the other chunks' bytes.
    pub const READ_RUN_OK: u8 = 0x87;
    /// Reply to `OBJ_GET`: the object, or none.
    pub const OBJ_DATA: u8 = 0x88;
    /// Reply to `OBJ_EXISTS` and `OBJ_CREATE`: yes or no.
    pub const OBJ_BOOL: u8 = 0x89;
    /// Reply to `OBJ_LIST`: names, and whether more follow.
    pub const OBJ_NAMES: u8 = 0x8b;
    /// Reply to any request that failed; with id 0, the connection is being closed.
    pub const ERROR: u8 = 0xff;
}

/// The content of one chunk on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Payload {
    /// The chunk reads as zeros; no bytes travel (the receiver knows its length from the
    /// geometry).
    Zero,
    /// The chunk's bytes.
    Data(Bytes),
}

/// The chunks of a run read: which are zero (no bytes travel for them), and the bytes of the
/// others, concatenated in order, held as pieces of any sizes (a sender hands slices of the
/// buffers it read into, without copying; a receiver gets one piece).
#[derive(Debug, Clone)]
pub struct RunData {
    count: u32,
    /// Bit `i % 8` of byte `i / 8`: chunk `i` of the run is zero.
    zeros: Bytes,
    pieces: Vec<Bytes>,
    data_len: usize,
}

impl RunData {
    /// A run of `zero.len()` chunks (1..=[`MAX_RUN_LIMIT`]), `zero[i]` telling whether chunk
    /// `i` is zero; `pieces` are the bytes of the others, concatenated in order.
    ///
    /// # Panics
    /// If the run is empty or longer than [`MAX_RUN_LIMIT`], or the data exceeds `u32::MAX`
    /// bytes.
    pub fn new(zero: &[bool], pieces: Vec<Bytes>) -> RunData {
        assert!(
            !zero.is_empty() && zero.len() <= MAX_RUN_LIMIT as usize,
            "a run has 1..={MAX_RUN_LIMIT} chunks"
        );
        let mut bits = vec![0u8; zero.len().div_ceil(8)];
        for (i, z) in zero.iter().enumerate() {
            if *z {
                bits[i / 8] |= 1 << (i % 8);
            }
        }
        let pieces: Vec<Bytes> = pieces.into_iter().filter(|p| !p.is_empty()).collect();
        let data_len = pieces.iter().map(Bytes::len).sum();
        assert!(u32::try_from(data_len).is_ok(), "a run's data fits a u32");
        RunData {
            count: zero.len() as u32,
            zeros: Bytes::from(bits),
            pieces,
            data_len,
        }
    }

    /// Chunks in the run.
    pub fn count(&self) -> usize {
        self.count as usize
    }

    /// Whether chunk `i` of the run is zero (false past the run).
    pub fn is_zero(&self, i: usize) -> bool {
        i < self.count() && self.zeros[i / 8] & (1 << (i % 8)) != 0
    }

    /// Bytes of the chunks that are not zero (what travels besides the bitmap).
    pub fn data_len(&self) -> usize {
        self.data_len
    }

    /// The bytes of the chunks that are not zero, as pieces.
    pub fn pieces(&self) -> &[Bytes] {
        &self.pieces
    }

    /// The bytes of the chunks that are not zero, in one buffer (copied only if they are in
    /// several pieces).
    pub fn data(&self) -> Bytes {
        match &self.pieces[..] {
            [] => Bytes::new(),
            [one] => one.clone(),
            many => Bytes::from(many.concat()),
        }
    }
}

impl PartialEq for RunData {
    fn eq(&self, other: &RunData) -> bool {
        self.count == other.count && self.zeros == other.zeros && self.data() == other.data()
    }
}

impl Eq for RunData {}

/// The region a server serves, as announced in its hello and in geometry replies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionInfo {
    /// Size and chunk size.
    pub geometry: Geometry,
    /// What the served store can do (without `WRITE` and `TRIM` when served read-only).
    pub caps: Caps,
    /// Whether the server refuses writes and trims.
    pub read_only: bool,
}

/// An error reply: the kind, for the client to act on, and a sentence for people.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteError {
    /// What went wrong.
    pub kind: ErrorKind,
    /// What the server said (at most [`MAX_MESSAGE`] bytes travel).
    pub message: String,
}

/// A request or a reply.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Message {
    /// Read these chunks (at least one, at most the server's batch limit).
    Read(Vec<ChunkIdx>),
    /// Replace one chunk.
    Write {
        /// The chunk.
        idx: ChunkIdx,
        /// Its new content.
        data: Payload,
    },
    /// Make completed writes durable.
    Flush,
    /// Make these chunks read as zeros.
    Trim(ChunkRange),
    /// What the store knows about a chunk.
    Status(ChunkIdx),
    /// The region's geometry and capabilities.
    Geometry,
    /// Read chunks `start..start + count` (`count` from 1 to [`MAX_RUN_LIMIT`]; feature
    /// [`RUN_READS`](crate::Features::RUN_READS)).
    ReadRun {
        /// The first chunk.
        start: ChunkIdx,
        /// How many.
        count: u32,
    },
    /// The object named by the key (feature [`OBJECTS`](crate::Features::OBJECTS)).
    ObjGet(String),
    /// Whether the object named by the key exists.
    ObjExists(String),
    /// Create an object unless one of that name exists (answered with
    /// [`ObjBool`](Message::ObjBool): whether this request created it).
    ObjCreate {
        /// Its name.
        key: String,
        /// Its bytes.
        data: Bytes,
    },
    /// The names directly under a folder, ascending, from after `after` (empty: from the
    /// first).
    ObjList {
        /// The folder.
        dir: String,
        /// The last name of the previous reply, or empty.
        after: String,
    },
    /// Remove the object named by the key (answered with [`Done`](Message::Done)).
    ObjDelete(String),
    /// The chunks of a run read.
    ReadRunOk(RunData),
    /// An object's bytes, `None` when there is no such object.
    ObjData(Option<Bytes>),
    /// Whether an object exists, or whether a create created it.
    ObjBool(bool),
    /// Names in a folder (at most [`MAX_NAMES`]), and whether more follow (ask again from
    /// the last).
    ObjNames {
        /// The names, ascending.
        names: Vec<String>,
        /// Whether the folder has names after these.
        more: bool,
    },
    /// The chunks of a read, in request order.
    ReadOk(Vec<Payload>),
    /// A write, flush or trim is done.
    Done,
    /// The status of a chunk.
    StatusOk(ChunkStatus),
    /// The region.
    GeometryOk(RegionInfo),
    /// The request failed (or, with frame id 0, the connection is being closed).
    Error(RemoteError),
}

impl Message {
    /// The op code of this message.
    pub fn op(&self) -> u8 {
        match self {
            Message::Read(_) => op::READ,
            Message::Write { .. } => op::WRITE,
            Message::Flush => op::FLUSH,
            Message::Trim(_) => op::TRIM,
            Message::Status(_) => op::STATUS,
            Message::Geometry => op::GEOMETRY,
            Message::ReadRun { .. } => op::READ_RUN,
            Message::ObjGet(_) => op::OBJ_GET,
            Message::ObjExists(_) => op::OBJ_EXISTS,
            Message::ObjCreate { .. } => op::OBJ_CREATE,
            Message::ObjList { .. } => op::OBJ_LIST,
            Message::ObjDelete(_) => op::OBJ_DELETE,
            Message::ReadRunOk(_) => op::READ_RUN_OK,
            Message::ObjData(_) => op::OBJ_DATA,
            Message::ObjBool(_) => op::OBJ_BOOL,
            Message::ObjNames { .. } => op::OBJ_NAMES,
            Message::ReadOk(_) => op::READ_OK,
            Message::Done => op::DONE,
            Message::StatusOk(_) => op::STATUS_OK,
            Message::GeometryOk(_) => op::GEOMETRY_OK,
            Message::Error(_) => op::ERROR,
        }
    }

    /// Whether this is a request (sent by clients) rather than a reply.
    pub fn is_request(&self) -> bool {
        self.op() & 0x80 == 0
    }

    fn body_len(&self) -> usize {
        match self {
            Message::Read(chunks) => 4 + 8 * chunks.len(),
            Message::Write { data, .. } => 9 + payload_len(data),
            Message::Flush | Message::Geometry | Message::Done => 0,
            Message::Trim(_) => 16,
            Message::Status(_) => 8,
            Message::ReadRun { .. } => 12,
            Message::ObjGet(k) | Message::ObjExists(k) | Message::ObjDelete(k) => k.len(),
            Message::ObjCreate { key, data } => 2 + key.len() + data.len(),
            Message::ObjList { dir, after } => 2 + dir.len() + after.len(),
            Message::ObjData(d) => 1 + d.as_ref().map_or(0, Bytes::len),
            Message::ObjBool(_) => 1,
            Message::ObjNames { names, .. } => 5 + names.iter().map(|n| 2 + n.len()).sum::<usize>(),
            Message::ReadRunOk(run) => 8 + run.zeros.len() + run.data_len,
            Message::ReadOk(chunks) => {
                4 + chunks
                    .iter()
                    .map(|c| {
                        1 + if let Payload::Data(d) = c {
                            4 + d.len()
                        } else {
                            0
                        }
                    })
                    .sum::<usize>()
            }
            Message::StatusOk(_) => 1,
            Message::GeometryOk(_) => REGION_LEN,
            Message::Error(e) => 1 + truncated(&e.message).len(),
        }
    }
}

fn payload_len(p: &Payload) -> usize {
    match p {
        Payload::Zero => 0,
        Payload::Data(d) => d.len(),
    }
}

/// `message` cut to at most [`MAX_MESSAGE`] bytes, at a character boundary.
fn truncated(message: &str) -> &str {
    if message.len() <= MAX_MESSAGE {
        return message;
    }
    let mut end = MAX_MESSAGE;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    &message[..end]
}

const REGION_LEN: usize = 20;

/// One frame: a request id and a message. Replies carry the id of their request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Request id, chosen by the client, unique among its requests in flight on one
    /// connection. `0` is reserved for connection-level errors sent by a server.
    pub id: u64,
    /// The request or reply.
    pub msg: Message,
}

impl Frame {
    /// A frame.
    pub fn new(id: u64, msg: Message) -> Self {
        Self { id, msg }
    }

    /// Bytes this frame takes on the wire, header included (compare with the peer's
    /// `max_frame` before sending).
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN + self.msg.body_len()
    }

    /// Appends the frame to `dst`. Error messages longer than [`MAX_MESSAGE`] are cut.
    ///
    /// # Panics
    /// If the frame is longer than `u32::MAX` bytes (no valid frame is: payloads are chunks).
    pub fn encode(&self, dst: &mut BytesMut) {
        dst.reserve(self.encoded_len());
        self.encode_into(dst, None);
    }

    /// The frame as pieces to send in order, without copying payloads: the same bytes as
    /// [`encode`](Self::encode), but every chunk payload of at least [`ZERO_COPY_MIN`] bytes
    /// is its own piece, sharing the message's buffer. Appends to `parts`.
    pub fn encode_parts(&self, parts: &mut Vec<Bytes>) {
        let mut head = BytesMut::with_capacity(self.encoded_len().min(4096));
        self.encode_into(&mut head, Some(parts));
        if !head.is_empty() {
            parts.push(head.freeze());
        }
    }

    fn encode_into(&self, dst: &mut BytesMut, mut parts: Option<&mut Vec<Bytes>>) {
        let len = self.encoded_len();
        let rest = u32::try_from(len - 4).expect("a frame fits a u32 length");
        dst.put_u32(rest);
        dst.put_u8(self.msg.op());
        dst.put_u64(self.id);
        match &self.msg {
            Message::Read(chunks) => {
                dst.put_u32(chunks.len() as u32);
                for c in chunks {
                    dst.put_u64(c.0);
                }
            }
            Message::Write { idx, data } => {
                dst.put_u64(idx.0);
                put_payload_flagged(dst, data, false, parts.as_deref_mut());
            }
            Message::Flush | Message::Geometry | Message::Done => {}
            Message::Trim(r) => {
                dst.put_u64(r.start.0);
                dst.put_u64(r.end.0);
            }
            Message::Status(idx) => dst.put_u64(idx.0),
            Message::ReadRun { start, count } => {
                dst.put_u64(start.0);
                dst.put_u32(*count);
            }
            Message::ObjGet(k) | Message::ObjExists(k) | Message::ObjDelete(k) => {
                dst.put_slice(k.as_bytes());
            }
            Message::ObjCreate { key, data } => {
                put_name(dst, key);
                put_bytes(dst, data, parts.as_deref_mut());
            }
            Message::ObjList { dir, after } => {
                put_name(dst, dir);
                dst.put_slice(after.as_bytes());
            }
            Message::ObjData(d) => {
                dst.put_u8(u8::from(d.is_some()));
                if let Some(d) = d {
                    put_bytes(dst, d, parts.as_deref_mut());
                }
            }
            Message::ObjBool(b) => dst.put_u8(u8::from(*b)),
            Message::ObjNames { names, more } => {
                dst.put_u8(u8::from(*more));
                dst.put_u32(names.len() as u32);
                for n in names {
                    put_name(dst, n);
                }
            }
            Message::ReadRunOk(run) => {
                dst.put_u32(run.count);
                dst.put_u32(run.data_len as u32);
                dst.put_slice(&run.zeros);
                for piece in &run.pieces {
                    match parts.as_deref_mut() {
                        Some(parts) if piece.len() >= ZERO_COPY_MIN => {
                            parts.push(dst.split().freeze());
                            parts.push(piece.clone());
                        }
                        _ => dst.put_slice(piece),
                    }
                }
            }
            Message::ReadOk(chunks) => {
                dst.put_u32(chunks.len() as u32);
                for c in chunks {
                    put_payload_flagged(dst, c, true, parts.as_deref_mut());
                }
            }
            Message::StatusOk(s) => dst.put_u8(status_to_code(*s)),
            Message::GeometryOk(r) => put_region(dst, r),
            Message::Error(e) => {
                dst.put_u8(kind_to_code(e.kind));
                dst.put_slice(truncated(&e.message).as_bytes());
            }
        }
    }
}

fn put_payload_flagged(
    dst: &mut BytesMut,
    p: &Payload,
    with_len: bool,
    parts: Option<&mut Vec<Bytes>>,
) {
    match p {
        Payload::Zero => dst.put_u8(FLAG_ZERO),
        Payload::Data(d) => {
            dst.put_u8(0);
            if with_len {
                dst.put_u32(d.len() as u32);
            }
            match parts {
                Some(parts) if d.len() >= ZERO_COPY_MIN => {
                    parts.push(dst.split().freeze());
                    parts.push(d.clone());
                }
                _ => dst.put_slice(d),
            }
        }
    }
}

/// A name with its length (u16) before it.
fn put_name(dst: &mut BytesMut, name: &str) {
    let len = u16::try_from(name.len()).expect("names are at most MAX_KEY bytes");
    dst.put_u16(len);
    dst.put_slice(name.as_bytes());
}

/// Bytes to the end of the frame, a piece of their own when large.
fn put_bytes(dst: &mut BytesMut, data: &Bytes, parts: Option<&mut Vec<Bytes>>) {
    match parts {
        Some(parts) if data.len() >= ZERO_COPY_MIN => {
            parts.push(dst.split().freeze());
            parts.push(data.clone());
        }
        _ => dst.put_slice(data),
    }
}

/// An object key or folder name from a frame: UTF-8, 1 to [`MAX_KEY`] bytes.
fn get_key(bytes: &[u8], op: &'static str) -> Result<String, WireError> {
    if bytes.is_empty() || bytes.len() > MAX_KEY {
        return Err(WireError::BadKey {
            op,
            len: bytes.len(),
        });
    }
    String::from_utf8(bytes.to_vec()).map_err(|_| WireError::BadKey {
        op,
        len: bytes.len(),
    })
}

/// A name with its length before it ([`put_name`]).
fn get_name(body: &mut Body) -> Result<String, WireError> {
    let len = body.u16()? as usize;
    let op = body.op;
    get_key(&body.take(len)?, op)
}

/// Encodes a region: size u64, chunk size u32, caps u32, flags u32 (bit 0: read-only).
pub(crate) fn put_region(dst: &mut impl BufMut, r: &RegionInfo) {
    dst.put_u64(r.geometry.size());
    dst.put_u32(r.geometry.chunk_size());
    dst.put_u32(caps_to_bits(r.caps));
    dst.put_u32(u32::from(r.read_only));
}

/// Decodes a region encoded by [`put_region`].
pub(crate) fn get_region(body: &mut Body) -> Result<RegionInfo, WireError> {
    let size = body.u64()?;
    let chunk = body.u32()?;
    let caps = caps_from_bits(body.u32()?);
    let flags = body.u32()?;
    // Bounded: a peer must not make us allocate per-chunk state for 2^50 chunks.
    let geometry = Geometry::new_bounded(size, u64::from(chunk)).map_err(WireError::BadGeometry)?;
    Ok(RegionInfo {
        geometry,
        caps,
        read_only: flags & 1 != 0,
    })
}

/// A cursor over a received body that reports truncation as a [`WireError`].
pub(crate) struct Body {
    buf: Bytes,
    op: &'static str,
}

impl Body {
    pub(crate) fn new(buf: Bytes, op: &'static str) -> Self {
        Self { buf, op }
    }
    fn need(&self, n: usize) -> Result<(), WireError> {
        if self.buf.len() < n {
            Err(WireError::Truncated { op: self.op })
        } else {
            Ok(())
        }
    }
    pub(crate) fn len(&self) -> usize {
        self.buf.len()
    }
    pub(crate) fn u8(&mut self) -> Result<u8, WireError> {
        self.need(1)?;
        Ok(self.buf.get_u8())
    }
    pub(crate) fn u16(&mut self) -> Result<u16, WireError> {
        self.need(2)?;
        Ok(self.buf.get_u16())
    }
    pub(crate) fn u32(&mut self) -> Result<u32, WireError> {
        self.need(4)?;
        Ok(self.buf.get_u32())
    }
    pub(crate) fn u64(&mut self) -> Result<u64, WireError> {
        self.need(8)?;
        Ok(self.buf.get_u64())
    }
    pub(crate) fn take(&mut self, n: usize) -> Result<Bytes, WireError> {
        self.need(n)?;
        Ok(self.buf.split_to(n))
    }
    pub(crate) fn rest(&mut self) -> Bytes {
        std::mem::take(&mut self.buf)
    }
    pub(crate) fn finish(self) -> Result<(), WireError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(WireError::TrailingBytes {
                op: self.op,
                extra: self.buf.len(),
            })
        }
    }
    fn exact(&self, expected: usize) -> Result<(), WireError> {
        if self.buf.len() == expected {
            Ok(())
        } else {
            Err(WireError::BodyLength {
                op: self.op,
                len: self.buf.len(),
                expected,
            })
        }
    }
}

/// The receiver's caps on what a peer may send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest frame, header included, in bytes.
    pub max_frame: u32,
    /// Most chunks in one read request or reply.
    pub max_batch: u32,
}

impl Default for Limits {
    /// [`DEFAULT_MAX_FRAME`] and [`DEFAULT_MAX_BATCH`].
    fn default() -> Self {
        Self {
            max_frame: DEFAULT_MAX_FRAME,
            max_batch: DEFAULT_MAX_BATCH,
        }
    }
}

/// Bytes a read reply of `count` chunks takes besides the chunks' payload.
pub fn read_reply_overhead(count: usize) -> usize {
    HEADER_LEN + 4 + count * 5
}

/// Bytes a run read reply of `count` chunks takes besides the chunks' bytes.
pub fn run_reply_overhead(count: usize) -> usize {
    HEADER_LEN + 8 + count.div_ceil(8)
}

fn op_name(code: u8) -> Result<&'static str, WireError> {
    Ok(match code {
        0 => return Err(WireError::ZeroOp),
        op::READ => "read",
        op::WRITE => "write",
        op::FLUSH => "flush",
        op::TRIM => "trim",
        op::STATUS => "status",
        op::GEOMETRY => "geometry",
        op::READ_RUN => "run read",
        op::OBJ_GET => "object get",
        op::OBJ_EXISTS => "object exists",
        op::OBJ_CREATE => "object create",
        op::OBJ_LIST => "object list",
        op::OBJ_DELETE => "object delete",
        op::OBJ_DATA => "object data reply",
        op::OBJ_BOOL => "object yes-or-no reply",
        op::OBJ_NAMES => "object names reply",
        op::READ_OK => "read reply",
        op::DONE => "done reply",
        op::STATUS_OK => "status reply",
        op::GEOMETRY_OK => "geometry reply",
        op::READ_RUN_OK => "run read reply",
        op::ERROR => "error reply",
        other => return Err(WireError::UnknownOp(other)),
    })
}

/// The incremental frame decoder: feed it the bytes received so far.
#[derive(Debug, Clone, Copy, Default)]
pub struct FrameDecoder {
    limits: Limits,
}

impl FrameDecoder {
    /// A decoder that enforces `limits`.
    pub fn new(limits: Limits) -> Self {
        Self { limits }
    }

    /// The limits enforced.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Takes one whole frame off the front of `buf`, or returns `Ok(None)` when more bytes
    /// are needed (having reserved room for the rest of the frame in `buf`). Chunk payloads
    /// in the frame are copied into buffers of their exact size, so that keeping one never
    /// keeps `buf`'s allocation alive.
    ///
    /// The length and op code are checked as soon as they arrive, before anything is
    /// allocated: a frame over [`Limits::max_frame`], a batch over [`Limits::max_batch`] or a
    /// payload over the largest chunk size is an error without waiting for its bytes. After an
    /// error the content of `buf` is unspecified: close the connection.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Frame>, WireError> {
        if buf.len() < 4 {
            return Ok(None);
        }
        let total = self.frame_len([buf[0], buf[1], buf[2], buf[3]])?;
        if buf.len() >= 5 {
            op_name(buf[4])?;
        }
        if buf.len() < total {
            buf.reserve(total - buf.len());
            return Ok(None);
        }
        let frame = buf.split_to(total).freeze();
        self.decode_frame(frame, true).map(Some)
    }

    /// Decodes `frame`, a buffer holding exactly one whole frame in an allocation of its own
    /// (read into a buffer of its exact size): chunk payloads are slices of it, not copies,
    /// so that keeping one keeps only this frame's memory alive. The length prefix is checked
    /// against the limits like [`decode`](Self::decode) does.
    pub fn decode_own(&mut self, frame: Bytes) -> Result<Frame, WireError> {
        if frame.len() < 4 {
            return Err(WireError::FrameTooShort {
                len: frame.len() as u32,
            });
        }
        let total = self.frame_len([frame[0], frame[1], frame[2], frame[3]])?;
        if total != frame.len() {
            return Err(WireError::BodyLength {
                op: "buffered frame",
                len: frame.len(),
                expected: total,
            });
        }
        self.decode_frame(frame, false)
    }

    /// The whole frame's length (prefix included) that the length prefix `prefix` gives,
    /// checked against the limits and the header's size.
    fn frame_len(&self, prefix: [u8; 4]) -> Result<usize, WireError> {
        let rest = u32::from_be_bytes(prefix);
        let total = 4 + u64::from(rest);
        if total > u64::from(self.limits.max_frame) {
            return Err(WireError::FrameTooLarge {
                len: total,
                max: self.limits.max_frame,
            });
        }
        if (rest as usize) < HEADER_LEN - 4 {
            return Err(WireError::FrameTooShort { len: rest });
        }
        Ok(total as usize)
    }

    /// Decodes one whole frame (length prefix included, already checked); `copy`: payloads
    /// get allocations of their own.
    fn decode_frame(&self, mut frame: Bytes, copy: bool) -> Result<Frame, WireError> {
        frame.advance(4);
        let code = frame.get_u8();
        let id = frame.get_u64();
        let name = op_name(code)?;
        if id == 0 && code != op::ERROR {
            return Err(WireError::ZeroId { op: code });
        }
        let msg = self.decode_body(code, Body::new(frame, name), copy)?;
        Ok(Frame { id, msg })
    }

    fn batch_count(&self, body: &mut Body, min_entry: usize) -> Result<usize, WireError> {
        let count = body.u32()?;
        if count == 0 {
            return Err(WireError::EmptyBatch);
        }
        if count > self.limits.max_batch {
            return Err(WireError::BatchTooLarge {
                count,
                max: self.limits.max_batch,
            });
        }
        let count = count as usize;
        // Checked before the vector is allocated: every entry takes at least `min_entry` bytes.
        if body.len() < count * min_entry {
            return Err(WireError::Truncated { op: body.op });
        }
        Ok(count)
    }

    fn decode_body(&self, code: u8, mut body: Body, copy: bool) -> Result<Message, WireError> {
        let own = |b: Bytes| if copy { own(b) } else { b };
        let msg = match code {
            op::READ => {
                let count = self.batch_count(&mut body, 8)?;
                body.exact(count * 8)?;
                let chunks = (0..count)
                    .map(|_| body.u64().map(ChunkIdx))
                    .collect::<Result<Vec<_>, _>>()?;
                Message::Read(chunks)
            }
            op::WRITE => {
                let idx = ChunkIdx(body.u64()?);
                let flags = body.u8()?;
                let data = match flags {
                    FLAG_ZERO => Payload::Zero,
                    0 => {
                        let data = body.rest();
                        check_chunk_len(data.len())?;
                        Payload::Data(own(data))
                    }
                    other => {
                        return Err(WireError::BadFlags {
                            op: body.op,
                            flags: other,
                        })
                    }
                };
                Message::Write { idx, data }
            }
            op::FLUSH | op::GEOMETRY | op::DONE => {
                body.exact(0)?;
                match code {
                    op::FLUSH => Message::Flush,
                    op::GEOMETRY => Message::Geometry,
                    _ => Message::Done,
                }
            }
            op::TRIM => {
                body.exact(16)?;
                let (start, end) = (body.u64()?, body.u64()?);
                if start > end {
                    return Err(WireError::BadRange { start, end });
                }
                Message::Trim(ChunkRange::new(ChunkIdx(start), ChunkIdx(end)))
            }
            op::STATUS => {
                body.exact(8)?;
                Message::Status(ChunkIdx(body.u64()?))
            }
            op::READ_RUN => {
                body.exact(12)?;
                let (start, count) = (body.u64()?, body.u32()?);
                run_count(count)?;
                if start.checked_add(u64::from(count)).is_none() {
                    return Err(WireError::RunOverflow { start, count });
                }
                Message::ReadRun {
                    start: ChunkIdx(start),
                    count,
                }
            }
            op::OBJ_GET..=op::OBJ_DELETE | op::OBJ_DATA | op::OBJ_BOOL | op::OBJ_NAMES => {
                decode_objects(code, &mut body, copy)?
            }
            op::READ_RUN_OK => {
                let count = body.u32()?;
                run_count(count)?;
                let data_len = body.u32()? as usize;
                let bits = count.div_ceil(8) as usize;
                // The bitmap is at most MAX_RUN_LIMIT / 8 bytes (checked above); it is copied
                // out so that the data can be checked against what is left.
                let zeros = Bytes::copy_from_slice(&body.take(bits)?);
                let tail = count % 8;
                if tail != 0 && zeros[bits - 1] >> tail != 0 {
                    return Err(WireError::BadFlags {
                        op: body.op,
                        flags: zeros[bits - 1],
                    });
                }
                if body.len() != data_len {
                    return Err(WireError::BodyLength {
                        op: body.op,
                        len: 8 + bits + body.len(),
                        expected: 8 + bits + data_len,
                    });
                }
                // One piece for the whole run, not copied: the caller installs it and drops it
                // (it shares the receive buffer of the frame it came in).
                let data = body.rest();
                Message::ReadRunOk(RunData {
                    count,
                    zeros,
                    pieces: if data.is_empty() {
                        Vec::new()
                    } else {
                        vec![data]
                    },
                    data_len,
                })
            }
            op::READ_OK => {
                let count = self.batch_count(&mut body, 1)?;
                let mut chunks = Vec::with_capacity(count);
                for _ in 0..count {
                    chunks.push(match body.u8()? {
                        FLAG_ZERO => Payload::Zero,
                        0 => {
                            let len = body.u32()?;
                            check_chunk_len(len as usize)?;
                            Payload::Data(own(body.take(len as usize)?))
                        }
                        other => {
                            return Err(WireError::BadFlags {
                                op: body.op,
                                flags: other,
                            })
                        }
                    });
                }
                Message::ReadOk(chunks)
            }
            op::STATUS_OK => {
                body.exact(1)?;
                Message::StatusOk(status_from_code(body.u8()?)?)
            }
            op::GEOMETRY_OK => {
                body.exact(REGION_LEN)?;
                Message::GeometryOk(get_region(&mut body)?)
            }
            op::ERROR => {
                let kind = kind_from_code(body.u8()?);
                let text = body.rest();
                if text.len() > MAX_MESSAGE {
                    return Err(WireError::MessageTooLong {
                        len: text.len(),
                        max: MAX_MESSAGE,
                    });
                }
                Message::Error(RemoteError {
                    kind,
                    message: String::from_utf8_lossy(&text).into_owned(),
                })
            }
            other => return Err(WireError::UnknownOp(other)),
        };
        body.finish()?;
        Ok(msg)
    }
}

/// The body of an objects request or reply (feature [`OBJECTS`](crate::Features::OBJECTS)).
fn decode_objects(code: u8, body: &mut Body, copy: bool) -> Result<Message, WireError> {
    let own = |b: Bytes| if copy { own(b) } else { b };
    Ok(match code {
        op::OBJ_GET | op::OBJ_EXISTS | op::OBJ_DELETE => {
            let key = get_key(&body.rest(), body.op)?;
            match code {
                op::OBJ_GET => Message::ObjGet(key),
                op::OBJ_EXISTS => Message::ObjExists(key),
                _ => Message::ObjDelete(key),
            }
        }
        op::OBJ_CREATE => {
            let key = get_name(body)?;
            Message::ObjCreate {
                key,
                data: own(body.rest()),
            }
        }
        op::OBJ_LIST => {
            let dir = get_name(body)?;
            let after = body.rest();
            let after = if after.is_empty() {
                String::new()
            } else {
                get_key(&after, body.op)?
            };
            Message::ObjList { dir, after }
        }
        op::OBJ_DATA => match body.u8()? {
            0 => {
                body.exact(0)?;
                Message::ObjData(None)
            }
            1 => Message::ObjData(Some(own(body.rest()))),
            other => {
                return Err(WireError::BadFlags {
                    op: body.op,
                    flags: other,
                })
            }
        },
        op::OBJ_BOOL => {
            body.exact(1)?;
            match body.u8()? {
                b @ (0 | 1) => Message::ObjBool(b == 1),
                other => {
                    return Err(WireError::BadFlags {
                        op: body.op,
                        flags: other,
                    })
                }
            }
        }
        op::OBJ_NAMES => {
            let more = match body.u8()? {
                b @ (0 | 1) => b == 1,
                other => {
                    return Err(WireError::BadFlags {
                        op: body.op,
                        flags: other,
                    })
                }
            };
            let count = body.u32()?;
            if count > MAX_NAMES {
                return Err(WireError::BatchTooLarge {
                    count,
                    max: MAX_NAMES,
                });
            }
            // Every name takes at least 3 bytes: checked before anything is kept.
            if body.len() < count as usize * 3 {
                return Err(WireError::Truncated { op: body.op });
            }
            let names = (0..count)
                .map(|_| get_name(body))
                .collect::<Result<Vec<_>, _>>()?;
            Message::ObjNames { names, more }
        }
        other => return Err(WireError::UnknownOp(other)),
    })
}

/// A chunk payload in an allocation of its own, of exactly its size.
///
/// Received bytes arrive in a shared receive buffer that holds many frames; a payload sliced
/// out of it would keep the whole buffer alive for as long as a store keeps the chunk (a
/// memory store keeps it forever: 4 KiB chunks each pinning a 256 KiB buffer grew a server
/// to gigabytes). One copy per chunk is cheap next to the network it came over.
fn own(payload: Bytes) -> Bytes {
    Bytes::copy_from_slice(&payload)
}

/// Checks the chunk count of a run read (1..=[`MAX_RUN_LIMIT`]).
fn run_count(count: u32) -> Result<(), WireError> {
    if count == 0 {
        return Err(WireError::EmptyBatch);
    }
    if count > MAX_RUN_LIMIT {
        return Err(WireError::BatchTooLarge {
            count,
            max: MAX_RUN_LIMIT,
        });
    }
    Ok(())
}

fn check_chunk_len(len: usize) -> Result<(), WireError> {
    if len > MAX_CHUNK_SIZE as usize {
        Err(WireError::ChunkTooLarge {
            len: len as u32,
            max: MAX_CHUNK_SIZE,
        })
    } else {
        Ok(())
    }
}

#[cfg(test)]
#[path = "frame_tests.rs"]
mod tests;
