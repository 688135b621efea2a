//! Regions that share their clean pages: two regions over stores with one base keep one copy
//! of each clean chunk (the base's file), written pages are private copies, and a store whose
//! chunk is not the base's cannot put it into the shared file.

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use common::*;
use farmap_core::{
    BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, Geometry, MemoryBase, Store, StoreResult,
};
use farmap_store::MemoryStore;
use farmap_testkit::block_on;
use farmap_testkit::contents::{snapshot, with_pattern};
use farmap_uffd::{Region, RegionOptions, WriteTracking};
use parking_lot::Mutex;

const CHUNK: u64 = 64 << 10;
const CHUNKS: u64 = 32;

/// A base: the content a test store started from, compared chunk by chunk.
#[derive(Debug)]
struct TestBase {
    key: [u8; 32],
    chunks: Vec<Vec<u8>>,
    /// The store's chunks changed since (by writes through it).
    written: Arc<Mutex<Vec<bool>>>,
    /// Chunks whose content differs from the base although `is_base` says otherwise (a store
    /// that lies).
    lies: Vec<u64>,
}

impl MemoryBase for TestBase {
    fn key(&self) -> [u8; 32] {
        self.key
    }
    fn is_base(&self, idx: ChunkIdx) -> bool {
        !self.written.lock()[idx.0 as usize]
    }
    fn check(&self, idx: ChunkIdx, data: &[u8]) -> bool {
        self.chunks[idx.0 as usize] == data
    }
}

/// A memory store that says what its base is.
#[derive(Debug)]
struct Based {
    store: Arc<MemoryStore>,
    base: Arc<TestBase>,
}

impl Store for Based {
    fn geometry(&self) -> Geometry {
        self.store.geometry()
    }
    fn caps(&self) -> Caps {
        self.store.caps()
    }
    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        self.store.read(idx)
    }
    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        self.base.written.lock()[idx.0 as usize] = !self.base.lies.contains(&idx.0);
        self.store.write(idx, data)
    }
    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        self.store.flush()
    }
    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        for idx in range.iter() {
            self.base.written.lock()[idx.0 as usize] = true;
        }
        self.store.trim(range)
    }
    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        self.store.status(idx)
    }
    fn memory_base(&self) -> BoxFuture<'_, StoreResult<Option<Arc<dyn MemoryBase>>>> {
        let base = self.base.clone() as Arc<dyn MemoryBase>;
        Box::pin(async move { Ok(Some(base)) })
    }
}

/// A clone of the base with pattern `seed`: a store holding it, whose base is it; chunks of
/// `lies` hold something else while the store says they are the base's.
fn clone_of(seed: u64, key: [u8; 32], lies: &[u64]) -> (Arc<Based>, Vec<u8>) {
    let geometry = Geometry::new(CHUNK * CHUNKS, CHUNK).unwrap();
    let store = with_pattern(MemoryStore::new(geometry), seed);
    let content = snapshot(&*store);
    let chunks: Vec<Vec<u8>> = content.chunks(CHUNK as usize).map(<[u8]>::to_vec).collect();
    for &c in lies {
        let other = vec![0xEE; CHUNK as usize];
        block_on(store.write(ChunkIdx(c), Bytes::from(other))).unwrap();
    }
    let base = Arc::new(TestBase {
        key,
        chunks,
        written: Arc::new(Mutex::new(vec![false; CHUNKS as usize])),
        lies: lies.to_vec(),
    });
    let content = snapshot(&*store);
    (Arc::new(Based { store, base }), content)
}

/// A directory on tmpfs (shared bases need shmem).
fn shm_dir() -> tempfile::TempDir {
    tempfile::tempdir_in("/dev/shm").unwrap()
}

fn opts(tracking: WriteTracking, dir: &Path) -> RegionOptions {
    RegionOptions {
        shared_dir: Some(dir.to_owned()),
        ..direct(tracking)
    }
}

fn read_all(region: &Region) -> Vec<u8> {
    let mut out = vec![0u8; region.len()];
    region.memory().read_into(0, &mut out).unwrap();
    out
}

/// Bytes of memory the base file holds.
fn file_bytes(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().blocks() * 512
}

