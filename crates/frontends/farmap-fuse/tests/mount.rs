//! A region mounted for real (root and /dev/fuse are needed; without them the tests say
//! "skipped" and why).

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use farmap_core::{ChunkIdx, Geometry, Store};
use farmap_fuse::{FuseMount, MountError, MountOptions};
use farmap_store::MemoryStore;
use farmap_testkit::block_on;

/// Whether this machine can mount FUSE file systems here; records a skip when not.
fn can_mount(test: &str) -> bool {
    farmap_testkit::skip::fuse_mountable(test)
}

fn store(size: u64, chunk: u64) -> Arc<MemoryStore> {
    Arc::new(MemoryStore::new(Geometry::new(size, chunk).unwrap()))
}

/// The store's bytes `offset..offset+len`.
fn store_bytes(s: &dyn Store, offset: u64, len: usize) -> Vec<u8> {
    let g = s.geometry();
    let mut out = Vec::with_capacity(len);
    for idx in g.chunks_for(offset, len as u64).iter() {
        let chunk = block_on(s.read(idx)).unwrap();
        let r = g.byte_range(idx);
        let from = offset.max(r.start) - r.start;
        let to = (offset + len as u64).min(r.end) - r.start;
        out.extend_from_slice(&chunk[from as usize..to as usize]);
    }
    out
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn file_reads_writes_and_fsync_reach_the_store() {
    if !can_mount("file_reads_writes_and_fsync_reach_the_store") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let s = store(8 << 20, 64 << 10);
    let m = FuseMount::mount(s.clone(), dir.path(), MountOptions::default()).unwrap();
    assert_eq!(m.path(), dir.path().join("region"));
    assert_eq!(std::fs::metadata(m.path()).unwrap().len(), 8 << 20);
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("region")]);

    let mut f = m.open().unwrap();
    // Unaligned, across chunk borders.
    let data = pattern(7, 200_000);
    f.write_all_at(&data, 65_000).unwrap();
    f.sync_all().unwrap();
    assert_eq!(
        store_bytes(&*s, 65_000, data.len()),
        data,
        "fsync reached the store"
    );
    let mut back = vec![0; data.len()];
    f.read_exact_at(&mut back, 65_000).unwrap();
    assert_eq!(back, data);
    // The end of the file: a short read, and writes cannot grow it.
    f.seek(SeekFrom::Start((8 << 20) - 10)).unwrap();
    let mut tail = Vec::new();
    f.read_to_end(&mut tail).unwrap();
    assert_eq!(tail.len(), 10);
    let e = f.write_all_at(b"x", 8 << 20).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EFBIG), "{e}");
    // Truncation to another size is refused; to the same size is fine.
    assert!(f.set_len(4096).is_err());
    f.set_len(8 << 20).unwrap();
    assert_eq!(std::fs::metadata(m.path()).unwrap().len(), 8 << 20);
    drop(f);
    m.unmount().unwrap();
    assert!(
        !std::fs::read_dir(dir.path()).unwrap().any(|_| true),
        "the mount point is empty again"
    );
}

#[test]
fn a_mapped_slice_writes_back_at_sync_and_unmount() {
    if !can_mount("a_mapped_slice_writes_back_at_sync_and_unmount") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let s = store(4 << 20, 64 << 10);
    // Data already in the store is what the mapping shows.
    block_on(s.write(ChunkIdx(3), pattern(1, 64 << 10).into())).unwrap();
    let m = FuseMount::mount(s.clone(), dir.path(), MountOptions::default()).unwrap();
    {
        let map = m.map().unwrap();
        let mem = map.memory();
        assert_eq!(mem.len(), 4 << 20);
        let mut chunk = vec![0; 64 << 10];
        mem.read_into(3 * (64 << 10), &mut chunk).unwrap();
        assert_eq!(chunk, pattern(1, 64 << 10));
        mem.write_from(100, b"synced").unwrap();
        map.sync().unwrap();
        assert_eq!(store_bytes(&*s, 100, 6), b"synced");
        // Left dirty in the page cache: unmount writes it back.
        mem.write_from(1 << 20, b"at unmount").unwrap();
    }
    m.unmount().unwrap();
    assert_eq!(store_bytes(&*s, 1 << 20, 10), b"at unmount");
}

