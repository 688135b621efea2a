//! [`Fair`]: a server's store work, shared out between its connections.
//!
//! Memory budgets ([`crate::budget`]) bound what clients make a server hold; they do not say
//! whose request runs next. With the store's work (a file read copies its chunk, a memory
//! read copies it too) running as fast as requests arrive, a client that keeps a hundred
//! requests in flight gets a hundred times the CPU of one that waits for each answer before
//! it asks again. So every operation on the store (one chunk read, written or trimmed) first
//! takes a [`Turn`] of its connection's [`Lane`] ([`InTurn`] does it for a server's store,
//! for requests run in [`Lane::run`]): at most [`Fair::limit`] turns are out at once over
//! the whole server,
//! and a freed turn goes to the waiting lane with the fewest turns out, then to one with a
//! single request waiting rather than a queue, then to the one that waited longest. A client with one request at a time is thus served as soon as a
//! turn is free, however many requests the others keep queued; clients that all keep
//! queues get equal shares.
//!
//! The limit is what makes this work: it should be about the number of CPUs when the store's
//! work is the server's own (memory, files on local disks: more turns only share the same
//! CPUs more finely), and much higher when requests mostly wait on another host (a remote
//! store: [`REMOTE_LIMIT`]). [`local_limit`] is the first.
//!
//! A turn is held while the store works on one chunk, not for a whole request (a read of many
//! chunks takes a turn per chunk, so one large request does not make others wait for all of
//! it) and not while the reply is sent: a client that does not read its replies holds memory
//! (bounded by its budget), never turns.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use farmap_core::{
    BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, Store, StoreError,
    StoreResult,
};
use parking_lot::Mutex;
use tokio::sync::oneshot;

tokio::task_local! {
    /// The lane of the request this task works for (see [`Lane::run`]).
    static LANE: Lane;
}

/// The turns of a server whose store's requests mostly wait on other hosts.
pub const REMOTE_LIMIT: usize = 64;

/// The turns of a server whose store works on this host's CPUs: one per CPU this process may
/// use (at least two).
pub fn local_limit() -> usize {
    std::thread::available_parallelism()
        .map(usize::from)
        .unwrap_or(2)
        .max(2)
}

/// The server-wide share-out of store work; cheap to clone (clones share the turns).
#[derive(Debug, Clone)]
pub struct Fair(Arc<Shared>);

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    next_lane: AtomicU64,
}

#[derive(Debug, Default)]
struct State {
    limit: usize,
    /// No more turns are given ([`Fair::close`]).
    closed: bool,
    running: usize,
    /// Lanes with turns out or waiters (others have no entry).
    lanes: HashMap<u64, LaneState>,
    /// Lanes with waiters, the longest waiting first.
    waiting: VecDeque<u64>,
}

#[derive(Debug, Default)]
struct LaneState {
    running: usize,
    waiters: VecDeque<oneshot::Sender<()>>,
}

/// One connection's place in a [`Fair`]; cheap to clone (clones are the same lane).
#[derive(Debug, Clone)]
pub struct Lane {
    fair: Fair,
    id: u64,
}

/// No turn: the server is stopping ([`Fair::close`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the server is shutting down: this request was not started")]
pub struct Closed;

impl From<Closed> for StoreError {
    /// Retryable: the request never reached the store.
    fn from(c: Closed) -> StoreError {
        StoreError::new(ErrorKind::Unavailable, c.to_string())
    }
}

/// The right to work on the store for one request; given back when dropped.
#[derive(Debug)]
#[must_use = "a turn is given back as soon as it is dropped"]
pub struct Turn {
    fair: Fair,
    lane: u64,
}

impl Fair {
    /// At most `limit` turns out at once (at least one).
    pub fn new(limit: usize) -> Fair {
        Fair(Arc::new(Shared {
            state: Mutex::new(State {
                limit: limit.max(1),
                ..State::default()
            }),
            next_lane: AtomicU64::new(0),
        }))
    }

    /// The most turns out at once.
    pub fn limit(&self) -> usize {
        self.0.state.lock().limit
    }

    /// Turns out right now.
    pub fn running(&self) -> usize {
        self.0.state.lock().running
    }

    /// Gives no more turns: waiting and later requests get [`Closed`] (a stopping server
    /// answers the requests that have not reached the store yet with an error, and lets
    /// those at the store finish). Turns out are given back as usual.
    pub fn close(&self) {
        let mut s = self.0.state.lock();
        s.closed = true;
        s.waiting.clear();
        for lane in s.lanes.values_mut() {
            lane.waiters.clear();
        }
        s.lanes.retain(|_, l| l.running > 0);
    }

    /// Closes this when `stop` is raised (a server's shutdown signal).
    pub fn close_on(&self, mut stop: tokio::sync::watch::Receiver<bool>) {
        let fair = self.clone();
        tokio::spawn(async move {
            crate::raised(&mut stop).await;
            fair.close();
        });
    }

    /// A new lane (one per connection).
    pub fn lane(&self) -> Lane {
        Lane {
            fair: self.clone(),
            id: self.0.next_lane.fetch_add(1, Ordering::Relaxed),
        }
    }

