//! The heaps and which one serves a call.
//!
//! - **boot**: farmap-heap over 1 GiB of plain `MAP_NORESERVE` memory, made by the first
//!   allocation (whoever makes it: ld.so, a library's constructor, a thread) and serving
//!   every allocation until [`init`] has read the environment. Never moved, never closed.
//! - **main**: set once by [`init`]: farmap-heap over the session's region (region mode),
//!   or over 64 GiB of plain `MAP_NORESERVE` memory (plain mode, no `FARMAP_RUN_SOCK`).
//! - **child**: in a process forked from a region-mode program whose region has no fork
//!   events (the region and staging area are `MADV_DONTFORK`, so not in the child), new
//!   allocations come from a plain heap made by the atfork child handler; the parent's
//!   objects are gone in the child (touching them faults: SIGSEGV), but freeing them is
//!   harmless (only metadata is touched). With fork events the child keeps the main heap:
//!   `farmap run` makes its copy of the region whole before the child runs on
//!   (`session::fork_child`), and the region is then plain memory of the child's.
//!
//! `free`, `realloc` and `malloc_usable_size` find the owner by address; a pointer no heap
//! owns (ld.so's own early memory) is ignored by `free`.

use core::cell::UnsafeCell;
use core::ffi::c_char;
use core::mem::MaybeUninit;
use core::ptr;
use core::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};

use farmap_heap::Heap;

use crate::backing::RawBacking;
use crate::{env, session, sys};

/// A heap of this library.
pub(crate) type H = Heap<RawBacking>;

/// The boot heap's region.
const BOOT_LEN: usize = 1 << 30;
/// The plain heaps' regions (virtual: they cost what is touched).
const PLAIN_LEN: usize = 64 << 30;

const EMPTY: u8 = 0;
const MAKING: u8 = 1;
const READY: u8 = 2;
const FAILED: u8 = 3;

/// A heap set once, and the allocations it served.
pub(crate) struct Slot {
    state: AtomicU8,
    heap: UnsafeCell<MaybeUninit<H>>,
    served: AtomicU64,
}

// SAFETY: the heap is written once, by the thread that moved `state` from EMPTY to MAKING,
// before it publishes READY (release); readers see it only after reading READY (acquire),
// and `H` is `Sync`.
unsafe impl Sync for Slot {}

impl Slot {
    const fn new() -> Self {
        Self {
            state: AtomicU8::new(EMPTY),
            heap: UnsafeCell::new(MaybeUninit::uninit()),
            served: AtomicU64::new(0),
        }
    }

    /// The heap, once set.
    pub(crate) fn get(&self) -> Option<&H> {
        if self.state.load(Ordering::Acquire) == READY {
            // SAFETY: READY is published after the heap was written, never before, and the
            // heap is never written again.
            Some(unsafe { (*self.heap.get()).assume_init_ref() })
        } else {
            None
        }
    }

    /// Makes the heap with `make` unless someone did (or is doing it: waits); the heap, or
    /// `None` if making it failed.
    fn get_or_make(&self, make: impl FnOnce() -> Option<H>) -> Option<&H> {
        loop {
            match self
                .state
                .compare_exchange(EMPTY, MAKING, Ordering::Acquire, Ordering::Acquire)
            {
                Ok(_) => {
                    let Some(heap) = make() else {
                        self.state.store(FAILED, Ordering::Release);
                        return None;
                    };
                    // SAFETY: this thread won EMPTY -> MAKING, so it alone writes, and no
                    // reader looks before READY.
                    unsafe { (*self.heap.get()).write(heap) };
                    self.state.store(READY, Ordering::Release);
                }
                Err(READY) => {}
                Err(FAILED) => return None,
                Err(_) => {
                    rustix::thread::sched_yield();
                    continue;
                }
            }
            return self.get();
        }
    }

    /// Counts an allocation this slot served: always for the boot heap (whose allocations
    /// come before the environment is read, and are few), for the others only with
    /// `FARMAP_PRELOAD_DEBUG=1` (a counter shared by all threads costs a contended cache
    /// line per allocation).
    fn served(&self) {
        if ptr::eq(self, &BOOT) || DEBUG.load(Ordering::Relaxed) {
            self.served.fetch_add(1, Ordering::Relaxed);
        }
    }
}

