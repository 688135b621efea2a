//! The region's memory: a private mapping (anonymous, or of a shared base's file, whose
//! written pages are then private copies), not inherited by child processes.
//!
//! One of the few files with `unsafe` code (see the crate documentation): mapping,
//! registering, discarding and unmapping the memory, and turning it into
//! [`RegionSlice`]s.

use std::io;
use std::ops::Deref;
use std::os::fd::BorrowedFd;
use std::ptr::NonNull;
use std::sync::Arc;

use parking_lot::RwLock;
use rustix::mm::{self, Advice, MapFlags, ProtFlags};

use crate::uffd::Uffd;
use farmap_memory::RegionSlice;

/// A private, `MAP_NORESERVE` mapping (anonymous, or of a file: its pages are the file's
/// until written, then private copies) marked `MADV_DONTFORK`, unmapped on drop.
///
/// Its memory is never reached through Rust references: only through [`RegionSlice`]s
/// (volatile accesses), system calls and the kernel's userfaultfd copies. Threads that share
/// a `Mapping` reach it while it is mapped with [`Mapping::with_slice`]; the region's own
/// [`OwnedMapping`] alone can unmap it, and waits for those accesses first.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    /// Held shared by accesses of other threads, exclusively by `unmap`; false once unmapped.
    alive: RwLock<bool>,
}

// SAFETY: the mapping's memory is never reached through references, only through volatile
// `RegionSlice` accesses and system calls, which tolerate concurrent use from any thread; the
// rest of the value is a pointer, a length and a lock.
unsafe impl Send for Mapping {}
// SAFETY: as above: `&Mapping` gives access to the memory only through `with_slice` (under
// the `alive` lock) and system calls on it.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes (a multiple of the page size), at `at` if given (then exactly there,
    /// or fails with `EEXIST` if something is mapped in the way).
    fn new(len: usize, at: Option<usize>, file: Option<BorrowedFd<'_>>) -> io::Result<Mapping> {
        let mut flags = MapFlags::PRIVATE | MapFlags::NORESERVE;
        if at.is_some() {
            flags |= MapFlags::FIXED_NOREPLACE;
        }
        let hint = at.unwrap_or(0) as *mut std::ffi::c_void;
        let prot = ProtFlags::READ | ProtFlags::WRITE;
        // SAFETY: a private mapping (anonymous, or of a file: writes never reach the file);
        // with MAP_FIXED_NOREPLACE the kernel refuses rather than replace an existing
        // mapping, so no memory of anyone else is touched.
        let p = unsafe {
            match file {
                Some(fd) => mm::mmap(hint, len, prot, flags, fd, 0),
                None => mm::mmap_anonymous(hint, len, prot, flags),
            }
        }?;
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap gave null"))?;
        // From here on, dropping `mapping` unmaps the memory.
        let mapping = Mapping {
            ptr,
            len,
            alive: RwLock::new(true),
        };
        if at.is_some_and(|a| a != p as usize) {
            // Kernels before 4.17 take MAP_FIXED_NOREPLACE as a mere hint.
            return Err(io::Error::from_raw_os_error(libc::EEXIST));
        }
        // A forked child must not see a registered region without a handler: with
        // MADV_DONTFORK the child simply has no mapping there (touching it is SIGSEGV).
        // SAFETY: advice on our own mapping, just made; it changes no content.
        unsafe { mm::madvise(p, len, Advice::LinuxDontFork) }?;
        Ok(mapping)
    }

    /// The first byte.
    pub fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Runs `f` with a slice of the whole memory while it is guaranteed to stay mapped;
    /// `None` if it is unmapped.
    ///
    /// A missing page faults, and the access waits until the region's handler installs it:
    /// never call this on a thread the handler depends on (its reader thread, its runtime's
    /// async workers).
    pub fn with_slice<R>(&self, f: impl FnOnce(RegionSlice<'_>) -> R) -> Option<R> {
        let alive = self.alive.read();
        if !*alive {
            return None;
        }
        // SAFETY: the memory stays mapped while `alive` is held shared (only `unmap` changes
        // it, holding it exclusively), which outlasts the slice (it cannot escape `f`); this
        // module never creates a reference into the memory.
        Some(f(unsafe { RegionSlice::new(self.ptr, self.len) }))
    }

    /// Copies `dst.len()` bytes at `offset` out of the mapping (volatile loads); false if it
    /// was unmapped. See [`with_slice`](Self::with_slice) for the threads it must not run on.
    /// Bytes that the application writes during the copy may be copied torn; the write is
    /// then reported by the next scan, and copied again.
    ///
    /// # Panics
    /// If the range is outside the mapping.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> bool {
        self.with_slice(|s| s.read_into(offset, dst).expect("read outside the mapping"))
            .is_some()
    }

    /// Runs `f` while the mapping is guaranteed to stay mapped; `None` if it is unmapped.
    pub fn while_mapped<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        let alive = self.alive.read();
        alive.then(f)
    }

    /// Discards `len` bytes at `offset` (page-aligned, inside the mapping) with
    /// `madvise(MADV_DONTNEED)`; `None` if the mapping is unmapped. In a registered region
    /// the call returns once the handler has read its remove event.
    ///
    /// # Panics
    /// If the range is unaligned or outside the mapping.
    pub fn discard(&self, offset: usize, len: usize) -> Option<io::Result<()>> {
        let page = crate::sys::page_size();
        assert!(
            offset.is_multiple_of(page)
                && len.is_multiple_of(page)
                && offset.checked_add(len).is_some_and(|end| end <= self.len),
            "discard of {len:#x} bytes at {offset:#x} outside the mapping or unaligned"
        );
        self.while_mapped(|| {
            // SAFETY: the range lies inside our mapping (checked), mapped while `alive` is
            // held. No reference into the memory exists (it is only reached through volatile
            // slices and system calls), so pages that read as zeros or as refetched content
            // afterwards break no assumption of the compiler.
            unsafe {
                mm::madvise(
                    self.ptr.as_ptr().add(offset).cast(),
                    len,
                    Advice::LinuxDontNeed,
                )
            }
            .map_err(io::Error::from)
        })
    }

    /// Registers the whole mapping with `uffd` in `mode` (`UFFDIO_REGISTER_MODE_*`); returns
    /// the ioctls available on it.
    pub fn register(&self, uffd: &Uffd, mode: u64) -> io::Result<u64> {
        let alive = self.alive.read();
        if !*alive {
            return Err(io::Error::from_raw_os_error(libc::ENOENT));
        }
        // SAFETY: a page-aligned private mapping of this process, owned by this
        // value and mapped while `alive` is held. Its memory is only reached through volatile
        // slices and system calls, which accept what registration brings: missing pages
        // blocking until a handler fills them, writes waiting out write protection, poisoned
        // pages raising SIGBUS.
        unsafe { uffd.register(self.addr(), self.len, mode) }
    }

    /// Unmaps the memory (once): waits for accesses in flight, refuses new ones.
    fn unmap(&self) {
        let mut alive = self.alive.write();
        if *alive {
            *alive = false;
            // SAFETY: our own mapping, unmapped once (guarded by `alive`, held exclusively):
            // no `with_slice` access is in flight, and slices of the owner (`OwnedMapping::
            // slice`) borrow it, while `OwnedMapping::unmap` needs it exclusively.
            let _ = unsafe { mm::munmap(self.ptr.as_ptr().cast(), self.len) };
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        self.unmap();
    }
}

