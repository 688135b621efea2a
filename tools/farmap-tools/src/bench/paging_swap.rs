//! The kernel-swap baseline of `farmap bench paging`: the same application as a plain
//! process (`farmap __paging-app`) in a cgroup v1 memory limit, swapping to a loop device
//! over a file in RAM.
//!
//! Set up once per benchmark run (root only), torn down when [`SwapEnv`] drops, on success,
//! error and Ctrl-C alike (the benchmark kills the child first):
//! - the memory controller's v1 hierarchy: the one mounted already (`/proc/self/mounts`,
//!   type `cgroup` with option `memory`), else one mounted for the run in a directory under
//!   `/run` (`mount -t cgroup -o memory`) and unmounted afterwards. Where the controller
//!   belongs to cgroup v2 the mount fails and the baseline is skipped, saying so.
//! - a cgroup of our own, `farmap-bench-paging-PID`, made under this process's own memory
//!   cgroup (so that it stays inside whatever limits the bench itself runs under), removed
//!   afterwards;
//! - the swap: a private tmpfs mounted with `noswap` (`/run/farmap-bench-paging-PID`, sized
//!   to fit), holding one file of the region's size plus 64 MiB, allocated in full up front
//!   by this process (`fallocate`); then `losetup --find --show`, `mkswap`, `swapon
//!   --priority 32767` (above any other swap, which is left on: the kernel fills the highest
//!   priority first). Teardown: `swapoff`, `losetup -d`, `umount`.
//!   - `noswap` because a swappable file under a swap device is a deadlock: this machine
//!     runs DAMON's proactive page-out (`kdamond`), which wrote cold pages of a swap file in
//!     `/dev/shm` out to the very loop device they back; the loop worker then waited for
//!     that write-back forever (and so did `swapoff`). Without `noswap` (kernels before 6.4)
//!     the baseline is skipped.
//!   - allocated up front because the loop driver charges its I/O to the memory cgroup
//!     whose pages it writes: a sparse file would take a new tmpfs page, charged to the
//!     limited cgroup, for every page swapped out, and the limit would free nothing.
//!   - Leftovers of a run that was killed (`SIGKILL`: no teardown) are cleaned up by the
//!     next run: directories and cgroups named after a dead PID.
//!
//! # The limit
//! The child joins the cgroup, allocates everything but the application's memory (its
//! per-thread versions, histograms, the runtime farmap's `main` starts), maps that memory
//! untouched, and says `ready`. The cgroup's `memory.usage_in_bytes` then is the child's own
//! overhead; the limit is set to that + `local%` of the size + 2 MiB (page tables of the
//! mapping, the application threads' stacks and the kernel's per-CPU charge batches), and
//! the child is told `go`. For the unlimited run the limit is `-1`.

use std::io::{BufRead, BufReader, Write as _};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use super::paging_app::{AppArgs, AppConfig, AppReport};

/// The swap's priority: the highest there is.
const SWAP_PRIORITY: &str = "32767";

/// Headroom of the limit over `local%` of the size and the child's measured overhead.
pub const LIMIT_SLACK: u64 = 2 << 20;

/// How often a run the OOM killer ended is tried again.
pub const OOM_RETRIES: u32 = 3;

/// One kernel-swap run.
#[derive(Debug)]
pub struct KernelRun {
    pub report: AppReport,
    /// `memory.limit_in_bytes` (`None`: unlimited).
    pub limit: Option<u64>,
    /// Attempts the OOM killer ended before this one.
    pub oom_kills: u32,
}

/// The child running now, killed by Ctrl-C.
static CHILD: Mutex<Option<u32>> = Mutex::new(None);

