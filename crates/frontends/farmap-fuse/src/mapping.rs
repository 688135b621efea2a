//! [`MappedRegion`]: the mounted file mapped `MAP_SHARED`, seen as a `RegionSlice`.

/// The mounted file mapped shared, read-write (read-only on a read-only mount): writes reach
/// the store at `sync`, at the file's writeback, and at unmount. It borrows the
/// [`FuseMount`](crate::FuseMount), so it is unmapped before the mount goes; the rules of a
/// mapping served by this process are [`MappingOf`](farmap_memory::MappingOf)'s. The file's
/// size is fixed (the file system refuses truncation), so no page goes away under it.
pub type MappedRegion<'m> = farmap_memory::MappingOf<'m, crate::FuseMount>;
