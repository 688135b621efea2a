//! Size classes and the page geometry they live in.
//!
//! Classes run from 16 B to 32 KiB: multiples of 16 up to 128 B, then four classes per
//! doubling (160, 192, 224, 256, 320, ...), 40 in all. Every class size is a multiple of
//! 16, so every object is 16-byte aligned. A class is served from *slabs*: spans of one to
//! [`MAX_SLAB_PAGES`] pages, as many as keep the unusable tail of the slab at most 1/16 of
//! it (or the fewest pages with the least waste).

/// Bytes per page of the region (64 KiB): the unit of spans and of the page table.
pub const PAGE_SIZE: usize = 1 << PAGE_SHIFT;
pub(crate) const PAGE_SHIFT: u32 = 16;
/// Alignment of every allocation (and the smallest class).
pub const MIN_ALIGN: usize = 16;
/// The largest small object; larger ones are spans of whole pages.
pub const MAX_SMALL: usize = 32 * 1024;
/// Number of small size classes.
pub const NCLASSES: usize = 40;
/// Classes 0..8 are 16, 32, ... 128 B.
const LINEAR_CLASSES: usize = 8;
/// The most pages a slab spans.
pub(crate) const MAX_SLAB_PAGES: usize = 8;
/// The most objects a slab holds (a one-page slab of 16 B objects).
pub(crate) const MAX_OBJECTS: usize = PAGE_SIZE / MIN_ALIGN;

/// Size in bytes of the objects of `class` (`class < NCLASSES`).
pub const fn class_size(class: usize) -> usize {
    if class < LINEAR_CLASSES {
        return (class + 1) * MIN_ALIGN;
    }
    let group = (class - LINEAR_CLASSES) / 4;
    let step = (class - LINEAR_CLASSES) % 4;
    let k = 7 + group;
    (1 << k) + (step + 1) * (1 << (k - 2))
}

/// The smallest class whose objects hold `size` bytes (`size <= MAX_SMALL`; 0 is class 0).
pub const fn class_of(size: usize) -> usize {
    if size <= 128 {
        return size.saturating_sub(1) / MIN_ALIGN;
    }
    let s = size - 1;
    let k = (usize::BITS - 1 - s.leading_zeros()) as usize;
    LINEAR_CLASSES + (k - 7) * 4 + ((s >> (k - 2)) - 4)
}

/// The smallest class holding `size` bytes whose objects are all `align`-aligned, for a
/// power of two `align <= MAX_SMALL`; `None` when that is no small object. Slabs start on a
/// page boundary, so objects of a class that is a multiple of `align` are aligned.
pub(crate) fn aligned_class(size: usize, align: usize) -> Option<usize> {
    let size = size.max(1).checked_add(align - 1)? & !(align - 1);
    if size > MAX_SMALL {
        return None;
    }
    let mut class = class_of(size);
    // Ends at the last class at the latest: 32 KiB is a multiple of every `align` here.
    while !class_size(class).is_multiple_of(align) {
        class += 1;
    }
    Some(class)
}

const fn best_slab_pages(size: usize) -> usize {
    let (mut best, mut best_waste, mut best_span) = (1, PAGE_SIZE % size, PAGE_SIZE);
    let mut n = 1;
    while n <= MAX_SLAB_PAGES {
        let span = n * PAGE_SIZE;
        let waste = span % size;
        if waste * 16 <= span {
            return n;
        }
        if waste * best_span < best_waste * span {
            (best, best_waste, best_span) = (n, waste, span);
        }
        n += 1;
    }
    best
}

const SLAB_PAGES: [u8; NCLASSES] = {
    let mut table = [0u8; NCLASSES];
    let mut class = 0;
    while class < NCLASSES {
        table[class] = best_slab_pages(class_size(class)) as u8;
        assert!(table[class] as usize * PAGE_SIZE / class_size(class) <= MAX_OBJECTS);
        class += 1;
    }
    table
};

/// Pages of a slab of `class`.
pub(crate) const fn slab_pages(class: usize) -> u32 {
    SLAB_PAGES[class] as u32
}

/// Objects in a slab of `class`.
pub(crate) const fn slab_objects(class: usize) -> u32 {
    (slab_pages(class) as usize * PAGE_SIZE / class_size(class)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_increasing_multiples_of_16_up_to_32k() {
        assert_eq!(class_size(0), 16);
        assert_eq!(class_size(7), 128);
        assert_eq!(class_size(8), 160);
        assert_eq!(class_size(11), 256);
        assert_eq!(class_size(12), 320);
        assert_eq!(class_size(NCLASSES - 1), MAX_SMALL);
        for c in 1..NCLASSES {
            assert!(class_size(c) > class_size(c - 1));
            assert_eq!(class_size(c) % MIN_ALIGN, 0);
        }
    }

    #[test]
    fn class_of_is_the_smallest_class_that_fits() {
        for size in 0..=MAX_SMALL {
            let c = class_of(size);
            assert!(class_size(c) >= size, "{size}");
            assert!(c == 0 || class_size(c - 1) < size, "{size}");
        }
    }

    #[test]
    fn aligned_classes_are_aligned() {
        for shift in 4..=15 {
            let align = 1usize << shift;
            for size in [0, 1, 17, 100, 1000, 5000, 20000, MAX_SMALL] {
                match aligned_class(size, align) {
                    Some(c) => {
                        assert!(class_size(c) >= size);
                        assert_eq!(class_size(c) % align, 0);
                    }
                    None => assert!(size.max(1).next_multiple_of(align) > MAX_SMALL),
                }
            }
        }
    }

    #[test]
    fn slabs_waste_little() {
        for c in 0..NCLASSES {
            let span = slab_pages(c) as usize * PAGE_SIZE;
            let used = slab_objects(c) as usize * class_size(c);
            assert!((span - used) * 8 <= span, "class {c}: {used} of {span}");
            assert!(slab_objects(c) >= 2);
        }
    }
}
