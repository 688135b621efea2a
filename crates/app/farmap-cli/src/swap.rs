//! `farmap swap on` / `farmap swap off`: a store as the host's swap space (r3map's ram-dl).
//!
//! The kernel refuses swap on a FUSE file (`swapon` needs a file system that can map swap
//! pages to disk blocks), so the chain is:
//!
//! ```text
//!   kernel swap ─▶ /dev/loopN (direct I/O) ─▶ /run/farmap/swap/PID/swap (FUSE, this
//!   process) ─▶ pipeline ─▶ the store (managed: a local cache ─▶ the remote)
//! ```
//!
//! `swap on` mounts the store in a private directory (`/run/farmap/swap/PID/`), attaches a
//! loop device to the file, runs `mkswap` and `swapon`, prints the device, and serves in the
//! foreground (like `farmap mount`) until SIGINT/SIGTERM or `farmap swap off`. Going down is
//! always in this order: `swapoff` (every swapped page read back into memory), `losetup -d`,
//! flush (a managed store pushes everything), unmount. If `swapoff` fails (not enough memory
//! to take the pages back) the server keeps serving: unmounting would lose the pages.
//! What a killed server leaves (a swap on a dead device, an attached loop device, a dead FUSE
//! mount, the directory) is cleaned up by the next `swap on` and by `swap off`.
//!
//! # Not deadlocking under memory pressure
//! The server's memory must never depend on the swap it serves. What is done:
//! - `PR_SET_IO_FLUSHER` on the main thread before any other thread exists
//!   ([`prepare`]); every thread inherits it. It needs `CAP_SYS_RESOURCE`; where
//!   root lacks it (this machine's sandbox does) a warning says so and the server goes on.
//!   Reclaim entered by an allocation of this process then does no I/O
//!   (`PF_MEMALLOC_NOIO`), so it can never wait for a swap-out that this process has to
//!   serve, and its writes are not throttled by the dirty limits of the device it serves
//!   (`PF_LOCAL_THROTTLE`).
//! - `mlockall(MCL_CURRENT | MCL_FUTURE)` once the mount's runtime, its threads and fuser's
//!   request buffer exist, before `swapon`: no page of this process (code, stacks, heap, a
//!   memory store's chunks, the managed cache) is ever swapped out or dropped. Root has
//!   `CAP_IPC_LOCK`, so `RLIMIT_MEMLOCK` does not apply; without it the limit is raised to
//!   unlimited, and `swap on` refuses to start if that fails (a locked process whose limit
//!   is reached cannot allocate any more).
//! - Nothing on the swap-out path takes a new page from the kernel (an allocation that
//!   needs one can enter reclaim, and reclaim may be waiting for this very swap-out):
//!   - pre-allocated and locked before `swapon`: fuser's 16 MiB request buffer, the
//!     runtimes' threads and stacks, and a pool of [`WRITE_BUFFERS`] 1 MiB buffers that write
//!     payloads are copied into ([`farmap_fuse::WritePool`]; a buffer comes back once the
//!     store has the data);
//!   - the store copies what it keeps into memory that exists from the start: a memory store
//!     is a [`DenseMemoryStore`] (every page of the region allocated and written at start),
//!     and a managed store's local copy is one too ([`ManagedOptions::dense_local`]); a
//!     remote store keeps nothing;
//!   - what the path still allocates (request tasks, store futures, a read's copy,
//!     read-modify-write buffers, network frames) comes from the heap, which is prepared on
//!     the main thread before any other thread exists ([`prepare_heap`]: one malloc arena, no
//!     trimming, no `mmap` for blocks up to 32 MiB) and grown by [`HEAP_RESERVE`] that is
//!     freed again before `mlockall`: freed memory stays in the process, locked, and is what
//!     later allocations get.
//!
//!   The swap test checks it: the server may take at most 1024 page faults while about
//!   200 MiB are swapped through it. Measured (`cargo test -p farmap-cli --test swap`): 0 for
//!   the memory store and 0 for the managed remote store; with the sparse memory store
//!   instead of the dense one the server took 57,982 and its RSS grew by 226 MiB.
//! - The loop device uses direct I/O (`--direct-io on`, measured below): swap-out goes
//!   straight to the FUSE server. A buffered loop device would copy every swapped page into
//!   the FUSE file's page cache first, charged to the memory cgroup that is swapping (the loop
//!   driver charges its I/O to the issuer's cgroup): swap-out would need the memory it is
//!   trying to free, and would wait for FUSE writeback.
//!
//! Residual risk: a burst of more write requests than the pool has buffers, or more heap than
//! the reserve, takes new pages (counted as pool misses; the reserve's size is a guess
//! checked by the test, not a bound). Without `PR_SET_IO_FLUSHER` (this machine) reclaim
//! entered then may do I/O. Pressure from a memory cgroup limit (the tested case) does not
//! touch the server as long as the server is not in that cgroup.
//!
//! Direct I/O measured on this machine (2 shared cores, memory store, `dd` through the loop
//! device, 1 MiB O_DIRECT requests): reads 1.7 GB/s, writes 2.1–3.4 GB/s once the store's
//! chunks exist; without direct I/O writes only fill the FUSE file's page cache.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, Subcommand, ValueEnum};
use farmap::store::DenseMemoryStore;
use farmap::{Geometry, ManagedOptions, SpecKind, Store, StoreSpec};
use farmap_fuse::{FuseMount, MountOptions};
use farmap_memory::heap::prepare_heap;

