//! [`Verified`]: every chunk carries a checksum and a generation number; a chunk whose data
//! does not match what this region last acknowledged is refused as
//! [`ErrorKind::Corrupt`], never returned.
//!
//! # Where the checksums live: a side table at the end of the same store
//!
//! A header inside each chunk would shrink the usable chunk below a power of two, and every
//! store and frontend here works in whole power-of-two chunks. So the checksums live in a
//! **side table kept in a reserved area at the end of the inner store**: the region this stage
//! shows is smaller than its inner store by the metadata chunks, and its
//! [`geometry`](Store::geometry) says so (a `verified:(memory:64MiB)` region of 64 KiB
//! chunks is 1023 chunks long: one chunk holds the records of 4094).
//!
//! ```text
//!   inner store:  [ data 0 | data 1 | ... | data D-1 | meta 0 | ... | meta M-1 | (unused) ]
//!   meta chunk:   header (32 bytes) + one 16-byte record per data chunk
//!     header:     magic "FMVERIF1" | data chunks (u64) | meta index (u64) | xxh3 of the rest (u64)
//!     record:     generation (u64; top bit: holds data, else zeros) | xxh3-64 of the data (u64)
//! ```
//!
//! All integers are little-endian. The checksum is XXH3-64 (`xxhash-rust`), over the bytes of
//! the chunk as the region shows them.
//!
//! # What is checked, against what
//!
//! The whole table is kept in memory (about 90 bytes per chunk) and is the authority while the
//! region is open: every write gets the region's next generation number; when the inner write
//! succeeds, the chunk's record becomes (generation, checksum). A read hashes what the inner
//! store returned and compares it with the versions the chunk may hold: the last acknowledged
//! write, and writes still in flight (a read that overlaps a write may see either version, as
//! the [`Store`] contract says). Anything else — flipped bits, a torn write, a write the store
//! dropped, an older version — is refused as `Corrupt`.
//!
//! Writes of one chunk that overlap in time may land in either order, so when one succeeds,
//! every write of that chunk that was still running when it started stays acceptable too
//! (whichever landed last is what the store holds); a write that ended before a successful
//! one started is overwritten and no longer accepted. The first read that finds the chunk
//! quiet settles which version it holds, and a flush settles the chunks it writes records
//! for (reading them when more than one version is possible), so a metadata record always
//! names the version that is there.
//!
//! # Durability of the table
//!
//! Changed metadata chunks are written on [`flush`](Store::flush): the inner store is flushed
//! first (the data is durable), then the metadata chunks are written and flushed. Over a store
//! that keeps what it flushes (a file, a directory), the first write or trim of a metadata
//! chunk's chunks after a flush first saves that metadata chunk marked *unclean* (magic
//! `FMVERIFU`, one extra write and flush per metadata chunk per flush interval), and the next
//! flush saves it clean again (when none of its chunks is being written). A crash between a
//! write and the next flush may leave a chunk whose stored record is older than its data:
//! after reopening, such a chunk of an unclean metadata chunk reads as a **lost write** (an
//! error saying so, kind `Corrupt`: never served) until it is written again; the trait
//! promised nothing for unflushed writes. A mismatch under a clean metadata chunk is
//! corruption (something changed what was flushed). A metadata chunk that fails its own check at
//! opening (torn, flipped) makes the chunks it describes unverifiable: they read as `Corrupt`
//! until written again. A stale metadata chunk *together with* equally stale data (both of its
//! writes lost) cannot be told from the truth after a restart: nothing newer is known then.
//! A store written without this stage reads as `Corrupt` wherever it holds data (a fresh
//! table expects zeros).
//!
//! After a failed inner write the chunk may hold either version; until the next successful
//! write (or a read that finds out which) both are accepted.
//!
//! # Concurrency contract
//! - The table is striped (per-stripe `parking_lot` mutex, held only to read or update
//!   records, never across an await); reads and writes of different chunks never wait for
//!   each other.
//! - A read that sees neither the newest acknowledged version nor a version in flight, while
//!   the chunk was being written meanwhile, reads again (up to 4 times) before refusing.
//! - `flush` serializes metadata writes (one async mutex); the data path never takes it.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use bytes::{BufMut, Bytes, BytesMut};
use farmap_core::{
    is_zero, BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, Store,
    StoreError, StoreResult,
};
use parking_lot::Mutex;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

const MAGIC: &[u8; 8] = b"FMVERIF1";
/// The magic of a metadata chunk whose chunks may have been written since it was saved (see
/// "Durability of the table").
const MAGIC_UNCLEAN: &[u8; 8] = b"FMVERIFU";
const HEADER: usize = 32;
const RECORD: usize = 16;
const HAS_DATA: u64 = 1 << 63;
const STRIPES: usize = 256;
const READ_ATTEMPTS: usize = 4;

/// What a chunk must read as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// Zeros (never written, or trimmed).
    Zeros,
    /// Data with this XXH3-64.
    Sum(u64),
    /// Nothing is known (its metadata chunk failed its check): every read is refused.
    Unknown,
}

/// One version a chunk may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Version {
    gen: u64,
    expect: Expect,
    /// The record's tick when the write that made it ended (0: loaded at opening).
    ended: u64,
}

