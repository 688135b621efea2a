//! [`MappedDevice`]: the whole device mapped `MAP_SHARED`, seen as a `RegionSlice`.

/// The device mapped shared, read-write (read-only on a read-only device): writes reach the
/// store at `sync`, at the kernel's writeback, and at the mount's shutdown. It borrows the
/// [`NbdMount`](crate::NbdMount), so it is unmapped before the device goes (the device's size
/// is fixed while it is connected; an I/O error after a failure is a SIGBUS, never memory of
/// someone else); the rules of a mapping served by this process are
/// [`MappingOf`](farmap_memory::MappingOf)'s.
pub type MappedDevice<'m> = farmap_memory::MappingOf<'m, crate::NbdMount>;
