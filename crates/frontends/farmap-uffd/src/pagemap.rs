//! `PAGEMAP_SCAN` on `/proc/<pid>/pagemap`: which pages were written (and re-protecting them
//! in the same call), and which pages are present.
//!
//! Facts this relies on (measured on this kernel by the research prototype):
//! - With `PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC` and `PAGE_IS_WRITTEN` as both
//!   category and return mask, one call returns the written pages and write-protects them
//!   atomically with respect to concurrent writers: a write is reported by this scan or by
//!   the next, never lost.
//! - Pages that hold nothing (never touched, discarded by `MADV_DONTNEED`, poisoned) are
//!   reported as written too. Asking for `PAGE_IS_PRESENT | PAGE_IS_SWAPPED` in the return
//!   mask tells them apart: only a written page that is present or swapped holds data.
//! - A full result vector stops the walk early; `walk_end` says where to continue.

use std::io;
use std::os::fd::{AsFd, OwnedFd};

use crate::sys::{self, PageRegion};

/// Entries per `PAGEMAP_SCAN` call when the caller's scratch vector has no capacity yet.
const VEC_LEN: usize = 1024;

/// What one walk asks `PAGEMAP_SCAN` for: its flags and category masks (a page is reported
/// when, after the `inverted` categories are flipped, it has every category of
/// `category_mask` and one of `anyof`, if any; `return_mask` is what it reports of it).
#[derive(Debug, Clone, Copy)]
struct Query {
    flags: u64,
    category_mask: u64,
    anyof: u64,
    inverted: u64,
    return_mask: u64,
}

impl Query {
    /// Written pages, with whether they hold data; no flag (nothing is write-protected).
    const WRITTEN: Query = Query {
        flags: 0,
        category_mask: sys::PAGE_IS_WRITTEN,
        anyof: 0,
        inverted: 0,
        return_mask: sys::PAGE_IS_WRITTEN | sys::PAGE_IS_PRESENT | sys::PAGE_IS_SWAPPED,
    };
    /// Pages that hold data: present or swapped.
    const HOLDS_DATA: Query = Query {
        flags: 0,
        category_mask: 0,
        anyof: sys::PAGE_IS_PRESENT | sys::PAGE_IS_SWAPPED,
        inverted: 0,
        return_mask: sys::PAGE_IS_PRESENT | sys::PAGE_IS_SWAPPED,
    };
    /// Pages present in memory.
    const IN_MEMORY: Query = Query {
        flags: 0,
        category_mask: sys::PAGE_IS_PRESENT,
        anyof: 0,
        inverted: 0,
        return_mask: sys::PAGE_IS_PRESENT,
    };
    /// Pages present in memory that are not the shared zero page.
    const NOT_ZERO_PAGE: Query = Query {
        flags: 0,
        category_mask: sys::PAGE_IS_PRESENT | sys::PAGE_IS_PFNZERO,
        anyof: 0,
        inverted: sys::PAGE_IS_PFNZERO,
        return_mask: sys::PAGE_IS_PRESENT,
    };
}

/// An open `/proc/<pid>/pagemap`: the page tables of the process it was opened for (the file
/// keeps that address space; it can be sent to another process, which then scans ours).
#[derive(Debug)]
pub struct Pagemap {
    fd: OwnedFd,
}

/// A run of pages with the same categories, as addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageRun {
    /// First byte.
    pub start: usize,
    /// One past the last byte.
    pub end: usize,
    /// Whether the pages hold data (present or swapped); written runs without it are holes.
    pub has_data: bool,
}

impl Pagemap {
    /// Opens this process's pagemap.
    pub fn open_self() -> io::Result<Pagemap> {
        let fd = rustix::fs::open(
            "/proc/self/pagemap",
            rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )?;
        Ok(Pagemap { fd })
    }

    /// Adopts a pagemap fd (received from the process it describes).
    pub fn from_owned(fd: OwnedFd) -> Pagemap {
        Pagemap { fd }
    }

