//! The object protocol's messages, carried as the payload of farmap-migrate's
//! `Msg::Object` frames (which frame, authenticate and cap them). Sans-I/O: encoding and a
//! decoder that checks every length before it allocates.
//!
//! Page runs are *slot-relative* page indices, ascending, disjoint and non-empty; the
//! receiver checks them against its slot ([`check_runs`]).

use std::ops::Range;

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// Most runs in one message.
pub const MAX_RUNS: u32 = 1 << 20;
/// Most bytes of page data in one message (the frame's cap is 64 MiB).
pub const MAX_DATA: u32 = 32 << 20;
/// Most bytes of a reason.
pub const MAX_REASON: u32 = 1024;

/// The arena both sides must share, as the source describes its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaShape {
    /// Base address.
    pub base: u64,
    /// Bytes.
    pub size: u64,
    /// log2 of the slot size.
    pub slot_shift: u32,
    /// The region's chunk.
    pub chunk: u32,
    /// The page size.
    pub page: u32,
}

/// One message of an object migration. `S→D` travels from the source (the object's owner)
/// to the destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ObjMsg {
    /// S→D: the object to move.
    Hello {
        /// Its slot.
        slot: u32,
        /// Its type's tag.
        tag: u64,
        /// The build of the executable that made it.
        build_id: [u8; 32],
        /// The source's arena.
        arena: ArenaShape,
    },
    /// D→S: the slot is free here and now inbound.
    Welcome,
    /// S→D: pages of the object (prefill: round 0; then the pages written meanwhile; after
    /// writes stopped, `u32::MAX` for the written pages that do not fit the hand-over).
    Pages {
        /// 0 for the page set, then the dirty rounds from 1, `u32::MAX` after writes stopped.
        round: u32,
        /// Slot-relative page runs.
        runs: Vec<Range<u64>>,
        /// The pages' bytes, run after run.
        data: Bytes,
    },
    /// S→D: writes stopped at the source; these are the pages written since the last
    /// `Pages` (the last ones the object needs). The destination installs them and says so.
    HandOver {
        /// Slot-relative page runs.
        runs: Vec<Range<u64>>,
        /// Their bytes.
        data: Bytes,
        /// CLOCK_MONOTONIC when writes stopped at the source (ns).
        writes_stopped_ns: u64,
    },
    /// D→S: every page is in place; reads may move here.
    Installed {
        /// CLOCK_MONOTONIC then (ns).
        installed_ns: u64,
    },
    /// S→D: the source's readers are gone: the destination owns the object.
    Released {
        /// CLOCK_MONOTONIC then (ns).
        released_ns: u64,
    },
    /// D→S: the object is the destination's (it may forget it).
    Done {
        /// CLOCK_MONOTONIC when the destination took ownership (ns).
        owned_ns: u64,
        /// Bytes of every frame the destination received on this connection.
        received_bytes: u64,
    },
    /// S→D: answer with `Flushed` once every page sent before this is installed (the source
    /// stops writes only once the destination has caught up, so the window holds only the
    /// last pages).
    Flush {
        /// The last round sent.
        round: u32,
    },
    /// D→S: every page sent before the `Flush` is installed.
    Flushed {
        /// The round of the `Flush`.
        round: u32,
    },
    /// Either way: abandoned.
    Abort {
        /// Why, as a sentence.
        reason: String,
    },
}

/// Why an object message could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ObjDecodeError {
    /// An unknown message kind.
    #[error("unknown object message kind {0}")]
    Kind(u8),
    /// A count or length above its cap.
    #[error("an object message claims {len} for {what}, more than the cap of {cap}")]
    TooLong {
        /// What.
        what: &'static str,
        /// Claimed.
        len: u64,
        /// Cap.
        cap: u64,
    },
    /// Short, long, or inconsistent.
    #[error("an object message is malformed: {0}")]
    Malformed(&'static str),
}

