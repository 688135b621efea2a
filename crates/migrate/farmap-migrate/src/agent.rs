//! The migration agent: a Unix socket inside the application that holds a region, through
//! which `farmap seed` and `farmap leech` (the controllers) start, watch and cancel
//! migrations — like a VM monitor socket through which a migration is driven.
//!
//! ```text
//!  farmap seed --app SOCK ─┐                         ┌─ farmap leech --app SOCK2 --from …
//!        (controller)      │ JSON lines              │        (controller)
//!  ┌───────────────────────▼──────────┐  control + data  ┌────▼─────────────────────────┐
//!  │ source application + agent       │◀────────────────▶│ destination application +    │
//!  │  seed(region, suspend, …)        │                  │  agent: leech(…), resume     │
//!  └──────────────────────────────────┘                  └──────────────────────────────┘
//! ```
//!
//! The controller's connection bounds the migration: if it closes (the command was stopped
//! or killed) or sends `cancel` before the hand-over, the migration is abandoned — the
//! leecher is told, tracking stops, and the source runs on untouched. After the hand-over
//! nothing cancels it: ownership has moved, and the agents finish the post-copy.
//!
//! The protocol, one JSON object per line: the controller sends one [`Request`] (then at
//! most `{"op":"cancel"}`); the agent answers with [`Reply`] lines ending with `done`,
//! `paging` or `error`. Lines are capped at [`MAX_LINE`] bytes. The socket is created mode
//! 0600: only the application's user may drive it.
//!
//! The same socket changes the bound on the region's local memory at run time
//! (`set_local_max`) and reports its paging state (`paging_state`): see [`mod@paging`].

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use farmap_core::error_chain;
use farmap_net::{ListenAddr, RemoteAddr, TlsClientConfig, TlsServerConfig};
use farmap_uffd::{BoundedRegion, Region};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::sync::mpsc;

use crate::budget::PullBudget;
use crate::endpoint::{Destination, Source};
use crate::event::{Event, Observer};
use crate::leech::{
    leech_into, LeechError, LeechOptions, LeechReport, Opener, Resumer, SharedOpener,
};
use crate::machine::Convergence;
use crate::msg::Mode;
use crate::seed::{seed, SeedError, SeedOptions, SeedReport};
use crate::suspend::Suspend;
use farmap_net::auth::Key;

pub mod paging;

pub use paging::{BudgetNote, LocalMax, LocalMaxError, PagingReport, SetLocalMaxRequest};

/// Longest request or reply line.
pub const MAX_LINE: usize = 64 * 1024;

/// What an application offers its agent.
pub trait App: Send + Sync + 'static {
    /// What an arriving region lands in (a userfaultfd [`Region`], a
    /// FUSE mount's file…).
    type Dest: Destination;
    /// The region this process holds and the hook that stops its writers; `None` if it
    /// holds none (it can then receive one).
    fn region(&self) -> Option<(Arc<dyn Source>, Arc<dyn Suspend>)>;
    /// The userfaultfd region this process holds, for the local-memory requests
    /// ([`Request::SetLocalMax`], [`Request::PagingState`]); `None` if it holds none or
    /// holds another kind (a mounted file). Unlike [`region`](Self::region), it starts
    /// nothing: it may be called at any time, during a migration too.
    fn uffd_region(&self) -> Option<Arc<Region>>;
    /// The region whose local memory the local-memory requests bound: by default
    /// [`uffd_region`](Self::uffd_region)'s.
    fn bounded_region(&self) -> Option<Arc<dyn BoundedRegion>> {
        self.uffd_region().map(|r| r as Arc<dyn BoundedRegion>)
    }
    /// The region was handed over and released: it is no longer this process's.
    fn released(&self, report: &SeedReport);
    /// Opens the destination of a region that is arriving (before pre-copy); for a
    /// userfaultfd region, [`region_opener`](crate::leech::region_opener).
    fn opener(&self) -> Opener<Self::Dest>;
    /// Starts the application on a region that is arriving (called inside the downtime).
    fn resumer(&self) -> Resumer<Self::Dest>;
    /// A migration here finished; the returned fields are added to the report (for
    /// application metrics such as the largest pause its workload saw, or `ttr80_ms`).
    fn arrived(&self, report: &LeechReport<Self::Dest>) -> Map<String, Value>;
    /// Opens the shared store of an instant migration from a spec (the seeder's, or the
    /// request's `store`); `None` if this application cannot (instant migrations are then
    /// refused here).
    fn shared_opener(&self) -> Option<SharedOpener> {
        None
    }
    /// The shared-store specs this host has approved (its own configuration, e.g. the store
    /// it was started with): a spec the seeder announces is opened only if it is one of
    /// these; otherwise the request must name the store (`farmap leech --store`). A peer
    /// never chooses what is opened here.
    fn approved_shared(&self) -> Vec<String> {
        Vec::new()
    }
}

