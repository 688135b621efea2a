//! The messages of `farmap run` (docs/design/farmap-run.md §2.1, §2.5), version 1: between
//! `farmap run` (the handler) and the preload library inside the program, over the
//! program's control socket, and between the handler and the program's reaper thread. No
//! I/O, no allocation, `no_std`: the preload library decodes these inside `malloc`.
//!
//! ```text
//!  program (preload library)                    farmap run
//!  Hello {token, pid}                 ───────▶  checks the token, the peer's uid and pid
//!                                     ◀───────  Config {region and trash sizes, features}
//!  maps and registers, then
//!  Registered {addresses} + 4 fds     ───────▶  checks everything before acting on any of it
//!  (region uffd, staging uffd,                  (sizes as configured, alignment, addresses)
//!   /proc/self/pagemap, /proc/self/mem)
//!                                     ◀───────  Verdict {0: serving, else a refusal}
//!  reaper thread                      ◀───────  Request {id, Discard | Move | Touch, ...}
//!                                     ───────▶  Done {id, errno, bytes}
//!
//!  before a fork, on a new connection:
//!  ForkPrepare {token, pid, region}   ───────▶  checks as for a hello; pauses the pager
//!                                     ◀───────  Verdict {0: paused, else a refusal}
//!  fork (the child inherits this connection; the parent closes its copy)
//!                                     ◀───────  Verdict {0: the child's heap is whole}
//!  the child closes it, and runs on
//! ```
//!
//! The handler may send up to [`MAX_PIPELINE`] requests before it reads their answers (one
//! write for a group of moves, one read for their outcomes): the reaper serves them in order
//! and answers each, in order, after the last of those it has read.
//!
//! Every message is a 16-byte header and a body whose length each kind fixes; all integers
//! are little-endian:
//!
//! ```text
//! offset size field
//!      0    4 magic         "FMRN"
//!      4    2 version       1 (0 is never valid)
//!      6    2 kind          1 Hello, 2 Config, 3 Registered, 4 Verdict, 5 Request, 6 Done,
//!                           7 ForkPrepare
//!      8    4 body length   exactly the kind's (below)
//!     12    4 reserved      zero
//!     16      body
//! ```
//!
//! Decoding is strict: a message decodes only if it is the one encoding of its value
//! (reserved bytes zero, every field within its limits), so what decodes re-encodes to the
//! same bytes (the fuzz target checks this). The reaper's moves exist because the kernel
//! refuses `UFFDIO_MOVE` from any process but the region's own (farmap-uffd's
//! `tests/foreign_kernel.rs`).
#![cfg_attr(not(test), no_std)]
#![forbid(unsafe_code)]
#![warn(missing_docs)]

use core::fmt;

/// First bytes of every message.
pub const MAGIC: [u8; 4] = *b"FMRN";
/// The version this code writes and reads.
pub const VERSION: u16 = 1;
/// Length of the header.
pub const HEADER_LEN: usize = 16;
/// Length of the longest message.
pub const MAX_MSG_LEN: usize = HEADER_LEN + 48;
/// Most requests the handler sends before it reads their answers; the reaper reads and
/// answers that many at once.
pub const MAX_PIPELINE: usize = 64;
/// Length of a [`Request`] message.
pub const REQUEST_LEN: usize = HEADER_LEN + 32;
/// Length of a [`Done`] message.
pub const DONE_LEN: usize = HEADER_LEN + 16;
/// Length of a token.
pub const TOKEN_LEN: usize = 32;
/// The page size addresses and lengths are multiples of.
pub const PAGE: u64 = 4096;
/// The end of the largest user address space (five-level paging).
pub const MAX_ADDRESS: u64 = 1 << 57;
/// Largest region, staging area or request: 64 TiB.
pub const MAX_LEN: u64 = 1 << 46;
/// File descriptors sent with [`Registered`].
pub const REGISTERED_FDS: usize = 4;

