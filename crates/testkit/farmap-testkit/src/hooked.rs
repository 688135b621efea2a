//! [`Hooked`]: a store wrapper for tests that runs a hook before each read, write and flush
//! (to count, record, delay, block or fail it), and optionally sees the data written or changes
//! the data read.

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

/// What a [`Hooked`] store runs before a write, given the data to be written (after the
/// [`Hook`], if any); an error fails the write.
pub type WriteHook =
    Arc<dyn Fn(ChunkIdx, &Bytes) -> BoxFuture<'static, StoreResult<()>> + Send + Sync>;

/// What a [`Hooked`] store makes of the data a successful read of the inner store returned.
pub type ReadMap = Arc<dyn Fn(ChunkIdx, Bytes) -> Bytes + Send + Sync>;

/// `inner` with a [`Hook`] run before each read, write and flush (trim and status go
/// straight through), and what [`Hooked::before_writes`] and [`Hooked::map_reads`] add.
pub struct Hooked<S> {
    /// The store behind the hook.
    pub inner: S,
    hook: Option<Hook>,
    before_write: Option<WriteHook>,
    map_read: Option<ReadMap>,
}

impl<S> Hooked<S> {
    /// `inner` behind `hook`.
    pub fn new(
        inner: S,
        hook: impl Fn(Op, ChunkIdx) -> BoxFuture<'static, StoreResult<()>> + Send + Sync + 'static,
    ) -> Self {
        Self {
            hook: Some(Arc::new(hook)),
            ..Self::through(inner)
        }
    }

    /// `inner` with no hook yet: every operation goes straight through until one is added.
    pub fn through(inner: S) -> Self {
        Self {
            inner,
            hook: None,
            before_write: None,
            map_read: None,
        }
    }

    /// Runs `hook` before each write, with the data to be written.
    pub fn before_writes(
        mut self,
        hook: impl Fn(ChunkIdx, &Bytes) -> BoxFuture<'static, StoreResult<()>> + Send + Sync + 'static,
    ) -> Self {
        self.before_write = Some(Arc::new(hook));
        self
    }

    /// Returns `map(idx, data)` in place of the `data` a read of chunk `idx` found (to
    /// corrupt it or replace it); a failed read stays failed.
    pub fn map_reads(
        mut self,
        map: impl Fn(ChunkIdx, Bytes) -> Bytes + Send + Sync + 'static,
    ) -> Self {
        self.map_read = Some(Arc::new(map));
        self
    }

    async fn run(&self, op: Op, idx: ChunkIdx) -> StoreResult<()> {
        match &self.hook {
            Some(hook) => hook(op, idx).await,
            None => Ok(()),
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
            self.run(Op::Read, idx).await?;
            let data = self.inner.read(idx).await?;
            Ok(match &self.map_read {
                Some(map) => map(idx, data),
                None => data,
            })
        })
    }
    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            self.run(Op::Write, idx).await?;
            if let Some(hook) = &self.before_write {
                hook(idx, &data).await?;
            }
            self.inner.write(idx, data).await
        })
    }
    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            self.run(Op::Flush, ChunkIdx(0)).await?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{block_on, ModelStore};
    use std::sync::Mutex;

    #[test]
    fn hooks_see_writes_and_reads_can_be_changed() {
        let g = Geometry::new(4 * 4096, 4096).unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        let store = Hooked::through(ModelStore::new(g))
            .before_writes(move |idx, data| {
                s.lock().unwrap().push((idx, data[0]));
                Box::pin(async { Ok(()) })
            })
            .map_reads(|idx, data| {
                if idx == ChunkIdx(1) {
                    Bytes::new()
                } else {
                    data
                }
            });
        block_on(async {
            store
                .write(ChunkIdx(1), Bytes::from(vec![5; 4096]))
                .await
                .unwrap();
            store
                .write(ChunkIdx(2), Bytes::from(vec![6; 4096]))
                .await
                .unwrap();
            assert!(store.read(ChunkIdx(1)).await.unwrap().is_empty());
            assert_eq!(store.read(ChunkIdx(2)).await.unwrap()[0], 6);
        });
        assert_eq!(*seen.lock().unwrap(), [(ChunkIdx(1), 5), (ChunkIdx(2), 6)]);
    }
}
