//! A mirrored store whose primary is a real `farmap serve` process, killed during a
//! write-heavy run: no error reaches the application, every acknowledged write is found (by a
//! model check) through the stage, and on the restarted primary once it is resynchronised.

mod common;
use common::farmap;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use farmap::pipeline::{MirrorPolicy, Mirrored, PrimaryState};
use farmap::spec::{open_mirror, SpecKind};
use farmap::{ChunkIdx, Store, StoreSpec};
use farmap_net::{ClientOptions, RemoteAddr, RemoteStore};
use farmap_testkit::cli::Listening;
use parking_lot::Mutex;

/// `farmap serve SPEC --listen LISTEN`, its stderr drained; killed when dropped.
fn serve(spec: &str, listen: &str) -> Listening {
    farmap()
        .listening(&["serve", spec, "--listen", listen])
        .drained()
}

const CHUNK: usize = 4096;
const CHUNKS: u64 = 512;
const WRITERS: u64 = 4;

/// Chunk `idx` as written at `version`.
fn content(idx: u64, version: u64) -> Bytes {
    farmap_testkit::versioned_chunk(idx, version, CHUNK)
}

/// Writer `w` writes `n` times to its own chunks (idx % WRITERS == w); the model keeps the
/// version of each acknowledged write. Every write must succeed.
async fn write_run(store: Arc<Mirrored>, model: Arc<Mutex<Vec<u64>>>, n: u64, round: u64) {
    let tasks: Vec<_> = (0..WRITERS)
        .map(|w| {
            let store = store.clone();
            let model = model.clone();
            tokio::spawn(async move {
                for i in 0..n {
                    let idx = (i * 7 * WRITERS + w + round * 13 * WRITERS) % CHUNKS;
                    let idx = idx - idx % WRITERS + w;
                    let version = round * 1_000_000 + i + 1;
                    store
                        .write(ChunkIdx(idx), content(idx, version))
                        .await
                        .unwrap_or_else(|e| {
                            panic!("write of chunk {idx} reached the application: {e}")
                        });
                    model.lock()[idx as usize] = version;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}

async fn check(store: &dyn Store, model: &[u64], what: &str) {
    for (idx, version) in model.iter().enumerate() {
        let got = store.read(ChunkIdx(idx as u64)).await.unwrap_or_else(|e| {
            panic!("{what}: reading chunk {idx}: {e}");
        });
        let want = if *version == 0 {
            Bytes::from(vec![0u8; CHUNK])
        } else {
            content(idx as u64, *version)
        };
        assert!(got == want, "{what}: chunk {idx} is not version {version}");
    }
}

async fn run(policy: &str) {
    let dir = tempfile::tempdir().unwrap();
    let primary_file = format!(
        "file:{}?size=2MiB&chunk=4KiB",
        dir.path().join("p.img").display()
    );
    let mut primary = serve(&primary_file, "127.0.0.1:0");
    let addr = primary.addr().to_owned();
    let spec: StoreSpec = format!(
        "mirror:(farmap://{addr}?timeout=2s)(file:{}?size=2MiB&chunk=4KiB)?policy={policy}&timeout=500ms&probe=50ms",
        dir.path().join("m.img").display()
    )
    .parse()
    .unwrap();
    let SpecKind::Mirror {
        primary: p,
        mirror: m,
        options,
    } = &spec.kind
    else {
        panic!()
    };
    assert_eq!(
        options.policy,
        if policy == "both" {
            MirrorPolicy::Both
        } else {
            MirrorPolicy::PrimaryFirst
        }
    );
    let store = Arc::new(open_mirror(&spec, p, m, *options).await.unwrap());
    let model = Arc::new(Mutex::new(vec![0u64; CHUNKS as usize]));

    // Writes in flight while the primary is killed.
    let writing = tokio::spawn(write_run(store.clone(), model.clone(), 3000, 0));
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(
        !writing.is_finished(),
        "the run must still be writing when the primary dies"
    );
    primary.kill();
    writing.await.expect("no write failed");
    // More writes with the primary gone.
    write_run(store.clone(), model.clone(), 500, 1).await;
    let st = store.mirror_status();
    assert_eq!(st.primary, PrimaryState::Down, "{st:?}");
    assert!(st.failovers >= 1 && st.to_resync > 0, "{st:?}");
    store.flush().await.unwrap();
    let snapshot = model.lock().clone();
    check(&*store, &snapshot, "through the mirror").await;

    // The primary comes back on the same address and file: it is resynchronised.
    let _again = serve(&primary_file, &addr);
    let deadline = Instant::now() + Duration::from_secs(30);
    // Writes keep coming during the resync.
    write_run(store.clone(), model.clone(), 200, 2).await;
    while store.mirror_status().primary != PrimaryState::Up {
        assert!(
            Instant::now() < deadline,
            "no resync: {:?}",
            store.mirror_status()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let st = store.mirror_status();
    assert!(st.resynced > 0 && st.resynced <= CHUNKS, "{st:?}");
    store.flush().await.unwrap();
    let model = model.lock().clone();
    check(&*store, &model, "through the stage after the resync").await;
    // And on the primary itself: every acknowledged write is there.
    let direct = RemoteStore::connect(RemoteAddr::Tcp(addr.clone()), ClientOptions::default())
        .await
        .unwrap();
    check(&direct, &model, "on the resynchronised primary").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_primary_serve_loses_nothing_with_both() {
    run("both").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_primary_serve_loses_nothing_with_primary_first() {
    run("primary-first").await;
}

/// `mirror:(farmap://A)(farmap://B)` through separate `farmap` processes, A's server killed
/// between them: a new process opens the mirror anyway (saying the primary is missing) and
/// reads from B; a copy into it goes to B and is noted in the mirror's journal; with A back
/// (stale), the next process reads B's version, not A's, and a long-running one resyncs A
/// and removes the journal.
#[test]
fn a_mirror_opens_with_its_primary_down_and_what_it_owes_outlives_the_process() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let farmap = || farmap().env("XDG_STATE_HOME", &state);
    let file = |name: &str| {
        format!(
            "file:{}?size=8MiB&chunk=64KiB",
            dir.path().join(name).display()
        )
    };
    let raw = |name: &str| dir.path().join(name);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let a_addr = format!("127.0.0.1:{port}");
    let a = serve(&file("a.img"), &a_addr);
    let b = serve(&file("b.img"), "127.0.0.1:0");
    let spec = format!(
        "mirror:(farmap://{a_addr}?timeout=1s)(farmap://{}?timeout=5s)?timeout=500ms&probe=50ms",
        b.addr()
    );
    let first = farmap_testkit::pattern_bytes(1, 0, 8 << 20);
    std::fs::write(raw("one.img"), &first).unwrap();
    farmap().ok(&["cp", "-q", &file("one.img"), &spec]);

    // A's server dies; a new process still opens the mirror, and says which side is missing.
    drop(a);
    let o = farmap().run(&["cp", "-q", &spec, &file("out1.img")]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("primary") && err.contains("cannot be reached"),
        "{err}"
    );
    assert!(
        std::fs::read(raw("out1.img")).unwrap() == first,
        "read from the mirror"
    );

    // Writes with A down go to B and are noted in the journal.
    let second = farmap_testkit::pattern_bytes(2, 0, 8 << 20);
    std::fs::write(raw("two.img"), &second).unwrap();
    farmap().ok(&["cp", "-q", &file("two.img"), &spec]);
    let journals = || std::fs::read_dir(state.join("farmap/mirror")).map_or(0, |d| d.count());
    assert_eq!(journals(), 1, "the journal outlives the process");

    // A is back, stale: the next process reads B's version.
    let _a = serve(&file("a.img"), &a_addr);
    farmap().ok(&["cp", "-q", &spec, &file("out2.img")]);
    assert!(
        std::fs::read(raw("out2.img")).unwrap() == second,
        "not A's stale chunks"
    );

    // A long-running process resyncs A, and the journal goes.
    let served = farmap()
        .listening(&["serve", &spec, "--listen", "127.0.0.1:0"])
        .drained();
    let deadline = Instant::now() + Duration::from_secs(60);
    while journals() > 0 {
        // Reads and writes through it keep it busy; the resync runs in the background.
        assert!(
            Instant::now() < deadline,
            "the journal was not emptied by a resync"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(served);
    farmap().ok(&["cp", "-q", &format!("farmap://{a_addr}"), &file("out3.img")]);
    assert!(
        std::fs::read(raw("out3.img")).unwrap() == second,
        "A was resynced"
    );
}
