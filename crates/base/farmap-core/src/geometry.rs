//! Region geometry: total size, chunk size, and chunk index newtypes.

use std::fmt;
use std::ops::Range;

use crate::size::format_size;

/// Smallest chunk size: one page.
pub const MIN_CHUNK_SIZE: u32 = 4 * 1024;
/// Largest chunk size.
pub const MAX_CHUNK_SIZE: u32 = 4 * 1024 * 1024;
/// Chunk size used when nothing else is asked for.
pub const DEFAULT_CHUNK_SIZE: u32 = 64 * 1024;
/// Most chunks a region asked for by a user may have ([`Geometry::new_bounded`]): 2^28, i.e.
/// 16 TiB in 64 KiB chunks, 1 PiB in 4 MiB chunks.
///
/// Stages keep per-chunk state (presence, dirty bits, pull order) and tools walk every chunk
/// (`farmap info`, copies): past this, a region takes minutes to look at and gigabytes of
/// bookkeeping. A larger region needs a larger chunk size.
pub const MAX_CHUNKS: u64 = 1 << 28;

/// Why a [`Geometry`] could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GeometryError {
    /// The chunk size is not a power of two between 4 KiB and 4 MiB.
    #[error("chunk size {0} is not a power of two from 4 KiB to 4 MiB")]
    BadChunkSize(u64),
    /// The region is empty.
    #[error("region size must be greater than zero")]
    Empty,
    /// The region has more chunks than a `u64` index space can address comfortably.
    #[error("region size {0} is too large")]
    TooLarge(u64),
    /// The region has more than [`MAX_CHUNKS`] chunks ([`Geometry::new_bounded`]).
    #[error(
        "a region of {} in chunks of {} has {chunks} chunks, more than the {MAX_CHUNKS} farmap \
         allows (16TiB in 64KiB chunks, 1PiB in 4MiB chunks): use a larger chunk size",
        format_size(*size), format_size(*chunk_size)
    )]
    TooManyChunks {
        /// Region size asked for.
        size: u64,
        /// Chunk size asked for.
        chunk_size: u64,
        /// How many chunks that makes.
        chunks: u64,
    },
}

/// The shape of a region: its size in bytes and its chunk size.
///
/// The chunk size is a power of two from [`MIN_CHUNK_SIZE`] to [`MAX_CHUNK_SIZE`]. The size need
/// not be a multiple of the chunk size: the last chunk is then shorter
/// (see [`Geometry::chunk_len`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Geometry {
    size: u64,
    chunk_shift: u8,
}

impl Geometry {
    /// Builds a geometry, checking the chunk size and that the region is not empty.
    pub fn new(size: u64, chunk_size: u64) -> Result<Self, GeometryError> {
        if !chunk_size.is_power_of_two()
            || chunk_size < u64::from(MIN_CHUNK_SIZE)
            || chunk_size > u64::from(MAX_CHUNK_SIZE)
        {
            return Err(GeometryError::BadChunkSize(chunk_size));
        }
        if size == 0 {
            return Err(GeometryError::Empty);
        }
        // Keep offset arithmetic (offset + len) far from overflow.
        if size > (1u64 << 62) {
            return Err(GeometryError::TooLarge(size));
        }
        Ok(Self {
            size,
            chunk_shift: chunk_size.trailing_zeros() as u8,
        })
    }

    /// Like [`new`](Self::new), and refuses a region of more than [`MAX_CHUNKS`] chunks with
    /// [`GeometryError::TooManyChunks`] (whose message names the way out: a larger chunk).
    /// What users ask for (store specs) goes through this; `new` stays permissive for code
    /// that only does index arithmetic on a huge sparse region.
    pub fn new_bounded(size: u64, chunk_size: u64) -> Result<Self, GeometryError> {
        let g = Self::new(size, chunk_size)?;
        let chunks = g.chunk_count();
        if chunks > MAX_CHUNKS {
            return Err(GeometryError::TooManyChunks {
                size,
                chunk_size,
                chunks,
            });
        }
        Ok(g)
    }

