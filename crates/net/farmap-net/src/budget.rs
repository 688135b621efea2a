//! [`Budget`]: the bytes a server lets one connection, and all of them together, hold.
//!
//! Every request is charged, before it runs, the memory it may hold until its reply has been
//! written (its payload, the store's chunks it reads, its reply). The charge is taken from
//! the connection's budget and then either from the connection's own small reserve or from
//! the server's [`Total`]; all come back when the [`Charge`] is dropped (after the reply is
//! written). A request never needs more than a whole connection budget, so every request can
//! run.
//!
//! The reserve is what keeps one client from starving the others: clients that stop reading
//! their replies can hold the whole total, but every connection can still run a request that
//! fits its reserve. The server's memory for requests is thus at most the total plus one
//! reserve per connection.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, TryAcquireError};

/// The most bytes one budget can count (tokio's semaphores count in `u32` at once).
const MAX_BUDGET: usize = u32::MAX as usize;

/// One connection's share of memory, drawn from the server's total.
#[derive(Debug, Clone)]
pub struct Budget {
    conn: Arc<Semaphore>,
    conn_bytes: usize,
    reserve: Arc<Semaphore>,
    reserve_bytes: usize,
    total: Arc<Semaphore>,
    total_bytes: usize,
}

/// Bytes held for one request (or several merged); returned when dropped.
#[derive(Debug)]
pub struct Charge {
    conn: OwnedSemaphorePermit,
    reserve: Option<OwnedSemaphorePermit>,
    total: Option<OwnedSemaphorePermit>,
}

fn merge_into(a: &mut Option<OwnedSemaphorePermit>, b: Option<OwnedSemaphorePermit>) {
    match (a.as_mut(), b) {
        (Some(a), Some(b)) => a.merge(b),
        (None, b) => *a = b,
        (Some(_), None) => {}
    }
}

impl Charge {
    /// Adds `other`'s bytes to this charge (both come back together).
    pub fn merge(&mut self, other: Charge) {
        self.conn.merge(other.conn);
        merge_into(&mut self.reserve, other.reserve);
        merge_into(&mut self.total, other.total);
    }

    /// Whether the charge came (wholly or in part) from the server's total.
    pub fn from_total(&self) -> bool {
        self.total.is_some()
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.conn.num_permits()
    }
}

/// The server-wide budget every connection's [`Budget`] draws from.
#[derive(Debug, Clone)]
pub struct Total {
    sem: Arc<Semaphore>,
    bytes: usize,
}

impl Total {
    /// A server-wide budget of `bytes`.
    pub fn new(bytes: usize) -> Total {
        let bytes = bytes.clamp(1, MAX_BUDGET);
        Total {
            sem: Arc::new(Semaphore::new(bytes)),
            bytes,
        }
    }

    /// Bytes not held by any connection right now.
    pub fn available(&self) -> usize {
        self.sem.available_permits()
    }

    /// The whole budget.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Holds `bytes` (at most the whole total) of the total alone, waiting for them: for
    /// memory no one connection's budget covers (a frame still arriving).
    pub async fn hold(&self, bytes: usize) -> OwnedSemaphorePermit {
        self.sem
            .clone()
            .acquire_many_owned(bytes.min(self.bytes) as u32)
            .await
            .expect("budgets are never closed")
    }

    /// A connection's budget of `conn_bytes` (at most the whole total) drawn from this one,
    /// with a reserve of its own of `reserve_bytes` (at most `conn_bytes`).
    pub fn connection(&self, conn_bytes: usize, reserve_bytes: usize) -> Budget {
        let conn_bytes = conn_bytes.clamp(1, self.bytes);
        let reserve_bytes = reserve_bytes.min(conn_bytes);
        Budget {
            conn: Arc::new(Semaphore::new(conn_bytes)),
            conn_bytes,
            reserve: Arc::new(Semaphore::new(reserve_bytes)),
            reserve_bytes,
            total: self.sem.clone(),
            total_bytes: self.bytes,
        }
    }
}

impl Budget {
    /// The most one charge can be: the whole connection budget (or the whole total, if
    /// smaller).
    pub fn limit(&self) -> usize {
        self.conn_bytes.min(self.total_bytes)
    }

    /// What a request of `bytes` is charged: at most [`limit`](Self::limit).
    pub fn clamp(&self, bytes: usize) -> u32 {
        bytes.min(self.limit()) as u32
    }