pub(crate) static BOOT: Slot = Slot::new();
pub(crate) static MAIN: Slot = Slot::new();
pub(crate) static CHILD: Slot = Slot::new();

/// What [`init`] chose.
static MODE: AtomicU8 = AtomicU8::new(MODE_NONE);
const MODE_NONE: u8 = 0;
const MODE_PLAIN: u8 = 1;
const MODE_REGION: u8 = 2;
/// A forked child's copy of a region-mode heap: whole, plain memory of its own.
const MODE_INHERITED: u8 = 3;
/// The session opens once the heap holds enough (`FARMAP_RUN_OPEN_AT`); the boot heap serves
/// until then.
const MODE_LAZY: u8 = 4;
/// `FARMAP_PRELOAD_DEBUG=1`.
static DEBUG: AtomicBool = AtomicBool::new(false);

/// Arenas of a heap: 4 per CPU, 4 to 64.
fn arenas() -> usize {
    let cpus = rustix::thread::sched_getaffinity(None).map_or(4, |s| s.count() as usize);
    (4 * cpus).clamp(4, farmap_heap::MAX_ARENAS)
}

/// A heap over `len` bytes of fresh plain memory.
fn plain_heap(len: usize, arenas: usize) -> Option<H> {
    let region = sys::map_anon(len);
    if region.is_null() {
        return None;
    }
    // SAFETY: a fresh private anonymous mapping (zeros) that only this heap uses, never
    // unmapped.
    unsafe { Heap::new(region, len, RawBacking, arenas) }.ok()
}

fn boot() -> Option<&'static H> {
    BOOT.get_or_make(|| plain_heap(BOOT_LEN, 4))
}

/// The slot that serves new allocations now.
pub(crate) fn current() -> Option<(&'static H, &'static Slot)> {
    if let Some(h) = CHILD.get() {
        return Some((h, &CHILD));
    }
    if let Some(h) = MAIN.get() {
        return Some((h, &MAIN));
    }
    boot().map(|h| (h, &BOOT))
}

/// Runs `f` (an allocation of `size` bytes) on the current heap and counts the allocation if
/// it succeeded; a pending session opens first if this allocation brings the heap to
/// `FARMAP_RUN_OPEN_AT`.
pub(crate) fn with_current(size: usize, f: impl FnOnce(&H) -> *mut u8) -> *mut u8 {
    if MODE.load(Ordering::Relaxed) == MODE_LAZY {
        maybe_open(size);
    }
    let Some((heap, slot)) = current() else {
        return ptr::null_mut();
    };
    let p = f(heap);
    if !p.is_null() {
        slot.served();
    }
    p
}

/// The heap that owns `p`, if any.
pub(crate) fn owner(p: *const u8) -> Option<&'static H> {
    [&MAIN, &BOOT, &CHILD]
        .into_iter()
        .filter_map(|s| s.get())
        .find(|h| h.owns(p))
}

/// `free`: to the heap that owns `p`; a pointer no heap owns is ignored.
///
/// # Safety
/// `p` is null, not ours, or a live allocation of ours that is not used after this.
pub(crate) unsafe fn free(p: *mut u8) {
    if let Some(h) = owner(p) {
        // SAFETY: `p` is a live allocation of `h` (the caller's contract; `owner` found it
        // in `h`'s region).
        unsafe { h.free(p) };
    }
}

/// `malloc_usable_size`: 0 for null and for pointers no heap owns.
pub(crate) fn usable_size(p: *const u8) -> usize {
    owner(p).map_or(0, |h| h.usable_size(p))
}

