//! The guest's serial console: QEMU's `ser` chardev socket, read line by line on a thread
//! (the guest program's `VMCHECK` lines among them: [`crate::vmcheck`]).
//!
//! The API is blocking (std threads, as the heartbeat collector); from async code call it
//! through `spawn_blocking`.
//!
//! - Lines are kept in arrival order (`\r` removed, at most [`MAX_KEPT_LINES`], each cut at
//!   [`MAX_CONSOLE_LINE`] bytes).
//! - [`Console::wait_line`] reads them through a cursor: each wait sees the lines after the
//!   one the previous wait returned, so a line that came before the wait began is not missed,
//!   and one is not returned twice. [`Console::skip_to_end`] moves the cursor past every
//!   line so far.

use std::collections::VecDeque;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::vmcheck::VmcheckLine;

/// The longest console line kept whole, in bytes; longer ones are cut into pieces.
pub const MAX_CONSOLE_LINE: usize = 64 * 1024;
/// Most lines kept; past it the oldest are forgotten.
pub const MAX_KEPT_LINES: usize = 100_000;
/// Lines of the console's end quoted by errors.
const TAIL_LINES: usize = 20;
/// How often [`Console::connect`] tries again while the socket does not exist yet.
const CONNECT_RETRY: Duration = Duration::from_millis(10);
/// How often the reader thread looks at its stop flag while nothing arrives.
const STOP_POLL: Duration = Duration::from_millis(20);

/// A failure of the console reader. Waits that fail quote the console's last lines.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsoleError {
    /// The socket did not accept a connection before the timeout.
    #[error("cannot connect to the serial console {}: no QEMU listening after {timeout:?}", path.display())]
    ConnectTimeout {
        /// The socket.
        path: PathBuf,
        /// How long we retried.
        timeout: Duration,
        /// The last connection error.
        #[source]
        source: io::Error,
    },
    /// Reading from or writing to the socket failed.
    #[error("the serial console {} failed", path.display())]
    Io {
        /// The socket.
        path: PathBuf,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// QEMU closed the console before a matching line came.
    #[error("QEMU closed the serial console {}; its last lines:\n{tail}", path.display())]
    Closed {
        /// The socket.
        path: PathBuf,
        /// The console's last lines.
        tail: String,
    },
    /// No matching line came in time.
    #[error("timed out after {timeout:?} waiting for a console line on {}; its last lines:\n{tail}", path.display())]
    Timeout {
        /// The socket.
        path: PathBuf,
        /// The timeout.
        timeout: Duration,
        /// The console's last lines.
        tail: String,
    },
}

/// The guest's serial console. Dropping it stops the reader thread.
#[derive(Debug)]
pub struct Console {
    path: PathBuf,
    shared: Arc<Shared>,
    writer: Mutex<UnixStream>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    stop: AtomicBool,
}

#[derive(Debug, Default)]
struct State {
    lines: VecDeque<String>,
    /// The number of the first line in `lines` (older ones were forgotten).
    first: usize,
    /// The number of the next line a wait looks at.
    cursor: usize,
    closed: bool,
}

impl State {
    fn end(&self) -> usize {
        self.first + self.lines.len()
    }

    fn tail(&self, n: usize) -> String {
        let skip = self.lines.len().saturating_sub(n);
        let lines: Vec<&str> = self.lines.iter().skip(skip).map(String::as_str).collect();
        lines.join("\n")
    }
}

impl Console {
    /// Connects to the console socket QEMU listens on, trying again every 10 ms while it
    /// does not exist (QEMU creates it at start-up), and starts reading.
    pub fn connect(path: impl AsRef<Path>, timeout: Duration) -> Result<Self, ConsoleError> {
        let path = path.as_ref().to_path_buf();
        let stream = connect_retrying(&path, timeout)?;
        let io_error = |source| ConsoleError::Io {
            path: path.clone(),
            source,
        };
        stream.set_read_timeout(Some(STOP_POLL)).map_err(io_error)?;
        let reader = stream.try_clone().map_err(io_error)?;
        let shared = Arc::new(Shared::default());
        let thread = std::thread::Builder::new()
            .name("farmap-vm-console".into())
            .spawn({
                let shared = shared.clone();
                move || read_lines(reader, &shared)
            })
            .map_err(io_error)?;
        Ok(Self {
            path,
            shared,
            writer: Mutex::new(stream),
            thread: Some(thread),
        })
    }

