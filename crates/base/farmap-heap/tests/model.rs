//! The heap against a model: random malloc/calloc/memalign/free/realloc sequences, checked
//! against a `BTreeMap` of the live allocations after every step.

mod common;

use std::collections::BTreeMap;

use common::{fill, holds, TestHeap, MIB};
use farmap_heap::{MIN_ALIGN, PAGE_SIZE};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

#[derive(Clone, Debug)]
enum Op {
    Malloc(usize),
    /// `calloc(n, size)`.
    Calloc(usize, usize),
    /// `memalign(1 << shift, size)`.
    Memalign(u32, usize),
    /// Frees the live allocation picked by this number (if any).
    Free(usize),
    /// Reallocs the live allocation picked by this number (or null) to a size.
    Realloc(usize, usize),
}

/// 0 to 3 MiB, skewed small.
fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        10 => 0..=256usize,
        6 => 257..=4096usize,
        3 => 4097..=(256usize << 10),
        1 => (256 << 10)..=(3 * MIB),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => size().prop_map(Op::Malloc),
        1 => (1..=8usize, size()).prop_map(|(n, s)| Op::Calloc(n, s / n)),
        1 => (4u32..=20, size()).prop_map(|(shift, s)| Op::Memalign(shift, s)),
        4 => any::<usize>().prop_map(Op::Free),
        2 => (any::<usize>(), size()).prop_map(|(i, s)| Op::Realloc(i, s)),
    ]
}

struct Live {
    usable: usize,
    fill: u8,
}

struct Model {
    heap: TestHeap,
    live: BTreeMap<usize, Live>,
    live_bytes: usize,
    peak_bytes: usize,
    next_fill: u8,
}

impl Model {
    fn new() -> Self {
        Self {
            heap: TestHeap::new(256 * MIB, 4),
            live: BTreeMap::new(),
            live_bytes: 0,
            peak_bytes: 0,
            next_fill: 0,
        }
    }

    fn pick(&self, i: usize) -> Option<usize> {
        let n = self.live.len();
        (n > 0).then(|| *self.live.keys().nth(i % n).expect("in range"))
    }

    /// Checks a new allocation of `size` bytes (zeros if `zeroed`) and fills it.
    fn admit(
        &mut self,
        p: *mut u8,
        size: usize,
        align: usize,
        zeroed: bool,
    ) -> Result<(), TestCaseError> {
        prop_assert!(!p.is_null(), "no room for {size} bytes");
        let addr = p.addr();
        let usable = self.heap.usable_size(p);
        let (start, len) = self.heap.region();
        prop_assert!(usable >= size.max(1), "{usable} usable for {size}");
        prop_assert!(self.heap.owns(p));
        prop_assert!(addr >= start.addr() && addr + usable <= start.addr() + len);
        prop_assert_eq!(addr % align.max(MIN_ALIGN), 0, "alignment {}", align);
        if let Some((&a, l)) = self.live.range(..=addr).next_back() {
            prop_assert!(a + l.usable <= addr, "{addr:#x} overlaps {a:#x}");
        }
        if let Some((&a, _)) = self.live.range(addr..).next() {
            prop_assert!(addr + usable <= a, "{addr:#x} overlaps {a:#x}");
        }
        // SAFETY: `p` was just allocated with `usable` bytes and is ours.
        unsafe {
            if zeroed {
                prop_assert!(holds(p, size, 0), "calloc memory is not zeros");
            }
            self.next_fill = self.next_fill.wrapping_add(1).max(1);
            fill(p, usable, self.next_fill);
        }
        let byte = self.next_fill;
        self.live.insert(addr, Live { usable, fill: byte });
        self.live_bytes += usable;
        self.peak_bytes = self.peak_bytes.max(self.live_bytes);
        Ok(())
    }

