//! [`Pool`]: the client side's one connection pool, used by every client that keeps several
//! connections to one server (the native [`RemoteStore`](crate::RemoteStore) and the NBD
//! store).
//!
//! # Concurrency
//! - A fixed number of slots, each kept connected by its own supervisor task: when a
//!   slot's connection closes, the supervisor dials again, pausing by the pool's
//!   [`RetryPolicy`] after each failure, until the pool is closed or dropped.
//! - [`Pool::get`] hands out the open connections round-robin. When none is open it waits,
//!   up to the caller's deadline, for one to come back; a pool made with
//!   [`PoolOptions::fail_fast`] instead fails at once with the latest dial error once a dial
//!   has failed (for servers whose clients expect an error rather than a wait).
//! - The gRPC store has no pool of its own either: its connections are tonic channels,
//!   which reconnect by themselves, and it only takes them in turn.
//! - The pool never looks inside a connection: a [`Link`] says whether it is open, resolves
//!   when it closes and can be closed; a [`Dial`] makes a new one (and checks that the server
//!   still serves what the pool was opened on).

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use farmap_core::{BoxFuture, ErrorKind, RetryPolicy, StoreError, StoreResult};
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::stream::raised;

/// One connection, as the pool sees it.
pub trait Link: Send + Sync + 'static {
    /// Whether requests may still be sent on it.
    fn is_open(&self) -> bool;
    /// Resolves once the connection is closed (at once if it already is).
    fn closed(&self) -> BoxFuture<'_, ()>;
    /// Closes it: requests in flight fail, naming `why`.
    fn close(&self, why: &str);
}

/// How the pool makes a new connection.
pub trait Dial: Send + Sync + 'static {
    /// The connections it makes.
    type Link: Link;
    /// Opens one connection, checked to serve what the pool was opened on; the failure is
    /// an error in a sentence (refused, TLS refused and why, another region...).
    fn dial(&self) -> BoxFuture<'_, StoreResult<Arc<Self::Link>>>;
    /// The server, as shown in messages.
    fn shown(&self) -> String;
}

/// How a [`Pool`] behaves.
#[derive(Debug, Clone)]
pub struct PoolOptions {
    /// Pauses between a slot's dial attempts (its `attempts` are ignored: a slot dials until
    /// the pool closes).
    pub reconnect: RetryPolicy,
    /// When no connection is open and a dial has failed, [`Pool::get`] fails at once with
    /// that dial's error instead of waiting for its deadline.
    pub fail_fast: bool,
}

struct Slot<L> {
    link: Mutex<Option<Arc<L>>>,
    last_error: Mutex<Option<StoreError>>,
}

/// A fixed set of connections to one server, kept open (see the [module docs](self)).
pub struct Pool<D: Dial> {
    dial: D,
    opts: PoolOptions,
    slots: Vec<Slot<D::Link>>,
    /// Bumped whenever a slot's connection comes or goes, or a dial fails.
    changed: watch::Sender<u64>,
    next: AtomicUsize,
    stop: watch::Sender<bool>,
}

impl<D: Dial> fmt::Debug for Pool<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("server", &self.dial.shown())
            .field("slots", &self.slots.len())
            .field("open", &self.open_count())
            .finish()
    }
}

impl<D: Dial> Pool<D> {
    /// A pool of `initial.len()` slots (at least one), starting with the connections given
    /// (`None`: the slot dials now, in the background). Needs a Tokio runtime.
    pub fn start(dial: D, opts: PoolOptions, initial: Vec<Option<Arc<D::Link>>>) -> Arc<Self> {
        let mut initial = initial;
        if initial.is_empty() {
            initial.push(None);
        }
        let pool = Arc::new(Pool {
            slots: (0..initial.len())
                .map(|_| Slot {
                    link: Mutex::new(None),
                    last_error: Mutex::new(None),
                })
                .collect(),
            changed: watch::channel(0).0,
            next: AtomicUsize::new(0),
            stop: watch::channel(false).0,
            dial,
            opts,
        });
        for (i, first) in initial.into_iter().enumerate() {
            if let Some(l) = &first {
                *pool.slots[i].link.lock() = Some(l.clone());
            }
            tokio::spawn(supervise(pool.clone(), i, first));
        }
        pool
    }

