//! `farmap mount` / `farmap umount`: a region as a file any program can read, write and
//! `mmap`, served by this process (FUSE) until SIGINT/SIGTERM or `farmap umount DIR`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use farmap::pipeline::{PullOptions, PullOrder, PushOptions};
use farmap::spec::open_store_async;
use farmap::{Managed, ManagedOptions, Store, StoreSpec};
use farmap_fuse::{FuseMount, MountOptions};
use farmap_migrate::mount::MountShared;

use crate::cache_max::{parse_cache_max, CacheMax};
use crate::stop::stop_signal;
use farmap_cli_kit::args::parse_duration;
use farmap_cli_kit::metrics::{Metrics, MetricsArgs};

/// The order of a managed mount's background pull.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PullOrderArg {
    /// First chunk to last.
    Sequential,
    /// Last chunk to first.
    Reverse,
    /// No background pull: chunks are fetched when read.
    None,
}

/// A managed front's background pull (`--workers`, `--pull-order`): the same flags for
/// `farmap mount` and `farmap swap on`.
#[derive(Debug, Clone, Copy, Args)]
pub struct PullArgs {
    /// Background pull workers, i.e. fetches in flight (managed mode). Default: farmap's
    /// choice: from a farmap server, runs of 1 MiB in one request each, as many in flight as
    /// keep the link busy (up to 16 MiB); from other stores, 16 MiB of single chunks.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub workers: Option<u32>,
    /// Background pull order (managed mode). Either order pulls a `versioned:` region's
    /// recorded working set (the chunks its last run touched first) first, in that order.
    #[arg(long, value_enum, default_value = "sequential")]
    pub pull_order: PullOrderArg,
}

#[derive(Debug, Args)]
pub struct MountArgs {
    /// The mount point (an existing empty directory), then the store; with --nbd or --ublk,
    /// only the store.
    #[arg(value_name = "DIR")]
    first: String,
    /// The store (any spec).
    #[arg(value_name = "STORE")]
    second: Option<String>,
    /// Managed mode: a local memory cache filled in the background and written back on an
    /// interval (for remote stores). Without it, reads and writes go to the store directly.
    #[arg(long)]
    managed: bool,
    /// The file's name in DIR.
    #[arg(long, default_value = farmap_fuse::DEFAULT_FILE_NAME)]
    name: String,
    #[command(flatten)]
    pull: PullArgs,
    /// How often written chunks are pushed to the store (managed mode); fsync, unmount and
    /// SIGTERM push everything.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    push_interval: Duration,
    /// Most of the region held in local memory (managed mode): SIZE (binary suffixes:
    /// 64MiB) or N% of the region. Over it, chunks are dropped (modified ones pushed
    /// first) and fetched again when read; there is no background pull then.
    #[arg(long, value_name = "SIZE|N%", value_parser = parse_cache_max, requires = "managed")]
    cache_max: Option<CacheMax>,
    /// Save a checkpoint every DURATION: what programs wrote (the page cache too) is written
    /// to the store and flushed, as an fsync of the file would. On a `versioned:` store each
    /// checkpoint with something new is a version (`farmap versions` lists them).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration,
          conflicts_with_all = ["nbd", "ublk", "agent"])]
    checkpoint_every: Option<Duration>,
    /// Refuse writes.
    #[arg(long)]
    read_only: bool,
    /// Let other users than this one use the file (allow_other).
    #[arg(long)]
    allow_other: bool,
    /// Warm the page cache: a `versioned:` region's recorded working set (the chunks its
    /// last run touched first, in that order) is read through the file as soon as a program
    /// first reads it, so that its first touches may find the pages cached. Off by default:
    /// it did not shorten a restored VM's stall here (see docs/vm.md).
    #[arg(long, conflicts_with_all = ["nbd", "ublk"])]
    warm_up: bool,
    /// Serve the region as a block device through the kernel's NBD client instead (STORE
    /// only): prints /dev/nbdN when it is ready; needs the kernel's nbd driver and root.
    #[arg(long, conflicts_with = "ublk")]
    nbd: bool,
    /// Serve the region as a ublk block device instead (STORE only): prints /dev/ublkbN
    /// when it is ready; needs the kernel's ublk_drv.
    #[arg(long)]
    ublk: bool,
    #[command(flatten)]
    ublk_opts: crate::mount_ublk::UblkMountOpts,
    /// Run a migration agent on this Unix socket: `farmap seed --app SOCKET` moves the file
    /// to another mount while programs use it. Without STORE, the mount waits for a file to
    /// arrive (`farmap leech --app SOCKET`) and mounts DIR when it does.
    #[arg(long, value_name = "SOCKET", conflicts_with_all = ["nbd", "ublk"])]
    agent: Option<PathBuf>,
    /// At the hand-over, stop the writers with this shell command instead of SIGSTOP of the
    /// processes that have the file open or mapped (it must exit 0).
    #[arg(long, value_name = "CMD", requires = "agent")]
    suspend: Option<String>,
    /// With --suspend: a command run before the migration heads for the suspension (an
    /// instant migration's last pushes, a copy's suspension), while the writers run on: a
    /// controller readies what the suspension needs (`farmap vm prepare`). It must exit 0;
    /// otherwise the migration is abandoned.
    #[arg(long, value_name = "CMD", requires = "suspend")]
    prepare: Option<String>,
    /// With --suspend: the command that lets the writers run again if the migration is
    /// abandoned before the hand-over.
    #[arg(long, value_name = "CMD", requires = "suspend")]
    resume: Option<String>,
    /// After the hand-over, run this shell command (FARMAP_PIDS: the stopped processes,
    /// FARMAP_FILE: the file) instead of sending them SIGTERM; they get SIGCONT after it.
    #[arg(long, value_name = "CMD", requires = "agent")]
    after: Option<String>,
    #[command(flatten)]
    nbd_opts: crate::mount_nbd::NbdMountOpts,
    #[command(flatten)]
    metrics: MetricsArgs,
}