    /// Waits for the next line, from the cursor on, for which `pred` holds, and moves the
    /// cursor past it.
    pub fn wait_line(
        &self,
        timeout: Duration,
        mut pred: impl FnMut(&str) -> bool,
    ) -> Result<String, ConsoleError> {
        let deadline = Instant::now() + timeout;
        let mut state = self.state();
        loop {
            let start = state.cursor.max(state.first);
            let lines = state.lines.iter().skip(start - state.first);
            let found = lines.enumerate().find(|(_, line)| pred(line));
            if let Some((i, line)) = found {
                let line = line.clone();
                state.cursor = start + i + 1;
                return Ok(line);
            }
            state.cursor = state.end();
            if state.closed {
                let tail = state.tail(TAIL_LINES);
                return Err(ConsoleError::Closed {
                    path: self.path.clone(),
                    tail,
                });
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                let tail = state.tail(TAIL_LINES);
                return Err(ConsoleError::Timeout {
                    path: self.path.clone(),
                    timeout,
                    tail,
                });
            };
            let (next, _) = self
                .shared
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(|e| e.into_inner());
            state = next;
        }
    }

    /// [`wait_line`](Self::wait_line) for a `VMCHECK` line for which `pred` holds.
    pub fn wait_vmcheck(
        &self,
        timeout: Duration,
        mut pred: impl FnMut(&VmcheckLine) -> bool,
    ) -> Result<VmcheckLine, ConsoleError> {
        let mut found = None;
        self.wait_line(timeout, |line| match VmcheckLine::parse(line) {
            Some(v) if pred(&v) => {
                found = Some(v);
                true
            }
            _ => false,
        })?;
        Ok(found.expect("wait_line returned the line the predicate took"))
    }

    /// Moves the cursor past every line so far: the next wait sees only new lines.
    pub fn skip_to_end(&self) {
        let mut state = self.state();
        state.cursor = state.end();
    }

    /// Writes `line` and a `\n` to the guest's console input (`stop` asks the guest program
    /// for its final check).
    pub fn send_line(&self, line: &str) -> Result<(), ConsoleError> {
        let mut writer = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        let mut bytes = Vec::with_capacity(line.len() + 1);
        bytes.extend_from_slice(line.as_bytes());
        bytes.push(b'\n');
        writer.write_all(&bytes).map_err(|source| ConsoleError::Io {
            path: self.path.clone(),
            source,
        })
    }

    /// The last `n` lines, joined by `\n`, for error messages.
    pub fn tail(&self, n: usize) -> String {
        self.state().tail(n)
    }

    /// Every line kept so far.
    pub fn lines(&self) -> Vec<String> {
        self.state().lines.iter().cloned().collect()
    }