pub(crate) fn put_runs(p: &mut BytesMut, runs: &[Range<u64>]) {
    p.put_u32(runs.len() as u32);
    for r in runs {
        p.put_u64(r.start);
        p.put_u64(r.end - r.start);
    }
}

fn put_data(p: &mut BytesMut, data: &[u8]) {
    p.put_u32(data.len() as u32);
    p.put_slice(data);
}

impl ObjMsg {
    /// The message's name, for errors.
    pub fn name(&self) -> &'static str {
        match self {
            ObjMsg::Hello { .. } => "Hello",
            ObjMsg::Welcome => "Welcome",
            ObjMsg::Pages { .. } => "Pages",
            ObjMsg::HandOver { .. } => "HandOver",
            ObjMsg::Installed { .. } => "Installed",
            ObjMsg::Released { .. } => "Released",
            ObjMsg::Done { .. } => "Done",
            ObjMsg::Flush { .. } => "Flush",
            ObjMsg::Flushed { .. } => "Flushed",
            ObjMsg::Abort { .. } => "Abort",
        }
    }

    /// The payload of a `Msg::Object` frame.
    pub fn encode(&self) -> Bytes {
        let mut p = BytesMut::new();
        match self {
            ObjMsg::Hello {
                slot,
                tag,
                build_id,
                arena,
            } => {
                p.put_u8(1);
                p.put_u32(*slot);
                p.put_u64(*tag);
                p.put_slice(build_id);
                p.put_u64(arena.base);
                p.put_u64(arena.size);
                p.put_u32(arena.slot_shift);
                p.put_u32(arena.chunk);
                p.put_u32(arena.page);
            }
            ObjMsg::Welcome => p.put_u8(2),
            ObjMsg::Pages { round, runs, data } => {
                p.put_u8(3);
                p.put_u32(*round);
                put_runs(&mut p, runs);
                put_data(&mut p, data);
            }
            ObjMsg::HandOver {
                runs,
                data,
                writes_stopped_ns,
            } => {
                p.put_u8(4);
                put_runs(&mut p, runs);
                put_data(&mut p, data);
                p.put_u64(*writes_stopped_ns);
            }
            ObjMsg::Installed { installed_ns } => {
                p.put_u8(5);
                p.put_u64(*installed_ns);
            }
            ObjMsg::Released { released_ns } => {
                p.put_u8(6);
                p.put_u64(*released_ns);
            }
            ObjMsg::Done {
                owned_ns,
                received_bytes,
            } => {
                p.put_u8(7);
                p.put_u64(*owned_ns);
                p.put_u64(*received_bytes);
            }
            ObjMsg::Flush { round } => {
                p.put_u8(9);
                p.put_u32(*round);
            }
            ObjMsg::Flushed { round } => {
                p.put_u8(10);
                p.put_u32(*round);
            }
            ObjMsg::Abort { reason } => {
                p.put_u8(8);
                let r = &reason.as_bytes()[..reason.len().min(MAX_REASON as usize)];
                put_data(&mut p, r);
            }
        }
        p.freeze()
    }

    /// Decodes a `Msg::Object` payload (page data is copied out of `p`).
    pub fn decode(p: &[u8]) -> Result<ObjMsg, ObjDecodeError> {
        Self::decode_with(p, &|at, len| Bytes::copy_from_slice(&p[at..at + len]))
    }

    /// [`decode`](Self::decode) of a payload held in `Bytes`: page data is a slice of it, not
    /// a copy.
    pub fn decode_shared(b: &Bytes) -> Result<ObjMsg, ObjDecodeError> {
        Self::decode_with(b, &|at, len| b.slice(at..at + len))
    }

    /// Decodes `whole`; `data(at, len)` makes the page data found at offset `at`.
    fn decode_with(
        whole: &[u8],
        data: &dyn Fn(usize, usize) -> Bytes,
    ) -> Result<ObjMsg, ObjDecodeError> {
        let mut rest = whole;
        let p = &mut rest;
        let total = whole.len();
        let get_data = |p: &mut &[u8], cap: u32| -> Result<Bytes, ObjDecodeError> {
            let n = get_len(p, cap)?;
            let b = data(total - p.len(), n);
            p.advance(n);
            Ok(b)
        };
        let kind = get_u8(p)?;
        let m = match kind {
            1 => ObjMsg::Hello {
                slot: get_u32(p)?,
                tag: get_u64(p)?,
                build_id: {
                    need(p, 32)?;
                    let mut b = [0u8; 32];
                    p.copy_to_slice(&mut b);
                    b
                },
                arena: ArenaShape {
                    base: get_u64(p)?,
                    size: get_u64(p)?,
                    slot_shift: get_u32(p)?,
                    chunk: get_u32(p)?,
                    page: get_u32(p)?,
                },
            },
            2 => ObjMsg::Welcome,
            3 => ObjMsg::Pages {
                round: get_u32(p)?,
                runs: get_runs(p)?,
                data: get_data(p, MAX_DATA)?,
            },
            4 => ObjMsg::HandOver {
                runs: get_runs(p)?,
                data: get_data(p, MAX_DATA)?,
                writes_stopped_ns: get_u64(p)?,
            },
            5 => ObjMsg::Installed {
                installed_ns: get_u64(p)?,
            },
            6 => ObjMsg::Released {
                released_ns: get_u64(p)?,
            },
            7 => ObjMsg::Done {
                owned_ns: get_u64(p)?,
                received_bytes: get_u64(p)?,
            },
            8 => {
                let b = get_data(p, MAX_REASON)?;
                ObjMsg::Abort {
                    reason: String::from_utf8_lossy(&b).into_owned(),
                }
            }
            9 => ObjMsg::Flush { round: get_u32(p)? },
            10 => ObjMsg::Flushed { round: get_u32(p)? },
            k => return Err(ObjDecodeError::Kind(k)),
        };
        if !p.is_empty() {
            return Err(ObjDecodeError::Malformed("bytes left over"));
        }
        Ok(m)
    }
}

