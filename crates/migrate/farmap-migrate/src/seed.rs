//! The seeder's runner: serves the live region's pages on a data plane
//! (`farmap_net::serve` of a [`LiveView`](crate::LiveView), or of another [`Source`]'s data
//! plane) and drives a [`Seeder`] over control connections until a leecher has taken the
//! region over and completed.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::collections::VecDeque;

use farmap_core::Store;
use farmap_net::auth::{Key, KeySlot};
use farmap_net::{
    serve_with_runs, ListenAddr, Listener, RunReader, ServeError, ServeOptions, Server,
    TlsServerConfig,
};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::auth::{Proven, SeederKeys};
use crate::budget::PullBudget;
use crate::channel::{Accepted, Channel, ControlListener, Sender};
use crate::endpoint::{EndpointError, Source};
use crate::event::{Event, Observer, Reporter};
use crate::machine::{RegionInfo, Seeder, SeederAction, SeederInput, SeederState};
use crate::msg::run_pages;
use crate::msg::Msg;
use crate::suspend::Suspend;
use crate::suspend::SuspendError;

/// How to seed.
#[derive(Debug, Clone)]
pub struct SeedOptions {
    /// Control connections.
    pub listen: ListenAddr,
    /// The data plane (pages of the live region).
    pub data_listen: ListenAddr,
    /// TLS (or mutual TLS) for both.
    pub tls: Option<TlsServerConfig>,
    /// How long to wait for a leecher that lost its connection after the hand-over.
    pub reconnect_wait: Duration,
    /// How long a new control connection has for its TLS handshake and first message.
    pub handshake_timeout: Duration,
    /// Most control connections in their handshake at once; a new one beyond it closes the
    /// oldest (a leecher's handshake takes a round trip, an attacker's lasts).
    pub max_handshakes: usize,
    /// Log progress lines on stderr.
    pub log: bool,
    /// Receives progress events.
    pub observer: Option<Observer>,
    /// What the data plane may take from the application: it runs on threads of its own at
    /// this priority, and its reads keep to the rate and CPU share.
    pub pull: PullBudget,
    /// Instant migration: how long the source pushes what the shared store lacks while the
    /// application still runs, before it suspends (what is still unpushed then is fetched
    /// from the source after the hand-over). Zero pushes nothing more.
    pub push_budget: Duration,
    /// The operator's migration key: a leecher must prove it holds it (see
    /// [`crate::auth`]); [`crate::auth::process_key`] for a migration within this process.
    pub key: Key,
}

/// Default [`SeedOptions::push_budget`].
pub const PUSH_BUDGET: Duration = Duration::from_secs(2);

/// Default [`SeedOptions::handshake_timeout`].
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one control message may take to send before the leecher counts as gone.
const SEND_TIMEOUT: Duration = Duration::from_secs(60);

/// Default [`SeedOptions::max_handshakes`].
pub const MAX_HANDSHAKES: usize = 64;

