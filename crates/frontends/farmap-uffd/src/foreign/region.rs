//! [`ForeignRegion`]: bounded local memory for a region of another process (`farmap run`'s
//! program), served from here over the fds the program sent (docs/design/foreign-region.md).
//!
//! The pieces are a local bounded region's (the pager, the fault server, the tracker, the
//! pusher, the reclaim thread), over the program's address space ([`ForeignSpace`]): its
//! pages are read through its mem fd, moved and discarded by its reaper, installed with
//! `UFFDIO_COPY` on its userfaultfd. What differs:
//! - a page the program discards reads as zeros afterwards ([`RemoveMeans::Zero`]: it is a
//!   heap), so chunks are one page;
//! - staged chunks come back by copy (a move across address spaces is refused, and a
//!   reaper round trip under the pager's lock would serialize every fault);
//! - the session ends with the program ([`End`]): a watcher thread sees the program exit
//!   or exec (or kills it when its reaper is lost), and then stops the pager, the reclaim
//!   thread, the readers and the pusher, in that order.
//!
//! Dropping a [`ForeignRegion`] whose program still runs kills the program first: nobody
//! would serve its faults, and closing our userfaultfd copies while the program's threads
//! wait would let them through as zeros (or, if the program closed its own copies, let its
//! heap read zeros from then on).

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use farmap_core::{Geometry, Store};
use farmap_pipeline::{Cached, PushOptions, RetryPolicy};
use farmap_run_proto::Registered;
use parking_lot::Mutex;
use tokio::runtime::Handle;

use super::fork::{ForkCopy, Forks};
use super::reaper::Reaper;
use super::space::{End, ForeignSpace};
use crate::error::RegionError;
use crate::memory::{Events, PushReads, RegionMemory};
use crate::options::{FaultWait, LocalLimit, PagingOptions, RemoveMeans, TrackingMode};
use crate::pagemap::Pagemap;
use crate::paging::{trash_len as staging_trash_len, Pager, PagerParts, Reclaimer};
use crate::region::{connect_pager, region_stats, start_pusher, RegionPusher};
use crate::server::{Reader, Server, ServerParts};
use crate::space::{Area, Moves};
use crate::stats::{Counters, HandlerLocation, RegionStats};
use crate::sys;
use crate::tracking::Tracker;
use crate::uffd::{Uffd, UffdRange};

/// The userfaultfd features the program's region must have: moves (for its reaper),
/// remove events (its discards), asynchronous write protection of every page.
pub const FOREIGN_FEATURES: u64 = sys::UFFD_FEATURE_MOVE
    | sys::UFFD_FEATURE_EVENT_REMOVE
    | sys::UFFD_FEATURE_WP_ASYNC
    | sys::UFFD_FEATURE_WP_UNPOPULATED;

/// Features the program's region must not have: faults resolved in the faulting thread
/// (this side serves them).
pub const FOREIGN_REFUSED_FEATURES: u64 = sys::UFFD_FEATURE_SIGBUS;

/// How long a dropped region waits for its killed program to be gone.
const KILL_WAIT: Duration = Duration::from_secs(5);

/// Bytes of trash after the staging slots of a region of `geometry`: the program maps its
/// staging area `region length + trash_len` long (`farmap run` says so in its config).
pub fn trash_len(geometry: Geometry) -> u64 {
    staging_trash_len(geometry) as u64
}

/// The fds a program sends with its `Registered` message, in farmap-run-proto's order
/// ([`REGISTERED_FDS`](farmap_run_proto::REGISTERED_FDS)).
#[derive(Debug)]
pub struct ForeignFds {
    /// The region's userfaultfd (missing and write-protect modes, events).
    pub region_uffd: OwnedFd,
    /// The staging area's userfaultfd (write-protect mode, no events).
    pub staging_uffd: OwnedFd,
    /// The program's `/proc/self/pagemap`.
    pub pagemap: OwnedFd,
    /// The program's `/proc/self/mem`.
    pub mem: OwnedFd,
}