#[derive(Debug, Clone)]
struct Record {
    /// The newest version the chunk may hold when no write is in flight.
    cur: Version,
    /// Other versions it may hold: writes that overlapped the newest one, or failed writes
    /// that may have landed. Usually empty.
    more: Vec<Version>,
    /// Writes in flight: (generation, expectation, tick when it started).
    in_flight: Vec<(u64, Expect, u64)>,
    /// Bumped when a write starts and when it ends.
    changes: u64,
    /// Loaded from a metadata chunk saved before writes that a crash cut short: a mismatch
    /// is a lost write, not corruption. Cleared by the next write.
    unclean: bool,
}

impl Record {
    fn fresh() -> Self {
        Self::loaded(0, Expect::Zeros)
    }

    fn loaded(gen: u64, expect: Expect) -> Self {
        Self {
            cur: Version {
                gen,
                expect,
                ended: 0,
            },
            more: Vec::new(),
            in_flight: Vec::new(),
            changes: 0,
            unclean: false,
        }
    }

    fn candidates(&self) -> Vec<Expect> {
        let mut v = Vec::with_capacity(1 + self.more.len() + self.in_flight.len());
        v.push(self.cur.expect);
        v.extend(self.more.iter().map(|m| m.expect));
        v.extend(self.in_flight.iter().map(|(_, e, _)| *e));
        v
    }

    /// Whether the chunk holds exactly one known version and nothing is being written.
    fn settled(&self) -> bool {
        self.more.is_empty() && self.in_flight.is_empty()
    }

    fn start(&mut self, gen: u64, expect: Expect) {
        self.unclean = false;
        self.changes += 1;
        self.in_flight.push((gen, expect, self.changes));
    }

    /// Ends write `gen`: a success overwrote every version that ended before it started; a
    /// failure may or may not have landed.
    fn end(&mut self, gen: u64, ok: bool) {
        self.changes += 1;
        let Some(at) = self.in_flight.iter().position(|(g, _, _)| *g == gen) else {
            return;
        };
        let (_, expect, started) = self.in_flight.swap_remove(at);
        let new = Version {
            gen,
            expect,
            ended: self.changes,
        };
        if ok && self.more.is_empty() && self.cur.ended <= started {
            // The common case, without allocating: it overwrote the one version there was.
            self.cur = new;
            return;
        }
        let mut all = std::mem::take(&mut self.more);
        all.push(self.cur);
        if ok {
            all.retain(|v| v.ended > started);
        }
        all.push(new);
        self.set_versions(all);
    }

    /// Keeps only the versions `keep` accepts (at least one must be kept).
    fn narrow(&mut self, keep: impl Fn(&Version) -> bool) {
        let mut all = std::mem::take(&mut self.more);
        all.push(self.cur);
        let kept: Vec<Version> = all.iter().copied().filter(|v| keep(v)).collect();
        self.set_versions(if kept.is_empty() { all } else { kept });
    }

    fn set_versions(&mut self, mut all: Vec<Version>) {
        // Newest first; one entry per distinct content.
        all.sort_unstable_by_key(|v| std::cmp::Reverse(v.gen));
        let mut seen: Vec<Expect> = Vec::with_capacity(all.len());
        all.retain(|v| {
            let new = !seen.contains(&v.expect);
            seen.push(v.expect);
            new
        });
        self.cur = all.remove(0);
        self.more = all;
    }
}

/// How the inner store is divided between data and metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VerifiedLayout {
    /// The region this stage shows.
    pub geometry: Geometry,
    /// Inner index of the first metadata chunk.
    pub meta_start: u64,
    /// Metadata chunks.
    pub meta_chunks: u64,
    /// Records per metadata chunk.
    pub per_meta: u64,
}

impl VerifiedLayout {
    /// Records one metadata chunk of `chunk_size` bytes holds.
    pub fn records_per_chunk(chunk_size: u32) -> u64 {
        ((chunk_size as usize - HEADER) / RECORD) as u64
    }

    /// The layout over an inner store of `inner` geometry: the largest region that fits when
    /// `size` is `None`, else a region of `size` bytes (refused when the inner store is too
    /// small for it and its metadata). Only whole inner chunks are used.
    pub fn new(inner: Geometry, size: Option<u64>) -> StoreResult<Self> {
        let c = u64::from(inner.chunk_size());
        let full = inner.size() / c;
        let per_meta = Self::records_per_chunk(inner.chunk_size());
        let data = match size {
            Some(size) => size.div_ceil(c),
            None => {
                let mut d = full - full.div_ceil(per_meta + 1);
                while d > 0 && d + d.div_ceil(per_meta) > full {
                    d -= 1;
                }
                while d + 1 + (d + 1).div_ceil(per_meta) <= full {
                    d += 1;
                }
                d
            }
        };
        let meta_chunks = data.div_ceil(per_meta);
        if data == 0 || data + meta_chunks > full {
            return Err(StoreError::invalid(format!(
                "a verified region needs {} whole chunks of {c} bytes ({} of data, {meta_chunks} of checksums); the store has {full}",
                data + meta_chunks.max(1),
                data.max(1),
            )));
        }
        let size = size.unwrap_or(data * c);
        let geometry = Geometry::new(size, c)
            .map_err(|e| StoreError::invalid(format!("verified region: {e}")))?;
        Ok(Self {
            geometry,
            meta_start: data,
            meta_chunks,
            per_meta,
        })
    }