#[derive(Debug, Args)]
pub struct UmountArgs {
    /// The mount point of a `farmap mount`.
    dir: PathBuf,
}

pub async fn run(args: MountArgs) -> anyhow::Result<ExitCode> {
    // From the start: a SIGTERM just after the path is printed must flush and unmount.
    crate::stop::listen_for_stop()?;
    let (spec, dir): (StoreSpec, Option<PathBuf>) = if args.ublk || args.nbd {
        if let Some(extra) = &args.second {
            let how = if args.nbd { "--nbd" } else { "--ublk" };
            bail!("farmap mount {how} takes only a store, not a mount point ({extra:?} is extra)");
        }
        (args.first.parse()?, None)
    } else {
        let Some(store_arg) = &args.second else {
            if let Some(socket) = args.agent.clone() {
                // A migration's destination: the file arrives through the agent.
                return crate::mount_agent::run(agent_mount(&args, socket, None, None)).await;
            }
            bail!("farmap mount needs a mount point and a store: farmap mount DIR STORE");
        };
        (store_arg.parse()?, Some(PathBuf::from(&args.first)))
    };
    if args.nbd && !farmap_nbd_kernel::kernel_has_nbd() {
        // Before the store is opened: a remote one is not contacted for nothing.
        return Err(anyhow::Error::new(
            farmap_nbd_kernel::NbdKernelError::NoDriver,
        ))
        .context("setting up the kernel NBD device");
    }
    let managed_opts = args
        .managed
        .then(|| managed_options(args.pull, args.push_interval));
    let metrics = args.metrics.metrics();
    let (served, managed) = open_served(&spec, managed_opts, args.cache_max, &metrics).await?;
    let _endpoint = args.metrics.serve("mount", &metrics).await?;
    if args.nbd {
        // The device is flushed and disconnected first (the server flushes the store stack
        // when it stops); then push what is left.
        let result =
            crate::mount_nbd::serve(served, &spec.to_string(), args.read_only, &args.nbd_opts)
                .await;
        finish_managed(managed, result).await?;
        return Ok(ExitCode::SUCCESS);
    }
    let Some(dir) = dir else {
        // --ublk: the device flushes the store stack when it stops; then push what is left.
        let result = crate::mount_ublk::serve(served, &spec.to_string(), &args.ublk_opts).await;
        finish_managed(managed, result).await?;
        return Ok(ExitCode::SUCCESS);
    };
    let opts = mount_options(&args);
    let mount_dir = dir.clone();
    let mount = tokio::task::spawn_blocking(move || FuseMount::mount(served, &mount_dir, opts))
        .await?
        .with_context(|| format!("mounting {spec} at {}", dir.display()))?;
    println!("{}", mount.path().display());
    if let Some(socket) = args.agent.clone() {
        return serve_with_agent(&args, socket, mount, &spec, managed).await;
    }
    serve_until_stopped(mount, &spec, &dir, managed, args.checkpoint_every).await
}

