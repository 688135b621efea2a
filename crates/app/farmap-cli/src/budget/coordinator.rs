//! The coordinator of `farmap budget NAME --total SIZE`: members join on its socket; every
//! interval it reads each member's paging state through the member's agent, divides the
//! total ([`policy::divide`]) and sends each its bound (`set_local_max`, with a
//! [`BudgetNote`]), lowered bounds first so that the bounds add up to at most the total
//! at every moment.
//!
//! Members are peers it does not trust (the socket is the user's own, but a program can be
//! anything): their lines are capped ([`MAX_LINE`]), a first line must come within
//! [`HELLO_TIMEOUT`], at most [`MAX_MEMBERS`] join and [`MAX_PENDING`] connections wait for
//! their first line, an agent must be a socket of the member's own user, and an agent is
//! asked with a timeout; whatever it answers only feeds the policy, whose arithmetic
//! saturates. A member leaves when its connection closes, or after [`MAX_FAILURES`]
//! intervals in a row without an answer from its agent.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use farmap_migrate::agent::{
    BudgetNote, Controller, LocalMax, PagingReport, Reply, Request, SetLocalMaxRequest,
};
use parking_lot::Mutex;
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{oneshot, Notify, Semaphore};

use super::policy::{self, Member, Policy, Reason, Watch};
use super::proto::{self, Answer, Hello, MemberStatus, Status, MAX_LINE};

/// Most members at once.
pub const MAX_MEMBERS: usize = 64;
/// Most connections waiting for their first line.
pub const MAX_PENDING: usize = 16;
/// How long a connection may take to say what it wants.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// Intervals in a row without an answer from a member's agent before it is dropped.
pub const MAX_FAILURES: u32 = 3;
/// The least equal split a new member may bring the shares down to.
const MIN_EQUAL_SPLIT: u64 = 1 << 20;

/// A budget being divided.
pub struct Coordinator {
    name: String,
    policy: Policy,
    interval: Duration,
    members: Mutex<Vec<Entry>>,
    next_id: std::sync::atomic::AtomicU64,
    /// A member joined or left: divide again now.
    wake: Notify,
}

struct Entry {
    id: u64,
    pid: Option<u32>,
    agent: PathBuf,
    region: u64,
    /// `None` until its first division.
    share: Option<u64>,
    reason: Reason,
    watch: Watch,
    seen: Option<Instant>,
    last: Option<PagingReport>,
    failures: u32,
    /// The joining connection, waiting for the first share.
    joining: Option<oneshot::Sender<BudgetNote>>,
}

/// What a member's agent said about its state.
enum Seen {
    Report(Box<PagingReport>),
    /// It answered, with no heap to report yet (the program has not started its heap).
    NoHeap,
    Failed,
}

impl Coordinator {
    /// A coordinator of `total` bytes for budget `name`, dividing every `interval`.
    pub fn new(name: String, policy: Policy, interval: Duration) -> Arc<Coordinator> {
        Arc::new(Coordinator {
            name,
            policy,
            interval,
            members: Mutex::new(Vec::new()),
            next_id: Default::default(),
            wake: Notify::new(),
        })
    }

