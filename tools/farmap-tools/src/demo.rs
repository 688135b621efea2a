//! `farmap demo`: a live region with a deterministic writer migrates to another process
//! through an emulated link, is verified, and migrates back.
//!
//! The parent starts two node processes (`farmap __demo-node`, hidden) and drives them with
//! one command per stdin line; they answer with JSON lines on stdout. The parent runs the
//! two delay proxies (control and data plane) of each direction.
//!
//! The writer: op `n` writes the u64 `value(seed, n)` at word `word(seed, n)` of the region;
//! the initial image is word `k` = `init(seed, k)`. Both are pure functions, so the checker
//! recomputes the image after any number of ops without looking at the source.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{ChildStdin, ChildStdout, Command as Proc, ExitCode, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::Args;
use farmap::pipeline::PushOptions;
use farmap::{Geometry, Store};
use farmap_migrate::agent::{self, LeechRequest, Request, SeedRequest};
use farmap_migrate::{
    monotonic_ns, Convergence, LeechReport, Resumer, SeedReport, Suspend, WriterGate,
};
use farmap_proxy::{Proxy, ProxyOptions};
use farmap_uffd::{Region, RegionOptions};
use tokio::io::AsyncBufReadExt;

use farmap_cli_kit::args::{parse_duration, parse_size_arg};
use farmap_cli_kit::drive::{drive, Outcome, Ui};
use serde_json::{json, Value};

use crate::output;

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Emulated round-trip time between the two hosts.
    #[arg(long, default_value = "0ms", value_parser = parse_duration)]
    rtt: Duration,
    /// Region size.
    #[arg(long, default_value = "1GiB", value_parser = parse_size_arg)]
    size: u64,
    /// Seed of the writer workload.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Pages the writer writes per second, as a percentage of the region's pages.
    #[arg(long, default_value_t = 6.5)]
    write_percent: f64,
    /// Downtime budget for the pre-copy convergence.
    #[arg(long, default_value = "5ms", value_parser = parse_duration)]
    max_downtime: Duration,
    /// One JSON line per direction on stdout instead of a summary.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    pull: farmap_cli_kit::args::PullArgs,
    /// How the region moves (as `farmap leech --mode`): precopy, postcopy, or instant (the
    /// region lives in a shared store, see --store).
    #[arg(long, default_value = "precopy", value_parser = parse_mode)]
    mode: farmap_migrate::Mode,
    /// The store both nodes' region lives in, started by the demo: farmap (a `farmap serve`
    /// of a memory store on loopback, in this process) or redis (a `redis-server` of its
    /// own, which must be installed). Instant mode needs one and uses farmap by default.
    #[arg(long, value_name = "redis|farmap")]
    store: Option<DemoStore>,
}

/// The shared store a demo starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DemoStore {
    /// A memory store served by this process (as `farmap serve memory:SIZE`).
    Farmap,
    /// A `redis-server` started for the demo.
    Redis,
}

fn parse_mode(s: &str) -> Result<farmap_migrate::Mode, String> {
    s.parse()
}

/// A shared store the demo started, stopped when dropped.
struct SharedStore {
    spec: String,
    _server: Option<farmap_net::Server>,
    redis: Option<std::process::Child>,
    _dir: Option<tempfile::TempDir>,
}

impl Drop for SharedStore {
    fn drop(&mut self) {
        if let Some(r) = &mut self.redis {
            let _ = r.kill();
            let _ = r.wait();
        }
    }
}

