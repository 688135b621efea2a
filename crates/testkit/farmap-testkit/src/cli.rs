//! A program under test run for real: `farmap` in the CLI's tests.
//!
//! Only the crate that builds a binary knows where it is (`env!("CARGO_BIN_EXE_farmap")` in
//! its integration tests), so [`Cli`] is given the path:
//!
//! ```text
//! let farmap = Cli::new(env!("CARGO_BIN_EXE_farmap"));
//! let info = farmap.json(&["info", "--json", "memory:1MiB"]);
//! ```

use std::ffi::{OsStr, OsString};
use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, ChildStderr, Command, ExitStatus, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;

use crate::process::Proc;

/// A program to run with arguments, and the environment changes every run gets.
#[derive(Debug, Clone)]
pub struct Cli {
    bin: PathBuf,
    /// Variables set (`Some`) or removed (`None`), in order.
    env: Vec<(OsString, Option<OsString>)>,
}

impl Cli {
    /// The program at `bin`, run with the test's environment, except its state directory
    /// (`XDG_STATE_HOME`, where a `mirror:` keeps its journal): one of this test process's
    /// own, shared by its runs, so that tests leave nothing in the user's.
    pub fn new(bin: impl Into<PathBuf>) -> Cli {
        let state = std::env::temp_dir().join(format!("farmap-test-state-{}", std::process::id()));
        Cli {
            bin: bin.into(),
            env: vec![("XDG_STATE_HOME".into(), Some(state.into_os_string()))],
        }
    }

    /// The same, with `key=value` in the environment of every run.
    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Cli {
        self.env
            .push((key.as_ref().to_owned(), Some(value.as_ref().to_owned())));
        self
    }

    /// The same, with `key` removed from the environment of every run.
    pub fn env_remove(mut self, key: impl AsRef<OsStr>) -> Cli {
        self.env.push((key.as_ref().to_owned(), None));
        self
    }

    /// A command for the program with the environment changes, to add arguments to.
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(&self.bin);
        for (key, value) in &self.env {
            if let Some(value) = value {
                cmd.env(key, value);
            } else {
                cmd.env_remove(key);
            }
        }
        cmd
    }

    /// Runs the program with `args` (stdin empty, stdout and stderr captured) to its end.
    ///
    /// # Panics
    /// If it cannot be started.
    pub fn run(&self, args: &[&str]) -> Output {
        self.command()
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", self.bin.display()))
    }

    /// Runs the program with `args`, which must succeed; its stdout.
    ///
    /// # Panics
    /// If it fails (with its stderr).
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "farmap {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs the program with `args`, which must fail; its stderr.
    ///
    /// # Panics
    /// If it succeeds.
    pub fn fails(&self, args: &[&str]) -> String {
        let out = self.run(args);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "farmap {args:?} succeeded: {stderr}");
        stderr
    }

    /// Runs the program with `args` (which ask for JSON), which must succeed and print
    /// exactly one line: that line's value.
    ///
    /// # Panics
    /// If it fails, prints another number of lines, or a line that is not JSON.
    pub fn json(&self, args: &[&str]) -> Value {
        let stdout = self.ok(args);
        let lines: Vec<&str> = stdout.lines().collect();
        assert_eq!(lines.len(), 1, "one JSON line from {args:?}: {stdout}");
        serde_json::from_str(lines[0]).unwrap_or_else(|e| panic!("{e}: {stdout}"))
    }

    /// Runs the program with `args` (which ask for JSON lines), which must succeed: the value
    /// of each line it printed.
    ///
    /// # Panics
    /// If it fails or prints a line that is not JSON.
    pub fn json_lines(&self, args: &[&str]) -> Vec<Value> {
        self.ok(args)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?} is not JSON")))
            .collect()
    }

    /// Starts the program with `args` as a server (`farmap serve`, `farmap proxy`): see
    /// [`Listening`].
    pub fn listening(&self, args: &[&str]) -> Listening {
        Listening::start(self.command().args(args))
    }

    /// Starts the program with `args` as a [`Proc`] named `name`, every wait for it bounded
    /// by `wait`.
    pub fn proc(&self, name: &str, args: &[&str], wait: Duration) -> Proc {
        Proc::spawn(name, self.command().args(args), wait)
    }
}

