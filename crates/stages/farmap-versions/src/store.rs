//! [`Versioned`]: a region kept as versions over [`Objects`], served as a [`Store`].

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use farmap_core::{
    is_zero, zero_chunk, BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry,
    MemoryBase, Objects, Store, StoreError, StoreResult,
};
use parking_lot::Mutex;

use crate::base::{Base, Lookup};
use crate::chunk::from_trash;
use crate::gc;
use crate::history::{self, latest, load, load_hinted, resolve, resolve_hinted};
use crate::manifest::Manifest;
use crate::page::{self, Map, PageCache, PageRef};
use crate::touched;
use crate::{check_name, chunk, now_ms, tags_dir, version_key, At, Hash, MAX_CHAIN, MAX_DELTA};

/// How to open a [`Versioned`] region.
#[derive(Debug, Clone)]
pub struct VersionedOptions {
    /// The region's name in the object store.
    pub region: String,
    /// Which version.
    pub at: At,
    /// Refuse writes.
    pub read_only: bool,
    /// Create the region with this shape when it has no version yet.
    pub create: Option<Geometry>,
    /// The garbage collector's grace to keep when the object store has none yet (see
    /// [`gc::grace`](crate::gc::grace)); a writer keeps its unsaved chunks safe from a
    /// collector by it.
    pub grace: Option<Duration>,
    /// Read ahead, in the background, the chunks a run on this version (or the latest before
    /// it) read first, in that order (see [`touched`](crate::touched)).
    pub read_ahead: bool,
}

impl VersionedOptions {
    /// The latest version of `region`, writable, not created.
    pub fn new(region: impl Into<String>) -> Self {
        Self {
            region: region.into(),
            at: At::Latest,
            read_only: false,
            create: None,
            grace: None,
            read_ahead: true,
        }
    }
}

/// Bytes of chunks read ahead and not read yet that an opening holds at most.
pub const READ_AHEAD_BYTES: usize = 256 << 20;

/// Chunks read ahead at once.
const READ_AHEAD_IN_FLIGHT: usize = 16;

/// The order in which this opening first read each chunk that holds data, or, once a cache
/// over it [reports touches](Store::reports_touches), first touched each chunk.
#[derive(Debug, Default)]
struct Order {
    seen: HashSet<u64>,
    list: Vec<u64>,
    /// How much of `list` the last save kept.
    saved: usize,
    /// A cache over this opening reports the application's touches: reads are not recorded.
    reported: bool,
}

impl Order {
    fn record(&mut self, idx: u64) {
        if self.list.len() < touched::MAX_CHUNKS && self.seen.insert(idx) {
            self.list.push(idx);
        }
    }
}

/// Chunks read ahead, until the first read of each takes it.
#[derive(Debug, Default)]
struct Ahead {
    warm: Mutex<HashMap<u64, (Hash, Bytes)>>,
    bytes: AtomicUsize,
    /// Reads served from what was read ahead.
    hits: AtomicUsize,
    /// Chunks read already (by the application): not read ahead any more.
    read: Mutex<HashSet<u64>>,
}

/// What the writer knows of the region's history.
#[derive(Debug)]
struct Head {
    /// The version this opening last read or wrote.
    seq: u64,
    epoch: u64,
    /// The whole manifest its chain starts from, and how many deltas follow it.
    base: u64,
    chain: u64,
}

#[derive(Debug)]
struct State {
    /// What each chunk holds (its pages read into the opening's [`PageCache`]).
    map: Map,
    /// Chunks changed since the last version written (zeros as [`Hash::ZERO`]).
    dirty: BTreeMap<u64, Hash>,
    head: Head,
    /// Set once another writer advanced the region: every later write and flush fails.
    fenced: Option<String>,
    /// A version whose create failed without saying whether it landed.
    pending: Option<Pending>,
}

/// A version ready to be written, with what writing it settles.
#[derive(Debug, Clone)]
struct Pending {
    seq: u64,
    epoch: u64,
    whole: bool,
    /// It takes the region over (the next epoch).
    claim: bool,
    bytes: Bytes,
    /// The dirty chunks it saves.
    written: Vec<(u64, Hash)>,
    /// A whole version: the map it makes, and the pages it wrote for it.
    folded: Option<Folded>,
}

