//! `farmap bench push`: managed write throughput, the write-back of a managed region.
//!
//! A first run of the unmirrored case, not reported, warms the heap (see the code).
//! Setup (not timed): a dense, pre-allocated local store behind a [`Pusher`] is written whole
//! with random data (every chunk dirty); the store pushed to (`--store`) is opened anew.
//! Timed: the pusher's flush, from its first push to the last chunk acknowledged by the store
//! (and the store's flush); `cpu_ms` is the CPU time the whole process spent meanwhile. Verified afterwards (not timed): the store, and the mirror when
//! there is one, hold every chunk.
//!
//! `--mirror-delay D` (see [`MirrorArgs`]): every run also pushes through a [`Mirrored`]
//! stage (`--mirror-policy`, default `both`) whose primary is the store and whose mirror is
//! `D` slower; each run prints the unmirrored line (`"mirror":"none"`), then the mirrored one
//! with `mirror_cost` = 1 − mirrored ÷ unmirrored, and a last `"case":"summary"` line gives
//! the cost of the medians.
//!
//! **The reference setup of the mirror-cost bar** is this command's default with
//! `--mirror-delay 20us`: 1 GiB in 64 KiB chunks, a memory store as primary and a memory
//! store as mirror (both keep the pushed buffers, so neither copies), no round trip (so that
//! the writes, not the round trips, bound the push), 64 pushes in flight, 3 runs. With
//! `--store farmap://...` and `--mirror-store farmap://...` (two `farmap serve` processes)
//! it measures real servers instead.
//!
//! [`Mirrored`]: farmap::pipeline::Mirrored

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::Args;
use farmap::pipeline::{MirrorPolicy, PushOptions, Pusher};
use farmap::store::DenseMemoryStore;
use farmap::{open_store_async, ChunkIdx, Store, StoreSpec};
use farmap_migrate::budget::process_cpu;
use futures::StreamExt;
use rand::{RngCore, SeedableRng};
use serde::Serialize;

use super::common::{delayed, memcpy_reference, parse_duration, parse_size_arg, set_chunk};
use super::mirror::{self, MirrorArgs, MirrorTally, RunHead};
use crate::output;

#[derive(Debug, Args)]
pub struct PushArgs {
    /// The store pushed to; its content is overwritten.
    #[arg(long, default_value = "memory:1GiB")]
    store: StoreSpec,
    /// Chunk size (overrides the spec's chunk=).
    #[arg(long, value_parser = parse_size_arg)]
    chunk: Option<u64>,
    /// Latency added to every operation of the store (an emulated round trip), e.g. 1ms.
    #[arg(long, default_value = "0ms", value_parser = parse_duration)]
    rtt: Duration,
    /// Pushes in flight at once.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    workers: u32,
    /// Repeat the timed push this many times (one result line per case each).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    runs: u32,
    #[command(flatten)]
    mirror: MirrorArgs,
    /// Allow overwriting an existing file or directory store.
    #[arg(long)]
    overwrite: bool,
    /// One JSON object per line on stdout, no progress bar.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct PushResult {
    #[serde(flatten)]
    head: RunHead,
    /// 1 − this ÷ the unmirrored case of the same run (mirrored lines only).
    #[serde(skip_serializing_if = "Option::is_none")]
    mirror_cost: Option<f64>,
    memcpy_mb_per_s: f64,
    /// Minor page faults of the process during the timed phase.
    page_faults: u64,
    /// CPU time of the whole process (every thread: pushes, stages, the timer) during the
    /// timed phase: what the case costs the host, steadier than its rate on a busy one.
    cpu_ms: f64,
    chunks: u64,
    verified: bool,
}

