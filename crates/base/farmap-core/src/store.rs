//! The chunk [`Store`] trait.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;

use crate::{Caps, ChunkIdx, ChunkRange, ErrorKind, Geometry, StoreError, StoreResult};

/// A boxed, `Send` future: what every [`Store`] method returns, so that `Arc<dyn Store>` works.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a store knows about a chunk without reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChunkStatus {
    /// The chunk reads as zeros (never written, trimmed, or a hole).
    Zero,
    /// The chunk holds data (which may still happen to be zeros).
    Data,
    /// The store cannot tell without reading.
    Unknown,
}

impl ChunkStatus {
    /// [`Data`](Self::Data) when the store holds something for the chunk, else
    /// [`Zero`](Self::Zero): the status of a store that keeps only written chunks.
    pub fn data_if(holds_data: bool) -> ChunkStatus {
        if holds_data {
            ChunkStatus::Data
        } else {
            ChunkStatus::Zero
        }
    }
}

/// A chunk-addressed region store: the leaf (memory, file, directory, Redis, S3, a remote
/// farmap host...) or a stage wrapping another store.
///
/// # Contract
/// - Every method takes `&self`; a store is shared as `Arc<dyn Store>` by any number of tasks.
/// - `read` returns exactly [`Geometry::chunk_len`] bytes. A chunk never written (or trimmed)
///   reads as zeros.
/// - `write` takes exactly [`Geometry::chunk_len`] bytes and replaces the chunk whole: a
///   concurrent `read` of the same chunk sees the old or the new content, never a mix.
/// - Indices outside the region fail with [`ErrorKind::OutOfRange`](crate::ErrorKind), wrong
///   lengths with `InvalidInput`, writes to a store without [`Caps::WRITE`] with `ReadOnly`.
/// - `flush` returns once every write that completed before it was called is durable in the
///   sense the store's [`Caps::FLUSH`] promises; for a store without it, `flush` succeeds and
///   promises nothing beyond "written".
/// - `trim` makes the chunks of a range read as zeros (releasing space where
///   [`Caps::TRIM`] says so).
///
/// The operations have no default bodies: a stage must decide, for every operation, what it
/// does (a silent pass-through is how a new operation bypasses a cache or a tracker
/// unnoticed). The hints do, written with `read` so that no stage is bypassed:
/// [`read_part`](Store::read_part) (the default reads the chunk and slices it; a file reads
/// only the part), [`prefetch`](Store::prefetch) (the default does nothing; a cache
/// fetches the chunk) and [`read_chunks`](Store::read_chunks) (the default reads chunk by
/// chunk; a farmap server's client reads a run in one request).
pub trait Store: Send + Sync + fmt::Debug + 'static {
    /// The size and chunk size of the region. Constant for the store's lifetime.
    fn geometry(&self) -> Geometry;

    /// What this store can do. Constant for the store's lifetime.
    fn caps(&self) -> Caps;

    /// Reads chunk `idx` whole.
    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>>;

    /// Replaces chunk `idx` whole with `data`.
    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>>;

    /// Makes every completed write durable (see [`Caps::FLUSH`]).
    fn flush(&self) -> BoxFuture<'_, StoreResult<()>>;

    /// Makes the chunks of `range` read as zeros.
    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>>;

    /// What the store knows about chunk `idx` without reading it.
    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>>;

    /// Reads `len` bytes at `offset` of chunk `idx` (within the chunk's length, else
    /// `OutOfRange`). The default reads the chunk whole and slices it.
    fn read_part(
        &self,
        idx: ChunkIdx,
        offset: usize,
        len: usize,
    ) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            let chunk = self.read(idx).await?;
            let range = part_range(idx, chunk.len(), offset, len)?;
            Ok(chunk.slice(range))
        })
    }

    /// A hint that chunk `idx` will be read soon (NBD's `CACHE`). The default does nothing;
    /// a store with a slower layer under a faster one fetches the chunk, a file asks the
    /// kernel to read it ahead.
    fn prefetch(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<()>> {
        let _ = idx;
        Box::pin(async { Ok(()) })
    }

    /// Most chunks [`read_chunks`](Store::read_chunks) reads in one request: 1 (the
    /// default) when every chunk is a request of its own, so that a caller gains nothing by
    /// asking for runs.
    fn chunks_per_read(&self) -> u32 {
        1
    }

    /// Reads the chunks of `range` whole, in order. The default reads them one by one with
    /// [`read`](Store::read); a store that reads a run in one request (a farmap server)
    /// does so, up to [`chunks_per_read`](Store::chunks_per_read) chunks a request.
    fn read_chunks(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<Vec<Bytes>>> {
        Box::pin(async move {
            let mut out = Vec::with_capacity(usize::try_from(range.len()).unwrap_or(0));
            for idx in range.iter() {
                out.push(self.read(idx).await?);
            }
            Ok(out)
        })
    }

    /// For a store that one writer at a time may change and that another opening may have
    /// changed since this one opened (a versioned region): reads what was saved since, so
    /// that reads return it. Fails with [`ErrorKind::Fenced`] when this opening has unsaved
    /// writes and another writer saved meanwhile. Live migration calls it on the new host
    /// before the hand-over. Other stores see every change already: nothing to do.
    fn catch_up(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async { Ok(()) })
    }

    /// [`catch_up`](Self::catch_up), then makes this opening the one writer: a store that
    /// fences writers saves a version under the next epoch, so that any other opening's
    /// next flush fails with [`ErrorKind::Fenced`] (never a silent overwrite). Live
    /// migration calls it on the new host once it owns the region. Other stores: nothing to
    /// do.
    fn take_over(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async { Ok(()) })
    }

    /// For a store whose content starts from one that other openings on this host may map
    /// too (a version of a region, or a fork of one): what this opening shares with them, so
    /// that their userfaultfd regions keep one copy of each clean page in memory (see
    /// `farmap_uffd`'s shared bases). `None` (the default): nothing is shared.
    fn memory_base(&self) -> BoxFuture<'_, StoreResult<Option<Arc<dyn MemoryBase>>>> {
        Box::pin(async { Ok(None) })
    }

    /// A hint: the chunks this opening expects to be read first, in the order they were
    /// first read the last time the region ran (a versioned region's recorded working set),
    /// so that a front can fetch them ahead (a mount warms the kernel's page cache with
    /// them). `None` (the default): nothing known. A stage over another store forwards it.
    fn working_set(&self) -> Option<Arc<[ChunkIdx]>> {
        None
    }

    /// A hint from a cache over this store that reads ahead of the application (a managed
    /// store's pull), sent once as it opens: this store's own reads no longer show what the
    /// application touched, so the cache reports that with [`touched`](Self::touched). A
    /// store that records working sets records those reports from now on, not its reads.
    /// A stage over another store forwards it; others ignore it.
    fn reports_touches(&self) {}

    /// A hint from a cache that [reports touches](Self::reports_touches): the application
    /// read or wrote chunk `idx` for the first time since the cache opened.
    fn touched(&self, idx: ChunkIdx) {
        let _ = idx;
    }
}