/// Kills the child running now, if any (Ctrl-C).
pub fn kill_child() {
    if let Some(pid) = *CHILD.lock().unwrap_or_else(|e| e.into_inner()) {
        if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
}

fn cmd(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {program}"))?;
    if !out.status.success() {
        bail!(
            "{program} {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// The kernel-swap environment; dropping it tears everything down.
#[derive(Debug, Default)]
pub struct SwapEnv {
    /// Our cgroup.
    cgroup: Option<PathBuf>,
    /// The v1 memory hierarchy mounted for this run (unmounted and removed on drop).
    mounted_hierarchy: Option<PathBuf>,
    /// The directory of the swap file, and whether our tmpfs is mounted on it.
    dir: Option<PathBuf>,
    tmpfs: bool,
    loop_dev: Option<String>,
    swap_on: bool,
}

fn libc_ebusy() -> i32 {
    rustix::io::Errno::BUSY.raw_os_error()
}

/// The prefix of everything a run names after its PID (directories under `/run`, cgroups).
const PREFIX: &str = "farmap-bench-paging-";

/// How long teardown waits for `swapoff` (it reads every swapped page back).
const SWAPOFF_TIMEOUT: Duration = Duration::from_secs(300);

/// Runs a command for at most `timeout`; one still running then is left alone (it may be
/// stuck in the kernel, where a signal would not reach it anyway).
fn cmd_timeout(program: &str, args: &[&str], timeout: Duration) -> anyhow::Result<()> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {program}"))?;
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            if status.success() {
                return Ok(());
            }
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut err);
            }
            bail!(
                "{program} {} failed ({status}): {}",
                args.join(" "),
                err.trim()
            );
        }
        if Instant::now() >= deadline {
            bail!(
                "{program} {} still runs after {} s (pid {}); left alone",
                args.join(" "),
                timeout.as_secs(),
                child.id()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The PID a name made by [`PREFIX`] carries, if that process is gone.
fn dead_owner(name: &str) -> Option<u32> {
    let rest = name.strip_prefix(PREFIX)?;
    let pid: u32 = rest.split('-').next()?.parse().ok()?;
    (!Path::new(&format!("/proc/{pid}")).exists()).then_some(pid)
}

/// Whether `dir` is a mount point.
fn is_mount_point(dir: &Path) -> bool {
    std::fs::read_to_string("/proc/self/mounts")
        .map(|m| {
            m.lines()
                .any(|l| l.split_whitespace().nth(1) == Some(&*dir.to_string_lossy()))
        })
        .unwrap_or(false)
}

/// Cleans up after runs that were killed before their teardown: swap, loop devices, mounts
/// and cgroups named after a PID that is gone.
fn clean_leftovers(cgroup_parent: &Path) {
    let warn = |what: String, e: anyhow::Error| {
        status!(
            "farmap bench paging: cleaning up {what}: {}",
            crate::output::error_chain(&e)
        );
    };
    if let Ok(entries) = std::fs::read_dir("/run") {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if dead_owner(&name).is_none() {
                continue;
            }
            let dir = e.path();
            let file = dir.join("swap");
            if file.exists() {
                let f = file.to_string_lossy().into_owned();
                let devs = cmd("losetup", &["--noheadings", "--output", "NAME", "-j", &f])
                    .unwrap_or_default();
                for dev in devs.lines().map(str::trim).filter(|d| !d.is_empty()) {
                    let swaps = std::fs::read_to_string("/proc/swaps").unwrap_or_default();
                    if swaps
                        .lines()
                        .any(|l| l.split_whitespace().next() == Some(dev))
                    {
                        if let Err(err) = cmd_timeout("swapoff", &[dev], SWAPOFF_TIMEOUT) {
                            warn(dev.to_string(), err);
                            continue;
                        }
                    }
                    if let Err(err) = cmd("losetup", &["-d", dev]) {
                        warn(dev.to_string(), err);
                    }
                }
            }
            if is_mount_point(&dir) {
                if let Err(err) = cmd("umount", &[&dir.to_string_lossy()]) {
                    warn(dir.display().to_string(), err);
                    continue;
                }
            }
            let _ = std::fs::remove_file(&file);
            let _ = std::fs::remove_dir(&dir);
        }
    }
    if let Ok(entries) = std::fs::read_dir(cgroup_parent) {
        for e in entries.flatten() {
            if dead_owner(&e.file_name().to_string_lossy()).is_some() {
                let _ = std::fs::remove_dir(e.path());
            }
        }
    }
}

/// Where the memory controller's v1 hierarchy is mounted, if it is.
fn find_v1_memory() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mounts.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.len() >= 4 && f[2] == "cgroup" && f[3].split(',').any(|o| o == "memory"))
            .then(|| PathBuf::from(f[1]))
    })
}

/// This process's cgroup in the memory hierarchy (`/` when it has none).
fn own_memory_cgroup() -> String {
    std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                let mut f = l.splitn(3, ':');
                let (_, ctrl, path) = (f.next()?, f.next()?, f.next()?);
                ctrl.split(',')
                    .any(|c| c == "memory")
                    .then(|| path.to_owned())
            })
        })
        .unwrap_or_else(|| "/".to_owned())
}

