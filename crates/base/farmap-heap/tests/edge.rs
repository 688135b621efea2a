//! Edge cases found by a review: double frees after coalescing, running out of room with
//! empty slabs kept, shrinking when full, huge and impossible arguments, threads exhausting
//! a small region, arenas changing on every call with purges that fail, and `lock_all`
//! under load. Each of the first four failed before its fix.

mod common;
use common::{fill, holds, Rng, TestHeap, MIB};
use farmap_heap::{class_size, MAX_SMALL, NCLASSES, PAGE_SIZE};
use std::sync::Mutex;

#[test]
fn large_double_free_after_left_merge_overlaps() {
    let heap = TestHeap::new(16 * MIB, 1);
    let a = heap.malloc(PAGE_SIZE); // page 0
    let b = heap.malloc(3 * PAGE_SIZE); // pages 1..4
    let _guard = heap.malloc(PAGE_SIZE); // page 4
                                         // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
    unsafe { heap.free(a) }; // dirty 0..1
                             // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
    unsafe { heap.free(b) }; // merges left: dirty 0..4, page 1 keeps a stale Large head
    let c = heap.malloc(4 * PAGE_SIZE); // takes 0..4, b's page inside it
    assert_eq!(c, a);
    // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
    unsafe { heap.free(b) }; // double free: should be ignored
    let d = heap.malloc(3 * PAGE_SIZE);
    let (c0, c1) = (c as usize, c as usize + 4 * PAGE_SIZE);
    let dd = d as usize;
    assert!(
        !(dd >= c0 && dd < c1),
        "double free of a large object made d overlap live c"
    );
}

#[test]
fn small_double_free_after_slab_release() {
    let heap = TestHeap::new(16 * MIB, 1);
    // Three slabs of one class, all freed: the ones not kept for reuse are released.
    let sz = 4096;
    let per = PAGE_SIZE / sz; // objects per 1-page slab
    let mut v: Vec<*mut u8> = (0..per * 3).map(|_| heap.malloc(sz)).collect();
    let first = v[0];
    for p in v.drain(..) {
        // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
        unsafe { heap.free(p) };
    }
    // now allocate a large object that may cover the released slab pages
    let big = heap.malloc(8 * PAGE_SIZE);
    // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
    unsafe { fill(big, 8 * PAGE_SIZE, 0xAB) };
    // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
    unsafe { heap.free(first) }; // double free
    let mut got = Vec::new();
    for _ in 0..64 {
        let p = heap.malloc(sz);
        // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
        unsafe { fill(p, sz, 0x11) };
        got.push(p);
    }
    assert!(
        // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
        unsafe { holds(big, 8 * PAGE_SIZE, 0xAB) },
        "double free corrupted a live large object"
    );
}

#[test]
fn realloc_shrink_fails_when_full() {
    let heap = TestHeap::new(4 * MIB, 1);
    let big = heap.malloc(MIB);
    let small = heap.malloc(8192);
    // fill the rest
    let mut hold = Vec::new();
    loop {
        let p = heap.malloc(PAGE_SIZE);
        if p.is_null() {
            break;
        }
        hold.push(p);
    }
    loop {
        let p = heap.malloc(16);
        if p.is_null() {
            break;
        }
        hold.push(p);
    }
    loop {
        let p = heap.malloc(100);
        if p.is_null() {
            break;
        }
        hold.push(p);
    }
    // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
    let r1 = unsafe { heap.realloc(small, 100) };
    // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
    let r2 = unsafe { heap.realloc(big, 1000) };
    assert!(
        !r1.is_null() && !r2.is_null(),
        "shrinking realloc returned null"
    );
}

#[test]
fn empty_sole_slabs_block_large_allocation() {
    let heap = TestHeap::new(16 * MIB, 1);
    let ps: Vec<_> = (0..NCLASSES).map(|c| heap.malloc(class_size(c))).collect();
    for p in ps {
        // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
        unsafe { heap.free(p) };
    }
    let st = heap.stats();
    let p = heap.malloc(16 * MIB - 2 * PAGE_SIZE);
    assert!(
        !p.is_null(),
        "empty slabs kept for reuse ({} pages) make a large malloc fail",
        st.slab_pages
    );
}

