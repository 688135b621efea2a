//! Reclaim: staged chunks are written back and their slots dropped, to keep resident memory
//! under the limit, on a fault that finds the region full ([`Pager::make_room`]) and ahead
//! of faults in the reclaim thread ([`Pager::spawn_reclaimer`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use farmap_core::{ChunkIdx, StoreError, StoreResult};
use tokio::runtime::Handle;

use super::deactivate::Refresh;
use super::moves::consecutive_runs;
use super::state::St;
use super::{Pager, Reclaimer};
use crate::stats::Counters;

impl Pager {
    /// Drops up to `n` staged chunks already in the store (oldest first); returns how many.
    fn drop_written_back(&self, n: u64, proactive: bool) -> u64 {
        let mut victims = Vec::new();
        {
            let mut st = self.state.lock_yielding();
            let st = &mut *st;
            let (chunk, staged_epoch, written_back, stage_id) = (
                &mut st.chunk,
                &st.staged_epoch,
                &st.written_back,
                &st.stage_id,
            );
            st.staged.retain(|&(i, id)| {
                let iu = i as usize;
                if chunk[iu] != St::Staged || stage_id[iu] != id {
                    return false;
                }
                if victims.len() as u64 >= n || staged_epoch[iu] >= written_back[iu] {
                    return true;
                }
                // Still resident (slot busy) until its pages are gone.
                chunk[iu] = St::Remote;
                victims.push(i);
                false
            });
            st.n_staged -= victims.len() as u64;
        }
        for group in victims.chunks(self.trash_chunks.max(1)) {
            self.discard_slots(group);
            let mut st = self.state.lock_yielding();
            for &i in group {
                st.slot_busy[i as usize] = false;
            }
            st.resident -= group.len() as u64;
            drop(st);
            self.changed.notify_waiters();
        }
        let n = victims.len() as u64;
        if n > 0 {
            let c = if proactive {
                &self.counters.evictions_proactive
            } else {
                &self.counters.evictions_reactive
            };
            Counters::add(c, n);
        }
        n
    }

    /// Drops stale slots (chunks copied back into the region, which holds their newest
    /// copy: no write-back), oldest first, in whole batches of up to `trash_chunks` until
    /// `n` are dropped or none is left; returns how many.
    fn drop_stale(&self, n: u64) -> u64 {
        let step = self.trash_chunks.max(1);
        let mut dropped = 0;
        while dropped < n {
            let group: Vec<u64> = {
                let mut st = self.state.lock_yielding();
                let k = st.stale.len().min(step);
                st.stale.drain(..k).collect()
            };
            if group.is_empty() {
                break;
            }
            self.discard_slots(&group);
            let mut st = self.state.lock_yielding();
            for &i in &group {
                st.slot_busy[i as usize] = false;
            }
            st.resident -= group.len() as u64;
            drop(st);
            self.changed.notify_waiters();
            dropped += group.len() as u64;
        }
        dropped
    }

    /// Frees the staging slots of `victims` (at most `trash_chunks`; dropped chunks or stale
    /// slots, busy, so nobody else moves their pages) with one `madvise`: their pages are
    /// moved into the trash area first, so that one system call (and one TLB flush) frees
    /// them all. A slot whose pages cannot be moved is discarded where it is. The staging
    /// area's fd raises no events (see the module docs); the event generation is still
    /// bumped after each discard, which only wakes copies that wait for one anyway.
    fn discard_slots(&self, victims: &[u64]) {
        let chunk = self.geometry.chunk_size() as usize;
        let mut sorted = victims.to_vec();
        sorted.sort_unstable();
        if !self.moves.in_process() {
            self.discard_slots_by_reaper(&sorted);
            return;
        }
        let mut in_trash = 0;
        // Each run of consecutive slots goes with one move (one TLB flush, as in
        // `deactivate_inner`).
        for run in consecutive_runs(&sorted) {
            let (off, len) = self.run_span(run);
            let (first, k) = (run[0], run.len());
            let moved = self.trash.as_ref().map(|trash| {
                self.move_present_to(&self.staging, off, trash, in_trash * chunk, len)
                    .is_ok()
            });
            for &i in run {
                self.tr(i, || format!("drop, to the trash: {moved:?}"));
            }
            if moved.is_some() {
                // The run's trash slots are discarded below, whatever landed in them (a move
                // that stopped part way leaves some pages there).
                in_trash += k;
            }
            if moved == Some(true) {
                continue;
            }
            // What is left in the slots goes where it is. Outside the lock.
            let r = self.staging_map.discard(off, len);
            for &i in run {
                self.tr(i, || format!("discarded {r:?}"));
            }
            if let Some(Err(e)) = r {
                self.region_counters.error(format!(
                    "dropping staged chunks {first}..{}: {e}",
                    first + k as u64
                ));
            }
            self.events.bump();
        }
        if in_trash > 0 {
            let r = self
                .staging_map
                .discard(self.trash_offset, in_trash * chunk);
            if let Some(Err(e)) = r {
                self.region_counters
                    .error(format!("dropping {in_trash} staged chunks: {e}"));
            }
            self.events.bump();
        }
    }

