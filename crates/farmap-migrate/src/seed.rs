//! The seeder's runner: serves the live region's pages on a data plane
//! (`farmap_net::serve` of a [`LiveView`]) and drives a [`Seeder`] over control
//! connections until a leecher has taken the region over and completed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use farmap_net::{serve, ListenAddr, Listener, ServeOptions, TlsServerConfig};
use farmap_uffd::Region;

use crate::channel::ControlListener;
use crate::event::{Event, Observer, Reporter};
use crate::machine::{RegionInfo, Seeder, SeederAction, SeederInput, SeederState};
use crate::msg::run_pages;
use crate::suspend::Suspend;
use crate::view::LiveView;

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
    /// Log progress lines on stderr.
    pub log: bool,
    /// Receives progress events.
    pub observer: Option<Observer>,
}

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
    /// The data plane could not start.
    #[error("starting the data plane failed: {0}")]
    Serve(String),
    /// Write tracking failed.
    #[error("taking the region's written pages failed")]
    Dirty(#[source] farmap_uffd::RegionError),
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

    /// Waits until the region was handed over and released (or seeding failed).
    pub async fn finish(self) -> Result<SeedReport, SeedError> {
        self.task
            .await
            .unwrap_or_else(|e| Err(SeedError::Serve(format!("the seeder task failed: {e}"))))
    }
}

/// Starts seeding `region`, whose writers `suspend` stops.
pub async fn seed(
    region: Arc<Region>,
    suspend: Arc<dyn Suspend>,
    opts: SeedOptions,
) -> Result<Seeding, SeedError> {
    let data_listener =
        Listener::bind(&opts.data_listen)
            .await
            .map_err(|source| SeedError::Listen {
                addr: opts.data_listen.to_string(),
                source,
            })?;
    let data = data_listener
        .local_addr()
        .map_err(|e| SeedError::Serve(e.to_string()))?;
    let server = serve(
        Arc::new(LiveView::new(region.clone())),
        data_listener,
        ServeOptions {
            read_only: true,
            tls: opts.tls.clone(),
            log: false,
            ..ServeOptions::default()
        },
    )
    .map_err(|e| SeedError::Serve(e.to_string()))?;
    let control_listener = ControlListener::bind(&opts.listen, opts.tls.as_ref())
        .await
        .map_err(|source| SeedError::Listen {
            addr: opts.listen.to_string(),
            source,
        })?;
    let control = control_listener
        .local_addr()
        .map_err(|e| SeedError::Serve(e.to_string()))?;
    let info = RegionInfo {
        size: region.len() as u64,
        chunk_size: region.geometry().chunk_size(),
        page_size: region.page_size() as u32,
        data_port: match &data {
            ListenAddr::Tcp(a) => a.port(),
            ListenAddr::Unix(_) => 0,
        },
        boot_id: crate::boot_id(),
    };
    let seed = u64::from(std::process::id()) << 32 | (crate::monotonic_ns() & 0xffff_ffff);
    let (cancel, cancelled) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(async move {
        let r = run(
            region,
            suspend,
            opts,
            control_listener,
            Seeder::new(info, seed),
            cancelled,
        )
        .await;
        let _ = server.shutdown().await;
        r
    });
    Ok(Seeding {
        control,
        data,
        cancel,
        task,
    })
}

/// Resolves once cancelled; never if every canceller is gone without cancelling.
async fn until_cancelled(rx: &mut tokio::sync::watch::Receiver<bool>) {
    if rx.wait_for(|c| *c).await.is_err() {
        std::future::pending::<()>().await;
    }
}

