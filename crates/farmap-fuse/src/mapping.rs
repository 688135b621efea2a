//! [`MappedRegion`]: the mounted file mapped `MAP_SHARED`, seen as a [`RegionSlice`].
//!
//! The one file of this crate with `unsafe` code: `mmap`, `msync`, `munmap`, and making a
//! [`RegionSlice`] over the mapping.

use std::fs::File;
use std::io;
use std::marker::PhantomData;
use std::ptr::NonNull;

use farmap_uffd::RegionSlice;
use rustix::mm::{madvise, mmap, msync, munmap, Advice, MapFlags, MsyncFlags, ProtFlags};

/// The mounted file mapped shared, read-write (read-only on a read-only mount): writes reach
/// the store at [`sync`](Self::sync), at the file's writeback, and at unmount.
///
/// It borrows the [`FuseMount`](crate::FuseMount), so it is unmapped before the mount goes.
/// Its memory is reached through [`memory`](Self::memory), a [`RegionSlice`] (volatile,
/// bounds-checked accesses), because other processes that map the file, and the kernel
/// reading it back from the store, change it behind Rust's back.
///
/// This process serves the file it maps, which has two rules:
/// - Touching the memory from a thread of the mount's own runtime can deadlock (a page fault
///   there waits for a request that thread would serve); any other thread is fine.
/// - Dropping it writes dirty pages back first (`msync`), then unmaps (see `Drop`). A process
///   that exits without dropping it (`std::process::exit`, an abort) while pages are dirty
///   hangs in the kernel: exiting unmaps the file, which waits for write-backs that the
///   process's own (already stopped) threads would have served. Drop or
///   [`sync`](Self::sync) before exiting.
pub struct MappedRegion<'m> {
    ptr: NonNull<u8>,
    len: usize,
    file: File,
    _mount: PhantomData<&'m crate::FuseMount>,
}

// SAFETY: the mapping is plain shared memory with no thread affinity; every access to it goes
// through `RegionSlice` (volatile) or the system calls below, which any thread may make.
unsafe impl Send for MappedRegion<'_> {}
// SAFETY: `&MappedRegion` only hands out `RegionSlice`s and makes `msync`/`fsync` calls,
// all of which are fine from several threads at once.
unsafe impl Sync for MappedRegion<'_> {}

impl<'m> MappedRegion<'m> {
    pub(crate) fn new(file: File, len: usize, writable: bool) -> io::Result<Self> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "an empty file cannot be mapped",
            ));
        }
        let prot = if writable {
            ProtFlags::READ | ProtFlags::WRITE
        } else {
            ProtFlags::READ
        };
        // SAFETY: a new mapping at an address the kernel picks (no existing memory is
        // replaced) of a file we keep open; it is unmapped in `drop`, and the file's size is
        // fixed (the file system refuses truncation), so no page of it goes away under it.
        let addr = unsafe { mmap(std::ptr::null_mut(), len, prot, MapFlags::SHARED, &file, 0) }?;
        let ptr =
            NonNull::new(addr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap gave null"))?;
        Ok(Self {
            ptr,
            len,
            file,
            _mount: PhantomData,
        })
    }

    /// The region's memory. On a read-only mount, writing through it raises SIGSEGV.
    pub fn memory(&self) -> RegionSlice<'_> {
        // SAFETY: `ptr..ptr+len` is mapped for as long as `self` lives (unmapped only in
        // `drop`, after every borrow of `self` has ended), readable and (unless read-only)
        // writable; this crate never forms a Rust reference to it, and the slice is the only
        // way out. Read-only mappings fault on writes (a signal, never undefined behaviour
        // in Rust's model, since no reference is involved).
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

    /// Writes the mapping's dirty pages back to the store (`msync(MS_SYNC)`) and flushes the
    /// store (`fsync`: managed stores push everything to the remote).
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

impl Drop for MappedRegion<'_> {
    /// Writes dirty pages back (`msync`), then unmaps. The order matters: unmapping a FUSE
    /// file's dirty shared mapping writes its pages back while holding this process's
    /// memory-map lock, and this process also serves those writes — a server thread that
    /// then maps memory (an allocation) would wait for that lock forever.
    fn drop(&mut self) {
        // SAFETY: the range is exactly our live mapping; no RegionSlice of it outlives
        // `self`, so nothing of ours writes it meanwhile.
        if let Err(e) = unsafe { msync(self.ptr.as_ptr().cast(), self.len, MsyncFlags::SYNC) } {
            tracing::warn!("msync of a mounted region before unmapping it failed: {e}");
        }
        // SAFETY: the range is exactly our mapping, and no borrow of `self` (so no
        // RegionSlice of it) outlives this call.
        if let Err(e) = unsafe { munmap(self.ptr.as_ptr().cast(), self.len) } {
            tracing::warn!("munmap of a mounted region failed: {e}");
        }
    }
}

impl std::fmt::Debug for MappedRegion<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedRegion")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}