    /// How many data chunks metadata chunk `m` holds the records of, from chunk
    /// `m * per_meta` on (`per_meta`, but fewer in the last one).
    pub fn records_in(&self, m: u64) -> u64 {
        self.per_meta
            .min(self.geometry.chunk_count() - m * self.per_meta)
    }

    /// The geometry an inner store needs so that the verified region has geometry `g`.
    pub fn inner_geometry_for(g: Geometry) -> Geometry {
        let c = u64::from(g.chunk_size());
        let data = g.chunk_count();
        let meta = data.div_ceil(Self::records_per_chunk(g.chunk_size()));
        Geometry::new((data + meta) * c, c).expect("a valid geometry grows by whole chunks")
    }
}

/// What a [`Verified`] stage saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VerifyStats {
    /// Reads refused as corrupt.
    pub refused: u64,
    /// Reads that had to be repeated because the chunk was written meanwhile.
    pub reread: u64,
    /// Metadata chunks that failed their check at opening.
    pub bad_meta_chunks: u64,
    /// Metadata chunks written by flushes.
    pub meta_writes: u64,
}

/// Checksums and generations for every chunk of an inner store; see the [module
/// docs](self) for where they live and what is promised.
#[derive(Debug)]
pub struct Verified<S> {
    inner: S,
    layout: VerifiedLayout,
    stripes: Vec<Mutex<Vec<Record>>>,
    next_gen: AtomicU64,
    /// Metadata chunks changed since the last flush.
    dirty_meta: Mutex<Vec<bool>>,
    /// Per metadata chunk: saved with the unclean magic (its chunks may be written).
    unclean: Vec<AtomicBool>,
    /// Per metadata chunk: writes and trims of its chunks running now.
    writing: Vec<AtomicUsize>,
    /// The inner store keeps what it flushes: the unclean marks are worth their writes.
    durable: bool,
    meta_lock: tokio::sync::Mutex<()>,
    refused: AtomicU64,
    reread: AtomicU64,
    bad_meta: u64,
    meta_writes: AtomicU64,
}

impl<S: Store> Verified<S> {
    /// Opens the verified region kept in `inner`: the largest that fits (`size: None`) or one
    /// of `size` bytes, and loads its checksums (a store whose metadata area reads as zeros is
    /// a fresh region). Fails when the store is too small, or holds the metadata of a region
    /// of another size.
    pub async fn open(inner: S, size: Option<u64>) -> StoreResult<Self> {
        let layout = VerifiedLayout::new(inner.geometry(), size)?;
        let chunks = layout.geometry.chunk_count();
        let per_stripe = chunks.div_ceil(STRIPES as u64) as usize;
        let stripes = (0..STRIPES.min(chunks as usize))
            .map(|s| {
                let start = s * per_stripe;
                let n = per_stripe.min((chunks as usize).saturating_sub(start));
                Mutex::new(vec![Record::fresh(); n])
            })
            .collect::<Vec<_>>();
        let durable = inner.caps().contains(Caps::FLUSH | Caps::WRITE);
        let mut v = Self {
            inner,
            layout,
            stripes,
            next_gen: AtomicU64::new(1),
            dirty_meta: Mutex::new(vec![false; layout.meta_chunks as usize]),
            unclean: (0..layout.meta_chunks)
                .map(|_| AtomicBool::new(false))
                .collect(),
            writing: (0..layout.meta_chunks)
                .map(|_| AtomicUsize::new(0))
                .collect(),
            durable,
            meta_lock: tokio::sync::Mutex::new(()),
            refused: AtomicU64::new(0),
            reread: AtomicU64::new(0),
            bad_meta: 0,
            meta_writes: AtomicU64::new(0),
        };
        v.load().await?;
        Ok(v)
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// How the inner store is divided.
    pub fn layout(&self) -> VerifiedLayout {
        self.layout
    }

    /// What the stage saw so far.
    pub fn stats(&self) -> VerifyStats {
        VerifyStats {
            refused: self.refused.load(Ordering::Relaxed),
            reread: self.reread.load(Ordering::Relaxed),
            bad_meta_chunks: self.bad_meta,
            meta_writes: self.meta_writes.load(Ordering::Relaxed),
        }
    }

    fn per_stripe(&self) -> u64 {
        self.layout
            .geometry
            .chunk_count()
            .div_ceil(self.stripes.len() as u64)
    }

    fn with_record<T>(&self, idx: ChunkIdx, f: impl FnOnce(&mut Record) -> T) -> T {
        let per = self.per_stripe();
        let mut stripe = self.stripes[(idx.0 / per) as usize].lock();
        f(&mut stripe[(idx.0 % per) as usize])
    }

    fn meta_of(&self, idx: ChunkIdx) -> u64 {
        idx.0 / self.layout.per_meta
    }

    /// Before a write or trim of the chunks of metadata chunk `m`: makes sure `m` is saved
    /// marked unclean (written and flushed once after each flush), so that a crash before the
    /// next flush leaves a mark saying its mismatches are lost writes. Counts the write as
    /// running until the guard is dropped (a flush marks `m` clean only with none running).
    async fn mark_unclean(&self, m: u64) -> StoreResult<Writing<'_>> {
        let i = m as usize;
        self.writing[i].fetch_add(1, Ordering::SeqCst);
        let guard = Writing(&self.writing[i]);
        if !self.durable || self.unclean[i].load(Ordering::SeqCst) {
            return Ok(guard);
        }
        let _serial = self.meta_lock.lock().await;
        if self.unclean[i].load(Ordering::SeqCst) {
            return Ok(guard);
        }
        let at = ChunkIdx(self.layout.meta_start + m);
        let marked = async {
            self.inner.write(at, self.meta_chunk(m, true)).await?;
            self.inner.flush().await
        };
        marked.await.map_err(|e| {
            StoreError::new(
                e.kind(),
                format!("marking checksum chunk {m} of a verified region as being written"),
            )
            .with_source(e)
        })?;
        self.meta_writes.fetch_add(1, Ordering::Relaxed);
        self.unclean[i].store(true, Ordering::SeqCst);
        Ok(guard)
    }