#[test]
fn concurrent_readers_see_the_store() {
    if !can_mount("concurrent_readers_see_the_store") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let s = store(16 << 20, 64 << 10);
    let content = pattern(9, 16 << 20);
    for idx in s.geometry().all().iter() {
        let r = s.geometry().byte_range(idx);
        block_on(s.write(
            idx,
            content[r.start as usize..r.end as usize].to_vec().into(),
        ))
        .unwrap();
    }
    let m = FuseMount::mount(s.clone(), dir.path(), MountOptions::default()).unwrap();
    std::thread::scope(|scope| {
        for t in 0..4u64 {
            let (m, content) = (&m, &content);
            scope.spawn(move || {
                let f = m.open().unwrap();
                let mut buf = vec![0; 300_000];
                let mut off = t * 1_000_003 % (16 << 20);
                for _ in 0..40 {
                    let n = buf.len().min((16 << 20) - off as usize);
                    f.read_exact_at(&mut buf[..n], off).unwrap();
                    assert_eq!(&buf[..n], &content[off as usize..off as usize + n]);
                    off = (off + 2_345_679) % (16 << 20);
                }
            });
        }
    });
    m.unmount().unwrap();
}

#[test]
fn read_only_mounts_refuse_writes_and_busy_mount_points_are_refused() {
    if !can_mount("read_only_mounts_refuse_writes_and_busy_mount_points_are_refused") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let s = store(1 << 20, 64 << 10);
    let opts = MountOptions {
        read_only: true,
        name: "disk.img".into(),
        ..MountOptions::default()
    };
    let m = FuseMount::mount(s.clone(), dir.path(), opts).unwrap();
    assert!(m.path().ends_with("disk.img"));
    let e = std::fs::OpenOptions::new()
        .write(true)
        .open(m.path())
        .unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{e}");
    let mut f = std::fs::File::open(m.path()).unwrap();
    let mut buf = vec![1; 4096];
    f.read_exact(&mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
    // Mounting again on the same directory is refused with a clear error.
    let again = FuseMount::mount(s.clone(), dir.path(), MountOptions::default()).unwrap_err();
    assert!(matches!(again, MountError::Busy { .. }), "{again}");
    let text = again.to_string();
    assert!(text.contains("farmap mount served by process"), "{text}");
    assert!(matches!(
        FuseMount::mount(s.clone(), dir.path().join("nope"), MountOptions::default()),
        Err(MountError::BadMountPoint { .. })
    ));
    let bad = MountOptions {
        name: "a/b".into(),
        ..MountOptions::default()
    };
    assert!(matches!(
        FuseMount::mount(s.clone(), dir.path(), bad),
        Err(MountError::BadName { .. })
    ));
    drop(f);
    m.unmount().unwrap();
}

#[test]
fn unmount_of_a_file_still_in_use_detaches_and_loses_nothing() {
    if !can_mount("unmount_of_a_file_still_in_use_detaches_and_loses_nothing") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let s = store(1 << 20, 64 << 10);
    let m = FuseMount::mount(s.clone(), dir.path(), MountOptions::default()).unwrap();
    let mut f = m.open().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let unmounter = std::thread::spawn(move || {
        let r = m.unmount();
        tx.send(()).unwrap();
        r
    });
    // The unmount waits for the file's user; writes meanwhile still reach the store.
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(
        rx.try_recv().is_err(),
        "unmount returned while the file was open"
    );
    f.write_all(b"late write").unwrap();
    drop(f);
    unmounter.join().unwrap().unwrap();
    assert_eq!(store_bytes(&*s, 0, 10), b"late write");
}

#[test]
fn pooled_write_buffers_over_a_copying_store_all_come_back() {
    if !can_mount("pooled_write_buffers_over_a_copying_store_all_come_back") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let g = Geometry::new(8 << 20, 64 << 10).unwrap();
    let s = Arc::new(farmap_store::DenseMemoryStore::new(g));
    let opts = MountOptions {
        write_buffers: 4,
        ..MountOptions::default()
    };
    let m = FuseMount::mount(s.clone(), dir.path(), opts).unwrap();
    let pool = m.write_pool().expect("a pool was asked for").clone();
    assert_eq!((pool.count(), pool.free()), (4, 4));
    // Writes from 4 threads at once, many more than the pool has buffers, each fsynced.
    std::thread::scope(|scope| {
        for t in 0..4u8 {
            let f = m.open().unwrap();
            scope.spawn(move || {
                for i in 0..16u64 {
                    let data = pattern(t * 16 + i as u8, 128 << 10);
                    f.write_all_at(&data, (u64::from(t) * 16 + i) * (128 << 10))
                        .unwrap();
                }
                f.sync_all().unwrap();
            });
        }
    });
    for k in 0..64u64 {
        assert_eq!(
            store_bytes(&*s, k * (128 << 10), 128 << 10),
            pattern(k as u8, 128 << 10),
            "block {k}"
        );
    }
    // The dense store copied every payload: every buffer is back, none was lent for good.
    assert_eq!(pool.free(), 4, "{pool:?}");
    m.unmount().unwrap();
}

/// Runs `sh -c script` as user `nobody`: whether it succeeded.
fn as_nobody(script: &str) -> bool {
    std::process::Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "sh",
            "-c",
            script,
        ])
        .stderr(std::process::Stdio::null())
        .status()
        .expect("setpriv runs")
        .success()
}

