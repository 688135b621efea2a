//! [`MappingOf`]: a [`SharedMapping`] of something a mount serves, borrowing that mount so
//! that it is unmapped before the mount goes.

use std::fmt;
use std::fs::File;
use std::io;
use std::marker::PhantomData;

use crate::{RegionSlice, SharedMapping};

/// A shared mapping of the file or device that `Owner` (a FUSE mount, a kernel NBD mount)
/// serves, borrowing it: the mapping is unmapped before its server stops. Its memory is
/// reached through [`memory`](Self::memory), a [`RegionSlice`] (volatile, bounds-checked
/// accesses), because other processes that map the same file, and the kernel reading it
/// back from the store, change it behind Rust's back.
///
/// The process serves what it maps: touching the memory from a thread of the runtime that
/// serves it can deadlock (a page fault there waits for a request that thread would serve);
/// any other thread is fine. Dropping it writes dirty pages back first (`msync`), then
/// unmaps; a process that exits without dropping it while pages are dirty can hang in the
/// kernel (exiting unmaps, which waits for write-backs its stopped threads would serve).
pub struct MappingOf<'m, Owner> {
    map: SharedMapping,
    _owner: PhantomData<&'m Owner>,
}

impl<'m, Owner> MappingOf<'m, Owner> {
    /// `map`, tied to the lifetime of `owner`, which serves it.
    pub fn new(map: SharedMapping, _owner: &'m Owner) -> Self {
        Self {
            map,
            _owner: PhantomData,
        }
    }

    /// The mapped memory. On a read-only mapping, writing through it raises SIGSEGV.
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

    /// Writes the mapping's dirty pages back (`msync(MS_SYNC)`), then flushes the store
    /// (`fsync`: managed stores push everything to the remote). Blocks; must not run on a
    /// thread of the runtime that serves the mapping.
    pub fn sync(&self) -> io::Result<()> {
        self.map.sync()
    }

    /// Tells the kernel the memory will be read in random order (`MADV_RANDOM`): a page
    /// fault then reads its page alone instead of the read-ahead window around it.
    pub fn advise_random(&self) -> io::Result<()> {
        self.map.advise_random()
    }

    /// The open file or device behind the mapping.
    pub fn file(&self) -> &File {
        self.map.file()
    }
}

impl<Owner> fmt::Debug for MappingOf<'_, Owner> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MappingOf").field("map", &self.map).finish()
    }
}
