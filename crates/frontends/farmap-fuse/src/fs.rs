//! [`RegionFs`]: the FUSE file system — a root directory holding one file, the region.
//!
//! fuser's session thread calls these methods one request at a time; every method that
//! touches the store hands its reply to a task on the mount's runtime and returns at once, so
//! requests are served concurrently and the session thread goes straight back to reading.

use std::ffi::{OsStr, OsString};
use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use farmap_core::{Geometry, Store, StoreError, StoreResult};
use farmap_pipeline::Unaligned;
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    KernelConfig, LockOwner, OpenAccMode, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory,
    ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow, WriteFlags,
};
use tokio::runtime::Handle;

use crate::control::MountControl;
use crate::pool::WritePool;
use crate::warm::Trigger;

/// The region file's inode.
pub(crate) const FILE_INO: INodeNo = INodeNo(2);

/// How long the kernel may cache names and attributes: they never change.
const TTL: Duration = Duration::from_secs(3600);

/// `fallocate` mode bits (linux/falloc.h).
const FALLOC_FL_KEEP_SIZE: i32 = 0x01;
const FALLOC_FL_PUNCH_HOLE: i32 = 0x02;

/// What the file system's requests share with their tasks.
#[derive(Debug)]
pub(crate) struct Shared {
    pub store: Unaligned<Arc<dyn Store>>,
    pub geometry: Geometry,
    pub name: OsString,
    pub read_only: bool,
    /// The file's owner, group and permission bits: what `chown` and `chmod` set, and what
    /// the kernel enforces (the mount has `default_permissions`).
    pub uid: AtomicU32,
    pub gid: AtomicU32,
    pub mode: AtomicU32,
    pub created: SystemTime,
    /// Largest request asked of the kernel (bytes).
    pub max_request: u32,
    /// Written pages and the gate (live migration).
    pub control: Arc<MountControl>,
    /// Where write payloads are copied, if the mount has pre-allocated buffers.
    pub pool: Option<WritePool>,
    /// Starts warming the page cache at the first read (see [`crate::warm`]).
    pub warm: Option<Arc<Trigger>>,
}

impl Shared {
    fn attr(&self, ino: INodeNo) -> FileAttr {
        let file = ino == FILE_INO;
        let size = if file { self.geometry.size() } else { 0 };
        let perm = if file {
            self.mode.load(Ordering::Relaxed) as u16
        } else {
            0o755
        };
        FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: self.created,
            mtime: self.created,
            ctime: self.created,
            crtime: self.created,
            kind: if file {
                FileType::RegularFile
            } else {
                FileType::Directory
            },
            perm,
            nlink: if file { 1 } else { 2 },
            uid: self.uid.load(Ordering::Relaxed),
            gid: self.gid.load(Ordering::Relaxed),
            rdev: 0,
            blksize: self.geometry.chunk_size().min(self.max_request),
            flags: 0,
        }
    }

    /// Runs `change`, which changes bytes `offset..offset + len` of the store, under a write
    /// pass, and marks those bytes written once it has succeeded, before the pass is
    /// dropped: a take that sees the mark sees the data. A closed gate is its errno; the
    /// store's answer is returned as it is.
    async fn change(
        &self,
        offset: u64,
        len: u64,
        change: impl Future<Output = StoreResult<()>>,
    ) -> Result<StoreResult<()>, Errno> {
        let pass = self.control.writable().await?;
        let result = change.await;
        if result.is_ok() {
            self.control.mark(offset, len);
        }
        drop(pass);
        Ok(result)
    }
}

/// The errno a store error is reported with.
fn errno(e: &StoreError) -> Errno {
    Errno::from_i32(e.errno())
}

/// Called once the kernel has answered INIT, with the largest write and read-ahead.
pub(crate) type OnInit = Box<dyn FnOnce(u32, u32) + Send + Sync>;

/// Reads up to this long are started in the session thread ([`RegionFs::run_here_or_spawn`]).
const INLINE_READ: usize = 64 << 10;

/// The single-file file system.
pub(crate) struct RegionFs {
    pub shared: Arc<Shared>,
    pub handle: Handle,
    /// Called once the kernel has answered INIT, with the limits it accepted.
    pub on_init: Option<OnInit>,
}

impl std::fmt::Debug for RegionFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionFs")
            .field("shared", &self.shared)
            .finish()
    }
}

