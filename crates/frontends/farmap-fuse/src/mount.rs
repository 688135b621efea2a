//! [`FuseMount`]: mounting, serving and unmounting one region file.

use std::ffi::OsString;
use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU32;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::SystemTime;

use farmap_core::{Caps, Geometry, Store};
use farmap_pipeline::Unaligned;
use fuser::{Config, MountOption, Session, SessionACL};
use parking_lot::Mutex;
use tokio::runtime::Runtime;
use tokio::sync::watch;

use crate::control::{Access, MountControl};
use crate::error::MountError;
use crate::fs::{RegionFs, Shared};
use crate::mapping::MappedRegion;
use crate::pool::WritePool;
use crate::sys::{self, Unmounted};
use crate::warm::{WarmStats, WarmUp};

pub use crate::sys::{find_mount, MountInfo};

/// The file's name unless [`MountOptions::name`] says otherwise.
pub const DEFAULT_FILE_NAME: &str = "region";

/// How to mount a region.
#[derive(Debug, Clone)]
pub struct MountOptions {
    /// The file's name in the mount's root directory.
    pub name: String,
    /// Refuse writes (`EROFS`) and mount read-only. Stores without [`Caps::WRITE`] are
    /// always mounted read-only.
    pub read_only: bool,
    /// Largest read or write request, in bytes (a multiple of 4 KiB, at most 16 MiB).
    pub max_request: u32,
    /// As root, raise `/proc/sys/fs/fuse/max_pages_limit` to fit `max_request` and set the
    /// mount's read-ahead to `max_request` (best effort: a failure is logged).
    pub tune_kernel: bool,
    /// Worker threads of the mount's runtime, which serves requests.
    pub worker_threads: usize,
    /// Let other users than the mounting one use the file (`allow_other`).
    pub allow_other: bool,
    /// Who may use the file at first: [`Access::Held`] makes every request wait until
    /// [`MountControl::open`] (a migration's destination before its hand-over).
    pub access: Access,
    /// Buffers of `max_request` bytes allocated at mount for write payloads (a
    /// [`WritePool`]); 0: every write's payload is copied into a fresh allocation. Only for
    /// stores that copy what they keep (see [`WritePool`]): a swap server's writes must not
    /// allocate.
    pub write_buffers: usize,
    /// Read the store's working set ([`Store::working_set`], asked when the file is first
    /// read) through the file, so that the page cache holds it before the program using the
    /// file touches it (at most half the memory available). Off by default: on a restored
    /// VM's RAM it did not shorten the guest's stall (the reads compete with the guest's own
    /// faults for the store).
    pub warm_page_cache: bool,
}

impl Default for MountOptions {
    /// `region`, read-write, 1 MiB requests, kernel tuning on, 4 worker threads, owner only,
    /// no write pool, no page-cache warming.
    fn default() -> Self {
        Self {
            name: DEFAULT_FILE_NAME.to_string(),
            read_only: false,
            max_request: 1 << 20,
            tune_kernel: true,
            worker_threads: 4,
            allow_other: false,
            access: Access::Open,
            write_buffers: 0,
            warm_page_cache: false,
        }
    }
}

/// A region mounted as one file on a FUSE file system, served by this process until
/// unmounted (see the [crate documentation](crate)).
#[derive(Debug)]
pub struct FuseMount {
    dir: PathBuf,
    path: PathBuf,
    geometry: Geometry,
    read_only: bool,
    store: Arc<dyn Store>,
    limits: (u32, u32),
    session: Option<JoinHandle<io::Result<()>>>,
    ended: watch::Receiver<bool>,
    runtime: Option<Runtime>,
    control: Arc<MountControl>,
    pool: Option<WritePool>,
    warm: Option<WarmUp>,
}