impl TryFrom<Vec<OwnedFd>> for ForeignFds {
    type Error = RegionError;

    /// Exactly four fds, in the protocol's order.
    fn try_from(fds: Vec<OwnedFd>) -> Result<Self, RegionError> {
        let n = fds.len();
        let [region_uffd, staging_uffd, pagemap, mem]: [OwnedFd; 4] =
            fds.try_into().map_err(|_| RegionError::Foreign {
                reason: format!("the program sent {n} descriptors, not 4"),
            })?;
        Ok(ForeignFds {
            region_uffd,
            staging_uffd,
            pagemap,
            mem,
        })
    }
}

/// The program whose region is served: its pid and a pidfd of it (opened by the caller,
/// which checked that the peer is the process it started).
#[derive(Debug)]
pub struct Program {
    /// Its pid.
    pub pid: u32,
    /// A pidfd of it (`pidfd_open`): how it is watched and, if need be, killed.
    pub pidfd: OwnedFd,
}

/// How a program's region is served.
#[derive(Debug, Clone)]
pub struct ForeignOptions {
    /// The bound on its local memory and the pager's options (`in_thread` is refused:
    /// this side serves the faults).
    pub paging: PagingOptions,
    /// What a page the program discards holds afterwards: zeros for a heap. Only
    /// [`RemoveMeans::Zero`] is served (the other needs the program's own fault path).
    pub remove: RemoveMeans,
    /// Write-backs of its written pages.
    pub push: PushOptions,
    /// Retries of a failed store read.
    pub fetch_retry: RetryPolicy,
    /// How the fault readers wait.
    pub fault_wait: FaultWait,
}

impl Default for ForeignOptions {
    /// A quarter of the region local, removed pages zeros, no periodic pushes (write-backs
    /// happen as chunks leave), readers that sleep.
    fn default() -> Self {
        let mut paging = PagingOptions::new(LocalLimit::Percent(25.0));
        paging.fresh = true;
        ForeignOptions {
            paging,
            remove: RemoveMeans::Zero,
            push: PushOptions {
                interval: None,
                ..PushOptions::default()
            },
            fetch_retry: RetryPolicy::default(),
            fault_wait: FaultWait::Sleep,
        }
    }
}

/// A region of another process served from here (see the module docs).
pub struct ForeignRegion {
    session: Arc<Session>,
    watcher: Option<JoinHandle<()>>,
    geometry: Geometry,
    base: usize,
}

/// What the watcher and the owner share.
struct Session {
    space: Arc<ForeignSpace>,
    pager: Arc<Pager>,
    server: Arc<Server>,
    pusher: Arc<RegionPusher>,
    reader: Mutex<Option<Reader>>,
    reclaimer: Mutex<Option<Reclaimer>>,
    forks: Arc<Forks>,
}

impl Session {
    /// Stops serving: the pager (and the fault tasks that wait on it), the reclaim thread,
    /// the readers, the pusher's background rounds. Twice is harmless.
    fn stop(&self) {
        self.pager.stop();
        if let Some(mut r) = self.reclaimer.lock().take() {
            r.stop();
        }
        if let Some(mut r) = self.reader.lock().take() {
            r.stop();
        }
        self.pusher.stop_background();
    }
}

