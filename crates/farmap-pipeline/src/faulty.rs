//! [`Faulty`]: injected errors (like nbdkit's error filter).

use std::fmt;
use std::ops::BitOr;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use farmap_core::{
    BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, Store, StoreError,
    StoreResult,
};
use parking_lot::Mutex;

/// A set of store operations.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct OpSet(u8);

impl OpSet {
    /// No operation.
    pub const NONE: OpSet = OpSet(0);
    /// `read`.
    pub const READ: OpSet = OpSet(1 << 0);
    /// `write`.
    pub const WRITE: OpSet = OpSet(1 << 1);
    /// `flush`.
    pub const FLUSH: OpSet = OpSet(1 << 2);
    /// `trim`.
    pub const TRIM: OpSet = OpSet(1 << 3);
    /// `status`.
    pub const STATUS: OpSet = OpSet(1 << 4);
    /// Every operation.
    pub const ALL: OpSet = OpSet(0b1_1111);

    const NAMES: [(OpSet, &'static str); 5] = [
        (OpSet::READ, "read"),
        (OpSet::WRITE, "write"),
        (OpSet::FLUSH, "flush"),
        (OpSet::TRIM, "trim"),
        (OpSet::STATUS, "status"),
    ];

    /// Whether every operation in `other` is in this set.
    pub fn contains(self, other: OpSet) -> bool {
        self.0 & other.0 == other.0
    }
}

impl BitOr for OpSet {
    type Output = OpSet;
    fn bitor(self, rhs: OpSet) -> OpSet {
        OpSet(self.0 | rhs.0)
    }
}

impl fmt::Debug for OpSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<_> = Self::NAMES
            .iter()
            .filter(|(op, _)| self.contains(*op))
            .map(|(_, n)| *n)
            .collect();
        write!(f, "OpSet({})", names.join("|"))
    }
}

/// Which of the matching operations fail. Operations are numbered from 1 in the order they
/// reach the stage, counting only those in the plan's [`OpSet`], from the moment the plan was
/// set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultTrigger {
    /// None.
    Never,
    /// All of them.
    Always,
    /// Only the nth (1-based; `Nth(0)` never fires).
    Nth(u64),
    /// The nth, the 2nth, the 3nth... (`EveryNth(0)` never fires).
    EveryNth(u64),
    /// The nth and every one after it (`FromNth(0)` and `FromNth(1)` both mean all of them).
    FromNth(u64),
    /// Each with probability `per_million` / 1 000 000, decided by a hash of `seed` and the
    /// operation's number: the same seed fails the same operation numbers on every run.
    Rate {
        /// Failures per million operations.
        per_million: u32,
        /// Seed of the deterministic choice.
        seed: u64,
    },
}

impl FaultTrigger {
    /// Whether operation number `n` (1-based) fails.
    fn fires(self, n: u64) -> bool {
        match self {
            FaultTrigger::Never => false,
            FaultTrigger::Always => true,
            FaultTrigger::Nth(k) => n == k,
            FaultTrigger::EveryNth(k) => k != 0 && n.is_multiple_of(k),
            FaultTrigger::FromNth(k) => n >= k,
            FaultTrigger::Rate { per_million, seed } => {
                splitmix64(seed ^ n.wrapping_mul(0xA24B_AED4_963E_E407)) % 1_000_000
                    < u64::from(per_million)
            }
        }
    }
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// What to inject: which operations, which of them, and with what error kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FaultPlan {
    /// The operations the plan applies to; others pass and are not counted.
    pub ops: OpSet,
    /// Which of the matching operations fail.
    pub trigger: FaultTrigger,
    /// The kind of the injected errors.
    pub kind: ErrorKind,
}

impl FaultPlan {
    /// A plan that injects nothing.
    pub fn never() -> Self {
        Self {
            ops: OpSet::NONE,
            trigger: FaultTrigger::Never,
            kind: ErrorKind::Io,
        }
    }
}

#[derive(Debug)]
struct PlanState {
    plan: FaultPlan,
    /// Matching operations seen since the plan was set.
    seen: u64,
}

/// Fails operations according to a [`FaultPlan`], before they reach the inner store.
///
/// Concurrency contract:
/// - An injected fault fails the operation before the inner store is called: a failed write
///   changes nothing.
/// - Operations are numbered under a short lock as they reach the stage (before any await),
///   so with concurrent callers the numbering follows arrival order; the inner call itself
///   holds no lock.
/// - [`set_plan`](Faulty::set_plan) takes effect for operations that arrive after it returns
///   and restarts the numbering.
#[derive(Debug)]
pub struct Faulty<S> {
    inner: S,
    state: Mutex<PlanState>,
    injected: AtomicU64,
}

