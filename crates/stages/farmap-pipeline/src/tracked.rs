//! [`Tracked`]: a stage that records which chunks were written (or trimmed).

use bytes::Bytes;
use farmap_core::{
    BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, Geometry, Store, StoreResult,
};

use crate::dirty::DirtySet;

/// A stage that records every chunk written or trimmed through it in a [`DirtySet`], so that a
/// migration or a write-back can copy exactly what changed.
///
/// # Concurrency
/// - A chunk is marked **after** the inner write (or trim) completes. Marking first would let
///   a concurrent [`take_dirty`](Self::take_dirty) clear the bit and copy the chunk before the
///   new data is in the inner store: the copy would be stale and the bit gone. Marking after
///   means a take that misses a write in progress leaves its bit for the next take.
/// - Hence: every write that completed before `take_dirty` was called is in the returned
///   set or in the set of an earlier take; a chunk copied after being taken holds data at
///   least as new as the write that marked it.
/// - A failed write or trim is marked too (when its chunks are in the region): the inner
///   store may have applied it before failing (a timeout after the data landed), and copying
///   an unchanged chunk costs a copy, while missing a changed one loses data.
/// - No lock is taken on any path; reads, status and flush go straight to the inner store.
#[derive(Debug)]
pub struct Tracked<S> {
    inner: S,
    dirty: DirtySet,
}

impl<S: Store> Tracked<S> {
    /// Tracks writes to `inner`, starting with nothing dirty.
    pub fn new(inner: S) -> Self {
        let dirty = DirtySet::new(inner.geometry().chunk_count());
        Self { inner, dirty }
    }

    /// Removes and returns every chunk marked since the last take, in ascending order.
    pub fn take_dirty(&self) -> Vec<ChunkIdx> {
        self.dirty.take()
    }

    /// Like [`take_dirty`](Self::take_dirty), appending to a reused vector; returns how many
    /// were appended.
    pub fn take_dirty_into(&self, out: &mut Vec<ChunkIdx>) -> usize {
        self.dirty.take_into(out)
    }

    /// Number of chunks marked and not yet taken.
    pub fn dirty_count(&self) -> u64 {
        self.dirty.count()
    }

    /// Whether `idx` is marked and not yet taken.
    ///
    /// # Panics
    /// If `idx` is outside the region.
    pub fn is_dirty(&self, idx: ChunkIdx) -> bool {
        self.dirty.is_dirty(idx)
    }

    /// Marks every chunk of the region dirty (to copy everything on the next take, e.g. when
    /// the destination was replaced).
    pub fn mark_all(&self) {
        self.dirty.mark_range(self.inner.geometry().all());
    }

    /// The dirty set itself, for a consumer that marks chunks too.
    pub fn dirty(&self) -> &DirtySet {
        &self.dirty
    }

    /// The inner store. Writes made directly to it are not tracked.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Gives the inner store back, dropping the dirty set.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Store> Store for Tracked<S> {
    fn geometry(&self) -> Geometry {
        self.inner.geometry()
    }

    fn caps(&self) -> Caps {
        self.inner.caps()
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        self.inner.read(idx)
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            let result = self.inner.write(idx, data).await;
            if self.inner.geometry().contains(idx) {
                self.dirty.mark(idx);
            }
            result
        })
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        self.inner.flush()
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            let result = self.inner.trim(range).await;
            if self.inner.geometry().check_range(range).is_ok() {
                self.dirty.mark_range(range);
            }
            result
        })
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        self.inner.status(idx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use farmap_testkit::ModelStore;
    use std::sync::Arc;

    fn geometry() -> Geometry {
        Geometry::new(100 * 4096, 4096).unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tracked_conforms() {
        farmap_testkit::run_conformance(|g| async move {
            Arc::new(Tracked::new(ModelStore::new(g))) as Arc<dyn Store>
        })
        .await;
    }

    #[tokio::test]
    async fn writes_and_trims_are_marked_reads_are_not() {
        let g = geometry();
        let t = Tracked::new(ModelStore::new(g));
        t.write(ChunkIdx(5), Bytes::from(vec![1; 4096]))
            .await
            .unwrap();
        t.read(ChunkIdx(6)).await.unwrap();
        t.status(ChunkIdx(7)).await.unwrap();
        t.flush().await.unwrap();
        t.trim(ChunkRange::new(ChunkIdx(10), ChunkIdx(13)))
            .await
            .unwrap();
        assert_eq!(t.dirty_count(), 4);
        assert!(t.is_dirty(ChunkIdx(5)) && !t.is_dirty(ChunkIdx(6)));
        let want: Vec<_> = [5, 10, 11, 12].into_iter().map(ChunkIdx).collect();
        assert_eq!(t.take_dirty(), want);
        assert_eq!(t.dirty_count(), 0);
        assert!(t.take_dirty().is_empty());
    }

    #[tokio::test]
    async fn refused_out_of_range_operations_mark_nothing() {
        let t = Tracked::new(ModelStore::new(geometry()));
        assert!(t
            .write(ChunkIdx(100), Bytes::from(vec![1; 4096]))
            .await
            .is_err());
        assert!(t
            .trim(ChunkRange::new(ChunkIdx(99), ChunkIdx(101)))
            .await
            .is_err());
        assert_eq!(t.dirty_count(), 0);
        t.mark_all();
        assert_eq!(t.dirty_count(), 100);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_writers_and_a_copying_taker_converge() {
        // Writers write versions of random chunks; a copier repeatedly takes the dirty set and
        // copies those chunks to a second store. After the writers stop, one last take and
        // copy must make the copy equal to the source.
        let g = geometry();
        let src = Arc::new(Tracked::new(ModelStore::new(g)));
        let dst = Arc::new(ModelStore::new(g));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        async fn copy(src: &Tracked<ModelStore>, dst: &ModelStore) -> usize {
            let chunks = src.take_dirty();
            for &c in &chunks {
                dst.write(c, src.read(c).await.unwrap()).await.unwrap();
            }
            chunks.len()
        }
        let copier = {
            let (src, dst, stop) = (src.clone(), dst.clone(), stop.clone());
            tokio::spawn(async move {
                let mut copied = 0;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    copied += copy(&src, &dst).await;
                    tokio::task::yield_now().await;
                }
                copied
            })
        };
        let writers: Vec<_> = (0..4u64)
            .map(|w| {
                let src = src.clone();
                tokio::spawn(async move {
                    for i in 0..500u64 {
                        let c = ChunkIdx((i * 31 + w * 17) % 100);
                        let byte = (i as u8) ^ (w as u8 * 64);
                        src.write(c, Bytes::from(vec![byte; 4096])).await.unwrap();
                        if i % 50 == 0 {
                            src.trim(ChunkRange::single(c)).await.unwrap();
                        }
                        if i % 7 == 0 {
                            tokio::task::yield_now().await;
                        }
                    }
                })
            })
            .collect();
        for w in writers {
            w.await.unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let copied = copier.await.unwrap();
        copy(&src, &dst).await;
        assert!(copied > 0, "the copier ran while the writers wrote");
        assert!(src.inner().snapshot() == dst.snapshot(), "copy differs");
    }
}
