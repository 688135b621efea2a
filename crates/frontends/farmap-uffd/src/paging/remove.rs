//! Remove events that mean zeros ([`RemoveMeans::Zero`]): the chunks they cover become zero,
//! and copies into the region pass a gate that keeps removed content from coming back (see
//! the module documentation, *Removed pages read as zeros*).

use farmap_core::ChunkIdx;

use super::state::{St, State};
use super::{Admit, Pager};
use crate::options::RemoveMeans;

impl Pager {
    /// Whether removed chunks read as zeros (else they are fetched again).
    pub(crate) fn zeroes_removed(&self) -> bool {
        self.remove == RemoveMeans::Zero
    }

    /// A remove event of `start..end` (addresses): with [`RemoveMeans::Zero`], every chunk
    /// it covers becomes zero and is marked dirty (its next push writes zeros); one with an
    /// operation in flight gets its removed bit, and the operation ends in the zero state.
    /// Called by the reader under the events' order, held exclusively since it read the
    /// event, before the event generation moves on. Nothing with [`RemoveMeans::Refetch`].
    pub(crate) fn removed(&self, start: usize, end: usize) {
        if !self.zeroes_removed() {
            return;
        }
        let (base, len) = (self.region.base(), self.region.len());
        let off = |a: usize| a.clamp(base, base + len) - base;
        let chunk = self.geometry.chunk_size() as usize;
        let (first, last) = (off(start).div_ceil(chunk) as u64, (off(end) / chunk) as u64);
        let mut st = self.state.lock();
        let before = st.resident;
        for i in first..last {
            self.remove_chunk(&mut st, i);
        }
        let freed = st.resident < before;
        drop(st);
        if freed {
            self.changed.notify_waiters();
        }
    }

    /// [`removed`](Self::removed) for chunk `i`. Every chunk of the range gets its bit: the
    /// remover zaps the range only after this, and a zero fill that lands before the zap
    /// is lost (prefetch leaves such a chunk alone; a fault fills it once its page is
    /// missing). An active chunk's page stays mapped until the zap (a fault that finds it
    /// present just wakes). A staged chunk's slot goes stale (dropped without a write-back).
    fn remove_chunk(&self, st: &mut State, i: u64) {
        let iu = i as usize;
        let was = st.chunk[iu];
        self.tr(i, || format!("removed ({was:?})"));
        st.set_removed(i, true);
        match was {
            St::Zero => return,
            St::Remote => st.chunk[iu] = St::Zero,
            St::Active => {
                st.chunk[iu] = St::Zero;
                st.prefetched[iu] = false;
                st.resident -= 1;
            }
            St::Staged => {
                st.chunk[iu] = St::Zero;
                st.n_staged -= 1;
                st.stale.push_back(i);
            }
            St::Fetching { .. } | St::Unstaging { .. } | St::Moving => {}
        }
        if let Some(mark) = self.mark.get() {
            mark(ChunkIdx(i));
        }
    }

    /// Ends an operation on chunk `i` that a remove event overtook (its bit is set): the
    /// chunk is zero (pages it installed before the event was read are zapped by the
    /// remover), its slot stale if `slot` (the slot holds pages), `units` of the limit
    /// freed. The bit stays: old pages may be mapped until the zap. Threads that faulted
    /// after the zap were told the operation would wake them: they are woken, fault again
    /// and find the chunk zero.
    pub(super) fn end_removed(&self, st: &mut State, i: u64, slot: bool, units: u64) {
        let iu = i as usize;
        self.tr(i, || format!("{:?} overtaken by a remove", st.chunk[iu]));
        st.chunk[iu] = St::Zero;
        st.prefetched[iu] = false;
        if slot {
            st.slot_busy[iu] = true;
            st.stale.push_back(i);
        }
        st.resident -= units;
        let (off, len) = self.chunk_span(i);
        let _ = self.region.wake(off, len);
    }

    /// The gate of copies into the region (with [`RemoveMeans::Zero`]): whether chunk `idx`
    /// was removed, so that nothing may be installed into it. The caller holds the events'
    /// order shared across this call and its copy, so that no remove event is handled in
    /// between.
    pub(crate) fn install_refused(&self, idx: ChunkIdx) -> bool {
        self.state.lock().is_removed(idx.0)
    }

