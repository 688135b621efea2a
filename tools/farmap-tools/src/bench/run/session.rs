//! One system's session with one program: a fresh server, YCSB's load, then each local share
//! and workload measured, the keyspace checked at the end.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context};
use farmap_migrate::agent::{
    Controller, LocalMax, PagingReport, Reply, Request, SetLocalMaxRequest,
};

use super::kinds::{client, Row, System, Workload};
use super::redis_benchmark;
use super::server::{self, Launch, Program, RssSampler, Server};
use super::ycsb::{self, Binding, Invocation, Mix};
use crate::bench::paging_swap::{SwapEnv, LIMIT_SLACK};

/// What a session needs from the benchmark.
pub struct Ctx<'a> {
    pub handle: &'a tokio::runtime::Handle,
    pub classpath: &'a str,
    /// (client CPU, server CPU).
    pub pin: Option<(usize, usize)>,
    pub records: u64,
    pub operations: u64,
    pub threads: u32,
    pub workloads: &'a [Workload],
    /// Local shares, in percent, largest first.
    pub locals: &'a [f64],
    pub preload: Option<&'a Path>,
}

/// What the unlimited session found, which the others are held to.
#[derive(Debug, Clone)]
pub struct Reference {
    pub working_set: u64,
    /// redis: `DEBUG DIGEST` of the loaded keyspace.
    pub digest: Option<String>,
}

/// Counters of the server at one moment.
#[derive(Debug, Clone, Copy, Default)]
struct Snapshot {
    faults: u64,
    evictions: u64,
    staged_refaults: u64,
    prefetched: u64,
}

