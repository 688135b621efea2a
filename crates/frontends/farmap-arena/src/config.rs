//! [`ArenaConfig`]: where the arena lies, and how it is cut into slots and leases.

use crate::error::ArenaError;

/// The default base: 16 TiB, clear of PIE images, `brk` and the mmap area on x86-64 with
/// 47-bit addresses (they sit near 0x5555_... and 0x7f..._...).
pub const DEFAULT_BASE: usize = 0x1000_0000_0000;
/// The default size: 64 GiB (the region keeps 4 bytes of state per chunk: 4 MiB at the
/// default chunk).
pub const DEFAULT_SIZE: usize = 64 << 30;
/// The default slot: 1 GiB (`1 << 30`).
pub const DEFAULT_SLOT_SHIFT: u32 = 30;
/// The smallest slot: 64 MiB, room for an object's heap metadata and its first pages.
pub const MIN_SLOT_SHIFT: u32 = 26;
/// The default number of slots in a lease.
pub const DEFAULT_LEASE_SLOTS: u32 = 4;
/// The default chunk: 64 KiB (the unit in which pages are fetched and tracked).
pub const DEFAULT_CHUNK: u32 = 64 << 10;

/// Where the arena lies in every process that takes part, and how it is cut up. Every
/// process of one arena must use the same configuration: migration checks it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaConfig {
    /// The first byte's address: a multiple of the slot size.
    pub base: usize,
    /// Bytes: a multiple of the slot size.
    pub size: usize,
    /// A slot is `1 << slot_shift` bytes, at least [`MIN_SLOT_SHIFT`].
    pub slot_shift: u32,
    /// Slots in one lease (the unit in which processes share out the address space).
    pub lease_slots: u32,
    /// The region's chunk: a power of two, from the page size to the slot size.
    pub chunk: u32,
}

impl Default for ArenaConfig {
    fn default() -> Self {
        Self {
            base: DEFAULT_BASE,
            size: DEFAULT_SIZE,
            slot_shift: DEFAULT_SLOT_SHIFT,
            lease_slots: DEFAULT_LEASE_SLOTS,
            chunk: DEFAULT_CHUNK,
        }
    }
}

impl ArenaConfig {
    /// Bytes in a slot.
    pub fn slot_size(&self) -> usize {
        1usize << self.slot_shift
    }

    /// Slots in the arena.
    pub fn slots(&self) -> u32 {
        (self.size >> self.slot_shift) as u32
    }

    /// Leases in the arena (a last, partial lease counts).
    pub fn leases(&self) -> u32 {
        self.slots().div_ceil(self.lease_slots)
    }

    /// Checks the configuration against itself and the page size.
    pub fn check(&self, page: usize) -> Result<(), ArenaError> {
        let bad = |why: String| Err(ArenaError::Config(why));
        if !(MIN_SLOT_SHIFT..=40).contains(&self.slot_shift) {
            return bad(format!(
                "the slot size must be from {} MiB to 1 TiB (a power of two), not 2^{} bytes",
                1 << (MIN_SLOT_SHIFT - 20),
                self.slot_shift
            ));
        }
        let slot = self.slot_size();
        if self.size == 0 || !self.size.is_multiple_of(slot) {
            return bad(format!(
                "the arena's size ({:#x}) must be a non-zero multiple of the slot size ({slot:#x})",
                self.size
            ));
        }
        if self.base == 0 || !self.base.is_multiple_of(slot) {
            return bad(format!(
                "the arena's base ({:#x}) must be a non-zero multiple of the slot size ({slot:#x})",
                self.base
            ));
        }
        if self
            .base
            .checked_add(self.size)
            .is_none_or(|end| end > 1 << 47)
        {
            return bad(format!(
                "the arena {:#x}+{:#x} does not fit below 128 TiB (the user address space)",
                self.base, self.size
            ));
        }
        let chunk = self.chunk as usize;
        if !chunk.is_power_of_two() || chunk < page || chunk > slot {
            return bad(format!(
                "the chunk ({chunk} bytes) must be a power of two from the page size ({page}) \
                 to the slot size"
            ));
        }
        if self.lease_slots == 0 || self.lease_slots > self.slots() {
            return bad(format!(
                "a lease must hold from 1 to {} slots, not {}",
                self.slots(),
                self.lease_slots
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_valid_and_bad_ones_say_why() {
        let d = ArenaConfig::default();
        d.check(4096).unwrap();
        assert_eq!(d.slots(), 64);
        assert_eq!(d.leases(), 16);
        let cases: [(ArenaConfig, &str); 6] = [
            (
                ArenaConfig {
                    slot_shift: 20,
                    ..d
                },
                "slot size",
            ),
            (
                ArenaConfig {
                    size: (1 << 30) + 4096,
                    ..d
                },
                "multiple of the slot size",
            ),
            (
                ArenaConfig {
                    base: d.base + 4096,
                    ..d
                },
                "base",
            ),
            (
                ArenaConfig {
                    base: 0x7fff_c000_0000,
                    ..d
                },
                "128 TiB",
            ),
            (ArenaConfig { chunk: 3000, ..d }, "chunk"),
            (
                ArenaConfig {
                    lease_slots: 0,
                    ..d
                },
                "lease",
            ),
        ];
        for (cfg, want) in cases {
            let e = cfg.check(4096).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
        let small = ArenaConfig {
            size: 5 << 26,
            slot_shift: 26,
            lease_slots: 2,
            ..d
        };
        small.check(4096).unwrap();
        assert_eq!((small.slots(), small.leases()), (5, 3));
    }
}
