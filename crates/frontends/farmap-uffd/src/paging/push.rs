//! Where a push reads a chunk: the pager's side of [`PushReads`], which keeps pushes off
//! region pages that can be missing (see the module documentation).

use std::sync::{Arc, Weak};

use farmap_core::ChunkIdx;

use super::state::St;
use super::Pager;
use crate::memory::{PushRead, PushReads};
use crate::stats::Counters;

impl Pager {
    /// Decides, under the state lock, where a push reads chunk `idx` (`buf` is as long as
    /// the chunk). The rule that keeps pushes from deadlocking with faults: a push never
    /// touches a page of the region that can be missing. A fault on a missing page may have
    /// to wait for room, room for a reclaim, and a reclaim for a write-back, which
    /// waits for this very push.
    /// - staged: copied out of its staging slot now (its pages cannot move while the lock
    ///   is held; a partly staged chunk has the rest of its pages moved into the slot
    ///   first);
    /// - active: pinned (not deactivated until [`unpin`](Self::unpin)), to be read out of
    ///   the region, where all its pages are;
    /// - being fetched, or copied back out of its slot: wait until it is active (a fetch or
    ///   a copy never waits for a push);
    /// - remote: every staged copy is written back before it is dropped, so the store holds
    ///   the newest content (and the region none of its pages).
    fn read_for_push(&self, idx: ChunkIdx, buf: &mut [u8]) -> PushRead {
        let i = idx.0 as usize;
        let mut st = self.state.lock_yielding();
        self.tr(idx.0, || format!("push read {:?}", st.chunk.get(i)));
        match st.chunk.get(i) {
            Some(St::Active) => {
                st.pins[i] += 1;
                PushRead::Pinned
            }
            Some(St::Staged) => {
                let (off, len) = self.chunk_span(idx.0);
                // Staged whole: nothing to finish, nothing missing (see `whole_slot`).
                if st.whole_slot[i] {
                    return if self.staging_map.read(off, &mut buf[..len]) {
                        PushRead::Copied
                    } else {
                        PushRead::NotLocal
                    };
                }
                if self
                    .move_present(&self.region, &self.staging, off, len)
                    .is_err()
                {
                    Counters::add(&self.counters.partial_moves, 1);
                    return PushRead::Busy;
                }
                let base = self.staging.base() + off;
                // Reading a hole of the staging area would fault, and nobody serves staging
                // faults: every page must be there (a staged chunk's pages are in its slot or
                // in the region, and those were just moved).
                if !self
                    .pagemap
                    .all_in_memory(base, base + len)
                    .unwrap_or(false)
                {
                    // Chunks of one page whose removed pages read as zeros: its page was
                    // zapped while it was active (a discard overtook its zero fill), so
                    // its content is zeros (waiting would wait for its next fault).
                    if self.zeroes_removed() {
                        buf[..len].fill(0);
                        return PushRead::Zero;
                    }
                    return PushRead::Busy;
                }
                if self.staging_map.read(off, &mut buf[..len]) {
                    PushRead::Copied
                } else {
                    PushRead::NotLocal
                }
            }
            // Being fetched: its pages may be installed already, and written (the install
            // wakes the faulting thread before the fetch is recorded). A fetch never waits
            // for a push: wait for it.
            Some(St::Fetching { .. }) => PushRead::Busy,
            // Being staged: its pages are moving; read it from its slot once it is staged.
            Some(St::Moving) => PushRead::Busy,
            // Being copied back out of its slot, where its newest content is (not in the
            // store: reading the store now would lose the staged writes): read the region
            // once it is active.
            Some(St::Unstaging { .. }) => PushRead::Busy,
            Some(St::Zero) => PushRead::Zero,
            _ => {
                Counters::add(&self.counters.pushes_from_store, 1);
                PushRead::NotLocal
            }
        }
    }

    /// Ends a push's read of an active chunk (see [`read_for_push`](Self::read_for_push)).
    fn unpin(&self, idx: ChunkIdx) {
        let mut st = self.state.lock_yielding();
        if let Some(p) = st.pins.get_mut(idx.0 as usize) {
            *p = p.saturating_sub(1);
        }
    }

    /// The store behind the region (for pushes of chunks that are not local).
    fn remote_store(&self) -> Option<Arc<dyn farmap_core::Store>> {
        let cache = self.cache.get().and_then(Weak::upgrade)?;
        Some(cache.remote().clone())
    }
}

impl PushReads for Pager {
    fn read_for_push(&self, idx: ChunkIdx, buf: &mut [u8]) -> PushRead {
        Pager::read_for_push(self, idx, buf)
    }

    fn unpin(&self, idx: ChunkIdx) {
        Pager::unpin(self, idx)
    }

    fn remote_store(&self) -> Option<Arc<dyn farmap_core::Store>> {
        Pager::remote_store(self)
    }

    fn trace_install(&self, idx: ChunkIdx, copied_pages: usize, present_pages: usize) {
        Pager::trace_install(self, idx, copied_pages, present_pages)
    }

    fn gates_installs(&self) -> bool {
        self.zeroes_removed()
    }

    fn install_refused(&self, idx: ChunkIdx) -> bool {
        Pager::install_refused(self, idx)
    }
}
