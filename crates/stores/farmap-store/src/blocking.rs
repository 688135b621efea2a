//! Running blocking file system calls off the async worker threads, and the [`Store`] that
//! the file and dir stores share over them ([`OnBlocking`]).

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use parking_lot::Mutex;

use bytes::Bytes;
use farmap_core::{
    BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, StoreError,
    StoreResult,
};

/// Runs `f` on Tokio's blocking pool and returns its result.
///
/// A panic inside `f` is resumed in the caller (it is a bug, not an I/O error); a task
/// cancelled because the runtime is shutting down becomes [`ErrorKind::Cancelled`].
pub(crate) async fn blocking<T, F>(f: F) -> StoreResult<T>
where
    T: Send + 'static,
    F: FnOnce() -> StoreResult<T> + Send + 'static,
{
    match tokio::task::spawn_blocking(f).await {
        Ok(result) => result,
        Err(err) if err.is_panic() => std::panic::resume_unwind(err.into_panic()),
        Err(_) => Err(StoreError::new(
            ErrorKind::Cancelled,
            "a file operation was cancelled because the runtime is shutting down",
        )),
    }
}

/// A store's state whose operations are blocking system calls (a file's positional I/O, a
/// directory's chunk files): [`OnBlocking`] runs them on the blocking pool, after the checks
/// every such store makes.
pub(crate) trait BlockingChunks: Send + Sync + 'static {
    /// The region's shape.
    fn geometry(&self) -> Geometry;
    /// Opened read-only.
    fn read_only(&self) -> bool;
    /// The file or directory, for messages.
    fn location(&self) -> &Path;
    /// Reads chunk `idx` (checked).
    fn read_chunk(&self, idx: ChunkIdx) -> StoreResult<Bytes>;
    /// Writes chunk `idx` (checked, writable).
    fn write_chunk(&self, idx: ChunkIdx, data: &[u8]) -> StoreResult<()>;
    /// Makes every write durable.
    fn flush_all(&self) -> StoreResult<()>;
    /// Trims `range` (checked, not empty, writable).
    fn trim_range(&self, range: ChunkRange) -> StoreResult<()>;
    /// What chunk `idx` holds (checked).
    fn chunk_status(&self, idx: ChunkIdx) -> StoreResult<ChunkStatus>;
    /// Reads `range` of chunk `idx` (checked); by default the chunk, sliced.
    fn read_part_chunk(&self, idx: ChunkIdx, range: std::ops::Range<usize>) -> StoreResult<Bytes> {
        Ok(self.read_chunk(idx)?.slice(range))
    }
    /// Asks for chunk `idx` to be read ahead (checked); by default nothing.
    fn prefetch_chunk(&self, idx: ChunkIdx) -> StoreResult<()> {
        let _ = idx;
        Ok(())
    }
}

/// The [`Store`] over a [`BlockingChunks`] state: the file and dir stores are this, with their
/// own opening and accessors.
///
/// A failed flush stays failed: once `fdatasync` (or a directory sync) has reported an error,
/// Linux may have dropped the dirty pages and marked them clean, and a second sync would
/// report success for data that is gone (the PostgreSQL fsync lesson). Every later flush of
/// the store fails, naming the first failure, until the store is reopened and the data
/// written again.
pub(crate) struct OnBlocking<I>(pub Arc<I>, Mutex<Option<StoreError>>);

impl<I: BlockingChunks> OnBlocking<I> {
    pub fn new(inner: Arc<I>) -> Self {
        Self(inner, Mutex::new(None))
    }

    fn check_writable(&self) -> StoreResult<()> {
        if self.0.read_only() {
            Err(StoreError::new(
                ErrorKind::ReadOnly,
                format!("{} was opened read-only", self.0.location().display()),
            ))
        } else {
            Ok(())
        }
    }