impl ForeignRegion {
    /// Serves the region a program `registered`, over the `fds` it sent with that message,
    /// from `store` (whose size is the region's), its moves and discards done by `reaper`.
    /// Fault tasks, fetches and pushes run on `rt` (a multi-thread runtime, shared by
    /// sessions if the caller likes).
    ///
    /// The caller has checked who the program is (its token, its credentials); this
    /// checks that the areas and features fit: the region as long as the store, the
    /// staging area as long as the region plus [`trash_len`], page-aligned, chunks of one
    /// page, the features of [`FOREIGN_FEATURES`] and none of
    /// [`FOREIGN_REFUSED_FEATURES`].
    pub fn start(
        registered: &Registered,
        fds: ForeignFds,
        program: Program,
        reaper: Reaper,
        store: Arc<dyn Store>,
        opts: ForeignOptions,
        rt: Handle,
    ) -> Result<ForeignRegion, RegionError> {
        let geometry = store.geometry();
        check(registered, geometry, &opts)?;
        crate::region::probe_paging()?;
        let (base, len) = (registered.region as usize, registered.region_len as usize);
        let (staging_base, staging_len) =
            (registered.staging as usize, registered.staging_len as usize);
        let loud = Arc::new(Uffd::from_owned(fds.region_uffd, registered.features));
        let quiet = Arc::new(Uffd::from_owned(fds.staging_uffd, sys::UFFD_FEATURE_MOVE));
        let range = UffdRange::new(loud, base, len);
        let pagemap = Pagemap::from_owned(fds.pagemap);
        let dup = |p: &Pagemap| {
            p.try_clone()
                .map_err(|e| RegionError::sys("duplicating the program's pagemap fd", e))
        };
        // The probe reads page 0, which no program maps (see ForeignSpace).
        let space = Arc::new(
            ForeignSpace::new(program.pid, program.pidfd, fds.mem, reaper, 0)
                .map_err(|e| RegionError::sys("watching the program", e))?,
        );
        let area = |base, len| Area::Foreign {
            space: space.clone(),
            base,
            len,
        };
        let events = Arc::new(Events::default());
        let counters = Arc::new(Counters::default());
        let p = &opts.paging;
        let pager = Arc::new(Pager::new(PagerParts {
            region: range.clone(),
            staging: UffdRange::new(quiet, staging_base, len),
            staging_map: area(staging_base, staging_len),
            moves: Moves::Reaper(space.clone()),
            events: events.clone(),
            geometry,
            limit: p
                .local_max
                .chunks(geometry.size(), u64::from(geometry.chunk_size())),
            min_free: p.min_free,
            fresh: p.fresh,
            prefetch: p.prefetch,
            region_counters: counters.clone(),
            pagemap: dup(&pagemap)?,
            remove: opts.remove,
        }));
        let memory = Arc::new(RegionMemory::new(
            range.clone(),
            geometry,
            true,
            Some(area(base, len)),
            events.clone(),
            counters.clone(),
            Some(pager.clone() as Arc<dyn PushReads>),
        ));
        let server = Arc::new(Server::new(ServerParts {
            range: range.clone(),
            geometry,
            cache: Arc::new(
                Cached::new(memory.clone(), store.clone())
                    .expect("the region's memory has the store's geometry"),
            ),
            pagemap: dup(&pagemap)?,
            readahead: 0,
            fetch_retry: opts.fetch_retry,
            written: None,
            events: events.clone(),
            counters: counters.clone(),
            pager: Some(pager.clone()),
            fault_wait: opts.fault_wait,
            signal: None,
            program: Some(program.pid),
        }));
        let tracker = Arc::new(Tracker::new(
            TrackingMode::Async,
            range,
            geometry,
            None,
            events,
            counters,
            area(base, len),
            pagemap,
        ));
        let forks = Arc::new(Forks::new(
            pager.clone(),
            store.clone(),
            base,
            registered.features,
            rt.clone(),
        ));
        if registered.features & sys::UFFD_FEATURE_EVENT_FORK != 0 {
            let forks = Arc::downgrade(&forks);
            let _ = server.fork.set(Box::new(move |child| {
                if let Some(forks) = forks.upgrade() {
                    forks.on_fork(child);
                }
            }));
        }
        let pusher = start_pusher(&memory, store, opts.push, &tracker, &rt)?;
        let reclaimer = connect_pager(&pager, &server, &pusher, Some(&opts.paging), &rt)?;
        let session = Arc::new(Session {
            space,
            pager,
            server: server.clone(),
            pusher,
            reader: Mutex::new(None),
            reclaimer: Mutex::new(reclaimer),
            forks,
        });
        let reader = Reader::spawn(server, rt)
            .map_err(|e| RegionError::sys("starting the fault reader", e))?;
        *session.reader.lock() = Some(reader);
        let watched = session.clone();
        let watcher = std::thread::Builder::new()
            .name("farmap-run-watch".into())
            .spawn(move || {
                if let Some(end) = watched.space.watch() {
                    watched.stop();
                    watched.space.finish(end);
                }
            })
            .map_err(|e| RegionError::sys("starting the program's watcher", e))?;
        Ok(ForeignRegion {
            session,
            watcher: Some(watcher),
            geometry,
            base,
        })
    }

