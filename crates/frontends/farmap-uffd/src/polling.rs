//! The polling fault path ([`FaultWait::Poll`](crate::FaultWait::Poll)): a fault round trip
//! that wakes no sleeping CPU while faults come back to back.
//!
//! On a VM a userfaultfd round trip is dominated by two wake-ups of halted virtual CPUs (tens
//! of µs each on this machine, whose guest idle driver does not poll): the reader's, asleep
//! in `poll(2)` until the fault message arrives, and the faulting thread's, asleep in the
//! kernel until `UFFDIO_COPY` wakes it. This module removes both without pinning threads and
//! without touching system settings:
//!
//! ```text
//!   reader (SCHED_OTHER)                        companions (SCHED_IDLE, one per CPU)
//!   ────────────────────                        ────────────────────────────────────
//!   poll(2) ─ message ─▶ read, handle batch      parked on a condvar
//!   ┌▶ deadline = now + window ──── open ─────▶ woken if parked; spin (`spin_loop`)
//!   │  non-blocking read ── a batch: handle ┐     until the deadline: the CPU of a
//!   │    └─ nothing: spin hint, until the    │     faulting thread never halts, and
//!   └──────  deadline, then poll(2) again ◀──┘     its wake-up preempts the companion
//!                                               past the deadline: park again
//! ```
//!
//! - The reader, after handling a batch, keeps reading the (non-blocking) userfaultfd for up
//!   to the window before it blocks in `poll(2)` again; every batch it finds restarts the
//!   window. Faults it finds this way are counted in
//!   [`RegionStats::faults_polled`](crate::RegionStats::faults_polled), the others in
//!   [`faults_slept`](crate::RegionStats::faults_slept).
//! - While the window is open, one `SCHED_IDLE` companion per CPU the process may run on
//!   spins, checking the window's deadline (an atomic) between spin hints. Each companion
//!   keeps to its own CPU (`sched_setaffinity` of the companion only: the application's and
//!   the reader's threads are not pinned); unpinned, the scheduler sometimes stacks them on
//!   one CPU (they weigh next to nothing), and a CPU left without one halts. A CPU running
//!   only a `SCHED_IDLE` thread does not halt, so the faulting thread's wake-up reaches a
//!   running virtual CPU; the kernel counts such a CPU as idle when it places the woken
//!   thread, and any normal thread preempts a `SCHED_IDLE` one at once. Companions only burn
//!   time nobody else wants, but that time is real CPU (and power, and a host's share):
//!   [`RegionStats::handler_cpu`](crate::RegionStats::handler_cpu) reports it with the reader's.
//!   A companion that cannot lower itself to `SCHED_IDLE` exits instead of spinning at
//!   normal priority.
//! - When the deadline passes, companions park on a condvar; the reader wakes them when it
//!   opens the next window (only then: a window that is extended costs one atomic store and
//!   one atomic load). They are stopped and joined with the reader (region close, hand-over).
//!
//! Measured on this VM (2 vCPUs, `guest_halt_poll_ns` = 0), `farmap bench uffd --case fault-4k
//! --runs 3 --json`, medians of three invocations: see the README's issue-16 row.
//!
//! # Concurrency
//! - The deadline is written by the reader only; companions read it. Parking is a Dekker
//!   pair in `SeqCst`: a companion counts itself parked, then re-reads the deadline; the
//!   reader stores the deadline, then reads the parked count and, if non-zero, notifies
//!   under the lock the companions wait with. Either the companion sees the new deadline or
//!   the reader sees it parked, so no companion sleeps through an open window.
//! - CPU time is read from `/proc/self/task/TID/schedstat` of the threads alive; a thread
//!   that exits adds its own final CPU time to a retired total under the lock that lists the
//!   live ones, so the sum never skips nor counts a thread twice.

use std::fmt;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use rustix::thread::{CpuSet, Pid};

use farmap_memory::sched::{set_thread_policy, ThreadPolicy};

/// Spin hints between two looks at the clock in a companion's loop.
const SPINS_PER_CHECK: u32 = 16;

