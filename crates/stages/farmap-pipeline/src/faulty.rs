//! [`Faulty`]: injected errors (like nbdkit's error filter) and injected data faults: flipped
//! bits, torn writes, silently lost writes and stale reads ([`DataFaults`]).

use std::collections::HashMap;
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

/// Data faults: a store that answers but lies. Each is a rate in faults per million of the
/// operations it applies to, decided by a hash of [`seed`](DataFaults::seed), the fault's kind
/// and the operation's number (reads and writes are numbered separately, from 1, since the
/// faults were set), so the same seed and the same sequence of operations give the same faults.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct DataFaults {
    /// Reads whose returned data has 1 to 3 bits flipped (the stored chunk is left alone).
    pub corrupt_reads: u32,
    /// Writes of which only the first half lands: the chunk then holds the new first half and
    /// the old second half. The write reports success.
    pub torn_writes: u32,
    /// Writes acknowledged but not written.
    pub lost_writes: u32,
    /// Reads that return an older version of the chunk: the content before the last write
    /// that passed through this stage (zeros when there was none).
    pub stale_reads: u32,
    /// Seed of the deterministic choice.
    pub seed: u64,
}

impl DataFaults {
    /// No data fault.
    pub fn none() -> Self {
        Self::default()
    }

    fn keeps_history(&self) -> bool {
        self.stale_reads > 0 || self.torn_writes > 0
    }
}

/// How many data faults a [`Faulty`] stage injected, by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct DataFaultCounts {
    /// Reads returned with flipped bits.
    pub corrupted: u64,
    /// Writes torn in half.
    pub torn: u64,
    /// Writes dropped.
    pub lost: u64,
    /// Reads returned stale.
    pub stale: u64,
}

impl DataFaultCounts {
    /// All of them.
    pub fn total(&self) -> u64 {
        self.corrupted + self.torn + self.lost + self.stale
    }
}

/// Salts that make the fault kinds independent of each other under one seed.
const SALT_CORRUPT: u64 = 0x636F_7272_7570_7431;
const SALT_TORN: u64 = 0x746F_726E_5F77_7231;
const SALT_LOST: u64 = 0x6C6F_7374_5F77_7231;
const SALT_STALE: u64 = 0x7374_616C_655F_7231;

fn rate_fires(per_million: u32, seed: u64, salt: u64, n: u64) -> bool {
    per_million > 0
        && splitmix64(seed ^ salt ^ n.wrapping_mul(0xA24B_AED4_963E_E407)) % 1_000_000
            < u64::from(per_million)
}

#[derive(Debug, Default)]
struct DataState {
    faults: DataFaults,
    reads: u64,
    writes: u64,
    counts: DataFaultCounts,
    /// Per chunk: the content before the last write through this stage, and the content of
    /// that write (kept only while stale reads or torn writes are asked for).
    history: HashMap<u64, (Option<Bytes>, Bytes)>,
}

/// What a read's data fault does to the data it returns.
#[derive(Debug, Clone, Copy)]
enum ReadFault {
    Corrupt(u64),
    Stale,
}

/// What a write's data fault does.
#[derive(Debug, Clone, Copy)]
enum WriteFault {
    Torn,
    Lost,
}