#[test]
fn huge_args() {
    let heap = TestHeap::new(16 * MIB, 2);
    assert!(heap.malloc(usize::MAX).is_null());
    assert!(heap.malloc(usize::MAX - 4096).is_null());
    assert!(heap.calloc(usize::MAX, 2).is_null());
    assert!(heap.calloc(1 << 33, 1 << 31).is_null());
    assert!(heap.memalign(1 << 63, 1).is_null());
    assert!(heap.memalign(1 << 40, 1).is_null());
    assert!(heap.memalign(3, 1).is_null());
    assert!(heap.memalign(4096, usize::MAX).is_null());
    assert!(heap.memalign(1 << 20, usize::MAX - (1 << 19)).is_null());
    let p = heap.malloc(10);
    // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
    assert!(unsafe { heap.realloc(p, usize::MAX) }.is_null());
    // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
    assert!(unsafe { heap.realloc(p, usize::MAX - MAX_SMALL) }.is_null());
    let q = heap.malloc(100_000);
    // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
    assert!(unsafe { heap.realloc(q, usize::MAX) }.is_null());
    // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
    assert!(unsafe { heap.realloc(q, (u32::MAX as usize) * PAGE_SIZE) }.is_null());
    // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
    assert!(unsafe { heap.realloc(q, (u32::MAX as usize - 1) * PAGE_SIZE) }.is_null());
    for a in [
        16usize,
        32,
        64,
        128,
        256,
        512,
        1024,
        2048,
        4096,
        8192,
        16384,
        32768,
        65536,
        1 << 17,
        1 << 20,
    ] {
        for s in [0usize, 1, 15, 17, 100, 1000, 5000, 40000, 70000] {
            let r = heap.memalign(a, s);
            assert!(
                !r.is_null() && (r as usize).is_multiple_of(a) && heap.usable_size(r) >= s,
                "{a} {s}"
            );
            // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
            unsafe { heap.free(r) };
        }
    }
    assert_eq!(heap.posix_memalign(4, 1).unwrap_err().errno(), 22);
    assert_eq!(heap.posix_memalign(0, 1).unwrap_err().errno(), 22);
    assert_eq!(heap.posix_memalign(1 << 40, 1).unwrap_err().errno(), 12);
}

/// Small region: threads run it out of memory, free each other's objects through a shared pool.
#[test]
fn threads_exhaust_a_small_region() {
    let heap = TestHeap::new(8 * MIB, 4);
    let pool: Mutex<Vec<(usize, usize, u8)>> = Mutex::new(Vec::new());
    let refused = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|sc| {
        for t in 0..4u64 {
            let heap = &heap.heap;
            let pool = &pool;
            let refused = &refused;
            sc.spawn(move || {
                let mut rng = Rng(0x1234_5678 + t * 7919);
                for i in 0..40_000u32 {
                    let r = rng.next();
                    let size = match r % 16 {
                        0 => (r >> 8) as usize % (600 * 1024),
                        1..=3 => (r >> 8) as usize % 33000,
                        _ => (r >> 8) as usize % 512,
                    };
                    let tag = (i as u8) | 1;
                    let p = if r.is_multiple_of(5) {
                        heap.calloc(1, size)
                    } else {
                        heap.malloc(size)
                    };
                    if p.is_null() {
                        refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    } else {
                        if r.is_multiple_of(5) {
                            // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
                            assert!(unsafe { holds(p, size, 0) }, "calloc not zero");
                        }
                        assert!(heap.usable_size(p) >= size);
                        // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
                        unsafe { fill(p, heap.usable_size(p), tag) };
                        pool.lock()
                            .unwrap()
                            .push((p as usize, heap.usable_size(p), tag));
                    }
                    let n = pool.lock().unwrap().len();
                    if n > 200 || p.is_null() {
                        for _ in 0..(if p.is_null() { 20 } else { 1 }) {
                            let o = {
                                let mut g = pool.lock().unwrap();
                                if g.is_empty() {
                                    break;
                                }
                                let k = rng.next() as usize % g.len();
                                g.swap_remove(k)
                            };
                            assert!(
                                // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
                                unsafe { holds(o.0 as *const u8, o.1, o.2) },
                                "object corrupted"
                            );
                            // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
                            unsafe { heap.free(o.0 as *mut u8) };
                        }
                    }
                }
            });
        }
    });
    for o in pool.into_inner().unwrap() {
        // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
        assert!(unsafe { holds(o.0 as *const u8, o.1, o.2) });
        // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
        unsafe { heap.free(o.0 as *mut u8) };
    }
    heap.trim();
    let st = heap.stats();
    assert_eq!((st.objects_in_use, st.pages_in_use), (0, 0), "{st:?}");
    assert!(
        refused.into_inner() > 0,
        "the region never ran out: the test missed its point"
    );
}

