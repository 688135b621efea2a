//! The exported symbols: the malloc family, glibc's `__libc_*` names, the C++ operators,
//! the constructor and the exit report. Not built for this crate's unit tests (the test
//! binary would serve its own heap with them).
//!
//! glibc's behaviour is kept where programs see it ("Replacing malloc" in the glibc manual):
//! `malloc(0)` is a unique pointer, `realloc(p, 0)` frees and returns null, `free(NULL)` does
//! nothing, `free` keeps `errno` (only raw system calls run under it), failures set `ENOMEM`,
//! `calloc` checks `n * size` for overflow, `posix_memalign` returns `EINVAL`/`ENOMEM`
//! without touching `errno`, `memalign` rounds an alignment that is not a power of two up to
//! one (as glibc 2.36 does, also for `aligned_alloc`), and `malloc_usable_size` is exact
//! (programs such as redis write up to it).

use core::ffi::{c_char, c_int, c_void};
use core::ptr;

use crate::heaps::{self, H};
use crate::sys;

fn set_errno(e: c_int) {
    // SAFETY: glibc's errno location for this thread: always valid to write.
    unsafe { *libc::__errno_location() = e };
}

fn fail<T>(e: c_int, v: T) -> T {
    set_errno(e);
    v
}

/// Allocates `size` bytes (the request's, for the heap's choice) with `f`.
fn alloc(size: usize, f: impl FnOnce(&H) -> *mut u8) -> *mut c_void {
    let p = heaps::with_current(size, f);
    if p.is_null() {
        set_errno(libc::ENOMEM);
    }
    p.cast()
}

fn align_up(align: usize) -> Option<usize> {
    align.checked_next_power_of_two()
}

fn memalign_impl(align: usize, size: usize) -> *mut c_void {
    match align_up(align) {
        Some(a) => alloc(size, |h| h.memalign(a, size)),
        None => fail(libc::EINVAL, ptr::null_mut()),
    }
}

/// # Safety
/// `p` is null, not ours (ignored), or a live allocation of ours.
unsafe fn free_impl(p: *mut c_void) {
    // SAFETY: the caller's contract.
    unsafe { heaps::free(p.cast()) }
}

/// # Safety
/// As `realloc(3)`: `p` is null or a live allocation of ours.
unsafe fn realloc_impl(p: *mut c_void, size: usize) -> *mut c_void {
    // SAFETY: the caller's contract.
    let q = unsafe { heaps::realloc(p.cast(), size) };
    if q.is_null() && (size != 0 || p.is_null()) {
        set_errno(libc::ENOMEM);
    }
    q.cast()
}

fn usable_impl(p: *const c_void) -> usize {
    heaps::usable_size(p.cast())
}

/// # Safety
/// `memptr` is writable.
unsafe fn posix_memalign_impl(memptr: *mut *mut c_void, align: usize, size: usize) -> c_int {
    if !align.is_power_of_two() || !align.is_multiple_of(size_of::<*mut c_void>()) {
        return libc::EINVAL;
    }
    let p = heaps::with_current(size, |h| h.memalign(align, size));
    if p.is_null() {
        return libc::ENOMEM;
    }
    // SAFETY: the caller's contract.
    unsafe { *memptr = p.cast() };
    0
}

const PAGE: usize = 4096;

#[cold]
fn new_failed(size: usize) -> ! {
    sys::say(format_args!("out of memory in operator new ({size} bytes)"));
    // SAFETY: abort is always safe to call.
    unsafe { libc::abort() }
}

fn new_impl(size: usize) -> *mut c_void {
    let p = alloc(size, |h| h.malloc(size));
    if p.is_null() {
        new_failed(size);
    }
    p
}

fn new_aligned_impl(size: usize, align: usize) -> *mut c_void {
    let p = memalign_impl(align, size);
    if p.is_null() {
        new_failed(size);
    }
    p
}

// ---- C ----

/// `malloc(3)`.
#[no_mangle]
pub extern "C" fn malloc(size: usize) -> *mut c_void {
    alloc(size, |h| h.malloc(size))
}

/// `calloc(3)`.
#[no_mangle]
pub extern "C" fn calloc(n: usize, size: usize) -> *mut c_void {
    alloc(n.saturating_mul(size), |h| h.calloc(n, size))
}

/// `free(3)`.
#[no_mangle]
pub unsafe extern "C" fn free(p: *mut c_void) {
    // SAFETY: free(3)'s contract.
    unsafe { free_impl(p) }
}

/// `cfree`, an old name of `free`.
#[no_mangle]
pub unsafe extern "C" fn cfree(p: *mut c_void) {
    // SAFETY: free(3)'s contract.
    unsafe { free_impl(p) }
}

