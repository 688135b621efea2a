//! [`Hooked`]: a store wrapper for tests that runs a hook before each read, write and flush
//! (to count, record, delay, block or fail it).

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use farmap_core::{
    BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, Geometry, Store, StoreResult,
};

/// Which operation a hook sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// A read of the chunk.
    Read,
    /// A write of the chunk.
    Write,
    /// A flush (the chunk is 0).
    Flush,
}

/// What a [`Hooked`] store runs before an operation; an error fails the operation.
pub type Hook = Arc<dyn Fn(Op, ChunkIdx) -> BoxFuture<'static, StoreResult<()>> + Send + Sync>;

/// `inner` with a [`Hook`] run before each read, write and flush (trim and status go
/// straight through).
pub struct Hooked<S> {
    /// The store behind the hook.
    pub inner: S,
    hook: Hook,
}

impl<S> Hooked<S> {
    /// `inner` behind `hook`.
    pub fn new(
        inner: S,
        hook: impl Fn(Op, ChunkIdx) -> BoxFuture<'static, StoreResult<()>> + Send + Sync + 'static,
    ) -> Self {
        Self {
            inner,
            hook: Arc::new(hook),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for Hooked<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Hooked")
            .field("inner", &self.inner)
            .finish()
    }
}

impl<S: Store> Store for Hooked<S> {
    fn geometry(&self) -> Geometry {
        self.inner.geometry()
    }
    fn caps(&self) -> Caps {
        self.inner.caps()
    }
    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            (self.hook)(Op::Read, idx).await?;
            self.inner.read(idx).await
        })
    }
    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            (self.hook)(Op::Write, idx).await?;
            self.inner.write(idx, data).await
        })
    }
    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            (self.hook)(Op::Flush, ChunkIdx(0)).await?;
            self.inner.flush().await
        })
    }
    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        self.inner.trim(range)
    }
    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        self.inner.status(idx)
    }
}
