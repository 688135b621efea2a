//! farmap's userfaultfd frontend: a [`Region`] of plain memory whose chunks are fetched from
//! a [`Store`](farmap_core::Store) on first touch, whose written pages are tracked and pushed
//! back, and whose fault handling can move to another process.
//!
//! ```text
//!   application threads                    region (this crate)
//!   ───────────────────                    ───────────────────
//!   load/store on region memory ─ fault ─▶ reader thread ── events first (REMOVE: chunks
//!     (anonymous mapping, registered        │               absent again), then faults:
//!      MISSING | WP, MADV_DONTFORK)         │ poll once inline, else spawn
//!                                           ▼
//!                 ┌──────── region runtime (tokio, own threads) ─────────┐
//!                 │ Cached<RegionMemory, store>: one fetch per chunk,    │
//!                 │   however many faults and pull workers want it;      │
//!                 │   RegionMemory::write = UFFDIO_COPY | MODE_WP        │
//!                 │ Puller (managed): background fill, faulted chunks    │
//!                 │   and the next few jump the queue                    │
//!                 │ Pusher: every interval and at sync(), collects       │
//!                 │   written pages (the region is its DirtySource:      │
//!                 │   PAGEMAP_SCAN, WP_ASYNC) and writes their chunks,   │
//!                 │   read out of the memory on blocking threads         │
//!                 └──────────────────────────────────────────────────────┘
//! ```
//!
//! # Kernel behaviour relied on (verified on Linux 6.18 by the research prototype)
//! - Chunks are installed whole with `UFFDIO_COPY` in write-protect mode, so that only real
//!   writes count as written; the first write to a page then costs ≈ 1 µs, resolved in the
//!   kernel (`UFFD_FEATURE_WP_ASYNC`). Chunks that are all zeros are copied in the same way
//!   from the store's zero chunk: `UFFDIO_ZEROPAGE` is not atomic with write protection
//!   (a write between zero-fill and protection would be lost), fails with `EEXIST` on pages
//!   that carry a write-protect marker, and its pages are reported as written.
//! - `EEXIST` (a page already present) and partial copies continue page by page; `EAGAIN`
//!   with nothing copied means a remove event is pending: the copy waits until the reader has
//!   read it. `ENOENT` means the region is gone.
//! - `madvise(MADV_DONTNEED)` blocks the caller until its `UFFD_EVENT_REMOVE` is read; the
//!   reader handles events before faults, and makes the touched chunks absent again.
//! - `PAGEMAP_SCAN` with `PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC` returns written pages
//!   and re-protects them atomically with respect to writers. It also reports pages without
//!   data (never touched, discarded, poisoned) as written: only present or swapped pages count.
//! - Where `WP_ASYNC` is missing (or [`WriteTracking::SyncFaults`] is asked for), each first
//!   write faults to the reader, which unprotects the page and records it.
//! - `UFFDIO_POISON` on the faulting page makes the faulting thread get SIGBUS: what happens
//!   when a fetch keeps failing. Never a hang, never zeros in place of data.
//! - Closing the last userfaultfd of a region lets blocked faults through as zero pages and
//!   silently unregisters it, so a region is always unmapped before its fd is closed.
//!
//! # Aliasing contract
//! The region is plain memory shared with farmap's own threads, which only (a) fill pages
//! that are missing, (b) read pages to push them, and (c) change their write protection.
//! Safe code reaches the region's memory only through [`Region::memory`], a [`RegionSlice`]
//! whose accesses are volatile and bounds-checked (as vm-memory's `VolatileSlice`), so that
//! no Rust reference ever covers bytes that other threads, fetches or discards change.
//! Plain slices of it ([`RegionSlice::as_slice`], [`RegionSlice::as_mut_slice`]) are
//! `unsafe`, with the contract they need written down. Region memory copies that can fault
//! never run on the region runtime's async workers (pushes read it on blocking threads, and
//! scans run as blocking work). A push may read a page while the application writes it;
//! the write is then reported by the next scan and pushed again, so after a final
//! [`Region::sync`] the store holds the memory's content.
//!
//! # Bounded local memory
//! With [`RegionOptions::paging`] a region holds at most a limit of chunks locally (mapped
//! or staged with `UFFDIO_MOVE`), evicts the rest to the store (written chunks are written
//! back first) and reclaims ahead of faults on its own thread; the limit can change at run
//! time ([`Region::set_local_max`]). The states, the eviction policy and why it was chosen
//! are documented in the `paging` module (`src/paging/mod.rs`).
//!
//! # Waiting for faults
//! By default the readers sleep in `poll(2)` between faults ([`FaultWait::Sleep`]), one per
//! CPU the process may run on, each kept to its CPU: a fault is read by the reader of the
//! faulting thread's CPU, which runs as soon as that thread sleeps, and whose copy wakes the
//! thread on the same CPU. On a VM whose idle virtual CPUs halt, a single reader on another
//! CPU would pay two wake-ups of a halted CPU per round trip (the reader's and the faulting
//! thread's); here that took a 4 KiB fault from about 50 µs to about 10 µs. A reader whose
//! CPU has no faulting thread rests ([`RegionStats::reader_rests`]; see `src/server.rs`).
//! [`FaultWait::Poll`] instead keeps one reader reading without sleeping for a bounded
//! window after each batch, and keeps every CPU awake meanwhile with one `SCHED_IDLE`
//! companion thread per CPU; [`RegionStats::faults_polled`] and
//! [`RegionStats::faults_slept`] say which path found each fault, and
//! [`RegionStats::handler_cpu`] what it cost. See the `polling` module (`src/polling.rs`).
//!
//! A bounded region can go further for its staged chunks ([`PagingOptions::in_thread`]):
//! its userfaultfd raises `SIGBUS` in the faulting thread, whose handler moves a staged
//! chunk back itself (one `UFFDIO_MOVE`, no other thread involved) and posts any other fault
//! to the reader; [`RegionStats::faults_in_thread`] counts the first kind. Kernel-mode
//! accesses to missing pages then fail with `EFAULT` rather than wait: see the `signal`
//! module (`src/signal.rs`).
//!
//! # fork()
//! The region is marked `MADV_DONTFORK`: a child process does not inherit it, and touching
//! its addresses in the child raises SIGSEGV (rather than silently reading zeros for pages
//! never fetched). The parent's region, handler and tracking are unaffected.
//!
//! # Hand-over
//! [`handover::send`] gives the region's userfaultfd to another process running
//! [`handover::serve`]; if that process stops or dies, the owner takes faults back and wakes
//! every blocked thread. See [`handover`] for the message layout.
//!
//! # Clean pages shared between regions
//! Regions over stores with one base (forks of one version of a `versioned:` region, or
//! openings of one version: [`farmap_core::MemoryBase`]) keep one copy of each clean chunk in
//! memory: the region is a private mapping of the base's file on tmpfs, registered for minor
//! faults too; a chunk of the base is written into the file once (checked against the base's
//! hash) and mapped with `UFFDIO_CONTINUE`, a write makes a private copy of its page, and
//! anything else is copied in privately as usual. On by default
//! ([`RegionOptions::share_clean_pages`]); [`Region::memory_use`] and
//! [`RegionStats::shared`] say what it saves. See the `shared` module (`src/shared.rs`).
//!
//! # Where the `unsafe` code is
//! Five files, every other module is `#[forbid(unsafe_code)]`:
//! - `sys.rs`: the raw kernel interface (its private `ioctl`, and `pagemap_scan`, its safe
//!   `PAGEMAP_SCAN` form);
//! - `uffd.rs`: opening a userfaultfd and its ioctls ([`uffd::Uffd::register`] is the one
//!   `unsafe fn` whose contract makes the others safe);
//! - `mapping.rs`: mapping, registering, discarding and unmapping the region's memory, and
//!   making [`RegionSlice`]s of it;
//! - `signal.rs`: the `SIGBUS` handler of in-thread fault resolution (`sigaction`, `futex`);
//! - `shared.rs`: the shared mapping of a shared base's bitmap (atomics other processes see).
//!
//! Region memory is reached through `farmap-memory`'s [`RegionSlice`] (volatile,
//! bounds-checked accesses), the layer that FUSE and NBD mounts share; scheduling classes
//! and `sync_file_range` live there too.
//!
//! eventfd, poll, mmap, madvise and `SCM_RIGHTS` go through `rustix`.
#![warn(missing_docs)]

