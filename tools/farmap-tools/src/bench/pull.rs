//! `farmap bench pull`: background-pull throughput.
//!
//! Setup (not timed): the source store is filled with random data; a dense, pre-allocated
//! local store is built. Timed: from the puller's first request to the last chunk stored in
//! local memory. Reference, measured in the same run: memcpy of the same chunk size between
//! two pre-touched buffers, and the ideal `min(workers × chunk / rtt, memcpy)`.
//!
//! `--mirror-delay D` (see [`MirrorArgs`]): every run also pulls into a [`Mirrored`] local
//! store (`--mirror-policy`, default `both`): the dense store as primary and, as mirror, a
//! memory store (or `--mirror-store`) behind a [`Delayed`] of latency `D`, so every pulled
//! chunk is written to both. Each run prints the unmirrored line (`"mirror":"none"`), then
//! the mirrored one with `mirror_cost` = 1 − mirrored ÷ unmirrored, and a last
//! `"case":"summary"` line gives the cost of the medians. Use `--rtt 0ms` so that the writes,
//! not the round trips, bound the pull. `farmap bench push` measures the same for writes.
//!
//! [`Mirrored`]: farmap::pipeline::Mirrored

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::Args;
use farmap::pipeline::{Cached, MirrorPolicy, PullOptions, PullOrder, Puller};
use farmap::store::DenseMemoryStore;
use farmap::{open_store_async, Store, StoreSpec};
use rand::{RngCore, SeedableRng};
use serde::Serialize;

use super::common::{delayed, memcpy_reference, parse_duration, parse_size_arg, set_chunk};
use super::mirror::{self, MirrorArgs, MirrorTally, RunHead};
use crate::output;

#[derive(Debug, Args)]
pub struct PullArgs {
    /// The store pulled from; it is filled with random data first.
    #[arg(long, default_value = "memory:1GiB")]
    store: StoreSpec,
    /// Chunk size (overrides the spec's chunk=).
    #[arg(long, value_parser = parse_size_arg)]
    chunk: Option<u64>,
    /// Latency added to every read of the store (an emulated round trip), e.g. 10ms.
    #[arg(long, default_value = "10ms", value_parser = parse_duration)]
    rtt: Duration,
    /// Concurrent pull workers (async tasks, not threads).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    workers: u32,
    /// Repeat the timed pull this many times (one result line each).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    runs: u32,
    #[command(flatten)]
    mirror: MirrorArgs,
    /// Allow filling an existing file or directory store with random data.
    #[arg(long)]
    overwrite: bool,
    /// One JSON object per run on stdout, no progress bar.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct PullResult {
    #[serde(flatten)]
    head: RunHead,
    memcpy_mb_per_s: f64,
    /// Minor page faults of the process during the timed phase.
    page_faults: u64,
    ideal_mb_per_s: f64,
    ratio_to_ideal: f64,
    /// 1 − this ÷ the unmirrored case of the same run (mirrored lines only).
    #[serde(skip_serializing_if = "Option::is_none")]
    mirror_cost: Option<f64>,
    chunks: u64,
    failed_chunks: u64,
    verified: bool,
}

async fn fill_random(store: &dyn Store, quiet: bool) -> anyhow::Result<()> {
    let g = store.geometry();
    let bar = output::byte_bar(g.size(), "filling", quiet);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(0xfa2_3a9);
    for idx in g.all().iter() {
        let mut buf = vec![0u8; g.chunk_len(idx)];
        rng.fill_bytes(&mut buf);
        store
            .write(idx, Bytes::from(buf))
            .await
            .with_context(|| format!("filling {idx} of the source store"))?;
        bar.inc(g.chunk_len(idx) as u64);
    }
    store
        .flush()
        .await
        .context("flushing the filled source store")?;
    bar.finish_and_clear();
    Ok(())
}