/// TLS of a seeder's listeners, as PEM file paths readable by the application.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerTls {
    /// Certificate chain.
    pub cert: PathBuf,
    /// Private key.
    pub key: PathBuf,
    /// Mutual TLS: the CA leechers' certificates must be issued by.
    #[serde(default)]
    pub client_ca: Option<PathBuf>,
}

/// TLS of a leecher's connections, as PEM file paths readable by the application.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientTls {
    /// The CA the seeder's certificate must be issued by.
    pub ca: PathBuf,
    /// Client certificate (mutual TLS).
    #[serde(default)]
    pub cert: Option<PathBuf>,
    /// Its key.
    #[serde(default)]
    pub key: Option<PathBuf>,
    /// The name the seeder's certificate must hold (default: the host of `from`).
    #[serde(default)]
    pub server_name: Option<String>,
}

/// Start seeding this process's region.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SeedRequest {
    /// Control listener, `IP:PORT` or `unix:/path`.
    pub listen: String,
    /// Data-plane listener.
    pub data_listen: String,
    /// TLS for both.
    #[serde(default)]
    pub tls: Option<ServerTls>,
    /// How long to wait for the leecher to come back after the hand-over, in ms.
    #[serde(default = "default_reconnect_ms")]
    pub reconnect_ms: u64,
    /// What the data plane may take from the application.
    #[serde(default)]
    pub pull: PullBudget,
    /// Instant migrations: how long to push what the shared store lacks before suspending,
    /// in ms.
    #[serde(default = "default_push_budget_ms")]
    pub push_budget_ms: u64,
    /// The migration key's secret (see [`crate::auth`]); absent: the key file of this
    /// process's user (`farmap_net::auth::default_key_file`), created if missing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}

fn default_push_budget_ms() -> u64 {
    crate::seed::PUSH_BUDGET.as_millis() as u64
}

/// Migrate a region here.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeechRequest {
    /// The seeder's control address.
    pub from: String,
    /// Its data plane (default: the control host with the port the seeder gives).
    #[serde(default)]
    pub data: Option<String>,
    /// TLS for both.
    #[serde(default)]
    pub tls: Option<ClientTls>,
    /// Downtime budget, in µs.
    pub max_downtime_us: u64,
    /// Most pre-copy rounds.
    pub max_rounds: u32,
    /// Background pull workers.
    pub workers: usize,
    /// Data-plane connections.
    pub connections: usize,
    /// How long to keep reconnecting after the hand-over, in ms.
    #[serde(default = "default_reconnect_ms")]
    pub reconnect_ms: u64,
    /// What the pre-copy may take from the source's application.
    #[serde(default)]
    pub pull: PullBudget,
    /// How the region moves.
    #[serde(default)]
    pub mode: Mode,
    /// Instant mode: the shared store's spec to open here instead of the one the seeder
    /// announces (another address, or credentials of this host).
    #[serde(default)]
    pub store: Option<String>,
    /// The migration key's secret; absent: the key file of this process's user, which must
    /// exist.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}

/// The key a request names: its secret, or the default key file (created for a seeder).
fn request_key(given: Option<&str>, create: bool) -> Result<Key, String> {
    use farmap_net::auth::{default_key_file, read_or_create_secret, read_secret};
    let secret = match given {
        Some(s) => s.to_owned(),
        None => {
            let path = default_key_file().map_err(|e| e.to_string())?;
            if create {
                read_or_create_secret(&path).map_err(|e| error_chain(&e))?.0
            } else {
                read_secret(&path).map_err(|e| error_chain(&e))?
            }
        }
    };
    Key::from_text(&secret).map_err(|e| e.to_string())
}

fn default_reconnect_ms() -> u64 {
    30_000
}

/// A controller's line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Seed the region held here.
    Seed(SeedRequest),
    /// Receive a region.
    Leech(LeechRequest),
    /// Abandon the migration if the hand-over has not happened.
    Cancel,
    /// Change the bound on the local memory of the region held here; answered with
    /// [`Reply::Paging`].
    SetLocalMax(SetLocalMaxRequest),
    /// Report the paging state of the region held here; answered with [`Reply::Paging`].
    PagingState,
}

/// Why an agent's migration ended without success.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailKind {
    /// The request was malformed or does not fit (no region to seed, one already held…).
    Refused,
    /// Cancelled before the hand-over; the source runs on.
    Cancelled,
    /// Abandoned before the hand-over by the other side, or failed before it; the source
    /// runs on.
    Aborted,
    /// Failed after the hand-over: data not yet moved is lost.
    AfterHandOver,
}

