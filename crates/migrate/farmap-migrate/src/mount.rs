//! Live migration of a mount: the file moves to a mount on another host while programs at
//! the source keep using it (see `docs/mount-migration.md`).
//!
//! ```text
//!  source: farmap mount DIR STORE --agent S1          destination: farmap mount DIR2 --agent S2
//!  ┌──────────────────────────────────────┐           ┌──────────────────────────────────────┐
//!  │ programs ─ page cache ─ FUSE server  │           │ FUSE server (gate held until resume) │
//!  │   MountControl: written pages, gate  │  pages    │   MountDest: chunks kept in memory,  │
//!  │ MountSource (Source + Suspend) ──────┼──────────▶│   fetched from the seeder's pages    │
//!  │   data plane: PageView of the store  │  control  │ (Destination + Store)                │
//!  └──────────────────────────────────────┘◀─────────▶└──────────────────────────────────────┘
//! ```
//!
//! - [`MountSource`] is what the seeder runs on: each round writes the page cache back
//!   (fsync, from the agent's thread: the FUSE server keeps serving on its own) and takes the
//!   pages whose writes reached the server; its [`Suspend`] stops the programs that hold the
//!   file ([`holders`]: `/proc/*/fd` and `/proc/*/maps`) with SIGSTOP, or runs the user's
//!   command, writes the page cache back a last time and closes the gate to writes; at the
//!   release it retires the mount (reads `EIO`, writes `EROFS`) and tells the programs
//!   ([`After`]: SIGTERM by default, then SIGCONT so they can act on it).
//! - [`MountDest`] is what the leecher lands the pages in: a store that serves the
//!   destination mount, keeps every chunk once fetched, and fetches pages written at the
//!   source after the hand-over first when they are read.

use std::collections::HashSet;
use std::fmt;
use std::ops::Range;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::msg::{Location, ManifestRun};
use crate::view::read_only_view;
use crate::{
    Confirm, Destination, EndpointError, Manifest, MigrationStore, Mode, OpenContext, Source,
    Suspend, SuspendError,
};
use bytes::{Bytes, BytesMut};
use farmap_core::{
    BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, Store, StoreError,
    StoreResult,
};
use parking_lot::Mutex;

use farmap_fuse::{Access, MountControl};

/// How the source's programs are stopped at the hand-over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SuspendHow {
    /// SIGSTOP every process that has the file open or mapped (SIGCONT if the migration is
    /// abandoned).
    Holders,
    /// Run `sh -c suspend` (it must exit 0); on abandon, `sh -c resume` if given.
    Command {
        /// Readies the suspension before the migration heads for it (see
        /// [`Suspend::prepare`]); it must exit 0.
        prepare: Option<String>,
        /// Stops the writers.
        suspend: String,
        /// Lets them run again.
        resume: Option<String>,
    },
}

/// How the source's programs are told that the file moved away.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum After {
    /// Send this signal to the stopped processes, then SIGCONT so they act on it.
    Signal(i32),
    /// Run `sh -c cmd` with `FARMAP_PIDS` (the stopped processes, space-separated) and
    /// `FARMAP_FILE` set; then SIGCONT the stopped processes.
    Command(String),
}

/// The processes other than this one that have `path` open (`/proc/*/fd`) or mapped
/// (`/proc/*/maps`, by device and inode); those this user may not inspect are skipped.
pub fn holders(path: &Path) -> std::io::Result<Vec<u32>> {
    let meta = std::fs::metadata(path)?;
    let dev = format!(
        "{:02x}:{:02x}",
        rustix::fs::major(meta.dev()),
        rustix::fs::minor(meta.dev())
    );
    let ino = meta.ino();
    let me = std::process::id();
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc")?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        let dir = entry.path();
        let open = std::fs::read_dir(dir.join("fd")).is_ok_and(|fds| {
            fds.flatten()
                .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|t| t == path))
        });
        let mapped = !open
            && std::fs::read_to_string(dir.join("maps")).is_ok_and(|maps| {
                maps.lines().any(|l| {
                    let mut f = l.split_ascii_whitespace().skip(3);
                    f.next() == Some(dev.as_str()) && f.next() == Some(ino.to_string().as_str())
                })
            });
        if open || mapped {
            out.push(pid);
        }
    }
    Ok(out)
}

