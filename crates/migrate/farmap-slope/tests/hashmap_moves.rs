//! The test: a hashbrown map of 10^6 entries built in process A is used in process B
//! after an object migration, with no serialization code, byte for byte equal; a writer
//! thread in A keeps inserting during the migration (so dirty rounds and the hand-over
//! carry real writes), and B inserts more afterwards (the heap's metadata came along).
//!
//! The test binary runs itself twice more: as B (the destination, which prints its port)
//! and as A (the source).

use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr};
use std::process::{Command, Stdio};
use std::sync::Arc;

use farmap_arena::foldhash::fast::FixedState;
use farmap_arena::{ensure_fixed_image, Arena, ArenaAlloc, ArenaConfig, Member, Obj};
use farmap_net::auth::Key;
use farmap_net::{ListenAddr, RemoteAddr};
use farmap_slope::{migrate, MigrateOptions, ObjListener};

type Map = farmap_arena::hashbrown::HashMap<u64, u64, FixedState, ArenaAlloc>;

const ROLE: &str = "FARMAP_SLOPE_TEST_ROLE";
const KEY: &str = "FARMAP_SLOPE_TEST_KEY";
const PORT: &str = "FARMAP_SLOPE_TEST_PORT";
const ENTRIES: u64 = 1_000_000;

fn cfg() -> ArenaConfig {
    // 8 slots of 256 MiB, 2 per lease: A (member 0) holds leases 0 and 2, B 1 and 3.
    ArenaConfig {
        base: 0x1500_0000_0000,
        size: 8 << 28,
        slot_shift: 28,
        lease_slots: 2,
        chunk: 64 << 10,
    }
}

fn value(k: u64) -> u64 {
    k.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5a5a
}

/// XXH3 of the whole slot, read through the region.
fn slot_digest(arena: &Arena, slot: u32) -> u64 {
    let r = arena.slot_addrs(slot);
    let bytes = arena
        .region()
        .read_vec_at(r.start - arena.config().base, r.len())
        .unwrap();
    xxhash_rust::xxh3::xxh3_64(&bytes)
}

fn key() -> Key {
    Key::from_secret(std::env::var(KEY).unwrap().as_bytes())
}

/// B: accept one object, attach it, check it, print what the parent compares.
fn destination() {
    let arena = Arc::new(Arena::open(cfg(), Member { index: 1, count: 2 }).unwrap());
    let l = ObjListener::bind(
        &ListenAddr::Tcp(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))),
        key(),
    )
    .unwrap();
    let ListenAddr::Tcp(addr) = l.local_addr().unwrap() else {
        panic!("tcp")
    };
    println!("LISTENING {}", addr.port());
    let arrival = l.accept(&arena).unwrap();
    let obj = Obj::<Map>::attach(&arena, arrival.slot).unwrap();
    let digest = slot_digest(&arena, arrival.slot);
    let len = {
        let m = obj.read().unwrap();
        let len = m.len() as u64;
        assert!(len >= ENTRIES);
        for k in 0..len {
            assert_eq!(m.get(&k), Some(&value(k)), "key {k} at the destination");
        }
        len
    };
    {
        let mut m = obj.write().unwrap();
        for k in len..len + 1000 {
            m.insert(k, value(k));
        }
    }
    let m = obj.read().unwrap();
    assert_eq!(m.len() as u64, len + 1000);
    assert!((0..len + 1000).all(|k| m.get(&k) == Some(&value(k))));
    println!(
        "DEST len={len} digest={digest:x} no_owner_us={:.0}",
        arrival.no_owner_us
    );
}