/// An agent's line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Reply {
    /// A progress line.
    Note {
        /// For people.
        msg: String,
    },
    /// The seeder listens here.
    Listening {
        /// Control address.
        control: String,
        /// Data plane address.
        data: String,
    },
    /// Pre-copy progress.
    Pulled {
        /// Bytes pulled.
        bytes: u64,
        /// Region size.
        total: u64,
    },
    /// The point of no return has passed.
    HandedOver,
    /// The paging state of the region held here (the answer to a local-memory request).
    Paging(PagingReport),
    /// Finished.
    Done {
        /// Metrics.
        report: Map<String, Value>,
    },
    /// Failed.
    Error {
        /// What kind of failure.
        kind: FailKind,
        /// Why.
        message: String,
    },
}

fn into_map(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => unreachable!("an object literal"),
    }
}

/// The metrics of a finished leech, as JSON fields (`downtime_ms`, `total_ms`, …).
pub fn leech_metrics<D: Destination>(r: &LeechReport<D>) -> Map<String, Value> {
    let ms = |d: Duration| (d.as_secs_f64() * 1e5).round() / 100.0;
    let v = json!({
        "downtime_ms": ms(r.downtime),
        "total_ms": ms(r.total),
        "postcopy_ms": ms(r.postcopy),
        "bytes_precopy": r.bytes_precopy,
        "bytes_postcopy": r.bytes_postcopy,
        "rounds": r.rounds,
        "converged": r.converged(),
        "max_downtime_ms": ms(r.max_downtime),
        "downtime_over_budget": r.over_budget(),
        "final_dirty_pages": r.final_pages,
        "dirty_rate_mb_per_s": (r.dirty_rate / 1e5).round() / 10.0,
        "region_bytes": r.region.geometry().size(),
        "mode": r.mode.name(),
        "bytes_before_resume": r.bytes_before_resume,
        "chunks_from_store": r.instant.chunks_from_store,
        "chunks_from_source": r.instant.chunks_from_source,
        "verify_failures": r.instant.verify_failures,
        "chunks_rolled_back": r.instant.chunks_rolled_back,
        "rolled_back": crate::view::ascending_runs(&r.rolled_back)
            .iter()
            .map(|r| [r.start, r.end])
            .collect::<Vec<_>>(),
        // Measured by the application's workload (its `arrived`), when it has one.
        "ttr80_ms": Value::Null,
        "effective_downtime_ms": Value::Null,
    });
    into_map(v)
}

fn seed_metrics(r: &SeedReport) -> Map<String, Value> {
    let v = json!({
        "dirty_sets": r.dirty_sets,
        "dirty_pages": r.dirty_pages,
        "abandoned_leechers": r.abandoned,
        "elapsed_ms": (r.elapsed.as_secs_f64() * 1e5).round() / 100.0,
        "mode": r.mode.name(),
    });
    into_map(v)
}

/// A running agent.
#[derive(Debug)]
pub struct Agent {
    path: PathBuf,
    task: tokio::task::JoinHandle<()>,
}

impl Agent {
    /// Where the agent listens.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Starts an agent for `app` on the Unix socket `path` (mode 0600). A stale socket file is
/// replaced; one that another agent still answers on is an error.
pub async fn serve<A: App>(path: impl AsRef<Path>, app: Arc<A>) -> io::Result<Agent> {
    let path = path.as_ref().to_path_buf();
    let listener = bind_agent(&path).await?;
    let busy = Arc::new(tokio::sync::Mutex::new(()));
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let (app, busy) = (app.clone(), busy.clone());
            tokio::spawn(async move {
                let _ = connection(stream, app, busy).await;
            });
        }
    });
    Ok(Agent { path, task })
}