    /// Charges `bytes` (clamped, see [`clamp`](Self::clamp)): waits for the connection's
    /// budget, then for whichever of its reserve and the server's total has room first.
    pub async fn charge(&self, bytes: usize) -> Charge {
        let n = self.clamp(bytes);
        let conn = self
            .conn
            .clone()
            .acquire_many_owned(n)
            .await
            .expect("budgets are never closed");
        if let Ok(r) = self.reserve.clone().try_acquire_many_owned(n) {
            return Charge {
                conn,
                reserve: Some(r),
                total: None,
            };
        }
        let from_total = self.total.clone().acquire_many_owned(n);
        let from_reserve = async {
            if n as usize <= self.reserve_bytes {
                self.reserve.clone().acquire_many_owned(n).await
            } else {
                std::future::pending().await
            }
        };
        tokio::select! {
            t = from_total => Charge {
                conn,
                reserve: None,
                total: Some(t.expect("budgets are never closed")),
            },
            r = from_reserve => Charge {
                conn,
                reserve: Some(r.expect("budgets are never closed")),
                total: None,
            },
        }
    }

    /// Charges `bytes` (clamped) if the connection's budget and its reserve or the total
    /// have them now.
    pub fn try_charge(&self, bytes: usize) -> Option<Charge> {
        let n = self.clamp(bytes);
        let conn = match self.conn.clone().try_acquire_many_owned(n) {
            Ok(p) => p,
            Err(TryAcquireError::NoPermits | TryAcquireError::Closed) => return None,
        };
        if let Ok(r) = self.reserve.clone().try_acquire_many_owned(n) {
            return Some(Charge {
                conn,
                reserve: Some(r),
                total: None,
            });
        }
        let total = self.total.clone().try_acquire_many_owned(n).ok()?;
        Some(Charge {
            conn,
            reserve: None,
            total: Some(total),
        })
    }

    /// Whether this connection holds nothing.
    pub fn is_idle(&self) -> bool {
        self.conn.available_permits() == self.conn_bytes
    }

    /// Bytes this connection holds.
    pub fn held(&self) -> usize {
        self.conn_bytes - self.conn.available_permits()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn charges_come_from_the_connection_and_the_total_and_come_back() {
        let total = Total::new(100);
        let a = total.connection(60, 0);
        let b = total.connection(60, 0);
        let ca = a.charge(60).await;
        assert_eq!(ca.bytes(), 60);
        assert!(
            a.try_charge(1).is_none(),
            "the connection's budget is spent"
        );
        let cb = b.try_charge(40).expect("the total has 40 left");
        assert!(b.try_charge(1).is_none(), "the total is spent");
        assert_eq!(total.available(), 0);
        let waiting = tokio::spawn({
            let b = b.clone();
            async move { b.charge(20).await.bytes() }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "waits for the total");
        drop(ca);
        assert_eq!(waiting.await.unwrap(), 20);
        drop(cb);
        assert!(a.is_idle() && b.is_idle());
        assert_eq!(total.available(), 100);
        assert_eq!(
            a.clamp(1 << 40),
            60,
            "never more than a whole connection budget"
        );
    }

    #[tokio::test]
    async fn a_connection_runs_what_fits_its_reserve_when_others_hold_the_total() {
        let total = Total::new(90);
        let hog = total.connection(100, 10);
        let good = total.connection(100, 10);
        // The hog's reserve first, then the whole total (its budget is clamped to 90).
        let held: Vec<Charge> = vec![hog.charge(10).await, hog.charge(80).await];
        assert!(held[1].from_total() && !held[0].from_total());
        let more = hog.try_charge(0).expect("nothing is always there");
        drop(more);
        let hog2 = total.connection(100, 0);
        let held2 = hog2.charge(10).await;
        assert!(held2.from_total());
        assert_eq!(total.available(), 0);
        assert!(hog.try_charge(1).is_none(), "the hog's budget is spent");
        let small = good.try_charge(8).expect("the good connection's reserve");
        assert!(!small.from_total());
        let waiting = tokio::spawn({
            let good = good.clone();
            async move { good.charge(5).await.from_total() }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            !waiting.is_finished(),
            "2 bytes left in the reserve, the total is held"
        );
        drop(small);
        assert!(!waiting.await.unwrap(), "the reserve came back first");
        drop((held, held2));
        assert_eq!(total.available(), 90);
    }
}
