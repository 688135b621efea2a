//! Who may take a migration: a peer without the operator's key gets nothing from the control
//! port or the data plane, session ids are 128 random bits, and a session (before or after
//! the hand-over) is continued only by the peer that holds its key; the real leecher then
//! completes.

mod common;
use common::raw::{abort_reason, as_leecher, as_new_leecher, read_msg, write_msg};
use common::uffd;

use std::sync::Arc;
use std::time::Duration;

use farmap_core::{ErrorKind, Geometry, Store};
use farmap_migrate::auth::process_key;
use farmap_migrate::leech::{ConnectError, LeechError, LeechOptions};
use farmap_migrate::msg::{Mode, Msg};
use farmap_migrate::seed::{SeedOptions, Seeding};
use farmap_migrate::{leech, seed};
use farmap_net::auth::Key;
use farmap_net::{ClientOptions, ListenAddr, RemoteAddr, RemoteStore};
use farmap_store::MemoryStore;
use farmap_uffd::Region;
use tokio::net::TcpStream;

const SIZE: u64 = 1 << 20;

async fn start_seeder() -> (Seeding, Arc<Region>) {
    let g = Geometry::new(SIZE, 65536).unwrap();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(g));
    let (region, gate) = common::source_region(store, None, |region| {
        let data: Vec<u8> = (0..SIZE).map(|i| (i * 7 % 251) as u8).collect();
        region.write_at(0, &data).unwrap();
    })
    .await;
    let seeding = seed(
        region.clone(),
        gate,
        SeedOptions {
            handshake_timeout: Duration::from_secs(2),
            reconnect_wait: Duration::from_secs(10),
            ..common::seed_options(farmap_migrate::seed::PUSH_BUDGET)
        },
    )
    .await
    .unwrap();
    (seeding, region)
}

fn tcp(a: &ListenAddr) -> std::net::SocketAddr {
    match a {
        ListenAddr::Tcp(a) => *a,
        ListenAddr::Unix(p) => panic!("a TCP seeder listens on {}", p.display()),
    }
}

async fn data_plane(s: &Seeding, key: Option<Key>) -> Result<RemoteStore, farmap_core::StoreError> {
    let opts = ClientOptions {
        connections: 1,
        connect_timeout: Duration::from_secs(3),
        key,
        ..ClientOptions::default()
    };
    RemoteStore::connect(RemoteAddr::from(&s.data), opts).await
}

async fn leech_with(from: &Seeding, key: Key) -> Result<farmap_migrate::LeechReport, LeechError> {
    let (_cancel, cancelled) = tokio::sync::watch::channel(false);
    let opts = LeechOptions {
        handshake_timeout: Duration::from_secs(3),
        reconnect_for: Duration::from_secs(3),
        key,
        ..LeechOptions::new(RemoteAddr::from(&from.control))
    };
    leech(opts, Box::new(|_, _| {}), cancelled).await
}

/// A raw leecher's first dirty round and `Finalize`, up to the seeder's hand-over.
async fn to_hand_over(s: &mut TcpStream) {
    write_msg(s, &Msg::DirtyRequest { round: 1 }).await;
    assert!(matches!(read_msg(s).await.unwrap(), Msg::Dirty { .. }));
    write_msg(s, &Msg::Finalize).await;
    assert!(matches!(read_msg(s).await.unwrap(), Msg::HandOver { .. }));
}

/// A Hello for `session`.
fn hello(session: u128) -> Msg {
    Msg::Hello {
        session,
        mode: Mode::Precopy,
    }
}