/// Starts an agent that answers the local-memory requests only
/// ([`Request::SetLocalMax`], [`Request::PagingState`]) for the region `region` returns
/// (`farmap run`'s: a program's heap, which does not migrate); every other request is
/// refused. On the Unix socket `path`, as [`serve`].
///
/// `budget`: the budget the program's bound is a share of (`farmap run --budget`), shown in
/// every report; a [`SetLocalMaxRequest`] with a note replaces it (the caller shares the
/// cell, to see the latest share).
pub async fn serve_bounded(
    path: impl AsRef<Path>,
    region: impl Fn() -> Option<Arc<dyn BoundedRegion>> + Send + Sync + 'static,
    budget: Arc<parking_lot::Mutex<Option<paging::BudgetNote>>>,
) -> io::Result<Agent> {
    let path = path.as_ref().to_path_buf();
    let listener = bind_agent(&path).await?;
    let region = Arc::new(region);
    let note = budget;
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let (region, note) = (region.clone(), note.clone());
            tokio::spawn(async move {
                let (rd, mut wr) = stream.into_split();
                let mut rd = BufReader::new(rd);
                let refuse = |message: String| Reply::Error {
                    kind: FailKind::Refused,
                    message,
                };
                let noted = |mut r: PagingReport| {
                    r.budget = note.lock().clone();
                    Reply::Paging(r)
                };
                let reply = match read_line(&mut rd).await {
                    Ok(None) => return,
                    Err(e) => refuse(format!("a bad request: {e}")),
                    Ok(Some(l)) => match serde_json::from_str::<Request>(&l) {
                        Err(e) => refuse(format!("a bad request: {e}")),
                        Ok(Request::SetLocalMax(r)) => {
                            let budget = r.budget.clone();
                            let set = paging::set_local_max(r, region()).await;
                            if set.is_ok() && budget.is_some() {
                                *note.lock() = budget;
                            }
                            set.map_or_else(refuse, noted)
                        }
                        Ok(Request::PagingState) => {
                            paging::state(region()).await.map_or_else(refuse, noted)
                        }
                        Ok(_) => refuse(
                            "this agent only bounds a program's memory (farmap run): its \
                             heap does not migrate"
                                .into(),
                        ),
                    },
                };
                let mut line = serde_json::to_vec(&reply).expect("replies serialize");
                line.push(b'\n');
                let _ = wr.write_all(&line).await;
            });
        }
    });
    Ok(Agent { path, task })
}

/// Listens on the agent's socket `path`: a stale socket file is replaced; anything else
/// there, or a socket another agent answers on, is an error.
async fn bind_agent(path: &Path) -> io::Result<tokio::net::UnixListener> {
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        use std::os::unix::fs::FileTypeExt;
        if !meta.file_type().is_socket() {
            // Never delete what is not ours to delete: a file, a directory, a link.
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", path.display()),
            ));
        }
        if UnixStream::connect(path).await.is_ok() {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("another agent answers on {}", path.display()),
            ));
        }
        std::fs::remove_file(path)?;
    }
    farmap_net::bind_private_unix(path)
}

/// Reads one line of at most [`MAX_LINE`] bytes; `Ok(None)` at the end of the stream.
async fn read_line<R: AsyncRead + Unpin>(r: &mut BufReader<R>) -> io::Result<Option<String>> {
    let mut buf = Vec::new();
    loop {
        let avail = r.fill_buf().await?;
        if avail.is_empty() {
            return if buf.is_empty() {
                Ok(None)
            } else {
                Err(io::ErrorKind::UnexpectedEof.into())
            };
        }
        let (take, end) = match avail.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (avail.len(), false),
        };
        if buf.len() + take > MAX_LINE + 1 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("a line longer than {MAX_LINE} bytes"),
            ));
        }
        buf.extend_from_slice(&avail[..take]);
        r.consume(take);
        if end {
            buf.pop();
            return String::from_utf8(buf)
                .map(Some)
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "a line not in UTF-8"));
        }
    }
}

/// How long a request waits for the previous migration to wind down (a cancelled one
/// finishes telling its peer) before it is refused as busy.
const BUSY_WAIT: Duration = Duration::from_secs(5);

/// Replies queued for a controller at most: progress beyond is dropped (a later `Pulled`
/// supersedes an earlier one), so a controller that stops reading holds little.
const REPLY_QUEUE: usize = 256;
/// How long the last reply waits for a controller that does not read.
const LAST_REPLY_WAIT: Duration = Duration::from_secs(10);

/// The queue of replies to a controller: bounded, progress dropped when full.
#[derive(Debug, Clone)]
struct Replies {
    tx: mpsc::Sender<Reply>,
    dropped: Arc<std::sync::atomic::AtomicU64>,
}

