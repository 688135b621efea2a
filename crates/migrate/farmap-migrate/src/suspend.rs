//! How a seeder stops the application's writers: the [`Suspend`] hook, an in-process
//! [`WriterGate`] (the Slope-style handshake: writers hold a pass while they write, the
//! seeder waits for the passes in use and lets no new one out), and [`ProcessSuspend`]
//! (SIGSTOP/SIGCONT of another process).

use std::time::Duration;

use bytes::Bytes;
use parking_lot::{Condvar, Mutex};

/// Why the application could not be suspended (it runs on).
#[derive(Debug, thiserror::Error)]
pub enum SuspendError {
    /// Not a process id.
    #[error("{pid} is not a process id")]
    NotAPid {
        /// The number given.
        pid: u32,
    },
    /// Signalling the process failed.
    #[error("signalling process {pid} failed")]
    Signal {
        /// The process.
        pid: u32,
        /// Why.
        #[source]
        source: rustix::io::Errno,
    },
    /// Its state could not be read.
    #[error("reading the state of process {pid} failed")]
    State {
        /// The process.
        pid: u32,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// It did not stop in time.
    #[error("process {pid} did not stop within {waited:?}")]
    DidNotStop {
        /// The process.
        pid: u32,
        /// How long it was given.
        waited: Duration,
    },
    /// The application's own hook failed.
    #[error("the application could not be suspended")]
    App(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// Stops and restarts the application that writes a region.
pub trait Suspend: Send + Sync + std::fmt::Debug {
    /// Called once before the migration starts towards its suspension (an instant
    /// migration's last pushes and draft; a pre-copy's or post-copy's suspension): the
    /// application readies what its suspension needs (a hypervisor, the destination's
    /// process), so that the window between the draft and the stop stays short. The
    /// application runs on; an error abandons the migration. Blocks.
    fn prepare(&self) -> Result<(), SuspendError> {
        Ok(())
    }
    /// Stops every writer; returns once none can write any more, with the application's
    /// state to hand over (opaque bytes, may be empty).
    fn suspend(&self) -> Result<Bytes, SuspendError>;
    /// Lets the writers run again (only ever called before the hand-over).
    fn resume(&self);
    /// Ownership has moved: the writers must never write this region again.
    fn retire(&self);
}

#[derive(Debug, Default)]
struct GateState {
    writers: u32,
    closed: bool,
    retired: bool,
}

/// An in-process writer gate. Writers call [`try_enter`](Self::try_enter) (or
/// [`enter`](Self::enter)) around each write; the seeder's [`suspend`](Suspend::suspend)
/// closes the gate and waits until no pass is out. The state handed over comes from the
/// `state` callback, called while the gate is closed.
pub struct WriterGate {
    state: Mutex<GateState>,
    changed: Condvar,
    snapshot: Box<dyn Fn() -> Bytes + Send + Sync>,
}

impl std::fmt::Debug for WriterGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriterGate")
            .field("state", &*self.state.lock())
            .finish()
    }
}

/// A writer's pass through a [`WriterGate`]; the write is over when it drops.
#[derive(Debug)]
pub struct Pass<'a> {
    gate: &'a WriterGate,
}

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        let mut s = self.gate.state.lock();
        s.writers -= 1;
        if s.writers == 0 {
            self.gate.changed.notify_all();
        }
    }
}

/// Why a writer may not write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Closed {
    /// Suspended for now: try again later.
    Suspended,
    /// Ownership moved: stop writing this region for good.
    Retired,
}

impl WriterGate {
    /// An open gate whose hand-over state is `snapshot()`.
    pub fn new(snapshot: impl Fn() -> Bytes + Send + Sync + 'static) -> Self {
        Self {
            state: Mutex::new(GateState::default()),
            changed: Condvar::new(),
            snapshot: Box::new(snapshot),
        }
    }

