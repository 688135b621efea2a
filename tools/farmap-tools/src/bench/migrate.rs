//! `farmap bench migrate`: the migration modes side by side on one workload.
//!
//! For every size and mode, in this process: a shared store (a memory store served on
//! loopback by `farmap_net::serve`, as `farmap serve` does) holds the whole region; a source
//! region over it runs a writer on a fixed working set (the same whatever the size); the
//! region migrates to a destination region over loopback in the mode asked, and the writer
//! goes on there. Measured: the downtime, the bytes received before the destination resumed,
//! TTR80 (from the suspension until the writer runs at 80% of its rate before the
//! migration, over 100 ms windows), the effective downtime (the largest gap between two of
//! the writer's writes), what came from where; and the destination's region is checked
//! byte for byte against the image recomputed from the writer's ops.

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use clap::Args;
use farmap::pipeline::PushOptions;
use farmap::store::MemoryStore;
use farmap::{ChunkIdx, Geometry, Store};
use farmap_migrate::leech::{LeechOptions, SharedOpener};
use farmap_migrate::seed::SeedOptions;
use farmap_migrate::{monotonic_ns, Mode, WriterGate};
use farmap_net::{ClientOptions, ListenAddr, Listener, RemoteAddr, RemoteStore, ServeOptions};
use farmap_uffd::{Region, RegionOptions};
use serde_json::json;

use super::common::{parse_duration, parse_size_arg};
use crate::output;

#[derive(Debug, Args)]
pub struct MigrateArgs {
    /// The modes to run, in this order (comma-separated): precopy, postcopy, instant.
    #[arg(long, default_value = "instant,precopy,postcopy", value_delimiter = ',',
          value_parser = parse_mode)]
    modes: Vec<Mode>,
    /// Region sizes (comma-separated, binary suffixes).
    #[arg(long, default_value = "1GiB", value_delimiter = ',', value_parser = parse_size_arg)]
    sizes: Vec<u64>,
    /// The writer's working set, the same for every size: the region's first bytes.
    #[arg(long, default_value = "64MiB", value_parser = parse_size_arg)]
    working_set: u64,
    /// How long the writer runs at the source before the migration (its rate over the
    /// second half is the rate TTR80 compares with).
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    warmup: Duration,
    /// How long to wait after the hand-over for the writer to reach 80% of its rate.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    settle: Duration,
    /// Runs of each mode and size (one line each).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    runs: u32,
    /// One JSON object per line on stdout.
    #[arg(long)]
    json: bool,
    /// Log the migrations' progress (both sides) on stderr.
    #[arg(long)]
    log: bool,
}

fn parse_mode(s: &str) -> Result<Mode, String> {
    s.parse()
}

const CHUNK: u64 = 64 << 10;
/// Ops per pass of the writer gate.
const BATCH: u64 = 256;
/// The sampler's period, and the window rates are measured over.
const SAMPLE: Duration = Duration::from_millis(10);
const WINDOW: usize = 10;

/// The value of word `k` before any op.
fn init_word(k: u64) -> u64 {
    crate::demo::mix(k ^ 0x5eed)
}

/// Op `n`: word index (within the working set's `words`) and value.
fn op(words: u64, n: u64) -> (u64, u64) {
    let h = crate::demo::mix(n.wrapping_mul(0x9e37_79b9) ^ 0xbe7c);
    (h % words, n.wrapping_add(1))
}

/// What the writer has done, shared by its source and destination threads and the sampler.
#[derive(Debug, Default)]
struct Work {
    ops: AtomicU64,
    last_op_ns: AtomicU64,
    max_gap_ns: AtomicU64,
    /// Measure gaps only while set (the migration).
    watch_gaps: AtomicBool,
    stop: AtomicBool,
}

/// Runs the writer on `region` until retired or stopped.
fn writer(region: Arc<Region>, gate: Arc<WriterGate>, work: Arc<Work>, words: u64) {
    loop {
        if work.stop.load(Ordering::Relaxed) {
            return;
        }
        let pass = match gate.enter(Duration::from_millis(50)) {
            Ok(p) => p,
            Err(farmap_migrate::suspend::Closed::Retired) => return,
            Err(farmap_migrate::suspend::Closed::Suspended) => continue,
        };
        let mut n = work.ops.load(Ordering::Acquire);
        for _ in 0..BATCH {
            let (k, v) = op(words, n);
            if region.write_at((k * 8) as usize, &v.to_le_bytes()).is_err() {
                return;
            }
            n += 1;
        }
        work.ops.store(n, Ordering::Release);
        drop(pass);
        let now = monotonic_ns();
        let last = work.last_op_ns.swap(now, Ordering::AcqRel);
        if last != 0 && work.watch_gaps.load(Ordering::Relaxed) {
            work.max_gap_ns
                .fetch_max(now.saturating_sub(last), Ordering::AcqRel);
        }
    }
}

