//! `farmap bench versions`: the versioned layout (`versioned:(dir:PATH)/REGION`) over a
//! directory of objects: what a snapshot costs, how soon a version opens, what forks cost.
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
//! - `restore`: open the snapshot read-only in a new opening: `time_to_first_access_ms`
//!   (open and the first chunk read), `time_to_warm_ms` (every chunk read, 16 at a time).
//! - `fork`: `--clones` forks of the snapshot, then each rewrites 1% of its chunks. `ms`
//!   (all forks), `ms_per_fork`, `clones`, `store_bytes` (the directory, all regions),
//!   `dedup_ratio` (the non-zero bytes all regions hold over `store_bytes`).

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use bytes::Bytes;
use clap::Args;
use farmap::store::DirObjects;
use farmap::versions::{fork, At, Objects, Versioned, VersionedOptions};
use farmap::{ChunkIdx, Geometry, Store};
use futures::StreamExt;
use serde::Serialize;

use super::common::parse_size_arg;
use crate::output;

/// Chunk writes and reads in flight.
const IN_FLIGHT: usize = 16;

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
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
    /// One JSON object per case on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Default, Serialize)]
struct Row {
    bench: &'static str,
    case: &'static str,
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
        _ => Bytes::from(farmap_testkit::pattern_bytes(
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
    }
}

pub async fn run(args: VersionsArgs) -> anyhow::Result<ExitCode> {
    let g = Geometry::new(args.size, args.chunk).context("--size and --chunk")?;
    let temp;
    let root = match &args.dir {
        Some(d) => d.clone(),
        None => {
            temp = tempfile::tempdir().context("a temporary directory")?;
            temp.path().join("objects")
        }
    };
    let objects: Arc<dyn Objects> = Arc::new(DirObjects::open(&root)?);
    let n = g.chunk_count();
    let nonzero = |gens: &dyn Fn(u64) -> u64| -> u64 {
        (0..n)
            .filter(|i| !(i % 4 == 0 && gens(*i) == 0))
            .map(|i| g.chunk_len(ChunkIdx(i)) as u64)
            .sum()
    };
    let emit = |row: Row| -> anyhow::Result<()> {
        if args.json {
            output::json_line(&row)
        } else {
            println!("{row:?}");
            Ok(())
        }
    };
    let base = Row {
        bench: "versions",
        region_bytes: g.size(),
        ..Row::default()
    };

    // create
    let v = Versioned::open(objects.clone(), open_opts("base", At::Latest, Some(g))).await?;
    let start = Instant::now();
    write_all(&v, (0..n).map(|i| (i, content(g, i, 0)))).await?;
    v.flush().await?;
    let took = start.elapsed();
    let written = du(&root);
    let data = nonzero(&|_| 0);
    emit(Row {
        case: "create",
        ms: ms(start),
        mb_per_s: Some(output::mb_per_s(g.size(), took)),
        bytes_written: Some(written),
        compression_ratio: Some(
            output::round1(data as f64 / du(&root.join("chunks")).max(1) as f64 * 100.0) / 100.0,
        ),
        verified: true,
        ..base_row(&base)
    })?;

    // snapshot: 1% of the chunks rewritten
    let dirty: Vec<u64> = (0..n).step_by(100).collect();
    let gen = |i: u64| u64::from(i.is_multiple_of(100));
    let before = du(&root);
    let chunks_before = du(&root.join("chunks"));
    let start = Instant::now();
    write_all(&v, dirty.iter().map(|&i| (i, content(g, i, 1)))).await?;
    let write_ms = ms(start);
    let start = Instant::now();
    v.snapshot("bench").await?;
    let snap_ms = ms(start);
    emit(Row {
        case: "snapshot",
        ms: snap_ms,
        write_ms: Some(write_ms),
        dirty_bytes: Some(dirty.iter().map(|&i| g.chunk_len(ChunkIdx(i)) as u64).sum()),
        dirty_stored_bytes: Some(du(&root.join("chunks")) - chunks_before),
        bytes_written: Some(du(&root) - before),
        verified: true,
        ..base_row(&base)
    })?;
    drop(v);

    // restore
    let start = Instant::now();
    let r = Versioned::open(
        objects.clone(),
        open_opts("base", At::Tag("bench".into()), None),
    )
    .await?;
    let first = r.read(ChunkIdx(0)).await?;
    let first_ms = ms(start);
    let ok = read_all(&r, |i| content(g, i, gen(i))).await? && first == content(g, 0, gen(0));
    emit(Row {
        case: "restore",
        ms: ms(start),
        time_to_first_access_ms: Some(first_ms),
        time_to_warm_ms: Some(ms(start)),
        verified: ok,
        ..base_row(&base)
    })?;
    drop(r);

    // fork
    let names: Vec<String> = (0..args.clones).map(|c| format!("fork-{c}")).collect();
    let start = Instant::now();
    fork(&*objects, "base", &At::Tag("bench".into()), &names).await?;
    let fork_ms = ms(start);
    let mut ok = true;
    for (c, name) in names.iter().enumerate() {
        let f = Versioned::open(objects.clone(), open_opts(name, At::Latest, None)).await?;
        let mine: Vec<u64> = (c as u64 + 1..n).step_by(100).collect();
        write_all(&f, mine.iter().map(|&i| (i, content(g, i, 2 + c as u64)))).await?;
        f.flush().await?;
        ok &= f.read(ChunkIdx(mine[0])).await? == content(g, mine[0], 2 + c as u64);
    }
    let store = du(&root);
    let logical = nonzero(&gen) * (1 + u64::from(args.clones));
    emit(Row {
        case: "fork",
        ms: fork_ms,
        clones: Some(args.clones),
        ms_per_fork: Some(output::round1(fork_ms / f64::from(args.clones) * 100.0) / 100.0),
        store_bytes: Some(store),
        dedup_ratio: Some(output::round1(logical as f64 / store.max(1) as f64 * 100.0) / 100.0),
        verified: ok,
        ..base_row(&base)
    })?;
    Ok(ExitCode::SUCCESS)
}

fn base_row(b: &Row) -> Row {
    Row {
        bench: b.bench,
        region_bytes: b.region_bytes,
        ..Row::default()
    }
}