impl Ctx<'_> {
    /// Where the client and the server ran (`farmap run`'s own threads are never pinned,
    /// like the kernel's reclaim: see [`Server::start`]).
    pub(super) fn cpu_pinning(&self) -> String {
        self.pin.map_or_else(
            || "none".to_owned(),
            |(c, s)| format!("client:{c},server:{s}"),
        )
    }

    pub(super) fn ycsb(
        &self,
        dir: &Path,
        p: Program,
        port: u16,
        run: Option<(Mix, u64)>,
    ) -> anyhow::Result<ycsb::Report> {
        let binding = match p {
            Program::Redis => Binding::Redis,
            Program::Memcached => Binding::Memcached,
        };
        let mut args = vec!["-cp".to_owned(), self.classpath.to_owned()];
        args.extend(
            Invocation {
                binding,
                port,
                records: self.records,
                run,
                threads: self.threads,
            }
            .args(),
        );
        let out = client(self.pin.map(|p| p.0), "java", &args, &dir.join("ycsb.log"))?;
        ycsb::Report::parse(&out).context("reading YCSB's report")
    }

    pub(super) fn agent(
        &self,
        sock: &Path,
        req: Request,
        wait: Duration,
    ) -> anyhow::Result<PagingReport> {
        self.handle.block_on(async {
            let mut c = Controller::connect(sock)
                .await
                .with_context(|| format!("connecting to farmap run's agent {}", sock.display()))?;
            c.send(&req).await.context("asking farmap run's agent")?;
            let reply = tokio::time::timeout(wait + Duration::from_secs(10), c.next())
                .await
                .map_err(|_| anyhow::anyhow!("farmap run's agent did not answer"))??;
            match reply {
                Some(Reply::Paging(r)) => Ok(r),
                Some(Reply::Error { message, .. }) => {
                    bail!("farmap run's agent refused: {message}")
                }
                other => bail!("farmap run's agent answered {other:?}"),
            }
        })
    }

    fn snapshot(&self, system: System, server: &Server, agent: &Path) -> anyhow::Result<Snapshot> {
        Ok(match system {
            System::Unlimited => Snapshot {
                faults: server::faults(server.pid)?,
                ..Snapshot::default()
            },
            System::KernelSwap => Snapshot {
                faults: server::faults(server.pid)?,
                evictions: server::vmstat("pswpout"),
                ..Snapshot::default()
            },
            System::Farmap => {
                let r = self.agent(agent, Request::PagingState, Duration::ZERO)?;
                Snapshot {
                    faults: r.faults,
                    evictions: r.evictions_reactive + r.evictions_proactive,
                    staged_refaults: r.staged_refaults,
                    prefetched: r.prefetched,
                }
            }
        })
    }

    /// Runs a session of `system` (`reference`: what the unlimited session found; `None`
    /// for the unlimited session itself, which finds it). Rows and the reference.
    pub fn session(
        &self,
        program: Program,
        system: System,
        env: Option<&SwapEnv>,
        reference: Option<&Reference>,
        mut emit: impl FnMut(Row) -> anyhow::Result<()>,
    ) -> anyhow::Result<Reference> {
        let dir = tempfile::Builder::new()
            .prefix("farmap-bench-run-")
            .tempdir()
            .context("making a directory for the server")?;
        let agent = dir.path().join("agent.sock");
        let launch = match system {
            System::Unlimited => Launch::Plain,
            System::KernelSwap => {
                let env = env.context("kernel-swap without its environment")?;
                env.set_limit(None)?;
                Launch::Cgroup(env.procs())
            }
            System::Farmap => {
                let ws = reference.map_or(0, |r| r.working_set);
                // Address space only: three times the working set, at least 1 GiB.
                let heap = (ws * 3).div_ceil(1 << 30).max(1) << 30;
                let mut opts = vec![
                    "--agent".to_owned(),
                    agent.to_string_lossy().into_owned(),
                    "--local-max".into(),
                    "100%".into(),
                    "--heap-max".into(),
                    heap.to_string(),
                ];
                if let Some(p) = self.preload {
                    opts.extend(["--preload".into(), p.to_string_lossy().into_owned()]);
                }
                Launch::Farmap(opts)
            }
        };
        let mut server = Server::start(program, launch, dir.path(), self.pin.map(|p| p.1))?;
        let usage_ready = match (system, env) {
            (System::KernelSwap, Some(env)) => env.usage()?,
            _ => 0,
        };
        let rss_ready = server::rss(server.pid).unwrap_or(0);
        let load = self.ycsb(dir.path(), program, server.port, None)?;
        let bad = load.not_ok();
        if !bad.is_empty() {
            bail!(
                "YCSB's load of {} failed: {}",
                program.name(),
                bad.join(", ")
            );
        }
        let working_set = match reference {
            Some(r) => r.working_set,
            None => server::rss(server.pid)
                .unwrap_or(0)
                .saturating_sub(rss_ready)
                .max(4096),
        };
        let digest = match program {
            Program::Redis => Some(redis_digest(server.port)?),
            Program::Memcached => None,
        };
        let found = Reference {
            working_set,
            digest,
        };
        let locals: Vec<Option<f64>> = match system {
            System::Unlimited => vec![None],
            _ => self.locals.iter().map(|l| Some(*l)).collect(),
        };
        let mut rows = Vec::new();
        for local in locals {
            let local_bytes = local.map_or(working_set, |p| {
                ((working_set as f64 * p / 100.0) as u64 / 4096).max(1) * 4096
            });
            let limit_bytes = self.bound(system, env, &agent, usage_ready, local_bytes, local)?;
            for w in self.workloads.iter().filter(|w| w.applies_to(program)) {
                let before = self.snapshot(system, &server, &agent)?;
                let mut row = self.workload(*w, program, &server, dir.path())?;
                let after = self.snapshot(system, &server, &agent)?;
                if !server.alive() {
                    bail!(
                        "{} ended during {} under {} (the OOM killer?)",
                        program.name(),
                        w.name(),
                        system.name()
                    );
                }
                row.system = system.name();
                row.local_percent = local.unwrap_or(100.0);
                row.local_bytes = local_bytes;
                row.working_set_bytes = working_set;
                row.limit_bytes = limit_bytes;
                row.faults = after.faults.saturating_sub(before.faults);
                row.evictions = after.evictions.saturating_sub(before.evictions);
                if system == System::Farmap {
                    row.staged_refaults =
                        Some(after.staged_refaults.saturating_sub(before.staged_refaults));
                    row.prefetched = Some(after.prefetched.saturating_sub(before.prefetched));
                } else {
                    row.handler_rss_max_bytes = None;
                }
                row.cpu_pinning = self.cpu_pinning();
                rows.push(row);
            }
        }
        // The keyspace at the end: the loaded one (updates write the same values).
        let same = match (&found.digest, reference.and_then(|r| r.digest.as_ref())) {
            (Some(_), _) => {
                let now = redis_digest(server.port)?;
                let want = reference
                    .and_then(|r| r.digest.clone())
                    .or_else(|| found.digest.clone());
                Some(want.as_deref() == Some(now.as_str()))
            }
            _ => None,
        };
        let status = server.stop()?;
        for mut row in rows {
            if same == Some(false) {
                row.verified = false;
                row.errors
                    .push("the keyspace's digest differs from the unlimited run's".into());
            }
            emit(row)?;
        }
        if !status.success() && system != System::KernelSwap {
            status!(
                "farmap bench run: {} under {} ended with {status}",
                program.name(),
                system.name()
            );
        }
        Ok(found)
    }

    /// Sets the bound of a share; kernel-swap's limit, if it has one.
    fn bound(
        &self,
        system: System,
        env: Option<&SwapEnv>,
        agent: &Path,
        usage_ready: u64,
        local_bytes: u64,
        local: Option<f64>,
    ) -> anyhow::Result<Option<u64>> {
        if local.is_none() {
            return Ok(None);
        }
        match (system, env) {
            (System::KernelSwap, Some(env)) => {
                let limit = usage_ready + local_bytes + LIMIT_SLACK;
                env.set_limit(Some(limit))?;
                Ok(Some(limit))
            }
            (System::Farmap, _) => {
                let wait = Duration::from_secs(60);
                let r = self.agent(
                    agent,
                    Request::SetLocalMax(SetLocalMaxRequest {
                        local_max: LocalMax::Bytes(local_bytes),
                        wait_ms: wait.as_millis() as u64,
                        budget: None,
                    }),
                    wait,
                )?;
                if !r.within_limit {
                    status!(
                        "farmap bench run: resident memory still above the bound after {wait:?}"
                    );
                }
                Ok(None)
            }
            _ => Ok(None),
        }
    }

    /// Runs one workload against a server: a row with the client's figures and the
    /// server's largest resident memory.
    pub(super) fn workload(
        &self,
        w: Workload,
        p: Program,
        server: &Server,
        dir: &Path,
    ) -> anyhow::Result<Row> {
        self.workload_ops(w, p, server, dir, self.operations)
    }

    /// [`workload`](Self::workload) with `operations` operations.
    pub(super) fn workload_ops(
        &self,
        w: Workload,
        p: Program,
        server: &Server,
        dir: &Path,
        operations: u64,
    ) -> anyhow::Result<Row> {
        let mut pids = vec![server.pid];
        pids.extend(server.handler);
        let sampler = RssSampler::start(pids);
        let measured = self.measure(w, p, server, dir, operations);
        let rss = sampler.finish();
        let mut row = measured?;
        row.rss_max_bytes = rss.first().copied().unwrap_or(0);
        row.handler_rss_max_bytes = rss.get(1).copied();
        Ok(row)
    }

    fn measure(
        &self,
        w: Workload,
        p: Program,
        server: &Server,
        dir: &Path,
        operations: u64,
    ) -> anyhow::Result<Row> {
        let mut row = Row::new(p, w, self.records, operations);
        match w {
            Workload::YcsbA | Workload::YcsbB => {
                let mix = if w == Workload::YcsbA { Mix::A } else { Mix::B };
                let r = self.ycsb(dir, p, server.port, Some((mix, operations)))?;
                row.ops_per_s = r.ops_per_s;
                row.p50_us = r.percentile_us("READ", "50th");
                row.p99_us = r.percentile_us("READ", "99th");
                row.p99_9_us = r.percentile_us("READ", "99.9");
                row.update_p99_us = r.percentile_us("UPDATE", "99th");
                row.errors = r.not_ok();
                let want = operations as f64;
                if r.ok() < want {
                    row.errors
                        .push(format!("{} of {want} operations returned OK", r.ok()));
                }
            }
            Workload::RedisBenchmark => {
                let args = redis_benchmark::args(server.port, self.records, operations, 50);
                let out = client(
                    self.pin.map(|p| p.0),
                    "redis-benchmark",
                    &args,
                    &dir.join("rb.log"),
                )?;
                let r = redis_benchmark::Report::parse(&out)?;
                row.ops_per_s = r.ops_per_s;
                row.p50_us = Some(r.p50_us);
                row.p99_us = Some(r.p99_us);
                row.p99_9_us = r.p99_9_us;
            }
        }
        row.verified = row.errors.is_empty();
        Ok(row)
    }
}

/// redis's `DEBUG DIGEST` (a hash of the whole keyspace).
fn redis_digest(port: u16) -> anyhow::Result<String> {
    let out = std::process::Command::new("redis-cli")
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "DEBUG",
            "DIGEST",
        ])
        .output()
        .context("running redis-cli (Debian: redis-tools)")?;
    let d = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if !out.status.success() || d.len() != 40 {
        bail!("redis-cli DEBUG DIGEST answered {d:?}");
    }
    Ok(d)
}