/// Flips 1 to 3 bits of `data` at positions derived from `h`.
fn flip_bits(data: &[u8], mut h: u64) -> Bytes {
    let mut v = data.to_vec();
    if v.is_empty() {
        return Bytes::from(v);
    }
    let flips = 1 + (h % 3) as usize;
    let mut flipped = Vec::with_capacity(flips);
    for _ in 0..flips {
        h = splitmix64(h);
        let bit = h % (v.len() as u64 * 8);
        // The same bit twice would undo the first flip.
        if !flipped.contains(&bit) {
            flipped.push(bit);
            v[(bit / 8) as usize] ^= 1 << (bit % 8);
        }
    }
    Bytes::from(v)
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
/// - [Data faults](DataFaults) apply to reads and writes that the plan let through; they are
///   numbered (separately for reads and writes) under the same kind of short lock. A torn write
///   reads the inner chunk first, then writes the mix: it is not atomic with a concurrent
///   write of the same chunk (it models a device that tears writes, after all).
/// - For stale reads the stage keeps, per chunk written through it, the previous and the
///   current content (shared `Bytes`, no copy); this costs memory only while stale reads or
///   torn writes are asked for.
#[derive(Debug)]
pub struct Faulty<S> {
    inner: S,
    state: Mutex<PlanState>,
    injected: AtomicU64,
    data: Mutex<DataState>,
}

impl<S: Store> Faulty<S> {
    /// Wraps `inner` with `plan`.
    pub fn new(inner: S, plan: FaultPlan) -> Self {
        Self {
            inner,
            state: Mutex::new(PlanState { plan, seen: 0 }),
            injected: AtomicU64::new(0),
            data: Mutex::new(DataState::default()),
        }
    }

    /// Wraps `inner` with no error plan and the data faults `faults`.
    pub fn with_data_faults(inner: S, faults: DataFaults) -> Self {
        let s = Self::new(inner, FaultPlan::never());
        s.set_data_faults(faults);
        s
    }

    /// Replaces the data faults and restarts their numbering (the kept history stays, so
    /// that stale reads still find older versions).
    pub fn set_data_faults(&self, faults: DataFaults) {
        let mut d = self.data.lock();
        d.faults = faults;
        d.reads = 0;
        d.writes = 0;
        if !faults.keeps_history() {
            d.history.clear();
        }
    }

    /// The current data faults.
    pub fn data_faults(&self) -> DataFaults {
        self.data.lock().faults
    }

    /// How many data faults were injected since the stage was made, by kind.
    pub fn data_injected(&self) -> DataFaultCounts {
        self.data.lock().counts
    }

    fn read_fault(&self, idx: ChunkIdx) -> Option<ReadFault> {
        let mut d = self.data.lock();
        let f = d.faults;
        if f.corrupt_reads == 0 && f.stale_reads == 0 {
            return None;
        }
        d.reads += 1;
        let n = d.reads;
        if rate_fires(f.stale_reads, f.seed, SALT_STALE, n) && d.history.contains_key(&idx.0) {
            d.counts.stale += 1;
            return Some(ReadFault::Stale);
        }
        if rate_fires(f.corrupt_reads, f.seed, SALT_CORRUPT, n) {
            d.counts.corrupted += 1;
            return Some(ReadFault::Corrupt(splitmix64(f.seed ^ n ^ idx.0)));
        }
        None
    }

    fn write_fault(&self) -> Option<WriteFault> {
        let mut d = self.data.lock();
        let f = d.faults;
        if f.lost_writes == 0 && f.torn_writes == 0 {
            return None;
        }
        d.writes += 1;
        let n = d.writes;
        if rate_fires(f.lost_writes, f.seed, SALT_LOST, n) {
            d.counts.lost += 1;
            return Some(WriteFault::Lost);
        }
        if rate_fires(f.torn_writes, f.seed, SALT_TORN, n) {
            d.counts.torn += 1;
            return Some(WriteFault::Torn);
        }
        None
    }

    /// Records that `data` is now what the caller believes chunk `idx` holds.
    fn remember(&self, idx: ChunkIdx, data: &Bytes) {
        let mut d = self.data.lock();
        if !d.faults.keeps_history() {
            return;
        }
        let prev = d.history.remove(&idx.0).map(|(_, cur)| cur);
        d.history.insert(idx.0, (prev, data.clone()));
    }

    fn stale_version(&self, idx: ChunkIdx) -> Bytes {
        let d = self.data.lock();
        let len = self.inner.geometry().chunk_len(idx);
        match d.history.get(&idx.0) {
            Some((Some(prev), _)) => prev.clone(),
            _ => farmap_core::zero_chunk(len),
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
            self.inner.geometry().check_idx(idx)?;
            let fault = self.read_fault(idx);
            let data = self.inner.read(idx).await?;
            Ok(match fault {
                None => data,
                Some(ReadFault::Corrupt(h)) => flip_bits(&data, h),
                Some(ReadFault::Stale) => self.stale_version(idx),
            })
        })
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        let checked = self.check(OpSet::WRITE, || format!("write of {idx}"));
        Box::pin(async move {
            checked?;
            self.inner.geometry().check_write(idx, data.len())?;
            let fault = self.write_fault();
            match fault {
                None => self.inner.write(idx, data.clone()).await?,
                Some(WriteFault::Lost) => {}
                Some(WriteFault::Torn) => {
                    let old = self.inner.read(idx).await?;
                    let half = data.len() / 2;
                    let mut mix = Vec::with_capacity(data.len());
                    mix.extend_from_slice(&data[..half]);
                    mix.extend_from_slice(&old[half..]);
                    self.inner.write(idx, Bytes::from(mix)).await?;
                }
            }
            self.remember(idx, &data);
            Ok(())
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
            self.inner.trim(range).await?;
            let g = self.inner.geometry();
            let keeps = self.data.lock().faults.keeps_history();
            if keeps {
                for idx in range.iter() {
                    self.remember(idx, &farmap_core::zero_chunk(g.chunk_len(idx)));
                }
            }
            Ok(())
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

    use farmap_testkit::ModelStore;

    fn g() -> Geometry {
        Geometry::new(8 * 4096, 4096).unwrap()
    }

    fn chunk(v: u8) -> Bytes {
        Bytes::from(vec![v; 4096])
    }

    #[tokio::test]
    async fn corrupt_reads_flip_bits_without_touching_the_store() {
        let f = Faulty::with_data_faults(
            ModelStore::new(g()),
            DataFaults {
                corrupt_reads: 1_000_000,
                seed: 5,
                ..DataFaults::none()
            },
        );
        f.write(ChunkIdx(1), chunk(7)).await.unwrap();
        let got = f.read(ChunkIdx(1)).await.unwrap();
        let flipped: u32 = got.iter().map(|b| (b ^ 7).count_ones()).sum();
        assert!((1..=3).contains(&flipped), "{flipped} bits flipped");
        assert_eq!(f.inner().read(ChunkIdx(1)).await.unwrap(), chunk(7));
        assert_eq!(f.data_injected().corrupted, 1);
    }

    #[tokio::test]
    async fn torn_writes_land_half_and_lost_writes_none() {
        let f = Faulty::new(ModelStore::new(g()), FaultPlan::never());
        f.write(ChunkIdx(2), chunk(1)).await.unwrap();
        f.set_data_faults(DataFaults {
            torn_writes: 1_000_000,
            ..DataFaults::none()
        });
        f.write(ChunkIdx(2), chunk(2)).await.unwrap();
        let got = f.inner().read(ChunkIdx(2)).await.unwrap();
        assert_eq!(&got[..2048], &chunk(2)[..2048]);
        assert_eq!(&got[2048..], &chunk(1)[2048..]);
        f.set_data_faults(DataFaults {
            lost_writes: 1_000_000,
            ..DataFaults::none()
        });
        f.write(ChunkIdx(3), chunk(3)).await.unwrap();
        assert_eq!(f.inner().read(ChunkIdx(3)).await.unwrap(), chunk(0));
        assert_eq!(f.data_injected().lost, 1);
        assert_eq!(f.data_injected().torn, 1);
    }

    #[tokio::test]
    async fn stale_reads_return_the_previous_version() {
        let f = Faulty::with_data_faults(
            ModelStore::new(g()),
            DataFaults {
                stale_reads: 1_000_000,
                ..DataFaults::none()
            },
        );
        // Never written through the stage: nothing older kept, the read is true.
        assert_eq!(f.read(ChunkIdx(0)).await.unwrap(), chunk(0));
        f.write(ChunkIdx(0), chunk(1)).await.unwrap();
        assert_eq!(
            f.read(ChunkIdx(0)).await.unwrap(),
            chunk(0),
            "zeros came before"
        );
        f.write(ChunkIdx(0), chunk(2)).await.unwrap();
        assert_eq!(f.read(ChunkIdx(0)).await.unwrap(), chunk(1));
        assert_eq!(f.data_injected().stale, 2);
    }

    #[tokio::test]
    async fn data_faults_are_deterministic_under_a_seed() {
        async fn run(seed: u64) -> (Vec<Bytes>, DataFaultCounts) {
            let f = Faulty::with_data_faults(
                ModelStore::new(g()),
                DataFaults {
                    corrupt_reads: 200_000,
                    torn_writes: 200_000,
                    lost_writes: 200_000,
                    stale_reads: 200_000,
                    seed,
                },
            );
            let mut seen = Vec::new();
            for i in 0..200u64 {
                let idx = ChunkIdx(i % 8);
                f.write(idx, chunk(i as u8)).await.unwrap();
                seen.push(f.read(ChunkIdx((i * 3) % 8)).await.unwrap());
            }
            (seen, f.data_injected())
        }
        let (a, ca) = run(11).await;
        let (b, cb) = run(11).await;
        assert_eq!(a, b);
        assert_eq!(ca, cb);
        assert!(
            ca.corrupted > 10 && ca.torn > 10 && ca.lost > 10 && ca.stale > 10,
            "{ca:?}"
        );
        let (c, _) = run(12).await;
        assert_ne!(a, c, "another seed, other faults");
    }

    #[test]
    fn op_sets() {
        let s = OpSet::READ | OpSet::WRITE;
        assert!(s.contains(OpSet::READ) && !s.contains(OpSet::FLUSH));
        assert!(OpSet::ALL.contains(s | OpSet::TRIM | OpSet::STATUS | OpSet::FLUSH));
        assert_eq!(format!("{s:?}"), "OpSet(read|write)");
    }
}
