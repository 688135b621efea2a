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
use std::process::{ChildStdin, ChildStdout, Command as Proc, ExitCode, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::Args;
use farmap::pipeline::PushOptions;
use farmap::{parse_size, Geometry, Store};
use farmap_migrate::leech::{leech, LeechOptions};
use farmap_migrate::seed::{seed, SeedOptions};
use farmap_migrate::{monotonic_ns, Convergence, WriterGate};
use farmap_net::proxy::{Proxy, ProxyOptions};
use farmap_net::RemoteAddr;
use farmap_uffd::{Region, RegionOptions};
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
}

#[derive(Debug, Args)]
pub struct NodeArgs {
    #[arg(long)]
    size: u64,
    #[arg(long)]
    seed: u64,
    #[arg(long)]
    ops_per_sec: u64,
    #[arg(long, value_parser = parse_duration)]
    max_downtime: Duration,
    /// Create the region and start the writer at once.
    #[arg(long)]
    init: bool,
}

pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .map_or((s, "ms"), |i| s.split_at(i));
    let v: f64 = num.parse().map_err(|_| format!("not a duration: {s}"))?;
    let ms = match unit {
        "us" | "µs" => v / 1e3,
        "ms" => v,
        "s" => v * 1e3,
        _ => return Err(format!("unknown unit in {s} (use us, ms or s)")),
    };
    Ok(Duration::from_secs_f64(ms / 1e3))
}

fn parse_size_arg(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}

// ---- the workload: pure functions of (seed, op) -------------------------------------------

fn mix(mut z: u64) -> u64 {
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
}