/// A whole version's pages, made from the map as it was then.
#[derive(Debug, Clone)]
struct Folded {
    pages: Arc<[PageRef]>,
    /// The overlay the pages were made from.
    overlay: Arc<HashMap<u64, Hash>>,
    /// The pages stored for it.
    stored: Vec<Hash>,
}

/// A region kept as versions over [`Objects`]: reads come from the version it opened (and
/// this opening's writes), writes go to new content-addressed chunks at once, and a flush
/// with something to save writes the next version (see the crate documentation).
pub struct Versioned {
    objects: Arc<dyn Objects>,
    region: String,
    geometry: Geometry,
    read_only: bool,
    state: Arc<Mutex<State>>,
    /// The pages of chunk maps read so far.
    pages: Arc<PageCache>,
    /// When this opening last saw each chunk it wrote in `chunks/` (see [`Self::seen`]).
    seen: Seen,
    /// The object store's garbage-collection grace.
    grace: Duration,
    /// Sees the unsaved chunks again every eighth of the grace (see [`gc`]).
    refresher: Option<tokio::task::JoinHandle<()>>,
    /// The order of first reads (writable openings only).
    order: Option<Mutex<Order>>,
    ahead: Arc<Ahead>,
    /// Reads a recorded working set ahead.
    reader: Option<tokio::task::JoinHandle<()>>,
    /// The recorded working set it reads ahead (see [`Store::working_set`]).
    working_set: Option<Arc<[ChunkIdx]>>,
    /// One flush at a time.
    flushing: tokio::sync::Mutex<()>,
}

/// When each chunk was last seen stored, by the clock of this process.
type Seen = Arc<Mutex<HashMap<Hash, Instant>>>;

impl Drop for Versioned {
    fn drop(&mut self) {
        for task in [&self.refresher, &self.reader].into_iter().flatten() {
            task.abort();
        }
    }
}

impl fmt::Debug for Versioned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.state.lock();
        f.debug_struct("Versioned")
            .field("objects", &self.objects.location())
            .field("region", &self.region)
            .field("version", &st.head.seq)
            .field("dirty", &st.dirty.len())
            .finish()
    }
}

impl Versioned {
    /// Opens `opts.region` in `objects`, creating it (version 0, empty) when it has no
    /// version and `opts.create` gives its shape.
    pub async fn open(objects: Arc<dyn Objects>, opts: VersionedOptions) -> StoreResult<Self> {
        check_name("region", &opts.region).map_err(StoreError::invalid)?;
        let region = opts.region.clone();
        let (seq, hint) = version_to_open(&*objects, &opts).await?;
        let (manifest, map) = load_hinted(&*objects, &region, seq, hint).await?;
        let geometry = manifest.geometry()?;
        if let Some(g) = opts.create {
            if (g.size(), g.chunk_size()) != (geometry.size(), geometry.chunk_size()) {
                return Err(StoreError::invalid(format!(
                    "region {region:?} is {} bytes in chunks of {}, not {} in chunks of {}",
                    geometry.size(),
                    geometry.chunk_size(),
                    g.size(),
                    g.chunk_size()
                )));
            }
        }
        let chain = seq - manifest.base;
        let grace = if opts.read_only {
            gc::DEFAULT_GRACE
        } else {
            gc::grace(&*objects, opts.grace).await?
        };
        let state = Arc::new(Mutex::new(State {
            map,
            dirty: BTreeMap::new(),
            head: Head {
                seq,
                epoch: manifest.epoch,
                base: manifest.base,
                chain,
            },
            fenced: None,
            pending: None,
        }));
        let seen = Seen::default();
        let pages = Arc::new(PageCache::default());
        let rt = tokio::runtime::Handle::try_current().ok();
        let refresher = match &rt {
            Some(rt) if !opts.read_only => Some(rt.spawn(refresh(
                objects.clone(),
                region.clone(),
                state.clone(),
                seen.clone(),
                grace,
            ))),
            _ => None,
        };
        let ahead = Arc::new(Ahead::default());
        let (reader, working_set) = match (&rt, opts.read_ahead) {
            (Some(rt), true) => {
                let to = Reader {
                    objects: objects.clone(),
                    geometry,
                    state: state.clone(),
                    pages: pages.clone(),
                    ahead: ahead.clone(),
                };
                start_read_ahead(rt, to, &region, seq).await
            }
            _ => (None, None),
        };
        Ok(Self {
            objects,
            region,
            geometry,
            read_only: opts.read_only,
            state,
            pages,
            seen,
            grace,
            refresher,
            order: (!opts.read_only).then(|| Mutex::new(Order::default())),
            ahead,
            reader,
            working_set,
            flushing: tokio::sync::Mutex::new(()),
        })
    }