impl Replies {
    /// Queues a progress reply, or drops it if the controller is that far behind.
    fn progress(&self, r: Reply) {
        if self.tx.try_send(r).is_err() {
            self.dropped
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Queues a reply the controller must get, waiting for room a bounded time.
    async fn must(&self, r: Reply) {
        let _ = tokio::time::timeout(LAST_REPLY_WAIT, self.tx.send(r)).await;
    }
}

async fn connection<A: App>(
    stream: UnixStream,
    app: Arc<A>,
    busy: Arc<tokio::sync::Mutex<()>>,
) -> io::Result<()> {
    let (rd, mut wr) = stream.into_split();
    let mut rd = BufReader::new(rd);
    let (tx, mut rx) = mpsc::channel::<Reply>(REPLY_QUEUE);
    let tx = Replies {
        tx,
        dropped: Arc::default(),
    };
    let writer = tokio::spawn(async move {
        while let Some(r) = rx.recv().await {
            let mut line = serde_json::to_vec(&r).expect("replies serialize");
            line.push(b'\n');
            if wr.write_all(&line).await.is_err() {
                return;
            }
        }
    });
    let refuse = |message: String| Reply::Error {
        kind: FailKind::Refused,
        message,
    };
    let request = match read_line(&mut rd).await {
        Ok(Some(l)) => {
            serde_json::from_str::<Request>(&l).map_err(|e| format!("a bad request: {e}"))
        }
        Ok(None) => return Ok(()),
        Err(e) => Err(format!("a bad request: {e}")),
    };
    let reply = match request {
        Err(e) => refuse(e),
        Ok(Request::Cancel) => refuse("nothing to cancel on a new connection".into()),
        // Never behind a migration: they change or read the region's bound, nothing else.
        Ok(Request::SetLocalMax(r)) => paging::set_local_max(r, app.bounded_region())
            .await
            .map_or_else(refuse, Reply::Paging),
        Ok(Request::PagingState) => paging::state(app.bounded_region())
            .await
            .map_or_else(refuse, Reply::Paging),
        Ok(req) => {
            if let Ok(_guard) = tokio::time::timeout(BUSY_WAIT, busy.lock_owned()).await {
                let observer = {
                    let tx = tx.clone();
                    Observer::new(move |e| {
                        tx.progress(match e {
                            Event::Note(msg) => Reply::Note { msg: msg.clone() },
                            Event::Pulled { bytes, total } => Reply::Pulled {
                                bytes: *bytes,
                                total: *total,
                            },
                            Event::HandedOver => Reply::HandedOver,
                        });
                    })
                };
                match req {
                    Request::Seed(r) => run_seed(r, &app, observer, &mut rd, &tx).await,
                    Request::Leech(r) => run_leech(r, &*app, observer, &mut rd).await,
                    Request::Cancel | Request::SetLocalMax(_) | Request::PagingState => {
                        unreachable!("handled above")
                    }
                }
            } else {
                refuse("a migration is already running in this process".into())
            }
        }
    };
    tx.must(reply).await;
    drop(tx);
    // A controller that stopped reading holds the writer in its write: not for long.
    let mut writer = writer;
    if tokio::time::timeout(LAST_REPLY_WAIT, &mut writer)
        .await
        .is_err()
    {
        writer.abort();
        tracing::warn!("a migration controller stopped reading its replies: closing it");
    }
    Ok(())
}

/// Resolves when the controller cancels: a `cancel` line, or the end of its connection.
async fn controller_gone<R: AsyncRead + Unpin>(rd: &mut BufReader<R>) -> &'static str {
    loop {
        match read_line(rd).await {
            Ok(Some(l)) if matches!(serde_json::from_str(&l), Ok(Request::Cancel)) => {
                return "the controller cancelled";
            }
            Ok(Some(_)) => continue,
            Ok(None) | Err(_) => return "the controller went away",
        }
    }
}

fn parse_listen(s: &str) -> Result<ListenAddr, String> {
    s.parse().map_err(|e: farmap_net::AddrError| e.to_string())
}

async fn run_seed<R: AsyncRead + Unpin, A: App>(
    req: SeedRequest,
    app: &Arc<A>,
    observer: Observer,
    rd: &mut BufReader<R>,
    tx: &Replies,
) -> Reply {
    let refuse = |message: String| Reply::Error {
        kind: FailKind::Refused,
        message,
    };
    let (listen, data_listen) = match (parse_listen(&req.listen), parse_listen(&req.data_listen)) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => return refuse(e),
    };
    if app.uffd_region().is_some_and(|r| r.is_paged()) {
        // Its write tracking scans the region only: a page written and then moved out to
        // staging before a dirty round would never reach the destination.
        return refuse(
            "the region here has bounded local memory (--local-max), which migration does \
             not support: writes to chunks moved out of the region would not be tracked"
                .into(),
        );
    }
    let Some((region, suspend)) = app.region() else {
        return refuse("this process holds no region to seed".into());
    };
    let key = match request_key(req.key.as_deref(), true) {
        Ok(k) => k,
        Err(e) => return refuse(e),
    };
    let opts = SeedOptions {
        listen,
        data_listen,
        tls: req.tls.map(|t| TlsServerConfig {
            cert: t.cert,
            key: t.key,
            client_ca: t.client_ca,
        }),
        reconnect_wait: Duration::from_millis(req.reconnect_ms),
        handshake_timeout: crate::seed::HANDSHAKE_TIMEOUT,
        max_handshakes: crate::seed::MAX_HANDSHAKES,
        log: false,
        observer: Some(observer),
        pull: req.pull,
        push_budget: Duration::from_millis(req.push_budget_ms),
        key,
    };
    let seeding = match seed(region, suspend, opts).await {
        Ok(s) => s,
        Err(e) => return refuse(error_chain(&e)),
    };
    tx.must(Reply::Listening {
        control: seeding.control.to_string(),
        data: seeding.data.to_string(),
    })
    .await;
    let cancel = seeding.canceller();
    let finish = seeding.finish();
    tokio::pin!(finish);
    let result = tokio::select! {
        r = &mut finish => r,
        why = controller_gone(rd) => {
            tx.progress(Reply::Note { msg: format!("{why}: cancelling unless the hand-over is done") });
            cancel();
            finish.await
        }
    };
    match result {
        Ok(report) => {
            let metrics = seed_metrics(&report);
            // An application lets go of its region there: it may join its threads and
            // drop its mapping and runtime, which no async worker may do.
            let app = app.clone();
            match tokio::task::spawn_blocking(move || app.released(&report)).await {
                Ok(()) => Reply::Done { report: metrics },
                Err(e) => Reply::Error {
                    kind: FailKind::AfterHandOver,
                    message: format!(
                        "the region is at the destination, but the application failed \
                         releasing it here: {e}"
                    ),
                },
            }
        }
        Err(e) => Reply::Error {
            kind: match e {
                SeedError::Cancelled => FailKind::Cancelled,
                SeedError::LostAfterHandOver(_) => FailKind::AfterHandOver,
                _ => FailKind::Aborted,
            },
            message: error_chain(&e),
        },
    }
}

