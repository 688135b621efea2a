//! Moving a chunk's pages between the region and its staging slot (or the trash) with
//! `UFFDIO_MOVE`, run by run over the pages actually present (see the module documentation:
//! a move that stops part way is finished, or undone, by the next one).

use super::Pager;
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
        let base = from.base();
        let mut runs = Vec::new();
        let mut scratch = Vec::new();
        self.pagemap
            .in_memory(
                base + from_off,
                base + from_off + len,
                &mut scratch,
                |run| runs.push((run.start - base, run.end - run.start)),
            )
            .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
        for (o, l) in runs {
            self.moves
                .move_pages(
                    from,
                    o,
                    to,
                    to_off + (o - from_off),
                    l,
                    sys::UFFDIO_MOVE_MODE_DONTWAKE,
                )
                .map_err(|(_, e)| e)?;
        }
        Ok(())
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
