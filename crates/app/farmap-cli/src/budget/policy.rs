//! How a budget divides its total among its programs: a pure function of what the
//! coordinator observed ([`divide`]), and the per-program bookkeeping that turns counters
//! into observations ([`Watch`]). No I/O and no clock, so that tables test it.
//!
//! RackMem's rebalancer, adapted to what can be seen here (no accessed bits, docs/design/
//! farmap-run.md §6):
//! - *demand*: faults per second, smoothed (EWMA), and *active*: the bytes the pager found
//!   touched since its clock last passed them. A program's weight is
//!   `demand · unit + ALPHA · active` (a fault per second weighs as much as a held page).
//! - An idle program (no faults for [`Policy::idle_after`] intervals) shrinks to the floor.
//! - A new program starts at an equal split (`total / programs`); the others make room, at
//!   once if they must (the only case where the step bound gives way).
//! - The others get the floor plus a part of what is left in proportion to their weights,
//!   each capped at its working set (resident or active, the larger) plus headroom (a
//!   quarter of it, at least the floor), and at its heap's size; what a cap leaves goes to
//!   the uncapped.
//! - A share moves by at most [`Policy::max_step`] of its size or of an equal split,
//!   whichever is larger, per interval; a change smaller than [`Policy::dead_band`] is not
//!   made (hysteresis).
//! - Shares are whole units, never below the floor (nor above the heap), and add up to at
//!   most the total.

/// The rules of a budget.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Policy {
    /// The local memory all programs share, in bytes.
    pub total: u64,
    /// The least share (lowered to an equal split when the programs are too many for it).
    pub floor: u64,
    /// Shares are multiples of this (the heap's chunk).
    pub unit: u64,
    /// The most a share moves per interval, as a part of its size or of an equal split,
    /// whichever is larger.
    pub max_step: f64,
    /// Intervals without faults after which a program counts as idle.
    pub idle_after: u32,
    /// Changes smaller than this are not made.
    pub dead_band: u64,
}

/// The weight of an active byte against a byte faulted per second.
pub const ALPHA: f64 = 1.0;

/// Below this many faults per second an interval counts as quiet (towards idle).
pub const QUIET_FAULTS_PER_SEC: f64 = 1.0;

/// How much of a new rate the smoothed demand takes each interval.
const EWMA_WEIGHT: f64 = 0.5;

impl Policy {
    /// The defaults for `total` bytes: floor 5% of the total within [1 MiB, 8 MiB], steps
    /// of 25%, idle after 3 quiet intervals, a dead band of 1/64 of the total; in units of
    /// `unit` bytes.
    pub fn new(total: u64, unit: u64) -> Policy {
        let unit = unit.max(1);
        Policy {
            total,
            floor: round_down((total / 20).clamp(1 << 20, 8 << 20), unit).max(unit),
            unit,
            max_step: 0.25,
            idle_after: 3,
            dead_band: (total / 64).max(unit),
        }
    }

    /// The floor with `n` programs: at most an equal split, a whole unit at least.
    pub fn floor_for(&self, n: usize) -> u64 {
        let equal = round_down(self.total / n.max(1) as u64, self.unit);
        self.floor.min(equal).max(self.unit)
    }
}

/// What the coordinator knows of one program.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Member {
    /// The share it holds; `None` when it just joined.
    pub share: Option<u64>,
    /// Faults per second, smoothed ([`Watch`]).
    pub demand: f64,
    /// Bytes touched since the pager's clock last passed them.
    pub active: u64,
    /// Bytes held locally now (mapped, staged, in flight).
    pub resident: u64,
    /// Its heap's size: no share is larger (0: not known yet).
    pub region: u64,
    /// Consecutive quiet intervals ([`QUIET_FAULTS_PER_SEC`]).
    pub idle_for: u32,
}

/// Why a share is what it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// Just joined: an equal split.
    New,
    /// No faults for a while: shrinking to the floor, or there.
    Idle,
    /// In proportion to its demand and active memory.
    Demand,
    /// Capped at its working set plus headroom (or its heap's size).
    WorkingSet,
    /// On its way, by at most one step per interval.
    Step,
    /// Kept: the change would have been smaller than the dead band.
    Held,
    /// At the floor: nothing left to give it.
    Floor,
}