pub async fn run(mut args: PullArgs) -> anyhow::Result<ExitCode> {
    set_chunk(&mut args.store, args.chunk)?;
    if !args.store.creates() && !args.overwrite {
        bail!(
            "{} exists; the benchmark would overwrite it with random data (pass --overwrite to allow)",
            args.store
        );
    }
    let source = open_store_async(&args.store)
        .await
        .context("opening the benchmark store")?;
    let g = source.geometry();
    fill_random(source.as_ref(), args.json).await?;
    let memcpy = memcpy_reference(g).await?;
    let rtt_s = args.rtt.as_secs_f64();
    let ideal = if rtt_s > 0.0 {
        (f64::from(args.workers) * f64::from(g.chunk_size()) / rtt_s / 1e6).min(memcpy)
    } else {
        memcpy
    };
    let bench = PullBench {
        args: &args,
        head: RunHead::new("pull", &args.store, g, args.rtt, args.workers, &args.mirror),
        source,
        memcpy,
        ideal,
    };
    let mut tally = MirrorTally::default();
    for run in 1..=args.runs {
        // The local stores of a finished case stay alive until the run ends, so that the
        // next case does not reuse the memory they would free.
        let mut keep = Vec::new();
        for case in args.mirror.cases() {
            keep.push(bench.case(run, case, &mut tally).await?);
        }
        drop(keep);
    }
    tally.finish("pull", &args.mirror, args.runs, args.json)?;
    Ok(ExitCode::SUCCESS)
}

/// One benchmark's source and references.
struct PullBench<'a> {
    args: &'a PullArgs,
    /// What every result line repeats.
    head: RunHead,
    source: Arc<dyn Store>,
    memcpy: f64,
    ideal: f64,
}

impl PullBench<'_> {
    /// Pulls the whole source once into fresh local memory (through a mirror in a mirrored
    /// `case`), verifies it and prints the result line; returns the local store.
    async fn case(
        &self,
        run: u32,
        case: Option<MirrorPolicy>,
        tally: &mut MirrorTally,
    ) -> anyhow::Result<Arc<dyn Store>> {
        let (args, source) = (self.args, &self.source);
        let g = source.geometry();
        let chunk = g.chunk_size();
        // Setup, untimed: dense local memory, every page touched.
        let dense: Arc<dyn Store> = Arc::new(DenseMemoryStore::new(g));
        let (local, mirrored) = args.mirror.case_store(case, dense, Duration::ZERO).await?;
        let cached = Arc::new(Cached::new(
            local.clone(),
            delayed(source.clone(), args.rtt),
        )?);
        let bar = output::byte_bar(g.size(), "pulling", args.json);
        let opts = PullOptions {
            workers: args.workers as usize,
            order: PullOrder::Sequential,
            ..PullOptions::default()
        };

        let faults = mirror::minor_faults();
        let started = Instant::now();
        let puller = Puller::start(cached.clone(), opts);
        if bar.is_hidden() {
            puller.wait().await;
        } else {
            let wait = puller.wait();
            tokio::pin!(wait);
            loop {
                tokio::select! {
                    _ = &mut wait => break,
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {
                        bar.set_position(puller.progress().done_chunks * u64::from(chunk));
                    }
                }
            }
        }
        let elapsed = started.elapsed();
        let faults = mirror::minor_faults().saturating_sub(faults);
        bar.finish_and_clear();

        // Verify, untimed: every chunk of local memory (and of the mirror) equals the
        // source.
        let mut verified = cached.is_complete();
        for idx in g.all().iter() {
            if !verified {
                break;
            }
            let want = source.read(idx).await?;
            verified = want == cached.read(idx).await?;
            if let Some(m) = &mirrored {
                verified = verified && want == m.mirror().read(idx).await?;
            }
        }
        let name = if case.is_some() {
            "cached-puller-mirrored"
        } else {
            "cached-puller"
        };
        let head = self.head.measured(name, case, run, elapsed);
        let mb = head.mb_per_s;
        let result = PullResult {
            head,
            memcpy_mb_per_s: output::round1(self.memcpy),
            page_faults: faults,
            ideal_mb_per_s: output::round1(self.ideal),
            ratio_to_ideal: (mb / self.ideal * 1000.0).round() / 1000.0,
            mirror_cost: tally.record(case, mb),
            chunks: g.chunk_count(),
            failed_chunks: puller.progress().failed_chunks,
            verified,
        };
        self.print(&result)?;
        if !verified {
            bail!("the pulled data differs from the source (or chunks failed to pull)");
        }
        Ok(local)
    }

    /// Prints one result line (JSON with --json).
    fn print(&self, result: &PullResult) -> anyhow::Result<()> {
        if self.args.json {
            return output::json_line(result);
        }
        println!(
            "{} = {:.2} × ideal {:.1} MB/s (memcpy {:.1} MB/s){}{}",
            result.head.summary("workers"),
            result.ratio_to_ideal,
            result.ideal_mb_per_s,
            result.memcpy_mb_per_s,
            mirror::cost_suffix(result.mirror_cost),
            if result.verified {
                ", verified"
            } else {
                ", VERIFICATION FAILED"
            }
        );
        Ok(())
    }
}
