//! Clean pages shared by the regions of one host: regions opened over the same base (forks
//! of one version, openings of one version: see [`MemoryBase`]) keep one copy of each clean
//! chunk in memory, and copy on write.
//!
//! ```text
//!   DIR/KEY.base (tmpfs):  [ region bytes: the base's chunks, filled as first read ][ bitmap ]
//!                                │ MAP_PRIVATE, registered MISSING|MINOR (+WP)
//!   region A ───────────────────┤  a chunk of the base: filled once (checked against the
//!   region B ───────────────────┘  base's hash), then mapped with UFFDIO_CONTINUE; a write
//!                                  makes a private copy of the page; anything else (written
//!                                  or changed chunks, zeros) is copied in privately
//! ```
//!
//! - **One file per base**, named by the base's key (a SHA-256 of its content), in a
//!   directory of the user's own (`/dev/shm/farmap-UID`, mode 0700, checked: owned by us,
//!   not a symbolic link, no access for others): a chunk in it was checked by a process of
//!   the same user, and nobody else can put one there.
//! - **Filled once**: a region that fetches a chunk of the base checks it against the base's
//!   hash, writes it into the file and then sets the chunk's bit (in the bitmap at the end of
//!   the same file, mapped shared: one inode, so the bits always describe the pages beside
//!   them). A set bit means the whole chunk is there; a process that died mid-write left its
//!   bit clear, and the next one writes the same bytes again. Regions that find the bit set
//!   map the chunk without fetching it.
//! - **Removed by the last user**: every user holds a shared `flock` from before the file
//!   has its name until it closes; a closer that can take the lock exclusively is the last
//!   and unlinks it, and so does an opener finding a file nobody holds (left by a crash). An
//!   opener re-checks, once it holds its lock, that the name still leads to the file it
//!   opened.
//!
//! One of the few files with `unsafe` code: the shared mapping of the bitmap.

use std::fmt;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use farmap_core::{
    BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, Geometry, MemoryBase, Store, StoreResult,
};
use rustix::fs::{flock, FlockOperation};
use rustix::mm::{self, MapFlags, ProtFlags};

use crate::stats::Counters;

/// Where shared bases go by default: `/dev/shm/farmap-UID`.
pub fn default_shared_dir() -> PathBuf {
    PathBuf::from(format!(
        "/dev/shm/farmap-{}",
        rustix::process::geteuid().as_raw()
    ))
}

/// A region's shared base: the content it started from, and the file other regions over
/// the same base map too.
pub(crate) struct SharedBase {
    base: Arc<dyn MemoryBase>,
    file: BaseFile,
    geometry: Geometry,
    counters: Arc<Counters>,
    /// A write into the file failed (full tmpfs): logged once.
    fill_failed: AtomicBool,
}

impl SharedBase {
    /// Opens (or creates) the file of `base` in `dir` (made if missing, and checked).
    pub fn open(
        dir: &Path,
        base: Arc<dyn MemoryBase>,
        geometry: Geometry,
        counters: Arc<Counters>,
    ) -> io::Result<SharedBase> {
        private_dir(dir)?;
        let name: String = base.key().iter().map(|b| format!("{b:02x}")).collect();
        let file = BaseFile::open(&dir.join(format!("{name}.base")), geometry)?;
        sweep(dir, &file.path);
        Ok(SharedBase {
            base,
            file,
            geometry,
            counters,
            fill_failed: AtomicBool::new(false),
        })
    }

    /// The file, to map privately.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.file.as_fd()
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.file.path
    }

    /// Whether chunk `idx` of the region reads as the base's now.
    pub fn is_base(&self, idx: ChunkIdx) -> bool {
        self.base.is_base(idx)
    }

    /// Whether the file holds chunk `idx` whole.
    pub fn filled(&self, idx: ChunkIdx) -> bool {
        self.file.bit(idx.0)
    }

    /// Makes sure the file holds chunk `idx`, writing `data` into it if not after checking
    /// that it is the base's content; false when it does not (then the chunk is the region's
    /// own: not the base's, or the file could not take it).
    pub fn fill(&self, idx: ChunkIdx, data: &[u8]) -> bool {
        if self.filled(idx) {
            return true;
        }
        if !self.base.check(idx, data) {
            return false;
        }
        let offset = self.geometry.offset_of(idx);
        match self.file.file.write_all_at(data, offset) {
            Ok(()) => {
                self.file.set_bit(idx.0);
                Counters::add(&self.counters.base_filled, 1);
                true
            }
            Err(e) => {
                if !self.fill_failed.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        path = %self.file.path.display(),
                        "cannot write into the shared base ({e}): chunks that do not fit are private copies"
                    );
                }
                false
            }
        }
    }

    /// Chunk `idx` out of the file, when it is the region's content now and the file holds it.
    fn read_filled(&self, idx: ChunkIdx) -> Option<Bytes> {
        if !self.is_base(idx) || !self.filled(idx) {
            return None;
        }
        let mut buf = vec![0u8; self.geometry.chunk_len(idx)];
        self.file
            .file
            .read_exact_at(&mut buf, self.geometry.offset_of(idx))
            .ok()?;
        Some(Bytes::from(buf))
    }
}

