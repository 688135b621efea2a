//! A store in one file (sparse when created), with positional I/O and no global lock.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use farmap_core::{
    format_size, zero_chunk, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, StoreError,
    StoreResult, DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE,
};
use rustix::fs::{FallocateFlags, SeekFrom};
use rustix::io::Errno;

use crate::blocking::{store_on_blocking, BlockingChunks, OnBlocking};
use crate::stripes::{Stripes, STRIPES};

/// How [`FileStore::open`] opens its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileOptions {
    /// Region size. `None`: the file must exist and be non-empty, and its length is the size.
    /// `Some(size)`: a missing (or empty) file is created sparse with this length; an existing
    /// file of another length is refused.
    pub size: Option<u64>,
    /// Chunk size in bytes (a power of two from 4 KiB to 4 MiB).
    pub chunk_size: u32,
    /// Open for reading only: writes and trims fail with [`ErrorKind::ReadOnly`], and the file
    /// is never created or resized.
    pub read_only: bool,
}

impl Default for FileOptions {
    fn default() -> Self {
        Self {
            size: None,
            chunk_size: DEFAULT_CHUNK_SIZE,
            read_only: false,
        }
    }
}

/// A region stored in one regular file: chunk `i` at byte offset `i * chunk_size`.
///
/// - `flush` is `fdatasync`: written chunks survive a crash once it returns.
/// - Creating the file (`size` given, no file there) sizes it, syncs it and syncs its parent
///   directory before `open` returns; a creation that fails removes the file it made.
///
/// # Crash safety
/// Chunks are overwritten in place (no copy, no journal), so:
/// - **Process crash** (the machine stays up): every write or trim that returned survives,
///   flushed or not. A write the crash interrupted may be partly applied: its chunk can read
///   part old, part new, split at page boundaries (the kernel stops a killed process's write
///   between pages).
/// - **Machine crash**: everything written or trimmed before a `flush` that returned survives.
///   Later writes may be lost, kept, or partly kept (page by page, as above).
///
/// Use a [`DirStore`](crate::DirStore) where a chunk must always read as one whole write.
/// - `trim` punches holes (`fallocate(PUNCH_HOLE | KEEP_SIZE)`), releasing the blocks; on a
///   file system that cannot punch holes it writes zeros instead.
/// - `status` asks the file system with `lseek(SEEK_DATA)`: a hole is
///   [`Zero`](ChunkStatus::Zero), anything else [`Data`](ChunkStatus::Data). On a file system
///   without hole support every chunk reports `Data`.
/// - The last chunk is shorter when the size is not a multiple of the chunk size.
///
/// # Concurrency
/// - One shared `File`, used only with positional I/O (`pread`/`pwrite`), and no lock over the
///   whole file: operations on different chunks run in parallel on Tokio's blocking pool.
/// - Chunks are guarded by 1024 striped `RwLock<()>` (chunk `i` uses stripe `i % 1024`): reads
///   share a stripe, a write or trim holds it alone, so a read never sees half a write.
/// - One writer per file: a writable opening takes an exclusive `flock` on the file
///   (another writable opening, in this process or another, is refused with
///   [`Unavailable`](ErrorKind::Unavailable)); read-only openings take no lock. Programs that
///   ignore `flock` and write the file get no guarantee.
pub struct FileStore {
    blocking: OnBlocking<Inner>,
}

struct Inner {
    path: PathBuf,
    file: File,
    geometry: Geometry,
    read_only: bool,
    stripes: Stripes,
    /// An errno the next sync reports after syncing (a fault hook for tests; 0: none).
    sync_fault: AtomicI32,
}

impl FileStore {
    /// Opens (or, with a size and not read-only, creates) the file at `path`.
    ///
    /// Errors name the path: a missing file without a size is
    /// [`NotFound`](ErrorKind::NotFound) and says that `?size=` creates it; a size that
    /// disagrees with the file's length, an empty file without a size, or a bad chunk size is
    /// [`InvalidInput`](ErrorKind::InvalidInput); failures to open keep the I/O error's kind
    /// (`PermissionDenied`, ...).
    pub fn open(path: &Path, opts: FileOptions) -> StoreResult<Self> {
        let shown = path.display();
        let geometry_of = |size: u64| {
            Geometry::new(size, u64::from(opts.chunk_size)).map_err(|e| {
                StoreError::invalid(format!(
                    "{shown} cannot hold a region of {size} bytes in chunks of {} bytes",
                    opts.chunk_size
                ))
                .with_source(e)
            })
        };
        // Check the geometry before creating anything.
        let wanted = opts.size.map(geometry_of).transpose()?;
        let create = !opts.read_only && opts.size.is_some();
        // `created`: this call made the file, so a failure below removes it again.
        let (file, created) = open_file(path, &opts, create)?;
        // One writer at a time: two could tear a chunk (each write lands page by page).
        let opened = lock_writer(path, &file, &opts)
            .and_then(|()| finish_open(path, &file, &opts, wanted, created));
        let geometry = match opened {
            Ok(g) => g,
            Err(e) => {
                if created {
                    // Best effort: the error says what went wrong; a leftover only adds noise.
                    let _ = std::fs::remove_file(path);
                }
                return Err(e);
            }
        };
        Ok(Self {
            blocking: OnBlocking::new(Arc::new(Inner {
                path: path.to_owned(),
                file,
                geometry,
                read_only: opts.read_only,
                stripes: Stripes::new(),
                sync_fault: AtomicI32::new(0),
            })),
        })
    }

