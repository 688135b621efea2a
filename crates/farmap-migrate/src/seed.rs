//! The seeder's runner: serves the live region's pages on a data plane
//! (`farmap_net::serve` of a [`LiveView`]) and drives a [`Seeder`] over control
//! connections until a leecher has taken the region over and completed.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use farmap_net::{serve, ListenAddr, Listener, ServeOptions, TlsServerConfig};
use farmap_uffd::Region;

use crate::channel::ControlListener;
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
    task: tokio::task::JoinHandle<Result<SeedReport, SeedError>>,
}

impl Seeding {
    /// Waits until the region was handed over and released (or seeding failed).
    pub async fn finish(self) -> Result<SeedReport, SeedError> {
        self.task
            .await
            .unwrap_or_else(|e| Err(SeedError::Serve(format!("the seeder task failed: {e}"))))
    }
}

fn to_runs(pages: &[Range<u64>]) -> Vec<Range<u64>> {
    pages.to_vec()
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
    let task = tokio::spawn(async move {
        let r = run(
            region,
            suspend,
            opts,
            control_listener,
            Seeder::new(info, seed),
        )
        .await;
        let _ = server.shutdown().await;
        r
    });
    Ok(Seeding {
        control,
        data,
        task,
    })
}

async fn run(
    region: Arc<Region>,
    suspend: Arc<dyn Suspend>,
    opts: SeedOptions,
    listener: ControlListener,
    mut machine: Seeder,
) -> Result<SeedReport, SeedError> {
    let log = |s: &str| {
        if opts.log {
            eprintln!("farmap seed: {s}");
        }
    };
    let mut report = SeedReport {
        dirty_sets: 0,
        dirty_pages: 0,
        abandoned: 0,
        elapsed: Duration::ZERO,
    };
    let mut started: Option<Instant> = None;
    loop {
        let accepted = if matches!(machine.state(), SeederState::HandedOver { .. }) {
            match tokio::time::timeout(opts.reconnect_wait, listener.accept()).await {
                Ok(r) => r,
                Err(_) => return Err(SeedError::LostAfterHandOver(opts.reconnect_wait)),
            }
        } else {
            listener.accept().await
        };
        let ch = match accepted {
            Ok(ch) => ch,
            Err(e) => {
                log(&format!("a control connection failed: {e}"));
                continue;
            }
        };
        let (mut tx, mut rx) = ch.split();
        let mut inputs = std::collections::VecDeque::new();
        'conn: loop {
            let input = match inputs.pop_front() {
                Some(i) => i,
                None => match rx.recv().await {
                    Some(Ok(m)) => SeederInput::Received(m),
                    Some(Err(_)) | None => SeederInput::Disconnected,
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
                        }
                    }
                    SeederAction::ResetTracking => {
                        log("a leecher connected: tracking writes");
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
                        inputs.push_back(SeederInput::Dirty {
                            round,
                            runs: to_runs(&d.pages),
                        });
                    }
                    SeederAction::Suspend => {
                        let (r, s) = (region.clone(), suspend.clone());
                        let verbose = opts.log;
                        let done = tokio::task::spawn_blocking(move || {
                            let t0 = Instant::now();
                            let state = s.suspend()?;
                            let at_ns = crate::monotonic_ns();
                            let t1 = Instant::now();
                            let d = r.take_dirty();
                            if verbose {
                                eprintln!(
                                    "farmap seed: suspending took {:.2} ms, the final scan {:.2} ms",
                                    (t1 - t0).as_secs_f64() * 1e3,
                                    t1.elapsed().as_secs_f64() * 1e3
                                );
                            }
                            match d {
                                Ok(d) => Ok((d, state, at_ns)),
                                Err(e) => {
                                    s.resume();
                                    Err(format!("taking the final dirty set: {e}"))
                                }
                            }
                        })
                        .await
                        .expect("suspend does not panic");
                        inputs.push_back(match done {
                            Ok((d, app_state, at_ns)) => {
                                report.dirty_sets += 1;
                                report.dirty_pages += run_pages(&d.pages);
                                log(&format!(
                                    "suspended; handing over ({} pages written since the last round)",
                                    run_pages(&d.pages)
                                ));
                                SeederInput::Suspended {
                                    runs: to_runs(&d.pages),
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
                        log(&reason);
                    }
                    SeederAction::AwaitReconnect => {
                        log("the leecher lost its connection after the hand-over: waiting for it");
                        break 'conn;
                    }
                    SeederAction::Release => {
                        suspend.retire();
                        log("the leecher has everything: region released");
                        report.elapsed = started.map_or(Duration::ZERO, |s| s.elapsed());
                        return Ok(report);
                    }
                    SeederAction::Close => break 'conn,
                }
            }
        }
    }
}
