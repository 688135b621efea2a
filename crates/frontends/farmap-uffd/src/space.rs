//! The address space a region lives in, as the pager, the region's memory and the tracker
//! reach it: an [`Area`] (memory they read, discard, or must know is still there) and
//! [`Moves`] (how pages move between two areas with `UFFDIO_MOVE`).
//!
//! Today both are this process's: an area is one of its mappings, and a move is issued
//! here. A region of another process (`farmap run`, docs/design/foreign-region.md) reaches
//! its areas through that process's `/proc/PID/mem` and asks the program's reaper thread to
//! move and discard pages, since the kernel refuses both across address spaces.

use std::io;
use std::sync::Arc;

use crate::mapping::Mapping;
use crate::uffd::UffdRange;

/// Memory of the region's address space: a mapping of this process.
#[derive(Debug, Clone)]
pub(crate) enum Area {
    /// A mapping of this process (the region, or its staging area).
    Local(Arc<Mapping>),
}

impl Area {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Area::Local(m) => m.len(),
        }
    }

    /// Copies `dst.len()` bytes at `offset` out of the area; false if it is gone. A local
    /// area's missing pages fault (see [`Mapping::read`] for the threads that must not call
    /// this).
    ///
    /// # Panics
    /// If the range is outside the area.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> bool {
        match self {
            Area::Local(m) => m.read(offset, dst),
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
        }
    }

    /// Runs `f` while the area is guaranteed to stay where it is (its addresses are not
    /// reused by another mapping meanwhile); `None` if it is gone.
    pub fn while_mapped<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        match self {
            Area::Local(m) => m.while_mapped(f),
        }
    }
}

/// Who issues the region's `UFFDIO_MOVE`s: this process.
#[derive(Debug, Clone)]
pub(crate) enum Moves {
    /// This process: the areas are its own.
    Local,
}

impl Moves {
    /// Moves the pages of `len` bytes at `from_off` of `from` to `to_off` of `to`
    /// ([`UffdRange::move_to`], with its `mode`); the bytes moved, or how many were moved
    /// before it stopped and the errno.
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
        match self {
            Moves::Local => from.move_to(from_off, to, to_off, len, mode),
        }
    }

    /// Whether the moves are issued in this process, so that a staged chunk's fault can move
    /// its pages back itself (in the reader, or in the faulting thread's signal handler).
    pub fn in_process(&self) -> bool {
        match self {
            Moves::Local => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mapping::OwnedMapping;

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
}