/// C23 `free_sized`.
#[no_mangle]
pub unsafe extern "C" fn free_sized(p: *mut c_void, _size: usize) {
    // SAFETY: free(3)'s contract.
    unsafe { free_impl(p) }
}

/// C23 `free_aligned_sized`.
#[no_mangle]
pub unsafe extern "C" fn free_aligned_sized(p: *mut c_void, _align: usize, _size: usize) {
    // SAFETY: free(3)'s contract.
    unsafe { free_impl(p) }
}

/// `realloc(3)`.
#[no_mangle]
pub unsafe extern "C" fn realloc(p: *mut c_void, size: usize) -> *mut c_void {
    // SAFETY: realloc(3)'s contract.
    unsafe { realloc_impl(p, size) }
}

/// `reallocarray(3)`.
#[no_mangle]
pub unsafe extern "C" fn reallocarray(p: *mut c_void, n: usize, size: usize) -> *mut c_void {
    match n.checked_mul(size) {
        // SAFETY: realloc(3)'s contract.
        Some(total) => unsafe { realloc_impl(p, total) },
        None => fail(libc::ENOMEM, ptr::null_mut()),
    }
}

/// `posix_memalign(3)`.
#[no_mangle]
pub unsafe extern "C" fn posix_memalign(
    memptr: *mut *mut c_void,
    align: usize,
    size: usize,
) -> c_int {
    // SAFETY: posix_memalign(3)'s contract.
    unsafe { posix_memalign_impl(memptr, align, size) }
}

/// `aligned_alloc(3)`.
#[no_mangle]
pub extern "C" fn aligned_alloc(align: usize, size: usize) -> *mut c_void {
    memalign_impl(align, size)
}

/// `memalign(3)`.
#[no_mangle]
pub extern "C" fn memalign(align: usize, size: usize) -> *mut c_void {
    memalign_impl(align, size)
}

/// `valloc(3)`.
#[no_mangle]
pub extern "C" fn valloc(size: usize) -> *mut c_void {
    memalign_impl(PAGE, size)
}

/// `pvalloc(3)`: whole pages (one for 0 bytes).
#[no_mangle]
pub extern "C" fn pvalloc(size: usize) -> *mut c_void {
    match size.max(1).checked_next_multiple_of(PAGE) {
        Some(s) => memalign_impl(PAGE, s),
        None => fail(libc::ENOMEM, ptr::null_mut()),
    }
}

/// `malloc_usable_size(3)`: exactly what may be written.
#[no_mangle]
pub extern "C" fn malloc_usable_size(p: *mut c_void) -> usize {
    usable_impl(p)
}

// ---- glibc's __libc_* names ----

/// glibc's `__libc_malloc`.
#[no_mangle]
pub extern "C" fn __libc_malloc(size: usize) -> *mut c_void {
    malloc(size)
}

/// glibc's `__libc_calloc`.
#[no_mangle]
pub extern "C" fn __libc_calloc(n: usize, size: usize) -> *mut c_void {
    calloc(n, size)
}

/// glibc's `__libc_realloc`.
#[no_mangle]
pub unsafe extern "C" fn __libc_realloc(p: *mut c_void, size: usize) -> *mut c_void {
    // SAFETY: realloc(3)'s contract.
    unsafe { realloc_impl(p, size) }
}

/// glibc's `__libc_free`.
#[no_mangle]
pub unsafe extern "C" fn __libc_free(p: *mut c_void) {
    // SAFETY: free(3)'s contract.
    unsafe { free_impl(p) }
}

/// glibc's `__libc_memalign`.
#[no_mangle]
pub extern "C" fn __libc_memalign(align: usize, size: usize) -> *mut c_void {
    memalign_impl(align, size)
}

/// glibc's `__libc_valloc`.
#[no_mangle]
pub extern "C" fn __libc_valloc(size: usize) -> *mut c_void {
    valloc(size)
}

/// glibc's `__libc_pvalloc`.
#[no_mangle]
pub extern "C" fn __libc_pvalloc(size: usize) -> *mut c_void {
    pvalloc(size)
}

/// glibc's `__posix_memalign`.
#[no_mangle]
pub unsafe extern "C" fn __posix_memalign(
    memptr: *mut *mut c_void,
    align: usize,
    size: usize,
) -> c_int {
    // SAFETY: posix_memalign(3)'s contract.
    unsafe { posix_memalign_impl(memptr, align, size) }
}

// ---- C++ (Itanium ABI names; `align_val_t` is a `size_t`, `nothrow_t` a reference) ----

