//! Warming the kernel's page cache with the store's working set ([`Store::working_set`]): once
//! the file is first read (an application started on it), a thread reads the recorded chunks
//! through the mount in that order, a few requests at a time, so that the application's first
//! touches of them find their pages cached (minor faults) instead of waiting for a FUSE round
//! trip each. A guest restored on a mount touches its working set in 4 KiB faults scattered
//! over its RAM; read here, the same bytes come in requests of up to `max_request` bytes.
//!
//! It only ever reads through the file, so the kernel fetches only the pages it does not
//! hold: a page the application wrote meanwhile is left as it is. (FUSE's `NOTIFY_STORE`
//! would save the round trips, but it overwrites what is cached, dirty pages included: it is
//! only safe while nobody uses the file.)
//!
//! [`Store::working_set`]: farmap_core::Store::working_set

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use farmap_core::{ChunkIdx, Geometry, Store};

/// Reads in flight at once.
const WORKERS: usize = 4;

/// What the read path and the warming thread share.
#[derive(Debug, Default)]
pub(crate) struct Trigger {
    /// Set by the first read; the fast path of [`fire`](Self::fire).
    fired: AtomicBool,
    phase: Mutex<Phase>,
    changed: Condvar,
    /// Stops the workers between two reads.
    stop: AtomicBool,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Phase {
    #[default]
    Waiting,
    Running,
    Stopped,
}

impl Trigger {
    /// Starts the warming (the first call; later ones cost an atomic load).
    pub(crate) fn fire(&self) {
        if self.fired.load(Ordering::Relaxed) || self.fired.swap(true, Ordering::AcqRel) {
            return;
        }
        let mut phase = self.phase.lock().unwrap_or_else(|e| e.into_inner());
        if *phase == Phase::Waiting {
            *phase = Phase::Running;
            self.changed.notify_all();
        }
    }

    fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        *self.phase.lock().unwrap_or_else(|e| e.into_inner()) = Phase::Stopped;
        self.changed.notify_all();
    }

    /// Waits for the first read; false once stopped.
    fn wait(&self) -> bool {
        let phase = self.phase.lock().unwrap_or_else(|e| e.into_inner());
        let phase = self
            .changed
            .wait_while(phase, |p| *p == Phase::Waiting)
            .unwrap_or_else(|e| e.into_inner());
        *phase == Phase::Running
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }
}

/// What a warming did.
#[derive(Debug, Default)]
pub struct WarmStats {
    /// Chunks of the working set it reads (0 until the first read of the file, and when the
    /// store knows none).
    pub chunks: AtomicU64,
    /// Bytes read through the file (cached pages included: the kernel skips those).
    pub bytes: AtomicU64,
    /// From the first read of the file until the last byte was in, in microseconds (0:
    /// not finished).
    pub done_us: AtomicU64,
}

/// The warming thread of one mount.
#[derive(Debug)]
pub(crate) struct WarmUp {
    trigger: Arc<Trigger>,
    stats: Arc<WarmStats>,
    thread: Option<JoinHandle<()>>,
}

impl WarmUp {
    /// A thread that, once `trigger` fires, reads the store's working set (as the store
    /// knows it then: a migration's destination learns it at the hand-over), capped at
    /// `max_bytes`, from the file at `path` in runs of at most `max_request` bytes.
    pub(crate) fn start(
        path: PathBuf,
        store: Arc<dyn Store>,
        max_request: u32,
        max_bytes: u64,
    ) -> std::io::Result<WarmUp> {
        let trigger = Arc::new(Trigger::default());
        let stats = Arc::new(WarmStats::default());
        let (t, s) = (trigger.clone(), stats.clone());
        let thread = std::thread::Builder::new()
            .name("farmap-fuse-warm".into())
            .spawn(move || {
                if !t.wait() {
                    return;
                }
                let Some(set) = store.working_set() else {
                    return;
                };
                s.chunks.store(set.len() as u64, Ordering::Relaxed);
                let runs = runs(store.geometry(), &set, u64::from(max_request), max_bytes);
                drop((store, set));
                warm(&path, &runs, max_request as usize, &t, &s);
            })?;
        Ok(WarmUp {
            trigger,
            stats,
            thread: Some(thread),
        })
    }

    pub(crate) fn trigger(&self) -> &Arc<Trigger> {
        &self.trigger
    }

