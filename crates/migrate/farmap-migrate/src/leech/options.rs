//! What a leech is given and what it returns: the destination's opener, the options, the
//! errors and the report.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use farmap_core::{BoxFuture, Geometry, GeometryError, StoreError};
use farmap_net::auth::Key;
use farmap_net::{RemoteAddr, TlsClientConfig};
use farmap_pipeline::{PushOptions, RetryPolicy};
use farmap_uffd::{Region, RegionMode, RegionOptions};

use crate::auth::LeecherAuthError;
use crate::budget::PullBudget;
use crate::endpoint::EndpointError;
use crate::event::Observer;
use crate::machine::{AbortCause, Convergence, Finalization};
use crate::msg::Mode;
use crate::view::MigrationStore;

/// Called at the hand-over with the region and the application state: starts the
/// application at the destination. It must return quickly (it is inside the downtime).
pub type Resumer<D = Region> = Box<dyn FnOnce(Arc<D>, Bytes) + Send>;

/// What a destination is opened with, once the seeder has described the region.
#[derive(Debug, Clone)]
pub struct OpenContext {
    /// Size and chunk size.
    pub geometry: Geometry,
    /// The seeder's page size (the unit of dirty sets).
    pub page_size: u32,
    /// How long a fetch should keep retrying a lost seeder (the runner's reconnect time).
    pub reconnect_for: Duration,
    /// How the region moves (an instant destination lives in the shared store from the
    /// hand-over on, and should push its writes there in the background).
    pub mode: Mode,
    /// Instant mode: the shared store's spec as opened here (what the region should give as
    /// its store spec, so that it can move on the same way).
    pub shared: Option<String>,
}

/// Opens the store an instant migration's chunks live in, given the spec the seeder
/// announced (the caller may ignore it and open another, e.g. with its own credentials).
#[derive(Clone)]
pub struct SharedOpener(
    #[allow(clippy::type_complexity)]
    pub  Arc<
        dyn Fn(String) -> BoxFuture<'static, Result<Arc<dyn farmap_core::Store>, EndpointError>>
            + Send
            + Sync,
    >,
);

impl std::fmt::Debug for SharedOpener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SharedOpener")
    }
}

/// Opens the destination over the store of the seeder's pages (called once the seeder has
/// answered, before pre-copy). The destination must not let the application in before the
/// [`Resumer`] is called.
pub type Opener<D> = Box<
    dyn FnOnce(
            Arc<MigrationStore>,
            OpenContext,
        ) -> BoxFuture<'static, Result<Arc<D>, EndpointError>>
        + Send,
>;

/// The [`Opener`] of a userfaultfd region (direct mode, over the migration store).
pub fn region_opener() -> Opener<Region> {
    Box::new(|store, ctx| {
        Box::pin(async move {
            let ropts = RegionOptions {
                mode: RegionMode::Direct,
                push: PushOptions {
                    // An instant destination lives in the shared store: it pushes there as
                    // any region does. Otherwise the region keeps its chunks itself.
                    interval: (ctx.mode == Mode::Instant).then(|| Duration::from_secs(1)),
                    ..PushOptions::default()
                },
                worker_threads: 2,
                // A fault on a page still at the source waits out a lost connection for as
                // long as the runner tries to reconnect, instead of failing the application
                // with SIGBUS.
                fetch_retry: RetryPolicy::for_at_least(ctx.reconnect_for),
                store_spec: ctx.shared.clone(),
                ..RegionOptions::default()
            };
            let s2: Arc<dyn farmap_core::Store> = store;
            let region = tokio::task::spawn_blocking(move || Region::open(s2, ropts)).await??;
            Ok(Arc::new(region))
        })
    })
}