/// Why bytes are not a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Error {
    /// Not the magic.
    BadMagic,
    /// A version this code does not speak.
    BadVersion(u16),
    /// An unknown kind.
    UnknownKind(u16),
    /// A body length other than the kind's.
    BadLength {
        /// The kind.
        kind: u16,
        /// The length announced.
        len: u32,
    },
    /// Reserved bytes that are not zero.
    Reserved,
    /// A field out of its limits: its name.
    BadField(&'static str),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::BadMagic => f.write_str("not a farmap run message (bad magic)"),
            Error::BadVersion(v) => {
                write!(
                    f,
                    "farmap run protocol version {v}; this side speaks {VERSION}"
                )
            }
            Error::UnknownKind(k) => write!(f, "unknown message kind {k}"),
            Error::BadLength { kind, len } => {
                write!(f, "message kind {kind} with a body of {len} bytes")
            }
            Error::Reserved => f.write_str("reserved bytes are not zero"),
            Error::BadField(name) => write!(f, "the field {name} is out of its limits"),
        }
    }
}

/// Program → handler: who is asking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// The token `farmap run` put in the program's environment.
    pub token: [u8; TOKEN_LEN],
    /// The program's process id.
    pub pid: u32,
}

/// Program → handler, first on a connection of its own, just before the program forks: who
/// is asking (as in a [`Hello`]) and which of its regions (an exec makes a new one under the
/// same pid). The handler pauses that region's pager (nothing the program wrote moves or is
/// dropped) and answers with a [`Verdict`]; once the child's heap is whole, a second
/// `Verdict` goes to the child, which inherited the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForkPrepare {
    /// The token `farmap run` put in the program's environment.
    pub token: [u8; TOKEN_LEN],
    /// The program's process id.
    pub pid: u32,
    /// The region's address (as in its [`Registered`]).
    pub region: u64,
}

/// Handler → program: what to map and register (`farmap run` decides every size).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// The region's length (a multiple of the chunk size).
    pub region_len: u64,
    /// The chunk size: a power of two from 4 KiB to 4 MiB.
    pub chunk_size: u32,
    /// The trash area's length after the staging area (a multiple of the page size).
    pub trash_len: u64,
    /// The `UFFD_FEATURE_*` bits to enable on the region's userfaultfd.
    pub features: u64,
}

/// Program → handler, with [`REGISTERED_FDS`] descriptors: where the areas are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registered {
    /// The region's address.
    pub region: u64,
    /// Its length.
    pub region_len: u64,
    /// The staging area's address (its trash area follows it).
    pub staging: u64,
    /// The staging and trash areas' length.
    pub staging_len: u64,
    /// The `UFFD_FEATURE_*` bits enabled on the region's userfaultfd.
    pub features: u64,
}

/// Handler → program: serving (0), or why not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// 0: serving; else a [`Refusal`] code.
    pub status: u16,
}

/// Why the handler refuses a program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum Refusal {
    /// The token is wrong.
    Token = 1,
    /// The peer is another user, or not a process `farmap run` started.
    Stranger = 2,
    /// The areas are not what was configured.
    Areas = 3,
    /// The descriptors are missing or not what they must be.
    Descriptors = 4,
    /// Setting up the region failed on the handler's side.
    Setup = 5,
}

impl Refusal {
    /// The refusal a status code names (`None` for 0 and unknown codes).
    pub fn from_status(status: u16) -> Option<Refusal> {
        Some(match status {
            1 => Refusal::Token,
            2 => Refusal::Stranger,
            3 => Refusal::Areas,
            4 => Refusal::Descriptors,
            5 => Refusal::Setup,
            _ => return None,
        })
    }
}

