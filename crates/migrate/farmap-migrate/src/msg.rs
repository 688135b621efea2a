//! The control messages of a migration and their framing (no I/O).
//!
//! Every frame is `magic "FMIG" | version u16 | kind u8 | length u32 | payload`, integers
//! big-endian. Version 0 is invalid; a frame of another version is refused before its payload
//! is read. Every length read from the wire is capped before anything is allocated: the
//! payload by [`MAX_PAYLOAD`], page runs by [`MAX_RUNS`], the application state by
//! [`MAX_APP_STATE`], texts by [`MAX_TEXT`]; and each kind of message has its own cap
//! ([`max_payload`]), checked with the header, so a peer cannot make a receiver wait for (or
//! buffer) megabytes that no message of that kind can hold. Messages the leecher sends are
//! all tiny ([`MAX_LEECHER_PAYLOAD`]).
//!
//! Decoding checks the form of a message; what it means for a given region (page runs within
//! it, a sane page size) is checked by the state machines ([`check_runs`], and
//! [`crate::machine`]).

use std::ops::Range;

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// The first bytes of every frame.
pub const MAGIC: [u8; 4] = *b"FMIG";
/// The protocol version this crate speaks (never 0). Version 2 authenticates both sides
/// ([`crate::auth`]) and has 128-bit session ids.
pub const VERSION: u16 = 2;
/// Bytes of a frame header.
pub const HEADER_LEN: usize = 11;
/// Largest payload accepted.
pub const MAX_PAYLOAD: u32 = 64 << 20;
/// Most page runs in one dirty set.
pub const MAX_RUNS: u32 = 4 << 20;
/// Largest application state handed over.
pub const MAX_APP_STATE: u32 = 1 << 20;
/// Longest text (reasons).
pub const MAX_TEXT: u32 = 4096;

/// Largest payload of a message the leecher sends (Hello, DirtyRequest, Abort…): what a
/// seeder accepts from a leecher.
pub const MAX_LEECHER_PAYLOAD: u32 = 4 + MAX_TEXT;
/// Most runs in a manifest.
pub const MAX_MANIFEST_RUNS: u32 = 1 << 20;
/// Most chunk records (generation and checksum) in a manifest.
pub const MAX_MANIFEST_CHUNKS: u32 = (MAX_PAYLOAD - 8 - 17 * MAX_MANIFEST_RUNS) / 16;

/// A migration session's id: 128 random bits (0: none, a new session).
pub type SessionId = u128;

/// How a region moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Pull the region while the source runs, rounds of changed pages, then a short pause
    /// (the default).
    #[default]
    Precopy,
    /// Hand over at once; every chunk comes from the source afterwards (faults first).
    Postcopy,
    /// Hand over at once with a manifest of where each chunk is: the destination reads the
    /// store both hosts share, checked against the manifest, and only what the store does not
    /// hold from the source.
    Instant,
}

impl Mode {
    fn code(self) -> u8 {
        match self {
            Mode::Precopy => 0,
            Mode::Postcopy => 1,
            Mode::Instant => 2,
        }
    }

    /// Its name on the command line and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Precopy => "precopy",
            Mode::Postcopy => "postcopy",
            Mode::Instant => "instant",
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "precopy" | "pre-copy" => Ok(Mode::Precopy),
            "postcopy" | "post-copy" => Ok(Mode::Postcopy),
            "instant" => Ok(Mode::Instant),
            _ => Err(format!(
                "{s:?} is not a migration mode (precopy, postcopy or instant)"
            )),
        }
    }
}

/// Where a run of chunks is read from after an instant hand-over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Location {
    /// The shared store holds them as the source last pushed them (one record each in the
    /// manifest's `pushed`, in run order).
    Store,
    /// Only the source holds their newest content.
    Source,
}

/// A run of chunks in a manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestRun {
    /// Where they are.
    pub location: Location,
    /// Chunk indices.
    pub chunks: Range<u64>,
}

/// The largest payload a message of `kind` can have (0 for a kind this version does not
/// define: such a frame is refused by [`Msg::decode`] anyway).
pub fn max_payload(kind: u8) -> u32 {
    match kind {
        1 => 17,
        2 => 16 + 8 + 4 + 4 + 2 + 16 + 4 + MAX_TEXT,
        3 => 4,
        4 => 4 + 4 + 12 * MAX_RUNS,
        6 => 4 + 12 * MAX_RUNS + 4 + MAX_APP_STATE + 8,
        5 | 7 | 8 | 9 | 13 => 0,
        10 => 4 + MAX_TEXT,
        11 => MAX_PAYLOAD,
        12 => 4 + 12 * MAX_RUNS + 4 + 12 * MAX_RUNS,
        14 => 16 + 32,
        15 => 64,
        16 => 32,
        17 => MAX_PAYLOAD,
        _ => 0,
    }
}

