//! The leecher's runner: opens the destination region over the seeder's data plane, drives a
//! [`Leecher`] over the control connection, resumes the application at the hand-over and
//! finishes the post-copy.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::io;

use crate::auth::{LeecherAuthError, Proven};
use bytes::Bytes;
use farmap_core::BoxFuture;
use farmap_core::{error_chain, ChunkIdx, Geometry, GeometryError, StoreError};
use farmap_net::auth::Key;
use farmap_net::{ClientOptions, RemoteAddr, RemoteStore, TlsClientConfig};
use farmap_pipeline::{PushOptions, RetryPolicy};
use farmap_uffd::{Region, RegionMode, RegionOptions};
use futures::StreamExt;
use tokio::sync::mpsc;

use crate::budget::{Pacer, PullBudget, PullPriority};
use crate::channel::{connect, Channel, Sender};
use crate::endpoint::{Destination, EndpointError};
use crate::event::{Event, Observer, Reporter};
use crate::machine::{
    AbortCause, Confirm, Convergence, Finalization, Leecher, LeecherAction, LeecherInput,
    LeecherLimits, Manifest, RoundResult,
};
use crate::msg::{run_pages, Location, Mode, Msg, RegionInfo};
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

/// The chunks holding pages of `runs` (checked runs: ascending, within the region),
/// ascending, each once.
fn chunks_of(runs: &[Range<u64>], page: u64, chunk: u64) -> Vec<ChunkIdx> {
    let mut out: Vec<ChunkIdx> = Vec::new();
    for r in runs {
        if r.start >= r.end {
            continue;
        }
        let a = r.start.saturating_mul(page) / chunk;
        let b = r.end.saturating_mul(page).saturating_sub(1) / chunk;
        let from = out.last().map_or(a, |l| a.max(l.0 + 1));
        out.extend((from..=b).map(ChunkIdx));
    }
    out
}

/// The parts of checked `runs` inside pages `lo..hi`.
fn clip(runs: &[Range<u64>], lo: u64, hi: u64) -> Vec<Range<u64>> {
    let first = runs.partition_point(|r| r.end <= lo);
    runs[first..]
        .iter()
        .take_while(|r| r.start < hi)
        .map(|r| r.start.max(lo)..r.end.min(hi))
        .collect()
}

struct Dest<D> {
    region: Arc<D>,
    store: Arc<MigrationStore>,
    page: u64,
    chunk: u64,
}

impl<D: Destination> Dest<D> {
    /// Discards the pages the source changed since they were copied (they fault in again).
    async fn discard(&self, runs: &[Range<u64>]) -> Result<(), LeechError> {
        self.store.note_discarded(runs);
        // madvise waits for the fault handler to read each remove event: a blocking
        // thread's work, not an async worker's.
        let (region, discard) = (self.region.clone(), runs.to_vec());
        tokio::task::spawn_blocking(move || region.discard_pages(&discard))
            .await
            .unwrap_or_else(|e| Err(e.into()))
            .map_err(|e| LeechError::LostAfterHandOver(AfterHandOver::Discard(e)))
    }
}

/// Connects the control channel and says hello, within the handshake deadline; returns the
/// channel and the seeder's first answer (a `Welcome` for the machine to check).
async fn handshake(opts: &LeechOptions, hello: &Msg) -> Result<(Channel, Msg, Proven), LeechError> {
    let fail = |source| LeechError::Connect {
        addr: opts.from.to_string(),
        source,
    };
    let sent_cert = opts.tls.as_ref().is_some_and(|t| t.has_client_cert());
    let classify = |e: io::Error| match farmap_net::describe_client_tls_failure(&e, sent_cert) {
        Some(reason) => ConnectError::Tls {
            reason: tls_hint(&e, reason),
            source: e,
        },
        None if e.kind() == io::ErrorKind::InvalidData => ConnectError::Garbage(e),
        None => ConnectError::Io(e),
    };
    let wait = opts.handshake_timeout;
    let mut ch = connect(&opts.from, opts.tls.as_ref(), wait)
        .await
        .map_err(|e| fail(classify(e)))?;
    // A connection that ends (or is reset) while shaking hands: a TLS refusal if TLS says
    // so, else the seeder closed it.
    let io_failure = |e: io::Error| {
        let closed = e.kind() == io::ErrorKind::UnexpectedEof || is_reset(&e);
        if closed && farmap_net::describe_client_tls_failure(&e, sent_cert).is_none() {
            ConnectError::Closed {
                tls: opts.tls.is_some(),
            }
        } else {
            classify(e)
        }
    };
    let answer = tokio::time::timeout(wait, async {
        let proven = crate::auth::leecher(&mut ch, &opts.key, 0)
            .await
            .map_err(|e| match e {
                LeecherAuthError::Refused(reason) => ConnectError::Refused { reason },
                LeecherAuthError::Io(e) => io_failure(e),
                e => ConnectError::Auth(e),
            })?;
        ch.send(hello).await.map_err(io_failure)?;
        match ch.recv().await.map_err(io_failure)? {
            None => Err(ConnectError::Closed {
                tls: opts.tls.is_some(),
            }),
            Some(Msg::Abort { reason }) => Err(ConnectError::Refused { reason }),
            Some(m) => Ok((m, proven)),
        }
    })
    .await
    .map_err(|_| fail(ConnectError::Silent { waited: wait }))?;
    let (m, proven) = answer.map_err(fail)?;
    Ok((ch, m, proven))
}

fn is_reset(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionAborted
    )
}

/// Adds what a TLS failure most likely means when the seeder answered in plain text.
fn tls_hint(e: &io::Error, reason: String) -> String {
    let plain = e
        .get_ref()
        .and_then(|i| i.downcast_ref::<rustls::Error>())
        .is_some_and(|t| matches!(t, rustls::Error::InvalidMessage(_)));
    if plain {
        format!("{reason} (the seeder does not seem to use TLS: connect without --tls-ca)")
    } else {
        reason
    }
}

