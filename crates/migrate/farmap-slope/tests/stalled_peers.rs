//! A destination is not held by its peers: one that connects and never speaks is cut off
//! at the handshake limit, one that proves the key, claims a slot and then stops is cut
//! off at the idle limit, and the slot it claimed is free again; a source whose
//! destination stops answering gives up at its idle limit and keeps the object, writable.

use std::sync::Arc;
use std::time::{Duration, Instant};

use farmap_arena::{ensure_fixed_image, Arena, ArenaAlloc, ArenaConfig, Member, Obj, SlotState};
use farmap_migrate::channel;
use farmap_migrate::msg::Msg;
use farmap_net::auth::Key;
use farmap_net::{ListenAddr, RemoteAddr};
use farmap_slope::msg::{ArenaShape, ObjMsg};
use farmap_slope::{migrate, MigrateOptions, ObjListener, SlopeError};

#[test]
fn silent_and_stalled_peers_are_cut_off_and_free_their_slot() {
    let test = "silent_and_stalled_peers_are_cut_off_and_free_their_slot";
    if farmap_testkit::skip::unless(test, farmap_uffd::probe()).is_none() {
        return;
    }
    // The destination refuses objects into a process with ASLR on; this binary has one
    // test, so re-executing it runs just this again.
    ensure_fixed_image().unwrap();
    // 4 slots of 64 MiB, one per lease; member 0 of 2 holds slots 0 and 2.
    let cfg = ArenaConfig {
        base: 0x1600_0000_0000,
        size: 4 << 26,
        slot_shift: 26,
        lease_slots: 1,
        chunk: 4096,
    };
    let arena = Arc::new(Arena::open(cfg, Member { index: 0, count: 2 }).unwrap());
    let key = Key::from_secret(b"stalled peers");
    let addr = ListenAddr::Tcp(std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
    let mut l = ObjListener::bind(&addr, key.clone()).unwrap();
    l.set_limits(Duration::from_millis(300), Duration::from_millis(300));
    let ListenAddr::Tcp(at) = l.local_addr().unwrap() else {
        panic!("tcp")
    };

    // 1. Connects and never speaks.
    let _silent = std::net::TcpStream::connect(at).unwrap();
    let t = Instant::now();
    match l.accept(&arena) {
        Err(SlopeError::Auth(why)) => assert!(why.contains("within"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());

    // 2. Proves the key, claims slot 1 with a good Hello, then stops.
    let hello = ObjMsg::Hello {
        slot: 1,
        tag: 7,
        build_id: arena.image().0 .0,
        arena: ArenaShape {
            base: cfg.base as u64,
            size: cfg.size as u64,
            slot_shift: cfg.slot_shift,
            chunk: cfg.chunk,
            page: 4096,
        },
    };
    let peer = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let to = RemoteAddr::Tcp(at.to_string());
            let mut ch = channel::connect(&to, None, Duration::from_secs(5))
                .await
                .unwrap();
            farmap_migrate::auth::leecher(&mut ch, &key, 0)
                .await
                .unwrap();
            ch.send(&Msg::Object(hello.encode())).await.unwrap();
            // Welcome, then nothing from here.
            let welcome = ch.recv().await.unwrap();
            tokio::time::sleep(Duration::from_secs(2)).await;
            welcome
        })
    });
    let t = Instant::now();
    match l.accept(&arena) {
        Err(SlopeError::Protocol(why)) => assert!(why.contains("sent nothing"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    let welcome = peer.join().unwrap();
    assert!(matches!(welcome, Some(Msg::Object(_))), "{welcome:?}");
    assert_eq!(arena.slots().state(1), Some(SlotState::Free));
}

#[test]
fn a_source_whose_destination_stops_answering_keeps_its_object() {
    let test = "a_source_whose_destination_stops_answering_keeps_its_object";
    if farmap_testkit::skip::unless(test, farmap_uffd::probe()).is_none() {
        return;
    }
    ensure_fixed_image().unwrap();
    let cfg = ArenaConfig {
        base: 0x1700_0000_0000,
        size: 4 << 26,
        slot_shift: 26,
        lease_slots: 1,
        chunk: 4096,
    };
    let arena = Arc::new(Arena::open(cfg, Member::SOLE).unwrap());
    let obj = Obj::new_in(&arena, || {
        let mut v = farmap_arena::allocator_api2::vec::Vec::new_in(ArenaAlloc);
        v.extend(0..100_000u64);
        v
    })
    .unwrap();
    let key = Key::from_secret(b"a silent destination");
    // A destination that proves the key, welcomes the object, then reads and never answers.
    let (tx, rx) = std::sync::mpsc::channel();
    let dest_key = key.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let addr = ListenAddr::Tcp(std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
            let l = farmap_migrate::channel::ControlListener::bind(&addr, None)
                .await
                .unwrap();
            tx.send(l.local_addr().unwrap()).unwrap();
            let mut ch = l.accept().await.unwrap();
            let keys = farmap_migrate::auth::SeederKeys::new(dest_key);
            farmap_migrate::auth::seeder(&mut ch, &keys).await.unwrap();
            ch.accept_payloads_up_to(farmap_migrate::msg::MAX_PAYLOAD);
            let _hello = ch.recv().await.unwrap();
            ch.send(&Msg::Object(ObjMsg::Welcome.encode()))
                .await
                .unwrap();
            while let Ok(Some(_)) = ch.recv().await {}
        })
    });
    let ListenAddr::Tcp(at) = rx.recv().unwrap() else {
        panic!("tcp")
    };
    let opts = MigrateOptions {
        idle_limit: Duration::from_millis(300),
        ..MigrateOptions::new(key)
    };
    let t = Instant::now();
    match migrate(&obj, &RemoteAddr::Tcp(at.to_string()), &opts) {
        Err(SlopeError::Protocol(why)) => assert!(why.contains("sent nothing"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert_eq!(arena.slots().state(obj.slot()), Some(SlotState::Local));
    obj.write().expect("writable again").push(7);
    let v = obj.read().unwrap();
    assert_eq!((v.len(), v[99_999], v[100_000]), (100_001, 99_999, 7));
}