use crate::mount::{finish_managed, is_gone, managed_options, open_served, PullArgs};
use farmap_cli_kit::args::parse_duration;

/// Where each `swap on` mounts its store: `SWAP_ROOT/PID/`.
const SWAP_ROOT: &str = "/run/farmap/swap";
/// The file's name in that directory.
const FILE_NAME: &str = "swap";

const ON_ABOUT: &str = "\
Use a store as swap space: the store is mounted (FUSE) in a private directory under \
/run/farmap/swap/, a loop device is attached to the file, and mkswap and swapon make it swap. \
The kernel refuses swap directly on a FUSE file (swapon needs a file system that maps swap \
pages to disk blocks), hence the loop device. Prints the device (/dev/loopN; --json: a JSON \
object with device and mountpoint) when the swap is on, then serves in the foreground until \
Ctrl-C, SIGTERM or `farmap swap off`, which run swapoff, detach the loop device, flush the \
store and unmount, in that order. A swap left by a killed server is cleaned up by the next \
`swap on` or by `swap off`. Needs root. The serving process locks its memory (mlockall) and \
marks itself an I/O flusher (PR_SET_IO_FLUSHER, which needs CAP_SYS_RESOURCE) so that it never \
waits on the swap it serves.";

/// Swap on a store.
#[derive(Debug, Subcommand)]
pub enum SwapCommand {
    /// Use a store as swap space (through a FUSE file and a loop device); serves until
    /// Ctrl-C, SIGTERM or `farmap swap off`.
    #[command(long_about = ON_ABOUT, after_help = crate::SPEC_HELP)]
    On(SwapOnArgs),
    /// Turn a `farmap swap on` off: swapoff, detach the loop device, flush, unmount (waits
    /// until it is done). Also cleans up what a killed server left.
    Off(SwapOffArgs),
}

/// On or off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OnOff {
    /// On.
    On,
    /// Off.
    Off,
}