/// Serves the mounted file with a migration agent on `socket` until a migration moves it
/// away or the agent stops; then pushes what is left, unless the store went with the file.
async fn serve_with_agent(
    args: &MountArgs,
    socket: PathBuf,
    mount: FuseMount,
    spec: &StoreSpec,
    managed: Option<Arc<Managed>>,
) -> anyhow::Result<ExitCode> {
    // A store another host can open moves instantly: only where each chunk is travels.
    let secret = spec.to_secret_string();
    let shared = (!secret.trim_start().starts_with("memory:")).then(|| MountShared {
        spec: secret,
        seal: managed
            .clone()
            .map(|m| m as Arc<dyn farmap::pipeline::Seal>),
    });
    let result = crate::mount_agent::run(agent_mount(args, socket, Some(mount), shared)).await;
    if let Some(m) = managed.filter(|m| {
        // An instant migration handed the store over with the file: pushing here now
        // could overwrite the destination's writes.
        !m.is_sealed()
    }) {
        // The agent's last references may linger: push what is left either way.
        report_evictions(&m);
        match Arc::try_unwrap(m) {
            Ok(m) => m.shutdown().await.context("pushing the last writes")?,
            Err(m) => m.flush().await.context("pushing the last writes")?,
        }
    }
    result
}

/// Serves the mounted file until SIGINT/SIGTERM or an unmount from outside; then unmounts
/// and flushes.
async fn serve_until_stopped(
    mount: FuseMount,
    spec: &StoreSpec,
    dir: &Path,
    managed: Option<Arc<Managed>>,
    checkpoint_every: Option<Duration>,
) -> anyhow::Result<ExitCode> {
    status!(
        "farmap mount: {} is {spec} ({}, {}{}); stop with Ctrl-C, SIGTERM or `farmap umount {}`",
        mount.path().display(),
        mount.geometry(),
        if managed.is_some() {
            "managed"
        } else {
            "direct"
        },
        if mount.is_read_only() {
            ", read-only"
        } else {
            ""
        },
        dir.display(),
    );
    let checkpoints = match checkpoint_every {
        Some(every) => Some(checkpoint(
            mount.open().context("opening the file for checkpoints")?,
            every,
        )),
        None => None,
    };
    let by_signal = tokio::select! {
        r = stop_signal() => { r?; true }
        _ = mount.ended() => false,
    };
    if let Some(task) = checkpoints {
        // Its handle on the file must be closed before the unmount (an open file keeps a
        // detached mount served).
        task.abort();
        let _ = task.await;
    }
    if by_signal {
        status!("farmap mount: flushing and unmounting {}", dir.display());
    } else {
        status!("farmap mount: {} was unmounted; flushing", dir.display());
    }
    let unmounted = tokio::task::spawn_blocking(move || mount.unmount()).await?;
    finish_managed(managed, unmounted.context("unmounting")).await?;
    status!("farmap mount: unmounted; the store is flushed");
    Ok(ExitCode::SUCCESS)
}