/// Two regions over clones of one base: the first fetches and fills every chunk, the second
/// maps them from the file without fetching; both read the base, the file holds one copy
/// (plus its bitmap), and neither mapping has private pages. A write makes a private copy
/// of its page only: the other region and the file keep the base, and the writer's sync puts
/// the write in its own store. Its page discarded and touched again, the written chunk comes
/// back from the store (it is not the base's any more). Closing both removes the file.
#[test]
fn clones_share_clean_pages_and_copy_written_ones() {
    if !uffd_available("clones_share_clean_pages_and_copy_written_ones") {
        return;
    }
    for tracking in tracking_modes() {
        let dir = shm_dir();
        let shared = dir.path().join("shared");
        let (a_store, base) = clone_of(7, [1; 32], &[]);
        let (b_store, _) = clone_of(7, [1; 32], &[]);
        let a = Region::open(a_store.clone(), opts(tracking, &shared)).unwrap();
        let b = Region::open(b_store.clone(), opts(tracking, &shared)).unwrap();
        let path = a.shared_base().expect("a shares its base").to_owned();
        assert_eq!(b.shared_base(), Some(path.as_path()), "{tracking:?}");
        assert_eq!(read_all(&a), base, "{tracking:?}");
        assert_eq!(read_all(&b), base, "{tracking:?}");
        let (sa, sb) = (a.stats(), b.stats());
        let (sa, sb) = (sa.shared.unwrap(), sb.shared.unwrap());
        assert_eq!((sa.mapped_chunks, sa.filled_chunks), (CHUNKS, CHUNKS));
        assert_eq!((sb.mapped_chunks, sb.filled_chunks), (CHUNKS, 0));
        let len = CHUNK * CHUNKS;
        let page = 4096u64;
        assert!(
            file_bytes(&path) <= len + page,
            "one copy in the file: {} bytes for {len}",
            file_bytes(&path)
        );
        for r in [&a, &b] {
            let m = r.memory_use().unwrap();
            assert_eq!(
                (m.resident_bytes, m.private_bytes),
                (len, 0),
                "{tracking:?}: all mapped, none private"
            );
        }

        // A write: a private copy of one page.
        let at = 5 * CHUNK as usize + 100;
        a.memory().write_from(at, b"written by a").unwrap();
        let private = a.memory_use().unwrap().private_bytes;
        assert_eq!(
            private, page,
            "{tracking:?}: one private page after a write"
        );
        let mut expect = base.clone();
        expect[at..at + 12].copy_from_slice(b"written by a");
        assert_eq!(read_all(&a), expect);
        assert_eq!(read_all(&b), base, "{tracking:?}: b still reads the base");
        let mut in_file = vec![0u8; 12];
        std::os::unix::fs::FileExt::read_exact_at(
            &std::fs::File::open(&path).unwrap(),
            &mut in_file,
            at as u64,
        )
        .unwrap();
        assert_eq!(in_file, &base[at..at + 12], "the file keeps the base");
        a.sync().unwrap();
        assert_eq!(snapshot(&*a_store.store), expect, "{tracking:?}: a's store");
        assert_eq!(snapshot(&*b_store.store), base, "{tracking:?}: b's store");

        // Discarded and touched again: the written chunk is a's own (from its store).
        let first = 5 * CHUNK / page;
        let run = first..first + CHUNK / page;
        a.discard_pages(std::slice::from_ref(&run)).unwrap();
        assert_eq!(read_all(&a), expect, "{tracking:?}: after a discard");
        drop(a);
        drop(b);
        assert!(!path.exists(), "the last region removed {}", path.display());
    }
}

/// A store whose chunk is not what its base says cannot put it into the shared file: its
/// region reads its own content there, and a region over a true clone reads the base.
#[test]
fn a_chunk_that_is_not_the_base_stays_private() {
    if !uffd_available("a_chunk_that_is_not_the_base_stays_private") {
        return;
    }
    let dir = shm_dir();
    let shared = dir.path().join("shared");
    let (liar, liar_content) = clone_of(9, [2; 32], &[3]);
    let (honest, base) = clone_of(9, [2; 32], &[]);
    assert_ne!(liar_content, base);
    let l = Region::open(liar, opts(WriteTracking::Auto, &shared)).unwrap();
    assert_eq!(read_all(&l), liar_content, "the liar reads its own content");
    let stats = l.stats().shared.unwrap();
    assert_eq!(stats.filled_chunks, CHUNKS - 1, "chunk 3 was refused");
    let h = Region::open(honest, opts(WriteTracking::Auto, &shared)).unwrap();
    assert_eq!(read_all(&h), base, "the honest clone reads the base");
    assert_eq!(
        h.stats().shared.unwrap().filled_chunks,
        1,
        "it filled chunk 3"
    );
}