async fn run_leech<R: AsyncRead + Unpin, A: App>(
    req: LeechRequest,
    app: &A,
    observer: Observer,
    rd: &mut BufReader<R>,
) -> Reply {
    let refuse = |message: String| Reply::Error {
        kind: FailKind::Refused,
        message,
    };
    if app.region().is_some() {
        return refuse("this process already holds a region".into());
    }
    let from: RemoteAddr = match req.from.parse() {
        Ok(a) => a,
        Err(e) => return refuse(format!("{e}")),
    };
    let data = match req
        .data
        .as_deref()
        .map(str::parse::<RemoteAddr>)
        .transpose()
    {
        Ok(d) => d,
        Err(e) => return refuse(format!("{e}")),
    };
    if req.workers == 0 || req.connections == 0 {
        return refuse("workers and connections must be at least 1".into());
    }
    let key = match request_key(req.key.as_deref(), false) {
        Ok(k) => k,
        Err(e) => return refuse(e),
    };
    let shared = match (req.mode, app.shared_opener()) {
        (Mode::Instant, None) => {
            return refuse(
                "this application cannot open a shared store: instant migrations \
                           cannot arrive here"
                    .into(),
            )
        }
        // The request's spec, when given, replaces the seeder's; without it, the seeder's
        // is opened only if this host approved it.
        (_, Some(open)) => Some(match req.store.clone() {
            Some(spec) => SharedOpener(Arc::new(move |_| (open.0)(spec.clone()))),
            None => approved_only(open, app.approved_shared()),
        }),
        (_, None) => None,
    };
    let opts = LeechOptions {
        data,
        tls: req.tls.map(|t| TlsClientConfig {
            ca: t.ca,
            cert: t.cert,
            key: t.key,
            server_name: t.server_name,
        }),
        convergence: Convergence {
            max_downtime: Duration::from_micros(req.max_downtime_us),
            max_rounds: req.max_rounds,
            ..Convergence::default()
        },
        pull_workers: req.workers,
        connections: req.connections,
        pull: req.pull,
        reconnect_for: Duration::from_millis(req.reconnect_ms),
        log: false,
        observer: Some(observer),
        mode: req.mode,
        shared,
        key,
        ..LeechOptions::new(from)
    };
    let (cancel_tx, cancel_rx) = tokio::sync::watch::channel(false);
    let run = leech_into(opts, app.opener(), app.resumer(), cancel_rx);
    tokio::pin!(run);
    let result = tokio::select! {
        r = &mut run => r,
        _ = controller_gone(rd) => {
            let _ = cancel_tx.send(true);
            run.await
        }
    };
    match result {
        Ok(report) => {
            let mut m = leech_metrics(&report);
            m.extend(app.arrived(&report));
            Reply::Done { report: m }
        }
        Err(e) => Reply::Error {
            kind: match e {
                LeechError::Cancelled => FailKind::Cancelled,
                LeechError::LostAfterHandOver(_) => FailKind::AfterHandOver,
                _ => FailKind::Aborted,
            },
            message: error_chain(&e),
        },
    }
}

/// `open`, for the specs in `approved` only: any other spec a seeder announces is refused
/// before anything is opened (it could name a file of this host, or a server anywhere).
fn approved_only(open: SharedOpener, approved: Vec<String>) -> SharedOpener {
    SharedOpener(Arc::new(move |spec: String| {
        if approved.contains(&spec) {
            return (open.0)(spec);
        }
        Box::pin(async move {
            Err(format!(
                "the seeder asks this host to open the shared store {spec:?}, which this \
                 host has not approved: a destination opens only a store it names itself \
                 (farmap leech --store SPEC, the shared store as this host reaches it)"
            )
            .into())
        })
    }))
}

