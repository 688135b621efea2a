//! The region's memory: an anonymous private mapping, not inherited by child processes.

use std::io;
use std::ptr::NonNull;

use parking_lot::RwLock;

/// An anonymous, private, `MAP_NORESERVE` mapping marked `MADV_DONTFORK`, unmapped on drop.
///
/// Reads of it go through [`Mapping::read`] while the mapping is alive; [`Mapping::unmap`]
/// waits for reads in flight and refuses new ones, so that the region can unmap its memory
/// while other threads still hold the shared state.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    /// Held shared by reads, exclusively by `unmap`; false once unmapped.
    alive: RwLock<bool>,
}

// SAFETY: the mapping is plain memory owned by this value; every access goes through raw
// pointer copies whose concurrency is documented at the region level, and `alive` is a lock.
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` only allows reads under the `alive` lock.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes (a multiple of the page size), at `at` if given (then exactly there,
    /// or fails with `EEXIST` if something is mapped in the way).
    pub fn new(len: usize, at: Option<usize>) -> io::Result<Mapping> {
        let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
        if at.is_some() {
            flags |= libc::MAP_FIXED_NOREPLACE;
        }
        let hint = at.unwrap_or(0) as *mut libc::c_void;
        // SAFETY: an anonymous mapping; with MAP_FIXED_NOREPLACE the kernel refuses rather
        // than replace an existing mapping, so no memory of anyone else is touched.
        let p = unsafe { libc::mmap(hint, len, libc::PROT_READ | libc::PROT_WRITE, flags, -1, 0) };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap gave null"))?;
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
        // SAFETY: advice on our own mapping; it changes no content.
        if unsafe { libc::madvise(p, len, libc::MADV_DONTFORK) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(mapping)
    }

    /// The first byte.
    pub fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// The first byte, as a pointer.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Copies `dst.len()` bytes at `offset` out of the mapping; false if it was unmapped.
    ///
    /// A missing page faults, and the copy waits until the region's handler installs it: never
    /// call this on a thread the handler depends on (its reader thread, its runtime's async
    /// workers). Bytes that the application writes during the copy may be copied torn; the
    /// write is then reported by the next scan, and copied again.
    ///
    /// # Panics
    /// If the range is outside the mapping.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> bool {
        assert!(
            offset
                .checked_add(dst.len())
                .is_some_and(|end| end <= self.len),
            "read outside the mapping"
        );
        let alive = self.alive.read();
        if !*alive {
            return false;
        }
        // SAFETY: the range lies in the mapping (checked), which stays mapped while `alive` is
        // held shared (`unmap` takes it exclusively); `dst` is a distinct buffer. The source is
        // memory shared with the application's threads, which may write it concurrently: the
        // copy then sees old or new bytes, never anything else (plain memory, no invariants).
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
        true
    }

    /// Runs `f` while the mapping is guaranteed to stay mapped; `None` if it is unmapped.
    pub fn while_mapped<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        let alive = self.alive.read();
        alive.then(f)
    }

    /// Unmaps the memory (once): waits for reads in flight, refuses new ones.
    pub fn unmap(&self) {
        let mut alive = self.alive.write();
        if *alive {
            *alive = false;
            // SAFETY: our own mapping, unmapped once (guarded by `alive`, held exclusively):
            // no read is in flight, and the region's safe API hands out no reference that
            // outlives the region, which unmaps only when it is dropped or closed.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        self.unmap();
    }
}