    /// The region's name.
    pub fn region(&self) -> &str {
        &self.region
    }

    /// The version this opening last read or wrote.
    pub fn version(&self) -> u64 {
        self.state.lock().head.seq
    }

    /// Reads served from the working set read ahead (see [`touched`](crate::touched)).
    pub fn read_ahead_hits(&self) -> usize {
        self.ahead.hits.load(Ordering::Relaxed)
    }

    /// Chunks written since the last version.
    pub fn dirty_chunks(&self) -> usize {
        self.state.lock().dirty.len()
    }

    /// Takes the region over: saves what this opening has written, then writes the next
    /// version with the next epoch, so that any other writer is fenced at its next flush.
    pub async fn claim(&self) -> StoreResult<u64> {
        self.flush().await?;
        let _one = self.flushing.lock().await;
        self.save(true).await
    }

    /// Reads the versions saved since this opening's (by another writer, or the old host of
    /// a migration), unless this opening has unsaved writes: then another writer's version
    /// fences it. Returns the version it reads now.
    pub async fn catch_up(&self) -> StoreResult<u64> {
        let _one = self.flushing.lock().await;
        let latest = latest(&*self.objects, &self.region).await?.unwrap_or(0);
        {
            let st = self.state.lock();
            if latest <= st.head.seq {
                return Ok(st.head.seq);
            }
            if !st.dirty.is_empty() || st.pending.is_some() {
                return Err(StoreError::new(
                    ErrorKind::Fenced,
                    format!(
                        "region {:?}: another writer saved version {latest} while this opening \
                         had unsaved writes on version {}",
                        self.region, st.head.seq
                    ),
                ));
            }
        }
        let (manifest, map) = load(&*self.objects, &self.region, latest).await?;
        let mut st = self.state.lock();
        self.pages.retain(&map);
        st.map = map;
        st.head = Head {
            seq: latest,
            epoch: manifest.epoch,
            base: manifest.base,
            chain: latest - manifest.base,
        };
        Ok(latest)
    }

    /// Saves what is written as a version and names it `name`; returns its number.
    pub async fn snapshot(&self, name: &str) -> StoreResult<u64> {
        check_name("snapshot", name).map_err(StoreError::invalid)?;
        self.flush().await?;
        let (seq, base) = {
            let head = &self.state.lock().head;
            (head.seq, head.base)
        };
        let key = format!("{}/{name}", tags_dir(&self.region));
        if !self
            .objects
            .create(&key, Bytes::from(history::number_text(seq)))
            .await?
        {
            return Err(StoreError::invalid(format!(
                "region {:?} already has a snapshot named {name:?}",
                self.region
            )));
        }
        // Where its chain starts, beside the name (older readers see the name alone): an
        // opening of the name reads the chain with the version's manifest. Only a hint: a
        // failure costs a later opening one round trip.
        let hint = format!("{}/{name}", crate::bases_dir(&self.region));
        if let Err(e) = self
            .objects
            .create(&hint, Bytes::from(history::number_text(base)))
            .await
        {
            tracing::warn!(
                region = self.region,
                "cannot save where snapshot {name:?} starts: {e}"
            );
        }
        Ok(seq)
    }

    fn check_writable(&self) -> StoreResult<()> {
        if self.read_only {
            return Err(StoreError::new(
                ErrorKind::ReadOnly,
                format!("region {:?} is open read-only", self.region),
            ));
        }
        if let Some(why) = &self.state.lock().fenced {
            return Err(StoreError::new(ErrorKind::Fenced, why.clone()));
        }
        Ok(())
    }

