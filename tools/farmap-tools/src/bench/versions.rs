//! `farmap bench versions`: the versioned layout (`versioned:(dir:PATH)/REGION`) over a
//! directory of objects, or over another object store with `--objects SPEC` (`s3://`,
//! `redis://`, `cql://`): what a snapshot costs, how soon a version opens, what forks cost.
//! Every row names the object store's kind (`objects`: `dir`, `s3`, ...).
//!
//! The region's chunks are a fixed mix: a quarter zeros, a quarter text-like (compressible,
//! each unique), half incompressible and unique. Cases, one JSON line each with `--json`
//! (keys `bench` = `versions`, `case`, `region_bytes`, `ms`, `verified` in all):
//! - `create`: write the whole region and flush (version 1). `bytes_written` (what the object
//!   directory grew by), `compression_ratio` (non-zero bytes written over the bytes their
//!   chunks take), `mb_per_s`.
//! - `snapshot`: rewrite 1% of the chunks (new content), then `snapshot` (a flush and a
//!   name). `ms` is the snapshot call; `write_ms` the rewrites (their chunks are stored as
//!   they are written); `dirty_bytes` the chunks rewritten, `dirty_stored_bytes` what their
//!   chunks take, `bytes_written` what the directory grew by in all (chunks and manifest).
//! - `restore`: open the snapshot read-only in a new opening, five times, each reading one
//!   chunk (in five parts of the region): `time_to_first_access_ms` (open and that read) and
//!   `open_ms` (the open call), medians; then once more reading every chunk, 16 at a time:
//!   `time_to_warm_ms`.
//! - `warm`: a run on the latest version reads a quarter of the chunks (scattered) one at a
//!   time, as faults would, and saves that order; then a new opening reads them again in
//!   that order, once without reading ahead (`cold_warm_ms`) and once reading the recorded
//!   working set ahead (`time_to_warm_ms`, from the open call; `time_to_first_access_ms`).
//!   `warm_ratio` is the second over the first; `working_set_bytes`.
//! - `fork`: `--clones` forks of the snapshot, then each rewrites 1% of its chunks. `ms`
//!   (all forks), `ms_per_fork`, `clones`, `store_bytes` (the directory, all regions),
//!   `dedup_ratio` (the non-zero bytes all regions hold over `store_bytes`), `unique_bytes`
//!   (the directory before the forks plus the forks' rewritten chunks as stored: what a
//!   perfect dedup keeps) and `store_ratio` (`store_bytes` over it; the bar: ≤ 1.2).
//! - `gc`: a writer rewrites 1% of the base and stops without a flush (garbage), then
//!   `farmap gc` runs twice, the grace apart (1 s in the bench's own directory). `ms` is the
//!   first run (every manifest read, every chunk listed, the garbage moved to the trash),
//!   `second_ms` the run that deletes it; `dirty_bytes` the garbage as written,
//!   `bytes_freed` what the directory shrank by, `store_bytes` what it holds after.
//! - `clones`: `--clones` new forks of the snapshot, each mapped as a userfaultfd region in
//!   this process (direct mode: no background pull) and reading the working set of `warm`
//!   (a quarter of the chunks); once sharing clean pages (the default) and once with
//!   `share_clean_pages` off, in the same run. `host_memory_bytes`: the clones' own pages
//!   (their mappings' `Anonymous`) plus what the shared base's file holds; `one_clone_bytes`:
//!   the same for one clone without sharing; `memory_ratio` the first over the second (the
//!   bar: ≤ 1.3); `unshared_host_memory_bytes` all clones without sharing; `ms` and
//!   `time_to_warm_ms` the clones' opens and reads, one after the other, sharing;
//!   `unshared_ms` without.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use clap::Args;
use farmap::store::DirObjects;
use farmap::versions::{fork, gc, At, GcOptions, Objects, Versioned, VersionedOptions};
use farmap::{ChunkIdx, Geometry, Store};
use futures::StreamExt;
use serde::Serialize;

use super::common::parse_size_arg;
use super::mirror::median;
use crate::output;

/// Chunk writes and reads in flight.
const IN_FLIGHT: usize = 16;

/// New openings whose first access the `restore` case times.
const RESTORE_TRIES: u64 = 5;