    fn give_back(&self, lane: u64) {
        let mut s = self.0.state.lock();
        s.running -= 1;
        if let Some(l) = s.lanes.get_mut(&lane) {
            l.running -= 1;
            if l.running == 0 && l.waiters.is_empty() {
                s.lanes.remove(&lane);
            }
        }
        s.grant();
    }
}

impl State {
    /// Hands free turns to waiters: each to the waiting lane with the fewest turns out, then
    /// to one with a single request waiting (a client that asks one at a time) before those
    /// with queues, then to the longest waiting.
    fn grant(&mut self) {
        while self.running < self.limit && !self.waiting.is_empty() {
            let (at, id) = self
                .waiting
                .iter()
                .enumerate()
                .min_by_key(|(_, id)| {
                    self.lanes
                        .get(id)
                        .map_or((0, 0), |l| (l.running, l.waiters.len().min(2)))
                })
                .map(|(at, id)| (at, *id))
                .expect("not empty");
            self.waiting.remove(at);
            let Some(lane) = self.lanes.get_mut(&id) else {
                continue;
            };
            let mut granted = false;
            while let Some(w) = lane.waiters.pop_front() {
                // A waiter that gave up has dropped its receiver.
                if w.send(()).is_ok() {
                    granted = true;
                    break;
                }
            }
            if granted {
                lane.running += 1;
                self.running += 1;
            }
            if !lane.waiters.is_empty() {
                self.waiting.push_back(id);
            } else if lane.running == 0 {
                self.lanes.remove(&id);
            }
        }
    }
}

impl Lane {
    /// Waits for a turn: at once if one is free and nobody waits, else when this lane's
    /// comes. Cancel-safe: a waiter dropped after it was granted its turn gives it back.
    pub async fn turn(&self) -> Result<Turn, Closed> {
        let rx = {
            let mut s = self.fair.0.state.lock();
            if s.closed {
                return Err(Closed);
            }
            if s.running < s.limit && s.waiting.is_empty() {
                s.running += 1;
                s.lanes.entry(self.id).or_default().running += 1;
                return Ok(Turn {
                    fair: self.fair.clone(),
                    lane: self.id,
                });
            }
            let (tx, rx) = oneshot::channel();
            let lane = s.lanes.entry(self.id).or_default();
            lane.waiters.push_back(tx);
            if lane.waiters.len() == 1 {
                s.waiting.push_back(self.id);
            }
            s.grant();
            rx
        };
        let mut waiting = Waiting {
            rx: Some(rx),
            lane: self,
        };
        let granted = waiting.rx.as_mut().expect("set above").await;
        waiting.rx = None;
        // The sender lives in the lane's queue until it is granted, the receiver is gone, or
        // the share-out is closed.
        granted.map_err(|_| Closed)?;
        Ok(Turn {
            fair: self.fair.clone(),
            lane: self.id,
        })
    }
}

impl Lane {
    /// Runs `work` as this lane's: the store operations an [`InTurn`] store does inside it
    /// take this lane's turns.
    pub async fn run<F: Future>(&self, work: F) -> F::Output {
        LANE.scope(self.clone(), work).await
    }
}

/// A store whose operations take a turn of the running request's lane (see [`Lane::run`])
/// while they work; operations outside any lane (a shutdown's flush) take none. A flush
/// never takes one: it mostly waits on a disk or another host, and holds no CPU.
pub struct InTurn(Arc<dyn Store>);

impl InTurn {
    /// Turns for `store`'s operations.
    pub fn new(store: Arc<dyn Store>) -> InTurn {
        InTurn(store)
    }
}

/// A turn of the lane this task works for, if it works for one (see [`Lane::run`]): for work
/// on a server's store that does not go through an [`InTurn`].
pub async fn current_turn() -> Result<Option<Turn>, Closed> {
    match LANE.try_with(Lane::clone) {
        Ok(lane) => lane.turn().await.map(Some),
        Err(_) => Ok(None),
    }
}

impl fmt::Debug for InTurn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("InTurn").field(&self.0).finish()
    }
}

impl Store for InTurn {
    fn geometry(&self) -> Geometry {
        self.0.geometry()
    }

    fn caps(&self) -> Caps {
        self.0.caps()
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            let _turn = current_turn().await?;
            self.0.read(idx).await
        })
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            let _turn = current_turn().await?;
            self.0.write(idx, data).await
        })
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        self.0.flush()
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            let _turn = current_turn().await?;
            self.0.trim(range).await
        })
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        Box::pin(async move {
            let _turn = current_turn().await?;
            self.0.status(idx).await
        })
    }

    fn read_part(
        &self,
        idx: ChunkIdx,
        offset: usize,
        len: usize,
    ) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            let _turn = current_turn().await?;
            self.0.read_part(idx, offset, len).await
        })
    }

    fn prefetch(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            let _turn = current_turn().await?;
            self.0.prefetch(idx).await
        })
    }
}

