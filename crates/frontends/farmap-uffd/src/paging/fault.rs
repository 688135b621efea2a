//! A fault on a missing page: what it does ([`Pager::on_fault`]), the end of the fetch it
//! admitted, zero fills, and staged chunks moved back (in the reader, or in the faulting
//! thread's signal handler).

use std::sync::atomic::Ordering;

use farmap_core::ChunkIdx;

use super::state::{St, State};
use super::{Admit, InThread, Pager};
use crate::memory::Landed;
use crate::stats::Counters;

impl Pager {
    /// Decides what a missing fault at `page` (offset in the region) of chunk `idx` does.
    pub(crate) fn on_fault(&self, idx: ChunkIdx, page: usize, overcommit: bool) -> Admit {
        let i = idx.0;
        let mut st = self.state.lock();
        match st.chunk[i as usize] {
            // A fetch, or a copy back, will wake the thread.
            St::Fetching { .. } | St::Unstaging { .. } => Admit::InFlight,
            // Its pages are on their way to the staging slot: ask again once they are there
            // (the deactivation bumps the event generation), and move them back then.
            St::Moving => Admit::Retry,
            St::Active => {
                if self.page_present(page) {
                    let _ = self.region.wake(page, self.region.page_size());
                    return Admit::Done;
                }
                // Its pages in its staging slot although it is active: a bug (see the module
                // docs). Move them back rather than fetch stale data, and say so.
                if !st.slot_busy[i as usize] && self.slot_pages(i) > 0 {
                    self.tr(i, || {
                        format!("active-missing page {page:#x} -> recover from slot")
                    });
                    Counters::add(&self.counters.recovered, 1);
                    self.region_counters.error(format!(
                        "chunk {i} is active but its pages are in its staging slot"
                    ));
                    if self.copy_refault {
                        return self.admit_copy(&mut st, i, false, overcommit);
                    }
                    return self.move_back(&mut st, i);
                }
                // Discarded behind our back (the application's madvise): fetch it again, or
                // fill it with zeros if that is what a discard means; already counted.
                let zero = self.zeroes_removed();
                st.chunk[i as usize] = St::Fetching { new: false, zero };
                self.tr(i, || format!("active-missing page {page:#x} -> refetch"));
                self.evict_from_cache(idx);
                if zero {
                    Admit::Zero
                } else {
                    Admit::Fetch
                }
            }
            St::Staged if self.copy_refault => self.admit_copy(&mut st, i, true, overcommit),
            St::Staged => self.move_back(&mut st, i),
            St::Remote | St::Zero => {
                if let Some(admit) = self.fault_on_removed(&mut st, i, page) {
                    return admit;
                }
                let zero = st.chunk[i as usize] == St::Zero;
                // A push of this process reading a page removed under it faults here (its
                // chunk was pinned): admitted at once, over the limit if need be, since the
                // push waits for this fault and reclaim may wait for the push.
                if st.pins[i as usize] > 0 {
                    st.resident += 1;
                } else if !self.take_unit(&mut st, overcommit) {
                    return Admit::Full;
                }
                self.tr(i, || format!("remote fault page {page:#x} -> fetch"));
                st.chunk[i as usize] = St::Fetching { new: true, zero };
                self.evict_from_cache(idx);
                if zero {
                    Admit::Zero
                } else {
                    Admit::Fetch
                }
            }
        }
    }

    /// Takes one unit of the limit for a fault, if there is room: below the limit, or with
    /// `overcommit` below the limit plus `min_free`, or under a fork fence (no reclaim can
    /// run until it ends, and a fault must not wait for it: the fence may be waiting for
    /// the faulting thread, the program's reaper). Wakes the reclaim thread when free
    /// chunks run low, or when there is no room (then false: the fault reclaims first).
    pub(super) fn take_unit(&self, st: &mut State, overcommit: bool) -> bool {
        let limit = self.limit();
        if st.resident < limit
            || (overcommit && st.resident < limit + self.min_free())
            || self.paused()
        {
            if st.resident >= limit {
                Counters::add(&self.counters.overcommits, 1);
            }
            st.resident += 1;
            if limit.saturating_sub(st.resident) < self.low_water() {
                self.kick();
            }
            true
        } else {
            self.kick();
            false
        }
    }

