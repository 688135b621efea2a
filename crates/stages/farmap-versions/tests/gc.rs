//! Garbage collection of the versioned layout: what no version lists goes in two runs, and
//! nothing a version lists (or a writer is about to list) is ever lost, with writers, forks,
//! snapshots and collectors running at once.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use farmap_core::{ChunkIdx, ChunkRange, Geometry, Objects, Store};
use farmap_store::MemoryObjects;
use farmap_versions::gc::{self, GcOptions, GcReport};
use farmap_versions::{fork, At, Versioned, VersionedOptions};
use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const CHUNK: u32 = 4096;
const CHUNKS: u64 = 16;

fn chunk(seed: u8) -> Bytes {
    Bytes::from(vec![seed; CHUNK as usize])
}

fn opts(region: &str, at: At, read_only: bool) -> VersionedOptions {
    VersionedOptions {
        region: region.into(),
        at,
        read_only,
        create: Some(Geometry::new(CHUNKS * u64::from(CHUNK), u64::from(CHUNK)).unwrap()),
        grace: None,
        read_ahead: true,
    }
}

async fn open(o: &Arc<dyn Objects>, region: &str) -> Versioned {
    Versioned::open(o.clone(), opts(region, At::Latest, false))
        .await
        .unwrap()
}

/// Objects whose grace is `grace`.
async fn objects(grace: Duration) -> Arc<dyn Objects> {
    let o: Arc<dyn Objects> = Arc::new(MemoryObjects::new());
    assert_eq!(gc::grace(&*o, Some(grace)).await.unwrap(), grace);
    o
}

async fn collect(o: &Arc<dyn Objects>) -> GcReport {
    gc::gc(&**o, &GcOptions::default()).await.unwrap()
}

/// Every key directly two levels under `top` (`chunks/HH/HASH`, `trash/HH/HASH.STAMP`).
async fn keys(o: &Arc<dyn Objects>, top: &str) -> Vec<String> {
    let mut out = Vec::new();
    for d in o.list(top).await.unwrap() {
        for n in o.list(&format!("{top}/{d}")).await.unwrap() {
            out.push(n);
        }
    }
    out
}

#[tokio::test]
async fn garbage_goes_in_two_runs_and_a_dry_run_changes_nothing() {
    let grace = Duration::from_millis(100);
    let o = objects(grace).await;
    let v = open(&o, "r").await;
    v.write(ChunkIdx(0), chunk(1)).await.unwrap();
    v.flush().await.unwrap();
    v.write(ChunkIdx(0), chunk(2)).await.unwrap();
    v.flush().await.unwrap();
    // A writer that stops before its flush leaves garbage.
    let crashed = open(&o, "r").await;
    crashed.write(ChunkIdx(3), chunk(3)).await.unwrap();
    drop(crashed);
    drop(v);
    assert_eq!(keys(&o, "chunks").await.len(), 3);

    let dry = gc::gc(
        &*o,
        &GcOptions {
            dry_run: true,
            ..GcOptions::default()
        },
    )
    .await
    .unwrap();
    assert_eq!((dry.chunks, dry.referenced, dry.trashed), (3, 2, 1));
    let fresh = MemoryObjects::new();
    let dry_fresh = GcOptions {
        dry_run: true,
        ..GcOptions::default()
    };
    gc::gc(&fresh, &dry_fresh).await.unwrap();
    assert!(
        fresh.get("gc/grace").await.unwrap().is_none(),
        "a dry run keeps no grace"
    );
    assert_eq!(keys(&o, "chunks").await.len(), 3, "a dry run moves nothing");
    assert!(keys(&o, "trash").await.is_empty());

    let first = collect(&o).await;
    assert_eq!((first.trashed, first.deleted, first.versions), (1, 0, 3));
    assert_eq!(keys(&o, "chunks").await.len(), 2);
    let again = collect(&o).await;
    assert_eq!((again.trashed, again.waiting, again.deleted), (0, 1, 0));
    tokio::time::sleep(grace).await;
    let last = collect(&o).await;
    assert_eq!((last.deleted, last.restored, last.waiting), (1, 0, 0));
    assert!(last.deleted_bytes > 0);
    assert!(keys(&o, "trash").await.is_empty());
    // Both versions still read.
    for (seq, want) in [(1, chunk(1)), (2, chunk(2))] {
        let old = Versioned::open(o.clone(), opts("r", At::Seq(seq), true))
            .await
            .unwrap();
        assert_eq!(old.read(ChunkIdx(0)).await.unwrap(), want);
    }
}