    /// The dialer the pool was made with.
    pub fn dialer(&self) -> &D {
        &self.dial
    }

    /// Slots in the pool (open or being reopened).
    pub fn size(&self) -> usize {
        self.slots.len()
    }

    /// Connections open right now.
    pub fn open_count(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| s.link.lock().as_ref().is_some_and(|l| l.is_open()))
            .count()
    }

    /// An open connection, round-robin; when none is open, waits for one until `deadline`
    /// (or fails at once with the latest dial error, see [`PoolOptions::fail_fast`]).
    pub async fn get(&self, deadline: Instant) -> StoreResult<Arc<D::Link>> {
        let mut changed = self.changed.subscribe();
        loop {
            if *self.stop.borrow() {
                return Err(StoreError::new(
                    ErrorKind::Closed,
                    format!("the store for {} was closed", self.dial.shown()),
                ));
            }
            let n = self.slots.len();
            let first = self.next.fetch_add(1, Ordering::Relaxed);
            for k in 0..n {
                let slot = &self.slots[(first + k) % n];
                if let Some(l) = slot.link.lock().as_ref().filter(|l| l.is_open()) {
                    return Ok(l.clone());
                }
            }
            if self.opts.fail_fast {
                if let Some(e) = self.last_error() {
                    return Err(e);
                }
            }
            if tokio::time::timeout_at(deadline, changed.changed())
                .await
                .is_err()
            {
                return Err(self.last_error().unwrap_or_else(|| {
                    StoreError::new(
                        ErrorKind::Timeout,
                        format!("no connection to {} in time", self.dial.shown()),
                    )
                }));
            }
        }
    }

    /// The latest dial error of any slot that has not reconnected since.
    fn last_error(&self) -> Option<StoreError> {
        self.slots
            .iter()
            .find_map(|s| s.last_error.lock().as_ref().map(|e| e.to_owned_lossy()))
    }

    /// Closes every connection (requests in flight fail, naming `why`) and stops dialing;
    /// later [`get`](Self::get)s fail with `Closed`. The supervisors hold the pool: its
    /// owner closes it when done (the stores do when dropped).
    pub fn close(&self, why: &str) {
        let _ = self.stop.send(true);
        for slot in &self.slots {
            if let Some(l) = slot.link.lock().take() {
                l.close(why);
            }
        }
        self.changed.send_modify(|g| *g += 1);
    }
}

