//! Paged chunk maps over a real directory: an open reads no page whatever the region's size,
//! a read reads its chunk's page once, a whole version stores only the pages that changed,
//! manifests written before pages still open, and the collector keeps pages and what they
//! list.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use farmap_core::{BoxFuture, ChunkIdx, Geometry, Objects, Store, StoreResult};
use farmap_store::DirObjects;
use farmap_versions::page::PAGE_CHUNKS;
use farmap_versions::{chunk, gc, history, At, GcOptions, Hash, Manifest, Versioned};
use farmap_versions::{VersionedOptions, MAX_CHAIN, MAX_DELTA};

const CHUNK: u64 = 4096;

/// Objects that count the gets and creates of keys under `chunks/` (chunks and pages).
#[derive(Debug)]
struct Counting {
    inner: DirObjects,
    gets: AtomicUsize,
    creates: AtomicUsize,
    lists: AtomicUsize,
}

impl Counting {
    fn open(dir: &Path) -> Arc<Counting> {
        Arc::new(Counting {
            inner: DirObjects::open(dir).unwrap(),
            gets: AtomicUsize::new(0),
            creates: AtomicUsize::new(0),
            lists: AtomicUsize::new(0),
        })
    }

    /// `(gets, creates)` since the last call.
    fn take(&self) -> (usize, usize) {
        (
            self.gets.swap(0, Ordering::SeqCst),
            self.creates.swap(0, Ordering::SeqCst),
        )
    }
}