    /// The fetch of a chunk [`on_fault`](Self::on_fault) admitted finished.
    pub(crate) fn fetched(&self, idx: ChunkIdx, ok: bool) {
        let i = idx.0 as usize;
        let mut st = self.state.lock();
        if let St::Fetching { new, zero } = st.chunk[i] {
            // Removed meanwhile: what it installed came before the event was read (the
            // gate), and the remover zaps it; zeros filled are right either way.
            let removed = st.is_removed(idx.0);
            if removed && !(ok && zero) {
                self.end_removed(&mut st, idx.0, false, 1);
                drop(st);
                self.changed.notify_waiters();
                return;
            }
            st.set_removed(idx.0, false);
            self.tr(idx.0, || format!("fetched ok={ok}"));
            if ok {
                st.chunk[i] = St::Active;
                st.referenced[i] = true;
                st.active.push_back(idx.0);
                if self.zeroes_removed() {
                    // A remover may have zapped what was installed since (the zap follows
                    // the handling of its event, which may come first): a thread that
                    // faulted after that was told the fetch would wake it. It faults again.
                    let (off, len) = self.chunk_span(idx.0);
                    let _ = self.region.wake(off, len);
                }
            } else {
                st.chunk[i] = if zero { St::Zero } else { St::Remote };
                st.prefetched[i] = false;
                if new {
                    st.resident -= 1;
                    drop(st);
                    self.changed.notify_waiters();
                }
            }
        }
    }

    /// Moves staged chunk `i` back into the region, re-protects it, wakes its waiters.
    fn move_back(&self, st: &mut State, i: u64) -> Admit {
        let (off, len) = self.chunk_span(i);
        // One move of the whole slot first; if it stops part way, the page-by-page path
        // below finishes it.
        let r = match self.move_slot_back(off, len) {
            Ok(()) => Ok(()),
            Err(()) => {
                let _ = self.region.write_protect(off, len, false, false);
                self.move_present(&self.staging, &self.region, off, len)
            }
        };
        self.tr(i, || format!("move back {r:?}"));
        if let Err(e) = r {
            // EAGAIN: an event is pending, or a page is busy. The pages already moved stay
            // in the region; the retry moves the rest.
            Counters::add(&self.counters.partial_moves, 1);
            if e != libc::EAGAIN {
                self.region_counters.error(format!(
                    "moving staged chunk {i} back into the region: {}",
                    std::io::Error::from_raw_os_error(e)
                ));
            }
            return Admit::Retry;
        }
        // Moved pages arrive unprotected (UFFDIO_MOVE drops the uffd-wp bit) and present,
        // so a thread may write one before the protection below: mark the chunk dirty after
        // protecting it, and the next push reads every such write. A protection failure
        // leaves the pages unprotected, which only means extra pushes.
        let _ = self.region.write_protect(off, len, true, false);
        if let Some(mark) = self.mark.get() {
            mark(ChunkIdx(i));
        }
        let _ = self.region.wake(off, len);
        Self::staged_to_active(st, i);
        Counters::add(&self.counters.staged_refaults, 1);
        Admit::Done
    }

    /// The state change of a move back (its pages are in the region, protected, marked).
    fn staged_to_active(st: &mut State, i: u64) {
        let iu = i as usize;
        st.chunk[iu] = St::Active;
        st.slot_busy[iu] = false;
        st.referenced[iu] = true;
        st.n_staged -= 1;
        st.active.push_back(i);
    }

