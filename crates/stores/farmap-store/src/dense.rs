//! A dense in-memory store: pre-allocated memory that every chunk is really copied into.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use farmap_core::{
    BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, Geometry, Store, StoreResult,
};
use parking_lot::RwLock;

/// Page size used to touch fresh buffers (the smallest page on every Linux target).
const PAGE: usize = 4096;

/// One chunk's bytes and whether they hold written data.
struct Slot {
    data: Box<[u8]>,
    written: bool,
}

/// A store holding the whole region in memory allocated up front, with every write copied in
/// and every read copied out.
///
/// Where [`MemoryStore`](crate::MemoryStore) only keeps references to the caller's buffers,
/// this store costs what a real memory-backed device costs: a `memcpy` of the chunk in each
/// direction and an allocation per read. Every page is written once at construction, so no
/// page fault happens later on the data path (construction of a large region therefore takes
/// a while and commits all of its memory).
///
/// Trim zeroes the chunk in place: it releases no memory, so [`Caps::TRIM`] is not reported.
///
/// # Concurrency
/// - One `parking_lot::RwLock` per chunk: reads of a chunk share it, a write or trim of that
///   chunk holds it alone while copying. Different chunks never contend.
/// - A write replaces a chunk whole: a concurrent read copies the old or the new content.
/// - [`status`](Store::status) and [`with_chunk`](Self::with_chunk) take the chunk's read lock.
pub struct DenseMemoryStore {
    geometry: Geometry,
    chunks: Box<[RwLock<Slot>]>,
    written: AtomicU64,
}

impl DenseMemoryStore {
    /// Allocates and touches the memory of the whole region (all zeros).
    ///
    /// # Panics
    /// Aborts like any allocation if the memory cannot be had.
    pub fn new(geometry: Geometry) -> Self {
        let chunks = geometry
            .all()
            .iter()
            .map(|idx| {
                let mut data = vec![0u8; geometry.chunk_len(idx)].into_boxed_slice();
                touch(&mut data);
                RwLock::new(Slot {
                    data,
                    written: false,
                })
            })
            .collect();
        Self {
            geometry,
            chunks,
            written: AtomicU64::new(0),
        }
    }

    /// Number of chunks written and not trimmed since.
    pub fn written_chunks(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }

    /// Calls `f` with the bytes of chunk `idx`, without copying them (for verification).
    /// Writes of that chunk wait until `f` returns.
    pub fn with_chunk<R>(&self, idx: ChunkIdx, f: impl FnOnce(&[u8]) -> R) -> StoreResult<R> {
        self.geometry.check_idx(idx)?;
        Ok(f(&self.chunks[idx.as_usize()].read().data))
    }
}

/// Writes one byte of every page of `buf`, so that the kernel backs each page with its own
/// frame now (a freshly allocated zeroed buffer may still map the shared zero page).
fn touch(buf: &mut [u8]) {
    for i in (0..buf.len()).step_by(PAGE) {
        // `black_box` hides the value from the optimizer, which would otherwise drop a store
        // of zero into memory it knows to be zeroed.
        buf[i] = std::hint::black_box(0);
    }
}

impl fmt::Debug for DenseMemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DenseMemoryStore")
            .field("geometry", &self.geometry)
            .field("written_chunks", &self.written_chunks())
            .finish()
    }
}

impl Store for DenseMemoryStore {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn caps(&self) -> Caps {
        Caps::WRITE | Caps::STATUS | Caps::PARALLEL
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            self.geometry.check_idx(idx)?;
            let slot = self.chunks[idx.as_usize()].read();
            Ok(Bytes::copy_from_slice(&slot.data))
        })
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            self.geometry.check_write(idx, data.len())?;
            let mut slot = self.chunks[idx.as_usize()].write();
            slot.data.copy_from_slice(&data);
            if !slot.written {
                slot.written = true;
                self.written.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        })
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async { Ok(()) })
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            self.geometry.check_range(range)?;
            for idx in range.iter() {
                let mut slot = self.chunks[idx.as_usize()].write();
                if slot.written {
                    slot.data.fill(0);
                    slot.written = false;
                    self.written.fetch_sub(1, Ordering::Relaxed);
                }
            }
            Ok(())
        })
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        Box::pin(async move {
            self.geometry.check_idx(idx)?;
            Ok(ChunkStatus::data_if(
                self.chunks[idx.as_usize()].read().written,
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use farmap_core::ErrorKind;
    use std::sync::Arc;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dense_store_conforms() {
        farmap_testkit::run_conformance(|g| async move {
            Arc::new(DenseMemoryStore::new(g)) as Arc<dyn Store>
        })
        .await;
    }

    #[tokio::test]
    async fn chunks_are_copied_in_and_out() {
        let g = Geometry::new(10 * 4096 + 100, 4096).unwrap();
        let s = DenseMemoryStore::new(g);
        let data = Bytes::from(vec![9u8; 4096]);
        s.write(ChunkIdx(2), data.clone()).await.unwrap();
        let back = s.read(ChunkIdx(2)).await.unwrap();
        assert_eq!(back, data);
        assert_ne!(back.as_ptr(), data.as_ptr(), "a read must be a copy");
        assert!(s.with_chunk(ChunkIdx(2), |b| b == &data[..]).unwrap());
        assert_eq!(s.with_chunk(ChunkIdx(10), <[u8]>::len).unwrap(), 100);
        let err = s.with_chunk(ChunkIdx(11), |_| ()).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::OutOfRange);
    }

    #[tokio::test]
    async fn written_flag_follows_writes_and_trims() {
        let g = Geometry::new(8 * 4096, 4096).unwrap();
        let s = DenseMemoryStore::new(g);
        assert_eq!(s.written_chunks(), 0);
        for i in [1, 2, 2, 5] {
            s.write(ChunkIdx(i), Bytes::from(vec![3u8; 4096]))
                .await
                .unwrap();
        }
        assert_eq!(s.written_chunks(), 3);
        s.trim(ChunkRange::new(ChunkIdx(2), ChunkIdx(6)))
            .await
            .unwrap();
        assert_eq!(s.written_chunks(), 1);
        assert_eq!(s.status(ChunkIdx(1)).await.unwrap(), ChunkStatus::Data);
        assert_eq!(s.status(ChunkIdx(5)).await.unwrap(), ChunkStatus::Zero);
        assert!(s.with_chunk(ChunkIdx(5), farmap_core::is_zero).unwrap());
    }
}