/// `realloc`, as glibc's: null `p` is `malloc`; size 0 frees and returns null; an object of
/// a heap that no longer serves new allocations (the boot heap, once the main one is set)
/// moves to the current one. Null on failure (`p` untouched), and for a pointer no heap
/// owns (its size is unknown, so it cannot be moved).
///
/// # Safety
/// `p` is null or a live allocation of ours; if the result is not null, `p` is not used
/// after this (unless they are equal).
pub(crate) unsafe fn realloc(p: *mut u8, size: usize) -> *mut u8 {
    if p.is_null() {
        return with_current(size, |h| h.malloc(size));
    }
    let Some(owner) = owner(p) else {
        return ptr::null_mut();
    };
    if MODE.load(Ordering::Relaxed) == MODE_LAZY {
        // A boot object that grows may bring the heap to the session's threshold: it moves
        // to the region then.
        maybe_open(size);
    }
    if size == 0 {
        // SAFETY: `p` is live in `owner` (the caller's contract).
        unsafe { owner.free(p) };
        return ptr::null_mut();
    }
    let Some((current, _)) = current() else {
        return ptr::null_mut();
    };
    if ptr::eq(owner, current) {
        // SAFETY: `p` is live in `owner` (the caller's contract).
        return unsafe { owner.realloc(p, size) };
    }
    let q = with_current(size, |h| h.malloc(size));
    if !q.is_null() {
        let old = owner.usable_size(p);
        // SAFETY: `p` is live with `old` usable bytes, `q` was just allocated with at least
        // `size`; they are in different heaps, so they do not overlap. `p` is not used
        // after this (the caller's contract).
        unsafe {
            ptr::copy_nonoverlapping(p, q, old.min(size));
            owner.free(p);
        }
    }
    q
}

/// Reads the environment and sets the main heap (the library's constructor), or, with
/// `FARMAP_RUN_OPEN_AT`, leaves the boot heap serving until the heap holds that much.
///
/// # Safety
/// `envp` is null or the process's environment array (the loader's).
pub(crate) unsafe fn init(envp: *const *const c_char) {
    // SAFETY: the caller's contract.
    let settings = unsafe { env::read(envp) };
    DEBUG.store(settings.debug, Ordering::Relaxed);
    // Whatever happens next, early allocations keep working.
    let _ = boot();
    let mode = match settings.sock {
        None => MODE_PLAIN,
        Some(path) => match session::Target::new(path, settings.token, settings.fd_base) {
            Ok(target) if settings.open_at > 0 => {
                OPEN_AT.store(settings.open_at, Ordering::Relaxed);
                let _ = PENDING.set(Pending {
                    target,
                    optional: settings.optional,
                });
                MODE_LAZY
            }
            Ok(target) => open_session(&target, settings.optional),
            Err(e) => failed(e, settings.optional),
        },
    };
    plain_if(mode);
    MODE.store(mode, Ordering::Relaxed);
    // SAFETY: registering handlers that only take and release heap locks (and, in a child,
    // make a plain heap with raw system calls); no lock of ours is held, so the allocation
    // glibc makes here is served as any other.
    unsafe {
        libc::pthread_atfork(
            Some(before_fork),
            Some(after_fork_parent),
            Some(after_fork_child),
        )
    };
}

/// A session to open once the heap holds [`OPEN_AT`] bytes.
struct Pending {
    target: session::Target,
    optional: bool,
}

static PENDING: std::sync::OnceLock<Pending> = std::sync::OnceLock::new();
/// Bytes of heap in use at which a pending session opens.
static OPEN_AT: AtomicU64 = AtomicU64::new(0);
/// Whether a thread has begun to open the pending session.
static OPENING: AtomicBool = AtomicBool::new(false);
/// Boot allocations between two looks at how much the heap holds.
const LOOK_EVERY: u64 = 32;
/// An allocation at least this large looks at once.
const LARGE: usize = 64 << 10;

/// Opens the session at `target` and serves the heap from its region: the mode that
/// results (plain if it failed and `optional`; else the process exits with status 127).
fn open_session(target: &session::Target, optional: bool) -> u8 {
    match session::open(target) {
        Ok(s) => {
            start_region(s);
            MODE_REGION
        }
        Err(e) => failed(e, optional),
    }
}