/// A: build the map, keep inserting from a thread, migrate, print what the parent compares.
fn source() {
    let arena = Arc::new(Arena::open(cfg(), Member { index: 0, count: 2 }).unwrap());
    let obj = Arc::new(
        Obj::new_in(&arena, || {
            Map::with_hasher_in(FixedState::with_seed(77), ArenaAlloc)
        })
        .unwrap(),
    );
    {
        let mut m = obj.write().unwrap();
        for k in 0..ENTRIES {
            m.insert(k, value(k));
        }
    }
    let writer = {
        let (obj, arena) = (obj.clone(), arena.clone());
        std::thread::spawn(move || {
            let mut next = ENTRIES;
            while let Ok(mut m) = obj.write() {
                m.insert(next, value(next));
                next += 1;
            }
            // Writes are closed; reads stay open until the destination installed it.
            let m = obj.read().expect("reads stay open after writes close");
            assert_eq!(m.len() as u64, next);
            (next, slot_digest(&arena, obj.slot()))
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(20));
    let port: u16 = std::env::var(PORT).unwrap().parse().unwrap();
    let report = migrate(
        &obj,
        &RemoteAddr::Tcp(format!("127.0.0.1:{port}")),
        &MigrateOptions::new(key()),
    )
    .unwrap();
    let (len, digest) = writer.join().unwrap();
    assert!(
        obj.read().is_err() && obj.write().is_err(),
        "the object is gone from here"
    );
    println!(
        "SOURCE len={len} digest={digest:x} pages={} rounds={} final={} no_owner_us={:.0}",
        report.pages, report.rounds, report.final_dirty_pages, report.no_owner_us
    );
}

#[test]
fn child() {
    match std::env::var(ROLE).as_deref() {
        Ok("dest") => {
            ensure_fixed_image().unwrap();
            destination()
        }
        Ok("source") => {
            ensure_fixed_image().unwrap();
            source()
        }
        _ => {}
    }
}

fn spawn(role: &str, env: &[(&str, String)]) -> std::process::Child {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", "child", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .stdout(Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    c.spawn().unwrap()
}

/// The line of `stdout` that holds `tag` (libtest may write on the same line before it).
fn line_with(stdout: &str, tag: &str) -> String {
    let at = stdout
        .find(tag)
        .unwrap_or_else(|| panic!("no {tag} in {stdout}"));
    stdout[at..].lines().next().unwrap().to_owned()
}

fn field<'a>(line: &'a str, name: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(name).and_then(|w| w.strip_prefix('=')))
        .unwrap_or_else(|| panic!("no {name} in {line}"))
}

#[test]
fn a_map_of_a_million_entries_moves_between_processes_byte_for_byte() {
    if farmap_testkit::skip::unless("a_map_of_a_million_entries_moves", farmap_uffd::probe())
        .is_none()
    {
        return;
    }
    let secret = format!(
        "{:x}{:x}",
        std::process::id(),
        std::time::SystemTime::now()
            .elapsed()
            .map_or(1, |d| d.as_nanos())
    );
    let mut dest = spawn("dest", &[(KEY, secret.clone())]);
    let mut out = BufReader::new(dest.stdout.take().unwrap());
    let mut seen = String::new();
    let port = loop {
        let mut l = String::new();
        assert!(
            out.read_line(&mut l).unwrap() > 0,
            "the destination ended: {seen}"
        );
        seen.push_str(&l);
        if let Some(at) = l.find("LISTENING ") {
            break l[at + 10..].trim().to_owned();
        }
    };
    let src = spawn("source", &[(KEY, secret), (PORT, port)])
        .wait_with_output()
        .unwrap();
    let src_out = String::from_utf8_lossy(&src.stdout).into_owned();
    assert!(src.status.success(), "source: {src_out}");
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    assert!(dest.wait().unwrap().success(), "destination: {seen}{rest}");
    let s = line_with(&src_out, "SOURCE ");
    let d = line_with(&rest, "DEST ");
    eprintln!("{s}\n{d}");
    assert_eq!(
        field(&s, "len"),
        field(&d, "len"),
        "every acknowledged insert arrived"
    );
    assert_eq!(
        field(&s, "digest"),
        field(&d, "digest"),
        "the slot is byte for byte equal"
    );
    assert!(
        field(&s, "len").parse::<u64>().unwrap() > ENTRIES,
        "the writer inserted during prefill"
    );
}
