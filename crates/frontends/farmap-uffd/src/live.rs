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
    /// Copies `dst.len()` bytes at `offset` out of the region as it is now, with volatile
    /// loads. Missing pages are fetched first (the calling thread waits for the handler, which
    /// runs on the region's own threads: never call this on them). Bytes the application
    /// writes during the copy may be copied torn; such a write is reported by the next
    /// [`take_dirty`](Self::take_dirty).
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<(), RegionError> {
        Ok(self.memory().read_into(offset, dst)?)
    }

    /// The `len` bytes at `offset`, copied as [`read_at`](Self::read_at) copies them, into a
    /// new buffer that is not zeroed first.
    pub fn read_vec_at(&self, offset: usize, len: usize) -> Result<Vec<u8>, RegionError> {
        Ok(self.memory().read_vec(offset, len)?)
    }

    /// Writes `src` at `offset` into the region with volatile stores (missing pages are
    /// fetched first; the write is tracked). Concurrent writes to the same bytes race like
    /// any shared memory: the bytes end up old or new.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<(), RegionError> {
        Ok(self.memory().write_from(offset, src)?)
    }

    /// Discards the pages of `runs` (page indices, ascending or not) with
    /// `madvise(MADV_DONTNEED)`: their chunks become absent, and the next touch (or
    /// [`fetch_chunks`](Self::fetch_chunks)) fetches them from the store again; pages of those
    /// chunks that were not discarded keep their content. (A bounded region whose discarded
    /// pages mean zeros, a test switch of the pager's, reads zeros there instead, and pushes
    /// them.) Each run costs one system call and
    /// one round trip through the fault reader.
    ///
    /// The caller makes sure that no fetch of these chunks is in flight (a fetch that started
    /// before the discard may install the data it read before).
    pub fn discard_pages(&self, runs: &[Range<u64>]) -> Result<(), RegionError> {
        let page = self.page_size() as u64;
        let pages = self.len() as u64 / page;
        if runs.iter().any(|r| r.start < r.end && r.end > pages) {
            return Err(RegionError::Geometry {
                size: self.geometry().size(),
                chunk_size: self.geometry().chunk_size(),
                reason: "pages to discard reach past the end of the region",
            });
        }
        for r in runs.iter().filter(|r| r.start < r.end) {
            let (offset, len) = (
                (r.start * page) as usize,
                ((r.end - r.start) * page) as usize,
            );
            match self.mapping().discard(offset, len) {
                None => return Err(RegionError::Closed),
                Some(Ok(())) => {
                    // The reader may not have handled the remove event yet: its chunks must
                    // be absent before this returns. A pager that makes them zero is told
                    // by the reader, which holds the events' order from its read of the
                    // event to the end of its handling: wait for that.
                    let inner = self.inner();
                    if inner.pager.as_ref().is_some_and(|p| p.zeroes_removed()) {
                        drop(inner.server.events.order().read());
                    }
                    let base = self.as_ptr() as usize;
                    inner.server.forget(base + offset, base + offset + len);
                }
                Some(Err(e)) => {
                    return Err(RegionError::sys(
                        "discarding pages with madvise(MADV_DONTNEED)",
                        e,
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

    /// Whether the chunks under `offset..offset + len` are all present: a read of them then
    /// waits for no fetch (unless the application discards their pages meanwhile, which
    /// makes the read wait for the region's own handler).
    pub fn holds(&self, offset: usize, len: usize) -> bool {
        let g = self.geometry();
        let Some(end) = offset.checked_add(len).filter(|e| *e as u64 <= g.size()) else {
            return false;
        };
        if len == 0 {
            return true;
        }
        let shift = g.chunk_shift();
        let cache = &self.inner().server.cache;
        ((offset as u64 >> shift)..=((end as u64 - 1) >> shift))
            .all(|i| cache.is_present(ChunkIdx(i)))
    }

    /// Whether every chunk is present (nothing will be fetched from the store unless pages
    /// are discarded).
    pub fn is_complete(&self) -> bool {
        self.inner().server.cache.is_complete()
    }
}
