//! [`Gate`]: the passes that readers and writers of one object hold, and the closing that
//! an object migration does in two stages (writes first, reads once the destination has
//! installed the object). Process-local, never in the object's memory: a counter there
//! would dirty a page on every read.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const COUNT_BITS: u32 = 20;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;
const WRITER: u64 = 1;
const READER: u64 = 1 << COUNT_BITS;
/// Writes are refused (a migration is handing the object over).
pub const WRITES_CLOSED: u64 = 1 << 40;
/// Reads are refused (the object's reads moved to its destination).
pub const READS_CLOSED: u64 = 1 << 41;
/// The object is gone from this process for good.
pub const RETIRED: u64 = 1 << 42;

/// Reader and writer passes of one object, with the flags that refuse new ones. A pass is
/// one atomic add and a check of the flags it returned; a refused pass takes itself back.
#[derive(Debug, Default)]
pub struct Gate {
    word: AtomicU64,
}

/// A pass was refused: the gate is closed for its kind (the flags say why).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Closed(pub u64);

impl Gate {
    /// An open gate with no pass out.
    pub const fn new() -> Gate {
        Gate {
            word: AtomicU64::new(0),
        }
    }

    fn pass(&self, unit: u64, refused_by: u64) -> Result<(), Closed> {
        let before = self.word.fetch_add(unit, Ordering::AcqRel);
        if before & refused_by != 0 {
            self.word.fetch_sub(unit, Ordering::AcqRel);
            return Err(Closed(before & !(COUNT_MASK | COUNT_MASK << COUNT_BITS)));
        }
        Ok(())
    }

    /// A writer's pass (refused once writes are closed); give it back with
    /// [`end_write`](Self::end_write).
    pub fn begin_write(&self) -> Result<(), Closed> {
        self.pass(WRITER, WRITES_CLOSED | RETIRED)
    }

    /// Gives a writer's pass back.
    pub fn end_write(&self) {
        self.word.fetch_sub(WRITER, Ordering::AcqRel);
    }

    /// A reader's pass (refused once reads are closed).
    pub fn begin_read(&self) -> Result<(), Closed> {
        self.pass(READER, READS_CLOSED | RETIRED)
    }

    /// Gives a reader's pass back.
    pub fn end_read(&self) {
        self.word.fetch_sub(READER, Ordering::AcqRel);
    }

    /// Writers holding a pass now.
    pub fn writers(&self) -> u64 {
        self.word.load(Ordering::Acquire) & COUNT_MASK
    }

    /// Readers holding a pass now.
    pub fn readers(&self) -> u64 {
        self.word.load(Ordering::Acquire) >> COUNT_BITS & COUNT_MASK
    }

    /// The flags set now.
    pub fn flags(&self) -> u64 {
        self.word.load(Ordering::Acquire) & (WRITES_CLOSED | READS_CLOSED | RETIRED)
    }

    /// Sets `flags` (new passes of their kinds are refused from now on).
    pub fn close(&self, flags: u64) {
        self.word.fetch_or(flags, Ordering::AcqRel);
    }

    /// Clears `flags`.
    pub fn reopen(&self, flags: u64) {
        self.word.fetch_and(!flags, Ordering::AcqRel);
    }

    /// Closes writes and waits up to `patience` for the writers out to give their passes
    /// back; true once none is out (writes stay closed), false after `patience` (and writes
    /// are open again: the caller tries later, nobody is blocked for long).
    pub fn close_writes_and_drain(&self, patience: Duration) -> bool {
        self.close(WRITES_CLOSED);
        if self.drain(patience, Self::writers) {
            return true;
        }
        self.reopen(WRITES_CLOSED);
        false
    }

    /// Waits up to `patience` until `count` reads 0.
    pub fn drain(&self, patience: Duration, count: impl Fn(&Gate) -> u64) -> bool {
        let deadline = Instant::now() + patience;
        let mut spins = 0u32;
        while count(self) != 0 {
            if Instant::now() >= deadline {
                return false;
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    #[test]
    fn closed_kinds_refuse_and_the_others_pass() {
        let g = Gate::new();
        g.begin_write().unwrap();
        g.begin_read().unwrap();
        assert_eq!((g.writers(), g.readers()), (1, 1));
        assert!(
            !g.close_writes_and_drain(Duration::from_millis(5)),
            "a writer is out"
        );
        assert_eq!(g.flags(), 0, "reopened after the patience ran out");
        g.end_write();
        assert!(g.close_writes_and_drain(Duration::from_millis(5)));
        assert_eq!(g.begin_write(), Err(Closed(WRITES_CLOSED)));
        g.begin_read().unwrap();
        g.close(READS_CLOSED);
        assert!(g.begin_read().is_err());
        g.end_read();
        g.end_read();
        assert!(g.drain(Duration::ZERO, Gate::readers));
        assert_eq!((g.writers(), g.readers()), (0, 0));
    }

    /// Writers hammer the gate while it is closed and drained again and again: once a
    /// drain says no writer is out, none is inside until the gate reopens.
    #[test]
    fn no_writer_slips_past_a_drained_gate() {
        let g = Arc::new(Gate::new());
        let inside = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let writers: Vec<_> = (0..3)
            .map(|_| {
                let (g, inside, stop) = (g.clone(), inside.clone(), stop.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        if g.begin_write().is_ok() {
                            inside.fetch_add(1, Ordering::SeqCst);
                            std::hint::spin_loop();
                            inside.fetch_sub(1, Ordering::SeqCst);
                            g.end_write();
                        }
                    }
                })
            })
            .collect();
        for _ in 0..2000 {
            if g.close_writes_and_drain(Duration::from_millis(100)) {
                for _ in 0..50 {
                    assert_eq!(inside.load(Ordering::SeqCst), 0);
                }
                g.reopen(WRITES_CLOSED);
            }
        }
        stop.store(true, Ordering::Relaxed);
        for w in writers {
            w.join().unwrap();
        }
    }
}
