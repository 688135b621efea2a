//! Opening any store from synchronous code: network stores get a runtime of their own.

use std::sync::Arc;

use bytes::Bytes;
use farmap_core::{
    BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, Geometry, MemoryBase, Store, StoreResult,
};

use super::model::{OpenError, StoreSpec};
use super::open::{open_store, open_store_async};

/// Opens the store `spec` names from synchronous code, whatever its kind: local stores
/// directly ([`open_store`]); network stores (`farmap://`, `redis://`, `s3://`, `cql://`...)
/// on a small runtime made for them, which lives as long as the store does, because their
/// connections are tasks on the runtime that opened them. Callers may use the store from
/// any runtime. Works inside an async context too (the opening runs on a scoped thread),
/// though it blocks the calling thread until the store is open.
pub fn open_store_blocking(spec: &StoreSpec) -> Result<Arc<dyn Store>, OpenError> {
    if !spec.needs_async() {
        return open_store(spec);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("farmap-store-rt")
        .enable_all()
        .build()
        .map_err(|e| OpenError::Store {
            spec: spec.to_string(),
            source: farmap_core::StoreError::io("starting the store's runtime", e),
        })?;
    let opened = std::thread::scope(|s| {
        s.spawn(|| runtime.block_on(open_store_async(spec)))
            .join()
            .expect("opening a store does not panic")
    })?;
    Ok(Arc::new(RuntimeKept {
        store: opened,
        runtime: Some(runtime),
    }))
}

/// A store with the runtime its connections live on; the runtime is shut down (without
/// waiting, so that dropping is allowed anywhere) when the store goes.
#[derive(Debug)]
struct RuntimeKept {
    store: Arc<dyn Store>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Drop for RuntimeKept {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

// Every method goes to the store as is: the wrapper only keeps the runtime alive.
impl Store for RuntimeKept {
    fn geometry(&self) -> Geometry {
        self.store.geometry()
    }
    fn caps(&self) -> Caps {
        self.store.caps()
    }
    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        self.store.read(idx)
    }
    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        self.store.write(idx, data)
    }
    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        self.store.flush()
    }
    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        self.store.trim(range)
    }
    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        self.store.status(idx)
    }
    fn read_part(
        &self,
        idx: ChunkIdx,
        offset: usize,
        len: usize,
    ) -> BoxFuture<'_, StoreResult<Bytes>> {
        self.store.read_part(idx, offset, len)
    }
    fn prefetch(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<()>> {
        self.store.prefetch(idx)
    }
    fn chunks_per_read(&self) -> u32 {
        self.store.chunks_per_read()
    }
    fn read_chunks(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<Vec<Bytes>>> {
        self.store.read_chunks(range)
    }
    fn catch_up(&self) -> BoxFuture<'_, StoreResult<()>> {
        self.store.catch_up()
    }
    fn take_over(&self) -> BoxFuture<'_, StoreResult<()>> {
        self.store.take_over()
    }
    fn memory_base(&self) -> BoxFuture<'_, StoreResult<Option<Arc<dyn MemoryBase>>>> {
        self.store.memory_base()
    }
    fn working_set(&self) -> Option<Arc<[ChunkIdx]>> {
        self.store.working_set()
    }

    fn reports_touches(&self) {
        self.store.reports_touches()
    }

    fn touched(&self, idx: ChunkIdx) {
        self.store.touched(idx)
    }
}
