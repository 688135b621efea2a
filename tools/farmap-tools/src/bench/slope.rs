//! `farmap bench slope`: object migration (farmap-slope) between two processes of one
//! arena on this host, each kept to a CPU (`farmap __slope-node`): the destination on CPU 1,
//! the source's migration thread on CPU 1 and its writer on CPU 0.
//!
//! Cases:
//! - `vector-clean`: a vector of `--pages` pages of words, nobody writing during the
//!   migration: prefill rate and the no-owner window of a quiet object.
//! - `vector-dirty`: the same, with a writer thread writing random words as fast as it can
//!   from a second before the migration until writes close: its ops per thread-CPU second
//!   during prefill against before (`writer_ops_ratio_during_prefill`; per wall second:
//!   `writer_wall_ratio`), and the windows with dirty rounds.
//!
//! Reference in the same run: `tcp_raw_mb_per_s`, the same bytes through a loopback TCP
//! socket between two threads of this process. `verified`: the destination's vector hashes
//! the same as the source's once writes stopped.

use std::io::{BufRead, BufReader};
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use serde::Serialize;

use super::common::parse_size_arg;
use super::slope_node::{DestLine, SourceLine};

/// One case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Case {
    /// A vector nobody writes during the migration.
    #[value(name = "vector-clean")]
    VectorClean,
    /// A vector a thread writes during the migration.
    #[value(name = "vector-dirty")]
    VectorDirty,
}

impl Case {
    fn name(self) -> &'static str {
        match self {
            Case::VectorClean => "vector-clean",
            Case::VectorDirty => "vector-dirty",
        }
    }
}

/// `farmap bench slope`.
#[derive(Debug, Args)]
pub struct SlopeArgs {
    /// Cases to run.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "vector-clean,vector-dirty"
    )]
    case: Vec<Case>,
    /// Object sizes, in pages of 4 KiB.
    #[arg(long, value_delimiter = ',', default_value = "1000,10000,100000")]
    pages: Vec<u64>,
    /// The arena's chunk sizes (the unit a fault fetches at the destination).
    #[arg(long, value_delimiter = ',', value_parser = parse_size_arg, default_value = "4KiB,64KiB")]
    page: Vec<u64>,
    /// Runs of each case and size.
    #[arg(long, default_value_t = 3)]
    runs: u32,
    /// One JSON object per line on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Row {
    bench: &'static str,
    object: &'static str,
    pages: u64,
    /// The `--pages` this row was asked for (`pages` is the page set found).
    pages_asked: u64,
    page_bytes: u64,
    run: u32,
    prefill_ms: f64,
    prefill_mb_per_s: f64,
    tcp_raw_mb_per_s: f64,
    no_owner_us: f64,
    read_unavailable_ms: f64,
    write_unavailable_ms: f64,
    writer_ops_ratio_during_prefill: Option<f64>,
    writer_wall_ratio: Option<f64>,
    end_to_end_ms: f64,
    rounds: u32,
    final_dirty_pages: u64,
    /// Bytes of every frame the destination received.
    bytes_moved: u64,
    /// Pages of the page set and pages sent again, in bytes.
    bytes_expected: u64,
    owned_bytes: u64,
    resent_dirty_bytes: u64,
    bytes_ratio: f64,
    verified: bool,
}

pub async fn run(args: SlopeArgs) -> anyhow::Result<ExitCode> {
    tokio::task::spawn_blocking(move || run_blocking(&args)).await?
}