impl Reason {
    /// The name shown in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::New => "new",
            Reason::Idle => "idle",
            Reason::Demand => "demand",
            Reason::WorkingSet => "working_set",
            Reason::Step => "step",
            Reason::Held => "held",
            Reason::Floor => "floor",
        }
    }
}

/// A program's new share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share {
    /// Bytes.
    pub bytes: u64,
    /// Why.
    pub reason: Reason,
}

/// The shares of `members` (in their order) under `policy`; see the module docs.
pub fn divide(policy: &Policy, members: &[Member]) -> Vec<Share> {
    let n = members.len();
    if n == 0 {
        return Vec::new();
    }
    let unit = policy.unit.max(1);
    let floor = policy.floor_for(n);
    let equal = round_down(policy.total / n as u64, unit).max(floor);
    let heap = |m: &Member| match m.region {
        0 => u64::MAX,
        r => round_down(r, unit).max(unit),
    };
    // 1. Targets: fixed for the new and the idle, by weight for the others.
    let mut target: Vec<f64> = vec![0.0; n];
    let mut reason = vec![Reason::Demand; n];
    let mut weighted = Vec::new();
    let mut fixed_sum = 0.0;
    for (i, m) in members.iter().enumerate() {
        if m.share.is_none() {
            (target[i], reason[i]) = (equal.min(heap(m)) as f64, Reason::New);
            fixed_sum += target[i];
        } else if m.idle_for >= policy.idle_after {
            (target[i], reason[i]) = (floor.min(heap(m)) as f64, Reason::Idle);
            fixed_sum += target[i];
        } else {
            weighted.push(i);
        }
    }
    let pool = (policy.total as f64 - fixed_sum - (weighted.len() as u64 * floor) as f64).max(0.0);
    fill(
        policy,
        members,
        &weighted,
        floor,
        pool,
        &mut target,
        &mut reason,
    );
    // 2. Steps and hysteresis for those that hold a share.
    let mut out = bound_steps(policy, members, equal, floor, &target, &mut reason);
    // 3. At most the total: take back increases first, then from the old members above
    // the floor (faster than a step: a newcomer's start comes first), then from the new.
    let lows: Vec<f64> = members.iter().map(|m| floor.min(heap(m)) as f64).collect();
    let mut excess = out.iter().sum::<f64>() - policy.total as f64;
    let rounds: [&dyn Fn(usize) -> f64; 3] = [
        &|i| match members[i].share {
            Some(prev) => prev as f64,
            None => f64::INFINITY,
        },
        &|i| match members[i].share {
            Some(_) => lows[i],
            None => f64::INFINITY,
        },
        &|i| lows[i],
    ];
    for down_to in rounds {
        if excess <= 0.0 {
            break;
        }
        excess = take_back(&mut out, &mut reason, excess, down_to);
    }
    // 4. Whole units, within [floor, heap], then trimmed to the total in whole units (the
    // floors fit: n floors are at most the total).
    let mut bytes: Vec<u64> = members
        .iter()
        .enumerate()
        .map(|(i, m)| {
            round_down(out[i].max(0.0) as u64, unit)
                .max(lows[i] as u64)
                .min(heap(m))
        })
        .collect();
    trim(&mut bytes, &lows, policy.total, unit);
    bytes
        .into_iter()
        .zip(reason)
        .map(|(bytes, reason)| Share {
            bytes,
            reason: match reason {
                Reason::Demand if bytes <= floor => Reason::Floor,
                r => r,
            },
        })
        .collect()
}