impl<S: Store> Faulty<S> {
    /// Wraps `inner` with `plan`.
    pub fn new(inner: S, plan: FaultPlan) -> Self {
        Self {
            inner,
            state: Mutex::new(PlanState { plan, seen: 0 }),
            injected: AtomicU64::new(0),
        }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Replaces the plan and restarts the numbering of matching operations.
    pub fn set_plan(&self, plan: FaultPlan) {
        *self.state.lock() = PlanState { plan, seen: 0 };
    }

    /// The current plan.
    pub fn plan(&self) -> FaultPlan {
        self.state.lock().plan
    }

    /// How many faults were injected since the stage was made.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }

    /// Numbers the operation and returns the error to fail it with, if the plan says so.
    /// `what` describes the operation ("write of chunk 3"), built only when it fails.
    fn check(&self, op: OpSet, what: impl FnOnce() -> String) -> StoreResult<()> {
        let kind = {
            let mut st = self.state.lock();
            if !st.plan.ops.contains(op) {
                return Ok(());
            }
            st.seen += 1;
            if !st.plan.trigger.fires(st.seen) {
                return Ok(());
            }
            st.plan.kind
        };
        self.injected.fetch_add(1, Ordering::Relaxed);
        Err(StoreError::new(
            kind,
            format!("injected fault on {}", what()),
        ))
    }
}

impl<S: Store> Store for Faulty<S> {
    fn geometry(&self) -> Geometry {
        self.inner.geometry()
    }

    fn caps(&self) -> Caps {
        self.inner.caps()
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        let checked = self.check(OpSet::READ, || format!("read of {idx}"));
        Box::pin(async move {
            checked?;
            self.inner.read(idx).await
        })
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        let checked = self.check(OpSet::WRITE, || format!("write of {idx}"));
        Box::pin(async move {
            checked?;
            self.inner.write(idx, data).await
        })
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        let checked = self.check(OpSet::FLUSH, || "flush".to_owned());
        Box::pin(async move {
            checked?;
            self.inner.flush().await
        })
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        let checked = self.check(OpSet::TRIM, || format!("trim of {range}"));
        Box::pin(async move {
            checked?;
            self.inner.trim(range).await
        })
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        let checked = self.check(OpSet::STATUS, || format!("status of {idx}"));
        Box::pin(async move {
            checked?;
            self.inner.status(idx).await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn triggers() {
        let fired = |t: FaultTrigger| (1..=10).filter(|n| t.fires(*n)).collect::<Vec<_>>();
        assert_eq!(fired(FaultTrigger::Never), Vec::<u64>::new());
        assert_eq!(fired(FaultTrigger::Always).len(), 10);
        assert_eq!(fired(FaultTrigger::Nth(3)), vec![3]);
        assert_eq!(fired(FaultTrigger::Nth(0)), Vec::<u64>::new());
        assert_eq!(fired(FaultTrigger::EveryNth(4)), vec![4, 8]);
        assert_eq!(fired(FaultTrigger::EveryNth(0)), Vec::<u64>::new());
        assert_eq!(fired(FaultTrigger::FromNth(8)), vec![8, 9, 10]);
    }

    #[test]
    fn rates_are_close_and_deterministic() {
        let rate = |seed| FaultTrigger::Rate {
            per_million: 100_000,
            seed,
        };
        let hits = |t: FaultTrigger| (1..=100_000).filter(|n| t.fires(*n)).count();
        let n = hits(rate(7));
        assert!((9_000..=11_000).contains(&n), "10% of 100 000 gave {n}");
        assert_eq!(n, hits(rate(7)));
        let a: Vec<_> = (1..=200).filter(|n| rate(1).fires(*n)).collect();
        let b: Vec<_> = (1..=200).filter(|n| rate(2).fires(*n)).collect();
        assert_ne!(a, b, "different seeds pick different operations");
        let none = FaultTrigger::Rate {
            per_million: 0,
            seed: 3,
        };
        assert_eq!(hits(none), 0);
        let all = FaultTrigger::Rate {
            per_million: 1_000_000,
            seed: 3,
        };
        assert_eq!(hits(all), 100_000);
    }

    #[test]
    fn op_sets() {
        let s = OpSet::READ | OpSet::WRITE;
        assert!(s.contains(OpSet::READ) && !s.contains(OpSet::FLUSH));
        assert!(OpSet::ALL.contains(s | OpSet::TRIM | OpSet::STATUS | OpSet::FLUSH));
        assert_eq!(format!("{s:?}"), "OpSet(read|write)");
    }
}
