//! Moving a chunk's pages between the region and its staging slot (or the trash) with
//! `UFFDIO_MOVE`, run by run over the pages actually present (see the module documentation:
//! a move that stops part way is finished, or undone, by the next one).

use super::Pager;
use crate::space::Move;
use crate::sys;
use crate::uffd::UffdRange;

/// `sorted` (ascending, no repeats) cut into runs of consecutive chunk indices.
pub(super) fn consecutive_runs(sorted: &[u64]) -> impl Iterator<Item = &[u64]> {
    sorted.chunk_by(|a, b| *a + 1 == *b)
}

impl Pager {
    /// The bytes of a run of consecutive chunks (not empty): its first one's offset and the
    /// length up to the end of its last one.
    pub(super) fn run_span(&self, run: &[u64]) -> (usize, usize) {
        let (off, _) = self.chunk_span(run[0]);
        let (last_off, last_len) = self.chunk_span(run[run.len() - 1]);
        (off, last_off + last_len - off)
    }

    /// Moves every page of `off..off+len` that is present in `from` to the same offset of
    /// `to`, run by run, with `UFFDIO_MOVE` (no wake-up). Holes of `from` are skipped, so
    /// the call is idempotent: after a partial move (`EAGAIN`: an event is pending or a page
    /// is busy) calling it again moves the rest. Called under the state lock, or by a
    /// deactivation on chunks it marked `Moving`: either keeps every other mover of this
    /// module away from the pages, so they stay where the page tables said they were.
    pub(super) fn move_present(
        &self,
        from: &UffdRange,
        to: &UffdRange,
        off: usize,
        len: usize,
    ) -> Result<(), i32> {
        self.move_present_to(from, off, to, off, len)
    }

    /// [`move_present`](Self::move_present) from `from_off` of `from` to `to_off` of `to`.
    pub(super) fn move_present_to(
        &self,
        from: &UffdRange,
        from_off: usize,
        to: &UffdRange,
        to_off: usize,
        len: usize,
    ) -> Result<(), i32> {
        let mut moves = Vec::new();
        self.present_moves(from, from_off, to, to_off, len, &mut moves)?;
        for m in moves {
            self.moves
                .move_pages(
                    m.from,
                    m.from_off,
                    m.to,
                    m.to_off,
                    m.len,
                    sys::UFFDIO_MOVE_MODE_DONTWAKE,
                )
                .map_err(|(_, e)| e)?;
        }
        Ok(())
    }

    /// [`move_present`](Self::move_present) of each `(off, len)` of `spans` from `from` to
    /// the same offset of `to`, all moves issued together (through a program's reaper, a
    /// group of them to a round trip, not one each): each span's outcome, whether every page
    /// of it was present (and moved), or the first errno of its moves (each move is tried
    /// whatever the others came to, so a span that failed may be partly moved, as after
    /// [`move_present`](Self::move_present)).
    pub(super) fn move_present_spans(
        &self,
        from: &UffdRange,
        to: &UffdRange,
        spans: &[(usize, usize)],
    ) -> Vec<Result<bool, i32>> {
        let mut outcomes: Vec<Result<bool, i32>> = Vec::with_capacity(spans.len());
        let mut moves = Vec::with_capacity(spans.len());
        // The span each move belongs to.
        let mut owner = Vec::with_capacity(spans.len());
        for (k, &(off, len)) in spans.iter().enumerate() {
            let before = moves.len();
            let scanned = self.present_moves(from, off, to, off, len, &mut moves);
            if scanned.is_err() {
                // Nothing of a span whose scan failed moves.
                moves.truncate(before);
            }
            let present: usize = moves[before..].iter().map(|m| m.len).sum();
            outcomes.push(scanned.map(|()| present == len));
            owner.resize(moves.len(), k);
        }
        let done = self.moves.move_many(&moves, sys::UFFDIO_MOVE_MODE_DONTWAKE);
        for (k, r) in owner.into_iter().zip(done) {
            if let (Ok(_), Err((_, e))) = (&outcomes[k], r) {
                outcomes[k] = Err(e);
            }
        }
        outcomes
    }

    /// Appends to `moves` one move per run of pages present in `from_off..from_off+len` of
    /// `from` (to the same place relative to `to_off` of `to`), from a scan of the page
    /// tables.
    fn present_moves<'a>(
        &self,
        from: &'a UffdRange,
        from_off: usize,
        to: &'a UffdRange,
        to_off: usize,
        len: usize,
        moves: &mut Vec<Move<'a>>,
    ) -> Result<(), i32> {
        let base = from.base();
        let mut scratch = Vec::new();
        self.pagemap
            .in_memory(
                base + from_off,
                base + from_off + len,
                &mut scratch,
                |run| {
                    let o = run.start - base;
                    moves.push(Move {
                        from,
                        from_off: o,
                        to,
                        to_off: to_off + (o - from_off),
                        len: run.end - run.start,
                    })
                },
            )
            .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))
    }

    /// Moves the pages of the staging slot at `off..off+len` back into the region with one
    /// `UFFDIO_MOVE` (holes of the slot skipped). The region's empty entries may carry
    /// write-protect markers (WP_UNPOPULATED: the tracker's scans protect holes too), which
    /// a move refuses as not empty (`EEXIST`): then they are cleared and the move tried once
    /// more. `Err` if it stopped part way (the pages moved stay in the region, and
    /// [`move_present`](Self::move_present) finishes the rest). Async-signal-safe. Only for
    /// areas of this process: the move is issued here.
    pub(super) fn move_slot_back(&self, off: usize, len: usize) -> Result<(), ()> {
        debug_assert!(
            self.moves.in_process(),
            "moves back are issued in this process"
        );
        let mode = sys::UFFDIO_MOVE_MODE_DONTWAKE | sys::UFFDIO_MOVE_MODE_ALLOW_SRC_HOLES;
        let mut moved = self.staging.move_to(off, &self.region, off, len, mode);
        if let Err((0, libc::EEXIST)) = moved {
            let _ = self.region.write_protect(off, len, false, false);
            moved = self.staging.move_to(off, &self.region, off, len, mode);
        }
        moved.map(|_| ()).map_err(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::consecutive_runs;

    #[test]
    fn runs_of_consecutive_chunks() {
        let runs: Vec<&[u64]> = consecutive_runs(&[1, 2, 3, 5, 7, 8, 10]).collect();
        assert_eq!(runs, [&[1, 2, 3][..], &[5], &[7, 8], &[10]]);
        assert_eq!(consecutive_runs(&[]).count(), 0);
        assert_eq!(consecutive_runs(&[4]).collect::<Vec<_>>(), [&[4][..]]);
    }
}
