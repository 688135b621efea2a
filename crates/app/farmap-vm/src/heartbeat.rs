//! The guest's heartbeats, stamped on the host as they arrive (docs/design/vm.md §7).
//!
//! The guest program writes single bytes to I/O port 0xe9; QEMU's `isa-debugcon` forwards
//! them to the `hb` chardev, a Unix socket QEMU connects to at start-up and we listen on.
//!
//! - A booted guest's stream starts with the magic pair [`MAGIC`] (`0xFA 0xCE`); bytes before
//!   it are someone else's (firmware) and are dropped. Then one byte per heartbeat: a
//!   sequence number 0, 1, ..., 255, 0, ...
//! - After a live migration (or a restore) the next QEMU's stream simply goes on with the
//!   sequence, without the magic: listen for it with [`HeartbeatListener::bind_continued`].
//! - Each byte is stamped with [`Instant::now`] when the read that carried it returns (the
//!   bytes of one read share a stamp), on a thread that does nothing else. Under TCG the
//!   guest's clocks stop with the VM, so only host stamps show a stop.
//! - [`analyse`] merges the streams of both ends of a migration in time order: the sequence
//!   must go on without a hole, and the largest gap is the guest's pause as the host saw it.

use std::io::{self, Read};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The two bytes a booted guest sends before its first heartbeat.
pub const MAGIC: [u8; 2] = [0xFA, 0xCE];

/// Most heartbeats kept per stream (16 bytes each: 64 MiB). A guest that sends more is
/// misbehaving; the excess is counted ([`Heartbeats::dropped`]) and logged, not kept.
pub const MAX_BEATS: usize = 1 << 22;

/// How often the reader thread looks at its stop flag while nothing arrives.
const STOP_POLL: Duration = Duration::from_millis(20);

/// Bytes per read: small, so a burst is stamped soon after each piece arrives.
const READ_BUF: usize = 64;

/// One heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Beat {
    /// When its read returned, on the host.
    pub at: Instant,
    /// The guest's sequence number (mod 256).
    pub seq: u8,
}

/// How a stream starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Start {
    /// With [`MAGIC`], after possible noise.
    Magic,
    /// Straight with heartbeats (the sequence goes on from another QEMU).
    Continued,
}

/// A Unix socket listening for one QEMU's heartbeat chardev. Bind it before QEMU starts:
/// QEMU connects at start-up and fails if nobody listens.
#[derive(Debug)]
pub struct HeartbeatListener {
    listener: UnixListener,
    path: PathBuf,
    start: Start,
}

impl HeartbeatListener {
    /// Listens at `path` for a booting guest's stream (magic first). A stale socket file at
    /// `path` is replaced; any other file there is an error.
    pub fn bind(path: impl AsRef<Path>) -> io::Result<Self> {
        Self::bind_as(path.as_ref(), Start::Magic)
    }

    /// Listens at `path` for a stream that continues another QEMU's (a migration's
    /// destination, a restore): every byte is a heartbeat.
    pub fn bind_continued(path: impl AsRef<Path>) -> io::Result<Self> {
        Self::bind_as(path.as_ref(), Start::Continued)
    }

    fn bind_as(path: &Path, start: Start) -> io::Result<Self> {
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            if meta.file_type().is_socket() {
                std::fs::remove_file(path)?;
            }
        }
        let listener = UnixListener::bind(path)?;
        listener.set_nonblocking(true)?;
        Ok(Self {
            listener,
            path: path.to_path_buf(),
            start,
        })
    }

    /// The socket's path (for [`QemuConfig::heartbeat`](crate::QemuConfig::heartbeat)).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Starts the collector thread: it accepts one connection, then reads and stamps until
    /// the stream ends or the [`Heartbeats`] handle is dropped.
    pub fn start(self) -> io::Result<Heartbeats> {
        let shared = Arc::new(Shared::default());
        let thread = std::thread::Builder::new()
            .name("farmap-vm-heartbeat".into())
            .spawn({
                let shared = shared.clone();
                move || collect(self.listener, self.start, &shared)
            })?;
        Ok(Heartbeats {
            shared,
            thread: Some(thread),
            path: self.path,
        })
    }
}

/// The handle of one stream's collector. Dropping it stops the thread and removes the
/// socket file.
#[derive(Debug)]
pub struct Heartbeats {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    path: PathBuf,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    stop: AtomicBool,
}