async fn start_store(kind: DemoStore, size: u64) -> anyhow::Result<SharedStore> {
    match kind {
        DemoStore::Farmap => {
            let g = Geometry::with_default_chunk(size)?;
            let mem: Arc<dyn Store> = Arc::new(farmap::store::MemoryStore::new(g));
            let listener = farmap_net::Listener::bind(&"127.0.0.1:0".parse()?).await?;
            let at = listener.local_addr()?;
            let server = farmap_net::serve(
                mem,
                listener,
                farmap_net::ServeOptions {
                    log: false,
                    ..farmap_net::ServeOptions::default()
                },
            )?;
            Ok(SharedStore {
                spec: format!("farmap://{at}"),
                _server: Some(server),
                redis: None,
                _dir: None,
            })
        }
        DemoStore::Redis => {
            let dir = tempfile::Builder::new()
                .prefix("farmap-demo-redis")
                .tempdir()?;
            // A free port now; redis-server takes it a moment later.
            let port = std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port();
            let child = Proc::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context(
                    "starting redis-server (is it installed? `apt-get install redis-server`, or \
                     use --store farmap)",
                )?;
            let mut store = SharedStore {
                spec: format!(
                    "redis://127.0.0.1:{port}/0?size={size}&prefix=farmap-demo-{}",
                    std::process::id()
                ),
                _server: None,
                redis: Some(child),
                _dir: Some(dir),
            };
            let deadline = Instant::now() + Duration::from_secs(10);
            while tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_err()
            {
                if let Some(r) = &mut store.redis {
                    if let Some(status) = r.try_wait()? {
                        bail!("redis-server exited at once ({status}): is port {port} taken?");
                    }
                }
                if Instant::now() >= deadline {
                    bail!("redis-server did not listen on port {port} within 10 s");
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(store)
        }
    }
}

#[derive(Debug, Args)]
pub struct NodeArgs {
    #[arg(long)]
    size: u64,
    #[arg(long)]
    seed: u64,
    #[arg(long)]
    ops_per_sec: u64,
    /// The migration agent's socket.
    #[arg(long)]
    agent: PathBuf,
    /// Create the region and start the writer at once.
    #[arg(long)]
    init: bool,
    /// With `--init`: the region lives in this store (any spec; a shared network store such
    /// as `redis://` for the migration tests), pushed in the background, instead of memory.
    /// The region is synced to it when it is handed over and released. Also the store that
    /// `check-store OPS` reads.
    #[arg(long, value_name = "SPEC")]
    store: Option<farmap::StoreSpec>,
    #[command(flatten)]
    local: farmap_cli_kit::args::LocalMaxArgs,
}

// ---- the workload: pure functions of (seed, op) -------------------------------------------

/// A 64-bit mixer (SplitMix64's finalizer): the workloads' pseudo-random positions and values.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Word index and value of op `n`.
fn op(seed: u64, words: u64, n: u64) -> (u64, u64) {
    let h = mix(seed ^ mix(n));
    (h % words, mix(h))
}

fn init_word(seed: u64, k: u64) -> u64 {
    mix(seed.wrapping_mul(31) ^ k)
}

/// The region's expected image after `ops` ops, computed from nothing but the seed.
fn expected_image(seed: u64, size: u64, ops: u64) -> Vec<u8> {
    let words = size / 8;
    let mut img = vec![0u8; size as usize];
    for (k, w) in img.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&init_word(seed, k as u64).to_le_bytes());
    }
    for n in 0..ops {
        let (k, v) = op(seed, words, n);
        img[(k * 8) as usize..(k * 8 + 8) as usize].copy_from_slice(&v.to_le_bytes());
    }
    img
}

/// The writer's position and timing, shared with its gate's snapshot.
#[derive(Debug, Default)]
struct WriterState {
    ops: AtomicU64,
    last_op_ns: AtomicU64,
    max_gap_ns: AtomicU64,
    /// When the largest gap ended (CLOCK_MONOTONIC, ns).
    max_gap_end_ns: AtomicU64,
    /// When this writer started here (CLOCK_MONOTONIC, ns; 0 at the first source).
    started_ns: u64,
    /// The op count this writer started from (at a destination: the ops at the hand-over).
    resumed_at: u64,
}

impl WriterState {
    fn encode(&self) -> Bytes {
        let mut b = Vec::with_capacity(32);
        for v in [
            &self.ops,
            &self.last_op_ns,
            &self.max_gap_ns,
            &self.max_gap_end_ns,
        ] {
            b.extend_from_slice(&v.load(Ordering::Acquire).to_le_bytes());
        }
        Bytes::from(b)
    }

    fn decode(b: &[u8]) -> WriterState {
        let get = |i: usize| {
            AtomicU64::new(u64::from_le_bytes(
                b.get(i * 8..i * 8 + 8)
                    .and_then(|s| s.try_into().ok())
                    .unwrap_or([0; 8]),
            ))
        };
        let ops = get(0);
        WriterState {
            resumed_at: ops.load(Ordering::Acquire),
            ops,
            last_op_ns: get(1),
            max_gap_ns: get(2),
            max_gap_end_ns: get(3),
            started_ns: monotonic_ns(),
        }
    }
}