    /// The region's shape (the store's).
    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    /// The page size (chunks are one page).
    pub fn page_size(&self) -> usize {
        self.session.server.range.page_size()
    }

    /// The region's address in the program.
    pub fn base(&self) -> usize {
        self.base
    }

    /// The program's pid.
    pub fn pid(&self) -> u32 {
        self.session.space.pid()
    }

    /// Always true: a program's region is bounded.
    pub fn is_paged(&self) -> bool {
        true
    }

    /// The region's counters (its handler is this process: [`HandlerLocation::Local`]).
    pub fn stats(&self) -> RegionStats {
        let s = &self.session;
        let mut stats = region_stats(
            &s.server,
            &s.pusher,
            Some(&s.pager),
            TrackingMode::Async,
            HandlerLocation::Local,
            None,
        );
        if stats.last_error.is_none() {
            stats.last_error = s.space.last_error();
        }
        stats
    }

    /// Pages present now, from the program's page tables: `(in the region, in its staging
    /// area)`.
    pub fn local_pages(&self) -> Option<Result<(u64, u64), RegionError>> {
        Some(
            self.session
                .pager
                .local_pages()
                .map_err(|e| RegionError::sys("PAGEMAP_SCAN of the program's pages", e)),
        )
    }

    /// Mapped chunks touched since the eviction clock last passed them (see
    /// [`Region::referenced_chunks`](crate::Region::referenced_chunks)).
    pub fn referenced_chunks(&self) -> u64 {
        self.session.pager.referenced_chunks()
    }

    /// Changes the bound on local memory (see [`Region::set_local_max`](crate::Region::set_local_max)).
    pub fn set_local_max(&self, limit: LocalLimit) -> bool {
        let g = self.geometry;
        self.session
            .pager
            .set_limit(limit.chunks(g.size(), u64::from(g.chunk_size())));
        true
    }

    /// Stages up to `max` chunks (see [`Region::deactivate`](crate::Region::deactivate)).
    pub fn deactivate(&self, max: u64) -> Option<u64> {
        Some(self.session.pager.deactivate(max))
    }

    /// Pauses the pager for a fork the program announced (its `ForkPrepare`): nothing it
    /// wrote moves or is dropped until the [`ForkPause`] ends, or, if the fork happens, until
    /// its child's heap is whole (see `foreign/fork.rs`). Blocks until nothing moves: call
    /// it outside the runtime.
    pub fn pause_for_fork(&self) -> ForkPause {
        let forks = self.session.forks.clone();
        let (id, done) = forks.prepare();
        ForkPause { forks, id, done }
    }

    /// The program's forks so far.
    pub fn fork_stats(&self) -> ForkStats {
        let c = &self.session.forks.counters;
        let get = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        ForkStats {
            forks: get(&c.forks),
            unpaused: get(&c.unpaused),
            failed: get(&c.failed),
            copied_bytes: get(&c.bytes),
            unshared_bytes: get(&c.unshared),
        }
    }

    /// How the session ended, once it has.
    pub fn ended(&self) -> Option<End> {
        self.session.space.ended()
    }

    /// Waits up to `timeout` for the session to end.
    pub fn wait_end(&self, timeout: Duration) -> Option<End> {
        self.session.space.wait_end(timeout)
    }
}