fn signal(pid: u32, sig: i32) -> Result<(), SuspendError> {
    let p = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
        .ok_or(SuspendError::NotAPid { pid })?;
    let sig = rustix::process::Signal::from_named_raw(sig).ok_or(SuspendError::NotAPid { pid })?;
    rustix::process::kill_process(p, sig).map_err(|source| SuspendError::Signal { pid, source })
}

/// Whether every thread of `pid` is stopped (or gone).
fn all_stopped(pid: u32) -> Result<bool, SuspendError> {
    let tasks = match std::fs::read_dir(format!("/proc/{pid}/task")) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(true),
        Err(source) => return Err(SuspendError::State { pid, source }),
    };
    for t in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else {
            continue; // the thread exited
        };
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, r)| r.trim_start().chars().next());
        if !matches!(state, Some('T' | 't' | 'Z' | 'X')) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// How long the programs have to stop.
const STOP_WAIT: Duration = Duration::from_secs(2);

fn run_sh(cmd: &str, pids: &[u32], file: &Path) -> Result<(), String> {
    let list: Vec<String> = pids.iter().map(u32::to_string).collect();
    let status = Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .env("FARMAP_PIDS", list.join(" "))
        .env("FARMAP_FILE", file)
        .status()
        .map_err(|e| format!("running sh -c {cmd:?}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("sh -c {cmd:?} failed: {status}"))
    }
}

/// A read-only store of the file's pages (the seeder's data plane): page `i` is read from
/// the chunk that holds it, as the FUSE server has it now.
struct PageView {
    store: Arc<dyn Store>,
    geometry: Geometry,
}

impl fmt::Debug for PageView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PageView")
            .field("geometry", &self.geometry)
            .finish()
    }
}

impl Store for PageView {
    read_only_view!("mount");

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            self.geometry.check_idx(idx)?;
            let inner = self.store.geometry();
            let offset = self.geometry.offset_of(idx);
            let chunk = inner.chunk_of(offset);
            let data = self.store.read(chunk).await?;
            let at = (offset - inner.offset_of(chunk)) as usize;
            let len = self.geometry.chunk_len(idx);
            if data.len() < at + len {
                return Err(StoreError::new(
                    ErrorKind::Corrupt,
                    format!("{chunk} of the mount's store is {} bytes long", data.len()),
                ));
            }
            Ok(data.slice(at..at + len))
        })
    }
}

/// The store a mount's file lives in, when another host can open it too: what an instant
/// migration hands over instead of copying the file.
#[derive(Clone)]
pub struct MountShared {
    /// The store's spec, as another host opens it.
    pub spec: String,
    /// The write-back in front of it (a managed mount); `None`: writes reach the store as
    /// they are made (a direct mount), so the store holds every chunk once the page cache
    /// is written back.
    pub seal: Option<Arc<dyn farmap_pipeline::Seal>>,
}

impl fmt::Debug for MountShared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MountShared")
            .field("spec", &self.spec)
            .field("managed", &self.seal.is_some())
            .finish()
    }
}

/// An instant migration's pushes before the draft stop once a round of write-back and
/// push takes no longer than this: what the programs write in that time is all the draft
/// leaves at the source.
const PUSH_SETTLED: Duration = Duration::from_millis(15);
/// At most this many rounds (a writer faster than the store never settles).
const PUSH_ROUNDS: usize = 8;