    fn mark_meta(&self, idx: ChunkIdx) {
        self.dirty_meta.lock()[(idx.0 / self.layout.per_meta) as usize] = true;
    }

    async fn load(&mut self) -> StoreResult<()> {
        let c = self.layout.geometry.chunk_size() as usize;
        let mut max_gen = 0;
        for m in 0..self.layout.meta_chunks {
            let at = ChunkIdx(self.layout.meta_start + m);
            let raw = self.inner.read(at).await.map_err(|e| {
                StoreError::new(
                    e.kind(),
                    format!("reading checksum chunk {m} (inner {at}) of a verified region"),
                )
                .with_source(e)
            })?;
            if is_zero(&raw) {
                continue;
            }
            let first = m * self.layout.per_meta;
            let count = self.layout.records_in(m);
            let unclean = &raw[..8] == MAGIC_UNCLEAN;
            let ok = raw.len() == c
                && (&raw[..8] == MAGIC || unclean)
                && meta_hash(&raw) == u64::from_le_bytes(raw[24..32].try_into().expect("8"));
            if !ok {
                tracing::warn!(
                    meta = m,
                    "checksum chunk {m} of a verified region fails its own check: its {count} chunks are unverifiable until written again"
                );
                self.bad_meta += 1;
                for i in 0..count {
                    self.with_record(ChunkIdx(first + i), |r| {
                        *r = Record::loaded(0, Expect::Unknown)
                    });
                }
                continue;
            }
            let data_chunks = u64::from_le_bytes(raw[8..16].try_into().expect("8"));
            let index = u64::from_le_bytes(raw[16..24].try_into().expect("8"));
            if data_chunks != self.layout.geometry.chunk_count() || index != m {
                return Err(StoreError::invalid(format!(
                    "checksum chunk {m} belongs to a verified region of {data_chunks} chunks (its chunk {index}), not to this one of {}: open it with that size",
                    self.layout.geometry.chunk_count()
                )));
            }
            for i in 0..count {
                let at = HEADER + i as usize * RECORD;
                let word = u64::from_le_bytes(raw[at..at + 8].try_into().expect("8"));
                let sum = u64::from_le_bytes(raw[at + 8..at + 16].try_into().expect("8"));
                let gen = word & !HAS_DATA;
                max_gen = max_gen.max(gen);
                let expect = if word & HAS_DATA != 0 {
                    Expect::Sum(sum)
                } else {
                    Expect::Zeros
                };
                self.with_record(ChunkIdx(first + i), |r| {
                    *r = Record::loaded(gen, expect);
                    r.unclean = unclean;
                });
            }
            if unclean {
                tracing::info!(
                    meta = m,
                    "a verified region was not flushed after its last writes (a crash or a kill): chunks                      that do not match their checksums read as lost until written again"
                );
                // Saved clean again by the next flush.
                self.unclean[m as usize].store(true, Ordering::SeqCst);
            }
        }
        self.next_gen = AtomicU64::new(max_gen + 1);
        Ok(())
    }

    /// Reads the chunks described by metadata chunk `m` that may hold more than one version,
    /// so that the record written names the one they hold. A chunk whose read fails or is
    /// being written keeps its newest version in the record.
    async fn settle_ambiguous(&self, m: u64) {
        let first = m * self.layout.per_meta;
        let count = self.layout.records_in(m);
        for i in 0..count {
            let idx = ChunkIdx(first + i);
            if self.with_record(idx, |r| !r.more.is_empty() && r.in_flight.is_empty()) {
                // A read that matches narrows the record; one that does not is refused and
                // counted, which is all that is known then.
                let _ = self.read_verified(idx).await;
            }
        }
    }

    /// Serializes metadata chunk `m` from the table, marked unclean or not.
    fn meta_chunk(&self, m: u64, unclean: bool) -> Bytes {
        let c = self.layout.geometry.chunk_size() as usize;
        let mut b = BytesMut::with_capacity(c);
        b.put_slice(if unclean { MAGIC_UNCLEAN } else { MAGIC });
        b.put_u64_le(self.layout.geometry.chunk_count());
        b.put_u64_le(m);
        b.put_u64_le(0);
        let first = m * self.layout.per_meta;
        let count = self.layout.records_in(m);
        for i in 0..count {
            let Version { gen, expect, .. } = self.with_record(ChunkIdx(first + i), |r| r.cur);
            let (word, sum) = match expect {
                Expect::Sum(s) => (gen | HAS_DATA, s),
                // An unknown chunk is written as zeros: after a reopen it is refused anyway
                // if it holds data, which is all that can be said about it.
                Expect::Zeros | Expect::Unknown => (gen, 0),
            };
            b.put_u64_le(word);
            b.put_u64_le(sum);
        }
        b.resize(c, 0);
        let h = meta_hash(&b);
        b[24..32].copy_from_slice(&h.to_le_bytes());
        b.freeze()
    }