/// What a seeder knows about its region, sent in [`Msg::Welcome`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionInfo {
    /// Region size in bytes.
    pub size: u64,
    /// The region's chunk size.
    pub chunk_size: u32,
    /// Page size: the unit of dirty tracking and of the data plane's chunks.
    pub page_size: u32,
    /// TCP port of the data plane (a read-only farmap server of the live region), on the
    /// host the leecher reached; 0 if the data plane is a Unix socket.
    pub data_port: u16,
    /// The seeder host's boot id: clocks of one boot are comparable.
    pub boot_id: [u8; 16],
    /// The spec of the store the region's chunks live in, if both hosts can open it (empty:
    /// none, and instant migrations are refused).
    pub shared: String,
}

/// A control message. `L→S` travels from the leecher to the seeder, `S→L` the other way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    /// L→S: the first message, before `Hello`: the session the leecher will ask for (0: a
    /// new one; the rest of the exchange then proves the session's key, not the operator's)
    /// and its nonce (see [`crate::auth`]).
    AuthHello {
        /// Session to continue, 0 for a new one.
        session: SessionId,
        /// The leecher's nonce.
        nonce: [u8; 32],
    },
    /// S→L: the seeder's nonce and its proof of the key over both nonces.
    AuthChallenge {
        /// The seeder's nonce.
        nonce: [u8; 32],
        /// The seeder's proof.
        proof: [u8; 32],
    },
    /// L→S: the leecher's proof of the key over both nonces.
    AuthProof {
        /// The leecher's proof.
        proof: [u8; 32],
    },
    /// L→S: the first message after authentication; `session` is 0 for a new migration, or
    /// the session to continue after a lost connection (the one authenticated).
    Hello {
        /// Session to continue, 0 for a new one.
        session: SessionId,
        /// How to move the region (a peer that sends no mode asks for pre-copy).
        mode: Mode,
    },
    /// S→L: the answer to `Hello`.
    Welcome {
        /// The session (to quote when reconnecting).
        session: SessionId,
        /// The region being migrated.
        region: RegionInfo,
    },
    /// L→S: which pages were written since the last dirty set (round `round`).
    DirtyRequest {
        /// Round number, from 1.
        round: u32,
    },
    /// S→L: the pages written since the previous set.
    Dirty {
        /// The round answered.
        round: u32,
        /// Written pages, as runs of page indices.
        runs: Vec<Range<u64>>,
    },
    /// L→S: suspend the application and hand ownership over.
    Finalize,
    /// S→L: the application is suspended for good; these pages changed since the last set.
    HandOver {
        /// Pages written since the last dirty set.
        runs: Vec<Range<u64>>,
        /// Opaque application state (e.g. a workload's position).
        app_state: Bytes,
        /// CLOCK_MONOTONIC at the suspension, in ns (comparable if boot ids match).
        suspended_at_ns: u64,
    },
    /// L→S: the destination runs the application (ownership has moved).
    Resumed,
    /// S→L (instant mode, right before `HandOver`): where every chunk is. Runs cover the
    /// region's chunks exactly once, in the order the destination should fetch what it must
    /// fetch from the source (most recently used first); `pushed` holds one (generation,
    /// XXH3-64) per chunk of the `Store` runs, in run order ((0, 0): not pushed by the
    /// source, taken as the store has it).
    Manifest {
        /// Runs of chunks.
        runs: Vec<ManifestRun>,
        /// Generation and checksum of each chunk of the `Store` runs.
        pushed: Vec<(u64, u64)>,
    },
    /// S→L (instant mode, after the `Manifest`): what the source found when it looked at
    /// the chunks the manifest places in the store: those of `at_source` (chunk runs) were
    /// written since and only the source holds them; every chunk not in `pending` (chunk
    /// runs) is now confirmed where the manifest says. One comes right before `HandOver`
    /// (the chunks written lately, looked at inside the downtime), the last one (nothing
    /// pending) after it: until then, the destination reads no pending chunk from the store.
    Confirm {
        /// Chunk runs written since the manifest (now at the source).
        at_source: Vec<Range<u64>>,
        /// Chunk runs not looked at yet.
        pending: Vec<Range<u64>>,
    },
    /// L→S (instant mode): the `Manifest` is installed; the source may suspend. The
    /// manifest grows with the region: installed before the suspension, it stays out of
    /// the downtime.
    Installed,
    /// L→S: every chunk is local; the seeder may release the region.
    Done,
    /// S→L: the seeder released the region.
    Bye,
    /// Either way: the migration is abandoned.
    Abort {
        /// Why, as a sentence.
        reason: String,
    },
    /// Either way: a message of an object migration (farmap-slope), opaque here: this
    /// protocol frames, authenticates and caps it (at most [`MAX_PAYLOAD`]), the object
    /// protocol decodes it. A region migration refuses it as unexpected.
    Object(Bytes),
}

