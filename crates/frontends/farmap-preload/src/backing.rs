//! [`RawBacking`]: farmap-heap's host services made of raw system calls (metadata mappings,
//! purges, futex sleeps) and the thread pointer.

use core::sync::atomic::AtomicU32;

use farmap_heap::Backing;
use rustix::mm::Advice;
use rustix::thread::futex;

use crate::sys;

/// The backing of every heap of this library: plain memory for metadata,
/// `madvise(MADV_DONTNEED)` for purges (in the region: a REMOVE event farmap run reads
/// before the call returns, after which the pages are zeros), futexes for sleeping.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawBacking;

// SAFETY: `map_metadata` returns a fresh private anonymous mapping (zeros, page-aligned,
// used by nothing else) that is never unmapped but through `unmap_metadata`; `purge`
// returns true only when `MADV_DONTNEED` succeeded on exactly the range (a private
// anonymous range then reads as zeros, and in a registered region the handler treats the
// REMOVE as zeros, `RemoveMeans::Zero`); `wait` is FUTEX_WAIT, which returns at the latest
// when woken after the word changed.
unsafe impl Backing for RawBacking {
    fn map_metadata(&self, len: usize) -> *mut u8 {
        sys::map_anon(len)
    }

    unsafe fn unmap_metadata(&self, ptr: *mut u8, len: usize) {
        // SAFETY: the heap's contract: a mapping of `map_metadata`, no longer used.
        unsafe { sys::unmap(ptr, len) }
    }

    unsafe fn purge(&self, ptr: *mut u8, len: usize) -> bool {
        // SAFETY: the heap hands over a free span of its region, which nothing uses.
        unsafe { sys::madvise(ptr, len, Advice::LinuxDontNeed) }.is_ok()
    }

    fn wait(&self, word: &AtomicU32, expected: u32) {
        let _ = futex::wait(word, futex::Flags::PRIVATE, expected, None);
    }

    fn wake_one(&self, word: &AtomicU32) {
        let _ = futex::wake(word, futex::Flags::PRIVATE, 1);
    }

    fn thread_hint(&self) -> usize {
        thread_pointer()
    }
}

/// The thread pointer (`%fs:0`, the TCB's address, distinct per live thread), read without
/// TLS.
#[cfg(target_arch = "x86_64")]
fn thread_pointer() -> usize {
    let tp: usize;
    // SAFETY: on x86-64 Linux, `%fs:0` holds the thread control block's own address (the
    // TLS ABI); reading it has no side effects.
    unsafe {
        core::arch::asm!("mov {}, qword ptr fs:[0]", out(reg) tp, options(nostack, readonly, preserves_flags));
    }
    tp >> 6
}

/// The stack address in MiB (threads' stacks are at least that far apart).
#[cfg(not(target_arch = "x86_64"))]
fn thread_pointer() -> usize {
    let marker = 0u8;
    core::ptr::addr_of!(marker).addr() >> 20
}