#[tokio::test]
async fn a_chunk_moved_before_its_version_is_written_reads_from_the_trash_and_comes_back() {
    let grace = Duration::from_millis(200);
    let o = objects(grace).await;
    let v = open(&o, "r").await;
    v.write(ChunkIdx(0), chunk(1)).await.unwrap();
    assert_eq!(collect(&o).await.trashed, 1, "no version lists it yet");
    assert_eq!(v.read(ChunkIdx(0)).await.unwrap(), chunk(1));
    v.flush().await.unwrap();
    let reader = Versioned::open(o.clone(), opts("r", At::Latest, true))
        .await
        .unwrap();
    assert_eq!(reader.read(ChunkIdx(0)).await.unwrap(), chunk(1));
    tokio::time::sleep(grace).await;
    let r = collect(&o).await;
    assert_eq!((r.restored, r.deleted, r.trashed), (1, 0, 0));
    assert_eq!(keys(&o, "chunks").await.len(), 1);
    assert!(keys(&o, "trash").await.is_empty());
}

#[tokio::test]
async fn an_idle_writer_keeps_its_unsaved_chunks_across_collections() {
    let grace = Duration::from_millis(100);
    let o = objects(grace).await;
    let v = open(&o, "r").await;
    v.write(ChunkIdx(2), chunk(7)).await.unwrap();
    // Each run moves the unsaved chunk again; the writer puts it back between runs.
    for _ in 0..4 {
        collect(&o).await;
        tokio::time::sleep(grace * 2).await;
    }
    v.flush().await.unwrap();
    drop(v);
    tokio::time::sleep(grace).await;
    collect(&o).await;
    tokio::time::sleep(grace).await;
    collect(&o).await;
    let reader = open(&o, "r").await;
    assert_eq!(reader.read(ChunkIdx(2)).await.unwrap(), chunk(7));
    assert_eq!(keys(&o, "chunks").await.len(), 1);
}

#[tokio::test]
async fn the_grace_is_set_once() {
    let o: Arc<dyn Objects> = Arc::new(MemoryObjects::new());
    let v = Versioned::open(
        o.clone(),
        VersionedOptions {
            grace: Some(Duration::from_millis(300)),
            ..opts("r", At::Latest, false)
        },
    )
    .await
    .unwrap();
    drop(v);
    assert_eq!(collect(&o).await.grace_ms, 300);
    let e = gc::gc(
        &*o,
        &GcOptions {
            grace: Some(Duration::from_secs(1)),
            dry_run: false,
        },
    )
    .await
    .unwrap_err();
    assert!(e.to_string().contains("cannot change"), "{e}");
    assert!(gc::grace(&*o, Some(Duration::from_millis(1)))
        .await
        .is_err());
}

/// What a version should hold: the seed of each chunk (0: zeros).
type Model = Vec<u8>;

#[derive(Default)]
struct Record {
    versions: Vec<(String, u64, Model)>,
    forks: Vec<(String, String, u64)>,
}