/// Saves a checkpoint of the mounted `file` every `every` (an fsync: the page cache to the
/// store, then the store's flush) until aborted.
fn checkpoint(file: std::fs::File, every: Duration) -> tokio::task::JoinHandle<()> {
    let file = Arc::new(file);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let f = file.clone();
            let start = std::time::Instant::now();
            match tokio::task::spawn_blocking(move || f.sync_all()).await {
                Ok(Ok(())) => {
                    tracing::info!(ms = start.elapsed().as_millis() as u64, "checkpoint saved")
                }
                Ok(Err(e)) => tracing::warn!("checkpoint failed: {e}"),
                Err(_) => return,
            }
        }
    })
}

/// Opens the store `spec` names, behind a managed front (Cached + Puller + Pusher) when
/// `managed` gives its options: the store to serve, and the front to finish with
/// [`finish_managed`]. Both are counted in `metrics` (the store as `store="store"`).
pub(crate) async fn open_served(
    spec: &StoreSpec,
    managed: Option<ManagedOptions>,
    cache_max: Option<CacheMax>,
    metrics: &Metrics,
) -> anyhow::Result<(Arc<dyn Store>, Option<Arc<Managed>>)> {
    let store = open_store_async(spec)
        .await
        .with_context(|| format!("opening {spec}"))?;
    let store = metrics.meter("store", spec, store);
    let Some(opts) = managed else {
        return Ok((store, None));
    };
    let size = store.geometry().size();
    let m = Arc::new(open_managed(store, opts, cache_max)?);
    metrics.managed(&m);
    if let Some(max) = cache_max {
        status!("{}", cache_max_note(size, max));
    }
    Ok((m.clone(), Some(m)))
}

/// Starts a managed front over `store`, bounded by `cache_max` (resolved against the
/// region's size) when given (the caller says so: see [`cache_max_note`]).
pub(crate) fn open_managed(
    store: Arc<dyn Store>,
    mut opts: ManagedOptions,
    cache_max: Option<CacheMax>,
) -> anyhow::Result<Managed> {
    if let Some(max) = cache_max {
        opts.cache_max = Some(max.bytes_of(store.geometry().size()));
    }
    Managed::open(store, opts).context("starting the managed store")
}

/// What a managed front bounded by `max` holds of a region of `size` bytes, for stderr.
pub(crate) fn cache_max_note(size: u64, max: CacheMax) -> String {
    format!(
        "farmap: the managed cache holds at most {} bytes of the region's {size} \
         (--cache-max {max}); no background pull",
        max.bytes_of(size)
    )
}

/// The managed front's options from the command line's `--workers`, `--pull-order` and
/// `--push-interval` (a zero interval: pushed only at flush).
pub(crate) fn managed_options(
    PullArgs {
        workers,
        pull_order,
    }: PullArgs,
    push_interval: Duration,
) -> ManagedOptions {
    let pull = match pull_order {
        PullOrderArg::None => None,
        order => Some(PullOptions {
            // 0: the pull's own choice from the chunk size.
            workers: workers.map_or(0, |w| w as usize),
            order: match order {
                PullOrderArg::Reverse => PullOrder::Priority(Arc::new(|idx| idx.0 as i64)),
                _ => PullOrder::Sequential,
            },
            ..PullOptions::default()
        }),
    };
    ManagedOptions {
        pull,
        push: PushOptions {
            interval: (!push_interval.is_zero()).then_some(push_interval),
            ..PushOptions::default()
        },
        ..ManagedOptions::default()
    }
}

fn mount_options(args: &MountArgs) -> MountOptions {
    MountOptions {
        name: args.name.clone(),
        read_only: args.read_only,
        allow_other: args.allow_other,
        warm_page_cache: args.warm_up,
        ..MountOptions::default()
    }
}

fn agent_mount(
    args: &MountArgs,
    socket: PathBuf,
    mount: Option<FuseMount>,
    shared: Option<MountShared>,
) -> crate::mount_agent::AgentMount {
    use farmap_migrate::mount::{After, SuspendHow};
    crate::mount_agent::AgentMount {
        socket,
        dir: PathBuf::from(&args.first),
        opts: mount_options(args),
        how: match &args.suspend {
            Some(cmd) => SuspendHow::Command {
                prepare: args.prepare.clone(),
                suspend: cmd.clone(),
                resume: args.resume.clone(),
            },
            None => SuspendHow::Holders,
        },
        after: match &args.after {
            Some(cmd) => After::Command(cmd.clone()),
            None => After::Signal(libc::SIGTERM),
        },
        mount,
        shared,
    }
}