/// A session that could not open: plain memory if `optional`, else one line and exit 127.
fn failed(e: session::SessionError, optional: bool) -> u8 {
    if optional {
        sys::say(format_args!(
            "{e}; running on plain memory (FARMAP_RUN_OPTIONAL)"
        ));
        return MODE_PLAIN;
    }
    sys::say(format_args!("{e}"));
    sys::exit_now(127);
}

/// Sets the plain main heap if `mode` is plain.
fn plain_if(mode: u8) {
    if mode == MODE_PLAIN
        && MAIN
            .get_or_make(|| plain_heap(PLAIN_LEN, arenas()))
            .is_none()
    {
        sys::say(format_args!(
            "could not map the plain heap; serving from the boot heap"
        ));
    }
}

/// Before an allocation of `size` bytes while the session is pending: when it is large, or
/// every [`LOOK_EVERY`] allocations, whether the heap would then hold [`OPEN_AT`] bytes, and
/// if so, the session opens, on this thread (which holds no lock of ours; allocations
/// meanwhile, the reaper thread's among them, come from the boot heap).
fn maybe_open(size: usize) {
    if size < LARGE
        && !BOOT
            .served
            .load(Ordering::Relaxed)
            .is_multiple_of(LOOK_EVERY)
    {
        return;
    }
    let Some(boot) = BOOT.get() else { return };
    let held = (boot.stats().bytes_in_use as u64).saturating_add(size as u64);
    if held < OPEN_AT.load(Ordering::Relaxed) || OPENING.swap(true, Ordering::AcqRel) {
        return;
    }
    let Some(p) = PENDING.get() else { return };
    let mode = open_session(&p.target, p.optional);
    plain_if(mode);
    MODE.store(mode, Ordering::Relaxed);
}

/// Serves the program's heap from the session's region, and starts the reaper.
fn start_region(s: session::Session) {
    let (region, len) = s.region();
    // The reaper first: creating a thread allocates (glibc's TLS vector), which the boot
    // heap serves; so no fault in the region is needed before the reaper runs.
    if let Err(e) = session::start_reaper(s) {
        sys::say(format_args!("cannot start the reaper thread: {e}"));
        sys::kill_self();
    }
    // SAFETY: the region is a fresh private anonymous mapping registered with the session's
    // userfaultfd: it reads as zeros (missing pages are served by farmap run as zeros, or
    // from the store once written), and only this heap hands it out; it is never unmapped.
    let heap = match unsafe { Heap::new(region, len, RawBacking, arenas()) } {
        Ok(h) => h,
        Err(e) => {
            sys::say(format_args!("cannot make a heap over the region: {e}"));
            sys::kill_self();
        }
    };
    if MAIN.get_or_make(|| Some(heap)).is_none() {
        sys::exit_now(127);
    }
}

fn each_heap(f: impl Fn(&H)) {
    for slot in [&BOOT, &MAIN, &CHILD] {
        if let Some(h) = slot.get() {
            f(h);
        }
    }
}

extern "C" fn before_fork() {
    each_heap(|h| h.lock_all());
    if MODE.load(Ordering::Relaxed) == MODE_REGION {
        // With every heap lock held, nothing of ours discards region pages until the fork.
        session::fork_prepare();
    }
}

extern "C" fn after_fork_parent() {
    if MODE.load(Ordering::Relaxed) == MODE_REGION {
        session::fork_parent();
    }
    // SAFETY: this thread took every lock in `before_fork`.
    each_heap(|h| unsafe { h.unlock_all() });
}

extern "C" fn after_fork_child() {
    if MODE.load(Ordering::Relaxed) == MODE_REGION {
        if session::fork_events() {
            // This child inherited the region; farmap run copies what it lacks, then lets
            // go of it: from then on it is this process's plain memory, served by nobody.
            session::fork_child();
            session::close_inherited();
            MODE.store(MODE_INHERITED, Ordering::Relaxed);
        } else {
            // The region is not in this child (MADV_DONTFORK), and no reaper serves it.
            session::close_inherited();
            let _ = CHILD.get_or_make(|| plain_heap(PLAIN_LEN, 4));
        }
    }
    // SAFETY: the parent's forking thread (this thread's original) took every lock in
    // `before_fork`.
    each_heap(|h| unsafe { h.unlock_all() });
}