impl RegionFs {
    /// Runs `fut` on the mount's runtime.
    fn spawn(&self, fut: impl std::future::Future<Output = ()> + Send + 'static) {
        self.handle.spawn(fut);
    }

    /// Runs `fut` here, in the session thread (inside the mount's runtime), until it would
    /// wait; only then on the runtime. A small read the store answers without waiting (a
    /// memory store, a cached chunk) is then answered with no hand-off to another thread:
    /// the faulting thread waits for one wake-up instead of two.
    fn run_here_or_spawn(&self, fut: impl std::future::Future<Output = ()> + Send + 'static) {
        let _runtime = self.handle.enter();
        let mut fut = Box::pin(fut);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        if fut.as_mut().poll(&mut cx).is_pending() {
            // Polled again there at once, with a waker that counts.
            self.handle.spawn(fut);
        }
    }

    /// Flushes the store and replies.
    fn flush_store(&self, reply: ReplyEmpty) {
        // A mount whose file moved away refuses writes (a page written back now fails
        // before this request): it has nothing to flush, and its store may belong to the
        // destination now.
        if self.shared.control.access() == crate::Access::Retired {
            return reply.ok();
        }
        let shared = self.shared.clone();
        self.spawn(async move {
            match shared.store.flush().await {
                Ok(()) => reply.ok(),
                Err(e) => {
                    tracing::warn!(error = %e.to_owned_lossy(), "flush of the store failed");
                    reply.error(errno(&e))
                }
            }
        });
    }
}

impl Filesystem for RegionFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> io::Result<()> {
        let want = self.shared.max_request;
        let write = match config.set_max_write(want) {
            Ok(_) => want,
            Err(cap) => {
                let _ = config.set_max_write(cap);
                cap
            }
        };
        let readahead = match config.set_max_readahead(want) {
            Ok(_) => want,
            Err(cap) => {
                let _ = config.set_max_readahead(cap);
                cap
            }
        };
        // Read-ahead and writeback requests are "background" ones; the default of 12 in
        // flight starves a store with many parallel workers.
        let _ = config.set_max_background(64);
        let _ = config.set_congestion_threshold(48);
        if let Some(f) = self.on_init.take() {
            f(write, readahead);
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if parent == INodeNo::ROOT && name == self.shared.name.as_os_str() {
            reply.entry(&TTL, &self.shared.attr(FILE_INO), Generation(0));
        } else {
            reply.error(Errno::ENOENT);
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        if ino == INodeNo::ROOT || ino == FILE_INO {
            reply.attr(&TTL, &self.shared.attr(ino));
        } else {
            reply.error(Errno::ENOENT);
        }
    }

    /// Only the size matters: the region's size is fixed, so truncation to another size is
    /// refused. Mode, owner and times are accepted and not kept.
    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        if ino != INodeNo::ROOT && ino != FILE_INO {
            return reply.error(Errno::ENOENT);
        }
        if let Some(size) = size {
            if ino != FILE_INO || size != self.shared.geometry.size() {
                return reply.error(Errno::EPERM);
            }
        }
        // The kernel has checked who may change what (`default_permissions`): the owner may
        // chmod, root may chown. The directory keeps its attributes.
        if ino == FILE_INO {
            if let Some(mode) = mode {
                self.shared.mode.store(mode & 0o7777, Ordering::Relaxed);
            }
            if let Some(uid) = uid {
                self.shared.uid.store(uid, Ordering::Relaxed);
            }
            if let Some(gid) = gid {
                self.shared.gid.store(gid, Ordering::Relaxed);
            }
        } else if mode.is_some() || uid.is_some() || gid.is_some() {
            return reply.error(Errno::EPERM);
        }
        reply.attr(&TTL, &self.shared.attr(ino));
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if ino != FILE_INO {
            return reply.error(Errno::EISDIR);
        }
        if self.shared.read_only && flags.acc_mode() != OpenAccMode::O_RDONLY {
            return reply.error(Errno::EROFS);
        }
        // Keep the page cache across opens: only this mount changes the file.
        reply.opened(FileHandle(0), FopenFlags::FOPEN_KEEP_CACHE);
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        if ino != FILE_INO {
            return reply.error(Errno::EISDIR);
        }
        let end = self.shared.geometry.size();
        let len = u64::from(size).min(end.saturating_sub(offset)) as usize;
        if len == 0 {
            return reply.data(&[]);
        }
        let shared = self.shared.clone();
        let read = async move {
            if let Err(e) = shared.control.readable().await {
                return reply.error(e);
            }
            if let Some(warm) = &shared.warm {
                warm.fire();
            }
            match shared.store.read_bytes(offset, len).await {
                Ok(data) => reply.data(&data),
                Err(e) => {
                    tracing::warn!(offset, len, error = %e.to_owned_lossy(), "read failed");
                    reply.error(errno(&e))
                }
            }
        };
        // Large reads (read-ahead) keep running side by side on the runtime's threads.
        if len <= INLINE_READ {
            self.run_here_or_spawn(read);
        } else {
            self.spawn(read);
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        if ino != FILE_INO {
            return reply.error(Errno::EISDIR);
        }
        if self.shared.read_only {
            return reply.error(Errno::EROFS);
        }
        let end = self.shared.geometry.size();
        if offset >= end && !data.is_empty() {
            // The file cannot grow.
            return reply.error(Errno::EFBIG);
        }
        // A write reaching past the end is cut short, like one on a full block device.
        let len = (data.len() as u64).min(end - offset) as usize;
        let data = match &self.shared.pool {
            Some(pool) => pool.copy(&data[..len]),
            None => Bytes::copy_from_slice(&data[..len]),
        };
        let shared = self.shared.clone();
        self.spawn(async move {
            let write = shared.store.write_bytes(offset, data);
            match shared.change(offset, len as u64, write).await {
                Ok(Ok(())) => reply.written(len as u32),
                Ok(Err(e)) => {
                    tracing::warn!(offset, len, error = %e.to_owned_lossy(), "write failed");
                    reply.error(errno(&e))
                }
                Err(e) => reply.error(e),
            }
        });
    }

    /// Called at every close of a descriptor; the kernel has written the file's dirty pages
    /// back first.
    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        if self.shared.read_only {
            return reply.ok();
        }
        self.flush_store(reply);
    }

