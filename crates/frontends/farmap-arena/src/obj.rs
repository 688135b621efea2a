//! [`Obj<T>`]: a value built in its own slot of the arena, with everything it allocates
//! (through [`ArenaAlloc`](crate::ArenaAlloc)) in that slot, so its page set is the slot's
//! pages in memory.

use std::marker::PhantomData;
use std::ops::{Deref, DerefMut, Range};
use std::sync::Arc;

use farmap_heap::Heap;
use farmap_uffd::RegionError;
use parking_lot::{RwLockReadGuard, RwLockWriteGuard};

use crate::alloc::{
    make_current, pop_context, push_context, ObjHeader, Shared, SlotBacking, HEADER_BYTES,
    HEAP_ARENAS, MAGIC,
};
use crate::arena::Arena;
use crate::error::ArenaError;
use crate::portable::{type_tag, Portable};
use crate::slots::{SlotEntry, SlotState};

/// Why an object could not be made or used.
#[derive(Debug, thiserror::Error)]
pub enum ObjError {
    /// The arena had no slot, or failed.
    #[error(transparent)]
    Arena(#[from] ArenaError),
    /// Another arena serves this process's objects (one arena per process has objects).
    #[error("another arena already serves this process's objects")]
    OtherArena,
    /// The slot's heap could not be made.
    #[error("the object's heap: {0:?}")]
    Heap(farmap_heap::HeapError),
    /// The object's heap had no room for its root value.
    #[error("the object's root of {0} bytes does not fit its slot")]
    TooLarge(usize),
    /// The slot holds no object of this type from this build.
    #[error("slot {slot} holds no object of this type and build ({why})")]
    NotThisObject {
        /// The slot.
        slot: u32,
        /// What did not match.
        why: &'static str,
    },
    /// The object's context stack is full on this thread.
    #[error(
        "more than {} objects nested on one thread",
        crate::alloc::MAX_CONTEXT_DEPTH
    )]
    TooDeep,
}

/// The object's access is closed here: it migrated (or is migrating) away.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the object moved away (gate flags {flags:#x})")]
pub struct Moved {
    /// The gate's flags when the pass was refused.
    pub flags: u64,
}

/// A value of type `T` in its own slot of an arena. This handle is process-local; the value
/// and everything it allocated are the slot's pages, which can move to another process of
/// the arena as they are (no serialization). Dropping the handle drops the value and gives
/// the slot back.
///
/// Pointers into the object are valid only while a guard ([`read`](Self::read),
/// [`write`](Self::write)) is held: once the object migrated away, its pages in this process
/// are gone.
pub struct Obj<T: Portable> {
    arena: Arc<Arena>,
    slot: u32,
    _t: PhantomData<fn() -> T>,
}

impl<T: Portable> std::fmt::Debug for Obj<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Obj")
            .field("slot", &self.slot)
            .field("type", &std::any::type_name::<T>())
            .finish()
    }
}

impl<T: Portable> Obj<T> {
    /// Takes a free slot, makes the object's heap in it and builds the value with `init`,
    /// with the object as this thread's allocation context, so whatever `init` allocates
    /// through [`ArenaAlloc`](crate::ArenaAlloc) lies in the slot.
    pub fn new_in(arena: &Arc<Arena>, init: impl FnOnce() -> T) -> Result<Obj<T>, ObjError> {
        let shared = arena.shared();
        if !make_current(shared) {
            return Err(ObjError::OtherArena);
        }
        let slot = arena.take_slot()?;
        // From here a failure gives the slot back (Drop of a half-made object would read a
        // header that is not there).
        let made = Self::make(arena, shared, slot, init);
        if made.is_err() {
            arena.discard_slot(slot);
            shared
                .slots
                .transition(slot, SlotState::Local, SlotState::Free);
        }
        made
    }

    fn make(
        arena: &Arc<Arena>,
        shared: &'static Shared,
        slot: u32,
        init: impl FnOnce() -> T,
    ) -> Result<Obj<T>, ObjError> {
        let base = shared.slot_base(slot);
        let meta = base + HEADER_BYTES;
        let meta_cap = shared.meta_reserve();
        let heap_start = meta + meta_cap;
        let heap_len = shared.cfg.slot_size() - HEADER_BYTES - meta_cap;
        let backing = SlotBacking {
            slot,
            meta,
            meta_cap,
        };
        // SAFETY: the heap's range is the rest of a slot this process just took (it reads as
        // zeros: a fresh slot reads zeros from the arena's store), used by nothing else; it
        // stays mapped as long as the arena, which every `Obj` keeps alive.
        let heap = unsafe { Heap::new(heap_start as *mut u8, heap_len, backing, HEAP_ARENAS) }
            .map_err(ObjError::Heap)?;
        let header = base as *mut ObjHeader;
        // SAFETY: the slot's first 64 KiB are the header's, and nothing else uses them.
        unsafe {
            header.write(ObjHeader {
                magic: MAGIC,
                tag: type_tag::<T>(),
                build_id: arena.image().0 .0,
                root: 0,
                heap,
            });
        }
        let depth = push_context(slot).ok_or(ObjError::TooDeep)?;
        let value = init();
        // SAFETY: written just above.
        let heap = unsafe { &(*header).heap };
        let size = std::mem::size_of::<T>().max(1);
        let root = heap.memalign(std::mem::align_of::<T>().max(16), size);
        pop_context(depth);
        if root.is_null() {
            drop(value);
            return Err(ObjError::TooLarge(size));
        }
        // SAFETY: `root` is a fresh block of the object's heap, big and aligned enough for T.
        unsafe {
            root.cast::<T>().write(value);
            (*header).root = root.addr();
        }
        Ok(Obj {
            arena: arena.clone(),
            slot,
            _t: PhantomData,
        })
    }