    /// A fault at `page` on zero chunk `i`, removed: its old page may still be mapped until
    /// the remover zaps it, and then the fault was raised before (an access racing the
    /// discard, which may see the old content): wake it ([`Admit::Done`]). Otherwise the zap
    /// is done or nothing was there: the bit is cleared, and the fault goes on (`None`).
    pub(super) fn fault_on_removed(&self, st: &mut State, i: u64, page: usize) -> Option<Admit> {
        if !st.is_removed(i) {
            return None;
        }
        if self.page_present(page) {
            let _ = self.region.wake(page, self.region.page_size());
            return Some(Admit::Done);
        }
        st.set_removed(i, false);
        None
    }

    /// Whether the region's page at `page` (offset) is mapped.
    pub(super) fn page_present(&self, page: usize) -> bool {
        let addr = self.region.base() + page;
        self.pagemap
            .all_in_memory(addr, addr + self.region.page_size())
            .unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use farmap_core::ChunkIdx;

    use super::super::state::{Moved, St};
    use super::super::testing::{pager, push_read, Fixture, CHUNKS, PAGE};
    use super::super::Admit;
    use crate::memory::{Landed, PushRead};
    use crate::options::{Prefetch, RemoveMeans};

    fn zeroing(test: &str) -> Option<Fixture> {
        pager(test, RemoveMeans::Zero, Prefetch::Off)
    }

    /// Removes every chunk of the fixture's region.
    fn remove_all(f: &Fixture) {
        let base = f.region.addr();
        f.pager.removed(base, base + CHUNKS as usize * PAGE);
    }

    #[test]
    fn a_remove_makes_every_chunk_zero_and_what_is_in_flight_ends_zero() {
        let test =
            "paging::remove::a_remove_makes_every_chunk_zero_and_what_is_in_flight_ends_zero";
        let Some(f) = zeroing(test) else {
            return;
        };
        let pager = &f.pager;
        {
            let mut st = pager.state.lock();
            st.chunk[0] = St::Active;
            st.active.push_back(0);
            st.chunk[2] = St::Fetching {
                new: true,
                zero: false,
            };
            st.resident = 3;
        }
        remove_all(&f);
        {
            let st = pager.state.lock();
            assert_eq!(st.chunk, [St::Zero, St::Zero, st.chunk[2], St::Zero]);
            assert!(matches!(st.chunk[2], St::Fetching { .. }));
            assert!((0..CHUNKS).all(|i| st.is_removed(i)));
            assert_eq!(st.stale, [1], "the staged chunk's slot is stale");
            assert_eq!(
                (st.resident, st.n_staged),
                (2, 0),
                "the active chunk's unit freed"
            );
        }
        // The gate: nothing goes into a removed chunk (zero fills included); its fetch ends
        // zero.
        assert!(pager.install_refused(ChunkIdx(2)));
        assert_eq!(pager.fill_zero(ChunkIdx(2)), Ok(Landed::Removed));
        pager.fetched(ChunkIdx(2), true);
        let st = pager.state.lock();
        assert_eq!((st.chunk[2], st.resident), (St::Zero, 1));
        assert!(st.is_removed(2), "the zap may still be pending");
        drop(st);
        for i in 0..CHUNKS {
            assert_eq!(push_read(pager, i), PushRead::Zero, "chunk {i}");
        }
    }

    #[test]
    fn a_fault_on_a_removed_chunk_waits_for_the_zap_and_then_fills_zeros() {
        let test =
            "paging::remove::a_fault_on_a_removed_chunk_waits_for_the_zap_and_then_fills_zeros";
        let Some(f) = zeroing(test) else {
            return;
        };
        let pager = &f.pager;
        f.region.slice().fill(0, PAGE, 7).unwrap();
        {
            let mut st = pager.state.lock();
            st.chunk[0] = St::Active;
            st.resident += 1;
        }
        remove_all(&f);
        // Its old page is still there (the remover zaps it next): the fault just wakes.
        assert_eq!(pager.on_fault(ChunkIdx(0), 0, false), Admit::Done);
        assert!(pager.state.lock().is_removed(0));
        f.region.discard(0, PAGE).unwrap().unwrap();
        assert_eq!(pager.on_fault(ChunkIdx(0), 0, false), Admit::Zero);
        let st = pager.state.lock();
        assert!(!st.is_removed(0));
        assert_eq!(
            st.chunk[0],
            St::Fetching {
                new: true,
                zero: true
            }
        );
        drop(st);
        pager.fetched(ChunkIdx(0), true);
        // Zapped again under it (its page missing while active): filled again, not fetched.
        assert_eq!(pager.on_fault(ChunkIdx(0), 0, false), Admit::Zero);
        assert_eq!(
            pager.state.lock().chunk[0],
            St::Fetching {
                new: false,
                zero: true
            }
        );
    }

    #[test]
    fn a_copy_back_overtaken_by_a_remove_leaves_the_chunk_zero() {
        let test = "paging::remove::a_copy_back_overtaken_by_a_remove_leaves_the_chunk_zero";
        for installed in [false, true] {
            let Some(f) = zeroing(test) else {
                return;
            };
            let pager = &f.pager;
            assert_eq!(pager.on_fault(ChunkIdx(1), PAGE, false), Admit::FromSlot);
            remove_all(&f);
            assert!(pager.install_refused(ChunkIdx(1)));
            pager.unstaged(ChunkIdx(1), installed);
            let st = pager.state.lock();
            assert_eq!(st.chunk[1], St::Zero, "installed {installed}");
            assert_eq!(st.stale, [1], "its slot (the old content) is stale");
            assert_eq!(st.resident, 1, "the copy's unit freed");
            drop(st);
            assert_eq!(push_read(pager, 1), PushRead::Zero);
        }
    }

    #[test]
    fn a_deactivation_overtaken_by_a_remove_leaves_its_chunks_zero() {
        let test = "paging::remove::a_deactivation_overtaken_by_a_remove_leaves_its_chunks_zero";
        let Some(f) = zeroing(test) else {
            return;
        };
        let pager = &f.pager;
        {
            let mut st = pager.state.lock();
            st.chunk[2] = St::Moving;
            st.chunk[3] = St::Moving;
            st.resident += 2;
        }
        remove_all(&f);
        let mut st = pager.state.lock();
        // Chunk 2's pages are in its slot, chunk 3's were put back in the region.
        let moved = [(2, Moved::Staged { whole: true }), (3, Moved::Active)];
        assert_eq!(pager.record_moves(&mut st, &moved), 0);
        assert_eq!((st.chunk[2], st.chunk[3]), (St::Zero, St::Zero));
        assert_eq!(st.stale, [1, 2]);
        assert_eq!((st.resident, st.n_staged), (2, 0), "two stale slots");
    }

    #[test]
    fn a_staged_chunk_whose_page_is_gone_pushes_zeros() {
        let test = "paging::remove::a_staged_chunk_whose_page_is_gone_pushes_zeros";
        for (remove, then) in [
            (RemoveMeans::Zero, PushRead::Zero),
            (RemoveMeans::Refetch, PushRead::Busy),
        ] {
            let Some(f) = pager(test, remove, Prefetch::Off) else {
                return;
            };
            f.staging.discard(PAGE, PAGE).unwrap().unwrap();
            assert_eq!(push_read(&f.pager, 1), then, "{remove:?}");
        }
    }

    #[test]
    fn prefetch_leaves_a_removed_chunk_to_its_fault() {
        let test = "paging::remove::prefetch_leaves_a_removed_chunk_to_its_fault";
        for remove in [false, true] {
            let prefetch = Prefetch::Sequential { max_chunks: 4 };
            let Some(f) = pager(test, RemoveMeans::Zero, prefetch) else {
                return;
            };
            if remove {
                let base = f.region.addr();
                f.pager.removed(base + 2 * PAGE, base + 3 * PAGE);
            }
            // A fault at chunk 0, then one at 1: a window of one chunk after it, chunk 2.
            assert!(f.pager.prefetch_after(1, ChunkIdx(0)).is_empty());
            let admitted = f.pager.prefetch_after(1, ChunkIdx(1));
            let want = if remove {
                vec![]
            } else {
                vec![(ChunkIdx(2), false)]
            };
            assert_eq!(admitted, want, "removed {remove}");
        }
    }
}
