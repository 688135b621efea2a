//! `farmap __slope-node`: one process of `farmap bench slope` (internal). The destination
//! prints the port it listens on, takes one object, checks it and prints what it found; the
//! source builds the object, runs its load, migrates it and prints the report. One JSON
//! line each on stdout.

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use farmap_arena::allocator_api2::vec::Vec as AVec;
use farmap_arena::{ensure_fixed_image, Arena, ArenaAlloc, ArenaConfig, Member, Obj};
use farmap_net::auth::Key;
use farmap_net::{ListenAddr, RemoteAddr};
use farmap_slope::{migrate, MigrateOptions, MigrationReport, ObjListener};
use serde::{Deserialize, Serialize};

/// The object of the vector cases.
pub type Words = AVec<u64, ArenaAlloc>;

/// `farmap __slope-node` (internal).
#[derive(Debug, Clone, Args)]
pub struct NodeArgs {
    /// `source` or `dest`.
    #[arg(long)]
    pub role: String,
    /// The arena's chunk in bytes.
    #[arg(long)]
    pub chunk: u32,
    /// The migration key, as text.
    #[arg(long)]
    pub key: String,
    /// Source: pages of the vector.
    #[arg(long, default_value_t = 0)]
    pub pages: u64,
    /// Source: a writer thread writes random words during the migration.
    #[arg(long)]
    pub dirty: bool,
    /// Source: the destination's port on loopback.
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// The CPU the node's main thread keeps to (the source's writer keeps to the other).
    #[arg(long)]
    pub cpu: usize,
}

/// What the source prints: the migration's report, and the writer's rates.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct SourceLine {
    #[serde(flatten)]
    pub report: MigrationReport,
    /// Writer ops per thread-CPU second during prefill ÷ before (dirty case).
    pub writer_ops_ratio_during_prefill: Option<f64>,
    /// The same per wall-clock second.
    pub writer_wall_ratio: Option<f64>,
    pub digest: String,
}

/// What the destination prints.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct DestLine {
    pub listening: Option<u16>,
    pub digest: Option<String>,
    pub no_owner_us: Option<f64>,
}

/// The arena of the bench: 4 slots of 1 GiB, one per lease; the source (member 0 of 2)
/// holds slots 0 and 2, the destination 1 and 3.
pub fn arena_config(chunk: u32) -> ArenaConfig {
    ArenaConfig {
        base: 0x1000_0000_0000,
        size: 4 << 30,
        slot_shift: 30,
        lease_slots: 1,
        chunk,
    }
}

fn word(i: u64) -> u64 {
    i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1
}

fn digest(words: &[u64]) -> String {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for w in words {
        h.update(&w.to_le_bytes());
    }
    format!("{:016x}", h.digest())
}

fn pin(cpu: usize) {
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    let _ = rustix::thread::sched_setaffinity(None, &set);
}

fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// Runs a node (before farmap's runtime exists: the node makes its own).
pub fn run(args: NodeArgs) -> ExitCode {
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL)).ok();
    if let Err(e) = ensure_fixed_image() {
        eprintln!("farmap __slope-node: {e}");
        return ExitCode::FAILURE;
    }
    pin(args.cpu);
    let r = match args.role.as_str() {
        "dest" => dest(&args),
        "source" => source(&args),
        r => Err(anyhow::anyhow!("unknown role {r}")),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("farmap __slope-node ({}): {e:#}", args.role);
            ExitCode::FAILURE
        }
    }
}

fn line<T: Serialize>(v: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string(v)?);
    Ok(())
}

