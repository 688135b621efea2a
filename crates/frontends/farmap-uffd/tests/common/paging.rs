//! Bounded regions for the paging tests (`paging.rs`, `paging_copy.rs`): their options, and
//! the no-write-lost model (a writer keeping a model of the region while the limit moves).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use farmap_core::{Geometry, Store};
use farmap_pipeline::PushOptions;
use farmap_store::MemoryStore;
use farmap_testkit::contents::{snapshot, with_pattern};
use farmap_testkit::pattern_bytes;
use farmap_uffd::{LocalLimit, PagingOptions, Region, RegionOptions, WriteTracking};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// The chunk size of the model's region.
pub const CHUNK: u32 = 16 * 1024;
/// Its chunks.
pub const CHUNKS: u64 = 64;

/// Whether bounded regions work here (userfaultfd with UFFDIO_MOVE and WP_ASYNC); records a
/// skip otherwise.
pub fn paging_available(test: &str) -> bool {
    farmap_testkit::skip::unless(test, farmap_uffd::probe_paging()).is_some()
}

/// A direct region with asynchronous tracking, bounded by `limit` (`min_free` 2, proactive
/// reclaim, not fresh, no prefetch, faults served by the reader), pushing every `push`.
pub fn bounded(limit: LocalLimit, push: Option<Duration>) -> RegionOptions {
    RegionOptions {
        tracking: WriteTracking::Async,
        push: PushOptions {
            interval: push,
            ..PushOptions::default()
        },
        paging: Some(PagingOptions {
            local_max: limit,
            min_free: Some(2),
            proactive: true,
            fresh: false,
            prefetch: farmap_uffd::Prefetch::Off,
            in_thread: false,
        }),
        ..RegionOptions::direct()
    }
}

/// One writer thread writing random words all over the region (keeping a model) while the
/// test thread changes the limit; at the end the memory, and the store after a sync, equal
/// the model.
pub fn no_write_lost(seed: u64, limits: &[u8], push: Option<Duration>, in_thread: bool) {
    no_write_lost_as(seed, limits, push, in_thread, false);
}

/// [`no_write_lost`]; `sequential`: the writer sweeps the region chunk after chunk (a word
/// in each, over and over) with sequential prefetch on, so that its stream leaves chunks
/// behind for drop-behind.
pub fn no_write_lost_as(
    seed: u64,
    limits: &[u8],
    push: Option<Duration>,
    in_thread: bool,
    sequential: bool,
) -> farmap_uffd::PagingStats {
    Model {
        seed,
        limits,
        push,
        in_thread,
        sequential,
        ..Model::default()
    }
    .run()
}

/// A run of the no-write-lost model (see [`no_write_lost`]).
#[derive(Debug, Clone)]
pub struct Model<'a> {
    pub seed: u64,
    /// The limits the test thread cycles through, 3 times (percent of the region), 3 ms each.
    pub limits: &'a [u8],
    pub push: Option<Duration>,
    pub in_thread: bool,
    /// See [`no_write_lost_as`].
    pub sequential: bool,
    /// The region's geometry.
    pub chunk: u32,
    pub chunks: u64,
    /// The writer's operations at least (it goes on until the limits are done).
    pub min_writes: usize,
    /// After each change of the limit, the test thread syncs the region and checks that the
    /// store holds every write made before the sync began (or a later one): the writer's
    /// values then increase, so that the store's value of a word is never below the last one
    /// written before.
    pub syncs: bool,
    /// One operation of the writer in this many discards a run of 1 to 8 pages
    /// (`madvise(MADV_DONTNEED)`) instead of writing, and checks that they read zeros: for a
    /// region whose discarded pages mean zeros (the model has zeros there).
    pub discards: Option<u32>,
    /// A second thread reads the region page after page, over and over, with sequential
    /// prefetch on (windows of 8 chunks); half of the discards go just ahead of it, where its
    /// prefetches are in flight.
    pub reader: bool,
}

impl Default for Model<'_> {
    fn default() -> Self {
        Model {
            seed: 0,
            limits: &[25],
            push: None,
            in_thread: false,
            sequential: false,
            chunk: CHUNK,
            chunks: CHUNKS,
            min_writes: 2000,
            syncs: false,
            discards: None,
            reader: false,
        }
    }
}