/// How to leech.
#[derive(Debug, Clone)]
pub struct LeechOptions {
    /// The seeder's control address.
    pub from: RemoteAddr,
    /// The data plane's address; by default the control host with the port the seeder gives.
    pub data: Option<RemoteAddr>,
    /// TLS (or mutual TLS) for both connections.
    pub tls: Option<TlsClientConfig>,
    /// When to stop pre-copy rounds.
    pub convergence: Convergence,
    /// Background pull workers.
    pub pull_workers: usize,
    /// Data plane connections.
    pub connections: usize,
    /// How long to keep trying to reconnect after the hand-over.
    pub reconnect_for: Duration,
    /// How long the seeder has to accept the connection (and TLS) and to answer the hello.
    pub handshake_timeout: Duration,
    /// How long the seeder has, after `Finalize`, to hand over: a seeder that stays silent
    /// (or a connection that is half open) is treated as lost then, instead of being waited
    /// for forever.
    pub finalize_timeout: Duration,
    /// Largest region accepted, in bytes.
    pub max_size: u64,
    /// Log progress lines (through `tracing`).
    pub log: bool,
    /// Receives progress events.
    pub observer: Option<Observer>,
    /// What the pre-copy may take from the source's application: this process's threads
    /// run at its priority until the hand-over (the application does not run here before),
    /// and the pull keeps to its rate and CPU share.
    pub pull: PullBudget,
    /// How the region moves.
    pub mode: Mode,
    /// Opens the shared store of an instant migration (required for [`Mode::Instant`]).
    pub shared: Option<SharedOpener>,
    /// The operator's migration key, which the seeder must prove it holds and this leecher
    /// proves to it (see [`crate::auth`]); by default [`crate::auth::process_key`], which
    /// only a seeder in this process holds.
    pub key: Key,
}

impl LeechOptions {
    /// Defaults for leeching from `from`.
    pub fn new(from: RemoteAddr) -> Self {
        Self {
            from,
            data: None,
            tls: None,
            convergence: Convergence::default(),
            pull_workers: 16,
            connections: 4,
            reconnect_for: Duration::from_secs(30),
            handshake_timeout: Duration::from_secs(10),
            finalize_timeout: Duration::from_secs(60),
            max_size: 1 << 40,
            log: false,
            observer: None,
            pull: PullBudget::default(),
            mode: Mode::Precopy,
            shared: None,
            key: crate::auth::process_key(),
        }
    }
}

