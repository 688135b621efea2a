//! glibc malloc settings for processes whose serving path must not fault fresh heap pages in
//! (a swap server) or that move a lot of data through short-lived buffers (migrations).
//! Both must be applied on the main thread before any other thread exists.

/// glibc malloc settings under which freed memory stays in the process (and locked): one
/// arena for every thread (each extra arena would grow, page by page, on its own), and what
/// [`keep_freed_memory`] sets (for a process that serves swap). Returns whether glibc took them all.
pub fn prepare_heap() -> bool {
    heap_settings(true)
}

/// glibc malloc settings under which freed memory is reused instead of given back: no
/// trimming of a heap's top, no `mmap` for blocks up to 32 MiB (each would be fresh pages,
/// zeroed by the kernel and faulted in one by one, and a `munmap` when freed), 16 MiB of
/// padding when a heap grows. For processes that move a lot of data through short-lived
/// buffers (a migration's network frames and page runs): with glibc's defaults a 1 GiB
/// migration faulted its receive buffers in page by page (13% of the CPU samples of its
/// pull). The price is memory: a peak of buffers stays in the process. Call it before any
/// other thread exists. Returns whether glibc took them all.
pub fn keep_freed_memory() -> bool {
    heap_settings(false)
}

/// glibc malloc settings under which a freed large buffer goes back to the kernel at once:
/// blocks of 1 MiB and more are `mmap`ed, always (glibc's default raises that threshold after
/// each free, up to 32 MiB, and then keeps freed blocks in each thread's arena). For servers
/// whose memory for clients is a budget: their resident memory then follows what the budget
/// holds instead of the peak of every arena. Call it before any other thread exists. Returns
/// whether glibc took it.
pub fn return_large_buffers() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: as in `heap_settings`.
        unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn heap_settings(one_arena: bool) -> bool {
    let mut settings = vec![
        (libc::M_TRIM_THRESHOLD, i32::MAX),
        (libc::M_MMAP_THRESHOLD, 32 << 20),
        (libc::M_TOP_PAD, 16 << 20),
    ];
    if one_arena {
        settings.insert(0, (libc::M_ARENA_MAX, 1));
    }
    // SAFETY: mallopt only changes the allocator's parameters, under the allocator's own
    // lock; it reads and writes no memory of the caller's.
    settings
        .iter()
        .all(|&(param, value)| unsafe { libc::mallopt(param, value) } == 1)
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn heap_settings(_one_arena: bool) -> bool {
    false
}