/// What the model's writer did, in order.
#[derive(Debug, Clone, Copy)]
enum Op {
    /// A word written (at this offset).
    Write(usize, u64),
    /// Bytes discarded (offset, length): zeros.
    Zero(usize, usize),
}

/// The writer's operations, each logged once it is checked (read back), and the discard it
/// is making now (from before its `madvise` until it is logged: a sync's check counts its
/// zeros as later than the sync's start).
#[derive(Default)]
struct Log {
    ops: Vec<Op>,
    discarding: Option<Op>,
}

/// Set in every value the writer writes when it increases them (see [`Model::syncs`]).
const WRITTEN: u64 = 1 << 63;

/// What the threads of a model run share.
#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    log: Mutex<Log>,
    /// The page the reader is at.
    reader_at: AtomicUsize,
    /// The offset the writer touches now, its operations so far, and whether it is done
    /// (for the watchdog).
    writer_at: AtomicUsize,
    writer_ops: AtomicUsize,
    writer_done: AtomicBool,
}

/// How long the writer may make no progress before the watchdog ends the test.
const STUCK: Duration = Duration::from_secs(20);

/// Ends the process, with the pager's trace of the chunk the writer is stuck on, if the
/// writer makes no progress for [`STUCK`] (a fault nobody serves would hang the test).
fn watch(region: &Region, shared: &Shared) {
    let mut last = (usize::MAX, std::time::Instant::now());
    while !shared.writer_done.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(50));
        let ops = shared.writer_ops.load(Ordering::Relaxed);
        if ops != last.0 {
            last = (ops, std::time::Instant::now());
        } else if last.1.elapsed() > STUCK {
            let off = shared.writer_at.load(Ordering::Relaxed);
            let chunk = off as u64 / u64::from(region.geometry().chunk_size());
            eprintln!(
                "the writer is stuck at {off:#x} (chunk {chunk}, operation {ops}, address {:#x}): {:#?}\n{:?}",
                region.as_ptr() as usize + off,
                region.diagnostics().pager_trace(chunk),
                region.stats()
            );
            std::process::abort();
        }
    }
}

