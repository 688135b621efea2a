//! [`Gated`]: holds all I/O while closed (migration finalize: quiesce, hand over, resume).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use farmap_core::{
    BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, Geometry, Store, StoreResult,
};
use parking_lot::Mutex;
use tokio::sync::{OwnedRwLockWriteGuard, RwLock};

/// Whether a [`Gated`] stage lets operations through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GateState {
    /// Operations pass.
    Open,
    /// Operations wait until the gate opens.
    Closed,
}

/// Lets operations through while open; holds them, not failing them, while closed.
///
/// Concurrency contract:
/// - Every data operation (`read`, `write`, `flush`, `trim`, `status`) holds a shared guard for
///   its whole duration; operations never wait for each other.
/// - [`close`](Gated::close) returns once every operation in flight has finished; operations
///   that arrive from the moment `close` is called wait (the lock is write-preferring), until
///   [`open`](Gated::open).
/// - `close` and `open` are idempotent; concurrent `close` calls all return once the gate is
///   closed. An `open` that overlaps a pending `close` wins: that `close` still waits for the
///   operations in flight, then leaves the gate open.
/// - `geometry` and `caps` are never held.
/// - Dropping a pending `close` future gives up closing; the gate stays open.
#[derive(Debug)]
pub struct Gated<S> {
    inner: S,
    gate: Arc<RwLock<()>>,
    /// The write guard while closed.
    held: Mutex<Option<OwnedRwLockWriteGuard<()>>>,
    /// Serializes `close` calls, so that a second one waits for the first instead of for the
    /// write guard the first keeps.
    closing: tokio::sync::Mutex<()>,
    /// Incremented by every `open`, so that a pending `close` can tell it was overtaken.
    opens: AtomicU64,
}

impl<S: Store> Gated<S> {
    /// Wraps `inner`, starting open or closed.
    pub fn new(inner: S, state: GateState) -> Self {
        let gate = Arc::new(RwLock::new(()));
        let held = match state {
            GateState::Open => None,
            GateState::Closed => Some(gate.clone().try_write_owned().expect("a new lock is free")),
        };
        Self {
            inner,
            gate,
            held: Mutex::new(held),
            closing: tokio::sync::Mutex::new(()),
            opens: AtomicU64::new(0),
        }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Closes the gate: returns once every operation in flight has finished. Operations that
    /// arrive from now on wait until [`open`](Gated::open).
    pub async fn close(&self) {
        let _closing = self.closing.lock().await;
        if self.held.lock().is_some() {
            return;
        }
        let opens = self.opens.load(Ordering::SeqCst);
        let guard = self.gate.clone().write_owned().await;
        let mut held = self.held.lock();
        if self.opens.load(Ordering::SeqCst) == opens {
            *held = Some(guard);
        }
        // Otherwise an `open` came while waiting: the guard is dropped here and the gate
        // stays open.
    }

    /// Opens the gate, releasing every operation that waits.
    pub fn open(&self) {
        let guard = {
            let mut held = self.held.lock();
            self.opens.fetch_add(1, Ordering::SeqCst);
            held.take()
        };
        drop(guard);
    }

    /// Whether the gate is open (a `close` still waiting for operations in flight counts as
    /// open).
    pub fn is_open(&self) -> bool {
        self.held.lock().is_none()
    }

    /// The gate's state, as [`is_open`](Gated::is_open) tells it.
    pub fn state(&self) -> GateState {
        if self.is_open() {
            GateState::Open
        } else {
            GateState::Closed
        }
    }
}

impl<S: Store> Store for Gated<S> {
    fn geometry(&self) -> Geometry {
        self.inner.geometry()
    }

    fn caps(&self) -> Caps {
        self.inner.caps()
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            let _pass = self.gate.read().await;
            self.inner.read(idx).await
        })
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            let _pass = self.gate.read().await;
            self.inner.write(idx, data).await
        })
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            let _pass = self.gate.read().await;
            self.inner.flush().await
        })
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            let _pass = self.gate.read().await;
            self.inner.trim(range).await
        })
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        Box::pin(async move {
            let _pass = self.gate.read().await;
            self.inner.status(idx).await
        })
    }
}