/// Checks the mount point: a directory with nothing mounted on it (a dead FUSE mount there is
/// unmounted first).
fn check_mount_point(dir: &Path) -> Result<(), MountError> {
    let bad = |reason: String| MountError::BadMountPoint {
        dir: dir.to_path_buf(),
        reason,
    };
    sys::cleanup_stale(dir)
        .map_err(|e| bad(format!("cannot unmount the dead FUSE mount there: {e}")))?;
    let meta = std::fs::metadata(dir).map_err(|e| bad(e.to_string()))?;
    if !meta.is_dir() {
        return Err(bad("not a directory".into()));
    }
    if sys::is_mount_point(dir).map_err(|e| bad(e.to_string()))? {
        let what = match find_mount(dir) {
            Ok(Some(m)) => match m.farmap_pid() {
                Some(pid) => format!("a farmap mount served by process {pid}"),
                None => format!("{} ({})", m.fs_type, m.source),
            },
            _ => "a file system".to_string(),
        };
        return Err(MountError::Busy {
            dir: dir.to_path_buf(),
            what,
        });
    }
    Ok(())
}

/// The FUSE session's options: requests of up to `max_request` bytes, the kernel checking
/// permissions, other users let in with `allow_other`.
fn session_config(max_request: u32, read_only: bool, allow_other: bool) -> Config {
    let mut mount_options = vec![
        MountOption::FSName(format!("farmap:{}", std::process::id())),
        MountOption::CUSTOM("subtype=farmap".into()),
        MountOption::CUSTOM(format!("max_read={max_request}")),
        MountOption::NoAtime,
        // The kernel checks the file's mode, owner and group for every access: with
        // `allow_other`, another user reads a 0644 file but cannot write it.
        MountOption::DefaultPermissions,
    ];
    if read_only {
        mount_options.push(MountOption::RO);
    }
    let mut config = Config::default();
    config.mount_options = mount_options;
    config.acl = if allow_other {
        SessionACL::All
    } else {
        SessionACL::Owner
    };
    config.n_threads = Some(1);
    config
}

/// Why mounting at `dir` failed (`EBUSY`: something is mounted there).
fn mount_error(dir: &Path, e: io::Error) -> MountError {
    if e.raw_os_error() == Some(libc::EBUSY) {
        MountError::Busy {
            dir: dir.to_path_buf(),
            what: "something".into(),
        }
    } else {
        MountError::sys(
            format!("cannot mount a FUSE file system at {}", dir.display()),
            e,
        )
    }
}

/// Runs the FUSE session on a thread of its own; `ended` turns true when it ends.
fn spawn_session(
    session: Session<RegionFs>,
    dir: PathBuf,
    ended: watch::Sender<bool>,
) -> Result<JoinHandle<io::Result<()>>, MountError> {
    std::thread::Builder::new()
        .name("farmap-fuse-session".into())
        .spawn(move || {
            // Every log line of the session names its mount point.
            let _span = tracing::info_span!("mount", dir = %dir.display()).entered();
            let result = session.run();
            if let Err(e) = &result {
                tracing::warn!("the FUSE session ended: {e}");
            }
            let _ = ended.send(true);
            result
        })
        .map_err(|e| MountError::sys("starting the FUSE session thread", e))
}

fn check_name(name: &str) -> Result<OsString, MountError> {
    if name.is_empty() || name.contains('/') || name == "." || name == ".." || name.contains('\0') {
        return Err(MountError::BadName {
            name: name.to_string(),
        });
    }
    Ok(OsString::from(name))
}

