//! [`ArenaStore`]: what the arena's region reads on a fault. A slot reads as zeros (fresh
//! anonymous memory), except while an object migrates into it: then its chunks come from
//! that migration's store (the source's pages), through a *route*.

use std::sync::Arc;

use bytes::Bytes;
use farmap_core::{
    zero_chunk, BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, Store,
    StoreError, StoreResult,
};
use parking_lot::RwLock;

/// The arena's store: zeros, or a slot's route. Nothing is ever written to it (the arena's
/// region pushes nothing): a write is a bug and fails loudly.
#[derive(Debug)]
pub struct ArenaStore {
    geometry: Geometry,
    /// `slot_shift - chunk_shift`: a chunk's slot is `idx >> chunks_shift`.
    chunks_shift: u32,
    /// A store per slot with an inbound migration, indexed by slot; its chunk 0 is the
    /// slot's first chunk.
    routes: RwLock<Vec<Option<Arc<dyn Store>>>>,
}

impl ArenaStore {
    /// A store of `size` bytes in chunks of `chunk`, cut into slots of `1 << slot_shift`.
    pub fn new(size: u64, chunk: u32, slot_shift: u32) -> StoreResult<ArenaStore> {
        let geometry = Geometry::new(size, u64::from(chunk))
            .map_err(|e| StoreError::invalid(format!("the arena's geometry: {e}")))?;
        let chunks_shift = slot_shift - chunk.trailing_zeros();
        let slots = (size >> slot_shift) as usize;
        Ok(ArenaStore {
            geometry,
            chunks_shift,
            routes: RwLock::new(vec![None; slots]),
        })
    }

    /// Chunks in a slot.
    pub fn chunks_per_slot(&self) -> u64 {
        1 << self.chunks_shift
    }

    /// Reads of `slot` go to `route` (whose geometry is one slot's) from now on.
    pub fn set_route(&self, slot: u32, route: Arc<dyn Store>) -> StoreResult<()> {
        let want = self.chunks_per_slot() * u64::from(self.geometry.chunk_size());
        if route.geometry().size() != want
            || route.geometry().chunk_size() != self.geometry.chunk_size()
        {
            return Err(StoreError::invalid(format!(
                "a slot's route must be {want} bytes in chunks of {}, not {:?}",
                self.geometry.chunk_size(),
                route.geometry()
            )));
        }
        let mut routes = self.routes.write();
        let entry = routes
            .get_mut(slot as usize)
            .ok_or_else(|| StoreError::out_of_range(format!("slot {slot}")))?;
        *entry = Some(route);
        Ok(())
    }

    /// Reads of `slot` are zeros again.
    pub fn clear_route(&self, slot: u32) {
        if let Some(e) = self.routes.write().get_mut(slot as usize) {
            *e = None;
        }
    }

    /// The route of `idx`'s slot and the index within it.
    fn route(&self, idx: ChunkIdx) -> StoreResult<Option<(Arc<dyn Store>, ChunkIdx)>> {
        self.geometry.check_idx(idx)?;
        let slot = (idx.0 >> self.chunks_shift) as usize;
        let within = ChunkIdx(idx.0 & (self.chunks_per_slot() - 1));
        Ok(self.routes.read()[slot].clone().map(|r| (r, within)))
    }
}

impl Store for ArenaStore {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn caps(&self) -> Caps {
        Caps::STATUS | Caps::PARALLEL
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            match self.route(idx)? {
                Some((route, within)) => route.read(within).await,
                None => Ok(zero_chunk(self.geometry.chunk_len(idx))),
            }
        })
    }

    fn write(&self, idx: ChunkIdx, _data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            Err(StoreError::new(
                ErrorKind::ReadOnly,
                format!(
                    "the arena pushes nothing, yet chunk {} was written back",
                    idx.0
                ),
            ))
        })
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async { Ok(()) })
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move { self.geometry.check_range(range) })
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        Box::pin(async move {
            match self.route(idx)? {
                Some((route, within)) => route.status(within).await,
                None => Ok(ChunkStatus::Zero),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use farmap_testkit::{block_on, PatternStore};

    #[test]
    fn slots_read_zeros_unless_routed_and_writes_fail() {
        // 4 slots of 1 MiB in 64 KiB chunks.
        let s = ArenaStore::new(4 << 20, 64 << 10, 20).unwrap();
        assert_eq!(s.chunks_per_slot(), 16);
        assert_eq!(
            block_on(s.read(ChunkIdx(17))).unwrap(),
            zero_chunk(64 << 10)
        );
        assert_eq!(block_on(s.status(ChunkIdx(17))).unwrap(), ChunkStatus::Zero);
        let slot = Geometry::new(1 << 20, 64 << 10).unwrap();
        let route = Arc::new(PatternStore::new(slot, 9));
        s.set_route(1, route.clone()).unwrap();
        // Slot 1's chunk 1 is the route's chunk 1; slot 2 stays zeros.
        let want = block_on(route.read(ChunkIdx(1))).unwrap();
        assert_eq!(block_on(s.read(ChunkIdx(17))).unwrap(), want);
        assert_eq!(
            block_on(s.read(ChunkIdx(33))).unwrap(),
            zero_chunk(64 << 10)
        );
        s.clear_route(1);
        assert_eq!(
            block_on(s.read(ChunkIdx(17))).unwrap(),
            zero_chunk(64 << 10)
        );
        // A route of the wrong shape, a slot out of range, a write, an index out of range.
        let wrong = Arc::new(PatternStore::new(
            Geometry::new(2 << 20, 64 << 10).unwrap(),
            1,
        ));
        assert!(s.set_route(0, wrong).is_err());
        assert!(s.set_route(4, route).is_err());
        let e = block_on(s.write(ChunkIdx(0), zero_chunk(64 << 10))).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ReadOnly);
        assert!(block_on(s.read(ChunkIdx(64))).is_err());
    }
}
