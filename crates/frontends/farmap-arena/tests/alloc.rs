//! Objects in the arena: collections built with `ArenaAlloc` land in their object's slot,
//! match a model built with std collections, free by address without a context, refuse to
//! allocate without one; a hashbrown map left in its slot is attached again, equal; a
//! dropped object gives its slot back.

use std::collections::HashMap as StdMap;
use std::sync::{Arc, OnceLock};

use farmap_arena::allocator_api2::vec::Vec as AVec;
use farmap_arena::foldhash::fast::FixedState;
use farmap_arena::{context, Arena, ArenaAlloc, ArenaConfig, Member, Obj, Portable};

type Map<K, V> = farmap_arena::hashbrown::HashMap<K, V, FixedState, ArenaAlloc>;

/// An object with a map and a vector of byte strings.
struct Table {
    map: Map<u64, [u8; 32]>,
    log: AVec<AVec<u8, ArenaAlloc>, ArenaAlloc>,
}
// SAFETY: a map and vectors in the arena, of plain values.
unsafe impl Portable for Table {}

/// One arena for the whole test binary (one arena per process serves objects): 32 slots of
/// 64 MiB; `None` when userfaultfd is unavailable.
fn arena(test: &str) -> Option<Arc<Arena>> {
    static ARENA: OnceLock<Option<Arc<Arena>>> = OnceLock::new();
    farmap_testkit::skip::unless(test, farmap_uffd::probe())?;
    ARENA
        .get_or_init(|| {
            let cfg = ArenaConfig {
                base: 0x1400_0000_0000,
                size: 32 << 26,
                slot_shift: 26,
                lease_slots: 4,
                chunk: 64 << 10,
            };
            Some(Arc::new(Arena::open(cfg, Member::SOLE).unwrap()))
        })
        .clone()
}

/// A small deterministic generator (xorshift64*).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// What one `Table` should hold, in std collections.
type Model = (StdMap<u64, [u8; 32]>, Vec<Vec<u8>>);

fn value(k: u64, gen: u64) -> [u8; 32] {
    let mut v = [0u8; 32];
    v[..8].copy_from_slice(&k.to_le_bytes());
    v[8..16].copy_from_slice(&gen.to_le_bytes());
    v
}

fn new_table(arena: &Arc<Arena>, seed: u64) -> Obj<Table> {
    Obj::new_in(arena, || Table {
        map: Map::with_hasher_in(FixedState::with_seed(seed), ArenaAlloc),
        log: AVec::new_in(ArenaAlloc),
    })
    .unwrap()
}

#[test]
fn three_objects_match_their_models_and_keep_to_their_slots() {
    let Some(arena) = arena("three_objects_match_their_models_and_keep_to_their_slots") else {
        return;
    };
    let objs: Vec<Obj<Table>> = (0..3).map(|i| new_table(&arena, i)).collect();
    let mut models: Vec<Model> = vec![Default::default(); 3];
    let mut rng = Rng(0x5eed);
    for step in 0..60_000u64 {
        let i = (rng.next() % 3) as usize;
        let k = rng.next() % 4000;
        let mut t = objs[i].write().unwrap();
        let (map, log) = &mut models[i];
        match rng.next() % 10 {
            0..=5 => {
                t.map.insert(k, value(k, step));
                map.insert(k, value(k, step));
            }
            6 | 7 => {
                assert_eq!(t.map.remove(&k), map.remove(&k));
            }
            8 => {
                let len = (rng.next() % 3000) as usize;
                let mut v = AVec::with_capacity_in(1, ArenaAlloc);
                v.extend((0..len).map(|j| (j as u64 ^ step) as u8));
                log.push(v.to_vec());
                t.log.push(v);
            }
            _ => {
                if !log.is_empty() {
                    let at = (rng.next() as usize) % log.len();
                    assert_eq!(&t.log.swap_remove(at)[..], &log.swap_remove(at)[..]);
                }
            }
        }
    }
    for (obj, (map, log)) in objs.iter().zip(&models) {
        let t = obj.read().unwrap();
        assert_eq!(t.map.len(), map.len());
        for (k, v) in map {
            assert_eq!(t.map.get(k), Some(v));
        }
        assert_eq!(t.log.iter().map(|v| v.to_vec()).collect::<Vec<_>>(), *log);
        // Every page the object touched lies in its slot.
        let slot = arena.slot_pages(obj.slot());
        let pages = obj.page_set().unwrap();
        assert!(!pages.is_empty());
        assert!(
            pages
                .iter()
                .all(|r| slot.start <= r.start && r.end <= slot.end),
            "{pages:?}"
        );
        assert!(obj.heap_stats().objects_in_use > 0);
    }
    assert_eq!(arena.counters(), (0, 0));
}

#[test]
fn allocation_needs_a_context_and_freeing_does_not() {
    let Some(arena) = arena("allocation_needs_a_context_and_freeing_does_not") else {
        return;
    };
    assert_eq!(context(), None);
    let mut outside: AVec<u8, ArenaAlloc> = AVec::new_in(ArenaAlloc);
    assert!(
        outside.try_reserve(10).is_err(),
        "no context: no allocation"
    );
    let obj = new_table(&arena, 7);
    let before = obj.heap_stats().objects_in_use;
    let taken = {
        let mut t = obj.write().unwrap();
        assert_eq!(context(), Some(obj.slot()));
        let mut v = AVec::new_in(ArenaAlloc);
        v.extend_from_slice(&[1u8; 5000]);
        t.log.push(v);
        std::mem::replace(&mut t.log, AVec::new_in(ArenaAlloc))
    };
    assert_eq!(context(), None);
    assert_eq!(obj.heap_stats().objects_in_use, before + 2);
    drop(taken); // freed by address, with no context
    assert_eq!(obj.heap_stats().objects_in_use, before);
    // Growing a vector with no context fails too (it may move).
    assert!(outside.try_reserve(1).is_err());
}

#[test]
fn a_map_left_in_its_slot_is_attached_again_equal_and_a_dropped_object_frees_its_slot() {
    let Some(arena) = arena("a_map_left_in_its_slot_is_attached_again") else {
        return;
    };
    let obj = new_table(&arena, 42);
    {
        let mut t = obj.write().unwrap();
        for k in 0..100_000u64 {
            t.map.insert(k, value(k, 1));
        }
    }
    let slot = obj.into_slot();
    assert!(Obj::<u64>::attach(&arena, slot).is_err(), "another type");
    let back = Obj::<Table>::attach(&arena, slot).unwrap();
    {
        let t = back.read().unwrap();
        assert_eq!(t.map.len(), 100_000);
        assert!((0..100_000u64).all(|k| t.map.get(&k) == Some(&value(k, 1))));
    }
    let pages = back
        .page_set()
        .unwrap()
        .iter()
        .map(|r| r.end - r.start)
        .sum::<u64>();
    assert!(
        pages > 100_000 * 40 / 4096,
        "{pages} pages for 100k entries"
    );
    drop(back);
    assert!(
        arena.page_set(slot).unwrap().is_empty(),
        "the slot's pages are discarded"
    );
    assert_eq!(
        arena.slots().state(slot),
        Some(farmap_arena::SlotState::Free)
    );
    // The slot is handed out again, and reads as a fresh slot.
    let mut held = Vec::new();
    let found = loop {
        let Ok(o) = Obj::new_in(&arena, || 0u64) else {
            break false;
        };
        if o.slot() == slot {
            assert_eq!(*o.read().unwrap(), 0);
            break true;
        }
        held.push(o);
    };
    assert!(found, "slot {slot} was not handed out again");
}