    /// [`discard_slots`](Self::discard_slots) of a program's region: each run of
    /// consecutive slots (`sorted`) is discarded where it is, all in one round trip to the
    /// reaper (moving them into the trash first would cost a scan and a move per run, and
    /// a round trip more).
    fn discard_slots_by_reaper(&self, sorted: &[u64]) {
        let runs: Vec<&[u64]> = consecutive_runs(sorted).collect();
        let spans: Vec<(usize, usize)> = runs.iter().map(|run| self.run_span(run)).collect();
        let Some(done) = self.moves.discard_many(&self.staging, &spans) else {
            return;
        };
        for (run, errno) in runs.into_iter().zip(done) {
            for &i in run {
                self.tr(i, || format!("discarded by the reaper: errno {errno}"));
            }
            // A program that ended: its memory is gone with it.
            if errno != 0 && errno != libc::ESRCH {
                self.region_counters.error(format!(
                    "dropping staged chunks {}..{}: {}",
                    run[0],
                    run[run.len() - 1] + 1,
                    std::io::Error::from_raw_os_error(errno)
                ));
            }
        }
        self.events.bump();
    }

    /// Writes back up to `n` staged chunks not yet in the store (oldest first), and only
    /// them; returns how many were written back. On success each is droppable, unless it was
    /// staged again meanwhile.
    async fn write_back_staged(&self, n: u64) -> StoreResult<u64> {
        let Some(write_back) = self.write_back.get() else {
            return Err(StoreError::new(
                farmap_core::ErrorKind::Closed,
                "the region's pusher is gone",
            ));
        };
        let (victims, started) = {
            let mut st = self.state.lock_yielding();
            let victims: Vec<u64> = st
                .staged
                .iter()
                .copied()
                .filter(|&(i, id)| {
                    let iu = i as usize;
                    st.chunk[iu] == St::Staged
                        && st.stage_id[iu] == id
                        && st.staged_epoch[iu] >= st.written_back[iu]
                })
                .map(|(i, _)| i)
                .take(n as usize)
                .collect();
            if victims.is_empty() {
                return Ok(0);
            }
            st.epoch += 1;
            (victims, st.epoch)
        };
        write_back(victims.iter().copied().map(ChunkIdx).collect()).await?;
        let mut st = self.state.lock_yielding();
        for &i in &victims {
            st.written_back[i as usize] = started;
        }
        let n = victims.len() as u64;
        Counters::add(&self.counters.writebacks, n);
        Ok(n)
    }

    /// Frees chunks until `target_free` are free below the limit (or nothing more can be
    /// freed); returns how many were dropped.
    async fn reclaim(&self, target_free: u64, proactive: bool) -> u64 {
        let _one = self.reclaim_lock.lock().await;
        self.reclaim_locked(target_free, proactive).await
    }