/// Checks `runs` (slot-relative pages) against a slot of `slot_pages` pages and `data`
/// against them: ascending, disjoint, non-empty, inside the slot, and exactly one page of
/// `page` bytes in `data` per page of the runs. Returns the page count.
pub fn check_runs(
    runs: &[Range<u64>],
    data_len: usize,
    slot_pages: u64,
    page: usize,
) -> Result<u64, &'static str> {
    let mut end = 0u64;
    let mut pages = 0u64;
    for (i, r) in runs.iter().enumerate() {
        if r.start >= r.end {
            return Err("an empty page run");
        }
        if i > 0 && r.start < end {
            return Err("page runs out of order or overlapping");
        }
        if r.end > slot_pages {
            return Err("a page run outside the object's slot");
        }
        end = r.end;
        pages += r.end - r.start;
    }
    if pages.checked_mul(page as u64) != Some(data_len as u64) {
        return Err("the page data does not match its runs");
    }
    Ok(pages)
}

fn need(p: &[u8], n: usize) -> Result<(), ObjDecodeError> {
    if p.len() < n {
        return Err(ObjDecodeError::Malformed("the payload ends early"));
    }
    Ok(())
}

fn get_u8(p: &mut &[u8]) -> Result<u8, ObjDecodeError> {
    need(p, 1)?;
    Ok(p.get_u8())
}

fn get_u32(p: &mut &[u8]) -> Result<u32, ObjDecodeError> {
    need(p, 4)?;
    Ok(p.get_u32())
}

fn get_u64(p: &mut &[u8]) -> Result<u64, ObjDecodeError> {
    need(p, 8)?;
    Ok(p.get_u64())
}

