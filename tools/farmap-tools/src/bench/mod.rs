//! `farmap bench`: benchmarks of the data paths, each with a reference measured in the same
//! run. With `--json`, one JSON object per line on stdout.

use std::process::ExitCode;

use clap::Subcommand;

mod common;
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
mod run;
mod slope;
pub mod slope_node;
mod stores;
mod timer;
mod uffd;
#[allow(unsafe_code)] // the raw reference: userfaultfd ioctls on its own mappings
mod uffd_raw;
mod versions;
mod vm;

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
    /// The versioned layout over a directory of objects: a whole write, an incremental
    /// snapshot (1% rewritten), opening the snapshot (first access, all read), and forks.
    Versions(versions::VersionsArgs),
    /// Real servers (redis-server, memcached) driven by real load generators (YCSB
    /// workloads A and B, redis-benchmark), their memory bounded to `--local` percent of
    /// their working set by `farmap run`, against the same server swapping under the
    /// kernel (a cgroup v1 memory limit; root) and unlimited, in the same run: throughput,
    /// latency percentiles, faults, evictions, the server's largest resident memory, and
    /// whether every value read back was right.
    Run(run::RunArgs),
    /// Object migration (farmap-slope) between two processes of one arena: a vector of
    /// words, quiet or written during the migration, at several sizes: prefill rate against
    /// a raw loopback TCP copy, the no-owner window, read and write unavailability, the
    /// writer's rate during prefill, bytes moved; the destination's copy is checked.
    Slope(slope::SlopeArgs),
    /// A QEMU guest (TCG) moved live between two QEMUs on this host: by farmap (its RAM on
    /// a farmap mount; instant and pre-copy) against the shared-file floor (QEMU moving
    /// device state only) and QEMU's own pre-copy and post-copy, in the same run: the pause
    /// the guest felt (heartbeats timed on the host), QEMU's downtime, bytes moved, and
    /// whether the guest found every byte it wrote (needs root, QEMU; builds the guest).
    Vm(vm::VmArgs),
}

pub use paging_app::{run_child as paging_app, AppArgs as PagingAppArgs};
pub use slope_node::{run as slope_node, NodeArgs as SlopeNodeArgs};

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
        BenchCommand::Versions(args) => versions::run(args).await,
        BenchCommand::Run(args) => run::run(args).await,
        BenchCommand::Slope(args) => slope::run(args).await,
        BenchCommand::Vm(args) => vm::run(args).await,
    }
}