    /// A geometry with the [default chunk size](DEFAULT_CHUNK_SIZE).
    pub fn with_default_chunk(size: u64) -> Result<Self, GeometryError> {
        Self::new(size, u64::from(DEFAULT_CHUNK_SIZE))
    }

    /// Region size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Chunk size in bytes.
    pub fn chunk_size(&self) -> u32 {
        1u32 << self.chunk_shift
    }

    /// log2 of the chunk size.
    pub fn chunk_shift(&self) -> u32 {
        u32::from(self.chunk_shift)
    }

    /// Number of chunks, counting a shorter last chunk.
    pub fn chunk_count(&self) -> u64 {
        self.size.div_ceil(u64::from(self.chunk_size()))
    }

    /// All chunks of the region.
    pub fn all(&self) -> ChunkRange {
        ChunkRange::new(ChunkIdx(0), ChunkIdx(self.chunk_count()))
    }

    /// Whether `idx` names a chunk of this region.
    pub fn contains(&self, idx: ChunkIdx) -> bool {
        idx.0 < self.chunk_count()
    }

    /// Byte offset of the start of chunk `idx`.
    pub fn offset_of(&self, idx: ChunkIdx) -> u64 {
        idx.0 << self.chunk_shift
    }

    /// The chunk holding byte `offset`.
    pub fn chunk_of(&self, offset: u64) -> ChunkIdx {
        ChunkIdx(offset >> self.chunk_shift)
    }

    /// Length of chunk `idx` in bytes: the chunk size, except for a shorter last chunk.
    /// Zero for an index past the end.
    pub fn chunk_len(&self, idx: ChunkIdx) -> usize {
        let start = self.offset_of(idx);
        if idx.0 >= self.chunk_count() {
            return 0;
        }
        (self.size - start).min(u64::from(self.chunk_size())) as usize
    }

    /// Byte range of chunk `idx` within the region.
    pub fn byte_range(&self, idx: ChunkIdx) -> Range<u64> {
        let start = self.offset_of(idx);
        start..start + self.chunk_len(idx) as u64
    }

    /// The chunks that overlap the byte range `offset..offset+len` (empty when `len` is 0).
    pub fn chunks_for(&self, offset: u64, len: u64) -> ChunkRange {
        if len == 0 {
            let c = self.chunk_of(offset);
            return ChunkRange::new(c, c);
        }
        let first = self.chunk_of(offset);
        let last = self.chunk_of(offset + len - 1);
        ChunkRange::new(first, ChunkIdx(last.0 + 1))
    }

    /// Checks that `offset..offset+len` lies within the region.
    pub fn check_bytes(&self, offset: u64, len: u64) -> bool {
        offset.checked_add(len).is_some_and(|end| end <= self.size)
    }
}

impl fmt::Debug for Geometry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Geometry")
            .field("size", &self.size)
            .field("chunk_size", &self.chunk_size())
            .finish()
    }
}

impl fmt::Display for Geometry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} in {} chunks of {}",
            format_size(self.size),
            self.chunk_count(),
            format_size(u64::from(self.chunk_size()))
        )
    }
}

/// Index of a chunk within a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ChunkIdx(pub u64);

impl ChunkIdx {
    /// The index as a `usize`, for indexing in-memory tables.
    ///
    /// # Panics
    /// On targets where the index does not fit a `usize` (never on 64-bit Linux).
    pub fn as_usize(self) -> usize {
        usize::try_from(self.0).expect("chunk index fits usize")
    }
}

impl fmt::Display for ChunkIdx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "chunk {}", self.0)
    }
}

impl From<u64> for ChunkIdx {
    fn from(v: u64) -> Self {
        Self(v)
    }
}

/// A half-open range of chunks, `start..end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChunkRange {
    /// First chunk in the range.
    pub start: ChunkIdx,
    /// One past the last chunk in the range.
    pub end: ChunkIdx,
}