    /// The next version to write: the dirty chunks (or, when the chain is long, every chunk,
    /// in pages: those that changed are stored first), with the next epoch when `claim`.
    async fn prepare(&self, claim: bool) -> StoreResult<Pending> {
        let (seq, epoch, base, whole, written, map) = {
            let st = self.state.lock();
            let whole = st.head.chain + 1 >= MAX_CHAIN || st.dirty.len() > MAX_DELTA;
            let written: Vec<(u64, Hash)> = st.dirty.iter().map(|(i, h)| (*i, *h)).collect();
            (
                st.head.seq + 1,
                st.head.epoch + u64::from(claim),
                st.head.base,
                whole,
                written,
                whole.then(|| st.map.clone()),
            )
        };
        let mut manifest = Manifest {
            seq,
            epoch,
            base: if whole { seq } else { base },
            size: self.geometry.size(),
            chunk_size: self.geometry.chunk_size(),
            whole,
            time_ms: now_ms(),
            entries: Vec::new(),
            pages: Vec::new(),
            page_chunks: 0,
            from: None,
        };
        let mut folded = None;
        match map {
            Some(map) => {
                let (pages, store) = map.fold(&*self.objects, &self.pages).await?;
                let mut stored = Vec::with_capacity(store.len());
                for (hash, bytes) in store {
                    let now = Instant::now();
                    self.objects.create(&chunk::key(&hash), bytes).await?;
                    self.seen.lock().insert(hash, now);
                    stored.push(hash);
                }
                manifest.page_chunks = map.page_chunks();
                manifest.pages = pages.clone();
                folded = Some(Folded {
                    pages: pages.into(),
                    overlay: Arc::new(map.overlay().clone()),
                    stored,
                });
            }
            None => manifest.entries = written.clone(),
        }
        Ok(Pending {
            seq,
            epoch,
            whole,
            claim,
            bytes: Bytes::from(manifest.encode()),
            written,
            folded,
        })
    }

    /// Writes the next version (see [`next_version`](Self::next_version)). A version whose
    /// create failed without saying whether it landed is tried again first, with the same
    /// bytes, so that the retry cannot mistake it for another writer's. Called under
    /// `flushing`.
    async fn save(&self, claim: bool) -> StoreResult<u64> {
        let mut claimed = !claim;
        loop {
            let pending = {
                let st = self.state.lock();
                if let Some(why) = &st.fenced {
                    return Err(StoreError::new(ErrorKind::Fenced, why.clone()));
                }
                if st.pending.is_none() && st.dirty.is_empty() && claimed {
                    return Ok(st.head.seq);
                }
                st.pending.clone()
            };
            let (p, retried) = match pending {
                Some(p) => (p, true),
                None => {
                    // Only a flush (holding `flushing`) prepares a version: none came since.
                    let p = self.prepare(!claimed).await?;
                    self.state.lock().pending = Some(p.clone());
                    (p, false)
                }
            };
            let pages = p.folded.iter().flat_map(|f| f.stored.iter().copied());
            self.see_again(
                p.written.iter().map(|(_, h)| *h).chain(pages),
                self.grace / 4,
            )
            .await?;
            let key = version_key(&self.region, p.seq);
            let created = match self.objects.create(&key, p.bytes.clone()).await {
                Ok(true) => true,
                // Taken: by another writer, or by this one's earlier try that reported an
                // error. What is there decides.
                Ok(false) => match self.objects.get(&key).await {
                    Ok(there) => there.is_some_and(|b| b == p.bytes),
                    Err(e) => return Err(e),
                },
                // The create may have landed before the error: what is there decides.
                Err(e) => match self.objects.get(&key).await {
                    Ok(Some(there)) if there == p.bytes => true,
                    Ok(Some(_)) => false,
                    Ok(None) | Err(_) => return Err(e),
                },
            };
            let mut st = self.state.lock();
            st.pending = None;
            if !created {
                let why = format!(
                    "region {:?}: another writer wrote version {} (this opening wrote up to {}); \
                     what was written here since is not saved",
                    self.region, p.seq, st.head.seq
                );
                st.fenced = Some(why.clone());
                return Err(StoreError::new(ErrorKind::Fenced, why));
            }
            st.head.seq = p.seq;
            st.head.epoch = p.epoch;
            if let Some(f) = &p.folded {
                st.map.folded(f.pages.clone(), &f.overlay);
                self.pages.retain(&st.map);
            }
            if p.whole {
                st.head.base = p.seq;
                st.head.chain = 0;
            } else {
                st.head.chain += 1;
            }
            for (idx, hash) in &p.written {
                if st.dirty.get(idx) == Some(hash) {
                    st.dirty.remove(idx);
                }
            }
            claimed |= p.claim;
            // A retried version may predate writes this flush must save: one more round.
            if claimed && (!retried || st.dirty.is_empty()) {
                return Ok(p.seq);
            }
        }
    }

