//! [`Backing`]: what the heap asks of its host (metadata memory, purging, sleeping).

use core::sync::atomic::AtomicU32;

/// The services a [`Heap`](crate::Heap) needs from the program that embeds it.
///
/// The heap never allocates: its metadata lives in one mapping it asks for here, and freed
/// spans of at least [`PURGE_BYTES`](crate::PURGE_BYTES) are handed to [`purge`](Self::purge).
/// A malloc replacement implements this with raw system calls (`mmap`, `madvise`, `futex`);
/// tests implement it with `libc`. No method may allocate from the heap it serves, or
/// take a lock that such an allocation could hold.
///
/// # Safety
/// Implementers promise that:
/// - [`map_metadata`](Self::map_metadata) returns null or `len` bytes of readable, writable
///   memory that reads as zeros, aligned to at least 64 bytes, used by nothing else, that
///   stays mapped until [`unmap_metadata`](Self::unmap_metadata) is called with it;
/// - [`purge`](Self::purge) returns `true` only if the range reads as zeros afterwards (the
///   heap then skips `calloc`'s memset there) and touches no memory outside the range;
/// - [`wait`](Self::wait) returns (at the latest) once [`wake_one`](Self::wake_one) has been
///   called for the same word after the word changed; spurious returns are fine.
pub unsafe trait Backing {
    /// Maps `len` bytes of zero-filled memory for metadata, or returns null. The heap
    /// touches only the part it uses, so a lazily backed mapping (`MAP_NORESERVE`) costs
    /// what is used: about 16 B per page of the region, plus 544 B per page that ever held
    /// small objects.
    fn map_metadata(&self, len: usize) -> *mut u8;

    /// Unmaps what [`map_metadata`](Self::map_metadata) returned; called by the heap's
    /// `Drop`. The default leaks it.
    ///
    /// # Safety
    /// `ptr` and `len` are a mapping returned by `map_metadata`, which nothing uses any more.
    unsafe fn unmap_metadata(&self, ptr: *mut u8, len: usize) {
        let _ = (ptr, len);
    }

    /// Gives the pages of `ptr..ptr + len` back (`madvise(MADV_DONTNEED)`), so that they read
    /// as zeros; returns whether it did. The range is page-aligned and lies in the region.
    /// The heap calls this with its span lock held (and maybe an arena lock), and hands the
    /// range out again only after this returns: a purge that is deferred must be done
    /// before returning `true`.
    ///
    /// # Safety
    /// Only the heap calls this, for a free span: nothing may use the range meanwhile.
    unsafe fn purge(&self, ptr: *mut u8, len: usize) -> bool;

    /// Sleeps while `word` holds `expected` (`FUTEX_WAIT_PRIVATE`). The default spins once,
    /// which turns the heap's locks into spin locks.
    fn wait(&self, word: &AtomicU32, expected: u32) {
        let _ = (word, expected);
        core::hint::spin_loop();
    }

    /// Wakes one thread sleeping in [`wait`](Self::wait) on `word` (`FUTEX_WAKE_PRIVATE`).
    fn wake_one(&self, word: &AtomicU32) {
        let _ = word;
    }

    /// A number that differs between threads and stays the same within one, to choose its
    /// arena (a malloc replacement reads the thread pointer, `%fs:0` on x86-64). The default
    /// is the stack address in MiB, which differs between threads whose stacks are at least
    /// 1 MiB apart.
    fn thread_hint(&self) -> usize {
        let marker = 0u8;
        core::ptr::addr_of!(marker).addr() >> 20
    }
}
