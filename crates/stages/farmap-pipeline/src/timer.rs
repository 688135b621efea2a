//! A precise async timer for latency emulation.
//!
//! tokio's timer wheel has a granularity of one millisecond and rounds every sleep up, so a
//! 10 ms round trip becomes 11 ms (9% of throughput lost) and a 200 µs one becomes a whole
//! millisecond. [`sleep`] and [`sleep_until`] instead hand their deadline to one dedicated
//! thread, started on first use and shared by the whole process, that keeps a min-heap of
//! deadlines and waits for the earliest with a nanosecond futex timeout. A sleep completes a
//! few tens of microseconds after its deadline (see `Backoff` for how late registrations
//! that stop after a busy phase can leave one), and never before it: the thread asks the
//! kernel for 1 µs of timer slack instead of the default 50 µs, and the rest is the time the
//! runtime takes to poll the woken task.
//!
//! Concurrency contract:
//! - A [`Sleep`] is an ordinary `Send` future; it works on any executor, on any number of
//!   threads, and is not affected by tokio's paused test clock.
//! - Registering a sleep costs one heap push under a short lock. The timer thread is only
//!   notified when it sleeps past the new deadline (or with nothing to wait for); while it is
//!   awake, or already due to wake earlier, registration makes no system call.
//! - A registration also completes up to [`FIRE_ON_REGISTER`] sleeps whose deadline has already
//!   passed, waking their tasks from the registering thread. A thread that sleeps often (a
//!   pipeline starting an operation every few microseconds) thus delivers the expirations it
//!   passes by itself, instead of each waiting for the timer thread to be scheduled; the
//!   thread remains the backstop that delivers every expiration nobody else did. Either way a
//!   sleep completes only once `Instant::now()` has reached its deadline.
//! - Tasks are woken outside the lock (by the timer thread and by registrations), so
//!   registration never waits for a burst of expirations to be delivered.
//! - A deadline already reached completes on the first poll without touching the thread
//!   (for [`sleep`], reached by the time `sleep` was called; see there).
//! - Dropping a [`Sleep`] early is fine: its waker is released at once, and its heap entry
//!   expires into nothing at its deadline.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::thread;
use std::time::{Duration, Instant};

use futures::task::AtomicWaker;
use parking_lot::{Condvar, Mutex, MutexGuard};

/// A future that completes at (shortly after, never before) its deadline.
///
/// Made by [`sleep`] or [`sleep_until`].
pub struct Sleep {
    deadline: Instant,
    /// The clock reading [`sleep`] took, used by the first poll instead of reading the clock
    /// again (see [`sleep`]); `None` from [`sleep_until`] and after the first poll.
    started: Option<Instant>,
    /// Set on the first poll that had to wait; shared with the timer thread's heap entry.
    shared: Option<Arc<Shared>>,
}

/// Completes after `duration` (measured from this call, not from the first poll).
///
/// The first poll does not read the clock again: it takes the reading of this call as "now"
/// (one clock read per sleep instead of two; a latency-emulating stage makes one sleep per
/// operation). That reading is never ahead of the time, so the sleep still never completes
/// early; a sleep first polled only after its deadline is registered instead of completing
/// on that poll, and is completed by the next registration or by the timer thread.
///
/// # Panics
/// If the timer thread cannot be started (the process is out of threads), on first use.
pub fn sleep(duration: Duration) -> Sleep {
    let now = Instant::now();
    Sleep {
        deadline: now
            .checked_add(duration)
            .unwrap_or(now + Duration::from_secs(1 << 32)),
        started: Some(now),
        shared: None,
    }
}

/// Completes at `deadline`. A deadline in the past completes on the first poll.
///
/// # Panics
/// If the timer thread cannot be started (the process is out of threads), on first use.
pub fn sleep_until(deadline: Instant) -> Sleep {
    Sleep {
        deadline,
        started: None,
        shared: None,
    }
}