/// Why bytes could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Not a migration frame.
    #[error("the peer does not speak farmap's migration protocol (bad magic)")]
    BadMagic,
    /// Version 0 or one this build does not speak.
    #[error("the peer speaks migration protocol version {0}, this build speaks {VERSION}")]
    Version(u16),
    /// A kind this version does not define.
    #[error("unknown migration message kind {0}")]
    Kind(u8),
    /// A length above its cap.
    #[error("a migration message claims {len} for {what}, more than the cap of {cap}")]
    TooLong {
        /// What was too long.
        what: &'static str,
        /// The length claimed.
        len: u64,
        /// The cap.
        cap: u64,
    },
    /// The payload ended early or has bytes left over, or a run is empty.
    #[error("a migration message is malformed: {0}")]
    Malformed(&'static str),
}

/// A decoded frame header: the payload's kind and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Message kind.
    pub kind: u8,
    /// Payload length (already checked against [`MAX_PAYLOAD`]).
    pub len: u32,
}

/// Appends a frame header for a payload of `kind` and `len` bytes: for a sender that builds
/// a frame's payload in place (an object migration's `Object` frames, whose pages are read
/// straight into the frame) and sends it with [`Channel::send_frame`](crate::channel::Channel::send_frame).
pub fn put_header(f: &mut BytesMut, kind: u8, len: u32) {
    f.put_slice(&MAGIC);
    f.put_u16(VERSION);
    f.put_u8(kind);
    f.put_u32(len);
}

/// The kind of [`Msg::Object`] frames.
pub const OBJECT_KIND: u8 = 17;

/// Checks a frame header.
pub fn decode_header(h: &[u8; HEADER_LEN]) -> Result<Header, DecodeError> {
    if h[..4] != MAGIC {
        return Err(DecodeError::BadMagic);
    }
    let version = u16::from_be_bytes([h[4], h[5]]);
    if version != VERSION {
        return Err(DecodeError::Version(version));
    }
    let kind = h[6];
    let len = u32::from_be_bytes([h[7], h[8], h[9], h[10]]);
    if len > MAX_PAYLOAD {
        return Err(DecodeError::TooLong {
            what: "its payload",
            len: len.into(),
            cap: MAX_PAYLOAD.into(),
        });
    }
    if !(1..=17).contains(&kind) {
        return Err(DecodeError::Kind(kind));
    }
    if len > max_payload(kind) {
        return Err(DecodeError::TooLong {
            what: "the payload of its kind",
            len: len.into(),
            cap: max_payload(kind).into(),
        });
    }
    Ok(Header { kind, len })
}

impl Msg {
    fn kind(&self) -> u8 {
        match self {
            Msg::Hello { .. } => 1,
            Msg::Welcome { .. } => 2,
            Msg::DirtyRequest { .. } => 3,
            Msg::Dirty { .. } => 4,
            Msg::Finalize => 5,
            Msg::HandOver { .. } => 6,
            Msg::Resumed => 7,
            Msg::Done => 8,
            Msg::Bye => 9,
            Msg::Abort { .. } => 10,
            Msg::Manifest { .. } => 11,
            Msg::Confirm { .. } => 12,
            Msg::Installed => 13,
            Msg::AuthHello { .. } => 14,
            Msg::AuthChallenge { .. } => 15,
            Msg::AuthProof { .. } => 16,
            Msg::Object(_) => OBJECT_KIND,
        }
    }

