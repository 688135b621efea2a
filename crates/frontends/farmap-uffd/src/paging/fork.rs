//! The fork fence: while a program forks, where each chunk's content is must hold still, so
//! that the child's copy of the heap can be made whole from it (`foreign/fork.rs`).
//!
//! A [`ForkFence`] holds the reclaim lock (no reclaim pass runs: nothing is staged, written
//! back or dropped; a fault at the limit goes over it, by `min_free` and then more, waiting
//! 2 ms at a time) and stops direct deactivations; it is taken once no deactivation moves
//! pages. Its [`ForkSnapshot`] then says, for each chunk, where its content is: mapped in
//! the region (a child has it, copy-on-write), in its staging slot, in the store, or
//! nowhere (zeros). Under the fence those places keep their content: slots are neither
//! dropped nor reused (a staged chunk copied back leaves its slot stale, and stale slots
//! are dropped by reclaim only), and the store is written only by write-backs, which
//! reclaim makes. Fetches, zero fills and copies back go on: they read those places and
//! change only the region.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::state::{ForkSnapshot, Source, St};
use super::{ForkFence, Pager};

impl Pager {
    /// Whether a fork fence holds (deactivations do nothing meanwhile).
    pub(super) fn paused(&self) -> bool {
        self.paused.load(Ordering::SeqCst)
    }

    /// The fork fence (the one that holds now, or a new one: waits for the reclaim pass that
    /// runs, and for deactivations moving pages) and where each chunk's content is under it.
    /// Blocks: not for a thread of the runtime.
    pub(crate) fn fork_fence(self: &Arc<Self>) -> (Arc<ForkFence>, ForkSnapshot) {
        let fence = {
            let mut held = self.fence.lock();
            match held.upgrade() {
                Some(f) => f,
                None => {
                    let guard = self.reclaim_lock.clone().blocking_lock_owned();
                    self.paused.store(true, Ordering::SeqCst);
                    let f = Arc::new(ForkFence {
                        pager: self.clone(),
                        _reclaim: guard,
                    });
                    *held = Arc::downgrade(&f);
                    f
                }
            }
        };
        loop {
            let st = self.state.lock();
            // A deactivation checks the pause under the state lock before it marks chunks
            // moving; the last one's chunks are recorded (staged or active) a moment after
            // its moves end.
            if self.moving.load(Ordering::SeqCst) == 0 && !st.chunk.contains(&St::Moving) {
                let sources = st
                    .chunk
                    .iter()
                    .map(|s| match *s {
                        St::Remote | St::Fetching { zero: false, .. } => Source::Store,
                        St::Staged | St::Unstaging { .. } => Source::Slot,
                        St::Zero | St::Fetching { zero: true, .. } | St::Active | St::Moving => {
                            Source::Region
                        }
                    })
                    .collect();
                return (fence, ForkSnapshot { sources });
            }
            drop(st);
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    /// Makes the region's pages the program's own again after a fork shared them with the
    /// child (`UFFDIO_MOVE` refuses a shared page, `EBUSY`, until the program writes it, and
    /// reclaim could not move them): the program's reaper writes nothing to each page
    /// present, the shared zero page left out. Under the fork fence only: a page discarded
    /// meanwhile faults in the reaper, and that fault needs no reaper then (no move runs).
    /// The bytes asked for, or why not.
    pub(crate) fn unshare_present(&self) -> std::io::Result<u64> {
        /// Most bytes one request touches (the reaper answers each within its deadline).
        const PIECE: usize = 64 << 20;
        debug_assert!(self.paused(), "under the fork fence");
        let base = self.region.base();
        let mut pieces = Vec::new();
        let mut scratch = Vec::new();
        self.pagemap
            .data_in_memory(base, base + self.region.len(), &mut scratch, |run| {
                let mut at = run.start - base;
                let end = run.end - base;
                while at < end {
                    let len = (end - at).min(PIECE);
                    pieces.push((at, len));
                    at += len;
                }
            })?;
        let asked = pieces.iter().map(|&(_, len)| len as u64).sum();
        let Some(errnos) = self.moves.touch_many(&self.region, &pieces) else {
            return Ok(0);
        };
        match errnos.into_iter().find(|&e| e != 0) {
            None => Ok(asked),
            Some(e) => Err(std::io::Error::from_raw_os_error(e)),
        }
    }

    /// Reads chunks `first..` out of their staging slots into `dst` (whole chunks); false if
    /// the read failed (the program is gone).
    pub(crate) fn read_slots(&self, first: u64, dst: &mut [u8]) -> bool {
        let (off, _) = self.chunk_span(first);
        self.staging_map.read(off, dst)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::super::state::{Source, St};
    use super::super::testing::{pager, Fixture, CHUNKS, PAGE};
    use crate::options::{Prefetch, RemoveMeans};

    /// Under a fence nothing is deactivated and no reclaim pass runs; the snapshot says where
    /// each chunk's content is; a second fence is the same fence; a chunk being moved holds
    /// the fence back until it is recorded.
    #[test]
    fn a_fork_fence_stops_what_moves_data_and_says_where_it_is() {
        let test = "paging::fork::a_fork_fence_stops_what_moves_data_and_says_where_it_is";
        let Some(Fixture {
            pager,
            region: _region,
            staging: _staging,
        }) = pager(test, RemoveMeans::Refetch, Prefetch::Off)
        else {
            return;
        };
        let pager = Arc::new(pager);
        {
            let mut st = pager.state.lock();
            st.chunk[0] = St::Moving;
            st.chunk[3] = St::Zero;
        }
        let taker = {
            let pager = pager.clone();
            std::thread::spawn(move || pager.fork_fence())
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!taker.is_finished(), "a chunk is still moving");
        assert!(pager.paused(), "paused while it waits");
        {
            let mut st = pager.state.lock();
            st.chunk[0] = St::Active;
            st.referenced[0] = false;
            st.active.push_back(0);
            st.resident += 1;
        }
        let (fence, snapshot) = taker.join().unwrap();
        assert_eq!(
            snapshot.sources,
            [Source::Region, Source::Slot, Source::Store, Source::Region]
        );
        assert_eq!(
            snapshot.elsewhere().collect::<Vec<_>>(),
            [(1, Source::Slot), (2, Source::Store)]
        );
        assert!(pager.reclaiming(), "the fence holds the reclaim lock");
        assert_eq!(pager.deactivate(CHUNKS), 0, "nothing moves under a fence");
        assert_eq!(pager.state.lock().chunk[0], St::Active);
        let (again, _) = pager.fork_fence();
        assert!(Arc::ptr_eq(&fence, &again), "one fence at a time");
        let mut slot = vec![0u8; PAGE];
        assert!(pager.read_slots(1, &mut slot));
        assert!(slot.iter().all(|&b| b == 0xab));
        drop((fence, again));
        assert!(!pager.paused());
        assert!(!pager.reclaiming());
    }
}
