//! Bounded regions for the paging tests (`paging.rs`, `paging_copy.rs`): their options, and
//! the no-write-lost model (a writer keeping a model of the region while the limit moves).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use farmap_core::Geometry;
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
    /// The writer's writes at least (it goes on until the limits are done).
    pub min_writes: usize,
    /// After each change of the limit, the test thread syncs the region and checks that the
    /// store holds every write made before the sync began (or a later one): the writer's
    /// values then increase, so that the store's value of a word is never below the last one
    /// written before.
    pub syncs: bool,
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
        }
    }
}

/// The writes of a model's writer, in order, each logged once it is read back.
type Log = Mutex<Vec<(usize, u64)>>;

/// Set in every value the writer writes when it increases them (see [`Model::syncs`]).
const WRITTEN: u64 = 1 << 63;

impl Model<'_> {
    /// Runs the model: no write lost, in memory or in the store after a sync; something was
    /// evicted, nothing poisoned or recovered. Returns the paging counters.
    pub fn run(&self) -> farmap_uffd::PagingStats {
        let g = Geometry::new(self.chunks * u64::from(self.chunk), u64::from(self.chunk)).unwrap();
        let store = with_pattern(MemoryStore::new(g), self.seed);
        let mut opts = bounded(LocalLimit::Percent(f64::from(self.limits[0])), self.push);
        if let Some(p) = &mut opts.paging {
            p.in_thread = self.in_thread;
            if self.sequential {
                p.prefetch = farmap_uffd::Prefetch::Sequential { max_chunks: 2 };
            }
        }
        let region = Region::open(store.clone(), opts).unwrap();
        let mut model = pattern_bytes(self.seed, 0, g.size() as usize);
        let (stop, log) = (AtomicBool::new(false), Log::default());
        std::thread::scope(|s| {
            let writer = s.spawn(|| self.write(&region, &stop, &log));
            for &pct in self.limits.iter().cycle().take(self.limits.len() * 3) {
                std::thread::sleep(Duration::from_millis(3));
                assert!(region.set_local_max(LocalLimit::Percent(f64::from(pct))));
                if self.syncs {
                    sync_keeps(&region, &*store, &log);
                }
            }
            stop.store(true, Ordering::Relaxed);
            writer.join().unwrap();
        });
        for (off, v) in log.into_inner().unwrap() {
            model[off..off + 8].copy_from_slice(&v.to_ne_bytes());
        }
        let stats = region.stats();
        let paging = stats.paging.clone().unwrap();
        assert!(
            paging.deactivations > 0,
            "the limit never made the region evict anything: {paging:?}"
        );
        region.sync().unwrap();
        check_store(&region, &snapshot(&*store), &model);
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
        drop(region);
        paging
    }

    /// The writer: random words (half of them in a hot eighth of the region), or a sweep,
    /// each read back at once and logged, until `stop` and at least `min_writes`.
    fn write(&self, region: &Region, stop: &AtomicBool, log: &Log) {
        let mem = region.memory();
        let mut rng = SmallRng::seed_from_u64(self.seed ^ 0x5eed);
        let words = region.len() / 8;
        let per_chunk = self.chunk as usize / 8;
        let mut k = 0;
        while !stop.load(Ordering::Relaxed) || k < self.min_writes {
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
            mem.store_u64(w * 8, v).unwrap();
            // Read back at once: a lost staged copy would show here too.
            assert_eq!(mem.load_u64(w * 8).unwrap(), v, "word {w} read back");
            log.lock().unwrap().push((w * 8, v));
            k += 1;
        }
    }
}

/// Syncs `region` while its writer runs; then `store` holds, for every word written before
/// the sync began, that write or a later one (the writer's values increase).
fn sync_keeps(region: &Region, store: &dyn farmap_core::Store, log: &Log) {
    let before = log.lock().unwrap().len();
    region.sync().unwrap();
    let snap = snapshot(store);
    let mut last = std::collections::HashMap::new();
    for &(off, v) in &log.lock().unwrap()[..before] {
        last.insert(off, v);
    }
    for (off, v) in last {
        let got = u64::from_ne_bytes(snap[off..off + 8].try_into().unwrap());
        assert!(
            got & WRITTEN != 0 && got >= v,
            "after a sync the store holds {got:#x} at {off:#x}, older than {v:#x} written \
             before the sync began; chunk trace: {:#?}",
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