/// The CPUs process `pid` (`None`: this one) may run on, in order; `None` if the affinity
/// cannot be read.
pub(crate) fn affinity_cpus(pid: Option<u32>) -> Option<Vec<usize>> {
    let pid = match pid {
        Some(p) => Some(Pid::from_raw(i32::try_from(p).ok()?)?),
        None => None,
    };
    let set = rustix::thread::sched_getaffinity(pid).ok()?;
    Some((0..CpuSet::MAX_CPU).filter(|c| set.is_set(*c)).collect())
}

/// Keeps the calling thread to `cpu`.
pub(crate) fn keep_to_cpu(cpu: usize) -> io::Result<()> {
    let mut set = CpuSet::new();
    set.set(cpu);
    rustix::thread::sched_setaffinity(None, &set).map_err(io::Error::from)
}

/// CPU time of a set of threads: the ones alive, read from the kernel, plus the ones gone.
#[derive(Debug, Default)]
pub(crate) struct CpuAccount {
    inner: Mutex<CpuAccountInner>,
}

#[derive(Debug, Default)]
struct CpuAccountInner {
    live: Vec<Pid>,
    retired_ns: u64,
}

impl CpuAccount {
    /// Counts the calling thread until the returned guard drops (on the same thread).
    pub fn enter(self: &Arc<Self>) -> CpuGuard {
        let tid = rustix::thread::gettid();
        self.inner.lock().live.push(tid);
        CpuGuard {
            account: self.clone(),
            tid,
        }
    }

    /// Nanoseconds of CPU all counted threads have used, and how many are alive.
    pub fn total(&self) -> (u64, u32) {
        let inner = self.inner.lock();
        let live: u64 = inner
            .live
            .iter()
            .map(|t| task_cpu_ns(*t).unwrap_or(0))
            .sum();
        (inner.retired_ns + live, inner.live.len() as u32)
    }
}

/// Keeps the calling thread counted in a [`CpuAccount`]; on drop, retires it.
pub(crate) struct CpuGuard {
    account: Arc<CpuAccount>,
    tid: Pid,
}

impl Drop for CpuGuard {
    fn drop(&mut self) {
        let own = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
        let ns = (own.tv_sec as u64)
            .saturating_mul(1_000_000_000)
            .saturating_add(own.tv_nsec as u64);
        let mut inner = self.account.inner.lock();
        inner.live.retain(|t| *t != self.tid);
        inner.retired_ns += ns;
    }
}

/// CPU time of thread `tid` of this process: the first field of its `schedstat`.
pub(crate) fn task_cpu_ns(tid: Pid) -> io::Result<u64> {
    let s = std::fs::read_to_string(format!(
        "/proc/self/task/{}/schedstat",
        tid.as_raw_nonzero()
    ))?;
    s.split_ascii_whitespace()
        .next()
        .and_then(|f| f.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "unexpected schedstat line"))
}

/// What the companions share with the reader.
struct Shared {
    epoch: Instant,
    /// Nanoseconds after `epoch` until which companions spin.
    deadline: AtomicU64,
    /// Companions waiting on `wake` (or about to).
    parked: AtomicU32,
    stop: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
    cpu: Arc<CpuAccount>,
}

impl Shared {
    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    fn open(&self) -> bool {
        self.now_ns() < self.deadline.load(Ordering::SeqCst)
    }
}

/// The idle-priority threads that keep every CPU awake while the reader's window is open.
pub(crate) struct Companions {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl Companions {
    /// Starts one companion per entry of `cpus` (each kept to that CPU; `None`: anywhere),
    /// parked; their CPU time goes to `cpu`.
    pub fn spawn(cpus: Vec<Option<usize>>, cpu: Arc<CpuAccount>) -> io::Result<Companions> {
        let shared = Arc::new(Shared {
            epoch: Instant::now(),
            deadline: AtomicU64::new(0),
            parked: AtomicU32::new(0),
            stop: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            cpu,
        });
        let mut companions = Companions {
            shared,
            threads: Vec::with_capacity(cpus.len()),
        };
        for on in cpus {
            let shared = companions.shared.clone();
            // On an error, dropping `companions` stops the ones already started.
            let t = std::thread::Builder::new()
                .name("farmap-uffd-spin".into())
                .spawn(move || companion(&shared, on))?;
            companions.threads.push(t);
        }
        Ok(companions)
    }

