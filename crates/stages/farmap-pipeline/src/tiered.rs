//! [`Tiered`]: one region over several stores of different speed and size (memory, then a
//! local disk, then a remote one), each holding up to a capacity of chunks.

use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use farmap_core::{
    BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, Store, StoreError,
    StoreResult,
};
use parking_lot::Mutex;
use tokio::sync::RwLock;

/// No tier holds the chunk: it was never written (or was trimmed), and reads as zeros.
const UNPLACED: u8 = u8::MAX;
/// A chunk whose only copy was in a tier that did not outlive the process that wrote it
/// (see [`TierOptions::lost_on_restart`]): read as an error until it is written again.
const LOST: u8 = u8::MAX - 1;

/// Most tiers (the placement map keeps a tier's index in one byte, 255 meaning none).
pub const MAX_TIERS: usize = 16;

/// Stripes of per-chunk locks.
const MAX_STRIPES: usize = 1024;

/// The placement map file: this magic, the chunk count and the tier count (u64 LE each),
/// then one byte per chunk (its tier, or 255 for none).
const MAP_MAGIC: &[u8; 8] = b"FMTIER01";

/// One tier of a [`Tiered`] store.
#[derive(Debug)]
pub struct Tier {
    /// The store (the region's geometry).
    pub store: Arc<dyn Store>,
    /// Most chunks placed in it.
    pub capacity: u64,
}

/// How a [`Tiered`] store places and demotes.
#[derive(Debug, Clone)]
pub struct TierOptions {
    /// Where the placement map is kept (written at every flush and before a demotion drops
    /// a chunk's old copy, read at open); `None`: not kept (all tiers in memory, say).
    pub map: Option<PathBuf>,
    /// How often the background task demotes cold chunks; `None`: only
    /// [`demote`](Tiered::demote) does.
    pub demote_every: Option<Duration>,
    /// A tier fuller than this (percent of its capacity) has cold chunks demoted until it is
    /// at [`low_water`](Self::low_water).
    pub high_water: u8,
    /// See [`high_water`](Self::high_water).
    pub low_water: u8,
    /// The tiers whose content does not outlive this process (a `memory:` tier): a chunk the
    /// placement map read at open puts in one of them is lost, and reads as an error (never
    /// as zeros) until it is written again.
    pub lost_on_restart: Vec<usize>,
}

impl Default for TierOptions {
    /// No map, demotion every second from 90% down to 80%.
    fn default() -> Self {
        Self {
            map: None,
            demote_every: Some(Duration::from_secs(1)),
            high_water: 90,
            low_water: 80,
            lost_on_restart: Vec::new(),
        }
    }
}

/// A region spread over tiers, highest priority first.
///
/// - Placement: a chunk's first write places it in the first tier with room (a chunk never
///   written is in no tier and reads as zeros, without asking any store). A write to a
///   placed chunk goes to its tier. When every tier is full, a first write fails with
///   `NoSpace`.
/// - Demotion: [`demote`](Self::demote) (and the background task, every
///   [`TierOptions::demote_every`]) moves cold chunks of a tier above its high water to the
///   next tier, until it is at its low water or the next tier is full. Cold: not read or
///   written since the previous pass looked at it (one referenced bit per chunk, set by
///   every access, cleared by the pass: a clock). A move copies the chunk, flushes the new
///   tier, records the new placement in the map file, and only then trims the old copy, so a
///   crash at any point leaves one complete copy that the map names.
/// - Trim: trims the chunk in its tier and unplaces it (its room is free again).
/// - The placement map lives in memory and, with [`TierOptions::map`], in a small file
///   (written whole to a temporary file and renamed over the old one) at every flush and
///   before a demotion drops old copies; [`open`](Self::open) reads it back. Chunks placed
///   after the last flush are not in it, like their data is not durable.
///
/// # Concurrency
/// - Per-chunk locks (striped `RwLock`s): reads take a read guard; writes, trims and moves
///   take a write guard, so a move never copies under a write and a first write is placed
///   once.
/// - Tier fill counts are atomics reserved with a compare-and-swap before a placement.
pub struct Tiered {
    shared: Arc<Shared>,
}