/// The stats line of `FARMAP_PRELOAD_DEBUG=1`, printed at exit.
pub(crate) fn report() {
    if !DEBUG.load(Ordering::Relaxed) {
        return;
    }
    let mode = match MODE.load(Ordering::Relaxed) {
        MODE_PLAIN => "plain",
        MODE_REGION => "region",
        MODE_INHERITED => "inherited",
        MODE_LAZY => "lazy",
        _ => "none",
    };
    let in_use = |s: &Slot| s.get().map_or(0, |h| h.stats().bytes_in_use);
    sys::say(format_args!(
        "stats pid={} mode={mode} main_allocs={} boot_allocs={} child_allocs={} main_bytes_in_use={} boot_bytes_in_use={}",
        rustix::process::getpid().as_raw_nonzero(),
        MAIN.served.load(Ordering::Relaxed),
        BOOT.served.load(Ordering::Relaxed),
        CHILD.served.load(Ordering::Relaxed),
        in_use(&MAIN),
        in_use(&BOOT),
    ));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The boot heap serves until the main heap is set; then new allocations come from the
    /// main heap, and each pointer goes back to (or moves from) the heap that owns it.
    #[test]
    fn calls_go_to_the_heap_that_owns_the_pointer() {
        let early = with_current(100, |h| h.malloc(100));
        assert!(!early.is_null());
        assert!(ptr::eq(owner(early).unwrap(), BOOT.get().unwrap()));
        assert!(MAIN.get().is_none());
        // SAFETY: `early` has at least 100 usable bytes.
        unsafe { early.write_bytes(0x5a, 100) };
        let doomed = with_current(10, |h| h.malloc(10));
        assert!(MAIN.get_or_make(|| plain_heap(1 << 30, 2)).is_some());
        let (_, slot) = current().unwrap();
        assert!(ptr::eq(slot, &MAIN));
        let late = with_current(100, |h| h.malloc(100));
        assert!(ptr::eq(owner(late).unwrap(), MAIN.get().unwrap()));
        assert!(usable_size(late) >= 100);
        // A boot object that grows moves to the main heap with its bytes.
        // SAFETY: `early` is live and not used after this.
        let moved = unsafe { realloc(early, 5000) };
        assert!(ptr::eq(owner(moved).unwrap(), MAIN.get().unwrap()));
        // SAFETY: `moved` kept the first 100 bytes.
        let kept = unsafe { core::slice::from_raw_parts(moved, 100) };
        assert!(kept.iter().all(|&b| b == 0x5a));
        assert_eq!(
            BOOT.get().unwrap().stats().objects_in_use,
            1,
            "only `doomed` is left"
        );
        // SAFETY: live pointers of ours, not used after this.
        unsafe {
            free(doomed);
            free(moved);
            free(late);
        }
        assert_eq!(BOOT.get().unwrap().stats().objects_in_use, 0);
        // Pointers no heap owns: ignored by free, 0 usable bytes, not reallocated.
        let mut on_stack = [0u8; 16];
        let foreign = on_stack.as_mut_ptr();
        assert!(owner(foreign).is_none());
        assert_eq!(usable_size(foreign), 0);
        // SAFETY: not ours: free ignores it and realloc refuses it without touching it.
        unsafe {
            free(foreign);
            assert!(realloc(foreign, 10).is_null());
        }
        assert_eq!(usable_size(ptr::null()), 0);
        // realloc(p, 0) frees; realloc(null, n) allocates.
        // SAFETY: null, then a live pointer not used after the call.
        unsafe {
            let p = realloc(ptr::null_mut(), 64);
            assert!(ptr::eq(owner(p).unwrap(), MAIN.get().unwrap()));
            assert!(realloc(p, 0).is_null());
        }
        assert_eq!(MAIN.get().unwrap().stats().objects_in_use, 0);
    }
}