    /// Another handle on the same file (a `dup`: the same process's page tables), for a
    /// second user of one pagemap received from another process.
    pub fn try_clone(&self) -> io::Result<Pagemap> {
        Ok(Pagemap {
            fd: self.fd.try_clone()?,
        })
    }

    /// The file descriptor (to send it).
    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// One scan call for `query`; returns the regions found and where the walk ended.
    fn scan(
        &self,
        start: usize,
        end: usize,
        query: Query,
        vec: &mut Vec<PageRegion>,
    ) -> io::Result<usize> {
        let len = if vec.capacity() == 0 {
            VEC_LEN
        } else {
            vec.capacity()
        };
        vec.clear();
        vec.resize(len, PageRegion::default());
        let mut arg = sys::PmScanArg {
            size: 0,
            flags: query.flags,
            start: start as u64,
            end: end as u64,
            walk_end: 0,
            vec: 0,
            vec_len: 0,
            max_pages: 0,
            category_inverted: query.inverted,
            category_mask: query.category_mask,
            category_anyof_mask: query.anyof,
            return_mask: query.return_mask,
        };
        let n = sys::pagemap_scan(self.fd.as_fd(), &mut arg, vec)
            .map_err(io::Error::from_raw_os_error)?;
        vec.truncate(n);
        Ok(arg.walk_end as usize)
    }

    /// Walks `start..end` for `query`, calling `f` for each run found, until the walk
    /// reaches `end`.
    fn walk(
        &self,
        start: usize,
        end: usize,
        query: Query,
        vec: &mut Vec<PageRegion>,
        mut f: impl FnMut(PageRun),
    ) -> io::Result<()> {
        let mut cur = start;
        // Where the runs reported so far end: the kernel can report a range again in a
        // later call (its walk ended before the end of the last run it returned: measured
        // on Linux 6.18 with a full vector, 5,554 pages counted twice in a 64k-page area),
        // so each run is clipped to what was not reported yet.
        let mut reported = start;
        while cur < end {
            let walk_end = self.scan(cur, end, query, vec)?;
            for r in vec.iter() {
                let (s, e) = ((r.start as usize).max(reported), r.end as usize);
                if s >= e {
                    continue;
                }
                reported = e;
                f(PageRun {
                    start: s,
                    end: e,
                    has_data: r.categories & (sys::PAGE_IS_PRESENT | sys::PAGE_IS_SWAPPED) != 0,
                });
            }
            if walk_end <= cur {
                // No progress (cannot happen: only a full vector stops a walk early, and a
                // full vector means progress); stop rather than spin.
                break;
            }
            cur = walk_end;
        }
        Ok(())
    }

    /// Reports the written pages of `start..end` (runs with `has_data` false are holes: never
    /// populated, discarded or poisoned) and write-protects them again, atomically with respect
    /// to concurrent writers. The range must be registered with `WP_ASYNC` (else `EPERM`).
    /// `vec` is scratch space, reused between calls.
    pub fn collect_written(
        &self,
        start: usize,
        end: usize,
        vec: &mut Vec<PageRegion>,
        f: impl FnMut(PageRun),
    ) -> io::Result<()> {
        let query = Query {
            flags: sys::PM_SCAN_WP_MATCHING | sys::PM_SCAN_CHECK_WPASYNC,
            ..Query::WRITTEN
        };
        self.walk(start, end, query, vec, f)
    }

    /// Reports the written pages of `start..end` (written since they were last
    /// write-protected; runs with `has_data` false are holes) without protecting them again:
    /// a look that takes nothing from the write tracking.
    pub fn peek_written(
        &self,
        start: usize,
        end: usize,
        vec: &mut Vec<PageRegion>,
        f: impl FnMut(PageRun),
    ) -> io::Result<()> {
        self.walk(start, end, Query::WRITTEN, vec, f)
    }

    /// Reports the runs of `start..end` that hold data (present or swapped pages); changes
    /// nothing.
    pub fn present(
        &self,
        start: usize,
        end: usize,
        vec: &mut Vec<PageRegion>,
        f: impl FnMut(PageRun),
    ) -> io::Result<()> {
        self.walk(start, end, Query::HOLDS_DATA, vec, f)
    }