impl WriterState {
    fn encode(&self) -> Bytes {
        let mut b = Vec::with_capacity(24);
        for v in [&self.ops, &self.last_op_ns, &self.max_gap_ns] {
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
        WriterState {
            ops: get(0),
            last_op_ns: get(1),
            max_gap_ns: get(2),
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
    let thread = std::thread::spawn(move || {
        let words = r.len() as u64 / 8;
        let start = Instant::now();
        let base_ops = st.ops.load(Ordering::Acquire);
        loop {
            let pass = match g.enter(Duration::from_millis(50)) {
                Ok(p) => p,
                Err(farmap_migrate::suspend::Closed::Retired) => return,
                Err(farmap_migrate::suspend::Closed::Suspended) => continue,
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
                    st.max_gap_ns
                        .fetch_max(now.saturating_sub(last), Ordering::AcqRel);
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

/// A demo node: one region (or none), commands on stdin, JSON lines on stdout.
pub async fn node(args: NodeArgs) -> anyhow::Result<ExitCode> {
    let mut app: Option<App> = None;
    if args.init {
        let geometry = Geometry::with_default_chunk(args.size)?;
        let store: Arc<dyn Store> = Arc::new(farmap::store::MemoryStore::new(geometry));
        let region = Region::open(
            store,
            RegionOptions {
                push: PushOptions {
                    interval: None,
                    ..PushOptions::default()
                },
                ..RegionOptions::direct()
            },
        )?;
        let mut buf = vec![0u8; 1 << 20];
        for off in (0..args.size).step_by(buf.len()) {
            for (i, w) in buf.chunks_exact_mut(8).enumerate() {
                w.copy_from_slice(&init_word(args.seed, off / 8 + i as u64).to_le_bytes());
            }
            region.write_at(off as usize, &buf)?;
        }
        app = Some(start_app(
            Arc::new(region),
            Arc::new(WriterState::default()),
            args.seed,
            args.ops_per_sec,
        ));
    }
    let mut lines = BufReader::new(std::io::stdin()).lines();
    while let Some(line) = lines.next().transpose()? {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["seed"] => {
                let a = app.take().context("no region to seed")?;
                a.state.max_gap_ns.store(0, Ordering::Release);
                let seeding = seed(
                    a.region.clone(),
                    a.gate.clone(),
                    SeedOptions {
                        listen: "127.0.0.1:0".parse()?,
                        data_listen: "127.0.0.1:0".parse()?,
                        tls: None,
                        reconnect_wait: Duration::from_secs(30),
                        log: std::env::var_os("FARMAP_DEMO_LOG").is_some(),
                    },
                )
                .await?;
                say(
                    json!({"event": "listening", "control": seeding.control.to_string(),
                           "data": seeding.data.to_string()}),
                );
                let report = seeding.finish().await?;
                let App { region, thread, .. } = a;
                if let Some(t) = thread {
                    let _ = t.join();
                }
                drop(region);
                say(json!({"event": "seeded", "dirty_sets": report.dirty_sets}));
            }
            ["leech", control, data] => {
                let (tx, rx) = tokio::sync::watch::channel(false);
                let started: Arc<parking_lot::Mutex<Option<App>>> = Default::default();
                let s2 = started.clone();
                let (seed_v, rate) = (args.seed, args.ops_per_sec);
                let opts = LeechOptions {
                    data: Some(RemoteAddr::Tcp(data.to_string())),
                    convergence: Convergence {
                        max_downtime: args.max_downtime,
                        ..Convergence::default()
                    },
                    log: std::env::var_os("FARMAP_DEMO_LOG").is_some(),
                    ..LeechOptions::new(RemoteAddr::Tcp(control.to_string()))
                };
                let report = leech(
                    opts,
                    Box::new(move |region, state| {
                        let st = Arc::new(WriterState::decode(&state));
                        *s2.lock() = Some(start_app(region, st, seed_v, rate));
                    }),
                    rx,
                )
                .await?;
                drop(tx);
                let a = started
                    .lock()
                    .take()
                    .context("the application was not resumed")?;
                let effective = a.state.max_gap_ns.load(Ordering::Acquire);
                say(json!({
                    "event": "leeched",
                    "downtime_ms": ms(report.downtime),
                    "effective_downtime_ms": (effective as f64 / 1e4).round() / 100.0,
                    "total_ms": ms(report.total),
                    "postcopy_ms": ms(report.postcopy),
                    "bytes_precopy": report.bytes_precopy,
                    "bytes_postcopy": report.bytes_postcopy,
                    "rounds": report.rounds,
                    "final_dirty_pages": report.final_pages,
                    "dirty_rate_mb_per_s": output::round1(report.dirty_rate / 1e6),
                    "region_bytes": report.region.len(),
                }));
                app = Some(a);
            }
            ["verify"] => {
                let a = app.as_ref().context("no region to verify")?;
                farmap_migrate::Suspend::suspend(&*a.gate).map_err(anyhow::Error::msg)?;
                let ops = a.state.ops.load(Ordering::Acquire);
                let t = Instant::now();
                let expected = expected_image(args.seed, args.size, ops);
                let ok = a.region.as_slice() == expected.as_slice();
                farmap_migrate::Suspend::resume(&*a.gate);
                say(json!({"event": "verified", "ok": ok, "ops": ops, "ms": ms(t.elapsed())}));
            }
            ["quit"] => break,
            other => bail!("unknown node command {other:?}"),
        }
    }
    if let Some(mut a) = app {
        farmap_migrate::Suspend::retire(&*a.gate);
        if let Some(t) = a.thread.take() {
            let _ = t.join();
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e5).round() / 100.0
}

struct Node {
    child: std::process::Child,
    stdin: ChildStdin,
    out: BufReader<ChildStdout>,
    name: &'static str,
}

impl Node {
    fn spawn(name: &'static str, args: &DemoArgs, init: bool) -> anyhow::Result<Node> {
        let exe = std::env::current_exe()?;
        let words = (args.size / 4096) as f64;
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
            .args([
                "--max-downtime",
                &format!("{}us", args.max_downtime.as_micros()),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        if init {
            cmd.arg("--init");
        }
        let mut child = cmd.spawn().context("starting a demo node")?;
        Ok(Node {
            stdin: child.stdin.take().expect("piped"),
            out: BufReader::new(child.stdout.take().expect("piped")),
            child,
            name,
        })
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

/// Blocking: migrates from `src` to `dst` through two proxies; returns the leecher's line.
async fn migrate_once(src: &mut Node, dst: &mut Node, rtt: Duration) -> anyhow::Result<Value> {
    src.send("seed")?;
    let l = src.expect("listening")?;
    let popts = ProxyOptions {
        rtt,
        ..ProxyOptions::default()
    };
    let control = l["control"].as_str().context("control address")?.to_owned();
    let data = l["data"].as_str().context("data address")?.to_owned();
    let pc = Proxy::bind("127.0.0.1:0", control.as_str(), popts)
        .await?
        .spawn();
    let pd = Proxy::bind("127.0.0.1:0", data.as_str(), popts)
        .await?
        .spawn();
    dst.send(&format!("leech {} {}", pc.local_addr(), pd.local_addr()))?;
    let (src_done, dst_line) = tokio::task::block_in_place(|| {
        let d = dst.expect("leeched");
        let s = src.expect("seeded");
        (s, d)
    });
    src_done?;
    let line = dst_line?;
    pc.shutdown().await;
    pd.shutdown().await;
    Ok(line)
}

pub async fn run(args: DemoArgs) -> anyhow::Result<ExitCode> {
    eprintln!(
        "farmap demo: a {} MiB region written at {}% of its pages per second migrates over \
         loopback with {} ms round trips, then back",
        args.size >> 20,
        args.write_percent,
        args.rtt.as_secs_f64() * 1e3
    );
    let mut a = Node::spawn("source", &args, true)?;
    let mut b = Node::spawn("destination", &args, false)?;
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
        let bar = output::byte_bar(args.size, &format!("migrating {direction}"), args.json);
        let mut line = migrate_once(src, dst, args.rtt).await?;
        bar.finish_and_clear();
        dst.send("verify")?;
        let v = tokio::task::block_in_place(|| dst.expect("verified"))?;
        let verified = before_ok && v["ok"].as_bool() == Some(true);
        before_ok = true;
        ok &= verified;
        let obj = line.as_object_mut().context("metrics object")?;
        obj.remove("event");
        obj.insert("direction".into(), json!(direction));
        obj.insert("rtt_ms".into(), json!(args.rtt.as_secs_f64() * 1e3));
        obj.insert("verified".into(), json!(verified));
        obj.insert("writer_ops".into(), v["ops"].clone());
        if args.json {
            output::json_line(&line)?;
        } else {
            let g = |k: &str| line[k].clone();
            println!(
                "{direction:>5}: downtime {} ms (largest gap between writes {} ms), total {} ms, \
                 {} rounds, pre-copy {} MB + post-copy {} MB of a {} MB region, writer dirtying \
                 {} MB/s, verified: {}",
                g("downtime_ms"),
                g("effective_downtime_ms"),
                g("total_ms"),
                g("rounds"),
                g("bytes_precopy").as_u64().unwrap_or(0) / 1_000_000,
                g("bytes_postcopy").as_u64().unwrap_or(0) / 1_000_000,
                args.size / 1_000_000,
                g("dirty_rate_mb_per_s"),
                verified
            );
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