#[test]
fn allow_other_enforces_the_files_mode_and_chmod_changes_it() {
    let test = "allow_other_enforces_the_files_mode_and_chmod_changes_it";
    if !can_mount(test) {
        return;
    }
    if !farmap_testkit::skip::is_root() {
        farmap_testkit::skip::skip(test, "needs root to act as another user");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // The mount point's parent must let `nobody` through.
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let s = store(1 << 20, 64 << 10);
    let opts = MountOptions {
        allow_other: true,
        ..MountOptions::default()
    };
    let m = FuseMount::mount(s.clone(), dir.path(), opts).unwrap();
    let path = m.path().display().to_string();
    // 0644, owned by root: another user reads, but cannot write.
    assert!(as_nobody(&format!("head -c 10 {path} > /dev/null")));
    assert!(
        !as_nobody(&format!("printf x | dd of={path} conv=notrunc 2>/dev/null")),
        "another user wrote a 0644 file of root's"
    );
    assert_eq!(store_bytes(&*s, 0, 1), [0], "nothing reached the store");
    // chmod is what it says: 0600 shuts the other user out, 0666 lets it write.
    std::fs::set_permissions(
        m.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(m.path()).unwrap().permissions(),
    );
    assert_eq!(mode & 0o777, 0o600);
    assert!(!as_nobody(&format!("head -c 10 {path} > /dev/null")));
    std::fs::set_permissions(
        m.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o666),
    )
    .unwrap();
    assert!(as_nobody(&format!(
        "printf x | dd of={path} conv=notrunc 2>/dev/null"
    )));
    drop(m);
}