#[derive(Debug, Args)]
pub struct SwapOnArgs {
    /// The store (any spec) that holds the swapped pages.
    store: String,
    /// Swap priority (0..=32767; higher is used first). Without it the kernel picks one below
    /// every other swap's.
    #[arg(long, value_parser = clap::value_parser!(i32).range(0..=32767))]
    priority: Option<i32>,
    /// Let the kernel discard freed swap pages (swapon --discard): they are trimmed in the
    /// store.
    #[arg(long)]
    discard: bool,
    /// Direct I/O between the loop device and the FUSE file (off: the swapped pages are also
    /// cached in the file's page cache, which needs memory while swapping out).
    #[arg(long, value_enum, default_value = "on")]
    direct_io: OnOff,
    /// Managed mode: a local memory cache filled in the background and written back on an
    /// interval (for remote stores).
    #[arg(long)]
    managed: bool,
    #[command(flatten)]
    pull: PullArgs,
    /// How often written chunks are pushed to the store (managed mode).
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    push_interval: Duration,
    /// Print a JSON object (device, mountpoint, file, pid, direct_io, priority) instead of
    /// the device's path.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
pub struct SwapOffArgs {
    /// The swap to turn off: its device (/dev/loopN), its directory under /run/farmap/swap/,
    /// or its server's PID. Without it: every farmap swap on this host.
    target: Option<String>,
}

/// What `swap on` sets up on the main thread before any other thread exists.
#[derive(Debug)]
pub struct Prepared {
    /// `PR_SET_IO_FLUSHER`'s result.
    io_flusher: std::io::Result<()>,
    /// Whether the allocator took the settings of [`prepare_heap`].
    heap: bool,
}

/// Prepares the process for serving swap; must run on the main thread before any other
/// thread starts: threads inherit the I/O flusher flag from the thread that creates them,
/// and each thread picks its malloc arena at its first allocation.
pub fn prepare() -> Prepared {
    Prepared {
        heap: prepare_heap(),
        io_flusher: become_io_flusher(),
    }
}

/// Marks the process an I/O flusher (`PR_SET_IO_FLUSHER`).
fn become_io_flusher() -> std::io::Result<()> {
    rustix::process::configure_io_flusher_behavior(true).map_err(std::io::Error::from)
}

/// How much heap is kept in reserve (allocated, written and then freed before `mlockall`, and
/// never given back): what the serving path allocates (request tasks, store futures, a
/// read's copy, network frames) comes out of it without a page fault.
const HEAP_RESERVE: usize = 64 << 20;

/// Buffers of the mount's write pool: one per FUSE write request in flight (1 MiB each);
/// more requests than this copy into the heap reserve.
const WRITE_BUFFERS: usize = 32;

/// Grows the heap by `bytes`, written, and frees it again: with [`prepare_heap`]'s settings
/// it stays in the process as free heap, and `mlockall` keeps it resident.
fn reserve_heap(bytes: usize) {
    const BLOCK: usize = 8 << 20;
    let blocks: Vec<Vec<u8>> = (0..bytes / BLOCK).map(|_| vec![1u8; BLOCK]).collect();
    // Not optimized away: the allocator must really have handed these out.
    drop(std::hint::black_box(blocks));
}

/// A line on stderr; a closed stderr is ignored (this runs in a daemon's path).
fn note(msg: impl std::fmt::Display) {
    let _ = writeln!(std::io::stderr(), "{msg}");
}

/// Runs a util-linux tool; its stdout on success, an error with its stderr otherwise.
async fn tool(tool: &'static str, args: Vec<String>) -> anyhow::Result<String> {
    tokio::task::spawn_blocking(move || {
        let out = std::process::Command::new(tool)
            .args(&args)
            .output()
            .with_context(|| format!("running {tool} (from util-linux)"))?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr).trim().to_owned();
            bail!(
                "{tool} {}: {}",
                args.join(" "),
                if err.is_empty() {
                    out.status.to_string()
                } else {
                    err
                }
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    })
    .await?
}

/// `/dev/loopN` → `loopN`.
fn dev_name(dev: &str) -> &str {
    dev.rsplit('/').next().unwrap_or(dev)
}

/// Whether the loop device has a backing file.
fn is_attached(dev: &str) -> bool {
    Path::new(&format!("/sys/block/{}/loop/backing_file", dev_name(dev))).exists()
}

/// The loop devices whose backing file lies in `dir`.
fn loops_in(dir: &Path) -> Vec<String> {
    let prefix = format!("{}/", dir.display());
    let Ok(blocks) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    let mut devs: Vec<String> = blocks
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            if !name.starts_with("loop") {
                return None;
            }
            let backing = std::fs::read_to_string(e.path().join("loop/backing_file")).ok()?;
            backing
                .trim()
                .starts_with(&prefix)
                .then(|| format!("/dev/{name}"))
        })
        .collect();
    devs.sort();
    devs
}