/// Lowers the largest shares above their lows, a unit at a time at most a few times over,
/// until they add up to at most `total` (the float arithmetic before can be a unit or so
/// off; this is exact).
fn trim(bytes: &mut [u64], lows: &[f64], total: u64, unit: u64) {
    let mut sum: u64 = bytes.iter().fold(0u64, |a, &b| a.saturating_add(b));
    while sum > total {
        let Some(i) = (0..bytes.len())
            .filter(|&i| bytes[i] >= lows[i] as u64 + unit)
            .max_by_key(|&i| bytes[i] - lows[i] as u64)
        else {
            return;
        };
        let over = round_up(sum - total, unit).min(bytes[i] - lows[i] as u64);
        let over = round_down(over, unit).max(unit);
        bytes[i] -= over;
        sum -= over;
    }
}

fn round_up(v: u64, unit: u64) -> u64 {
    v.div_ceil(unit.max(1)).saturating_mul(unit.max(1))
}

/// The targets moved at most a step from the shares held, and not at all within the dead
/// band, except down to the floor (an idle member gives back all it can: else a share that
/// ended up within a dead band above the floor would stay there for good).
fn bound_steps(
    policy: &Policy,
    members: &[Member],
    equal: u64,
    floor: u64,
    target: &[f64],
    reason: &mut [Reason],
) -> Vec<f64> {
    let mut out = target.to_vec();
    for (i, m) in members.iter().enumerate() {
        let Some(prev) = m.share else { continue };
        let prev = prev as f64;
        let step = policy.max_step * prev.max(equal as f64);
        let t = target[i];
        let why = if (t - prev).abs() < policy.dead_band as f64 && t > floor as f64 {
            out[i] = prev;
            Reason::Held
        } else if t > prev + step || t < prev - step {
            out[i] = t.clamp(prev - step, prev + step);
            Reason::Step
        } else {
            continue;
        };
        if reason[i] != Reason::Idle {
            reason[i] = why;
        }
    }
    out
}

/// Gives the weighted members `floor` plus parts of `pool` in proportion to their weights,
/// each capped at its working set plus headroom and its heap; what a cap leaves goes to
/// the others (water-filling).
fn fill(
    policy: &Policy,
    members: &[Member],
    weighted: &[usize],
    floor: u64,
    mut pool: f64,
    target: &mut [f64],
    reason: &mut [Reason],
) {
    let weight = |m: &Member| {
        let w = m.demand.max(0.0) * policy.unit as f64 + ALPHA * m.active as f64;
        if w.is_finite() {
            w
        } else {
            f64::MAX / 1e6
        }
    };
    let cap = |m: &Member| {
        let ws = m.resident.max(m.active);
        let with_room = ws.saturating_add((ws / 4).max(floor)).max(floor);
        match m.region {
            0 => with_room,
            r => with_room.min(r.max(floor)),
        }
    };
    let mut open: Vec<usize> = weighted.to_vec();
    loop {
        let total_w: f64 = open.iter().map(|&i| weight(&members[i])).sum();
        let part = |i: usize| match total_w > 0.0 {
            true => pool * weight(&members[i]) / total_w,
            false => pool / open.len() as f64,
        };
        let capped: Vec<usize> = open
            .iter()
            .copied()
            .filter(|&i| floor as f64 + part(i) > cap(&members[i]) as f64)
            .collect();
        if capped.is_empty() {
            for &i in &open {
                target[i] = floor as f64 + part(i);
            }
            return;
        }
        for &i in &capped {
            target[i] = cap(&members[i]) as f64;
            reason[i] = Reason::WorkingSet;
            pool = (pool - (target[i] - floor as f64)).max(0.0);
        }
        open.retain(|i| !capped.contains(i));
        if open.is_empty() {
            return;
        }
    }
}

/// Lowers shares above `down_to(i)` in proportion to what they have above it, by `excess`
/// in all if they can; returns what is left of the excess.
fn take_back(
    out: &mut [f64],
    reason: &mut [Reason],
    excess: f64,
    down_to: &dyn Fn(usize) -> f64,
) -> f64 {
    let room: Vec<f64> = (0..out.len())
        .map(|i| (out[i] - down_to(i)).max(0.0))
        .collect();
    let total_room: f64 = room.iter().sum();
    if total_room <= 0.0 {
        return excess;
    }
    let take = excess.min(total_room);
    for i in 0..out.len() {
        if room[i] > 0.0 {
            out[i] -= take * room[i] / total_room;
            if reason[i] == Reason::Demand || reason[i] == Reason::WorkingSet {
                reason[i] = Reason::Step;
            }
        }
    }
    excess - take
}

