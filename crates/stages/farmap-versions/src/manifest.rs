//! A version's manifest: which chunk holds which content, as a change to its parent or whole.
//!
//! ```text
//!   magic "FMVERS01" | seq u64 | epoch u64 | base u64 | size u64 | chunk_size u32 | flags u32
//!   | time_ms u64 | count u64 | [from] | count × (index u64 | hash [32])
//!   | sha256 of all before [32]
//!   from = seq u64 | depth u32 | name_len u32 | name [name_len]      (flags bit 1 only)
//! ```
//!
//! Integers are little-endian. `flags` bit 0: the manifest is whole (every chunk that holds
//! data is listed; `base == seq`); otherwise it lists the chunks that changed since version
//! `seq - 1`, and `base` is the whole manifest the chain starts from. Bit 1 (only on version
//! 0 of a fork, which is not whole): the chain starts from version `seq` of region `name`
//! instead of from nothing, `depth` forks deep. A hash of all zeros is a chunk that reads as
//! zeros.

use farmap_core::{ErrorKind, Geometry, StoreError, StoreResult, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE};

use crate::Hash;

const MAGIC: &[u8; 8] = b"FMVERS01";
/// Bytes before the entries.
const HEADER: usize = 8 + 8 * 4 + 4 * 2 + 8 + 8;
/// Bytes of one entry.
const ENTRY: usize = 8 + 32;
/// Bytes of the trailer.
const TRAILER: usize = 32;
/// The whole-manifest flag.
const WHOLE: u32 = 1;
/// The flag of a fork's first version (a [`Parent`] follows the header).
const FROM: u32 = 2;
/// Forks of forks a chain may go through: a deeper fork is written whole.
pub const MAX_DEPTH: u32 = 8;

/// The version a fork starts from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parent {
    /// Its region.
    pub region: String,
    /// Its version.
    pub seq: u64,
    /// Forks between it and a region that started from nothing, plus one (at most
    /// [`MAX_DEPTH`]).
    pub depth: u32,
}

/// One version of a region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    /// Its number: versions of a region are numbered from 0 without gaps.
    pub seq: u64,
    /// The writer's epoch (raised by a writer that takes the region over).
    pub epoch: u64,
    /// The whole manifest its chain starts from (itself when whole).
    pub base: u64,
    /// The region's size in bytes.
    pub size: u64,
    /// The region's chunk size.
    pub chunk_size: u32,
    /// Whether it lists every chunk holding data (else the changes since `seq - 1`).
    pub whole: bool,
    /// When it was written, milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// `(chunk, content)`, ascending by chunk, each once.
    pub entries: Vec<(u64, Hash)>,
    /// A fork's version 0: the version its chain starts from.
    pub from: Option<Parent>,
}

impl Manifest {
    /// A region's version 0, written now: whole, listing `entries`.
    pub fn first(size: u64, chunk_size: u32, entries: Vec<(u64, Hash)>) -> Manifest {
        Manifest {
            seq: 0,
            epoch: 1,
            base: 0,
            size,
            chunk_size,
            whole: true,
            time_ms: crate::now_ms(),
            entries,
            from: None,
        }
    }

    /// A fork's version 0, written now: it lists nothing and starts from `parent`.
    pub fn fork_of(size: u64, chunk_size: u32, parent: Parent) -> Manifest {
        Manifest {
            whole: false,
            from: Some(parent),
            ..Manifest::first(size, chunk_size, Vec::new())
        }
    }

    /// The region's shape.
    pub fn geometry(&self) -> StoreResult<Geometry> {
        Geometry::new(self.size, u64::from(self.chunk_size)).map_err(|e| corrupt(format!("{e}")))
    }

