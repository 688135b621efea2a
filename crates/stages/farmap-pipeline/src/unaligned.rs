//! [`Unaligned`]: byte ranges over a chunk store; what frontends call.

use std::ops::Range;

use bytes::Bytes;
use farmap_core::{
    zero_chunk, BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, Store,
    StoreError, StoreResult,
};
use futures::stream::{self, TryStreamExt};
use tokio::sync::{Mutex, MutexGuard};

/// Number of stripe locks (fewer for a region with fewer chunks).
const STRIPES: u64 = 1024;

/// Chunks of one request in flight at once: every chunk of any ordinary kernel request
/// (NBD's 32 MiB in 64 KiB chunks is 512), while a huge request cannot flood the inner store.
const MAX_IN_FLIGHT: usize = 256;

/// The part of one chunk that a byte-range request covers.
#[derive(Debug, Clone, Copy)]
struct Piece {
    idx: ChunkIdx,
    /// Offset of the part within the chunk.
    at: usize,
    /// Length of the part.
    len: usize,
    /// Offset of the part within the request's buffer.
    pos: usize,
    /// Whether the part is the whole chunk.
    whole: bool,
}

impl Piece {
    fn in_chunk(&self) -> Range<usize> {
        self.at..self.at + self.len
    }

    fn in_buf(&self) -> Range<usize> {
        self.pos..self.pos + self.len
    }
}

/// Reads and writes byte ranges of any offset and length over a chunk store.
///
/// A range is cut into the chunks it covers; the chunks of a multi-chunk request are read or
/// written concurrently (up to 256 at once). A chunk covered whole is written as is; a chunk
/// covered in part is read, modified and written back.
///
/// Concurrency contract:
/// - Every write of a chunk, whole or read-modify-write, and every trim holds the chunk's
///   stripe lock (one of 1024, picked by chunk index): two partial writes to different bytes of
///   one chunk never lose each other's data, and a read-modify-write never resurrects data
///   under a concurrent whole-chunk write or trim.
/// - Reads take no lock; they see each chunk before or after any concurrent write of it
///   (the inner store replaces chunks whole), but a multi-chunk read is not a snapshot.
/// - A multi-chunk write is not atomic: concurrent readers may see some of its chunks
///   written and others not, and when one chunk fails the others may have been written
///   (like a failed `pwrite`). Ranges outside the region fail before anything is done.
/// - Its own [`Store`] methods pass through, with `write` and `trim` taking the stripe locks,
///   so chunk-level users can share it with byte-range users.
#[derive(Debug)]
pub struct Unaligned<S> {
    inner: S,
    geometry: Geometry,
    stripes: Box<[Mutex<()>]>,
}