    /// A pass if the gate is open (Slope's `try_finish_write` is the pass's drop).
    pub fn try_enter(&self) -> Result<Pass<'_>, Closed> {
        let mut s = self.state.lock();
        if s.retired {
            return Err(Closed::Retired);
        }
        if s.closed {
            return Err(Closed::Suspended);
        }
        s.writers += 1;
        Ok(Pass { gate: self })
    }

    /// A pass, waiting while the gate is suspended (at most `patience` at a time);
    /// `Err(Retired)` once ownership moved.
    pub fn enter(&self, patience: Duration) -> Result<Pass<'_>, Closed> {
        let mut s = self.state.lock();
        loop {
            if s.retired {
                return Err(Closed::Retired);
            }
            if !s.closed {
                s.writers += 1;
                return Ok(Pass { gate: self });
            }
            if self.changed.wait_for(&mut s, patience).timed_out() {
                return Err(Closed::Suspended);
            }
        }
    }
}

impl Suspend for WriterGate {
    fn suspend(&self) -> Result<Bytes, SuspendError> {
        let mut s = self.state.lock();
        s.closed = true;
        while s.writers > 0 {
            self.changed.wait(&mut s);
        }
        drop(s);
        Ok((self.snapshot)())
    }

    fn resume(&self) {
        self.state.lock().closed = false;
        self.changed.notify_all();
    }

    fn retire(&self) {
        self.state.lock().retired = true;
        self.changed.notify_all();
    }
}

/// Suspends another process with SIGSTOP and resumes it with SIGCONT. After the hand-over it
/// stays stopped (ownership moved; whoever runs it decides what to do with it).
#[derive(Debug, Clone, Copy)]
pub struct ProcessSuspend {
    /// The process.
    pub pid: u32,
}

impl ProcessSuspend {
    fn signal(&self, sig: rustix::process::Signal) -> Result<(), SuspendError> {
        let pid = i32::try_from(self.pid)
            .ok()
            .and_then(rustix::process::Pid::from_raw)
            .ok_or(SuspendError::NotAPid { pid: self.pid })?;
        rustix::process::kill_process(pid, sig).map_err(|source| SuspendError::Signal {
            pid: self.pid,
            source,
        })
    }
}

impl Suspend for ProcessSuspend {
    fn suspend(&self) -> Result<Bytes, SuspendError> {
        self.signal(rustix::process::Signal::STOP)?;
        // Wait until the kernel reports it stopped (state T in /proc/PID/stat).
        for _ in 0..1000 {
            let stat =
                std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).map_err(|source| {
                    SuspendError::State {
                        pid: self.pid,
                        source,
                    }
                })?;
            let state = stat
                .rsplit_once(')')
                .and_then(|(_, r)| r.trim_start().chars().next());
            if matches!(state, Some('T') | Some('t')) {
                return Ok(Bytes::new());
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        Err(SuspendError::DidNotStop {
            pid: self.pid,
            waited: Duration::from_micros(100) * 1000,
        })
    }

    fn resume(&self) {
        let _ = self.signal(rustix::process::Signal::CONT);
    }

    fn retire(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn the_gate_waits_for_writers_and_keeps_them_out() {
        let gate = Arc::new(WriterGate::new(|| Bytes::from_static(b"s")));
        let pass = gate.try_enter().unwrap();
        let g2 = gate.clone();
        let t = std::thread::spawn(move || g2.suspend().unwrap());
        std::thread::sleep(Duration::from_millis(20));
        assert!(!t.is_finished(), "suspend waits for the pass");
        drop(pass);
        assert_eq!(&t.join().unwrap()[..], b"s");
        assert_eq!(gate.try_enter().unwrap_err(), Closed::Suspended);
        gate.resume();
        drop(gate.try_enter().unwrap());
        gate.retire();
        assert_eq!(
            gate.enter(Duration::from_millis(1)).unwrap_err(),
            Closed::Retired
        );
    }

    #[test]
    fn a_child_process_stops_and_continues() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let s = ProcessSuspend { pid: child.id() };
        s.suspend().unwrap();
        s.resume();
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