/// Keeps slot `i` connected until the pool is closed.
async fn supervise<D: Dial>(pool: Arc<Pool<D>>, i: usize, mut next: Option<Arc<D::Link>>) {
    let slot = &pool.slots[i];
    let mut stop = pool.stop.subscribe();
    let mut failed = 0u32;
    loop {
        let link = match next.take() {
            Some(l) => l,
            None => {
                let result = tokio::select! {
                    r = pool.dial.dial() => r,
                    _ = raised(&mut stop) => break,
                };
                match result {
                    Ok(l) => l,
                    Err(e) => {
                        *slot.last_error.lock() = Some(e);
                        pool.changed.send_modify(|g| *g += 1);
                        failed = failed.saturating_add(1);
                        let pause = pool.opts.reconnect.backoff(failed);
                        tokio::select! {
                            _ = tokio::time::sleep(pause) => {}
                            _ = raised(&mut stop) => break,
                        }
                        continue;
                    }
                }
            }
        };
        failed = 0;
        *slot.last_error.lock() = None;
        *slot.link.lock() = Some(link.clone());
        pool.changed.send_modify(|g| *g += 1);
        tokio::select! {
            _ = link.closed() => {}
            _ = raised(&mut stop) => break,
        }
        slot.link.lock().take();
        pool.changed.send_modify(|g| *g += 1);
        // Only the handle in `link` is left; the next dial replaces it.
        drop(link);
    }
    if let Some(l) = slot.link.lock().take() {
        l.close("the client closed the store");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::time::Duration;

    #[derive(Debug)]
    struct FakeLink {
        open: watch::Sender<bool>,
        id: usize,
    }

    impl Link for FakeLink {
        fn is_open(&self) -> bool {
            *self.open.borrow()
        }
        fn closed(&self) -> BoxFuture<'_, ()> {
            let mut rx = self.open.subscribe();
            Box::pin(async move {
                let _ = rx.wait_for(|o| !*o).await;
            })
        }
        fn close(&self, _why: &str) {
            let _ = self.open.send(false);
        }
    }

    struct FakeDial {
        dialed: AtomicUsize,
        refuse: AtomicBool,
    }

    impl Dial for Arc<FakeDial> {
        type Link = FakeLink;
        fn dial(&self) -> BoxFuture<'_, StoreResult<Arc<FakeLink>>> {
            Box::pin(async move {
                if self.refuse.load(Ordering::SeqCst) {
                    return Err(StoreError::new(ErrorKind::Unavailable, "refused"));
                }
                let id = self.dialed.fetch_add(1, Ordering::SeqCst);
                Ok(Arc::new(FakeLink {
                    open: watch::channel(true).0,
                    id,
                }))
            })
        }
        fn shown(&self) -> String {
            "fake".into()
        }
    }

    fn opts(fail_fast: bool) -> PoolOptions {
        PoolOptions {
            reconnect: RetryPolicy {
                attempts: u32::MAX,
                initial_backoff: Duration::from_millis(5),
                max_backoff: Duration::from_millis(20),
            },
            fail_fast,
        }
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    #[tokio::test]
    async fn hands_out_connections_round_robin_and_replaces_closed_ones() {
        let dial = Arc::new(FakeDial {
            dialed: AtomicUsize::new(0),
            refuse: AtomicBool::new(false),
        });
        let pool = Pool::start(dial.clone(), opts(false), vec![None, None, None]);
        while pool.open_count() < 3 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let mut seen: Vec<usize> = Vec::new();
        for _ in 0..3 {
            seen.push(pool.get(soon()).await.unwrap().id);
        }
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 3, "three gets use three connections");
        let l = pool.get(soon()).await.unwrap();
        l.close("test");
        while dial.dialed.load(Ordering::SeqCst) < 4 || pool.open_count() < 3 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_ne!(pool.get(soon()).await.unwrap().id, l.id);
        pool.close("done");
        let e = pool.get(soon()).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Closed);
    }

    #[tokio::test]
    async fn waits_for_a_connection_or_fails_fast_when_asked() {
        let dial = Arc::new(FakeDial {
            dialed: AtomicUsize::new(0),
            refuse: AtomicBool::new(true),
        });
        let waiting = Pool::start(dial.clone(), opts(false), vec![None]);
        let fast = Pool::start(dial.clone(), opts(true), vec![None]);
        tokio::time::sleep(Duration::from_millis(30)).await;
        let e = fast.get(soon()).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
        let e = waiting
            .get(Instant::now() + Duration::from_millis(50))
            .await
            .unwrap_err();
        assert_eq!(
            e.kind(),
            ErrorKind::Unavailable,
            "the latest dial error: {e}"
        );
        let got = tokio::spawn({
            let waiting = waiting.clone();
            async move { waiting.get(soon()).await.map(|l| l.id) }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        dial.refuse.store(false, Ordering::SeqCst);
        assert!(
            got.await.unwrap().is_ok(),
            "a waiting get takes the new connection"
        );
    }
}