    /// The message's name, for errors.
    pub fn name(&self) -> &'static str {
        match self {
            Msg::Hello { .. } => "Hello",
            Msg::Welcome { .. } => "Welcome",
            Msg::DirtyRequest { .. } => "DirtyRequest",
            Msg::Dirty { .. } => "Dirty",
            Msg::Finalize => "Finalize",
            Msg::HandOver { .. } => "HandOver",
            Msg::Resumed => "Resumed",
            Msg::Done => "Done",
            Msg::Bye => "Bye",
            Msg::Abort { .. } => "Abort",
            Msg::Manifest { .. } => "Manifest",
            Msg::Confirm { .. } => "Confirm",
            Msg::Installed => "Installed",
            Msg::AuthHello { .. } => "AuthHello",
            Msg::AuthChallenge { .. } => "AuthChallenge",
            Msg::AuthProof { .. } => "AuthProof",
            Msg::Object(_) => "Object",
        }
    }

    /// The whole frame (header and payload).
    pub fn encode(&self) -> Bytes {
        let mut p = BytesMut::new();
        match self {
            Msg::AuthHello { session, nonce } => {
                p.put_u128(*session);
                p.put_slice(nonce);
            }
            Msg::AuthChallenge { nonce, proof } => {
                p.put_slice(nonce);
                p.put_slice(proof);
            }
            Msg::AuthProof { proof } => p.put_slice(proof),
            Msg::Hello { session, mode } => {
                p.put_u128(*session);
                p.put_u8(mode.code());
            }
            Msg::Welcome { session, region } => {
                p.put_u128(*session);
                p.put_u64(region.size);
                p.put_u32(region.chunk_size);
                p.put_u32(region.page_size);
                p.put_u16(region.data_port);
                p.put_slice(&region.boot_id);
                put_text(&mut p, &region.shared);
            }
            Msg::Manifest { runs, pushed } => {
                p.put_u32(runs.len() as u32);
                for r in runs {
                    p.put_u8(match r.location {
                        Location::Store => 1,
                        Location::Source => 2,
                    });
                    p.put_u64(r.chunks.start);
                    p.put_u64(r.chunks.end.saturating_sub(r.chunks.start));
                }
                p.put_u32(pushed.len() as u32);
                for (gen, sum) in pushed {
                    p.put_u64(*gen);
                    p.put_u64(*sum);
                }
            }
            Msg::Confirm { at_source, pending } => {
                put_runs(&mut p, at_source);
                put_runs(&mut p, pending);
            }
            Msg::DirtyRequest { round } => p.put_u32(*round),
            Msg::Dirty { round, runs } => {
                p.put_u32(*round);
                put_runs(&mut p, runs);
            }
            Msg::HandOver {
                runs,
                app_state,
                suspended_at_ns,
            } => {
                put_runs(&mut p, runs);
                p.put_u32(app_state.len() as u32);
                p.put_slice(app_state);
                p.put_u64(*suspended_at_ns);
            }
            Msg::Finalize | Msg::Resumed | Msg::Installed | Msg::Done | Msg::Bye => {}
            Msg::Abort { reason } => put_text(&mut p, reason),
            Msg::Object(b) => p.put_slice(b),
        }
        let mut f = BytesMut::with_capacity(HEADER_LEN + p.len());
        put_header(&mut f, self.kind(), p.len() as u32);
        f.put_slice(&p);
        f.freeze()
    }

    /// Decodes the payload of a frame whose header said `kind`.
    pub fn decode(kind: u8, mut p: &[u8]) -> Result<Msg, DecodeError> {
        let p = &mut p;
        let msg = match kind {
            1 => Msg::Hello {
                session: get_u128(p)?,
                mode: match p.first() {
                    // A peer that predates modes.
                    None => Mode::Precopy,
                    Some(_) => match p.get_u8() {
                        0 => Mode::Precopy,
                        1 => Mode::Postcopy,
                        2 => Mode::Instant,
                        _ => return Err(DecodeError::Malformed("an unknown migration mode")),
                    },
                },
            },
            2 => Msg::Welcome {
                session: get_u128(p)?,
                region: RegionInfo {
                    size: get_u64(p)?,
                    chunk_size: get_u32(p)?,
                    page_size: get_u32(p)?,
                    data_port: {
                        need(p, 2)?;
                        p.get_u16()
                    },
                    boot_id: {
                        need(p, 16)?;
                        let mut b = [0; 16];
                        p.copy_to_slice(&mut b);
                        b
                    },
                    shared: if p.is_empty() {
                        String::new()
                    } else {
                        get_exact_text(p, "a store spec")?
                    },
                },
            },
            3 => Msg::DirtyRequest { round: get_u32(p)? },
            4 => Msg::Dirty {
                round: get_u32(p)?,
                runs: get_runs(p)?,
            },
            5 => Msg::Finalize,
            6 => {
                let runs = get_runs(p)?;
                let len = capped(get_u32(p)?, MAX_APP_STATE, "the application state")?;
                need(p, len)?;
                let app_state = Bytes::copy_from_slice(&p[..len]);
                p.advance(len);
                Msg::HandOver {
                    runs,
                    app_state,
                    suspended_at_ns: get_u64(p)?,
                }
            }
            7 => Msg::Resumed,
            8 => Msg::Done,
            9 => Msg::Bye,
            10 => Msg::Abort {
                reason: get_text(p, "a reason")?,
            },
            17 => {
                let b = Bytes::copy_from_slice(p);
                p.advance(p.len());
                Msg::Object(b)
            }
            11 => {
                let n = capped(get_u32(p)?, MAX_MANIFEST_RUNS, "manifest runs")?;
                need(p, n * 17)?;
                let mut runs = Vec::with_capacity(n);
                for _ in 0..n {
                    let location = match p.get_u8() {
                        1 => Location::Store,
                        2 => Location::Source,
                        _ => return Err(DecodeError::Malformed("an unknown chunk location")),
                    };
                    let start = p.get_u64();
                    let len = p.get_u64();
                    if len == 0 {
                        return Err(DecodeError::Malformed("an empty manifest run"));
                    }
                    let end = start
                        .checked_add(len)
                        .ok_or(DecodeError::Malformed("a manifest run past 2^64"))?;
                    runs.push(ManifestRun {
                        location,
                        chunks: start..end,
                    });
                }
                let n = capped(get_u32(p)?, MAX_MANIFEST_CHUNKS, "manifest chunk records")?;
                need(p, n * 16)?;
                let pushed = (0..n).map(|_| (p.get_u64(), p.get_u64())).collect();
                Msg::Manifest { runs, pushed }
            }
            12 => Msg::Confirm {
                at_source: get_runs(p)?,
                pending: get_runs(p)?,
            },
            13 => Msg::Installed,
            14 => Msg::AuthHello {
                session: get_u128(p)?,
                nonce: get_array(p)?,
            },
            15 => Msg::AuthChallenge {
                nonce: get_array(p)?,
                proof: get_array(p)?,
            },
            16 => Msg::AuthProof {
                proof: get_array(p)?,
            },
            k => return Err(DecodeError::Kind(k)),
        };
        if !p.is_empty() {
            return Err(DecodeError::Malformed("bytes left over after the message"));
        }
        Ok(msg)
    }
}