/// What the handler asks of the reaper.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `madvise(MADV_DONTNEED)` of `len` bytes at `start`.
    Discard {
        /// First byte.
        start: u64,
        /// Bytes.
        len: u64,
    },
    /// A write that changes nothing (a compare-and-swap of its first word with itself) to
    /// each page of `len` bytes at `start`, in the region: a page a fork left shared with
    /// the child is the parent's alone again, and can move (`UFFDIO_MOVE` refuses shared
    /// pages).
    Touch {
        /// First byte.
        start: u64,
        /// Bytes.
        len: u64,
    },
    /// `UFFDIO_MOVE` of `len` bytes from `src` to `dst` (on the destination's userfaultfd).
    Move {
        /// Where the pages are.
        src: u64,
        /// Where they go (missing pages).
        dst: u64,
        /// Bytes.
        len: u64,
    },
}

/// Handler → reaper.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Echoed in the [`Done`].
    pub id: u32,
    /// What to do.
    pub op: Op,
}

/// Reaper → handler: a request's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Done {
    /// The request's id.
    pub id: u32,
    /// 0, or the errno that stopped it.
    pub errno: i32,
    /// Bytes done before it stopped (all of them when `errno` is 0).
    pub bytes: u64,
}

/// One message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Msg {
    /// See [`Hello`].
    Hello(Hello),
    /// See [`Config`].
    Config(Config),
    /// See [`Registered`].
    Registered(Registered),
    /// See [`Verdict`].
    Verdict(Verdict),
    /// See [`Request`].
    Request(Request),
    /// See [`Done`].
    Done(Done),
    /// See [`ForkPrepare`].
    ForkPrepare(ForkPrepare),
}

const HELLO: u16 = 1;
const CONFIG: u16 = 2;
const REGISTERED: u16 = 3;
const VERDICT: u16 = 4;
const REQUEST: u16 = 5;
const DONE: u16 = 6;
const FORK_PREPARE: u16 = 7;

const OP_DISCARD: u16 = 1;
const OP_MOVE: u16 = 2;
const OP_TOUCH: u16 = 3;

/// The body length of each kind.
fn body_len(kind: u16) -> Option<usize> {
    Some(match kind {
        HELLO => TOKEN_LEN + 8,
        FORK_PREPARE => TOKEN_LEN + 16,
        CONFIG => 32,
        REGISTERED => 40,
        VERDICT => 8,
        REQUEST => 32,
        DONE => 16,
        _ => return None,
    })
}

/// Reads little-endian fields from a body, in order.
struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn bytes<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        out.copy_from_slice(&self.buf[self.at..self.at + N]);
        self.at += N;
        out
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.bytes())
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.bytes())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.bytes())
    }
    /// Reserved bytes, which must be zero.
    fn zeros(&mut self, n: usize) -> Result<(), Error> {
        let all = self.buf[self.at..self.at + n].iter().all(|b| *b == 0);
        self.at += n;
        all.then_some(()).ok_or(Error::Reserved)
    }
}

/// Writes little-endian fields, in order.
struct Writer<'a> {
    buf: &'a mut [u8],
    at: usize,
}

