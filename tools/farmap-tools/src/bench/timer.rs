//! `farmap bench timer`: how precisely latency is emulated (the pipeline's timer and the
//! `Delayed` stage). Tests only assert that nothing is ever early; how late, and how close to
//! its link a `Delayed` store runs, is measured here.
//!
//! Cases, one JSON line each with `--json`:
//! - `timer`: `tasks` concurrent tasks each sleep `sleeps` times for `--sleep` with
//!   `farmap_pipeline::timer::sleep`, starts staggered over one period. Lateness per sleep
//!   (mean, median, 99th percentile, max), sleeps completed per second of wall time, and how
//!   many ended early (must be 0).
//! - `tokio-sleep`: the same with `tokio::time::sleep` (1 ms wheel, rounds up): the reference.
//! - `delayed-concurrent`: `tasks` concurrent reads of a `Delayed` memory store whose latency
//!   is `--sleep`; the ideal is one latency for all of them (`ratio_to_ideal` ≥ 1).
//! - `delayed-bandwidth-write`, `delayed-bandwidth-read`: 8 tasks write, then read, `--bytes`
//!   through a `Delayed` store limited to `--bandwidth` bytes per second; the ideal is the
//!   bandwidth (`ratio_to_ideal`, the rate over the bandwidth, ≤ 1).

use std::future::Future;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::Args;
use farmap::pipeline::{timer, DelayOptions, Delayed};
use farmap::store::MemoryStore;
use farmap::{format_size, ChunkIdx, Geometry, Store};
use serde::Serialize;

use super::common::{parse_duration, parse_size_arg};
use crate::output;

const CHUNK: u64 = 64 << 10;

#[derive(Debug, Args)]
pub struct TimerArgs {
    /// Length of each sleep (and the latency of the `Delayed` cases).
    #[arg(long, default_value = "1ms", value_parser = parse_duration)]
    sleep: Duration,
    /// Concurrent tasks (and concurrent reads in `delayed-concurrent`).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    tasks: u32,
    /// Sleeps per task.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    sleeps: u32,
    /// Bandwidth of the `delayed-bandwidth` case, in bytes per second (e.g. 8MiB).
    #[arg(long, default_value = "8MiB", value_parser = parse_size_arg)]
    bandwidth: u64,
    /// Bytes written then read in the `delayed-bandwidth` case.
    #[arg(long, default_value = "4MiB", value_parser = parse_size_arg)]
    bytes: u64,
    /// One JSON object per case on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct SleepResult {
    bench: &'static str,
    case: &'static str,
    sleep_us: f64,
    tasks: u32,
    sleeps: u64,
    early: u64,
    mean_late_us: f64,
    p50_late_us: f64,
    p99_late_us: f64,
    max_late_us: f64,
    sleeps_per_s: f64,
    elapsed_ms: f64,
}

#[derive(Debug, Serialize)]
struct DelayedResult {
    bench: &'static str,
    case: &'static str,
    latency_us: f64,
    tasks: u32,
    bytes: u64,
    /// The ideal: one latency (concurrent) or bytes / bandwidth.
    ideal_ms: f64,
    elapsed_ms: f64,
    /// elapsed / ideal for `delayed-concurrent`, rate / bandwidth for `delayed-bandwidth`.
    ratio_to_ideal: f64,
    mb_per_s: f64,
    bandwidth_mb_per_s: Option<f64>,
    verified: bool,
}

fn us(d: Duration) -> f64 {
    output::round1(d.as_secs_f64() * 1e6)
}

fn ms(d: Duration) -> f64 {
    output::round1(d.as_secs_f64() * 1e3)
}