struct Shared {
    geometry: Geometry,
    tiers: Vec<Tier>,
    used: Vec<AtomicU64>,
    placement: Box<[AtomicU8]>,
    referenced: Box<[AtomicBool]>,
    stripes: Box<[RwLock<()>]>,
    map_path: Option<PathBuf>,
    map_dirty: AtomicBool,
    /// Serialises writers of the map file and demotion passes.
    map_write: tokio::sync::Mutex<()>,
    hands: Mutex<Vec<u64>>,
    high_water: u8,
    low_water: u8,
    demoted: AtomicU64,
}

impl Tiered {
    /// A tiered store over `tiers` (highest priority first; all of the same geometry),
    /// reading the placement map from `opts.map` if that file exists.
    ///
    /// # Panics
    /// With a demotion interval, outside a tokio runtime.
    pub fn open(tiers: Vec<Tier>, opts: TierOptions) -> StoreResult<Tiered> {
        let Some(first) = tiers.first() else {
            return Err(StoreError::invalid(
                "a tiered store needs at least one tier",
            ));
        };
        if tiers.len() > MAX_TIERS {
            return Err(StoreError::invalid(format!(
                "a tiered store has at most {MAX_TIERS} tiers, not {}",
                tiers.len()
            )));
        }
        let geometry = first.store.geometry();
        for (i, t) in tiers.iter().enumerate() {
            if t.store.geometry() != geometry {
                return Err(StoreError::invalid(format!(
                    "tier {i} ({}) does not have the geometry of tier 0 ({geometry})",
                    t.store.geometry()
                )));
            }
            if !t.store.caps().contains(Caps::WRITE) {
                return Err(StoreError::invalid(format!("tier {i} cannot be written")));
            }
        }
        if opts.low_water > opts.high_water || opts.high_water > 100 {
            return Err(StoreError::invalid(format!(
                "tier water marks must be low ≤ high ≤ 100, not {} and {}",
                opts.low_water, opts.high_water
            )));
        }
        let n = geometry.chunk_count() as usize;
        let placement: Box<[AtomicU8]> = (0..n).map(|_| AtomicU8::new(UNPLACED)).collect();
        let used: Vec<AtomicU64> = tiers.iter().map(|_| AtomicU64::new(0)).collect();
        if let Some(path) = &opts.map {
            if let Some(map) = read_map(path, geometry.chunk_count(), tiers.len())? {
                for (slot, &t) in placement.iter().zip(map.iter()) {
                    let t = if opts.lost_on_restart.contains(&usize::from(t)) {
                        LOST
                    } else {
                        t
                    };
                    slot.store(t, Ordering::Relaxed);
                    if t != UNPLACED && t != LOST {
                        used[usize::from(t)].fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        let stripes = n.next_power_of_two().min(MAX_STRIPES);
        let shared = Arc::new(Shared {
            geometry,
            hands: Mutex::new(vec![0; tiers.len()]),
            tiers,
            used,
            placement,
            referenced: (0..n).map(|_| AtomicBool::new(false)).collect(),
            stripes: (0..stripes).map(|_| RwLock::new(())).collect(),
            map_path: opts.map,
            map_dirty: AtomicBool::new(false),
            map_write: tokio::sync::Mutex::new(()),
            high_water: opts.high_water,
            low_water: opts.low_water,
            demoted: AtomicU64::new(0),
        });
        if let Some(every) = opts.demote_every {
            tokio::spawn(demote_in_background(Arc::downgrade(&shared), every));
        }
        Ok(Tiered { shared })
    }

    /// The tier chunk `idx` is placed in (`None`: in none, or outside the region).
    pub fn tier_of(&self, idx: ChunkIdx) -> Option<usize> {
        self.shared.tier_of(idx)
    }

    /// Chunks placed in each tier.
    pub fn used(&self) -> Vec<u64> {
        self.shared
            .used
            .iter()
            .map(|u| u.load(Ordering::Acquire))
            .collect()
    }

    /// Chunks moved to a lower tier so far.
    pub fn demoted_count(&self) -> u64 {
        self.shared.demoted.load(Ordering::Relaxed)
    }

    /// One demotion pass over every tier but the last (see the type's docs); returns the
    /// chunks it moved.
    pub async fn demote(&self) -> StoreResult<u64> {
        self.shared.demote().await
    }
}

async fn demote_in_background(shared: Weak<Shared>, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if let Err(e) = shared.demote().await {
            tracing::warn!(error = %farmap_core::error_chain(&e), "tier demotion failed");
        }
    }
}

impl Shared {
    fn tier_of(&self, idx: ChunkIdx) -> Option<usize> {
        let t = self.placement.get(idx.as_usize())?.load(Ordering::Acquire);
        (t != UNPLACED && t != LOST).then_some(usize::from(t))
    }

    /// Fails for a chunk whose only copy was lost with a tier that did not outlive the
    /// process that wrote it.
    fn check_not_lost(&self, idx: ChunkIdx) -> StoreResult<()> {
        match self
            .placement
            .get(idx.as_usize())
            .map(|p| p.load(Ordering::Acquire))
        {
            Some(LOST) => Err(StoreError::new(
                ErrorKind::Corrupt,
                format!(
                    "{idx} was last written to a tier that does not outlive its process \
                     (memory:), and that process ended: its data is lost (write it again)"
                ),
            )),
            _ => Ok(()),
        }
    }

    fn stripe(&self, idx: ChunkIdx) -> &RwLock<()> {
        &self.stripes[idx.as_usize() & (self.stripes.len() - 1)]
    }

    fn touch(&self, idx: ChunkIdx) {
        if let Some(r) = self.referenced.get(idx.as_usize()) {
            if !r.load(Ordering::Relaxed) {
                r.store(true, Ordering::Relaxed);
            }
        }
    }

    /// Reserves room in the first tier (from `from` on) that has some.
    fn reserve(&self, from: usize) -> Option<usize> {
        (from..self.tiers.len()).find(|&t| {
            let used = &self.used[t];
            let cap = self.tiers[t].capacity;
            let mut now = used.load(Ordering::Acquire);
            while now < cap {
                match used.compare_exchange(now, now + 1, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return true,
                    Err(v) => now = v,
                }
            }
            false
        })
    }

    fn set_placement(&self, idx: ChunkIdx, tier: u8) {
        self.placement[idx.as_usize()].store(tier, Ordering::Release);
        self.map_dirty.store(true, Ordering::Release);
    }

    async fn read(&self, idx: ChunkIdx) -> StoreResult<Bytes> {
        self.geometry.check_idx(idx)?;
        let _g = self.stripe(idx).read().await;
        self.touch(idx);
        self.check_not_lost(idx)?;
        match self.tier_of(idx) {
            Some(t) => self.tiers[t].store.read(idx).await,
            None => Ok(farmap_core::zero_chunk(self.geometry.chunk_len(idx))),
        }
    }

    async fn write(&self, idx: ChunkIdx, data: Bytes) -> StoreResult<()> {
        self.geometry.check_write(idx, data.len())?;
        let _g = self.stripe(idx).write().await;
        self.touch(idx);
        if let Some(t) = self.tier_of(idx) {
            return self.tiers[t].store.write(idx, data).await;
        }
        let Some(t) = self.reserve(0) else {
            return Err(StoreError::new(
                ErrorKind::NoSpace,
                format!("placing {idx}: every tier is full"),
            ));
        };
        if let Err(e) = self.tiers[t].store.write(idx, data).await {
            self.used[t].fetch_sub(1, Ordering::AcqRel);
            return Err(e);
        }
        self.set_placement(idx, t as u8);
        Ok(())
    }

    async fn trim(&self, range: ChunkRange) -> StoreResult<()> {
        self.geometry.check_range(range)?;
        for idx in range.iter() {
            let _g = self.stripe(idx).write().await;
            if let Some(t) = self.tier_of(idx) {
                self.tiers[t].store.trim(ChunkRange::single(idx)).await?;
                self.set_placement(idx, UNPLACED);
                self.used[t].fetch_sub(1, Ordering::AcqRel);
            } else if self.check_not_lost(idx).is_err() {
                // Trimmed: zeros from now on, which is what was asked.
                self.set_placement(idx, UNPLACED);
            }
        }
        Ok(())
    }

    async fn flush(&self) -> StoreResult<()> {
        for (i, t) in self.tiers.iter().enumerate() {
            t.store.flush().await.map_err(|e| {
                StoreError::new(e.kind(), format!("flushing tier {i}")).with_source(e)
            })?;
        }
        let _w = self.map_write.lock().await;
        self.save_map()
    }

    /// Writes the map file if the map changed since it was last written. The caller holds
    /// `map_write`.
    fn save_map(&self) -> StoreResult<()> {
        let Some(path) = &self.map_path else {
            return Ok(());
        };
        if !self.map_dirty.swap(false, Ordering::AcqRel) {
            return Ok(());
        }
        let bytes: Vec<u8> = self
            .placement
            .iter()
            .map(|p| p.load(Ordering::Acquire))
            .collect();
        write_map(path, &bytes, self.tiers.len()).inspect_err(|_| {
            self.map_dirty.store(true, Ordering::Release);
        })
    }

    async fn demote(&self) -> StoreResult<u64> {
        let _w = self.map_write.lock().await;
        let mut moved_total = 0;
        for t in 0..self.tiers.len().saturating_sub(1) {
            let cap = self.tiers[t].capacity;
            let high = cap * u64::from(self.high_water) / 100;
            let low = cap * u64::from(self.low_water) / 100;
            if self.used[t].load(Ordering::Acquire) <= high {
                continue;
            }
            // Copy cold chunks down; the old copies are dropped after the map names the new.
            let mut moved: Vec<(ChunkIdx, usize)> = Vec::new();
            let n = self.geometry.chunk_count();
            let mut hand = self.hands.lock()[t];
            let mut looked = 0;
            while self.used[t].load(Ordering::Acquire) > low && looked < 2 * n {
                let idx = ChunkIdx(hand % n);
                hand = hand.wrapping_add(1);
                looked += 1;
                if self.tier_of(idx) != Some(t) {
                    continue;
                }
                if self.referenced[idx.as_usize()].swap(false, Ordering::AcqRel) {
                    continue;
                }
                let Some(to) = self.reserve(t + 1) else {
                    break;
                };
                let _g = self.stripe(idx).write().await;
                if self.tier_of(idx) != Some(t) {
                    self.used[to].fetch_sub(1, Ordering::AcqRel);
                    continue;
                }
                let copied = async {
                    let data = self.tiers[t].store.read(idx).await?;
                    self.tiers[to].store.write(idx, data).await
                }
                .await;
                if let Err(e) = copied {
                    self.used[to].fetch_sub(1, Ordering::AcqRel);
                    return Err(StoreError::new(
                        e.kind(),
                        format!("demoting {idx} from tier {t} to tier {to}"),
                    )
                    .with_source(e));
                }
                self.set_placement(idx, to as u8);
                self.used[t].fetch_sub(1, Ordering::AcqRel);
                moved.push((idx, t));
            }
            self.hands.lock()[t] = hand;
            if moved.is_empty() {
                continue;
            }
            // The new copies durable, then the map, then the old copies go.
            for to in t + 1..self.tiers.len() {
                self.tiers[to].store.flush().await?;
            }
            self.save_map()?;
            for (idx, from) in &moved {
                let _g = self.stripe(*idx).write().await;
                // Trimming an old copy can only fail to free space; the map no longer names it.
                if let Err(e) = self.tiers[*from].store.trim(ChunkRange::single(*idx)).await {
                    tracing::warn!(chunk = idx.0, tier = from, error = %e, "dropping a demoted chunk's old copy");
                }
            }
            self.demoted
                .fetch_add(moved.len() as u64, Ordering::Relaxed);
            moved_total += moved.len() as u64;
        }
        Ok(moved_total)
    }
}

/// Reads a placement map; `None` if the file does not exist.
fn read_map(path: &Path, chunks: u64, tiers: usize) -> StoreResult<Option<Vec<u8>>> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(StoreError::io(
                format!("reading the tier placement map {}", path.display()),
                e,
            ))
        }
    };
    let bad = |why: String| {
        StoreError::new(
            ErrorKind::Corrupt,
            format!("the tier placement map {}: {why}", path.display()),
        )
    };
    if bytes.len() < 24 || &bytes[..8] != MAP_MAGIC {
        return Err(bad("not a placement map (bad header)".into()));
    }
    let n = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
    let t = u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes"));
    if n != chunks || t != tiers as u64 {
        return Err(bad(format!(
            "it is for {n} chunks in {t} tiers, this store has {chunks} chunks in {tiers} tiers"
        )));
    }
    let map = bytes[24..].to_vec();
    if map.len() as u64 != chunks {
        return Err(bad(format!("{} placements for {chunks} chunks", map.len())));
    }
    if let Some(p) = map
        .iter()
        .position(|&b| b != UNPLACED && b != LOST && usize::from(b) >= tiers)
    {
        return Err(bad(format!("chunk {p} is placed in tier {}", map[p])));
    }
    Ok(Some(map))
}

