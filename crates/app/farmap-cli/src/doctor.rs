//! `farmap doctor`: what this machine and this user can do, which farmap features follow,
//! and how to enable what is missing. Every check tries the thing itself where it can (opens
//! a userfaultfd, scans this process's pagemap, opens `/dev/fuse`, sets up an io_uring)
//! rather than reading version numbers.

use std::path::Path;
use std::process::ExitCode;

use clap::Args;
use farmap_uffd::sys;
use serde::Serialize;

use crate::output;

#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// One thing checked.
#[derive(Debug, Serialize)]
struct Check {
    /// A short, stable name (`userfaultfd`, `fuse`, ...).
    name: &'static str,
    /// Whether it is there and usable by this user.
    ok: bool,
    /// What was found.
    detail: String,
    /// What farmap does with it.
    enables: &'static str,
    /// How to get it, when it is missing.
    #[serde(skip_serializing_if = "Option::is_none")]
    fix: Option<String>,
}

impl Check {
    fn new(name: &'static str, enables: &'static str, found: Result<String, String>) -> Check {
        let ok = found.is_ok();
        Check {
            name,
            ok,
            detail: found.unwrap_or_else(|e| e),
            enables,
            fix: None,
        }
    }

    /// `fix` when the check failed.
    fn fix(mut self, fix: impl Into<String>) -> Check {
        if !self.ok {
            self.fix = Some(fix.into());
        }
        self
    }
}

#[derive(Debug, Serialize)]
struct Report {
    root: bool,
    checks: Vec<Check>,
}

pub fn run(args: DoctorArgs) -> anyhow::Result<ExitCode> {
    let report = Report {
        root: rustix::process::geteuid().is_root(),
        checks: checks(),
    };
    if args.json {
        output::json_line(&report)?;
    } else {
        print(&report);
    }
    Ok(ExitCode::SUCCESS)
}

fn print(r: &Report) {
    println!(
        "farmap doctor: as {}",
        if r.root {
            "root"
        } else {
            "a user without root"
        }
    );
    for c in &r.checks {
        let mark = if c.ok { "yes" } else { "no " };
        println!("  {mark}  {:<16} {}", c.name, c.detail);
        println!("       {:<16} for: {}", "", c.enables);
        if let Some(fix) = &c.fix {
            println!("       {:<16} to enable: {fix}", "");
        }
    }
}

fn checks() -> Vec<Check> {
    let mut out = uffd_checks();
    out.extend([
        Check::new(
            "pagemap-scan",
            "write tracking without faults (pre-copy migration, pushes, bounded memory)",
            pagemap_scan(),
        )
        .fix("a kernel of 6.7 or later"),
        Check::new(
            "fuse",
            "farmap mount (a file of the region)",
            open_rw("/dev/fuse"),
        )
        .fix(
            "modprobe fuse if /dev/fuse is missing; if it is there, give this user read and \
             write access to it (mode 0666 is usual)",
        ),
        Check::new(
            "nbd",
            "farmap mount --nbd (the kernel's NBD client), farmap serve --nbd clients on this host",
            module("nbd", "/dev/nbd0"),
        )
        .fix("modprobe nbd (a kernel built with CONFIG_BLK_DEV_NBD)"),
        Check::new(
            "ublk",
            "farmap mount --ublk (a block device served from user space)",
            open_rw("/dev/ublk-control"),
        )
        .fix("modprobe ublk_drv (a kernel built with CONFIG_BLK_DEV_UBLK)"),
        Check::new("io_uring", "farmap mount --ublk", io_uring())
            .fix("sysctl kernel.io_uring_disabled=0"),
        Check::new(
            "memory-cgroup",
            "the kernel-swap baselines of farmap bench paging",
            memory_cgroup(),
        )
        .fix("mount the cgroup memory controller (v1: mount -t cgroup -o memory none DIR)"),
        Check::new(
            "swap",
            "farmap swap on (swap space on a farmap store)",
            swap(),
        )
        .fix("run as root with swapon and losetup installed (util-linux, mount)"),
    ]);
    out.extend(limit_checks());
    out
}

/// userfaultfd and the features farmap's regions use.
fn uffd_checks() -> Vec<Check> {
    let sysctl = read_trimmed("/proc/sys/vm/unprivileged_userfaultfd");
    let support = farmap_uffd::probe();
    let features = support.as_ref().map(|s| s.features).unwrap_or(0);
    let feature = |bit: u64, name: &str| {
        if support.is_err() {
            Err(format!(
                "{name}: unknown (userfaultfd is not usable by this user)"
            ))
        } else if features & bit != 0 {
            Ok(format!("{name} supported"))
        } else {
            Err(format!("{name} not supported by this kernel"))
        }
    };
    // A missing feature needs a newer kernel; an unknown one, userfaultfd first.
    let kernel = |version: &str| {
        if support.is_err() {
            "make userfaultfd usable first (see above)".to_owned()
        } else {
            format!("a kernel of {version} or later")
        }
    };
    let uffd = match &support {
        Ok(s) => Ok(format!(
            "works (features {:#x}; vm.unprivileged_userfaultfd = {})",
            s.features,
            sysctl.as_deref().unwrap_or("unknown")
        )),
        Err(e) => Err(farmap::error_chain(e)),
    };
    vec![
        Check::new(
            "userfaultfd",
            "regions (memory served from a store), their live migration, farmap demo",
            uffd,
        )
        .fix("run as root, or sysctl vm.unprivileged_userfaultfd=1, or give the user /dev/userfaultfd"),
        Check::new(
            "wp-async",
            "write tracking without faults",
            feature(sys::UFFD_FEATURE_WP_ASYNC, "UFFD_FEATURE_WP_ASYNC"),
        )
        .fix(kernel("6.7")),
        Check::new(
            "uffdio-move",
            "bounded local memory (paging, farmap region limit)",
            feature(sys::UFFD_FEATURE_MOVE, "UFFDIO_MOVE"),
        )
        .fix(kernel("6.8")),
        Check::new(
            "uffd-minor-shmem",
            "regions over one version sharing their clean pages in memory",
            feature(sys::UFFD_FEATURE_MINOR_SHMEM, "minor faults on shmem"),
        )
        .fix(kernel("5.13")),
    ]
}

