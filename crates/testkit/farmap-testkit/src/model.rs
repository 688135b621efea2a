//! The simplest possible correct store: the reference for stage tests.

use bytes::Bytes;
use farmap_core::{
    zero_chunk, BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, Geometry, Store, StoreResult,
};
use std::sync::Mutex;

/// A store that keeps every chunk in one `Mutex<Vec<Option<Bytes>>>`: slow, obviously correct,
/// and independent of the real stores, so stage tests do not trust what they test.
#[derive(Debug)]
pub struct ModelStore {
    geometry: Geometry,
    caps: Caps,
    chunks: Mutex<Vec<Option<Bytes>>>,
}

impl ModelStore {
    /// An empty (all-zero) model store.
    pub fn new(geometry: Geometry) -> Self {
        Self::with_caps(geometry, Caps::WRITE | Caps::TRIM | Caps::STATUS)
    }

    /// An empty model store that claims `caps` (and refuses a trim without
    /// [`Caps::TRIM`]): for frontends that must announce only what their store can do.
    pub fn with_caps(geometry: Geometry, caps: Caps) -> Self {
        Self {
            geometry,
            caps,
            chunks: Mutex::new(vec![None; geometry.chunk_count() as usize]),
        }
    }

    /// The whole region as one byte vector.
    pub fn snapshot(&self) -> Vec<u8> {
        let chunks = self.chunks.lock().expect("model lock");
        let mut out = Vec::with_capacity(self.geometry.size() as usize);
        for (i, c) in chunks.iter().enumerate() {
            match c {
                Some(b) => out.extend_from_slice(b),
                None => out.resize(out.len() + self.geometry.chunk_len(ChunkIdx(i as u64)), 0),
            }
        }
        out
    }
}

impl Store for ModelStore {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn caps(&self) -> Caps {
        self.caps
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            self.geometry.check_idx(idx)?;
            let chunks = self.chunks.lock().expect("model lock");
            Ok(chunks[idx.as_usize()]
                .clone()
                .unwrap_or_else(|| zero_chunk(self.geometry.chunk_len(idx))))
        })
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            self.geometry.check_write(idx, data.len())?;
            self.chunks.lock().expect("model lock")[idx.as_usize()] = Some(data);
            Ok(())
        })
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async { Ok(()) })
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            if !self.caps.contains(Caps::TRIM) {
                return Err(farmap_core::StoreError::new(
                    farmap_core::ErrorKind::Unsupported,
                    "this model store does not trim",
                ));
            }
            self.geometry.check_range(range)?;
            let mut chunks = self.chunks.lock().expect("model lock");
            for idx in range.iter() {
                chunks[idx.as_usize()] = None;
            }
            Ok(())
        })
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        Box::pin(async move {
            self.geometry.check_idx(idx)?;
            let chunks = self.chunks.lock().expect("model lock");
            Ok(match chunks[idx.as_usize()] {
                Some(_) => ChunkStatus::Data,
                None => ChunkStatus::Zero,
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn model_store_conforms() {
        crate::run_conformance(|g| async move { Arc::new(ModelStore::new(g)) as Arc<dyn Store> })
            .await;
    }

    #[tokio::test]
    async fn pattern_store_conforms_read_only() {
        let g = Geometry::new(10 * 4096 + 5, 4096).unwrap();
        let p = Arc::new(crate::PatternStore::new(g, 42));
        let oracle = p.clone();
        crate::run_read_only_conformance(p, move |idx| {
            oracle.expected(g.offset_of(idx), g.chunk_len(idx))
        })
        .await;
    }
}
