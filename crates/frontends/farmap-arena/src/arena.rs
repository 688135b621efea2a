//! [`Arena`]: the region at its fixed address, its slots and leases.

use std::ops::Range;
use std::sync::Arc;

use farmap_pipeline::PushOptions;
use farmap_uffd::{DirtyReport, Region, RegionError, RegionOptions, WriteTracking};
use parking_lot::Mutex;

use crate::alloc::{retire, Shared};
use crate::config::ArenaConfig;
use crate::error::ArenaError;
use crate::image::{fixed_image, BuildId};
use crate::maps;
use crate::slots::{LeaseBook, Member, SlotState, SlotTable};
use crate::store::ArenaStore;
use std::sync::atomic::{AtomicU64, Ordering};

/// An arena: one userfaultfd region mapped at the configuration's base in this process,
/// with asynchronous write tracking and no write-back (its memory lives here, and moves
/// between processes by object migration, never through a store), cut into slots.
pub struct Arena {
    store: Arc<ArenaStore>,
    shared: &'static Shared,
    leases: Mutex<LeaseBook>,
    build_id: BuildId,
    fixed_image: bool,
    // Dropped last: the slots' memory.
    region: Region,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("cfg", &self.shared.cfg)
            .field("build_id", &self.build_id.to_string())
            .field("fixed_image", &self.fixed_image)
            .finish_non_exhaustive()
    }
}