    /// Runs `op` on the state, on the blocking pool.
    async fn run<T: Send + 'static>(
        &self,
        op: impl FnOnce(&I) -> StoreResult<T> + Send + 'static,
    ) -> StoreResult<T> {
        let inner = self.0.clone();
        blocking(move || op(&inner)).await
    }

    /// A `Debug` of the store `name` with the fields every such store shows: its path, its
    /// geometry and whether it is read-only.
    pub fn debug_struct<'a, 'b>(
        &self,
        f: &'a mut fmt::Formatter<'b>,
        name: &str,
    ) -> fmt::DebugStruct<'a, 'b> {
        let mut d = f.debug_struct(name);
        d.field("path", &self.0.location())
            .field("geometry", &self.0.geometry())
            .field("read_only", &self.0.read_only());
        d
    }

    pub fn geometry(&self) -> Geometry {
        self.0.geometry()
    }

    pub fn caps(&self) -> Caps {
        let caps = Caps::WRITE | Caps::FLUSH | Caps::TRIM | Caps::STATUS | Caps::PARALLEL;
        if self.0.read_only() {
            caps.without(Caps::WRITE | Caps::TRIM)
        } else {
            caps
        }
    }

    pub fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            self.0.geometry().check_idx(idx)?;
            self.run(move |i| i.read_chunk(idx)).await
        })
    }

    pub fn read_part(
        &self,
        idx: ChunkIdx,
        offset: usize,
        len: usize,
    ) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            let g = self.0.geometry();
            g.check_idx(idx)?;
            let range = farmap_core::part_range(idx, g.chunk_len(idx), offset, len)?;
            self.run(move |i| i.read_part_chunk(idx, range)).await
        })
    }

    pub fn prefetch(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            self.0.geometry().check_idx(idx)?;
            self.run(move |i| i.prefetch_chunk(idx)).await
        })
    }

    pub fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            self.check_writable()?;
            self.0.geometry().check_write(idx, data.len())?;
            self.run(move |i| i.write_chunk(idx, &data)).await
        })
    }

    pub fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            if self.0.read_only() {
                return Ok(());
            }
            if let Some(first) = &*self.1.lock() {
                return Err(StoreError::new(
                    first.kind(),
                    format!(
                        "an earlier flush of {} failed ({}): writes acknowledged before it may \
                         be lost, and no later flush can say otherwise; reopen the store and \
                         write the data again",
                        self.0.location().display(),
                        farmap_core::error_chain(first)
                    ),
                ));
            }
            let result = self.run(|i| i.flush_all()).await;
            if let Err(e) = &result {
                if e.kind() != ErrorKind::Cancelled {
                    self.1.lock().get_or_insert_with(|| e.to_owned_lossy());
                }
            }
            result
        })
    }

    pub fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            self.check_writable()?;
            self.0.geometry().check_range(range)?;
            if range.is_empty() {
                return Ok(());
            }
            self.run(move |i| i.trim_range(range)).await
        })
    }

    pub fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        Box::pin(async move {
            self.0.geometry().check_idx(idx)?;
            self.run(move |i| i.chunk_status(idx)).await
        })
    }
}

/// `impl Store for $store`, whose field `blocking` is an [`OnBlocking`]: every data method
/// is the shared one (nothing forwards by default: the list is written out once, here).
macro_rules! store_on_blocking {
    ($store:ty) => {
        impl farmap_core::Store for $store {
            fn geometry(&self) -> farmap_core::Geometry {
                self.blocking.geometry()
            }
            fn caps(&self) -> farmap_core::Caps {
                self.blocking.caps()
            }
            fn read(
                &self,
                idx: farmap_core::ChunkIdx,
            ) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<bytes::Bytes>> {
                self.blocking.read(idx)
            }
            fn write(
                &self,
                idx: farmap_core::ChunkIdx,
                data: bytes::Bytes,
            ) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<()>> {
                self.blocking.write(idx, data)
            }
            fn flush(&self) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<()>> {
                self.blocking.flush()
            }
            fn trim(
                &self,
                range: farmap_core::ChunkRange,
            ) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<()>> {
                self.blocking.trim(range)
            }
            fn status(
                &self,
                idx: farmap_core::ChunkIdx,
            ) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<farmap_core::ChunkStatus>>
            {
                self.blocking.status(idx)
            }
            fn read_part(
                &self,
                idx: farmap_core::ChunkIdx,
                offset: usize,
                len: usize,
            ) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<bytes::Bytes>> {
                self.blocking.read_part(idx, offset, len)
            }
            fn prefetch(
                &self,
                idx: farmap_core::ChunkIdx,
            ) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<()>> {
                self.blocking.prefetch(idx)
            }
        }
    };
}
pub(crate) use store_on_blocking;
