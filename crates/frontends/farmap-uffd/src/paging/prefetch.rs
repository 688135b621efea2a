//! Sequential prefetch: after a fault, the chunks its thread's stream will touch next are
//! admitted for fetching, below the limit.

use farmap_core::ChunkIdx;

use super::state::St;
use super::stream::{Plan, MAX_STREAMS};
use super::Pager;
use crate::options::Prefetch;
use crate::stats::Counters;

impl Pager {
    /// After thread `tid`'s fault at chunk `idx` was served: moves its sequential stream on
    /// and admits the chunks to prefetch (marked fetching and prefetched; the caller fetches
    /// each and calls [`fetched`](Self::fetched)), as `(chunk, zero)` where `zero` says the
    /// chunk is to be filled with zero pages rather than read. Empty without prefetch.
    ///
    /// A fault at the chunk after the thread's last window doubles the window (up to the
    /// maximum) and counts the last window's chunks still marked prefetched as hits; the
    /// first fault inside the window (the thread caught up with chunks still being fetched)
    /// extends it by as much again, ahead of the thread; any other fault closes it (and
    /// forgets what the stream left behind for drop-behind). Chunks already local are skipped;
    /// admission stops at the limit, or while a reclaim pass runs at the limit plus
    /// `min_free` as a fault's does (prefetch never waits for room; it wakes the reclaim
    /// thread instead).
    pub(crate) fn prefetch_after(&self, tid: u32, idx: ChunkIdx) -> Vec<(ChunkIdx, bool)> {
        let Prefetch::Sequential { max_chunks } = self.prefetch else {
            return Vec::new();
        };
        let count = self.geometry.chunk_count();
        let plan = {
            let mut streams = self.streams.lock();
            if streams.len() >= MAX_STREAMS && !streams.contains_key(&tid) {
                streams.clear();
            }
            streams
                .entry(tid)
                .or_default()
                .advance(idx.0, count, max_chunks)
        };
        let Some(Plan {
            confirm,
            start,
            window,
            extend,
            behind,
            ended,
        }) = plan
        else {
            return Vec::new();
        };
        let mut st = self.state.lock();
        let mut used = 0;
        for i in confirm {
            used += u64::from(std::mem::take(&mut st.prefetched[i as usize]));
        }
        Counters::add(&self.counters.prefetch_hits, used);
        if ended {
            // What an ended stream left behind is judged by the clock like everything else.
            // Dropped first whatever its use, it was the resident set the thread worked on
            // next: `bench paging --pattern zipf` after its sequential init faulted 44,000
            // times instead of 38,700.
            st.behind.clear();
        }
        if !behind.is_empty() {
            let n = st.chunk.len();
            if st.behind.len() + (behind.end - behind.start) as usize > n {
                st.behind.clear();
            }
            st.behind.extend(behind);
        }
        let limit = self.limit();
        let mut admitted = Vec::new();
        // The chunks after `idx` that are local or admitted now: the window as it stands
        // (it ends early at the limit, and the next fault after it continues the stream).
        let mut covered = 0;
        for i in start..start + window {
            let iu = i as usize;
            let zero = match st.chunk[iu] {
                St::Remote => false,
                // Removed: its old page may be mapped until the zap; only a fault fills it.
                St::Zero if st.is_removed(i) => {
                    covered += 1;
                    continue;
                }
                St::Zero => true,
                _ => {
                    covered += 1;
                    continue;
                }
            };
            // At the limit, prefetch goes on into the headroom a fault may use (`min_free`
            // over the limit) while a reclaim pass makes room: a sequential stream whose
            // faults went over the limit would otherwise stop prefetching and fault chunk
            // by chunk (`bench paging --pattern seq`: twice the faults).
            // (The pass is looked for only at the limit.)
            if st.resident >= limit
                && (st.resident >= limit + self.min_free() || !self.reclaiming())
            {
                self.kick();
                break;
            }
            st.resident += 1;
            st.chunk[iu] = St::Fetching { new: true, zero };
            st.prefetched[iu] = true;
            self.evict_from_cache(ChunkIdx(i));
            admitted.push((ChunkIdx(i), zero));
            covered += 1;
        }
        if limit.saturating_sub(st.resident) < self.low_water() {
            self.kick();
        }
        drop(st);
        if let Some(s) = self.streams.lock().get_mut(&tid) {
            s.settle(start, covered, extend);
        }
        Counters::add(&self.counters.prefetched, admitted.len() as u64);
        admitted
    }
}