async fn run(
    region: Arc<Region>,
    suspend: Arc<dyn Suspend>,
    opts: SeedOptions,
    listener: ControlListener,
    mut machine: Seeder,
    mut cancelled: tokio::sync::watch::Receiver<bool>,
) -> Result<SeedReport, SeedError> {
    let rep = Reporter {
        prefix: "farmap seed",
        log: opts.log,
        observer: opts.observer.clone(),
    };
    let mut report = SeedReport {
        dirty_sets: 0,
        dirty_pages: 0,
        abandoned: 0,
        elapsed: Duration::ZERO,
    };
    let mut started: Option<Instant> = None;
    // Cancelling counts only before the hand-over.
    let cancellable =
        |m: &Seeder| matches!(m.state(), SeederState::Idle | SeederState::Serving { .. });
    loop {
        let accepted = if matches!(machine.state(), SeederState::HandedOver { .. }) {
            match tokio::time::timeout(opts.reconnect_wait, listener.accept()).await {
                Ok(r) => r,
                Err(_) => return Err(SeedError::LostAfterHandOver(opts.reconnect_wait)),
            }
        } else {
            tokio::select! {
                r = listener.accept() => r,
                _ = until_cancelled(&mut cancelled) => {
                    rep.note("cancelled before any leecher took the region: the source runs on");
                    return Err(SeedError::Cancelled);
                }
            }
        };
        let ch = match accepted {
            Ok(ch) => ch,
            Err(e) => {
                rep.note(format!("a control connection failed: {e}"));
                continue;
            }
        };
        let (mut tx, mut rx) = ch.split();
        let mut inputs = std::collections::VecDeque::new();
        'conn: loop {
            let input = match inputs.pop_front() {
                Some(i) => i,
                None => tokio::select! {
                    m = rx.recv() => match m {
                        Some(Ok(m)) => SeederInput::Received(m),
                        Some(Err(_)) | None => SeederInput::Disconnected,
                    },
                    _ = until_cancelled(&mut cancelled), if cancellable(&machine) => {
                        // The same path as a leecher's Abort: tracking stops, nothing was
                        // suspended, the source runs on. The leecher is told why.
                        let reason = "the seeder was cancelled before the hand-over; the source keeps \
                                      running"
                            .to_owned();
                        let _ = tx.send(&crate::msg::Msg::Abort { reason }).await;
                        machine.step(SeederInput::Disconnected);
                        rep.note("cancelled before the hand-over: the leecher was told, the source runs on");
                        return Err(SeedError::Cancelled);
                    }
                },
            };
            if started.is_none() {
                started = Some(Instant::now());
            }
            for action in machine.step(input) {
                match action {
                    SeederAction::Send(m) => {
                        if tx.send(&m).await.is_err() {
                            inputs.push_back(SeederInput::Disconnected);
                        } else if matches!(m, crate::msg::Msg::HandOver { .. }) {
                            rep.emit(Event::HandedOver);
                        }
                    }
                    SeederAction::ResetTracking => {
                        rep.note("a leecher connected: tracking writes");
                        let r = region.clone();
                        tokio::task::spawn_blocking(move || r.take_dirty())
                            .await
                            .expect("take_dirty does not panic")
                            .map_err(SeedError::Dirty)?;
                    }
                    SeederAction::TakeDirty { round } => {
                        let r = region.clone();
                        let d = tokio::task::spawn_blocking(move || r.take_dirty())
                            .await
                            .expect("take_dirty does not panic")
                            .map_err(SeedError::Dirty)?;
                        report.dirty_sets += 1;
                        report.dirty_pages += run_pages(&d.pages);
                        rep.note(format!(
                            "round {round}: {} pages written since the last round",
                            run_pages(&d.pages)
                        ));
                        inputs.push_back(SeederInput::Dirty {
                            round,
                            runs: d.pages,
                        });
                    }
                    SeederAction::Suspend => {
                        let (r, s) = (region.clone(), suspend.clone());
                        let done = tokio::task::spawn_blocking(move || {
                            let t0 = Instant::now();
                            let state = s.suspend()?;
                            let at_ns = crate::monotonic_ns();
                            let t1 = Instant::now();
                            let d = r.take_dirty();
                            let took = (t1 - t0, t1.elapsed());
                            match d {
                                Ok(d) => Ok((d, state, at_ns, took)),
                                Err(e) => {
                                    s.resume();
                                    Err(format!("taking the final dirty set: {e}"))
                                }
                            }
                        })
                        .await
                        .expect("suspend does not panic");
                        inputs.push_back(match done {
                            Ok((d, app_state, at_ns, (suspending, scan))) => {
                                report.dirty_sets += 1;
                                report.dirty_pages += run_pages(&d.pages);
                                rep.note(format!(
                                    "suspended in {:.2} ms (final scan {:.2} ms); handing over \
                                     {} pages written since the last round",
                                    suspending.as_secs_f64() * 1e3,
                                    scan.as_secs_f64() * 1e3,
                                    run_pages(&d.pages)
                                ));
                                SeederInput::Suspended {
                                    runs: d.pages,
                                    app_state,
                                    at_ns,
                                }
                            }
                            Err(e) => SeederInput::SuspendFailed(e),
                        });
                    }
                    SeederAction::Resume => suspend.resume(),
                    SeederAction::StopTracking { reason } => {
                        report.abandoned += 1;
                        rep.note(reason);
                    }
                    SeederAction::AwaitReconnect => {
                        rep.note(
                            "the leecher lost its connection after the hand-over: waiting for it",
                        );
                        break 'conn;
                    }
                    SeederAction::Release => {
                        suspend.retire();
                        rep.note("the leecher has everything: region released");
                        report.elapsed = started.map_or(Duration::ZERO, |s| s.elapsed());
                        return Ok(report);
                    }
                    SeederAction::Close => break 'conn,
                }
            }
        }
    }
}
