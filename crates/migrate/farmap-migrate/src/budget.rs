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

/// Longest pause one [`Pacer::pace`] call takes (a budget is kept on average, and a cancel
/// or a hand-over is never held up for long).
const MAX_PAUSE: Duration = Duration::from_millis(100);

/// Keeps a pull within its rate and CPU share by pausing between batches.
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
            state: Mutex::new(PacerState {
                start: Instant::now(),
                cpu_at_start: process_cpu(),
                bytes: 0,
            }),
        }
    }

    /// Whether it ever pauses.
    pub(crate) fn is_limited(&self) -> bool {
        self.rate.is_some() || self.cpu.is_some()
    }

    /// How long to pause before moving `bytes` more (and counts them).
    pub(crate) fn delay(&self, bytes: u64) -> Duration {
        if !self.is_limited() {
            return Duration::ZERO;
        }
        let mut s = self.state.lock();
        let elapsed = s.start.elapsed().as_secs_f64();
        let mut due = 0.0f64;
        if let Some(rate) = self.rate {
            // The bytes moved so far take this long at the rate.
            due = due.max(s.bytes as f64 / rate);
        }
        if let Some(cpu) = self.cpu {
            let used = process_cpu().saturating_sub(s.cpu_at_start).as_secs_f64();
            due = due.max(used / cpu);
        }
        s.bytes += bytes;
        Duration::from_secs_f64((due - elapsed).max(0.0)).min(MAX_PAUSE)
    }

    /// Pauses as long as the budget needs before moving `bytes` more.
    pub(crate) async fn pace(&self, bytes: u64) {
        let d = self.delay(bytes);
        if !d.is_zero() {
            tokio::time::sleep(d).await;
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
    fn a_rate_spreads_bytes_over_time() {
        let p = Pacer::new(&PullBudget {
            max_rate: Some(1_000_000),
            ..PullBudget::default()
        });
        assert_eq!(p.delay(50_000), Duration::ZERO, "nothing moved yet");
        // 50 kB at 1 MB/s take 50 ms: the next batch waits for most of them.
        let d = p.delay(50_000);
        assert!(
            d > Duration::from_millis(30) && d <= Duration::from_millis(50),
            "{d:?}"
        );
        // Never more than the longest pause at once.
        let d = p.delay(10_000_000);
        assert!(d <= MAX_PAUSE, "{d:?}");
        assert!(p.delay(0) == MAX_PAUSE, "10 MB at 1 MB/s are 10 s ahead");
    }

    #[test]
    fn no_budget_never_pauses() {
        let p = Pacer::new(&PullBudget::default());
        assert!(!p.is_limited());
        assert_eq!(p.delay(u64::MAX / 2), Duration::ZERO);
        assert_eq!(p.delay(u64::MAX / 2), Duration::ZERO);
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
