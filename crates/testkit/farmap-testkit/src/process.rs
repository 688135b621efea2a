//! Child processes of a test: their output read as it comes, killed when dropped.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use serde_json::Value;

/// The lines of `r` (a child's stdout or stderr), read to the end on a thread of their own
/// (so the child never blocks on a full pipe); with `tag`, each is also echoed to stderr as
/// `[tag] line`.
pub fn lines(r: impl Read + Send + 'static, tag: Option<String>) -> Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(r).lines().map_while(Result::ok) {
            if let Some(tag) = &tag {
                eprintln!("[{tag}] {l}");
            }
            if tx.send(l).is_err() {
                return;
            }
        }
    });
    rx
}

/// The next line of `out` that is a JSON object whose `event` is `event`, skipping the
/// others.
///
/// # Panics
/// If none comes within `wait` (naming `who`).
pub fn next_event(out: &Receiver<String>, event: &str, who: &str, wait: Duration) -> Value {
    let deadline = Instant::now() + wait;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let l = out
            .recv_timeout(left)
            .unwrap_or_else(|e| panic!("{who}: no '{event}' event ({e})"));
        if let Ok(v) = serde_json::from_str::<Value>(&l) {
            if v["event"] == event {
                return v;
            }
        }
    }
}

/// Runs `cmd` to its end (stdin empty), which must succeed: its stdout.
///
/// # Panics
/// If it cannot be started, or fails (with its stderr).
pub fn stdout_of(cmd: &mut Command) -> String {
    let result = cmd.output();
    let out = result.unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Waits up to `limit` for `child` to exit; kills (SIGKILL) and reaps it if it has not.
pub fn wait_or_kill(child: &mut Child, limit: Duration) {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Stops `child` if it still runs: SIGTERM (through kill(1)), then [`wait_or_kill`] with
/// `limit`. For a process that cleans up on SIGTERM (a mount unmounts, a swap turns off).
pub fn terminate(child: &mut Child, limit: Duration) {
    if let Ok(None) = child.try_wait() {
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        wait_or_kill(child, limit);
    }
}

/// A child process killed (and reaped) when dropped.
#[derive(Debug)]
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A child process talked to through its stdin, whose stdout and stderr lines are collected
/// as they come (each echoed to the test's stderr as `[NAME out]` and `[NAME err]`); killed
/// when dropped. Every wait is bounded by the `wait` it was started with.
#[derive(Debug)]
pub struct Proc {
    name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    out: Receiver<String>,
    err: Receiver<String>,
    seen_err: Vec<String>,
    wait: Duration,
}

impl Proc {
    /// Starts `cmd` with its stdin, stdout and stderr piped to the test.
    ///
    /// # Panics
    /// If it cannot be started.
    pub fn spawn(name: &str, cmd: &mut Command, wait: Duration) -> Proc {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name}: {e}"));
        let out = lines(
            child.stdout.take().expect("piped"),
            Some(format!("{name} out")),
        );
        let err = lines(
            child.stderr.take().expect("piped"),
            Some(format!("{name} err")),
        );
        Proc {
            name: name.to_owned(),
            stdin: child.stdin.take(),
            child,
            out,
            err,
            seen_err: Vec::new(),
            wait,
        }
    }

    /// The name it was started with.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The process.
    pub fn child(&mut self) -> &mut Child {
        &mut self.child
    }

    /// Its process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Writes `line` and a newline to its stdin.
    pub fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin is open");
        writeln!(stdin, "{line}").expect("write to the child's stdin");
        stdin.flush().expect("flush the child's stdin");
    }

    /// The next stdout line that is JSON whose `event` is `event` (see [`next_event`]).
    pub fn event(&mut self, event: &str) -> Value {
        next_event(&self.out, event, &self.name, self.wait)
    }

    /// Waits for a stderr line containing `text` (one seen before counts); returns it.
    ///
    /// # Panics
    /// If none comes within the wait.
    pub fn stderr_line(&mut self, text: &str) -> String {
        if let Some(l) = self.seen_err.iter().find(|l| l.contains(text)) {
            return l.clone();
        }
        let deadline = Instant::now() + self.wait;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let l = self.err.recv_timeout(left).unwrap_or_else(|e| {
                panic!(
                    "{}: no stderr line with {text:?} ({e}); saw {:#?}",
                    self.name, self.seen_err
                )
            });
            self.seen_err.push(l.clone());
            if l.contains(text) {
                return l;
            }
        }
    }

    /// Waits for the exit; returns its success, its stdout lines and all its stderr.
    ///
    /// # Panics
    /// If it does not exit within the wait.
    pub fn finish(self) -> (bool, Vec<String>, String) {
        let (status, out, err) = self.finish_status();
        (status.success(), out, err)
    }

    /// Waits for the exit; returns its exit status, its stdout lines and all its stderr.
    ///
    /// # Panics
    /// If it does not exit within the wait.
    pub fn finish_status(mut self) -> (ExitStatus, Vec<String>, String) {
        let deadline = Instant::now() + self.wait;
        let status = loop {
            if let Some(s) = self.child.try_wait().expect("wait for the child") {
                break s;
            }
            assert!(Instant::now() < deadline, "{} did not exit", self.name);
            std::thread::sleep(Duration::from_millis(20));
        };
        let wait = self.wait;
        let out: Vec<String> = std::iter::from_fn(|| self.out.recv_timeout(wait).ok()).collect();
        let rest: Vec<String> = std::iter::from_fn(|| self.err.recv_timeout(wait).ok()).collect();
        self.seen_err.extend(rest);
        (status, out, self.seen_err.join("\n"))
    }

    /// Sends it `signal` (by name, through kill(1): `INT` is a Ctrl-C).
    ///
    /// # Panics
    /// If kill(1) fails.
    pub fn signal(&self, signal: &str) {
        let sent = Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(sent.success(), "kill -{signal} {} failed", self.name);
    }

    /// Kills it (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Whether it is still running.
    pub fn running(&mut self) -> bool {
        self.child.try_wait().expect("wait for the child").is_none()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Resident memory (`VmRSS`) of process `pid`, in bytes.
///
/// # Panics
/// If the process does not exist (or its status has no `VmRSS`).
pub fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("process {pid} is not running: {e}"));
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS in /proc/PID/status");
    kb * 1024
}

/// A hostile client's writer: writes `bytes` to `s` until done or `stop`, never reading the
/// replies, counting what it sent in `sent`; then keeps the connection open (and unread)
/// until `stop`.
pub fn pipeline_without_reading(
    mut s: std::net::TcpStream,
    bytes: &[u8],
    stop: &std::sync::atomic::AtomicBool,
    sent: &std::sync::atomic::AtomicU64,
) {
    use std::sync::atomic::Ordering;
    s.set_write_timeout(Some(Duration::from_millis(100)))
        .expect("a write timeout");
    let mut at = 0;
    while at < bytes.len() && !stop.load(Ordering::Relaxed) {
        match s.write(&bytes[at..]) {
            Ok(0) => break,
            Ok(n) => {
                at += n;
                sent.fetch_add(n as u64, Ordering::Relaxed);
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
    }
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(50));
    }
}
