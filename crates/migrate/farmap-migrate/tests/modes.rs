//! The other migration modes, end to end over real sockets: post-copy (hand over at once,
//! every chunk from the source) and instant (hand over at once with a manifest; chunks come
//! from a store both hosts reach, served by `farmap_net::serve` here, checked against the
//! manifest, and from the source only where the store lacks them or holds them wrong).

mod common;
use common::uffd;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use farmap_core::{ChunkIdx, Geometry, Store};
use farmap_migrate::leech::{LeechOptions, SharedOpener};
use farmap_migrate::{leech, seed, LeechReport, Mode, WriterGate};
use farmap_net::{ClientOptions, ListenAddr, Listener, RemoteAddr, RemoteStore, ServeOptions};
use farmap_store::MemoryStore;
use farmap_testkit::Hooked;
use farmap_uffd::Region;

const CHUNK: u64 = 64 << 10;
const CHUNKS: u64 = 64;
const SIZE: u64 = CHUNK * CHUNKS;

fn geometry() -> Geometry {
    Geometry::new(SIZE, CHUNK).unwrap()
}

/// Chunk `c`'s content in version `v`: every chunk holds data.
fn chunk_of(c: u64, v: u8) -> Vec<u8> {
    (0..CHUNK)
        .map(|i| (i as u8).wrapping_mul(13) ^ (c as u8) ^ v.wrapping_mul(71) | 1)
        .collect()
}

/// A shared store on a socket, as `farmap serve` runs one; returns its spec, address and
/// the memory behind it.
async fn shared_store() -> (String, RemoteAddr, Arc<MemoryStore>, farmap_net::Server) {
    let mem = Arc::new(MemoryStore::new(geometry()));
    let listener = Listener::bind(&"127.0.0.1:0".parse::<ListenAddr>().unwrap())
        .await
        .unwrap();
    let at = listener.local_addr().unwrap();
    let server = farmap_net::serve(mem.clone(), listener, ServeOptions::default()).unwrap();
    let addr = RemoteAddr::from(&at);
    (format!("farmap://{at}"), addr, mem, server)
}

async fn connect(addr: RemoteAddr) -> Arc<dyn Store> {
    Arc::new(
        RemoteStore::connect(addr, ClientOptions::default())
            .await
            .unwrap(),
    )
}

/// A source region over `store`, every chunk written (version 0) and pushed, then
/// `unpushed` chunks written again (version 1) and not pushed.
async fn source(
    store: Arc<dyn Store>,
    spec: Option<String>,
    unpushed: &[u64],
) -> (Arc<Region>, Arc<WriterGate>) {
    let unpushed = unpushed.to_vec();
    common::source_region(store, spec, move |region| {
        for c in 0..CHUNKS {
            region
                .write_at((c * CHUNK) as usize, &chunk_of(c, 0))
                .unwrap();
        }
        region.sync().unwrap();
        for &c in &unpushed {
            region
                .write_at((c * CHUNK) as usize, &chunk_of(c, 1))
                .unwrap();
        }
    })
    .await
}

async fn migrate(
    region: Arc<Region>,
    gate: Arc<WriterGate>,
    mode: Mode,
    shared: Option<SharedOpener>,
) -> LeechReport {
    common::migrate(region, gate, Duration::ZERO, |o| LeechOptions {
        mode,
        shared,
        ..o
    })
    .await
}

fn image(r: &Region) -> Vec<u8> {
    let mut v = vec![0u8; SIZE as usize];
    r.read_at(0, &mut v).unwrap();
    v
}