impl Arena {
    /// Maps the arena at `cfg.base` in this process, as `member` of its processes (which
    /// decides the leases it starts with). Refused with [`ArenaError::RangeTaken`], naming
    /// the mapping in the way, if anything is mapped in the range.
    pub fn open(cfg: ArenaConfig, member: Member) -> Result<Arena, ArenaError> {
        let page = rustix::param::page_size();
        cfg.check(page)?;
        if member.count == 0 || member.index >= member.count {
            return Err(ArenaError::Config(format!(
                "member {} of {} does not exist",
                member.index, member.count
            )));
        }
        let range = cfg.base..cfg.base + cfg.size;
        let taken = |by| ArenaError::RangeTaken {
            base: cfg.base,
            size: cfg.size,
            by,
        };
        let io = |what, source| ArenaError::Io { what, source };
        if let Some(line) =
            maps::taken_in_self(range.clone()).map_err(|e| io("reading /proc/self/maps", e))?
        {
            return Err(taken(line));
        }
        let store = Arc::new(
            ArenaStore::new(cfg.size as u64, cfg.chunk, cfg.slot_shift)
                .map_err(|e| ArenaError::Config(e.to_string()))?,
        );
        let opts = RegionOptions {
            tracking: WriteTracking::Async,
            push: PushOptions {
                interval: None,
                ..PushOptions::default()
            },
            address: Some(cfg.base),
            share_clean_pages: false,
            ..RegionOptions::direct()
        };
        let region = Region::open(store.clone(), opts).map_err(|e| {
            // Mapped in between (another thread): name it as the check above would.
            match maps::taken_in_self(range.clone()) {
                Ok(Some(line)) => taken(line),
                _ => ArenaError::Region(e),
            }
        })?;
        let shared = Box::leak(Box::new(Shared {
            cfg,
            slots: SlotTable::new(cfg.slots()),
            dealloc_foreign: AtomicU64::new(0),
            purges_refused: AtomicU64::new(0),
        }));
        Ok(Arena {
            shared,
            leases: Mutex::new(LeaseBook::genesis(&cfg, member)),
            build_id: BuildId::of_self()?,
            fixed_image: fixed_image(),
            store,
            region,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ArenaConfig {
        &self.shared.cfg
    }

    /// The region under the arena.
    pub fn region(&self) -> &Region {
        &self.region
    }

    /// The store the region reads on a fault (zeros, or a migration's route).
    pub fn store(&self) -> &Arc<ArenaStore> {
        &self.store
    }

    /// The slots' states.
    pub fn slots(&self) -> &SlotTable {
        &self.shared.slots
    }

    pub(crate) fn shared(&self) -> &'static Shared {
        self.shared
    }

    /// Frees of arena pointers this process could not free (their object lives elsewhere),
    /// and heap purges refused because an object was not `Local`.
    pub fn counters(&self) -> (u64, u64) {
        (
            self.shared.dealloc_foreign.load(Ordering::Relaxed),
            self.shared.purges_refused.load(Ordering::Relaxed),
        )
    }

    /// The gate of `slot`'s object: its reader and writer passes here.
    pub fn gate(&self, slot: u32) -> Option<&crate::gate::Gate> {
        self.shared.slots.entry(slot).map(|e| &e.gate)
    }

    /// Discards every page of `slot` (the region reads it as zeros again). Only for a slot
    /// whose object is not in use here: one that migrated away, or one a migration into
    /// this process abandoned.
    pub fn discard_slot(&self, slot: u32) {
        let r = self.slot_addrs(slot);
        // SAFETY: the slot lies in the arena's mapping, which lives as long as `self`; its
        // object is gone (the caller's), so nothing uses its pages.
        unsafe { libc::madvise(r.start as *mut libc::c_void, r.len(), libc::MADV_DONTNEED) };
    }

    /// The leases this process holds.
    pub fn leases(&self) -> parking_lot::MutexGuard<'_, LeaseBook> {
        self.leases.lock()
    }

    /// This executable's build, and whether this process runs with ASLR off: objects may
    /// move only between processes that agree on the first and both have the second.
    pub fn image(&self) -> (BuildId, bool) {
        (self.build_id, self.fixed_image)
    }

    /// The slot that holds address `addr`, if it is in the arena.
    pub fn slot_of(&self, addr: usize) -> Option<u32> {
        self.shared.slot_of(addr)
    }

    /// The addresses of `slot`.
    pub fn slot_addrs(&self, slot: u32) -> Range<usize> {
        let start = self.shared.slot_base(slot);
        start..start + self.shared.cfg.slot_size()
    }

    /// The region's pages of `slot`.
    pub fn slot_pages(&self, slot: u32) -> Range<u64> {
        let shift = self.shared.cfg.slot_shift - rustix::param::page_size().trailing_zeros();
        u64::from(slot) << shift..(u64::from(slot) + 1) << shift
    }

    /// Takes a free slot of a lease this process holds, now [`SlotState::Local`].
    pub fn take_slot(&self) -> Result<u32, ArenaError> {
        let leases = self.leases.lock();
        for lease in leases.held() {
            for slot in leases.slots_of(lease) {
                if self
                    .shared
                    .slots
                    .transition(slot, SlotState::Free, SlotState::Local)
                {
                    return Ok(slot);
                }
            }
        }
        Err(ArenaError::NoFreeSlot {
            held: leases.held().count(),
        })
    }

    /// The pages of `slot` in memory (region page indices, ascending runs): its object's
    /// page set.
    pub fn page_set(&self, slot: u32) -> Result<Vec<Range<u64>>, RegionError> {
        self.region.pages_in_memory(self.slot_pages(slot))
    }

    /// The pages of `slot` written since its last scan, write-protected again (the region's
    /// other slots keep theirs).
    pub fn take_written(&self, slot: u32) -> Result<DirtyReport, RegionError> {
        self.take_written_in(self.slot_pages(slot))
    }

    /// The pages of `pages` (region page indices) written since their last scan,
    /// write-protected again; the scan costs the chunks that cover `pages`.
    pub fn take_written_in(&self, pages: Range<u64>) -> Result<DirtyReport, RegionError> {
        let per_chunk = u64::from(self.shared.cfg.chunk) / rustix::param::page_size() as u64;
        let chunks = pages.start / per_chunk..pages.end.div_ceil(per_chunk);
        self.region.take_dirty_within(std::slice::from_ref(&chunks))
    }

    /// The pages of `slot` its object can have used (region page indices): from the slot's
    /// start to the highest page its heap ever handed out. Every page of the object lies
    /// here, so scans of this range see all of them and cost no more than the object.
    /// `None` if the slot holds no object here.
    pub fn object_extent(&self, slot: u32) -> Option<Range<u64>> {
        let state = self.shared.slots.state(slot)?;
        if !matches!(
            state,
            SlotState::Local | SlotState::Outbound | SlotState::Installed
        ) {
            return None;
        }
        // SAFETY: a slot in these states holds an object whose header this process can read.
        let header = unsafe { self.shared.header(slot) };
        if header.magic != crate::alloc::MAGIC {
            return None;
        }
        let (heap_base, _) = header.heap.region();
        let end = heap_base.addr() + (header.heap.stats().high_water_pages << 16);
        let page = rustix::param::page_size();
        let pages = self.slot_pages(slot);
        Some(pages.start..pages.start + ((end - self.slot_addrs(slot).start) / page) as u64)
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        retire(self.shared);
    }
}