/// A chunk of the region as the store first holds it.
fn base_chunk(idx: u64) -> Bytes {
    let mut v = Vec::with_capacity(CHUNK as usize);
    for k in idx * CHUNK / 8..(idx + 1) * CHUNK / 8 {
        v.extend_from_slice(&init_word(k).to_le_bytes());
    }
    Bytes::from(v)
}

/// One migration's figures.
struct Outcome {
    report: farmap_migrate::LeechReport,
    pre_rate: f64,
    ttr80_ms: Option<f64>,
    effective_downtime_ms: f64,
    verified: bool,
}

async fn one(size: u64, mode: Mode, args: &MigrateArgs) -> anyhow::Result<Outcome> {
    let (_server, addr) = serve_base_image(size).await?;
    let source = source_region(&addr).await?;
    let words = args.working_set.min(size) / 8;
    let work = Arc::new(Work::default());
    let gate = {
        let w = work.clone();
        Arc::new(WriterGate::new(move || {
            Bytes::copy_from_slice(&w.ops.load(Ordering::Acquire).to_le_bytes())
        }))
    };
    let src_thread = {
        let (r, g2, w) = (source.clone(), gate.clone(), work.clone());
        std::thread::spawn(move || writer(r, g2, w, words))
    };
    let sampler = Sampler::start(work.clone());
    let t0 = sampler.t0;
    tokio::time::sleep(args.warmup).await;
    let pre_rate = sampler.pre_rate()?;

    // The migration.
    work.watch_gaps.store(true, Ordering::Release);
    work.last_op_ns.store(0, Ordering::Release);
    let seeding =
        farmap_migrate::seed::seed(source.clone(), gate.clone(), seed_options(args)?).await?;
    let dest_slot: Arc<parking_lot::Mutex<Option<std::thread::JoinHandle<()>>>> =
        Default::default();
    let resumed_ns = Arc::new(AtomicU64::new(0));
    let resume: farmap_migrate::Resumer = {
        let (slot, w, r_ns) = (dest_slot.clone(), work.clone(), resumed_ns.clone());
        Box::new(move |region, state| {
            r_ns.store(t0.elapsed().as_nanos() as u64, Ordering::Release);
            let ops = state
                .get(..8)
                .and_then(|b| b.try_into().ok())
                .map_or(0, u64::from_le_bytes);
            w.ops.store(ops, Ordering::Release);
            let gate = Arc::new(WriterGate::new(Bytes::new));
            *slot.lock() = Some(std::thread::spawn(move || writer(region, gate, w, words)));
        })
    };
    let opener = SharedOpener(Arc::new(move |_spec: String| {
        let addr = addr.clone();
        Box::pin(async move {
            Ok(
                Arc::new(RemoteStore::connect(addr, ClientOptions::default()).await?)
                    as Arc<dyn Store>,
            )
        })
    }));
    let (_cancel, cancelled) = tokio::sync::watch::channel(false);
    let report = farmap_migrate::leech(
        LeechOptions {
            mode,
            shared: Some(opener),
            log: args.log,
            ..LeechOptions::new(RemoteAddr::from(&seeding.control))
        },
        resume,
        cancelled,
    )
    .await
    .with_context(|| format!("the {mode} migration"))?;
    seeding.finish().await.context("the seeder")?;
    let _ = src_thread.join();
    // TTR80: from the suspension (resume minus downtime) to the end of the first window at
    // the destination at 80% of the rate before.
    let resumed = resumed_ns.load(Ordering::Acquire);
    let suspended = resumed.saturating_sub(report.downtime.as_nanos() as u64);
    let ttr80_ms = sampler.ttr80(suspended, pre_rate, args.settle).await;
    work.stop.store(true, Ordering::Release);
    if let Some(t) = dest_slot.lock().take() {
        let _ = t.join();
    }
    let _ = sampler.thread.join();
    let effective_downtime_ms = work.max_gap_ns.load(Ordering::Acquire) as f64 / 1e6;
    // The destination against the image recomputed from the ops.
    let ops = work.ops.load(Ordering::Acquire);
    let dest = report.region.clone();
    let verified = tokio::task::spawn_blocking(move || check(&dest, size, words, ops)).await??;
    Ok(Outcome {
        report,
        pre_rate,
        ttr80_ms,
        effective_downtime_ms,
        verified,
    })
}