    /// A fault on chunk `i`, served in the faulting thread's signal handler (see the
    /// `signal` module): a staged chunk whose slot holds all its pages is moved back with one
    /// `UFFDIO_MOVE`, re-protected and marked dirty, and [`InThread::Done`] tells the thread to
    /// retry its access. Anything else (another state, the lock taken, a move that stops part
    /// way, a trace being recorded) is [`InThread::Elsewhere`]: the reader serves it, and
    /// finishes any partial move as [`move_back`](Self::move_back) does. Async-signal-safe:
    /// no allocation, no blocking lock.
    pub(crate) fn move_back_in_thread(&self, i: u64) -> InThread {
        if self.trace.is_some() || self.copy_refault {
            return InThread::Elsewhere;
        }
        let Some(mut st) = self.state.try_lock() else {
            return InThread::Elsewhere;
        };
        let iu = i as usize;
        if st.chunk.get(iu) != Some(&St::Staged) || st.active.len() >= st.active.capacity() {
            return InThread::Elsewhere;
        }
        let (off, len) = self.chunk_span(i);
        if self.move_slot_back(off, len).is_err() {
            Counters::add(&self.counters.partial_moves, 1);
            return InThread::Elsewhere;
        }
        // Not write-protected here (one ioctl, a µs, off the fault path): moved pages carry
        // no uffd-wp bit, so until the next reclaim pass protects the chunk
        // (`protect_moved_back`) every write to it shows as written to the tracker's scans.
        // Marked dirty now for the staged content itself.
        self.unprotected[iu / 64].fetch_or(1 << (iu % 64), Ordering::Release);
        self.unprotected_any.store(true, Ordering::Release);
        if let Some(mark) = self.mark.get() {
            mark(ChunkIdx(i));
        }
        Self::staged_to_active(&mut st, i);
        drop(st);
        // Other threads of this chunk may be waiting for it.
        self.region.uffd().wakeups().bump();
        Counters::add(&self.counters.staged_refaults, 1);
        Counters::add(&self.counters.staged_refaults_in_thread, 1);
        InThread::Done
    }

    /// Pages of chunk `i`'s staging slot present in memory.
    fn slot_pages(&self, i: u64) -> usize {
        let (off, len) = self.chunk_span(i);
        let base = self.staging.base() + off;
        let mut n = 0;
        let mut v = Vec::new();
        let _ = self
            .pagemap
            .in_memory(base, base + len, &mut v, |run| n += run.end - run.start);
        n
    }

    /// Fills chunk `idx` (admitted with [`Admit::Zero`]) with the shared zero page and wakes
    /// its waiters: no store read, no page allocated until a write. `Err(EAGAIN)` while an
    /// event is pending (call again once the reader has read it). A chunk removed meanwhile
    /// gets nothing ([`Landed::Removed`]: the fill passes the remove gate, as copies do; see
    /// the module docs).
    pub(crate) fn fill_zero(&self, idx: ChunkIdx) -> Result<Landed, i32> {
        let zeroes = self.zeroes_removed();
        let _order = zeroes.then(|| self.events.order().read());
        if zeroes && self.state.lock().is_removed(idx.0) {
            return Ok(Landed::Removed);
        }
        self.fill_zero_now(idx).map(|()| Landed::Installed)
    }

    /// [`fill_zero`](Self::fill_zero), past the gate.
    ///
    /// `UFFDIO_ZEROPAGE` has no write-protect mode: the zero pages are protected right after
    /// (so that the scans see later writes), before anyone is woken. A thread that touches a
    /// page for the first time in between may write it unprotected; such a page is no longer
    /// the zero page, which the page tables tell, and the chunk is then marked dirty.
    fn fill_zero_now(&self, idx: ChunkIdx) -> Result<(), i32> {
        let (off, len) = self.chunk_span(idx.0);
        // Empty entries may carry write-protect markers (the scans protect holes), which
        // UFFDIO_ZEROPAGE refuses (EEXIST): unprotecting clears them.
        self.region.write_protect(off, len, false, false)?;
        let mut done = 0;
        while done < len {
            match self.region.zeropage(off + done, len - done, true) {
                Ok(n) | Err(crate::uffd::CopyError::Partial(n)) => done += n,
                // Present already (a racing install cannot happen: the chunk is ours to
                // fill; but never overwrite data): skip the page.
                Err(crate::uffd::CopyError::Exists) => done += self.region.page_size(),
                Err(crate::uffd::CopyError::EventPending) => return Err(libc::EAGAIN),
                Err(crate::uffd::CopyError::Gone) => return Err(libc::ENOENT),
                Err(crate::uffd::CopyError::Os(e)) => return Err(e),
            }
        }
        self.region.write_protect(off, len, true, false)?;
        let base = self.region.base() + off;
        if self
            .pagemap
            .any_not_zero_page(base, base + len)
            .unwrap_or(true)
        {
            if let Some(mark) = self.mark.get() {
                mark(idx);
            }
        }
        Counters::add(&self.counters.zero_fills, 1);
        self.tr(idx.0, || "zero-filled".to_string());
        let _ = self.region.wake(off, len);
        Ok(())
    }
}
