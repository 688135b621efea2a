//! A qemu VM for kernel tests (NBD, ublk): boots a Debian kernel that has the modules this
//! machine's kernel lacks, runs a guest shell script, and returns its `MARK` lines.
//!
//! The work is done by `scripts/vm/run.sh` (see it for the guest's environment: busybox,
//! nbd-client, mkfs.ext4, the host's loopback at 10.0.2.2); this type builds its command line
//! and reads its result. The kernel is cached under `~/.cache/farmap/vm/`, so only the first
//! run on a machine downloads it. The VM is CPU-heavy: keep the tests that boot it few and let
//! one boot run several checks.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::service::repo_root;

/// Why a VM run did not succeed.
#[derive(Debug)]
pub enum VmError {
    /// This machine cannot run the VM (no qemu and it could not be installed, the kernel could
    /// not be fetched...): the test should [`skip`](fn@crate::skip) with this reason.
    Unavailable(String),
    /// The guest script failed, the guest died or it timed out; `console_tail` is the end of
    /// the serial console.
    Failed {
        /// What happened (exit status, timeout).
        what: String,
        /// The guest's `MARK` lines so far.
        marks: Vec<String>,
        /// The serial console's last lines.
        console_tail: String,
    },
}

impl std::fmt::Display for VmError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            VmError::Unavailable(why) => write!(f, "the VM cannot run here: {why}"),
            VmError::Failed {
                what,
                marks,
                console_tail,
            } => write!(
                f,
                "{what}; marks so far: {marks:?}; the console's last lines:\n{console_tail}"
            ),
        }
    }
}

impl std::error::Error for VmError {}

/// What a successful run printed.
#[derive(Debug, Clone)]
pub struct VmOutput {
    /// The guest's `MARK` lines, without the `MARK ` prefix, in order.
    pub marks: Vec<String>,
    /// The whole serial console.
    pub console: String,
}

impl VmOutput {
    /// The text after `MARK <key> ` of the first mark with that key, if any.
    pub fn mark(&self, key: &str) -> Option<&str> {
        self.marks.iter().find_map(|m| {
            let rest = m.strip_prefix(key)?;
            if rest.is_empty() {
                Some(rest)
            } else {
                rest.strip_prefix(' ')
            }
        })
    }
}

/// One VM boot: the guest script, the binaries and files to put in it, limits.
#[derive(Debug, Clone)]
pub struct Vm {
    script: String,
    bins: Vec<(PathBuf, String)>,
    files: Vec<(PathBuf, String)>,
    timeout: Duration,
    mem_mib: u32,
}

impl Vm {
    /// A VM that runs `script` (a busybox `sh` script, run with `-ex` in `/tmp`; print
    /// `MARK key value` lines for the host).
    pub fn new(script: impl Into<String>) -> Self {
        Self {
            script: script.into(),
            bins: Vec::new(),
            files: Vec::new(),
            timeout: Duration::from_secs(240),
            mem_mib: 1024,
        }
    }

    /// Puts the executable `path` into the guest as `/bin/<name>` (stripped, with the
    /// libraries it links).
    pub fn bin(mut self, path: impl AsRef<Path>, name: &str) -> Self {
        self.bins
            .push((path.as_ref().to_path_buf(), name.to_string()));
        self
    }

    /// Puts the file `path` into the guest at `dest` (an absolute path).
    pub fn file(mut self, path: impl AsRef<Path>, dest: &str) -> Self {
        self.files
            .push((path.as_ref().to_path_buf(), dest.to_string()));
        self
    }

    /// The whole run's limit, boot included (default 240 s: emulation is slow).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The guest's memory (default 1024 MiB).
    pub fn mem_mib(mut self, mib: u32) -> Self {
        self.mem_mib = mib;
        self
    }

    /// Boots the VM, runs the script and waits for the guest to power off.
    pub fn run(&self) -> Result<VmOutput, VmError> {
        let unavailable = |why: String| VmError::Unavailable(why);
        let mut script = tempfile_in_tmp("farmap-vm-guest", ".sh")
            .map_err(|e| unavailable(format!("cannot write the guest script: {e}")))?;
        script
            .1
            .write_all(self.script.as_bytes())
            .map_err(|e| unavailable(format!("cannot write the guest script: {e}")))?;
        let runner = repo_root().join("scripts/vm/run.sh");
        let mut cmd = Command::new(&runner);
        cmd.arg("--guest")
            .arg(&script.0)
            .arg("--timeout")
            .arg(self.timeout.as_secs().max(1).to_string())
            .arg("--mem")
            .arg(self.mem_mib.to_string());
        for (path, name) in &self.bins {
            cmd.arg("--bin").arg(format!("{}:{name}", path.display()));
        }
        for (path, dest) in &self.files {
            cmd.arg("--file").arg(format!("{}:{dest}", path.display()));
        }
        let out = cmd
            .stdin(Stdio::null())
            .output()
            .map_err(|e| unavailable(format!("cannot run {}: {e}", runner.display())))?;
        let _ = std::fs::remove_file(&script.0);
        let console = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        let marks: Vec<String> = console
            .lines()
            // Lines that start with it: `sh -x` also echoes the commands that print them.
            .filter_map(|l| l.strip_prefix("MARK ").map(|m| m.trim_end().to_string()))
            .collect();
        match out.status.code() {
            Some(0) => Ok(VmOutput { marks, console }),
            Some(3) => Err(VmError::Unavailable(stderr.trim().to_string())),
            code => Err(VmError::Failed {
                what: match code {
                    Some(124) => format!("the guest did not finish within {:?}", self.timeout),
                    Some(c) => format!("the guest script failed (run.sh exit {c})"),
                    None => "run.sh was killed by a signal".to_string(),
                },
                marks,
                console_tail: tail(&console, 80) + "\n" + &tail(&stderr, 10),
            }),
        }
    }
}

