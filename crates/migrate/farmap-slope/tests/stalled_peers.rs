//! A destination is not held by its peers: one that connects and never speaks is cut off
//! at the handshake limit, one that proves the key, claims a slot and then stops is cut
//! off at the idle limit, and the slot it claimed is free again.

use std::sync::Arc;
use std::time::{Duration, Instant};

use farmap_arena::{ensure_fixed_image, Arena, ArenaConfig, Member, SlotState};
use farmap_migrate::channel;
use farmap_migrate::msg::Msg;
use farmap_net::auth::Key;
use farmap_net::{ListenAddr, RemoteAddr};
use farmap_slope::msg::{ArenaShape, ObjMsg};
use farmap_slope::{ObjListener, SlopeError};

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
