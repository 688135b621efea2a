//! `farmap bench nbd`: farmap's NBD server against `nbdkit memory` and `qemu-nbd` on a file
//! in /dev/shm, measured in the same run with the same clients.
//!
//! Cases, one JSON line per server and case with `--json`:
//! - `seq-write`: `nbdcopy` of `--size` random bytes from /dev/shm into the export
//!   (`seq_write_mb_per_s`); this also fills the export for the reads.
//! - `seq-read`: `nbdcopy` of the export to `null:` (`seq_read_mb_per_s`).
//! - `randread-qd1`, `randread-qd16`: fio's nbd engine, 4 KiB random reads at queue depth 1
//!   and 16 for `--runtime` (`iops`, `p50_us`, `p99_us` of completion latency).
//!
//! Servers are started and filled before anything is timed; farmap serves a memory store
//! from this process.

use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use farmap::Geometry;
use farmap_nbd::{serve_nbd, Export, NbdServeOptions};
use farmap_net::{ListenAddr, Listener};
use serde::Serialize;

use super::common::{parse_duration, parse_size_arg};
use crate::output;

#[derive(Debug, Args)]
pub struct NbdArgs {
    /// Size of each export (and of each sequential copy).
    #[arg(long, default_value = "256MiB", value_parser = parse_size_arg)]
    size: u64,
    /// Time each fio case runs.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    runtime: Duration,
    /// Servers to measure, comma-separated (farmap, nbdkit, qemu-nbd).
    #[arg(long, default_value = "farmap,nbdkit,qemu-nbd", value_delimiter = ',')]
    servers: Vec<String>,
    /// One JSON object per server and case on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct SeqResult {
    bench: &'static str,
    server: String,
    case: &'static str,
    bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    seq_read_mb_per_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    seq_write_mb_per_s: Option<f64>,
    elapsed_ms: f64,
}

#[derive(Debug, Serialize)]
struct RandResult {
    bench: &'static str,
    server: String,
    case: &'static str,
    iodepth: u32,
    iops: f64,
    p50_us: f64,
    p99_us: f64,
}