/// Migrates a region here. `cancel` turning true before the hand-over abandons the migration
/// (the source runs on); `resume` starts the application at the hand-over.
///
/// The driver: it feeds the [`Leecher`] machine what happens (messages, task results) and
/// carries out its actions; the long work runs in named tasks (`bulk_pull`,
/// `refresh_round`, `post_copy`) that report back as machine inputs.
pub async fn leech(
    opts: LeechOptions,
    resume: Resumer,
    cancel: tokio::sync::watch::Receiver<bool>,
) -> Result<LeechReport, LeechError> {
    leech_into(opts, region_opener(), resume, cancel).await
}

/// Migrates a region here into the destination `open` makes (see [`leech`]).
pub async fn leech_into<D: Destination>(
    opts: LeechOptions,
    open: Opener<D>,
    resume: Resumer<D>,
    mut cancel: tokio::sync::watch::Receiver<bool>,
) -> Result<LeechReport<D>, LeechError> {
    let started = Instant::now();
    let mut machine = new_machine(&opts);
    let hello = match machine.start().pop() {
        Some(LeecherAction::Send(m)) => m,
        _ => Msg::Hello {
            session: 0,
            mode: opts.mode,
        },
    };
    let (ch, welcome, proven) = handshake(&opts, &hello).await?;
    let received = ch.received();
    let opts_pull = opts.pull;
    let (tx, rx) = ch.split();
    let (work_tx, mut work_rx) = mpsc::unbounded_channel::<LeecherInput>();
    let mut run = Run {
        rep: Reporter {
            prefix: "farmap leech",
            log: opts.log,
            observer: opts.observer.clone(),
        },
        opts,
        tx,
        rx,
        connected: true,
        work: work_tx,
        dest: None,
        resume: Some(resume),
        open: Some(open),
        started,
        finalize_sent: None,
        finalize_by: None,
        tracking_since: None,
        resumed_at: None,
        downtime: Duration::ZERO,
        dirty_pages: 0,
        final_pages: 0,
        handed_over: false,
        last_error: None,
        seeder_boot: [0; 16],
        lost_since: None,
        answer_by: None,
        postcopy: None,
        lowered: false,
        pacer: Arc::new(Pacer::new(&opts_pull)),
        received,
        bytes_before_resume: 0,
        manifest: None,
        awake: None,
        session_key: proven.session_key,
    };
    let mut queue: VecDeque<LeecherAction> = machine.step(LeecherInput::Received(welcome)).into();
    loop {
        while let Some(action) = queue.pop_front() {
            if let Some(done) = run.act(action, &mut machine, &mut queue).await? {
                return Ok(done);
            }
        }
        let Some(input) = run.next_input(&mut work_rx, &mut cancel).await? else {
            continue;
        };
        queue.extend(machine.step(input));
    }
}

/// The machine for `opts`, accepting regions of this host's page size.
fn new_machine(opts: &LeechOptions) -> Leecher {
    let page_size = u32::try_from(rustix::param::page_size()).unwrap_or(u32::MAX);
    Leecher::new(
        opts.convergence,
        LeecherLimits {
            max_size: opts.max_size,
            ..LeecherLimits::new(page_size)
        },
    )
    .with_mode(opts.mode)
}

/// The leecher's side of one migration, between the machine's actions.
struct Run<D> {
    opts: LeechOptions,
    rep: Reporter,
    tx: Sender,
    rx: mpsc::Receiver<io::Result<Msg>>,
    connected: bool,
    /// Where the tasks report (as machine inputs).
    work: mpsc::UnboundedSender<LeecherInput>,
    dest: Option<Dest<D>>,
    resume: Option<Resumer<D>>,
    open: Option<Opener<D>>,
    started: Instant,
    finalize_sent: Option<Instant>,
    /// When the seeder must have handed over, once `Finalize` is sent.
    finalize_by: Option<tokio::time::Instant>,
    tracking_since: Option<Instant>,
    resumed_at: Option<Instant>,
    downtime: Duration,
    dirty_pages: u64,
    final_pages: u64,
    handed_over: bool,
    /// Why the control connection ended, if it failed.
    last_error: Option<io::Error>,
    seeder_boot: [u8; 16],
    /// When the control connection was lost after the hand-over (until a message arrives).
    lost_since: Option<Instant>,
    /// After a reconnect: when the seeder must have answered the hello.
    answer_by: Option<tokio::time::Instant>,
    /// The post-copy task: it ends with the migration, however the migration ends.
    postcopy: Option<tokio::task::AbortHandle>,
    /// Whether this process's threads run at the pull's priority (until the hand-over).
    lowered: bool,
    /// Keeps the pre-copy within its rate and CPU share.
    pacer: Arc<Pacer>,
    /// Bytes of control frames received on the first connection.
    received: Arc<std::sync::atomic::AtomicU64>,
    bytes_before_resume: u64,
    /// Instant mode: the manifest installed (its runs give the order of the fetches).
    manifest: Option<Manifest>,
    /// Keeps this host's CPUs awake from the request for the hand-over until it arrives.
    awake: Option<farmap_uffd::KeepAwake>,
    /// The session's key: reconnects prove it, and so does the data plane's client.
    session_key: Key,
}

impl<D> Run<D> {
    /// Keeps the CPUs awake for at most [`HANDOVER_AWAKE`] (see [`farmap_uffd::KeepAwake`]);
    /// without it (no threads to spare), the hand-over only waits for a CPU's wake-up.
    fn keep_awake(&mut self) {
        if self.awake.is_none() {
            match farmap_uffd::KeepAwake::new() {
                Ok(a) => self.awake = Some(a),
                Err(e) => {
                    tracing::debug!(error = %e, "cannot keep the CPUs awake for the hand-over");
                    return;
                }
            }
        }
        if let Some(a) = &self.awake {
            a.until(Instant::now() + HANDOVER_AWAKE);
        }
    }

    /// Gives this process's threads their normal priority back (before the application
    /// resumes here, or when the migration ends).
    fn restore_priority(&mut self) {
        if std::mem::take(&mut self.lowered) {
            let failed = PullPriority::Normal.apply_to_process();
            if failed > 0 {
                tracing::warn!("{failed} threads kept the pull's lower priority");
            }
        }
    }
}

impl<D> Drop for Run<D> {
    fn drop(&mut self) {
        self.restore_priority();
        if let Some(task) = self.postcopy.take() {
            task.abort();
        }
    }
}

/// Sleeps until `at` (for ever, without one).
async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

