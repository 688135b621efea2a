//! Slots and leases. A slot is an aligned range of the arena that exactly one object owns,
//! for as long as the object lives anywhere; a lease is a run of slots that one process
//! hands out. Processes share the arena out by leases, never by slots, so two processes
//! never hand out the same slot (no consensus service: a lease has one holder at a time).

use std::collections::BTreeSet;
use std::ops::Range;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::config::ArenaConfig;
use crate::gate::Gate;

/// Where a slot's object is, from this process's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum SlotState {
    /// No object: may be handed out by the lease's holder.
    Free = 0,
    /// Its object lives here, and this process owns it.
    Local = 1,
    /// Its object is migrating here: pages arrive, nobody here uses it yet.
    Inbound = 2,
    /// Its object migrated here and may be read; writes wait for the source's release.
    Installed = 3,
    /// Its object is migrating away from here: still owned here.
    Outbound = 4,
    /// Its object lives in another process; the slot stays reserved for it.
    Away = 5,
    /// Given up on (its object was freed elsewhere): never handed out again.
    Leaked = 6,
}

impl SlotState {
    fn from_u32(v: u32) -> SlotState {
        match v {
            0 => SlotState::Free,
            1 => SlotState::Local,
            2 => SlotState::Inbound,
            3 => SlotState::Installed,
            4 => SlotState::Outbound,
            5 => SlotState::Away,
            _ => SlotState::Leaked,
        }
    }
}

/// What this process keeps of one slot, outside the slot's memory.
#[derive(Debug, Default)]
pub(crate) struct SlotEntry {
    state: AtomicU32,
    /// Reader and writer passes of the slot's object.
    pub(crate) gate: Gate,
    /// Held by a `write()` guard: one writer at a time with `&mut`.
    pub(crate) lock: parking_lot::RwLock<()>,
}

/// The state of every slot (changed by compare-and-swap only), with each slot's gate.
#[derive(Debug)]
pub struct SlotTable {
    entries: Box<[SlotEntry]>,
}

impl SlotTable {
    /// `slots` slots, all free.
    pub fn new(slots: u32) -> SlotTable {
        SlotTable {
            entries: (0..slots).map(|_| SlotEntry::default()).collect(),
        }
    }

    /// Slots in the table.
    pub fn len(&self) -> u32 {
        self.entries.len() as u32
    }

    /// Whether the table has no slot.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub(crate) fn entry(&self, slot: u32) -> Option<&SlotEntry> {
        self.entries.get(slot as usize)
    }

    /// The state of `slot` (`None`: no such slot).
    pub fn state(&self, slot: u32) -> Option<SlotState> {
        let e = self.entries.get(slot as usize)?;
        Some(SlotState::from_u32(e.state.load(Ordering::Acquire)))
    }

    /// Moves `slot` from `from` to `to`; false if it was not in `from` (or does not exist).
    pub fn transition(&self, slot: u32, from: SlotState, to: SlotState) -> bool {
        self.entries.get(slot as usize).is_some_and(|e| {
            e.state
                .compare_exchange(from as u32, to as u32, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        })
    }

    /// Counts of slots per state, in the order of [`SlotState`]'s values.
    pub fn counts(&self) -> [u32; 7] {
        let mut c = [0u32; 7];
        for e in self.entries.iter() {
            c[SlotState::from_u32(e.state.load(Ordering::Relaxed)) as usize] += 1;
        }
        c
    }
}

/// Which member of the arena's processes this one is at first start, `index` of `count`:
/// it starts with the leases `l` where `l % count == index`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    /// From 0.
    pub index: u32,
    /// At least 1.
    pub count: u32,
}

impl Member {
    /// The only process of its arena: every lease is its own.
    pub const SOLE: Member = Member { index: 0, count: 1 };
}

/// The leases this process holds (ids from 0 to the arena's lease count).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseBook {
    lease_slots: u32,
    slots: u32,
    held: BTreeSet<u32>,
}

impl LeaseBook {
    /// The leases a member holds at the arena's first start.
    pub fn genesis(cfg: &ArenaConfig, member: Member) -> LeaseBook {
        let count = member.count.max(1);
        let held = (0..cfg.leases())
            .filter(|l| l % count == member.index)
            .collect();
        LeaseBook {
            lease_slots: cfg.lease_slots,
            slots: cfg.slots(),
            held,
        }
    }

