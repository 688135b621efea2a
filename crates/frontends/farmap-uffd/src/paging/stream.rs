//! A faulting thread's sequential stream, for prefetch: the window it moves on to at each
//! fault, and what falls behind it (see the module documentation's eviction policy).

use std::ops::Range;

/// A faulting thread's sequential stream (prefetch).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Stream {
    /// The chunk whose fault would continue the stream.
    next: Option<u64>,
    /// The window, in chunks (0: closed).
    window: u64,
    /// The chunks prefetched for this window: `next - pending .. next`.
    pending: u64,
    /// A fault inside the window has already extended it.
    extended: bool,
    /// The first chunk behind the thread not queued for drop-behind yet.
    behind: u64,
}

/// Threads whose streams are remembered at most (a process that churns through threads
/// forgets them all and starts over).
pub(super) const MAX_STREAMS: usize = 4096;

/// Most chunks one sequential fault queues for drop-behind (a stream that jumped far ahead
/// does not queue everything it skipped).
const MAX_BEHIND: u64 = 4096;

/// What a fault does with its thread's stream ([`Stream::advance`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Plan {
    /// The last window's chunks, to count as hits where still marked prefetched.
    pub(super) confirm: Range<u64>,
    /// The chunks to prefetch: `start..start + window`.
    pub(super) start: u64,
    pub(super) window: u64,
    /// The window extends the current one (a fault inside it) rather than replacing it.
    pub(super) extend: bool,
    /// The chunks to queue for drop-behind.
    pub(super) behind: Range<u64>,
    /// The fault ended a sequential stream (the thread jumped elsewhere): what it left
    /// behind and has not been dropped yet is not behind anything any more.
    pub(super) ended: bool,
}

impl Stream {
    /// Moves the stream on for a fault at chunk `idx` of `count`, with windows of at most
    /// `max_chunks`; `None` when there is nothing to prefetch (a fault inside a window that
    /// was extended already, or one at the end of the region).
    pub(super) fn advance(&mut self, idx: u64, count: u64, max_chunks: u32) -> Option<Plan> {
        let s = self;
        let sequential = s.next == Some(idx);
        // A fault inside the window: a prefetched chunk still being fetched (the thread
        // is woken before its window is fetched, and catches up with it). The thread is
        // that close behind: extend the window once by as much again, ahead of it.
        let inside = s
            .next
            .filter(|&next| !sequential && idx < next && idx >= next - s.pending);
        if let Some(next) = inside {
            if s.extended || next >= count {
                return None;
            }
            s.extended = true;
            Some(Plan {
                confirm: 0..0,
                start: next,
                window: s.window.min(count - next),
                extend: true,
                behind: 0..0,
                ended: false,
            })
        } else {
            let ended = !sequential && s.window > 0;
            let confirm = if sequential {
                idx - s.pending..idx
            } else {
                0..0
            };
            s.window = if sequential {
                (s.window * 2).clamp(1, u64::from(max_chunks.max(1)))
            } else {
                0
            };
            s.extended = false;
            // Drop-behind: the chunks more than a maximal window behind the thread.
            let behind = if sequential {
                let upto = idx.saturating_sub(u64::from(max_chunks.max(1)));
                let from = s.behind.max(upto.saturating_sub(MAX_BEHIND));
                s.behind = s.behind.max(upto);
                from..upto
            } else {
                s.behind = idx;
                0..0
            };
            Some(Plan {
                confirm,
                start: idx + 1,
                window: s.window.min(count - 1 - idx),
                extend: false,
                behind,
                ended,
            })
        }
    }

    /// Records what the fault's [`Plan`] came to: the `covered` chunks from `start` on are
    /// local or being fetched (the window as it stands: it ends early at the limit, and the
    /// next fault after it continues the stream).
    pub(super) fn settle(&mut self, start: u64, covered: u64, extend: bool) {
        self.pending = if extend {
            self.pending + covered
        } else {
            covered
        };
        self.next = Some(start + covered);
    }
}

#[cfg(test)]
mod tests {
    use super::{Plan, Stream};

    /// Advances `s` for a fault at `idx` (of 100 chunks, windows of at most 4) and settles
    /// it as if the whole window were admitted.
    fn fault(s: &mut Stream, idx: u64) -> Option<Plan> {
        let plan = s.advance(idx, 100, 4)?;
        s.settle(plan.start, plan.window, plan.extend);
        Some(plan)
    }

    #[test]
    fn windows_double_extend_once_and_leave_chunks_behind() {
        let mut s = Stream::default();
        // A first fault opens nothing; the next chunk's fault opens a window of 1, then 2.
        let p = fault(&mut s, 10).unwrap();
        assert_eq!((p.start, p.window, p.extend), (11, 0, false));
        let p = fault(&mut s, 11).unwrap();
        assert_eq!((p.start, p.window, p.confirm), (12, 1, 11..11));
        let p = fault(&mut s, 13).unwrap();
        assert_eq!((p.start, p.window, p.confirm), (14, 2, 12..13));
        assert!(p.behind.is_empty());
        // A fault inside the window (14..16) extends it once, by as much again.
        let p = fault(&mut s, 15).unwrap();
        assert_eq!((p.start, p.window, p.extend), (16, 2, true));
        assert_eq!(fault(&mut s, 17), None);
        // The chunk after the window: doubled up to the maximum; the chunks more than a
        // maximal window behind go to drop-behind.
        let p = fault(&mut s, 18).unwrap();
        assert_eq!((p.start, p.window, p.extend), (19, 4, false));
        assert_eq!((p.confirm, p.behind), (14..18, 10..14));
        assert!(!p.ended);
        // Any other fault closes the window, and ends the stream.
        let p = fault(&mut s, 50).unwrap();
        assert_eq!((p.start, p.window, p.behind), (51, 0, 0..0));
        assert!(p.ended, "a jump ends an open stream");
        // A window never goes past the region's end.
        let p = fault(&mut s, 51).unwrap();
        assert_eq!(p.window, 1);
        let mut s = Stream::default();
        fault(&mut s, 98);
        assert_eq!(fault(&mut s, 99).unwrap().window, 0);
        // A jump from a stream that never opened a window ends nothing.
        let mut s = Stream::default();
        fault(&mut s, 5);
        assert!(!fault(&mut s, 70).unwrap().ended);
    }
}