pub async fn run(mut args: PushArgs) -> anyhow::Result<ExitCode> {
    set_chunk(&mut args.store, args.chunk)?;
    if !args.store.creates() && !args.overwrite {
        bail!(
            "{} exists; the benchmark would overwrite it (pass --overwrite to allow)",
            args.store
        );
    }
    let g = open_store_async(&args.store)
        .await
        .context("opening the benchmark store")?
        .geometry();
    // The data, made once: the same for every case.
    let mut rng = rand::rngs::SmallRng::seed_from_u64(0x9b5_4f1);
    let data: Arc<Vec<Bytes>> = Arc::new(
        g.all()
            .iter()
            .map(|idx| {
                let mut buf = vec![0u8; g.chunk_len(idx)];
                rng.fill_bytes(&mut buf);
                Bytes::from(buf)
            })
            .collect(),
    );
    let memcpy = memcpy_reference(g).await?;
    let bench = PushBench { args: &args, data };

    // Each case allocates a dense store and (the pusher's reads, kept by the stores) the
    // region's size again. With the heap settings made at start (no trimming), the memory
    // faulted in by a first, unreported run of the unmirrored case is reused by every case,
    // instead of being faulted in anew by some cases and not others.
    let head = RunHead::new("push", &args.store, g, args.rtt, args.workers, &args.mirror);
    let mut tally = MirrorTally::default();
    for run in 0..=args.runs {
        let cases = if run == 0 {
            vec![None]
        } else {
            args.mirror.cases()
        };
        for case in cases {
            let measured = bench.case(case).await?;
            if run == 0 {
                if !measured.verified {
                    bail!(
                        "the pushed data differs from what was written (or chunks failed to push)"
                    );
                }
                continue;
            }
            let head = head.measured("pusher", case, run, measured.elapsed);
            let result = PushResult {
                mirror_cost: tally.record(case, head.mb_per_s),
                head,
                memcpy_mb_per_s: output::round1(memcpy),
                page_faults: measured.faults,
                cpu_ms: output::round1(measured.cpu.as_secs_f64() * 1e3),
                chunks: g.chunk_count(),
                verified: measured.verified,
            };
            print(&args, &result)?;
            if !result.verified {
                bail!("the pushed data differs from what was written (or chunks failed to push)");
            }
        }
    }
    tally.finish("push", &args.mirror, args.runs, args.json)?;
    Ok(ExitCode::SUCCESS)
}

/// One benchmark's arguments and data.
struct PushBench<'a> {
    args: &'a PushArgs,
    data: Arc<Vec<Bytes>>,
}

/// What one case measured.
struct Measured {
    elapsed: Duration,
    cpu: Duration,
    faults: u64,
    verified: bool,
}

impl PushBench<'_> {
    /// Writes the data whole into fresh local memory, times the push to a freshly opened
    /// store (through a mirror in a mirrored `case`) and verifies what arrived.
    async fn case(&self, case: Option<MirrorPolicy>) -> anyhow::Result<Measured> {
        let (args, data) = (self.args, &self.data);
        // Setup, untimed: a fresh store, a dense local store written whole.
        let store = open_store_async(&args.store)
            .await
            .context("opening the benchmark store")?;
        let g = store.geometry();
        let primary: Arc<dyn Store> = Arc::new(delayed(store.clone(), args.rtt));
        let (remote, mirrored) = args.mirror.case_store(case, primary, args.rtt).await?;
        let local: Arc<dyn Store> = Arc::new(DenseMemoryStore::new(g));
        let pusher = Pusher::new(
            local,
            remote.clone(),
            PushOptions {
                workers: args.workers as usize,
                interval: None,
                ..PushOptions::default()
            },
        )?;
        for idx in g.all().iter() {
            pusher
                .write(idx, data[idx.as_usize()].clone())
                .await
                .with_context(|| format!("writing {idx} locally"))?;
        }

        let faults = mirror::minor_faults();
        let cpu = process_cpu();
        let started = Instant::now();
        pusher.flush().await.context("pushing")?;
        let elapsed = started.elapsed();
        let cpu = process_cpu().saturating_sub(cpu);
        let faults = mirror::minor_faults().saturating_sub(faults);

        // Verify, untimed: the store and the mirror hold every chunk.
        let mut verified =
            pusher.stats().pushed_chunks == g.chunk_count() && holds(store.as_ref(), data).await?;
        if let Some(m) = &mirrored {
            verified = verified && holds(m.mirror().as_ref(), data).await?;
        }
        Ok(Measured {
            elapsed,
            cpu,
            faults,
            verified,
        })
    }
}

/// Prints one result line (JSON with --json).
fn print(args: &PushArgs, result: &PushResult) -> anyhow::Result<()> {
    if args.json {
        return output::json_line(result);
    }
    println!(
        "{}{} (CPU {:.1} ms; memcpy {:.1} MB/s){}",
        result.head.summary("in flight"),
        mirror::cost_suffix(result.mirror_cost),
        result.cpu_ms,
        result.memcpy_mb_per_s,
        if result.verified {
            ", verified"
        } else {
            ", VERIFICATION FAILED"
        }
    );
    Ok(())
}

/// Whether `store` holds `data` (chunk `i` is `data[i]`); reads 64 chunks at a time.
async fn holds(store: &dyn Store, data: &[Bytes]) -> anyhow::Result<bool> {
    let mut reads = futures::stream::iter(0..data.len())
        .map(|i| async move {
            let idx = ChunkIdx(i as u64);
            let got = store
                .read(idx)
                .await
                .with_context(|| format!("reading {idx} back"))?;
            anyhow::Ok(got == data[i])
        })
        .buffer_unordered(64);
    while let Some(same) = reads.next().await {
        if !same? {
            return Ok(false);
        }
    }
    Ok(true)
}