impl Model<'_> {
    /// Runs the model: no write lost (and zeros where pages were discarded), in memory or in
    /// the store after a sync; something was evicted, nothing poisoned or recovered. Returns
    /// the paging counters.
    pub fn run(&self) -> farmap_uffd::PagingStats {
        let g = Geometry::new(self.chunks * u64::from(self.chunk), u64::from(self.chunk)).unwrap();
        let store = with_pattern(MemoryStore::new(g), self.seed);
        let mut opts = bounded(LocalLimit::Percent(f64::from(self.limits[0])), self.push);
        if let Some(p) = &mut opts.paging {
            p.in_thread = self.in_thread;
            if self.sequential {
                p.prefetch = farmap_uffd::Prefetch::Sequential { max_chunks: 2 };
            } else if self.reader {
                p.prefetch = farmap_uffd::Prefetch::Sequential { max_chunks: 8 };
            }
        }
        let region = Region::open(store.clone(), opts).unwrap();
        let shared = Shared::default();
        std::thread::scope(|s| {
            // A failed check of the test thread stops the others (the scope waits for them).
            let _stop = StopOnDrop(&shared.stop);
            let writer = s.spawn(|| {
                let _done = StopOnDrop(&shared.writer_done);
                self.write(&region, &shared);
            });
            s.spawn(|| watch(&region, &shared));
            let reader = self.reader.then(|| s.spawn(|| read_on(&region, &shared)));
            for &pct in self.limits.iter().cycle().take(self.limits.len() * 3) {
                std::thread::sleep(Duration::from_millis(3));
                assert!(region.set_local_max(LocalLimit::Percent(f64::from(pct))));
                if self.syncs {
                    sync_keeps(&region, &*store, &shared.log);
                }
            }
            shared.stop.store(true, Ordering::Relaxed);
            writer.join().unwrap();
            if let Some(r) = reader {
                r.join().unwrap();
            }
        });
        let mut model = pattern_bytes(self.seed, 0, g.size() as usize);
        for op in shared.log.into_inner().unwrap().ops {
            match op {
                Op::Write(off, v) => model[off..off + 8].copy_from_slice(&v.to_ne_bytes()),
                Op::Zero(off, len) => model[off..off + len].fill(0),
            }
        }
        self.check(&region, &*store, &model)
    }

    /// The end of a run: memory and store (after a sync) equal `model`.
    fn check(&self, region: &Region, store: &dyn Store, model: &[u8]) -> farmap_uffd::PagingStats {
        let stats = region.stats();
        let paging = stats.paging.clone().unwrap();
        assert!(
            paging.deactivations > 0,
            "the limit never made the region evict anything: {paging:?}"
        );
        if self.discards.is_some() {
            assert!(stats.remove_events > 0, "nothing discarded: {stats:?}");
        }
        region.sync().unwrap();
        check_store(region, &snapshot(store), model);
        assert!(
            region.memory().to_vec() == model,
            "the region's memory differs from the model"
        );
        assert_eq!(stats.poisoned_pages, 0);
        let paging = region.stats().paging.unwrap();
        assert_eq!(
            paging.recovered, 0,
            "an active chunk's pages turned up in its staging slot: {paging:?}"
        );
        paging
    }

    /// The writer: random words (half of them in a hot eighth of the region), or a sweep,
    /// each read back at once and logged, until `stop` and at least `min_writes`; with
    /// `discards`, some discards, each checked at once.
    fn write(&self, region: &Region, shared: &Shared) {
        let mem = region.memory();
        let mut rng = SmallRng::seed_from_u64(self.seed ^ 0x5eed);
        let words = region.len() / 8;
        let per_chunk = self.chunk as usize / 8;
        let mut k = 0;
        while !shared.stop.load(Ordering::Relaxed) || k < self.min_writes {
            shared.writer_ops.store(k, Ordering::Relaxed);
            if self.discards.is_some_and(|n| rng.gen_ratio(1, n)) {
                self.discard(region, shared, &mut rng);
                k += 1;
                continue;
            }
            let w = if self.sequential {
                (k % (words / per_chunk)) * per_chunk + rng.gen_range(0..per_chunk)
            } else if rng.gen_bool(0.5) {
                rng.gen_range(0..words / 8)
            } else {
                rng.gen_range(0..words)
            };
            let v: u64 = if self.syncs {
                WRITTEN | k as u64
            } else {
                rng.gen()
            };
            shared.writer_at.store(w * 8, Ordering::Relaxed);
            mem.store_u64(w * 8, v).unwrap();
            // Read back at once: a lost staged copy would show here too.
            assert_eq!(mem.load_u64(w * 8).unwrap(), v, "word {w} read back");
            shared.log.lock().unwrap().ops.push(Op::Write(w * 8, v));
            k += 1;
        }
    }

    /// Discards 1 to 8 pages: in the hot eighth, anywhere, or (with a reader) just ahead of
    /// the reader; checks that each reads zeros at once; logs it.
    fn discard(&self, region: &Region, shared: &Shared, rng: &mut SmallRng) {
        let page = region.page_size();
        let pages = region.len() / page;
        let n = rng.gen_range(1..=8);
        let first = if self.reader && rng.gen_bool(0.5) {
            shared.reader_at.load(Ordering::Relaxed) + rng.gen_range(0..16)
        } else if rng.gen_bool(0.5) {
            rng.gen_range(0..pages / 8)
        } else {
            rng.gen_range(0..pages)
        };
        let first = first.min(pages - n);
        let op = Op::Zero(first * page, n * page);
        shared.log.lock().unwrap().discarding = Some(op);
        region
            .discard_pages(std::slice::from_ref(&(first as u64..(first + n) as u64)))
            .unwrap();
        let mem = region.memory();
        for p in first..first + n {
            let off = p * page + rng.gen_range(0..page / 8) * 8;
            shared.writer_at.store(off, Ordering::Relaxed);
            assert_eq!(
                mem.load_u64(off).unwrap(),
                0,
                "a discarded page at {off:#x}"
            );
        }
        let mut log = shared.log.lock().unwrap();
        log.ops.push(op);
        log.discarding = None;
    }
}