    /// One companion per CPU this process may run on, each kept to its CPU (so that every
    /// CPU has one: the scheduler, left alone, sometimes stacks them on one CPU, since they
    /// weigh next to nothing); one per CPU, unpinned, if the affinity cannot be read.
    pub fn per_cpu(cpu: Arc<CpuAccount>) -> io::Result<Companions> {
        let cpus = match affinity_cpus(None) {
            Some(cpus) => cpus.into_iter().map(Some).collect(),
            None => {
                let n = std::thread::available_parallelism().map_or(1, |n| n.get());
                vec![None; n]
            }
        };
        Self::spawn(cpus, cpu)
    }

    /// Keeps the companions spinning until `until` (or later, if a later deadline is set).
    pub fn open_until(&self, until: Instant) {
        let s = &*self.shared;
        let ns = until.saturating_duration_since(s.epoch).as_nanos() as u64;
        s.deadline.store(ns, Ordering::SeqCst);
        if s.parked.load(Ordering::SeqCst) > 0 {
            let _g = s.lock.lock();
            s.wake.notify_all();
        }
    }

    /// Stops and joins every companion.
    pub fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let _g = self.shared.lock.lock();
            self.shared.wake.notify_all();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Companions {
    fn drop(&mut self) {
        self.stop();
    }
}

impl fmt::Debug for Companions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Companions")
            .field("threads", &self.threads.len())
            .finish()
    }
}

/// Thread ids of the companions alive in this process (see [`idle_companions`]).
static COMPANION_TIDS: Mutex<Vec<i32>> = Mutex::new(Vec::new());

/// The thread ids of this process's companions (of the polling fault path and of
/// [`KeepAwake`]), which run at `SCHED_IDLE` by design: code that sets the priority of every
/// thread of the process (a migration's pull, lowered and then restored) leaves them alone,
/// since a companion at normal priority spins against the application.
pub fn idle_companions() -> Vec<i32> {
    COMPANION_TIDS.lock().clone()
}

/// Keeps the calling companion listed in [`COMPANION_TIDS`] until dropped.
struct Listed(i32);

impl Listed {
    fn new() -> Listed {
        let tid = rustix::thread::gettid().as_raw_nonzero().get();
        COMPANION_TIDS.lock().push(tid);
        Listed(tid)
    }
}

impl Drop for Listed {
    fn drop(&mut self) {
        COMPANION_TIDS.lock().retain(|&t| t != self.0);
    }
}

