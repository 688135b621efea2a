//! Hostile peers: a fake seeder speaking the control protocol with bad values, raw TCP
//! clients sending garbage, huge length prefixes, floods of tiny frames and hundreds of idle
//! connections to a real seeder's control port, and a silent peer. Each case ends with a clear
//! error, nothing panics, and the side under attack then serves a good peer (a real
//! migration completes).
#![allow(clippy::single_range_in_vec_init)] // page runs: one run is a real case

mod common;
use common::raw::{abort_reason, as_new_leecher, as_seeder, read_msg, write_msg};
use common::uffd;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use farmap_core::{Geometry, Store};
use farmap_migrate::leech::{ConnectError, LeechError, LeechOptions};
use farmap_migrate::machine::{AbortCause, Violation, WelcomeError};
use farmap_migrate::msg::{Mode, Msg, RegionInfo, MAGIC, VERSION};
use farmap_migrate::seed::{SeedOptions, Seeding};
use farmap_migrate::{leech, seed, WriterGate};
use farmap_net::auth::KeySlot;
use farmap_net::{
    ListenAddr, Listener, RemoteAddr, ServeOptions, Server, TlsClientConfig, TlsServerConfig,
};
use farmap_store::MemoryStore;
use farmap_testkit::tls::Pki;
use farmap_uffd::Region;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const SIZE: u64 = 1 << 20;
const PAGE: u32 = 4096;

/// This process's resident set, in MiB (0 if unknown).
fn rss_mib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kib| kib / 1024)
}

fn leech_opts(from: RemoteAddr) -> LeechOptions {
    LeechOptions {
        handshake_timeout: Duration::from_secs(3),
        reconnect_for: Duration::from_secs(3),
        ..LeechOptions::new(from)
    }
}

async fn run_leech(opts: LeechOptions) -> Result<farmap_migrate::LeechReport, LeechError> {
    let (_cancel, cancelled) = tokio::sync::watch::channel(false);
    leech(opts, Box::new(|_, _| {}), cancelled).await
}

/// Runs a leecher that must fail; returns its error, the error's whole chain as text and
/// how long it took to fail.
async fn failing_leech(opts: LeechOptions) -> (LeechError, String, Duration) {
    let t0 = Instant::now();
    let err = run_leech(opts).await.unwrap_err();
    let took = t0.elapsed();
    let text = farmap_core::error_chain(&err);
    (err, text, took)
}

/// A listener on a fresh loopback port, and its address for a leecher.
async fn loopback() -> (TcpListener, RemoteAddr) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = RemoteAddr::Tcp(l.local_addr().unwrap().to_string());
    (l, addr)
}

/// Keeps `held` open, and accepts every later connection on `l` and never answers it.
async fn hold_every_connection(l: TcpListener, mut held: Vec<TcpStream>) {
    loop {
        let (s, _) = l.accept().await.unwrap();
        held.push(s);
    }
}

/// A source region of `SIZE` bytes holding a pattern, with a writer gate.
async fn source() -> (Arc<Region>, Arc<WriterGate>) {
    let g = Geometry::new(SIZE, 65536).unwrap();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(g));
    common::source_region(store, None, |region| {
        let data: Vec<u8> = (0..SIZE).map(|i| (i * 7 % 251) as u8).collect();
        region.write_at(0, &data).unwrap();
    })
    .await
}

async fn start_seeder(tls: Option<TlsServerConfig>) -> (Seeding, Arc<Region>) {
    let (region, gate) = source().await;
    let seeding = seed(
        region.clone(),
        gate,
        SeedOptions {
            tls,
            handshake_timeout: Duration::from_secs(2),
            ..common::seed_options(farmap_migrate::seed::PUSH_BUDGET)
        },
    )
    .await
    .unwrap();
    (seeding, region)
}

fn control_of(s: &Seeding) -> RemoteAddr {
    RemoteAddr::from(&s.control)
}

fn tcp_of(s: &Seeding) -> std::net::SocketAddr {
    match &s.control {
        ListenAddr::Tcp(a) => *a,
        ListenAddr::Unix(p) => panic!("a TCP seeder listens on {}", p.display()),
    }
}