impl Sleep {
    /// The instant this sleep completes at.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Whether the deadline has been reached.
    pub fn is_elapsed(&self) -> bool {
        match &self.shared {
            Some(s) if s.fired.load(AtomicOrdering::Acquire) => true,
            _ => Instant::now() >= self.deadline,
        }
    }
}

impl Future for Sleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        match &this.shared {
            None => {
                let now = this.started.take().unwrap_or_else(Instant::now);
                if now >= this.deadline {
                    return Poll::Ready(());
                }
                let shared = Arc::new(Shared {
                    fired: AtomicBool::new(false),
                    waker: AtomicWaker::new(),
                });
                shared.waker.register(cx.waker());
                timer().register(this.deadline, shared.clone(), now);
                this.shared = Some(shared);
                Poll::Pending
            }
            Some(shared) => {
                if shared.fired.load(AtomicOrdering::Acquire) {
                    return Poll::Ready(());
                }
                // `register` keeps the stored waker when it would wake the same task. The
                // timer sets `fired` before it takes the waker: checked again after the
                // registration, a waker stored here is either taken by it or not needed.
                shared.waker.register(cx.waker());
                if shared.fired.load(AtomicOrdering::Acquire) {
                    return Poll::Ready(());
                }
                Poll::Pending
            }
        }
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        // Release the task's waker now rather than at the deadline (it may be far away).
        // Once fired, whoever fired it has taken the waker already: no lock needed.
        if let Some(shared) = &self.shared {
            if !shared.fired.load(AtomicOrdering::Acquire) {
                drop(shared.waker.take());
            }
        }
    }
}

impl fmt::Debug for Sleep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sleep")
            .field("deadline", &self.deadline)
            .field("registered", &self.shared.is_some())
            .field("elapsed", &self.is_elapsed())
            .finish()
    }
}

/// State shared by a [`Sleep`] and its heap entry.
///
/// No lock: `fired` is set before the waker is taken, and a poll checks it again after it
/// registers its waker, so a wake-up is never lost.
struct Shared {
    fired: AtomicBool,
    waker: AtomicWaker,
}

impl Shared {
    fn fire(&self) {
        self.fired.store(true, AtomicOrdering::Release);
        self.waker.wake();
    }
}

/// A heap entry, ordered so that `BinaryHeap` (a max-heap) yields the earliest deadline.
struct Entry {
    deadline: Instant,
    shared: Arc<Shared>,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        self.deadline == other.deadline
    }
}

impl Eq for Entry {}

impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Entry {
    fn cmp(&self, other: &Self) -> Ordering {
        other.deadline.cmp(&self.deadline)
    }
}

/// Most sleeps already due that one registration completes (a bound on the work, and on the
/// stack space, that a registration takes on for others).
pub const FIRE_ON_REGISTER: usize = 8;

/// The first step of the timer thread's grace (see [`Backoff`]).
const GRACE_STEP: Duration = Duration::from_micros(5);

/// Longest the timer thread waits past the earliest deadline (its grace; see [`Backoff`]).
/// While a busy thread delivers expirations as it registers sleeps, the timer thread thus
/// wakes about once per `GRACE_MAX` instead of once per deadline: each wake-up of a thread on
/// an idle virtual CPU costs tens of microseconds of the host's time (`farmap bench push
/// --mirror-delay 20us`, whose mirror's emulated latency keeps a sleep registered all the
/// time, woke this thread every 40 µs when that was the most: 2000-2500 wake-ups and 45-52 ms
/// of CPU per GiB pushed, against about 300 wake-ups now).
const GRACE_MAX: Duration = Duration::from_micros(1000);

/// How late registrations may deliver sleeps for the timer thread to keep backing off (see
/// [`Backoff`]). Registrations every few microseconds deliver each sleep within that time of
/// its deadline; sparser ones deliver later, and the thread then comes back closer to the
/// deadlines itself.
const ON_TIME: Duration = Duration::from_micros(40);

