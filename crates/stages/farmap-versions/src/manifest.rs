//! A version's manifest: which chunk holds which content, as a change to its parent or whole.
//!
//! ```text
//!   magic "FMVERS01" | seq u64 | epoch u64 | base u64 | size u64 | chunk_size u32 | flags u32
//!   | time_ms u64 | count u64 | [from] | [page_chunks u32]
//!   | count × (index u64 | hash [32])        (flags bit 2 clear)
//!   | count × (hash [32] | chunks u32)       (flags bit 2 set: pages)
//!   | sha256 of all before [32]
//!   from = seq u64 | depth u32 | name_len u32 | name [name_len]      (flags bit 1 only)
//! ```
//!
//! Integers are little-endian. `flags` bit 0: the manifest is whole (every chunk that holds
//! data is listed; `base == seq`); otherwise it lists the chunks that changed since version
//! `seq - 1`, and `base` is the whole manifest the chain starts from. Bit 1 (only on version
//! 0 of a fork, which is not whole): the chain starts from version `seq` of region `name`
//! instead of from nothing, `depth` forks deep. A hash of all zeros is a chunk that reads as
//! zeros. Bit 2 (whole manifests only; every whole manifest this crate writes): the chunks
//! are listed in pages of `page_chunks` chunks each ([`page`](crate::page)), and the
//! manifest lists the pages, one per run of `page_chunks` chunks of the region, each with its
//! hash and the chunks it lists (an empty page has the zero hash).

use farmap_core::{ErrorKind, Geometry, StoreError, StoreResult, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE};

use crate::page::{page_count, valid_page_chunks, PageRef, PAGE_CHUNKS};
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
/// The flag of a manifest of pages.
const PAGED: u32 = 4;
/// Bytes of one page reference.
const PAGE_ENTRY: usize = 32 + 4;
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
    /// `(chunk, content)`, ascending by chunk, each once (none in a manifest of pages).
    pub entries: Vec<(u64, Hash)>,
    /// A whole manifest's pages (see [`page`](crate::page)): one per run of
    /// `page_chunks` chunks; empty when the manifest lists its chunks itself.
    pub pages: Vec<PageRef>,
    /// Chunks per page (0 when `pages` is empty).
    pub page_chunks: u32,
    /// A fork's version 0: the version its chain starts from.
    pub from: Option<Parent>,
}

impl Manifest {
    /// A region's version 0, written now: whole, its chunks in `pages` of `page_chunks`.
    pub fn first(size: u64, chunk_size: u32, page_chunks: u32, pages: Vec<PageRef>) -> Manifest {
        Manifest {
            seq: 0,
            epoch: 1,
            base: 0,
            size,
            chunk_size,
            whole: true,
            time_ms: crate::now_ms(),
            entries: Vec::new(),
            pages,
            page_chunks,
            from: None,
        }
    }

    /// A new region's version 0 for a region of `geometry`: whole, holding nothing.
    pub fn empty(geometry: Geometry) -> Manifest {
        let n = page_count(geometry, PAGE_CHUNKS) as usize;
        Manifest::first(
            geometry.size(),
            geometry.chunk_size(),
            PAGE_CHUNKS,
            vec![PageRef::EMPTY; n],
        )
    }

    /// A fork's version 0, written now: it lists nothing and starts from `parent`.
    pub fn fork_of(size: u64, chunk_size: u32, parent: Parent) -> Manifest {
        Manifest {
            whole: false,
            from: Some(parent),
            pages: Vec::new(),
            page_chunks: 0,
            ..Manifest::first(size, chunk_size, 0, Vec::new())
        }
    }

    /// Chunks it lists: in its entries, or in its pages.
    pub fn chunks(&self) -> u64 {
        if self.pages.is_empty() {
            self.entries.len() as u64
        } else {
            self.pages.iter().map(|p| u64::from(p.chunks)).sum()
        }
    }

    /// The region's shape.
    pub fn geometry(&self) -> StoreResult<Geometry> {
        Geometry::new_bounded(self.size, u64::from(self.chunk_size))
            .map_err(|e| corrupt(format!("{e}")))
    }

    /// Its bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER + self.entries.len() * ENTRY + TRAILER);
        out.extend_from_slice(MAGIC);
        for v in [self.seq, self.epoch, self.base, self.size] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&self.chunk_size.to_le_bytes());
        let paged = !self.pages.is_empty();
        let flags = if self.whole { WHOLE } else { 0 }
            | if self.from.is_some() { FROM } else { 0 }
            | if paged { PAGED } else { 0 };
        out.extend_from_slice(&flags.to_le_bytes());
        out.extend_from_slice(&self.time_ms.to_le_bytes());
        let count = if paged {
            self.pages.len()
        } else {
            self.entries.len()
        };
        out.extend_from_slice(&(count as u64).to_le_bytes());
        if let Some(p) = &self.from {
            out.extend_from_slice(&p.seq.to_le_bytes());
            out.extend_from_slice(&p.depth.to_le_bytes());
            out.extend_from_slice(&(p.region.len() as u32).to_le_bytes());
            out.extend_from_slice(p.region.as_bytes());
        }
        if paged {
            out.extend_from_slice(&self.page_chunks.to_le_bytes());
            for p in &self.pages {
                out.extend_from_slice(&p.hash.0);
                out.extend_from_slice(&p.chunks.to_le_bytes());
            }
        } else {
            for (idx, hash) in &self.entries {
                out.extend_from_slice(&idx.to_le_bytes());
                out.extend_from_slice(&hash.0);
            }
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
        if flags & !(WHOLE | FROM | PAGED) != 0 {
            return Err(corrupt(format!("unknown flags {flags:#x}")));
        }
        let whole = flags & WHOLE != 0;
        if !(MIN_CHUNK_SIZE..=MAX_CHUNK_SIZE).contains(&chunk_size) || !chunk_size.is_power_of_two()
        {
            return Err(corrupt(format!("chunk size {chunk_size}")));
        }
        let geometry = Geometry::new_bounded(size, u64::from(chunk_size))
            .map_err(|e| corrupt(format!("{e}")))?;
        if base > seq || (whole && base != seq) {
            return Err(corrupt(format!("version {seq} names base {base}")));
        }
        let mut rest = &body[HEADER..];
        let mut from = None;
        if flags & FROM != 0 {
            if whole || seq != 0 {
                return Err(corrupt(format!("version {seq} names a parent")));
            }
            let (parent, after) = decode_parent(rest)?;
            from = Some(parent);
            rest = after;
        }
        let (entries, pages, page_chunks) = if flags & PAGED != 0 {
            if !whole {
                return Err(corrupt(format!(
                    "version {seq} lists pages but is not whole"
                )));
            }
            let (pages, page_chunks) = decode_pages(rest, count, geometry)?;
            (Vec::new(), pages, page_chunks)
        } else {
            (decode_entries(rest, count, geometry)?, Vec::new(), 0)
        };
        Ok(Manifest {
            seq,
            epoch,
            base,
            size,
            chunk_size,
            whole,
            time_ms,
            entries,
            pages,
            page_chunks,
            from,
        })
    }
}