    /// The kernel has written the file's dirty pages back first.
    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.flush_store(reply);
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        if ino == INodeNo::ROOT {
            reply.opened(FileHandle(0), FopenFlags::empty());
        } else {
            reply.error(Errno::ENOTDIR);
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        if ino != INodeNo::ROOT {
            return reply.error(Errno::ENOTDIR);
        }
        let entries = [
            (INodeNo::ROOT, FileType::Directory, OsStr::new(".")),
            (INodeNo::ROOT, FileType::Directory, OsStr::new("..")),
            (
                FILE_INO,
                FileType::RegularFile,
                self.shared.name.as_os_str(),
            ),
        ];
        for (i, (ino, kind, name)) in entries.iter().enumerate().skip(offset as usize) {
            if reply.add(*ino, (i + 1) as u64, *kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let bsize = 4096u32;
        let blocks = self.shared.geometry.size().div_ceil(u64::from(bsize));
        reply.statfs(blocks, 0, 0, 2, 0, bsize, 255, bsize);
    }

    fn access(&self, _req: &Request, _ino: INodeNo, mask: fuser::AccessFlags, reply: ReplyEmpty) {
        if self.shared.read_only && mask.contains(fuser::AccessFlags::W_OK) {
            reply.error(Errno::EROFS);
        } else {
            reply.ok();
        }
    }

    /// `FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE` trims the range (it reads as zeros);
    /// plain allocation within the file is a no-op (a store has no space to reserve).
    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        if ino != FILE_INO {
            return reply.error(Errno::EISDIR);
        }
        if self.shared.read_only {
            return reply.error(Errno::EROFS);
        }
        let end = self.shared.geometry.size();
        let Some(stop) = offset.checked_add(length) else {
            return reply.error(Errno::EINVAL);
        };
        match mode {
            0 | FALLOC_FL_KEEP_SIZE if stop <= end => reply.ok(),
            0 | FALLOC_FL_KEEP_SIZE => reply.error(Errno::EFBIG),
            m if m == FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE => {
                let stop = stop.min(end);
                if offset >= stop {
                    return reply.ok();
                }
                let shared = self.shared.clone();
                self.spawn(async move {
                    let trim = shared.store.trim_at(offset, stop - offset);
                    match shared.change(offset, stop - offset, trim).await {
                        Ok(Ok(())) => reply.ok(),
                        Ok(Err(e)) => reply.error(errno(&e)),
                        Err(e) => reply.error(e),
                    }
                });
            }
            _ => reply.error(Errno::EOPNOTSUPP),
        }
    }
}
