//! `farmap bench fuse`: mmap reads of a region mounted as a FUSE file, against the same
//! reads from memory (memcpy) and from a userfaultfd region over the same store, in one run.
//!
//! The store is a memory store of pseudo-random bytes (no zero chunk flatters a number). Each
//! FUSE run mounts afresh, so the page cache is cold and every page comes from the server;
//! each uffd run opens a fresh direct-mode region. Timing starts at the first touch.
//!
//! Cases, one JSON line per case, frontend and run:
//! - `seq-read`: the whole region read in order, 1 MiB at a time (64 KiB chunks);
//!   `mb_per_s` over the whole read, `p50_us`/`p99_us` of the 1 MiB reads.
//! - `rand-read-4k`: one byte of each of `--samples` random distinct pages, each timed
//!   alone (4 KiB chunks; the FUSE mapping is `MADV_RANDOM`, so a fault reads its page
//!   alone); `mb_per_s` counts 4 KiB per page.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::{Args, ValueEnum};
use farmap::Store;
use farmap_fuse::{FuseMount, MountOptions};
use farmap_memory::RegionSlice;
use serde::Serialize;

use super::common::parse_size_arg;
use super::uffd::{open_region, random_bytes, store_over};
use super::uffd_raw::{random_pages, touch_each, Latencies, PAGE_SIZE};

/// Bytes per timed read of `seq-read`.
const SEQ_BLOCK: usize = 1 << 20;

/// Seed of the pages `rand-read-4k` touches (the same for every frontend).
const PAGES_SEED: u64 = 0x0f05_e4a2;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Case {
    /// Sequential 1 MiB reads of the whole region.
    #[value(name = "seq-read")]
    SeqRead,
    /// Random single-page reads.
    #[value(name = "rand-read-4k")]
    RandRead4k,
}

impl Case {
    fn name(self) -> &'static str {
        match self {
            Case::SeqRead => "seq-read",
            Case::RandRead4k => "rand-read-4k",
        }
    }

    fn chunk(self) -> usize {
        match self {
            Case::SeqRead => 64 << 10,
            Case::RandRead4k => 4 << 10,
        }
    }
}

#[derive(Debug, Args)]
pub struct FuseArgs {
    /// Size of the region (held in memory twice: the store and the reference buffer).
    #[arg(long, default_value = "256MiB", value_parser = parse_size_arg)]
    size: u64,
    /// The cases to run, comma-separated.
    #[arg(
        long = "case",
        value_enum,
        value_delimiter = ',',
        default_value = "seq-read,rand-read-4k"
    )]
    cases: Vec<Case>,
    /// Pages touched in rand-read-4k.
    #[arg(long, default_value_t = 5_000, value_parser = clap::value_parser!(u32).range(1..))]
    samples: u32,
    /// Repeat every case this many times (one line per frontend and run).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    runs: u32,
    /// Largest FUSE request (`max_read`, `max_write`, read-ahead) of the mount; default: the
    /// mount's (`farmap mount`'s) own, 1 MiB.
    #[arg(long, value_parser = parse_size_arg)]
    max_request: Option<u64>,
    /// One JSON object per line on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Row {
    bench: &'static str,
    case: &'static str,
    frontend: &'static str,
    run: u32,
    size_bytes: u64,
    chunk_bytes: usize,
    mb_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    samples: usize,
    /// The bytes read equal the store's (seq-read: the whole region; rand: the pages).
    verified: bool,
    /// The FUSE mount's largest request (fuse rows).
    #[serde(skip_serializing_if = "Option::is_none")]
    max_request_bytes: Option<u32>,
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

/// Reads `mem` in order, `SEQ_BLOCK` at a time, into `out`; returns each read's time.
fn seq_read(mem: RegionSlice<'_>, out: &mut [u8]) -> Vec<Duration> {
    let mut times = Vec::with_capacity(out.len() / SEQ_BLOCK + 1);
    for (i, block) in out.chunks_mut(SEQ_BLOCK).enumerate() {
        let started = Instant::now();
        mem.read_into(i * SEQ_BLOCK, block).expect("in range");
        times.push(started.elapsed());
    }
    times
}

/// Whether each page in `pages` of `mem` equals `data`'s.
fn pages_match(mem: RegionSlice<'_>, data: &[u8], pages: &[usize]) -> bool {
    let mut buf = vec![0u8; PAGE_SIZE];
    pages.iter().all(|&p| {
        mem.read_into(p * PAGE_SIZE, &mut buf).expect("in range");
        buf[..] == data[p * PAGE_SIZE..(p + 1) * PAGE_SIZE]
    })
}

struct Bench {
    data: Bytes,
    samples: usize,
    mount: MountOptions,
}

/// What one frontend's run measured: per-read times, bytes, and the check.
struct Measured {
    times: Vec<Duration>,
    bytes: u64,
    verified: bool,
}

impl Bench {
    fn row(&self, case: Case, frontend: &'static str, run: u32, m: Measured) -> Row {
        let total: Duration = m.times.iter().sum();
        let lat = Latencies::from_samples(m.times);
        Row {
            bench: "fuse",
            case: case.name(),
            frontend,
            run,
            size_bytes: self.data.len() as u64,
            chunk_bytes: case.chunk(),
            mb_per_s: round3(m.bytes as f64 / total.as_secs_f64().max(1e-9) / 1e6),
            p50_us: round3(lat.p50_us),
            p99_us: round3(lat.p99_us),
            samples: lat.samples,
            verified: m.verified,
            max_request_bytes: (frontend == "fuse").then_some(self.mount.max_request),
        }
    }