fn companion(s: &Shared, on: Option<usize>) {
    // Listed before its policy is set, so that a priority change of the whole process
    // meanwhile cannot undo it.
    let _listed = Listed::new();
    if let Err(e) = set_thread_policy(0, ThreadPolicy::Idle) {
        // Spinning at normal priority would take the CPU from the application.
        tracing::warn!(error = %e, "a fault-path companion cannot run at SCHED_IDLE; it exits");
        return;
    }
    if let Some(c) = on {
        if let Err(e) = keep_to_cpu(c) {
            // Still useful wherever the scheduler puts it.
            tracing::debug!(error = %e, cpu = c, "a fault-path companion cannot keep to its CPU");
        }
    }
    let _cpu = s.cpu.enter();
    loop {
        if s.stop.load(Ordering::Relaxed) {
            return;
        }
        if s.open() {
            for _ in 0..SPINS_PER_CHECK {
                std::hint::spin_loop();
            }
            continue;
        }
        let mut g = s.lock.lock();
        s.parked.fetch_add(1, Ordering::SeqCst);
        while !s.stop.load(Ordering::SeqCst) && !s.open() {
            s.wake.wait(&mut g);
        }
        s.parked.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Keeps every CPU of this process from halting for a short, known wait: the same
/// idle-priority companions as the polling fault path, opened on demand.
///
/// On a VM whose idle virtual CPUs halt, waking a thread on one costs tens of µs, and more at
/// random: a migration's destination uses this between asking for the hand-over and
/// receiving it, so that the wake-up of the thread that reads the hand-over lands on a
/// running CPU. The companions run at `SCHED_IDLE` (any other thread preempts them at once)
/// and only until the deadline given; their CPU time is [`cpu_time`](Self::cpu_time).
#[derive(Debug)]
pub struct KeepAwake {
    companions: Companions,
    cpu: Arc<CpuAccount>,
}

impl KeepAwake {
    /// Starts one parked companion per CPU this process may run on.
    pub fn new() -> io::Result<KeepAwake> {
        let cpu = Arc::new(CpuAccount::default());
        Ok(KeepAwake {
            companions: Companions::per_cpu(cpu.clone())?,
            cpu,
        })
    }

    /// Keeps the CPUs awake until `deadline` (a deadline already past lets them halt again;
    /// dropping the `KeepAwake` stops the companions).
    pub fn until(&self, deadline: Instant) {
        self.companions.open_until(deadline);
    }

    /// CPU time the companions have used so far.
    pub fn cpu_time(&self) -> Duration {
        Duration::from_nanos(self.cpu.total().0)
    }
}

/// The reader's side of [`FaultWait::Poll`](crate::FaultWait::Poll): its window and its
/// companions.
#[derive(Debug)]
pub(crate) struct PollWindow {
    pub window: Duration,
    pub companions: Companions,
}

impl PollWindow {
    /// Opens (or extends) the window from now; returns its end.
    pub fn open(&self) -> Instant {
        let until = Instant::now() + self.window;
        self.companions.open_until(until);
        until
    }
}

/// The CPU accounts of a server's reader threads and companions (kept across reader
/// restarts).
#[derive(Debug, Default)]
pub(crate) struct HandlerAccounts {
    pub reader: Arc<CpuAccount>,
    pub companions: Arc<CpuAccount>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CPU time of the companions, sampled a little apart, until two samples agree (they
    /// are parked) or the tries run out.
    fn settled(cpu: &CpuAccount) -> (u64, bool) {
        let mut last = cpu.total().0;
        for _ in 0..200 {
            std::thread::sleep(Duration::from_millis(20));
            let now = cpu.total().0;
            if now == last {
                return (now, true);
            }
            last = now;
        }
        (last, false)
    }

    #[test]
    fn companions_spin_in_the_window_park_after_it_and_are_joined() {
        let cpu = Arc::new(CpuAccount::default());
        let mut c = Companions::spawn(vec![None, None], cpu.clone()).unwrap();
        // Both register themselves (or exit, if SCHED_IDLE is refused: then none counts).
        for _ in 0..500 {
            if cpu.total().1 == 2 {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(cpu.total().1, 2, "both companions run");
        let (before, parked) = settled(&cpu);
        assert!(parked, "companions with no window open do not spin");
        c.open_until(Instant::now() + Duration::from_millis(300));
        std::thread::sleep(Duration::from_millis(400));
        let (after, parked) = settled(&cpu);
        assert!(parked, "companions park again once the window is over");
        assert!(after > before, "companions spun while the window was open");
        c.stop();
        assert_eq!(cpu.total().1, 0, "every companion is joined");
        assert!(cpu.total().0 >= after, "their time is kept after they exit");
    }

    #[test]
    fn keep_awake_spins_until_its_deadline_is_moved_back() {
        let a = KeepAwake::new().unwrap();
        for _ in 0..500 {
            if a.cpu.total().1 > 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        assert!(a.cpu.total().1 > 0, "the companions run");
        let (idle, parked) = settled(&a.cpu);
        assert!(parked, "nothing spins before a deadline is set");
        a.until(Instant::now() + Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            a.cpu_time().as_nanos() as u64 > idle,
            "they spin until the deadline"
        );
        a.until(Instant::now());
        let (_, parked) = settled(&a.cpu);
        assert!(
            parked,
            "with the deadline moved back to now, they park again"
        );
    }

    #[test]
    fn a_thread_is_counted_until_it_exits() {
        let cpu = Arc::new(CpuAccount::default());
        let c2 = cpu.clone();
        std::thread::spawn(move || {
            let _g = c2.enter();
            let t = Instant::now();
            while t.elapsed() < Duration::from_millis(30) {
                std::hint::spin_loop();
            }
            assert_eq!(c2.total().1, 1);
            assert!(c2.total().0 > 0);
        })
        .join()
        .unwrap();
        let (ns, live) = cpu.total();
        assert_eq!(live, 0);
        assert!(ns > 0, "a thread that spun is counted after it exits");
    }
}
