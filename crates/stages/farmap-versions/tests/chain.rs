//! Opening a version whose chain has deltas, over a real directory whose manifest reads are
//! slowed down: beside a snapshot's name, a hint says where the chain starts, so the chain's
//! manifests are read together (one round trip, not one each); a name without a hint, or
//! with a wrong one, still opens exactly the version it names; the name itself holds the
//! version alone, as older readers of the layout read it.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use farmap_core::{BoxFuture, ChunkIdx, ErrorKind, Geometry, Objects, Store, StoreResult};
use farmap_store::DirObjects;
use farmap_versions::{history, At, Versioned, VersionedOptions, MAX_CHAIN};

const CHUNK: u64 = 4096;

/// Objects whose gets under `regions/` (manifests, snapshot names) take 20 ms each, with
/// the most of them in flight at once.
#[derive(Debug)]
struct Slow {
    inner: DirObjects,
    in_flight: AtomicUsize,
    peak: AtomicUsize,
    gets: AtomicUsize,
    /// Lists and creates under `regions/` take 20 ms too (off unless set), and the most
    /// of them in flight at once.
    slow_lists: std::sync::atomic::AtomicBool,
    lists_in_flight: AtomicUsize,
    lists_peak: AtomicUsize,
}

impl Slow {
    fn open(dir: &Path) -> Arc<Slow> {
        Arc::new(Slow {
            inner: DirObjects::open(dir).unwrap(),
            in_flight: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            gets: AtomicUsize::new(0),
            slow_lists: std::sync::atomic::AtomicBool::new(false),
            lists_in_flight: AtomicUsize::new(0),
            lists_peak: AtomicUsize::new(0),
        })
    }

    /// Runs `op` (a list or a create of `key`) slowly when asked to, counting it.
    async fn slowly<T>(&self, key: &str, op: BoxFuture<'_, StoreResult<T>>) -> StoreResult<T> {
        if !key.starts_with("regions/") || !self.slow_lists.load(Ordering::SeqCst) {
            return op.await;
        }
        let now = self.lists_in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.lists_peak.fetch_max(now, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(20)).await;
        let done = op.await;
        self.lists_in_flight.fetch_sub(1, Ordering::SeqCst);
        done
    }

    /// `(gets, most in flight at once)` since the last call.
    fn take(&self) -> (usize, usize) {
        (
            self.gets.swap(0, Ordering::SeqCst),
            self.peak.swap(0, Ordering::SeqCst),
        )
    }
}

impl Objects for Slow {
    fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, StoreResult<Option<Bytes>>> {
        Box::pin(async move {
            if !key.starts_with("regions/") {
                return self.inner.get(key).await;
            }
            self.gets.fetch_add(1, Ordering::SeqCst);
            let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            self.peak.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(20)).await;
            let got = self.inner.get(key).await;
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            got
        })
    }
    fn exists<'a>(&'a self, key: &'a str) -> BoxFuture<'a, StoreResult<bool>> {
        self.inner.exists(key)
    }
    fn create<'a>(&'a self, key: &'a str, data: Bytes) -> BoxFuture<'a, StoreResult<bool>> {
        Box::pin(self.slowly(key, self.inner.create(key, data)))
    }
    fn list<'a>(&'a self, dir: &'a str) -> BoxFuture<'a, StoreResult<Vec<String>>> {
        Box::pin(self.slowly(dir, self.inner.list(dir)))
    }
    fn delete<'a>(&'a self, key: &'a str) -> BoxFuture<'a, StoreResult<()>> {
        self.inner.delete(key)
    }
    fn location(&self) -> String {
        self.inner.location()
    }
}

fn opts(at: At, create: Option<Geometry>) -> VersionedOptions {
    VersionedOptions {
        read_only: at != At::Latest,
        at,
        create,
        read_ahead: false,
        ..VersionedOptions::new("r")
    }
}

fn content(idx: u64, round: u64) -> Bytes {
    let mut b = vec![round as u8 + 1; CHUNK as usize];
    b[..8].copy_from_slice(&idx.to_le_bytes());
    b[8..16].copy_from_slice(&round.to_le_bytes());
    Bytes::from(b)
}

/// Writes `flushes` versions (version `k` rewrites chunk `k % 64` with round `k`) and names
/// the last one `snap`. Returns the writer.
async fn region(o: &Arc<dyn Objects>, flushes: u64) -> Versioned {
    let g = Geometry::new(64 * CHUNK, CHUNK).unwrap();
    let v = Versioned::open(o.clone(), opts(At::Latest, Some(g)))
        .await
        .unwrap();
    for idx in 0..64 {
        v.write(ChunkIdx(idx), content(idx, 0)).await.unwrap();
    }
    v.flush().await.unwrap();
    for k in 1..flushes {
        v.write(ChunkIdx(k % 64), content(k % 64, k)).await.unwrap();
        v.flush().await.unwrap();
    }
    v.snapshot("snap").await.unwrap();
    v
}

/// What chunk `idx` holds after `flushes` versions of [`region`].
fn expected(idx: u64, flushes: u64) -> Bytes {
    let last = (1..flushes).filter(|k| k % 64 == idx).max().unwrap_or(0);
    content(idx, last)
}