/// The owner of a [`Mapping`]: the only handle that can unmap it, and so the only one that
/// hands out slices without taking the `alive` lock (a slice borrows the owner, and
/// [`unmap`](Self::unmap) needs it exclusively).
#[derive(Debug)]
pub(crate) struct OwnedMapping(Arc<Mapping>);

impl OwnedMapping {
    /// Maps `len` bytes (a multiple of the page size), at `at` if given. See [`Mapping`].
    pub fn new(len: usize, at: Option<usize>) -> io::Result<OwnedMapping> {
        Mapping::new(len, at, None).map(|m| OwnedMapping(Arc::new(m)))
    }

    /// Maps the first `len` bytes of `file` privately (a multiple of the page size), at `at`
    /// if given: pages read are the file's (its page cache, shared with whoever maps it),
    /// pages written are private copies. See [`Mapping`].
    pub fn of_file(
        len: usize,
        at: Option<usize>,
        file: BorrowedFd<'_>,
    ) -> io::Result<OwnedMapping> {
        Mapping::new(len, at, Some(file)).map(|m| OwnedMapping(Arc::new(m)))
    }

    /// The mapping, for other threads (which reach it through [`Mapping::with_slice`]).
    pub fn shared(&self) -> Arc<Mapping> {
        self.0.clone()
    }

    /// The whole memory as a slice, valid while the owner is borrowed.
    pub fn slice(&self) -> RegionSlice<'_> {
        // SAFETY: only `unmap`, which takes `&mut self` (so no slice of `&self` is alive), and
        // the last drop of the mapping (which needs the owner gone) unmap the memory: it stays
        // mapped for the borrow. This module never creates a reference into the memory.
        unsafe { RegionSlice::new(self.0.ptr, self.0.len) }
    }

    /// Unmaps the memory (waits for other threads' accesses in flight).
    pub fn unmap(&mut self) {
        self.0.unmap();
    }
}

impl Deref for OwnedMapping {
    type Target = Mapping;

    fn deref(&self) -> &Mapping {
        &self.0
    }
}
