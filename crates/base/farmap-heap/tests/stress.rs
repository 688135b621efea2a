//! Eight threads allocate, write, check and free, passing a quarter of their objects to
//! the next thread to free (cross-arena frees); at the end nothing is in use.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::time::Duration;

use common::{fill, holds, MmapBacking, Rng, TestHeap, MIB};
use farmap_heap::Heap;

const THREADS: usize = 8;
const STEPS: usize = 20_000;
const KEEP: usize = 48;

/// An allocation in flight: its address, its size and the byte it holds.
struct Obj {
    addr: usize,
    size: usize,
    tag: u8,
}

fn check_and_free(heap: &Heap<MmapBacking>, o: Obj) {
    // SAFETY: `o` is a live allocation of `size` bytes, handed to this thread alone.
    unsafe {
        assert!(
            holds(o.addr as *const u8, o.size, o.tag),
            "{:#x} changed",
            o.addr
        );
        heap.free(o.addr as *mut u8);
    }
}

fn allocate(heap: &Heap<MmapBacking>, rng: &mut Rng, tag: u8) -> Obj {
    let size = rng.size();
    let p = match rng.next() % 4 {
        0 => {
            let p = heap.calloc(1, size);
            assert!(!p.is_null());
            // SAFETY: `p` has `size` bytes.
            assert!(unsafe { holds(p, size, 0) }, "calloc gave non-zero bytes");
            p
        }
        1 => heap.memalign(256, size),
        _ => heap.malloc(size),
    };
    assert!(!p.is_null(), "no room for {size} bytes");
    assert!(heap.usable_size(p) >= size);
    // SAFETY: `p` has `size` bytes.
    unsafe { fill(p, size, tag) };
    Obj {
        addr: p.addr(),
        size,
        tag,
    }
}

fn resize(heap: &Heap<MmapBacking>, rng: &mut Rng, o: &mut Obj) {
    let size = rng.size().max(1);
    // SAFETY: `o` is a live allocation this thread owns; it is replaced by the result.
    let p = unsafe { heap.realloc(o.addr as *mut u8, size) };
    assert!(!p.is_null());
    let kept = o.size.min(size);
    // SAFETY: `p` has `size >= kept` bytes.
    unsafe {
        assert!(holds(p, kept, o.tag), "realloc lost content");
        fill(p, size, o.tag);
    }
    (o.addr, o.size) = (p.addr(), size);
}

fn worker(heap: &Heap<MmapBacking>, me: usize, tx: Sender<Obj>, rx: Receiver<Obj>) {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ ((me as u64 + 1) * 0x1000_0001));
    let mut mine: Vec<Obj> = Vec::with_capacity(KEEP + 1);
    for step in 0..STEPS {
        let o = allocate(heap, &mut rng, ((me * 31 + step) as u8) | 1);
        if rng.next().is_multiple_of(4) {
            tx.send(o).expect("next thread alive");
        } else {
            mine.push(o);
        }
        if rng.next().is_multiple_of(16) {
            let i = rng.next() as usize % mine.len().max(1);
            if let Some(o) = mine.get_mut(i) {
                resize(heap, &mut rng, o);
            }
        }
        if mine.len() > KEEP {
            let o = mine.swap_remove(rng.next() as usize % mine.len());
            check_and_free(heap, o);
        }
        while let Ok(o) = rx.try_recv() {
            check_and_free(heap, o);
        }
    }
    for o in mine {
        check_and_free(heap, o);
    }
    drop(tx);
    for o in rx {
        check_and_free(heap, o);
    }
}

#[test]
fn eight_threads_free_each_others_objects() {
    let heap = TestHeap::new(512 * MIB, THREADS);
    let (mut txs, rxs): (Vec<_>, Vec<_>) = (0..THREADS).map(|_| channel::<Obj>()).unzip();
    // Thread `me` receives on channel `me` and sends on channel `me + 1`.
    txs.rotate_left(1);
    std::thread::scope(|scope| {
        for (me, (tx, rx)) in txs.into_iter().zip(rxs).enumerate() {
            let heap = &heap.heap;
            scope.spawn(move || worker(heap, me, tx, rx));
        }
    });
    let stats = heap.stats();
    assert_eq!(
        (stats.objects_in_use, stats.bytes_in_use),
        (0, 0),
        "{stats:?}"
    );
    heap.trim();
    let stats = heap.stats();
    assert_eq!(
        (stats.pages_in_use, stats.slab_pages, stats.large_pages),
        (0, 0, 0),
        "{stats:?}"
    );
    assert!(stats.purged_bytes > 0);
}

#[test]
fn lock_all_holds_off_other_threads_until_unlock_all() {
    let heap = TestHeap::new(16 * MIB, 4);
    let done = AtomicBool::new(false);
    heap.lock_all();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let p = heap.malloc(100);
            done.store(true, Ordering::SeqCst);
            // SAFETY: `p` is a live allocation of this heap.
            unsafe { heap.free(p) };
        });
        std::thread::sleep(Duration::from_millis(100));
        let early = done.load(Ordering::SeqCst);
        // SAFETY: this thread called lock_all above.
        unsafe { heap.unlock_all() };
        assert!(!early, "malloc ran while every lock was held");
    });
    assert!(done.load(Ordering::SeqCst));
    assert_eq!(heap.stats().objects_in_use, 0);
}