    fn shown_len(&self, idx: ChunkIdx) -> usize {
        self.layout.geometry.chunk_len(idx)
    }

    fn is(data: &[u8], e: Expect, sum: &mut Option<u64>) -> bool {
        match e {
            Expect::Zeros => is_zero(data),
            Expect::Sum(s) => *sum.get_or_insert_with(|| xxh3_64(data)) == s,
            Expect::Unknown => false,
        }
    }

    fn matches(data: &[u8], candidates: &[Expect], sum: &mut Option<u64>) -> bool {
        candidates.iter().any(|e| Self::is(data, *e, sum))
    }

    /// After a read of `data` that no write overlapped (the record's tick is still `changes`):
    /// when the chunk could hold several versions, it holds this one.
    fn settle_by_read(&self, idx: ChunkIdx, changes: u64, data: &[u8], sum: &mut Option<u64>) {
        let ambiguous = self.with_record(idx, |r| !r.more.is_empty());
        if !ambiguous {
            return;
        }
        let sum = *sum.get_or_insert_with(|| xxh3_64(data));
        let zero = is_zero(data);
        self.with_record(idx, |r| {
            if r.changes == changes && r.in_flight.is_empty() {
                r.narrow(|v| match v.expect {
                    Expect::Zeros => zero,
                    Expect::Sum(s) => s == sum,
                    Expect::Unknown => false,
                });
            }
        });
    }

    async fn read_verified(&self, idx: ChunkIdx) -> StoreResult<Bytes> {
        self.layout.geometry.check_idx(idx)?;
        let len = self.shown_len(idx);
        for attempt in 0..READ_ATTEMPTS {
            let (before, changes) = self.with_record(idx, |r| (r.candidates(), r.changes));
            let raw = self.inner.read(idx).await?;
            if raw.len() < len {
                self.refused.fetch_add(1, Ordering::Relaxed);
                return Err(StoreError::new(
                    ErrorKind::Corrupt,
                    format!(
                        "{idx} came back {} bytes long, not {len}: refused",
                        raw.len()
                    ),
                ));
            }
            let data = raw.slice(..len);
            let mut sum = None;
            if Self::matches(&data, &before, &mut sum) {
                self.settle_by_read(idx, changes, &data, &mut sum);
                return Ok(data);
            }
            let (after, changed) =
                self.with_record(idx, |r| (r.candidates(), r.changes != changes));
            if Self::matches(&data, &after, &mut sum) {
                return Ok(data);
            }
            if !changed || attempt + 1 == READ_ATTEMPTS {
                break;
            }
            self.reread.fetch_add(1, Ordering::Relaxed);
        }
        self.refused.fetch_add(1, Ordering::Relaxed);
        let (Version { gen, expect, .. }, unclean) = self.with_record(idx, |r| (r.cur, r.unclean));
        if unclean {
            return Err(StoreError::new(
                ErrorKind::Corrupt,
                format!(
                    "{idx}: a write since the region's last flush was lost when its writer \
                     stopped without flushing (killed, or its machine crashed): what the store \
                     holds cannot be verified (the write's checksum was never saved); refused \
                     until written again"
                ),
            ));
        }
        let why = match expect {
            Expect::Zeros => format!("it should read as zeros (generation {gen})"),
            Expect::Sum(s) => format!("generation {gen} has checksum {s:016x}"),
            Expect::Unknown => "its checksum record was lost (its checksum chunk failed its check at opening); write it again".to_owned(),
        };
        Err(StoreError::new(
            ErrorKind::Corrupt,
            format!("{idx} does not match what this region last wrote: {why}; refused"),
        ))
    }

    async fn write_verified(&self, idx: ChunkIdx, data: Bytes) -> StoreResult<()> {
        if !self.inner.caps().contains(Caps::WRITE) {
            return Err(StoreError::new(
                ErrorKind::ReadOnly,
                "the store under a verified region is read-only",
            ));
        }
        self.layout.geometry.check_write(idx, data.len())?;
        let expect = Expect::Sum(xxh3_64(&data));
        let _writing = self.mark_unclean(self.meta_of(idx)).await?;
        let gen = self.next_gen.fetch_add(1, Ordering::Relaxed);
        self.with_record(idx, |r| r.start(gen, expect));
        let full = self.layout.geometry.chunk_size() as usize;
        let padded = if data.len() == full {
            data
        } else {
            let mut b = BytesMut::with_capacity(full);
            b.put_slice(&data);
            b.resize(full, 0);
            b.freeze()
        };
        let res = self.inner.write(idx, padded).await;
        self.settle(idx, gen, res.is_ok());
        res
    }