/// `tasks` tasks sleeping `sleeps` times for `d` with `sleep`: every sleep's lateness, and how
/// many ended early (as a negative lateness cannot be stored, those count as 0 late).
async fn sleep_case<F, S>(
    case: &'static str,
    sleep: S,
    d: Duration,
    tasks: u32,
    sleeps: u32,
) -> anyhow::Result<SleepResult>
where
    S: Fn(Duration) -> F + Copy + Send + Sync + 'static,
    F: Future<Output = ()> + Send,
{
    let started = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|t| {
            tokio::spawn(async move {
                sleep(d * t / tasks).await;
                let mut late = Vec::with_capacity(sleeps as usize);
                let mut early = 0u64;
                for _ in 0..sleeps {
                    let start = Instant::now();
                    sleep(d).await;
                    let took = start.elapsed();
                    if took < d {
                        early += 1;
                    }
                    late.push(took.saturating_sub(d));
                }
                (late, early)
            })
        })
        .collect();
    let mut late = Vec::with_capacity(tasks as usize * sleeps as usize);
    let mut early = 0;
    for h in handles {
        let (l, e) = h.await.context("a sleeping task failed")?;
        late.extend(l);
        early += e;
    }
    let elapsed = started.elapsed();
    late.sort();
    let n = late.len();
    let at = |q: f64| late[((n as f64 * q) as usize).min(n - 1)];
    Ok(SleepResult {
        bench: "timer",
        case,
        sleep_us: us(d),
        tasks,
        sleeps: n as u64,
        early,
        mean_late_us: us(late.iter().sum::<Duration>() / n as u32),
        p50_late_us: us(at(0.5)),
        p99_late_us: us(at(0.99)),
        max_late_us: us(late[n - 1]),
        sleeps_per_s: output::round1(n as f64 / elapsed.as_secs_f64()),
        elapsed_ms: ms(elapsed),
    })
}

/// A memory store of `chunks` chunks whose chunk `i` is filled with `i as u8`.
async fn filled(chunks: u64) -> anyhow::Result<(Geometry, Arc<MemoryStore>)> {
    let g = Geometry::new(chunks * CHUNK, CHUNK)?;
    let store = Arc::new(MemoryStore::new(g));
    for idx in g.all().iter() {
        let data = Bytes::from(vec![idx.0 as u8; g.chunk_len(idx)]);
        store.write(idx, data).await?;
    }
    Ok((g, store))
}

async fn delayed_concurrent(latency: Duration, tasks: u32) -> anyhow::Result<DelayedResult> {
    let (g, store) = filled(u64::from(tasks).min(1024)).await?;
    let d = Arc::new(Delayed::new(
        store,
        DelayOptions {
            latency,
            bandwidth: None,
        },
    ));
    let started = Instant::now();
    let reads = (0..u64::from(tasks)).map(|i| {
        let d = d.clone();
        let idx = ChunkIdx(i % g.chunk_count());
        tokio::spawn(async move { (idx, d.read(idx).await) })
    });
    let mut verified = true;
    for r in reads.collect::<Vec<_>>() {
        let (idx, data) = r.await.context("a reading task failed")?;
        let data = data.context("a read of the delayed store failed")?;
        verified &= data.iter().all(|&b| b == idx.0 as u8);
    }
    let elapsed = started.elapsed();
    let bytes = u64::from(tasks) * CHUNK;
    Ok(DelayedResult {
        bench: "timer",
        case: "delayed-concurrent",
        latency_us: us(latency),
        tasks,
        bytes,
        ideal_ms: ms(latency),
        elapsed_ms: ms(elapsed),
        ratio_to_ideal: round3(elapsed.as_secs_f64() / latency.as_secs_f64().max(1e-9)),
        mb_per_s: output::mb_per_s(bytes, elapsed),
        bandwidth_mb_per_s: None,
        verified,
    })
}