/// A server under test: its URI and what keeps it alive.
struct Running {
    name: String,
    uri: String,
    child: Option<Child>,
    farmap: Option<farmap_nbd::NbdServer>,
    _file: Option<tempfile::NamedTempFile>,
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

fn wait_port(port: u16, what: &str) -> anyhow::Result<()> {
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    for _ in 0..200 {
        if TcpStream::connect(addr).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    bail!("{what} did not start listening on {addr}")
}

fn spawn(cmd: &str, args: &[String]) -> anyhow::Result<Child> {
    Command::new(cmd)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("cannot run {cmd} (Debian: apt-get install nbdkit qemu-utils)"))
}

/// The external server `name`, started as `child` on `port` (serving `file`, if any), once it
/// accepts connections.
fn external(
    name: &str,
    port: u16,
    child: Child,
    file: Option<tempfile::NamedTempFile>,
) -> anyhow::Result<Running> {
    let r = Running {
        name: name.into(),
        uri: format!("nbd://127.0.0.1:{port}/"),
        child: Some(child),
        farmap: None,
        _file: file,
    };
    wait_port(port, name)?;
    Ok(r)
}

async fn start(name: &str, size: u64) -> anyhow::Result<Running> {
    match name {
        "farmap" => {
            let store: Arc<dyn farmap::Store> =
                Arc::new(farmap::store::MemoryStore::new(Geometry::new(size, 65536)?));
            let listener = Listener::bind(&"127.0.0.1:0".parse::<ListenAddr>()?).await?;
            let opts = NbdServeOptions {
                log: false,
                ..NbdServeOptions::default()
            };
            let export = Export {
                name: String::new(),
                description: "bench".into(),
                store,
                read_only: false,
            };
            let server = serve_nbd(vec![export], listener, opts)?;
            let uri = format!("nbd://{}/", server.local_addr());
            Ok(Running {
                name: name.into(),
                uri,
                child: None,
                farmap: Some(server),
                _file: None,
            })
        }
        "nbdkit" => {
            let port = free_port()?;
            let child = spawn(
                "nbdkit",
                &[
                    "-f".into(),
                    "--exit-with-parent".into(),
                    "-i".into(),
                    "127.0.0.1".into(),
                    "-p".into(),
                    port.to_string(),
                    "memory".into(),
                    size.to_string(),
                ],
            )?;
            external(name, port, child, None)
        }
        "qemu-nbd" => {
            let port = free_port()?;
            let file = tempfile::NamedTempFile::new_in("/dev/shm")
                .context("creating the qemu-nbd file in /dev/shm")?;
            file.as_file().set_len(size)?;
            let child = spawn(
                "qemu-nbd",
                &[
                    "-f".into(),
                    "raw".into(),
                    "-b".into(),
                    "127.0.0.1".into(),
                    "-p".into(),
                    port.to_string(),
                    "-x".into(),
                    String::new(),
                    "--persistent".into(),
                    "--shared=64".into(),
                    "--cache=writeback".into(),
                    file.path().display().to_string(),
                ],
            )?;
            external(name, port, child, Some(file))
        }
        other => bail!("unknown server {other:?}: farmap, nbdkit or qemu-nbd"),
    }
}

/// Runs a command on a blocking thread; its stdout, or an error with its stderr.
async fn run(cmd: &str, args: Vec<String>) -> anyhow::Result<String> {
    let c = cmd.to_owned();
    let out = tokio::task::spawn_blocking(move || Command::new(&c).args(&args).output())
        .await?
        .with_context(|| format!("cannot run {cmd}"))?;
    if !out.status.success() {
        bail!(
            "{cmd} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

async fn timed_copy(from: &str, to: &str) -> anyhow::Result<Duration> {
    let t = Instant::now();
    run("nbdcopy", vec![from.into(), to.into()]).await?;
    Ok(t.elapsed())
}

/// (iops, p50 µs, p99 µs) of 4 KiB random reads at `depth`.
async fn fio(
    uri: &str,
    size: u64,
    depth: u32,
    runtime: Duration,
) -> anyhow::Result<(f64, f64, f64)> {
    let out = run(
        "fio",
        vec![
            "--name=randread".into(),
            "--ioengine=nbd".into(),
            format!("--uri={uri}"),
            "--rw=randread".into(),
            "--bs=4k".into(),
            format!("--size={size}"),
            format!("--iodepth={depth}"),
            "--time_based".into(),
            format!("--runtime={}ms", runtime.as_millis()),
            "--ramp_time=1s".into(),
            "--norandommap".into(),
            "--output-format=json".into(),
        ],
    )
    .await?;
    // fio may print notes ("fio: connected to NBD server") before its JSON.
    let json = out.find('{').map_or("", |at| &out[at..]);
    let v: serde_json::Value = serde_json::from_str(json).context("parsing fio's JSON")?;
    let read = &v["jobs"][0]["read"];
    let iops = read["iops"].as_f64().context("fio gave no iops")?;
    let pct = &read["clat_ns"]["percentile"];
    let p = |k: &str| pct[k].as_f64().map(|ns| output::round1(ns / 1e3));
    Ok((
        output::round1(iops),
        p("50.000000").context("fio gave no p50")?,
        p("99.000000").context("fio gave no p99")?,
    ))
}

pub async fn run_bench(args: NbdArgs) -> anyhow::Result<ExitCode> {
    let src = tempfile::NamedTempFile::new_in("/dev/shm").context("a source file in /dev/shm")?;
    {
        use rand::{RngCore, SeedableRng};
        use std::io::Write;
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        let mut w = std::io::BufWriter::new(src.as_file());
        let mut buf = vec![0u8; 1 << 20];
        let mut left = args.size;
        while left > 0 {
            rng.fill_bytes(&mut buf);
            let n = left.min(buf.len() as u64) as usize;
            w.write_all(&buf[..n])?;
            left -= n as u64;
        }
    }
    let src_path = src.path().display().to_string();
    for name in &args.servers {
        let mut server = start(name, args.size).await?;
        let write = timed_copy(&src_path, &server.uri).await?;
        let read = timed_copy(&server.uri, "null:").await?;
        for (case, d) in [("seq-write", write), ("seq-read", read)] {
            let mb = output::mb_per_s(args.size, d);
            let r = SeqResult {
                bench: "nbd",
                server: server.name.clone(),
                case,
                bytes: args.size,
                seq_read_mb_per_s: (case == "seq-read").then_some(mb),
                seq_write_mb_per_s: (case == "seq-write").then_some(mb),
                elapsed_ms: output::round1(d.as_secs_f64() * 1e3),
            };
            if args.json {
                output::json_line(&r)?;
            } else {
                println!("{:<9} {case:<13} {mb:>9.1} MB/s", server.name);
            }
        }
        for (case, depth) in [("randread-qd1", 1), ("randread-qd16", 16)] {
            let (iops, p50, p99) = fio(&server.uri, args.size, depth, args.runtime).await?;
            let r = RandResult {
                bench: "nbd",
                server: server.name.clone(),
                case,
                iodepth: depth,
                iops,
                p50_us: p50,
                p99_us: p99,
            };
            if args.json {
                output::json_line(&r)?;
            } else {
                println!(
                    "{:<9} {case:<13} {iops:>9.0} IOPS  p50 {p50:>7.1} µs  p99 {p99:>7.1} µs",
                    server.name
                );
            }
        }
        if let Some(s) = server.farmap.take() {
            s.shutdown().await?;
        }
    }
    Ok(ExitCode::SUCCESS)
}
