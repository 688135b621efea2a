//! [`MappedDevice`]: the whole device mapped `MAP_SHARED`, seen as a [`RegionSlice`].
//!
//! The one file of this crate with `unsafe` code: `mmap`, `msync`, `munmap`, and making a
//! [`RegionSlice`] over the mapping.

use std::fs::File;
use std::io;
use std::marker::PhantomData;
use std::ptr::NonNull;

use farmap_uffd::RegionSlice;
use rustix::mm::{mmap, msync, munmap, MapFlags, MsyncFlags, ProtFlags};

/// The device mapped shared, read-write (read-only on a read-only device): writes reach the
/// store at [`sync`](Self::sync), at the kernel's writeback, and at the mount's shutdown.
///
/// It borrows the [`NbdMount`](crate::NbdMount), so it is unmapped before the device goes.
/// Its memory is reached through [`memory`](Self::memory), a [`RegionSlice`] (volatile,
/// bounds-checked accesses), because other processes that map the device, and the kernel
/// reading it back from the store, change it behind Rust's back.
///
/// This process serves the device it maps: touching the memory from a thread of the
/// runtime that serves it can deadlock (a page fault there waits for a request that thread
/// would serve); any other thread is fine.
pub struct MappedDevice<'m> {
    ptr: NonNull<u8>,
    len: usize,
    file: File,
    _mount: PhantomData<&'m crate::NbdMount>,
}

// SAFETY: the mapping is plain shared memory with no thread affinity; every access to it goes
// through `RegionSlice` (volatile) or the system calls below, which any thread may make.
unsafe impl Send for MappedDevice<'_> {}
// SAFETY: `&MappedDevice` only hands out `RegionSlice`s and makes `msync`/`fsync` calls, all
// of which are fine from several threads at once.
unsafe impl Sync for MappedDevice<'_> {}

impl MappedDevice<'_> {
    pub(crate) fn new(file: File, len: usize, writable: bool) -> io::Result<Self> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "an empty device cannot be mapped",
            ));
        }
        let prot = if writable {
            ProtFlags::READ | ProtFlags::WRITE
        } else {
            ProtFlags::READ
        };
        // SAFETY: a new mapping at an address the kernel picks (no existing memory is
        // replaced) of a device we keep open; it is unmapped in `drop`. The device's size is
        // fixed while it is connected, and the mapping borrows the mount, so the device is
        // not disconnected while the mapping lives (an I/O error after a failure is a
        // SIGBUS, never memory of someone else).
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

    /// The region's memory. On a read-only device, writing through it raises SIGSEGV.
    pub fn memory(&self) -> RegionSlice<'_> {
        // SAFETY: `ptr..ptr+len` is mapped for as long as `self` lives (unmapped only in
        // `drop`, after every borrow of `self` has ended), readable and (unless read-only)
        // writable; this crate never forms a Rust reference to it, and the slice is the only
        // way out.
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

    /// Writes the mapping's dirty pages back (`msync(MS_SYNC)`) and flushes the store
    /// (`fsync`). Blocks; must not run on a thread of the runtime that serves the device.
    pub fn sync(&self) -> io::Result<()> {
        // SAFETY: the range is exactly our live mapping.
        unsafe { msync(self.ptr.as_ptr().cast(), self.len, MsyncFlags::SYNC) }?;
        self.file.sync_all()
    }

    /// The open device behind the mapping.
    pub fn file(&self) -> &File {
        &self.file
    }
}

impl Drop for MappedDevice<'_> {
    /// Writes dirty pages back (`msync`), then unmaps.
    fn drop(&mut self) {
        // SAFETY: the range is exactly our live mapping; no RegionSlice of it outlives
        // `self`, so nothing of ours writes it meanwhile.
        if let Err(e) = unsafe { msync(self.ptr.as_ptr().cast(), self.len, MsyncFlags::SYNC) } {
            tracing::warn!("msync of a mapped NBD device before unmapping it failed: {e}");
        }
        // SAFETY: the range is exactly our mapping, and no borrow of `self` (so no
        // RegionSlice of it) outlives this call.
        if let Err(e) = unsafe { munmap(self.ptr.as_ptr().cast(), self.len) } {
            tracing::warn!("munmap of a mapped NBD device failed: {e}");
        }
    }
}

impl std::fmt::Debug for MappedDevice<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedDevice")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}
