//! What the integration tests share: a [`Backing`] over libc, and heaps over `mmap`ed regions.
#![allow(dead_code)]

use std::ops::Deref;
use std::ptr;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use farmap_heap::{Backing, Heap, PAGE_SIZE};

pub const MIB: usize = 1 << 20;

/// Metadata from `mmap` (`MAP_NORESERVE`), purges by `madvise(MADV_DONTNEED)` (or none at
/// all while `lie` is set: purge then reports success and leaves the bytes), futex sleeps.
#[derive(Debug, Default)]
pub struct MmapBacking {
    pub purges: AtomicUsize,
    pub lie: bool,
}

/// A private anonymous `MAP_NORESERVE` mapping of `len` bytes, or null.
pub fn map(len: usize) -> *mut u8 {
    // SAFETY: a new private anonymous mapping at an address the kernel picks; no existing
    // memory is affected.
    let p = unsafe {
        libc::mmap(
            ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        ptr::null_mut()
    } else {
        p.cast()
    }
}

// SAFETY: `map_metadata` returns fresh zero-filled anonymous memory (page aligned) that stays
// mapped until `unmap_metadata`; `purge` reports success only after `MADV_DONTNEED`, after
// which private anonymous pages read as zeros (except with `lie`, which tests set on
// purpose to see that calloc trusts it); futex waits return on wake or spuriously.
unsafe impl Backing for MmapBacking {
    fn map_metadata(&self, len: usize) -> *mut u8 {
        map(len)
    }

    unsafe fn unmap_metadata(&self, ptr: *mut u8, len: usize) {
        // SAFETY: `ptr..ptr + len` is a mapping from `map_metadata` that nothing uses (the
        // caller's contract).
        unsafe { libc::munmap(ptr.cast(), len) };
    }

    unsafe fn purge(&self, ptr: *mut u8, len: usize) -> bool {
        self.purges.fetch_add(1, Ordering::Relaxed);
        if self.lie {
            return true;
        }
        // SAFETY: the range is a free span of the region, which nothing uses (the caller's
        // contract); DONTNEED on private anonymous memory only drops its pages.
        unsafe { libc::madvise(ptr.cast(), len, libc::MADV_DONTNEED) == 0 }
    }

    fn wait(&self, word: &AtomicU32, expected: u32) {
        // SAFETY: FUTEX_WAIT reads the aligned u32 `word`, which outlives the call.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
                expected,
                ptr::null::<libc::timespec>(),
            )
        };
    }

    fn wake_one(&self, word: &AtomicU32) {
        // SAFETY: FUTEX_WAKE only uses the address of `word` as a key.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
                1,
            )
        };
    }
}

/// An `mmap`ed region, unmapped when dropped.
pub struct Region {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the region is plain memory; the heap over it arbitrates its use between threads.
unsafe impl Send for Region {}
// SAFETY: as above; `Region` itself is never written through after it is made.
unsafe impl Sync for Region {}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: the mapping was made by `map` with this length; the heap using it has
        // been dropped (`TestHeap` drops its heap first).
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// A heap over a fresh region of exactly `len` bytes of whole pages.
pub struct TestHeap {
    pub heap: Heap<MmapBacking>,
    region: Region,
}

impl TestHeap {
    pub fn new(len: usize, arenas: usize) -> Self {
        Self::with_backing(len, arenas, MmapBacking::default())
    }

    pub fn with_backing(len: usize, arenas: usize, backing: MmapBacking) -> Self {
        let ptr = map(len + PAGE_SIZE);
        assert!(!ptr.is_null(), "mmap of {len} bytes failed");
        let region = Region {
            ptr,
            len: len + PAGE_SIZE,
        };
        let start = ptr.wrapping_add(ptr.align_offset(PAGE_SIZE));
        // SAFETY: `start..start + len` lies in the fresh mapping `region`, which reads as
        // zeros, is used by nothing else and outlives the heap (dropped first).
        let heap = unsafe { Heap::new(start, len, backing, arenas) }.expect("heap");
        assert_eq!(heap.stats().region_pages, len / PAGE_SIZE);
        Self { heap, region }
    }
}

impl Deref for TestHeap {
    type Target = Heap<MmapBacking>;

    fn deref(&self) -> &Self::Target {
        &self.heap
    }
}

/// Writes `byte` over `p..p + len`.
///
/// # Safety
/// `p..p + len` is an allocation the caller owns.
pub unsafe fn fill(p: *mut u8, len: usize, byte: u8) {
    // SAFETY: the caller's contract.
    unsafe { p.write_bytes(byte, len) };
}

/// Whether `p..p + len` holds `byte` everywhere.
///
/// # Safety
/// `p..p + len` is an allocation the caller owns.
pub unsafe fn holds(p: *const u8, len: usize, byte: u8) -> bool {
    // SAFETY: the caller's contract; nothing else writes it meanwhile.
    unsafe { std::slice::from_raw_parts(p, len) }
        .iter()
        .all(|&b| b == byte)
}

/// A xorshift generator: the stress tests' sizes and choices, the same on every run.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Mostly small, some up to 64 KiB, a few up to 2 MiB.
    pub fn size(&mut self) -> usize {
        let r = self.next();
        let bound = match r % 100 {
            0 => 2 * MIB,
            1..=9 => 64 << 10,
            _ => 512,
        };
        (r >> 8) as usize % bound
    }
}