/// A kernel and an initramfs whose guest runs `vmcheck` (`scripts/vm/vmcheck.c`, the
/// self-checking guest of issue 32) with the options given on the kernel command line as
/// `vmcheck.KEY=VALUE` (`vmcheck.ws-mib=16 vmcheck.rate-mibs=32`), for tests that boot it with
/// their own QEMU command line (farmap-vm's `QemuConfig`). The files are removed on drop.
#[derive(Debug)]
pub struct VmcheckImage {
    /// The kernel (`-kernel`).
    pub kernel: PathBuf,
    /// The initramfs (`-initrd`).
    pub initrd: PathBuf,
    dir: tempfile::TempDir,
}

impl VmcheckImage {
    /// Builds it with `scripts/vm/initramfs.sh --vmcheck` (the kernel is fetched once and
    /// cached; the initramfs takes a few seconds). [`VmError::Unavailable`] when this machine
    /// cannot (no packages, no kernel).
    pub fn build() -> Result<Self, VmError> {
        let dir = tempfile::Builder::new()
            .prefix("farmap-vmcheck")
            .tempdir()
            .map_err(|e| VmError::Unavailable(format!("cannot make a temp dir: {e}")))?;
        let guest = dir.path().join("guest.sh");
        std::fs::write(&guest, "exec vmcheck\n")
            .map_err(|e| VmError::Unavailable(format!("cannot write the guest script: {e}")))?;
        let out = Command::new(repo_root().join("scripts/vm/initramfs.sh"))
            .arg("--out")
            .arg(dir.path())
            .arg("--guest")
            .arg(&guest)
            .arg("--vmcheck")
            .stdin(Stdio::null())
            .output()
            .map_err(|e| VmError::Unavailable(format!("cannot run initramfs.sh: {e}")))?;
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        match out.status.code() {
            Some(0) => Ok(Self {
                kernel: dir.path().join("vmlinuz"),
                initrd: dir.path().join("initramfs.cpio"),
                dir,
            }),
            Some(3) => Err(VmError::Unavailable(stderr.trim().to_string())),
            code => Err(VmError::Failed {
                what: format!("scripts/vm/initramfs.sh failed ({code:?})"),
                marks: Vec::new(),
                console_tail: tail(&stderr, 20),
            }),
        }
    }

    /// The image for `test`, or `None` after recording why this machine cannot boot it (see
    /// [`skip`](fn@crate::skip)): it needs root (the guest's RAM on FUSE mounts), /dev/fuse and
    /// QEMU.
    ///
    /// # Panics
    /// If the image cannot be built on a machine that has all that.
    pub fn for_test(test: &str) -> Option<Self> {
        use crate::skip;
        if !skip::is_root() {
            skip::skip(test, "needs root (FUSE mounts, the guest's kernel)");
            return None;
        }
        if !skip::fuse_mountable(test) || !skip::program(test, "qemu-system-x86_64", &["--version"])
        {
            return None;
        }
        match Self::build() {
            Ok(image) => Some(image),
            Err(VmError::Unavailable(why)) => {
                skip::skip(test, why);
                None
            }
            Err(e) => panic!("{e}"),
        }
    }

    /// The folder the files are in.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

/// The last `n` lines of `s`.
fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A new file in the temp dir, with its path.
fn tempfile_in_tmp(prefix: &str, suffix: &str) -> std::io::Result<(PathBuf, std::fs::File)> {
    let dir = std::env::temp_dir();
    for i in 0..1000u32 {
        let path = dir.join(format!("{prefix}-{}-{i}{suffix}", std::process::id()));
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
        {
            Ok(f) => return Ok((path, f)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::other("no free temp file name"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mark_finds_the_value_after_its_key() {
        let out = VmOutput {
            marks: vec!["guest-start 6.12".into(), "sum abc".into(), "done".into()],
            console: String::new(),
        };
        assert_eq!(out.mark("sum"), Some("abc"));
        assert_eq!(out.mark("done"), Some(""));
        assert_eq!(out.mark("su"), None);
        assert_eq!(out.mark("missing"), None);
    }

    #[test]
    fn tail_keeps_the_last_lines() {
        assert_eq!(tail("a\nb\nc", 2), "b\nc");
        assert_eq!(tail("a", 5), "a");
    }
}
