//! The pager's state lock ([`SleepLock`]), fair to the fault path.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// The pager's state lock: a futex lock that puts a contended waiter to sleep after a short
/// spin, and wakes it when the holder unlocks.
///
/// Not `parking_lot::Mutex`: its waiters call `sched_yield` several times before they sleep,
/// and the lock is held across system calls (moves, scans), so its holder is sometimes
/// preempted while it holds it, often by the fault reader of its own CPU. That reader then
/// yields to the holder, which, under EEVDF, runs on for the rest of its time slice (the
/// reader, runnable, is not woken by the unlock): measured with `perf sched timehist`, a
/// fault waited 606 µs this way while the other CPU was idle.
///
/// The lock is not fair by itself: a thread that unlocks and locks again at once (a
/// write-back reading chunk after chunk) keeps a woken waiter out, which wakes, finds the
/// lock taken and sleeps again, for as long as the loop runs (measured: 850 µs, 50 such
/// wake-ups). So the background work takes it with [`lock_yielding`](Self::lock_yielding),
/// whose unlock waits (at most [`HANDOFF_MAX`]) until a fault that was waiting has had it.
pub(super) struct SleepLock<T> {
    inner: std::sync::Mutex<T>,
    /// Fault-path threads in [`lock`](Self::lock) that found the lock taken and have not
    /// got it yet.
    waiting: AtomicU32,
    /// Bumped by each of those when it gets the lock.
    handed: AtomicU32,
}

/// Longest a background unlock waits for a waiting fault to take the lock.
const HANDOFF_MAX: Duration = Duration::from_micros(100);

impl<T> SleepLock<T> {
    pub(super) fn new(value: T) -> Self {
        Self {
            inner: std::sync::Mutex::new(value),
            waiting: AtomicU32::new(0),
            handed: AtomicU32::new(0),
        }
    }

    /// Locks, sleeping while another thread holds the lock; for the fault path (a background
    /// holder lets it in when it unlocks). A panic while the lock was held (a bug) leaves the
    /// state as the panicking thread left it, as `parking_lot`'s lock did: the lock is not
    /// poisoned for the region's other threads.
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, T> {
        if let Some(g) = self.try_lock() {
            return g;
        }
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let g = self.lock_inner();
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        self.handed.fetch_add(1, Ordering::SeqCst);
        g
    }

    /// Locks for background work (reclaim, write-back): see [`Yielding`].
    pub(super) fn lock_yielding(&self) -> Yielding<'_, T> {
        Yielding {
            guard: Some(self.lock_inner()),
            lock: self,
        }
    }

    fn lock_inner(&self) -> std::sync::MutexGuard<'_, T> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Locks if nobody holds the lock (async-signal-safe: one atomic compare-exchange).
    pub(super) fn try_lock(&self) -> Option<std::sync::MutexGuard<'_, T>> {
        match self.inner.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }
}

/// A background hold of a [`SleepLock`]: when it ends and a fault waits for the lock, the
/// unlocking thread yields until that fault has taken it (at most [`HANDOFF_MAX`]) instead of
/// taking it again first.
pub(super) struct Yielding<'a, T> {
    guard: Option<std::sync::MutexGuard<'a, T>>,
    lock: &'a SleepLock<T>,
}

impl<T> std::ops::Deref for Yielding<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.guard.as_deref().expect("held until dropped")
    }
}

impl<T> std::ops::DerefMut for Yielding<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.guard.as_deref_mut().expect("held until dropped")
    }
}

impl<T> Drop for Yielding<'_, T> {
    fn drop(&mut self) {
        let handed = self.lock.handed.load(Ordering::SeqCst);
        let waiting = self.lock.waiting.load(Ordering::SeqCst) > 0;
        drop(self.guard.take());
        if !waiting {
            return;
        }
        let start = std::time::Instant::now();
        while self.lock.handed.load(Ordering::SeqCst) == handed && start.elapsed() < HANDOFF_MAX {
            // The waiter may be on this CPU: give it the CPU.
            std::thread::yield_now();
        }
    }
}