/// A fork announced by the program, its pager paused (see
/// [`ForeignRegion::pause_for_fork`]); dropping it ends the pause unless the fork's child is
/// being copied (which holds the pause until it is done).
pub struct ForkPause {
    forks: Arc<Forks>,
    id: u64,
    done: std::sync::mpsc::Receiver<Result<ForkCopy, String>>,
}

impl ForkPause {
    /// Whether the fork's event has not come yet.
    pub fn waiting_for_fork(&self) -> bool {
        self.forks.waiting(self.id)
    }

    /// How the child's copy went, once the fork's event came and the copy ended (`None`
    /// while not, after `timeout`): its bytes, or why it failed.
    pub fn wait_child(&self, timeout: Duration) -> Option<Result<ForkCopy, String>> {
        match self.done.recv_timeout(timeout) {
            Ok(r) => Some(r),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => None,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                Some(Err("the child's copy was abandoned".into()))
            }
        }
    }
}

impl Drop for ForkPause {
    fn drop(&mut self) {
        self.forks.unprepare(self.id);
    }
}

impl std::fmt::Debug for ForkPause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForkPause").field("id", &self.id).finish()
    }
}

/// A program's forks (see [`ForeignRegion::fork_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ForkStats {
    /// Fork events (children made whole, or tried).
    pub forks: u64,
    /// Of those, forks no `ForkPrepare` announced (copied from a later fence).
    pub unpaused: u64,
    /// Children whose copy failed (they are left to fault on zeros, or killed if they wait).
    pub failed: u64,
    /// Bytes copied into children.
    pub copied_bytes: u64,
    /// Bytes of the program's pages made its own again after its forks (so that they can
    /// leave memory).
    pub unshared_bytes: u64,
}

impl Drop for ForeignRegion {
    /// Stops serving; a program still running is killed first, and gone (or 5 s passed)
    /// before our userfaultfd copies close (see the module docs).
    fn drop(&mut self) {
        let s = &self.session;
        if let Some(mut r) = s.reader.lock().take() {
            r.stop();
        }
        if s.space.ended().is_none() {
            let _ = s.space.kill();
            s.space.wait_gone(KILL_WAIT);
        }
        s.space.stop_watch();
        if let Some(w) = self.watcher.take() {
            let _ = w.join();
        }
        // Nothing serves the program from here on, whether or not the watcher saw it go.
        s.space.end_serving();
        s.stop();
        if s.space.ended().is_none() {
            s.space.finish(End::Killed {
                why: "the region was dropped while the program ran".into(),
            });
        }
    }
}

impl std::fmt::Debug for ForeignRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForeignRegion")
            .field("pid", &self.pid())
            .field("base", &format_args!("{:#x}", self.base))
            .field("geometry", &self.geometry)
            .field("ended", &self.ended())
            .finish()
    }
}