impl Writer<'_> {
    fn put(&mut self, b: &[u8]) {
        self.buf[self.at..self.at + b.len()].copy_from_slice(b);
        self.at += b.len();
    }
    fn u16(&mut self, v: u16) {
        self.put(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.put(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.put(&v.to_le_bytes());
    }
}

/// A page-aligned, non-empty range of user addresses.
fn check_area(name: &'static str, start: u64, len: u64) -> Result<(), Error> {
    let ok = start.is_multiple_of(PAGE)
        && len.is_multiple_of(PAGE)
        && len > 0
        && len <= MAX_LEN
        && start < MAX_ADDRESS
        && start + len <= MAX_ADDRESS;
    ok.then_some(()).ok_or(Error::BadField(name))
}

fn check(name: &'static str, ok: bool) -> Result<(), Error> {
    ok.then_some(()).ok_or(Error::BadField(name))
}

impl Msg {
    fn kind(&self) -> u16 {
        match self {
            Msg::Hello(_) => HELLO,
            Msg::Config(_) => CONFIG,
            Msg::Registered(_) => REGISTERED,
            Msg::Verdict(_) => VERDICT,
            Msg::Request(_) => REQUEST,
            Msg::Done(_) => DONE,
            Msg::ForkPrepare(_) => FORK_PREPARE,
        }
    }

    /// Checks the fields' limits (what [`decode`] refuses, [`encode`](Msg::encode) refuses
    /// too: nothing this side sends is something the other side would refuse).
    pub fn validate(&self) -> Result<(), Error> {
        match *self {
            Msg::Hello(h) => check("pid", h.pid > 0 && h.pid <= i32::MAX as u32),
            Msg::ForkPrepare(f) => {
                check("pid", f.pid > 0 && f.pid <= i32::MAX as u32)?;
                check_area("region", f.region, PAGE)
            }
            Msg::Config(c) => {
                check(
                    "chunk_size",
                    c.chunk_size.is_power_of_two() && (4096..=4 << 20).contains(&c.chunk_size),
                )?;
                check_area("region_len", 0, c.region_len)?;
                check(
                    "region_len",
                    c.region_len.is_multiple_of(u64::from(c.chunk_size)),
                )?;
                check(
                    "trash_len",
                    c.trash_len.is_multiple_of(PAGE) && c.trash_len <= MAX_LEN,
                )
            }
            Msg::Registered(r) => {
                check_area("region", r.region, r.region_len)?;
                check_area("staging", r.staging, r.staging_len)?;
                let apart =
                    r.region + r.region_len <= r.staging || r.staging + r.staging_len <= r.region;
                check("staging", apart)
            }
            Msg::Verdict(_) => Ok(()),
            Msg::Request(r) => match r.op {
                Op::Discard { start, len } | Op::Touch { start, len } => {
                    check_area("start", start, len)
                }
                Op::Move { src, dst, len } => {
                    check_area("src", src, len)?;
                    check_area("dst", dst, len)?;
                    check("dst", src + len <= dst || dst + len <= src)
                }
            },
            Msg::Done(d) => check("errno", d.errno >= 0 && d.bytes <= MAX_LEN),
        }
    }

    /// Encodes the message into `out`; returns its length. Fails (writing nothing) if a
    /// field is out of its limits.
    pub fn encode(&self, out: &mut [u8; MAX_MSG_LEN]) -> Result<usize, Error> {
        self.validate()?;
        let kind = self.kind();
        let len = body_len(kind).unwrap_or(0);
        out.fill(0);
        let mut w = Writer { buf: out, at: 0 };
        w.put(&MAGIC);
        w.u16(VERSION);
        w.u16(kind);
        w.u32(len as u32);
        w.u32(0);
        match *self {
            Msg::ForkPrepare(f) => {
                w.put(&f.token);
                w.u32(f.pid);
                w.u32(0);
                w.u64(f.region);
            }
            Msg::Hello(h) => {
                w.put(&h.token);
                w.u32(h.pid);
                w.u32(0);
            }
            Msg::Config(c) => {
                w.u64(c.region_len);
                w.u32(c.chunk_size);
                w.u32(0);
                w.u64(c.trash_len);
                w.u64(c.features);
            }
            Msg::Registered(r) => {
                for v in [r.region, r.region_len, r.staging, r.staging_len, r.features] {
                    w.u64(v);
                }
            }
            Msg::Verdict(v) => {
                w.u16(v.status);
                w.put(&[0; 6]);
            }
            Msg::Request(r) => {
                w.u32(r.id);
                let (op, a, b, n) = match r.op {
                    Op::Discard { start, len } => (OP_DISCARD, start, 0, len),
                    Op::Touch { start, len } => (OP_TOUCH, start, 0, len),
                    Op::Move { src, dst, len } => (OP_MOVE, src, dst, len),
                };
                w.u16(op);
                w.u16(0);
                w.u64(a);
                w.u64(b);
                w.u64(n);
            }
            Msg::Done(d) => {
                w.u32(d.id);
                w.u32(d.errno as u32);
                w.u64(d.bytes);
            }
        }
        Ok(HEADER_LEN + len)
    }
}

/// Decodes the message at the start of `buf`: `Ok(None)` when more bytes are needed (no
/// more than [`MAX_MSG_LEN`] in all), else the message and its length.
pub fn decode(buf: &[u8]) -> Result<Option<(Msg, usize)>, Error> {
    if buf.len() < HEADER_LEN {
        // A wrong magic is refused as soon as its bytes are there.
        let n = buf.len().min(MAGIC.len());
        return if buf[..n] == MAGIC[..n] {
            Ok(None)
        } else {
            Err(Error::BadMagic)
        };
    }
    let mut h = Reader { buf, at: 0 };
    if h.bytes::<4>() != MAGIC {
        return Err(Error::BadMagic);
    }
    let version = h.u16();
    if version != VERSION {
        return Err(Error::BadVersion(version));
    }
    let kind = h.u16();
    let want = body_len(kind).ok_or(Error::UnknownKind(kind))?;
    let len = h.u32();
    if len as usize != want {
        return Err(Error::BadLength { kind, len });
    }
    h.zeros(4)?;
    if buf.len() < HEADER_LEN + want {
        return Ok(None);
    }
    let mut r = Reader {
        buf: &buf[..HEADER_LEN + want],
        at: HEADER_LEN,
    };
    let msg = decode_body(kind, &mut r)?;
    msg.validate()?;
    Ok(Some((msg, HEADER_LEN + want)))
}

fn decode_body(kind: u16, r: &mut Reader<'_>) -> Result<Msg, Error> {
    Ok(match kind {
        HELLO => {
            let token = r.bytes();
            let pid = r.u32();
            r.zeros(4)?;
            Msg::Hello(Hello { token, pid })
        }
        FORK_PREPARE => {
            let token = r.bytes();
            let pid = r.u32();
            r.zeros(4)?;
            Msg::ForkPrepare(ForkPrepare {
                token,
                pid,
                region: r.u64(),
            })
        }
        CONFIG => {
            let region_len = r.u64();
            let chunk_size = r.u32();
            r.zeros(4)?;
            Msg::Config(Config {
                region_len,
                chunk_size,
                trash_len: r.u64(),
                features: r.u64(),
            })
        }
        REGISTERED => Msg::Registered(Registered {
            region: r.u64(),
            region_len: r.u64(),
            staging: r.u64(),
            staging_len: r.u64(),
            features: r.u64(),
        }),
        VERDICT => {
            let status = r.u16();
            r.zeros(6)?;
            Msg::Verdict(Verdict { status })
        }
        REQUEST => {
            let id = r.u32();
            let op = r.u16();
            r.zeros(2)?;
            let (a, b, len) = (r.u64(), r.u64(), r.u64());
            let op = match op {
                OP_DISCARD if b == 0 => Op::Discard { start: a, len },
                OP_DISCARD => return Err(Error::Reserved),
                OP_TOUCH if b == 0 => Op::Touch { start: a, len },
                OP_TOUCH => return Err(Error::Reserved),
                OP_MOVE => Op::Move {
                    src: a,
                    dst: b,
                    len,
                },
                _ => return Err(Error::BadField("op")),
            };
            Msg::Request(Request { id, op })
        }
        DONE => Msg::Done(Done {
            id: r.u32(),
            errno: r.u32() as i32,
            bytes: r.u64(),
        }),
        _ => return Err(Error::UnknownKind(kind)),
    })
}

/// The fuzz target's body: decoding arbitrary bytes never panics, and what decodes
/// re-encodes to exactly the bytes it was decoded from.
pub fn fuzz(data: &[u8]) {
    if let Ok(Some((msg, n))) = decode(data) {
        let mut out = [0u8; MAX_MSG_LEN];
        let len = msg.encode(&mut out).expect("a decoded message encodes");
        assert_eq!(&out[..len], &data[..n], "{msg:?} re-encodes differently");
    }
}

#[cfg(test)]
mod tests;