fn assert_same(want: &[u8], got: &[u8]) {
    for c in 0..CHUNKS as usize {
        let r = c * CHUNK as usize..(c + 1) * CHUNK as usize;
        assert!(want[r.clone()] == got[r], "chunk {c} differs");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_copy_hands_over_at_once_and_every_chunk_arrives() {
    if !uffd("post_copy_hands_over_at_once_and_every_chunk_arrives") {
        return;
    }
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(geometry()));
    let (region, gate) = source(store, None, &[3, 9]).await;
    let want = image(&region);
    let report = migrate(region, gate, Mode::Postcopy, None).await;
    assert_eq!(report.mode, Mode::Postcopy);
    assert_eq!(report.rounds, 0, "no pre-copy rounds");
    assert_eq!(
        report.bytes_precopy, 0,
        "nothing pulled before the hand-over"
    );
    assert_eq!(
        report.bytes_postcopy, SIZE,
        "every chunk came from the source after it"
    );
    assert_same(&want, &image(&report.region));
}

/// The destination's view of the shared store `inner`, with faults: chunks in `corrupt`
/// come back with a flipped bit, chunks in `stale` as the version before the source's last
/// push.
fn bad_reads(inner: Arc<dyn Store>, corrupt: HashSet<u64>, stale: HashSet<u64>) -> impl Store {
    Hooked::through(inner).map_reads(move |idx, data| {
        if stale.contains(&idx.0) {
            return Bytes::from(chunk_of(idx.0, 0));
        }
        if corrupt.contains(&idx.0) {
            let mut b = BytesMut::from(&data[..]);
            b[100] ^= 0x10;
            return b.freeze();
        }
        data
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instant_takes_only_what_the_store_lacks_and_catches_a_bad_store() {
    if !uffd("instant_takes_only_what_the_store_lacks_and_catches_a_bad_store") {
        return;
    }
    let (spec, addr, behind, _server) = shared_store().await;
    // Chunk 20 is pushed in version 1 too (the store then "loses" that push: stale reads);
    // chunks 3, 9 and 40 are written after the last push.
    let (region, gate) = source(connect(addr.clone()).await, Some(spec.clone()), &[]).await;
    let r2 = region.clone();
    tokio::task::spawn_blocking(move || {
        r2.write_at((20 * CHUNK) as usize, &chunk_of(20, 1))
            .unwrap();
        r2.sync().unwrap();
        for c in [3u64, 9, 40] {
            r2.write_at((c * CHUNK) as usize, &chunk_of(c, 1)).unwrap();
        }
    })
    .await
    .unwrap();
    let want = image(&region);
    let opened = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let opener = {
        let opened = opened.clone();
        SharedOpener(Arc::new(move |spec: String| {
            opened.lock().push(spec);
            let addr = addr.clone();
            Box::pin(async move {
                let store: Arc<dyn Store> =
                    Arc::new(bad_reads(connect(addr).await, [7, 33].into(), [20].into()));
                Ok(store)
            })
        }))
    };
    let report = migrate(region.clone(), gate, Mode::Instant, Some(opener)).await;
    assert_eq!(
        *opened.lock(),
        vec![spec],
        "the seeder's spec is what was opened"
    );
    let c = report.instant;
    assert_eq!(
        c.verify_failures, 3,
        "chunks 7, 20 and 33 fail their checks: {c:?}"
    );
    assert_eq!(
        c.chunks_from_source, 6,
        "3, 9 and 40 (never pushed) and the three bad ones: {c:?}"
    );
    assert_eq!(c.chunks_from_store, CHUNKS - 6, "{c:?}");
    assert_eq!(report.bytes_precopy, 0);
    assert!(
        report.bytes_before_resume <= 32 * CHUNKS + 65536,
        "{} bytes before resuming",
        report.bytes_before_resume
    );
    // Byte for byte, and the shared store holds what the source alone held.
    assert_same(&want, &image(&report.region));
    for c in [3u64, 9, 40] {
        assert_eq!(
            &behind.read(ChunkIdx(c)).await.unwrap()[..],
            &chunk_of(c, 1)[..],
            "chunk {c} was pushed to the shared store before the source was released"
        );
    }
    // The source pushes nothing any more.
    assert!(region.sync().is_err(), "a sealed source cannot push");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instant_is_refused_for_a_region_without_a_shared_store() {
    if !uffd("instant_is_refused_for_a_region_without_a_shared_store") {
        return;
    }
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(geometry()));
    let (region, gate) = source(store, Some("memory:4MiB".into()), &[]).await;
    let seeding = seed(region.clone(), gate, common::seed_options(Duration::ZERO))
        .await
        .unwrap();
    let (_cancel, cancelled) = tokio::sync::watch::channel(false);
    let err = leech(
        LeechOptions {
            mode: Mode::Instant,
            ..LeechOptions::new(RemoteAddr::from(&seeding.control))
        },
        Box::new(|_, _| {}),
        cancelled,
    )
    .await
    .unwrap_err();
    let msg = farmap_core::error_chain(&err);
    assert!(msg.contains("store"), "{msg}");
    // The source runs on, and can still push.
    region.write_at(0, &[9u8; 16]).unwrap();
    region.sync().unwrap();
    seeding.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instant_catches_the_writes_made_after_the_manifest_was_sent() {
    if !uffd("instant_catches_the_writes_made_after_the_manifest_was_sent") {
        return;
    }
    let (spec, addr, behind, _server) = shared_store().await;
    let (region, _) = source(connect(addr.clone()).await, Some(spec), &[]).await;
    // Every chunk was pushed longer ago than the draft's window (cold), except chunk 7
    // (hot: pushed within it).
    tokio::time::sleep(farmap_migrate::endpoint::HOT_WINDOW + Duration::from_millis(200)).await;
    let r2 = region.clone();
    tokio::task::spawn_blocking(move || {
        r2.write_at((7 * CHUNK) as usize, &chunk_of(7, 1)).unwrap();
        r2.sync().unwrap();
    })
    .await
    .unwrap();
    // The application's last writes land after the manifest went out, as it stops: one
    // hot chunk and one cold one.
    let weak = Arc::downgrade(&region);
    let gate = Arc::new(WriterGate::new(move || {
        if let Some(r) = weak.upgrade() {
            for c in [7u64, 30] {
                r.write_at((c * CHUNK) as usize, &chunk_of(c, 2)).unwrap();
            }
        }
        Bytes::from_static(b"state")
    }));
    let shared = {
        let addr = addr.clone();
        SharedOpener(Arc::new(move |_spec: String| {
            let addr = addr.clone();
            Box::pin(async move { Ok(connect(addr).await) })
        }))
    };
    let report = migrate(region.clone(), gate, Mode::Instant, Some(shared)).await;
    let want = image(&region);
    for c in [7u64, 30] {
        assert_eq!(
            &want[(c * CHUNK) as usize..((c + 1) * CHUNK) as usize],
            &chunk_of(c, 2)[..]
        );
    }
    assert_same(&want, &image(&report.region));
    let c = report.instant;
    assert_eq!(c.verify_failures, 0, "{c:?}");
    assert_eq!(
        c.chunks_from_source, 2,
        "chunks 7 and 30, written after the manifest: {c:?}"
    );
    for c in [7u64, 30] {
        assert_eq!(
            &behind.read(ChunkIdx(c)).await.unwrap()[..],
            &chunk_of(c, 2)[..],
            "chunk {c} reached the shared store before the source was released"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instant_finishes_from_the_store_when_the_source_dies_after_the_hand_over() {
    if !uffd("instant_finishes_from_the_store_when_the_source_dies_after_the_hand_over") {
        return;
    }
    let (spec, addr, _behind, _server) = shared_store().await;
    // Every chunk pushed (version 0), then 3, 9 and 40 written again and not pushed: only the
    // source holds their newest content.
    let (region, gate) = source(connect(addr.clone()).await, Some(spec), &[3, 9, 40]).await;
    let at_handover = image(&region);
    let shared = {
        let addr = addr.clone();
        SharedOpener(Arc::new(move |_spec: String| {
            let addr = addr.clone();
            Box::pin(async move { Ok(connect(addr).await) })
        }))
    };
    let seeding = Arc::new(
        seed(region.clone(), gate, common::seed_options(Duration::ZERO))
            .await
            .unwrap(),
    );
    let (_cancel, cancelled) = tokio::sync::watch::channel(false);
    let opts = LeechOptions {
        mode: Mode::Instant,
        shared: Some(shared),
        reconnect_for: Duration::from_secs(1),
        ..common::test_leech_options(&seeding.control)
    };
    // The source host dies as the application resumes here: before the post-copy.
    let killer = seeding.clone();
    let report = leech(opts, Box::new(move |_, _| killer.kill()), cancelled)
        .await
        .expect("the destination finishes without its source");
    let rolled: HashSet<u64> = report.rolled_back.iter().copied().collect();
    assert!(
        !rolled.is_empty() && rolled.is_subset(&[3, 9, 40].into()),
        "only chunks the source alone held roll back: {:?}",
        report.rolled_back
    );
    assert_eq!(report.instant.chunks_rolled_back, rolled.len() as u64);
    let got = image(&report.region);
    for c in 0..CHUNKS {
        let r = (c * CHUNK) as usize..((c + 1) * CHUNK) as usize;
        if rolled.contains(&c) {
            assert!(
                got[r] == chunk_of(c, 0)[..],
                "chunk {c} rolled back to the store's version"
            );
        } else {
            assert!(
                got[r.clone()] == at_handover[r],
                "chunk {c} as at the hand-over"
            );
        }
    }
}