impl Objects for Counting {
    fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, StoreResult<Option<Bytes>>> {
        if key.starts_with("chunks/") {
            self.gets.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.get(key)
    }
    fn exists<'a>(&'a self, key: &'a str) -> BoxFuture<'a, StoreResult<bool>> {
        self.inner.exists(key)
    }
    fn create<'a>(&'a self, key: &'a str, data: Bytes) -> BoxFuture<'a, StoreResult<bool>> {
        if key.starts_with("chunks/") {
            self.creates.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.create(key, data)
    }
    fn list<'a>(&'a self, dir: &'a str) -> BoxFuture<'a, StoreResult<Vec<String>>> {
        self.lists.fetch_add(1, Ordering::SeqCst);
        self.inner.list(dir)
    }
    fn delete<'a>(&'a self, key: &'a str) -> BoxFuture<'a, StoreResult<()>> {
        self.inner.delete(key)
    }
    fn location(&self) -> String {
        self.inner.location()
    }
}

/// A region of `pages` pages of 4 KiB chunks.
fn geometry(pages: u64) -> Geometry {
    Geometry::new(pages * u64::from(PAGE_CHUNKS) * CHUNK, CHUNK).unwrap()
}

fn opts(region: &str, at: At, create: Option<Geometry>) -> VersionedOptions {
    VersionedOptions {
        read_only: at != At::Latest,
        at,
        create,
        // The working set's read-ahead would read chunks (and pages) of its own.
        read_ahead: false,
        ..VersionedOptions::new(region)
    }
}

fn content(idx: u64, round: u8) -> Bytes {
    let mut b = vec![round; CHUNK as usize];
    b[..8].copy_from_slice(&idx.to_le_bytes());
    Bytes::from(b)
}

/// The first chunk of page `p`, and one in its middle.
fn in_page(p: u64) -> [u64; 2] {
    let first = p * u64::from(PAGE_CHUNKS);
    [first, first + u64::from(PAGE_CHUNKS) / 2 + p]
}

/// Writes two chunks in each of `pages` pages, then flushes until the chain is cut by a
/// whole version (each flush rewriting chunk 1). Returns the writer.
async fn whole_region(o: &Arc<dyn Objects>, region: &str, pages: u64) -> Versioned {
    let g = geometry(pages);
    let v = Versioned::open(o.clone(), opts(region, At::Latest, Some(g)))
        .await
        .unwrap();
    for p in 0..pages {
        for idx in in_page(p) {
            v.write(ChunkIdx(idx), content(idx, 1)).await.unwrap();
        }
    }
    for round in 0..MAX_CHAIN {
        v.write(ChunkIdx(1), content(1, round as u8)).await.unwrap();
        v.flush().await.unwrap();
    }
    let h = history(&**o, region).await.unwrap();
    let last = h.last().unwrap();
    assert!(last.whole, "version {} is whole: {h:?}", last.seq);
    assert_eq!(last.chunks, 2 * pages + 1, "{last:?}");
    v
}

#[tokio::test]
async fn an_open_reads_no_page_and_a_read_reads_its_page_once() {
    for pages in [1, 64] {
        let dir = tempfile::tempdir().unwrap();
        let counting = Counting::open(dir.path());
        let o: Arc<dyn Objects> = counting.clone();
        drop(whole_region(&o, "r", pages).await);
        counting.take();

        let v = Versioned::open(o.clone(), opts("r", At::Latest, None))
            .await
            .unwrap();
        assert_eq!(counting.take().0, 0, "{pages} pages: the open read no page");
        let last = pages - 1;
        let [a, b] = in_page(last);
        assert_eq!(v.read(ChunkIdx(a)).await.unwrap(), content(a, 1));
        assert_eq!(counting.take().0, 2, "its page, then the chunk");
        assert_eq!(v.read(ChunkIdx(b)).await.unwrap(), content(b, 1));
        assert_eq!(v.read(ChunkIdx(b + 1)).await.unwrap(), vec![0; 4096]);
        assert_eq!(counting.take().0, 1, "the page was read already");
        assert_eq!(v.read(ChunkIdx(1)).await.unwrap(), content(1, 31));

        // A read-only opening of a given version lists nothing (a listing is a slow call on
        // S3): it reads that version's manifests.
        let seq = v.version();
        counting.lists.store(0, Ordering::SeqCst);
        let old = Versioned::open(o.clone(), opts("r", At::Seq(seq), None))
            .await
            .unwrap();
        assert_eq!(counting.lists.load(Ordering::SeqCst), 0);
        assert_eq!(old.read(ChunkIdx(a)).await.unwrap(), content(a, 1));
    }
}

#[tokio::test]
async fn a_whole_version_stores_only_the_pages_that_changed() {
    let dir = tempfile::tempdir().unwrap();
    let counting = Counting::open(dir.path());
    let o: Arc<dyn Objects> = counting.clone();
    let pages = 16;
    let v = whole_region(&o, "r", pages).await;
    let first_whole = v.version();
    // Now only page 5 changes, one chunk at a time, until the next whole version.
    let [idx, _] = in_page(5);
    let mut page_creates = Vec::new();
    for round in 0..MAX_CHAIN {
        v.write(ChunkIdx(idx), content(idx, 100 + round as u8))
            .await
            .unwrap();
        counting.take();
        v.flush().await.unwrap();
        page_creates.push(counting.take().1);
    }
    assert_eq!(v.version(), first_whole + MAX_CHAIN);
    assert_eq!(
        page_creates.iter().sum::<usize>(),
        1,
        "one page stored, by the whole version: {page_creates:?}"
    );
    drop(v);
    let h = history(&*o, "r").await.unwrap();
    assert!(h.last().unwrap().whole);

    // Every version reads back as saved, the new whole one and the one before.
    for (seq, round) in [
        (first_whole, None),
        (first_whole + MAX_CHAIN, Some(100 + MAX_CHAIN as u8 - 1)),
    ] {
        let r = Versioned::open(o.clone(), opts("r", At::Seq(seq), None))
            .await
            .unwrap();
        for p in 0..pages {
            for i in in_page(p) {
                let want = match round {
                    Some(k) if i == idx => content(i, k),
                    _ => content(i, 1),
                };
                assert_eq!(r.read(ChunkIdx(i)).await.unwrap(), want, "v{seq} {i}");
            }
        }
    }
}

/// A whole manifest that lists its chunks itself (written before pages) opens, reads, and
/// is followed by whole versions of pages.
#[tokio::test]
async fn manifests_written_before_pages_still_open() {
    let dir = tempfile::tempdir().unwrap();
    let o: Arc<dyn Objects> = Arc::new(DirObjects::open(dir.path()).unwrap());
    let g = geometry(2);
    let mut entries = Vec::new();
    for idx in [3, 5000] {
        let data = content(idx, 7);
        let hash = Hash::of(&data);
        o.create(&chunk::key(&hash), Bytes::from(chunk::encode(&data)))
            .await
            .unwrap();
        entries.push((idx, hash));
    }
    let old = Manifest {
        entries,
        pages: Vec::new(),
        page_chunks: 0,
        ..Manifest::empty(g)
    };
    o.create(
        "regions/old/versions/00000000000000000000",
        Bytes::from(old.encode()),
    )
    .await
    .unwrap();

    let v = Versioned::open(o.clone(), opts("old", At::Latest, None))
        .await
        .unwrap();
    assert_eq!(v.read(ChunkIdx(5000)).await.unwrap(), content(5000, 7));
    for round in 0..MAX_CHAIN {
        v.write(ChunkIdx(9), content(9, round as u8)).await.unwrap();
        v.flush().await.unwrap();
    }
    drop(v);
    let h = history(&*o, "old").await.unwrap();
    assert!(h.last().unwrap().whole);
    assert_eq!(h.last().unwrap().chunks, 3);
    let v = Versioned::open(o.clone(), opts("old", At::Latest, None))
        .await
        .unwrap();
    for (idx, round) in [(3, 7), (5000, 7), (9, MAX_CHAIN as u8 - 1)] {
        assert_eq!(v.read(ChunkIdx(idx)).await.unwrap(), content(idx, round));
    }
}

/// The collector keeps every page a version lists and every chunk a page lists, and
/// removes a page nobody lists.
#[tokio::test]
async fn the_collector_keeps_pages_and_what_they_list() {
    let dir = tempfile::tempdir().unwrap();
    let o: Arc<dyn Objects> = Arc::new(DirObjects::open(dir.path()).unwrap());
    let grace = Duration::from_millis(50);
    gc(
        &*o,
        &GcOptions {
            grace: Some(grace),
            dry_run: false,
        },
    )
    .await
    .unwrap();
    let pages = 4;
    drop(whole_region(&o, "r", pages).await);
    // A page nobody lists (a writer that stopped before its manifest).
    let stray = farmap_versions::page::Page::new(vec![(1, Hash::of(b"x"))]);
    let (r, bytes) = stray.stored();
    o.create(&chunk::key(&r.hash), bytes.unwrap())
        .await
        .unwrap();

    let opts_gc = GcOptions::default();
    let first = gc(&*o, &opts_gc).await.unwrap();
    // Every chunk written is listed by a version (versions are never deleted): only the page.
    assert_eq!(first.trashed, 1, "{first:?}");
    tokio::time::sleep(grace * 2).await;
    let second = gc(&*o, &opts_gc).await.unwrap();
    assert_eq!(second.deleted, first.trashed, "{second:?}");
    assert!(!o.exists(&chunk::key(&r.hash)).await.unwrap());

    let v = Versioned::open(o.clone(), opts("r", At::Latest, None))
        .await
        .unwrap();
    for p in 0..pages {
        for i in in_page(p) {
            assert_eq!(v.read(ChunkIdx(i)).await.unwrap(), content(i, 1));
        }
    }
}

/// The largest file under `dir`, in bytes.
fn largest(dir: &Path) -> u64 {
    let mut max = 0;
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let m = e.metadata().unwrap();
        max = max.max(if m.is_dir() {
            largest(&e.path())
        } else {
            m.len()
        });
    }
    max
}

/// A flush that saves more than [`MAX_DELTA`] chunks writes a whole version in pages, not a
/// long delta: no object the layout writes grows with the region or the change (a CQL
/// object holds at most 8 MiB).
#[tokio::test]
async fn a_big_change_is_saved_whole_and_no_object_is_big() {
    let dir = tempfile::tempdir().unwrap();
    let o: Arc<dyn Objects> = Arc::new(DirObjects::open(dir.path()).unwrap());
    // 64 GiB in 4 KiB chunks: 16 Mi chunks, 4096 pages.
    let g = geometry(4096);
    let v = Versioned::open(o.clone(), opts("big", At::Latest, Some(g)))
        .await
        .unwrap();
    // One content (stored once), over 17 pages.
    let written: Vec<u64> = (0..=MAX_DELTA as u64).map(|i| i * 16 + 5).collect();
    let same = content(0, 3);
    for &idx in &written {
        v.write(ChunkIdx(idx), same.clone()).await.unwrap();
    }
    v.flush().await.unwrap();
    assert_eq!(v.version(), 1);
    drop(v);
    let h = history(&*o, "big").await.unwrap();
    assert!(h[1].whole, "{:?}", h[1]);
    assert_eq!(h[1].chunks, written.len() as u64);
    let biggest = largest(dir.path());
    assert!(biggest < 200 << 10, "the largest object is {biggest} bytes");
    let v = Versioned::open(o.clone(), opts("big", At::Latest, None))
        .await
        .unwrap();
    for &idx in written.iter().step_by(97) {
        assert_eq!(v.read(ChunkIdx(idx)).await.unwrap(), same);
        assert_eq!(v.read(ChunkIdx(idx + 1)).await.unwrap(), vec![0; 4096]);
    }
}