/// Writes runs, splitting any longer than a run's 32-bit length can say.
fn put_runs(p: &mut BytesMut, runs: &[Range<u64>]) {
    let max = u64::from(u32::MAX);
    let pieces = |r: &Range<u64>| r.end.saturating_sub(r.start).div_ceil(max);
    let n: u64 = runs.iter().map(pieces).sum();
    p.put_u32(u32::try_from(n).unwrap_or(u32::MAX));
    for r in runs {
        let mut at = r.start;
        while at < r.end {
            let len = (r.end - at).min(max);
            p.put_u64(at);
            p.put_u32(len as u32);
            at += len;
        }
    }
}

fn get_runs(p: &mut &[u8]) -> Result<Vec<Range<u64>>, DecodeError> {
    let n = capped(get_u32(p)?, MAX_RUNS, "page runs")?;
    need(p, n * 12)?;
    let mut runs = Vec::with_capacity(n);
    for _ in 0..n {
        let start = p.get_u64();
        let len = p.get_u32();
        if len == 0 {
            return Err(DecodeError::Malformed("an empty page run"));
        }
        let end = start
            .checked_add(len.into())
            .ok_or(DecodeError::Malformed("a page run past 2^64"))?;
        runs.push(start..end);
    }
    Ok(runs)
}

fn put_text(p: &mut BytesMut, text: &str) {
    // Cut at a character boundary at most MAX_TEXT bytes in.
    let mut end = text.len().min(MAX_TEXT as usize);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    p.put_u32(end as u32);
    p.put_slice(&text.as_bytes()[..end]);
}

/// A length-prefixed text, decoded lossily (a reason for people).
fn get_text(p: &mut &[u8], what: &'static str) -> Result<String, DecodeError> {
    let len = capped(get_u32(p)?, MAX_TEXT, what)?;
    need(p, len)?;
    let text = String::from_utf8_lossy(&p[..len]).into_owned();
    p.advance(len);
    Ok(text)
}