#[derive(Debug, Default)]
struct State {
    beats: Vec<Beat>,
    connected: bool,
    closed: bool,
    dropped: u64,
    error: Option<String>,
}

impl Heartbeats {
    /// Every heartbeat so far, in arrival order (the magic, and bytes before it, excluded).
    pub fn beats(&self) -> Vec<Beat> {
        self.state().beats.clone()
    }

    /// How many heartbeats so far.
    pub fn count(&self) -> usize {
        self.state().beats.len()
    }

    /// The latest heartbeat.
    pub fn last(&self) -> Option<Beat> {
        self.state().beats.last().copied()
    }

    /// Whether QEMU has connected.
    pub fn is_connected(&self) -> bool {
        self.state().connected
    }

    /// Whether the stream has ended (QEMU exited or closed it, or reading failed).
    pub fn is_closed(&self) -> bool {
        self.state().closed
    }

    /// Heartbeats not kept past [`MAX_BEATS`].
    pub fn dropped(&self) -> u64 {
        self.state().dropped
    }

    /// Why reading stopped, if it failed (rather than ended).
    pub fn error(&self) -> Option<String> {
        self.state().error.clone()
    }

    /// Waits until there are at least `count` heartbeats: `false` after `timeout`, or as soon
    /// as the stream ends short of them.
    pub fn wait_for(&self, count: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut state = self.state();
        loop {
            if state.beats.len() >= count {
                return true;
            }
            if state.closed {
                return false;
            }
            match self.wait(state, deadline) {
                Some(next) => state = next,
                None => return false,
            }
        }
    }

    /// The first heartbeat stamped after `after` (already there, or arriving within
    /// `timeout`): how the first guest instruction after a restore is timed. `None` after
    /// `timeout`, or once the stream ends without one.
    pub fn wait_after(&self, after: Instant, timeout: Duration) -> Option<Beat> {
        let deadline = Instant::now() + timeout;
        let mut state = self.state();
        loop {
            let first = state.beats.partition_point(|b| b.at <= after);
            if let Some(beat) = state.beats.get(first) {
                return Some(*beat);
            }
            if state.closed {
                return None;
            }
            state = self.wait(state, deadline)?;
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for a change until `deadline`; `None` once it has passed.
    fn wait<'a>(
        &'a self,
        state: MutexGuard<'a, State>,
        deadline: Instant,
    ) -> Option<MutexGuard<'a, State>> {
        let left = deadline.checked_duration_since(Instant::now())?;
        let (state, _) = self
            .shared
            .changed
            .wait_timeout(state, left)
            .unwrap_or_else(|e| e.into_inner());
        Some(state)
    }
}

impl Drop for Heartbeats {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The collector thread: accept, then read and stamp until the end.
fn collect(listener: UnixListener, start: Start, shared: &Shared) {
    let result = accept(&listener, shared).and_then(|stream| match stream {
        Some(stream) => read_stream(stream, start, shared),
        None => Ok(()),
    });
    let mut state = shared.state.lock().unwrap_or_else(|e| e.into_inner());
    state.closed = true;
    if let Err(e) = result {
        tracing::warn!(error = %e, "heartbeat stream failed");
        state.error = Some(e.to_string());
    }
    drop(state);
    shared.changed.notify_all();
}

/// Accepts one connection; `None` when told to stop first.
fn accept(listener: &UnixListener, shared: &Shared) -> io::Result<Option<UnixStream>> {
    loop {
        if shared.stop.load(Ordering::Relaxed) {
            return Ok(None);
        }
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false)?;
                stream.set_read_timeout(Some(STOP_POLL))?;
                shared.update(|s| s.connected = true);
                return Ok(Some(stream));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(e),
        }
    }
}

fn read_stream(mut stream: UnixStream, start: Start, shared: &Shared) -> io::Result<()> {
    let mut magic = MagicScan::new(start);
    let mut buf = [0u8; READ_BUF];
    let mut beats = Vec::with_capacity(READ_BUF);
    while !shared.stop.load(Ordering::Relaxed) {
        let n = match stream.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if is_idle(&e) => continue,
            Err(e) => return Err(e),
        };
        let at = Instant::now();
        beats.clear();
        beats.extend(
            buf[..n]
                .iter()
                .filter_map(|&b| magic.feed(b))
                .map(|seq| Beat { at, seq }),
        );
        if !beats.is_empty() {
            shared.update(|s| s.append(&beats));
        }
    }
    Ok(())
}