impl FuseMount {
    /// Mounts `store` at `dir` (an existing, empty directory; a dead FUSE mount there is
    /// cleaned up) as the file `dir/<opts.name>` and serves it on a thread and a runtime of
    /// its own until [`unmount`](Self::unmount) or drop. Needs root (or a `fusermount3` the
    /// user may run).
    pub fn mount(
        store: Arc<dyn Store>,
        dir: impl AsRef<Path>,
        opts: MountOptions,
    ) -> Result<FuseMount, MountError> {
        let dir = dir.as_ref().to_path_buf();
        let name = check_name(&opts.name)?;
        check_mount_point(&dir)?;
        let max_request = (opts.max_request.clamp(4096, 16 << 20) / 4096) * 4096;
        let root = rustix::process::geteuid().is_root();
        if opts.tune_kernel && root {
            if let Err(e) = sys::raise_max_pages(max_request / 4096) {
                tracing::warn!("requests may be smaller than asked: {e}");
            }
        }
        let geometry = store.geometry();
        let read_only = opts.read_only || !store.caps().contains(Caps::WRITE);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(opts.worker_threads.max(1))
            .thread_name("farmap-fuse")
            .enable_all()
            .build()
            .map_err(|e| MountError::sys("starting the mount's runtime", e))?;
        let control = Arc::new(MountControl::new(
            geometry.size(),
            rustix::param::page_size() as u64,
            opts.access,
        ));
        let pool = (opts.write_buffers > 0)
            .then(|| WritePool::new(opts.write_buffers, max_request as usize));
        let path = dir.join(&opts.name);
        let warm = if opts.warm_page_cache {
            let max_bytes = sys::mem_available().map_or(0, |m| m / 2);
            Some(
                WarmUp::start(path.clone(), store.clone(), max_request, max_bytes)
                    .map_err(|e| MountError::sys("starting the page-cache warming", e))?,
            )
        } else {
            None
        };
        let shared = Arc::new(Shared {
            warm: warm.as_ref().map(|w| w.trigger().clone()),
            pool: pool.clone(),
            control: control.clone(),
            store: Unaligned::new(store.clone()),
            geometry,
            name,
            read_only,
            uid: AtomicU32::new(rustix::process::geteuid().as_raw()),
            gid: AtomicU32::new(rustix::process::getegid().as_raw()),
            mode: AtomicU32::new(if read_only { 0o444 } else { 0o644 }),
            created: SystemTime::now(),
            max_request,
        });
        let limits = Arc::new(Mutex::new((0, 0)));
        let seen = limits.clone();
        let fs = RegionFs {
            shared,
            handle: runtime.handle().clone(),
            on_init: Some(Box::new(move |w, r| *seen.lock() = (w, r))),
        };
        let config = session_config(max_request, read_only, opts.allow_other);
        let session = Session::new(fs, &dir, &config).map_err(|e| mount_error(&dir, e))?;
        let notifier = session.notifier();
        control.set_invalidate(Box::new(move || {
            if let Err(e) = notifier.inval_inode(crate::fs::FILE_INO, 0, 0) {
                tracing::debug!("invalidating the page cache: {e}");
            }
        }));
        let (ended_tx, ended) = watch::channel(false);
        let session = spawn_session(session, dir.clone(), ended_tx)?;
        let mut mount = FuseMount {
            path,
            dir,
            geometry,
            read_only,
            store,
            limits: *limits.lock(),
            session: Some(session),
            ended,
            runtime: Some(runtime),
            control,
            pool,
            warm,
        };
        if opts.tune_kernel && root {
            mount.tune_read_ahead(max_request);
        }
        tracing::debug!(path = %mount.path.display(), max_write = mount.limits.0,
            max_readahead = mount.limits.1, "mounted");
        Ok(mount)
    }

    fn tune_read_ahead(&mut self, max_request: u32) {
        let dev = match std::fs::metadata(&self.dir) {
            Ok(m) => m.dev(),
            Err(e) => return tracing::warn!("cannot stat the new mount: {e}"),
        };
        let device = format!("{}:{}", rustix::fs::major(dev), rustix::fs::minor(dev));
        if let Err(e) = sys::set_read_ahead(&device, max_request / 1024) {
            tracing::warn!("read-ahead left at the kernel's default: {e}");
        }
    }

    /// The mount's migration controls: written pages, and the gate in front of requests.
    pub fn control(&self) -> &Arc<MountControl> {
        &self.control
    }

    /// What the page-cache warming with the store's working set did so far (`None`:
    /// [`MountOptions::warm_page_cache`] is off).
    pub fn warm_stats(&self) -> Option<&Arc<WarmStats>> {
        self.warm.as_ref().map(WarmUp::stats)
    }

    /// The pre-allocated write buffers ([`MountOptions::write_buffers`]), if any.
    pub fn write_pool(&self) -> Option<&WritePool> {
        self.pool.as_ref()
    }

    /// The store the file is served from.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The mounted file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The mount point.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The region's shape (the store's).
    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    /// Whether writes are refused.
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// The largest write and read-ahead the kernel accepted at INIT, in bytes.
    pub fn request_limits(&self) -> (u32, u32) {
        self.limits
    }