    /// Sees each of `hashes` in `chunks/` again (putting it back from the trash if a
    /// collector moved it) unless this opening saw it there less than `within` ago. A version
    /// lists a chunk only within half the grace of seeing it (see [`gc`]).
    async fn see_again(
        &self,
        hashes: impl Iterator<Item = Hash>,
        within: Duration,
    ) -> StoreResult<()> {
        see_again(&*self.objects, &self.region, &self.seen, hashes, within).await
    }

    /// Saves the order of first reads with the version this opening is on, when it grew
    /// since the last save. A failure only costs the next opening its read-ahead: logged.
    async fn save_order(&self) {
        let Some(order) = &self.order else { return };
        let list = {
            let o = order.lock();
            if o.list.len() <= o.saved {
                return;
            }
            o.list.clone()
        };
        let seq = self.version();
        match touched::save(&*self.objects, &self.region, seq, &list).await {
            Ok(()) => order.lock().saved = list.len(),
            Err(e) => tracing::warn!(
                region = self.region,
                "cannot save the working set (the next opening reads nothing ahead): {e}"
            ),
        }
    }

    /// Chunk `idx` now holds `hash`; a chunk written again with the content it holds is not
    /// a change (the next version does not list it).
    /// Call [`lookup`](Self::lookup) first, so that what it held is known; when it is not
    /// (its page was dropped meanwhile), the write counts as a change.
    fn set(&self, idx: u64, hash: Hash) {
        let mut st = self.state.lock();
        let before = st.map.get(idx, &self.pages);
        st.map.set(idx, hash);
        if before.map(|b| b.unwrap_or(Hash::ZERO)) != Ok(hash) || st.dirty.contains_key(&idx) {
            st.dirty.insert(idx, hash);
        }
    }

    /// What chunk `idx` holds now (`None`: zeros), reading its page when needed.
    async fn lookup(&self, idx: u64) -> StoreResult<Option<Hash>> {
        let state = &self.state;
        page::lookup(
            || state.lock().map.get(idx, &self.pages),
            &*self.objects,
            &self.pages,
        )
        .await
    }
}