/// Kernel facts that guest RAM on a mount rests on (docs/design/vm.md §3, issue 32): a
/// writer through a `MAP_SHARED` mapping dirties the page cache one 4 KiB page at a time (this
/// kernel gives FUSE files no large folios, so one byte written costs one page of write-back,
/// not a folio of up to 1 MiB), and the mount's bdi takes the knobs that lift FUSE's
/// strict 1 % share of the dirty limit.
#[test]
fn mapped_writes_dirty_single_pages_and_the_bdi_takes_the_dirty_knobs() {
    use std::os::unix::fs::MetadataExt;
    if !can_mount("mapped_writes_dirty_single_pages_and_the_bdi_takes_the_dirty_knobs") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let s = store(64 << 20, 64 << 10);
    let m = FuseMount::mount(s.clone(), dir.path(), MountOptions::default()).unwrap();
    let map = m.map().unwrap();
    let mem = map.memory();
    // Read the whole file first, so that read-ahead has built whatever folios it builds.
    let mut buf = vec![0; 1 << 20];
    for mib in 0..64usize {
        mem.read_into(mib << 20, &mut buf).unwrap();
    }
    let _ = m.control().take_dirty();
    for mib in 0..64usize {
        mem.write_from((mib << 20) + 4096 * 7 + 17, &[mib as u8 + 1])
            .unwrap();
    }
    map.sync().unwrap();
    let runs = m.control().take_dirty();
    let pages: u64 = runs.iter().map(|r| r.end - r.start).sum();
    assert_eq!(
        (runs.len(), pages),
        (64, 64),
        "64 one-byte writes 1 MiB apart came back as these dirty page runs: {runs:?}"
    );
    assert!(runs
        .iter()
        .enumerate()
        .all(|(i, r)| r.start == i as u64 * 256 + 7));
    assert_eq!(store_bytes(&*s, (63 << 20) + 4096 * 7 + 17, 1), [64]);
    drop(map);

    let meta = std::fs::metadata(m.path()).unwrap();
    let bdi = format!(
        "/sys/class/bdi/{}:{}",
        rustix::fs::major(meta.dev()),
        rustix::fs::minor(meta.dev())
    );
    let read = |knob: &str| std::fs::read_to_string(format!("{bdi}/{knob}")).unwrap();
    assert_eq!(read("strict_limit").trim(), "1", "FUSE mounts start strict");
    assert_eq!(read("max_ratio").trim(), "1", "FUSE mounts start at 1 %");
    std::fs::write(format!("{bdi}/strict_limit"), "0").unwrap();
    std::fs::write(format!("{bdi}/max_ratio"), "100").unwrap();
    assert_eq!(read("strict_limit").trim(), "0");
    assert_eq!(read("max_ratio").trim(), "100");
    m.unmount().unwrap();
}

/// A store that names a working set and counts the reads of each chunk.
#[derive(Debug)]
struct WithWorkingSet {
    inner: MemoryStore,
    set: Arc<[ChunkIdx]>,
    reads: Vec<std::sync::atomic::AtomicU32>,
}