fn write_map(path: &Path, map: &[u8], tiers: usize) -> StoreResult<()> {
    let io = |what: &str, e| StoreError::io(format!("{what} {}", path.display()), e);
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut f = std::fs::File::create(&tmp).map_err(|e| io("creating a new", e))?;
    let mut header = Vec::with_capacity(24);
    header.extend_from_slice(MAP_MAGIC);
    header.extend_from_slice(&(map.len() as u64).to_le_bytes());
    header.extend_from_slice(&(tiers as u64).to_le_bytes());
    f.write_all(&header)
        .and_then(|()| f.write_all(map))
        .and_then(|()| f.sync_all())
        .map_err(|e| io("writing the tier placement map", e))?;
    std::fs::rename(&tmp, path).map_err(|e| io("replacing the tier placement map", e))?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

impl Store for Tiered {
    fn geometry(&self) -> Geometry {
        self.shared.geometry
    }

    /// Write, flush and trim always (a write places or moves nothing another tier could
    /// refuse); status and parallelism when every tier has them.
    fn caps(&self) -> Caps {
        let mut caps = Caps::WRITE | Caps::FLUSH | Caps::TRIM;
        for all in [Caps::STATUS, Caps::PARALLEL] {
            if self
                .shared
                .tiers
                .iter()
                .all(|t| t.store.caps().contains(all))
            {
                caps = caps | all;
            }
        }
        caps
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(self.shared.read(idx))
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(self.shared.write(idx, data))
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(self.shared.flush())
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(self.shared.trim(range))
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        Box::pin(async move {
            self.shared.geometry.check_idx(idx)?;
            let _g = self.shared.stripe(idx).read().await;
            if self.shared.check_not_lost(idx).is_err() {
                return Ok(ChunkStatus::Unknown);
            }
            match self.shared.tier_of(idx) {
                Some(t) => self.shared.tiers[t].store.status(idx).await,
                None => Ok(ChunkStatus::Zero),
            }
        })
    }
}

impl fmt::Debug for Tiered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tiered")
            .field("geometry", &self.shared.geometry)
            .field("used", &self.used())
            .field("tiers", &self.shared.tiers)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use farmap_store::{DirOptions, DirStore, MemoryStore};

    fn memory(g: Geometry) -> Arc<dyn Store> {
        Arc::new(MemoryStore::new(g))
    }

    fn dir(path: &Path, g: Geometry) -> Arc<dyn Store> {
        let opts = DirOptions {
            size: Some(g.size()),
            chunk_size: Some(g.chunk_size()),
            ..DirOptions::default()
        };
        Arc::new(DirStore::open(path, opts).unwrap())
    }

    /// Tier 0 holds about half the region, tier 1 all of it.
    fn two_tiers(a: Arc<dyn Store>, b: Arc<dyn Store>, opts: TierOptions) -> Tiered {
        let n = a.geometry().chunk_count();
        let tiers = vec![
            Tier {
                store: a,
                capacity: n.div_ceil(2),
            },
            Tier {
                store: b,
                capacity: n,
            },
        ];
        Tiered::open(tiers, opts).unwrap()
    }

    fn fast() -> TierOptions {
        TierOptions {
            demote_every: Some(Duration::from_millis(2)),
            ..TierOptions::default()
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_memory_tiers_conform() {
        farmap_testkit::run_conformance(|g| async move {
            Arc::new(two_tiers(memory(g), memory(g), fast())) as Arc<dyn Store>
        })
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn memory_over_dir_conforms() {
        let tmp = tempfile::tempdir().unwrap();
        let n = std::sync::atomic::AtomicUsize::new(0);
        let tmp_path = tmp.path().to_path_buf();
        farmap_testkit::run_conformance(|g| {
            let i = n.fetch_add(1, Ordering::SeqCst);
            let root = tmp_path.join(format!("case{i}"));
            async move {
                let opts = TierOptions {
                    map: Some(root.with_extension("tiers")),
                    ..fast()
                };
                Arc::new(two_tiers(memory(g), dir(&root, g), opts)) as Arc<dyn Store>
            }
        })
        .await;
    }

    fn chunk(g: Geometry, idx: u64, byte: u8) -> Bytes {
        Bytes::from(vec![byte; g.chunk_len(ChunkIdx(idx))])
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn first_writes_fill_the_first_tier_then_the_next_and_then_fail() {
        let g = Geometry::new(8 * 4096, 4096).unwrap();
        let tiers = vec![
            Tier {
                store: memory(g),
                capacity: 3,
            },
            Tier {
                store: memory(g),
                capacity: 2,
            },
        ];
        let opts = TierOptions {
            demote_every: None,
            ..TierOptions::default()
        };
        let t = Tiered::open(tiers, opts).unwrap();
        for i in 0..5 {
            t.write(ChunkIdx(i), chunk(g, i, i as u8 + 1))
                .await
                .unwrap();
        }
        assert_eq!(t.used(), vec![3, 2]);
        assert_eq!(t.tier_of(ChunkIdx(2)), Some(0));
        assert_eq!(t.tier_of(ChunkIdx(3)), Some(1));
        let err = t.write(ChunkIdx(5), chunk(g, 5, 9)).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::NoSpace, "{err}");
        // Rewriting a placed chunk needs no room; a trim frees some.
        t.write(ChunkIdx(4), chunk(g, 4, 0xaa)).await.unwrap();
        t.trim(ChunkRange::single(ChunkIdx(1))).await.unwrap();
        assert_eq!(t.used(), vec![2, 2]);
        t.write(ChunkIdx(5), chunk(g, 5, 9)).await.unwrap();
        assert_eq!(t.tier_of(ChunkIdx(5)), Some(0));
        assert_eq!(t.read(ChunkIdx(4)).await.unwrap()[0], 0xaa);
        assert!(farmap_core::is_zero(&t.read(ChunkIdx(1)).await.unwrap()));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cold_chunks_are_demoted_oldest_first() {
        let g = Geometry::new(16 * 4096, 4096).unwrap();
        let (fast_tier, slow_tier) = (Arc::new(MemoryStore::new(g)), memory(g));
        let tiers = vec![
            Tier {
                store: fast_tier.clone(),
                capacity: 10,
            },
            Tier {
                store: slow_tier,
                capacity: 16,
            },
        ];
        let opts = TierOptions {
            demote_every: None,
            high_water: 50,
            low_water: 30,
            ..TierOptions::default()
        };
        let t = Tiered::open(tiers, opts).unwrap();
        for i in 0..10 {
            t.write(ChunkIdx(i), chunk(g, i, i as u8 + 1))
                .await
                .unwrap();
        }
        // Everything was just written: the pass's first lap only clears referenced bits, its
        // second moves chunks in clock order until tier 0 is at its low water (3 of 10).
        assert_eq!(t.demote().await.unwrap(), 7);
        assert_eq!(t.used(), vec![3, 7]);
        let in_fast = |t: &Tiered| -> Vec<u64> {
            (0..16)
                .filter(|&i| t.tier_of(ChunkIdx(i)) == Some(0))
                .collect()
        };
        assert_eq!(in_fast(&t), vec![7, 8, 9]);
        assert_eq!(
            t.demote().await.unwrap(),
            0,
            "below the high water: nothing moves"
        );
        // Four new chunks: the older, untouched ones go first.
        for i in 10..14 {
            t.write(ChunkIdx(i), chunk(g, i, i as u8 + 1))
                .await
                .unwrap();
        }
        assert_eq!(t.demote().await.unwrap(), 4);
        assert_eq!(in_fast(&t), vec![11, 12, 13]);
        assert_eq!(t.demoted_count(), 11);
        for i in 0..14 {
            assert_eq!(
                t.read(ChunkIdx(i)).await.unwrap()[0],
                i as u8 + 1,
                "chunk {i}"
            );
            if t.tier_of(ChunkIdx(i)) == Some(1) {
                assert_eq!(
                    fast_tier.status(ChunkIdx(i)).await.unwrap(),
                    ChunkStatus::Zero,
                    "chunk {i}'s old copy is dropped"
                );
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn background_demotion_moves_cold_chunks_and_what_it_moved_outlives_a_crash() {
        let tmp = tempfile::tempdir().unwrap();
        let g = Geometry::new(16 * 4096, 4096).unwrap();
        let map = tmp.path().join("region.tiers");
        let disk = tmp.path().join("disk");
        let open = || {
            let tiers = vec![
                Tier {
                    store: memory(g),
                    capacity: 10,
                },
                Tier {
                    store: Arc::new(DirStore::open(
                        &disk,
                        DirOptions {
                            size: Some(g.size()),
                            chunk_size: Some(g.chunk_size()),
                            ..DirOptions::default()
                        },
                    )?) as Arc<dyn Store>,
                    capacity: 16,
                },
            ];
            let opts = TierOptions {
                map: Some(map.clone()),
                demote_every: Some(Duration::from_millis(20)),
                high_water: 50,
                low_water: 30,
                lost_on_restart: vec![0],
            };
            Tiered::open(tiers, opts)
        };
        let t = open().unwrap();
        for i in 0..10 {
            t.write(ChunkIdx(i), chunk(g, i, i as u8 + 1))
                .await
                .unwrap();
        }
        // Nobody calls `demote`: the background task brings the memory tier to its low water.
        let start = std::time::Instant::now();
        while t.used()[0] > 3 {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "no background demotion: {:?}",
                t.used()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(t.used(), vec![3, 7]);
        let moved: Vec<u64> = (0..10)
            .filter(|&i| t.tier_of(ChunkIdx(i)) == Some(1))
            .collect();
        assert_eq!(moved.len(), 7);
        // A crash: no flush, the memory tier is gone with the process. (The background task
        // lets go of the dir tier, and its lock, at its next tick.)
        drop(t);
        let t = loop {
            match open() {
                Ok(t) => break t,
                Err(e) if start.elapsed() < Duration::from_secs(20) => {
                    assert_eq!(e.kind(), farmap_core::ErrorKind::Unavailable, "{e}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => panic!("{e}"),
            }
        };
        for i in 0..10 {
            let read = t.read(ChunkIdx(i)).await;
            if moved.contains(&i) {
                assert_eq!(read.unwrap(), chunk(g, i, i as u8 + 1), "demoted chunk {i}");
            } else {
                let e = read.expect_err("a chunk left in memory is lost");
                assert!(e.to_string().contains("lost"), "chunk {i}: {e}");
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reopened_store_has_its_data_and_placement() {
        let tmp = tempfile::tempdir().unwrap();
        let g = Geometry::new(32 * 4096, 4096).unwrap();
        let map = tmp.path().join("region.tiers");
        let open = || {
            let tiers = vec![
                Tier {
                    store: dir(&tmp.path().join("ssd"), g),
                    capacity: 8,
                },
                Tier {
                    store: dir(&tmp.path().join("disk"), g),
                    capacity: 32,
                },
            ];
            let opts = TierOptions {
                map: Some(map.clone()),
                demote_every: None,
                high_water: 50,
                low_water: 25,
                lost_on_restart: Vec::new(),
            };
            Tiered::open(tiers, opts).unwrap()
        };
        let t = open();
        for i in 0..20 {
            t.write(ChunkIdx(i), chunk(g, i, i as u8 + 1))
                .await
                .unwrap();
        }
        t.demote().await.unwrap();
        t.demote().await.unwrap();
        t.trim(ChunkRange::single(ChunkIdx(15))).await.unwrap();
        t.flush().await.unwrap();
        let placement: Vec<_> = (0..32).map(|i| t.tier_of(ChunkIdx(i))).collect();
        let used = t.used();
        assert!(t.demoted_count() > 0);
        assert_eq!(used.iter().sum::<u64>(), 19);
        drop(t);

        let t = open();
        let again: Vec<_> = (0..32).map(|i| t.tier_of(ChunkIdx(i))).collect();
        assert_eq!(again, placement, "the placement map was reloaded");
        assert_eq!(t.used(), used);
        for i in 0..32u64 {
            let data = t.read(ChunkIdx(i)).await.unwrap();
            if i < 20 && i != 15 {
                assert_eq!(data, chunk(g, i, i as u8 + 1), "chunk {i}");
            } else {
                assert!(farmap_core::is_zero(&data), "chunk {i}");
            }
        }
        // A map for another region is refused, not trusted.
        let other = Geometry::new(16 * 4096, 4096).unwrap();
        let tiers = vec![Tier {
            store: memory(other),
            capacity: 16,
        }];
        let opts = TierOptions {
            map: Some(map.clone()),
            demote_every: None,
            ..TierOptions::default()
        };
        let err = Tiered::open(tiers, opts).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    }
}