fn get_runs(p: &mut &[u8]) -> Result<Vec<Range<u64>>, ObjDecodeError> {
    let n = get_u32(p)?;
    if n > MAX_RUNS {
        return Err(ObjDecodeError::TooLong {
            what: "page runs",
            len: n.into(),
            cap: MAX_RUNS.into(),
        });
    }
    let n = n as usize;
    need(p, n * 16)?;
    let mut runs = Vec::with_capacity(n);
    for _ in 0..n {
        let start = p.get_u64();
        let len = p.get_u64();
        let end = start
            .checked_add(len)
            .ok_or(ObjDecodeError::Malformed("a page run past 2^64"))?;
        runs.push(start..end);
    }
    Ok(runs)
}

/// A data length (capped) whose bytes are all there.
fn get_len(p: &mut &[u8], cap: u32) -> Result<usize, ObjDecodeError> {
    let n = get_u32(p)?;
    if n > cap {
        return Err(ObjDecodeError::TooLong {
            what: "page data",
            len: n.into(),
            cap: cap.into(),
        });
    }
    need(p, n as usize)?;
    Ok(n as usize)
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // one-run lists are the cases
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// One message of every kind: the fuzz target's seeds (written by farmap-fuzz-seeds),
    /// which must therefore decode.
    fn all() -> Vec<ObjMsg> {
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../fuzz/corpus/slope_msg"
        );
        let mut msgs = Vec::new();
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("seed-")
            {
                let m = ObjMsg::decode(&std::fs::read(&p).unwrap())
                    .unwrap_or_else(|e| panic!("{p:?}: {e}"));
                msgs.push(m);
            }
        }
        let kinds: std::collections::BTreeSet<_> = msgs.iter().map(ObjMsg::name).collect();
        assert_eq!(
            (msgs.len(), kinds.len()),
            (10, 10),
            "one seed per kind: {kinds:?}"
        );
        msgs
    }

    #[test]
    fn every_message_round_trips_and_truncations_fail() {
        for m in all() {
            let e = m.encode();
            assert_eq!(ObjMsg::decode(&e).unwrap(), m);
            for cut in 0..e.len() {
                assert!(
                    ObjMsg::decode(&e[..cut]).is_err(),
                    "{} cut at {cut}",
                    m.name()
                );
            }
            let mut long = e.to_vec();
            long.push(0);
            assert!(ObjMsg::decode(&long).is_err());
        }
        assert_eq!(ObjMsg::decode(&[11]), Err(ObjDecodeError::Kind(11)));
    }

    #[test]
    fn claimed_lengths_are_capped_before_anything_is_read() {
        let mut p = vec![3, 0, 0, 0, 1];
        p.extend_from_slice(&(MAX_RUNS + 1).to_be_bytes());
        assert!(matches!(
            ObjMsg::decode(&p),
            Err(ObjDecodeError::TooLong { .. })
        ));
        let mut p = vec![3, 0, 0, 0, 1, 0, 0, 0, 0];
        p.extend_from_slice(&(MAX_DATA + 1).to_be_bytes());
        assert!(matches!(
            ObjMsg::decode(&p),
            Err(ObjDecodeError::TooLong { .. })
        ));
        // A run whose end overflows.
        let mut p = vec![4, 0, 0, 0, 1];
        p.extend_from_slice(&u64::MAX.to_be_bytes());
        p.extend_from_slice(&2u64.to_be_bytes());
        assert!(ObjMsg::decode(&p).is_err());
    }

    #[test]
    fn runs_are_checked_against_the_slot_and_the_data() {
        assert_eq!(check_runs(&[0..2, 4..5], 3 * 4096, 16, 4096), Ok(3));
        assert!(
            check_runs(&[0..2, 1..5], 5 * 4096, 16, 4096).is_err(),
            "overlap"
        );
        assert!(
            check_runs(&[4..5, 0..2], 3 * 4096, 16, 4096).is_err(),
            "order"
        );
        assert!(check_runs(&[3..3], 0, 16, 4096).is_err(), "empty");
        assert!(
            check_runs(&[15..17], 2 * 4096, 16, 4096).is_err(),
            "outside"
        );
        assert!(check_runs(&[0..2], 4096, 16, 4096).is_err(), "short data");
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = ObjMsg::decode(&b);
        }
    }
}