/// Raises its flag when dropped (a panic unwinding included).
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// The model's reader: every page in turn, over and over, until `stop`.
fn read_on(region: &Region, shared: &Shared) {
    let mem = region.memory();
    let page = region.page_size();
    let pages = region.len() / page;
    let mut p = 0;
    while !shared.stop.load(Ordering::Relaxed) {
        shared.reader_at.store(p, Ordering::Relaxed);
        mem.load_u64(p * page).unwrap();
        p = (p + 1) % pages;
    }
}

/// Syncs `region` while its writer runs; then `store` holds, for every word the writer
/// touched before the sync began, what it left there or something later: a later write
/// (values increase) or zeros of a later discard.
fn sync_keeps(region: &Region, store: &dyn Store, log: &Mutex<Log>) {
    let before = log.lock().unwrap().ops.len();
    region.sync().unwrap();
    let snap = snapshot(store);
    let (ops, discarding) = {
        let log = log.lock().unwrap();
        (log.ops.clone(), log.discarding)
    };
    // The last operation on each word before the sync, by its index in the log.
    let mut last = HashMap::new();
    for (k, op) in ops[..before].iter().enumerate() {
        match *op {
            Op::Write(off, _) => {
                last.insert(off, k);
            }
            Op::Zero(off, len) => last.extend((off..off + len).step_by(8).map(|w| (w, k))),
        }
    }
    let zeroed_later: HashSet<usize> = ops[before..]
        .iter()
        .chain(&discarding)
        .flat_map(|op| match *op {
            Op::Zero(off, len) => (off..off + len).step_by(8),
            Op::Write(..) => (0..0).step_by(8),
        })
        .collect();
    for (off, k) in last {
        let got = u64::from_ne_bytes(snap[off..off + 8].try_into().unwrap());
        let later_write = got & WRITTEN != 0 && got & !WRITTEN >= k as u64;
        let ok = match ops[k] {
            Op::Write(..) => later_write || (got == 0 && zeroed_later.contains(&off)),
            Op::Zero(..) => got == 0 || later_write,
        };
        if ok {
            continue;
        }
        let page = region.page_size();
        let on_page: Vec<(usize, Op)> = ops
            .iter()
            .copied()
            .enumerate()
            .filter(|(_, op)| match *op {
                Op::Write(o, _) => o / page == off / page,
                Op::Zero(o, len) => (o..o + len).contains(&off),
            })
            .collect();
        panic!(
            "after a sync the store holds {got:#x} at {off:#x}, older than {:?} (operation \
             {k}; the sync began after operation {before}); the writer's operations on its \
             page: {on_page:?}; chunk trace: {:#?}",
            ops[k],
            region
                .diagnostics()
                .pager_trace(off as u64 / u64::from(region.geometry().chunk_size()))
        );
    }
}

/// Panics, with the differing words and the pager's trace of their chunks, unless the
/// store's content (`snap`, after a sync) equals `model`.
pub fn check_store(region: &Region, snap: &[u8], model: &[u8]) {
    if snap == model {
        return;
    }
    let chunk = region.geometry().chunk_size() as usize;
    let bad: Vec<usize> = (0..model.len() / 8)
        .filter(|w| snap[w * 8..w * 8 + 8] != model[w * 8..w * 8 + 8])
        .collect();
    let mem = region.memory().to_vec();
    let mem_bad = (0..model.len() / 8)
        .filter(|w| mem[w * 8..w * 8 + 8] != model[w * 8..w * 8 + 8])
        .count();
    let chunks: std::collections::BTreeSet<usize> = bad.iter().map(|w| w * 8 / chunk).collect();
    for c in &chunks {
        eprintln!(
            "chunk {c}: {:#?}",
            region.diagnostics().pager_trace(*c as u64)
        );
    }
    for w in bad.iter().take(64) {
        eprintln!(
            "word {w} (offset {:#x}) model {:x?} mem {:x?} store {:x?}",
            w * 8,
            &model[w * 8..w * 8 + 8],
            &mem[w * 8..w * 8 + 8],
            &snap[w * 8..w * 8 + 8]
        );
    }
    panic!(
        "the store differs from the model after a sync: {} words in chunks {chunks:?} \
         (memory differs in {mem_bad} words); {:?}",
        bad.len(),
        region.stats()
    );
}