/// A mounted file as a migration source and the hook that suspends its programs (see the
/// module notes).
pub struct MountSource {
    path: PathBuf,
    store: Arc<dyn Store>,
    control: Arc<MountControl>,
    how: SuspendHow,
    after: After,
    stopped: Mutex<Vec<u32>>,
    shared: Option<MountShared>,
    /// Set by an instant migration's draft: the store takes no flush any more (its pushes
    /// are stopped), so the page cache is written back without asking for one.
    drafted: std::sync::atomic::AtomicBool,
    /// The file, open for write-backs without a flush (kept open: a close asks the FUSE
    /// server for a flush too).
    file: Mutex<Option<std::fs::File>>,
}

impl fmt::Debug for MountSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MountSource")
            .field("path", &self.path)
            .field("how", &self.how)
            .field("after", &self.after)
            .finish()
    }
}

impl MountSource {
    /// The source of the file at `path`, served from `store` under `control` (a mount's
    /// [`FuseMount::control`](farmap_fuse::FuseMount::control)).
    pub fn new(
        path: PathBuf,
        store: Arc<dyn Store>,
        control: Arc<MountControl>,
        how: SuspendHow,
        after: After,
    ) -> Self {
        Self {
            path,
            store,
            control,
            how,
            after,
            stopped: Mutex::new(Vec::new()),
            shared: None,
            drafted: std::sync::atomic::AtomicBool::new(false),
            file: Mutex::new(None),
        }
    }

    /// The same, whose store another host can open (`None`: not shared): instant
    /// migrations hand it over.
    pub fn with_shared(mut self, shared: Option<MountShared>) -> Self {
        self.shared = shared;
        self
    }

    /// Writes the page cache back to the FUSE server (and flushes the store, unless an
    /// instant migration stopped its pushes). The server serves the writes on its own
    /// threads; this blocks.
    fn write_back(&self) -> std::io::Result<()> {
        if !self.drafted.load(Ordering::Acquire) {
            return std::fs::File::open(&self.path)?.sync_all();
        }
        // sync_file_range writes the dirty pages back (FUSE writes) and waits for them,
        // without the fsync that would ask the store for a flush.
        let mut file = self.file.lock();
        if file.is_none() {
            *file = Some(std::fs::File::open(&self.path)?);
        }
        farmap_memory::sys::write_back_file(std::os::fd::AsFd::as_fd(
            file.as_ref().expect("opened just above"),
        ))
    }

    /// Runs `f` on the runtime this blocking thread belongs to.
    fn block_on<T>(f: impl std::future::Future<Output = T>) -> Result<T, EndpointError> {
        let handle = tokio::runtime::Handle::try_current()
            .map_err(|_| "an instant migration's hooks run on the agent's runtime")?;
        Ok(handle.block_on(f))
    }