fn round_down(v: u64, unit: u64) -> u64 {
    v - v % unit.max(1)
}

/// One program's counters between intervals: its smoothed demand and quiet intervals.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Watch {
    /// The fault counter last read (`None` before the first reading).
    pub last_faults: Option<u64>,
    /// Faults per second, smoothed.
    pub demand: f64,
    /// Consecutive quiet intervals.
    pub idle_for: u32,
}

impl Watch {
    /// Takes a reading of the fault counter, `secs` after the previous one. A counter that
    /// went down (a new program image, whose counters start again) counts from zero.
    pub fn observe(&mut self, faults: u64, secs: f64) {
        let Some(last) = self.last_faults.replace(faults) else {
            return;
        };
        let delta = if faults >= last {
            faults - last
        } else {
            faults
        };
        let rate = if secs > 0.0 && secs.is_finite() {
            delta as f64 / secs
        } else {
            0.0
        };
        self.demand += EWMA_WEIGHT * (rate - self.demand);
        if rate < QUIET_FAULTS_PER_SEC {
            self.idle_for = self.idle_for.saturating_add(1);
        } else {
            self.idle_for = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn policy() -> Policy {
        Policy::new(64 * MIB, 4096)
    }

    fn busy(share: u64, resident: u64) -> Member {
        Member {
            share: Some(share),
            demand: 20_000.0,
            active: resident,
            resident,
            region: 1 << 30,
            idle_for: 0,
        }
    }

    fn idle(share: u64, resident: u64) -> Member {
        Member {
            share: Some(share),
            demand: 0.0,
            active: resident,
            resident,
            region: 1 << 30,
            idle_for: 5,
        }
    }

    fn fresh() -> Member {
        Member {
            region: 1 << 30,
            ..Member::default()
        }
    }

    fn bytes(s: &[Share]) -> Vec<u64> {
        s.iter().map(|s| s.bytes).collect()
    }

    /// The invariants every division keeps.
    fn check(p: &Policy, members: &[Member], s: &[Share]) {
        assert_eq!(s.len(), members.len());
        let floor = p.floor_for(members.len());
        let sum: u64 = s.iter().map(|s| s.bytes).sum();
        assert!(sum <= p.total, "{sum} > {}: {s:?}", p.total);
        for (m, s) in members.iter().zip(s) {
            assert_eq!(s.bytes % p.unit, 0, "{s:?}");
            assert!(
                s.bytes >= floor.min(m.region.max(p.unit)),
                "{s:?} < {floor}"
            );
            if m.region > 0 {
                assert!(s.bytes <= m.region, "{s:?}");
            }
        }
    }

    /// Runs the policy `steps` times, each member's share fed back as it would be.
    fn converge(p: &Policy, mut members: Vec<Member>, steps: usize) -> Vec<Share> {
        let mut last = Vec::new();
        for _ in 0..steps {
            last = divide(p, &members);
            check(p, &members, &last);
            for (m, s) in members.iter_mut().zip(&last) {
                m.share = Some(s.bytes);
                // The busy fill their share; the idle hold what they held.
                if m.demand > 0.0 {
                    m.resident = s.bytes;
                    m.active = s.bytes;
                }
            }
        }
        last
    }

    #[test]
    fn the_defaults_follow_the_total() {
        let p = policy();
        assert_eq!(p.floor, 819 * 4096); // 5% of 64 MiB, in whole 4 KiB pages
        assert_eq!(p.dead_band, MIB);
        assert_eq!(Policy::new(1 << 30, 4096).floor, 8 * MIB);
        assert_eq!(Policy::new(4 * MIB, 4096).floor, MIB);
        assert_eq!(p.floor_for(64), MIB);
        assert_eq!(Policy::new(4 * MIB, 4096).floor_for(8), 512 * 1024);
    }

    #[test]
    fn an_idle_member_gives_memory_back_to_a_busy_one() {
        let p = policy();
        let members = vec![busy(32 * MIB, 32 * MIB), idle(32 * MIB, 16 * MIB)];
        let s = divide(&p, &members);
        check(&p, &members, &s);
        // One step each way: 25% of an equal split (32 MiB) is 8 MiB; the busy one's
        // working set plus a quarter allows as much.
        assert_eq!(bytes(&s), [40 * MIB, 24 * MIB]);
        assert_eq!(
            (s[0].reason, s[1].reason),
            (Reason::WorkingSet, Reason::Idle)
        );
        let s = converge(&p, members, 8);
        assert_eq!(s[1].bytes, p.floor, "{s:?}");
        assert_eq!(s[1].reason, Reason::Idle);
        assert!(s[0].bytes >= 60 * MIB, "{s:?}");
    }

    /// A share left within the dead band above the floor (by earlier steps) still goes
    /// down to the floor once its member is idle (seen in CI: 4.1 MiB against a floor of
    /// 3.2 MiB, for good).
    #[test]
    fn an_idle_member_reaches_the_floor_from_within_the_dead_band() {
        let p = policy();
        let near = p.floor + p.dead_band - 64 * 1024;
        let members = vec![busy(56 * MIB, 56 * MIB), idle(near, 16 * MIB)];
        let s = divide(&p, &members);
        check(&p, &members, &s);
        assert_eq!(s[1].bytes, p.floor, "{s:?}");
        assert_eq!(s[1].reason, Reason::Idle);
    }

    #[test]
    fn shares_add_up_to_at_most_the_total() {
        let p = policy();
        let tables: Vec<Vec<Member>> = vec![
            vec![busy(64 * MIB, 64 * MIB), fresh()],
            vec![busy(64 * MIB, 64 * MIB), fresh(), fresh(), fresh()],
            vec![busy(40 * MIB, 40 * MIB), busy(40 * MIB, 40 * MIB)],
            vec![idle(60 * MIB, 60 * MIB), busy(4 * MIB, 4 * MIB), fresh()],
            (0..40).map(|_| busy(MIB, MIB)).collect(),
            (0..100).map(|_| fresh()).collect(),
            vec![
                Member {
                    demand: f64::MAX,
                    active: u64::MAX,
                    resident: u64::MAX,
                    ..busy(u64::MAX / 2, 0)
                },
                busy(10 * MIB, 10 * MIB),
            ],
        ];
        for members in tables {
            let s = divide(&p, &members);
            check(&p, &members, &s);
            converge(&p, members, 6);
        }
    }

    #[test]
    fn the_floor_is_kept() {
        let p = policy();
        // Nobody wants anything: still the floor each (an idle member is never starved).
        let members = vec![idle(p.floor, 0), idle(p.floor, 0), busy(60 * MIB, 60 * MIB)];
        let s = divide(&p, &members);
        check(&p, &members, &s);
        assert_eq!(&bytes(&s)[..2], [p.floor, p.floor]);
        // Too many members for the floor: an equal split each.
        let members: Vec<Member> = (0..32).map(|_| busy(2 * MIB, 2 * MIB)).collect();
        let s = divide(&p, &members);
        check(&p, &members, &s);
        assert!(s.iter().all(|s| s.bytes == 2 * MIB), "{s:?}");
        // A heap smaller than the floor: its size.
        let small = Member {
            region: 256 * 1024,
            ..busy(256 * 1024, 256 * 1024)
        };
        let s = divide(&p, &[small, busy(32 * MIB, 32 * MIB)]);
        assert_eq!(s[0].bytes, 256 * 1024);
    }

    #[test]
    fn a_share_moves_at_most_a_step_per_interval() {
        let p = policy();
        // Wants everything, holds 20 MiB (40 MiB resident: its bound was just lowered): a
        // quarter of an equal split more; the idle one gives a quarter of its share.
        let members = vec![busy(20 * MIB, 40 * MIB), idle(44 * MIB, 44 * MIB)];
        let s = divide(&p, &members);
        check(&p, &members, &s);
        assert_eq!(bytes(&s), [28 * MIB, 33 * MIB]);
        assert_eq!((s[0].reason, s[1].reason), (Reason::Step, Reason::Idle));
        // A large share moves by a quarter of itself.
        let members = vec![idle(60 * MIB, 60 * MIB), busy(4 * MIB, 4 * MIB)];
        let s = divide(&p, &members);
        assert_eq!(s[0].bytes, 45 * MIB);
        // Within the dead band: nothing moves.
        let members = vec![busy(32 * MIB, 32 * MIB), busy(32 * MIB, 32 * MIB)];
        let s = divide(&p, &members);
        assert_eq!(bytes(&s), [32 * MIB, 32 * MIB]);
        assert_eq!(s[0].reason, Reason::Held);
    }

    #[test]
    fn a_share_is_capped_at_the_working_set_and_headroom() {
        let p = policy();
        // A program that holds 8 MiB and is busy gets 8 MiB + 25% headroom (at least the
        // floor) however much is free; the rest stays with the other.
        let small = busy(16 * MIB, 8 * MIB);
        let s = divide(&p, &[small, busy(52 * MIB, 52 * MIB)]);
        assert_eq!(s[0].bytes, 8 * MIB + p.floor, "{s:?}");
        assert_eq!(s[0].reason, Reason::WorkingSet);
        // Capped by its heap's size too.
        let tiny_heap = Member {
            region: 6 * MIB,
            ..busy(6 * MIB, 6 * MIB)
        };
        let s = divide(&p, &[tiny_heap, busy(32 * MIB, 32 * MIB)]);
        assert_eq!(s[0].bytes, 6 * MIB);
        // Everyone capped: shares add up to less than the total.
        let members = vec![busy(12 * MIB, 4 * MIB), busy(12 * MIB, 4 * MIB)];
        let s = divide(&p, &members);
        check(&p, &members, &s);
        assert!(bytes(&s).iter().sum::<u64>() < p.total, "{s:?}");
        assert!(s.iter().all(|s| s.reason == Reason::WorkingSet), "{s:?}");
    }

    #[test]
    fn a_new_member_gets_a_fair_start() {
        let p = policy();
        // The first member: the whole total.
        let s = divide(&p, &[fresh()]);
        assert_eq!(
            s[0],
            Share {
                bytes: 64 * MIB,
                reason: Reason::New
            }
        );
        // A second: half, the first giving up half at once (faster than a step).
        let s = divide(&p, &[busy(64 * MIB, 64 * MIB), fresh()]);
        assert_eq!(bytes(&s), [32 * MIB, 32 * MIB]);
        assert_eq!(s[1].reason, Reason::New);
        // Three more at once: a fifth each, rounded down to whole pages.
        let members = vec![
            busy(32 * MIB, 32 * MIB),
            idle(32 * MIB, 32 * MIB),
            fresh(),
            fresh(),
            fresh(),
        ];
        let s = divide(&p, &members);
        check(&p, &members, &s);
        let fifth = (64 * MIB / 5) / 4096 * 4096;
        assert!(s[2..].iter().all(|s| s.bytes == fifth), "{s:?}");
    }

    #[test]
    fn demand_is_smoothed_and_quiet_intervals_counted() {
        let mut w = Watch::default();
        w.observe(100, 1.0);
        assert_eq!(
            (w.demand, w.idle_for),
            (0.0, 0),
            "the first reading is a base"
        );
        w.observe(1100, 1.0);
        assert_eq!((w.demand, w.idle_for), (500.0, 0));
        w.observe(1100, 1.0);
        w.observe(1100, 1.0);
        assert_eq!((w.demand, w.idle_for), (125.0, 2));
        // A new program image: its counter starts again.
        w.observe(300, 0.5);
        assert_eq!((w.demand, w.idle_for), (362.5, 0));
        // No time passed: no rate.
        w.observe(400, 0.0);
        assert_eq!(w.idle_for, 1);
    }
}