fn is_idle(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

impl Shared {
    fn update(&self, f: impl FnOnce(&mut State)) {
        f(&mut self.state.lock().unwrap_or_else(|e| e.into_inner()));
        self.changed.notify_all();
    }
}

impl State {
    fn append(&mut self, beats: &[Beat]) {
        let room = MAX_BEATS.saturating_sub(self.beats.len());
        let (kept, over) = beats.split_at(room.min(beats.len()));
        self.beats.extend_from_slice(kept);
        if !over.is_empty() {
            if self.dropped == 0 {
                tracing::warn!(
                    max = MAX_BEATS,
                    "heartbeat stream past its limit: dropping beats"
                );
            }
            self.dropped += over.len() as u64;
        }
    }
}

/// Finds the magic pair; every byte after it is a heartbeat.
#[derive(Debug)]
struct MagicScan {
    found: bool,
    after_first: bool,
}

impl MagicScan {
    fn new(start: Start) -> Self {
        Self {
            found: start == Start::Continued,
            after_first: false,
        }
    }

    /// The heartbeat `byte` is, if it is one.
    fn feed(&mut self, byte: u8) -> Option<u8> {
        if self.found {
            return Some(byte);
        }
        self.found = self.after_first && byte == MAGIC[1];
        self.after_first = byte == MAGIC[0];
        None
    }
}

/// What a run's heartbeats say, all streams merged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Analysis {
    /// Heartbeats in all streams.
    pub beats: usize,
    /// Heartbeats whose sequence number does not follow the one before them (in time order,
    /// across stream boundaries too): lost, repeated or foreign bytes.
    pub holes: usize,
    /// The largest time between two consecutive heartbeats.
    pub max_gap: Duration,
    /// When the largest gap began: the stamp of the heartbeat before it (`None` with fewer
    /// than two heartbeats).
    pub max_gap_at: Option<Instant>,
}