/// Why the control connection could not be set up (nothing was taken from the source).
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The connection could not be made.
    #[error("the connection failed")]
    Io(#[source] io::Error),
    /// TLS failed (or the seeder refused this client's certificate).
    #[error("{reason}")]
    Tls {
        /// Why, as a sentence.
        reason: String,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// The seeder accepted the connection and said nothing.
    #[error(
        "the seeder accepted the connection but did not answer the hello within {waited:?} (is it \
         a farmap seeder? does it expect TLS?)"
    )]
    Silent {
        /// How long it was given.
        waited: Duration,
    },
    /// The seeder closed the connection without answering.
    #[error(
        "the seeder closed the connection without answering the hello ({})",
        if *tls { "is it a farmap seeder? does it require a client certificate?" }
        else { "is it a farmap seeder? if it uses TLS, connect with a CA (--tls-ca)" }
    )]
    Closed {
        /// Whether this leecher used TLS.
        tls: bool,
    },
    /// The seeder answered the hello with a refusal.
    #[error("the seeder refused: {reason}")]
    Refused {
        /// The seeder's reason.
        reason: String,
    },
    /// The seeder's answer is not a migration message.
    #[error("the seeder's answer is not a migration message")]
    Garbage(#[source] io::Error),
    /// The seeder did not prove it holds the migration key.
    #[error("authentication failed")]
    Auth(#[source] LeecherAuthError),
}

/// Why the destination region could not be opened (nothing was taken from the source).
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The data plane could not be reached.
    #[error("connecting the data plane at {addr} failed")]
    DataPlane {
        /// Where.
        addr: String,
        /// Why.
        #[source]
        source: StoreError,
    },
    /// The data plane serves another region than the seeder described.
    #[error("the data plane at {addr} serves {got:?}, the seeder announced {want:?}")]
    Mismatch {
        /// Where.
        addr: String,
        /// What it serves.
        got: Geometry,
        /// What the Welcome said (pages as chunks).
        want: Geometry,
    },
    /// The seeder's geometry is not one a region can have.
    #[error("the region's geometry is invalid")]
    Geometry(#[source] GeometryError),
    /// The region could not be opened.
    #[error("opening the region failed")]
    Open(#[source] EndpointError),
    /// Opening the region panicked.
    #[error("opening the region panicked")]
    Task(#[source] tokio::task::JoinError),
    /// An instant migration, and this leecher cannot open the shared store.
    #[error(
        "an instant migration needs the shared store {spec:?}, and this leecher was given no \
         way to open it"
    )]
    NoSharedOpener {
        /// The spec the seeder announced.
        spec: String,
    },
    /// The shared store could not be opened.
    #[error("opening the shared store failed")]
    Shared(#[source] EndpointError),
}

/// What failed after the hand-over (the application runs here; chunks not yet fetched are
/// lost if the seeder does not come back).
#[derive(Debug, thiserror::Error)]
pub enum AfterHandOver {
    /// Discarding the pages written at the source failed.
    #[error("discarding the pages written at the source failed")]
    Discard(#[source] EndpointError),
    /// The control connection could not be made again.
    #[error("could not reconnect within {waited:?}")]
    Reconnect {
        /// How long it tried.
        waited: Duration,
        /// The last attempt's error.
        #[source]
        source: io::Error,
    },
    /// The seeder failed or broke the protocol.
    #[error("the seeder failed")]
    Seeder(#[source] AbortCause),
}

/// Why leeching failed.
#[derive(Debug, thiserror::Error)]
pub enum LeechError {
    /// The seeder could not be reached, or did not answer the hello.
    #[error("cannot reach the seeder at {addr}")]
    Connect {
        /// Where.
        addr: String,
        /// Why.
        #[source]
        source: ConnectError,
    },
    /// Opening the destination region failed (nothing was taken from the source).
    #[error("opening the destination region failed")]
    Region(#[source] OpenError),
    /// The migration was abandoned before the hand-over: the source runs on.
    #[error(
        "migration aborted{}",
        connection.as_ref().map(|e| format!(" (the control connection failed: {e})")).unwrap_or_default()
    )]
    Aborted {
        /// Why.
        #[source]
        cause: AbortCause,
        /// The control connection's error, if it failed.
        connection: Option<io::Error>,
    },
    /// Cancelled before the hand-over: the source runs on.
    #[error("migration cancelled before the hand-over; the source keeps running")]
    Cancelled,
    /// After the hand-over, the seeder could not be reached again: chunks not yet fetched
    /// are lost.
    #[error("lost the seeder after the hand-over")]
    LostAfterHandOver(#[source] AfterHandOver),
    /// After `Finalize` and before the hand-over, the seeder went silent or away and could
    /// not be reached again: nothing was resumed here (the source resumes by itself).
    #[error("lost the seeder after Finalize, before it handed over: nothing was resumed here")]
    LostAtFinalize(#[source] AfterHandOver),
}

/// A finished migration, as the destination saw it.
#[derive(Debug)]
pub struct LeechReport<D = Region> {
    /// The region, now owned here and detached from the seeder.
    pub region: Arc<D>,
    /// Suspend → resume (across hosts of one boot; otherwise Finalize sent → resume).
    pub downtime: Duration,
    /// The downtime budget it was given.
    pub max_downtime: Duration,
    /// Why pre-copy stopped.
    pub finalization: Finalization,
    /// First hello → complete.
    pub total: Duration,
    /// Bytes fetched before the hand-over.
    pub bytes_precopy: u64,
    /// Bytes fetched after it.
    pub bytes_postcopy: u64,
    /// Dirty rounds before the hand-over.
    pub rounds: u32,
    /// Pages written at the source during the migration (all dirty sets).
    pub dirty_pages: u64,
    /// Pages written per second at the source, in bytes, over the tracked time.
    pub dirty_rate: f64,
    /// Pages in the final (hand-over) set.
    pub final_pages: u64,
    /// Resume → everything local.
    pub postcopy: Duration,
    /// How the region moved.
    pub mode: Mode,
    /// Bytes received before the application resumed here (pages and control messages).
    pub bytes_before_resume: u64,
    /// Instant mode: what was read from where, and what failed its check.
    pub instant: crate::view::InstantCounts,
    /// Instant mode, the source lost after the hand-over: the chunks (ascending) that only
    /// it held and that read as the shared store's last version holds them.
    pub rolled_back: Vec<u64>,
}

impl<D> LeechReport<D> {
    /// Whether pre-copy converged: the last round's set fit the downtime budget (not merely
    /// `max_rounds` reached or rounds that stopped shrinking).
    pub fn converged(&self) -> bool {
        matches!(
            self.finalization,
            Finalization::Converged | Finalization::NoPreCopy
        )
    }

    /// Whether the downtime exceeded its budget.
    pub fn over_budget(&self) -> bool {
        self.downtime > self.max_downtime
    }
}