impl<D: Destination> Run<D> {
    /// Waits for what happens next: a message, the connection's end or a silent seeder's
    /// deadline, a task's report, or the cancellation (`None`: nothing for the machine).
    async fn next_input(
        &mut self,
        work_rx: &mut mpsc::UnboundedReceiver<LeecherInput>,
        cancel: &mut tokio::sync::watch::Receiver<bool>,
    ) -> Result<Option<LeecherInput>, LeechError> {
        let input = tokio::select! {
            m = self.rx.recv(), if self.connected => match m {
                Some(Ok(m)) => {
                    self.answer_by = None;
                    self.lost_since = None;
                    LeecherInput::Received(m)
                }
                other => {
                    if let Some(Err(e)) = other {
                        self.last_error = Some(e);
                    }
                    self.connected = false;
                    LeecherInput::Disconnected
                }
            },
            Some(w) = work_rx.recv() => w,
            _ = sleep_until(self.answer_by), if self.connected && self.answer_by.is_some() => {
                // Reconnected, and the seeder does not answer the hello.
                self.answer_by = None;
                self.seeder_silent(format!(
                    "the seeder did not answer the hello within {:?} after reconnecting",
                    self.opts.handshake_timeout
                ))
            }
            _ = sleep_until(self.finalize_by), if self.connected && !self.handed_over && self.finalize_by.is_some() => {
                // Finalized, and the seeder neither hands over nor closes the connection.
                self.finalize_by = None;
                self.seeder_silent(format!(
                    "the seeder did not hand over within {:?} of Finalize",
                    self.opts.finalize_timeout
                ))
            }
            _ = cancel.changed(), if !self.handed_over && self.finalize_sent.is_none() => {
                if *cancel.borrow() {
                    let abort = Msg::Abort { reason: "the leecher was cancelled".into() };
                    let _ = tokio::time::timeout(Duration::from_secs(5), self.tx.send(&abort)).await;
                    return Err(LeechError::Cancelled);
                }
                return Ok(None);
            }
        };
        Ok(Some(input))
    }

    /// The seeder stayed silent past a deadline: the connection counts as lost, and `why`
    /// as its error.
    fn seeder_silent(&mut self, why: String) -> LeecherInput {
        self.connected = false;
        self.last_error = Some(io::Error::new(io::ErrorKind::TimedOut, why));
        LeecherInput::Disconnected
    }

    /// Carries out one action; `Some` when the migration is complete.
    async fn act(
        &mut self,
        action: LeecherAction,
        machine: &mut Leecher,
        queue: &mut VecDeque<LeecherAction>,
    ) -> Result<Option<LeechReport<D>>, LeechError> {
        match action {
            LeecherAction::Send(m) => self.send(m, machine, queue).await,
            LeecherAction::OpenRegion { region, mode, .. } => self.open_region(region, mode).await,
            LeecherAction::Refresh { runs } => self.refresh(runs),
            LeecherAction::Resume {
                runs,
                app_state,
                suspended_at_ns,
                confirm,
                fetch_all,
            } => {
                self.resume(runs, app_state, suspended_at_ns, confirm, fetch_all)
                    .await?;
                Ok(None)
            }
            LeecherAction::InstallManifest(m) => self.install_manifest(m),
            LeecherAction::Confirm(c) => self.confirm(c),
            LeecherAction::Reconnect => self.reconnect(machine, queue).await,
            LeecherAction::Finish => self.finish(machine),
            LeecherAction::Abort(cause) => self.abort(cause),
        }
    }

    /// Sends `m` to the seeder (keeping this side awake when the hand-over follows).
    async fn send(
        &mut self,
        m: Msg,
        machine: &mut Leecher,
        queue: &mut VecDeque<LeecherAction>,
    ) -> Result<Option<LeechReport<D>>, LeechError> {
        if matches!(m, Msg::Finalize) {
            self.finalize_sent = Some(Instant::now());
            self.finalize_by = Some(tokio::time::Instant::now() + self.opts.finalize_timeout);
            self.rep.note(match machine.finalization() {
                Some(Finalization::Converged) | None => "pre-copy converged: finalizing".to_owned(),
                Some(Finalization::MaxRounds) => format!(
                    "pre-copy did not converge within {} rounds: finalizing anyway; the \
                     downtime may exceed its budget of {:?}",
                    machine.rounds(),
                    self.opts.convergence.max_downtime
                ),
                Some(Finalization::NotShrinking) => format!(
                    "pre-copy did not converge (the dirty set stopped shrinking): \
                     finalizing anyway; the downtime may exceed its budget of {:?}",
                    self.opts.convergence.max_downtime
                ),
                Some(Finalization::NoPreCopy) => {
                    format!("{} mode: finalizing at once", self.opts.mode)
                }
            });
        }
        // The hand-over follows these within milliseconds (after the draft, in
        // instant mode): its reading must not wait for a halted CPU to wake up.
        let handover_next = match m {
            Msg::Installed => true,
            Msg::Finalize => self.opts.mode != Mode::Instant,
            _ => false,
        };
        if handover_next {
            self.keep_awake();
        }
        if self.connected && self.tx.send(&m).await.is_err() {
            self.connected = false;
            queue.extend(machine.step(LeecherInput::Disconnected));
        }
        Ok(None)
    }