    /// Serves `listener` and divides the budget until the task is dropped.
    pub async fn run(self: Arc<Self>, listener: UnixListener) {
        let accepting = tokio::spawn(self.clone().accept(listener));
        let _stop = AbortOnDrop(accepting);
        let mut next = tokio::time::Instant::now() + self.interval;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(next) => {
                    next = tokio::time::Instant::now() + self.interval;
                }
                _ = self.wake.notified() => {}
            }
            self.step().await;
        }
    }

    async fn accept(self: Arc<Self>, listener: UnixListener) {
        let pending = Arc::new(Semaphore::new(MAX_PENDING));
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            let Ok(permit) = pending.clone().try_acquire_owned() else {
                continue; // Dropped: too many connections say nothing.
            };
            let me = self.clone();
            tokio::spawn(async move {
                if let Err(e) = me.connection(stream, permit).await {
                    tracing::debug!("budget connection: {e:#}");
                }
            });
        }
    }

    /// One peer: a status request, or a member from its join to its end.
    async fn connection(
        self: Arc<Self>,
        stream: UnixStream,
        permit: tokio::sync::OwnedSemaphorePermit,
    ) -> anyhow::Result<()> {
        let cred = stream.peer_cred()?;
        let (rd, mut wr) = stream.into_split();
        let mut rd = BufReader::new(rd);
        let first = tokio::time::timeout(HELLO_TIMEOUT, proto::read_line(&mut rd)).await;
        let hello = match first {
            Err(_) => return Ok(()),
            Ok(Ok(None)) => return Ok(()),
            Ok(Err(e)) => {
                let message = format!("a bad request: {e}");
                wr.write_all(&proto::line(&Answer::Error { message }))
                    .await?;
                return Ok(());
            }
            Ok(Ok(Some(l))) => serde_json::from_str::<Hello>(&l),
        };
        let (agent, region) = match hello {
            Err(e) => {
                let message = format!("a bad request: {e}");
                wr.write_all(&proto::line(&Answer::Error { message }))
                    .await?;
                return Ok(());
            }
            Ok(Hello::Status) => {
                wr.write_all(&proto::line(&Answer::Status(self.status())))
                    .await?;
                return Ok(());
            }
            Ok(Hello::Join {
                agent,
                region_bytes,
            }) => (agent, region_bytes),
        };
        let (id, share) = match self.admit(agent, region, cred.uid(), cred.pid()) {
            Ok(admitted) => admitted,
            Err(message) => {
                wr.write_all(&proto::line(&Answer::Error { message }))
                    .await?;
                return Ok(());
            }
        };
        drop(permit);
        let _leave = Leave(self.clone(), id);
        self.wake.notify_one();
        let note = match tokio::time::timeout(HELLO_TIMEOUT, share).await {
            Ok(Ok(note)) => note,
            _ => return Ok(()),
        };
        tracing::info!(id, share = note.share_bytes, "a member joined");
        wr.write_all(&proto::line(&Answer::Joined { note })).await?;
        // A member says nothing more; it leaves by closing. Anything it sends is read (a
        // line at a time, capped) and ignored.
        while let Ok(Some(_)) = proto::read_line(&mut rd).await {}
        Ok(())
    }

    /// Checks a join and adds the member; the receiver gets its first share.
    fn admit(
        &self,
        agent: PathBuf,
        region: u64,
        uid: u32,
        pid: Option<i32>,
    ) -> Result<(u64, oneshot::Receiver<BudgetNote>), String> {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        // A Unix socket path is at most 107 bytes.
        let raw = agent.as_os_str().len();
        if !agent.is_absolute() || raw > 107 {
            return Err("the agent must be an absolute socket path of at most 107 bytes".into());
        }
        match std::fs::symlink_metadata(&agent) {
            Ok(m) if m.file_type().is_socket() && m.uid() == uid => {}
            _ => {
                return Err(format!(
                    "{} is not a socket of the joining process's user",
                    agent.display()
                ))
            }
        }
        let mut members = self.members.lock();
        if members.len() >= MAX_MEMBERS {
            return Err(format!("the budget has {MAX_MEMBERS} members already"));
        }
        if self.policy.total / (members.len() as u64 + 1) < MIN_EQUAL_SPLIT {
            return Err("the budget is too small for another program (1 MiB each at least)".into());
        }
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        members.push(Entry {
            id,
            pid: pid.and_then(|p| u32::try_from(p).ok()),
            agent,
            region,
            share: None,
            reason: Reason::New,
            watch: Watch::default(),
            seen: None,
            last: None,
            failures: 0,
            joining: Some(tx),
        });
        Ok((id, rx))
    }

    /// One division: read, divide, apply.
    async fn step(&self) {
        let asked: Vec<(u64, PathBuf)> = self
            .members
            .lock()
            .iter()
            .filter(|e| e.share.is_some())
            .map(|e| (e.id, e.agent.clone()))
            .collect();
        let timeout = self
            .interval
            .clamp(Duration::from_millis(200), Duration::from_secs(2));
        let seen = futures::future::join_all(
            asked
                .iter()
                .map(|(_, agent)| paging_state(agent.clone(), timeout)),
        )
        .await;
        let now = Instant::now();
        let mut sends = Vec::new();
        {
            let mut members = self.members.lock();
            for ((id, _), seen) in asked.iter().zip(seen) {
                let Some(e) = members.iter_mut().find(|e| e.id == *id) else {
                    continue;
                };
                let secs = e.seen.map_or(0.0, |t| (now - t).as_secs_f64());
                e.seen = Some(now);
                match seen {
                    Seen::Report(r) => {
                        e.failures = 0;
                        e.watch.observe(r.faults, secs);
                        e.last = Some(*r);
                    }
                    Seen::NoHeap => {
                        e.failures = 0;
                        e.watch.observe(e.watch.last_faults.unwrap_or(0), secs);
                        e.last = None;
                    }
                    Seen::Failed => e.failures += 1,
                }
            }
            members.retain(|e| {
                let keep = e.failures < MAX_FAILURES;
                if !keep {
                    tracing::info!(id = e.id, "a member's agent stopped answering: dropped");
                }
                keep
            });
            let observed: Vec<Member> = members.iter().map(observation).collect();
            let shares = policy::divide(&self.policy, &observed);
            for (e, s) in members.iter_mut().zip(shares) {
                let old = e.share.replace(s.bytes);
                e.reason = s.reason;
                let note = self.note(s.bytes, s.reason);
                if let Some(tx) = e.joining.take() {
                    let _ = tx.send(note);
                    continue;
                }
                let limit = e.last.as_ref().map(|r| r.limit_bytes);
                let noted = e.last.as_ref().and_then(|r| r.budget.as_ref());
                let stale = noted.is_none_or(|n| n.reason != note.reason);
                if e.last.is_some() && (limit != Some(s.bytes) || stale) {
                    let lower = old.is_some_and(|o| s.bytes < o);
                    sends.push((lower, e.agent.clone(), note));
                }
            }
        }
        // Lowered bounds first: the bounds add up to at most the total at every moment.
        let (lower, higher): (Vec<_>, Vec<_>) = sends.into_iter().partition(|s| s.0);
        for batch in [lower, higher] {
            futures::future::join_all(
                batch
                    .into_iter()
                    .map(|(_, agent, note)| set_local_max(agent, note, timeout)),
            )
            .await;
        }
    }

    fn note(&self, share: u64, reason: Reason) -> BudgetNote {
        BudgetNote {
            name: self.name.clone(),
            total_bytes: self.policy.total,
            share_bytes: share,
            reason: reason.as_str().into(),
        }
    }

    /// The members and their shares now.
    pub fn status(&self) -> Status {
        let members = self.members.lock();
        Status {
            name: self.name.clone(),
            total_bytes: self.policy.total,
            floor_bytes: self.policy.floor_for(members.len()),
            interval_ms: self.interval.as_millis() as u64,
            members: members
                .iter()
                .filter(|e| e.share.is_some())
                .map(|e| MemberStatus {
                    pid: e.pid,
                    agent: e.agent.clone(),
                    share_bytes: e.share.unwrap_or(0),
                    reason: e.reason.as_str().into(),
                    limit_bytes: e.last.as_ref().map(|r| r.limit_bytes),
                    resident_bytes: e.last.as_ref().map_or(0, |r| r.resident_bytes),
                    referenced_bytes: e
                        .last
                        .as_ref()
                        .and_then(|r| r.referenced_bytes)
                        .unwrap_or(0),
                    faults_per_sec: (e.watch.demand * 10.0).round() / 10.0,
                    idle_intervals: e.watch.idle_for,
                })
                .collect(),
        }
    }
}