/// The content an opening of a store started from, as other openings on the same host see it
/// too: regions opened over the same base keep one copy of each of its clean chunks in
/// memory (a shared page cache), and copy on write.
///
/// A chunk goes into the shared copy only once [`check`](Self::check) confirmed it is the
/// base's, and a region maps the shared copy of a chunk only while
/// [`is_base`](Self::is_base) says this opening still reads the base's content there.
pub trait MemoryBase: Send + Sync + fmt::Debug {
    /// Names the base: equal for openings whose base content is the same, and different
    /// otherwise (a cryptographic hash of the base's layout and chunk contents).
    fn key(&self) -> [u8; 32];

    /// Whether chunk `idx` of this opening reads as the base's content now: false once
    /// written (or changed by another writer and caught up with), and for chunks of zeros.
    fn is_base(&self, idx: ChunkIdx) -> bool;

    /// Whether `data` is the base's content of chunk `idx` (a hash check).
    fn check(&self, idx: ChunkIdx, data: &[u8]) -> bool;
}

/// `offset..offset + len` checked against a chunk of `chunk_len` bytes.
pub fn part_range(
    idx: ChunkIdx,
    chunk_len: usize,
    offset: usize,
    len: usize,
) -> StoreResult<std::ops::Range<usize>> {
    match offset.checked_add(len) {
        Some(end) if end <= chunk_len => Ok(offset..end),
        _ => Err(StoreError::new(
            ErrorKind::OutOfRange,
            format!("{len} bytes at {offset} reach past {idx}'s {chunk_len} bytes"),
        )),
    }
}

