//! The pager's per-chunk state: [`St`] for each chunk, in one [`State`] for the region,
//! under the pager's lock (see the module documentation for the states and their moves).

use std::collections::VecDeque;
/// The state of one chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum St {
    /// Never written: the store holds nothing for it (a fresh region), so its first touch
    /// maps zero pages, with no store read.
    Zero,
    Remote,
    /// Being fetched; `new` when the fetch took a new unit of the limit (from remote or
    /// zero), `zero` when it is filled with zeros rather than read.
    Fetching {
        new: bool,
        zero: bool,
    },
    Active,
    /// Active, its pages being moved to its staging slot by a deactivation (outside the
    /// state lock); then staged, or active again if the move could be undone.
    Moving,
    Staged,
    /// A fault's copy of its staging slot is being installed in the region (outside the
    /// state lock, [`Admit::FromSlot`](super::Admit::FromSlot)); then active, its slot
    /// stale. `staged`: it was staged (else active with pages in its slot: a bug recovered).
    Unstaging {
        staged: bool,
    },
}

/// What a deactivation's move came to for one chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Moved {
    /// Its pages are in its staging slot; `whole`: every page of it was present and moved
    /// (see [`State::whole_slot`]).
    Staged { whole: bool },
    /// Back in the region (the move stopped part way and was undone).
    Active,
}

/// The state of every chunk of the region, under the pager's lock.
pub(super) struct State {
    pub(super) chunk: Vec<St>,
    /// The staging slot holds pages (staged, or being dropped).
    pub(super) slot_busy: Vec<bool>,
    /// The chunk's last deactivation found every page of it in the region and moved them
    /// all: while it is staged, its slot holds all its pages and the region none (a push
    /// reads the slot with no scan of the page tables). Set at each staging.
    pub(super) whole_slot: Vec<bool>,
    /// The epoch when the chunk was last staged.
    pub(super) staged_epoch: Vec<u64>,
    /// The epoch at the start of the chunk's last successful write-back: a staged chunk whose
    /// `staged_epoch` is older is in the store, and its slot can be dropped.
    pub(super) written_back: Vec<u64>,
    pub(super) referenced: Vec<bool>,
    /// Fetched ahead of faults and not yet found used.
    pub(super) prefetched: Vec<bool>,
    /// Pushes reading the chunk out of the region now: it is not deactivated meanwhile.
    pub(super) pins: Vec<u32>,
    pub(super) active: VecDeque<u64>,
    /// Drop-behind: chunks that a sequential stream has left behind, oldest first, taken as
    /// victims before the clock's (entries whose chunk is no longer active are skipped).
    pub(super) behind: VecDeque<u64>,
    /// Staged chunks, oldest first, with the id of their staging: an entry is current only
    /// while its chunk is staged with that id (leaving the staged state removes nothing
    /// here, so that a move back, in a signal handler too, is O(1)).
    pub(super) staged: VecDeque<(u64, u64)>,
    /// The id of each chunk's last staging.
    pub(super) stage_id: Vec<u64>,
    /// The last staging id given.
    pub(super) stage_seq: u64,
    /// Stale slots, oldest first: chunks copied back into the region whose staging slot
    /// still holds the old copy (busy, so that nothing moves into it), to be dropped without
    /// a write-back. Each counts as resident until then.
    pub(super) stale: VecDeque<u64>,
    /// Removed (a remove event covered it, [`RemoveMeans::Zero`](crate::RemoveMeans) only;
    /// empty otherwise): the remover may not have zapped the range yet, and its old pages
    /// may still be mapped, so nothing is installed into it, prefetch leaves it alone, and
    /// an operation in flight on it ends in the zero state. Cleared when a fault finds its
    /// page missing; never set on an active or staged chunk.
    removed: Vec<bool>,
    /// Chunks in the staged state.
    pub(super) n_staged: u64,
    /// Chunks counted against the limit.
    pub(super) resident: u64,
    /// Bumped when a write-back starts.
    pub(super) epoch: u64,
}

impl State {
    /// Every one of `n` chunks zero (`fresh`) or remote; `removes`: chunks can be removed
    /// (their bits are kept).
    pub(super) fn new(n: usize, fresh: bool, removes: bool) -> Self {
        State {
            chunk: vec![if fresh { St::Zero } else { St::Remote }; n],
            slot_busy: vec![false; n],
            whole_slot: vec![false; n],
            staged_epoch: vec![0; n],
            written_back: vec![0; n],
            referenced: vec![false; n],
            prefetched: vec![false; n],
            pins: vec![0; n],
            // Reserved so that a move back in a signal handler never allocates (one
            // entry per chunk, plus stale duplicates of refetched chunks).
            active: VecDeque::with_capacity(n + n / 8 + 64),
            behind: VecDeque::new(),
            staged: VecDeque::new(),
            stage_id: vec![0; n],
            stage_seq: 0,
            stale: VecDeque::new(),
            removed: if removes { vec![false; n] } else { Vec::new() },
            n_staged: 0,
            resident: 0,
            epoch: 0,
        }
    }

    /// Whether chunk `i` is removed (see the field).
    pub(super) fn is_removed(&self, i: u64) -> bool {
        self.removed.get(i as usize).copied().unwrap_or(false)
    }

    /// Sets or clears chunk `i`'s removed bit (only kept when chunks can be removed).
    pub(super) fn set_removed(&mut self, i: u64, removed: bool) {
        if let Some(r) = self.removed.get_mut(i as usize) {
            *r = removed;
        }
    }
}

/// Where a chunk's content was when the fence was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// Mapped in the region (a forked child shares its pages), or never written (zeros).
    Region,
    /// In its staging slot.
    Slot,
    /// In the store.
    Store,
}

/// Where every chunk's content was when the fence was taken (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct ForkSnapshot {
    pub(crate) sources: Vec<Source>,
}

impl ForkSnapshot {
    /// Chunks whose content is not in the region, with where it is.
    pub(crate) fn elsewhere(&self) -> impl Iterator<Item = (u64, Source)> + '_ {
        self.sources
            .iter()
            .enumerate()
            .filter(|(_, s)| **s != Source::Region)
            .map(|(i, s)| (i as u64, *s))
    }
}
