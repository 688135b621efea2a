//! Scheduling policy of a thread (`sched_setscheduler`), for work that should give way to the
//! application: a migration's pull runs at `SCHED_IDLE` or `SCHED_BATCH` so that the
//! application's threads, at `SCHED_OTHER`, are scheduled first on a busy machine.

use std::io;

/// A thread's scheduling class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadPolicy {
    /// `SCHED_OTHER` (the default, time-shared by nice value).
    Other,
    /// `SCHED_BATCH`: like `SCHED_OTHER`, but never preempts on wake-up.
    Batch,
    /// `SCHED_IDLE`: runs only when nothing else wants the CPU (below nice 19).
    Idle,
}

/// Sets the scheduling policy of thread `tid` (0: the calling thread). Leaving `SCHED_IDLE`
/// may need `CAP_SYS_NICE` (or an `RLIMIT_NICE` that allows it).
pub fn set_thread_policy(tid: i32, policy: ThreadPolicy) -> io::Result<()> {
    let p = match policy {
        ThreadPolicy::Other => libc::SCHED_OTHER,
        ThreadPolicy::Batch => libc::SCHED_BATCH,
        ThreadPolicy::Idle => libc::SCHED_IDLE,
    };
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler reads `param` (a valid, initialized struct that outlives the
    // call) and touches no memory of ours; a bad tid is an error return, not UB.
    let r = unsafe { libc::sched_setscheduler(tid, p, &param) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_can_go_idle_and_batch() {
        std::thread::spawn(|| {
            set_thread_policy(0, ThreadPolicy::Idle).unwrap();
            // SAFETY: sched_getscheduler takes a pid and touches no memory.
            assert_eq!(unsafe { libc::sched_getscheduler(0) }, libc::SCHED_IDLE);
            set_thread_policy(0, ThreadPolicy::Batch).unwrap();
            // SAFETY: as above.
            assert_eq!(unsafe { libc::sched_getscheduler(0) }, libc::SCHED_BATCH);
            assert!(set_thread_policy(-5, ThreadPolicy::Batch).is_err());
        })
        .join()
        .unwrap();
    }
}