impl SwapEnv {
    /// Sets everything up for an application of `size` bytes; `Err` says why the baseline
    /// cannot run here (what was set up is torn down).
    pub fn setup(size: u64) -> anyhow::Result<SwapEnv> {
        if !rustix::process::geteuid().is_root() {
            bail!("memory cgroups, loop devices and swapon need root");
        }
        let pid = std::process::id();
        let mut env = SwapEnv::default();
        let root = match find_v1_memory() {
            Some(root) => root,
            None => {
                let dir = PathBuf::from(format!("/run/{PREFIX}{pid}-memcg"));
                std::fs::create_dir_all(&dir)
                    .with_context(|| format!("making {}", dir.display()))?;
                env.mounted_hierarchy = Some(dir.clone());
                let d = dir.to_string_lossy().into_owned();
                cmd("mount", &["-t", "cgroup", "-o", "memory", "cgroup", &d]).context(
                    "no cgroup v1 memory hierarchy is mounted and mounting one failed \
                     (is the memory controller bound to cgroup v2?)",
                )?;
                dir
            }
        };
        let parent = if env.mounted_hierarchy.is_some() {
            root.clone()
        } else {
            root.join(own_memory_cgroup().trim_start_matches('/'))
        };
        clean_leftovers(&parent);
        let cg = parent.join(format!("{PREFIX}{pid}"));
        std::fs::create_dir(&cg)
            .with_context(|| format!("making the memory cgroup {}", cg.display()))?;
        env.cgroup = Some(cg.clone());
        if !cg.join("memory.limit_in_bytes").exists() {
            bail!("{} has no memory.limit_in_bytes", cg.display());
        }

        let dir = PathBuf::from(format!("/run/{PREFIX}{pid}"));
        std::fs::create_dir_all(&dir).with_context(|| format!("making {}", dir.display()))?;
        env.dir = Some(dir.clone());
        let len = size + (64 << 20);
        let d = dir.to_string_lossy().into_owned();
        let opts = format!("noswap,size={},mode=0700", len + (1 << 20));
        cmd(
            "mount",
            &["-t", "tmpfs", "-o", &opts, "farmap-bench-paging", &d],
        )
        .context(
            "mounting a tmpfs with `noswap` for the swap file (Linux 6.4 or later; a \
             swappable one can deadlock the loop device)",
        )?;
        env.tmpfs = true;
        let file = dir.join("swap");
        let f = std::fs::File::create(&file).context("creating the swap file")?;
        rustix::fs::fallocate(f.as_fd(), rustix::fs::FallocateFlags::empty(), 0, len)
            .context("allocating the swap file")?;
        drop(f);
        let file = file.to_string_lossy().into_owned();
        let dev = cmd("losetup", &["--find", "--show", &file])
            .context("attaching a loop device (util-linux's losetup)")?;
        env.loop_dev = Some(dev.clone());
        cmd("mkswap", &[&dev])?;
        cmd("swapon", &["--priority", SWAP_PRIORITY, &dev])?;
        env.swap_on = true;
        Ok(env)
    }

    fn cgroup(&self) -> &Path {
        self.cgroup.as_deref().expect("set up")
    }

    /// The swap device (`/dev/loopN`).
    pub fn device(&self) -> &str {
        self.loop_dev.as_deref().unwrap_or("?")
    }

    /// The cgroup's `cgroup.procs` (a process that writes its PID there joins it).
    pub fn procs(&self) -> PathBuf {
        self.cgroup().join("cgroup.procs")
    }