/// The timer thread's grace: how long past the earliest deadline it waits, on the bet that
/// registrations deliver that sleep (and the others due) before it wakes.
///
/// After each wait that timed out, for the deadline it had waited for:
/// - still there: nobody else delivers, so the grace is zero (on time again) and the run of
///   deliveries by registrations is over;
/// - delivered by registrations, every sleep they delivered meanwhile at most [`ON_TIME`]
///   late: the grace doubles (from [`GRACE_STEP`]);
/// - delivered, but some later than that: it halves (down to [`GRACE_STEP`]).
///
/// It never exceeds a quarter of the time registrations have been delivering for the thread
/// (nor [`GRACE_MAX`]). That bounds what a stop costs: when registrations stop right after
/// delivering every earlier sleep, the next sleeps are late by the grace, once. A short
/// burst (a reply through an emulated link) thus leaves its sleeps at most a few tens of
/// microseconds late, as before the grace could grow past 40 µs; a long busy phase (a push
/// of a whole region through a slow mirror) at most a millisecond, at its end. A thread
/// with nothing left to wait for starts again from zero.
#[derive(Debug, Default)]
struct Backoff {
    grace: Duration,
    /// When registrations started delivering for the thread (the grace left zero).
    delivering_since: Option<Instant>,
}

impl Backoff {
    /// Updates the grace after a wait for a deadline that timed out at `now`; `delivered`:
    /// registrations delivered that sleep, `late`: the latest they delivered any sleep.
    fn update(&mut self, now: Instant, delivered: bool, late: Duration) {
        if !delivered {
            *self = Self::default();
            return;
        }
        let since = *self.delivering_since.get_or_insert(now);
        let cap = (now.saturating_duration_since(since) / 4).clamp(GRACE_STEP, GRACE_MAX);
        self.grace = if late <= ON_TIME {
            self.grace * 2
        } else {
            self.grace / 2
        }
        .clamp(GRACE_STEP, cap);
    }
}

/// The process-wide timer: the heap and the condition variable its thread waits on.
struct Timer {
    state: Mutex<TimerState>,
    cond: Condvar,
}

/// What the timer's lock guards.
struct TimerState {
    heap: BinaryHeap<Entry>,
    /// What the timer thread does: a registration notifies it only when it would otherwise
    /// sleep past the new deadline.
    thread: ThreadState,
    /// The latest that a registration delivered a sleep past its deadline since the timer
    /// thread last looked.
    delivered_late: Duration,
}

#[derive(Clone, Copy)]
enum ThreadState {
    /// Running: it looks at the heap again before it next waits.
    Awake,
    /// Waiting for the earliest deadline, this one (plus its grace), or a notification.
    Until(Instant),
    /// Waiting for a notification only (the heap was empty).
    Idle,
}

fn timer() -> &'static Timer {
    static TIMER: OnceLock<&'static Timer> = OnceLock::new();
    TIMER.get_or_init(|| {
        // Leaked on purpose: the timer lives as long as the process, like its thread.
        let timer: &'static Timer = Box::leak(Box::new(Timer {
            state: Mutex::new(TimerState {
                heap: BinaryHeap::with_capacity(1024),
                thread: ThreadState::Awake,
                delivered_late: Duration::ZERO,
            }),
            cond: Condvar::new(),
        }));
        thread::Builder::new()
            .name("farmap-timer".into())
            .spawn(move || {
                reduce_timer_slack();
                timer.run()
            })
            .expect("the farmap timer thread could not be started");
        timer
    })
}

/// Asks the kernel to wake this thread within 1 µs of its timeouts instead of the default 50 µs
/// slack. Best effort: without `/proc` the default slack stays (still far finer than 1 ms).
fn reduce_timer_slack() {
    // `/proc/thread-self` links to `<pid>/task/<tid>`; `/proc/<tid>/timerslack_ns` is this
    // thread's slack, which a thread may set for itself without privileges.
    let Ok(link) = std::fs::read_link("/proc/thread-self") else {
        return;
    };
    if let Some(tid) = link.file_name().and_then(|t| t.to_str()) {
        let _ = std::fs::write(format!("/proc/{tid}/timerslack_ns"), "1000");
    }
}