struct App {
    region: Arc<Region>,
    gate: Arc<WriterGate>,
    state: Arc<WriterState>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Starts the writer on `region` from `state`.
fn start_app(region: Arc<Region>, state: Arc<WriterState>, seed: u64, rate: u64) -> App {
    let s2 = state.clone();
    let gate = Arc::new(WriterGate::new(move || s2.encode()));
    let (r, g, st) = (region.clone(), gate.clone(), state.clone());
    // Named, so that a trace of a migration can tell the application's thread apart.
    let spawned = std::thread::Builder::new()
        .name("demo-writer".into())
        .spawn(move || {
            let words = r.len() as u64 / 8;
            let mut start = Instant::now();
            let mut base_ops = st.ops.load(Ordering::Acquire);
            loop {
                let pass = match g.enter(Duration::from_millis(50)) {
                    Ok(p) => p,
                    Err(farmap_migrate::suspend::Closed::Retired) => return,
                    Err(farmap_migrate::suspend::Closed::Suspended) => {
                        // Paused (by `verify`): go on at the same rate afterwards, without a
                        // burst to catch up on the time lost.
                        start = Instant::now();
                        base_ops = st.ops.load(Ordering::Acquire);
                        continue;
                    }
                };
                let due = base_ops + (start.elapsed().as_secs_f64() * rate as f64) as u64;
                let mut n = st.ops.load(Ordering::Acquire);
                let batch_end = due.min(n + 64);
                while n < batch_end {
                    let (k, v) = op(seed, words, n);
                    if r.write_at((k * 8) as usize, &v.to_le_bytes()).is_err() {
                        return;
                    }
                    let now = monotonic_ns();
                    let last = st.last_op_ns.swap(now, Ordering::AcqRel);
                    if last != 0 {
                        // Only this thread writes them while it runs.
                        let gap = now.saturating_sub(last);
                        if gap > st.max_gap_ns.load(Ordering::Acquire) {
                            st.max_gap_ns.store(gap, Ordering::Release);
                            st.max_gap_end_ns.store(now, Ordering::Release);
                        }
                    }
                    n += 1;
                    st.ops.store(n, Ordering::Release);
                }
                drop(pass);
                if n >= due {
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
        });
    let thread = spawned.expect("cannot start the demo's writer thread");
    App {
        region,
        gate,
        state,
        thread: Some(thread),
    }
}

fn say(v: Value) {
    println!("{v}");
    let _ = std::io::stdout().flush();
}

/// The demo application as its migration agent sees it.
struct NodeApp {
    app: Arc<parking_lot::Mutex<Option<App>>>,
    seed: u64,
    rate: u64,
    /// Whether the region lives in a store of its own that it syncs to when released.
    synced_store: bool,
    /// The store this node was started with (`--store`): the only shared store it opens for
    /// an instant migration that does not name one.
    approved: Vec<String>,
}

impl agent::App for NodeApp {
    type Dest = Region;

    fn opener(&self) -> farmap_migrate::Opener<Region> {
        farmap_migrate::region_opener()
    }

    fn shared_opener(&self) -> Option<farmap_migrate::SharedOpener> {
        Some(farmap_cli_kit::drive::shared_opener())
    }

    fn approved_shared(&self) -> Vec<String> {
        self.approved.clone()
    }

    fn region(&self) -> Option<(Arc<dyn farmap_migrate::Source>, Arc<dyn Suspend>)> {
        let g = self.app.lock();
        let a = g.as_ref()?;
        // Each migration measures its own largest gap between two writes.
        a.state.max_gap_ns.store(0, Ordering::Release);
        Some((a.region.clone(), a.gate.clone()))
    }

    fn uffd_region(&self) -> Option<Arc<Region>> {
        self.app.lock().as_ref().map(|a| a.region.clone())
    }

    fn released(&self, report: &SeedReport) {
        let taken = self.app.lock().take();
        if let Some(App {
            thread: Some(t),
            region,
            ..
        }) = taken
        {
            let _ = t.join();
            if self.synced_store && report.mode == farmap_migrate::Mode::Instant {
                // The store belongs to the destination now: this side pushes nothing.
                say(json!({"event": "released", "synced": false, "handed_store_over": true}));
            } else if self.synced_store {
                // The writer stopped at the hand-over: the store gets the image it left.
                let synced = region.sync();
                say(json!({
                    "event": "released",
                    "synced": synced.is_ok(),
                    "error": synced.err().map(|e| format!("{:#}", anyhow::Error::new(e))),
                }));
            }
        }
    }

    fn resumer(&self) -> Resumer {
        let (slot, seed, rate) = (self.app.clone(), self.seed, self.rate);
        Box::new(move |region, state| {
            let st = Arc::new(WriterState::decode(&state));
            *slot.lock() = Some(start_app(region, st, seed, rate));
        })
    }

    fn arrived(&self, _: &LeechReport) -> serde_json::Map<String, Value> {
        let gap = self
            .app
            .lock()
            .as_ref()
            .map_or(0, |a| a.state.max_gap_ns.load(Ordering::Acquire));
        let resumed_at = self.app.lock().as_ref().map_or(0, |a| a.state.resumed_at);
        // Where the largest gap ended, from the writer's start here: below 0 at the source
        // (pre-copy), near 0 at the hand-over, above 0 during the post-copy.
        let gap_at = self.app.lock().as_ref().map_or(0.0, |a| {
            let end = a.state.max_gap_end_ns.load(Ordering::Acquire);
            (end as f64 - a.state.started_ns as f64) / 1e6
        });
        let mut m = serde_json::Map::new();
        m.insert(
            "app_max_gap_at_ms".into(),
            json!((gap_at * 100.0).round() / 100.0),
        );
        m.insert("resumed_at_op".into(), json!(resumed_at));
        // The largest gap between two of the writer's writes is what the application felt;
        // `effective_downtime_ms` is its older name, kept as an alias.
        let gap_ms = json!((gap as f64 / 1e4).round() / 100.0);
        m.insert("app_max_gap_ms".into(), gap_ms.clone());
        m.insert("effective_downtime_ms".into(), gap_ms);
        m
    }
}

/// A demo node: one region (or none) with its migration agent; `verify` and `quit` on
/// stdin, JSON lines on stdout.
pub async fn node(args: NodeArgs) -> anyhow::Result<ExitCode> {
    let slot: Arc<parking_lot::Mutex<Option<App>>> = Default::default();
    if args.local.local_max.is_some() {
        // Refused rather than ignored: the region would not be bounded.
        if !args.init {
            bail!(
                "--local-max needs --init: a node without it is a migration destination, and \
                 a region that arrives by migration cannot bound its local memory"
            );
        }
        if args.store.is_some() {
            bail!(
                "--local-max cannot be used with --store: that region is pulled in the \
                 background (managed mode), which bounded local memory does not support"
            );
        }
    }
    if args.init {
        let region = match &args.store {
            None => {
                let geometry = Geometry::with_default_chunk(args.size)?;
                let store: Arc<dyn Store> = Arc::new(farmap::store::MemoryStore::new(geometry));
                Region::open(
                    store,
                    RegionOptions {
                        push: PushOptions {
                            interval: None,
                            ..PushOptions::default()
                        },
                        // A new memory store holds nothing yet.
                        paging: args.local.paging(true)?,
                        ..RegionOptions::direct()
                    },
                )
                .context("opening the node's region")?
            }
            Some(spec) => {
                // Pushed often, so that push rounds and a migration's dirty rounds interleave.
                let opts = RegionOptions {
                    push: PushOptions {
                        interval: Some(Duration::from_millis(50)),
                        ..PushOptions::default()
                    },
                    ..RegionOptions::default()
                };
                let region = farmap::open_region(spec, opts)
                    .with_context(|| format!("opening a region over {spec}"))?;
                anyhow::ensure!(
                    region.len() as u64 == args.size,
                    "{spec} holds {} bytes, not --size {}",
                    region.len(),
                    args.size
                );
                region
            }
        };
        let mut buf = vec![0u8; 1 << 20];
        for off in (0..args.size).step_by(buf.len()) {
            for (i, w) in buf.chunks_exact_mut(8).enumerate() {
                w.copy_from_slice(&init_word(args.seed, off / 8 + i as u64).to_le_bytes());
            }
            region.write_at(off as usize, &buf)?;
        }
        *slot.lock() = Some(start_app(
            Arc::new(region),
            Arc::new(WriterState::default()),
            args.seed,
            args.ops_per_sec,
        ));
    }
    let _agent = agent::serve(
        &args.agent,
        Arc::new(NodeApp {
            app: slot.clone(),
            seed: args.seed,
            rate: args.ops_per_sec,
            synced_store: args.init && args.store.is_some(),
            approved: args.store.iter().map(|s| s.to_secret_string()).collect(),
        }),
    )
    .await
    .with_context(|| format!("starting the agent on {}", args.agent.display()))?;
    say(json!({"event": "ready", "agent": args.agent}));
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        match line.trim() {
            "verify" => {
                let g = slot.lock();
                let Some(a) = g.as_ref() else {
                    say(json!({"event": "verified", "ok": false, "error": "no region here"}));
                    continue;
                };
                Suspend::suspend(&*a.gate).map_err(anyhow::Error::msg)?;
                let ops = a.state.ops.load(Ordering::Acquire);
                let t = Instant::now();
                let expected = expected_image(args.seed, args.size, ops);
                let ok = a.region.memory().to_vec() == expected;
                Suspend::resume(&*a.gate);
                say(json!({"event": "verified", "ok": ok, "ops": ops, "ms": ms(t.elapsed())}));
            }
            "quit" => break,
            other if other.starts_with("verify-except ") => {
                // Byte ranges `START-END,...` left out of the comparison (chunks a migration
                // rolled back to an older version).
                let except = parse_ranges(&other["verify-except ".len()..])?;
                let g = slot.lock();
                let Some(a) = g.as_ref() else {
                    say(json!({"event": "verified", "ok": false, "error": "no region here"}));
                    continue;
                };
                Suspend::suspend(&*a.gate).map_err(anyhow::Error::msg)?;
                let ops = a.state.ops.load(Ordering::Acquire);
                let mut expected = expected_image(args.seed, args.size, ops);
                let mut held = a.region.memory().to_vec();
                Suspend::resume(&*a.gate);
                for r in &except {
                    let r = r.start.min(held.len())..r.end.min(held.len());
                    held[r.clone()].fill(0);
                    expected[r].fill(0);
                }
                let differ = held
                    .chunks(4096)
                    .zip(expected.chunks(4096))
                    .filter(|(a, b)| a != b)
                    .count();
                say(json!({"event": "verified", "ok": differ == 0, "ops": ops,
                           "pages_differing": differ}));
            }
            other if other.starts_with("check-store ") => {
                let ops: u64 = other["check-store ".len()..]
                    .trim()
                    .parse()
                    .context("check-store OPS")?;
                let spec = args.store.as_ref().context("check-store needs --store")?;
                let expected = expected_image(args.seed, args.size, ops);
                let held = read_store(spec, args.size).await;
                say(match held {
                    Ok(held) => {
                        let differ = held
                            .chunks(4096)
                            .zip(expected.chunks(4096))
                            .filter(|(a, b)| a != b)
                            .count();
                        json!({"event": "store-checked", "ok": differ == 0, "ops": ops,
                               "pages_differing": differ})
                    }
                    Err(e) => json!({"event": "store-checked", "ok": false,
                                     "error": format!("{e:#}")}),
                });
            }
            other => bail!("unknown node command {other:?}"),
        }
    }
    let taken = slot.lock().take();
    if let Some(mut a) = taken {
        Suspend::retire(&*a.gate);
        if let Some(t) = a.thread.take() {
            let _ = t.join();
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `START-END,START-END` (bytes, end excluded; empty: none).
fn parse_ranges(text: &str) -> anyhow::Result<Vec<std::ops::Range<usize>>> {
    text.split(',')
        .map(str::trim)
        .filter(|r| !r.is_empty())
        .map(|r| {
            let (a, b) = r
                .split_once('-')
                .with_context(|| format!("{r:?} is not START-END"))?;
            Ok(a.parse()?..b.parse()?)
        })
        .collect()
}

/// The first `size` bytes of the store `spec` names, read by a client of its own.
async fn read_store(spec: &farmap::StoreSpec, size: u64) -> anyhow::Result<Vec<u8>> {
    let store = farmap::spec::open_store_async(spec)
        .await
        .with_context(|| format!("opening {spec}"))?;
    let u = farmap::pipeline::Unaligned::new(store);
    let bytes = u
        .read_bytes(0, size as usize)
        .await
        .with_context(|| format!("reading {spec}"))?;
    Ok(bytes.to_vec())
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e5).round() / 100.0
}

struct Node {
    child: std::process::Child,
    stdin: ChildStdin,
    out: BufReader<ChildStdout>,
    agent: PathBuf,
    name: &'static str,
}

impl Node {
    fn spawn(
        name: &'static str,
        args: &DemoArgs,
        dir: &std::path::Path,
        init: bool,
        store: Option<&str>,
    ) -> anyhow::Result<Node> {
        let exe = std::env::current_exe()?;
        let words = (args.size / 4096) as f64;
        let agent = dir.join(format!("{name}.agent"));
        let mut cmd = Proc::new(exe);
        cmd.arg("__demo-node")
            .args(["--size", &args.size.to_string()])
            .args(["--seed", &args.seed.to_string()])
            .args([
                "--ops-per-sec",
                &((words * args.write_percent / 100.0) as u64)
                    .max(1)
                    .to_string(),
            ])
            .arg("--agent")
            .arg(&agent)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        if init {
            cmd.arg("--init");
        }
        if let Some(spec) = store {
            cmd.args(["--store", spec]);
        }
        let mut child = cmd.spawn().context("starting a demo node")?;
        let mut node = Node {
            stdin: child.stdin.take().expect("piped"),
            out: BufReader::new(child.stdout.take().expect("piped")),
            child,
            agent,
            name,
        };
        node.expect("ready")?;
        Ok(node)
    }

    fn send(&mut self, line: &str) -> anyhow::Result<()> {
        writeln!(self.stdin, "{line}")?;
        Ok(self.stdin.flush()?)
    }

    fn expect(&mut self, event: &str) -> anyhow::Result<Value> {
        let mut line = String::new();
        loop {
            line.clear();
            if self.out.read_line(&mut line)? == 0 {
                bail!(
                    "the {} node exited while the demo waited for '{event}'",
                    self.name
                );
            }
            let Ok(v) = serde_json::from_str::<Value>(&line) else {
                continue;
            };
            if v["event"] == event {
                return Ok(v);
            }
        }
    }
}

fn done(role: &str, outcome: Outcome) -> anyhow::Result<serde_json::Map<String, Value>> {
    match outcome {
        Outcome::Done(m) => Ok(m),
        Outcome::Failed(kind, message) => bail!("the {role} failed ({kind:?}): {message}"),
    }
}

/// A raw TCP stream of `len` bytes through a proxy with `opts` (the link a migration sees),
/// in MB/s: bytes after the receiver's first read over the time they took to arrive.
async fn wire_rate(opts: ProxyOptions, len: u64) -> anyhow::Result<f64> {
    use std::io::Read;
    let sink = std::net::TcpListener::bind("127.0.0.1:0").context("binding a local sink")?;
    let to = sink.local_addr()?;
    let receiver = tokio::task::spawn_blocking(move || {
        let (mut s, _) = sink.accept()?;
        let mut buf = vec![0u8; 1 << 20];
        let (mut got, mut first) = (0u64, None);
        let mut last = Instant::now();
        loop {
            let n = s.read(&mut buf)?;
            if n == 0 {
                break;
            }
            last = Instant::now();
            first.get_or_insert((last, n as u64));
            got += n as u64;
        }
        let (t0, n0) = first.unwrap_or((last, 0));
        anyhow::Ok((got.saturating_sub(n0), last - t0))
    });
    let proxy = Proxy::bind("127.0.0.1:0", to, opts).await?.spawn();
    let via = proxy.local_addr();
    tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(via)?;
        s.set_nodelay(true)?;
        let buf = vec![0x5au8; 1 << 20];
        let mut sent = 0u64;
        while sent < len {
            let n = (len - sent).min(buf.len() as u64) as usize;
            s.write_all(&buf[..n])?;
            sent += n as u64;
        }
        s.shutdown(std::net::Shutdown::Write)?;
        anyhow::Ok(())
    })
    .await
    .context("the wire sender panicked")?
    .context("streaming through the proxy")?;
    let (bytes, took) = receiver
        .await
        .context("the wire receiver panicked")?
        .context("receiving through the proxy")?;
    proxy.shutdown().await;
    Ok((bytes as f64 / took.as_secs_f64().max(1e-9) / 1e6 * 10.0).round() / 10.0)
}

/// Migrates from `src` to `dst` through two proxies (control and data plane), driving both
/// agents as `farmap seed` and `farmap leech` do; returns the leecher's metrics.
async fn migrate_once(
    src: &Node,
    dst: &Node,
    args: &DemoArgs,
) -> anyhow::Result<serde_json::Map<String, Value>> {
    let log = std::env::var_os("FARMAP_DEMO_LOG").is_some();
    let popts = ProxyOptions {
        rtt: args.rtt,
        ..ProxyOptions::default()
    };
    // The wire this migration runs on, measured just before it: a raw TCP stream as long as
    // the region (between 64 MiB and 1 GiB) through a proxy like the data plane's.
    let wire = wire_rate(popts, args.size.clamp(64 << 20, 1 << 30))
        .await
        .context("measuring the wire through the proxy")?;
    let steal_before = host_steal();
    let (ltx, lrx) = tokio::sync::oneshot::channel::<(String, String)>();
    let mut ltx = Some(ltx);
    // A key for this demo's two agents only.
    let key: String = farmap_net::auth::random_nonce()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let seed_req = Request::Seed(SeedRequest {
        listen: "127.0.0.1:0".into(),
        data_listen: "127.0.0.1:0".into(),
        tls: None,
        reconnect_ms: 30_000,
        pull: args.pull.budget(),
        push_budget_ms: 2000,
        key: Some(key.clone()),
    });
    let src_agent = src.agent.clone();
    let seeding = tokio::spawn(async move {
        let ui = Ui {
            prefix: "farmap demo: source",
            notes: log,
            bar: false,
        };
        drive(&src_agent, seed_req, ui, move |c, d| {
            if let Some(tx) = ltx.take() {
                let _ = tx.send((c.to_owned(), d.to_owned()));
            }
        })
        .await
    });
    let Ok((control, data)) = lrx.await else {
        return done("source", seeding.await??).map(|_| Default::default());
    };
    let pc = Proxy::bind("127.0.0.1:0", control.as_str(), popts)
        .await?
        .spawn();
    let pd = Proxy::bind("127.0.0.1:0", data.as_str(), popts)
        .await?
        .spawn();
    let leech_req = Request::Leech(LeechRequest {
        from: pc.local_addr().to_string(),
        data: Some(pd.local_addr().to_string()),
        tls: None,
        max_downtime_us: args.max_downtime.as_micros() as u64,
        max_rounds: Convergence::default().max_rounds,
        workers: 16,
        connections: 4,
        reconnect_ms: 30_000,
        pull: args.pull.budget(),
        mode: args.mode,
        store: None,
        key: Some(key),
    });
    let ui = Ui {
        prefix: "farmap demo: destination",
        notes: log,
        bar: !args.json,
    };
    let leeched = drive(&dst.agent, leech_req, ui, |_, _| {}).await;
    let seeded = seeding.await?;
    pc.shutdown().await;
    pd.shutdown().await;
    let mut line = done("destination", leeched?)?;
    done("source", seeded?)?;
    line.insert("wire_mb_per_s".into(), json!(wire));
    if let (Some(a), Some(b)) = (steal_before, host_steal()) {
        line.insert(
            "steal_ms".into(),
            json!(output::round1(b.saturating_sub(a).as_secs_f64() * 1e3)),
        );
    }
    Ok(line)
}

/// CPU time the hypervisor has taken from this machine's CPUs so far (all CPUs together:
/// the `steal` column of `/proc/stat`'s `cpu` line, in clock ticks of 10 ms), `None` where
/// unreadable. While it is taken, no thread of this machine runs: a gap between the
/// writer's writes that the host made, not farmap.
fn host_steal() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    steal_in(&stat, rustix::param::clock_ticks_per_second())
}

/// The steal time of a `/proc/stat` text whose ticks are `1/hz` s.
fn steal_in(stat: &str, hz: u64) -> Option<Duration> {
    if hz == 0 {
        return None;
    }
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    // cpu user nice system idle iowait irq softirq steal ...
    let ticks: u64 = line.split_whitespace().nth(8)?.parse().ok()?;
    Some(Duration::from_nanos(
        ticks.saturating_mul(1_000_000_000 / hz),
    ))
}

pub async fn run(args: DemoArgs) -> anyhow::Result<ExitCode> {
    eprintln!(
        "farmap demo: a {} MiB region written at {}% of its pages per second migrates over \
         loopback with {} ms round trips, then back",
        args.size >> 20,
        args.write_percent,
        args.rtt.as_secs_f64() * 1e3
    );
    let dir = tempfile::Builder::new()
        .prefix("farmap-demo")
        .tempdir()
        .context("creating a directory for the agents' sockets")?;
    let kind = match (args.store, args.mode) {
        (None, farmap_migrate::Mode::Instant) => Some(DemoStore::Farmap),
        (k, _) => k,
    };
    let shared = match kind {
        Some(k) => Some(start_store(k, args.size).await?),
        None => None,
    };
    let spec = shared.as_ref().map(|s| s.spec.as_str());
    if let Some(spec) = spec {
        eprintln!(
            "farmap demo: the region lives in {spec}; moving it in {} mode",
            args.mode
        );
    }
    let mut a =
        tokio::task::block_in_place(|| Node::spawn("source", &args, dir.path(), true, spec))?;
    let mut b =
        tokio::task::block_in_place(|| Node::spawn("destination", &args, dir.path(), false, spec))?;
    let mut ok = true;
    a.send("verify")?;
    let before = tokio::task::block_in_place(|| a.expect("verified"))?;
    let mut before_ok = before["ok"].as_bool() == Some(true);
    for (direction, from_a) in [("there", true), ("back", false)] {
        let (src, dst) = if from_a {
            (&mut a, &mut b)
        } else {
            (&mut b, &mut a)
        };
        let mut line = migrate_once(src, dst, &args).await?;
        dst.send("verify")?;
        let v = tokio::task::block_in_place(|| dst.expect("verified"))?;
        let verified = before_ok && v["ok"].as_bool() == Some(true);
        before_ok = true;
        ok &= verified;
        let obj = &mut line;
        obj.insert("direction".into(), json!(direction));
        obj.insert("rtt_ms".into(), json!(args.rtt.as_secs_f64() * 1e3));
        obj.insert("verified".into(), json!(verified));
        obj.insert("writer_ops".into(), v["ops"].clone());
        if args.json {
            output::json_line(&line)?;
        } else {
            let g = |k: &str| line[k].clone();
            let gap = line["app_max_gap_ms"].as_f64().unwrap_or(0.0);
            let budget = args.max_downtime.as_secs_f64() * 1e3;
            let wire = line["wire_mb_per_s"].as_f64().unwrap_or(0.0);
            let at_wire_ms = if wire > 0.0 {
                (args.size as f64 / 1e6 / wire * 1e3).round()
            } else {
                0.0
            };
            let steal = line["steal_ms"].as_f64().unwrap_or(0.0);
            println!(
                "{direction:>5}: downtime {} ms (largest gap between writes {} ms{}), total {} ms \
                 (the wire, {} MB/s raw TCP through the proxy, carries the region in {} ms), \
                 {} rounds, pre-copy {} MB + post-copy {} MB of a {} MB region, writer dirtying \
                 {} MB/s, verified: {}",
                g("downtime_ms"),
                g("app_max_gap_ms"),
                match (gap > budget, steal > 0.0) {
                    (true, false) => {
                        format!(": OVER the {budget} ms budget, the application felt the migration")
                    }
                    (true, true) => format!(
                        ": OVER the {budget} ms budget, the application felt the migration; the \
                         hypervisor took {steal} ms of CPU time from this machine meanwhile \
                         (steal time), so part of it may be the host's"
                    ),
                    (false, _) => String::new(),
                },
                g("total_ms"),
                wire,
                at_wire_ms,
                g("rounds"),
                g("bytes_precopy").as_u64().unwrap_or(0) / 1_000_000,
                g("bytes_postcopy").as_u64().unwrap_or(0) / 1_000_000,
                args.size / 1_000_000,
                g("dirty_rate_mb_per_s"),
                verified
            );
            if args.mode == farmap_migrate::Mode::Instant {
                println!(
                    "{direction:>5}: instant: {} bytes before resuming; chunks: {} from the \
                     shared store, {} from the source, {} failed their check",
                    g("bytes_before_resume"),
                    g("chunks_from_store"),
                    g("chunks_from_source"),
                    g("verify_failures")
                );
            }
        }
    }
    for n in [&mut a, &mut b] {
        let _ = n.send("quit");
        let _ = n.child.wait();
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steal_is_the_eighth_value_of_the_cpu_line() {
        let stat = "cpu  4283366 0 626630 2246684 27754 0 19768 79205 0 0\n\
                    cpu0 2115050 0 305254 1163311 10152 0 7990 39599 0 0\n";
        assert_eq!(steal_in(stat, 100), Some(Duration::from_millis(792_050)));
        assert_eq!(steal_in(stat, 0), None);
        // Kernels without the column, or no aggregate line: unknown, not zero.
        assert_eq!(steal_in("cpu  1 2 3 4 5 6 7\n", 100), None);
        assert_eq!(steal_in("cpu0 1 2 3 4 5 6 7 8\n", 100), None);
    }
}
