//! The programs `farmap bench run` measures, started under each system, and what it reads
//! of a running process: resident memory (sampled), page faults, the children of
//! `farmap run`.

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// The programs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Program {
    /// redis-server (Debian's redis-server package).
    Redis,
    /// memcached (Debian's memcached package).
    Memcached,
}

impl Program {
    pub fn name(self) -> &'static str {
        match self {
            Program::Redis => "redis",
            Program::Memcached => "memcached",
        }
    }

    fn binary(self) -> &'static str {
        match self {
            Program::Redis => "redis-server",
            Program::Memcached => "memcached",
        }
    }

    /// The command line of the server on `port`, its files in `dir`: no persistence (a
    /// fork would copy the heap), in the foreground.
    fn command_line(self, port: u16, dir: &Path) -> Vec<String> {
        let p = port.to_string();
        let mut v: Vec<String> = vec![self.binary().into()];
        match self {
            Program::Redis => {
                v.extend(
                    [
                        "--port",
                        &p,
                        "--bind",
                        "127.0.0.1",
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--daemonize",
                        "no",
                        // DEBUG DIGEST, to compare the keyspace with the unlimited run's.
                        "--enable-debug-command",
                        "local",
                        "--logfile",
                    ]
                    .map(str::to_owned),
                );
                v.push(dir.join("redis.log").to_string_lossy().into_owned());
                v.push("--dir".into());
                v.push(dir.to_string_lossy().into_owned());
            }
            Program::Memcached => {
                // -m: far above the data, so that memcached evicts nothing (a read that
                // finds nothing fails YCSB's check); -U 0: no UDP.
                v.extend(
                    [
                        "-l",
                        "127.0.0.1",
                        "-p",
                        &p,
                        "-m",
                        "65536",
                        "-t",
                        "2",
                        "-U",
                        "0",
                    ]
                    .map(str::to_owned),
                );
                if rustix::process::geteuid().is_root() {
                    v.extend(["-u".into(), "root".into()]);
                }
            }
        }
        v
    }

    /// Whether the program is installed (on PATH).
    pub fn installed(self) -> bool {
        which(self.binary()).is_some()
    }
}

/// `name`'s path on PATH.
pub fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    })
}

/// How a server is started.
pub enum Launch {
    /// As it is.
    Plain,
    /// Joining the memory cgroup whose `cgroup.procs` this is, before it execs.
    Cgroup(PathBuf),
    /// Under `farmap run` with these options before `--`.
    Farmap(Vec<String>),
}

/// A server started by the benchmark; dropping it kills it.
pub struct Server {
    child: Child,
    /// The program's own process (under `farmap run`: its child).
    pub pid: u32,
    /// `farmap run`'s process, if there is one.
    pub handler: Option<u32>,
    pub port: u16,
}

