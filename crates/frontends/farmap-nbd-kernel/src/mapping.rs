//! [`MappedDevice`]: the whole device mapped `MAP_SHARED`, seen as a [`RegionSlice`].

use std::fs::File;
use std::io;
use std::marker::PhantomData;

use farmap_memory::{RegionSlice, SharedMapping};

/// The device mapped shared, read-write (read-only on a read-only device): writes reach the
/// store at [`sync`](Self::sync), at the kernel's writeback, and at the mount's shutdown.
///
/// It borrows the [`NbdMount`](crate::NbdMount), so it is unmapped before the device goes
/// (the device's size is fixed while it is connected; an I/O error after a failure is a
/// SIGBUS, never memory of someone else). Its memory is reached through
/// [`memory`](Self::memory), a [`RegionSlice`] (volatile, bounds-checked accesses), because
/// other processes that map the device, and the kernel reading it back from the store,
/// change it behind Rust's back.
///
/// This process serves the device it maps: touching the memory from a thread of the
/// runtime that serves it can deadlock (a page fault there waits for a request that thread
/// would serve); any other thread is fine.
#[derive(Debug)]
pub struct MappedDevice<'m> {
    map: SharedMapping,
    _mount: PhantomData<&'m crate::NbdMount>,
}

impl MappedDevice<'_> {
    pub(crate) fn new(file: File, len: usize, writable: bool) -> io::Result<Self> {
        Ok(Self {
            map: SharedMapping::new(file, len, writable, "a mapped NBD device")?,
            _mount: PhantomData,
        })
    }

    /// The region's memory. On a read-only device, writing through it raises SIGSEGV.
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

    /// Writes the mapping's dirty pages back (`msync(MS_SYNC)`) and flushes the store
    /// (`fsync`). Blocks; must not run on a thread of the runtime that serves the device.
    pub fn sync(&self) -> io::Result<()> {
        self.map.sync()
    }

    /// The open device behind the mapping.
    pub fn file(&self) -> &File {
        self.map.file()
    }
}