    /// Takes the allocation at `addr` out of the model, checking its content.
    fn retire(&mut self, addr: usize) -> Result<Live, TestCaseError> {
        let l = self.live.remove(&addr).expect("live");
        self.live_bytes -= l.usable;
        // SAFETY: the allocation is live, with `usable` bytes.
        let intact = unsafe { holds(addr as *const u8, l.usable, l.fill) };
        prop_assert!(intact, "{addr:#x} changed");
        Ok(l)
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Malloc(size) => self.admit(self.heap.malloc(size), size, MIN_ALIGN, false)?,
            Op::Calloc(n, size) => {
                self.admit(self.heap.calloc(n, size), n * size, MIN_ALIGN, true)?
            }
            Op::Memalign(shift, size) => {
                let align = 1 << shift;
                self.admit(self.heap.memalign(align, size), size, align, false)?;
            }
            Op::Free(i) => {
                if let Some(addr) = self.pick(i) {
                    self.retire(addr)?;
                    // SAFETY: a live allocation of this heap, forgotten by the model.
                    unsafe { self.heap.free(addr as *mut u8) };
                }
            }
            Op::Realloc(i, size) => self.realloc(i, size)?,
        }
        let stats = self.heap.stats();
        prop_assert_eq!(stats.bytes_in_use, self.live_bytes);
        prop_assert_eq!(stats.objects_in_use, self.live.len());
        Ok(())
    }

    fn realloc(&mut self, i: usize, size: usize) -> Result<(), TestCaseError> {
        let Some(addr) = self.pick(i) else {
            // SAFETY: realloc of null is malloc.
            let p = unsafe { self.heap.realloc(std::ptr::null_mut(), size) };
            return self.admit(p, size, MIN_ALIGN, false);
        };
        let old = self.retire(addr)?;
        // SAFETY: a live allocation of this heap, forgotten by the model.
        let p = unsafe { self.heap.realloc(addr as *mut u8, size) };
        if size == 0 {
            prop_assert!(p.is_null());
            return Ok(());
        }
        prop_assert!(!p.is_null());
        let kept = old.usable.min(size);
        // SAFETY: `p` is live with at least `size >= kept` bytes.
        prop_assert!(unsafe { holds(p, kept, old.fill) }, "realloc lost content");
        self.admit(p, size, MIN_ALIGN, false)
    }

    fn finish(mut self) -> Result<(), TestCaseError> {
        while let Some((&addr, _)) = self.live.first_key_value() {
            self.retire(addr)?;
            // SAFETY: a live allocation of this heap, forgotten by the model.
            unsafe { self.heap.free(addr as *mut u8) };
        }
        let stats = self.heap.stats();
        prop_assert_eq!((stats.bytes_in_use, stats.objects_in_use), (0, 0));
        self.heap.trim();
        prop_assert_eq!(self.heap.stats().pages_in_use, 0);
        // Freed memory is reused: the heap reached no further than the peak of live bytes,
        // with room for one partial slab per class and for alignment gaps.
        let reach = stats.high_water_pages * PAGE_SIZE;
        prop_assert!(
            reach <= 2 * self.peak_bytes + 40 * MIB,
            "reached {reach} for a peak of {}",
            self.peak_bytes
        );
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn the_heap_behaves_like_its_model(ops in prop::collection::vec(op(), 1..160)) {
        let mut model = Model::new();
        for op in &ops {
            model.apply(op)?;
        }
        model.finish()?;
    }
}

/// Rounds of 64 allocations of up to 2 MiB, all freed again: 300 rounds would need about
/// 3 GiB if nothing were reused (the region has 256 MiB), and the heap's reach stays near
/// the largest round.
#[test]
fn churn_reuses_freed_memory() {
    let heap = TestHeap::new(256 * MIB, 2);
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut ptrs = Vec::with_capacity(64);
    let mut largest_round = 0;
    for round in 0..300 {
        let mut bytes = 0;
        for _ in 0..64 {
            let r = next();
            let size = match r % 10 {
                0 => (r >> 8) as usize % (2 * MIB),
                1..=3 => (r >> 8) as usize % (64 << 10),
                _ => (r >> 8) as usize % 1024,
            };
            let p = heap.malloc(size);
            assert!(!p.is_null(), "round {round}: no room for {size} bytes");
            // SAFETY: `p` has at least `size` bytes.
            unsafe { fill(p, size, 0x5A) };
            bytes += heap.usable_size(p);
            ptrs.push(p);
        }
        largest_round = largest_round.max(bytes);
        for p in ptrs.drain(..) {
            // SAFETY: live allocations of this heap, dropped from `ptrs`.
            unsafe { heap.free(p) };
        }
    }
    let stats = heap.stats();
    assert_eq!(stats.objects_in_use, 0);
    let reach = stats.high_water_pages * PAGE_SIZE;
    assert!(
        reach <= 3 * largest_round + 16 * MIB,
        "reached {reach}; largest round {largest_round}"
    );
    assert!(stats.purged_bytes > 0);
}
