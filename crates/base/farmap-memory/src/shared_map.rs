//! [`SharedMapping`]: a file or block device mapped `MAP_SHARED`, seen as a [`RegionSlice`].
//! The mounts (`farmap-fuse`'s file, `farmap-nbd-kernel`'s device) wrap it with a borrow of
//! the mount that serves what is mapped.

use std::fs::File;
use std::io;
use std::ptr::NonNull;

use rustix::mm::{madvise, mmap, msync, munmap, Advice, MapFlags, MsyncFlags, ProtFlags};

use crate::RegionSlice;

/// `len` bytes of an open file (or device) mapped shared, read-write or read-only. Writes
/// reach the file at [`sync`](Self::sync), at the kernel's writeback and at drop, which
/// writes dirty pages back (`msync`) before it unmaps.
///
/// Its memory is reached only through [`memory`](Self::memory), a [`RegionSlice`] (volatile,
/// bounds-checked accesses), because other processes that map the file, and the kernel
/// reading it back, change it behind Rust's back. A file that shrinks under the mapping, or
/// a device whose I/O fails, raises SIGBUS on access, never undefined behaviour.
pub struct SharedMapping {
    ptr: NonNull<u8>,
    len: usize,
    file: File,
    /// What is mapped, for the warnings of `drop`.
    what: &'static str,
}

// SAFETY: the mapping is plain shared memory with no thread affinity; every access to it goes
// through `RegionSlice` (volatile) or the system calls below, which any thread may make.
unsafe impl Send for SharedMapping {}
// SAFETY: `&SharedMapping` only hands out `RegionSlice`s and makes `msync`/`madvise`/`fsync`
// calls, all of which are fine from several threads at once.
unsafe impl Sync for SharedMapping {}

impl SharedMapping {
    /// Maps the first `len` bytes of `file` (`what` names it in warnings: "a mounted
    /// region", "an NBD device").
    pub fn new(file: File, len: usize, writable: bool, what: &'static str) -> io::Result<Self> {
        Self::new_at(file, 0, len, writable, what)
    }

    /// Maps `len` bytes of `file` from byte `offset` (a multiple of the page size).
    pub fn new_at(
        file: File,
        offset: u64,
        len: usize,
        writable: bool,
        what: &'static str,
    ) -> io::Result<Self> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{what} of length 0 cannot be mapped"),
            ));
        }
        let prot = if writable {
            ProtFlags::READ | ProtFlags::WRITE
        } else {
            ProtFlags::READ
        };
        // SAFETY: a new mapping at an address the kernel picks (no existing memory is
        // replaced) of a file we keep open; it is unmapped in `drop`. Pages that go away
        // under it (a truncation, a failed device) fault with SIGBUS; no Rust reference to
        // the memory is ever formed.
        let addr = unsafe {
            mmap(
                std::ptr::null_mut(),
                len,
                prot,
                MapFlags::SHARED,
                &file,
                offset,
            )
        }?;
        let ptr =
            NonNull::new(addr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap gave null"))?;
        Ok(Self {
            ptr,
            len,
            file,
            what,
        })
    }

    /// The mapped memory. On a read-only mapping, writing through it raises SIGSEGV.
    pub fn memory(&self) -> RegionSlice<'_> {
        // SAFETY: `ptr..ptr+len` is mapped for as long as `self` lives (unmapped only in
        // `drop`, after every borrow of `self` has ended), readable and (unless read-only)
        // writable; no Rust reference to it is formed, and the slice is the only way out.
        // A write to a read-only mapping is a signal, never undefined behaviour.
        unsafe { RegionSlice::new(self.ptr, self.len) }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty (never).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Writes the mapping's dirty pages back (`msync(MS_SYNC)`), then `fsync`s the file.
    pub fn sync(&self) -> io::Result<()> {
        // SAFETY: the range is exactly our live mapping.
        unsafe { msync(self.ptr.as_ptr().cast(), self.len, MsyncFlags::SYNC) }?;
        self.file.sync_all()
    }

    /// Tells the kernel the memory will be read in random order (`MADV_RANDOM`): a page
    /// fault then reads its page alone instead of the read-ahead window around it.
    pub fn advise_random(&self) -> io::Result<()> {
        // SAFETY: the range is exactly our live mapping; the advice changes no content.
        unsafe { madvise(self.ptr.as_ptr().cast(), self.len, Advice::Random) }?;
        Ok(())
    }

    /// The open file behind the mapping.
    pub fn file(&self) -> &File {
        &self.file
    }
}

impl Drop for SharedMapping {
    /// Writes dirty pages back (`msync`), then unmaps. The order matters for a file this
    /// process serves itself (FUSE, NBD): unmapping dirty shared pages writes them back while
    /// holding the process's memory-map lock, and a serving thread that then maps memory (an
    /// allocation) would wait for that lock forever.
    fn drop(&mut self) {
        // SAFETY: the range is exactly our live mapping; no RegionSlice of it outlives
        // `self`, so nothing of ours writes it meanwhile.
        if let Err(e) = unsafe { msync(self.ptr.as_ptr().cast(), self.len, MsyncFlags::SYNC) } {
            tracing::warn!("msync of {} before unmapping it failed: {e}", self.what);
        }
        // SAFETY: the range is exactly our mapping, and no borrow of `self` (so no
        // RegionSlice of it) outlives this call.
        if let Err(e) = unsafe { munmap(self.ptr.as_ptr().cast(), self.len) } {
            tracing::warn!("munmap of {} failed: {e}", self.what);
        }
    }
}

impl std::fmt::Debug for SharedMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedMapping")
            .field("what", &self.what)
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}