    fn stop_holders(&self) -> Result<Vec<u32>, SuspendError> {
        let pids = holders(&self.path).map_err(|source| SuspendError::State {
            pid: std::process::id(),
            source,
        })?;
        let mut stopped = Vec::new();
        let result = (|| {
            for &pid in &pids {
                match signal(pid, libc::SIGSTOP) {
                    Ok(()) => stopped.push(pid),
                    // It exited meanwhile.
                    Err(SuspendError::Signal { source, .. })
                        if source == rustix::io::Errno::SRCH => {}
                    Err(e) => return Err(e),
                }
            }
            let t0 = Instant::now();
            let mut waiting: HashSet<u32> = stopped.iter().copied().collect();
            while !waiting.is_empty() {
                let mut still = HashSet::new();
                for &pid in &waiting {
                    if !all_stopped(pid)? {
                        still.insert(pid);
                    }
                }
                waiting = still;
                if let Some(&pid) = waiting.iter().next() {
                    if t0.elapsed() > STOP_WAIT {
                        return Err(SuspendError::DidNotStop {
                            pid,
                            waited: STOP_WAIT,
                        });
                    }
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
            Ok(())
        })();
        match result {
            Ok(()) => Ok(stopped),
            Err(e) => {
                for &pid in &stopped {
                    let _ = signal(pid, libc::SIGCONT);
                }
                Err(e)
            }
        }
    }
}

impl Source for MountSource {
    fn geometry(&self) -> Geometry {
        self.store.geometry()
    }

    fn page_size(&self) -> u32 {
        u32::try_from(self.control.page_size()).unwrap_or(u32::MAX)
    }

    fn take_dirty(&self) -> Result<Vec<Range<u64>>, EndpointError> {
        // While the gate is open, pages written through mappings may still be in the page
        // cache only: write them back first, so this round carries them. Once the writers
        // are suspended, the suspension has written everything back.
        if self.control.access() == Access::Open {
            self.write_back().map_err(|e| {
                format!(
                    "writing the page cache of {} back (fsync): {e}",
                    self.path.display()
                )
            })?;
        }
        Ok(self.control.take_dirty())
    }

    fn shared_store(&self) -> Option<String> {
        self.shared.as_ref().map(|s| s.spec.clone())
    }

    fn push_shared(&self, budget: Duration) -> Result<bool, EndpointError> {
        let Some(seal) = self.shared.as_ref().and_then(|s| s.seal.clone()) else {
            return Ok(true);
        };
        // Rounds of write-back and push while the programs write on: each leaves what was
        // written during it, so the rounds shorten until one takes no longer than
        // PUSH_SETTLED (what is left then comes from here after the hand-over), or the
        // budget runs out.
        let t0 = Instant::now();
        for _ in 0..PUSH_ROUNDS {
            let round = Instant::now();
            self.write_back().map_err(|e| {
                format!(
                    "writing the page cache of {} back: {e}",
                    self.path.display()
                )
            })?;
            let left = budget.saturating_sub(t0.elapsed());
            if !Self::block_on(seal.push_for(left))?? {
                return Ok(false);
            }
            if round.elapsed() <= PUSH_SETTLED {
                break;
            }
        }
        Ok(true)
    }

    fn draft(&self) -> Result<Manifest, EndpointError> {
        let Some(shared) = &self.shared else {
            return Err("this mount's store is not shared: it cannot move instantly".into());
        };
        let n = self.store.geometry().chunk_count();
        match &shared.seal {
            Some(seal) => match Self::block_on(async {
                // From here on the store takes no flush: write-backs skip it.
                self.drafted.store(true, Ordering::Release);
                seal.draft(crate::endpoint::HOT_WINDOW).await
            })? {
                Ok(d) => Ok(crate::endpoint::manifest_from_ledger(&d.ledger)),
                Err(e) => {
                    self.unseal();
                    Err(e.into())
                }
            },
            // Every write reaches the store as it is made: it holds every chunk (the ones
            // the page cache still holds arrive with the suspension's write-back).
            None => Ok(Manifest {
                runs: std::iter::once(n)
                    .filter(|&n| n > 0)
                    .map(|n| ManifestRun {
                        location: Location::Store,
                        chunks: 0..n,
                    })
                    .collect(),
                pushed: vec![(0, 0); n as usize],
            }),
        }
    }

    /// Every chunk is looked at inside the downtime: the writes that reached the mount's
    /// store since the draft are its dirty set, with nothing to scan.
    fn seal(&self) -> Result<Confirm, EndpointError> {
        match self.shared.as_ref().and_then(|s| s.seal.clone()) {
            Some(seal) => Ok(crate::endpoint::confirm_from_delta(Self::block_on(
                seal.seal_hot(),
            )??)),
            None => Ok(Confirm::default()),
        }
    }

    fn unseal(&self) {
        self.drafted.store(false, Ordering::Release);
        if let Some(seal) = self.shared.as_ref().and_then(|s| s.seal.as_ref()) {
            seal.unseal();
        }
    }

    fn data_plane(self: Arc<Self>) -> Arc<dyn Store> {
        let size = self.store.geometry().size();
        let geometry =
            Geometry::new(size, self.control.page_size()).unwrap_or_else(|_| self.store.geometry());
        Arc::new(PageView {
            store: self.store.clone(),
            geometry,
        })
    }
}

impl Suspend for MountSource {
    fn prepare(&self) -> Result<(), SuspendError> {
        match &self.how {
            SuspendHow::Command {
                prepare: Some(cmd), ..
            } => run_sh(cmd, &[], &self.path).map_err(|e| SuspendError::App(e.into())),
            _ => Ok(()),
        }
    }

    /// Stops the writers, writes the page cache back and closes the gate to writes. The
    /// state handed over is the CLOCK_MONOTONIC time the suspension began (8 bytes, little
    /// endian), so that the destination can report the freeze the programs saw.
    fn suspend(&self) -> Result<Bytes, SuspendError> {
        let t0 = crate::monotonic_ns();
        match &self.how {
            SuspendHow::Holders => *self.stopped.lock() = self.stop_holders()?,
            SuspendHow::Command { suspend, .. } => {
                run_sh(suspend, &[], &self.path).map_err(|e| SuspendError::App(e.into()))?
            }
        }
        if let Err(e) = self.write_back() {
            self.resume();
            return Err(SuspendError::App(
                format!(
                    "writing the page cache of {} back (fsync): {e}",
                    self.path.display()
                )
                .into(),
            ));
        }
        self.control.hold_writes();
        Ok(Bytes::copy_from_slice(&t0.to_le_bytes()))
    }

    fn resume(&self) {
        self.control.open();
        match &self.how {
            SuspendHow::Holders => {
                for pid in std::mem::take(&mut *self.stopped.lock()) {
                    let _ = signal(pid, libc::SIGCONT);
                }
            }
            SuspendHow::Command { resume, .. } => {
                if let Some(cmd) = resume {
                    if let Err(e) = run_sh(cmd, &[], &self.path) {
                        tracing::warn!("resuming the programs: {e}");
                    }
                }
            }
        }
    }

    fn retire(&self) {
        self.control.retire();
        let pids = std::mem::take(&mut *self.stopped.lock());
        let (after, path) = (self.after.clone(), self.path.clone());
        // Off the seeder's path: the hook may take its time. The page cache is kept: pages
        // the programs hold stay readable to them, and what they write to them never reaches
        // the store (write-back is refused), so nothing diverges; a program that must not
        // even read stale pages is told by the hook (and MountControl::invalidate_cache
        // drops them, at the price of SIGBUS for a program still touching its mapping).
        std::thread::spawn(move || {
            match &after {
                After::Signal(sig) => {
                    for &pid in &pids {
                        let _ = signal(pid, *sig);
                    }
                }
                After::Command(cmd) => {
                    if let Err(e) = run_sh(cmd, &pids, &path) {
                        tracing::warn!("the --after hook: {e}");
                    }
                }
            }
            for &pid in &pids {
                let _ = signal(pid, libc::SIGCONT);
            }
        });
    }
}

/// One chunk at the destination.
#[derive(Debug, Default)]
struct Slot {
    /// Its bytes, once fetched (or written here).
    data: Option<Bytes>,
    /// Pages written at the source after it was fetched (absolute page runs within it).
    pending: Vec<Range<u64>>,
}

impl Slot {
    fn is_local(&self) -> bool {
        self.data.is_some() && self.pending.is_empty()
    }
}

struct DestInner {
    geometry: Geometry,
    page: u64,
    remote: Arc<MigrationStore>,
    /// Instant mode: the file lives in the shared store from the hand-over on; writes go
    /// through to it.
    instant: bool,
    slots: Box<[tokio::sync::Mutex<Slot>]>,
    local: AtomicU64,
}

/// The destination of a mount's migration: the store the destination mount serves. Chunks
/// are fetched from the seeder once (the bulk pull, or a read that comes first) and kept in
/// memory; pages written at the source after the hand-over are fetched again, first when
/// the file reads them. Writes land here.
#[derive(Clone)]
pub struct MountDest {
    inner: Arc<DestInner>,
}

impl fmt::Debug for MountDest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MountDest")
            .field("geometry", &self.inner.geometry)
            .field("local", &self.inner.local.load(Ordering::Relaxed))
            .finish()
    }
}

