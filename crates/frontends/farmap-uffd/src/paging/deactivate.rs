//! Deactivation: victims picked by the eviction policy (drop-behind first, then the clock)
//! move from the region to their staging slots, active → staged (see the module
//! documentation).

use std::sync::atomic::Ordering;

use farmap_core::ChunkIdx;

use super::moves::consecutive_runs;
use super::state::{Moved, St, State};
use super::Pager;
use crate::stats::Counters;

/// Most bytes of victims a deactivation takes at once under the state lock (see
/// [`Pager::deactivate`]): 64 pages of 4 KiB.
const GROUP_BYTES: u64 = 256 << 10;

/// Most chunks of the active FIFO a deactivation looks at under one hold of the state lock.
/// After a scan for written chunks most resident chunks can be referenced, and the clock
/// then goes through all of them before it finds a victim (≈ 20,000 chunks, a few hundred
/// µs, at 30% of a 256 MiB region in 4 KiB chunks): faults would wait for all of it.
const SCAN_PER_HOLD: usize = 1024;

/// Whether a deactivation first scans the region for written chunks (their referenced
/// flags): the scan reads the page tables of the whole region (half a million entries for
/// a 2 GiB heap), and reclaim passes come hundreds of times a second under a tight limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refresh {
    /// Scan.
    Now,
    /// Scan if the last scan is [`REFRESH_EVERY`] old.
    IfOld,
    /// Do not.
    No,
}

/// How old the last scan for written chunks may be before a reclaim pass scans again: the
/// clock's hand takes about a second to go round at 20,000 evictions a second over 30,000
/// chunks, so a flag 20 ms stale changes few of its choices.
const REFRESH_EVERY: std::time::Duration = std::time::Duration::from_millis(20);

impl Pager {
    /// Moves up to `n` victims from the active FIFO to staging; returns how many.
    pub(crate) fn deactivate(&self, n: u64) -> u64 {
        self.deactivate_inner(n, Refresh::Now)
    }

    /// [`deactivate`](Self::deactivate); `refresh`: whether to scan for written chunks first
    /// (see [`Refresh`]).
    ///
    /// Victims are taken a group at a time (at most [`GROUP_BYTES`]), and each run of
    /// consecutive chunks in a group moves with one page-table scan and one `UFFDIO_MOVE`
    /// per run of present pages: the kernel flushes the TLB once per move, not once per
    /// page, and a flush is an interrupt of every CPU the application runs on.
    pub(super) fn deactivate_inner(&self, n: u64, refresh: Refresh) -> u64 {
        if n == 0 {
            return 0;
        }
        if refresh != Refresh::No {
            self.refresh_referenced(refresh == Refresh::Now);
        }
        let per_group = (GROUP_BYTES / u64::from(self.geometry.chunk_size()).max(1)).max(1);
        let mut st = self.state.lock_yielding();
        let mut done = 0;
        let mut budget = 2 * st.active.len() + 1;
        let mut group: Vec<u64> = Vec::with_capacity(per_group as usize);
        let mut outcomes: Vec<(u64, Moved)> = Vec::with_capacity(per_group as usize);
        while done < n && budget > 0 {
            if self.paused() {
                // A fork fence: nothing moves until it ends.
                break;
            }
            group.clear();
            let want = per_group.min(n - done) as usize;
            self.take_behind(&mut st, &mut group, want);
            let popped = self.take_clock(&mut st, &mut group, want, &mut budget);
            if group.is_empty() {
                if popped == SCAN_PER_HOLD && budget > 0 {
                    // Second chances only so far: let the faults waiting for the lock in
                    // before scanning on.
                    drop(st);
                    st = self.state.lock_yielding();
                    continue;
                }
                break;
            }
            // The moves run outside the lock (a scattered group is one move, and one TLB
            // flush, per chunk: hundreds of µs that every fault would wait for). Meanwhile
            // the group's chunks are `Moving`: a fault on one of their pages waits for the
            // state change below, and a push waits too.
            // Marked dirty now, before the moves: the pages leave the region's write
            // tracking as they move, and a flush that starts meanwhile must see the chunk
            // (its push waits for the chunk to be staged, then reads the slot). Marked after
            // the move, a flush in between finished without it.
            if let Some(mark) = self.mark.get() {
                for &i in &group {
                    mark(ChunkIdx(i));
                }
            }
            let epoch = st.epoch;
            self.moving.fetch_add(1, Ordering::SeqCst);
            drop(st);
            group.sort_unstable();
            self.move_group(&group, epoch, &mut outcomes);
            self.moved.fetch_add(1, Ordering::SeqCst);
            self.moving.fetch_sub(1, Ordering::SeqCst);
            st = self.state.lock_yielding();
            done += self.record_moves(&mut st, &outcomes);
            // Wakes the faults that found a chunk of the group moving (`Admit::Retry`).
            self.events.bump();
        }
        done
    }