impl Store for Versioned {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn caps(&self) -> Caps {
        let base = Caps::STATUS | Caps::PARALLEL;
        if self.read_only {
            base
        } else {
            base | Caps::WRITE | Caps::FLUSH | Caps::TRIM
        }
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            self.geometry.check_idx(idx)?;
            let len = self.geometry.chunk_len(idx);
            let Some(hash) = self.lookup(idx.0).await? else {
                return Ok(zero_chunk(len));
            };
            if let Some(order) = &self.order {
                let mut o = order.lock();
                if !o.reported {
                    o.record(idx.0);
                }
            }
            if self.reader.is_some() {
                self.ahead.read.lock().insert(idx.0);
                if let Some((h, data)) = self.ahead.warm.lock().remove(&idx.0) {
                    self.ahead.bytes.fetch_sub(data.len(), Ordering::Relaxed);
                    if h == hash {
                        self.ahead.hits.fetch_add(1, Ordering::Relaxed);
                        return Ok(data);
                    }
                }
            }
            let stored = match self.objects.get(&chunk::key(&hash)).await? {
                Some(b) => Some(b),
                // A collector moved it (a version written since lists it; the collector's
                // next run puts it back).
                None => from_trash(&*self.objects, &hash).await?,
            };
            let stored = stored.ok_or_else(|| {
                StoreError::new(
                    ErrorKind::Corrupt,
                    format!(
                        "region {:?}: chunk {} ({}) is missing from {}",
                        self.region,
                        idx.0,
                        hash.hex(),
                        self.objects.location()
                    ),
                )
            })?;
            chunk::decode(&stored, len, &hash)
        })
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            self.geometry.check_write(idx, data.len())?;
            self.check_writable()?;
            self.lookup(idx.0).await?;
            if is_zero(&data) {
                self.set(idx.0, Hash::ZERO);
                return Ok(());
            }
            let hash = Hash::of(&data);
            let fresh = self
                .seen
                .lock()
                .get(&hash)
                .is_some_and(|t| t.elapsed() < self.grace / 4);
            if !fresh {
                // Created or already there (the same bytes, written before): both are stored.
                let now = Instant::now();
                self.objects
                    .create(&chunk::key(&hash), Bytes::from(chunk::encode(&data)))
                    .await?;
                self.seen.lock().insert(hash, now);
            }
            self.set(idx.0, hash);
            Ok(())
        })
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            if self.read_only {
                return Ok(());
            }
            let _one = self.flushing.lock().await;
            self.save(false).await?;
            self.save_order().await;
            Ok(())
        })
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            self.geometry.check_range(range)?;
            self.check_writable()?;
            for idx in range.iter() {
                self.lookup(idx.0).await?;
                self.set(idx.0, Hash::ZERO);
            }
            Ok(())
        })
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        Box::pin(async move {
            self.geometry.check_idx(idx)?;
            Ok(ChunkStatus::data_if(self.lookup(idx.0).await?.is_some()))
        })
    }

    fn catch_up(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move { Versioned::catch_up(self).await.map(|_| ()) })
    }

    fn working_set(&self) -> Option<Arc<[ChunkIdx]>> {
        self.working_set.clone()
    }

    /// From now on the order recorded is the cache's reports; what was read so far (the
    /// cache's pull, likely) is forgotten.
    fn reports_touches(&self) {
        if let Some(order) = &self.order {
            let mut o = order.lock();
            if !o.reported {
                *o = Order {
                    reported: true,
                    ..Order::default()
                };
            }
        }
    }

    fn touched(&self, idx: ChunkIdx) {
        if let Some(order) = &self.order {
            if self.geometry.contains(idx) {
                let mut o = order.lock();
                if o.reported {
                    o.record(idx.0);
                }
            }
        }
    }

    fn memory_base(&self) -> BoxFuture<'_, StoreResult<Option<Arc<dyn MemoryBase>>>> {
        Box::pin(async move {
            let (state, pages) = (self.state.clone(), self.pages.clone());
            let now: Lookup = Arc::new(move |idx| state.lock().map.get(idx, &pages).ok());
            let opened = || self.state.lock().map.clone();
            let base = Base::of(
                &*self.objects,
                &self.region,
                self.geometry,
                opened,
                now,
                self.pages.clone(),
            )
            .await?;
            Ok(Some(Arc::new(base) as Arc<dyn MemoryBase>))
        })
    }

    fn take_over(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            if self.read_only {
                return Err(StoreError::new(
                    ErrorKind::ReadOnly,
                    format!(
                        "region {:?} is open read-only: it cannot take over",
                        self.region
                    ),
                ));
            }
            Versioned::catch_up(self).await?;
            self.claim().await.map(|_| ())
        })
    }
}

/// The latest version of `opts.region`, made (version 0, empty) when it has none and
/// `opts.create` gives its shape.
async fn latest_or_create(objects: &dyn Objects, opts: &VersionedOptions) -> StoreResult<u64> {
    let region = &opts.region;
    if let Some(latest) = latest(objects, region).await? {
        return Ok(latest);
    }
    let Some(g) = opts.create.filter(|_| !opts.read_only) else {
        return Err(StoreError::new(
            ErrorKind::NotFound,
            format!(
                "region {region:?} has no versions in {}: give its size to create it",
                objects.location()
            ),
        ));
    };
    let first = Manifest::empty(g);
    // Losing this race to another creator is fine: its version 0 is what opens.
    objects
        .create(&version_key(region, 0), Bytes::from(first.encode()))
        .await?;
    Ok(0)
}

/// What reading ahead needs of an opening.
struct Reader {
    objects: Arc<dyn Objects>,
    geometry: Geometry,
    state: Arc<Mutex<State>>,
    pages: Arc<PageCache>,
    ahead: Arc<Ahead>,
}

/// The version an opening opens (checked writable unless read-only), and where its chain
/// starts when a snapshot's name says so.
async fn version_to_open(
    objects: &dyn Objects,
    opts: &VersionedOptions,
) -> StoreResult<(u64, Option<u64>)> {
    let region = &opts.region;
    let mut hint = None;
    let seq = match &opts.at {
        At::Latest => latest_or_create(objects, opts).await?,
        // A read-only opening of a given version needs nothing else: no listing.
        at if opts.read_only => {
            let (seq, base) = resolve_hinted(objects, region, at).await?;
            hint = base;
            seq
        }
        at => {
            let latest = latest_or_create(objects, opts).await?;
            let seq = resolve(objects, region, at).await?;
            if seq != latest {
                return Err(StoreError::new(
                    ErrorKind::ReadOnly,
                    format!(
                        "region {region:?}: version {seq} is not the latest ({latest}); \
                         open it read-only"
                    ),
                ));
            }
            seq
        }
    };
    Ok((seq, hint))
}