    /// [`reclaim`](Self::reclaim), `reclaim_lock` held: drop staged chunks already written
    /// back; stage victims and write back just them, in steps of at most `trash_chunks`
    /// (the chunks one `madvise` drops), so that the first room appears after one step
    /// rather than after the whole pass: faults that wait for room wait for a step.
    async fn reclaim_locked(&self, target_free: u64, proactive: bool) -> u64 {
        let step = (self.trash_chunks as u64).max(1);
        let mut total = 0;
        let mut rounds = 0;
        // Each step either drops what it wrote back or finds nothing more to do; the bound
        // only stops a pass that keeps losing its victims (staged and moved back at once).
        let max_rounds = 2 + 2 * target_free.div_ceil(step);
        let mut refreshed = false;
        loop {
            let (need, staged) = {
                let st = self.state.lock_yielding();
                let free = self.limit().saturating_sub(st.resident);
                (target_free.saturating_sub(free), st.n_staged)
            };
            if need == 0 {
                return total;
            }
            let stale = self.drop_stale(need);
            total += stale;
            if stale >= need {
                continue;
            }
            let need = need - stale;
            let dropped = self.drop_written_back(need, proactive);
            total += dropped;
            if dropped >= need {
                continue;
            }
            let batch = (need - dropped).max(self.min_free()).min(step).max(1);
            let staged = staged.saturating_sub(dropped);
            if staged < batch {
                let refresh = if refreshed {
                    Refresh::No
                } else {
                    Refresh::IfOld
                };
                self.deactivate_inner(batch - staged, refresh);
                refreshed = true;
            }
            if rounds >= max_rounds {
                return total;
            }
            rounds += 1;
            match self.write_back_staged(batch).await {
                Ok(0) => {
                    // Nothing left to write back: drop what can be, and stop.
                    return total + self.drop_written_back(need - dropped, proactive);
                }
                Ok(_) => {
                    if proactive {
                        // The reclaim thread's step ran without sleeping (its write-back
                        // copies out of the staging slots on this thread): give the CPU to
                        // an application thread that woke meanwhile (its fault served), or
                        // it waits out the rest of this thread's time slice (p99.9 of
                        // faulting accesses 1.3 -> 3.2 ms without this).
                        std::thread::yield_now();
                    }
                }
                Err(e) => {
                    self.region_counters.error(format!(
                        "writing staged chunks back before dropping them: {}",
                        farmap_core::error_chain(&e)
                    ));
                    return total;
                }
            }
        }
    }

    /// A fault found the region full: reclaim one chunk (a reactive eviction), or let it
    /// go over the limit while someone else's reclaim makes room.
    ///
    /// While a reclaim pass runs (the reclaim thread's, usually), the fault does not queue
    /// behind it: the first time (`over` false) it goes over the limit at once, since room
    /// is on its way; a fault that found even that headroom full waits until the pass frees
    /// room (woken at once) or 2 ms pass. Returns whether room appeared; `false` lets the
    /// fault go over the limit (by at most `min_free`).
    ///
    /// Waiting for the pass's step was the paging tail: `bench paging --pattern zipf
    /// --local 30%` p99.9 288-358 µs, 13.7-16× its p50, with about a hundred faults a run
    /// waiting for room.
    pub(crate) async fn make_room(&self, over: bool) -> bool {
        let notified = self.changed.notified();
        if let Ok(_one) = self.reclaim_lock.try_lock() {
            if self.reclaim_locked(1, false).await > 0 {
                return true;
            }
        } else if !over {
            return false;
        }
        tokio::time::timeout(Duration::from_millis(2), notified)
            .await
            .is_ok()
    }

    /// Whether a reclaim pass runs now (room is on its way).
    pub(crate) fn reclaiming(&self) -> bool {
        self.reclaim_lock.try_lock().is_err()
    }

    /// Starts the proactive reclaim thread.
    pub(crate) fn spawn_reclaimer(self: &Arc<Self>, rt: Handle) -> std::io::Result<Reclaimer> {
        let pager = self.clone();
        let thread = std::thread::Builder::new()
            .name("farmap-uffd-reclaim".into())
            .spawn(move || pager.reclaim_loop(&rt))?;
        Ok(Reclaimer {
            pager: self.clone(),
            thread: Some(thread),
        })
    }

    fn reclaim_loop(&self, rt: &Handle) {
        while !self.stop.load(Ordering::Acquire) {
            {
                let (m, cv) = &self.kick;
                let mut kicked = m.lock();
                if !*kicked {
                    cv.wait_for(&mut kicked, Duration::from_millis(5));
                }
                *kicked = false;
            }
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            let short = {
                let st = self.state.lock_yielding();
                self.limit().saturating_sub(st.resident) < self.low_water()
            };
            if short {
                rt.block_on(self.reclaim(self.min_free(), true));
            }
        }
    }
}