/// A line of `/proc/swaps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SwapLine {
    pub device: String,
    pub size_kib: u64,
    pub used_kib: u64,
    pub priority: i64,
}

/// The active swaps (`/proc/swaps`).
pub(crate) fn swaps() -> Vec<SwapLine> {
    let table = std::fs::read_to_string("/proc/swaps").unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            Some(SwapLine {
                device: f.first()?.to_string(),
                size_kib: f.get(2)?.parse().ok()?,
                used_kib: f.get(3)?.parse().ok()?,
                priority: f.get(4)?.parse().ok()?,
            })
        })
        .collect()
}

fn is_swap_on(dev: &str) -> bool {
    swaps().iter().any(|s| s.device == dev)
}

/// The processes that have `dev` open (from `/proc/*/fd`).
fn holders(dev: &str) -> Vec<u32> {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = procs
        .filter_map(Result::ok)
        .filter_map(|p| {
            let pid: u32 = p.file_name().to_str()?.parse().ok()?;
            let fds = std::fs::read_dir(p.path().join("fd")).ok()?;
            fds.filter_map(Result::ok)
                .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|l| l == Path::new(dev)))
                .then_some(pid)
        })
        .collect();
    pids.sort_unstable();
    pids
}

/// One `swap on`'s directory under [`SWAP_ROOT`], with the loop devices over its file.
#[derive(Debug)]
struct Entry {
    pid: u32,
    dir: PathBuf,
    /// The loop devices attached to its file now.
    devices: Vec<String>,
    /// The device its server recorded (`PID.device`), which `swap off DEVICE` finds even once
    /// it is detached.
    recorded: Option<String>,
}

/// Where a server records its device: `SWAP_ROOT/PID.device`.
fn record_path(pid: u32) -> PathBuf {
    Path::new(SWAP_ROOT).join(format!("{pid}.device"))
}

impl Entry {
    fn new(pid: u32, dir: PathBuf) -> Entry {
        let devices = loops_in(&dir);
        let recorded = std::fs::read_to_string(record_path(pid))
            .ok()
            .map(|s| s.trim().to_owned());
        Entry {
            pid,
            dir,
            devices,
            recorded,
        }
    }

    /// Removes its directory and record.
    fn remove(&self) -> std::io::Result<()> {
        let _ = std::fs::remove_file(record_path(self.pid));
        std::fs::remove_dir(&self.dir)
    }

    /// Whether its `swap on` server still runs (a process of that PID running `swap on`).
    fn is_served(&self) -> bool {
        if is_gone(self.pid) {
            return false;
        }
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", self.pid)).unwrap_or_default();
        let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
        args.windows(2).any(|w| w == [&b"swap"[..], &b"on"[..]])
    }
}

/// Every `swap on` directory on this host.
fn entries() -> Vec<Entry> {
    let Ok(dirs) = std::fs::read_dir(SWAP_ROOT) else {
        return Vec::new();
    };
    let mut entries: Vec<Entry> = dirs
        .filter_map(Result::ok)
        .filter_map(|d| {
            let pid = d.file_name().to_str()?.parse().ok()?;
            Some(Entry::new(pid, d.path()))
        })
        .collect();
    entries.sort_by_key(|e| e.pid);
    entries
}

