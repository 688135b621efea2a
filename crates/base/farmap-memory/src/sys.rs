//! Plain system calls the frontends share (FUSE, the kernel NBD mount, userfaultfd regions),
//! with safe signatures.

/// Writes the page cache of `fd`'s file back and waits for it (`sync_file_range` with
/// `WAIT_BEFORE | WRITE | WAIT_AFTER` over the whole file), without an `fsync`: on a FUSE
/// file, the dirty pages reach the server as writes and no flush request follows (what a
/// mount whose store takes no flush any more needs; rustix has no `sync_file_range`).
pub fn write_back_file(fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE
        | libc::SYNC_FILE_RANGE_WRITE
        | libc::SYNC_FILE_RANGE_WAIT_AFTER;
    // SAFETY: a plain system call on a descriptor the caller keeps open for the call.
    if unsafe { libc::sync_file_range(fd.as_raw_fd(), 0, 0, flags) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The calling thread's `errno` (`EIO` if the last error has none).
pub fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// The system page size.
pub fn page_size() -> usize {
    rustix::param::page_size()
}