/// What the policy sees of a member.
fn observation(e: &Entry) -> Member {
    let r = e.last.as_ref();
    let resident = r.map_or(0, |r| r.resident_bytes);
    Member {
        share: e.share,
        demand: e.watch.demand,
        active: r.and_then(|r| r.referenced_bytes).unwrap_or(resident),
        resident,
        region: r.map_or(e.region, |r| r.region_bytes),
        idle_for: e.watch.idle_for,
    }
}

/// Removes a member when its connection ends, and divides again.
struct Leave(Arc<Coordinator>, u64);

impl Drop for Leave {
    fn drop(&mut self) {
        self.0.members.lock().retain(|e| e.id != self.1);
        tracing::info!(id = self.1, "a member left");
        self.0.wake.notify_one();
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Asks a member's agent one request, within `timeout`.
async fn ask(agent: PathBuf, req: Request, timeout: Duration) -> Option<Reply> {
    let asked = async {
        let mut c = Controller::connect(&agent).await.ok()?;
        c.send(&req).await.ok()?;
        c.next().await.ok()?
    };
    tokio::time::timeout(timeout, asked).await.ok()?
}

async fn paging_state(agent: PathBuf, timeout: Duration) -> Seen {
    match ask(agent, Request::PagingState, timeout).await {
        Some(Reply::Paging(r)) => Seen::Report(Box::new(r)),
        Some(Reply::Error { .. }) => Seen::NoHeap,
        _ => Seen::Failed,
    }
}

async fn set_local_max(agent: PathBuf, note: BudgetNote, timeout: Duration) {
    let req = Request::SetLocalMax(SetLocalMaxRequest {
        local_max: LocalMax::Bytes(note.share_bytes),
        wait_ms: 0,
        budget: Some(note),
    });
    if !matches!(ask(agent, req, timeout).await, Some(Reply::Paging(_))) {
        tracing::debug!("a member's agent did not take its bound");
    }
}

/// The bound `MAX_LINE` is what the agent's lines are capped at too (its own, larger cap).
const _: () = assert!(MAX_LINE <= farmap_migrate::agent::MAX_LINE);