/// A shared directory that others can reach is refused (the region works, unshared), and
/// so is one that is not a directory; off by option, nothing is shared.
#[test]
fn a_directory_others_can_reach_is_not_used() {
    if !uffd_available("a_directory_others_can_reach_is_not_used") {
        return;
    }
    let dir = shm_dir();
    let open = dir.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(dir.path().join("elsewhere"), &link).unwrap();
    std::fs::create_dir(dir.path().join("elsewhere")).unwrap();
    for (what, o) in [
        ("mode 0777", opts(WriteTracking::Auto, &open)),
        ("a symbolic link", opts(WriteTracking::Auto, &link)),
        (
            "sharing off",
            RegionOptions {
                share_clean_pages: false,
                ..opts(WriteTracking::Auto, &dir.path().join("off"))
            },
        ),
    ] {
        let (store, base) = clone_of(3, [3; 32], &[]);
        let r = Region::open(store, o).unwrap();
        assert_eq!(r.shared_base(), None, "{what}");
        assert!(r.stats().shared.is_none(), "{what}");
        assert_eq!(read_all(&r), base, "{what}");
        assert_eq!(std::fs::read_dir(&open).unwrap().count(), 0, "{what}");
    }
}

/// A base file nobody holds (its process died) is removed by the next region that opens a
/// base in the directory; a file another region holds is left alone.
#[test]
fn files_left_by_dead_processes_are_swept() {
    if !uffd_available("files_left_by_dead_processes_are_swept") {
        return;
    }
    let dir = shm_dir();
    let shared = dir.path().join("shared");
    let (held, _) = clone_of(1, [4; 32], &[]);
    let keep = Region::open(held, opts(WriteTracking::Auto, &shared)).unwrap();
    let stale = shared.join(format!("{}.base", "ab".repeat(32)));
    std::fs::write(&stale, b"left behind").unwrap();
    let (store, base) = clone_of(2, [5; 32], &[]);
    let r = Region::open(store, opts(WriteTracking::Auto, &shared)).unwrap();
    assert_eq!(read_all(&r), base);
    assert!(!stale.exists(), "the stale file was removed");
    assert!(keep.shared_base().unwrap().exists(), "the held one was not");
}

/// A region that shares its base cannot hand its faults to another process (that process
/// could not map the base's file), and says so; a bounded region does not share.
#[test]
fn sharing_regions_keep_their_faults_and_bounded_ones_do_not_share() {
    if !uffd_available("sharing_regions_keep_their_faults_and_bounded_ones_do_not_share") {
        return;
    }
    let dir = shm_dir();
    let shared = dir.path().join("shared");
    let (store, base) = clone_of(4, [6; 32], &[]);
    let r = Region::open(
        store,
        RegionOptions {
            store_spec: Some("memory:2MiB".into()),
            ..opts(WriteTracking::Auto, &shared)
        },
    )
    .unwrap();
    assert!(r.shared_base().is_some());
    let (ours, _theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    let err = farmap_uffd::handover::send(&r, ours, Default::default()).unwrap_err();
    assert!(
        matches!(err, farmap_uffd::handover::HandoverError::Shared),
        "{err}"
    );
    assert_eq!(read_all(&r), base, "the region still serves its faults");
    if farmap_uffd::probe_paging().is_ok() {
        let (store, base) = clone_of(4, [6; 32], &[]);
        let bounded = Region::open(
            store,
            RegionOptions {
                paging: Some(farmap_uffd::PagingOptions::new(
                    farmap_uffd::LocalLimit::Percent(50.0),
                )),
                ..opts(WriteTracking::Auto, &shared)
            },
        )
        .unwrap();
        assert_eq!(
            bounded.shared_base(),
            None,
            "a bounded region has its own pages"
        );
        assert_eq!(read_all(&bounded), base);
    }
}