    /// Opens the file (read-write unless the mount is read-only).
    pub fn open(&self) -> io::Result<File> {
        std::fs::OpenOptions::new()
            .read(true)
            .write(!self.read_only)
            .open(&self.path)
    }

    /// Maps the whole file shared: its memory is the region (see [`MappedRegion`]).
    pub fn map(&self) -> Result<MappedRegion<'_>, MountError> {
        let len = usize::try_from(self.geometry.size()).map_err(|_| MountError::TooLarge {
            size: self.geometry.size(),
        })?;
        let file = self
            .open()
            .map_err(|e| MountError::sys(format!("opening {}", self.path.display()), e))?;
        farmap_memory::SharedMapping::new(file, len, !self.read_only, "a mounted region")
            .map(|map| MappedRegion::new(map, self))
            .map_err(|e| MountError::sys(format!("mapping {}", self.path.display()), e))
    }

    /// Writes the file's dirty pages (from `write` or shared mappings of any process) back
    /// to the store and flushes it (managed stores: everything pushed to the remote). Blocks;
    /// must not run on the mount's own runtime.
    pub fn sync(&self) -> Result<(), MountError> {
        let file = File::open(&self.path)
            .map_err(|e| MountError::sys(format!("opening {}", self.path.display()), e))?;
        file.sync_all().map_err(|e| {
            MountError::sys(
                format!(
                    "fsync of {} (page cache to the store, store flush)",
                    self.path.display()
                ),
                e,
            )
        })
    }

    /// Whether the session has ended (unmounted, by this process or another).
    pub fn is_ended(&self) -> bool {
        *self.ended.borrow()
    }

    /// Resolves when the session ends: someone unmounted it (`umount DIR`, `fusermount3 -u`)
    /// or [`unmount`](Self::unmount) is under way.
    pub fn ended(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut ended = self.ended.clone();
        async move {
            let _ = ended.wait_for(|e| *e).await;
        }
    }

    /// Syncs (page cache to the store, store flush), unmounts, waits until the kernel lets go
    /// of the mount, and flushes the store a last time. If programs still hold the file, the
    /// mount is detached from the directory at once and served until they let go (this call
    /// waits for that), so nothing they write is lost. On an error the mount is unmounted all
    /// the same (as at drop).
    pub fn unmount(mut self) -> Result<(), MountError> {
        self.shut_down()
    }

    fn shut_down(&mut self) -> Result<(), MountError> {
        // The warming holds the file open: it must let go before the unmount.
        if let Some(mut warm) = self.warm.take() {
            warm.stop();
        }
        let Some(session) = self.session.take() else {
            return Ok(());
        };
        let mut first_error = None;
        if !self.is_ended() {
            if let Err(e) = self.sync() {
                first_error = Some(e);
            }
            match sys::unmount_or_detach(&self.dir) {
                Ok(Unmounted::Detached) => tracing::info!(
                    dir = %self.dir.display(),
                    "the file is still in use: detached, serving until its users let go"
                ),
                Ok(_) => {}
                Err(e) => {
                    first_error.get_or_insert(MountError::sys(
                        format!("unmounting {}", self.dir.display()),
                        e,
                    ));
                }
            }
        }
        let _ = session.join();
        if let Some(runtime) = self.runtime.take() {
            let store = self.store.clone();
            let (tx, rx) = std::sync::mpsc::sync_channel(1);
            runtime.spawn(async move {
                let flushed = store.flush().await;
                // Let go of the store before answering: the runtime is shut down in the
                // background, and a caller that reopens the store after `unmount` (a file
                // store's writer lock) must not find this task still holding it.
                drop(store);
                let _ = tx.send(flushed);
            });
            if let Ok(Err(e)) = rx.recv() {
                first_error.get_or_insert(MountError::Flush {
                    path: self.path.clone(),
                    source: e,
                });
            }
            runtime.shutdown_background();
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for FuseMount {
    /// As [`unmount`](FuseMount::unmount), with errors logged.
    fn drop(&mut self) {
        if let Err(e) = self.shut_down() {
            tracing::warn!(dir = %self.dir.display(), "unmounting: {e}");
        }
    }
}