impl ChunkRange {
    /// The range `start..end`; an inverted range is treated as empty.
    pub fn new(start: ChunkIdx, end: ChunkIdx) -> Self {
        Self {
            start,
            end: end.max(start),
        }
    }

    /// One chunk.
    pub fn single(idx: ChunkIdx) -> Self {
        Self::new(idx, ChunkIdx(idx.0 + 1))
    }

    /// Number of chunks in the range.
    pub fn len(&self) -> u64 {
        self.end.0 - self.start.0
    }

    /// Whether the range holds no chunk.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `idx` lies in the range.
    pub fn contains(&self, idx: ChunkIdx) -> bool {
        idx >= self.start && idx < self.end
    }

    /// The chunk indices of the range, in order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = ChunkIdx> {
        (self.start.0..self.end.0).map(ChunkIdx)
    }
}

impl fmt::Display for ChunkRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "chunks {}..{}", self.start.0, self.end.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_sizes_are_checked() {
        assert!(Geometry::new(1 << 20, 4096).is_ok());
        assert!(Geometry::new(1 << 20, 4 << 20).is_ok());
        assert_eq!(
            Geometry::new(1 << 20, 2048),
            Err(GeometryError::BadChunkSize(2048))
        );
        assert_eq!(
            Geometry::new(1 << 20, 8 << 20),
            Err(GeometryError::BadChunkSize(8 << 20))
        );
        assert_eq!(
            Geometry::new(1 << 20, 12288),
            Err(GeometryError::BadChunkSize(12288))
        );
        assert_eq!(Geometry::new(0, 4096), Err(GeometryError::Empty));
    }

    #[test]
    fn chunk_count_is_capped_with_a_message_naming_the_way_out() {
        assert_eq!(
            Geometry::new_bounded(16 << 40, 64 << 10)
                .unwrap()
                .chunk_count(),
            MAX_CHUNKS
        );
        assert!(
            Geometry::new_bounded(1 << 50, 4 << 20).is_ok(),
            "1 PiB in 4 MiB chunks"
        );
        let e = Geometry::new_bounded(1 << 50, 64 << 10).unwrap_err();
        assert_eq!(
            e,
            GeometryError::TooManyChunks {
                size: 1 << 50,
                chunk_size: 64 << 10,
                chunks: 1 << 34
            }
        );
        let msg = e.to_string();
        assert!(
            msg.contains("1PiB") && msg.contains("64KiB") && msg.contains("larger chunk size"),
            "{msg}"
        );
        assert!(Geometry::new_bounded((16 << 40) + 1, 64 << 10).is_err());
        assert!(Geometry::new(1 << 50, 64 << 10).is_ok(), "new does not cap");
    }

    #[test]
    fn short_last_chunk() {
        let g = Geometry::new(10_000, 4096).unwrap();
        assert_eq!(g.chunk_count(), 3);
        assert_eq!(g.chunk_len(ChunkIdx(0)), 4096);
        assert_eq!(g.chunk_len(ChunkIdx(2)), 10_000 - 8192);
        assert_eq!(g.chunk_len(ChunkIdx(3)), 0);
        assert_eq!(g.byte_range(ChunkIdx(2)), 8192..10_000);
    }

    #[test]
    fn chunks_for_byte_ranges() {
        let g = Geometry::new(1 << 20, 4096).unwrap();
        assert_eq!(
            g.chunks_for(0, 4096),
            ChunkRange::new(ChunkIdx(0), ChunkIdx(1))
        );
        assert_eq!(
            g.chunks_for(4095, 2),
            ChunkRange::new(ChunkIdx(0), ChunkIdx(2))
        );
        assert!(g.chunks_for(100, 0).is_empty());
        assert!(g.check_bytes(0, 1 << 20));
        assert!(!g.check_bytes(1, 1 << 20));
        assert!(!g.check_bytes(u64::MAX, 2));
    }
}