/// A raw leecher's new session: its connection, what it proved, the session id.
async fn new_session(at: std::net::SocketAddr) -> (TcpStream, farmap_migrate::auth::Proven, u128) {
    let mut s = TcpStream::connect(at).await.unwrap();
    let proven = as_new_leecher(&mut s).await;
    write_msg(&mut s, &hello(0)).await;
    let id = match read_msg(&mut s).await.unwrap() {
        Msg::Welcome { session, .. } => session,
        other => panic!("expected a Welcome, got {other:?}"),
    };
    (s, proven, id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nobody_without_the_key_gets_a_message_or_a_page() {
    if !uffd("nobody_without_the_key_gets_a_message_or_a_page") {
        return;
    }
    let (seeding, region) = start_seeder().await;
    let at = tcp(&seeding.control);

    // The first protocol's attack: a Hello, then Finalize, without any key.
    let mut s = TcpStream::connect(at).await.unwrap();
    write_msg(&mut s, &hello(0)).await;
    write_msg(&mut s, &Msg::Finalize).await;
    let r = abort_reason(read_msg(&mut s).await);
    assert!(r.contains("requires the migration key"), "{r}");

    // A wrong proof is refused, and so is a leecher holding another key.
    let mut s = TcpStream::connect(at).await.unwrap();
    let (_, seeder_proof) = (
        write_msg(
            &mut s,
            &Msg::AuthHello {
                session: 0,
                nonce: [1; 32],
            },
        )
        .await,
        read_msg(&mut s).await.unwrap(),
    );
    assert!(matches!(seeder_proof, Msg::AuthChallenge { .. }));
    write_msg(&mut s, &Msg::AuthProof { proof: [0; 32] }).await;
    let r = abort_reason(read_msg(&mut s).await);
    assert!(r.contains("not this seeder's"), "{r}");
    let err = leech_with(&seeding, Key::random()).await.unwrap_err();
    let text = farmap_core::error_chain(&err);
    assert!(
        matches!(
            &err,
            LeechError::Connect {
                source: ConnectError::Auth(_),
                ..
            }
        ),
        "{text}"
    );
    assert!(text.contains("keys differ"), "{text}");

    // The data plane serves nobody before a session, and nobody without its key.
    let e = data_plane(&seeding, None).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
    let e = data_plane(&seeding, Some(process_key())).await.unwrap_err();
    assert!(e.to_string().contains("no client yet"), "{e}");

    // The source was never suspended: a real leecher with the key takes it whole.
    let report = leech_with(&seeding, process_key()).await.unwrap();
    seeding.finish().await.unwrap();
    let (mut want, mut got) = (vec![0u8; SIZE as usize], vec![0u8; SIZE as usize]);
    region.read_at(0, &mut want).unwrap();
    report.region.read_at(0, &mut got).unwrap();
    assert!(want == got, "the migrated region differs from the source");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_are_random_and_only_their_leecher_continues_them() {
    if !uffd("sessions_are_random_and_only_their_leecher_continues_them") {
        return;
    }
    let (seeding, _region) = start_seeder().await;
    let at = tcp(&seeding.control);
    let (mut s, proven, id) = new_session(at).await;
    // 128 random bits: the high half is not zero (but for a chance of 2^-64).
    assert_ne!(id >> 64, 0, "session id {id:#x}");

    // The data plane serves the session's key only: not the operator's key.
    let e = data_plane(&seeding, Some(process_key())).await.unwrap_err();
    assert!(e.to_string().contains("not this server's"), "{e}");
    let pages = data_plane(&seeding, Some(proven.data_key())).await.unwrap();
    pages.read(farmap_core::ChunkIdx(0)).await.unwrap();

    // Through the hand-over, as a raw leecher.
    to_hand_over(&mut s).await;
    write_msg(&mut s, &Msg::Resumed).await;

    // Another holder of the operator's key knows the id (say it was overheard) and tries to
    // take the session over: with the operator's key as the session's...
    let mut t = TcpStream::connect(at).await.unwrap();
    let r = as_leecher(&mut t, &process_key(), id).await.unwrap_err();
    assert!(r.contains("did not prove"), "{r}");
    // ... or proving a new session and then asking for this one.
    let mut t = TcpStream::connect(at).await.unwrap();
    as_new_leecher(&mut t).await;
    write_msg(&mut t, &hello(id)).await;
    let r = abort_reason(read_msg(&mut t).await);
    assert!(r.contains("another session"), "{r}");
    // An unknown session is refused outright.
    let mut t = TcpStream::connect(at).await.unwrap();
    let r = as_leecher(&mut t, &proven.session_key, id ^ 1)
        .await
        .unwrap_err();
    assert!(r.contains("no such session"), "{r}");

    // The real leecher's connection was not replaced: it finishes, and the seeder with it.
    write_msg(&mut s, &Msg::Done).await;
    assert_eq!(read_msg(&mut s).await.unwrap(), Msg::Bye);
    seeding
        .finish()
        .await
        .expect("the seeder completes with its own leecher");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leecher_that_reconnects_proves_the_session_key() {
    if !uffd("a_leecher_that_reconnects_proves_the_session_key") {
        return;
    }
    let (seeding, _region) = start_seeder().await;
    let at = tcp(&seeding.control);
    let (mut s, proven, id) = new_session(at).await;
    to_hand_over(&mut s).await;
    // The connection is lost after the hand-over; the leecher comes back with its key.
    drop(s);
    let mut s = TcpStream::connect(at).await.unwrap();
    as_leecher(&mut s, &proven.session_key, id).await.unwrap();
    write_msg(&mut s, &hello(id)).await;
    assert!(matches!(
        read_msg(&mut s).await.unwrap(),
        Msg::Welcome { session, .. } if session == id
    ));
    // The hand-over again (not yet resumed), then the end.
    loop {
        match read_msg(&mut s).await.unwrap() {
            Msg::HandOver { .. } => break,
            Msg::Manifest { .. } | Msg::Confirm { .. } => {}
            other => panic!("expected the hand-over again, got {other:?}"),
        }
    }
    write_msg(&mut s, &Msg::Resumed).await;
    write_msg(&mut s, &Msg::Done).await;
    assert_eq!(read_msg(&mut s).await.unwrap(), Msg::Bye);
    seeding.finish().await.unwrap();
}
