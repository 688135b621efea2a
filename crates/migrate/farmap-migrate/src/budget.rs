//! How much of the machine a migration's pull may take from the application: the
//! scheduling priority of the threads that pull ([`PullPriority`]), a byte rate
//! (`max_rate`) and a share of the CPU (`cpu_share`), together a [`PullBudget`].
//!
//! The seeder's data plane runs on a runtime of its own whose threads take the priority; the
//! leecher's process (where the application does not run before the hand-over) takes it for
//! the pre-copy and gets its normal priority back before the application resumes there.

use std::str::FromStr;
use std::time::{Duration, Instant};

use farmap_memory::sched::{set_thread_policy, ThreadPolicy};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

/// The scheduling priority of the threads that pull.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PullPriority {
    /// As the application (`SCHED_OTHER`, nice 0): the library's default (an embedder's
    /// other threads are not touched); the CLI's default is `idle`.
    #[default]
    Normal,
    /// `SCHED_OTHER` at nice 19.
    Nice,
    /// `SCHED_BATCH` at nice 19: never preempts the application on wake-up.
    Batch,
    /// `SCHED_IDLE`: runs only when the application does not want the CPU.
    Idle,
}

impl FromStr for PullPriority {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "normal" => Ok(Self::Normal),
            "nice" => Ok(Self::Nice),
            "batch" => Ok(Self::Batch),
            "idle" => Ok(Self::Idle),
            _ => Err(format!(
                "unknown pull priority {s:?}: normal, nice, batch or idle"
            )),
        }
    }
}

impl std::fmt::Display for PullPriority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Normal => "normal",
            Self::Nice => "nice",
            Self::Batch => "batch",
            Self::Idle => "idle",
        })
    }
}

impl PullPriority {
    /// Gives thread `tid` (0: the calling one) this priority.
    pub fn apply(self, tid: i32) -> std::io::Result<()> {
        let (policy, nice) = match self {
            Self::Normal => (ThreadPolicy::Other, 0),
            Self::Nice => (ThreadPolicy::Other, 19),
            Self::Batch => (ThreadPolicy::Batch, 19),
            Self::Idle => (ThreadPolicy::Idle, 0),
        };
        set_thread_policy(tid, policy)?;
        // setpriority(PRIO_PROCESS, tid) sets one thread's nice value on Linux.
        let pid = if tid == 0 {
            None
        } else {
            rustix::process::Pid::from_raw(tid)
        };
        rustix::process::setpriority_process(pid, nice)?;
        Ok(())
    }

    /// Gives every thread of this process this priority (threads they start inherit it),
    /// except the idle-priority companions of the fault path
    /// ([`farmap_uffd::idle_companions`]), which stay at `SCHED_IDLE`; returns how many
    /// threads refused (they exited meanwhile, or lack the privilege).
    pub fn apply_to_process(self) -> usize {
        let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
            return 1;
        };
        let companions = farmap_uffd::idle_companions();
        let mut failed = 0;
        for t in tasks.flatten() {
            let Some(tid) = t.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            if companions.contains(&tid) {
                continue;
            }
            if let Err(e) = self.apply(tid) {
                tracing::debug!("thread {tid}: setting the {self} priority failed: {e}");
                failed += 1;
            }
        }
        failed
    }
}

/// What a pull may take: its threads' priority, a byte rate, a CPU share.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct PullBudget {
    /// Priority of the threads that pull.
    #[serde(default)]
    pub priority: PullPriority,
    /// Most bytes per second the pull moves (none: as fast as it can).
    #[serde(default)]
    pub max_rate: Option<u64>,
    /// Most CPU this process spends while pulling, as a share of the machine's CPUs (0 to 1;
    /// none: no limit).
    #[serde(default)]
    pub cpu_share: Option<f64>,
}

/// Longest sleep between two looks at the budget, and longest pause for the CPU share.
const MAX_PAUSE: Duration = Duration::from_millis(100);