async fn delayed_bandwidth(
    latency: Duration,
    bandwidth: u64,
    bytes: u64,
) -> anyhow::Result<Vec<DelayedResult>> {
    let chunks = bytes.div_ceil(CHUNK).max(1);
    let g = Geometry::new(chunks * CHUNK, CHUNK)?;
    let d = Arc::new(Delayed::new(
        MemoryStore::new(g),
        DelayOptions {
            latency,
            bandwidth: Some(bandwidth),
        },
    ));
    let ideal = Duration::from_secs_f64(g.size() as f64 / bandwidth as f64);
    let mut rows = Vec::new();
    for (case, write) in [
        ("delayed-bandwidth-write", true),
        ("delayed-bandwidth-read", false),
    ] {
        let started = Instant::now();
        let tasks: Vec<_> = (0..8u64)
            .map(|t| {
                let d = d.clone();
                tokio::spawn(async move {
                    let mut ok = true;
                    for i in (t..chunks).step_by(8) {
                        let idx = ChunkIdx(i);
                        if write {
                            d.write(idx, Bytes::from(vec![i as u8; CHUNK as usize]))
                                .await?;
                        } else {
                            ok &= d.read(idx).await?.iter().all(|&b| b == i as u8);
                        }
                    }
                    anyhow::Ok(ok)
                })
            })
            .collect();
        let mut verified = true;
        for t in tasks {
            verified &= t.await.context("a transfer task failed")??;
        }
        let elapsed = started.elapsed();
        let rate = g.size() as f64 / elapsed.as_secs_f64();
        rows.push(DelayedResult {
            bench: "timer",
            case,
            latency_us: us(latency),
            tasks: 8,
            bytes: g.size(),
            ideal_ms: ms(ideal),
            elapsed_ms: ms(elapsed),
            ratio_to_ideal: round3(rate / bandwidth as f64),
            mb_per_s: output::mb_per_s(g.size(), elapsed),
            bandwidth_mb_per_s: Some(output::round1(bandwidth as f64 / 1e6)),
            verified,
        });
    }
    Ok(rows)
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

fn print_sleep(json: bool, r: &SleepResult) -> anyhow::Result<()> {
    if json {
        return output::json_line(r);
    }
    println!(
        "{:<12} {} sleeps of {} µs from {} tasks: late mean {} µs, median {} µs, p99 {} µs, max {} µs; {} early; {:.0} sleeps/s",
        r.case,
        r.sleeps,
        r.sleep_us,
        r.tasks,
        r.mean_late_us,
        r.p50_late_us,
        r.p99_late_us,
        r.max_late_us,
        r.early,
        r.sleeps_per_s
    );
    Ok(())
}

fn print_delayed(json: bool, r: &DelayedResult) -> anyhow::Result<()> {
    if json {
        return output::json_line(r);
    }
    println!(
        "{:<24} {} in {} ms (ideal {} ms, ratio {}), {} MB/s{}",
        r.case,
        format_size(r.bytes),
        r.elapsed_ms,
        r.ideal_ms,
        r.ratio_to_ideal,
        r.mb_per_s,
        if r.verified {
            ", verified"
        } else {
            ", VERIFICATION FAILED"
        }
    );
    Ok(())
}

pub async fn run(args: TimerArgs) -> anyhow::Result<ExitCode> {
    if args.sleep.is_zero() {
        bail!("--sleep must be more than 0");
    }
    let (d, tasks, sleeps) = (args.sleep, args.tasks, args.sleeps);
    let farmap = sleep_case("timer", timer::sleep, d, tasks, sleeps).await?;
    print_sleep(args.json, &farmap)?;
    let tokio = sleep_case("tokio-sleep", tokio::time::sleep, d, tasks, sleeps).await?;
    print_sleep(args.json, &tokio)?;
    let concurrent = delayed_concurrent(d, tasks).await?;
    print_delayed(args.json, &concurrent)?;
    let mut verified = concurrent.verified;
    for r in delayed_bandwidth(d, args.bandwidth, args.bytes).await? {
        print_delayed(args.json, &r)?;
        verified &= r.verified;
    }
    if farmap.early > 0 {
        bail!("{} sleeps of the farmap timer ended early", farmap.early);
    }
    if !verified {
        bail!("data read through the Delayed stage differs from what was written");
    }
    Ok(ExitCode::SUCCESS)
}