    /// Takes victims for `group`, up to `want` in all, from the drop-behind queue: active
    /// chunks, neither pinned nor with a busy slot, whatever their referenced flag. They are
    /// `Moving` from here on.
    fn take_behind(&self, st: &mut State, group: &mut Vec<u64>, want: usize) {
        // Drop-behind first: what sequential streams left behind goes in runs, whatever
        // its referenced flag says (written during the scan, it would get a second chance
        // and the victims of a group would alternate: a move and a TLB flush each).
        while group.len() < want {
            let Some(i) = st.behind.pop_front() else {
                break;
            };
            let iu = i as usize;
            if st.chunk[iu] == St::Active && !st.slot_busy[iu] && st.pins[iu] == 0 {
                st.referenced[iu] = false;
                st.chunk[iu] = St::Moving;
                group.push(i);
                Counters::add(&self.counters.dropped_behind, 1);
            }
        }
    }

    /// Takes victims for `group`, up to `want` in all, from the head of the active FIFO with
    /// a second chance (CLOCK: a referenced, pinned or slot-busy chunk has its flag cleared
    /// and goes to the tail), looking at no more than `budget` chunks in all and
    /// [`SCAN_PER_HOLD`] now; returns how many it looked at. Victims are `Moving` from here on.
    fn take_clock(
        &self,
        st: &mut State,
        group: &mut Vec<u64>,
        want: usize,
        budget: &mut usize,
    ) -> usize {
        let mut popped = 0;
        while group.len() < want && *budget > 0 && popped < SCAN_PER_HOLD {
            *budget -= 1;
            popped += 1;
            let Some(i) = st.active.pop_front() else {
                break;
            };
            let iu = i as usize;
            if st.chunk[iu] != St::Active {
                continue;
            }
            if st.referenced[iu] || st.slot_busy[iu] || st.pins[iu] > 0 {
                st.referenced[iu] = false;
                st.active.push_back(i);
                continue;
            }
            // Moving from here on (also keeps a chunk from being taken twice).
            st.chunk[iu] = St::Moving;
            group.push(i);
        }
        popped
    }

    /// Moves the pages of `group` (sorted, `Moving`) to their staging slots, one move per
    /// run of consecutive chunks, all issued together (one round trip to a program's reaper
    /// for the group), outside the state lock (`epoch`: the state's, for the
    /// trace); a run whose move stops part way is undone chunk by chunk. Sets `outcomes` to
    /// each chunk with whether it is staged now.
    fn move_group(&self, group: &[u64], epoch: u64, outcomes: &mut Vec<(u64, Moved)>) {
        outcomes.clear();
        let runs: Vec<&[u64]> = consecutive_runs(group).collect();
        let spans: Vec<(usize, usize)> = runs.iter().map(|run| self.run_span(run)).collect();
        let moved = self.move_present_spans(&self.region, &self.staging, &spans);
        for (run, r) in runs.into_iter().zip(moved) {
            if r.is_err() {
                Counters::add(&self.counters.partial_moves, 1);
            }
            for &i in run {
                self.tr(i, || format!("deactivate {r:?} epoch {epoch}"));
                let moved = match r {
                    Ok(whole) => Moved::Staged { whole },
                    Err(e) if self.undo_deactivation(i, e) => Moved::Staged { whole: false },
                    Err(_) => Moved::Active,
                };
                outcomes.push((i, moved));
            }
        }
    }

    /// Records the `outcomes` of [`move_group`](Self::move_group): staged chunks as staged,
    /// the others active again (and referenced), removed ones zero (a slot with their pages
    /// stale); returns how many were staged.
    pub(super) fn record_moves(&self, st: &mut State, outcomes: &[(u64, Moved)]) -> u64 {
        let mut staged_now = 0;
        let mut freed = false;
        for &(i, moved) in outcomes {
            let staged = moved != Moved::Active;
            if st.is_removed(i) {
                // The unit goes to the stale slot, or is freed (pages left in the region,
                // or moved back before the event was read, are zapped by the remover).
                self.end_removed(st, i, staged, u64::from(!staged));
                freed |= !staged;
            } else if let Moved::Staged { whole } = moved {
                self.active_to_staged(st, i);
                st.whole_slot[i as usize] = whole;
                self.evict_from_cache(ChunkIdx(i));
                Counters::add(&self.counters.deactivations, 1);
                staged_now += 1;
            } else {
                st.chunk[i as usize] = St::Active;
                st.referenced[i as usize] = true;
                st.active.push_back(i);
            }
        }
        if freed {
            self.changed.notify_waiters();
        }
        staged_now
    }