    /// The path the store was opened with.
    pub fn path(&self) -> &Path {
        &self.blocking.0.path
    }

    /// A fault hook for tests: the next sync syncs, then fails with `errno` (as `fdatasync`
    /// does after a write-back error, having marked the pages it dropped clean).
    #[doc(hidden)]
    pub fn fail_next_sync(&self, errno: i32) {
        self.blocking.0.sync_fault.store(errno, Ordering::SeqCst);
    }
}

/// A writable opening takes an exclusive `flock` on the file (released when it is closed);
/// a read-only one takes none.
fn lock_writer(path: &Path, file: &File, opts: &FileOptions) -> StoreResult<()> {
    if opts.read_only {
        return Ok(());
    }
    match rustix::fs::flock(file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(()),
        Err(Errno::WOULDBLOCK) => Err(StoreError::new(
            ErrorKind::Unavailable,
            format!(
                "{} is in use: another writer (another process, or another opening in this one) \
                 holds its lock; open it read-only (?ro) to read it meanwhile",
                path.display()
            ),
        )),
        Err(e) => Err(StoreError::io(
            format!("cannot lock {}", path.display()),
            e.into(),
        )),
    }
}

/// Opens `path` (creating it when `create`); the flag says whether this call created it.
fn open_file(path: &Path, opts: &FileOptions, create: bool) -> StoreResult<(File, bool)> {
    let shown = path.display();
    let open = |create_new: bool| {
        OpenOptions::new()
            .read(true)
            .write(!opts.read_only)
            .create_new(create_new)
            .open(path)
    };
    let opened = if create {
        match open(true) {
            Ok(f) => Ok((f, true)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => open(false).map(|f| (f, false)),
            Err(e) => Err(e),
        }
    } else {
        open(false).map(|f| (f, false))
    };
    opened.map_err(|e| match (e.kind(), opts.size) {
        (io::ErrorKind::NotFound, None) => StoreError::new(
            ErrorKind::NotFound,
            format!("{shown} does not exist; add ?size= (e.g. ?size=1GiB) to create it"),
        ),
        (io::ErrorKind::NotFound, Some(_)) if opts.read_only => StoreError::new(
            ErrorKind::NotFound,
            format!("{shown} does not exist (a read-only store does not create it)"),
        ),
        _ if create => StoreError::io(format!("cannot open or create {shown}"), e),
        _ => StoreError::io(format!("cannot open {shown}"), e),
    })
}

/// Checks (and, when new or empty, sizes) the opened file; returns the region's geometry.
/// A file this call `created` is synced with its parent directory, so that it survives a
/// machine crash once the store is open.
fn finish_open(
    path: &Path,
    file: &File,
    opts: &FileOptions,
    wanted: Option<Geometry>,
    created: bool,
) -> StoreResult<Geometry> {
    let shown = path.display();
    let meta = file
        .metadata()
        .map_err(|e| StoreError::io(format!("cannot stat {shown}"), e))?;
    if !meta.is_file() {
        return Err(StoreError::invalid(format!(
            "{shown} is not a regular file"
        )));
    }
    let len = meta.len();
    let geometry = match (wanted, opts.size) {
        (Some(g), Some(size)) if len == size => g,
        (Some(g), Some(size)) if len == 0 && !opts.read_only => {
            // Freshly created (or empty): extend without allocating any block.
            file.set_len(size).map_err(|e| {
                let to = format_size(size);
                if e.raw_os_error() == Some(Errno::FBIG.raw_os_error()) {
                    StoreError::new(
                        ErrorKind::InvalidInput,
                        format!(
                            "cannot extend {shown} to {to}: the file system does not allow a \
                             file that large (file too large); use a smaller size or a dir: store"
                        ),
                    )
                    .with_source(e)
                } else {
                    StoreError::io(format!("cannot extend {shown} to {to}"), e)
                }
            })?;
            file.sync_all()
                .map_err(|e| StoreError::io(format!("cannot sync {shown}"), e))?;
            g
        }
        (_, Some(size)) => {
            return Err(StoreError::invalid(format!(
                "{shown} is {len} bytes but size={} was asked for",
                format_size(size)
            )))
        }
        (_, None) if len == 0 => {
            return Err(StoreError::invalid(format!(
                "{shown} is empty; add ?size= (e.g. ?size=1GiB) to give the region a size"
            )))
        }
        (_, None) => {
            let chunk = u64::from(opts.chunk_size);
            Geometry::new(len, chunk).map_err(|e| {
                StoreError::invalid(format!(
                    "{shown} cannot hold a region of {len} bytes in chunks of {chunk} bytes"
                ))
                .with_source(e)
            })?
        }
    };
    if created {
        let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
        let parent = parent.unwrap_or(Path::new("."));
        File::open(parent).and_then(|d| d.sync_all()).map_err(|e| {
            StoreError::io(format!("cannot sync directory {}", parent.display()), e)
        })?;
    }
    Ok(geometry)
}

impl Inner {
    fn io_error(&self, what: impl fmt::Display, err: io::Error) -> StoreError {
        StoreError::io(format!("{what} of {}", self.path.display()), err)
    }

    /// Releases the blocks of `len` bytes at `offset`, or writes zeros there when the file
    /// system cannot punch holes.
    fn punch(&self, offset: u64, len: u64) -> io::Result<()> {
        let flags = FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE;
        match rustix::fs::fallocate(&self.file, flags, offset, len) {
            Ok(()) => Ok(()),
            Err(Errno::OPNOTSUPP | Errno::NOSYS) => {
                let mut at = offset;
                while at < offset + len {
                    let n = (offset + len - at).min(u64::from(MAX_CHUNK_SIZE));
                    self.file.write_all_at(&zero_chunk(n as usize), at)?;
                    at += n;
                }
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }
}

impl fmt::Debug for FileStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.blocking.debug_struct(f, "FileStore").finish()
    }
}

store_on_blocking!(FileStore);

impl BlockingChunks for Inner {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn location(&self) -> &Path {
        &self.path
    }

    fn flush_all(&self) -> StoreResult<()> {
        let synced =
            self.file
                .sync_data()
                .and_then(|()| match self.sync_fault.swap(0, Ordering::SeqCst) {
                    0 => Ok(()),
                    errno => Err(std::io::Error::from_raw_os_error(errno)),
                });
        synced.map_err(|e| self.io_error("flushing", e))
    }

    fn read_chunk(&self, idx: ChunkIdx) -> StoreResult<Bytes> {
        let mut buf = vec![0u8; self.geometry.chunk_len(idx)];
        let _shared = self.stripes.read(idx.0);
        self.file
            .read_exact_at(&mut buf, self.geometry.offset_of(idx))
            .map_err(|e| self.io_error(format_args!("reading {idx}"), e))?;
        Ok(Bytes::from(buf))
    }

    fn read_part_chunk(&self, idx: ChunkIdx, range: std::ops::Range<usize>) -> StoreResult<Bytes> {
        let mut buf = vec![0u8; range.len()];
        let _shared = self.stripes.read(idx.0);
        self.file
            .read_exact_at(&mut buf, self.geometry.offset_of(idx) + range.start as u64)
            .map_err(|e| self.io_error(format_args!("reading part of {idx}"), e))?;
        Ok(Bytes::from(buf))
    }

    fn prefetch_chunk(&self, idx: ChunkIdx) -> StoreResult<()> {
        let at = self.geometry.offset_of(idx);
        let len = std::num::NonZeroU64::new(self.geometry.chunk_len(idx) as u64);
        // Only a hint: the kernel reads it ahead into the page cache, or does not.
        let _ = rustix::fs::fadvise(&self.file, at, len, rustix::fs::Advice::WillNeed);
        Ok(())
    }

    fn write_chunk(&self, idx: ChunkIdx, data: &[u8]) -> StoreResult<()> {
        let _exclusive = self.stripes.write(idx.0);
        self.file
            .write_all_at(data, self.geometry.offset_of(idx))
            .map_err(|e| self.io_error(format_args!("writing {idx}"), e))
    }

    fn trim_range(&self, range: ChunkRange) -> StoreResult<()> {
        // Batches of at most STRIPES chunks: each batch is one fallocate call under the write
        // locks of all its stripes (distinct, since the chunks are consecutive).
        let mut start = range.start.0;
        while start < range.end.0 {
            let end = (start + STRIPES as u64).min(range.end.0);
            let _exclusive = self.stripes.write_batch(start, end);
            let from = self.geometry.offset_of(ChunkIdx(start));
            let to = self.geometry.byte_range(ChunkIdx(end - 1)).end;
            self.punch(from, to - from)
                .map_err(|e| self.io_error(format_args!("trimming chunks {start}..{end}"), e))?;
            start = end;
        }
        Ok(())
    }

    fn chunk_status(&self, idx: ChunkIdx) -> StoreResult<ChunkStatus> {
        let range = self.geometry.byte_range(idx);
        match rustix::fs::seek(&self.file, SeekFrom::Data(range.start)) {
            Ok(next_data) if next_data < range.end => Ok(ChunkStatus::Data),
            Ok(_) => Ok(ChunkStatus::Zero),
            // No data at or after the offset: a hole up to the end of the file.
            Err(Errno::NXIO) => Ok(ChunkStatus::Zero),
            Err(e) => Err(self.io_error(format_args!("finding data in {idx}"), e.into())),
        }
    }
}