/// A length-prefixed text that must be UTF-8 (a spec to act on).
fn get_exact_text(p: &mut &[u8], what: &'static str) -> Result<String, DecodeError> {
    let len = capped(get_u32(p)?, MAX_TEXT, what)?;
    need(p, len)?;
    let text = std::str::from_utf8(&p[..len])
        .map_err(|_| DecodeError::Malformed("a store spec that is not UTF-8"))?
        .to_owned();
    p.advance(len);
    Ok(text)
}

fn get_u128(p: &mut &[u8]) -> Result<u128, DecodeError> {
    need(p, 16)?;
    Ok(p.get_u128())
}

fn get_array(p: &mut &[u8]) -> Result<[u8; 32], DecodeError> {
    need(p, 32)?;
    let mut a = [0u8; 32];
    p.copy_to_slice(&mut a);
    Ok(a)
}

fn capped(len: u32, cap: u32, what: &'static str) -> Result<usize, DecodeError> {
    if len > cap {
        return Err(DecodeError::TooLong {
            what,
            len: len.into(),
            cap: cap.into(),
        });
    }
    Ok(len as usize)
}

fn need(p: &[u8], n: usize) -> Result<(), DecodeError> {
    if p.len() < n {
        return Err(DecodeError::Malformed("the payload ends early"));
    }
    Ok(())
}

fn get_u64(p: &mut &[u8]) -> Result<u64, DecodeError> {
    need(p, 8)?;
    Ok(p.get_u64())
}

fn get_u32(p: &mut &[u8]) -> Result<u32, DecodeError> {
    need(p, 4)?;
    Ok(p.get_u32())
}

/// Total pages in `runs` (saturating: runs checked by [`check_runs`] never reach it).
pub fn run_pages(runs: &[Range<u64>]) -> u64 {
    runs.iter()
        .map(|r| r.end.saturating_sub(r.start))
        .fold(0u64, u64::saturating_add)
}

/// Why a set of page runs does not fit a region.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RunError {
    /// A run reaches past the region's last page.
    #[error("page run {start}..{end} reaches past the region's {pages} pages")]
    PastEnd {
        /// First page of the run.
        start: u64,
        /// End of the run (exclusive).
        end: u64,
        /// Pages in the region.
        pages: u64,
    },
    /// Runs overlap or are out of order (a dirty set is ascending and disjoint).
    #[error("page run {start}..{end} overlaps or precedes the run before it (runs must be ascending and disjoint)")]
    Unordered {
        /// First page of the run.
        start: u64,
        /// End of the run (exclusive).
        end: u64,
    },
    /// An empty run.
    #[error("an empty page run at {start}")]
    Empty {
        /// Where.
        start: u64,
    },
}

/// Checks that `runs` are ascending, disjoint, non-empty runs of a region of `pages` pages;
/// returns how many pages they hold (at most `pages`, so nothing derived from them can grow
/// past the region's size). Runs are checked as ranges, never expanded.
pub fn check_runs(runs: &[Range<u64>], pages: u64) -> Result<u64, RunError> {
    let mut next = 0u64;
    let mut total = 0u64;
    for r in runs {
        let (start, end) = (r.start, r.end);
        if start >= end {
            return Err(RunError::Empty { start });
        }
        if end > pages {
            return Err(RunError::PastEnd { start, end, pages });
        }
        if start < next {
            return Err(RunError::Unordered { start, end });
        }
        next = end;
        total += end - start;
    }
    Ok(total)
}

/// Why a manifest does not describe a region.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    /// Its runs leave chunks out, cover some twice, or reach past the region.
    #[error(
        "its runs do not cover the region's {chunks} chunks exactly once (first problem at \
         chunk {at})"
    )]
    Coverage {
        /// Chunks in the region.
        chunks: u64,
        /// The first chunk missing, doubled or past the end.
        at: u64,
    },
    /// The records do not match the chunks its `Store` runs hold.
    #[error("it has {records} chunk records for {store} chunks in the store")]
    Records {
        /// Records sent.
        records: u64,
        /// Chunks of the `Store` runs.
        store: u64,
    },
}

