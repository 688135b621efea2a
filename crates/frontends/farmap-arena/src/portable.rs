//! [`Portable`]: what may live in an arena object, because its bytes mean the same in every
//! process of the arena.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicI64, AtomicU32, AtomicU64, AtomicUsize};

use crate::alloc::ArenaAlloc;

/// A type whose bytes mean the same in every process of an arena, so that an object holding
/// it can move to another process as its pages.
///
/// # Safety
/// Implementers promise that the type holds no pointer outside the arena or the executable
/// (no `std` `Box`, `Vec` or `String` on the global allocator, no `&'static` to anything
/// made at run time, no `dyn` or `fn` pointers, no file descriptors or thread ids), and
/// nothing seeded per process (hashbrown's default `RandomState`: use
/// [`FixedState`](foldhash::fast::FixedState), whose seed is stored in the map).
pub unsafe trait Portable: Send + Sync + 'static {}

/// A tag of `T`'s name, size and alignment: an arriving object must carry its type's.
pub fn type_tag<T: 'static>() -> u64 {
    let name = xxhash_rust::xxh3::xxh3_64(std::any::type_name::<T>().as_bytes());
    name ^ (std::mem::size_of::<T>() as u64).rotate_left(32) ^ std::mem::align_of::<T>() as u64
}

macro_rules! portable {
    ($($t:ty),* $(,)?) => { $(
        // SAFETY: plain values without pointers.
        unsafe impl Portable for $t {}
    )* };
}

portable!(
    u8,
    u16,
    u32,
    u64,
    u128,
    usize,
    i8,
    i16,
    i32,
    i64,
    i128,
    isize,
    f32,
    f64,
    bool,
    char,
    (),
    AtomicBool,
    AtomicU32,
    AtomicU64,
    AtomicUsize,
    AtomicI32,
    AtomicI64,
    foldhash::fast::FixedState,
);

// SAFETY: arrays and tuples of portable values are portable.
unsafe impl<T: Portable, const N: usize> Portable for [T; N] {}
// SAFETY: as above.
unsafe impl<A: Portable, B: Portable> Portable for (A, B) {}
// SAFETY: as above.
unsafe impl<A: Portable, B: Portable, C: Portable> Portable for (A, B, C) {}
// SAFETY: as above.
unsafe impl<T: Portable> Portable for Option<T> {}
// SAFETY: the box's memory is in the arena (its allocator), the value portable.
unsafe impl<T: Portable + ?Sized> Portable for allocator_api2::boxed::Box<T, ArenaAlloc> {}
// SAFETY: the vector's buffer is in the arena, its elements portable.
unsafe impl<T: Portable> Portable for allocator_api2::vec::Vec<T, ArenaAlloc> {}
// SAFETY: the table is in the arena, its entries portable, its hasher's seed in the map. An
// empty table points at a static in the executable: the same address in every process of
// the arena (same build, ASLR off; see `ensure_fixed_image`).
unsafe impl<K: Portable, V: Portable> Portable
    for hashbrown::HashMap<K, V, foldhash::fast::FixedState, ArenaAlloc>
{
}
// SAFETY: as for the map.
unsafe impl<K: Portable> Portable
    for hashbrown::HashSet<K, foldhash::fast::FixedState, ArenaAlloc>
{
}
// SAFETY: as for u8.
unsafe impl Portable for [u8] {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_differ_by_type_and_agree_within_one() {
        assert_eq!(type_tag::<u64>(), type_tag::<u64>());
        assert_ne!(type_tag::<u64>(), type_tag::<i64>());
        assert_ne!(type_tag::<[u8; 4]>(), type_tag::<[u8; 5]>());
    }
}