/// Limits that bound what farmap can hold.
fn limit_checks() -> Vec<Check> {
    use rustix::process::{getrlimit, Resource};
    let shown = |v: Option<u64>| v.map_or_else(|| "unlimited".into(), |b| b.to_string());
    let memlock = getrlimit(Resource::Memlock).current;
    let nofile = getrlimit(Resource::Nofile).current;
    let overcommit = read_trimmed("/proc/sys/vm/overcommit_memory");
    vec![
        Check::new(
            "open-files",
            "many connections and dir: stores with many open chunk files",
            match nofile {
                Some(n) if n < 4096 => Err(format!("RLIMIT_NOFILE {n} (below 4096)")),
                n => Ok(format!("RLIMIT_NOFILE {}", shown(n))),
            },
        )
        .fix("ulimit -n 65536 (or LimitNOFILE= in a systemd unit)"),
        Check::new(
            "memlock",
            "io_uring rings on older kernels (farmap mount --ublk)",
            Ok(format!("RLIMIT_MEMLOCK {} bytes", shown(memlock))),
        ),
        Check::new(
            "overcommit",
            "large regions (they reserve address space, MAP_NORESERVE)",
            match overcommit.as_deref() {
                Ok("2") => Err(
                    "vm.overcommit_memory = 2: regions larger than the commit limit fail".into(),
                ),
                Ok(v) => Ok(format!("vm.overcommit_memory = {v}")),
                Err(e) => Err(e.clone()),
            },
        )
        .fix("sysctl vm.overcommit_memory=0"),
    ]
}

fn read_trimmed(path: &str) -> Result<String, String> {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_owned())
        .map_err(|e| format!("cannot read {path}: {e}"))
}

fn open_rw(path: &str) -> Result<String, String> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map(|_| format!("{path} opens"))
        .map_err(|e| format!("{path}: {e}"))
}

/// A kernel module (or built-in driver) by its sysfs entry, or the device it makes.
fn module(name: &str, device: &str) -> Result<String, String> {
    if Path::new(&format!("/sys/module/{name}")).exists() || Path::new(device).exists() {
        Ok(format!("{name} is loaded"))
    } else {
        Err(format!(
            "no {name} module loaded (no /sys/module/{name}, no {device})"
        ))
    }
}

/// A `PAGEMAP_SCAN` of a page of this process.
fn pagemap_scan() -> Result<String, String> {
    let pagemap = farmap_uffd::pagemap::Pagemap::open_self()
        .map_err(|e| format!("/proc/self/pagemap: {e}"))?;
    let page = vec![1u8; 2 * 4096];
    let start = (page.as_ptr() as usize + 4095) & !4095;
    let mut scratch = Vec::new();
    let mut present = 0;
    pagemap
        .present(start, start + 4096, &mut scratch, |_| present += 1)
        .map_err(|e| format!("PAGEMAP_SCAN: {e}"))?;
    if present == 1 {
        Ok("PAGEMAP_SCAN works".into())
    } else {
        Err(format!(
            "PAGEMAP_SCAN answered {present} runs for one present page"
        ))
    }
}

fn io_uring() -> Result<String, String> {
    farmap_ublk::io_uring_works()
        .map(|()| "an io_uring was set up".into())
        .map_err(|e| format!("io_uring_setup: {e}"))
}

fn memory_cgroup() -> Result<String, String> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").map_err(|e| e.to_string())?;
    let v1 = mounts.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.get(2) == Some(&"cgroup")
            && f.get(3)
                .is_some_and(|o| o.split(',').any(|o| o == "memory"))
    });
    if v1 {
        return Ok("cgroup v1 memory controller mounted".into());
    }
    match read_trimmed("/sys/fs/cgroup/cgroup.controllers") {
        Ok(c) if c.split_whitespace().any(|c| c == "memory") => {
            Ok("cgroup v2 memory controller".into())
        }
        _ => Err("no cgroup memory controller mounted".into()),
    }
}

fn swap() -> Result<String, String> {
    let root = rustix::process::geteuid().is_root();
    let tools = ["swapon", "losetup"].iter().all(|t| in_path(t));
    let swaps = std::fs::read_to_string("/proc/swaps").map_err(|e| format!("/proc/swaps: {e}"))?;
    let active = swaps.lines().count().saturating_sub(1);
    match (root, tools) {
        (true, true) => Ok(format!(
            "swapon and losetup found; {active} swap areas active"
        )),
        (false, _) => Err("swapon needs root".into()),
        (_, false) => Err("swapon or losetup not found in PATH".into()),
    }
}

fn in_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
}