/// A controller's side of an agent connection.
#[derive(Debug)]
pub struct Controller {
    rd: BufReader<tokio::net::unix::OwnedReadHalf>,
    wr: tokio::net::unix::OwnedWriteHalf,
}

impl Controller {
    /// Connects to the agent at `path`.
    pub async fn connect(path: impl AsRef<Path>) -> io::Result<Controller> {
        let path = path.as_ref();
        let s = UnixStream::connect(path).await.map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "no migration agent answers on {} ({e}); is the application running \
                     with its agent there?",
                    path.display()
                ),
            )
        })?;
        let (rd, wr) = s.into_split();
        Ok(Controller {
            rd: BufReader::new(rd),
            wr,
        })
    }

    /// Sends a request (or `cancel`).
    pub async fn send(&mut self, r: &Request) -> io::Result<()> {
        let mut line = serde_json::to_vec(r).map_err(io::Error::other)?;
        line.push(b'\n');
        self.wr.write_all(&line).await
    }

    /// The next reply; `Ok(None)` if the agent closed the connection.
    pub async fn next(&mut self) -> io::Result<Option<Reply>> {
        match read_line(&mut self.rd).await? {
            None => Ok(None),
            Some(l) => serde_json::from_str(&l)
                .map(Some)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e)),
        }
    }
}

#[cfg(test)]
mod tests {

    #[tokio::test]
    async fn a_seeders_spec_is_opened_only_when_this_host_approved_it() {
        let opened: Arc<parking_lot::Mutex<Vec<String>>> = Arc::default();
        let seen = opened.clone();
        let open = SharedOpener(Arc::new(move |spec: String| {
            seen.lock().push(spec);
            Box::pin(async {
                Err::<Arc<dyn farmap_core::Store>, crate::EndpointError>("not in this test".into())
            })
        }));
        let guarded = approved_only(open, vec!["redis://10.0.0.2:6379/0?size=1GiB".into()]);
        let e = (guarded.0)("file:/etc/cron.d/x?size=4KiB".into())
            .await
            .expect_err("refused");
        assert!(e.to_string().contains("has not approved"), "{e}");
        assert!(opened.lock().is_empty(), "nothing was opened");
        let _ = (guarded.0)("redis://10.0.0.2:6379/0?size=1GiB".into()).await;
        assert_eq!(opened.lock().len(), 1, "the approved spec is opened");
    }

    use super::*;