#[derive(Debug, Args)]
pub struct VersionsArgs {
    /// Region size.
    #[arg(long, default_value = "1GiB", value_parser = parse_size_arg)]
    size: u64,
    /// Chunk size.
    #[arg(long, default_value = "64KiB", value_parser = parse_size_arg)]
    chunk: u64,
    /// Forks in the `fork` case.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1000))]
    clones: u32,
    /// Where the objects go (a new directory in the system's temporary directory if not
    /// given; removed at the end).
    #[arg(long, conflicts_with = "objects")]
    dir: Option<std::path::PathBuf>,
    /// Keep the objects in this object store instead of a directory: `s3://BUCKET/PREFIX?...`,
    /// `redis://...`, `cql://...` (a new, empty prefix: the bench sets its garbage
    /// collection grace, and leaves its objects there). Bytes are counted by listing and
    /// reading the objects.
    #[arg(long, value_name = "SPEC")]
    objects: Option<String>,
    /// One JSON object per case on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Default, Serialize)]
struct Row {
    bench: &'static str,
    case: &'static str,
    objects: String,
    region_bytes: u64,
    ms: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    write_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    mb_per_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    dirty_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    dirty_stored_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    bytes_written: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    compression_ratio: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    open_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    time_to_first_access_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    time_to_warm_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    clones: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ms_per_fork: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    store_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    dedup_ratio: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    unique_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    store_ratio: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cold_warm_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    warm_ratio: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    working_set_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    second_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    bytes_freed: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    host_memory_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    one_clone_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    memory_ratio: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    unshared_host_memory_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    unshared_ms: Option<f64>,
    verified: bool,
}

/// Chunk `idx` of generation `gen`: zeros, text-like or incompressible (see the module doc).
fn content(g: Geometry, idx: u64, gen: u64) -> Bytes {
    let len = g.chunk_len(ChunkIdx(idx));
    match idx % 4 {
        0 if gen == 0 => Bytes::from(vec![0u8; len]),
        1 => {
            let mut v = Vec::with_capacity(len + 64);
            let mut line = 0u64;
            while v.len() < len {
                v.extend_from_slice(format!("chunk {idx} gen {gen} line {line}\n").as_bytes());
                line += 1;
            }
            v.truncate(len);
            Bytes::from(v)
        }
        _ => Bytes::from(farmap::pattern::pattern_bytes(
            idx.wrapping_mul(0x9e37_79b9) ^ gen,
            0,
            len,
        )),
    }
}

fn ms(since: Instant) -> f64 {
    output::round1(since.elapsed().as_secs_f64() * 1e3)
}

/// Bytes of the files under `p`.
fn du(p: &Path) -> u64 {
    std::fs::read_dir(p).map_or(0, |d| {
        d.flatten()
            .map(|e| match e.file_type() {
                Ok(t) if t.is_dir() => du(&e.path()),
                _ => e.metadata().map_or(0, |m| m.len()),
            })
            .sum()
    })
}

async fn write_all(
    v: &Versioned,
    chunks: impl Iterator<Item = (u64, Bytes)>,
) -> anyhow::Result<()> {
    let mut writes = futures::stream::iter(chunks)
        .map(|(i, data)| async move { v.write(ChunkIdx(i), data).await })
        .buffer_unordered(IN_FLIGHT);
    while let Some(r) = writes.next().await {
        r?;
    }
    Ok(())
}

/// Reads every chunk of `v` and checks it against `expect`.
async fn read_all(v: &Versioned, expect: impl Fn(u64) -> Bytes + Sync) -> anyhow::Result<bool> {
    let n = v.geometry().chunk_count();
    let expect = &expect;
    let mut reads = futures::stream::iter(0..n)
        .map(|i| async move { (i, v.read(ChunkIdx(i)).await) })
        .buffer_unordered(IN_FLIGHT);
    let mut ok = true;
    while let Some((i, r)) = reads.next().await {
        ok &= r? == expect(i);
    }
    Ok(ok)
}

fn open_opts(region: &str, at: At, g: Option<Geometry>) -> VersionedOptions {
    VersionedOptions {
        region: region.into(),
        read_only: at != At::Latest,
        at,
        create: g,
        grace: None,
        // Only the warm case reads a working set ahead.
        read_ahead: false,
    }
}

/// What every case works on.
struct Bench {
    g: Geometry,
    /// The object directory (`None`: another object store).
    root: Option<std::path::PathBuf>,
    /// The objects' spec, as `versioned:(SPEC)/REGION` takes it.
    spec: String,
    objects: Arc<dyn Objects>,
    /// The size of each object counted so far (every object of the layout is immutable).
    sizes: std::sync::Mutex<std::collections::HashMap<String, u64>>,
    json: bool,
    /// The object directory's garbage-collection grace.
    grace: Duration,
}

/// Generation of chunk `i` after the snapshot case (every 100th rewritten once).
fn after_snapshot(i: u64) -> u64 {
    u64::from(i.is_multiple_of(100))
}

/// `x` to three decimals.
fn ratio(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// What [`Bench::stored`] counts.
#[derive(Clone, Copy, PartialEq)]
enum Stored {
    /// Chunks (and pages of chunk maps).
    Chunks,
    /// Everything.
    All,
}

impl Bench {
    /// Bytes the objects take: the directory's files, or the objects listed and read.
    async fn stored(&self, what: Stored) -> anyhow::Result<u64> {
        if let Some(root) = &self.root {
            return Ok(match what {
                Stored::Chunks => du(&root.join("chunks")),
                Stored::All => du(root),
            });
        }
        let o = &*self.objects;
        let mut keys = Vec::new();
        let tops: &[&str] = match what {
            Stored::Chunks => &["chunks"],
            Stored::All => &["chunks", "trash"],
        };
        for top in tops {
            for d in o.list(top).await? {
                for n in o.list(&format!("{top}/{d}")).await? {
                    keys.push(format!("{top}/{d}/{n}"));
                }
            }
        }
        if what == Stored::All {
            for r in o.list("regions").await? {
                for sub in ["versions", "tags", "touched"] {
                    let dir = format!("regions/{r}/{sub}");
                    keys.extend(
                        o.list(&dir)
                            .await?
                            .into_iter()
                            .map(|n| format!("{dir}/{n}")),
                    );
                }
            }
            keys.push("gc/grace".into());
        }
        let sizes = &self.sizes;
        let mut lens = futures::stream::iter(keys)
            .map(|k| async move {
                let known = sizes.lock().expect("sizes").get(&k).copied();
                if let Some(len) = known {
                    return anyhow::Ok(len);
                }
                let len = o.get(&k).await?.map_or(0, |b| b.len() as u64);
                sizes.lock().expect("sizes").insert(k, len);
                Ok(len)
            })
            .buffer_unordered(IN_FLIGHT);
        let mut total = 0;
        while let Some(len) = lens.next().await {
            total += len?;
        }
        Ok(total)
    }

    fn row(&self, case: &'static str) -> Row {
        Row {
            bench: "versions",
            case,
            objects: self.spec.split(':').next().unwrap_or_default().to_owned(),
            region_bytes: self.g.size(),
            ..Row::default()
        }
    }

    fn emit(&self, row: Row) -> anyhow::Result<()> {
        if self.json {
            output::json_line(&row)
        } else {
            println!("{row:?}");
            Ok(())
        }
    }

    /// Bytes of the chunks that hold data after generation `gens(i)` of each.
    fn nonzero(&self, gens: impl Fn(u64) -> u64) -> u64 {
        (0..self.g.chunk_count())
            .filter(|i| !(i % 4 == 0 && gens(*i) == 0))
            .map(|i| self.g.chunk_len(ChunkIdx(i)) as u64)
            .sum()
    }

    async fn create(&self) -> anyhow::Result<Versioned> {
        let (g, n) = (self.g, self.g.chunk_count());
        let v =
            Versioned::open(self.objects.clone(), open_opts("base", At::Latest, Some(g))).await?;
        let start = Instant::now();
        write_all(&v, (0..n).map(|i| (i, content(g, i, 0)))).await?;
        v.flush().await?;
        let took = start.elapsed();
        let chunks = self.stored(Stored::Chunks).await?.max(1);
        self.emit(Row {
            ms: ms(start),
            mb_per_s: Some(output::mb_per_s(g.size(), took)),
            bytes_written: Some(self.stored(Stored::All).await?),
            compression_ratio: Some(ratio(self.nonzero(|_| 0) as f64 / chunks as f64)),
            verified: true,
            ..self.row("create")
        })?;
        Ok(v)
    }

    async fn snapshot(&self, v: &Versioned) -> anyhow::Result<()> {
        let g = self.g;
        let dirty: Vec<u64> = (0..g.chunk_count()).step_by(100).collect();
        let before = self.stored(Stored::All).await?;
        let chunks_before = self.stored(Stored::Chunks).await?;
        let start = Instant::now();
        write_all(v, dirty.iter().map(|&i| (i, content(g, i, 1)))).await?;
        let write_ms = ms(start);
        let start = Instant::now();
        v.snapshot("bench").await?;
        self.emit(Row {
            ms: ms(start),
            write_ms: Some(write_ms),
            dirty_bytes: Some(dirty.iter().map(|&i| g.chunk_len(ChunkIdx(i)) as u64).sum()),
            dirty_stored_bytes: Some(self.stored(Stored::Chunks).await? - chunks_before),
            bytes_written: Some(self.stored(Stored::All).await? - before),
            verified: true,
            ..self.row("snapshot")
        })
    }

    async fn restore(&self) -> anyhow::Result<()> {
        let g = self.g;
        let at = At::Tag("bench".into());
        // Five new openings, each reading one chunk (each in another part of the region): the
        // median of their open and first access.
        let mut ok = true;
        let (mut opens, mut firsts) = (Vec::new(), Vec::new());
        for k in 0..RESTORE_TRIES {
            let idx = g.chunk_count() * k / RESTORE_TRIES;
            let start = Instant::now();
            let r =
                Versioned::open(self.objects.clone(), open_opts("base", at.clone(), None)).await?;
            opens.push(ms(start));
            let first = r.read(ChunkIdx(idx)).await?;
            firsts.push(ms(start));
            ok &= first == content(g, idx, after_snapshot(idx));
        }
        let start = Instant::now();
        let r = Versioned::open(self.objects.clone(), open_opts("base", at, None)).await?;
        ok &= read_all(&r, |i| content(g, i, after_snapshot(i))).await?;
        self.emit(Row {
            ms: ms(start),
            open_ms: Some(median(&opens)),
            time_to_first_access_ms: Some(median(&firsts)),
            time_to_warm_ms: Some(ms(start)),
            verified: ok,
            ..self.row("restore")
        })
    }

    async fn fork(&self, clones: u32) -> anyhow::Result<()> {
        let (g, n) = (self.g, self.g.chunk_count());
        let names: Vec<String> = (0..clones).map(|c| format!("fork-{c}")).collect();
        let before = self.stored(Stored::All).await?;
        let start = Instant::now();
        fork(&*self.objects, "base", &At::Tag("bench".into()), &names).await?;
        let fork_ms = ms(start);
        let mut ok = true;
        let mut rewritten = 0u64;
        for (c, name) in names.iter().enumerate() {
            let f =
                Versioned::open(self.objects.clone(), open_opts(name, At::Latest, None)).await?;
            let gen = 2 + c as u64;
            let mine: Vec<u64> = (c as u64 + 1..n).step_by(100).collect();
            rewritten += mine
                .iter()
                .map(|&i| content(g, i, gen))
                .filter(|d| !farmap::is_zero(d))
                .map(|d| farmap::versions::chunk::encode(&d).len() as u64)
                .sum::<u64>();
            write_all(&f, mine.iter().map(|&i| (i, content(g, i, gen)))).await?;
            f.flush().await?;
            if let Some(&i) = mine.first() {
                ok &= f.read(ChunkIdx(i)).await? == content(g, i, gen);
            }
        }
        let store = self.stored(Stored::All).await?.max(1);
        let logical = self.nonzero(after_snapshot) * (1 + u64::from(clones));
        self.emit(Row {
            ms: fork_ms,
            clones: Some(clones),
            ms_per_fork: Some(ratio(fork_ms / f64::from(clones))),
            store_bytes: Some(store),
            dedup_ratio: Some(ratio(logical as f64 / store as f64)),
            unique_bytes: Some(before + rewritten),
            store_ratio: Some(ratio(store as f64 / (before + rewritten).max(1) as f64)),
            verified: ok,
            ..self.row("fork")
        })
    }
}

/// What the clones of the `clones` case cost: opening and reading (ms), the host memory they
/// take, the memory of the first clone alone, whether they read what they should.
struct ClonesRun {
    ms: f64,
    host_bytes: u64,
    first_bytes: u64,
    ok: bool,
}

/// Opens `names` in the objects `spec` as regions, one after the other, each reading `ws`
/// (checked against `expect`); measures before closing them.
fn clones_run(
    spec: &str,
    names: &[String],
    ws: &[u64],
    g: Geometry,
    share: bool,
    expect: impl Fn(u64) -> Bytes,
) -> anyhow::Result<ClonesRun> {
    let start = Instant::now();
    let mut regions = Vec::new();
    let mut ok = true;
    let mut buf = vec![0u8; g.chunk_size() as usize];
    for name in names {
        let spec: farmap::StoreSpec = format!("versioned:({spec})/{name}")
            .parse()
            .context("the clone's spec")?;
        let opts = farmap::RegionOptions {
            share_clean_pages: share,
            ..farmap::RegionOptions::direct()
        };
        let r = farmap::open_region(&spec, opts).with_context(|| format!("opening {name}"))?;
        ok &= r.shared_base().is_some() == share;
        for &i in ws {
            let idx = ChunkIdx(i);
            let len = g.chunk_len(idx);
            r.memory()
                .read_into(g.offset_of(idx) as usize, &mut buf[..len])
                .context("reading a clone")?;
            ok &= buf[..len] == expect(i)[..];
        }
        regions.push(r);
    }
    let ms = ms(start);
    let mut own = Vec::new();
    for r in &regions {
        own.push(r.memory_use()?.private_bytes);
    }
    let file = regions
        .first()
        .and_then(|r| r.shared_base())
        .map(|p| std::fs::metadata(p).map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512))
        .transpose()?
        .unwrap_or(0);
    for r in regions {
        r.close()?;
    }
    Ok(ClonesRun {
        ms,
        host_bytes: own.iter().sum::<u64>() + file,
        first_bytes: own.first().copied().unwrap_or(0) + file,
        ok,
    })
}

impl Bench {
    /// `clones` forks mapped as regions reading the working set, sharing clean pages and not
    /// (see the module doc).
    async fn clones(&self, clones: u32) -> anyhow::Result<()> {
        let names: Vec<String> = (0..clones).map(|c| format!("clone-{c}")).collect();
        fork(&*self.objects, "base", &At::Tag("bench".into()), &names).await?;
        let (g, spec, ws) = (self.g, self.spec.clone(), self.working_set());
        let ws_bytes = ws.iter().map(|&i| g.chunk_len(ChunkIdx(i)) as u64).sum();
        let expect = move |i: u64| content(g, i, after_snapshot(i));
        let (shared, own) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
            Ok((
                clones_run(&spec, &names, &ws, g, true, expect)?,
                clones_run(&spec, &names, &ws, g, false, expect)?,
            ))
        })
        .await??;
        let one = own.first_bytes.max(1);
        self.emit(Row {
            ms: shared.ms,
            time_to_warm_ms: Some(shared.ms),
            unshared_ms: Some(own.ms),
            clones: Some(clones),
            host_memory_bytes: Some(shared.host_bytes),
            one_clone_bytes: Some(one),
            memory_ratio: Some(ratio(shared.host_bytes as f64 / one as f64)),
            unshared_host_memory_bytes: Some(own.host_bytes),
            working_set_bytes: Some(ws_bytes),
            verified: shared.ok && own.ok,
            ..self.row("clones")
        })
    }

    /// A quarter of the chunks that hold data, scattered (a stride through the region).
    fn working_set(&self) -> Vec<u64> {
        let n = self.g.chunk_count();
        let stride = (n / 3) | 1;
        let mut out = Vec::new();
        let mut seen = std::collections::HashSet::new();
        let mut i = 0;
        for _ in 0..n {
            i = (i + stride) % n;
            if i % 4 != 0 && seen.insert(i) {
                out.push(i);
                if out.len() as u64 >= n / 4 {
                    break;
                }
            }
        }
        out
    }

    async fn warm(&self) -> anyhow::Result<()> {
        let g = self.g;
        let ws = self.working_set();
        let expect = |i: u64| content(g, i, after_snapshot(i));
        // The run that records it.
        let run =
            Versioned::open(self.objects.clone(), open_opts("base", At::Latest, None)).await?;
        for &i in &ws {
            run.read(ChunkIdx(i)).await?;
        }
        run.flush().await?;
        drop(run);
        let latest = farmap::versions::resolve(&*self.objects, "base", &At::Latest).await?;
        let mut ok = true;
        let mut timed = Vec::new();
        for read_ahead in [false, true] {
            let start = Instant::now();
            let v = Versioned::open(
                self.objects.clone(),
                VersionedOptions {
                    read_ahead,
                    ..open_opts("base", At::Seq(latest), None)
                },
            )
            .await?;
            let mut first = None;
            for &i in &ws {
                ok &= v.read(ChunkIdx(i)).await? == expect(i);
                first.get_or_insert_with(|| ms(start));
            }
            timed.push((first.unwrap_or(0.0), ms(start), v.read_ahead_hits()));
        }
        let (cold, warm) = (timed[0], timed[1]);
        ok &= cold.2 == 0 && warm.2 > 0;
        self.emit(Row {
            ms: warm.1,
            time_to_first_access_ms: Some(warm.0),
            time_to_warm_ms: Some(warm.1),
            cold_warm_ms: Some(cold.1),
            warm_ratio: Some(ratio(warm.1 / cold.1.max(1e-3))),
            working_set_bytes: Some(ws.iter().map(|&i| g.chunk_len(ChunkIdx(i)) as u64).sum()),
            verified: ok,
            ..self.row("warm")
        })
    }

    async fn gc(&self) -> anyhow::Result<()> {
        let (g, n) = (self.g, self.g.chunk_count());
        let w = Versioned::open(self.objects.clone(), open_opts("base", At::Latest, None)).await?;
        let garbage: Vec<u64> = (50..n).step_by(100).collect();
        write_all(&w, garbage.iter().map(|&i| (i, content(g, i, 1000)))).await?;
        // Stopped before its flush: what it stored no version lists.
        drop(w);
        let stored: u64 = garbage.iter().filter(|i| *i % 4 != 0).count() as u64;
        let before = self.stored(Stored::All).await?;
        let start = Instant::now();
        let first = gc(&*self.objects, &GcOptions::default()).await?;
        let first_ms = ms(start);
        tokio::time::sleep(self.grace).await;
        let start = Instant::now();
        let second = gc(&*self.objects, &GcOptions::default()).await?;
        let second_ms = ms(start);
        let after = self.stored(Stored::All).await?;
        let r = Versioned::open(self.objects.clone(), open_opts("base", At::Latest, None)).await?;
        let mut ok = first.trashed == stored && second.deleted == stored;
        for &i in garbage.iter().take(64) {
            ok &= r.read(ChunkIdx(i)).await? == content(g, i, after_snapshot(i));
        }
        self.emit(Row {
            ms: first_ms,
            second_ms: Some(second_ms),
            dirty_bytes: Some(
                garbage
                    .iter()
                    .map(|&i| g.chunk_len(ChunkIdx(i)) as u64)
                    .sum(),
            ),
            bytes_freed: Some(before.saturating_sub(after)),
            store_bytes: Some(after),
            verified: ok,
            ..self.row("gc")
        })
    }
}

