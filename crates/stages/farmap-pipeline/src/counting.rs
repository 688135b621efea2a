//! [`Counting`]: per-operation statistics (like nbdkit's stats filter).

use std::ops::Sub;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use farmap_core::{
    BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, Geometry, Store, StoreResult,
};

/// A snapshot of a [`Counting`] stage's counters.
///
/// Subtracting two snapshots gives the activity between them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Counts {
    /// `read` calls that finished (successfully or not).
    pub reads: u64,
    /// `write` calls that finished.
    pub writes: u64,
    /// `flush` calls that finished.
    pub flushes: u64,
    /// `trim` calls that finished (one per call, whatever the number of chunks).
    pub trims: u64,
    /// `status` calls that finished.
    pub statuses: u64,
    /// Bytes returned by successful reads.
    pub bytes_read: u64,
    /// Bytes accepted by successful writes.
    pub bytes_written: u64,
    /// Calls of any kind that failed.
    pub errors: u64,
}

impl Counts {
    /// All operations counted, of every kind.
    pub fn ops(&self) -> u64 {
        self.reads + self.writes + self.flushes + self.trims + self.statuses
    }
}

impl Sub for Counts {
    type Output = Counts;

    /// The activity between an earlier snapshot `rhs` and this one (saturating at zero, so a
    /// [`Counting::reset`] in between gives zeros rather than an overflow).
    fn sub(self, rhs: Counts) -> Counts {
        Counts {
            reads: self.reads.saturating_sub(rhs.reads),
            writes: self.writes.saturating_sub(rhs.writes),
            flushes: self.flushes.saturating_sub(rhs.flushes),
            trims: self.trims.saturating_sub(rhs.trims),
            statuses: self.statuses.saturating_sub(rhs.statuses),
            bytes_read: self.bytes_read.saturating_sub(rhs.bytes_read),
            bytes_written: self.bytes_written.saturating_sub(rhs.bytes_written),
            errors: self.errors.saturating_sub(rhs.errors),
        }
    }
}

#[derive(Debug, Default)]
struct Counters {
    reads: AtomicU64,
    writes: AtomicU64,
    flushes: AtomicU64,
    trims: AtomicU64,
    statuses: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    errors: AtomicU64,
}

/// Counts the operations that pass through it, and their bytes.
///
/// Concurrency contract:
/// - Every operation is forwarded to the inner store unchanged, at once, with no lock.
/// - An operation is counted when it finishes (an operation whose future is dropped before it
///   finishes is not counted); counters are relaxed atomics.
/// - [`counts`](Counting::counts) and [`reset`](Counting::reset) read or swap each counter
///   atomically, but not all of them at one instant: under concurrent traffic a snapshot may
///   show an operation in `reads` and not yet in `bytes_read`.
#[derive(Debug)]
pub struct Counting<S> {
    inner: S,
    c: Counters,
}

impl<S: Store> Counting<S> {
    /// Wraps `inner`, with every counter at zero.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            c: Counters::default(),
        }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// The counters now.
    pub fn counts(&self) -> Counts {
        self.snapshot(|a| a.load(Ordering::Relaxed))
    }

    /// Sets every counter to zero and returns what they held (no increment is lost between
    /// the two).
    pub fn reset(&self) -> Counts {
        self.snapshot(|a| a.swap(0, Ordering::Relaxed))
    }

    /// Every counter, each read with `read`.
    fn snapshot(&self, read: impl Fn(&AtomicU64) -> u64) -> Counts {
        let c = &self.c;
        Counts {
            reads: read(&c.reads),
            writes: read(&c.writes),
            flushes: read(&c.flushes),
            trims: read(&c.trims),
            statuses: read(&c.statuses),
            bytes_read: read(&c.bytes_read),
            bytes_written: read(&c.bytes_written),
            errors: read(&c.errors),
        }
    }

    fn finished<T>(&self, op: &AtomicU64, result: &StoreResult<T>) {
        op.fetch_add(1, Ordering::Relaxed);
        if result.is_err() {
            self.c.errors.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl<S: Store> Store for Counting<S> {
    fn geometry(&self) -> Geometry {
        self.inner.geometry()
    }

    fn caps(&self) -> Caps {
        self.inner.caps()
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            let r = self.inner.read(idx).await;
            if let Ok(data) = &r {
                self.c
                    .bytes_read
                    .fetch_add(data.len() as u64, Ordering::Relaxed);
            }
            self.finished(&self.c.reads, &r);
            r
        })
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            let len = data.len() as u64;
            let r = self.inner.write(idx, data).await;
            if r.is_ok() {
                self.c.bytes_written.fetch_add(len, Ordering::Relaxed);
            }
            self.finished(&self.c.writes, &r);
            r
        })
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            let r = self.inner.flush().await;
            self.finished(&self.c.flushes, &r);
            r
        })
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            let r = self.inner.trim(range).await;
            self.finished(&self.c.trims, &r);
            r
        })
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        Box::pin(async move {
            let r = self.inner.status(idx).await;
            self.finished(&self.c.statuses, &r);
            r
        })
    }
}
