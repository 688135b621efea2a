//! Staged refaults by copy: a staged chunk's slot is read and installed in the region with
//! `UFFDIO_COPY|WP`, and the slot is left stale until reclaim drops it (see the module
//! documentation, *Staged refaults by copy*).

use std::sync::Weak;

use bytes::Bytes;
use farmap_core::ChunkIdx;

use super::state::{St, State};
use super::{Admit, Pager};
use crate::memory::Landed;
use crate::stats::Counters;

impl Pager {
    /// Admits a fault on chunk `i` for a copy back out of its slot ([`Admit::FromSlot`]):
    /// `staged`, or active with pages in its slot (a bug, recovered). The copy takes one more
    /// unit of the limit (the slot's pages stay until reclaim drops them), so at the limit the
    /// fault reclaims first ([`Admit::Full`]). The slot stays busy: nobody moves its pages or
    /// drops them meanwhile, and pushes of the chunk wait.
    pub(super) fn admit_copy(
        &self,
        st: &mut State,
        i: u64,
        staged: bool,
        overcommit: bool,
    ) -> Admit {
        if !self.take_unit(st, overcommit) {
            return Admit::Full;
        }
        let iu = i as usize;
        st.chunk[iu] = St::Unstaging { staged };
        st.slot_busy[iu] = true;
        if staged {
            st.n_staged -= 1;
        }
        self.tr(i, || {
            format!("refault: copy from the slot (staged {staged})")
        });
        Admit::FromSlot
    }

    /// Installs staged chunk `idx`, admitted for a copy back ([`Admit::FromSlot`]), from a
    /// copy of its staging slot read outside the state lock, with `UFFDIO_COPY|WP` (the
    /// region's memory: [`RegionMemory`](crate::memory::RegionMemory), which waits out
    /// pending events and skips present pages), and records the outcome
    /// ([`unstaged`](Self::unstaged)).
    pub(crate) async fn copy_back(&self, idx: ChunkIdx) {
        let installed = match (
            self.read_slot(idx),
            self.cache.get().and_then(Weak::upgrade),
        ) {
            (Some(data), Some(cache)) => match cache.local().install(idx, data).await {
                Ok(landed) => landed == Landed::Installed,
                Err(e) => {
                    self.region_counters.error(format!(
                        "copying staged chunk {idx} back into the region: {}",
                        farmap_core::error_chain(&e)
                    ));
                    false
                }
            },
            _ => false,
        };
        self.unstaged(idx, installed);
    }

    /// A copy of chunk `idx`'s staging slot (admitted with [`Admit::FromSlot`]; read outside
    /// the state lock: the slot is busy, nothing moves its pages). Holes of the slot read as
    /// zeros (pages a move that stopped part way left in the region, which the install skips);
    /// the read maps the zero page into them, which the slot's drop discards. `None` if the
    /// staging area is gone.
    fn read_slot(&self, idx: ChunkIdx) -> Option<Bytes> {
        let (off, len) = self.chunk_span(idx.0);
        let mut buf = vec![0u8; len];
        self.staging_map
            .read(off, &mut buf)
            .then(|| Bytes::from(buf))
    }

    /// The copy back of chunk `idx` ([`Admit::FromSlot`]) ended: `installed` in the region
    /// (and its faulting threads woken by the copy), or not. Installed: the chunk is active
    /// and marked dirty (its staged content may not be in the store yet; the pages came
    /// write-protected, so later writes are tracked), its slot stale. Not installed: the chunk
    /// is as it was (a staged chunk keeps its write-back proof) and its waiters are woken to
    /// fault again. Removed meanwhile: zero, its slot stale.
    pub(super) fn unstaged(&self, idx: ChunkIdx, installed: bool) {
        let (i, iu) = (idx.0, idx.0 as usize);
        let mut st = self.state.lock();
        let St::Unstaging { staged } = st.chunk[iu] else {
            return;
        };
        self.tr(i, || format!("unstaged installed={installed}"));
        let removed = st.is_removed(i);
        if installed && !removed {
            st.chunk[iu] = St::Active;
            st.referenced[iu] = true;
            st.active.push_back(i);
            st.stale.push_back(i);
            drop(st);
            if let Some(mark) = self.mark.get() {
                mark(idx);
            }
            Counters::add(&self.counters.staged_refaults, 1);
            return;
        }
        if removed {
            // Overtaken by a remove event: zero, its slot stale, the copy's unit freed (a
            // page it installed came before the event was read, and the remover zaps it).
            self.end_removed(&mut st, i, true, 1);
        } else {
            // The unit taken for the copy.
            st.resident -= 1;
            if staged {
                Self::restage(&mut st, i);
            } else {
                st.chunk[iu] = St::Active;
                st.slot_busy[iu] = false;
            }
        }
        drop(st);
        self.changed.notify_waiters();
        let (off, len) = self.chunk_span(i);
        let _ = self.region.wake(off, len);
    }