#[test]
fn impossible_memalign_purges_every_dirty_span() {
    let heap = TestHeap::new(64 * MIB, 1);
    let v: Vec<_> = (0..20).map(|_| heap.malloc(3 * PAGE_SIZE)).collect();
    let _keep: Vec<_> = v.iter().step_by(2).copied().collect();
    for p in v.iter().skip(1).step_by(2) {
        // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
        unsafe { heap.free(*p) };
    }
    let purges = || {
        heap.backing()
            .purges
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let (before, before_bytes) = (purges(), heap.stats().purged_bytes);
    // No span of the region can be so aligned: refused at once, nothing purged for it.
    assert!(heap.memalign(1 << 40, 1).is_null());
    assert_eq!(purges(), before);
    assert_eq!(heap.stats().purged_bytes, before_bytes);
}

/// A backing whose thread hint changes on every call (every call another arena) and whose
/// every third purge is declined.
struct Hop(std::sync::atomic::AtomicUsize, common::MmapBacking);
// SAFETY: forwards to MmapBacking, which keeps the contract; declining a purge (false) is
// allowed.
unsafe impl farmap_heap::Backing for Hop {
    fn map_metadata(&self, len: usize) -> *mut u8 {
        self.1.map_metadata(len)
    }
    unsafe fn purge(&self, p: *mut u8, len: usize) -> bool {
        // fail every third purge to exercise the dirty >= 1 MiB path
        if self
            .0
            .load(std::sync::atomic::Ordering::Relaxed)
            .is_multiple_of(3)
        {
            return false;
        }
        // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
        unsafe { self.1.purge(p, len) }
    }
    fn thread_hint(&self) -> usize {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }
}

#[test]
fn hopping_arenas_single_thread_model() {
    use std::collections::BTreeMap;
    let region = common::map(9 * MIB);
    let start = region.wrapping_add(region.align_offset(PAGE_SIZE));
    // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
    let heap = unsafe {
        farmap_heap::Heap::new(
            start,
            8 * MIB,
            Hop(Default::default(), Default::default()),
            7,
        )
    }
    .unwrap();
    let mut live: BTreeMap<usize, (usize, u8)> = BTreeMap::new();
    let mut rng = Rng(0xdead_beef);
    for i in 0..200_000u32 {
        let r = rng.next();
        if r.is_multiple_of(3) && !live.is_empty() {
            let k = *live.keys().nth((r >> 8) as usize % live.len()).unwrap();
            let (u, t) = live.remove(&k).unwrap();
            assert!(
                // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
                unsafe { holds(k as *const u8, u, t) },
                "corrupt at step {i}"
            );
            if r.is_multiple_of(7) {
                let ns = (r >> 20) as usize % 200_000;
                // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
                let p = unsafe { heap.realloc(k as *mut u8, ns) };
                if p.is_null() {
                    live.insert(k, (u, t));
                    continue;
                }
                // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
                assert!(unsafe { holds(p, u.min(ns), t) });
                let nu = heap.usable_size(p);
                // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
                unsafe { fill(p, nu, t) };
                if let Some((&a, &(lu, _))) = live.range(..p as usize + nu).next_back() {
                    assert!(a + lu <= p as usize, "overlap");
                }
                live.insert(p as usize, (nu, t));
            } else {
                // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
                unsafe { heap.free(k as *mut u8) };
            }
            continue;
        }
        let size = match r % 10 {
            0 => (r >> 8) as usize % 300_000,
            1 | 2 => (r >> 8) as usize % 33_000,
            _ => (r >> 8) as usize % 300,
        };
        let (p, z) = match (r >> 4) % 4 {
            0 => (heap.calloc(1, size), true),
            1 => (heap.memalign(1 << (4 + (r >> 40) % 14), size), false),
            _ => (heap.malloc(size), false),
        };
        if p.is_null() {
            continue;
        }
        if z {
            // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
            assert!(unsafe { holds(p, size, 0) }, "calloc nonzero step {i}");
        }
        let u = heap.usable_size(p);
        assert!(u >= size);
        if let Some((&a, &(lu, _))) = live.range(..p as usize + u).next_back() {
            assert!(a + lu <= p as usize, "overlap step {i}");
        }
        let t = (i as u8) | 1;
        // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
        unsafe { fill(p, u, t) };
        live.insert(p as usize, (u, t));
        if i.is_multiple_of(50_000) {
            heap.trim();
        }
    }
    for (k, (u, t)) in live {
        // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
        assert!(unsafe { holds(k as *const u8, u, t) });
        // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
        unsafe { heap.free(k as *mut u8) };
    }
    heap.trim();
    let st = heap.stats();
    assert_eq!((st.objects_in_use, st.pages_in_use), (0, 0), "{st:?}");
}

#[test]
fn lock_all_under_load_no_deadlock() {
    let heap = TestHeap::new(32 * MIB, 3);
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|sc| {
        for t in 0..3u64 {
            let heap = &heap.heap;
            let stop = &stop;
            sc.spawn(move || {
                let mut rng = Rng(77 + t);
                let mut v = Vec::new();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let r = rng.next();
                    let p = heap.malloc(if r.is_multiple_of(20) {
                        2 * MIB
                    } else {
                        (r >> 8) as usize % 4000
                    });
                    if !p.is_null() {
                        v.push(p as usize);
                    }
                    if v.len() > 50 {
                        let p = v.swap_remove((r >> 30) as usize % v.len());
                        // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
                        unsafe { heap.free(p as *mut u8) };
                    }
                }
                for p in v {
                    // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
                    unsafe { heap.free(p as *mut u8) };
                }
            });
        }
        for _ in 0..300 {
            heap.lock_all();
            std::thread::yield_now();
            // SAFETY: pointers this heap handed out, live in the test's bookkeeping (double frees are the point where named).
            unsafe { heap.unlock_all() };
            heap.trim();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    heap.trim();
    assert_eq!(heap.stats().pages_in_use, 0);
}