/// Merges streams in time order (a stable merge: equal stamps keep the order of `streams`,
/// so pass the source's stream first) and measures holes and gaps.
pub fn analyse(streams: &[&[Beat]]) -> Analysis {
    let mut all: Vec<Beat> = streams.iter().flat_map(|s| s.iter().copied()).collect();
    all.sort_by_key(|b| b.at);
    let mut analysis = Analysis {
        beats: all.len(),
        holes: 0,
        max_gap: Duration::ZERO,
        max_gap_at: None,
    };
    for pair in all.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        if b.seq != a.seq.wrapping_add(1) {
            analysis.holes += 1;
        }
        let gap = b.at - a.at;
        if analysis.max_gap_at.is_none() || gap > analysis.max_gap {
            analysis.max_gap = gap;
            analysis.max_gap_at = Some(a.at);
        }
    }
    analysis
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    const LONG: Duration = Duration::from_secs(10);

    /// Beats `seqs` at `t0 + ms` each.
    fn beats(t0: Instant, beats: &[(u64, u8)]) -> Vec<Beat> {
        beats
            .iter()
            .map(|&(ms, seq)| Beat {
                at: t0 + Duration::from_millis(ms),
                seq,
            })
            .collect()
    }

    #[test]
    fn a_sequence_wraps_at_255_without_a_hole() {
        let t0 = Instant::now();
        let seqs: Vec<(u64, u8)> = (0..600u64).map(|i| (i, (i % 256) as u8)).collect();
        let a = analyse(&[&beats(t0, &seqs)]);
        assert_eq!((a.beats, a.holes), (600, 0));
        assert_eq!(a.max_gap, Duration::from_millis(1));
    }

    #[test]
    fn holes_repeats_and_the_largest_gap() {
        let t0 = Instant::now();
        // 2 is lost, 4 comes twice: two holes. The gap of 7 ms begins at 10 ms.
        let one = beats(t0, &[(0, 0), (1, 1), (5, 3), (6, 4), (10, 4), (17, 5)]);
        let a = analyse(&[&one]);
        assert_eq!((a.beats, a.holes), (6, 2));
        assert_eq!(a.max_gap, Duration::from_millis(7));
        assert_eq!(a.max_gap_at, Some(t0 + Duration::from_millis(10)));
    }

    #[test]
    fn a_gap_across_two_streams() {
        let t0 = Instant::now();
        let source = beats(t0, &[(0, 254), (2, 255), (4, 0), (6, 1)]);
        let dest = beats(t0, &[(56, 2), (58, 3), (59, 4)]);
        // Either order of the streams gives the same merge.
        for streams in [[&source[..], &dest[..]], [&dest[..], &source[..]]] {
            let a = analyse(&streams);
            assert_eq!((a.beats, a.holes), (7, 0));
            assert_eq!(a.max_gap, Duration::from_millis(50));
            assert_eq!(a.max_gap_at, Some(t0 + Duration::from_millis(6)));
        }
        // A destination that starts over at 0 is a hole.
        let restarted = beats(t0, &[(56, 0), (58, 1)]);
        assert_eq!(analyse(&[&source, &restarted]).holes, 1);
    }

    #[test]
    fn nothing_to_analyse() {
        let a = analyse(&[&[], &[]]);
        assert_eq!(
            (a.beats, a.holes, a.max_gap, a.max_gap_at),
            (0, 0, Duration::ZERO, None)
        );
        let one = beats(Instant::now(), &[(0, 9)]);
        assert_eq!(analyse(&[&one]).max_gap_at, None);
    }

    #[test]
    fn the_magic_scan_drops_what_comes_before() {
        let mut scan = MagicScan::new(Start::Magic);
        let bytes = [0x12, 0xFA, 0x00, 0xFA, 0xFA, 0xCE, 0xFA, 0xCE, 0x00, 0x01];
        let seqs: Vec<u8> = bytes.iter().filter_map(|&b| scan.feed(b)).collect();
        assert_eq!(seqs, [0xFA, 0xCE, 0x00, 0x01]);
        let mut scan = MagicScan::new(Start::Continued);
        let seqs: Vec<u8> = [0x07, 0xFA, 0xCE]
            .iter()
            .filter_map(|&b| scan.feed(b))
            .collect();
        assert_eq!(seqs, [0x07, 0xFA, 0xCE]);
    }

    #[test]
    fn bytes_from_a_client_are_stamped_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hb.sock");
        let beats = HeartbeatListener::bind(&path).unwrap().start().unwrap();
        assert!(!beats.is_connected());
        let mut qemu = UnixStream::connect(&path).unwrap();
        qemu.write_all(&[0x01, 0x02, 0xFA, 0xCE, 0, 1, 2]).unwrap();
        assert!(beats.wait_for(3, LONG));
        assert!(beats.is_connected());
        let first = beats.beats();
        assert_eq!(first.iter().map(|b| b.seq).collect::<Vec<_>>(), [0, 1, 2]);
        let mark = Instant::now();
        std::thread::sleep(Duration::from_millis(5));
        qemu.write_all(&[3, 4]).unwrap();
        let next = beats.wait_after(mark, LONG).unwrap();
        assert_eq!(next.seq, 3);
        assert!(next.at > mark && next.at > first[2].at);
        assert!(beats.wait_for(5, LONG));
        assert_eq!(beats.last().map(|b| b.seq), Some(4));
        assert_eq!(beats.count(), 5);
        drop(qemu);
        assert!(!beats.wait_for(6, LONG), "the stream ended");
        assert!(beats.is_closed() && beats.error().is_none());
        assert_eq!(beats.wait_after(Instant::now(), LONG), None);
        assert_eq!(analyse(&[&beats.beats()]).holes, 0);
        drop(beats);
        assert!(!path.exists(), "the socket file is removed");
    }

    #[test]
    fn a_continued_stream_has_no_magic_and_a_stale_socket_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hb.sock");
        drop(UnixListener::bind(&path).unwrap());
        assert!(path.exists());
        let beats = HeartbeatListener::bind_continued(&path)
            .unwrap()
            .start()
            .unwrap();
        let mut qemu = UnixStream::connect(&path).unwrap();
        qemu.write_all(&[0xFA, 0xFB]).unwrap();
        assert!(beats.wait_for(2, LONG));
        assert_eq!(beats.beats()[0].seq, 0xFA);
        std::fs::write(dir.path().join("plain"), b"x").unwrap();
        assert!(HeartbeatListener::bind(dir.path().join("plain")).is_err());
    }

    #[test]
    fn a_handle_dropped_before_qemu_connects_stops_its_thread() {
        let dir = tempfile::tempdir().unwrap();
        let beats = HeartbeatListener::bind(dir.path().join("hb.sock"))
            .unwrap()
            .start()
            .unwrap();
        assert!(!beats.wait_for(1, Duration::from_millis(20)));
        drop(beats);
    }
}