/// Keeps a pull within its rate and CPU share by pausing between batches.
///
/// - The rate is kept: a batch starts only once the bytes moved before it are paid for
///   (moved at the rate), so a pull bursts by one batch at most, whatever number of tasks
///   pace concurrently (the check and the count are one step under the lock).
/// - The CPU share slows a pull, never stops it: a batch pauses while the process has used
///   more than its share, at most [`MAX_PAUSE`] (an application that alone uses more than
///   the share must not starve the pull).
/// - Both count from the start of the current pull ([`restart`](Self::restart)): time spent
///   waiting for a leecher is no credit.
/// - [`lift`](Self::lift) ends the pacing until the next restart, and releases waiting
///   batches within [`MAX_PAUSE`]: once the source's application is suspended, the reads
///   are the downtime's and the post-copy's, which the destination waits for.
#[derive(Debug)]
pub(crate) struct Pacer {
    rate: Option<f64>,
    /// CPU seconds per wall second allowed.
    cpu: Option<f64>,
    state: Mutex<PacerState>,
}

#[derive(Debug)]
struct PacerState {
    start: Instant,
    cpu_at_start: Duration,
    bytes: u64,
    lifted: bool,
}

impl PacerState {
    fn now() -> Self {
        PacerState {
            start: Instant::now(),
            cpu_at_start: process_cpu(),
            bytes: 0,
            lifted: false,
        }
    }
}

/// What a pacer answers a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Take {
    /// Counted: the batch may go after this pause (the CPU share's; zero for none).
    Go(Duration),
    /// Not counted: the bytes moved so far are not paid for yet; ask again after this long.
    Wait(Duration),
}

/// CPU time of this process so far (`CLOCK_PROCESS_CPUTIME_ID`: every thread, including
/// those that have exited, up to the moment of the call).
pub fn process_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

impl Pacer {
    pub(crate) fn new(budget: &PullBudget) -> Self {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        Self {
            rate: budget.max_rate.filter(|r| *r > 0).map(|r| r as f64),
            cpu: budget
                .cpu_share
                .filter(|s| s.is_finite() && *s > 0.0 && *s < 1.0)
                .map(|s| s * cpus),
            state: Mutex::new(PacerState::now()),
        }
    }

    /// Whether it ever pauses.
    pub(crate) fn is_limited(&self) -> bool {
        self.rate.is_some() || self.cpu.is_some()
    }

    /// A new pull starts: bytes and CPU count from now, and pacing is on again.
    pub(crate) fn restart(&self) {
        *self.state.lock() = PacerState::now();
    }

    /// Pacing is off until the next [`restart`](Self::restart).
    pub(crate) fn lift(&self) {
        self.state.lock().lifted = true;
    }

    /// Counts `bytes` if the bytes moved so far are paid for.
    fn take(&self, bytes: u64) -> Take {
        if !self.is_limited() {
            return Take::Go(Duration::ZERO);
        }
        let mut s = self.state.lock();
        if s.lifted {
            return Take::Go(Duration::ZERO);
        }
        let elapsed = s.start.elapsed().as_secs_f64();
        if let Some(rate) = self.rate {
            // The bytes moved so far take this long at the rate.
            let ahead = s.bytes as f64 / rate - elapsed;
            if ahead > 0.0 {
                return Take::Wait(Duration::from_secs_f64(ahead).min(MAX_PAUSE));
            }
        }
        s.bytes = s.bytes.saturating_add(bytes);
        let mut pause = 0.0f64;
        if let Some(cpu) = self.cpu {
            let used = process_cpu().saturating_sub(s.cpu_at_start).as_secs_f64();
            pause = used / cpu - elapsed;
        }
        Take::Go(Duration::from_secs_f64(pause.max(0.0)).min(MAX_PAUSE))
    }

    /// Pauses as long as the budget needs before moving `bytes` more (and counts them).
    pub(crate) async fn pace(&self, bytes: u64) {
        loop {
            match self.take(bytes) {
                Take::Go(pause) => {
                    if !pause.is_zero() {
                        tokio::time::sleep(pause).await;
                    }
                    return;
                }
                Take::Wait(d) => tokio::time::sleep(d).await,
            }
        }
    }
}

/// A runtime of its own, shut down in the background when dropped (it may be dropped on
/// another runtime's thread).
#[derive(Debug)]
pub(crate) struct PullRuntime(Option<tokio::runtime::Runtime>);

impl PullRuntime {
    pub(crate) fn handle(&self) -> &tokio::runtime::Handle {
        self.0.as_ref().expect("present until dropped").handle()
    }
}