    /// Its bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER + self.entries.len() * ENTRY + TRAILER);
        out.extend_from_slice(MAGIC);
        for v in [self.seq, self.epoch, self.base, self.size] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&self.chunk_size.to_le_bytes());
        let flags = if self.whole { WHOLE } else { 0 } | if self.from.is_some() { FROM } else { 0 };
        out.extend_from_slice(&flags.to_le_bytes());
        out.extend_from_slice(&self.time_ms.to_le_bytes());
        out.extend_from_slice(&(self.entries.len() as u64).to_le_bytes());
        if let Some(p) = &self.from {
            out.extend_from_slice(&p.seq.to_le_bytes());
            out.extend_from_slice(&p.depth.to_le_bytes());
            out.extend_from_slice(&(p.region.len() as u32).to_le_bytes());
            out.extend_from_slice(p.region.as_bytes());
        }
        for (idx, hash) in &self.entries {
            out.extend_from_slice(&idx.to_le_bytes());
            out.extend_from_slice(&hash.0);
        }
        let sum = Hash::of(&out);
        out.extend_from_slice(&sum.0);
        out
    }

    /// Reads a manifest, checking everything: its sum, its shape, its entries (in the
    /// region, ascending). Nothing is allocated beyond what `bytes` holds.
    pub fn decode(bytes: &[u8]) -> StoreResult<Manifest> {
        if bytes.len() < HEADER + TRAILER {
            return Err(corrupt(format!("{} bytes is too short", bytes.len())));
        }
        let (body, sum) = bytes.split_at(bytes.len() - TRAILER);
        if Hash::of(body).0 != sum {
            return Err(corrupt("its checksum does not match".into()));
        }
        if &body[..8] != MAGIC {
            return Err(corrupt("it does not start with FMVERS01".into()));
        }
        let u64_at = |at: usize| u64::from_le_bytes(body[at..at + 8].try_into().expect("8"));
        let u32_at = |at: usize| u32::from_le_bytes(body[at..at + 4].try_into().expect("4"));
        let (seq, epoch, base, size) = (u64_at(8), u64_at(16), u64_at(24), u64_at(32));
        let chunk_size = u32_at(40);
        let flags = u32_at(44);
        let time_ms = u64_at(48);
        let count = u64_at(56);
        if flags & !(WHOLE | FROM) != 0 {
            return Err(corrupt(format!("unknown flags {flags:#x}")));
        }
        let whole = flags & WHOLE != 0;
        if !(MIN_CHUNK_SIZE..=MAX_CHUNK_SIZE).contains(&chunk_size) || !chunk_size.is_power_of_two()
        {
            return Err(corrupt(format!("chunk size {chunk_size}")));
        }
        let geometry =
            Geometry::new(size, u64::from(chunk_size)).map_err(|e| corrupt(format!("{e}")))?;
        if base > seq || (whole && base != seq) {
            return Err(corrupt(format!("version {seq} names base {base}")));
        }
        let mut rest = &body[HEADER..];
        let mut from = None;
        if flags & FROM != 0 {
            if whole || seq != 0 {
                return Err(corrupt(format!("version {seq} names a parent")));
            }
            let (fixed, after) = rest
                .split_at_checked(16)
                .ok_or_else(|| corrupt("its parent is cut short".into()))?;
            let pseq = u64::from_le_bytes(fixed[..8].try_into().expect("8"));
            let depth = u32::from_le_bytes(fixed[8..12].try_into().expect("4"));
            let len = u32::from_le_bytes(fixed[12..].try_into().expect("4")) as usize;
            let (name, after) = after
                .split_at_checked(len)
                .ok_or_else(|| corrupt("its parent is cut short".into()))?;
            let name = std::str::from_utf8(name)
                .ok()
                .filter(|n| crate::check_name("region", n).is_ok())
                .ok_or_else(|| corrupt("its parent's name is not a region name".into()))?;
            if !(1..=MAX_DEPTH).contains(&depth) {
                return Err(corrupt(format!("its parent is {depth} forks deep")));
            }
            from = Some(Parent {
                region: name.to_owned(),
                seq: pseq,
                depth,
            });
            rest = after;
        }
        if count.checked_mul(ENTRY as u64) != Some(rest.len() as u64) {
            return Err(corrupt(format!("{count} entries in {} bytes", rest.len())));
        }
        let mut entries = Vec::with_capacity(rest.len() / ENTRY);
        for e in rest.chunks_exact(ENTRY) {
            let idx = u64::from_le_bytes(e[..8].try_into().expect("8"));
            if idx >= geometry.chunk_count() {
                return Err(corrupt(format!("chunk {idx} is outside the region")));
            }
            if entries.last().is_some_and(|(last, _)| *last >= idx) {
                return Err(corrupt(format!("chunk {idx} is out of order")));
            }
            entries.push((idx, Hash(e[8..].try_into().expect("32"))));
        }
        Ok(Manifest {
            seq,
            epoch,
            base,
            size,
            chunk_size,
            whole,
            time_ms,
            entries,
            from,
        })
    }
}

fn corrupt(why: String) -> StoreError {
    StoreError::new(
        ErrorKind::Corrupt,
        format!("a version manifest is damaged: {why}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Manifest {
        Manifest {
            seq: 7,
            epoch: 2,
            base: 4,
            size: 1 << 20,
            chunk_size: 65536,
            whole: false,
            time_ms: 1_700_000_000_000,
            entries: vec![(0, Hash::of(b"a")), (3, Hash::ZERO), (15, Hash::of(b"b"))],
            from: None,
        }
    }

    #[test]
    fn round_trip() {
        let m = sample();
        assert_eq!(Manifest::decode(&m.encode()).unwrap(), m);
        let whole = Manifest {
            whole: true,
            base: 7,
            entries: vec![],
            ..m
        };
        assert_eq!(Manifest::decode(&whole.encode()).unwrap(), whole.clone());
        let fork = Manifest {
            seq: 0,
            base: 0,
            whole: false,
            from: Some(Parent {
                region: "base".into(),
                seq: 12,
                depth: 2,
            }),
            ..whole
        };
        assert_eq!(Manifest::decode(&fork.encode()).unwrap(), fork);
        let not_first = Manifest {
            seq: 1,
            ..fork.clone()
        };
        assert!(Manifest::decode(&not_first.encode()).is_err());
        let too_deep = Manifest {
            from: Some(Parent {
                region: "base".into(),
                seq: 1,
                depth: MAX_DEPTH + 1,
            }),
            ..fork
        };
        assert!(Manifest::decode(&too_deep.encode()).is_err());
    }

    #[test]
    fn damage_is_refused() {
        let bytes = sample().encode();
        for cut in [0, 10, HEADER, bytes.len() - 1] {
            assert!(Manifest::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        for flip in [0, 9, 41, HEADER + 3, bytes.len() - 1] {
            let mut b = bytes.clone();
            b[flip] ^= 1;
            let e = Manifest::decode(&b).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
        }
    }

    /// Well-summed manifests that lie about their shape are refused all the same.
    #[test]
    fn lies_are_refused() {
        let resum = |mut m: Vec<u8>| {
            let n = m.len() - TRAILER;
            m.truncate(n);
            let s = Hash::of(&m);
            m.extend_from_slice(&s.0);
            m
        };
        let mut outside = sample();
        outside.entries.push((16, Hash::ZERO));
        assert!(Manifest::decode(&outside.encode()).is_err());
        let mut unordered = sample();
        unordered.entries.swap(0, 1);
        assert!(Manifest::decode(&unordered.encode()).is_err());
        let mut count = sample().encode();
        count[56..64].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(Manifest::decode(&resum(count)).is_err());
        let bad_base = Manifest {
            base: 9,
            ..sample()
        };
        assert!(Manifest::decode(&bad_base.encode()).is_err());
    }
}
