//! `farmap bench`: benchmarks of the data paths, each with a reference measured in the same
//! run. With `--json`, one JSON object per line on stdout.

use std::process::ExitCode;

use clap::Subcommand;

mod fuse;
mod migrate;
mod mirror;
mod nbd;
mod net;
mod paging;
mod paging_app;
mod paging_swap;
mod proxy;
mod pull;
mod push;
mod stores;
mod timer;
mod uffd;
mod uffd_raw;

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Background pull (Cached + Puller) from a store behind an emulated round trip into
    /// dense local memory, against memcpy and the ideal workers × chunk / rtt.
    Pull(pull::PullArgs),
    /// Managed write throughput: a Pusher writing back a dense local store whole to a store
    /// (memory by default, behind an emulated round trip). With --mirror-delay, every run
    /// also pushes through a mirrored store and reports the mirror's cost.
    Push(push::PushArgs),
    /// A userfaultfd region (direct mode, memory store): random 4 KiB faults, sequential
    /// fills in 4 KiB, 64 KiB and 1 MiB chunks, and take_dirty() over 1% and 100% written
    /// pages, against a raw userfaultfd handler copying from a plain buffer, and memcpy.
    ///
    /// On a VM, waking a thread on an idle virtual CPU can cost far more than a fault;
    /// `taskset -c 0 farmap bench uffd` keeps every thread on one CPU; so does letting idle
    /// virtual CPUs poll before halting (`/sys/module/haltpoll/parameters/guest_halt_poll_ns`,
    /// where the guest has the haltpoll driver).
    Uffd(uffd::UffdArgs),
    /// farmap's transports (native protocol, gRPC) through an emulated link (a delay proxy
    /// in this process), against a plain TCP stream through the same link: throughput and
    /// first-chunk latency per round-trip time.
    Net(net::NetArgs),
    /// farmap's NBD server against `nbdkit memory` and `qemu-nbd` (a file in /dev/shm):
    /// sequential read and write with nbdcopy, 4 KiB random reads with fio at queue depth 1
    /// and 16.
    Nbd(nbd::NbdArgs),
    /// The pipeline's timer and the Delayed stage: how late sleeps end (never early), against
    /// tokio's sleep, and how close a Delayed store runs to its latency and bandwidth.
    Timer(timer::TimerArgs),
    /// mmap reads of a region mounted as a FUSE file (memory store): sequential 1 MiB and
    /// random 4 KiB, against memcpy and a userfaultfd region in the same run (needs root).
    Fuse(fuse::FuseArgs),
    /// The delay proxy (`farmap proxy`): what it adds to a round trip, against a direct
    /// connection, and how close to its bandwidth a bulk transfer runs.
    Proxy(proxy::ProxyArgs),
    /// Reading a region out of each store given (`--store`, repeatable), with a memory
    /// store as the reference in the same run: direct reads, managed reads (Cached +
    /// Puller) and random 4 KiB reads (p50/p99).
    Stores(stores::StoresArgs),
    /// A self-checking application (`--pattern seq|uniform|zipf`) in a farmap region bounded
    /// to `--local` percent of its size, against the same application swapping under the
    /// kernel (a cgroup v1 memory limit, swap on a loop device over a file in RAM; needs
    /// root) in the same run: percentiles of faulting accesses, runtime against an unlimited
    /// run, faults, evictions, prefetch.
    Paging(paging::PagingArgs),
    /// The migration modes (`--modes instant,precopy,postcopy`) on one workload, for each
    /// region size (`--sizes 1GiB,4GiB`) with the same working set, over a shared store this
    /// command serves on loopback: downtime, bytes before resuming, TTR80 (until the writer
    /// runs at 80% of its rate before), effective downtime (its largest pause), what came
    /// from the store and from the source; the destination is checked byte for byte.
    Migrate(migrate::MigrateArgs),
}

pub use farmap_cli_kit::args::{parse_duration, parse_size_arg};
pub use paging_app::{run_child as paging_app, AppArgs as PagingAppArgs};

pub async fn run(cmd: BenchCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        BenchCommand::Pull(args) => pull::run(args).await,
        BenchCommand::Push(args) => push::run(args).await,
        BenchCommand::Uffd(args) => uffd::run(args).await,
        BenchCommand::Net(args) => net::run(args).await,
        BenchCommand::Nbd(args) => nbd::run_bench(args).await,
        BenchCommand::Timer(args) => timer::run(args).await,
        BenchCommand::Proxy(args) => proxy::run(args).await,
        BenchCommand::Stores(args) => stores::run(args).await,
        BenchCommand::Fuse(args) => fuse::run(args).await,
        BenchCommand::Paging(args) => paging::run(args).await,
        BenchCommand::Migrate(args) => migrate::run(args).await,
    }
}

/// The memcpy reference of the benchmarks, in MB/s: `chunk`-sized copies out of `src` into
/// a pre-touched buffer (best of three passes over up to 256 MiB of `src`).
pub fn measure_memcpy(src: &[u8], chunk: usize) -> f64 {
    let n = src.len().min(256 << 20);
    let src = &src[..n];
    let mut dst = vec![0xa5u8; n];
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = std::time::Instant::now();
        for (d, s) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
            d.copy_from_slice(std::hint::black_box(s));
        }
        std::hint::black_box(&mut dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    n as f64 / best / 1e6
}

/// Page faults of this process so far.
#[derive(Debug, Clone, Copy)]
pub struct SelfFaults {
    pub minor: u64,
    pub major: u64,
}

/// Reads this process's page faults from `/proc/self/stat`.
pub fn self_faults() -> anyhow::Result<SelfFaults> {
    use anyhow::Context;
    let stat = std::fs::read_to_string("/proc/self/stat").context("reading /proc/self/stat")?;
    // The fields after the command name (which may hold spaces) start after the last ')'.
    let after = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .context("/proc/self/stat has no ')'")?;
    let fields: Vec<&str> = after.split_whitespace().collect();
    // state(3) ppid pgrp session tty_nr tpgid flags minflt(10) cminflt majflt(12)
    let field = |n: usize| -> anyhow::Result<u64> {
        fields
            .get(n - 3)
            .and_then(|f| f.parse().ok())
            .with_context(|| format!("field {n} of /proc/self/stat"))
    };
    Ok(SelfFaults {
        minor: field(10)?,
        major: field(12)?,
    })
}

/// Applies a `--chunk` flag to `spec` (a power of two from 4 KiB to 4 MiB).
pub fn set_chunk(spec: &mut farmap::StoreSpec, chunk: Option<u64>) -> anyhow::Result<()> {
    if let Some(c) = chunk {
        spec.chunk_size = Some(
            u32::try_from(c)
                .ok()
                .filter(|c| farmap::Geometry::new(1, u64::from(*c)).is_ok())
                .ok_or_else(|| {
                    anyhow::anyhow!("--chunk {c} is not a power of two from 4KiB to 4MiB")
                })?,
        );
    }
    Ok(())
}