    /// No lease at all: a process that rejoins an arena whose leases are all out.
    pub fn empty(cfg: &ArenaConfig) -> LeaseBook {
        LeaseBook {
            lease_slots: cfg.lease_slots,
            slots: cfg.slots(),
            held: BTreeSet::new(),
        }
    }

    /// The leases held, ascending.
    pub fn held(&self) -> impl Iterator<Item = u32> + '_ {
        self.held.iter().copied()
    }

    /// The slots of `lease` (the last lease may be short).
    pub fn slots_of(&self, lease: u32) -> Range<u32> {
        let start = lease.saturating_mul(self.lease_slots).min(self.slots);
        start..start.saturating_add(self.lease_slots).min(self.slots)
    }

    /// The lease `slot` belongs to.
    pub fn lease_of(&self, slot: u32) -> u32 {
        slot / self.lease_slots
    }

    /// Whether this process holds the lease of `slot`.
    pub fn holds_slot(&self, slot: u32) -> bool {
        slot < self.slots && self.held.contains(&self.lease_of(slot))
    }

    /// Takes `leases` (granted by another process) into the book; ids out of the arena or
    /// held already are refused, and nothing changes then.
    pub fn receive(&mut self, leases: &[u32]) -> Result<(), String> {
        let total = self.slots.div_ceil(self.lease_slots);
        if let Some(l) = leases
            .iter()
            .find(|l| **l >= total || self.held.contains(l))
        {
            return Err(format!(
                "lease {l} is not in the arena or is held here already"
            ));
        }
        self.held.extend(leases.iter().copied());
        Ok(())
    }

    /// Gives up to `want` leases away, only leases whose every slot `is_free` says is free,
    /// highest ids first; they are out of the book before the caller sends them.
    pub fn give(&mut self, want: usize, is_free: impl Fn(u32) -> bool) -> Vec<u32> {
        let free: Vec<u32> = self
            .held
            .iter()
            .rev()
            .copied()
            .filter(|l| self.slots_of(*l).all(&is_free))
            .take(want)
            .collect();
        for l in &free {
            self.held.remove(l);
        }
        free
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ArenaConfig {
        // 10 slots of 64 MiB, 4 per lease: leases 0..3, the last one 2 slots long.
        ArenaConfig {
            size: 10 << 26,
            slot_shift: 26,
            lease_slots: 4,
            ..ArenaConfig::default()
        }
    }

    #[test]
    fn members_split_the_leases_and_never_share_one() {
        let c = cfg();
        let a = LeaseBook::genesis(&c, Member { index: 0, count: 2 });
        let b = LeaseBook::genesis(&c, Member { index: 1, count: 2 });
        assert_eq!(a.held().collect::<Vec<_>>(), vec![0, 2]);
        assert_eq!(b.held().collect::<Vec<_>>(), vec![1]);
        assert_eq!(a.slots_of(2), 8..10);
        assert!(a.holds_slot(9) && !a.holds_slot(4) && !a.holds_slot(10));
        let sole = LeaseBook::genesis(&c, Member::SOLE);
        assert_eq!(sole.held().count(), 3);
    }

    #[test]
    fn only_wholly_free_leases_are_given_and_received_once() {
        let c = cfg();
        let mut a = LeaseBook::genesis(&c, Member::SOLE);
        // Slot 9 (lease 2) is used: lease 2 stays, 1 and 0 go.
        let given = a.give(5, |s| s != 9);
        assert_eq!(given, vec![1, 0]);
        assert_eq!(a.held().collect::<Vec<_>>(), vec![2]);
        let mut b = LeaseBook::empty(&c);
        b.receive(&given).unwrap();
        assert!(b.receive(&[1]).is_err(), "held already");
        assert!(b.receive(&[3]).is_err(), "out of the arena");
        assert_eq!(b.held().collect::<Vec<_>>(), vec![0, 1]);
    }

    #[test]
    fn slot_states_change_by_compare_and_swap() {
        let t = SlotTable::new(3);
        assert_eq!(t.state(1), Some(SlotState::Free));
        assert!(t.transition(1, SlotState::Free, SlotState::Local));
        assert!(!t.transition(1, SlotState::Free, SlotState::Local));
        assert!(!t.transition(7, SlotState::Free, SlotState::Local));
        assert_eq!(t.state(1), Some(SlotState::Local));
        assert_eq!(t.state(3), None);
        assert_eq!(t.counts()[..2], [2, 1]);
    }
}