impl MountDest {
    /// A destination of `ctx.geometry` whose chunks come from `remote`.
    pub fn new(remote: Arc<MigrationStore>, ctx: &OpenContext) -> Self {
        let n = ctx.geometry.chunk_count() as usize;
        Self {
            inner: Arc::new(DestInner {
                geometry: ctx.geometry,
                page: u64::from(ctx.page_size),
                remote,
                instant: ctx.mode == Mode::Instant,
                slots: (0..n).map(|_| Default::default()).collect(),
                local: AtomicU64::new(0),
            }),
        }
    }
}

impl DestInner {
    fn slot(&self, idx: ChunkIdx) -> StoreResult<&tokio::sync::Mutex<Slot>> {
        self.geometry.check_idx(idx)?;
        Ok(&self.slots[idx.0 as usize])
    }

    /// The chunk's bytes, fetching what is not local.
    async fn ensure(&self, idx: ChunkIdx) -> StoreResult<Bytes> {
        let mut slot = self.slot(idx)?.lock().await;
        if let (Some(d), true) = (&slot.data, slot.pending.is_empty()) {
            return Ok(d.clone());
        }
        let fetched = self.remote.read(idx).await?;
        let data = match slot.data.take() {
            None => fetched,
            Some(old) => {
                // Only the pending pages are fresh in `fetched`.
                let mut out = BytesMut::from(&old[..]);
                let base = self.geometry.offset_of(idx);
                for r in &slot.pending {
                    let a = (r.start * self.page - base) as usize;
                    let b = ((r.end * self.page).min(base + out.len() as u64) - base) as usize;
                    if b > fetched.len() {
                        slot.data = Some(old);
                        return Err(StoreError::new(
                            ErrorKind::Corrupt,
                            format!("{idx} came back {} bytes long", fetched.len()),
                        ));
                    }
                    out[a..b].copy_from_slice(&fetched[a..b]);
                }
                out.freeze()
            }
        };
        slot.pending.clear();
        slot.data = Some(data.clone());
        self.local.fetch_add(1, Ordering::AcqRel);
        Ok(data)
    }