    /// The object in `slot` (one that arrived from another process of the arena), checked
    /// to be a `T` made by this same build. The slot must be this process's (`Local`).
    pub fn attach(arena: &Arc<Arena>, slot: u32) -> Result<Obj<T>, ObjError> {
        let shared = arena.shared();
        if !make_current(shared) {
            return Err(ObjError::OtherArena);
        }
        let not = |why| ObjError::NotThisObject { slot, why };
        if shared.slots.state(slot) != Some(SlotState::Local) {
            return Err(not("the slot is not this process's"));
        }
        // SAFETY: a Local slot is mapped and readable (zeros if nothing was ever there).
        let h = unsafe { shared.header(slot) };
        if h.magic != MAGIC {
            return Err(not("no object header"));
        }
        if h.tag != type_tag::<T>() {
            return Err(not("another type"));
        }
        if h.build_id != arena.image().0 .0 {
            return Err(not("another build of the executable"));
        }
        Ok(Obj {
            arena: arena.clone(),
            slot,
            _t: PhantomData,
        })
    }

    /// Lets go of the handle without dropping the value: the slot keeps it (for
    /// [`attach`](Self::attach), or a migration). Returns the slot.
    pub fn into_slot(self) -> u32 {
        let slot = self.slot;
        std::mem::forget(self);
        slot
    }

    fn entry(&self) -> &SlotEntry {
        self.arena
            .shared()
            .slots
            .entry(self.slot)
            .expect("the object's slot exists")
    }

    fn root(&self) -> *mut T {
        // SAFETY: the slot holds this object (made or attached above).
        unsafe { self.arena.shared().header(self.slot).root as *mut T }
    }

    /// Shared access, with a reader's pass (refused once reads moved away).
    pub fn read(&self) -> Result<ObjRef<'_, T>, Moved> {
        let e = self.entry();
        e.gate.begin_read().map_err(|c| Moved { flags: c.0 })?;
        let lock = e.lock.read();
        Ok(ObjRef {
            obj: self,
            _lock: lock,
        })
    }

    /// Exclusive access, with a writer's pass (refused once writes are closed) and the
    /// object as this thread's allocation context while the guard lives.
    pub fn write(&self) -> Result<ObjMut<'_, T>, Moved> {
        let e = self.entry();
        e.gate.begin_write().map_err(|c| Moved { flags: c.0 })?;
        let lock = e.lock.write();
        let Some(depth) = push_context(self.slot) else {
            e.gate.end_write();
            panic!(
                "more than {} objects nested on one thread",
                crate::alloc::MAX_CONTEXT_DEPTH
            );
        };
        Ok(ObjMut {
            obj: self,
            depth,
            _lock: lock,
        })
    }

    /// The arena the object lives in.
    pub fn arena(&self) -> &Arc<Arena> {
        &self.arena
    }

    /// The object's slot.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// The object's pages in memory (region page indices, ascending runs): what migrating
    /// it moves.
    pub fn page_set(&self) -> Result<Vec<Range<u64>>, RegionError> {
        self.arena.page_set(self.slot)
    }

    /// The object's heap's figures.
    pub fn heap_stats(&self) -> farmap_heap::Stats {
        // SAFETY: the slot holds this object.
        unsafe { self.arena.shared().header(self.slot).heap.stats() }
    }
}

impl<T: Portable> Drop for Obj<T> {
    /// Drops the value (its frees go to its heap by address), discards the slot's pages
    /// and frees the slot.
    fn drop(&mut self) {
        let shared = self.arena.shared();
        if shared.slots.state(self.slot) == Some(SlotState::Local) {
            let e = self.entry();
            let _lock = e.lock.write();
            if let Some(depth) = push_context(self.slot) {
                // SAFETY: the value was written at `root` and is dropped once, here, with
                // no guard out (the write lock is held).
                unsafe { std::ptr::drop_in_place(self.root()) };
                pop_context(depth);
            }
        }
        self.arena.discard_slot(self.slot);
        shared
            .slots
            .transition(self.slot, SlotState::Local, SlotState::Free);
    }
}

impl<T: Portable> std::fmt::Debug for ObjRef<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjRef")
            .field("slot", &self.obj.slot)
            .finish_non_exhaustive()
    }
}

impl<T: Portable> std::fmt::Debug for ObjMut<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjMut")
            .field("slot", &self.obj.slot)
            .finish_non_exhaustive()
    }
}

/// Shared access to an object's value.
pub struct ObjRef<'a, T: Portable> {
    obj: &'a Obj<T>,
    _lock: RwLockReadGuard<'a, ()>,
}

impl<T: Portable> Deref for ObjRef<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the read lock keeps writers out; the reader's pass keeps the pages here.
        unsafe { &*self.obj.root() }
    }
}

impl<T: Portable> Drop for ObjRef<'_, T> {
    fn drop(&mut self) {
        self.obj.entry().gate.end_read();
    }
}

/// Exclusive access to an object's value; the object is this thread's allocation context
/// while it lives.
pub struct ObjMut<'a, T: Portable> {
    obj: &'a Obj<T>,
    depth: usize,
    _lock: RwLockWriteGuard<'a, ()>,
}

impl<T: Portable> Deref for ObjMut<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the write lock makes this the only access.
        unsafe { &*self.obj.root() }
    }
}

impl<T: Portable> DerefMut for ObjMut<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: the write lock makes this the only access.
        unsafe { &mut *self.obj.root() }
    }
}

impl<T: Portable> Drop for ObjMut<'_, T> {
    fn drop(&mut self) {
        pop_context(self.depth);
        self.obj.entry().gate.end_write();
    }
}