pub async fn run(args: VersionsArgs) -> anyhow::Result<ExitCode> {
    let g = Geometry::new(args.size, args.chunk).context("--size and --chunk")?;
    let temp;
    let (objects, root, spec): (Arc<dyn Objects>, _, _) = match &args.objects {
        Some(text) => {
            let spec: farmap::StoreSpec = text.parse().context("--objects")?;
            let objects = farmap::spec::open_objects(&spec)
                .await
                .with_context(|| format!("--objects {spec}"))?;
            (objects, None, text.clone())
        }
        None => {
            let root = match &args.dir {
                Some(d) => d.clone(),
                None => {
                    temp = tempfile::tempdir().context("a temporary directory")?;
                    temp.path().join("objects")
                }
            };
            let spec = format!("dir:{}", root.display());
            (Arc::new(DirObjects::open(&root)?), Some(root), spec)
        }
    };
    // A short grace, so that the gc case deletes within a second.
    let grace = Duration::from_secs(1);
    farmap::versions::gc::grace(&*objects, Some(grace))
        .await
        .with_context(|| {
            format!(
                "{}: give a new --dir or --objects prefix",
                objects.location()
            )
        })?;
    let bench = Bench {
        g,
        objects,
        root,
        spec,
        sizes: Default::default(),
        json: args.json,
        grace,
    };
    let v = bench.create().await?;
    bench.snapshot(&v).await?;
    drop(v);
    bench.restore().await?;
    bench.warm().await?;
    bench.fork(args.clones).await?;
    bench.gc().await?;
    match farmap::region::probe() {
        Ok(_) => bench.clones(args.clones).await?,
        Err(e) => eprintln!("skipped: the clones case maps regions: {e}"),
    }
    Ok(ExitCode::SUCCESS)
}