    /// Opens the destination region; in pre-copy, starts pulling it while the source runs.
    async fn open_region(
        &mut self,
        region: RegionInfo,
        mode: Mode,
    ) -> Result<Option<LeechReport<D>>, LeechError> {
        let size = region.size;
        self.seeder_boot = region.boot_id;
        self.tracking_since = Some(Instant::now());
        let data_addr = self.data_addr(region.data_port);
        let Some(open) = self.open.take() else {
            return Ok(None);
        };
        let geometry = (size, region.chunk_size, region.page_size);
        let data_key = crate::auth::data_key(&self.session_key);
        let dest = (data_addr, data_key);
        let d = open_dest(&self.opts, open, dest, geometry, mode, region.shared)
            .await
            .map_err(LeechError::Region)?;
        if mode != Mode::Precopy {
            self.rep.note(format!(
                "{mode}: region of {size} bytes opened here; handing over at once"
            ));
            self.dest = Some(d);
            return Ok(None);
        }
        let priority = self.opts.pull.priority;
        if priority != PullPriority::Normal {
            // Nothing of the application runs here yet: every thread of this process
            // (and those they start) pulls, and gives way to the source's writers.
            self.lowered = true;
            let failed = priority.apply_to_process();
            if failed > 0 {
                tracing::warn!("{failed} threads refused the {priority} priority");
            }
        }
        self.rep.note(format!(
            "pulling {size} bytes while the source runs (pull priority {priority}; \
             region opened {:.1} ms after the start)",
            self.started.elapsed().as_secs_f64() * 1e3
        ));
        let (r, st, w) = (d.region.clone(), d.store.clone(), self.work.clone());
        let (page, chunk, workers) = (d.page, d.chunk, self.opts.pull_workers);
        let (rep, pacer) = (self.rep.clone(), self.pacer.clone());
        tokio::spawn(async move {
            let started = Instant::now();
            let pulled = bulk_pull(r, st, page, chunk, workers, rep.clone(), pacer).await;
            let input = match pulled {
                Ok(()) => {
                    let took = started.elapsed().as_secs_f64();
                    rep.note(format!(
                        "pre-copy pull: {size} bytes in {:.1} ms ({:.0} MB/s)",
                        took * 1e3,
                        size as f64 / took.max(1e-9) / 1e6
                    ));
                    LeecherInput::PullDone
                }
                Err(e) => {
                    rep.note(format!("the pre-copy pull failed: {}", error_chain(&e)));
                    LeecherInput::Disconnected
                }
            };
            let _ = w.send(input);
        });
        self.dest = Some(d);
        Ok(None)
    }

    /// Pulls again the pages written at the source during the last round.
    fn refresh(&mut self, runs: Vec<Range<u64>>) -> Result<Option<LeechReport<D>>, LeechError> {
        let Some(d) = self.dest.as_ref() else {
            return Ok(None);
        };
        self.dirty_pages += run_pages(&runs);
        let (region, store, w) = (d.region.clone(), d.store.clone(), self.work.clone());
        let (page, rep, pacer) = (d.page, self.rep.clone(), self.pacer.clone());
        tokio::spawn(async move {
            let round = refresh_round(region, store, &runs, page, &rep, &pacer).await;
            let input = match round {
                Ok(r) => LeecherInput::RoundDone(r),
                Err(e) => {
                    rep.note(format!("a dirty round failed: {}", error_chain(&e)));
                    LeecherInput::Disconnected
                }
            };
            let _ = w.send(input);
        });
        Ok(None)
    }

    /// Instant mode: installs the manifest before the hand-over.
    fn install_manifest(&mut self, m: Manifest) -> Result<Option<LeechReport<D>>, LeechError> {
        if let Some(d) = self.dest.as_ref() {
            // Before the hand-over, while the source still runs: the downtime
            // carries only the confirmation of the chunks written lately.
            let t0 = Instant::now();
            d.store.install_manifest(&m);
            self.rep.note(format!(
                "instant: manifest installed in {:.2} ms ({} chunks in the shared \
                 store, {} at the source)",
                t0.elapsed().as_secs_f64() * 1e3,
                m.pushed.len(),
                m.source_chunks()
            ));
        }
        self.manifest = Some(m);
        Ok(None)
    }

    /// Instant mode: applies the source's confirmation of the chunks written lately.
    fn confirm(&mut self, c: Confirm) -> Result<Option<LeechReport<D>>, LeechError> {
        if let Some(d) = self.dest.as_ref() {
            d.store.apply_confirm(&c);
            if c.pending.is_empty() {
                self.rep.note(format!(
                    "instant: the source confirmed every chunk ({} more chunks come \
                     from it)",
                    run_pages(&c.at_source)
                ));
            }
        }
        Ok(None)
    }

    /// The seeder is lost for good: after the hand-over, or at `Finalize` before it.
    fn lost(&self, why: AfterHandOver) -> LeechError {
        if self.handed_over {
            LeechError::LostAfterHandOver(why)
        } else {
            LeechError::LostAtFinalize(why)
        }
    }