    fn memcpy(&self, case: Case, pages: &[usize]) -> Measured {
        let src = &self.data[..];
        match case {
            Case::SeqRead => {
                let mut out = vec![0xa5u8; src.len()];
                let mut times = Vec::new();
                for (i, block) in out.chunks_mut(SEQ_BLOCK).enumerate() {
                    let started = Instant::now();
                    block.copy_from_slice(std::hint::black_box(
                        &src[i * SEQ_BLOCK..i * SEQ_BLOCK + block.len()],
                    ));
                    times.push(started.elapsed());
                }
                Measured {
                    verified: out[..] == src[..],
                    times,
                    bytes: src.len() as u64,
                }
            }
            Case::RandRead4k => {
                let times = pages
                    .iter()
                    .map(|&p| {
                        let started = Instant::now();
                        std::hint::black_box(src[std::hint::black_box(p * PAGE_SIZE)]);
                        started.elapsed()
                    })
                    .collect();
                Measured {
                    times,
                    bytes: (pages.len() * PAGE_SIZE) as u64,
                    verified: true,
                }
            }
        }
    }

    fn measure(&self, case: Case, mem: RegionSlice<'_>, pages: &[usize]) -> Measured {
        match case {
            Case::SeqRead => {
                // Written before the clock starts, as memcpy's is: a zeroed allocation would
                // leave every destination page to be faulted in and cleared inside the timed
                // reads (a fifth of their time), a cost memcpy's reference does not pay.
                let mut out = vec![0xa5u8; mem.len()];
                let times = seq_read(mem, &mut out);
                Measured {
                    verified: out[..] == self.data[..],
                    times,
                    bytes: mem.len() as u64,
                }
            }
            Case::RandRead4k => {
                let times = touch_each(mem, pages);
                Measured {
                    times,
                    bytes: (pages.len() * PAGE_SIZE) as u64,
                    verified: pages_match(mem, &self.data, pages),
                }
            }
        }
    }

    fn fuse(&self, case: Case, store: Arc<dyn Store>, pages: &[usize]) -> anyhow::Result<Measured> {
        let dir = tempfile::tempdir().context("creating a mount point")?;
        let mount = FuseMount::mount(store, dir.path(), self.mount.clone())
            .context("mounting the region (FUSE needs root here)")?;
        let measured = {
            let map = mount.map().context("mapping the mounted file")?;
            if case == Case::RandRead4k {
                map.advise_random().context("madvise(MADV_RANDOM)")?;
            }
            self.measure(case, map.memory(), pages)
        };
        mount.unmount().context("unmounting")?;
        Ok(measured)
    }

    fn uffd(&self, case: Case, store: Arc<dyn Store>, pages: &[usize]) -> anyhow::Result<Measured> {
        let region = open_region(store, None, farmap_uffd::FaultWait::Sleep)?;
        Ok(self.measure(case, region.memory(), pages))
    }
}

pub async fn run(args: FuseArgs) -> anyhow::Result<ExitCode> {
    if !rustix::process::geteuid().is_root() {
        bail!("farmap bench fuse mounts FUSE file systems without fusermount3: run it as root");
    }
    let size = usize::try_from(args.size).context("--size does not fit this machine")?;
    if size == 0 || !size.is_multiple_of(SEQ_BLOCK) {
        bail!("--size must be a positive multiple of 1MiB");
    }
    let data = random_bytes(size);
    let mut mount = MountOptions::default();
    if let Some(max) = args.max_request {
        mount.max_request = u32::try_from(max)
            .ok()
            .filter(|m| (4096..=64 << 20).contains(m) && m.is_power_of_two())
            .context("--max-request must be a power of two from 4KiB to 64MiB")?;
    }
    let bench = Bench {
        data: data.clone(),
        samples: (args.samples as usize).min(size / PAGE_SIZE),
        mount,
    };
    let pages = random_pages(size / PAGE_SIZE, bench.samples, PAGES_SEED);
    for run in 1..=args.runs {
        for &case in &args.cases {
            let store = store_over(&data, case.chunk()).await?;
            let fuse_store = store.clone();
            let (b, p) = (&bench, &pages);
            let rows = tokio::task::block_in_place(|| -> anyhow::Result<Vec<Row>> {
                let memcpy = b.memcpy(case, p);
                let fuse = b.fuse(case, fuse_store, p)?;
                let uffd = b.uffd(case, store, p)?;
                Ok(vec![
                    b.row(case, "fuse", run, fuse),
                    b.row(case, "memcpy", run, memcpy),
                    b.row(case, "uffd", run, uffd),
                ])
            })?;
            for row in rows {
                if args.json {
                    println!("{}", serde_json::to_string(&row)?);
                } else {
                    println!(
                        "{:<13} {:<7} run {}: {:>9.1} MB/s  p50 {:>9.1} µs  p99 {:>9.1} µs  {}",
                        row.case,
                        row.frontend,
                        row.run,
                        row.mb_per_s,
                        row.p50_us,
                        row.p99_us,
                        if row.verified { "verified" } else { "MISMATCH" }
                    );
                }
                if !row.verified {
                    bail!(
                        "{} {}: the bytes read differ from the store's",
                        row.case,
                        row.frontend
                    );
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