    #[test]
    fn requests_round_trip_as_one_tagged_object() {
        let r = Request::Leech(LeechRequest {
            from: "10.0.0.1:7100".into(),
            data: None,
            tls: None,
            max_downtime_us: 5000,
            max_rounds: 30,
            workers: 16,
            connections: 4,
            reconnect_ms: 1000,
            pull: PullBudget {
                priority: crate::PullPriority::Idle,
                max_rate: Some(100 << 20),
                cpu_share: Some(0.5),
            },
            mode: Mode::Instant,
            store: Some("redis://10.0.0.2:6379".into()),
            key: None,
        });
        let s = serde_json::to_string(&r).unwrap();
        assert!(s.contains(r#""mode":"instant""#), "{s}");
        assert!(
            s.starts_with(r#"{"op":"leech","from":"10.0.0.1:7100""#),
            "{s}"
        );
        assert_eq!(serde_json::from_str::<Request>(&s).unwrap(), r);
        // A controller that predates the pull budget gets the default one.
        let old = r#"{"op":"leech","from":"a:1","max_downtime_us":1,"max_rounds":1,"workers":1,"connections":1}"#;
        match serde_json::from_str::<Request>(old).unwrap() {
            Request::Leech(l) => {
                assert_eq!(l.pull, PullBudget::default());
                assert_eq!(l.mode, Mode::Precopy);
            }
            other => panic!("{other:?}"),
        }
        let c: Request = serde_json::from_str(r#"{"op":"cancel"}"#).unwrap();
        assert_eq!(c, Request::Cancel);
        let e = serde_json::to_string(&Reply::Error {
            kind: FailKind::AfterHandOver,
            message: "x".into(),
        })
        .unwrap();
        assert_eq!(
            e,
            r#"{"event":"error","kind":"after_hand_over","message":"x"}"#
        );
    }

    #[tokio::test]
    async fn lines_are_capped() {
        let long = vec![b'a'; MAX_LINE + 10];
        let mut r = BufReader::new(&long[..]);
        let e = read_line(&mut r).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        let ok = b"{\"op\":\"cancel\"}\nrest";
        let mut r = BufReader::new(&ok[..]);
        assert_eq!(
            read_line(&mut r).await.unwrap().unwrap(),
            "{\"op\":\"cancel\"}"
        );
        assert!(
            read_line(&mut r).await.is_err(),
            "a cut-off last line is an error"
        );
    }

    struct NoRegion;
    impl App for NoRegion {
        type Dest = farmap_uffd::Region;
        fn region(&self) -> Option<(Arc<dyn Source>, Arc<dyn Suspend>)> {
            None
        }
        fn uffd_region(&self) -> Option<Arc<Region>> {
            None
        }
        fn opener(&self) -> Opener<farmap_uffd::Region> {
            crate::leech::region_opener()
        }
        fn released(&self, _: &SeedReport) {}
        fn resumer(&self) -> Resumer {
            Box::new(|_, _| {})
        }
        fn arrived(&self, _: &LeechReport) -> Map<String, Value> {
            Map::new()
        }
    }

    #[tokio::test]
    async fn a_controller_that_does_not_read_holds_a_bounded_queue() {
        let (tx, mut rx) = mpsc::channel(REPLY_QUEUE);
        let replies = Replies {
            tx,
            dropped: Arc::default(),
        };
        for i in 0..100_000u64 {
            replies.progress(Reply::Pulled {
                bytes: i,
                total: 100_000,
            });
        }
        let dropped = replies.dropped.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(dropped, 100_000 - REPLY_QUEUE as u64);
        // The last reply waits for room (a bounded time): here the reader makes some.
        rx.recv().await.unwrap();
        replies.must(Reply::HandedOver).await;
        let mut last = None;
        while let Ok(r) = rx.try_recv() {
            last = Some(r);
        }
        assert_eq!(last, Some(Reply::HandedOver));
    }

    #[tokio::test]
    async fn a_path_that_is_not_a_socket_is_never_deleted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        std::fs::write(&path, b"precious").unwrap();
        let e = serve(&path, Arc::new(NoRegion)).await.unwrap_err();
        assert!(e.to_string().contains("is not a socket"), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), b"precious");
        // A stale socket (nothing accepts on it) is replaced.
        let stale = dir.path().join("stale.sock");
        drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
        let _agent = serve(&stale, Arc::new(NoRegion)).await.unwrap();
    }

    #[tokio::test]
    async fn bad_requests_are_refused_clearly() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let _agent = serve(&path, Arc::new(NoRegion)).await.unwrap();
        let mode = std::fs::metadata(&path).unwrap();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
            0o600
        );
        assert!(
            serve(&path, Arc::new(NoRegion)).await.is_err(),
            "a live agent's socket is not taken over"
        );
        let cases: [(&str, &str); 9] = [
            ("{\"op\":\"nope\"}\n", "a bad request"),
            (
                "{\"op\":\"set_local_max\",\"local_max\":{\"bytes\":65536}}\n",
                "holds no userfaultfd region",
            ),
            ("{\"op\":\"paging_state\"}\n", "holds no userfaultfd region"),
            (
                "{\"op\":\"set_local_max\",\"local_max\":{\"bytes\":0}}\n",
                "limit of 0 bytes",
            ),
            (
                "{\"op\":\"set_local_max\",\"local_max\":{\"percent\":150}}\n",
                "150% is not a share of the region",
            ),
            (
                "{\"op\":\"set_local_max\",\"local_max\":{\"bytes\":1},\"wait_ms\":61000}\n",
                "longer than the 60 s",
            ),
            (
                "{\"op\":\"seed\",\"listen\":\"127.0.0.1:0\",\"data_listen\":\"127.0.0.1:0\"}\n",
                "holds no region",
            ),
            (
                "{\"op\":\"seed\",\"listen\":\"nowhere\",\"data_listen\":\"127.0.0.1:0\"}\n",
                "not an address to listen on",
            ),
            (
                "{\"op\":\"leech\",\"from\":\"no-port\",\"max_downtime_us\":1,\"max_rounds\":1,\
                 \"workers\":1,\"connections\":1}\n",
                "not an address to connect to",
            ),
        ];
        for (line, want) in cases {
            let mut s = UnixStream::connect(&path).await.unwrap();
            s.write_all(line.as_bytes()).await.unwrap();
            let mut r = BufReader::new(s);
            let reply: Reply =
                serde_json::from_str(&read_line(&mut r).await.unwrap().unwrap()).unwrap();
            match reply {
                Reply::Error { kind, message } => {
                    assert_eq!(kind, FailKind::Refused);
                    assert!(message.contains(want), "{message:?} lacks {want:?}");
                }
                other => panic!("{line}: {other:?}"),
            }
        }
    }
}