/// Serves a memory store holding the base image of a `size`-byte region on loopback (the
/// store both hosts reach); returns the server (it serves while kept) and its address.
async fn serve_base_image(size: u64) -> anyhow::Result<(farmap_net::Server, RemoteAddr)> {
    let g = Geometry::new(size, CHUNK)?;
    let mem = Arc::new(MemoryStore::new(g));
    for c in 0..g.chunk_count() {
        mem.write(ChunkIdx(c), base_chunk(c)).await?;
    }
    let listener = Listener::bind(&"127.0.0.1:0".parse::<ListenAddr>()?).await?;
    let at = listener.local_addr()?;
    let server = farmap_net::serve(
        mem.clone(),
        listener,
        ServeOptions {
            log: false,
            ..ServeOptions::default()
        },
    )?;
    Ok((server, RemoteAddr::from(&at)))
}

/// The source: a direct region over the served store, pushing every 200 ms.
async fn source_region(addr: &RemoteAddr) -> anyhow::Result<Arc<Region>> {
    let spec = format!("farmap://{addr}");
    let store: Arc<dyn Store> =
        Arc::new(RemoteStore::connect(addr.clone(), ClientOptions::default()).await?);
    let source = tokio::task::spawn_blocking(move || {
        Region::open(
            store,
            RegionOptions {
                push: PushOptions {
                    interval: Some(Duration::from_millis(200)),
                    ..PushOptions::default()
                },
                store_spec: Some(spec),
                ..RegionOptions::direct()
            },
        )
    })
    .await??;
    Ok(Arc::new(source))
}

/// The seeder's options: loopback, the process's migration key.
fn seed_options(args: &MigrateArgs) -> anyhow::Result<SeedOptions> {
    Ok(SeedOptions {
        listen: "127.0.0.1:0".parse()?,
        data_listen: "127.0.0.1:0".parse()?,
        tls: None,
        reconnect_wait: Duration::from_secs(30),
        handshake_timeout: farmap_migrate::seed::HANDSHAKE_TIMEOUT,
        max_handshakes: farmap_migrate::seed::MAX_HANDSHAKES,
        log: args.log,
        observer: None,
        pull: Default::default(),
        push_budget: farmap_migrate::seed::PUSH_BUDGET,
        key: farmap_migrate::auth::process_key(),
    })
}

/// A thread that samples (ns since `t0`, ops) every [`SAMPLE`] until the work stops.
struct Sampler {
    t0: Instant,
    samples: Arc<parking_lot::Mutex<Vec<(u64, u64)>>>,
    thread: std::thread::JoinHandle<()>,
}

impl Sampler {
    fn start(work: Arc<Work>) -> Sampler {
        let t0 = Instant::now();
        let samples = Arc::new(parking_lot::Mutex::new(Vec::<(u64, u64)>::new()));
        let s = samples.clone();
        let thread = std::thread::spawn(move || {
            while !work.stop.load(Ordering::Relaxed) {
                s.lock().push((
                    t0.elapsed().as_nanos() as u64,
                    work.ops.load(Ordering::Acquire),
                ));
                std::thread::sleep(SAMPLE);
            }
        });
        Sampler {
            t0,
            samples,
            thread,
        }
    }

    /// Ops per second over the second half of the samples so far (the warm-up's).
    fn pre_rate(&self) -> anyhow::Result<f64> {
        let s = self.samples.lock();
        let end = *s.last().context("no sample")?;
        let half = s
            .iter()
            .find(|(t, _)| *t >= end.0 / 2)
            .copied()
            .unwrap_or(end);
        Ok((end.1 - half.1) as f64 / ((end.0 - half.0).max(1) as f64 / 1e9))
    }

