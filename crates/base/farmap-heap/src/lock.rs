//! [`RawLock`]: a three-state futex mutex (unlocked, locked, locked with sleepers).
//!
//! Sleeping and waking go through the [`Backing`], so this crate makes no system call of its
//! own: a malloc replacement passes raw `futex` calls, tests pass `libc::syscall`, and the
//! default [`Backing::wait`] spins. The lock is not reentrant, records no owner and never
//! allocates; unlocking a lock this thread does not hold breaks mutual exclusion, so every
//! unlock here is paired with a lock in the same function (or through [`Guard`]), except
//! `Heap::unlock_all`, whose contract says so.

use core::sync::atomic::{AtomicU32, Ordering};

use crate::backing::Backing;

const UNLOCKED: u32 = 0;
const LOCKED: u32 = 1;
const CONTENDED: u32 = 2;
/// Tries before sleeping: hold times are short (no page fault happens under a heap lock).
const SPINS: u32 = 100;

pub(crate) struct RawLock {
    state: AtomicU32,
}

impl RawLock {
    pub(crate) const fn new() -> Self {
        Self {
            state: AtomicU32::new(UNLOCKED),
        }
    }

    pub(crate) fn try_lock(&self) -> bool {
        self.state
            .compare_exchange(UNLOCKED, LOCKED, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    pub(crate) fn lock<B: Backing>(&self, backing: &B) {
        if !self.try_lock() {
            self.lock_contended(backing);
        }
    }

    #[cold]
    fn lock_contended<B: Backing>(&self, backing: &B) {
        for _ in 0..SPINS {
            if self.state.load(Ordering::Relaxed) == UNLOCKED && self.try_lock() {
                return;
            }
            core::hint::spin_loop();
        }
        // Whoever takes the lock from here on marks it contended, so its unlock wakes a sleeper.
        while self.state.swap(CONTENDED, Ordering::Acquire) != UNLOCKED {
            backing.wait(&self.state, CONTENDED);
        }
    }

    /// Releases the lock, which the caller holds.
    pub(crate) fn unlock<B: Backing>(&self, backing: &B) {
        if self.state.swap(UNLOCKED, Ordering::Release) == CONTENDED {
            backing.wake_one(&self.state);
        }
    }

    pub(crate) fn guard<'a, B: Backing>(&'a self, backing: &'a B) -> Guard<'a, B> {
        self.lock(backing);
        Guard {
            lock: self,
            backing,
        }
    }

    pub(crate) fn try_guard<'a, B: Backing>(&'a self, backing: &'a B) -> Option<Guard<'a, B>> {
        // Not `then_some`: a guard made for a lock not taken would unlock it when dropped.
        if self.try_lock() {
            Some(Guard {
                lock: self,
                backing,
            })
        } else {
            None
        }
    }
}

/// Holds a [`RawLock`] until dropped.
pub(crate) struct Guard<'a, B: Backing> {
    lock: &'a RawLock,
    backing: &'a B,
}

impl<B: Backing> Drop for Guard<'_, B> {
    fn drop(&mut self) {
        self.lock.unlock(self.backing);
    }
}
