//! The address space a region lives in, as the pager, the region's memory and the tracker
//! reach it: an [`Area`] (memory they read, discard, or must know is still there) and
//! [`Moves`] (how pages move between two areas with `UFFDIO_MOVE`).
//!
//! Either this process's: an area is one of its mappings, and a move is issued here. Or a
//! program's whose region this process serves (`farmap run`, docs/design/foreign-region.md):
//! an area is read through the program's `/proc/PID/mem`, and its reaper thread moves and
//! discards pages, which the kernel refuses across address spaces
//! ([`ForeignSpace`](crate::foreign::space::ForeignSpace)).

use std::io;
use std::sync::Arc;

use crate::foreign::space::ForeignSpace;
use crate::mapping::Mapping;
use crate::uffd::UffdRange;

/// Memory of the region's address space: a mapping of this process, or a range of a
/// program's.
#[derive(Debug, Clone)]
pub(crate) enum Area {
    /// A mapping of this process (the region, or its staging area).
    Local(Arc<Mapping>),
    /// `len` bytes at `base` in a program's address space.
    Foreign {
        space: Arc<ForeignSpace>,
        base: usize,
        len: usize,
    },
}

impl Area {
    /// Whether the area is in another process.
    pub fn is_foreign(&self) -> bool {
        matches!(self, Area::Foreign { .. })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Area::Local(m) => m.len(),
            Area::Foreign { len, .. } => *len,
        }
    }

    /// Copies `dst.len()` bytes at `offset` out of the area; false if it is gone or the read
    /// fails. A local area's missing pages fault (see [`Mapping::read`] for the threads that
    /// must not call this); a foreign area's fail the read (`EIO`, noted in the space).
    ///
    /// # Panics
    /// If the range is outside the area.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> bool {
        match self {
            Area::Local(m) => m.read(offset, dst),
            Area::Foreign { space, base, len } => {
                check_inside(offset, dst.len(), *len);
                space.read_at((base + offset) as u64, dst).is_ok()
            }
        }
    }

    /// Discards `len` bytes at `offset` (page-aligned, inside the area): their pages are
    /// freed and read as holes. `None` if the area is gone.
    ///
    /// # Panics
    /// If the range is unaligned or outside the area.
    pub fn discard(&self, offset: usize, len: usize) -> Option<io::Result<()>> {
        match self {
            Area::Local(m) => m.discard(offset, len),
            Area::Foreign {
                space,
                base,
                len: area_len,
            } => {
                check_inside(offset, len, *area_len);
                let page = crate::sys::page_size();
                assert!(
                    offset.is_multiple_of(page) && len.is_multiple_of(page),
                    "discard of {len:#x} bytes at {offset:#x} unaligned"
                );
                let start = (base + offset) as u64;
                space.is_alive().then(|| space.discard(start, len as u64))
            }
        }
    }

    /// Runs `f` while the area is guaranteed to stay where it is (its addresses are not
    /// reused by another mapping meanwhile); `None` if it is gone. A foreign area: while its
    /// session lives (nothing here can reuse a program's addresses; a program that unmaps
    /// its own area only makes our calls fail).
    pub fn while_mapped<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        match self {
            Area::Local(m) => m.while_mapped(f),
            Area::Foreign { space, .. } => space.is_alive().then(f),
        }
    }
}

/// Panics unless `len` bytes at `offset` lie inside an area of `area_len` bytes.
fn check_inside(offset: usize, len: usize, area_len: usize) {
    assert!(
        offset.checked_add(len).is_some_and(|end| end <= area_len),
        "{len:#x} bytes at {offset:#x} outside an area of {area_len:#x}"
    );
}

/// One move of [`Moves::move_many`]: `len` bytes at `from_off` of `from` to `to_off` of `to`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Move<'a> {
    pub from: &'a UffdRange,
    pub from_off: usize,
    pub to: &'a UffdRange,
    pub to_off: usize,
    pub len: usize,
}

/// Who issues the region's `UFFDIO_MOVE`s: this process, or the program's reaper.
#[derive(Debug, Clone)]
pub(crate) enum Moves {
    /// This process: the areas are its own.
    Local,
    /// The reaper of the program whose areas they are (the kernel refuses moves across
    /// address spaces).
    Reaper(Arc<ForeignSpace>),
}

impl Moves {
    /// Moves the pages of `len` bytes at `from_off` of `from` to `to_off` of `to`
    /// ([`UffdRange::move_to`], with its `mode`; the reaper picks its own); the bytes
    /// moved, or how many were moved before it stopped and the errno. Through the reaper,
    /// `EINVAL` is also a request out of the protocol's limits, and `ESRCH` a session that
    /// ended or a reaper lost (which ends it).
    ///
    /// # Panics
    /// If either range is unaligned or outside its area.
    pub fn move_pages(
        &self,
        from: &UffdRange,
        from_off: usize,
        to: &UffdRange,
        to_off: usize,
        len: usize,
        mode: u64,
    ) -> Result<usize, (usize, i32)> {
        let one = Move {
            from,
            from_off,
            to,
            to_off,
            len,
        };
        self.move_many(&[one], mode)
            .pop()
            .expect("one outcome per move")
    }

