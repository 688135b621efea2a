//! Direct and managed read throughput of a region in MinIO (started here by
//! scripts/services/minio.sh), one JSON line per case:
//!
//! - `direct-read`: one chunk at a time, in order (what a direct mount does on a sequential
//!   scan);
//! - `managed-read`: `Cached` over a dense local store with a `Puller` of `WORKERS` workers,
//!   from the first request to the last chunk stored locally, then checked against the source.
//!
//! Setup (filling the region with random data) is not timed. Run it in release mode:
//! `cargo run --release -p farmap-s3 --example s3_read_bench -- [SIZE_MIB] [CHUNK_KIB] [WORKERS]`
//! (defaults: 256 MiB, 64 KiB, 64). `farmap bench stores --store s3://...` measures the same
//! through the CLI.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use farmap_core::{Geometry, Store};
use farmap_pipeline::{Cached, PullOptions, PullOrder, Puller};
use farmap_s3::{S3Location, S3Options, S3Store};
use farmap_store::DenseMemoryStore;
use futures::stream::{self, StreamExt, TryStreamExt};

/// CPU seconds (user + system) used so far by process `pid` (`self` for this one), from
/// `/proc/PID/stat` (clock ticks of 10 ms).
fn cpu_secs(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which is in parentheses and may hold spaces).
    let after = stat.rsplit_once(')').map(|(_, a)| a).unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    (ticks(11) + ticks(12)) / 100.0
}

/// The pid of the MinIO server whose data lives under `dir`.
fn minio_pid(dir: &std::path::Path) -> String {
    let out = std::process::Command::new("pgrep")
        .args([
            "-f",
            &format!("minio server {}", dir.join("data").display()),
        ])
        .output()
        .expect("pgrep");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .unwrap_or("0")
        .to_owned()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let arg = |i: usize, default: u64| -> u64 {
        std::env::args()
            .nth(i)
            .map(|a| a.parse().expect("a whole number"))
            .unwrap_or(default)
    };
    let (size_mib, chunk_kib, workers) = (arg(1, 256), arg(2, 64), arg(3, 64) as usize);
    let svc = farmap_testkit::Service::start("minio", &[])?;
    let g = Geometry::new(size_mib << 20, chunk_kib << 10)?;
    let mut loc = S3Location::parse(&format!("//{}/bench", svc.var("BUCKET")))?;
    loc.set("endpoint", svc.var("ENDPOINT"))?;
    loc.set("connections", &workers.to_string())?;
    let env = |k: &str| match k {
        "AWS_ACCESS_KEY_ID" => Some(svc.var("ACCESS_KEY").to_owned()),
        "AWS_SECRET_ACCESS_KEY" => Some(svc.var("SECRET_KEY").to_owned()),
        _ => None,
    };
    let s3: Arc<dyn Store> = Arc::new(
        S3Store::open_with_env(
            S3Options {
                location: loc,
                size: Some(g.size()),
                chunk_size: Some(g.chunk_size()),
                read_only: false,
            },
            &env,
        )
        .await?,
    );
    // Setup: random data, many writes at once.
    let source = Arc::new(DenseMemoryStore::new(g));
    let mut x = farmap_testkit::XorShift(0x2545_f491_4f6c_dd1d);
    for idx in g.all().iter() {
        let mut buf = vec![0u8; g.chunk_len(idx)];
        for (b, x) in buf.iter_mut().zip(&mut x) {
            *b = (x >> 24) as u8;
        }
        source.write(idx, Bytes::from(buf)).await?;
    }
    stream::iter(g.all().iter())
        .map(|idx| {
            let (s3, source) = (s3.clone(), source.clone());
            async move { s3.write(idx, source.read(idx).await?).await }
        })
        .buffer_unordered(workers)
        .try_collect::<()>()
        .await?;
    let mb = g.size() as f64 / 1e6;
    let server = minio_pid(svc.dir());
    let cpu = || (cpu_secs("self"), cpu_secs(&server));
    let line = |case: &str, secs: f64, verified: bool, cpu0: (f64, f64)| {
        let cpu1 = cpu();
        println!(
            "{{\"bench\":\"s3-read\",\"case\":\"{case}\",\"size_bytes\":{},\"chunk_bytes\":{},\
             \"workers\":{},\"elapsed_ms\":{:.1},\"mb_per_s\":{:.1},\"verified\":{verified},\
             \"client_cpu_s\":{:.2},\"server_cpu_s\":{:.2}}}",
            g.size(),
            g.chunk_size(),
            if case == "direct-read" { 1 } else { workers },
            secs * 1e3,
            mb / secs,
            cpu1.0 - cpu0.0,
            cpu1.1 - cpu0.1,
        )
    };
    // Direct: one chunk at a time.
    let cpu0 = cpu();
    let started = Instant::now();
    let mut verified = true;
    for idx in g.all().iter() {
        let got = s3.read(idx).await?;
        verified &= got == source.read(idx).await?;
    }
    line(
        "direct-read",
        started.elapsed().as_secs_f64(),
        verified,
        cpu0,
    );
    // Managed: Cached + Puller.
    let cached = Arc::new(Cached::new(DenseMemoryStore::new(g), s3.clone())?);
    let cpu0 = cpu();
    let started = Instant::now();
    let puller = Puller::start(
        cached.clone(),
        PullOptions {
            workers,
            order: PullOrder::Sequential,
            ..PullOptions::default()
        },
    );
    let report = puller.wait().await;
    let secs = started.elapsed().as_secs_f64();
    let cpu_pulled = cpu();
    let mut verified = report.is_complete();
    for idx in g.all().iter() {
        verified &= cached.local().read(idx).await? == source.read(idx).await?;
    }
    // CPU of the pull only (the check after it is not the pull's).
    let check = (cpu().0 - cpu_pulled.0, 0.0);
    line("managed-read", secs, verified, (cpu0.0 + check.0, cpu0.1));
    svc.stop();
    Ok(())
}
