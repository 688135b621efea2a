//! [`Stats`], [`HeapError`] and [`AllocError`]: what the heap reports.

use core::fmt;

/// Counters of a heap, from [`Heap::stats`](crate::Heap::stats).
///
/// Each arena and the span allocator are read under their own lock, one after the other:
/// while other threads allocate, the figures may come from slightly different moments.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Bytes of live allocations, each counted at its usable size.
    pub bytes_in_use: usize,
    /// Live allocations.
    pub objects_in_use: usize,
    /// Pages of the region in slabs or large objects.
    pub pages_in_use: usize,
    /// Pages in slabs (some may be empty slabs kept for reuse; see `Heap::trim`).
    pub slab_pages: usize,
    /// Pages in large objects.
    pub large_pages: usize,
    /// Bytes handed to `Backing::purge` (and purged) since the heap was made.
    pub purged_bytes: u64,
    /// The highest page end ever handed out: how far into the region the heap has reached.
    pub high_water_pages: usize,
    /// Pages in the region.
    pub region_pages: usize,
}

/// Why [`Heap::new`](crate::Heap::new) refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HeapError {
    /// The number of arenas is not in `1..=MAX_ARENAS`.
    Arenas(usize),
    /// The region holds no whole 64 KiB page.
    RegionTooSmall,
    /// The region has `u32::MAX` pages or more (256 TiB), or its metadata size overflows.
    RegionTooLarge,
    /// The backing could not map (64-byte aligned) metadata of this many bytes.
    MetadataUnavailable(usize),
}

impl fmt::Display for HeapError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Arenas(n) => write!(f, "{n} arenas asked for; a heap has 1 to 64"),
            Self::RegionTooSmall => write!(f, "the region holds no whole 64 KiB page"),
            Self::RegionTooLarge => write!(f, "the region is larger than 2^32 - 1 pages"),
            Self::MetadataUnavailable(len) => {
                write!(f, "the backing could not map {len} bytes of metadata")
            }
        }
    }
}

impl core::error::Error for HeapError {}

/// Why [`Heap::posix_memalign`](crate::Heap::posix_memalign) failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocError {
    /// The alignment is not a power of two multiple of `size_of::<*const ()>()`.
    InvalidAlignment,
    /// The region has no room for it.
    OutOfMemory,
}

impl AllocError {
    /// The errno `posix_memalign` returns for it on Linux (`EINVAL`, `ENOMEM`).
    pub const fn errno(self) -> i32 {
        match self {
            Self::InvalidAlignment => 22,
            Self::OutOfMemory => 12,
        }
    }
}

impl fmt::Display for AllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InvalidAlignment => write!(f, "the alignment is not a power of two"),
            Self::OutOfMemory => write!(f, "the heap's region is full"),
        }
    }
}

impl core::error::Error for AllocError {}