impl<S: Store> Unaligned<S> {
    /// Wraps `inner`.
    pub fn new(inner: S) -> Self {
        let geometry = inner.geometry();
        let stripes = (0..geometry.chunk_count().min(STRIPES))
            .map(|_| Mutex::new(()))
            .collect();
        Self {
            inner,
            geometry,
            stripes,
        }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Reads `buf.len()` bytes at `offset` into `buf`.
    pub async fn read_at(&self, offset: u64, buf: &mut [u8]) -> StoreResult<()> {
        self.check("read", offset, buf.len() as u64)?;
        let mut pieces = self.pieces(offset, buf.len());
        if pieces.len() == 1 {
            let p = pieces[0];
            let chunk = self.read_chunk(p.idx).await?;
            buf.copy_from_slice(&chunk[p.in_chunk()]);
            return Ok(());
        }
        // Hand each piece its own disjoint part of `buf`.
        let mut rest = buf;
        let jobs = pieces.drain(..).map(|p| {
            let (part, tail) = std::mem::take(&mut rest).split_at_mut(p.len);
            rest = tail;
            Ok((p, part))
        });
        let jobs: Vec<StoreResult<(Piece, &mut [u8])>> = jobs.collect();
        stream::iter(jobs)
            .try_for_each_concurrent(MAX_IN_FLIGHT, |(p, part)| async move {
                let chunk = self.read_chunk(p.idx).await?;
                part.copy_from_slice(&chunk[p.in_chunk()]);
                Ok(())
            })
            .await
    }

    /// Reads `len` bytes at `offset`. A whole chunk is returned as the inner store returned
    /// it, without copying; part of one chunk is read alone ([`Store::read_part`]: a file
    /// reads only those bytes).
    pub async fn read_bytes(&self, offset: u64, len: usize) -> StoreResult<Bytes> {
        self.check("read", offset, len as u64)?;
        let pieces = self.pieces(offset, len);
        match pieces.as_slice() {
            [] => Ok(Bytes::new()),
            [p] if p.whole => self.read_chunk(p.idx).await,
            [p] => {
                let r = p.in_chunk();
                let part = self.inner.read_part(p.idx, r.start, r.len()).await?;
                if part.len() != r.len() {
                    return Err(StoreError::new(
                        ErrorKind::Corrupt,
                        format!(
                            "the inner store returned {} bytes of {}, not {}",
                            part.len(),
                            p.idx,
                            r.len()
                        ),
                    ));
                }
                Ok(part)
            }
            _ => {
                let mut buf = vec![0; len];
                self.read_at(offset, &mut buf).await?;
                Ok(Bytes::from(buf))
            }
        }
    }

    /// Hints that the chunks of `len` bytes at `offset` will be read ([`Store::prefetch`]).
    pub async fn prefetch_bytes(&self, offset: u64, len: u64) -> StoreResult<()> {
        self.check("prefetch", offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let g = self.geometry;
        let first = g.chunk_of(offset).0;
        let last = g.chunk_of(offset + len - 1).0;
        for idx in first..=last {
            self.inner.prefetch(ChunkIdx(idx)).await?;
        }
        Ok(())
    }

    /// Writes `data` at `offset`.
    pub async fn write_at(&self, offset: u64, data: &[u8]) -> StoreResult<()> {
        self.check("write", offset, data.len() as u64)?;
        self.write_pieces(offset, data, |r| Bytes::copy_from_slice(&data[r]))
            .await
    }

    /// Writes `data` at `offset`; the chunks it covers whole are passed to the inner store as
    /// slices of `data`, without copying.
    pub async fn write_bytes(&self, offset: u64, data: Bytes) -> StoreResult<()> {
        self.check("write", offset, data.len() as u64)?;
        self.write_pieces(offset, &data, |r| data.slice(r)).await
    }

    /// Makes `len` bytes at `offset` read as zeros: the chunks covered whole are trimmed in
    /// the inner store, the parts of chunks at either end are overwritten with zeros.
    pub async fn trim_at(&self, offset: u64, len: u64) -> StoreResult<()> {
        self.check("trim", offset, len)?;
        let len = usize::try_from(len).map_err(|_| {
            StoreError::invalid(format!(
                "a trim of {len} bytes is too large for one request"
            ))
        })?;
        // Only the chunks at either end can be partial: the bookkeeping stays two pieces
        // and one range, whatever the length (a whole-region trim lists no chunks).
        let edges = self.edge_pieces(offset, len);
        let (first_whole, end_whole) = self.whole_chunks(offset, len as u64);
        let partial = edges
            .into_iter()
            .flatten()
            .filter(|p| !p.whole)
            .map(|p| async move {
                let zeros = zero_chunk(p.len);
                self.write_piece(p, &zeros, || zeros.clone()).await
            });
        let trim = async {
            if first_whole < end_whole {
                self.trim_locked(ChunkRange::new(ChunkIdx(first_whole), ChunkIdx(end_whole)))
                    .await
            } else {
                Ok(())
            }
        };
        futures::try_join!(trim, futures::future::try_join_all(partial))?;
        Ok(())
    }

    /// Fails with `OutOfRange` unless `offset..offset+len` lies within the region.
    fn check(&self, what: &str, offset: u64, len: u64) -> StoreResult<()> {
        if self.geometry.check_bytes(offset, len) {
            Ok(())
        } else {
            Err(StoreError::out_of_range(format!(
                "{what} of {len} bytes at offset {offset} reaches past the end of a region \
                 of {} bytes",
                self.geometry.size()
            )))
        }
    }

    /// The pieces of the first and the last chunk of `offset..offset+len` (one when the
    /// range lies in one chunk; none when it is empty).
    fn edge_pieces(&self, offset: u64, len: usize) -> [Option<Piece>; 2] {
        if len == 0 {
            return [None, None];
        }
        let cs = u64::from(self.geometry.chunk_size());
        let end = offset + len as u64;
        let (first, last) = (offset / cs, (end - 1) / cs);
        let piece_of = |idx: u64| {
            let start = (idx * cs).max(offset);
            let stop = ((idx + 1) * cs).min(end);
            self.pieces(start, (stop - start) as usize).pop()
        };
        let head = piece_of(first);
        let tail = if last > first { piece_of(last) } else { None };
        [head, tail]
    }

    /// The chunks `first..end` that `offset..offset+len` covers whole.
    fn whole_chunks(&self, offset: u64, len: u64) -> (u64, u64) {
        let g = self.geometry;
        let cs = u64::from(g.chunk_size());
        let end = offset + len;
        let first = offset.div_ceil(cs);
        // The region's last chunk may be short: it is whole when the range reaches the end.
        let end_chunk = if end == g.size() {
            g.chunk_count()
        } else {
            end / cs
        };
        (first, end_chunk.max(first))
    }

    /// The chunk parts of the byte range `offset..offset+len` (which lies within the region).
    fn pieces(&self, offset: u64, len: usize) -> Vec<Piece> {
        let g = self.geometry;
        let end = offset + len as u64;
        g.chunks_for(offset, len as u64)
            .iter()
            .map(|idx| {
                let chunk = g.byte_range(idx);
                let start = chunk.start.max(offset);
                let stop = chunk.end.min(end);
                Piece {
                    idx,
                    at: (start - chunk.start) as usize,
                    len: (stop - start) as usize,
                    pos: (start - offset) as usize,
                    whole: start == chunk.start && stop == chunk.end,
                }
            })
            .collect()
    }

    fn stripe(&self, idx: ChunkIdx) -> &Mutex<()> {
        &self.stripes[(idx.0 % self.stripes.len() as u64) as usize]
    }

    /// Reads a chunk, checking that the inner store returned its exact length.
    async fn read_chunk(&self, idx: ChunkIdx) -> StoreResult<Bytes> {
        let chunk = self.inner.read(idx).await?;
        let want = self.geometry.chunk_len(idx);
        if chunk.len() == want {
            Ok(chunk)
        } else {
            Err(StoreError::new(
                ErrorKind::Corrupt,
                format!(
                    "the inner store returned {} bytes for {idx}, which is {want} bytes long",
                    chunk.len()
                ),
            ))
        }
    }

    /// Writes the pieces of `data` concurrently; `whole(range)` gives the bytes of a piece
    /// that covers its chunk whole.
    async fn write_pieces<F>(&self, offset: u64, data: &[u8], whole: F) -> StoreResult<()>
    where
        F: Fn(Range<usize>) -> Bytes + Sync,
    {
        let pieces = self.pieces(offset, data.len());
        if let [p] = pieces.as_slice() {
            return self
                .write_piece(*p, &data[p.in_buf()], || whole(p.in_buf()))
                .await;
        }
        let whole = &whole;
        stream::iter(pieces.into_iter().map(Ok))
            .try_for_each_concurrent(MAX_IN_FLIGHT, |p| async move {
                self.write_piece(p, &data[p.in_buf()], || whole(p.in_buf()))
                    .await
            })
            .await
    }

    /// Writes one piece under its chunk's stripe lock: a whole chunk as `whole()` gives it, a
    /// part by reading the chunk, patching in `part` and writing it back.
    async fn write_piece(
        &self,
        p: Piece,
        part: &[u8],
        whole: impl FnOnce() -> Bytes,
    ) -> StoreResult<()> {
        if p.whole {
            let data = whole();
            let _stripe = self.stripe(p.idx).lock().await;
            return self.inner.write(p.idx, data).await;
        }
        let _stripe = self.stripe(p.idx).lock().await;
        let mut chunk = self.read_chunk(p.idx).await?.to_vec();
        chunk[p.in_chunk()].copy_from_slice(part);
        self.inner.write(p.idx, Bytes::from(chunk)).await
    }

    /// Trims `range` in the inner store while holding the stripe locks of all its chunks.
    async fn trim_locked(&self, range: ChunkRange) -> StoreResult<()> {
        let n = self.stripes.len() as u64;
        // Stripes are taken in ascending order; every other holder takes one stripe at a time,
        // so no cycle of waiters can form.
        let mut stripes: Vec<u64> = if range.len() >= n {
            (0..n).collect()
        } else {
            range.iter().map(|idx| idx.0 % n).collect()
        };
        stripes.sort_unstable();
        stripes.dedup();
        let mut guards: Vec<MutexGuard<'_, ()>> = Vec::with_capacity(stripes.len());
        for s in stripes {
            guards.push(self.stripes[s as usize].lock().await);
        }
        self.inner.trim(range).await
    }
}

impl<S: Store> Store for Unaligned<S> {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn caps(&self) -> Caps {
        self.inner.caps()
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        self.inner.read(idx)
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            let _stripe = self.stripe(idx).lock().await;
            self.inner.write(idx, data).await
        })
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        self.inner.flush()
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(self.trim_locked(range))
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        self.inner.status(idx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_range() {
        let g = Geometry::new(3 * 4096 + 100, 4096).expect("geometry");
        let u = Unaligned::new(farmap_testkit::ModelStore::new(g));
        let p = u.pieces(4000, 4096 + 200);
        assert_eq!(p.len(), 3);
        assert_eq!(
            (p[0].idx, p[0].at, p[0].len, p[0].pos),
            (ChunkIdx(0), 4000, 96, 0)
        );
        assert!(!p[0].whole && p[1].whole && !p[2].whole);
        assert_eq!((p[1].at, p[1].len, p[1].pos), (0, 4096, 96));
        assert_eq!((p[2].at, p[2].len, p[2].pos), (0, 104, 4192));
        let last = u.pieces(3 * 4096, 100);
        assert_eq!(last.len(), 1);
        assert!(
            last[0].whole,
            "the short last chunk covered to its end is whole"
        );
        assert!(u.pieces(5, 0).is_empty());
    }
}
