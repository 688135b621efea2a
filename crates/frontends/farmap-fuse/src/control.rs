//! [`MountControl`]: what a live migration needs from the file system — the pages written
//! since the last look, and a gate in front of reads and writes.
//!
//! # Concurrency
//! - A write request marks its pages dirty *after* the store has taken it (a concurrent
//!   [`take_dirty`](MountControl::take_dirty) either sees the mark and the data, or leaves
//!   the mark for the next take).
//! - Every write holds a pass (a read guard) while it runs; [`hold_writes`] closes the gate
//!   and then waits until no pass is out, so when it returns no write can reach the store
//!   until the gate opens again.
//! - Requests that find the gate closed wait (asynchronously, on the mount's runtime; the
//!   session thread never waits) until it opens, or fail once the mount is retired: reads
//!   with `EIO`, writes with `EROFS`.
//!
//! [`hold_writes`]: MountControl::hold_writes

use std::ops::Range;

use farmap_core::{ChunkIdx, ChunkRange};
use farmap_pipeline::DirtySet;
use fuser::Errno;
use tokio::sync::{watch, RwLock, RwLockReadGuard};

/// Who may use the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Everyone.
    Open,
    /// Nobody yet: requests wait (a migration's destination before its hand-over).
    Held,
    /// Reads go on; writes wait (a migration's source while it is suspended).
    WritesHeld,
    /// Nobody, for good: the file moved elsewhere (reads `EIO`, writes `EROFS`).
    Retired,
}

/// The migration controls of one mount (see the module notes).
pub struct MountControl {
    dirty: DirtySet,
    page: u64,
    size: u64,
    access: watch::Sender<Access>,
    writes: RwLock<()>,
    /// Drops the kernel's cached pages of the file (set by the mount).
    invalidate: parking_lot::Mutex<Option<Box<dyn Fn() + Send + Sync>>>,
}

impl std::fmt::Debug for MountControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MountControl")
            .field("access", &self.access())
            .field("page", &self.page)
            .finish()
    }
}

/// A write's pass: the gate cannot close while it is held.
pub(crate) type WritePass<'a> = RwLockReadGuard<'a, ()>;

impl MountControl {
    /// Controls of a file of `size` bytes, tracked in pages of `page` bytes.
    pub fn new(size: u64, page: u64, access: Access) -> Self {
        let page = page.max(1);
        Self {
            dirty: DirtySet::new(size.div_ceil(page)),
            page,
            size,
            access: watch::Sender::new(access),
            writes: RwLock::new(()),
            invalidate: parking_lot::Mutex::new(None),
        }
    }

    /// The tracking unit, in bytes.
    pub fn page_size(&self) -> u64 {
        self.page
    }

    /// Who may use the file now.
    pub fn access(&self) -> Access {
        *self.access.borrow()
    }

    /// Marks the pages under `offset..offset + len` written.
    pub(crate) fn mark(&self, offset: u64, len: u64) {
        let end = offset.saturating_add(len).min(self.size);
        if offset >= end {
            return;
        }
        self.dirty.mark_range(ChunkRange {
            start: ChunkIdx(offset / self.page),
            end: ChunkIdx(end.div_ceil(self.page)),
        });
    }

    /// The pages written since the last call, as ascending disjoint runs of page indices.
    pub fn take_dirty(&self) -> Vec<Range<u64>> {
        let mut runs: Vec<Range<u64>> = Vec::new();
        for ChunkIdx(p) in self.dirty.take() {
            match runs.last_mut() {
                Some(r) if r.end == p => r.end = p + 1,
                _ => runs.push(p..p + 1),
            }
        }
        runs
    }

    /// Waits until reads are allowed; `EIO` once retired.
    pub(crate) async fn readable(&self) -> Result<(), Errno> {
        let mut rx = self.access.subscribe();
        let state = rx.wait_for(|a| *a != Access::Held).await.map(|a| *a);
        match state {
            Ok(Access::Retired) | Err(_) => Err(Errno::EIO),
            Ok(_) => Ok(()),
        }
    }

    /// A pass for one write, waiting while the gate is closed; `EROFS` once retired.
    pub(crate) async fn writable(&self) -> Result<WritePass<'_>, Errno> {
        let mut rx = self.access.subscribe();
        loop {
            let state = rx
                .wait_for(|a| matches!(a, Access::Open | Access::Retired))
                .await
                .map(|a| *a);
            if !matches!(state, Ok(Access::Open)) {
                return Err(Errno::EROFS);
            }
            let pass = self.writes.read().await;
            // The gate may have closed while this waited for the pass.
            if self.access() == Access::Open {
                return Ok(pass);
            }
            drop(pass);
        }
    }

    /// Closes the gate to writes and waits until the writes in progress have reached the
    /// store. Blocks: call it from a thread that serves no request (never the mount's
    /// runtime).
    pub fn hold_writes(&self) {
        self.access.send_modify(|a| {
            if *a != Access::Retired {
                *a = Access::WritesHeld;
            }
        });
        drop(self.writes.blocking_write());
    }

    /// Opens the gate (unless retired).
    pub fn open(&self) {
        self.access.send_modify(|a| {
            if *a != Access::Retired {
                *a = Access::Open;
            }
        });
    }

    /// Refuses every request from now on: the file lives elsewhere.
    pub fn retire(&self) {
        self.access.send_replace(Access::Retired);
    }

    pub(crate) fn set_invalidate(&self, f: Box<dyn Fn() + Send + Sync>) {
        *self.invalidate.lock() = Some(f);
    }

    /// Drops the kernel's cached pages of the file (after [`retire`](Self::retire): later
    /// reads reach the server and fail, instead of seeing the page cache). Blocks while the
    /// kernel writes back dirty pages (which a retired mount refuses): call it from a thread
    /// that serves no request.
    pub fn invalidate_cache(&self) {
        if let Some(f) = self.invalidate.lock().as_ref() {
            f();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn marks_become_runs_once() {
        let c = MountControl::new(10 * 4096 + 100, 4096, Access::Open);
        c.mark(0, 1);
        c.mark(4096, 4097);
        c.mark(9 * 4096, 1 << 20);
        c.mark(1 << 40, 5);
        assert_eq!(c.take_dirty(), vec![0..3, 9..11]);
        assert!(c.take_dirty().is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hold_waits_for_writes_and_retire_refuses() {
        let c = Arc::new(MountControl::new(4096, 4096, Access::Open));
        let pass = c.writable().await.unwrap();
        let c2 = c.clone();
        let holder = tokio::task::spawn_blocking(move || c2.hold_writes());
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(
            !holder.is_finished(),
            "hold_writes waits for the write in progress"
        );
        drop(pass);
        holder.await.unwrap();
        assert_eq!(c.access(), Access::WritesHeld);
        c.readable().await.unwrap();
        let c3 = c.clone();
        let waiting = tokio::spawn(async move { c3.writable().await.map(drop) });
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(!waiting.is_finished(), "a write waits while held");
        c.retire();
        assert_eq!(waiting.await.unwrap(), Err(Errno::EROFS));
        assert_eq!(c.readable().await, Err(Errno::EIO));
        c.open();
        assert_eq!(c.access(), Access::Retired, "retirement is for good");
    }
}
