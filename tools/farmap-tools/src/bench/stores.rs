//! `farmap bench stores`: reading a region out of each store given (Redis, S3, CQL, a remote
//! farmap host...), with a memory store measured in the same run as the reference.
//!
//! For each store (data prefilled with random bytes first; setup is not timed):
//! - `direct-read`: every chunk read straight from the store, `--direct-concurrency`
//!   requests at a time (1 by default: what an application faulting chunk after chunk on a
//!   direct mount gets); p50/p99 are per-read latencies.
//! - `managed-read`: `Cached` (dense local memory) + `Puller` with `--workers` fetches in
//!   flight pulls the whole region, as a managed mount does; verified against the source.
//! - `read-4k`: 4 KiB reads at random offsets through `Unaligned`, one at a time: p50/p99.
//!
//! `--rtt` puts a `farmap proxy` delay in front of stores reached at one TCP address
//! (`redis://`, `rediss://`, `farmap://`); the memory reference runs without it.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::Args;
use farmap::net::RemoteAddr;
use farmap::pipeline::Unaligned;
use farmap::spec::open_store_async;
use farmap::{format_size, ChunkIdx, Geometry, SpecKind, Store, StoreSpec};
use farmap_proxy::{Proxy, ProxyHandle, ProxyOptions};
use futures::stream::{self, StreamExt, TryStreamExt};
use rand::{Rng, RngCore, SeedableRng};
use serde::Serialize;

use super::common::{parse_duration, parse_size_arg};
use crate::output;

#[derive(Debug, Args)]
pub struct StoresArgs {
    /// A store to measure (repeatable). Its region is overwritten with random data: name a
    /// scratch region (e.g. `redis://127.0.0.1:6379/0?prefix=bench`). `memory:` is always
    /// measured too, as the reference.
    #[arg(long = "store")]
    stores: Vec<StoreSpec>,
    /// Region size (given to stores whose spec has none).
    #[arg(long, default_value = "256MiB", value_parser = parse_size_arg)]
    size: u64,
    /// Chunk size (given to stores whose spec has none).
    #[arg(long, default_value = "64KiB", value_parser = parse_size_arg)]
    chunk: u64,
    /// Emulated round-trip time in front of TCP stores (a delay proxy in this process).
    #[arg(long, default_value = "0ms", value_parser = parse_duration)]
    rtt: Duration,
    /// Requests in flight of `direct-read`.
    #[arg(long, default_value_t = 1)]
    direct_concurrency: usize,
    /// Pull workers (requests in flight) of `managed-read`. (64 beat 256 against one
    /// redis-server on 2 cores: deeper pipelines only queue behind its one thread.)
    #[arg(long, default_value_t = 64)]
    workers: usize,
    /// 4 KiB reads of `read-4k`.
    #[arg(long, default_value_t = 2000)]
    samples: usize,
    /// One JSON object per store and case on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct StoresResult {
    bench: &'static str,
    store: String,
    case: &'static str,
    mb_per_s: f64,
    p50_us: Option<f64>,
    p99_us: Option<f64>,
    size_bytes: u64,
    chunk_bytes: u32,
    concurrency: usize,
    rtt_ms: f64,
    elapsed_ms: f64,
    verified: bool,
}

fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    Some(output::round1(sorted[i]))
}

/// The chunk content of the prefill: random, the same for every store of a run.
fn content(g: Geometry, idx: ChunkIdx) -> Bytes {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(0x5707e5 ^ idx.0);
    let mut buf = vec![0u8; g.chunk_len(idx)];
    rng.fill_bytes(&mut buf);
    Bytes::from(buf)
}

/// The TCP address of a store a delay proxy can sit in front of.
fn tcp_addr(spec: &mut StoreSpec) -> Option<&mut String> {
    match &mut spec.kind {
        SpecKind::Remote {
            addr: RemoteAddr::Tcp(a),
            ..
        } => Some(a),
        SpecKind::Nbd { target, .. } => match &mut target.addr {
            RemoteAddr::Tcp(a) => Some(a),
            RemoteAddr::Unix(_) => None,
        },
        SpecKind::Redis(c) => match &mut c.target {
            farmap_redis::Target::Single { addr, .. } => Some(addr),
            farmap_redis::Target::Cluster { .. } => None,
        },
        _ => None,
    }
}

async fn proxied(
    mut spec: StoreSpec,
    rtt: Duration,
) -> anyhow::Result<(StoreSpec, Option<ProxyHandle>)> {
    if rtt.is_zero() {
        return Ok((spec, None));
    }
    let shown = spec.to_string();
    let Some(addr) = tcp_addr(&mut spec) else {
        bail!("--rtt needs stores reached at one TCP address; {shown} is not one");
    };
    let to = tokio::net::lookup_host(addr.as_str())
        .await
        .with_context(|| format!("resolving {addr}"))?
        .next()
        .with_context(|| format!("{addr} resolves to nothing"))?;
    let proxy = Proxy::bind(
        "127.0.0.1:0",
        to,
        ProxyOptions {
            rtt,
            ..ProxyOptions::default()
        },
    )
    .await
    .context("starting the delay proxy")?
    .spawn();
    *addr = proxy.local_addr().to_string();
    Ok((spec, Some(proxy)))
}

async fn prefill(store: &dyn Store) -> anyhow::Result<()> {
    let g = store.geometry();
    stream::iter(g.all().iter())
        .map(|idx| async move { store.write(idx, content(g, idx)).await })
        .buffer_unordered(64)
        .try_collect::<()>()
        .await
        .context("prefilling the region")?;
    store.flush().await.context("flushing the prefill")?;
    Ok(())
}

