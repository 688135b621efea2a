//! A size-class allocator over one contiguous region of memory that its caller provides,
//! for `farmap run`'s malloc replacement (the `LD_PRELOAD` library that serves a program's
//! heap from a userfaultfd region; see `docs/design/farmap-run.md`, §3.3 and §3.8).
//!
//! It is `no_std` and allocates nothing: no `alloc` crate, no thread-local storage, no
//! global state. Everything it needs from its host goes through a [`Backing`]: one mapping
//! for its metadata, purging freed memory, sleeping on a lock, and a hint for choosing an
//! arena. A malloc replacement implements it with raw system calls; the tests do with
//! `libc` over an `mmap`ed region.
//!
//! # Layout
//! - The region is cut into 64 KiB pages ([`PAGE_SIZE`]); a partial page at either end is
//!   not used. Every allocation is a *span* of whole pages (a large object) or an object in
//!   a *slab* (a span of 1 to 8 pages cut into objects of one size class).
//! - No metadata lives in the region, and no object has a header. The metadata mapping
//!   holds, in order: the arenas, the span allocator, the page table (16 B per page: free
//!   span, large object, or slab with its class and owning arena), and one slab state per
//!   page (544 B: list links, counters, a bump cursor and a free bitmap of 4096 bits). It is
//!   touched only where used: the page table is 0.025% of the region, slab states 0.8% of
//!   the slabs ever made. So no lock is ever held across a page fault in the region (which,
//!   under userfaultfd, can take a round trip to a store), and `free` and `usable_size` find
//!   an object's class in the page table without reading the object's memory.
//!
//! # Size classes
//! 40 classes from 16 B to 32 KiB ([`MAX_SMALL`]): multiples of 16 up to 128 B, then four per
//! doubling (160, 192, 224, 256, 320, ...). [`Heap::usable_size`] is exactly the class size
//! (or the span's length), and a program may write all of it. Larger objects are spans of
//! whole pages, so a 33 KiB object uses 64 KiB. Alignments up to 32 KiB are served by the
//! smallest class that is a multiple of the alignment; larger ones by aligned spans.
//!
//! # Spans, purging and zeros
//! Free spans sit in bins by length, coalesced with their free neighbours through the page
//! table in O(1). A freed span that comes to [`PURGE_BYTES`] (1 MiB) or more, after merging
//! with free neighbours, is handed to [`Backing::purge`] (`madvise(MADV_DONTNEED)`: the
//! pages go back to the kernel, or for a userfaultfd region to farmap, as zeros, with no
//! write-back). The heap tracks which free spans read as zeros (never used, or purged):
//! `calloc` skips its memset on them, and on the never-used objects of slabs made from
//! them. Allocation prefers dirty (already resident) spans to zero ones. Dirty and zero
//! spans that touch are not merged (that would lose what is known to be zeros); when an
//! allocation finds no room, every dirty free span is purged, so that all free memory
//! merges, and it looks again; if there is still none, the arenas give back the empty slabs
//! they keep for reuse ([`Heap::trim`]) and it tries once more before returning null. A
//! shrinking `realloc` never fails (at worst the object stays where it is).
//!
//! # Locking
//! - Small objects come from *arenas* (1 to [`MAX_ARENAS`], the caller's choice), each with
//!   its own lock and its own slabs. A call starts at the arena that
//!   [`Backing::thread_hint`] picks (a malloc replacement hashes the thread pointer; no
//!   TLS) and, if that arena's lock is taken, tries the next ones (`try_lock`) before
//!   waiting for the first.
//! - `free` finds the owning arena in the page table and locks it, whichever thread frees.
//! - Spans (large objects, and slabs for arenas) come from one span allocator with one
//!   lock. Lock order: an arena, then the span lock; never two arenas.
//! - Locks are three-state futex mutexes; sleeping and waking go through [`Backing::wait`]
//!   and [`Backing::wake_one`] (the default spins). So the crate needs no `libc`: the
//!   preload library makes raw `futex` system calls (its own `libc` calls may be
//!   interposed), and this crate builds for any target.
//! - Under a lock the heap touches only metadata, never region memory: `calloc`'s memset
//!   and `realloc`'s copy run after the locks are released. The exception is
//!   [`Backing::purge`], called with the span lock held, which must not fault.
//! - [`Heap::lock_all`] and [`Heap::unlock_all`] serve `pthread_atfork`.
//!
//! # Limits
//! - Regions of up to `2^32 - 1` pages (256 TiB); up to 64 arenas.
//! - Dirty free spans shorter than 1 MiB are kept as they are (no decay): a freed 64 KiB
//!   slab stays resident until it is reused or merged into a span of 1 MiB.
//! - A slab that empties goes back to the spans unless it is the only one of its class in
//!   its arena; [`Heap::trim`] returns those too.
//! - Large objects are whole pages: up to 64 KiB - 1 of slack per large object.
//! - Arenas do not move objects or slabs between them; a thread that frees what others
//!   allocated only returns it to their arenas.
//! - Double frees and foreign pointers are ignored when they are noticed (a pointer that
//!   is not an object start, a free slot, a page that is no large object); they are not
//!   always noticed.
//!
//! # Safety
//! [`Heap::new`] is `unsafe`: the region must be memory that reads as zeros and that only the
//! heap (and the holders of its pointers) use, for as long as the heap lives. [`Heap::free`]
//! and [`Heap::realloc`] are `unsafe`: their pointer must be one this heap handed out and has
//! not seen freed (or null). [`Heap::unlock_all`] must follow this thread's
//! [`Heap::lock_all`]. [`Backing`] is an `unsafe` trait: the heap trusts its metadata
//! mapping and its purges. Everything else is safe: `malloc`, `calloc`, `memalign`,
//! `usable_size`, `owns`, `stats`, `trim`.
#![no_std]
#![warn(missing_docs)]

#[cfg(test)]
extern crate std;

mod arena;
mod backing;
#[forbid(unsafe_code)]
mod class;
mod heap;
#[forbid(unsafe_code)]
mod lock;
#[forbid(unsafe_code)]
mod pagemap;
#[forbid(unsafe_code)]
mod slab;
mod span;
#[forbid(unsafe_code)]
mod stats;

pub use backing::Backing;
pub use class::{class_size, MAX_SMALL, MIN_ALIGN, NCLASSES, PAGE_SIZE};
pub use heap::{Heap, MAX_ARENAS};
pub use stats::{AllocError, HeapError, Stats};

/// Freed spans of at least this many bytes (1 MiB) are purged.
pub const PURGE_BYTES: usize = span::PURGE_PAGES as usize * PAGE_SIZE;