    /// Reports the runs of `start..end` whose pages are present in memory (not swapped, not
    /// write-protect markers on empty entries); changes nothing.
    pub fn in_memory(
        &self,
        start: usize,
        end: usize,
        vec: &mut Vec<PageRegion>,
        f: impl FnMut(PageRun),
    ) -> io::Result<()> {
        self.walk(start, end, Query::IN_MEMORY, vec, f)
    }

    /// The runs of `start..end` present in memory that are not the shared zero page.
    pub fn data_in_memory(
        &self,
        start: usize,
        end: usize,
        vec: &mut Vec<PageRegion>,
        f: impl FnMut(PageRun),
    ) -> io::Result<()> {
        self.walk(start, end, Query::NOT_ZERO_PAGE, vec, f)
    }

    /// Whether a page of `start..end` is present in memory and not the shared zero page
    /// (something wrote it, or filled it with data).
    pub fn any_not_zero_page(&self, start: usize, end: usize) -> io::Result<bool> {
        let mut vec = Vec::with_capacity(16);
        let mut found = false;
        self.walk(start, end, Query::NOT_ZERO_PAGE, &mut vec, |_| found = true)?;
        Ok(found)
    }

    /// Whether the runs `query` finds cover every page of `start..end`.
    fn covers(&self, start: usize, end: usize, query: Query) -> io::Result<bool> {
        let mut vec = Vec::with_capacity(16);
        let mut covered = 0;
        self.walk(start, end, query, &mut vec, |run| {
            covered += run.end - run.start
        })?;
        Ok(covered == end - start)
    }

    /// Whether every page of `start..end` is present in memory.
    pub fn all_in_memory(&self, start: usize, end: usize) -> io::Result<bool> {
        self.covers(start, end, Query::IN_MEMORY)
    }

    /// Whether every page of `start..end` holds data.
    pub fn all_present(&self, start: usize, end: usize) -> io::Result<bool> {
        self.covers(start, end, Query::HOLDS_DATA)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mapping::OwnedMapping;

    /// Present pages by a plain read of `/proc/self/pagemap` (bit 63 of each entry).
    fn present_by_read(start: usize, pages: usize) -> usize {
        use std::io::{Read, Seek, SeekFrom};
        let mut f = std::fs::File::open("/proc/self/pagemap").unwrap();
        let page = crate::sys::page_size();
        f.seek(SeekFrom::Start((start / page * 8) as u64)).unwrap();
        let mut buf = vec![0u8; pages * 8];
        f.read_exact(&mut buf).unwrap();
        buf.chunks(8)
            .filter(|e| u64::from_le_bytes((*e).try_into().unwrap()) >> 63 == 1)
            .count()
    }

    /// Many runs (more than a scan's vector holds, and more than the kernel's own buffer):
    /// every present page counted once, as a plain read of the pagemap counts them.
    #[test]
    fn a_walk_over_many_runs_counts_each_page_once() {
        let page = crate::sys::page_size();
        let pages = 16 * VEC_LEN;
        let m = OwnedMapping::new(pages * page, None).unwrap();
        // Runs of 1 to 3 present pages between holes of 1 to 2 pages.
        let (mut p, mut k) = (0, 0usize);
        while p < pages {
            let run = 1 + k % 3;
            for q in p..(p + run).min(pages) {
                m.slice().store_u8(q * page, 1).unwrap();
            }
            p += run + 1 + k % 2;
            k += 1;
        }
        let pagemap = Pagemap::open_self().unwrap();
        let mut scratch = Vec::new();
        let (mut counted, mut last_end) = (0, 0);
        pagemap
            .in_memory(m.addr(), m.addr() + pages * page, &mut scratch, |run| {
                assert!(run.start >= last_end, "runs overlap");
                last_end = run.end;
                counted += (run.end - run.start) / page;
            })
            .unwrap();
        assert_eq!(counted, present_by_read(m.addr(), pages));
        assert!(k > 2 * VEC_LEN, "{k} runs only");
    }
}