    /// Ends write `gen` of `idx` in the table.
    fn settle(&self, idx: ChunkIdx, gen: u64, ok: bool) {
        self.with_record(idx, |r| r.end(gen, ok));
        if ok {
            self.mark_meta(idx);
        }
    }

    /// Writes the metadata chunks changed since the last flush (and, with a durable inner
    /// store, those marked unclean), each marked clean when none of its chunks is being
    /// written; whether it wrote any.
    async fn flush_meta(&self) -> StoreResult<bool> {
        let _serial = self.meta_lock.lock().await;
        let dirty: Vec<u64> = {
            let mut d = self.dirty_meta.lock();
            let list = d
                .iter()
                .enumerate()
                .filter(|(i, x)| **x || self.unclean[*i].load(Ordering::SeqCst))
                .map(|(i, _)| i as u64)
                .collect();
            d.iter_mut().for_each(|x| *x = false);
            list
        };
        for (n, m) in dirty.iter().enumerate() {
            self.settle_ambiguous(*m).await;
            // A write that starts from here on marks it again (after this flush, which holds
            // the lock); one already running keeps it unclean.
            let i = *m as usize;
            self.unclean[i].store(false, Ordering::SeqCst);
            let unclean = self.writing[i].load(Ordering::SeqCst) > 0;
            if unclean {
                self.unclean[i].store(true, Ordering::SeqCst);
            }
            let chunk = self.meta_chunk(*m, unclean);
            if let Err(e) = self
                .inner
                .write(ChunkIdx(self.layout.meta_start + m), chunk)
                .await
            {
                // Written again by the next flush.
                let mut d = self.dirty_meta.lock();
                for m in &dirty[n..] {
                    d[*m as usize] = true;
                }
                self.unclean[i].store(self.durable, Ordering::SeqCst);
                return Err(StoreError::new(
                    e.kind(),
                    format!("writing checksum chunk {m} of a verified region"),
                )
                .with_source(e));
            }
            self.meta_writes.fetch_add(1, Ordering::Relaxed);
        }
        Ok(!dirty.is_empty())
    }
}

/// A write or trim running over the chunks of one metadata chunk.
struct Writing<'a>(&'a AtomicUsize);

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The hash a metadata chunk carries at bytes 24..32: over bytes 0..24 and 32.. .
fn meta_hash(raw: &[u8]) -> u64 {
    xxh3_64_with_seed(&raw[HEADER..], xxh3_64(&raw[..24]))
}

impl<S: Store> Store for Verified<S> {
    fn geometry(&self) -> Geometry {
        self.layout.geometry
    }