    /// After a move of chunk `i`'s run to staging stopped part way (`e`: a busy page, an
    /// event pending), puts back what moved, so that the chunk is wholly active again.
    /// Returns whether the chunk must count as staged all the same (pages left in its slot:
    /// the undo stopped part way too). The region's holes may carry write-protect markers by
    /// now (a scan): unprotect first, protect after, and mark the chunk dirty (moves drop the
    /// write protection).
    ///
    /// Removed chunks pass the gate (see the module docs): the undo holds the events' order
    /// shared, and a chunk removed already keeps its pages in the slot (which goes stale).
    fn undo_deactivation(&self, i: u64, e: i32) -> bool {
        let zeroes = self.zeroes_removed();
        let _order = zeroes.then(|| self.events.order().read());
        if zeroes && self.state.lock_yielding().is_removed(i) {
            return true;
        }
        let (off, len) = self.chunk_span(i);
        let _ = self.region.write_protect(off, len, false, false);
        let undone = self.move_present(&self.staging, &self.region, off, len);
        let _ = self.region.write_protect(off, len, true, false);
        let _ = self.region.wake(off, len);
        if let Some(mark) = self.mark.get() {
            mark(ChunkIdx(i));
        }
        match undone {
            Ok(()) => false,
            // Pages left in the slot: the chunk is staged (partly), and its next fault, or a
            // push, finishes the move one way or the other.
            Err(e2) => {
                self.region_counters.error(format!(
                    "moving chunk {i} to staging stopped part way ({}), and so did moving it \
                     back ({})",
                    std::io::Error::from_raw_os_error(e),
                    std::io::Error::from_raw_os_error(e2)
                ));
                true
            }
        }
    }

    /// The state change of a deactivation (the chunk's pages are in its staging slot).
    fn active_to_staged(&self, st: &mut State, i: u64) {
        let iu = i as usize;
        if std::mem::take(&mut st.prefetched[iu]) {
            Counters::add(&self.counters.prefetch_wasted, 1);
        }
        st.chunk[iu] = St::Staged;
        st.slot_busy[iu] = true;
        st.staged_epoch[iu] = st.epoch;
        st.stage_seq += 1;
        let id = st.stage_seq;
        st.stage_id[iu] = id;
        st.n_staged += 1;
        st.staged.push_back((i, id));
    }

    /// Write-protects the chunks moved back in their faulting thread since the last pass, so
    /// that their written bits (the eviction score) mean "written since", and marks each
    /// dirty after protecting it, like [`move_back`](Self::move_back) does: a write that
    /// landed unprotected in between is pushed. A chunk staged again meanwhile has no pages
    /// to protect (at most write-protect markers on its holes, which a move back clears).
    fn protect_moved_back(&self) {
        if !self.unprotected_any.swap(false, Ordering::AcqRel) {
            return;
        }
        for (w, word) in self.unprotected.iter().enumerate() {
            let mut bits = word.swap(0, Ordering::AcqRel);
            while bits != 0 {
                let b = bits.trailing_zeros() as u64;
                bits &= bits - 1;
                let i = w as u64 * 64 + b;
                let (off, len) = self.chunk_span(i);
                let _ = self.region.write_protect(off, len, true, false);
                if let Some(mark) = self.mark.get() {
                    mark(ChunkIdx(i));
                }
            }
        }
    }

    /// Sets the referenced flag of chunks with written pages (a look that changes nothing);
    /// unless `now`, only if the last look is [`REFRESH_EVERY`] old.
    fn refresh_referenced(&self, now: bool) {
        self.protect_moved_back();
        let at = self.born.elapsed().as_micros() as u64 + 1;
        let last = self.refreshed_at.load(Ordering::Relaxed);
        if !now && last != 0 && at.saturating_sub(last) < REFRESH_EVERY.as_micros() as u64 {
            return;
        }
        self.refreshed_at.store(at, Ordering::Relaxed);
        let base = self.region.base();
        let shift = self.geometry.chunk_shift();
        let mut hits = Vec::new();
        let mut scratch = Vec::new();
        let _ = self
            .pagemap
            .peek_written(base, base + self.region.len(), &mut scratch, |run| {
                if run.has_data {
                    let first = ((run.start - base) as u64) >> shift;
                    let last = ((run.end - base - 1) as u64) >> shift;
                    hits.extend(first..=last);
                }
            });
        if hits.is_empty() {
            return;
        }
        let mut st = self.state.lock_yielding();
        let mut used = 0;
        for i in hits {
            if let Some(r) = st.referenced.get_mut(i as usize) {
                *r = true;
            }
            if let Some(p) = st.prefetched.get_mut(i as usize) {
                used += u64::from(std::mem::take(p));
            }
        }
        Counters::add(&self.counters.prefetch_hits, used);
    }
}