    pub(crate) fn stats(&self) -> &Arc<WarmStats> {
        &self.stats
    }

    /// Stops it between two reads and waits for it (it holds the file open).
    pub(crate) fn stop(&mut self) {
        self.trigger.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for WarmUp {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The byte ranges of `set`, in its order, consecutive chunks merged up to `max_request`
/// bytes, `max_bytes` in all.
fn runs(geometry: Geometry, set: &[ChunkIdx], max_request: u64, max_bytes: u64) -> Vec<Range<u64>> {
    let chunk = u64::from(geometry.chunk_size());
    let mut out: Vec<Range<u64>> = Vec::new();
    let mut total = 0u64;
    for &idx in set {
        if !geometry.contains(idx) {
            continue;
        }
        let start = idx.0 * chunk;
        let len = geometry.chunk_len(idx) as u64;
        if total + len > max_bytes {
            break;
        }
        total += len;
        match out.last_mut() {
            Some(r) if r.end == start && r.end - r.start + len <= max_request.max(chunk) => {
                r.end += len;
            }
            _ => out.push(start..start + len),
        }
    }
    // A run longer than a request (chunks above max_request) is read in request-sized parts.
    out.into_iter()
        .flat_map(|r| {
            let step = max_request.max(4096);
            (r.start..r.end)
                .step_by(step as usize)
                .map(move |s| s..(s + step).min(r.end))
        })
        .collect()
}

fn warm(path: &Path, runs: &[Range<u64>], max_request: usize, t: &Trigger, s: &WarmStats) {
    let start = Instant::now();
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) => {
            return tracing::debug!("warming the page cache: opening {}: {e}", path.display())
        }
    };
    // Exactly the ranges asked: no read-ahead of the kernel's own around them.
    if let Err(e) = rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::Random) {
        tracing::debug!("warming the page cache: fadvise: {e}");
    }
    let next = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..WORKERS.min(runs.len()) {
            scope.spawn(|| {
                let mut buf = vec![0u8; max_request];
                while !t.stopped() {
                    let Some(r) = runs.get(next.fetch_add(1, Ordering::Relaxed)) else {
                        break;
                    };
                    let want = (r.end - r.start) as usize;
                    let mut got = 0;
                    while got < want {
                        match file.read_at(&mut buf[got..want], r.start + got as u64) {
                            Ok(0) => break,
                            Ok(n) => got += n,
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                            Err(e) => {
                                // The application's own reads report what is wrong.
                                tracing::debug!(offset = r.start, "warming the page cache: {e}");
                                t.stop.store(true, Ordering::Release);
                                break;
                            }
                        }
                    }
                    s.bytes.fetch_add(got as u64, Ordering::Relaxed);
                }
            });
        }
    });
    let took = start.elapsed();
    if !t.stopped() {
        s.done_us
            .store(took.as_micros().max(1) as u64, Ordering::Relaxed);
    }
    tracing::debug!(
        bytes = s.bytes.load(Ordering::Relaxed),
        ms = took.as_secs_f64() * 1e3,
        "warmed the page cache with the working set"
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn runs_merge_neighbours_in_order_and_stop_at_the_cap() {
        let g = Geometry::new(10 * 65536, 65536).unwrap();
        let set: Vec<ChunkIdx> = [3, 4, 5, 0, 9, 1].into_iter().map(ChunkIdx).collect();
        let r = runs(g, &set, 2 * 65536, u64::MAX);
        let k = 65536;
        assert_eq!(
            r,
            vec![3 * k..5 * k, 5 * k..6 * k, 0..k, 9 * k..10 * k, k..2 * k]
        );
        assert_eq!(runs(g, &set, 1 << 20, 3 * k), vec![3 * k..6 * k]);
        let outside = [ChunkIdx(10), ChunkIdx(2)];
        assert_eq!(runs(g, &outside, 1 << 20, u64::MAX), vec![2 * k..3 * k]);
    }

    #[test]
    fn trigger_starts_once_and_stop_wakes_the_waiter() {
        let t = Arc::new(Trigger::default());
        t.fire();
        t.fire();
        assert!(t.wait());
        let t = Arc::new(Trigger::default());
        let w = {
            let t = t.clone();
            std::thread::spawn(move || t.wait())
        };
        std::thread::sleep(Duration::from_millis(20));
        t.stop();
        assert!(!w.join().unwrap());
        assert!(t.stopped());
    }
}