    fn caps(&self) -> Caps {
        // Trim is done by the table (the expected content becomes zeros), and status is
        // answered from it.
        let inner = self.inner.caps();
        let mut caps = Caps::STATUS;
        if inner.contains(Caps::WRITE) {
            caps = caps | Caps::WRITE | Caps::TRIM;
        }
        if inner.contains(Caps::FLUSH) {
            caps = caps | Caps::FLUSH;
        }
        caps
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(self.read_verified(idx))
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(self.write_verified(idx, data))
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            if !self.durable {
                self.flush_meta().await?;
                return self.inner.flush().await;
            }
            // The data first, then the checksums that describe it, marked clean: a crash
            // in between leaves them marked unclean, and mismatches read as lost writes.
            self.inner.flush().await?;
            if self.flush_meta().await? {
                self.inner.flush().await?;
            }
            Ok(())
        })
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            self.layout.geometry.check_range(range)?;
            if range.is_empty() {
                return Ok(());
            }
            if !self.inner.caps().contains(Caps::WRITE) {
                return Err(StoreError::new(
                    ErrorKind::ReadOnly,
                    "the store under a verified region is read-only",
                ));
            }
            // Zeros become the expected content first (as a write in flight), then the inner
            // store is trimmed; a store that cannot trim gets zeros written.
            let mut writing = Vec::new();
            for m in self.meta_of(range.start)..=self.meta_of(ChunkIdx(range.end.0 - 1)) {
                writing.push(self.mark_unclean(m).await?);
            }
            let gens: Vec<u64> = range
                .iter()
                .map(|idx| {
                    let gen = self.next_gen.fetch_add(1, Ordering::Relaxed);
                    self.with_record(idx, |r| r.start(gen, Expect::Zeros));
                    gen
                })
                .collect();
            let res = if self.inner.caps().contains(Caps::TRIM) {
                self.inner.trim(range).await
            } else {
                let zeros = farmap_core::zero_chunk(self.layout.geometry.chunk_size() as usize);
                let mut res = Ok(());
                for idx in range.iter() {
                    res = self.inner.write(idx, zeros.clone()).await;
                    if res.is_err() {
                        break;
                    }
                }
                res
            };
            for (idx, gen) in range.iter().zip(gens) {
                self.settle(idx, gen, res.is_ok());
            }
            res
        })
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        Box::pin(async move {
            self.layout.geometry.check_idx(idx)?;
            Ok(
                self.with_record(idx, |r| match (r.cur.expect, r.settled()) {
                    (Expect::Zeros, true) => ChunkStatus::Zero,
                    (Expect::Sum(_), true) => ChunkStatus::Data,
                    _ => ChunkStatus::Unknown,
                }),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use farmap_testkit::{Hooked, ModelStore};
    use std::sync::Arc;

    #[test]
    fn layouts_are_honest() {
        let g = Geometry::new(64 << 20, 64 << 10).unwrap();
        let l = VerifiedLayout::new(g, None).unwrap();
        assert_eq!(l.per_meta, 4094);
        assert_eq!(l.meta_chunks, 1);
        assert_eq!(l.geometry.chunk_count(), 1023);
        assert_eq!(l.meta_start, 1023);
        // The largest region: one more data chunk would need more chunks than there are.
        let g = Geometry::new(5000 * 4096, 4096).unwrap();
        let l = VerifiedLayout::new(g, None).unwrap();
        let d = l.geometry.chunk_count();
        assert!(d + d.div_ceil(254) <= 5000 && (d + 1) + (d + 1).div_ceil(254) > 5000);
        // Asked sizes: refused when they do not fit.
        assert!(VerifiedLayout::new(g, Some(5000 * 4096)).is_err());
        let one = Geometry::new(4096, 4096).unwrap();
        assert!(VerifiedLayout::new(one, None).is_err());
        for g in farmap_testkit::conformance::geometries() {
            let inner = VerifiedLayout::inner_geometry_for(g);
            assert_eq!(
                VerifiedLayout::new(inner, Some(g.size())).unwrap().geometry,
                g
            );
        }
    }

    #[test]
    fn overlapping_writes_keep_every_version_that_may_have_landed_last() {
        let (a, b, c) = (Expect::Sum(1), Expect::Sum(2), Expect::Sum(3));
        let mut r = Record::fresh();
        // A and B overlap; B ends first: either may be there.
        r.start(1, a);
        r.start(2, b);
        r.end(2, true);
        r.end(1, true);
        assert_eq!(r.cur.expect, b);
        assert_eq!(r.more.iter().map(|v| v.expect).collect::<Vec<_>>(), [a]);
        assert!(!r.settled());
        // C starts after both ended: it overwrote them.
        r.start(3, c);
        r.end(3, true);
        assert_eq!(r.candidates(), [c]);
        assert!(r.settled());
        // A write that ended before another started is not accepted after it.
        r.start(4, a);
        r.end(4, true);
        r.start(5, b);
        r.end(5, true);
        assert_eq!(r.candidates(), [b]);
        // A failed write may have landed; the next success ends that.
        r.start(6, c);
        r.end(6, false);
        assert_eq!(r.candidates(), [c, b]);
        r.start(7, a);
        r.end(7, true);
        assert_eq!(r.candidates(), [a]);
        // A read narrows an ambiguous record to what it found.
        r.start(8, b);
        r.start(9, c);
        r.end(8, true);
        r.end(9, true);
        r.narrow(|v| v.expect == b);
        assert_eq!(r.candidates(), [b]);
        assert_eq!(r.cur.gen, 8);
    }

    /// The store behind [`older_lands_last`]'s region: it holds back writes of ones until
    /// released.
    type Holding = Hooked<ModelStore>;

    /// A verified region over a [`Holding`] store in which an older write of chunk `idx`
    /// (ones) lands after a newer one (twos) that overlapped it; returns the store, the
    /// region and the two versions.
    async fn older_lands_last(
        idx: ChunkIdx,
    ) -> (Arc<Holding>, Arc<Verified<Arc<Holding>>>, Bytes, Bytes) {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let held = gate.clone();
        let inner = Arc::new(
            Hooked::through(ModelStore::new(Geometry::new(64 * 4096, 4096).unwrap()))
                .before_writes(move |_, data| {
                    let held = (data[0] == 1).then(|| held.clone());
                    Box::pin(async move {
                        if let Some(gate) = held {
                            gate.acquire().await.expect("open").forget();
                        }
                        Ok(())
                    })
                }),
        );
        let v = Arc::new(Verified::open(inner.clone(), None).await.unwrap());
        let (old, new) = (Bytes::from(vec![1u8; 4096]), Bytes::from(vec![2u8; 4096]));
        let first = tokio::spawn({
            let (v, old) = (v.clone(), old.clone());
            async move { v.write(idx, old).await }
        });
        // The older write is in flight (held) when the newer one runs and finishes.
        while v.with_record(idx, |r| r.in_flight.is_empty()) {
            tokio::task::yield_now().await;
        }
        v.write(idx, new.clone()).await.unwrap();
        gate.add_permits(1);
        first.await.unwrap().unwrap();
        (inner, v, old, new)
    }

    #[tokio::test]
    async fn an_older_write_that_lands_last_is_served_and_survives_a_reopen() {
        let (inner, v, old, new) = older_lands_last(ChunkIdx(5)).await;
        // The older one landed last: that is what the chunk holds, and it is not corrupt.
        assert_eq!(v.read(ChunkIdx(5)).await.unwrap(), old);
        assert_eq!(v.stats().refused, 0);
        v.flush().await.unwrap();
        drop(v);
        let v = Verified::open(inner.clone(), None).await.unwrap();
        assert_eq!(v.read(ChunkIdx(5)).await.unwrap(), old);
        // And the newer one, had it landed, is not accepted after the chunk was settled.
        inner.inner.write(ChunkIdx(5), new).await.unwrap();
        assert_eq!(
            v.read(ChunkIdx(5)).await.unwrap_err().kind(),
            ErrorKind::Corrupt
        );
    }

    #[tokio::test]
    async fn a_flush_records_the_version_an_ambiguous_chunk_holds() {
        let (inner, v, old, _) = older_lands_last(ChunkIdx(9)).await;
        // No read in between: the flush must find out which version is there.
        v.flush().await.unwrap();
        drop(v);
        let v = Verified::open(inner.clone(), None).await.unwrap();
        assert_eq!(v.read(ChunkIdx(9)).await.unwrap(), old);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn verified_memory_conforms() {
        farmap_testkit::run_conformance(|g| async move {
            let inner = ModelStore::new(VerifiedLayout::inner_geometry_for(g));
            Arc::new(Verified::open(inner, Some(g.size())).await.unwrap()) as Arc<dyn Store>
        })
        .await;
    }

    /// Fills chunk `changed.0` with bytes `changed.1` behind the back of the (dropped)
    /// region over `inner`, then reopens the region: chunk `kept.0` still reads `kept.1`, and
    /// a read of the changed chunk fails as corrupt. Returns the region and that error.
    async fn reopen_after_change(
        inner: &Arc<ModelStore>,
        changed: (ChunkIdx, u8),
        kept: (ChunkIdx, &Bytes),
    ) -> (Verified<Arc<ModelStore>>, StoreError) {
        inner
            .write(changed.0, Bytes::from(vec![changed.1; 4096]))
            .await
            .unwrap();
        let v = Verified::open(inner.clone(), None).await.unwrap();
        assert_eq!(&v.read(kept.0).await.unwrap(), kept.1);
        let e = v.read(changed.0).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
        (v, e)
    }

    #[tokio::test]
    async fn checksums_survive_a_reopen_and_catch_what_changed_meanwhile() {
        let inner = Arc::new(ModelStore::new(Geometry::new(64 * 4096, 4096).unwrap()));
        let v = Verified::open(inner.clone(), None).await.unwrap();
        let a = Bytes::from(vec![7u8; 4096]);
        v.write(ChunkIdx(3), a.clone()).await.unwrap();
        v.write(ChunkIdx(4), a.clone()).await.unwrap();
        v.flush().await.unwrap();
        drop(v);
        // Behind the region's back: one chunk changes.
        let (v, e) = reopen_after_change(&inner, (ChunkIdx(4), 8), (ChunkIdx(3), &a)).await;
        assert!(
            e.to_string().contains("chunk 4") || e.to_string().contains('4'),
            "{e}"
        );
        // Written again: good again.
        v.write(ChunkIdx(4), a.clone()).await.unwrap();
        assert_eq!(v.read(ChunkIdx(4)).await.unwrap(), a);
        // A flipped bit in the checksum chunk: its chunks become unverifiable.
        v.flush().await.unwrap();
        let meta_at = ChunkIdx(v.layout().meta_start);
        drop(v);
        let mut raw = inner.read(meta_at).await.unwrap().to_vec();
        raw[100] ^= 4;
        inner.write(meta_at, Bytes::from(raw)).await.unwrap();
        let v = Verified::open(inner.clone(), None).await.unwrap();
        assert_eq!(v.stats().bad_meta_chunks, 1);
        assert_eq!(
            v.read(ChunkIdx(3)).await.unwrap_err().kind(),
            ErrorKind::Corrupt
        );
    }

    #[tokio::test]
    async fn a_write_cut_short_by_a_crash_reads_as_lost_and_a_change_after_a_flush_as_corrupt() {
        // A store that keeps what it flushes (a file).
        let inner = Arc::new(ModelStore::with_caps(
            Geometry::new(64 * 4096, 4096).unwrap(),
            Caps::WRITE | Caps::FLUSH | Caps::TRIM,
        ));
        let v = Verified::open(inner.clone(), None).await.unwrap();
        let (a, b) = (Bytes::from(vec![7u8; 4096]), Bytes::from(vec![9u8; 4096]));
        v.write(ChunkIdx(3), a.clone()).await.unwrap();
        v.flush().await.unwrap();
        let flushes = v.stats().meta_writes;
        // Written after the flush, then the writer dies without flushing: the data landed,
        // its checksum record did not.
        v.write(ChunkIdx(4), b.clone()).await.unwrap();
        v.write(ChunkIdx(5), b.clone()).await.unwrap();
        assert_eq!(
            v.stats().meta_writes,
            flushes + 1,
            "one unclean mark for the first write after the flush, none for the next"
        );
        drop(v);
        let v = Verified::open(inner.clone(), None).await.unwrap();
        assert_eq!(v.read(ChunkIdx(3)).await.unwrap(), a, "flushed before");
        let e = v.read(ChunkIdx(4)).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
        assert!(e.to_string().contains("lost"), "{e}");
        // Written again and flushed: the region is clean, and a change behind its back is
        // corruption, not a lost write.
        v.write(ChunkIdx(4), b.clone()).await.unwrap();
        v.write(ChunkIdx(5), b.clone()).await.unwrap();
        v.flush().await.unwrap();
        drop(v);
        let (_, e) = reopen_after_change(&inner, (ChunkIdx(5), 1), (ChunkIdx(4), &b)).await;
        assert!(!e.to_string().contains("lost"), "{e}");
        assert!(e.to_string().contains("does not match"), "{e}");
    }
}