    /// Replaces a whole chunk.
    async fn put(&self, idx: ChunkIdx, data: Bytes) -> StoreResult<()> {
        let mut slot = self.slot(idx)?.lock().await;
        let was_local = slot.is_local();
        slot.pending.clear();
        slot.data = Some(data);
        if !was_local {
            self.local.fetch_add(1, Ordering::AcqRel);
        }
        Ok(())
    }
}

impl Store for MountDest {
    fn geometry(&self) -> Geometry {
        self.inner.geometry
    }

    fn caps(&self) -> Caps {
        Caps::WRITE | Caps::TRIM | Caps::PARALLEL
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(self.inner.ensure(idx))
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            let len = self.inner.geometry.chunk_len(idx);
            if data.len() != len {
                return Err(StoreError::new(
                    ErrorKind::InvalidInput,
                    format!("writing {idx}: {} bytes for a chunk of {len}", data.len()),
                ));
            }
            if self.inner.instant {
                // The shared store first: a write it refuses fails, and changes nothing.
                self.inner.remote.write(idx, data.clone()).await?;
            }
            self.inner.put(idx, data).await
        })
    }

    /// Instant mode: flushes the shared store (writes went through to it).
    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async {
            if self.inner.instant {
                return self.inner.remote.flush().await;
            }
            Ok(())
        })
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            if self.inner.instant {
                self.inner.geometry.check_range(range)?;
                self.inner.remote.trim(range).await?;
            }
            for i in range.start.0..range.end.0 {
                let idx = ChunkIdx(i);
                let len = self.inner.geometry.chunk_len(idx);
                self.inner.put(idx, Bytes::from(vec![0u8; len])).await?;
            }
            Ok(())
        })
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        Box::pin(async move {
            self.inner.geometry.check_idx(idx)?;
            Ok(ChunkStatus::Unknown)
        })
    }
}