/// swapoff and `losetup -d` for every loop device of `entry` (the steps that can fail and
/// must not be followed by an unmount when they do).
async fn release_devices(entry: &Entry) -> anyhow::Result<()> {
    for dev in &entry.devices {
        if is_swap_on(dev) {
            tool("swapoff", vec![dev.clone()]).await.with_context(|| {
                format!(
                    "turning the swap on {dev} off (its swapped pages must fit in memory); it \
                     stays on and served"
                )
            })?;
        }
        if is_attached(dev) {
            tool("losetup", vec!["-d".into(), dev.clone()])
                .await
                .with_context(|| format!("detaching the loop device {dev}"))?;
        }
        // A loop device that something holds open is only detached at its last close.
        let start = Instant::now();
        while is_attached(dev) {
            if start.elapsed() > Duration::from_secs(2) {
                let who = holders(dev);
                bail!(
                    "the swap on {dev} is off but {dev} is still open (by process(es) {who:?}); \
                     it is detached when they close it: run `farmap swap off` again then"
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    Ok(())
}

/// Cleans up what a dead `swap on` left: its swap, loop device, dead mount and directory.
async fn clean_dead(entry: &Entry) -> anyhow::Result<()> {
    release_devices(entry).await?;
    if farmap_fuse::find_mount(&entry.dir).ok().flatten().is_some() {
        rustix::mount::unmount(&entry.dir, rustix::mount::UnmountFlags::DETACH)
            .with_context(|| format!("unmounting the dead mount {}", entry.dir.display()))?;
    }
    entry
        .remove()
        .with_context(|| format!("removing {}", entry.dir.display()))?;
    note(format_args!(
        "farmap swap: cleaned up after the dead server {} ({}; devices {:?}); what it had not \
         flushed is lost",
        entry.pid,
        entry.dir.display(),
        entry.devices
    ));
    Ok(())
}

pub async fn run(cmd: SwapCommand, prepared: Option<Prepared>) -> anyhow::Result<ExitCode> {
    match cmd {
        SwapCommand::On(args) => on(args, prepared).await,
        SwapCommand::Off(args) => off(args).await,
    }
}

/// Whether this process has `CAP_IPC_LOCK` (from `/proc/self/status`), which lifts
/// `RLIMIT_MEMLOCK`.
fn has_cap_ipc_lock() -> bool {
    const CAP_IPC_LOCK: u32 = 14;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
            u64::from_str_radix(hex.trim(), 16).ok()
        })
        .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
}

/// Makes sure `mlockall(MCL_FUTURE)` cannot make the server's later allocations fail: either
/// `CAP_IPC_LOCK` (root's) or no `RLIMIT_MEMLOCK` (raised to unlimited where allowed).
fn check_memlock() -> anyhow::Result<()> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    if has_cap_ipc_lock() {
        return Ok(());
    }
    let unlimited = Rlimit {
        current: None,
        maximum: None,
    };
    let _ = setrlimit(Resource::Memlock, unlimited);
    match getrlimit(Resource::Memlock).current {
        None => Ok(()),
        Some(limit) => bail!(
            "RLIMIT_MEMLOCK is {limit} bytes and this process lacks CAP_IPC_LOCK: with its memory \
             locked (mlockall) its allocations would fail past that; run it with CAP_IPC_LOCK \
             or `ulimit -l unlimited`"
        ),
    }
}

/// What `swap on` has set up so far, undone in reverse on a failure.
struct Setup {
    dir: PathBuf,
    mount: Option<FuseMount>,
    device: Option<String>,
}

impl Setup {
    async fn undo(mut self) {
        let entry = Entry {
            pid: std::process::id(),
            dir: self.dir.clone(),
            devices: self.device.take().into_iter().collect(),
            recorded: None,
        };
        if let Err(e) = release_devices(&entry).await {
            note(format_args!(
                "farmap swap on: {}",
                crate::output::error_chain(&e)
            ));
        }
        if let Some(mount) = self.mount.take() {
            let _ = tokio::task::spawn_blocking(move || mount.unmount()).await;
        }
        let _ = entry.remove();
    }
}

async fn on(args: SwapOnArgs, prepared: Option<Prepared>) -> anyhow::Result<ExitCode> {
    check_prepared(prepared)?;
    let spec: StoreSpec = args.store.parse()?;
    // Listen for SIGTERM/SIGINT from the start: one that comes before the device is printed
    // (or just after) must turn the swap off, not kill the server with its device attached.
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("listening for SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("listening for SIGINT")?;
    for entry in entries() {
        // A directory named after this process is from an earlier one of the same PID.
        if entry.pid == std::process::id() || !entry.is_served() {
            clean_dead(&entry)
                .await
                .context("cleaning up after a dead `farmap swap on`")?;
        }
    }
    check_memlock()?;

    let (served, managed) = open_dense(&args, &spec).await?;
    let pid = std::process::id();
    let dir = Path::new(SWAP_ROOT).join(pid.to_string());
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut setup = Setup {
        dir: dir.clone(),
        mount: None,
        device: None,
    };
    let started = start(&args, &spec, served, &mut setup).await;
    let (device, direct_io) = match started {
        Ok(v) => v,
        Err(e) => {
            setup.undo().await;
            let _ = finish_managed(managed, Ok(())).await;
            return Err(e);
        }
    };
    let Some(mount) = setup.mount.take() else {
        bail!("internal: no mount after the setup");
    };
    print_device(&args, &spec, &dir, &mount, &device, direct_io);
    note(format_args!(
        "farmap swap on: {device} is swap on {spec} ({}, {}, direct I/O {}); stop with Ctrl-C, \
         SIGTERM or `farmap swap off {device}`",
        mount.geometry(),
        if managed.is_some() {
            "managed"
        } else {
            "direct"
        },
        if direct_io { "on" } else { "off" },
    ));

    // Serve until told to stop and the swap could be turned off.
    let own = Entry {
        pid,
        dir: dir.clone(),
        devices: vec![device.clone()],
        recorded: None,
    };
    serve_until_off(&own, &mut term, &mut int, &mount).await;
    note(format_args!(
        "farmap swap on: {device} is off and detached; flushing and unmounting"
    ));
    let pool = mount.write_pool().cloned();
    let unmounted = tokio::task::spawn_blocking(move || mount.unmount()).await?;
    if let Some(pool) = pool.filter(|p| p.misses() > 0) {
        note(format_args!(
            "farmap swap on: {} write payloads found none of the {} pre-allocated buffers free \
             and were copied into the heap",
            pool.misses(),
            pool.count()
        ));
    }
    finish_managed(managed, unmounted.context("unmounting")).await?;
    let _ = own.remove();
    note("farmap swap on: unmounted; the store is flushed");
    Ok(ExitCode::SUCCESS)
}

/// Refuses to run without root or without [`prepare`]; warns of what [`prepare`] could not
/// set up.
fn check_prepared(prepared: Option<Prepared>) -> anyhow::Result<()> {
    if !rustix::process::geteuid().is_root() {
        bail!(
            "farmap swap on needs root (FUSE mount, losetup, swapon, mlockall, \
             PR_SET_IO_FLUSHER)"
        );
    }
    let Some(prepared) = prepared else {
        bail!("internal: swap::prepare was not called before the runtime started");
    };
    if let Err(e) = &prepared.io_flusher {
        // Without CAP_SYS_RESOURCE (some containers drop it from root): go on, and say what
        // is lost.
        tracing::warn!(
            "not an I/O flusher (PR_SET_IO_FLUSHER: {e}; it needs CAP_SYS_RESOURCE): reclaim \
             entered by this server's allocations may write pages out and wait for it"
        );
    }
    if !prepared.heap {
        tracing::warn!(
            "the allocator did not take the swap server's settings (glibc mallopt): freed \
             memory may go back to the kernel, and allocations on the swap-out path may need \
             new pages"
        );
    }
    Ok(())
}

/// Opens the store to swap on. Stores whose writes copy into memory that exists from the
/// start: a memory store is dense (the swapped pages are in memory anyway), and so is a
/// managed store's local copy.
async fn open_dense(
    args: &SwapOnArgs,
    spec: &StoreSpec,
) -> anyhow::Result<(Arc<dyn Store>, Option<Arc<farmap::Managed>>)> {
    let managed_opts = args.managed.then(|| ManagedOptions {
        dense_local: true,
        ..managed_options(args.pull, args.push_interval)
    });
    if matches!(spec.kind, SpecKind::Memory) && managed_opts.is_none() {
        let g = Geometry::new(
            spec.size.context("a memory spec has a size")?,
            u64::from(spec.chunk_size_or_default()),
        )
        .with_context(|| format!("the geometry of {spec}"))?;
        let dense: Arc<dyn Store> = Arc::new(DenseMemoryStore::new(g));
        return Ok((dense, None));
    }
    open_served(
        spec,
        managed_opts,
        None,
        &farmap_cli_kit::metrics::Metrics::default(),
    )
    .await
}

/// Prints the device on stdout (with --json: one object describing the swap).
fn print_device(
    args: &SwapOnArgs,
    spec: &StoreSpec,
    dir: &Path,
    mount: &FuseMount,
    device: &str,
    direct_io: bool,
) {
    let line = if args.json {
        serde_json::json!({
            "device": device,
            "mountpoint": dir,
            "file": mount.path().to_path_buf(),
            "pid": std::process::id(),
            "direct_io": direct_io,
            "priority": swaps().iter().find(|s| s.device == device).map(|s| s.priority),
            "store": spec.to_string(),
        })
        .to_string()
    } else {
        device.to_owned()
    };
    let _ = writeln!(std::io::stdout(), "{line}");
    let _ = std::io::stdout().flush();
}

/// Serves until SIGTERM or SIGINT turns the swap off (a failure to turn it off is said and
/// serving goes on), or until the file is unmounted from outside.
async fn serve_until_off(
    own: &Entry,
    term: &mut tokio::signal::unix::Signal,
    int: &mut tokio::signal::unix::Signal,
    mount: &FuseMount,
) {
    loop {
        let ended = tokio::select! {
            _ = term.recv() => false,
            _ = int.recv() => false,
            _ = mount.ended() => true,
        };
        match release_devices(own).await {
            Ok(()) => break,
            Err(e) if ended => {
                note(format_args!(
                    "farmap swap on: {}",
                    crate::output::error_chain(&e)
                ));
                break;
            }
            Err(e) => note(format_args!(
                "farmap swap on: {}; still serving",
                crate::output::error_chain(&e)
            )),
        }
    }
}

/// Mounts, locks the memory, attaches the loop device, mkswap, swapon. Returns the device
/// and whether the loop device does direct I/O.
async fn start(
    args: &SwapOnArgs,
    spec: &StoreSpec,
    served: Arc<dyn Store>,
    setup: &mut Setup,
) -> anyhow::Result<(String, bool)> {
    let opts = MountOptions {
        name: FILE_NAME.to_string(),
        write_buffers: WRITE_BUFFERS,
        // The kernel's swap reads what it needs; nothing is to be read ahead for it.
        warm_page_cache: false,
        ..MountOptions::default()
    };
    let mount_dir = setup.dir.clone();
    let mount = tokio::task::spawn_blocking(move || FuseMount::mount(served, &mount_dir, opts))
        .await?
        .with_context(|| format!("mounting {spec} at {}", setup.dir.display()))?;
    if mount.is_read_only() {
        setup.mount = Some(mount);
        bail!("{spec} is read-only: it cannot hold swap");
    }
    let file = mount.path().display().to_string();
    setup.mount = Some(mount);
    reserve_heap(HEAP_RESERVE);
    // Everything this process has mapped, and will map, stays in memory: before swapon, so
    // that none of it can ever be swapped out to the device this process serves.
    rustix::mm::mlockall(rustix::mm::MlockAllFlags::CURRENT | rustix::mm::MlockAllFlags::FUTURE)
        .context("locking the server's memory (mlockall)")?;

    let want_dio = args.direct_io == OnOff::On;
    let mut losetup = vec!["--find".to_string(), "--show".to_string()];
    if want_dio {
        losetup.push("--direct-io=on".into());
    }
    losetup.push(file.clone());
    let device = tool("losetup", losetup)
        .await
        .with_context(|| format!("attaching a loop device to {file}"))?;
    setup.device = Some(device.clone());
    std::fs::write(record_path(std::process::id()), format!("{device}\n"))
        .with_context(|| format!("recording the device in {SWAP_ROOT}"))?;
    let direct_io = std::fs::read_to_string(format!("/sys/block/{}/loop/dio", dev_name(&device)))
        .is_ok_and(|s| s.trim() == "1");
    if want_dio && !direct_io {
        tracing::warn!(
            device,
            "the loop device fell back to buffered I/O over the FUSE file"
        );
    }
    tool(
        "mkswap",
        vec![
            "-L".into(),
            format!("farmap-{}", std::process::id()),
            device.clone(),
        ],
    )
    .await
    .with_context(|| format!("making swap on {device}"))?;
    let mut swapon = Vec::new();
    if let Some(p) = args.priority {
        swapon.push(format!("--priority={p}"));
    }
    if args.discard {
        swapon.push("--discard".into());
    }
    swapon.push(device.clone());
    tool("swapon", swapon)
        .await
        .with_context(|| format!("turning swap on {device} on"))?;
    Ok((device, direct_io))
}

async fn off(args: SwapOffArgs) -> anyhow::Result<ExitCode> {
    let all = entries();
    let chosen: Vec<&Entry> = match &args.target {
        None => all.iter().collect(),
        Some(t) => {
            let as_path = std::path::absolute(t).ok();
            all.iter()
                .filter(|e| {
                    t.parse::<u32>() == Ok(e.pid)
                        || e.devices.iter().any(|d| d == t)
                        || e.recorded.as_deref() == Some(t.as_str())
                        || as_path.as_deref() == Some(e.dir.as_path())
                })
                .collect()
        }
    };
    if chosen.is_empty() {
        match &args.target {
            Some(t) => bail!(
                "{t} is not a farmap swap (none of {SWAP_ROOT}/*: give its device, directory or \
                 server PID)"
            ),
            None => {
                note("farmap swap off: no farmap swap is on");
                return Ok(ExitCode::SUCCESS);
            }
        }
    }
    for entry in chosen {
        if !entry.is_served() {
            clean_dead(entry).await?;
            continue;
        }
        release_devices(entry).await?;
        let Some(pid) = rustix::process::Pid::from_raw(entry.pid as i32) else {
            bail!("bad pid {}", entry.pid);
        };
        rustix::process::kill_process(pid, rustix::process::Signal::TERM)
            .with_context(|| format!("signalling the serving process {}", entry.pid))?;
        let start = Instant::now();
        let mut told = false;
        while !is_gone(entry.pid) {
            if !told && start.elapsed() > Duration::from_secs(2) {
                note(format_args!(
                    "farmap swap off: waiting for process {} to flush and unmount",
                    entry.pid
                ));
                told = true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if entry.dir.exists() {
            bail!(
                "process {} exited but left {} behind (see its error output)",
                entry.pid,
                entry.dir.display()
            );
        }
        note(format_args!(
            "farmap swap off: {} is off, detached, flushed and unmounted",
            entry.recorded.as_deref().unwrap_or("the swap")
        ));
    }
    Ok(ExitCode::SUCCESS)
}