    /// Chunk `i`, unstaging, is staged again (its copy failed), with a new staging id (its
    /// entry in the staged queue may be gone, or stale) and its old epoch: a write-back that
    /// began after it was staged still lets its slot be dropped.
    fn restage(st: &mut State, i: u64) {
        let iu = i as usize;
        st.chunk[iu] = St::Staged;
        st.stage_seq += 1;
        let id = st.stage_seq;
        st.stage_id[iu] = id;
        st.n_staged += 1;
        st.staged.push_back((i, id));
    }
}

#[cfg(test)]
mod tests {
    use farmap_core::ChunkIdx;

    use super::super::state::St;
    use super::super::testing::{pager, push_read, CHUNKS, PAGE};
    use super::super::Admit;
    use crate::memory::PushRead;
    use crate::options::{Prefetch, RemoveMeans};

    #[test]
    fn a_staged_chunk_comes_back_by_copy_and_pushes_wait_meanwhile() {
        let test = "paging::copy::a_staged_chunk_comes_back_by_copy_and_pushes_wait_meanwhile";
        let Some(f) = pager(test, RemoveMeans::Refetch, Prefetch::Off) else {
            return;
        };
        let pager = &f.pager;
        assert!(pager.copy_refault);
        assert_eq!(pager.on_fault(ChunkIdx(1), PAGE, false), Admit::FromSlot);
        {
            let st = pager.state.lock();
            assert_eq!(st.chunk[1], St::Unstaging { staged: true });
            assert_eq!(
                (st.resident, st.n_staged),
                (2, 0),
                "one more unit for the copy"
            );
        }
        assert_eq!(pager.on_fault(ChunkIdx(1), PAGE, false), Admit::InFlight);
        // The newest content is in the slot: a push must not read the store now.
        assert_eq!(push_read(pager, 1), PushRead::Busy);
        assert_eq!(
            &pager.read_slot(ChunkIdx(1)).unwrap()[..],
            &[0xab; PAGE][..]
        );
        pager.unstaged(ChunkIdx(1), true);
        let st = pager.state.lock();
        assert_eq!(st.chunk[1], St::Active);
        assert!(
            st.slot_busy[1],
            "the stale slot stays busy until it is dropped"
        );
        assert_eq!(st.stale, [1]);
        assert_eq!((st.resident, st.n_staged), (2, 0));
        drop(st);
        assert_eq!(push_read(pager, 1), PushRead::Pinned);
        // A stale slot is never taken for a deactivation (nothing moves into it).
        pager.state.lock().referenced[1] = false;
        assert_eq!(pager.deactivate(CHUNKS), 0);
        assert_eq!(pager.state.lock().chunk[1], St::Active);
    }

    #[test]
    fn a_failed_copy_leaves_the_chunk_staged_and_a_full_region_reclaims_first() {
        let test =
            "paging::copy::a_failed_copy_leaves_the_chunk_staged_and_a_full_region_reclaims_first";
        let Some(f) = pager(test, RemoveMeans::Refetch, Prefetch::Off) else {
            return;
        };
        let pager = &f.pager;
        assert_eq!(pager.on_fault(ChunkIdx(1), PAGE, false), Admit::FromSlot);
        pager.unstaged(ChunkIdx(1), false);
        {
            let st = pager.state.lock();
            assert_eq!(st.chunk[1], St::Staged);
            assert_eq!((st.resident, st.n_staged), (1, 1));
            let current: Vec<_> = st
                .staged
                .iter()
                .filter(|&&(i, id)| i == 1 && st.stage_id[1] == id)
                .collect();
            assert_eq!(current.len(), 1, "one current entry in the staged queue");
            assert!(st.stale.is_empty());
        }
        // Its slot holds every page: a push copies it out.
        assert_eq!(push_read(pager, 1), PushRead::Copied);
        pager.state.lock().resident = CHUNKS;
        assert_eq!(pager.on_fault(ChunkIdx(1), PAGE, false), Admit::Full);
        assert_eq!(pager.state.lock().chunk[1], St::Staged);
        assert_eq!(pager.on_fault(ChunkIdx(1), PAGE, true), Admit::FromSlot);
        assert_eq!(
            pager.state.lock().resident,
            CHUNKS + 1,
            "over the limit, within min_free"
        );
    }
}
