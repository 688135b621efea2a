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
//! - the swap: a file in `/dev/shm` (tmpfs) of the region's size plus 64 MiB, allocated in
//!   full up front by this process (`fallocate`). The loop driver charges its I/O to the
//!   memory cgroup of the task whose pages it writes: a sparse file would take a new tmpfs
//!   page, charged to the limited cgroup, for every page swapped out, and the limit would
//!   free nothing. Then `losetup --find --show`, `mkswap`, `swapon --priority 32767` (above
//!   any other swap, which is left on: the kernel fills the highest priority first).
//!   Teardown: `swapoff`, `losetup -d`, the file removed.
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

use anyhow::{bail, Context};

use super::paging_app::{AppArgs, AppConfig, AppReport};

/// The swap's priority: the highest there is.
const SWAP_PRIORITY: &str = "32767";

/// Headroom of the limit over `local%` of the size and the child's measured overhead.
pub const LIMIT_SLACK: u64 = 2 << 20;

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
    /// The hierarchy mounted for this run (unmounted and removed on drop).
    mounted: Option<PathBuf>,
    /// The swap file's directory in /dev/shm.
    dir: Option<tempfile::TempDir>,
    loop_dev: Option<String>,
    swap_on: bool,
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
        let mut env = SwapEnv::default();
        let root = match find_v1_memory() {
            Some(root) => root,
            None => {
                let dir = tempfile::Builder::new()
                    .prefix("farmap-memcg-")
                    .tempdir_in("/run")
                    .context("making a mount point under /run")?
                    .keep();
                env.mounted = Some(dir.clone());
                let d = dir.to_string_lossy().into_owned();
                cmd("mount", &["-t", "cgroup", "-o", "memory", "cgroup", &d]).context(
                    "no cgroup v1 memory hierarchy is mounted and mounting one failed \
                     (is the memory controller bound to cgroup v2?)",
                )?;
                dir
            }
        };
        let parent = if env.mounted.is_some() {
            root.clone()
        } else {
            root.join(own_memory_cgroup().trim_start_matches('/'))
        };
        let cg = parent.join(format!("farmap-bench-paging-{}", std::process::id()));
        std::fs::create_dir(&cg)
            .with_context(|| format!("making the memory cgroup {}", cg.display()))?;
        env.cgroup = Some(cg.clone());
        if !cg.join("memory.limit_in_bytes").exists() {
            bail!("{} has no memory.limit_in_bytes", cg.display());
        }

        let shm = Path::new("/dev/shm");
        let fs = rustix::fs::statfs(shm).context("statfs /dev/shm")?;
        if fs.f_type as i64 != 0x0102_1994 {
            bail!("/dev/shm is not a tmpfs: the swap would not be in RAM");
        }
        let dir = tempfile::Builder::new()
            .prefix("farmap-bench-paging-")
            .tempdir_in(shm)
            .context("making a directory in /dev/shm")?;
        let file = dir.path().join("swap");
        env.dir = Some(dir);
        let len = size + (64 << 20);
        let f = std::fs::File::create(&file).context("creating the swap file")?;
        rustix::fs::fallocate(f.as_fd(), rustix::fs::FallocateFlags::empty(), 0, len)
            .context("allocating the swap file in /dev/shm")?;
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

    fn set_limit(&self, limit: Option<u64>) -> anyhow::Result<()> {
        let v = limit.map_or_else(|| "-1".to_owned(), |l| l.to_string());
        std::fs::write(self.cgroup().join("memory.limit_in_bytes"), &v)
            .with_context(|| format!("setting memory.limit_in_bytes to {v}"))
    }

    fn usage(&self) -> anyhow::Result<u64> {
        let p = self.cgroup().join("memory.usage_in_bytes");
        std::fs::read_to_string(&p)
            .with_context(|| format!("reading {}", p.display()))?
            .trim()
            .parse()
            .context("memory.usage_in_bytes is not a number")
    }

    /// Runs the application in the cgroup, limited to `local` bytes (plus its overhead and
    /// [`LIMIT_SLACK`]) or unlimited; returns its report and the limit set.
    pub fn run(
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
        if let Some(dev) = self.loop_dev.take() {
            if self.swap_on {
                if let Err(e) = cmd("swapoff", &[&dev]) {
                    warn("swapoff", e);
                }
            }
            if let Err(e) = cmd("losetup", &["-d", &dev]) {
                warn("losetup -d", e);
            }
        }
        drop(self.dir.take());
        if let Some(cg) = self.cgroup.take() {
            // The child has been reaped; its last pages may take a moment to be uncharged.
            let mut tries = 0;
            while let Err(e) = std::fs::remove_dir(&cg) {
                tries += 1;
                if tries == 50 {
                    warn(&format!("removing {}", cg.display()), e.into());
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
        if let Some(dir) = self.mounted.take() {
            match cmd("umount", &[&dir.to_string_lossy()]) {
                Ok(_) => {
                    let _ = std::fs::remove_dir(&dir);
                }
                Err(e) => warn("umount", e),
            }
        }
    }
}
