//! What live migration needs from a region: reading its memory at any offset while the
//! application writes it, discarding pages (so that their next touch fetches them again),
//! fetching chunks on request, and knowing when every chunk is local.
//!
//! These add to [`Region`] without changing anything else it does.

use std::future::Future;
use std::ops::Range;
use std::sync::Arc;

use farmap_core::ChunkIdx;
use parking_lot::Mutex;

use crate::error::RegionError;
use crate::region::Region;

impl Region {
    /// Copies `dst.len()` bytes at `offset` out of the region as it is now. Missing pages are
    /// fetched first (the calling thread waits for the handler, which runs on the region's own
    /// threads). Bytes the application writes during the copy may be copied torn; such a write
    /// is reported by the next [`take_dirty`](Self::take_dirty).
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<(), RegionError> {
        if offset
            .checked_add(dst.len())
            .is_none_or(|end| end > self.len())
        {
            return Err(RegionError::Geometry {
                size: self.geometry().size(),
                chunk_size: self.geometry().chunk_size(),
                reason: "a read reaches past the end of the region",
            });
        }
        if self.mapping().read(offset, dst) {
            Ok(())
        } else {
            Err(RegionError::Closed)
        }
    }

    /// Writes `src` at `offset` into the region, like a store through a raw pointer (missing
    /// pages are fetched first; the write is tracked). For workloads that share the region
    /// between threads: concurrent writes to the same bytes race like any plain memory.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<(), RegionError> {
        if offset
            .checked_add(src.len())
            .is_none_or(|end| end > self.len())
        {
            return Err(RegionError::Geometry {
                size: self.geometry().size(),
                chunk_size: self.geometry().chunk_size(),
                reason: "a write reaches past the end of the region",
            });
        }
        self.mapping()
            .while_mapped(|| {
                // SAFETY: the range lies inside the mapping (checked), mapped while
                // `while_mapped` runs; `src` is a distinct buffer. The region is plain shared
                // memory: other threads may read or write the same bytes concurrently and see
                // old or new bytes (the aliasing contract of the crate documentation).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        src.as_ptr(),
                        self.as_ptr().add(offset),
                        src.len(),
                    )
                }
            })
            .ok_or(RegionError::Closed)
    }

    /// Discards the pages of `runs` (page indices, ascending or not) with
    /// `madvise(MADV_DONTNEED)`: their chunks become absent, and the next touch (or
    /// [`fetch_chunks`](Self::fetch_chunks)) fetches them from the store again; pages of those
    /// chunks that were not discarded keep their content. Each run costs one system call and
    /// one round trip through the fault reader.
    ///
    /// The caller makes sure that no fetch of these chunks is in flight (a fetch that started
    /// before the discard may install the data it read before).
    pub fn discard_pages(&self, runs: &[Range<u64>]) -> Result<(), RegionError> {
        let page = self.page_size() as u64;
        let pages = self.len() as u64 / page;
        for r in runs {
            if r.start >= r.end {
                continue;
            }
            if r.end > pages {
                return Err(RegionError::Geometry {
                    size: self.geometry().size(),
                    chunk_size: self.geometry().chunk_size(),
                    reason: "pages to discard reach past the end of the region",
                });
            }
            let done = self.mapping().while_mapped(|| {
                // SAFETY: the range lies inside the region's mapping (checked above), which
                // stays mapped while `while_mapped` runs. Discarding pages of a registered
                // region is part of its contract: the handler reads the REMOVE event, makes
                // the chunks absent and later refills the pages; no Rust reference into the
                // region is invalidated (the pages read as their refetched content).
                unsafe {
                    libc::madvise(
                        self.as_ptr().add((r.start * page) as usize).cast(),
                        ((r.end - r.start) * page) as usize,
                        libc::MADV_DONTNEED,
                    )
                }
            });
            match done {
                None => return Err(RegionError::Closed),
                Some(0) => {}
                Some(_) => {
                    return Err(RegionError::sys(
                        "discarding pages with madvise(MADV_DONTNEED)",
                        std::io::Error::last_os_error(),
                    ))
                }
            }
        }
        Ok(())
    }

    /// Makes `chunks` present, fetching the absent ones from the store with `parallel` fetches
    /// in flight on the region's runtime (a chunk a fault or the puller fetches meanwhile is
    /// fetched once). Resolves when all are present, or with the first error.
    pub fn fetch_chunks(
        &self,
        chunks: Vec<ChunkIdx>,
        parallel: usize,
    ) -> impl Future<Output = Result<(), RegionError>> + Send + 'static {
        let inner = self.inner().clone();
        let queue = Arc::new(Mutex::new(chunks.into_iter()));
        let tasks: Vec<_> = (0..parallel.max(1))
            .map(|_| {
                let queue = queue.clone();
                let cache = inner.server.cache.clone();
                inner.handle.spawn(async move {
                    loop {
                        let Some(idx) = queue.lock().next() else {
                            return Ok(());
                        };
                        cache.fetch(idx).await?;
                    }
                })
            })
            .collect();
        async move {
            let mut first = None;
            for t in tasks {
                match t.await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        first.get_or_insert(RegionError::Read(e));
                    }
                    Err(_) => {
                        first.get_or_insert(RegionError::Closed);
                    }
                }
            }
            first.map_or(Ok(()), Err)
        }
    }

    /// Whether every chunk is present (nothing will be fetched from the store unless pages
    /// are discarded).
    pub fn is_complete(&self) -> bool {
        self.inner().server.cache.is_complete()
    }
}
