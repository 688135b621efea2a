//! [`MappedRegion`]: the mounted file mapped `MAP_SHARED`, seen as a [`RegionSlice`].

use std::fs::File;
use std::io;
use std::marker::PhantomData;

use farmap_memory::{RegionSlice, SharedMapping};

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
/// - Dropping it writes dirty pages back first (`msync`), then unmaps. A process
///   that exits without dropping it (`std::process::exit`, an abort) while pages are dirty
///   hangs in the kernel: exiting unmaps the file, which waits for write-backs that the
///   process's own (already stopped) threads would have served. Drop or
///   [`sync`](Self::sync) before exiting.
#[derive(Debug)]
pub struct MappedRegion<'m> {
    map: SharedMapping,
    _mount: PhantomData<&'m crate::FuseMount>,
}

impl MappedRegion<'_> {
    pub(crate) fn new(file: File, len: usize, writable: bool) -> io::Result<Self> {
        // The file's size is fixed (the file system refuses truncation), so no page of it
        // goes away under the mapping.
        Ok(Self {
            map: SharedMapping::new(file, len, writable, "a mounted region")?,
            _mount: PhantomData,
        })
    }

    /// The region's memory. On a read-only mount, writing through it raises SIGSEGV.
    pub fn memory(&self) -> RegionSlice<'_> {
        self.map.memory()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the mapping is empty (never).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Writes the mapping's dirty pages back to the store (`msync(MS_SYNC)`) and flushes the
    /// store (`fsync`: managed stores push everything to the remote).
    pub fn sync(&self) -> io::Result<()> {
        self.map.sync()
    }

    /// Tells the kernel the memory will be read in random order (`MADV_RANDOM`): a page
    /// fault then reads its page alone instead of the read-ahead window around it.
    pub fn advise_random(&self) -> io::Result<()> {
        self.map.advise_random()
    }

    /// The open file behind the mapping.
    pub fn file(&self) -> &File {
        self.map.file()
    }
}