/// The number `key` of a JSON row a command printed.
///
/// # Panics
/// If `row` has no number `key` (naming the row).
pub fn number(row: &Value, key: &str) -> f64 {
    row[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number in {row}"))
}

/// A server process whose first stderr line, its banner, says `listening on ADDR`; killed
/// (and reaped) when dropped. Its stdout goes nowhere. The rest of its stderr is left in the
/// pipe until [`Listening::drain_stderr`], [`Listening::log_stderr`], [`Listening::stop`] or
/// [`Listening::close_stderr`] say what becomes of it: a server that logs much must have its
/// stderr drained or it blocks on the full pipe.
#[derive(Debug)]
pub struct Listening {
    child: Child,
    addr: String,
    banner: String,
    stderr: Option<BufReader<ChildStderr>>,
}

impl Listening {
    /// Starts `cmd` and reads its banner.
    ///
    /// # Panics
    /// If it cannot be started, or no line before its output ends names an address (it is
    /// killed first). Lines before the one that does (warnings) are skipped.
    pub fn start(cmd: &mut Command) -> Listening {
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start a server: {e}"));
        let mut stderr = BufReader::new(child.stderr.take().expect("piped"));
        // Warnings logged while the store is opened may come first.
        let mut banner = String::new();
        let mut before = String::new();
        for _ in 0..64 {
            banner.clear();
            if stderr.read_line(&mut banner).unwrap_or(0) == 0 || banner.contains("listening on ") {
                break;
            }
            before.push_str(&banner);
        }
        if !banner.contains("listening on ") {
            banner.insert_str(0, &before);
        }
        let addr = banner
            .split("listening on ")
            .nth(1)
            .and_then(|rest| rest.split(|c: char| c.is_whitespace() || c == ',').next())
            .filter(|a| !a.is_empty())
            .map(str::to_owned);
        let Some(addr) = addr else {
            // Not left running (holding its port, and whatever it inherited) after the panic.
            let _ = child.kill();
            let _ = child.wait();
            panic!("no address in {banner:?}");
        };
        Listening {
            child,
            addr,
            banner,
            stderr: Some(stderr),
        }
    }

    /// The address it listens on, as printed (`127.0.0.1:PORT`, `unix:PATH`).
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Its first stderr line, which named the address.
    pub fn banner(&self) -> &str {
        &self.banner
    }

    /// The process.
    pub fn child(&mut self) -> &mut Child {
        &mut self.child
    }

    /// Its process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Reads the rest of its stderr on a thread of its own and drops it: it never blocks on a
    /// full pipe, and its logging never fails on a closed one.
    pub fn drain_stderr(&mut self) {
        if let Some(mut stderr) = self.stderr.take() {
            std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
        }
    }

    /// The same server, its stderr drained (see [`Listening::drain_stderr`]).
    pub fn drained(mut self) -> Listening {
        self.drain_stderr();
        self
    }

    /// Reads the rest of its stderr on a thread of its own into a string shared with the
    /// caller (which starts with the banner).
    pub fn log_stderr(&mut self) -> Arc<Mutex<String>> {
        let log = Arc::new(Mutex::new(self.banner.clone()));
        if let Some(mut stderr) = self.stderr.take() {
            let sink = log.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = stderr.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    sink.lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push_str(&String::from_utf8_lossy(&buf[..n]));
                }
            });
        }
        log
    }

    /// Closes our end of its stderr pipe, as a parent that stops reading does.
    pub fn close_stderr(&mut self) {
        self.stderr = None;
    }

    /// Sends it `signal` (by name, through kill(1)).
    ///
    /// # Panics
    /// If kill(1) fails.
    pub fn signal(&self, signal: &str) {
        let sent = Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(sent.success(), "kill -{signal} failed");
    }

    /// Sends it `signal` (see [`Listening::signal`]) and waits for its exit: its status, and
    /// the rest of its stderr if it was still in the pipe.
    pub fn stop(mut self, signal: &str) -> (ExitStatus, String) {
        self.signal(signal);
        let status = self.child.wait().expect("wait for the server");
        let mut rest = String::new();
        if let Some(stderr) = &mut self.stderr {
            let _ = stderr.read_to_string(&mut rest);
        }
        (status, rest)
    }

    /// Kills it (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Listening {
    fn drop(&mut self) {
        self.kill();
    }
}
