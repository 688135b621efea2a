//! [`ArenaError`].

use farmap_uffd::RegionError;

/// Why an arena could not be opened or a slot not be had.
#[derive(Debug, thiserror::Error)]
pub enum ArenaError {
    /// The configuration is not usable.
    #[error("arena configuration: {0}")]
    Config(String),
    /// Something is already mapped where the arena must lie.
    #[error(
        "the arena's range {base:#x}..{end:#x} is taken in this process by `{by}`: choose \
         another base (--arena-base) for every process of the arena",
        end = base + size
    )]
    RangeTaken {
        /// The arena's base.
        base: usize,
        /// The arena's size.
        size: usize,
        /// The line of `/proc/self/maps` in the way (or what the kernel said).
        by: String,
    },
    /// The region under the arena failed.
    #[error("the arena's region: {0}")]
    Region(#[from] RegionError),
    /// Every slot of the leases this process holds is taken.
    #[error("no free slot in the {held} leases this process holds")]
    NoFreeSlot {
        /// Leases held.
        held: usize,
    },
    /// Reading this process's own files failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The error.
        source: std::io::Error,
    },
}