async fn writer(
    o: Arc<dyn Objects>,
    n: u64,
    grace: Duration,
    rec: Arc<Mutex<Record>>,
    stop: Arc<AtomicBool>,
) {
    let region = format!("w{n}");
    let v = open(&o, &region).await;
    let mut model: Model = vec![0; CHUNKS as usize];
    rec.lock().versions.push((region.clone(), 0, model.clone()));
    let mut rng = SmallRng::seed_from_u64(n);
    let mut names = 0;
    while !stop.load(Ordering::Relaxed) {
        match rng.gen_range(0..20) {
            0..=11 => {
                let idx = rng.gen_range(0..CHUNKS);
                // Few distinct contents: regions share chunks, and often write one the
                // collector is moving.
                let seed = rng.gen_range(0..60u8);
                if seed == 0 {
                    v.trim(ChunkRange::new(ChunkIdx(idx), ChunkIdx(idx + 1)))
                        .await
                        .unwrap();
                } else {
                    v.write(ChunkIdx(idx), chunk(seed)).await.unwrap();
                }
                model[idx as usize] = seed;
            }
            12..=15 => {
                v.flush().await.unwrap();
                rec.lock()
                    .versions
                    .push((region.clone(), v.version(), model.clone()));
            }
            16 => {
                names += 1;
                let seq = v.snapshot(&format!("s{names}")).await.unwrap();
                rec.lock()
                    .versions
                    .push((region.clone(), seq, model.clone()));
            }
            _ => tokio::time::sleep(rng.gen_range(Duration::ZERO..grace * 3)).await,
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    v.flush().await.unwrap();
    rec.lock().versions.push((region, v.version(), model));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn collecting_while_writers_forks_and_snapshots_run_loses_nothing() {
    // Long enough that a loaded CI host does not delay a writer's refresher past it.
    let grace = Duration::from_millis(300);
    let o = objects(grace).await;
    let rec = Arc::new(Mutex::new(Record::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for n in 0..3 {
        tasks.push(tokio::spawn(writer(
            o.clone(),
            n,
            grace,
            rec.clone(),
            stop.clone(),
        )));
    }
    // Writers that stop before their flush: garbage, some of it equal to what others write.
    let (o2, stop2) = (o.clone(), stop.clone());
    tasks.push(tokio::spawn(async move {
        let mut rng = SmallRng::seed_from_u64(99);
        while !stop2.load(Ordering::Relaxed) {
            let v = open(&o2, "crashed").await;
            for _ in 0..4 {
                let seed = rng.gen_range(1..60u8);
                v.write(ChunkIdx(rng.gen_range(0..CHUNKS)), chunk(seed))
                    .await
                    .unwrap();
            }
            drop(v);
            tokio::time::sleep(Duration::from_millis(15)).await;
        }
    }));
    let (o3, stop3, rec3) = (o.clone(), stop.clone(), rec.clone());
    tasks.push(tokio::spawn(async move {
        let mut rng = SmallRng::seed_from_u64(7);
        let mut n = 0;
        while !stop3.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(40)).await;
            n += 1;
            let parent = format!("w{}", rng.gen_range(0..3));
            let name = format!("f{n}");
            if let Ok(seq) = fork(&*o3, &parent, &At::Latest, std::slice::from_ref(&name)).await {
                rec3.lock().forks.push((name, parent, seq));
            }
        }
    }));
    let (o4, stop4) = (o.clone(), stop.clone());
    let collector = tokio::spawn(async move {
        let mut total = GcReport::default();
        while !stop4.load(Ordering::Relaxed) {
            let r = collect(&o4).await;
            total.trashed += r.trashed;
            total.restored += r.restored;
            total.deleted += r.deleted;
            tokio::time::sleep(grace / 3).await;
        }
        total
    });
    tokio::time::sleep(Duration::from_secs(5)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let mut total = collector.await.unwrap();
    // With nothing running, two runs a grace apart leave exactly what versions list.
    for _ in 0..2 {
        tokio::time::sleep(grace).await;
        let r = collect(&o).await;
        total.trashed += r.trashed;
        total.restored += r.restored;
        total.deleted += r.deleted;
    }
    let rec = std::mem::take(&mut *rec.lock());
    assert!(total.trashed > 0 && total.deleted > 0, "{total:?}");
    assert!(rec.forks.len() > 10, "{} forks", rec.forks.len());

    let read = |region: String, seq: u64| {
        let o = o.clone();
        async move {
            let v = Versioned::open(o, opts(&region, At::Seq(seq), true))
                .await
                .unwrap();
            let mut got = Vec::new();
            for idx in 0..CHUNKS {
                let data = v.read(ChunkIdx(idx)).await.unwrap_or_else(|e| {
                    panic!("{region}@{seq} chunk {idx}: {e}");
                });
                assert!(
                    data.iter().all(|b| *b == data[0]),
                    "{region}@{seq} chunk {idx}"
                );
                got.push(data[0]);
            }
            got
        }
    };
    for (region, seq, model) in &rec.versions {
        assert_eq!(&read(region.clone(), *seq).await, model, "{region}@{seq}");
    }
    for (name, parent, seq) in &rec.forks {
        let want = rec
            .versions
            .iter()
            .find(|(r, s, _)| r == parent && s == seq)
            .map(|(_, _, m)| m.clone())
            .unwrap_or_else(|| panic!("{parent}@{seq} was not recorded"));
        assert_eq!(
            read(name.clone(), 0).await,
            want,
            "{name} from {parent}@{seq}"
        );
    }
    let stored: HashSet<String> = keys(&o, "chunks").await.into_iter().collect();
    let last = collect(&o).await;
    assert_eq!(
        stored.len() as u64,
        last.referenced,
        "only what versions list is left"
    );
    assert_eq!((last.trashed, last.waiting), (0, 0));
    assert!(keys(&o, "trash").await.is_empty());
}