macro_rules! forward_store {
    ($ty:ty) => {
        impl<S: Store + ?Sized> Store for $ty {
            fn geometry(&self) -> Geometry {
                (**self).geometry()
            }
            fn caps(&self) -> Caps {
                (**self).caps()
            }
            fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
                (**self).read(idx)
            }
            fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
                (**self).write(idx, data)
            }
            fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
                (**self).flush()
            }
            fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
                (**self).trim(range)
            }
            fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
                (**self).status(idx)
            }
            fn read_part(
                &self,
                idx: ChunkIdx,
                offset: usize,
                len: usize,
            ) -> BoxFuture<'_, StoreResult<Bytes>> {
                (**self).read_part(idx, offset, len)
            }
            fn prefetch(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<()>> {
                (**self).prefetch(idx)
            }
            fn chunks_per_read(&self) -> u32 {
                (**self).chunks_per_read()
            }
            fn read_chunks(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<Vec<Bytes>>> {
                (**self).read_chunks(range)
            }
            fn catch_up(&self) -> BoxFuture<'_, StoreResult<()>> {
                (**self).catch_up()
            }
            fn take_over(&self) -> BoxFuture<'_, StoreResult<()>> {
                (**self).take_over()
            }
            fn memory_base(&self) -> BoxFuture<'_, StoreResult<Option<Arc<dyn MemoryBase>>>> {
                (**self).memory_base()
            }
            fn working_set(&self) -> Option<Arc<[ChunkIdx]>> {
                (**self).working_set()
            }
            fn reports_touches(&self) {
                (**self).reports_touches()
            }
            fn touched(&self, idx: ChunkIdx) {
                (**self).touched(idx)
            }
        }
    };
}

// Shared and boxed stores are stores: `Arc<dyn Store>` is the common currency.
forward_store!(Arc<S>);
forward_store!(Box<S>);

impl Geometry {
    /// Checks that `idx` names a chunk of this region.
    pub fn check_idx(&self, idx: ChunkIdx) -> StoreResult<()> {
        if self.contains(idx) {
            Ok(())
        } else {
            Err(StoreError::out_of_range(format!(
                "{idx} is past the end of a region of {} chunks",
                self.chunk_count()
            )))
        }
    }

    /// Checks that `idx` is in the region and `len` is exactly its length.
    pub fn check_write(&self, idx: ChunkIdx, len: usize) -> StoreResult<()> {
        self.check_idx(idx)?;
        let want = self.chunk_len(idx);
        if len == want {
            Ok(())
        } else {
            Err(StoreError::invalid(format!(
                "write of {len} bytes to {idx}, which is {want} bytes long"
            )))
        }
    }

    /// Checks that `range` lies within the region.
    pub fn check_range(&self, range: ChunkRange) -> StoreResult<()> {
        if range.end.0 <= self.chunk_count() {
            Ok(())
        } else {
            Err(StoreError::out_of_range(format!(
                "{range} reaches past the end of a region of {} chunks",
                self.chunk_count()
            )))
        }
    }
}
