//! `farmap`: the command-line face of farmap.
//!
//! Results (and `--json` lines) go to stdout; progress bars and logs go to stderr.
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

#[macro_use]
extern crate farmap_cli_kit;

mod budget;
mod cache_max;
mod cp;
mod doctor;
mod info;
mod logging;
mod manual;
mod migrate;
mod mount;
mod mount_agent;
mod mount_nbd;
mod mount_ublk;
#[cfg(feature = "tools")]
mod proxy;
mod region;
mod run;
mod serve;
mod serve_args;
mod serve_nbd;
mod stop;
mod swap;
mod verify;
mod versions;
mod vm;

use farmap_cli_kit::output;
#[cfg(feature = "tools")]
use farmap_tools::{bench, demo, guest};

/// Store specs, shown in every command's help.
const SPEC_HELP: &str = "\
STORE SPECS:
  memory:SIZE                 sparse memory (only written chunks use RAM)
  file:PATH                   an existing file; its length is the region size
  file:PATH?size=SIZE         a file, created sparse if missing
  dir:PATH?size=SIZE          a directory with one file per chunk
  farmap://HOST:PORT          a region served by `farmap serve` (farmaps:// for TLS:
                              ?ca=CA.pem[&cert=C.pem&key=K.pem]; farmap+unix:/path)
  farmap+grpc://HOST:PORT     a region served by `farmap serve --grpc`
  redis://HOST:PORT/DB?size=SIZE&prefix=P   Redis, one key per chunk (rediss:// for TLS;
                              redis+cluster://H:P,H:P/ for a Redis Cluster)
  s3://BUCKET/PREFIX?endpoint=URL&size=SIZE  an S3 bucket, one object per chunk
                              (credentials from the AWS environment or profile)
  https://HOST/PATH           a file on a web server, read-only, one range request
                              per chunk (also http://)
  cql://HOST:PORT/KEYSPACE?table=T&region=R&size=SIZE&create=true   Cassandra/ScyllaDB
  nbd://HOST[:PORT]/EXPORT    an NBD server's export (nbds:// for TLS: ?ca=CA.pem;
                              nbd+unix:///EXPORT?socket=/path)
  mirror:(SPEC)(SPEC)?policy=both|primary-first   every write to both stores; reads
                              fail over to the mirror; a recovered primary is resynced
  verified:(SPEC)             checksums for every chunk of SPEC (kept at its end);
                              bad chunks are refused (`farmap verify` scrubs)
  versioned:(dir:PATH)/REGION[@VERSION]?size=SIZE   versions of a region, chunks stored
                              once by content (or (s3://BUCKET/PREFIX?endpoint=URL),
                              (redis://HOST:PORT/DB?prefix=P) or
                              (cql://HOST:PORT/KEYSPACE?table=T&create=true));
                              `farmap snapshot`, `farmap versions`, `farmap fork`
Every store with an example and its options: `farmap help stores`.
Options after '?', joined by '&': size=SIZE, chunk=SIZE (power of two, 4KiB..4MiB,
default 64KiB), ro (read-only file/dir), max-open=N (dir), connections=N and
timeout=DURATION (remote). Sizes take binary suffixes: KiB, MiB, GiB, TiB, PiB
(K, M, G, T, P mean the same); at most 2^28 chunks (16TiB in 64KiB chunks). Durations need
a unit: ns, us, ms, s, m, h (250ms, 1.5s). Throughput is printed in MB/s (10^6 bytes).";

/// Every store, with an example and its options (`farmap help stores`, `farmap stores`):
/// the one reference of store specs, `docs/store-specs.md`, printed as it is.
const STORES_HELP: &str = include_str!("../../../../docs/store-specs.md");

/// farmap makes a memory region live somewhere else (a file, a directory of chunks, ...)
/// while applications use it as plain memory, and moves live regions between hosts.
#[derive(Debug, Parser)]
#[command(name = "farmap", version, after_help = SPEC_HELP)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// How log and status lines on stderr are written: text, or one JSON object per line
    /// (timestamp, level, target, fields, spans).
    #[arg(
        long,
        global = true,
        value_enum,
        default_value_t,
        env = "FARMAP_LOG_FORMAT"
    )]
    log_format: logging::LogFormat,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// What this machine and this user can do (userfaultfd and its features, FUSE, nbd,
    /// ublk, io_uring, cgroups, swap, limits), which farmap features follow, and how to
    /// enable what is missing.
    Doctor(doctor::DoctorArgs),
    /// Show a store's size, chunk size, capabilities and how much of it holds data.
    #[command(after_help = SPEC_HELP)]
    Info(info::InfoArgs),
    /// Copy a whole region from one store to another, in parallel, with progress.
    ///
    /// Chunks that read as zeros are skipped where the destination already reads zeros.
    /// The destination is flushed (made durable) before the command reports success.
    /// Sizes must match; a destination that does not exist yet takes the source's size.
    #[command(after_help = SPEC_HELP)]
    Cp(cp::CpArgs),
    /// Scrub a verified region (`verified:(SPEC)`): check every chunk against its checksum
    /// and list the bad ones; exits with 2 when there are some.
    #[command(after_help = SPEC_HELP)]
    Verify(verify::VerifyArgs),
    /// Name the latest version of a versioned region (`versioned:(dir:PATH)/REGION`), so
    /// that it opens later as REGION@NAME. Metadata only: what is saved stays where it is.
    Snapshot(versions::SnapshotArgs),
    /// List the versions of a versioned region, oldest first, with their snapshot names.
    Versions(versions::VersionsArgs),
    /// Make new versioned regions that start as a version of another: every chunk is
    /// shared until written (only a manifest is written per fork).
    Fork(versions::ForkArgs),
    /// Remove the chunks no version of any region lists, from an object store that keeps
    /// versioned regions; safe while writers, forks and snapshots run. Two runs at least the
    /// grace apart: the first moves garbage to the trash, a later one deletes it.
    Gc(versions::GcArgs),
    /// Measure a data path against a reference measured in the same run.
    #[cfg(feature = "tools")]
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Forward TCP connections through an emulated slow link (added round-trip time and
    /// bandwidth), for benchmarks and tests; runs until Ctrl-C.
    #[cfg(feature = "tools")]
    Proxy(proxy::ProxyArgs),
    /// Serve a store to other hosts (farmap://, farmaps://, farmap+unix: clients, or NBD
    /// clients with --nbd) until Ctrl-C.
    #[command(after_help = SPEC_HELP)]
    Serve(Box<serve::ServeArgs>),
    /// Migrate a live region away: tell the application's migration agent to seed it, show
    /// progress until a leecher has taken it over, print the result.
    Seed(migrate::SeedArgs),
    /// Migrate a live region here: tell this host's application agent to pull it from a
    /// seeder (by default pre-copy while the source runs, hand-over within --max-downtime,
    /// post-copy; --mode postcopy hands over at once, --mode instant through a shared store).
    Leech(migrate::LeechArgs),
    /// Bound the local memory of the region an application holds, while it runs (`region
    /// limit --app SOCKET SIZE|N%`), or show its paging state (`region stats --app SOCKET`).
    #[command(subcommand)]
    Region(region::RegionCommand),
    /// Run a program with its heap served by farmap, its local memory bounded.
    Run(run::RunArgs),
    /// Share a total of local memory among programs under `farmap run --budget NAME`,
    /// divided by their recent faults and active memory, again every --interval (runs
    /// until Ctrl-C); or list a running budget's programs and shares (--status).
    Budget(budget::BudgetArgs),
    /// Live migration, shown: a region that a deterministic writer keeps changing moves to
    /// another process over loopback (through an emulated link), is verified, and moves back.
    #[cfg(feature = "tools")]
    Demo(demo::DemoArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions(manual::CompletionsArgs),
    /// Print farmap's man page, or write one per command into a directory (--dir).
    Man(manual::ManArgs),
    /// Every store farmap can keep a region in, with an example and its options.
    #[command(long_about = STORES_HELP)]
    Stores,
    /// Mount a region as a file (DIR/region) that any program can read, write and mmap;
    /// runs until Ctrl-C, SIGTERM or `farmap umount DIR`, which flush first. Prints the
    /// file's path on stdout when it is ready.
    #[command(after_help = SPEC_HELP)]
    Mount(mount::MountArgs),
    /// Flush and unmount a `farmap mount` (waits until it is done).
    Umount(mount::UmountArgs),
    /// Use a store as swap space (`swap on STORE`, through a FUSE file and a loop device), or
    /// turn it off (`swap off [DEVICE]`).
    #[command(subcommand)]
    Swap(swap::SwapCommand),
    /// QEMU guests whose RAM is a farmap mount: move one live to another QEMU (`vm migrate`).
    #[command(subcommand)]
    Vm(vm::VmCommand),
    /// A node of `farmap demo` (internal).
    #[cfg(feature = "tools")]
    #[command(name = "__demo-node", hide = true)]
    DemoNode(demo::NodeArgs),
    /// Pattern writes and checks through a block device or its mapping, for the kernel
    /// tests' VM (internal).
    #[cfg(feature = "tools")]
    #[command(name = "__guest", hide = true)]
    Guest(guest::GuestArgs),
    /// A ublk block device over a store, until Ctrl-C (internal, for now; to become
    /// `farmap mount --ublk STORE`).
    #[command(name = "__mount-ublk", hide = true)]
    MountUblk(mount_ublk::MountUblkArgs),
    /// The application of `farmap bench paging` as a plain process, for its kernel-swap
    /// baseline (internal).
    #[cfg(feature = "tools")]
    #[command(name = "__paging-app", hide = true)]
    PagingApp(bench::PagingAppArgs),
    /// A process of `farmap bench slope` (internal).
    #[cfg(feature = "tools")]
    #[command(name = "__slope-node", hide = true)]
    SlopeNode(bench::SlopeNodeArgs),
}

impl Command {
    /// Whether the command moves regions through short-lived buffers (migrations, the
    /// proxy): it keeps freed heap for reuse instead of faulting fresh pages in (a 1 GiB
    /// demo's pull measured 789 -> 708-725 ms, medians of 8).
    fn moves_regions(&self) -> bool {
        match self {
            Command::Seed(_) | Command::Leech(_) => true,
            #[cfg(feature = "tools")]
            Command::Demo(_) | Command::DemoNode(_) | Command::Proxy(_) => true,
            _ => false,
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    logging::init(
        matches!(&cli.command, Command::Serve(args) if args.quiet),
        cli.log_format,
    );
    // A node of `farmap bench slope` re-executes itself without ASLR and runs its own
    // runtime: before farmap's exists.
    #[cfg(feature = "tools")]
    if let Command::SlopeNode(args) = cli.command {
        return bench::slope_node(args);
    }
    // Before the runtime's threads exist: they inherit it (see `swap`).
    let swap_prepared =
        matches!(&cli.command, Command::Swap(swap::SwapCommand::On(_))).then(swap::prepare);
    // `bench push` keeps freed memory too, so that its timed phase reuses the heap instead of
    // faulting fresh pages in (see `bench/push.rs`).
    #[cfg(feature = "tools")]
    if matches!(&cli.command, Command::Bench(bench::BenchCommand::Push(_))) {
        farmap_memory::heap::prepare_heap();
    }
    // A server's memory for its clients is a budget: large buffers go back when freed, so
    // that its resident memory follows the budget (see `hostile_nbd.rs`).
    if matches!(&cli.command, Command::Serve(_)) {
        farmap_memory::heap::return_large_buffers();
    }
    // The migration commands reuse freed buffers instead of faulting fresh ones in (see
    // `farmap_memory::heap::keep_freed_memory`).
    if cli.command.moves_regions() {
        farmap_memory::heap::keep_freed_memory();
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            status!("farmap: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async {
        match cli.command {
            Command::Doctor(args) => doctor::run(args),
            Command::Completions(args) => manual::completions(args, Cli::command()),
            Command::Man(args) => manual::man(args, Cli::command()),
            Command::Info(args) => info::run(args).await,
            Command::Cp(args) => cp::run(args).await,
            Command::Verify(args) => verify::run(args).await,
            Command::Snapshot(args) => versions::snapshot(args).await,
            Command::Versions(args) => versions::versions(args).await,
            Command::Fork(args) => versions::fork(args).await,
            Command::Gc(args) => versions::gc(args).await,
            #[cfg(feature = "tools")]
            Command::Bench(cmd) => bench::run(cmd).await,
            #[cfg(feature = "tools")]
            Command::Proxy(args) => proxy::run(args).await,
            Command::Serve(args) => serve::run(*args).await,
            Command::Seed(args) => migrate::seed(args).await,
            Command::Leech(args) => migrate::leech(args).await,
            #[cfg(feature = "tools")]
            Command::Demo(args) => demo::run(args).await,
            Command::Region(cmd) => region::run(cmd).await,
            Command::Run(args) => run::run(args).await,
            Command::Budget(args) => budget::run(args).await,
            Command::Stores => {
                println!("{STORES_HELP}");
                Ok(ExitCode::SUCCESS)
            }
            #[cfg(feature = "tools")]
            Command::DemoNode(args) => demo::node(args).await,
            #[cfg(feature = "tools")]
            Command::Guest(args) => guest::run(args),
            #[cfg(feature = "tools")]
            Command::PagingApp(args) => bench::paging_app(args),
            #[cfg(feature = "tools")]
            Command::SlopeNode(_) => unreachable!("run before the runtime"),
            Command::MountUblk(args) => mount_ublk::run_args(args).await,
            Command::Mount(args) => mount::run(args).await,
            Command::Umount(args) => mount::umount(args).await,
            Command::Swap(cmd) => swap::run(cmd, swap_prepared).await,
            Command::Vm(cmd) => vm::run(cmd).await,
        }
    });
    match result {
        Ok(code) => code,
        Err(err) => {
            if output::json_status() {
                tracing::error!(target: "farmap::status", "farmap: {}", output::error_chain(&err));
            } else {
                status!("farmap: {}", output::error_chain(&err));
            }
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The short list under every command's help names no scheme that the one reference
    /// (`docs/store-specs.md`, printed by `farmap help stores`) lacks.
    #[test]
    fn spec_help_agrees_with_the_reference() {
        let schemes: Vec<&str> = SPEC_HELP
            .split(|c: char| c.is_whitespace() || c == '(' || c == '`')
            .filter_map(|w| w.split_once(':'))
            .filter(|(_, body)| !body.is_empty())
            .map(|(scheme, _)| scheme)
            .filter(|s| !s.is_empty() && s.chars().all(|c| c.is_ascii_lowercase() || c == '+'))
            .collect();
        assert!(schemes.len() >= 10, "{schemes:?}");
        for scheme in schemes {
            assert!(
                STORES_HELP.contains(&format!("{scheme}:")),
                "docs/store-specs.md lacks the scheme {scheme:?} that SPEC_HELP names"
            );
        }
    }
}