/// A real leecher migrates the region from `seeding` and gets the same bytes.
async fn good_migration(seeding: Seeding, source: Arc<Region>, tls: Option<TlsClientConfig>) {
    let from = control_of(&seeding);
    let report = run_leech(LeechOptions {
        tls,
        ..leech_opts(from)
    })
    .await
    .expect("a good leecher completes");
    seeding.finish().await.expect("the seeder completes");
    let mut want = vec![0u8; SIZE as usize];
    let mut got = vec![0u8; SIZE as usize];
    source.read_at(0, &mut want).unwrap();
    report.region.read_at(0, &mut got).unwrap();
    assert!(want == got, "the migrated region differs from the source");
}

/// A fake seeder: authenticates the leecher (its data plane's `data` slot then holds the
/// session's data key), then plays `script` on the connection.
async fn fake_seeder<F, Fut>(data: KeySlot, script: F) -> (RemoteAddr, tokio::task::JoinHandle<()>)
where
    F: FnOnce(TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let (l, addr) = loopback().await;
    let task = tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        as_seeder(&mut s, &data).await;
        script(s).await;
    });
    (addr, task)
}

fn welcome(page_size: u32, data_port: u16) -> Msg {
    Msg::Welcome {
        session: 9,
        region: RegionInfo {
            size: SIZE,
            chunk_size: 65536,
            page_size,
            data_port,
            boot_id: [0; 16],
            shared: String::new(),
        },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seeder_with_a_bad_page_size_is_refused_before_anything_is_opened() {
    for (page_size, says) in [
        (0, "power of two"),
        (3, "power of two"),
        (1 << 30, "differs"),
    ] {
        let (told_tx, told_rx) = tokio::sync::oneshot::channel();
        let (addr, task) = fake_seeder(KeySlot::default(), move |mut s| async move {
            assert_eq!(
                read_msg(&mut s).await.unwrap(),
                Msg::Hello {
                    session: 0,
                    mode: Mode::Precopy
                }
            );
            write_msg(&mut s, &welcome(page_size, 1)).await;
            let _ = told_tx.send(abort_reason(read_msg(&mut s).await));
        })
        .await;
        let t0 = Instant::now();
        let err = run_leech(leech_opts(addr)).await.unwrap_err();
        match &err {
            LeechError::Aborted {
                cause: AbortCause::Invalid(Violation::Welcome(w)),
                ..
            } => assert!(
                matches!(
                    w,
                    WelcomeError::PageSize { .. } | WelcomeError::PageMismatch { .. }
                ),
                "{w:?}"
            ),
            other => panic!("page size {page_size}: {other:?}"),
        }
        let text = farmap_core::error_chain(&err);
        assert!(text.contains(says), "{text}");
        let told = told_rx.await.unwrap();
        assert!(told.contains(says), "the seeder is told why: {told}");
        assert!(t0.elapsed() < Duration::from_secs(3));
        task.await.unwrap();
    }
}

/// A fake seeder with a real data plane (a memory store of pages), so that the leecher gets
/// past its pull; then `script` plays the rest.
async fn fake_seeder_with_data<F, Fut>(script: F) -> (RemoteAddr, tokio::task::JoinHandle<()>)
where
    F: FnOnce(TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let (server, port, slot) = zero_data_plane().await;
    fake_seeder(slot, move |mut s| async move {
        assert_eq!(
            read_msg(&mut s).await.unwrap(),
            Msg::Hello {
                session: 0,
                mode: Mode::Precopy
            }
        );
        write_msg(&mut s, &welcome(PAGE, port)).await;
        script(s).await;
        let _ = server.shutdown().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dirty_runs_past_the_region_or_of_2_32_pages_are_refused() {
    if !uffd("dirty_runs_past_the_region_or_of_2_32_pages_are_refused") {
        return;
    }
    let runs: [Vec<std::ops::Range<u64>>; 3] = [
        vec![250..300],
        vec![0..(1 << 32)],
        vec![
            0..u64::from(u32::MAX),
            (1 << 40)..(1 << 40) + u64::from(u32::MAX),
        ],
    ];
    for bad in runs {
        let sent = bad.clone();
        let (addr, task) = fake_seeder_with_data(move |mut s| async move {
            assert_eq!(
                read_msg(&mut s).await.unwrap(),
                Msg::DirtyRequest { round: 1 }
            );
            write_msg(
                &mut s,
                &Msg::Dirty {
                    round: 1,
                    runs: sent,
                },
            )
            .await;
            let told = abort_reason(read_msg(&mut s).await);
            assert!(told.contains("reaches past"), "{told}");
        })
        .await;
        let err = run_leech(leech_opts(addr)).await.unwrap_err();
        assert!(
            matches!(
                &err,
                LeechError::Aborted {
                    cause: AbortCause::Invalid(Violation::Runs { msg: "Dirty", .. }),
                    ..
                }
            ),
            "{bad:?}: {err:?}"
        );
        task.await.unwrap();
    }
    // A run whose end passes 2^64 is refused by the decoder: the connection fails.
    let (addr, task) = fake_seeder_with_data(|mut s| async move {
        let _ = read_msg(&mut s).await;
        let mut p = 1u32.to_be_bytes().to_vec();
        p.extend_from_slice(&1u32.to_be_bytes());
        p.extend_from_slice(&(u64::MAX - 5).to_be_bytes());
        p.extend_from_slice(&u32::MAX.to_be_bytes());
        let mut f = MAGIC.to_vec();
        f.extend_from_slice(&VERSION.to_be_bytes());
        f.push(4);
        f.extend_from_slice(&(p.len() as u32).to_be_bytes());
        f.extend_from_slice(&p);
        s.write_all(&f).await.unwrap();
        let _ = s.read(&mut [0u8; 64]).await;
    })
    .await;
    let err = run_leech(leech_opts(addr)).await.unwrap_err();
    let text = farmap_core::error_chain(&err);
    assert!(text.contains("past 2^64"), "{text}");
    task.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_over_past_the_region_is_refused_and_nothing_resumes() {
    if !uffd("a_hand_over_past_the_region_is_refused_and_nothing_resumes") {
        return;
    }
    let (addr, task) = fake_seeder_with_data(|mut s| async move {
        assert_eq!(
            read_msg(&mut s).await.unwrap(),
            Msg::DirtyRequest { round: 1 }
        );
        write_msg(
            &mut s,
            &Msg::Dirty {
                round: 1,
                runs: vec![],
            },
        )
        .await;
        assert_eq!(read_msg(&mut s).await.unwrap(), Msg::Finalize);
        let h = Msg::HandOver {
            runs: vec![0..1 << 32],
            app_state: Bytes::new(),
            suspended_at_ns: 0,
        };
        write_msg(&mut s, &h).await;
        let told = abort_reason(read_msg(&mut s).await);
        assert!(told.contains("HandOver"), "{told}");
    })
    .await;
    let resumed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let r2 = resumed.clone();
    let (_c, cancelled) = tokio::sync::watch::channel(false);
    let err = leech(
        leech_opts(addr),
        Box::new(move |_, _| r2.store(true, std::sync::atomic::Ordering::SeqCst)),
        cancelled,
    )
    .await
    .unwrap_err();
    assert!(
        matches!(
            &err,
            LeechError::Aborted {
                cause: AbortCause::Invalid(Violation::Runs {
                    msg: "HandOver",
                    ..
                }),
                ..
            }
        ),
        "{err:?}"
    );
    assert!(!resumed.load(std::sync::atomic::Ordering::SeqCst));
    task.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_seeder_fails_the_leecher_within_its_deadline() {
    let (l, addr) = loopback().await;
    let hold = tokio::spawn(async move {
        let (s, _) = l.accept().await.unwrap();
        tokio::time::sleep(Duration::from_secs(10)).await;
        drop(s);
    });
    let (err, text, took) = failing_leech(LeechOptions {
        handshake_timeout: Duration::from_millis(500),
        ..LeechOptions::new(addr)
    })
    .await;
    assert!(
        matches!(
            &err,
            LeechError::Connect {
                source: ConnectError::Silent { .. },
                ..
            }
        ),
        "{err:?}"
    );
    assert!(text.contains("did not answer the hello"));
    assert!(took < Duration::from_secs(5), "failed after {took:?}");
    hold.abort();
}

/// Sends `bytes` to the seeder's control port; returns what it answered (an Abort's reason)
/// and checks that it closed the connection.
async fn poke(at: std::net::SocketAddr, bytes: &[u8]) -> String {
    let mut s = TcpStream::connect(at).await.unwrap();
    // The seeder may close before reading everything: a write error is fine.
    let _ = s.write_all(bytes).await;
    let reason = abort_reason(
        tokio::time::timeout(Duration::from_secs(5), read_msg(&mut s))
            .await
            .expect("the seeder answers"),
    );
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest))
        .await
        .expect("the seeder closes the connection");
    reason
}

fn header(kind: u8, len: u32) -> Vec<u8> {
    let mut f = MAGIC.to_vec();
    f.extend_from_slice(&VERSION.to_be_bytes());
    f.push(kind);
    f.extend_from_slice(&len.to_be_bytes());
    f
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_huge_lengths_floods_and_idle_connections_leave_the_seeder_serving() {
    if !uffd("garbage_huge_lengths_floods_and_idle_connections_leave_the_seeder_serving") {
        return;
    }
    let (seeding, region) = start_seeder(None).await;
    let at = tcp_of(&seeding);
    let rss0 = rss_mib();

    let r = poke(at, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert!(r.contains("bad magic"), "{r}");
    let r = poke(at, &header(1, u32::MAX)).await;
    assert!(r.contains("cap"), "{r}");
    let r = poke(at, &header(10, 60 << 20)).await;
    assert!(r.contains("cap"), "{r}");
    let r = poke(at, &header(42, 0)).await;
    assert!(r.contains("unknown migration message kind 42"), "{r}");
    // Without the key, a migration message is not even read as one.
    let r = poke(at, &Msg::Finalize.encode()).await;
    assert!(r.contains("expected an authentication hello"), "{r}");
    // Thousands of tiny frames from a key holder: the first out-of-place one ends the
    // connection.
    let flood: Vec<u8> = std::iter::repeat_n(Msg::Done.encode().to_vec(), 10_000)
        .flatten()
        .collect();
    let mut s = TcpStream::connect(at).await.unwrap();
    as_new_leecher(&mut s).await;
    let _ = s.write_all(&flood).await;
    let r = abort_reason(read_msg(&mut s).await);
    assert!(r.contains("unexpected Done"), "{r}");
    drop(s);
    // A leecher that asks for rounds out of order is dropped, and tracking stops.
    let mut frames = Msg::Hello {
        session: 0,
        mode: Mode::Precopy,
    }
    .encode()
    .to_vec();
    frames.extend_from_slice(&Msg::DirtyRequest { round: 5 }.encode());
    let mut s = TcpStream::connect(at).await.unwrap();
    as_new_leecher(&mut s).await;
    s.write_all(&frames).await.unwrap();
    assert!(matches!(
        read_msg(&mut s).await.unwrap(),
        Msg::Welcome { .. }
    ));
    let r = abort_reason(read_msg(&mut s).await);
    assert!(r.contains("one by one"), "{r}");
    drop(s);

    // 500 idle connections, still open while a real leecher migrates.
    let mut idle = Vec::new();
    for _ in 0..500 {
        idle.push(TcpStream::connect(at).await.unwrap());
    }
    let rss1 = rss_mib();
    let budget = 64;
    println!(
        "RSS: {rss0} MiB before the attacks, {rss1} MiB with 500 idle control connections \
         (budget: {budget} MiB of growth)"
    );
    assert!(
        rss1.saturating_sub(rss0) <= budget,
        "RSS grew from {rss0} to {rss1} MiB"
    );
    good_migration(seeding, region, None).await;
    drop(idle);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_does_not_block_a_leecher() {
    if !uffd("an_idle_connection_does_not_block_a_leecher") {
        return;
    }
    let (seeding, region) = start_seeder(None).await;
    let idle = TcpStream::connect(tcp_of(&seeding)).await.unwrap();
    let t0 = Instant::now();
    good_migration(seeding, region, None).await;
    // Well within the seeder's 2 s handshake deadline: the idle one did not hold it up.
    println!("migrated in {:?} next to an idle connection", t0.elapsed());
    drop(idle);
}

/// TLS for a seeder (its certificate, for 127.0.0.1) and for a leecher that trusts its CA
/// (without a certificate of its own).
fn tls(pki: &Pki) -> (TlsServerConfig, TlsClientConfig) {
    (
        TlsServerConfig {
            cert: pki.server.cert.clone(),
            key: pki.server.key.clone(),
            client_ca: None,
        },
        TlsClientConfig {
            ca: pki.ca.pem.clone(),
            cert: None,
            key: None,
            server_name: None,
        },
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_leecher_is_told_that_the_seeder_requires_tls() {
    if !uffd("a_plain_leecher_is_told_that_the_seeder_requires_tls") {
        return;
    }
    let pki = Pki::new();
    let (server, client) = tls(&pki);
    let (seeding, region) = start_seeder(Some(server)).await;
    let err = run_leech(leech_opts(control_of(&seeding)))
        .await
        .unwrap_err();
    let text = farmap_core::error_chain(&err);
    assert!(
        matches!(
            &err,
            LeechError::Connect {
                source: ConnectError::Refused { .. },
                ..
            }
        ),
        "{text}"
    );
    assert!(text.contains("requires TLS"), "{text}");
    good_migration(seeding, region, Some(client)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seeder_silent_after_a_reconnect_fails_the_leecher_within_its_deadline() {
    if !uffd("a_seeder_silent_after_a_reconnect_fails_the_leecher_within_its_deadline") {
        return;
    }
    let (server, addr, fake) = fake_over_zero_data(|l, port, slot| async move {
        // The first connection goes through the hand-over, then drops.
        let (mut s, _) = l.accept().await.unwrap();
        through_hand_over(&mut s, port, &slot).await;
        drop(s);
        // Later connections are accepted and never answered.
        hold_every_connection(l, Vec::new()).await;
    })
    .await;
    let (err, text, took) = failing_leech(LeechOptions {
        handshake_timeout: Duration::from_millis(300),
        reconnect_for: Duration::from_secs(1),
        ..LeechOptions::new(addr)
    })
    .await;
    assert!(
        matches!(
            &err,
            LeechError::LostAfterHandOver(farmap_migrate::leech::AfterHandOver::Reconnect { .. })
        ),
        "{text}"
    );
    assert!(text.contains("did not answer the hello"), "{text}");
    assert!(took < Duration::from_secs(6), "failed after {took:?}");
    fake.abort();
    let _ = server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_message_after_the_hand_over_does_not_stop_the_leecher() {
    if !uffd("a_bad_message_after_the_hand_over_does_not_stop_the_leecher") {
        return;
    }
    let (server, addr, fake) = fake_over_zero_data(|l, port, slot| async move {
        let (mut s, _) = l.accept().await.unwrap();
        through_hand_over(&mut s, port, &slot).await;
        let empty = Msg::Dirty {
            round: 1,
            runs: vec![],
        };
        // Out of place after the hand-over: a second welcome and a stale dirty round.
        write_msg(&mut s, &welcome(PAGE, port)).await;
        write_msg(&mut s, &empty).await;
        // Then the seeder behaves: the leecher says it is done, the seeder says goodbye.
        loop {
            match read_msg(&mut s).await {
                Ok(Msg::Done) => break,
                Ok(_) => {}
                Err(e) => panic!("the leecher went away instead of finishing: {e}"),
            }
        }
        write_msg(&mut s, &Msg::Bye).await;
        let _ = read_msg(&mut s).await;
    })
    .await;
    let report = tokio::time::timeout(Duration::from_secs(30), run_leech(leech_opts(addr)))
        .await
        .expect("the leecher finishes")
        .expect("a stray message after the hand-over is not fatal");
    assert!(report.region.is_complete());
    fake.await.unwrap();
    let _ = server.shutdown().await;
}

/// A fake seeder over a [`zero_data_plane`], on a fresh loopback port: `fake` runs with its
/// listener and the data plane's port and key slot. Returns the data plane, the fake's
/// address and its task.
async fn fake_over_zero_data<F, Fut>(fake: F) -> (Server, RemoteAddr, tokio::task::JoinHandle<()>)
where
    F: FnOnce(TcpListener, u16, KeySlot) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (server, port, slot) = zero_data_plane().await;
    let (l, addr) = loopback().await;
    (server, addr, tokio::spawn(fake(l, port, slot)))
}

/// A read-only data plane of zero pages, as a fake seeder's: the server, its port, and the
/// slot of the key it requires.
async fn zero_data_plane() -> (Server, u16, KeySlot) {
    let data = Listener::bind(&"127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let port = match data.local_addr().unwrap() {
        ListenAddr::Tcp(a) => a.port(),
        ListenAddr::Unix(_) => unreachable!(),
    };
    let pages = Arc::new(MemoryStore::new(Geometry::new(SIZE, PAGE.into()).unwrap()));
    let slot = KeySlot::default();
    let server = farmap_net::serve(
        pages,
        data,
        ServeOptions {
            read_only: true,
            log: false,
            auth: Some(slot.clone()),
            ..ServeOptions::default()
        },
    )
    .unwrap();
    (server, port, slot)
}

/// A fake seeder's side of a migration with nothing dirty, up to the leecher's `Finalize`
/// (authentication included).
async fn through_finalize(s: &mut TcpStream, port: u16, slot: &KeySlot) {
    as_seeder(s, slot).await;
    assert_eq!(
        read_msg(s).await.unwrap(),
        Msg::Hello {
            session: 0,
            mode: Mode::Precopy
        }
    );
    write_msg(s, &welcome(PAGE, port)).await;
    assert_eq!(read_msg(s).await.unwrap(), Msg::DirtyRequest { round: 1 });
    let empty = Msg::Dirty {
        round: 1,
        runs: vec![],
    };
    write_msg(s, &empty).await;
    assert_eq!(read_msg(s).await.unwrap(), Msg::Finalize);
}

/// A fake seeder's side of a migration with nothing dirty, up to the leecher's `Resumed`.
async fn through_hand_over(s: &mut TcpStream, port: u16, slot: &KeySlot) {
    through_finalize(s, port, slot).await;
    let h = Msg::HandOver {
        runs: vec![],
        app_state: Bytes::new(),
        suspended_at_ns: 0,
    };
    write_msg(s, &h).await;
    assert_eq!(read_msg(s).await.unwrap(), Msg::Resumed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seeder_silent_after_finalize_fails_the_leecher_within_its_deadline() {
    if !uffd("a_seeder_silent_after_finalize_fails_the_leecher_within_its_deadline") {
        return;
    }
    let (server, addr, fake) = fake_over_zero_data(|l, port, slot| async move {
        // The first connection goes as far as Finalize, then says nothing and stays open
        // (a seeder that hangs, or a half-open connection).
        let (mut s, _) = l.accept().await.unwrap();
        through_finalize(&mut s, port, &slot).await;
        // Later connections are accepted and never answered.
        hold_every_connection(l, vec![s]).await;
    })
    .await;
    let (err, text, took) = failing_leech(LeechOptions {
        finalize_timeout: Duration::from_millis(500),
        handshake_timeout: Duration::from_millis(300),
        reconnect_for: Duration::from_secs(1),
        ..LeechOptions::new(addr)
    })
    .await;
    println!("{took:?}: {text}");
    assert!(matches!(&err, LeechError::LostAtFinalize(_)), "{text}");
    assert!(text.contains("before it handed over"), "{text}");
    assert!(took < Duration::from_secs(10), "failed after {took:?}");
    fake.abort();
    let _ = server.shutdown().await;
}

/// A flood of peers from another host that each send an authentication hello and then hold
/// the connection (they cannot prove the key) does not evict a real leecher's handshake:
/// peers that have not proved the key are closed least advanced first, then from the host
/// with the most waiting, then oldest, so the flood closes its own. (Before, the oldest
/// handshake was closed, and with four slots the leecher's was whenever four peers came
/// during its round trip.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_handshakes_does_not_evict_a_real_leecher() {
    if !uffd("a_flood_of_handshakes_does_not_evict_a_real_leecher") {
        return;
    }
    let (region, gate) = source().await;
    let seeding = seed(
        region.clone(),
        gate,
        SeedOptions {
            handshake_timeout: Duration::from_secs(5),
            max_handshakes: 4,
            ..common::seed_options(farmap_migrate::seed::PUSH_BUDGET)
        },
    )
    .await
    .unwrap();
    let at = tcp_of(&seeding);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood = tokio::spawn({
        let stop = stop.clone();
        async move {
            let stranger =
                farmap_net::auth::Key::from_text("not the seeder's migration key").expect("a key");
            let mut held = std::collections::VecDeque::new();
            let mut sent = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // From another host than the leecher's (127.0.0.2).
                let socket = tokio::net::TcpSocket::new_v4().unwrap();
                socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
                let Ok(mut s) = socket.connect(at).await else {
                    continue;
                };
                let (_, hello) = farmap_migrate::auth::LeecherExchange::start(&stranger, 0);
                if s.write_all(&hello.encode()).await.is_ok() {
                    sent += 1;
                }
                held.push_back(s);
                if held.len() > 64 {
                    held.pop_front();
                }
                tokio::task::yield_now().await;
            }
            sent
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t0 = Instant::now();
    good_migration(seeding, region, None).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent = flood.await.unwrap();
    println!(
        "migrated in {:?} while {sent} peers sent a hello and held on (4 handshake slots)",
        t0.elapsed()
    );
    assert!(sent > 100, "the flood ran ({sent} hellos)");
}