impl Timer {
    /// Adds `shared`'s deadline to the heap, and completes the sleeps due at `now` (a clock
    /// reading taken before this call, so never ahead of the time; at most
    /// [`FIRE_ON_REGISTER`] of them) on the way.
    fn register(&self, deadline: Instant, shared: Arc<Shared>, now: Instant) {
        let mut due: [Option<Arc<Shared>>; FIRE_ON_REGISTER] = Default::default();
        let mut st = self.state.lock();
        for slot in &mut due {
            match st.heap.peek() {
                Some(top) if top.deadline <= now => {
                    let late = now - top.deadline;
                    st.delivered_late = st.delivered_late.max(late);
                    *slot = st.heap.pop().map(|entry| entry.shared);
                }
                _ => break,
            }
        }
        st.heap.push(Entry { deadline, shared });
        let notify = match st.thread {
            ThreadState::Awake => false,
            // The thread delivers everything due by `earliest` when it wakes (at most its
            // grace later); only a new earliest deadline needs it sooner.
            ThreadState::Until(earliest) => deadline < earliest,
            ThreadState::Idle => true,
        };
        if notify {
            // Marked awake so that the registrations until it runs do not notify it again.
            st.thread = ThreadState::Awake;
        }
        drop(st);
        if notify {
            self.cond.notify_one();
        }
        for shared in due.iter().flatten() {
            shared.fire();
        }
    }