/// Why seeding failed.
#[derive(Debug, thiserror::Error)]
pub enum SeedError {
    /// A socket could not be bound.
    #[error("cannot listen on {addr}")]
    Listen {
        /// Where.
        addr: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The bound address could not be read.
    #[error("reading the address of a bound socket failed")]
    LocalAddr(#[source] std::io::Error),
    /// The data plane could not start.
    #[error("starting the data plane failed")]
    Serve(#[source] ServeError),
    /// Write tracking failed.
    #[error("taking the region's written pages failed")]
    Dirty(#[source] EndpointError),
    /// A blocking step (a dirty scan, the suspension) panicked.
    #[error("the seeder's {what} failed")]
    Task {
        /// Which step.
        what: &'static str,
        /// The join error.
        #[source]
        source: tokio::task::JoinError,
    },
    /// Cancelled before the hand-over: the source runs on.
    #[error("seeding cancelled before the hand-over; the source keeps running")]
    Cancelled,
    /// The destination vanished after the hand-over.
    #[error(
        "the destination failed after the hand-over (no reconnection within {0:?}); the source \
         stays suspended and will not resume: ownership had moved"
    )]
    LostAfterHandOver(Duration),
}

/// Why the final suspension (and dirty scan) failed; the source runs on.
#[derive(Debug, thiserror::Error)]
enum FinalError {
    #[error(transparent)]
    Suspend(#[from] SuspendError),
    #[error("taking the final dirty set failed")]
    Dirty(#[source] EndpointError),
    #[error("sealing the region's pushes for the manifest failed")]
    Seal(#[source] EndpointError),
}
/// What a finished seeding did.
#[derive(Debug, Clone)]
pub struct SeedReport {
    /// Dirty sets answered (the final one included).
    pub dirty_sets: u32,
    /// Pages in them.
    pub dirty_pages: u64,
    /// Leechers that went away before the hand-over.
    pub abandoned: u32,
    /// From the first leecher's hello to the release.
    pub elapsed: Duration,
    /// How the region moved (an instant migration's source never pushes again: the shared
    /// store belongs to the destination).
    pub mode: crate::msg::Mode,
}

/// A seeder at work: its addresses, and the task.
#[derive(Debug)]
pub struct Seeding {
    /// Where control connections go.
    pub control: ListenAddr,
    /// Where the data plane listens.
    pub data: ListenAddr,
    cancel: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<Result<SeedReport, SeedError>>,
}

impl Seeding {
    /// Abandons the seeding if the hand-over has not happened yet: a leecher at work is told
    /// (it aborts), tracking stops, and the source runs on untouched. After the hand-over
    /// it changes nothing (ownership has moved; the seeding finishes).
    pub fn cancel(&self) {
        let _ = self.cancel.send(true);
    }

    /// A handle that cancels like [`cancel`](Self::cancel), for another task.
    pub fn canceller(&self) -> impl Fn() + Send + Sync + 'static {
        let tx = self.cancel.clone();
        move || {
            let _ = tx.send(true);
        }
    }

    /// Stops seeding at once, releasing and resuming nothing, its connections dropped: what
    /// a crash of the source host does (for tests of what a destination does then).
    pub fn kill(&self) {
        self.task.abort();
    }

    /// Waits until the region was handed over and released (or seeding failed).
    pub async fn finish(self) -> Result<SeedReport, SeedError> {
        self.task.await.unwrap_or_else(|source| {
            Err(SeedError::Task {
                what: "task",
                source,
            })
        })
    }
}

/// Starts seeding `region` (a userfaultfd [`Region`](farmap_uffd::Region) or any other
/// [`Source`]), whose writers `suspend` stops.
pub async fn seed(
    region: Arc<dyn Source>,
    suspend: Arc<dyn Suspend>,
    opts: SeedOptions,
) -> Result<Seeding, SeedError> {
    // The data plane runs on threads of its own, at the pull's priority: copying pages out
    // for the leecher gives way to the application's writers.
    let pull_rt =
        crate::budget::pull_runtime(opts.pull.priority, 2).map_err(|source| SeedError::Listen {
            addr: opts.data_listen.to_string(),
            source,
        })?;
    let pacer = Arc::new(crate::budget::Pacer::new(&opts.pull));
    let (plane, runs) = paced_plane(&region, &pacer);
    // The data plane serves the current session's leecher only.
    let keys = SeederKeys::new(opts.key.clone());
    let (data, server) = start_data_plane(&pull_rt, plane, runs, &opts, keys.data.clone()).await?;
    let control_listener = ControlListener::bind(&opts.listen, opts.tls.as_ref())
        .await
        .map_err(|source| SeedError::Listen {
            addr: opts.listen.to_string(),
            source,
        })?;
    let control = control_listener
        .local_addr()
        .map_err(SeedError::LocalAddr)?;
    let info = region_info(&*region, &data);
    let (cancel, cancelled) = tokio::sync::watch::channel(false);
    // Every log line of the migration names its side and control address.
    let span = tracing::info_span!("seed", control = %control, size = info.size);
    let task = tokio::spawn(tracing::Instrument::instrument(
        async move {
            let (conn_tx, conn_rx) = mpsc::channel(4);
            let acceptor = Acceptor {
                listener: control_listener,
                timeout: opts.handshake_timeout,
                max: opts.max_handshakes.max(1),
                out: conn_tx,
                keys: keys.clone(),
            };
            let accepting = AbortOnDrop(tokio::spawn(acceptor.run()));
            let seed_run = SeedRun::new(region, suspend, opts, keys, pacer);
            let r = run(seed_run, conn_rx, Seeder::new(info, 0), cancelled).await;
            drop(accepting);
            let _ = server.shutdown().await;
            drop(pull_rt);
            r
        },
        span,
    ));
    Ok(Seeding {
        control,
        data,
        cancel,
        task,
    })
}

/// The region's data plane and run reader, kept to the pull's rate and CPU share if it
/// has any.
fn paced_plane(
    region: &Arc<dyn Source>,
    pacer: &Arc<crate::budget::Pacer>,
) -> (Arc<dyn Store>, Option<Arc<dyn RunReader>>) {
    let mut plane = region.clone().data_plane();
    let mut runs: Option<Arc<dyn RunReader>> = region.clone().run_reader();
    if pacer.is_limited() {
        plane = Arc::new(crate::view::Paced::new(plane, pacer.clone()));
        runs = runs.map(|r| {
            Arc::new(crate::view::PacedRuns::new(
                r,
                plane.geometry(),
                pacer.clone(),
            )) as Arc<dyn RunReader>
        });
    }
    (plane, runs)
}

/// Binds and serves the data plane (read-only, for holders of `data_key`) on the pull's
/// threads; returns where it listens and the server.
async fn start_data_plane(
    pull_rt: &crate::budget::PullRuntime,
    plane: Arc<dyn Store>,
    runs: Option<Arc<dyn RunReader>>,
    opts: &SeedOptions,
    data_key: KeySlot,
) -> Result<(ListenAddr, Server), SeedError> {
    let (data_listen, tls) = (opts.data_listen.clone(), opts.tls.clone());
    let started = pull_rt
        .handle()
        .spawn(async move {
            let data_listener =
                Listener::bind(&data_listen)
                    .await
                    .map_err(|source| SeedError::Listen {
                        addr: data_listen.to_string(),
                        source,
                    })?;
            let data = data_listener.local_addr().map_err(SeedError::LocalAddr)?;
            let server = serve_with_runs(
                plane,
                runs,
                data_listener,
                ServeOptions {
                    read_only: true,
                    tls,
                    auth: Some(data_key),
                    log: false,
                    ..ServeOptions::default()
                },
            )
            .map_err(SeedError::Serve)?;
            Ok::<_, SeedError>((data, server))
        })
        .await;
    match started {
        Ok(r) => r,
        Err(source) => Err(SeedError::Task {
            what: "data plane",
            source,
        }),
    }
}

/// What the `Welcome` says of the region, its data plane listening at `data`.
fn region_info(region: &dyn Source, data: &ListenAddr) -> RegionInfo {
    RegionInfo {
        size: region.geometry().size(),
        chunk_size: region.geometry().chunk_size(),
        page_size: region.page_size(),
        data_port: match data {
            ListenAddr::Tcp(a) => a.port(),
            ListenAddr::Unix(_) => 0,
        },
        boot_id: crate::boot_id(),
        shared: region.shared_store().unwrap_or_default(),
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A control connection that finished its handshake, with its first message.
struct NewConn {
    channel: Channel,
    first: Msg,
    peer: String,
    /// What its authentication proved.
    proven: Proven,
}

/// Accepts control connections and runs their handshakes concurrently, each under a
/// deadline; at most `max` at once. A new one beyond closes one of them (see [`evictee`]).
struct Acceptor {
    listener: ControlListener,
    timeout: Duration,
    max: usize,
    out: mpsc::Sender<NewConn>,
    keys: SeederKeys,
}

/// A control connection in its handshake.
struct Pending {
    task: AbortOnDrop,
    /// The peer's host (its address without the port).
    host: String,
    /// How far it came ([`crate::auth::stage`]).
    progress: Arc<AtomicU8>,
    /// When it was accepted.
    since: Instant,
}

/// A connection that has sent nothing for this long is silent (a leecher's hello follows its
/// connection at once).
const SILENT: Duration = Duration::from_millis(250);

/// Which handshake to close for a new connection when `pending` is full: one that has not
/// proved the key (a leecher proves it one round trip after its hello; a peer without the
/// key never does), from the host with the most handshakes waiting (a flood from one host
/// closes its own), then a silent one, then the oldest. `None` when every one has proved
/// the key.
fn evictee(pending: &VecDeque<Pending>) -> Option<usize> {
    use crate::auth::stage::{CONNECTED, HELLO, PROVEN};
    let count = |host: &str| pending.iter().filter(|p| p.host == host).count();
    let stage = |p: &Pending| match p.progress.load(Ordering::Relaxed) {
        // Just accepted: its hello is on its way.
        CONNECTED if p.since.elapsed() < SILENT => HELLO,
        s => s,
    };
    pending
        .iter()
        .enumerate()
        .filter(|(_, p)| p.progress.load(Ordering::Relaxed) < PROVEN)
        .min_by_key(|(at, p)| (std::cmp::Reverse(count(&p.host)), stage(p), *at))
        .map(|(at, _)| at)
}

/// The host part of a peer's address (`1.2.3.4:5` → `1.2.3.4`, `[::1]:5` → `[::1]`).
fn host_of(peer: &str) -> &str {
    match peer.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => peer,
    }
}

impl Acceptor {
    async fn run(self) {
        let mut pending: VecDeque<Pending> = VecDeque::new();
        loop {
            let accepted = match self.listener.accept_raw().await {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors, for example: wait a little instead of spinning.
                    tracing::warn!("accepting a control connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            pending.retain(|p| !p.task.0.is_finished());
            if pending.len() >= self.max {
                match evictee(&pending) {
                    Some(at) => {
                        let p = pending.remove(at).expect("in range");
                        tracing::warn!(
                            "{} control connections in their handshake: closing one from {}",
                            self.max,
                            p.host
                        );
                    }
                    None => {
                        tracing::warn!(
                            "{} control connections proved the key and wait: refusing {}",
                            self.max,
                            accepted.peer
                        );
                        continue;
                    }
                }
            }
            let host = host_of(&accepted.peer).to_owned();
            let progress = Arc::new(AtomicU8::new(crate::auth::stage::CONNECTED));
            let (out, timeout, keys) = (self.out.clone(), self.timeout, self.keys.clone());
            let shake = handshake(accepted, timeout, keys, out, progress.clone());
            pending.push_back(Pending {
                task: AbortOnDrop(tokio::spawn(shake)),
                host,
                progress,
                since: Instant::now(),
            });
        }
    }
}

async fn handshake(
    accepted: Accepted,
    timeout: Duration,
    keys: SeederKeys,
    out: mpsc::Sender<NewConn>,
    progress: Arc<AtomicU8>,
) {
    let peer = accepted.peer.clone();
    let shaken = tokio::time::timeout(timeout, async {
        let mut channel = accepted
            .handshake()
            .await
            .map_err(|e| farmap_core::error_chain(&e))?;
        let proven = crate::auth::seeder_noting(&mut channel, &keys, &progress).await?;
        match channel.recv().await {
            Ok(Some(first)) => Ok((channel, first, proven)),
            Ok(None) => Err("it closed without a message".to_owned()),
            Err(e) => {
                let _ = channel
                    .send(&Msg::Abort {
                        reason: format!("not a migration message: {e}"),
                    })
                    .await;
                Err(format!("its first message was refused: {e}"))
            }
        }
    })
    .await;
    match shaken {
        Ok(Ok((channel, first, proven))) => {
            let _ = out
                .send(NewConn {
                    channel,
                    first,
                    peer,
                    proven,
                })
                .await;
        }
        Ok(Err(why)) => tracing::info!("control connection from {peer} dropped: {why}"),
        Err(_) => {
            tracing::info!("control connection from {peer} dropped: no message within {timeout:?}")
        }
    }
}

/// Resolves once cancelled; never if every canceller is gone without cancelling.
async fn until_cancelled(rx: &mut tokio::sync::watch::Receiver<bool>) {
    if rx.wait_for(|c| *c).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Refuses a connection while another leecher is served, without holding up the seeder.
fn refuse_busy(ch: Channel, peer: String) {
    refuse(ch, peer, "the seeder is busy with another leecher");
}

/// Refuses a connection with `reason`, without holding up the seeder.
fn refuse(mut ch: Channel, peer: String, reason: &'static str) {
    tokio::spawn(async move {
        let abort = Msg::Abort {
            reason: reason.into(),
        };
        let _ = tokio::time::timeout(Duration::from_secs(5), ch.send(&abort)).await;
        tracing::info!("refused a control connection from {peer}: {reason}");
    });
}

/// The next message of the current connection (never, without one).
async fn recv_current(c: &mut Option<Current>) -> Option<std::io::Result<Msg>> {
    match c {
        Some(c) => c.rx.recv().await,
        None => std::future::pending().await,
    }
}

/// Sleeps until `at` (forever, without one).
async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The leecher's control connection being served.
struct Current {
    tx: Sender,
    rx: mpsc::Receiver<std::io::Result<Msg>>,
}

async fn run(
    mut run: SeedRun,
    mut conns: mpsc::Receiver<NewConn>,
    mut machine: Seeder,
    mut cancelled: tokio::sync::watch::Receiver<bool>,
) -> Result<SeedReport, SeedError> {
    loop {
        let input = match run.inputs.pop_front() {
            Some(i) => i,
            None => match run.wait(&mut conns, &mut machine, &mut cancelled).await? {
                Some(i) => i,
                None => continue,
            },
        };
        run.started.get_or_insert_with(Instant::now);
        for action in machine.step(input) {
            if let Some(report) = run.act(action, &machine).await? {
                return Ok(report);
            }
        }
    }
}

/// A seeder's state between the steps of its machine: the leecher's connection, the inputs
/// its actions produced, the report so far.
struct SeedRun {
    region: Arc<dyn Source>,
    suspend: Arc<dyn Suspend>,
    opts: SeedOptions,
    rep: Reporter,
    report: SeedReport,
    started: Option<Instant>,
    current: Option<Current>,
    /// Set while handed over with no connection: when the leecher was lost.
    lost_since: Option<tokio::time::Instant>,
    inputs: VecDeque<SeederInput>,
    /// The keys of the current session and its data plane.
    keys: SeederKeys,
    /// The data plane's pull budget: restarted for each leecher, lifted at the suspension.
    pacer: Arc<crate::budget::Pacer>,
}

impl SeedRun {
    fn new(
        region: Arc<dyn Source>,
        suspend: Arc<dyn Suspend>,
        opts: SeedOptions,
        keys: SeederKeys,
        pacer: Arc<crate::budget::Pacer>,
    ) -> Self {
        let rep = Reporter {
            prefix: "farmap seed",
            log: opts.log,
            observer: opts.observer.clone(),
        };
        Self {
            region,
            suspend,
            opts,
            rep,
            report: SeedReport {
                dirty_sets: 0,
                dirty_pages: 0,
                abandoned: 0,
                elapsed: Duration::ZERO,
                mode: crate::msg::Mode::Precopy,
            },
            started: None,
            current: None,
            lost_since: None,
            inputs: VecDeque::new(),
            keys,
            pacer,
        }
    }

    /// Waits for the machine's next input: a message or the loss of the connection, a new
    /// connection (`None` after refusing a second leecher), the reconnect deadline after the
    /// hand-over, or a cancel before it.
    async fn wait(
        &mut self,
        conns: &mut mpsc::Receiver<NewConn>,
        machine: &mut Seeder,
        cancelled: &mut tokio::sync::watch::Receiver<bool>,
    ) -> Result<Option<SeederInput>, SeedError> {
        // Cancelling counts only before the hand-over.
        let cancellable = matches!(
            machine.state(),
            SeederState::Idle | SeederState::Serving { .. }
        );
        let give_up = self.lost_since.map(|t| t + self.opts.reconnect_wait);
        tokio::select! {
            m = recv_current(&mut self.current), if self.current.is_some() => Ok(Some(match m {
                Some(Ok(m)) => SeederInput::Received(m),
                Some(Err(e)) => {
                    self.rep.note(format!("the control connection failed: {e}"));
                    self.current = None;
                    SeederInput::Disconnected
                }
                None => {
                    self.current = None;
                    SeederInput::Disconnected
                }
            })),
            Some(new) = conns.recv() => {
                let asked = match &new.first {
                    Msg::Hello { session, .. } => Some(*session),
                    _ => None,
                };
                if asked.is_some_and(|s| s != new.proven.session) {
                    // Proving one session (or a new one) and asking for another: someone
                    // trying to take over a session whose key it does not hold.
                    refuse(new.channel, new.peer, "the Hello asks for another session than \
                        the one authenticated");
                    return Ok(None);
                }
                let reconnect = matches!(
                    (machine.state(), asked),
                    (SeederState::HandedOver { session, .. }, Some(s)) if s == session
                );
                if self.current.is_some() && !reconnect {
                    refuse_busy(new.channel, new.peer);
                    return Ok(None);
                }
                if asked == Some(0) && machine.state() == SeederState::Idle {
                    // A new session: an id nobody can guess, and the key this connection's
                    // authentication made, for its reconnects and its data plane.
                    let id = u128::from_be_bytes(
                        farmap_net::auth::random_nonce()[..16].try_into().expect("16 bytes"),
                    );
                    machine.set_next_session(id);
                    self.keys.begin(id.max(1), &new.proven.session_key);
                }
                // A leecher coming back replaces its old connection.
                let (tx, rx) = new.channel.split();
                self.current = Some(Current { tx, rx });
                self.lost_since = None;
                Ok(Some(SeederInput::Received(new.first)))
            },
            _ = sleep_until(give_up), if give_up.is_some() && self.current.is_none() => {
                Err(SeedError::LostAfterHandOver(self.opts.reconnect_wait))
            }
            _ = until_cancelled(cancelled), if cancellable => Err(self.cancel(machine).await),
        }
    }

    /// Cancels before the hand-over: the same path as a leecher's Abort (tracking stops,
    /// nothing was suspended, the source runs on); the leecher is told why.
    async fn cancel(&mut self, machine: &mut Seeder) -> SeedError {
        if let Some(c) = self.current.as_mut() {
            let reason = "the seeder was cancelled before the hand-over; the source keeps running"
                .to_owned();
            let _ = tokio::time::timeout(Duration::from_secs(5), c.tx.send(&Msg::Abort { reason }))
                .await;
            machine.step(SeederInput::Disconnected);
            self.rep
                .note("cancelled before the hand-over: the leecher was told, the source runs on");
        } else {
            self.rep
                .note("cancelled before any leecher took the region: the source runs on");
        }
        SeedError::Cancelled
    }

    /// Carries out one action of the machine; the report once the region is released.
    async fn act(
        &mut self,
        action: SeederAction,
        machine: &Seeder,
    ) -> Result<Option<SeedReport>, SeedError> {
        match action {
            SeederAction::Send(m) => self.send(m).await,
            SeederAction::ResetTracking => {
                self.rep.note("a leecher connected: tracking writes");
                // Its pull's budget counts from now: the wait for it was no credit.
                self.pacer.restart();
                self.take_dirty().await?;
            }
            SeederAction::TakeDirty { round } => {
                let d = self.take_dirty().await?;
                self.report.dirty_sets += 1;
                self.report.dirty_pages += run_pages(&d);
                self.rep.note(format!(
                    "round {round}: {} pages written since the last round",
                    run_pages(&d)
                ));
                self.inputs.push_back(SeederInput::Dirty { round, runs: d });
            }
            SeederAction::Draft => self.draft().await?,
            SeederAction::Suspend { instant } => {
                // The application stops: what the leecher reads from here on (the last
                // changes, the post-copy) is what the destination waits for.
                self.pacer.lift();
                self.suspend(instant).await?;
            }
            SeederAction::ConfirmRest => self.confirm_rest().await?,
            SeederAction::Resume => {
                if machine.mode() == crate::msg::Mode::Instant {
                    // Abandoned before the hand-over: the region keeps its store.
                    self.region.unseal();
                }
                self.suspend.resume();
            }
            SeederAction::StopTracking { reason } => {
                self.report.abandoned += 1;
                self.rep.note(reason);
            }
            SeederAction::AwaitReconnect => {
                self.rep
                    .note("the leecher lost its connection after the hand-over: waiting for it");
                self.current = None;
                // The deadline runs from the first loss: strangers connecting meanwhile
                // (and being refused) do not push it back.
                self.lost_since
                    .get_or_insert_with(tokio::time::Instant::now);
            }
            SeederAction::Release => {
                self.suspend.retire();
                self.rep.note("the leecher has everything: region released");
                self.report.elapsed = self.started.map_or(Duration::ZERO, |s| s.elapsed());
                self.report.mode = machine.mode();
                return Ok(Some(self.report.clone()));
            }
            SeederAction::Close => {
                // The connection is gone for the machine too (a refused leecher's
                // session is undone by the machine's own actions).
                if self.current.take().is_some() {
                    self.inputs.push_back(SeederInput::Disconnected);
                }
            }
        }
        Ok(None)
    }

    /// Sends `m` to the leecher, if one is connected. A leecher that stops reading cannot
    /// hold the seeder (and its cancel) for ever: a send that makes no headway for
    /// [`SEND_TIMEOUT`] drops it.
    async fn send(&mut self, m: Msg) {
        let Some(c) = self.current.as_mut() else {
            return;
        };
        let sent = tokio::time::timeout(SEND_TIMEOUT, c.tx.send(&m)).await;
        if !matches!(sent, Ok(Ok(()))) {
            self.current = None;
            self.inputs.push_back(SeederInput::Disconnected);
        } else if matches!(m, Msg::HandOver { .. }) {
            self.rep.emit(Event::HandedOver);
        }
    }

    /// The pages written since the last scan, scanned on a blocking thread.
    async fn take_dirty(&mut self) -> Result<Vec<std::ops::Range<u64>>, SeedError> {
        let r = self.region.clone();
        tokio::task::spawn_blocking(move || r.take_dirty())
            .await
            .map_err(|source| SeedError::Task {
                what: "dirty scan",
                source,
            })?
            .map_err(SeedError::Dirty)
    }

    /// Instant mode, while the application runs: pushes what the shared store lacks (within
    /// the push budget), then drafts the manifest (no push starts after it).
    async fn draft(&mut self) -> Result<(), SeedError> {
        let (r, s) = (self.region.clone(), self.suspend.clone());
        let budget = self.opts.push_budget;
        let rep = self.rep.clone();
        let drafted = tokio::task::spawn_blocking(move || {
            // The application readies its suspension first: what is written while it
            // does is still pushed below, not left at the source.
            let t0 = Instant::now();
            s.prepare().map_err(FinalError::Suspend)?;
            rep.note(format!(
                "instant: the application was ready to be suspended after {:.1} ms",
                t0.elapsed().as_secs_f64() * 1e3
            ));
            if !budget.is_zero() {
                rep.note(format!(
                    "instant: pushing what the shared store lacks (at most {budget:?})"
                ));
            }
            let mut pushed = None;
            if !budget.is_zero() {
                // The application runs on meanwhile; whatever is left is
                // fetched from here after the hand-over.
                let t0 = Instant::now();
                match r.push_shared(budget) {
                    Ok(all) => pushed = Some((all, t0.elapsed())),
                    Err(e) => tracing::warn!(
                        "pushing before an instant hand-over failed (those chunks \
                         come from the source): {}",
                        farmap_core::error_chain(e.as_ref())
                    ),
                }
            }
            // No push starts from here on; the manifest is sent while the
            // application still runs, so the downtime does not carry it.
            let t0 = Instant::now();
            let m = r.draft();
            if m.is_err() {
                r.unseal();
            }
            m.map(|m| (m, t0.elapsed(), pushed))
                .map_err(FinalError::Seal)
        })
        .await
        .map_err(|source| SeedError::Task {
            what: "the instant draft",
            source,
        })?;
        let input = match drafted {
            Ok((m, took, pushed)) => {
                if let Some((all, pushing)) = pushed {
                    self.rep.note(format!(
                        "instant: pushed for {:.1} ms: {}",
                        pushing.as_secs_f64() * 1e3,
                        if all {
                            "what was written before it is in the shared store"
                        } else {
                            "the budget ran out first"
                        }
                    ));
                }
                self.rep.note(format!(
                    "instant: manifest made in {:.2} ms while the application \
                     runs: {} chunks in the shared store, {} only here",
                    took.as_secs_f64() * 1e3,
                    m.pushed.len(),
                    m.source_chunks(),
                ));
                SeederInput::Drafted(m)
            }
            Err(e) => SeederInput::SuspendFailed(Arc::new(e)),
        };
        self.inputs.push_back(input);
        Ok(())
    }

    /// Suspends the application and takes the last dirty set (or, in instant mode, seals
    /// the region's store); on a failure the application runs on.
    async fn suspend(&mut self, instant: bool) -> Result<(), SeedError> {
        let (r, s) = (self.region.clone(), self.suspend.clone());
        let done = run_blocking(move || {
            // An instant migration prepared before its draft.
            if !instant {
                s.prepare()?;
            }
            let t0 = Instant::now();
            let state = match s.suspend() {
                Ok(state) => state,
                Err(e) => {
                    if instant {
                        r.unseal();
                    }
                    return Err(e.into());
                }
            };
            let at_ns = crate::monotonic_ns();
            let t1 = Instant::now();
            let d = if instant {
                r.seal()
                    .map(|c| (Vec::new(), Some(c)))
                    .map_err(FinalError::Seal)
            } else {
                r.take_dirty().map(|d| (d, None)).map_err(FinalError::Dirty)
            };
            let took = (t1 - t0, t1.elapsed());
            match d {
                Ok((d, c)) => Ok((d, c, state, at_ns, took)),
                Err(e) => {
                    if instant {
                        r.unseal();
                    }
                    s.resume();
                    Err(e)
                }
            }
        })
        .await
        .map_err(|source| SeedError::Task {
            what: "suspension",
            source,
        })?;
        let input = match done {
            Ok((d, confirm, app_state, at_ns, (suspending, scan))) => {
                self.report.dirty_sets += 1;
                self.report.dirty_pages += run_pages(&d);
                match &confirm {
                    Some(c) => self.rep.note(format!(
                        "suspended in {:.2} ms (seal {:.2} ms): {} chunks written \
                         lately moved to the source, {} chunk runs looked at after \
                         the hand-over",
                        suspending.as_secs_f64() * 1e3,
                        scan.as_secs_f64() * 1e3,
                        run_pages(&c.at_source),
                        c.pending.len(),
                    )),
                    None => self.rep.note(format!(
                        "suspended in {:.2} ms (final scan {:.2} ms); handing over \
                         {} pages written since the last round",
                        suspending.as_secs_f64() * 1e3,
                        scan.as_secs_f64() * 1e3,
                        run_pages(&d)
                    )),
                }
                SeederInput::Suspended {
                    runs: d,
                    confirm,
                    app_state,
                    at_ns,
                }
            }
            Err(e) => SeederInput::SuspendFailed(Arc::new(e)),
        };
        self.inputs.push_back(input);
        Ok(())
    }

    /// Instant mode, after the hand-over: looks at the chunks the seal left for later.
    async fn confirm_rest(&mut self) -> Result<(), SeedError> {
        let r = self.region.clone();
        let t0 = Instant::now();
        let c = tokio::task::spawn_blocking(move || r.confirm_rest())
            .await
            .map_err(|source| SeedError::Task {
                what: "the instant confirmation",
                source,
            })?;
        self.rep.note(format!(
            "instant: looked at the other chunks in {:.2} ms after the hand-over: \
             {} more written lately",
            t0.elapsed().as_secs_f64() * 1e3,
            run_pages(&c.at_source),
        ));
        self.inputs.push_back(SeederInput::Confirmed(c));
        Ok(())
    }
}

/// Runs `f`, which blocks, from the seeder's task: on a multi-thread runtime in place (the
/// worker's other tasks move to another thread first), so that the task goes on on this
/// thread when `f` returns. Inside the downtime that saves waking another thread (tens of µs
/// on a VM whose idle CPUs halt). Elsewhere, on the blocking pool.
async fn run_blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, tokio::task::JoinError> {
    match tokio::runtime::Handle::current().runtime_flavor() {
        tokio::runtime::RuntimeFlavor::MultiThread => Ok(tokio::task::block_in_place(f)),
        _ => tokio::task::spawn_blocking(f).await,
    }
}

#[cfg(test)]
mod acceptor_tests {
    use super::*;

    fn pending(host: &str, progress: u8, age: Duration) -> Pending {
        Pending {
            task: AbortOnDrop(tokio::spawn(std::future::pending::<()>())),
            host: host.to_owned(),
            progress: Arc::new(AtomicU8::new(progress)),
            since: Instant::now() - age,
        }
    }

    #[tokio::test]
    async fn the_handshake_closed_is_of_the_busiest_host_then_silent_then_the_oldest() {
        use crate::auth::stage::{CONNECTED, HELLO, PROVEN};
        let (fresh, old) = (Duration::ZERO, Duration::from_secs(1));
        let mut p: VecDeque<Pending> = VecDeque::new();
        p.push_back(pending("10.0.0.1", CONNECTED, fresh)); // the leecher, just accepted
        p.push_back(pending("10.0.0.9", HELLO, old));
        p.push_back(pending("10.0.0.9", HELLO, old));
        p.push_back(pending("10.0.0.9", CONNECTED, old));
        assert_eq!(evictee(&p), Some(3), "the flooding host's silent one first");
        p.remove(3);
        assert_eq!(evictee(&p), Some(1), "then its oldest");
        p.remove(1);
        p.push_back(pending("10.0.0.7", CONNECTED, old));
        assert_eq!(evictee(&p), Some(2), "one each: the silent one");
        p.remove(2);
        assert_eq!(evictee(&p), Some(0), "one each, none silent: the oldest");
        p.remove(0);
        p.push_back(pending("10.0.0.9", PROVEN, old));
        p.push_back(pending("10.0.0.9", PROVEN, old));
        assert_eq!(evictee(&p), Some(0), "all that is left unproven");
        p.remove(0);
        assert_eq!(
            evictee(&p),
            None,
            "a key holder is never closed for a newcomer"
        );
        assert_eq!(host_of("10.0.0.1:7100"), "10.0.0.1");
        assert_eq!(host_of("[::1]:7100"), "[::1]");
        assert_eq!(host_of("unix:/run/farmap.sock"), "unix:/run/farmap.sock");
    }
}