/// Reads every chunk, `concurrency` at a time; returns the time, the sorted latencies and
/// whether every chunk was the prefill's.
async fn direct_read(
    store: &dyn Store,
    concurrency: usize,
) -> anyhow::Result<(Duration, Vec<f64>, bool)> {
    let g = store.geometry();
    let started = Instant::now();
    let results: Vec<(f64, bool)> = stream::iter(g.all().iter())
        .map(|idx| async move {
            let t = Instant::now();
            let data = store.read(idx).await?;
            let us = t.elapsed().as_secs_f64() * 1e6;
            anyhow::Ok((us, data == content(g, idx)))
        })
        .buffered(concurrency.max(1))
        .try_collect()
        .await?;
    let elapsed = started.elapsed();
    let verified = results.iter().all(|(_, ok)| *ok);
    let mut lat: Vec<f64> = results.into_iter().map(|(us, _)| us).collect();
    lat.sort_by(f64::total_cmp);
    Ok((elapsed, lat, verified))
}

async fn managed_read(remote: Arc<dyn Store>, workers: usize) -> anyhow::Result<(Duration, bool)> {
    let g = remote.geometry();
    let (timed, verified, _) = super::net::run_managed(remote, Some(workers), |idx| {
        std::future::ready(Ok(content(g, idx)))
    })
    .await?;
    Ok((timed.elapsed, verified))
}

async fn read_4k(
    store: Arc<dyn Store>,
    samples: usize,
) -> anyhow::Result<(Duration, Vec<f64>, bool)> {
    let g = store.geometry();
    let u = Unaligned::new(store);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(0x4b);
    let len = 4096u64.min(g.size());
    let mut lat = Vec::with_capacity(samples);
    let mut verified = true;
    let started = Instant::now();
    for _ in 0..samples {
        let offset = rng.gen_range(0..=(g.size() - len));
        let t = Instant::now();
        let data = u.read_bytes(offset, len as usize).await?;
        lat.push(t.elapsed().as_secs_f64() * 1e6);
        let idx = g.chunk_of(offset);
        let start = (offset - g.offset_of(idx)) as usize;
        let chunk = content(g, idx);
        let first = (chunk.len() - start).min(len as usize);
        verified &= data[..first] == chunk[start..start + first];
    }
    let elapsed = started.elapsed();
    lat.sort_by(f64::total_cmp);
    Ok((elapsed, lat, verified))
}

pub async fn run(args: StoresArgs) -> anyhow::Result<ExitCode> {
    let reference: StoreSpec = format!(
        "memory:{}?chunk={}",
        format_size(args.size),
        format_size(args.chunk)
    )
    .parse()
    .context("the memory reference")?;
    let mut specs = vec![(reference, false)];
    specs.extend(args.stores.iter().cloned().map(|s| (s, true)));
    let mut failed = false;
    for (mut spec, remote) in specs {
        if spec.size.is_none() {
            spec.size = Some(args.size);
        }
        if spec.chunk_size.is_none() {
            spec.chunk_size = Some(args.chunk as u32);
        }
        let shown = spec.to_string();
        let scheme = shown.split(':').next().unwrap_or_default().to_owned();
        let rtt = if remote { args.rtt } else { Duration::ZERO };
        let (spec, proxy) = proxied(spec, rtt).await?;
        let store = open_store_async(&spec)
            .await
            .with_context(|| format!("opening {shown}"))?;
        let g = store.geometry();
        if !args.json {
            eprintln!("{shown}: prefilling {}", format_size(g.size()));
        }
        prefill(store.as_ref()).await?;
        for case in ["direct-read", "managed-read", "read-4k"] {
            let (bytes, elapsed, lat, verified, concurrency) = match case {
                "direct-read" => {
                    let (e, lat, ok) = direct_read(store.as_ref(), args.direct_concurrency).await?;
                    (g.size(), e, lat, ok, args.direct_concurrency)
                }
                "managed-read" => {
                    let (e, ok) = managed_read(store.clone(), args.workers).await?;
                    (g.size(), e, Vec::new(), ok, args.workers)
                }
                _ => {
                    let (e, lat, ok) = read_4k(store.clone(), args.samples).await?;
                    let bytes = lat.len() as u64 * 4096u64.min(g.size());
                    (bytes, e, lat, ok, 1)
                }
            };
            failed |= !verified;
            let r = StoresResult {
                bench: "stores",
                store: scheme.clone(),
                case,
                mb_per_s: output::mb_per_s(bytes, elapsed),
                p50_us: percentile(&lat, 0.5),
                p99_us: percentile(&lat, 0.99),
                size_bytes: bytes,
                chunk_bytes: g.chunk_size(),
                concurrency,
                rtt_ms: rtt.as_secs_f64() * 1e3,
                elapsed_ms: output::round1(elapsed.as_secs_f64() * 1e3),
                verified,
            };
            if args.json {
                output::json_line(&r)?;
            } else {
                let lat = match (r.p50_us, r.p99_us) {
                    (Some(a), Some(b)) => format!(", p50 {a:.0} us, p99 {b:.0} us"),
                    _ => String::new(),
                };
                println!(
                    "{:<8} {:<13} {:>9.1} MB/s{lat}{}",
                    r.store,
                    r.case,
                    r.mb_per_s,
                    if verified {
                        ""
                    } else {
                        ", VERIFICATION FAILED"
                    }
                );
            }
        }
        drop(store);
        if let Some(p) = proxy {
            p.shutdown().await;
        }
    }
    if failed {
        bail!("some data read back differed from what was written");
    }
    Ok(ExitCode::SUCCESS)
}