/// Whether `registered` can be served over a store of `geometry` with `opts` (see
/// [`ForeignRegion::start`]).
fn check(
    registered: &Registered,
    geometry: Geometry,
    opts: &ForeignOptions,
) -> Result<(), RegionError> {
    let refuse = |reason: String| Err(RegionError::Foreign { reason });
    let page = sys::page_size() as u64;
    if registered.region_len != geometry.size() {
        return refuse(format!(
            "the program's region is {} bytes, the store {}",
            registered.region_len,
            geometry.size()
        ));
    }
    let staging_len = registered.region_len + trash_len(geometry);
    if registered.staging_len != staging_len {
        return refuse(format!(
            "the program's staging area is {} bytes, not {staging_len}",
            registered.staging_len
        ));
    }
    if u64::from(geometry.chunk_size()) != page {
        return refuse(format!(
            "chunks of {} bytes: a program's region is served in chunks of one page ({page})",
            geometry.chunk_size()
        ));
    }
    if !registered.region.is_multiple_of(page) || !registered.staging.is_multiple_of(page) {
        return refuse("the program's areas are not page-aligned".into());
    }
    let (r, s) = (registered.region, registered.staging);
    if r < s + staging_len && s < r + registered.region_len {
        return refuse("the program's region and staging area overlap".into());
    }
    let f = registered.features;
    if f & FOREIGN_FEATURES != FOREIGN_FEATURES {
        return refuse(format!(
            "the program's userfaultfd lacks features {:#x}",
            FOREIGN_FEATURES & !f
        ));
    }
    if f & FOREIGN_REFUSED_FEATURES != 0 {
        return refuse(format!(
            "the program's userfaultfd has features {:#x}, which are not served",
            f & FOREIGN_REFUSED_FEATURES
        ));
    }
    if opts.paging.in_thread {
        return refuse("in-thread fault resolution is for regions of this process".into());
    }
    if opts.remove != RemoveMeans::Zero {
        return refuse("a program's discarded pages can only mean zeros".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registered(g: Geometry) -> Registered {
        Registered {
            region: 0x1000_0000,
            region_len: g.size(),
            staging: 0x2000_0000,
            staging_len: g.size() + trash_len(g),
            features: FOREIGN_FEATURES | sys::UFFD_FEATURE_THREAD_ID,
        }
    }

    #[test]
    fn areas_and_features_that_do_not_fit_are_refused_with_why() {
        let page = sys::page_size() as u64;
        let g = Geometry::new(256 * page, page).unwrap();
        let opts = ForeignOptions::default();
        assert!(check(&registered(g), g, &opts).is_ok());
        let cases: Vec<(Registered, Geometry, &str)> = vec![
            (
                Registered {
                    region_len: 128 * page,
                    ..registered(g)
                },
                g,
                "bytes, the store",
            ),
            (
                Registered {
                    staging_len: g.size(),
                    ..registered(g)
                },
                g,
                "staging area is",
            ),
            (
                registered(Geometry::new(256 * page, 2 * page).unwrap()),
                Geometry::new(256 * page, 2 * page).unwrap(),
                "chunks of one page",
            ),
            (
                Registered {
                    region: 0x1000_0010,
                    ..registered(g)
                },
                g,
                "page-aligned",
            ),
            (
                Registered {
                    staging: 0x1000_0000 + 4 * page,
                    ..registered(g)
                },
                g,
                "overlap",
            ),
            (
                Registered {
                    features: FOREIGN_FEATURES & !sys::UFFD_FEATURE_WP_ASYNC,
                    ..registered(g)
                },
                g,
                "lacks features",
            ),
            (
                Registered {
                    features: FOREIGN_FEATURES | sys::UFFD_FEATURE_SIGBUS,
                    ..registered(g)
                },
                g,
                "not served",
            ),
        ];
        for (r, g, why) in cases {
            match check(&r, g, &opts) {
                Err(RegionError::Foreign { reason }) => {
                    assert!(reason.contains(why), "{reason:?} lacks {why:?}")
                }
                other => panic!("{r:?}: {other:?}"),
            }
        }
        let mut in_thread = opts.clone();
        in_thread.paging.in_thread = true;
        assert!(check(&registered(g), g, &in_thread).is_err());
        let refetch = ForeignOptions {
            remove: RemoveMeans::Refetch,
            ..opts
        };
        assert!(check(&registered(g), g, &refetch).is_err());
    }

    #[test]
    fn four_fds_in_order_or_a_refusal() {
        let fds: Vec<OwnedFd> = (0..3)
            .map(|_| std::fs::File::open("/dev/null").unwrap().into())
            .collect();
        assert!(ForeignFds::try_from(fds).is_err());
        let fds: Vec<OwnedFd> = (0..4)
            .map(|_| std::fs::File::open("/dev/null").unwrap().into())
            .collect();
        assert!(ForeignFds::try_from(fds).is_ok());
    }
}
