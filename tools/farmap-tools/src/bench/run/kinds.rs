//! What `farmap bench run` measures and prints: the workloads, the systems, a row, and
//! the load generators run as child processes (killed by Ctrl-C).

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::Mutex;

use anyhow::{bail, Context};
use clap::ValueEnum;
use serde::Serialize;

use super::server::Program;
use crate::bench::paging_app::INTERRUPTED;
use crate::output;

/// The load a program is measured under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Workload {
    /// YCSB workload A: 50% reads, 50% updates, zipfian.
    #[value(name = "ycsb-a")]
    YcsbA,
    /// YCSB workload B: 95% reads, 5% updates, zipfian.
    #[value(name = "ycsb-b")]
    YcsbB,
    /// redis-benchmark: HGETALL of random records, uniform (redis only).
    #[value(name = "redis-benchmark")]
    RedisBenchmark,
}

impl Workload {
    pub fn name(self) -> &'static str {
        match self {
            Workload::YcsbA => "ycsb-a",
            Workload::YcsbB => "ycsb-b",
            Workload::RedisBenchmark => "redis-benchmark-hgetall",
        }
    }

    pub fn applies_to(self, p: Program) -> bool {
        self != Workload::RedisBenchmark || p == Program::Redis
    }
}

/// The systems compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum System {
    /// The server as it is (always run: it measures the working set).
    Unlimited,
    /// The server in a memory cgroup, swapping to a loop device over RAM (root, cgroup v1).
    #[value(name = "kernel-swap")]
    KernelSwap,
    /// The server under `farmap run`.
    Farmap,
}

impl System {
    pub fn name(self) -> &'static str {
        match self {
            System::Unlimited => "unlimited",
            System::KernelSwap => "kernel-swap",
            System::Farmap => "farmap",
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub bench: &'static str,
    pub program: &'static str,
    pub workload: &'static str,
    pub system: &'static str,
    pub local_percent: f64,
    pub ops_per_s: f64,
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
    pub p99_9_us: Option<f64>,
    /// The server's page faults over the workload (farmap: faults its handler resolved;
    /// kernel: the process's minor + major faults).
    pub faults: u64,
    /// Pages sent out of memory over the workload (farmap: chunks dropped by the pager;
    /// kernel-swap: the system's `pswpout`).
    pub evictions: u64,
    /// The server's largest resident memory (VmRSS, sampled every 50 ms) over the workload.
    pub rss_max_bytes: u64,
    pub verified: bool,
    /// YCSB workload A: the updates' p99.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub update_p99_us: Option<f64>,
    /// The bound: farmap's limit, or the share of the working set under the cgroup limit.
    pub local_bytes: u64,
    /// The server's resident memory grown by the load, in the unlimited run.
    pub working_set_bytes: u64,
    /// kernel-swap: `memory.limit_in_bytes`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit_bytes: Option<u64>,
    /// farmap: `farmap run`'s own largest resident memory (the memory store lives there).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub handler_rss_max_bytes: Option<u64>,
    /// farmap: faults served by moving a staged page back (no store read).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub staged_refaults: Option<u64>,
    /// farmap: pages read ahead of faults.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefetched: Option<u64>,
    pub records: u64,
    pub operations: u64,
    /// `client:N,server:M`, or `none`.
    pub cpu_pinning: String,
    /// `--budget-pair`: how the pair's local memory was divided (`static`: half each;
    /// `shared`: a budget).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budget: Option<&'static str>,
    /// Operations that did not return OK, by kind.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<String>,
}

/// The client processes running now, killed by Ctrl-C or SIGTERM.
static CLIENTS: Mutex<Vec<u32>> = Mutex::new(Vec::new());

pub fn kill_clients() {
    for pid in CLIENTS.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        if let Some(pid) = rustix::process::Pid::from_raw(*pid as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
}

pub fn interrupted() -> anyhow::Result<()> {
    if INTERRUPTED.load(Ordering::Relaxed) {
        bail!("interrupted");
    }
    Ok(())
}

/// Runs a client to its end (pinned to `cpu`), killable by Ctrl-C; its stdout.
pub fn client(
    cpu: Option<usize>,
    program: &str,
    args: &[String],
    log: &Path,
) -> anyhow::Result<String> {
    interrupted()?;
    let mut cmd = match cpu {
        Some(cpu) => {
            let mut c = Command::new("taskset");
            c.args(["-c", &cpu.to_string(), program]);
            c
        }
        None => Command::new(program),
    };
    let child = cmd
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log)?)
        .spawn()
        .with_context(|| format!("running {program}"))?;
    let pid = child.id();
    CLIENTS.lock().unwrap_or_else(|e| e.into_inner()).push(pid);
    let out = child.wait_with_output();
    CLIENTS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .retain(|p| *p != pid);
    let out = out.with_context(|| format!("waiting for {program}"))?;
    interrupted()?;
    if !out.status.success() {
        let err = std::fs::read_to_string(log).unwrap_or_default();
        let tail: Vec<&str> = err.lines().rev().take(15).collect();
        bail!(
            "{program} failed ({}); the end of its log:\n{}",
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl Row {
    pub fn new(p: Program, w: Workload, records: u64, operations: u64) -> Row {
        Row {
            bench: "run",
            program: p.name(),
            workload: w.name(),
            system: "",
            local_percent: 100.0,
            ops_per_s: 0.0,
            p50_us: None,
            p99_us: None,
            p99_9_us: None,
            faults: 0,
            evictions: 0,
            rss_max_bytes: 0,
            verified: false,
            update_p99_us: None,
            local_bytes: 0,
            working_set_bytes: 0,
            limit_bytes: None,
            handler_rss_max_bytes: None,
            staged_refaults: None,
            prefetched: None,
            records,
            operations,
            cpu_pinning: String::new(),
            budget: None,
            errors: Vec::new(),
        }
    }

    pub fn print(&self, json: bool) -> anyhow::Result<()> {
        if json {
            return output::json_line(self);
        }
        let us = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.0}"));
        println!(
            "{:<9} {:<23} {:<11} {:>5.0}%  {:>9.0} ops/s  p50 {:>6} µs  p99 {:>7} µs  \
             p99.9 {:>7} µs  faults {:>8}  evictions {:>8}  RSS max {:>6.1} MB  {}",
            self.program,
            self.workload,
            self.system,
            self.local_percent,
            self.ops_per_s,
            us(self.p50_us),
            us(self.p99_us),
            us(self.p99_9_us),
            self.faults,
            self.evictions,
            self.rss_max_bytes as f64 / 1e6,
            if self.verified {
                "verified".to_owned()
            } else {
                format!("NOT VERIFIED: {}", self.errors.join("; "))
            }
        );
        Ok(())
    }
}