    /// Sets `memory.limit_in_bytes` (`None`: unlimited); lowering it reclaims (swaps out)
    /// down to it before it returns.
    ///
    /// The kernel gives up (EBUSY) when a few rounds of reclaim did not bring the usage
    /// down; each write reclaims more, so it is written again for up to 10 s.
    pub fn set_limit(&self, limit: Option<u64>) -> anyhow::Result<()> {
        let v = limit.map_or_else(|| "-1".to_owned(), |l| l.to_string());
        let path = self.cgroup().join("memory.limit_in_bytes");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match std::fs::write(&path, &v) {
                Ok(()) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc_ebusy()) && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => {
                    let usage = self.usage().unwrap_or(0);
                    return Err(anyhow::Error::new(e).context(format!(
                        "setting memory.limit_in_bytes to {v} (usage {usage})"
                    )));
                }
            }
        }
    }

    /// `memory.usage_in_bytes`: what the cgroup's processes are charged for now.
    pub fn usage(&self) -> anyhow::Result<u64> {
        let p = self.cgroup().join("memory.usage_in_bytes");
        std::fs::read_to_string(&p)
            .with_context(|| format!("reading {}", p.display()))?
            .trim()
            .parse()
            .context("memory.usage_in_bytes is not a number")
    }

    /// The cgroup's OOM kills so far (`oom_kill` in `memory.oom_control`).
    pub fn oom_kills(&self) -> u64 {
        std::fs::read_to_string(self.cgroup().join("memory.oom_control"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok())
            })
            .unwrap_or(0)
    }

    /// Runs the application in the cgroup, limited to `local` bytes (plus its overhead and
    /// [`LIMIT_SLACK`]) or unlimited; returns its report, the limit set and how many
    /// attempts the OOM killer ended first (each is retried, up to [`OOM_RETRIES`]).
    pub fn run(&self, config: &AppConfig, local: Option<u64>) -> anyhow::Result<KernelRun> {
        let mut oom_kills = 0;
        loop {
            let before = self.oom_kills();
            let result = self.run_once(config, local);
            if result.is_err() {
                // Ctrl-C reaches the child too: say so rather than guess at a cause.
                super::paging_app::interrupted()?;
            }
            match result {
                Ok((report, limit)) => {
                    return Ok(KernelRun {
                        report,
                        limit,
                        oom_kills,
                    })
                }
                Err(e) if self.oom_kills() > before && oom_kills < OOM_RETRIES => {
                    oom_kills += 1;
                    status!(
                        "farmap bench paging: the OOM killer ended the kernel-swap application \
                         (attempt {oom_kills}); running it again"
                    );
                    drop(e);
                }
                Err(e) if self.oom_kills() > before => {
                    return Err(e.context(format!(
                        "the OOM killer ended the kernel-swap application {} times in a row",
                        oom_kills + 1
                    )))
                }
                Err(e) => return Err(e),
            }
            super::paging_app::interrupted()?;
        }
    }

    fn run_once(
        &self,
        config: &AppConfig,
        local: Option<u64>,
    ) -> anyhow::Result<(AppReport, Option<u64>)> {
        self.set_limit(None)?;
        let exe = std::env::current_exe().context("finding the farmap binary")?;
        let mut child = Command::new(exe)
            .args(AppArgs::command_line(config, self.cgroup()))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting the kernel-swap application")?;
        *CHILD.lock().unwrap_or_else(|e| e.into_inner()) = Some(child.id());
        let result = self.drive(&mut child, local);
        if result.is_err() {
            let _ = child.kill();
        }
        let status = child.wait();
        *CHILD.lock().unwrap_or_else(|e| e.into_inner()) = None;
        let status = status.context("waiting for the kernel-swap application")?;
        let report = result?;
        if !status.success() {
            bail!("the kernel-swap application failed: {status}");
        }
        Ok(report)
    }

    fn drive(
        &self,
        child: &mut Child,
        local: Option<u64>,
    ) -> anyhow::Result<(AppReport, Option<u64>)> {
        let mut stdin: ChildStdin = child.stdin.take().context("child stdin")?;
        let stdout: ChildStdout = child.stdout.take().context("child stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let mut next = |what: &str| -> anyhow::Result<String> {
            lines
                .next()
                .transpose()?
                .with_context(|| format!("the kernel-swap application ended before {what}"))
        };
        let ready = next("saying ready")?;
        if ready != "ready" {
            bail!("the kernel-swap application said {ready:?} instead of ready");
        }
        let limit = match local {
            Some(local) => Some(self.usage()? + local + LIMIT_SLACK),
            None => None,
        };
        self.set_limit(limit)?;
        writeln!(stdin, "go")?;
        stdin.flush()?;
        let line = next("reporting (killed by the OOM killer?)")?;
        let report: AppReport = serde_json::from_str(&line)
            .with_context(|| format!("the kernel-swap application's report {line:?}"))?;
        Ok((report, limit))
    }
}

impl Drop for SwapEnv {
    fn drop(&mut self) {
        let warn = |what: &str, e: anyhow::Error| {
            status!(
                "farmap bench paging: teardown: {what}: {}",
                crate::output::error_chain(&e)
            );
        };
        let mut stuck = false;
        if let Some(dev) = self.loop_dev.take() {
            if self.swap_on {
                if let Err(e) = cmd_timeout("swapoff", &[&dev], SWAPOFF_TIMEOUT) {
                    warn("swapoff", e);
                    stuck = true;
                }
            }
            if !stuck {
                if let Err(e) = cmd("losetup", &["-d", &dev]) {
                    warn("losetup -d", e);
                    stuck = true;
                }
            }
        }
        if let Some(dir) = self.dir.take() {
            if self.tmpfs && !stuck {
                // A detached loop device lets go of its file a moment later.
                let d = dir.to_string_lossy().into_owned();
                let mut umount = cmd("umount", &[&d]);
                for _ in 0..50 {
                    if umount.is_ok() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                    umount = cmd("umount", &[&d]);
                }
                if let Err(e) = umount {
                    warn("umount of the swap file's tmpfs", e);
                    stuck = true;
                }
            }
            if !stuck {
                let _ = std::fs::remove_dir(&dir);
            }
        }
        if let Some(cg) = self.cgroup.take() {
            // The child has been reaped; its last pages may take a moment to be uncharged.
            let mut tries = 0;
            while let Err(e) = std::fs::remove_dir(&cg) {
                tries += 1;
                if tries == 50 {
                    warn(&format!("removing {}", cg.display()), e.into());
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        if let Some(dir) = self.mounted_hierarchy.take() {
            match cmd("umount", &[&dir.to_string_lossy()]) {
                Ok(_) => {
                    let _ = std::fs::remove_dir(&dir);
                }
                Err(e) => warn("umount of the cgroup hierarchy", e),
            }
        }
    }
}