impl fmt::Debug for SharedBase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedBase")
            .field("path", &self.file.path)
            .field("base", &self.base)
            .finish()
    }
}

/// `statfs(2)`'s `f_type` of tmpfs.
const TMPFS_MAGIC: i64 = 0x0102_1994;

/// Makes `dir` (mode 0700) if missing, and refuses it unless it is a directory of ours that
/// nobody else can reach, on tmpfs.
fn private_dir(dir: &Path) -> io::Result<()> {
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let meta = std::fs::symlink_metadata(dir)?;
    let uid = rustix::process::geteuid().as_raw();
    // Minor faults (pages mapped from the page cache) work on shmem only.
    let fs = rustix::fs::statfs(dir)?;
    if fs.f_type as i64 != TMPFS_MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!(
                "{} is not on tmpfs (shared pages need shmem): not sharing",
                dir.display()
            ),
        ));
    }
    if !meta.is_dir() || meta.uid() != uid || meta.mode() & 0o077 != 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{} is not a private directory of uid {uid} (a directory, mode 0700): refusing to share memory through it",
                dir.display()
            ),
        ));
    }
    Ok(())
}

/// Unlinks the base files in `dir` (other than `ours`) that nobody holds: left by processes
/// that died.
fn sweep(dir: &Path, ours: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path == ours || path.extension().is_none_or(|e| e != "base") {
            continue;
        }
        let Ok(file) = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path)
        else {
            continue;
        };
        if flock(&file, FlockOperation::NonBlockingLockExclusive).is_ok() && same_file(&path, &file)
        {
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// Whether `path` leads to `file` (not unlinked, not replaced).
fn same_file(path: &Path, file: &File) -> bool {
    match (std::fs::symlink_metadata(path), file.metadata()) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// A base's file: the region's bytes, then one bit per chunk (set once the chunk is there
/// whole), mapped shared.
struct BaseFile {
    file: File,
    path: PathBuf,
    bits: NonNull<AtomicU64>,
    words: usize,
    map_len: usize,
}

// SAFETY: `bits` points into a shared mapping this value owns until drop, only ever reached
// through atomics.
unsafe impl Send for BaseFile {}
// SAFETY: as above.
unsafe impl Sync for BaseFile {}

impl BaseFile {
    /// Opens the base file at `path` for a region of `geometry`, creating it if missing, and
    /// holds it (a shared lock) until dropped.
    fn open(path: &Path, geometry: Geometry) -> io::Result<BaseFile> {
        let page = crate::sys::page_size() as u64;
        let words = geometry.chunk_count().div_ceil(64);
        let map_len = (words * 8).div_ceil(page) * page;
        let len = geometry.size();
        let total = len + map_len;
        let file = open_held(path, total)?;
        let meta = file.metadata()?;
        if meta.len() != total || meta.uid() != rustix::process::geteuid().as_raw() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{} is {} bytes owned by uid {}, not the {total} bytes of this base: not shared",
                    path.display(),
                    meta.len(),
                    meta.uid()
                ),
            ));
        }
        let map_len = usize::try_from(map_len).map_err(io::Error::other)?;
        // SAFETY: a new shared mapping of the bitmap at the end of our file (offset `len`, a
        // multiple of the page size: region sizes are); only atomics ever reach it.
        let p = unsafe {
            mm::mmap(
                std::ptr::null_mut(),
                map_len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &file,
                len,
            )
        }?;
        let bits = NonNull::new(p.cast::<AtomicU64>())
            .ok_or_else(|| io::Error::other("mmap gave null"))?;
        Ok(BaseFile {
            file,
            path: path.to_owned(),
            bits,
            words: words as usize,
            map_len,
        })
    }

    fn word(&self, chunk: u64) -> Option<(&AtomicU64, u64)> {
        let w = (chunk / 64) as usize;
        if w >= self.words {
            return None;
        }
        // SAFETY: `w` is within the mapping (words * 8 <= map_len), mapped until drop; every
        // access is atomic, in this process and in the others that map the file.
        let word = unsafe { &*self.bits.as_ptr().add(w) };
        Some((word, 1u64 << (chunk % 64)))
    }

    fn bit(&self, chunk: u64) -> bool {
        self.word(chunk)
            .is_some_and(|(w, bit)| w.load(Ordering::Acquire) & bit != 0)
    }

    fn set_bit(&self, chunk: u64) {
        if let Some((w, bit)) = self.word(chunk) {
            w.fetch_or(bit, Ordering::Release);
        }
    }
}