    /// [`move_pages`](Self::move_pages) of each of `moves`, in order, each whatever the ones
    /// before it came to (`mode` for this process's moves): through the reaper, a group of
    /// them to a round trip.
    ///
    /// # Panics
    /// If a range is unaligned or outside its area.
    pub fn move_many(&self, moves: &[Move<'_>], mode: u64) -> Vec<Result<usize, (usize, i32)>> {
        match self {
            Moves::Local => moves
                .iter()
                .map(|m| m.from.move_to(m.from_off, m.to, m.to_off, m.len, mode))
                .collect(),
            Moves::Reaper(space) => {
                let ops: Vec<farmap_run_proto::Op> = moves
                    .iter()
                    .map(|m| {
                        check_inside(m.from_off, m.len, m.from.len());
                        check_inside(m.to_off, m.len, m.to.len());
                        farmap_run_proto::Op::Move {
                            src: (m.from.base() + m.from_off) as u64,
                            dst: (m.to.base() + m.to_off) as u64,
                            len: m.len as u64,
                        }
                    })
                    .collect();
                space
                    .run(&ops)
                    .into_iter()
                    .map(|r| r.map(|n| n as usize).map_err(|(n, e)| (n as usize, e)))
                    .collect()
            }
        }
    }

    /// Discards `len` bytes at `off` of `area` for each of `ranges` (page-aligned, inside
    /// it) through the program's reaper, a group of them to a round trip: each one's
    /// outcome (an errno). `None` for this process's moves: discard the mapping itself.
    pub fn discard_many(&self, area: &UffdRange, ranges: &[(usize, usize)]) -> Option<Vec<i32>> {
        self.reaper_ops(area, ranges, |start, len| farmap_run_proto::Op::Discard {
            start,
            len,
        })
    }

    /// Writes nothing to each page of `ranges` of `area` (page-aligned, inside it) through
    /// the program's reaper ([`Op::Touch`](farmap_run_proto::Op::Touch)): pages a fork
    /// shared become the program's own again, and can move. Each range's errno; `None` for
    /// this process's regions (never shared with a child: `MADV_DONTFORK`).
    pub fn touch_many(&self, area: &UffdRange, ranges: &[(usize, usize)]) -> Option<Vec<i32>> {
        self.reaper_ops(area, ranges, |start, len| farmap_run_proto::Op::Touch {
            start,
            len,
        })
    }

    /// `op(address, length)` for each of `ranges` of `area` (page-aligned, inside it),
    /// through the program's reaper, a group of them to a round trip: each one's errno.
    /// `None` for this process's regions.
    fn reaper_ops(
        &self,
        area: &UffdRange,
        ranges: &[(usize, usize)],
        op: impl Fn(u64, u64) -> farmap_run_proto::Op,
    ) -> Option<Vec<i32>> {
        let Moves::Reaper(space) = self else {
            return None;
        };
        let ops: Vec<farmap_run_proto::Op> = ranges
            .iter()
            .map(|&(off, len)| {
                check_inside(off, len, area.len());
                op((area.base() + off) as u64, len as u64)
            })
            .collect();
        Some(
            space
                .run(&ops)
                .into_iter()
                .map(|r| r.err().map_or(0, |(_, e)| e))
                .collect(),
        )
    }

    /// Whether the moves are issued in this process, so that a staged chunk's fault can move
    /// its pages back itself (in the reader, or in the faulting thread's signal handler).
    pub fn in_process(&self) -> bool {
        match self {
            Moves::Local => true,
            Moves::Reaper(_) => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::foreign::testing::{end_session, serve, space_of};
    use crate::mapping::OwnedMapping;
    use crate::uffd::Uffd;

    #[test]
    fn a_local_area_reads_discards_and_ends_with_its_mapping() {
        let page = crate::sys::page_size();
        let mut owned = OwnedMapping::new(2 * page, None).unwrap();
        owned.slice().fill(0, 2 * page, 7).unwrap();
        let area = Area::Local(owned.shared());
        assert_eq!(area.len(), 2 * page);
        let mut buf = vec![0u8; 16];
        assert!(area.read(page - 8, &mut buf));
        assert_eq!(buf, [7; 16]);
        area.discard(page, page).unwrap().unwrap();
        assert!(area.read(page - 8, &mut buf));
        assert_eq!(buf[..8], [7; 8]);
        assert_eq!(buf[8..], [0; 8], "discarded pages read as zeros");
        assert_eq!(area.while_mapped(|| 1), Some(1));
        owned.unmap();
        assert!(!area.read(0, &mut buf));
        assert!(area.discard(0, page).is_none());
        assert_eq!(area.while_mapped(|| 1), None);
    }

    #[test]
    fn a_foreign_area_reads_through_the_mem_fd_and_the_reaper_moves_and_discards() {
        let test =
            "space::a_foreign_area_reads_through_the_mem_fd_and_the_reaper_moves_and_discards";
        let uffd = match Uffd::open(0) {
            Ok(u) => Arc::new(u),
            Err(e) => return farmap_testkit::skip(test, format!("userfaultfd: {e}")),
        };
        let long = Duration::from_secs(10);
        let Some((space, peer)) = space_of(test, std::process::id(), 0, long) else {
            return;
        };
        let space = Arc::new(space);
        let page = crate::sys::page_size();
        // Reads: this process's own memory, through its mem fd.
        let data: Vec<u8> = (0..2 * page).map(|i| (i % 253) as u8).collect();
        let here = Area::Foreign {
            space: space.clone(),
            base: data.as_ptr() as usize,
            len: data.len(),
        };
        assert_eq!(here.len(), 2 * page);
        let mut buf = vec![0u8; 100];
        assert!(here.read(page - 50, &mut buf));
        assert_eq!(buf[..], data[page - 50..page + 50]);
        assert_eq!(here.while_mapped(|| 1), Some(1));
        // Discards and moves: requests to the reaper (a stand-in: the addresses are made up).
        let (close, served) = serve(
            peer,
            vec![(0, page as u64), (libc::EBUSY, 0), (libc::ENOMEM, 0)],
        );
        let (r, s) = (1 << 30, 1 << 31);
        let there = Area::Foreign {
            space: space.clone(),
            base: r,
            len: 4 * page,
        };
        there.discard(page, page).unwrap().unwrap();
        let moves = Moves::Reaper(space.clone());
        assert!(!moves.in_process());
        let region = UffdRange::new(uffd.clone(), r, 4 * page);
        let staging = UffdRange::new(uffd, s, 4 * page);
        let mv = |len| moves.move_pages(&region, page, &staging, 0, len, 0);
        assert_eq!(mv(page), Err((0, libc::EBUSY)));
        let e = there.discard(0, page).unwrap().unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOMEM), "the reaper's refusal");
        drop(close);
        served.join().unwrap();
        assert_eq!(mv(2 * page), Err((0, libc::ESRCH)), "the reaper is lost");
        // Once the session ended: nothing reaches the program any more.
        end_session(&space);
        assert!(!here.read(0, &mut buf));
        assert!(there.discard(0, page).is_none());
        assert_eq!(here.while_mapped(|| 1), None);
        assert_eq!(mv(page), Err((0, libc::ESRCH)));
    }

    #[test]
    fn a_group_of_moves_or_discards_through_the_reaper_has_an_outcome_each() {
        let test = "space::a_group_of_moves_or_discards_through_the_reaper_has_an_outcome_each";
        let uffd = match Uffd::open(0) {
            Ok(u) => Arc::new(u),
            Err(e) => return farmap_testkit::skip(test, format!("userfaultfd: {e}")),
        };
        let Some((space, peer)) = space_of(test, std::process::id(), 0, Duration::from_secs(10))
        else {
            return;
        };
        let space = Arc::new(space);
        let page = crate::sys::page_size();
        let p = page as u64;
        let (close, served) = serve(
            peer,
            vec![
                (0, p),
                (libc::EAGAIN, 0),
                (0, 2 * p),
                (0, 2 * p),
                (libc::EINVAL, 0),
            ],
        );
        let (r, s) = (1usize << 30, 1usize << 31);
        let region = UffdRange::new(uffd.clone(), r, 4 * page);
        let staging = UffdRange::new(uffd, s, 4 * page);
        let mv = |off, len| Move {
            from: &region,
            from_off: off,
            to: &staging,
            to_off: off,
            len,
        };
        let moves = Moves::Reaper(space.clone());
        let group = [mv(0, page), mv(page, page), mv(2 * page, 2 * page)];
        assert_eq!(
            moves.move_many(&group, 0),
            vec![Ok(page), Err((0, libc::EAGAIN)), Ok(2 * page)]
        );
        assert_eq!(
            moves.discard_many(&staging, &[(0, 2 * page), (2 * page, page)]),
            Some(vec![0, libc::EINVAL])
        );
        assert_eq!(Moves::Local.discard_many(&staging, &[(0, page)]), None);
        drop(close);
        served.join().unwrap();
        assert_eq!(
            moves.move_many(&group, 0),
            vec![Err((0, libc::ESRCH)); 3],
            "the reaper is lost"
        );
    }
}