impl Server {
    /// Starts `program` on a free port (pinned to `cpu`, if any) and waits until it accepts
    /// connections.
    pub fn start(
        program: Program,
        launch: Launch,
        dir: &Path,
        cpu: Option<usize>,
    ) -> anyhow::Result<Server> {
        let port = free_port()?;
        let mut argv: Vec<String> = Vec::new();
        // The server's threads are pinned; under farmap run, only the server's: farmap run's
        // own threads are placed by the kernel, as the kernel's reclaim (kswapd) is (its fault
        // readers follow the program's CPUs by themselves).
        if let Launch::Farmap(opts) = &launch {
            let exe = std::env::current_exe().context("finding the farmap binary")?;
            argv.push(exe.to_string_lossy().into_owned());
            argv.push("run".into());
            argv.extend(opts.iter().cloned());
            argv.push("--".into());
        }
        if let Some(cpu) = cpu {
            argv.extend(["taskset".into(), "-c".into(), cpu.to_string()]);
        }
        argv.extend(program.command_line(port, dir));
        let farmap = matches!(launch, Launch::Farmap(_));
        let mut cmd = match launch {
            Launch::Cgroup(procs) => {
                // The shell joins the cgroup, then becomes the server: every page the
                // server touches is charged there.
                let mut c = Command::new("sh");
                c.arg("-c")
                    .arg("echo $$ > \"$0\" && exec \"$@\"")
                    .arg(procs)
                    .args(&argv);
                c
            }
            _ => {
                let mut c = Command::new(&argv[0]);
                c.args(&argv[1..]);
                c
            }
        };
        let child = cmd
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("stderr.log"))?)
            .spawn()
            .with_context(|| format!("starting {}", argv.join(" ")))?;
        let mut server = Server {
            pid: child.id(),
            handler: None,
            child,
            port,
        };
        server.wait_ready(program, dir, farmap)?;
        Ok(server)
    }

    fn wait_ready(&mut self, program: Program, dir: &Path, farmap: bool) -> anyhow::Result<()> {
        let addr: SocketAddr = ([127, 0, 0, 1], self.port).into();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait()? {
                let log = std::fs::read_to_string(dir.join("stderr.log")).unwrap_or_default();
                bail!(
                    "{} ended before it listened ({status}): {}",
                    program.name(),
                    log.trim()
                );
            }
            if TcpStream::connect(addr).is_ok() {
                break;
            }
            if Instant::now() > deadline {
                bail!("{} did not listen on {addr} within 60 s", program.name());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if farmap {
            self.handler = Some(self.pid);
            self.pid = children(self.pid)
                .first()
                .copied()
                .context("farmap run has no child although the program listens")?;
        }
        Ok(())
    }

    /// Stops the server (SIGTERM, then SIGKILL after 20 s) and returns how it ended.
    pub fn stop(mut self) -> anyhow::Result<std::process::ExitStatus> {
        let pid = rustix::process::Pid::from_raw(self.child.id() as i32).context("pid")?;
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(s) = self.child.try_wait()? {
                return Ok(s);
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                return Ok(self.child.wait()?);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether the server still runs.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

/// The children of `pid` (all its threads').
pub fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            if let Ok(s) = std::fs::read_to_string(t.path().join("children")) {
                out.extend(s.split_whitespace().filter_map(|c| c.parse::<u32>().ok()));
            }
        }
    }
    out
}

/// `VmRSS` of `pid` in bytes.
pub fn rss(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse::<u64>()
        .ok()
        .map(|kb| kb * 1024)
}

/// Minor + major page faults of `pid` so far.
pub fn faults(pid: u32) -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    let after = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .context("/proc/PID/stat has no ')'")?;
    let f: Vec<&str> = after.split_whitespace().collect();
    // state(3) ppid pgrp session tty_nr tpgid flags minflt(10) cminflt majflt(12)
    let field = |n: usize| -> anyhow::Result<u64> {
        f.get(n - 3)
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("field {n} of /proc/{pid}/stat"))
    };
    Ok(field(10)? + field(12)?)
}

/// A `/proc/vmstat` counter.
pub fn vmstat(key: &str) -> u64 {
    std::fs::read_to_string("/proc/vmstat")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
        })
        .unwrap_or(0)
}

/// Samples the resident memory of some processes every 50 ms until stopped; keeps the
/// largest sample of each.
pub struct RssSampler {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<u64>>,
}

impl RssSampler {
    pub fn start(pids: Vec<u32>) -> RssSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut max = vec![0u64; pids.len()];
            loop {
                for (m, pid) in max.iter_mut().zip(&pids) {
                    *m = (*m).max(rss(*pid).unwrap_or(0));
                }
                if s.load(Ordering::Relaxed) {
                    return max;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        RssSampler { stop, thread }
    }

    /// The largest sample of each process, in the order given.
    pub fn finish(self) -> Vec<u64> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_resident_memory_and_faults() {
        let me = std::process::id();
        assert!(rss(me).unwrap() > 0);
        assert!(faults(me).unwrap() > 0);
        let s = RssSampler::start(vec![me, u32::MAX]);
        std::thread::sleep(Duration::from_millis(60));
        let max = s.finish();
        assert!(max[0] > 0 && max[1] == 0, "{max:?}");
    }

    #[test]
    fn servers_run_in_the_foreground_without_persistence() {
        let redis = Program::Redis.command_line(7000, Path::new("/tmp/x"));
        assert!(redis.windows(2).any(|w| w == ["--save", ""]));
        assert!(redis.windows(2).any(|w| w == ["--daemonize", "no"]));
        let mc = Program::Memcached.command_line(7001, Path::new("/tmp/x"));
        assert!(mc.windows(2).any(|w| w == ["-p", "7001"]));
        assert!(!mc.iter().any(|a| a == "-d"));
    }
}