impl Drop for BaseFile {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once; no reference into it outlives `&self`.
        let _ = unsafe { mm::munmap(self.bits.as_ptr().cast(), self.map_len) };
        // The last user removes the file (see the module doc).
        if flock(&self.file, FlockOperation::NonBlockingLockExclusive).is_ok()
            && same_file(&self.path, &self.file)
        {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Opens `path` (or creates it, `total` bytes, mode 0600) and takes a shared lock on it,
/// making sure the name still leads to the file once the lock is held.
fn open_held(path: &Path, total: u64) -> io::Result<File> {
    let dir = path.parent().unwrap_or(Path::new("."));
    for _ in 0..100 {
        match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
        {
            Ok(file) => {
                flock(&file, FlockOperation::LockShared)?;
                if same_file(path, &file) {
                    return Ok(file);
                }
                // Removed by its last user meanwhile: start again.
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                // Made nameless, locked and sized first, then linked: nobody sees it before
                // it is held.
                let file = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .mode(0o600)
                    .custom_flags(libc::O_TMPFILE)
                    .open(dir)?;
                flock(&file, FlockOperation::LockShared)?;
                file.set_len(total)?;
                let proc_path = format!("/proc/self/fd/{}", file.as_raw_fd());
                match rustix::fs::linkat(
                    rustix::fs::CWD,
                    proc_path.as_str(),
                    rustix::fs::CWD,
                    path,
                    rustix::fs::AtFlags::SYMLINK_FOLLOW,
                ) {
                    Ok(()) => return Ok(file),
                    Err(rustix::io::Errno::EXIST) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::other(format!(
        "{} keeps changing under us: not shared",
        path.display()
    )))
}

/// The region's store as its cache fetches from it: chunks of the base that the shared file
/// holds are read out of the file (a copy in memory) instead of the store.
pub(crate) struct BaseFirst {
    pub store: Arc<dyn Store>,
    pub shared: Arc<SharedBase>,
}

impl fmt::Debug for BaseFirst {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BaseFirst")
            .field("store", &self.store)
            .field("shared", &self.shared)
            .finish()
    }
}

impl Store for BaseFirst {
    fn geometry(&self) -> Geometry {
        self.store.geometry()
    }
    fn caps(&self) -> Caps {
        self.store.caps()
    }
    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        match self.shared.read_filled(idx) {
            Some(data) => Box::pin(async move { Ok(data) }),
            None => self.store.read(idx),
        }
    }
    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        self.store.write(idx, data)
    }
    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        self.store.flush()
    }
    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        self.store.trim(range)
    }
    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        self.store.status(idx)
    }
    fn prefetch(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<()>> {
        if self.shared.is_base(idx) && self.shared.filled(idx) {
            return Box::pin(async { Ok(()) });
        }
        self.store.prefetch(idx)
    }
    fn chunks_per_read(&self) -> u32 {
        self.store.chunks_per_read()
    }
    fn read_chunks(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<Vec<Bytes>>> {
        Box::pin(async move {
            let from_file: Option<Vec<Bytes>> = range
                .iter()
                .map(|idx| self.shared.read_filled(idx))
                .collect();
            match from_file {
                Some(chunks) => Ok(chunks),
                None => self.store.read_chunks(range).await,
            }
        })
    }
}