async fn check_all(v: &Versioned, flushes: u64) {
    for idx in 0..64 {
        assert_eq!(
            v.read(ChunkIdx(idx)).await.unwrap(),
            expected(idx, flushes),
            "chunk {idx}"
        );
    }
}

#[tokio::test]
async fn a_snapshot_reads_its_chain_in_one_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let slow = Slow::open(dir.path());
    let o: Arc<dyn Objects> = slow.clone();
    // Version 0 (the new, empty region) is whole, versions 1 to 10 are deltas over it.
    let flushes = 10;
    let _writer = region(&o, flushes).await;
    let h = history(&*o, "r").await.unwrap();
    assert_eq!(h.len() as u64, flushes + 1);
    assert!(h[0].whole && h[1..].iter().all(|v| !v.whole), "{h:?}");
    slow.take();

    let v = Versioned::open(o.clone(), opts(At::Tag("snap".into()), None))
        .await
        .unwrap();
    let (gets, peak) = slow.take();
    // The name and where its chain starts, then the eleven manifests at once.
    assert_eq!(gets, 13);
    assert_eq!(peak, 11, "the chain's manifests were not read together");
    assert_eq!(v.version(), flushes);
    check_all(&v, flushes).await;

    // By number, the chain is read together after its top: two round trips, not eleven.
    let v = Versioned::open(o.clone(), opts(At::Seq(flushes), None))
        .await
        .unwrap();
    let (gets, peak) = slow.take();
    assert_eq!((gets, peak), (11, 10));
    check_all(&v, flushes).await;
}

#[tokio::test]
async fn a_name_without_its_chain_start_or_with_a_wrong_one_opens_its_version() {
    let dir = tempfile::tempdir().unwrap();
    let slow = Slow::open(dir.path());
    let o: Arc<dyn Objects> = slow.clone();
    // Past a whole version in the middle: the chain of the last starts after version 0.
    let flushes = MAX_CHAIN + 6;
    let _writer = region(&o, flushes).await;
    let h = history(&*o, "r").await.unwrap();
    let last = h.last().unwrap().seq;
    let base = h.iter().rev().find(|v| v.whole).unwrap().seq;
    assert!(base > 1, "{h:?}");
    // The name holds the version alone (as older readers read it), the hint beside it.
    assert_eq!(
        std::fs::read_to_string(dir.path().join("regions/r/tags/snap")).unwrap(),
        format!("{last}\n")
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("regions/r/bases/snap")).unwrap(),
        format!("{base}\n")
    );
    for (name, hint) in [
        // As names were written before they had a hint.
        ("old", None),
        // A start too early, and one past the version: each read again from the version's.
        ("early", Some(format!("{}\n", base - 1))),
        ("late", Some(format!("{}\n", last + 5))),
        // Further back than a chain goes: not followed.
        ("far", Some("0\n".to_owned())),
        // Not a number: no hint.
        ("garbage", Some("x y\n".to_owned())),
    ] {
        let key = format!("regions/r/tags/{name}");
        assert!(o
            .create(&key, Bytes::from(format!("{last}\n")))
            .await
            .unwrap());
        if let Some(hint) = hint {
            let key = format!("regions/r/bases/{name}");
            assert!(o.create(&key, Bytes::from(hint)).await.unwrap());
        }
        let v = Versioned::open(o.clone(), opts(At::Tag(name.into()), None))
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(v.version(), last, "{name}");
        check_all(&v, flushes).await;
    }
    for (name, text) in [("words", "7 x\n"), ("two", "7 1\n"), ("empty", "")] {
        let key = format!("regions/r/tags/{name}");
        assert!(o.create(&key, Bytes::from(text)).await.unwrap());
        let e = Versioned::open(o.clone(), opts(At::Tag(name.into()), None))
            .await
            .err()
            .unwrap_or_else(|| panic!("{name} opened"));
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{name}: {e}");
    }
}

/// Forking into several regions looks their names up together, while the source version
/// is resolved, and writes them together: its round trips do not grow with the forks.
#[tokio::test]
async fn forks_are_looked_up_and_written_together() {
    let dir = tempfile::tempdir().unwrap();
    let slow = Slow::open(dir.path());
    let o: Arc<dyn Objects> = slow.clone();
    let _writer = region(&o, 3).await;
    slow.slow_lists.store(true, Ordering::SeqCst);
    let names: Vec<String> = (0..8).map(|i| format!("f{i}")).collect();
    let seq = farmap_versions::fork(&*o, "r", &At::Tag("snap".into()), &names)
        .await
        .unwrap();
    assert_eq!(seq, 3);
    let peak = slow.lists_peak.swap(0, Ordering::SeqCst);
    assert!(
        peak >= 8,
        "the names were looked up or written one by one (peak {peak})"
    );
    slow.slow_lists.store(false, Ordering::SeqCst);
    for name in &names {
        let v = Versioned::open(
            o.clone(),
            VersionedOptions {
                read_only: true,
                read_ahead: false,
                ..VersionedOptions::new(name)
            },
        )
        .await
        .unwrap();
        check_all(&v, 3).await;
    }
    // A name that exists is refused, and no other fork is made.
    let again = vec!["g0".to_owned(), "f3".to_owned()];
    let e = farmap_versions::fork(&*o, "r", &At::Latest, &again)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("\"f3\" already exists"), "{e}");
    assert!(o.list("regions/g0/versions").await.unwrap().is_empty());
}