/// Checks that a manifest's runs cover chunks `0..chunks` exactly once (in any order) and that
/// it has one record per chunk of its `Store` runs. Runs are checked as ranges.
pub fn check_manifest(
    runs: &[ManifestRun],
    pushed: &[(u64, u64)],
    chunks: u64,
) -> Result<(), ManifestError> {
    let mut ranges: Vec<Range<u64>> = runs.iter().map(|r| r.chunks.clone()).collect();
    ranges.sort_unstable_by_key(|r| r.start);
    let mut next = 0u64;
    for r in &ranges {
        if r.start != next || r.end <= r.start || r.end > chunks {
            return Err(ManifestError::Coverage {
                chunks,
                at: next.min(r.start),
            });
        }
        next = r.end;
    }
    if next != chunks {
        return Err(ManifestError::Coverage { chunks, at: next });
    }
    let store: u64 = runs
        .iter()
        .filter(|r| r.location == Location::Store)
        .map(|r| r.chunks.end - r.chunks.start)
        .sum();
    if store != pushed.len() as u64 {
        return Err(ManifestError::Records {
            records: pushed.len() as u64,
            store,
        });
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // page runs: one run is a real case
mod tests {
    use super::*;

    fn roundtrip(m: Msg) {
        let f = m.encode();
        let h = decode_header(f[..HEADER_LEN].try_into().unwrap()).unwrap();
        assert_eq!(h.len as usize, f.len() - HEADER_LEN);
        assert_eq!(Msg::decode(h.kind, &f[HEADER_LEN..]).unwrap(), m);
    }

    #[test]
    fn every_message_round_trips() {
        for mode in [Mode::Precopy, Mode::Postcopy, Mode::Instant] {
            roundtrip(Msg::Hello { session: 7, mode });
        }
        roundtrip(Msg::Hello {
            session: u128::MAX - 3,
            mode: Mode::Precopy,
        });
        roundtrip(Msg::AuthHello {
            session: 1 << 100,
            nonce: [3; 32],
        });
        roundtrip(Msg::AuthChallenge {
            nonce: [4; 32],
            proof: [5; 32],
        });
        roundtrip(Msg::AuthProof { proof: [6; 32] });
        for shared in ["", "redis://127.0.0.1:6379/0"] {
            roundtrip(Msg::Welcome {
                session: 1,
                region: RegionInfo {
                    size: 1 << 30,
                    chunk_size: 65536,
                    page_size: 4096,
                    data_port: 7401,
                    boot_id: [3; 16],
                    shared: shared.into(),
                },
            });
        }
        roundtrip(Msg::Confirm {
            at_source: vec![3..4, 9..12],
            pending: vec![0..3, 12..1 << 20],
        });
        roundtrip(Msg::Confirm {
            at_source: Vec::new(),
            pending: Vec::new(),
        });
        roundtrip(Msg::Manifest {
            runs: vec![
                ManifestRun {
                    location: Location::Source,
                    chunks: 4..6,
                },
                ManifestRun {
                    location: Location::Store,
                    chunks: 0..4,
                },
            ],
            pushed: vec![(1, 2), (0, 0), (3, 4), (5, 6)],
        });
        roundtrip(Msg::DirtyRequest { round: 2 });
        roundtrip(Msg::Dirty {
            round: 2,
            runs: vec![0..3, 10..11],
        });
        roundtrip(Msg::Finalize);
        roundtrip(Msg::HandOver {
            runs: vec![5..9],
            app_state: Bytes::from_static(b"pos"),
            suspended_at_ns: 99,
        });
        roundtrip(Msg::Resumed);
        roundtrip(Msg::Installed);
        roundtrip(Msg::Done);
        roundtrip(Msg::Bye);
        roundtrip(Msg::Abort {
            reason: "gone".into(),
        });
        roundtrip(Msg::Object(Bytes::from_static(b"\x01anything")));
        roundtrip(Msg::Object(Bytes::new()));
    }

    #[test]
    fn bad_headers_and_lengths_are_refused() {
        let mut f = Msg::Done.encode().to_vec();
        f[4] = 0;
        f[5] = 0;
        let h: [u8; HEADER_LEN] = f[..HEADER_LEN].try_into().unwrap();
        assert_eq!(decode_header(&h), Err(DecodeError::Version(0)));
        let mut h2 = h;
        h2[0] = b'X';
        assert_eq!(decode_header(&h2), Err(DecodeError::BadMagic));
        let mut big = Msg::Done.encode().to_vec();
        big[7..11].copy_from_slice(&(MAX_PAYLOAD + 1).to_be_bytes());
        assert!(matches!(
            decode_header(big[..HEADER_LEN].try_into().unwrap()),
            Err(DecodeError::TooLong { .. })
        ));
        // A run count far beyond what the payload holds is refused before allocating.
        let mut p = 1u32.to_be_bytes().to_vec();
        p.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(
            Msg::decode(4, &p),
            Err(DecodeError::TooLong { .. })
        ));
        assert!(matches!(
            Msg::decode(4, &p[..6]),
            Err(DecodeError::Malformed(_))
        ));
        assert_eq!(Msg::decode(99, &[]), Err(DecodeError::Kind(99)));
        assert!(matches!(
            Msg::decode(8, &[0]),
            Err(DecodeError::Malformed(_))
        ));
    }

    #[test]
    fn long_runs_are_split_on_the_wire_and_checked_as_ranges() {
        let f = Msg::Dirty {
            round: 1,
            runs: vec![3..3 + (1 << 33)],
        }
        .encode();
        let h = decode_header(f[..HEADER_LEN].try_into().unwrap()).unwrap();
        let Msg::Dirty { runs, .. } = Msg::decode(h.kind, &f[HEADER_LEN..]).unwrap() else {
            panic!("not a Dirty");
        };
        assert_eq!(runs.len(), 3);
        assert_eq!(run_pages(&runs), 1 << 33);
        assert_eq!(check_runs(&runs, 4 + (1 << 33)), Ok(1 << 33));
        assert!(matches!(
            check_runs(&runs, 1 << 33),
            Err(RunError::PastEnd { .. })
        ));
        assert_eq!(
            check_runs(&[5..9, 2..3], 100),
            Err(RunError::Unordered { start: 2, end: 3 })
        );
        assert_eq!(check_runs(&[5..5], 100), Err(RunError::Empty { start: 5 }));
        // A kind's own cap is checked with the header.
        let mut big = Msg::Hello {
            session: 1,
            mode: Mode::Instant,
        }
        .encode()
        .to_vec();
        big[7..11].copy_from_slice(&18u32.to_be_bytes());
        assert!(matches!(
            decode_header(big[..HEADER_LEN].try_into().unwrap()),
            Err(DecodeError::TooLong {
                len: 18,
                cap: 17,
                ..
            })
        ));
    }

    #[test]
    fn peers_without_modes_or_shared_stores_are_understood() {
        // The hello and welcome of a build that predates modes.
        assert_eq!(
            Msg::decode(1, &5u128.to_be_bytes()),
            Ok(Msg::Hello {
                session: 5,
                mode: Mode::Precopy
            })
        );
        let mut w = Msg::Welcome {
            session: 1,
            region: RegionInfo {
                size: 4096,
                chunk_size: 4096,
                page_size: 4096,
                data_port: 1,
                boot_id: [0; 16],
                shared: String::new(),
            },
        }
        .encode()
        .to_vec();
        w.truncate(w.len() - 4);
        let m = Msg::decode(2, &w[HEADER_LEN..]).unwrap();
        assert!(matches!(m, Msg::Welcome { region, .. } if region.shared.is_empty()));
        let mut h = 5u128.to_be_bytes().to_vec();
        h.push(9);
        assert!(matches!(Msg::decode(1, &h), Err(DecodeError::Malformed(_))));
    }

    #[test]
    fn manifests_are_capped_and_checked() {
        // Counts beyond what the payload holds are refused before allocating.
        let mut p = u32::MAX.to_be_bytes().to_vec();
        assert!(matches!(
            Msg::decode(11, &p),
            Err(DecodeError::TooLong { .. })
        ));
        p = 1u32.to_be_bytes().to_vec();
        assert!(matches!(
            Msg::decode(11, &p),
            Err(DecodeError::Malformed(_))
        ));
        p.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]);
        p.extend_from_slice(&(MAX_MANIFEST_CHUNKS + 1).to_be_bytes());
        assert!(matches!(
            Msg::decode(11, &p),
            Err(DecodeError::TooLong { .. })
        ));
        let run = |location, chunks| ManifestRun { location, chunks };
        let ok = [run(Location::Source, 3..5), run(Location::Store, 0..3)];
        assert_eq!(check_manifest(&ok, &[(1, 1); 3], 5), Ok(()));
        assert_eq!(
            check_manifest(&ok, &[(1, 1); 2], 5),
            Err(ManifestError::Records {
                records: 2,
                store: 3
            })
        );
        assert!(
            check_manifest(&ok, &[(1, 1); 3], 6).is_err(),
            "a chunk left out"
        );
        assert!(
            check_manifest(&ok, &[(1, 1); 3], 4).is_err(),
            "past the end"
        );
        let twice = [run(Location::Source, 2..5), run(Location::Store, 0..3)];
        assert!(
            check_manifest(&twice, &[(1, 1); 3], 5).is_err(),
            "a chunk twice"
        );
    }
}