fn dest(args: &NodeArgs) -> anyhow::Result<()> {
    let arena = Arc::new(Arena::open(
        arena_config(args.chunk),
        Member { index: 1, count: 2 },
    )?);
    let addr = ListenAddr::Tcp(std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
    let l = ObjListener::bind(&addr, Key::from_secret(args.key.as_bytes()))?;
    let ListenAddr::Tcp(a) = l.local_addr()? else {
        bail!("not TCP")
    };
    line(&DestLine {
        listening: Some(a.port()),
        ..DestLine::default()
    })?;
    let arrival = l.accept(&arena)?;
    let obj = Obj::<Words>::attach(&arena, arrival.slot)?;
    let d = digest(&obj.read().map_err(|e| anyhow::anyhow!("{e}"))?);
    line(&DestLine {
        listening: None,
        digest: Some(d),
        no_owner_us: Some(arrival.no_owner_us),
    })
}

/// Ops of the writer, in a window.
#[derive(Debug, Clone, Copy)]
struct Rate {
    ops: u64,
    cpu: Duration,
    wall: Duration,
}

fn source(args: &NodeArgs) -> anyhow::Result<()> {
    let arena = Arc::new(Arena::open(
        arena_config(args.chunk),
        Member { index: 0, count: 2 },
    )?);
    let n = args.pages * 4096 / 8;
    let obj = Arc::new(Obj::new_in(&arena, || {
        let mut v = AVec::with_capacity_in(n as usize, ArenaAlloc);
        v.extend((0..n).map(word));
        v
    })?);
    // The writer: random words, as fast as it can; it measures itself before and during.
    let started = Arc::new(AtomicBool::new(false));
    let writer = args.dirty.then(|| {
        let (obj, started) = (obj.clone(), started.clone());
        let other = if args.cpu == 0 { 1 } else { 0 };
        std::thread::spawn(move || -> anyhow::Result<(Rate, Rate, String)> {
            pin(other);
            let mut x = 0x2545_f491_4f6c_dd1du64;
            let mut step = |v: &mut Words| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let i = (x % n) as usize;
                v[i] = v[i].wrapping_add(x | 1);
            };
            let window = |ops: u64, c0: Duration, w0: Instant| Rate {
                ops,
                cpu: thread_cpu() - c0,
                wall: w0.elapsed(),
            };
            let (c0, w0) = (thread_cpu(), Instant::now());
            let mut ops = 0;
            while w0.elapsed() < Duration::from_secs(1) {
                let mut v = obj.write().map_err(|e| anyhow::anyhow!("{e}"))?;
                for _ in 0..256 {
                    step(&mut v);
                }
                ops += 256;
            }
            let before = window(ops, c0, w0);
            started.store(true, Ordering::Release);
            let (c1, w1) = (thread_cpu(), Instant::now());
            let mut ops = 0;
            while let Ok(mut v) = obj.write() {
                for _ in 0..256 {
                    step(&mut v);
                }
                ops += 256;
            }
            let during = window(ops, c1, w1);
            let d = digest(
                &obj.read()
                    .map_err(|e| anyhow::anyhow!("reads closed early: {e}"))?,
            );
            Ok((before, during, d))
        })
    });
    if writer.is_some() {
        while !started.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let d_clean = if writer.is_none() {
        Some(digest(&obj.read().map_err(|e| anyhow::anyhow!("{e}"))?))
    } else {
        None
    };
    let to = RemoteAddr::Tcp(format!("127.0.0.1:{}", args.port));
    let report = migrate(
        &obj,
        &to,
        &MigrateOptions::new(Key::from_secret(args.key.as_bytes())),
    )
    .context("migrating the object")?;
    let (ratio, wall_ratio, digest) = match writer {
        Some(w) => {
            let (before, during, d) = w
                .join()
                .map_err(|_| anyhow::anyhow!("the writer panicked"))??;
            let per = |r: Rate, t: Duration| r.ops as f64 / t.as_secs_f64().max(1e-9);
            (
                Some(per(during, during.cpu) / per(before, before.cpu)),
                Some(per(during, during.wall) / per(before, before.wall)),
                d,
            )
        }
        None => (None, None, d_clean.unwrap_or_default()),
    };
    line(&SourceLine {
        report,
        writer_ops_ratio_during_prefill: ratio,
        writer_wall_ratio: wall_ratio,
        digest,
    })
}