/// After the frontend has stopped (`result`): pushes what a managed store still holds and
/// stops it (the frontend's last reference went with it).
pub(crate) async fn finish_managed(
    managed: Option<Arc<Managed>>,
    result: anyhow::Result<()>,
) -> anyhow::Result<()> {
    if let Some(mut m) = managed {
        report_evictions(&m);
        // The frontend's last requests may still be finishing on the runtime (a reply task
        // holds the store until it ends): give them a moment.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match Arc::try_unwrap(m) {
                Ok(owned) => {
                    let shut = owned
                        .shutdown()
                        .await
                        .context("pushing the last writes to the store");
                    return result.and(shut);
                }
                Err(shared) if Instant::now() < deadline => {
                    m = shared;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(shared) => {
                    // Still held: push what is dirty all the same.
                    tracing::warn!("the managed store is still in use: flushing it instead");
                    let flushed = shared
                        .flush()
                        .await
                        .context("pushing the last writes to the store");
                    return result.and(flushed);
                }
            }
        }
    }
    result
}

/// Prints what a bounded managed front's evictions did (nothing for an unbounded one).
pub(crate) fn report_evictions(m: &Managed) {
    if let Some(st) = m.evict_stats() {
        status!(
            "farmap: managed cache: at most {} chunks held; {} evicted, {} of them pushed first",
            st.max_chunks,
            st.evicted_chunks,
            st.written_back_chunks
        );
    }
}

/// Whether process `pid` is gone (or a zombie: it has stopped serving).
pub(crate) fn is_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_none_or(|state| state == "Z" || state == "X"),
    }
}

pub async fn umount(args: UmountArgs) -> anyhow::Result<ExitCode> {
    let dir = args.dir;
    let info = farmap_fuse::find_mount(&dir)
        .with_context(|| format!("looking {} up in /proc/self/mountinfo", dir.display()))?;
    let Some(info) = info else {
        bail!("{} is not a mount point", dir.display());
    };
    let Some(pid) = info.farmap_pid() else {
        bail!(
            "{} is not a farmap mount (it is {} from {})",
            dir.display(),
            info.fs_type,
            info.source
        );
    };
    if is_gone(pid) || farmap_fuse::is_stale(&dir) {
        farmap_fuse::cleanup_stale(&dir)
            .with_context(|| format!("unmounting the dead mount at {}", dir.display()))?;
        status!(
            "farmap umount: the process that served {} (pid {pid}) was gone; unmounted it \
             (writes it had not flushed are lost)",
            dir.display()
        );
        return Ok(ExitCode::SUCCESS);
    }
    let Some(pid_nz) = rustix::process::Pid::from_raw(pid as i32) else {
        bail!("bad pid {pid} in the mount's source {}", info.source);
    };
    rustix::process::kill_process(pid_nz, rustix::process::Signal::TERM)
        .with_context(|| format!("signalling the serving process {pid}"))?;
    let start = Instant::now();
    let mut told = false;
    while !is_gone(pid) {
        if !told && start.elapsed() > Duration::from_secs(2) {
            status!(
                "farmap umount: waiting for process {pid} to flush and for programs that still \
                 use {} to let go of it",
                dir.display()
            );
            told = true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if still_mounted_by(&dir, pid) {
        bail!(
            "process {pid} exited but {} is still mounted (see its error output)",
            dir.display()
        );
    }
    status!("farmap umount: {} is unmounted and flushed", dir.display());
    Ok(ExitCode::SUCCESS)
}

fn still_mounted_by(dir: &Path, pid: u32) -> bool {
    matches!(farmap_fuse::find_mount(dir), Ok(Some(m)) if m.farmap_pid() == Some(pid))
}