    /// After the hand-over (or `Finalize`): reconnects to the seeder until the reconnect
    /// deadline.
    async fn reconnect(
        &mut self,
        machine: &mut Leecher,
        queue: &mut VecDeque<LeecherAction>,
    ) -> Result<Option<LeechReport<D>>, LeechError> {
        self.rep.note("control connection lost: reconnecting");
        // The deadline runs from the first loss: a seeder that accepts and then says
        // nothing does not restart it.
        let since = *self.lost_since.get_or_insert_with(Instant::now);
        let deadline = since + self.opts.reconnect_for;
        if Instant::now() >= deadline {
            let source = self.last_error.take().unwrap_or_else(|| {
                io::Error::new(io::ErrorKind::TimedOut, "the seeder did not answer")
            });
            return Err(self.lost(AfterHandOver::Reconnect {
                waited: self.opts.reconnect_for,
                source,
            }));
        }
        loop {
            let connected = async {
                let mut ch = connect(
                    &self.opts.from,
                    self.opts.tls.as_ref(),
                    Duration::from_secs(2),
                )
                .await?;
                let session = machine.session();
                let auth = crate::auth::leecher(&mut ch, &self.session_key, session);
                match tokio::time::timeout(self.opts.handshake_timeout, auth).await {
                    Ok(Ok(_)) => Ok(ch),
                    Ok(Err(e)) => Err(io::Error::new(
                        io::ErrorKind::PermissionDenied,
                        farmap_core::error_chain(&e),
                    )),
                    Err(_) => Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the seeder did not answer the hello (the authentication) in time",
                    )),
                }
            };
            match connected.await {
                Ok(ch) => {
                    (self.tx, self.rx) = ch.split();
                    self.connected = true;
                    self.answer_by =
                        Some(tokio::time::Instant::now() + self.opts.handshake_timeout);
                    queue.extend(machine.step(LeecherInput::Reconnected));
                    break;
                }
                Err(source) if Instant::now() >= deadline => {
                    return Err(self.lost(AfterHandOver::Reconnect {
                        waited: self.opts.reconnect_for,
                        source,
                    }));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        Ok(None)
    }

    /// The migration is complete: the region is local; the report.
    fn finish(&mut self, machine: &Leecher) -> Result<Option<LeechReport<D>>, LeechError> {
        let Some(d) = self.dest.take() else {
            return Ok(None);
        };
        d.store.detach();
        let (pre, post) = d.store.bytes();
        let tracked = self
            .tracking_since
            .and_then(|t| self.finalize_sent.map(|f| f - t))
            .unwrap_or_default();
        self.rep.note("complete: the region is local");
        Ok(Some(LeechReport {
            region: d.region,
            downtime: self.downtime,
            max_downtime: self.opts.convergence.max_downtime,
            finalization: machine.finalization().unwrap_or(Finalization::Converged),
            total: self.started.elapsed(),
            bytes_precopy: pre,
            bytes_postcopy: post,
            rounds: machine.rounds(),
            dirty_pages: self.dirty_pages,
            dirty_rate: if tracked.is_zero() {
                0.0
            } else {
                self.dirty_pages.saturating_mul(d.page) as f64 / tracked.as_secs_f64()
            },
            final_pages: self.final_pages,
            postcopy: self.resumed_at.map(|r| r.elapsed()).unwrap_or_default(),
            mode: self.opts.mode,
            bytes_before_resume: self.bytes_before_resume,
            instant: d.store.instant_counts(),
        }))
    }

    /// A bad message or a failure: fatal before the hand-over, reported after it.
    fn abort(&mut self, cause: AbortCause) -> Result<Option<LeechReport<D>>, LeechError> {
        if self.handed_over {
            // The application runs here now: a message the seeder should not have
            // sent is reported, never fatal. The machine kept its state; post-copy
            // goes on over the data plane, and a seeder that is really gone is
            // found out by the reconnect deadline.
            let why = farmap_core::error_chain(&cause);
            tracing::warn!("ignored a bad message from the seeder after the hand-over: {why}");
            self.rep
                .note(format!("ignored a bad message from the seeder: {why}"));
            return Ok(None);
        }
        Err(LeechError::Aborted {
            cause,
            connection: self.last_error.take(),
        })
    }

    /// The data plane's address: as given, or the control host with the announced port.
    fn data_addr(&self, data_port: u16) -> RemoteAddr {
        self.opts
            .data
            .clone()
            .unwrap_or_else(|| match &self.opts.from {
                RemoteAddr::Tcp(_) => {
                    let host = self.opts.from.host();
                    if host.contains(':') {
                        RemoteAddr::Tcp(format!("[{host}]:{data_port}"))
                    } else {
                        RemoteAddr::Tcp(format!("{host}:{data_port}"))
                    }
                }
                RemoteAddr::Unix(p) => RemoteAddr::Unix(p.with_extension("data")),
            })
    }

    /// The hand-over: discard the pages written at the source, resume the application at
    /// once, and start the post-copy.
    async fn resume(
        &mut self,
        runs: Vec<Range<u64>>,
        app_state: Bytes,
        suspended_at_ns: u64,
        confirm: Option<Confirm>,
        fetch_all: bool,
    ) -> Result<(), LeechError> {
        // The hand-over is here: the companions that kept the CPUs awake for it stop
        // spinning now. Left spinning through the discard below, the scheduler sometimes ran
        // one instead of the thread a remove event had just woken, until its next tick:
        // 1.5-4 ms more downtime (seen with `perf sched` in `farmap demo`).
        if let Some(awake) = &self.awake {
            awake.until(Instant::now());
        }
        // The application runs here from now on: nothing of this process gives way any more.
        self.restore_priority();
        let Some(d) = self.dest.as_ref() else {
            return Ok(());
        };
        d.store.start_postcopy();
        let manifest = match &confirm {
            Some(c) => {
                d.store.apply_confirm(c);
                self.manifest.take()
            }
            None => None,
        };
        let t_discard = Instant::now();
        // Only pre-copy has pages here that the source changed since.
        if confirm.is_none() && !fetch_all {
            d.discard(&runs).await?;
        }
        if let Some(resume) = self.resume.take() {
            resume(d.region.clone(), app_state);
        }
        self.bytes_before_resume =
            d.store.bytes().0 + self.received.load(std::sync::atomic::Ordering::Relaxed);
        self.note_handed_over(suspended_at_ns);
        self.final_pages = run_pages(&runs);
        self.dirty_pages += self.final_pages;
        self.report_resumed(manifest.as_ref(), confirm.as_ref(), fetch_all, t_discard);
        self.start_post_copy(manifest, confirm, runs, fetch_all);
        Ok(())
    }

    /// The application runs here: the downtime is measured (from the suspension if both
    /// hosts share a clock, else from `Finalize`).
    fn note_handed_over(&mut self, suspended_at_ns: u64) {
        let now = Instant::now();
        let same_boot = self.seeder_boot == crate::boot_id() && self.seeder_boot != [0; 16];
        self.downtime = if same_boot {
            Duration::from_nanos(crate::monotonic_ns().saturating_sub(suspended_at_ns))
        } else {
            self.finalize_sent.map_or(Duration::ZERO, |f| now - f)
        };
        self.resumed_at = Some(now);
        // Dropped here: the spinners stop.
        if let Some(awake) = self.awake.take() {
            tracing::debug!(
                cpu_ms = awake.cpu_time().as_secs_f64() * 1e3,
                "the CPUs were kept awake for the hand-over"
            );
        }
        self.handed_over = true;
        self.rep.emit(Event::HandedOver);
    }

    /// Says how the application resumed and where the rest comes from; warns of a downtime
    /// over its budget.
    fn report_resumed(
        &self,
        manifest: Option<&Manifest>,
        confirm: Option<&Confirm>,
        fetch_all: bool,
        t_discard: Instant,
    ) {
        let budget = self.opts.convergence.max_downtime;
        match (manifest, fetch_all) {
            (Some(m), _) => self.rep.note(format!(
                "resumed here after {:.1} ms; {} chunks come from the source, the rest from the \
                 shared store",
                self.downtime.as_secs_f64() * 1e3,
                m.source_chunks() + confirm.map_or(0, |c| run_pages(&c.at_source)),
            )),
            (None, true) => self.rep.note(format!(
                "resumed here after {:.1} ms; every chunk comes from the source (faults first)",
                self.downtime.as_secs_f64() * 1e3,
            )),
            (None, false) => self.rep.note(format!(
                "discarding took {:.1} ms; resumed here after {:.1} ms; fetching {} changed \
                 pages in the background",
                t_discard.elapsed().as_secs_f64() * 1e3,
                self.downtime.as_secs_f64() * 1e3,
                self.final_pages
            )),
        }
        if self.downtime > budget {
            self.rep.note(format!(
                "warning: the downtime of {:.1} ms exceeded its budget of {:.1} ms",
                self.downtime.as_secs_f64() * 1e3,
                budget.as_secs_f64() * 1e3
            ));
        }
    }

    /// Starts the task that makes every chunk local (instant mode: in the manifest's order;
    /// post-copy: all of them; pre-copy: the pages `runs` discarded); it answers
    /// [`LeecherInput::AllLocal`].
    fn start_post_copy(
        &mut self,
        manifest: Option<Manifest>,
        confirm: Option<Confirm>,
        runs: Vec<Range<u64>>,
        fetch_all: bool,
    ) {
        let Some(d) = self.dest.as_ref() else {
            return;
        };
        let (region, store, w) = (d.region.clone(), d.store.clone(), self.work.clone());
        let (page, chunk, workers, rep) =
            (d.page, d.chunk, self.opts.pull_workers, self.rep.clone());
        let all_pages = region.geometry().size() / page;
        let task = tokio::spawn(async move {
            match manifest {
                Some(m) => {
                    let first = confirm.map(|c| c.at_source).unwrap_or_default();
                    instant_copy(region, store, m, first, page, chunk, workers, rep).await
                }
                None if fetch_all => {
                    post_copy(
                        region,
                        store,
                        std::iter::once(0..all_pages).collect(),
                        page,
                        chunk,
                        workers,
                        rep,
                    )
                    .await
                }
                None => post_copy(region, store, runs, page, chunk, workers, rep).await,
            }
            let _ = w.send(LeecherInput::AllLocal);
        });
        self.postcopy = Some(task.abort_handle());
    }
}

/// Pages per read of a dirty round (the round's set is read and written batch by batch).
const REFRESH_BATCH: u64 = 1024;
/// Reads of a dirty round in flight at once: one at a time, a round of scattered pages paid a
/// round trip of the data plane per batch (12 batches for the 12,000 pages of a 1 GiB demo's
/// first round).
const REFRESH_READS: usize = 4;

/// Why a dirty round failed (the migration is abandoned; the source runs on).
#[derive(Debug, thiserror::Error)]
enum RoundError {
    #[error("reading the changed pages failed")]
    Read(#[source] StoreError),
    #[error("writing the changed pages failed")]
    Write(#[source] EndpointError),
    #[error("writing the changed pages panicked")]
    Task(#[source] tokio::task::JoinError),
}

/// A pre-copy dirty round: read the changed pages and write them in place, batch by batch,
/// [`REFRESH_READS`] batches read at once while the one before is written (1024 pages of
/// reading is a round trip and a transfer; writing them is a memcpy on a blocking thread).
/// The application does not run here yet, and a write costs a memcpy where a discard costs a
/// round trip through the fault reader per run.
async fn refresh_round<D: Destination>(
    region: Arc<D>,
    store: Arc<MigrationStore>,
    runs: &[Range<u64>],
    page: u64,
    rep: &Reporter,
    pacer: &Pacer,
) -> Result<RoundResult, RoundError> {
    let t0 = Instant::now();
    let mut read = Duration::ZERO;
    let mut apply = Duration::ZERO;
    let store = &store;
    let mut reads = futures::stream::iter(batches_of(runs, REFRESH_BATCH))
        .map(|batch| async move {
            pacer.pace(run_pages(&batch) * page).await;
            store.read_runs(&batch).await
        })
        .buffered(REFRESH_READS);
    let mut writing: Option<tokio::task::JoinHandle<Result<Duration, EndpointError>>> = None;
    // Waits for the batch being written; a failed or panicked write fails the round.
    async fn written(
        job: tokio::task::JoinHandle<Result<Duration, EndpointError>>,
    ) -> Result<Duration, RoundError> {
        job.await
            .map_err(RoundError::Task)?
            .map_err(RoundError::Write)
    }
    while let Some(segments) = reads.next().await {
        // Until the last batch arrived (reads overlap each other and the writes).
        read = t0.elapsed();
        if let Some(job) = writing.take() {
            apply += written(job).await?;
        }
        let segments = segments.map_err(RoundError::Read)?;
        let r = region.clone();
        // One write per run of pages holding data, and zeros where the source now has zero
        // pages (their old content is here).
        writing = Some(tokio::task::spawn_blocking(move || {
            let t = Instant::now();
            segments.iter().try_for_each(|s| {
                let at = s.pages.start * page;
                match &s.data {
                    Some(d) => r.write_at(at, d),
                    None => write_zeros(&*r, at, (s.pages.end - s.pages.start) * page),
                }
            })?;
            Ok(t.elapsed())
        }));
    }
    if let Some(job) = writing.take() {
        apply += written(job).await?;
    }
    let pages = run_pages(runs);
    rep.note(format!(
        "round: {pages} pages in {} runs: read in {:.1} ms, written in place in {:.1} ms \
         (overlapping the reads), {:.1} ms in all",
        runs.len(),
        read.as_secs_f64() * 1e3,
        apply.as_secs_f64() * 1e3,
        t0.elapsed().as_secs_f64() * 1e3,
    ));
    Ok(RoundResult {
        pages,
        runs: runs.len() as u64,
        apply,
        elapsed: t0.elapsed(),
    })
}

/// `runs` (ascending) cut into batches of at most `max` pages each.
fn batches_of(runs: &[Range<u64>], max: u64) -> Vec<Vec<Range<u64>>> {
    let mut out: Vec<Vec<Range<u64>>> = Vec::new();
    let mut cur: Vec<Range<u64>> = Vec::new();
    let mut n = 0;
    for r in runs {
        let mut at = r.start;
        while at < r.end {
            let take = (r.end - at).min(max - n);
            cur.push(at..at + take);
            n += take;
            at += take;
            if n == max {
                out.push(std::mem::take(&mut cur));
                n = 0;
            }
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// Writes `len` zero bytes at `offset` (shared zeros, one write per 4 MiB).
fn write_zeros<D: Destination>(d: &D, offset: u64, len: u64) -> Result<(), EndpointError> {
    let max = u64::from(farmap_core::MAX_CHUNK_SIZE);
    let mut done = 0;
    while done < len {
        let n = (len - done).min(max);
        d.write_at(offset + done, &farmap_core::zero_chunk(n as usize))?;
        done += n;
    }
    Ok(())
}

/// Post-copy: fetch the chunks of the pages discarded at the hand-over (faults fetch theirs
/// first), batch by batch, retrying until every chunk is local.
async fn post_copy<D: Destination>(
    region: Arc<D>,
    store: Arc<MigrationStore>,
    runs: Vec<Range<u64>>,
    page: u64,
    chunk: u64,
    workers: usize,
    rep: Reporter,
) {
    let chunks = chunks_of(&runs, page, chunk);
    let per_chunk = (chunk / page).max(1);
    loop {
        let mut failed = None;
        for batch in chunks.chunks(PULL_BATCH as usize) {
            let (Some(first), Some(last)) = (batch.first(), batch.last()) else {
                continue;
            };
            let lo = first.0.saturating_mul(per_chunk);
            let hi = last.0.saturating_add(1).saturating_mul(per_chunk);
            let pages = clip(&runs, lo, hi);
            let _ = store.stage(&pages).await;
            let fetched = region.fetch_chunks(batch.to_vec(), workers).await;
            store.unstage(&pages);
            if let Err(e) = fetched {
                failed = Some(e);
                break;
            }
        }
        let (have, all) = (region.present_chunks(), region.geometry().chunk_count());
        match &failed {
            None => rep.note(format!("post-copy: {have} of {all} chunks present")),
            Some(e) => rep.note(format!(
                "post-copy: {}; {have} of {all} chunks present; retrying",
                error_chain(e.as_ref())
            )),
        }
        if failed.is_none() && region.is_complete() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// After an instant hand-over: fetch the chunks only the source holds (those written
/// lately first, then in the manifest's order; faults fetch theirs first) and push each
/// batch to the shared store; once the source has confirmed every chunk, the same for the
/// chunks it found written last, then read and check the chunks the store holds (one failing
/// its check is read from the source, and pushed again), so that the source holds nothing
/// the destination needs when it is released. Retries until done.
#[allow(clippy::too_many_arguments)]
async fn instant_copy<D: Destination>(
    region: Arc<D>,
    store: Arc<MigrationStore>,
    manifest: Manifest,
    first: Vec<Range<u64>>,
    page: u64,
    chunk: u64,
    workers: usize,
    rep: Reporter,
) {
    let n = region.geometry().chunk_count();
    let mut done = vec![false; n as usize];
    let mut source = Vec::new();
    let lately = first.iter().flat_map(|r| r.clone());
    let placed = manifest
        .runs
        .iter()
        .filter(|r| r.location == Location::Source)
        .flat_map(|r| r.chunks.clone());
    for c in lately.chain(placed) {
        if let Some(d) = done.get_mut(c as usize) {
            if !std::mem::replace(d, true) {
                source.push(ChunkIdx(c));
            }
        }
    }
    drop(manifest);
    let copy = CopyCtx {
        region: &region,
        store: &store,
        page,
        chunk,
        workers,
        rep: &rep,
    };
    let t0 = Instant::now();
    copy.fetch_all(&source, true).await;
    if !source.is_empty() {
        let took = t0.elapsed().as_secs_f64();
        rep.note(format!(
            "instant: the {} chunks only the source held came in {:.1} ms ({:.0} MB/s)",
            source.len(),
            took * 1e3,
            (source.len() as u64 * chunk) as f64 / took.max(1e-9) / 1e6
        ));
    }
    copy.push(&source).await;
    store.wait_confirmed().await;
    let (all_source, shared) = store.instant_places();
    let late: Vec<ChunkIdx> = all_source
        .into_iter()
        .filter(|c| !done[c.0 as usize])
        .collect();
    copy.batches(&late, true).await;
    copy.batches(&shared, false).await;
    // Chunks whose store copy failed its check came from the source: the store gets them
    // now, or it would keep serving the bad copy once the source is gone.
    let failed = store.take_failed();
    if !failed.is_empty() {
        copy.batches(&failed, true).await;
    }
    let c = store.instant_counts();
    rep.note(format!(
        "instant: {} chunks from the source, {} from the shared store, {} failed their check",
        c.chunks_from_source, c.chunks_from_store, c.verify_failures
    ));
}

/// What [`instant_copy`] fetches with.
struct CopyCtx<'a, D> {
    region: &'a Arc<D>,
    store: &'a Arc<MigrationStore>,
    page: u64,
    chunk: u64,
    workers: usize,
    rep: &'a Reporter,
}

impl<D: Destination> CopyCtx<'_, D> {
    /// Fetches `chunks` batch by batch (from the source: [`INSTANT_IN_FLIGHT`] batches at
    /// once, each staged in one read first; from the store, where nobody waits for them,
    /// one at a time, so that the application keeps the CPU), retrying each batch until it
    /// is done; then, for chunks from the source, pushes them to the shared store. The
    /// application waits for the fetches, not for the pushes, which follow once everything
    /// is here.
    async fn batches(&self, chunks: &[ChunkIdx], from_source: bool) {
        self.fetch_all(chunks, from_source).await;
        if from_source {
            self.push(chunks).await;
        }
    }

    /// The fetches of [`batches`](Self::batches).
    async fn fetch_all(&self, chunks: &[ChunkIdx], from_source: bool) {
        let in_flight = if from_source { INSTANT_IN_FLIGHT } else { 1 };
        futures::stream::iter(chunks.chunks(PULL_BATCH as usize))
            .for_each_concurrent(in_flight, |batch| self.fetch(batch, from_source))
            .await;
    }

    /// Pushes `chunks`, fetched from the source, to the shared store, batch by batch.
    async fn push(&self, chunks: &[ChunkIdx]) {
        for batch in chunks.chunks(PULL_BATCH as usize) {
            loop {
                let (r, b) = (self.region.clone(), batch.to_vec());
                match tokio::task::spawn_blocking(move || r.push_chunks(b))
                    .await
                    .unwrap_or_else(|e| Err(e.into()))
                {
                    Ok(()) => break,
                    Err(e) => self.retry_after(e.as_ref()).await,
                }
            }
        }
    }

    /// Fetches one batch, retrying until it is done.
    async fn fetch(&self, batch: &[ChunkIdx], from_source: bool) {
        let per_chunk = (self.chunk / self.page).max(1);
        let total_pages = self.region.geometry().size().div_ceil(self.page);
        loop {
            let pages: Vec<Range<u64>> = if from_source {
                let mut sorted = batch.to_vec();
                sorted.sort_unstable();
                let mut runs: Vec<Range<u64>> = Vec::new();
                for c in sorted {
                    let (a, b) = (c.0 * per_chunk, ((c.0 + 1) * per_chunk).min(total_pages));
                    match runs.last_mut() {
                        Some(r) if r.end == a => r.end = b,
                        _ => runs.push(a..b),
                    }
                }
                runs
            } else {
                Vec::new()
            };
            if !pages.is_empty() {
                let _ = self.store.stage(&pages).await;
            }
            let fetched = self.region.fetch_chunks(batch.to_vec(), self.workers).await;
            self.store.unstage(&pages);
            match fetched {
                Ok(()) => return,
                Err(e) => self.retry_after(e.as_ref()).await,
            }
        }
    }

    async fn retry_after(&self, e: &(dyn std::error::Error + Send + Sync + 'static)) {
        self.rep
            .note(format!("instant: {}; retrying", error_chain(e)));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How long the destination keeps its CPUs awake waiting for the hand-over: the source's
/// suspension and last scan take milliseconds; past this, the CPUs may halt again.
const HANDOVER_AWAKE: Duration = Duration::from_millis(100);

/// Batches an instant migration's copy fetches at once.
const INSTANT_IN_FLIGHT: usize = 4;

/// Chunks per bulk-pull batch (one `read_many` of their pages, then one install each).
const PULL_BATCH: u64 = 64;
/// Bulk-pull batches in flight (enough to fill a long fat link: 8 × 4 MiB).
const PULL_IN_FLIGHT: usize = 8;

/// Why the bulk pull failed.
#[derive(Debug, thiserror::Error)]
enum PullError {
    #[error("reading pages from the seeder failed")]
    Read(#[source] StoreError),
    #[error("installing chunks failed")]
    Install(#[source] EndpointError),
    #[error("a pull task panicked")]
    Task(#[source] tokio::task::JoinError),
}

/// Pre-copy: the whole region, batch by batch, several batches in flight.
async fn bulk_pull<D: Destination>(
    region: Arc<D>,
    store: Arc<MigrationStore>,
    page: u64,
    chunk: u64,
    workers: usize,
    rep: Reporter,
    pacer: Arc<Pacer>,
) -> Result<(), PullError> {
    let chunks = region.geometry().chunk_count();
    let total = region.geometry().size();
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..PULL_IN_FLIGHT {
        let (region, store, next, rep) = (region.clone(), store.clone(), next.clone(), rep.clone());
        let pacer = pacer.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                let first = next.fetch_add(PULL_BATCH, std::sync::atomic::Ordering::AcqRel);
                if first >= chunks {
                    return Ok::<(), PullError>(());
                }
                let last = (first + PULL_BATCH).min(chunks);
                let p0 = first * chunk / page;
                let p1 = (last * chunk).min(total) / page;
                let pages: Vec<Range<u64>> = std::iter::once(p0..p1).collect();
                pacer.pace((p1 - p0) * page).await;
                store.stage(&pages).await.map_err(PullError::Read)?;
                let r = region
                    .fetch_chunks((first..last).map(ChunkIdx).collect(), workers)
                    .await;
                store.unstage(&pages);
                r.map_err(PullError::Install)?;
                rep.emit(Event::Pulled {
                    bytes: store.bytes().0.min(total),
                    total,
                });
            }
        }));
    }
    for t in tasks {
        t.await.map_err(PullError::Task)??;
    }
    Ok(())
}

async fn open_dest<D: Destination>(
    opts: &LeechOptions,
    open: Opener<D>,
    (data, key): (RemoteAddr, Key),
    (size, chunk_size, page_size): (u64, u32, u32),
    mode: Mode,
    shared: String,
) -> Result<Dest<D>, OpenError> {
    // The seeder just answered on the control connection, so a data plane that cannot be
    // reached (refused, reset mid-handshake, silent) is an outage of the link: it is ridden
    // out under the same rule as the control connection's. A refusal of the key is not.
    let client = ClientOptions {
        connections: opts.connections,
        tls: opts.tls.clone(),
        key: Some(key),
        ..ClientOptions::default()
    };
    let remote = farmap_pipeline::retry(RetryPolicy::for_at_least(opts.reconnect_for), || {
        RemoteStore::connect(data.clone(), client.clone())
    })
    .await
    .map_err(|source| OpenError::DataPlane {
        addr: data.to_string(),
        source,
    })?;
    let geometry = Geometry::new(size, chunk_size.into()).map_err(OpenError::Geometry)?;
    let pages = Geometry::new(size, page_size.into()).map_err(OpenError::Geometry)?;
    let served = farmap_core::Store::geometry(&remote);
    if served != pages {
        return Err(OpenError::Mismatch {
            addr: data.to_string(),
            got: served,
            want: pages,
        });
    }
    let spec = (mode == Mode::Instant).then(|| shared.clone());
    let store = if mode == Mode::Instant {
        let Some(opener) = &opts.shared else {
            return Err(OpenError::NoSharedOpener { spec: shared });
        };
        let shared = (opener.0)(shared).await.map_err(OpenError::Shared)?;
        MigrationStore::instant(geometry, page_size.into(), Arc::new(remote), shared)
            .map_err(|e| OpenError::Shared(e.into()))?
    } else {
        MigrationStore::new(geometry, page_size.into(), Arc::new(remote))
    };
    let store = Arc::new(store);
    let ctx = OpenContext {
        geometry,
        page_size,
        reconnect_for: opts.reconnect_for,
        mode,
        shared: spec,
    };
    let region = open(store.clone(), ctx).await.map_err(OpenError::Open)?;
    Ok(Dest {
        region,
        store,
        page: page_size.into(),
        chunk: chunk_size.into(),
    })
}