    /// Whether the console has ended (QEMU exited or closed it).
    pub fn is_closed(&self) -> bool {
        self.state().closed
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Console {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn connect_retrying(path: &Path, timeout: Duration) -> Result<UnixStream, ConsoleError> {
    let deadline = Instant::now() + timeout;
    loop {
        let error = match UnixStream::connect(path) {
            Ok(stream) => return Ok(stream),
            Err(e) => e,
        };
        let retry = matches!(
            error.kind(),
            io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused
        );
        if !retry {
            return Err(ConsoleError::Io {
                path: path.into(),
                source: error,
            });
        }
        if Instant::now() + CONNECT_RETRY > deadline {
            return Err(ConsoleError::ConnectTimeout {
                path: path.into(),
                timeout,
                source: error,
            });
        }
        std::thread::sleep(CONNECT_RETRY);
    }
}

/// The reader thread: lines until the end of the stream or the stop flag.
fn read_lines(stream: UnixStream, shared: &Shared) {
    let mut reader = BufReader::new(stream);
    let mut buf = Vec::new();
    while !shared.stop.load(Ordering::Relaxed) {
        let room = (MAX_CONSOLE_LINE - buf.len()) as u64;
        match (&mut reader).take(room).read_until(b'\n', &mut buf) {
            Ok(0) if room > 0 => break,
            Ok(_) if buf.last() == Some(&b'\n') || buf.len() >= MAX_CONSOLE_LINE => {
                push_line(shared, &buf);
                buf.clear();
            }
            Ok(_) => {}
            Err(e) if is_idle(&e) => {}
            Err(e) => {
                tracing::warn!(error = %e, "serial console read failed");
                break;
            }
        }
    }
    if !buf.is_empty() {
        push_line(shared, &buf);
    }
    let mut state = shared.state.lock().unwrap_or_else(|e| e.into_inner());
    state.closed = true;
    drop(state);
    shared.changed.notify_all();
}

fn is_idle(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

/// Keeps one line: its `\n` and every `\r` removed, invalid UTF-8 replaced.
fn push_line(shared: &Shared, bytes: &[u8]) {
    let bytes = bytes.strip_suffix(b"\n").unwrap_or(bytes);
    let line: String = String::from_utf8_lossy(bytes)
        .chars()
        .filter(|&c| c != '\r')
        .collect();
    tracing::trace!(line, "console");
    let mut state = shared.state.lock().unwrap_or_else(|e| e.into_inner());
    if state.lines.len() >= MAX_KEPT_LINES {
        state.lines.pop_front();
        state.first += 1;
    }
    state.lines.push_back(line);
    drop(state);
    shared.changed.notify_all();
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener;

    use super::*;

    const LONG: Duration = Duration::from_secs(10);

    /// A fake QEMU console: a listener, and the accepted stream once the console connects.
    fn fake(dir: &Path) -> (PathBuf, UnixListener) {
        let path = dir.join("serial.sock");
        let listener = UnixListener::bind(&path).unwrap();
        (path, listener)
    }

    #[test]
    fn lines_in_order_once_each_and_input_to_the_guest() {
        let dir = tempfile::tempdir().unwrap();
        let (path, listener) = fake(dir.path());
        let console = Console::connect(&path, LONG).unwrap();
        let (mut qemu, _) = listener.accept().unwrap();
        qemu.write_all(b"Run /init as init process\r\nVMCHECK ready ws_mib=16 rate_mibs=32\r\n")
            .unwrap();
        qemu.write_all(
            b"VMCHECK t_ms=500 gen=1 pages=2048 mibs=32.0 max_gap_us=900 mismatches=0\r\n",
        )
        .unwrap();
        let ready = console
            .wait_vmcheck(LONG, |l| matches!(l, VmcheckLine::Ready { .. }))
            .unwrap();
        assert!(matches!(ready, VmcheckLine::Ready { ws_mib: 16, .. }));
        // The report came before this wait, after the ready line: it is seen, once.
        let report = console.wait_line(LONG, |l| l.contains("t_ms=")).unwrap();
        assert!(report.starts_with("VMCHECK t_ms=500"), "{report}");
        console.send_line("stop").unwrap();
        let mut input = [0u8; 5];
        qemu.read_exact(&mut input).unwrap();
        assert_eq!(&input, b"stop\n");
        qemu.write_all(b"VMCHECK done pages=4096 mismatches=0\r\n")
            .unwrap();
        let done = console
            .wait_vmcheck(LONG, |l| matches!(l, VmcheckLine::Done { .. }))
            .unwrap();
        assert!(matches!(done, VmcheckLine::Done { mismatches: 0, .. }));
        assert_eq!(console.tail(1), "VMCHECK done pages=4096 mismatches=0");
        assert_eq!(console.lines().len(), 4);
        let err = console
            .wait_line(Duration::from_millis(20), |l| l.contains("t_ms="))
            .unwrap_err();
        assert!(matches!(err, ConsoleError::Timeout { .. }), "{err:?}");
        assert!(err.to_string().contains("serial.sock") && err.to_string().contains("done pages"));
        qemu.write_all(b"Kernel panic - not syncing: Attempted to kill init!")
            .unwrap();
        drop(qemu);
        let err = console
            .wait_line(LONG, |l| l.contains("never"))
            .unwrap_err();
        assert!(matches!(err, ConsoleError::Closed { .. }), "{err:?}");
        assert!(err.to_string().contains("Kernel panic"), "{err}");
        assert!(console.is_closed());
    }

    #[test]
    fn skip_to_end_and_long_lines() {
        let dir = tempfile::tempdir().unwrap();
        let (path, listener) = fake(dir.path());
        let console = Console::connect(&path, LONG).unwrap();
        let (mut qemu, _) = listener.accept().unwrap();
        qemu.write_all(b"old 1\nold 2\n").unwrap();
        console.wait_line(LONG, |l| l == "old 2").unwrap();
        qemu.write_all(b"old 3\n").unwrap();
        console.wait_line(LONG, |l| l == "old 3").unwrap();
        console.skip_to_end();
        let long = vec![b'x'; MAX_CONSOLE_LINE + 10];
        qemu.write_all(&long).unwrap();
        qemu.write_all(b"\nnew\n").unwrap();
        let first = console.wait_line(LONG, |_| true).unwrap();
        assert_eq!(first.len(), MAX_CONSOLE_LINE);
        assert_eq!(console.wait_line(LONG, |_| true).unwrap(), "x".repeat(10));
        assert_eq!(console.wait_line(LONG, |_| true).unwrap(), "new");
    }

    #[test]
    fn connect_waits_for_the_socket_and_times_out_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("serial.sock");
        let later = path.clone();
        let qemu = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            let listener = UnixListener::bind(&later).unwrap();
            listener.accept().unwrap()
        });
        let console = Console::connect(&path, LONG).unwrap();
        drop(qemu.join().unwrap());
        assert!(console.wait_line(LONG, |_| true).is_err(), "closed");
        let absent = dir.path().join("absent.sock");
        let err = Console::connect(&absent, Duration::from_millis(30)).unwrap_err();
        assert!(
            matches!(err, ConsoleError::ConnectTimeout { .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("absent.sock"), "{err}");
    }
}