fn run_blocking(args: &SlopeArgs) -> anyhow::Result<ExitCode> {
    if farmap_uffd::probe().is_err() {
        bail!(
            "userfaultfd is not available here: {:?}",
            farmap_uffd::probe().err()
        );
    }
    let mut all_verified = true;
    for &page in &args.page {
        for &case in &args.case {
            for &pages in &args.pages {
                let tcp = tcp_raw_mb_per_s(pages * 4096)?;
                for run in 1..=args.runs {
                    let row = one(case, pages, page, run, tcp)?;
                    all_verified &= row.verified;
                    if args.json {
                        println!("{}", serde_json::to_string(&row)?);
                    } else {
                        println!(
                            "{:<12} {:>6} pages, chunk {:>5}: prefill {:.1} ms ({:.0} MB/s; tcp {:.0}), \
                             no owner {:.0} µs, reads {:.2} ms, writes {:.2} ms unavailable, \
                             writer ×{} per CPU s, {} rounds, {} final pages{}",
                            row.object,
                            row.pages,
                            row.page_bytes,
                            row.prefill_ms,
                            row.prefill_mb_per_s,
                            row.tcp_raw_mb_per_s,
                            row.no_owner_us,
                            row.read_unavailable_ms,
                            row.write_unavailable_ms,
                            row.writer_ops_ratio_during_prefill.map_or("-".into(), |r| format!("{r:.2}")),
                            row.rounds,
                            row.final_dirty_pages,
                            if row.verified { "" } else { "  NOT VERIFIED" },
                        );
                    }
                }
            }
        }
    }
    Ok(if all_verified {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn node(role: &str, chunk: u64, key: &str, cpu: usize) -> Command {
    let mut c = Command::new(std::env::current_exe().expect("this executable"));
    c.args([
        "__slope-node",
        "--role",
        role,
        "--chunk",
        &chunk.to_string(),
        "--key",
        key,
    ])
    .args(["--cpu", &cpu.to_string()])
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    c
}

fn one(case: Case, pages: u64, chunk: u64, run: u32, tcp: f64) -> anyhow::Result<Row> {
    let key = format!("bench-slope-{}-{:?}", std::process::id(), Instant::now());
    let mut dest = node("dest", chunk, &key, 1)
        .spawn()
        .context("starting the destination node")?;
    let mut out = BufReader::new(dest.stdout.take().expect("piped"));
    let mut l = String::new();
    out.read_line(&mut l)?;
    let port = serde_json::from_str::<DestLine>(&l)
        .ok()
        .and_then(|d| d.listening)
        .with_context(|| format!("the destination node said {l:?}"))?;
    let mut src = node("source", chunk, &key, 1);
    src.args(["--pages", &pages.to_string(), "--port", &port.to_string()]);
    if case == Case::VectorDirty {
        src.arg("--dirty");
    }
    let so = src.output().context("running the source node")?;
    if !so.status.success() {
        let _ = dest.kill();
        bail!("the source node failed ({})", so.status);
    }
    let s: SourceLine = serde_json::from_slice(&so.stdout).context("the source node's line")?;
    l.clear();
    out.read_line(&mut l)?;
    let d: DestLine =
        serde_json::from_str(&l).with_context(|| format!("the destination said {l:?}"))?;
    if !dest.wait()?.success() {
        bail!("the destination node failed");
    }
    let r = &s.report;
    let expected = r.owned_bytes + r.resent_dirty_bytes;
    Ok(Row {
        bench: "slope",
        object: case.name(),
        pages: r.pages,
        pages_asked: pages,
        page_bytes: chunk,
        run,
        prefill_ms: r.prefill_ms,
        prefill_mb_per_s: r.prefill_mb_per_s,
        tcp_raw_mb_per_s: tcp,
        no_owner_us: r.no_owner_us,
        read_unavailable_ms: r.read_unavailable_ms,
        write_unavailable_ms: r.write_unavailable_ms,
        writer_ops_ratio_during_prefill: s.writer_ops_ratio_during_prefill,
        writer_wall_ratio: s.writer_wall_ratio,
        end_to_end_ms: r.end_to_end_ms,
        rounds: r.rounds,
        final_dirty_pages: r.final_dirty_pages,
        bytes_moved: r.wire_bytes,
        bytes_expected: expected,
        owned_bytes: r.owned_bytes,
        resent_dirty_bytes: r.resent_dirty_bytes,
        bytes_ratio: r.wire_bytes as f64 / expected.max(1) as f64,
        verified: d.digest.as_deref() == Some(s.digest.as_str()),
    })
}

/// The same bytes through a loopback TCP socket between two threads: the ceiling of the
/// transport.
fn tcp_raw_mb_per_s(bytes: u64) -> anyhow::Result<f64> {
    use std::io::{Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let reader = std::thread::spawn(move || -> std::io::Result<u64> {
        let (mut s, _) = l.accept()?;
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0;
        loop {
            let n = s.read(&mut buf)?;
            if n == 0 {
                return Ok(got);
            }
            got += n as u64;
        }
    });
    let buf = vec![7u8; 4 << 20];
    let started = Instant::now();
    let mut s = std::net::TcpStream::connect(addr)?;
    let mut left = bytes;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        s.write_all(&buf[..n])?;
        left -= n as u64;
    }
    drop(s);
    let got = reader
        .join()
        .map_err(|_| anyhow::anyhow!("the reader panicked"))??;
    anyhow::ensure!(got == bytes, "tcp-raw moved {got} of {bytes} bytes");
    Ok(bytes as f64 / 1e6 / started.elapsed().as_secs_f64())
}