/// A turn being waited for; gives it back if it came but the wait was abandoned.
struct Waiting<'a> {
    rx: Option<oneshot::Receiver<()>>,
    lane: &'a Lane,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if let Some(mut rx) = self.rx.take() {
            rx.close();
            if rx.try_recv().is_ok() {
                self.lane.fair.give_back(self.lane.id);
            }
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.fair.give_back(self.lane);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn settle() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    #[tokio::test]
    async fn turns_are_limited_and_given_back() {
        let fair = Fair::new(2);
        let lane = fair.lane();
        let a = lane.turn().await.unwrap();
        let b = lane.turn().await.unwrap();
        assert_eq!(fair.running(), 2);
        let third = tokio::spawn({
            let lane = lane.clone();
            async move { lane.turn().await.unwrap() }
        });
        settle().await;
        assert!(!third.is_finished(), "two turns are out");
        drop(a);
        let c = third.await.unwrap();
        assert_eq!(fair.running(), 2);
        drop((b, c));
        assert_eq!(fair.running(), 0);
        assert!(fair.0.state.lock().lanes.is_empty(), "no lane is kept idle");
    }

    #[tokio::test]
    async fn a_freed_turn_goes_to_the_lane_with_the_fewest_out() {
        let fair = Fair::new(2);
        let (busy, quiet) = (fair.lane(), fair.lane());
        let mut held = vec![busy.turn().await.unwrap(), busy.turn().await.unwrap()];
        // The busy lane queues many more, then the quiet one asks for one.
        let mut queued = Vec::new();
        for _ in 0..10 {
            let busy = busy.clone();
            queued.push(tokio::spawn(async move { busy.turn().await.unwrap() }));
            settle().await;
        }
        let quiet_turn = tokio::spawn({
            let quiet = quiet.clone();
            async move { quiet.turn().await.unwrap() }
        });
        settle().await;
        drop(held.pop());
        let t = tokio::time::timeout(Duration::from_secs(1), quiet_turn)
            .await
            .expect("the quiet lane is served first")
            .unwrap();
        assert_eq!(t.lane, quiet.id);
        settle().await;
        assert!(queued.iter().all(|q| !q.is_finished()));
        drop((t, held));
        for q in queued {
            drop(q.await.unwrap());
        }
        assert_eq!(fair.running(), 0);
    }

    #[tokio::test]
    async fn lanes_that_all_queue_share_equally() {
        let fair = Fair::new(1);
        let lanes: Vec<Lane> = (0..3).map(|_| fair.lane()).collect();
        let first = lanes[0].turn().await.unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks = Vec::new();
        for (n, lane) in lanes.iter().enumerate() {
            for _ in 0..8 {
                let (lane, tx) = (lane.clone(), tx.clone());
                tasks.push(tokio::spawn(async move {
                    let t = lane.turn().await.unwrap();
                    tx.send(n).unwrap();
                    tokio::task::yield_now().await;
                    drop(t);
                }));
            }
        }
        settle().await;
        drop(first);
        for t in tasks {
            t.await.unwrap();
        }
        drop(tx);
        let mut order = Vec::new();
        while let Some(n) = rx.recv().await {
            order.push(n);
        }
        assert_eq!(order.len(), 24);
        // While every lane has a queue (two or more waiting), they take turns.
        for round in order[..18].chunks(3) {
            let mut r = round.to_vec();
            r.sort_unstable();
            assert_eq!(r, [0, 1, 2], "each round serves every lane once: {order:?}");
        }
    }

    #[tokio::test]
    async fn a_waiter_that_gives_up_loses_nothing() {
        let fair = Fair::new(1);
        let lane = fair.lane();
        let held = lane.turn().await.unwrap();
        let gave_up = tokio::spawn({
            let lane = lane.clone();
            async move { lane.turn().await.unwrap() }
        });
        settle().await;
        gave_up.abort();
        let _ = gave_up.await;
        drop(held);
        assert_eq!(fair.running(), 0, "the abandoned turn came back");
        let _again = tokio::time::timeout(Duration::from_secs(1), lane.turn())
            .await
            .expect("free")
            .unwrap();
        // Granted and then abandoned before it was polled again.
        let other = fair.lane();
        let mut waiting = Box::pin(other.turn());
        assert!(futures::poll!(waiting.as_mut()).is_pending());
        drop(_again);
        drop(waiting);
        assert_eq!(fair.running(), 0);
    }
}

#[cfg(test)]
mod close_tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_closed_share_out_refuses_waiters_and_new_turns_and_takes_back_those_out() {
        let fair = Fair::new(1);
        let lane = fair.lane();
        let out = lane.turn().await.unwrap();
        let waiter = tokio::spawn({
            let lane = lane.clone();
            async move { lane.turn().await.map(drop) }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        fair.close();
        assert_eq!(waiter.await.unwrap(), Err(Closed));
        assert_eq!(lane.turn().await.map(drop), Err(Closed));
        assert_eq!(fair.running(), 1);
        drop(out);
        assert_eq!(fair.running(), 0);
    }
}