#[forbid(unsafe_code)]
mod bounded;
mod error;
#[forbid(unsafe_code)]
pub mod foreign;
#[forbid(unsafe_code)]
pub mod handover;
#[forbid(unsafe_code)]
mod live;
mod mapping;
#[forbid(unsafe_code)]
mod memory;
#[forbid(unsafe_code)]
mod options;
#[forbid(unsafe_code)]
pub mod pagemap;
#[forbid(unsafe_code)]
mod paging;
#[forbid(unsafe_code)]
mod polling;
#[forbid(unsafe_code)]
mod region;
#[forbid(unsafe_code)]
mod server;
mod shared;
mod signal;
#[forbid(unsafe_code)]
mod space;
#[forbid(unsafe_code)]
mod stats;
pub mod sys;
#[forbid(unsafe_code)]
mod tracking;
pub mod uffd;

pub use bounded::BoundedRegion;
pub use error::{RegionError, Unsupported};
/// The volatile view of region memory ([`Region::memory`]), from `farmap-memory`.
pub use farmap_memory::{RegionSlice, SliceError};
pub use options::{
    FaultWait, LocalLimit, PagingOptions, Prefetch, RegionMode, RegionOptions, RemoveMeans,
    TrackingMode, WriteTracking, DEFAULT_PREFETCH_CHUNKS, PAGING_CHUNK_SIZE,
};
pub use polling::{idle_companions, KeepAwake};
pub use region::{probe, probe_paging, Diagnostics, Region, Support};
pub use shared::default_shared_dir;
pub use stats::{
    DirtyReport, HandlerCpu, HandlerLocation, MemoryUse, PagingStats, RegionStats, SharedStats,
};