/// A fork's parent, and what follows it.
fn decode_parent(rest: &[u8]) -> StoreResult<(Parent, &[u8])> {
    let (fixed, after) = rest
        .split_at_checked(16)
        .ok_or_else(|| corrupt("its parent is cut short".into()))?;
    let seq = u64::from_le_bytes(fixed[..8].try_into().expect("8"));
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
    let parent = Parent {
        region: name.to_owned(),
        seq,
        depth,
    };
    Ok((parent, after))
}

/// `count` entries, each a chunk of the region, ascending.
fn decode_entries(rest: &[u8], count: u64, geometry: Geometry) -> StoreResult<Vec<(u64, Hash)>> {
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
    Ok(entries)
}

/// The chunks per page, then `count` pages: one per run of that many chunks of the region,
/// each listing no more chunks than its run holds, the empty ones (only) with the zero hash.
fn decode_pages(rest: &[u8], count: u64, geometry: Geometry) -> StoreResult<(Vec<PageRef>, u32)> {
    let (pc, rest) = rest
        .split_first_chunk::<4>()
        .ok_or_else(|| corrupt("its pages are cut short".into()))?;
    let page_chunks = u32::from_le_bytes(*pc);
    if !valid_page_chunks(page_chunks) {
        return Err(corrupt(format!("pages of {page_chunks} chunks")));
    }
    let want = page_count(geometry, page_chunks);
    if count != want || count.checked_mul(PAGE_ENTRY as u64) != Some(rest.len() as u64) {
        return Err(corrupt(format!(
            "{count} pages in {} bytes, for a region of {want}",
            rest.len()
        )));
    }
    let mut pages = Vec::with_capacity(rest.len() / PAGE_ENTRY);
    for (n, e) in rest.chunks_exact(PAGE_ENTRY).enumerate() {
        let hash = Hash(e[..32].try_into().expect("32"));
        let chunks = u32::from_le_bytes(e[32..].try_into().expect("4"));
        let room = (geometry.chunk_count() - n as u64 * u64::from(page_chunks))
            .min(u64::from(page_chunks));
        if (hash == Hash::ZERO) != (chunks == 0) || u64::from(chunks) > room {
            return Err(corrupt(format!("page {n} says it lists {chunks} chunks")));
        }
        pages.push(PageRef { hash, chunks });
    }
    Ok((pages, page_chunks))
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
            pages: Vec::new(),
            page_chunks: 0,
            from: None,
        }
    }

    fn paged() -> Manifest {
        Manifest {
            seq: 4,
            base: 4,
            whole: true,
            entries: Vec::new(),
            // 16 chunks in pages of 64: one page.
            pages: vec![PageRef {
                hash: Hash::of(b"page"),
                chunks: 3,
            }],
            page_chunks: 64,
            ..sample()
        }
    }

    #[test]
    fn pages_round_trip_and_lies_are_refused() {
        let m = paged();
        assert_eq!(Manifest::decode(&m.encode()).unwrap(), m);
        assert_eq!(m.chunks(), 3);
        let empty = Manifest::empty(Geometry::new(1 << 30, 65536).unwrap());
        assert_eq!(Manifest::decode(&empty.encode()).unwrap(), empty);
        assert_eq!(empty.pages.len(), 4);
        let lies = [
            Manifest {
                whole: false,
                base: 3,
                ..paged()
            },
            Manifest {
                page_chunks: 48,
                ..paged()
            },
            Manifest {
                pages: vec![PageRef::EMPTY; 2],
                ..paged()
            },
            Manifest {
                pages: vec![PageRef {
                    hash: Hash::of(b"page"),
                    chunks: 17,
                }],
                ..paged()
            },
            Manifest {
                pages: vec![PageRef {
                    hash: Hash::ZERO,
                    chunks: 1,
                }],
                ..paged()
            },
        ];
        for m in lies {
            assert!(Manifest::decode(&m.encode()).is_err(), "{m:?}");
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
        // A region past the chunks farmap allows (its map alone would be too big to hold).
        let huge = Manifest {
            size: 1 << 62,
            chunk_size: 4096,
            entries: Vec::new(),
            ..sample()
        };
        assert!(Manifest::decode(&huge.encode()).is_err());
        let bad_base = Manifest {
            base: 9,
            ..sample()
        };
        assert!(Manifest::decode(&bad_base.encode()).is_err());
    }
}
