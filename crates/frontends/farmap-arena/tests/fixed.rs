//! The arena at a fixed address: two processes of one executable, with ASLR turned off by
//! `ensure_fixed_image`, see the executable's statics at the same address and map the
//! arena at the same base; a taken range is refused, naming what is in the way; an
//! object's page set and written pages are those of its slot only.

use std::process::Command;

use farmap_arena::{ensure_fixed_image, fixed_image, Arena, ArenaConfig, ArenaError, Member};

const PAGE: usize = 4096;
/// Set in the environment of the children this test binary runs as.
const CHILD_ENV: &str = "FARMAP_ARENA_TEST_CHILD";

static MARKER: [u8; 3] = *b"abc";

fn uffd_available(test: &str) -> bool {
    farmap_testkit::skip::unless(test, farmap_uffd::probe()).is_some()
}

/// A small arena: 8 slots of 64 MiB at `base`, 4 KiB chunks.
fn small(base: usize) -> ArenaConfig {
    ArenaConfig {
        base,
        size: 8 << 26,
        slot_shift: 26,
        lease_slots: 2,
        chunk: 4096,
    }
}

/// Run by the children only: fixes the image, opens the default-base arena, writes a page
/// of a slot and prints what the parent compares.
#[test]
fn child_entry() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    ensure_fixed_image().unwrap();
    assert!(fixed_image());
    let arena = Arena::open(small(0x1000_0000_0000), Member::SOLE).unwrap();
    let slot = arena.take_slot().unwrap();
    let at = arena.slot_addrs(slot).start;
    let mem = arena.region().memory();
    mem.store_u8(at - arena.config().base + 5 * PAGE, 1)
        .unwrap();
    println!(
        "RESULT static={:p} fn={:#x} slot={slot} at={at:#x} pages={:?}",
        MARKER.as_ptr(),
        child_entry as fn() as usize,
        arena.page_set(slot).unwrap()
    );
}

fn run_child() -> String {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "child failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // libtest writes "test child_entry ... " on the same line.
    let at = stdout
        .find("RESULT ")
        .unwrap_or_else(|| panic!("no RESULT in {stdout}"));
    stdout[at..].lines().next().unwrap().to_owned()
}

#[test]
fn two_processes_of_one_executable_agree_on_every_address() {
    if !uffd_available("two_processes_of_one_executable_agree_on_every_address") {
        return;
    }
    let a = run_child();
    let b = run_child();
    assert_eq!(a, b, "the image or the arena moved between processes");
    // The slot's first chunk holding page 5 is in memory, nothing else of the slot.
    assert!(a.contains("at=0x100000000000 pages=[5..6]"), "{a}");
    // This process runs with ASLR (the children turned it off for themselves).
    assert!(!fixed_image() || std::env::var_os("FARMAP_ARENA_REEXEC").is_some());
}

#[test]
fn a_taken_range_is_refused_naming_the_mapping_in_the_way() {
    if !uffd_available("a_taken_range_is_refused_naming_the_mapping_in_the_way") {
        return;
    }
    let cfg = small(0x1100_0000_0000);
    let first = Arena::open(cfg, Member::SOLE).unwrap();
    let err = Arena::open(cfg, Member::SOLE).unwrap_err();
    match &err {
        ArenaError::RangeTaken { by, .. } => assert!(by.starts_with("110000000000-"), "{by}"),
        e => panic!("{e}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("0x110000000000..0x110020000000") && msg.contains("--arena-base"),
        "{msg}"
    );
    // Overlapping from below is refused too; a neighbour just above is fine.
    let below = ArenaConfig {
        base: 0x1100_0000_0000 - (4 << 26),
        ..cfg
    };
    assert!(matches!(
        Arena::open(below, Member::SOLE),
        Err(ArenaError::RangeTaken { .. })
    ));
    let above = ArenaConfig {
        base: 0x1100_0000_0000 + (8 << 26),
        ..cfg
    };
    drop(Arena::open(above, Member::SOLE).unwrap());
    // A bad configuration or member changes nothing.
    assert!(matches!(
        Arena::open(
            ArenaConfig {
                base: 0x1200_0000_0001,
                ..cfg
            },
            Member::SOLE
        ),
        Err(ArenaError::Config(_))
    ));
    assert!(matches!(
        Arena::open(small(0x1200_0000_0000), Member { index: 2, count: 2 }),
        Err(ArenaError::Config(_))
    ));
    drop(first);
    // Unmapped with the arena: the range is free again.
    drop(Arena::open(cfg, Member::SOLE).unwrap());
}

#[test]
fn slots_come_from_held_leases_and_scans_stay_within_a_slot() {
    if !uffd_available("slots_come_from_held_leases_and_scans_stay_within_a_slot") {
        return;
    }
    let cfg = small(0x1300_0000_0000);
    // Member 1 of 2 holds leases 1 and 3: slots 2, 3, 6, 7.
    let arena = Arena::open(cfg, Member { index: 1, count: 2 }).unwrap();
    let slots: Vec<u32> = (0..4).map(|_| arena.take_slot().unwrap()).collect();
    assert_eq!(slots, vec![2, 3, 6, 7]);
    assert!(matches!(
        arena.take_slot(),
        Err(ArenaError::NoFreeSlot { held: 2 })
    ));
    assert_eq!(arena.slot_of(cfg.base + (3 << 26) + 17), Some(3));
    assert_eq!(arena.slot_of(cfg.base - 1), None);
    assert_eq!(arena.slot_of(cfg.base + cfg.size), None);
    let mem = arena.region().memory();
    let off = |slot: usize, page: usize| (slot << 26) + page * PAGE;
    // A first scan protects the whole region; then writes in slots 2 and 3.
    for s in [2u32, 3] {
        assert!(arena.take_written(s).unwrap().is_empty());
    }
    for (s, p) in [(2, 0), (2, 1), (2, 9), (3, 4)] {
        mem.store_u8(off(s, p), 7).unwrap();
    }
    let _ = mem.load_u8(off(3, 100)).unwrap();
    let slot_pages = |s: u64| s << 14; // 64 MiB of 4 KiB pages
    let d = arena.take_written(2).unwrap();
    assert_eq!(
        d.pages,
        vec![
            slot_pages(2)..slot_pages(2) + 2,
            slot_pages(2) + 9..slot_pages(2) + 10
        ]
    );
    assert!(arena.take_written(2).unwrap().is_empty());
    let d = arena.take_written(3).unwrap();
    assert_eq!(d.pages, vec![slot_pages(3) + 4..slot_pages(3) + 5]);
    assert_eq!(
        arena.page_set(3).unwrap(),
        vec![
            slot_pages(3) + 4..slot_pages(3) + 5,
            slot_pages(3) + 100..slot_pages(3) + 101
        ]
    );
    assert!(arena.page_set(6).unwrap().is_empty());
}