/// `operator new(size_t)`.
#[no_mangle]
pub extern "C" fn _Znwm(size: usize) -> *mut c_void {
    new_impl(size)
}

/// `operator new[](size_t)`.
#[no_mangle]
pub extern "C" fn _Znam(size: usize) -> *mut c_void {
    new_impl(size)
}

/// `operator new(size_t, const nothrow_t&)`.
#[no_mangle]
pub extern "C" fn _ZnwmRKSt9nothrow_t(size: usize, _nt: *const c_void) -> *mut c_void {
    malloc(size)
}

/// `operator new[](size_t, const nothrow_t&)`.
#[no_mangle]
pub extern "C" fn _ZnamRKSt9nothrow_t(size: usize, _nt: *const c_void) -> *mut c_void {
    malloc(size)
}

/// `operator new(size_t, align_val_t)`.
#[no_mangle]
pub extern "C" fn _ZnwmSt11align_val_t(size: usize, align: usize) -> *mut c_void {
    new_aligned_impl(size, align)
}

/// `operator new[](size_t, align_val_t)`.
#[no_mangle]
pub extern "C" fn _ZnamSt11align_val_t(size: usize, align: usize) -> *mut c_void {
    new_aligned_impl(size, align)
}

/// `operator new(size_t, align_val_t, const nothrow_t&)`.
#[no_mangle]
pub extern "C" fn _ZnwmSt11align_val_tRKSt9nothrow_t(
    size: usize,
    align: usize,
    _nt: *const c_void,
) -> *mut c_void {
    memalign_impl(align, size)
}

/// `operator new[](size_t, align_val_t, const nothrow_t&)`.
#[no_mangle]
pub extern "C" fn _ZnamSt11align_val_tRKSt9nothrow_t(
    size: usize,
    align: usize,
    _nt: *const c_void,
) -> *mut c_void {
    memalign_impl(align, size)
}

macro_rules! deletes {
    ($($(#[$doc:meta])* $name:ident($($arg:ident: $ty:ty),*);)*) => {$(
        $(#[$doc])*
        #[no_mangle]
        pub unsafe extern "C" fn $name(p: *mut c_void $(, $arg: $ty)*) {
            $(let _ = $arg;)*
            // SAFETY: operator delete's contract: `p` is null or a live allocation of ours.
            unsafe { free_impl(p) }
        }
    )*};
}

deletes! {
    /// `operator delete(void*)`.
    _ZdlPv();
    /// `operator delete[](void*)`.
    _ZdaPv();
    /// `operator delete(void*, size_t)`.
    _ZdlPvm(size: usize);
    /// `operator delete[](void*, size_t)`.
    _ZdaPvm(size: usize);
    /// `operator delete(void*, const nothrow_t&)`.
    _ZdlPvRKSt9nothrow_t(nt: *const c_void);
    /// `operator delete[](void*, const nothrow_t&)`.
    _ZdaPvRKSt9nothrow_t(nt: *const c_void);
    /// `operator delete(void*, align_val_t)`.
    _ZdlPvSt11align_val_t(align: usize);
    /// `operator delete[](void*, align_val_t)`.
    _ZdaPvSt11align_val_t(align: usize);
    /// `operator delete(void*, align_val_t, const nothrow_t&)`.
    _ZdlPvSt11align_val_tRKSt9nothrow_t(align: usize, nt: *const c_void);
    /// `operator delete[](void*, align_val_t, const nothrow_t&)`.
    _ZdaPvSt11align_val_tRKSt9nothrow_t(align: usize, nt: *const c_void);
    /// `operator delete(void*, size_t, align_val_t)`.
    _ZdlPvmSt11align_val_t(size: usize, align: usize);
    /// `operator delete[](void*, size_t, align_val_t)`.
    _ZdaPvmSt11align_val_t(size: usize, align: usize);
}

// ---- constructor and exit report ----

/// The constructor: glibc calls `.init_array` entries of a shared object with `(argc, argv,
/// envp)`, after the constructors of the program's other libraries (which may already have
/// allocated from the boot heap) and before the program's own.
extern "C" fn constructor(_argc: c_int, _argv: *const *const c_char, envp: *const *const c_char) {
    // SAFETY: `envp` is the loader's environment array (or null).
    unsafe { heaps::init(envp) }
}

#[used]
#[link_section = ".init_array"]
static CONSTRUCTOR: extern "C" fn(c_int, *const *const c_char, *const *const c_char) = constructor;

extern "C" fn destructor() {
    heaps::report();
}

#[used]
#[link_section = ".fini_array"]
static DESTRUCTOR: extern "C" fn() = destructor;