/// Starts reading ahead the working set recorded for version `seq` (see
/// [`touched`](crate::touched)), if there is one: the task, and the working set.
async fn start_read_ahead(
    rt: &tokio::runtime::Handle,
    to: Reader,
    region: &str,
    seq: u64,
) -> (Option<tokio::task::JoinHandle<()>>, Option<Arc<[ChunkIdx]>>) {
    let Some(order) = touched::find(&*to.objects, region, seq, to.geometry.chunk_count()).await
    else {
        return (None, None);
    };
    tracing::debug!(region, chunks = order.len(), "reading a working set ahead");
    let set = order.iter().map(|&c| ChunkIdx(c)).collect();
    (Some(rt.spawn(read_ahead(to, order))), Some(set))
}

/// Sees each of `hashes` (but zeros) in `chunks/` again unless seen less than `within` ago,
/// putting it back from the trash when a collector moved it.
async fn see_again(
    objects: &dyn Objects,
    region: &str,
    seen: &Seen,
    hashes: impl Iterator<Item = Hash>,
    within: Duration,
) -> StoreResult<()> {
    let stale: Vec<Hash> = {
        let seen = seen.lock();
        hashes
            .filter(|h| *h != Hash::ZERO)
            .filter(|h| seen.get(h).is_none_or(|t| t.elapsed() >= within))
            .collect()
    };
    for hash in stale {
        let now = Instant::now();
        gc::ensure(objects, &hash, region).await?;
        seen.lock().insert(hash, now);
    }
    Ok(())
}

/// A writer's side of garbage collection (see [`gc`]): every eighth of the grace, sees the
/// chunks written but not yet saved in a version again, and forgets the others.
async fn refresh(
    objects: Arc<dyn Objects>,
    region: String,
    state: Arc<Mutex<State>>,
    seen: Seen,
    grace: Duration,
) {
    let period = grace / 8;
    loop {
        tokio::time::sleep(period).await;
        let unsaved: HashSet<Hash> = state.lock().dirty.values().copied().collect();
        seen.lock()
            .retain(|h, t| unsaved.contains(h) || t.elapsed() < grace / 4);
        if let Err(e) = see_again(&*objects, &region, &seen, unsaved.into_iter(), period).await {
            tracing::warn!(
                region,
                "cannot keep the unsaved chunks from the collector: {e}"
            );
        }
    }
}

/// Reads `order` ahead: each chunk that holds data and was not read yet, [`READ_AHEAD_IN_FLIGHT`]
/// at a time, holding at most [`READ_AHEAD_BYTES`] not read yet.
async fn read_ahead(to: Reader, order: Vec<u64>) {
    let Reader {
        objects,
        geometry,
        state,
        pages,
        ahead,
    } = to;
    let mut tasks = tokio::task::JoinSet::new();
    for idx in order {
        while tasks.len() >= READ_AHEAD_IN_FLIGHT
            || ahead.bytes.load(Ordering::Relaxed) >= READ_AHEAD_BYTES
        {
            if tasks.join_next().await.is_none() {
                // Full, with nothing in flight: wait for reads to take some.
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        if ahead.read.lock().contains(&idx) {
            continue;
        }
        let found = page::lookup(|| state.lock().map.get(idx, &pages), &*objects, &pages);
        // A page that cannot be read is reported when its chunk is asked for.
        let Ok(Some(hash)) = found.await else {
            continue;
        };
        let (objects, ahead) = (objects.clone(), ahead.clone());
        let len = geometry.chunk_len(ChunkIdx(idx));
        tasks.spawn(async move {
            let stored = match objects.get(&chunk::key(&hash)).await {
                Ok(Some(b)) => Some(b),
                _ => from_trash(&*objects, &hash).await.ok().flatten(),
            };
            // What cannot be read ahead is read (and its error reported) when asked for.
            let Some(data) = stored.and_then(|s| chunk::decode(&s, len, &hash).ok()) else {
                return;
            };
            if !ahead.read.lock().contains(&idx) {
                ahead.bytes.fetch_add(data.len(), Ordering::Relaxed);
                ahead.warm.lock().insert(idx, (hash, data));
            }
        });
    }
    while tasks.join_next().await.is_some() {}
}