    fn run(&self) {
        let mut due: Vec<Arc<Shared>> = Vec::with_capacity(256);
        // How long after the earliest deadline the thread wakes (see `GRACE_MAX`).
        let mut backoff = Backoff::default();
        // The earliest deadline when the last wait timed out.
        let mut waited_for: Option<Instant> = None;
        let mut st = self.state.lock();
        loop {
            st.thread = ThreadState::Awake;
            let now = Instant::now();
            if let Some(earliest) = waited_for.take() {
                let delivered = st.heap.peek().is_none_or(|top| top.deadline > earliest);
                backoff.update(now, delivered, st.delivered_late);
            }
            st.delivered_late = Duration::ZERO;
            while st.heap.peek().is_some_and(|top| top.deadline <= now) {
                if let Some(entry) = st.heap.pop() {
                    due.push(entry.shared);
                }
            }
            if !due.is_empty() {
                MutexGuard::unlocked(&mut st, || {
                    for shared in due.drain(..) {
                        shared.fire();
                    }
                });
                continue;
            }
            match st.heap.peek().map(|top| top.deadline) {
                Some(earliest) => {
                    st.thread = ThreadState::Until(earliest);
                    if self
                        .cond
                        .wait_until(&mut st, earliest + backoff.grace)
                        .timed_out()
                    {
                        waited_for = Some(earliest);
                    }
                }
                None => {
                    // Nothing left to deliver: whoever was delivering has stopped, and the
                    // next sleep, maybe a lone one, must not wait for a grace earned before.
                    backoff = Backoff::default();
                    st.thread = ThreadState::Idle;
                    self.cond.wait(&mut st);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::task::{Wake, Waker};

    struct CountingWaker(AtomicUsize);

    impl Wake for CountingWaker {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, AtomicOrdering::SeqCst);
        }
    }

    fn counting_waker() -> (Arc<CountingWaker>, Waker) {
        let c = Arc::new(CountingWaker(AtomicUsize::new(0)));
        (c.clone(), Waker::from(c))
    }

    #[test]
    fn the_grace_grows_only_while_registrations_deliver_on_time() {
        let us = Duration::from_micros;
        let start = Instant::now();
        let mut b = Backoff::default();
        // Registrations deliver on time, one wake-up every 100 µs: the grace doubles, but
        // stays within a quarter of the time they have been delivering.
        let mut steps = Vec::new();
        for i in 0..5u32 {
            b.update(start + us(100) * i, true, us(3));
            steps.push(b.grace);
        }
        assert_eq!(steps, [us(5), us(10), us(20), us(40), us(80)]);
        for i in 5..200u32 {
            b.update(start + us(100) * i, true, us(3));
            assert!(b.grace <= us(100) * i / 4, "grace {:?} at {i}", b.grace);
        }
        assert_eq!(b.grace, GRACE_MAX, "after 20 ms of on-time deliveries");
        // Late deliveries bring it closer again, halving, never below the first step.
        let later = start + Duration::from_millis(30);
        b.update(later, true, ON_TIME + us(1));
        assert_eq!(b.grace, GRACE_MAX / 2);
        for _ in 0..20 {
            b.update(later, true, us(500));
        }
        assert_eq!(b.grace, GRACE_STEP);
        // A sleep nobody delivered: on time again at once, and a new run starts afresh.
        b.update(later, false, Duration::ZERO);
        assert_eq!(b.grace, Duration::ZERO);
        b.update(later + us(10), true, us(1));
        b.update(later + us(20), true, us(1));
        assert_eq!(
            b.grace, GRACE_STEP,
            "a run 10 µs long allows no more than the first step"
        );
    }

    #[test]
    fn past_and_zero_deadlines_are_ready_at_once() {
        let (count, waker) = counting_waker();
        let mut cx = Context::from_waker(&waker);
        let mut s = sleep(Duration::ZERO);
        assert!(Pin::new(&mut s).poll(&mut cx).is_ready());
        let mut s = sleep_until(Instant::now() - Duration::from_millis(5));
        assert!(Pin::new(&mut s).poll(&mut cx).is_ready());
        assert!(s.shared.is_none(), "no registration for a past deadline");
        assert_eq!(count.0.load(AtomicOrdering::SeqCst), 0);
    }

    #[test]
    fn a_repoll_with_a_new_waker_is_the_one_woken() {
        let (first, w1) = counting_waker();
        let (second, w2) = counting_waker();
        let mut s = sleep(Duration::from_millis(5));
        assert!(Pin::new(&mut s)
            .poll(&mut Context::from_waker(&w1))
            .is_pending());
        assert!(Pin::new(&mut s)
            .poll(&mut Context::from_waker(&w2))
            .is_pending());
        let start = Instant::now();
        while second.0.load(AtomicOrdering::SeqCst) == 0 {
            assert!(start.elapsed() < Duration::from_secs(5), "never woken");
            thread::sleep(Duration::from_micros(200));
        }
        assert_eq!(first.0.load(AtomicOrdering::SeqCst), 0, "stale waker woken");
        assert!(Instant::now() >= s.deadline());
        assert!(Pin::new(&mut s)
            .poll(&mut Context::from_waker(&w2))
            .is_ready());
    }

    #[test]
    fn dropped_sleeps_fire_into_nothing() {
        let (count, waker) = counting_waker();
        for _ in 0..100 {
            let mut s = sleep(Duration::from_millis(1));
            assert!(Pin::new(&mut s)
                .poll(&mut Context::from_waker(&waker))
                .is_pending());
        }
        // A later sleep still works after the dropped ones expire.
        thread::sleep(Duration::from_millis(3));
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        rt.block_on(sleep(Duration::from_millis(1)));
        assert_eq!(count.0.load(AtomicOrdering::SeqCst), 0);
    }

    #[test]
    fn a_sleep_first_polled_after_its_deadline_completes_and_not_early() {
        // `sleep` lends its clock reading to the first poll; polled late, the sleep is due
        // although that reading says otherwise: it must still complete, soon, exactly once.
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        for _ in 0..20 {
            let s = sleep(Duration::from_micros(200));
            let deadline = s.deadline();
            thread::sleep(Duration::from_millis(1));
            // Never woken would hang here (the test harness's timeout catches it).
            rt.block_on(s);
            assert!(Instant::now() >= deadline);
        }
        // Polled before its deadline, a `sleep` still waits for it.
        let s = sleep(Duration::from_millis(2));
        let deadline = s.deadline();
        rt.block_on(s);
        assert!(Instant::now() >= deadline, "a sleep ended early");
    }

    /// Records when it was woken, and how often.
    struct StampWaker(Mutex<Vec<Instant>>);

    impl Wake for StampWaker {
        fn wake(self: Arc<Self>) {
            self.0.lock().push(Instant::now());
        }
    }

    #[test]
    fn every_sleep_is_woken_once_and_not_before_its_deadline() {
        // Deadlines 0-40 µs apart, registered back to back from this thread: many are due
        // while later ones register, so both the registrations and the timer thread deliver
        // them. Whoever does, each task is woken exactly once, at or after its deadline.
        let mut sleeps = Vec::new();
        let start = Instant::now();
        for i in 0..2000u32 {
            let stamps = Arc::new(StampWaker(Mutex::new(Vec::new())));
            let waker = Waker::from(stamps.clone());
            let mut s = sleep(Duration::from_micros(u64::from(i % 41)));
            if Pin::new(&mut s)
                .poll(&mut Context::from_waker(&waker))
                .is_pending()
            {
                sleeps.push((s, stamps));
            }
        }
        for (s, stamps) in &sleeps {
            while stamps.0.lock().is_empty() {
                assert!(start.elapsed() < Duration::from_secs(10), "never woken");
                thread::yield_now();
            }
            let woken = stamps.0.lock()[0];
            assert!(woken >= s.deadline(), "woken before its deadline");
        }
        // Late duplicate deliveries would show up after a moment.
        thread::sleep(Duration::from_millis(2));
        for (_, stamps) in &sleeps {
            assert_eq!(stamps.0.lock().len(), 1, "woken more than once");
        }
    }

    /// Held by the tests that measure time, so that they do not load the machine for each other.
    static TIMING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_sleeps_never_end_early() {
        // Only "never early" is asserted: lateness is measured by `farmap bench timer`.
        let _timing = TIMING.lock().await;
        let d = Duration::from_millis(2);
        let handles: Vec<_> = (0..100u32)
            .map(|t| {
                tokio::spawn(async move {
                    sleep(d * t / 100).await;
                    let mut late = Duration::ZERO;
                    for _ in 0..20 {
                        let start = Instant::now();
                        sleep(d).await;
                        let took = start.elapsed();
                        assert!(took >= d, "a sleep of {d:?} ended early, after {took:?}");
                        late += took - d;
                    }
                    late
                })
            })
            .collect();
        let mut late = Duration::ZERO;
        for h in handles {
            late += h.await.expect("sleeping task");
        }
        eprintln!("2000 sleeps of {d:?}: mean lateness {:?}", late / 2000);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hundred_thousand_sleeps_all_complete_and_none_early() {
        // 2000 tasks × 50 sleeps of 1 ms: every one completes, none before its deadline. The
        // rate the timer sustains is measured by `farmap bench timer`.
        let _timing = TIMING.lock().await;
        let start = Instant::now();
        let handles: Vec<_> = (0..2000)
            .map(|_| {
                tokio::spawn(async {
                    let mut done = 0u32;
                    for _ in 0..50 {
                        let s = sleep(Duration::from_millis(1));
                        let deadline = s.deadline();
                        s.await;
                        assert!(Instant::now() >= deadline, "a sleep ended early");
                        done += 1;
                    }
                    done
                })
            })
            .collect();
        let mut done = 0;
        for h in handles {
            done += h.await.expect("sleeping task");
        }
        assert_eq!(done, 100_000);
        eprintln!(
            "100000 sleeps of 1 ms from 2000 tasks took {:?}",
            start.elapsed()
        );
    }
}
