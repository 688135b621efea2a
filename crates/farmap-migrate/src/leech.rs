//! The leecher's runner: opens the destination region over the seeder's data plane, drives a
//! [`Leecher`] over the control connection, resumes the application at the hand-over and
//! finishes the post-copy.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use farmap_core::{ChunkIdx, Geometry};
use farmap_net::{ClientOptions, RemoteAddr, RemoteStore, TlsClientConfig};
use farmap_pipeline::{PushOptions, RetryPolicy};
use farmap_uffd::{Region, RegionMode, RegionOptions};
use tokio::sync::mpsc;

use crate::channel::{connect, Sender};
use crate::event::{Event, Observer, Reporter};
use crate::machine::{Convergence, Leecher, LeecherAction, LeecherInput, RoundResult};
use crate::msg::{run_pages, Msg};
use crate::view::MigrationStore;

/// Called at the hand-over with the region and the application state: starts the
/// application at the destination. It must return quickly (it is inside the downtime).
pub type Resumer = Box<dyn FnOnce(Arc<Region>, Bytes) + Send>;

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
    /// Log progress lines on stderr.
    pub log: bool,
    /// Receives progress events.
    pub observer: Option<Observer>,
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
            log: false,
            observer: None,
        }
    }
}

/// Why leeching failed.
#[derive(Debug, thiserror::Error)]
pub enum LeechError {
    /// The seeder could not be reached.
    #[error("cannot reach the seeder at {addr}")]
    Connect {
        /// Where.
        addr: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Opening the destination region failed (nothing was taken from the source).
    #[error("opening the destination region failed: {0}")]
    Region(String),
    /// The migration was abandoned before the hand-over: the source runs on.
    #[error("migration aborted: {0}")]
    Aborted(String),
    /// Cancelled before the hand-over: the source runs on.
    #[error("migration cancelled before the hand-over; the source keeps running")]
    Cancelled,
    /// After the hand-over, the seeder could not be reached again: chunks not yet fetched
    /// are lost.
    #[error("lost the seeder after the hand-over: {0}")]
    LostAfterHandOver(String),
}

/// A finished migration, as the destination saw it.
#[derive(Debug)]
pub struct LeechReport {
    /// The region, now owned here and detached from the seeder.
    pub region: Arc<Region>,
    /// Suspend → resume (across hosts of one boot; otherwise Finalize sent → resume).
    pub downtime: Duration,
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
}

fn chunks_of(runs: &[Range<u64>], page: u64, chunk: u64) -> Vec<ChunkIdx> {
    let mut out: Vec<ChunkIdx> = Vec::new();
    for r in runs {
        let (a, b) = (r.start * page / chunk, (r.end * page - 1) / chunk);
        for c in a..=b {
            if out.last().is_none_or(|l| l.0 < c) {
                out.push(ChunkIdx(c));
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

struct Dest {
    region: Arc<Region>,
    store: Arc<MigrationStore>,
    page: u64,
    chunk: u64,
}

/// Migrates a region here. `cancel` turning true before the hand-over abandons the migration
/// (the source runs on); `resume` starts the application at the hand-over.
pub async fn leech(
    opts: LeechOptions,
    resume: Resumer,
    mut cancel: tokio::sync::watch::Receiver<bool>,
) -> Result<LeechReport, LeechError> {
    let rep = Reporter {
        prefix: "farmap leech",
        log: opts.log,
        observer: opts.observer.clone(),
    };
    let log = |s: &str| rep.note(s);
    let started = Instant::now();
    let connect_ctl = |addr: RemoteAddr, tls: Option<TlsClientConfig>| async move {
        connect(&addr, tls.as_ref(), Duration::from_secs(10))
            .await
            .map_err(|source| LeechError::Connect {
                addr: addr.to_string(),
                source,
            })
    };
    let (mut tx, mut rx): (Sender, mpsc::Receiver<std::io::Result<Msg>>) =
        connect_ctl(opts.from.clone(), opts.tls.clone())
            .await?
            .split();
    let mut machine = Leecher::new(opts.convergence);
    let (work_tx, mut work_rx) = mpsc::unbounded_channel::<LeecherInput>();
    let mut queue: VecDeque<LeecherAction> = machine.start().into();
    let mut dest: Option<Dest> = None;
    let mut resume = Some(resume);
    let mut finalize_sent: Option<Instant> = None;
    let mut tracking_since: Option<Instant> = None;
    let mut dirty_pages = 0u64;
    let mut report_downtime = Duration::ZERO;
    let mut resumed_at: Option<Instant> = None;
    let mut final_pages = 0;
    let mut handed_over = false;
    let mut connected = true;
    let mut last_error: Option<String> = None;
    let same_boot = |id: [u8; 16]| id == crate::boot_id() && id != [0; 16];
    let mut seeder_boot = [0u8; 16];
    loop {
        while let Some(action) = queue.pop_front() {
            match action {
                LeecherAction::Send(m) => {
                    if matches!(m, Msg::Finalize) {
                        finalize_sent = Some(Instant::now());
                        log("pre-copy converged: finalizing");
                    }
                    if connected && tx.send(&m).await.is_err() {
                        connected = false;
                        queue.extend(machine.step(LeecherInput::Disconnected));
                    }
                }
                LeecherAction::OpenRegion {
                    size,
                    chunk_size,
                    page_size,
                    data_port,
                    boot_id,
                    ..
                } => {
                    seeder_boot = boot_id;
                    tracking_since = Some(Instant::now());
                    let data_addr = opts.data.clone().unwrap_or_else(|| match &opts.from {
                        RemoteAddr::Tcp(_) => {
                            let host = opts.from.host();
                            if host.contains(':') {
                                RemoteAddr::Tcp(format!("[{host}]:{data_port}"))
                            } else {
                                RemoteAddr::Tcp(format!("{host}:{data_port}"))
                            }
                        }
                        RemoteAddr::Unix(p) => RemoteAddr::Unix(p.with_extension("data")),
                    });
                    let d = open_dest(&opts, data_addr, size, chunk_size, page_size).await?;
                    log(&format!("pulling {size} bytes while the source runs"));
                    let (r, st, w) = (d.region.clone(), d.store.clone(), work_tx.clone());
                    let (page, chunk, workers) = (d.page, d.chunk, opts.pull_workers);
                    let rep2 = rep.clone();
                    tokio::spawn(async move {
                        let input = match bulk_pull(r, st, page, chunk, workers, rep2).await {
                            Ok(()) => LeecherInput::PullDone,
                            Err(_) => LeecherInput::Disconnected,
                        };
                        let _ = w.send(input);
                    });
                    dest = Some(d);
                }
                LeecherAction::Refresh { runs } => {
                    let d = dest.as_ref().expect("a round follows the open");
                    dirty_pages += run_pages(&runs);
                    let (region, store, w) = (d.region.clone(), d.store.clone(), work_tx.clone());
                    let page_len = d.page;
                    let rep2 = rep.clone();
                    tokio::spawn(async move {
                        // Pre-copy rounds overwrite the changed pages in place: the
                        // application does not run here yet, and a write costs a memcpy where
                        // a discard costs a round trip through the fault reader per run.
                        let t0 = Instant::now();
                        let pages: Vec<u64> = runs.iter().flat_map(|r| r.clone()).collect();
                        let data = store.read_pages(&pages).await;
                        let t1 = Instant::now();
                        let applied = match data {
                            Ok(data) => {
                                let (r2, page) = (region.clone(), page_len);
                                let p2 = pages.clone();
                                tokio::task::spawn_blocking(move || {
                                    p2.iter()
                                        .zip(data)
                                        .try_for_each(|(p, d)| r2.write_at((p * page) as usize, &d))
                                })
                                .await
                                .map_err(|e| e.to_string())
                                .and_then(|r| r.map_err(|e| e.to_string()))
                            }
                            Err(e) => Err(e.to_string()),
                        };
                        let apply = t1.elapsed();
                        rep2.note(format!(
                            "round: {} pages in {} runs: read {:.1} ms, written in place in \
                             {:.1} ms",
                            pages.len(),
                            runs.len(),
                            (t1 - t0).as_secs_f64() * 1e3,
                            apply.as_secs_f64() * 1e3,
                        ));
                        if applied.is_err() {
                            let _ = w.send(LeecherInput::Disconnected);
                            return;
                        }
                        let _ = w.send(LeecherInput::RoundDone(RoundResult {
                            pages: run_pages(&runs),
                            runs: runs.len() as u64,
                            apply,
                            elapsed: t0.elapsed(),
                        }));
                    });
                }
                LeecherAction::Resume {
                    runs,
                    app_state,
                    suspended_at_ns,
                } => {
                    let d = dest.as_ref().expect("a hand-over follows the open");
                    d.store.start_postcopy();
                    d.store.note_discarded(&runs);
                    let t_discard = Instant::now();
                    d.region
                        .discard_pages(&runs)
                        .map_err(|e| LeechError::LostAfterHandOver(format!("discarding: {e}")))?;
                    if let Some(resume) = resume.take() {
                        resume(d.region.clone(), app_state);
                    }
                    let now = Instant::now();
                    let now_ns = crate::monotonic_ns();
                    report_downtime = if same_boot(seeder_boot) {
                        Duration::from_nanos(now_ns.saturating_sub(suspended_at_ns))
                    } else {
                        finalize_sent.map_or(Duration::ZERO, |f| now - f)
                    };
                    resumed_at = Some(now);
                    handed_over = true;
                    rep.emit(Event::HandedOver);
                    final_pages = run_pages(&runs);
                    dirty_pages += final_pages;
                    log(&format!(
                        "discarding took {:.1} ms; resumed here after {:.1} ms; fetching {} changed pages in the background",
                        t_discard.elapsed().as_secs_f64() * 1e3,
                        report_downtime.as_secs_f64() * 1e3,
                        final_pages
                    ));
                    let chunks = chunks_of(&runs, d.page, d.chunk);
                    let pages: Vec<u64> = runs.iter().flat_map(|r| r.clone()).collect();
                    let (region, store, w, workers) = (
                        d.region.clone(),
                        d.store.clone(),
                        work_tx.clone(),
                        opts.pull_workers,
                    );
                    let rep2 = rep.clone();
                    tokio::spawn(async move {
                        loop {
                            let _ = store.stage(&pages).await;
                            let fetched = region.fetch_chunks(chunks.clone(), workers).await;
                            store.unstage(&pages);
                            let (have, all) = (
                                region.stats().present_chunks,
                                region.geometry().chunk_count(),
                            );
                            match &fetched {
                                Ok(()) => {
                                    rep2.note(format!("post-copy: {have} of {all} chunks present"))
                                }
                                Err(e) => rep2.note(format!(
                                    "post-copy: {e}; {have} of {all} chunks present; retrying"
                                )),
                            }
                            if fetched.is_ok() && region.is_complete() {
                                let _ = w.send(LeecherInput::AllLocal);
                                return;
                            }
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    });
                }
                LeecherAction::Reconnect => {
                    log("control connection lost: reconnecting");
                    let deadline = Instant::now() + opts.reconnect_for;
                    loop {
                        match connect(&opts.from, opts.tls.as_ref(), Duration::from_secs(2)).await {
                            Ok(ch) => {
                                (tx, rx) = ch.split();
                                connected = true;
                                queue.extend(machine.step(LeecherInput::Reconnected));
                                break;
                            }
                            Err(e) if Instant::now() >= deadline => {
                                return Err(LeechError::LostAfterHandOver(format!(
                                    "could not reconnect within {:?}: {e}",
                                    opts.reconnect_for
                                )));
                            }
                            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                        }
                    }
                }
                LeecherAction::Finish => {
                    let d = dest.take().expect("finished after the open");
                    d.store.detach();
                    let (pre, post) = d.store.bytes();
                    let tracked = tracking_since
                        .and_then(|t| finalize_sent.map(|f| f - t))
                        .unwrap_or_default();
                    log("complete: the region is local");
                    return Ok(LeechReport {
                        region: d.region,
                        downtime: report_downtime,
                        total: started.elapsed(),
                        bytes_precopy: pre,
                        bytes_postcopy: post,
                        rounds: machine.rounds(),
                        dirty_pages,
                        dirty_rate: if tracked.is_zero() {
                            0.0
                        } else {
                            (dirty_pages * d.page) as f64 / tracked.as_secs_f64()
                        },
                        final_pages,
                        postcopy: resumed_at.map(|r| r.elapsed()).unwrap_or_default(),
                    });
                }
                LeecherAction::Abort(reason) => {
                    let reason = match &last_error {
                        Some(e) => format!("{reason} (the control connection failed: {e})"),
                        None => reason,
                    };
                    if handed_over {
                        return Err(LeechError::LostAfterHandOver(reason));
                    }
                    return Err(LeechError::Aborted(reason));
                }
            }
        }
        let input = tokio::select! {
            m = rx.recv(), if connected => match m {
                Some(Ok(m)) => LeecherInput::Received(m),
                other => {
                    if let Some(Err(e)) = other {
                        let sent_cert = opts.tls.as_ref().is_some_and(|t| t.has_client_cert());
                        last_error = Some(
                            farmap_net::describe_client_tls_failure(&e, sent_cert)
                                .unwrap_or_else(|| e.to_string()),
                        );
                    }
                    connected = false;
                    LeecherInput::Disconnected
                }
            },
            Some(w) = work_rx.recv() => w,
            _ = cancel.changed(), if !handed_over && finalize_sent.is_none() => {
                if *cancel.borrow() {
                    let _ = tx.send(&Msg::Abort { reason: "the leecher was cancelled".into() }).await;
                    return Err(LeechError::Cancelled);
                }
                continue;
            }
        };
        queue.extend(machine.step(input));
    }
}

/// Chunks per bulk-pull batch (one `read_many` of their pages, then one install each).
const PULL_BATCH: u64 = 64;
/// Bulk-pull batches in flight (enough to fill a long fat link: 8 × 4 MiB).
const PULL_IN_FLIGHT: usize = 8;

/// Pre-copy: the whole region, batch by batch, several batches in flight.
async fn bulk_pull(
    region: Arc<Region>,
    store: Arc<MigrationStore>,
    page: u64,
    chunk: u64,
    workers: usize,
    rep: Reporter,
) -> Result<(), String> {
    let chunks = region.geometry().chunk_count();
    let total = region.len() as u64;
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..PULL_IN_FLIGHT {
        let (region, store, next, rep) = (region.clone(), store.clone(), next.clone(), rep.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let first = next.fetch_add(PULL_BATCH, std::sync::atomic::Ordering::AcqRel);
                if first >= chunks {
                    return Ok::<(), String>(());
                }
                let last = (first + PULL_BATCH).min(chunks);
                let p0 = first * chunk / page;
                let p1 = (last * chunk).min(region.len() as u64) / page;
                let pages: Vec<u64> = (p0..p1).collect();
                store.stage(&pages).await.map_err(|e| e.to_string())?;
                let r = region
                    .fetch_chunks((first..last).map(ChunkIdx).collect(), workers)
                    .await;
                store.unstage(&pages);
                r.map_err(|e| e.to_string())?;
                rep.emit(Event::Pulled {
                    bytes: store.bytes().0.min(total),
                    total,
                });
            }
        }));
    }
    for t in tasks {
        t.await.map_err(|e| e.to_string())??;
    }
    Ok(())
}

async fn open_dest(
    opts: &LeechOptions,
    data: RemoteAddr,
    size: u64,
    chunk_size: u32,
    page_size: u32,
) -> Result<Dest, LeechError> {
    let remote = RemoteStore::connect(
        data.clone(),
        ClientOptions {
            connections: opts.connections,
            tls: opts.tls.clone(),
            ..ClientOptions::default()
        },
    )
    .await
    .map_err(|e| LeechError::Region(format!("connecting the data plane at {data}: {e}")))?;
    let geometry =
        Geometry::new(size, chunk_size.into()).map_err(|e| LeechError::Region(e.to_string()))?;
    let store = Arc::new(MigrationStore::new(
        geometry,
        page_size.into(),
        Arc::new(remote),
    ));
    let ropts = RegionOptions {
        mode: RegionMode::Direct,
        push: PushOptions {
            interval: None,
            ..PushOptions::default()
        },
        worker_threads: 2,
        // A fault on a page still at the source waits out a lost connection for as long as
        // the runner tries to reconnect, instead of failing the application with SIGBUS.
        fetch_retry: RetryPolicy::for_at_least(opts.reconnect_for),
        ..RegionOptions::default()
    };
    let s2: Arc<dyn farmap_core::Store> = store.clone();
    let region = tokio::task::spawn_blocking(move || Region::open(s2, ropts))
        .await
        .map_err(|e| LeechError::Region(e.to_string()))?
        .map_err(|e| LeechError::Region(e.to_string()))?;
    Ok(Dest {
        region: Arc::new(region),
        store,
        page: page_size.into(),
        chunk: chunk_size.into(),
    })
}