    /// TTR80: from `suspended` to the end of the first window at the destination at 80% of
    /// `pre_rate`, waiting at most `settle` for it.
    async fn ttr80(&self, suspended: u64, pre_rate: f64, settle: Duration) -> Option<f64> {
        let deadline = Instant::now() + settle;
        loop {
            let found = {
                let s = self.samples.lock();
                let from = s.partition_point(|(t, _)| *t < suspended);
                s[from..]
                    .windows(WINDOW + 1)
                    .find(|w| {
                        let (a, b) = (w[0], w[WINDOW]);
                        let rate = (b.1 - a.1) as f64 / ((b.0 - a.0).max(1) as f64 / 1e9);
                        rate >= 0.8 * pre_rate
                    })
                    .map(|w| (w[WINDOW].0 - suspended) as f64 / 1e6)
            };
            if found.is_some() || Instant::now() >= deadline {
                return found;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Whether `region` holds the base image with ops `0..ops` applied.
fn check(region: &Region, size: u64, words: u64, ops: u64) -> anyhow::Result<bool> {
    let mut ws: Vec<u64> = (0..words).map(init_word).collect();
    for n in 0..ops {
        let (k, v) = op(words, n);
        ws[k as usize] = v;
    }
    let mut buf = vec![0u8; CHUNK as usize];
    for c in 0..size / CHUNK {
        region.read_at((c * CHUNK) as usize, &mut buf)?;
        for (i, w) in buf.chunks_exact(8).enumerate() {
            let k = c * CHUNK / 8 + i as u64;
            let want = ws.get(k as usize).copied().unwrap_or_else(|| init_word(k));
            if u64::from_le_bytes(w.try_into().expect("8 bytes")) != want {
                return Ok(false);
            }
        }
    }
    Ok(true)
}

pub async fn run(args: MigrateArgs) -> anyhow::Result<ExitCode> {
    if args.working_set < CHUNK {
        anyhow::bail!("--working-set must be at least 64KiB");
    }
    for &size in &args.sizes {
        if size % CHUNK != 0 || size < args.working_set {
            anyhow::bail!(
                "--sizes: {size} bytes is not a whole number of 64 KiB chunks at least as large \
                 as the working set ({} bytes)",
                args.working_set
            );
        }
    }
    let mut failed = false;
    for &size in &args.sizes {
        for &mode in &args.modes {
            for run in 1..=args.runs {
                // Progress on stderr, with --json too: a 4 GiB run takes tens of seconds.
                status!(
                    "farmap bench migrate: {mode}, {} MiB region, working set {} MiB, run {run}",
                    size >> 20,
                    args.working_set >> 20
                );
                let o = one(size, mode, &args).await?;
                let r = &o.report;
                failed |= !o.verified;
                let ms = |d: Duration| (d.as_secs_f64() * 1e5).round() / 100.0;
                let line = json!({
                    "bench": "migrate",
                    "mode": mode.name(),
                    "run": run,
                    "region_bytes": size,
                    "working_set_bytes": args.working_set,
                    "verified": o.verified,
                    "downtime_ms": ms(r.downtime),
                    "bytes_before_resume": r.bytes_before_resume,
                    "ttr80_ms": o.ttr80_ms.map(|v| (v * 100.0).round() / 100.0),
                    "effective_downtime_ms": (o.effective_downtime_ms * 100.0).round() / 100.0,
                    "bytes_precopy": r.bytes_precopy,
                    "bytes_postcopy": r.bytes_postcopy,
                    "chunks_from_store": r.instant.chunks_from_store,
                    "chunks_from_source": r.instant.chunks_from_source,
                    "verify_failures": r.instant.verify_failures,
                    "total_ms": ms(r.total),
                    "rate_before_ops_per_s": o.pre_rate.round(),
                });
                if args.json {
                    output::json_line(&line)?;
                } else {
                    println!(
                        "{:>8} {:>6} MiB: downtime {:>8.2} ms, TTR80 {:>9}, effective downtime \
                         {:>8.2} ms, {:>10} B before resuming, total {:>9.1} ms, verified {}",
                        mode.name(),
                        size >> 20,
                        r.downtime.as_secs_f64() * 1e3,
                        o.ttr80_ms
                            .map_or("never".to_owned(), |v| format!("{v:.1} ms")),
                        o.effective_downtime_ms,
                        r.bytes_before_resume,
                        r.total.as_secs_f64() * 1e3,
                        o.verified
                    );
                }
            }
        }
    }
    if failed {
        anyhow::bail!("a destination region differs from the writer's image (see verified)");
    }
    Ok(ExitCode::SUCCESS)
}
