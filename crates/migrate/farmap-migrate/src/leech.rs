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
use farmap_core::{error_chain, Geometry};
use farmap_net::auth::Key;
use farmap_net::{ClientOptions, RemoteAddr, RemoteStore};
use farmap_pipeline::RetryPolicy;
use tokio::sync::mpsc;

use crate::budget::{Pacer, PullPriority};
use crate::channel::{connect, Channel, Sender};
use crate::endpoint::Destination;
use crate::event::{Event, Reporter};
use crate::machine::{
    AbortCause, Confirm, Finalization, Leecher, LeecherAction, LeecherInput, LeecherLimits,
    Manifest,
};
use crate::msg::{run_pages, Mode, Msg, RegionInfo};
use crate::view::MigrationStore;

mod copy;
mod options;

use copy::{bulk_pull, instant_copy, post_copy, refresh_round, HANDOVER_AWAKE};

pub use options::{
    region_opener, AfterHandOver, ConnectError, LeechError, LeechOptions, LeechReport, OpenContext,
    OpenError, Opener, Resumer, SharedOpener,
};

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
    cancel: tokio::sync::watch::Receiver<bool>,
) -> Result<LeechReport<D>, LeechError> {
    // Every log line of the migration names its side and its source.
    let span = tracing::info_span!("leech", from = %opts.from);
    tracing::Instrument::instrument(leech_here(opts, open, resume, cancel), span).await
}

/// [`leech_into`], inside its span.
async fn leech_here<D: Destination>(
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
        postcopy_done: None,
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
    /// Ends when the post-copy does.
    postcopy_done: Option<tokio::sync::oneshot::Receiver<()>>,
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
            LeecherAction::InstallManifest(m) => self.install_manifest(m).await,
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
    async fn install_manifest(
        &mut self,
        m: Manifest,
    ) -> Result<Option<LeechReport<D>>, LeechError> {
        if let Some(d) = self.dest.as_ref() {
            // Before the hand-over, while the source still runs: the downtime
            // carries only the confirmation of the chunks written lately.
            let t0 = Instant::now();
            // A store that keeps versions reads the one the source saved with its last
            // pushes (made before it sent the manifest), so that those read as pushed.
            d.store
                .catch_up_shared()
                .await
                .map_err(|e| LeechError::Region(OpenError::Shared(e.into())))?;
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
            if let Some(report) = self.fall_back(machine).await {
                return Ok(Some(report));
            }
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
                    if let Some(report) = self.fall_back(machine).await {
                        return Ok(Some(report));
                    }
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

    /// An instant migration whose seeder is lost for good after the hand-over: finishes from
    /// the shared store (the chunks only the source held and not received yet roll back to
    /// its last version, and the report lists them). `None` otherwise (nothing to fall back
    /// on: the migration fails).
    async fn fall_back(&mut self, machine: &Leecher) -> Option<LeechReport<D>> {
        if !self.handed_over || self.opts.mode != Mode::Instant {
            return None;
        }
        let d = self.dest.as_ref()?;
        let rolled = d.store.fall_back_to_shared();
        self.rep.note(format!(
            "the seeder is gone: finishing from the shared store; {} chunks only it held \
             roll back to the store's last version{}",
            rolled.len(),
            if rolled.is_empty() {
                String::new()
            } else {
                format!(" ({})", crate::leech::copy::chunk_list(&rolled))
            }
        ));
        if let Some(done) = self.postcopy_done.take() {
            let _ = done.await;
        }
        self.finish(machine).ok().flatten()
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
            rolled_back: d.store.rolled_back(),
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
        if manifest.is_some() {
            // The region is here: this host becomes the shared store's one writer (a
            // versioned region's next epoch), so that the old host is fenced at its next
            // flush. Outside the downtime: the application already runs.
            let store = self.dest.as_ref().map(|d| d.store.clone());
            tokio::spawn(async move {
                let Some(store) = store else { return };
                match store.take_over_shared().await {
                    Ok(()) => tracing::debug!("took the shared store over"),
                    Err(e) => tracing::warn!(
                        "taking the shared store over failed (this host's next flush to it \
                         says why): {}",
                        farmap_core::error_chain(&e)
                    ),
                }
            });
        }
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
        let (done, done_rx) = tokio::sync::oneshot::channel();
        self.postcopy_done = Some(done_rx);
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
            let _ = done.send(());
        });
        self.postcopy = Some(task.abort_handle());
    }
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