impl Drop for PullRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// A runtime for pulling work whose threads run at `priority` (the seeder's data plane).
pub(crate) fn pull_runtime(priority: PullPriority, threads: usize) -> std::io::Result<PullRuntime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .thread_name("farmap-pull")
        .enable_all()
        .on_thread_start(move || {
            if let Err(e) = priority.apply(0) {
                tracing::warn!("a pull thread kept its priority ({priority} refused: {e})");
            }
        })
        .build()
        .map(|rt| PullRuntime(Some(rt)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priorities_parse_and_print() {
        for p in ["normal", "nice", "batch", "idle"] {
            assert_eq!(p.parse::<PullPriority>().unwrap().to_string(), p);
        }
        assert!("fast".parse::<PullPriority>().is_err());
    }

    #[test]
    fn a_rate_lets_a_batch_go_once_the_bytes_before_it_are_paid_for() {
        let p = Pacer::new(&PullBudget {
            max_rate: Some(1_000_000),
            ..PullBudget::default()
        });
        assert_eq!(
            p.take(50_000),
            Take::Go(Duration::ZERO),
            "nothing moved yet"
        );
        // 50 kB at 1 MB/s take 50 ms: the next batch waits for most of them, uncounted.
        for _ in 0..3 {
            match p.take(50_000) {
                Take::Wait(d) => assert!(
                    d > Duration::from_millis(30) && d <= Duration::from_millis(50),
                    "{d:?}"
                ),
                go => panic!("went early: {go:?}"),
            }
        }
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(p.take(10_000_000), Take::Go(Duration::ZERO));
        // 10 MB ahead: told to look again within the longest pause, as often as asked.
        assert_eq!(p.take(0), Take::Wait(MAX_PAUSE));
        assert_eq!(p.take(0), Take::Wait(MAX_PAUSE));
        // Lifted: everything goes; restarted: counted from nothing again.
        p.lift();
        assert_eq!(p.take(u64::MAX), Take::Go(Duration::ZERO));
        p.restart();
        assert_eq!(p.take(50_000), Take::Go(Duration::ZERO));
        assert!(matches!(p.take(50_000), Take::Wait(_)));
    }

    #[test]
    fn concurrent_batches_keep_the_rate() {
        // 8 tasks of 100 kB batches at 2 MB/s: 2 MB (20 batches) take at least 950 ms
        // (the first batch goes at once), however many tasks ask at the same time.
        let p = std::sync::Arc::new(Pacer::new(&PullBudget {
            max_rate: Some(2_000_000),
            ..PullBudget::default()
        }));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let took = rt.block_on(async {
            let t = Instant::now();
            let next = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
            let tasks: Vec<_> = (0..8)
                .map(|_| {
                    let (p, next) = (p.clone(), next.clone());
                    tokio::spawn(async move {
                        while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < 20 {
                            p.pace(100_000).await;
                        }
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
            t.elapsed()
        });
        assert!(
            took >= Duration::from_millis(950),
            "2 MB at 2 MB/s in {took:?}"
        );
        assert!(took < Duration::from_secs(5), "{took:?}");
    }

    #[test]
    fn a_cpu_share_pauses_a_batch_at_most_the_longest_pause() {
        let p = Pacer::new(&PullBudget {
            cpu_share: Some(0.01),
            ..PullBudget::default()
        });
        // Burn CPU far over the share: each batch still goes, after at most MAX_PAUSE.
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(50) {
            std::hint::black_box(process_cpu());
        }
        match p.take(1) {
            Take::Go(d) => assert!(d > Duration::ZERO && d <= MAX_PAUSE, "{d:?}"),
            wait => panic!("a CPU share never holds a batch back: {wait:?}"),
        }
    }

    #[test]
    fn no_budget_never_pauses() {
        let p = Pacer::new(&PullBudget::default());
        assert!(!p.is_limited());
        assert_eq!(p.take(u64::MAX / 2), Take::Go(Duration::ZERO));
        assert_eq!(p.take(u64::MAX / 2), Take::Go(Duration::ZERO));
    }

    #[test]
    fn pull_runtime_threads_take_the_priority() {
        let rt = pull_runtime(PullPriority::Idle, 1).unwrap();
        let policy = rt.handle().block_on(async {
            tokio::spawn(async {
                std::fs::read_to_string("/proc/thread-self/sched")
                    .ok()
                    .and_then(|s| {
                        s.lines()
                            .find(|l| l.starts_with("policy"))
                            .and_then(|l| l.split(':').nth(1))
                            .map(|v| v.trim().to_owned())
                    })
            })
            .await
            .unwrap()
        });
        // SCHED_IDLE is policy 5.
        assert_eq!(policy.as_deref(), Some("5"));
    }
}