impl WithWorkingSet {
    fn reads(&self, idx: u64) -> u32 {
        self.reads[idx as usize].load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Store for WithWorkingSet {
    fn geometry(&self) -> Geometry {
        self.inner.geometry()
    }
    fn caps(&self) -> farmap_core::Caps {
        self.inner.caps()
    }
    fn read(
        &self,
        idx: ChunkIdx,
    ) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<bytes::Bytes>> {
        if let Some(n) = self.reads.get(idx.0 as usize) {
            n.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        self.inner.read(idx)
    }
    fn write(
        &self,
        idx: ChunkIdx,
        data: bytes::Bytes,
    ) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<()>> {
        self.inner.write(idx, data)
    }
    fn flush(&self) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<()>> {
        self.inner.flush()
    }
    fn trim(
        &self,
        range: farmap_core::ChunkRange,
    ) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<()>> {
        self.inner.trim(range)
    }
    fn status(
        &self,
        idx: ChunkIdx,
    ) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<farmap_core::ChunkStatus>> {
        self.inner.status(idx)
    }
    fn working_set(&self) -> Option<Arc<[ChunkIdx]>> {
        Some(self.set.clone())
    }
}

#[test]
fn the_working_set_is_read_into_the_page_cache_at_the_first_read_without_undoing_writes() {
    if !can_mount(
        "the_working_set_is_read_into_the_page_cache_at_the_first_read_without_undoing_writes",
    ) {
        return;
    }
    const CHUNK: u64 = 64 << 10;
    let set: Vec<u64> = vec![9, 10, 11, 3, 40];
    for warm in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let s = Arc::new(WithWorkingSet {
            inner: MemoryStore::new(Geometry::new(128 * CHUNK, CHUNK).unwrap()),
            set: set.iter().map(|&c| ChunkIdx(c)).collect(),
            reads: (0..128).map(|_| Default::default()).collect(),
        });
        for &c in &set {
            block_on(
                s.inner
                    .write(ChunkIdx(c), pattern(c as u8, CHUNK as usize).into()),
            )
            .unwrap();
        }
        let opts = MountOptions {
            warm_page_cache: warm,
            ..MountOptions::default()
        };
        let m = FuseMount::mount(s.clone(), dir.path(), opts).unwrap();
        let f = m.open().unwrap();
        assert!(
            set.iter().all(|&c| s.reads(c) == 0),
            "nothing is read before the file is"
        );
        // Written before the warming: it must not be undone by it.
        f.write_all_at(b"mine", 10 * CHUNK + 100).unwrap();
        // The first read starts it.
        let mut one = [0u8; 1];
        f.read_exact_at(&mut one, 0).unwrap();
        if !warm {
            assert!(m.warm_stats().is_none());
            std::thread::sleep(std::time::Duration::from_millis(300));
            assert_eq!(s.reads(40), 0, "no warming when it is off");
            continue;
        }
        let stats = m.warm_stats().expect("a working set to warm").clone();
        let t0 = std::time::Instant::now();
        while stats.done_us.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            assert!(t0.elapsed().as_secs() < 20, "the warming did not finish");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(
            stats.bytes.load(std::sync::atomic::Ordering::SeqCst),
            set.len() as u64 * CHUNK
        );
        for &c in &[9, 11, 3, 40] {
            assert!(s.reads(c) >= 1, "chunk {c} was read ahead");
        }
        // Now cached: reading them through the file does not reach the store.
        let before: Vec<u32> = set.iter().map(|&c| s.reads(c)).collect();
        for &c in &set {
            let mut back = vec![0u8; CHUNK as usize];
            f.read_exact_at(&mut back, c * CHUNK).unwrap();
            let mut want = pattern(c as u8, CHUNK as usize);
            if c == 10 {
                want[100..104].copy_from_slice(b"mine");
            }
            assert!(back == want, "chunk {c} reads what was stored and written");
        }
        let after: Vec<u32> = set.iter().map(|&c| s.reads(c)).collect();
        assert_eq!(before, after, "the warmed chunks came from the page cache");
        drop(f);
        m.unmount().unwrap();
        let mut back = vec![0u8; 4];
        back.copy_from_slice(&block_on(s.inner.read(ChunkIdx(10))).unwrap()[100..104]);
        assert_eq!(&back, b"mine", "the write reached the store");
    }
}

#[test]
fn a_mount_whose_file_is_never_read_unmounts_at_once() {
    if !can_mount("a_mount_whose_file_is_never_read_unmounts_at_once") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let s = Arc::new(WithWorkingSet {
        inner: MemoryStore::new(Geometry::new(1 << 20, 64 << 10).unwrap()),
        set: vec![ChunkIdx(1)].into(),
        reads: (0..16).map(|_| Default::default()).collect(),
    });
    let opts = MountOptions {
        warm_page_cache: true,
        ..MountOptions::default()
    };
    let m = FuseMount::mount(s.clone(), dir.path(), opts).unwrap();
    let t0 = std::time::Instant::now();
    m.unmount().unwrap();
    assert!(t0.elapsed().as_secs() < 5);
    assert_eq!(s.reads(1), 0, "never warmed: nobody read the file");
}