impl Destination for MountDest {
    fn geometry(&self) -> Geometry {
        self.inner.geometry
    }

    fn fetch_chunks(
        &self,
        chunks: Vec<ChunkIdx>,
        parallel: usize,
    ) -> BoxFuture<'static, Result<(), EndpointError>> {
        let inner = self.inner.clone();
        Box::pin(async move {
            let queue = Arc::new(Mutex::new(chunks.into_iter()));
            let tasks: Vec<_> = (0..parallel.max(1))
                .map(|_| {
                    let (queue, inner) = (queue.clone(), inner.clone());
                    tokio::spawn(async move {
                        loop {
                            let Some(idx) = queue.lock().next() else {
                                return Ok::<(), StoreError>(());
                            };
                            inner.ensure(idx).await?;
                        }
                    })
                })
                .collect();
            let mut first: Option<EndpointError> = None;
            for t in tasks {
                match t.await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        first.get_or_insert(e.into());
                    }
                    Err(e) => {
                        first.get_or_insert(e.into());
                    }
                }
            }
            first.map_or(Ok(()), Err)
        })
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), EndpointError> {
        let g = self.inner.geometry;
        let mut at = 0usize;
        while at < data.len() {
            let off = offset + at as u64;
            let idx = g.chunk_of(off);
            let base = g.offset_of(idx);
            let within = (off - base) as usize;
            let n = (g.chunk_len(idx) - within).min(data.len() - at);
            let mut slot = self.inner.slot(idx)?.blocking_lock();
            // A chunk not fetched yet is fetched whole later, with this write in it.
            if let Some(old) = slot.data.take() {
                let mut b = BytesMut::from(&old[..]);
                b[within..within + n].copy_from_slice(&data[at..at + n]);
                slot.data = Some(b.freeze());
            }
            at += n;
        }
        Ok(())
    }

    fn discard_pages(&self, runs: &[Range<u64>]) -> Result<(), EndpointError> {
        let g = self.inner.geometry;
        let per_chunk = (u64::from(g.chunk_size()) / self.inner.page).max(1);
        for r in runs {
            let mut p = r.start;
            while p < r.end {
                let idx = ChunkIdx(p / per_chunk);
                let end = ((idx.0 + 1) * per_chunk).min(r.end);
                let mut slot = self.inner.slot(idx)?.blocking_lock();
                let was_local = slot.is_local();
                if slot.data.is_some() {
                    slot.pending.push(p..end);
                    if was_local {
                        self.inner.local.fetch_sub(1, Ordering::AcqRel);
                    }
                }
                p = end;
            }
        }
        Ok(())
    }

    /// Instant mode: writes the chunks (fetched from the source) to the shared store.
    fn push_chunks(&self, chunks: Vec<ChunkIdx>) -> Result<(), EndpointError> {
        if !self.inner.instant {
            return Err("this destination does not live in a shared store".into());
        }
        let handle = tokio::runtime::Handle::try_current()
            .map_err(|_| "pushing chunks needs the leecher's runtime")?;
        let inner = self.inner.clone();
        handle.block_on(async move {
            for idx in chunks {
                let data = inner.ensure(idx).await?;
                inner.remote.write(idx, data).await?;
            }
            inner.remote.flush().await
        })?;
        Ok(())
    }

    fn present_chunks(&self) -> u64 {
        self.inner.local.load(Ordering::Acquire)
    }

    fn is_complete(&self) -> bool {
        self.present_chunks() >= self.inner.geometry.chunk_count()
    }
}
