//! The userfaultfd and `PAGEMAP_SCAN` kernel interface, written by hand (no bindgen, so that
//! building needs no libclang).
//!
//! Sources: `include/uapi/linux/userfaultfd.h` and `include/uapi/linux/fs.h` (Linux 6.8+).
//! Every struct size and ioctl number is checked at compile time against the values the
//! kernel headers give (`_IOWR` and friends, computed here by [`ioc`]); the research prototype
//! cross-checked the older ones against the system headers in C.
//!
//! Everything here is raw: prefer the safe types of this crate
//! ([`Uffd`](crate::uffd::Uffd), [`UffdRange`](crate::uffd::UffdRange),
//! [`Pagemap`](crate::pagemap::Pagemap)). The one `unsafe` function, `ioctl` (private to this crate), is the only
//! way this crate calls `ioctl(2)`; `pagemap_scan` is its safe `PAGEMAP_SCAN` form.

use std::os::fd::{AsRawFd, BorrowedFd, RawFd};

const IOC_NONE: u64 = 0;
const IOC_WRITE: u64 = 1;
const IOC_READ: u64 = 2;

/// An ioctl request number, as `_IOC(dir, type, nr, size)` builds it on x86_64 and aarch64.
pub const fn ioc(dir: u64, ty: u64, nr: u64, size: u64) -> u64 {
    (dir << 30) | (size << 16) | (ty << 8) | nr
}

/// `UFFD_API`: the API version `UFFDIO_API` takes.
pub const UFFD_API: u64 = 0xAA;
/// `USERFAULTFD_IOC_NEW` (on `/dev/userfaultfd`).
pub const USERFAULTFD_IOC_NEW: u64 = ioc(IOC_NONE, 0xAA, 0x00, 0);

/// `UFFD_FEATURE_PAGEFAULT_FLAG_WP`.
pub const UFFD_FEATURE_PAGEFAULT_FLAG_WP: u64 = 1 << 0;
/// `UFFD_FEATURE_EVENT_FORK`.
pub const UFFD_FEATURE_EVENT_FORK: u64 = 1 << 1;
/// `UFFD_FEATURE_EVENT_REMAP`.
pub const UFFD_FEATURE_EVENT_REMAP: u64 = 1 << 2;
/// `UFFD_FEATURE_EVENT_REMOVE`: madvise(DONTNEED/FREE) of a registered range sends an event.
pub const UFFD_FEATURE_EVENT_REMOVE: u64 = 1 << 3;
/// `UFFD_FEATURE_EVENT_UNMAP`.
pub const UFFD_FEATURE_EVENT_UNMAP: u64 = 1 << 6;
/// `UFFD_FEATURE_SIGBUS`.
pub const UFFD_FEATURE_SIGBUS: u64 = 1 << 7;
/// `UFFD_FEATURE_THREAD_ID`.
pub const UFFD_FEATURE_THREAD_ID: u64 = 1 << 8;
/// `UFFD_FEATURE_WP_UNPOPULATED`: write-protection also applies to never-populated pages.
pub const UFFD_FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
/// `UFFD_FEATURE_POISON`: `UFFDIO_POISON` exists.
pub const UFFD_FEATURE_POISON: u64 = 1 << 14;
/// `UFFD_FEATURE_WP_ASYNC`: write faults on write-protected pages resolve in the kernel.
pub const UFFD_FEATURE_WP_ASYNC: u64 = 1 << 15;
/// `UFFD_FEATURE_MOVE`.
pub const UFFD_FEATURE_MOVE: u64 = 1 << 16;
/// `UFFD_FEATURE_MINOR_SHMEM`: minor faults on shmem (a page in the page cache, not mapped).
pub const UFFD_FEATURE_MINOR_SHMEM: u64 = 1 << 10;

/// `UFFD_EVENT_PAGEFAULT`.
pub const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
/// `UFFD_EVENT_FORK`.
pub const UFFD_EVENT_FORK: u8 = 0x13;
/// `UFFD_EVENT_REMAP`.
pub const UFFD_EVENT_REMAP: u8 = 0x14;
/// `UFFD_EVENT_REMOVE`.
pub const UFFD_EVENT_REMOVE: u8 = 0x15;
/// `UFFD_EVENT_UNMAP`.
pub const UFFD_EVENT_UNMAP: u8 = 0x16;

/// `UFFD_PAGEFAULT_FLAG_WRITE`: the fault is a write.
pub const UFFD_PAGEFAULT_FLAG_WRITE: u64 = 1 << 0;
/// `UFFD_PAGEFAULT_FLAG_WP`: the fault hit a write-protected page.
pub const UFFD_PAGEFAULT_FLAG_WP: u64 = 1 << 1;
/// `UFFD_PAGEFAULT_FLAG_MINOR`.
pub const UFFD_PAGEFAULT_FLAG_MINOR: u64 = 1 << 2;

/// `UFFDIO_REGISTER_MODE_MISSING`.
pub const UFFDIO_REGISTER_MODE_MISSING: u64 = 1 << 0;
/// `UFFDIO_REGISTER_MODE_WP`.
pub const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;
/// `UFFDIO_REGISTER_MODE_MINOR`.
pub const UFFDIO_REGISTER_MODE_MINOR: u64 = 1 << 2;
/// `UFFDIO_CONTINUE_MODE_DONTWAKE`.
pub const UFFDIO_CONTINUE_MODE_DONTWAKE: u64 = 1 << 0;
/// `UFFDIO_CONTINUE_MODE_WP`: map the pages write-protected.
pub const UFFDIO_CONTINUE_MODE_WP: u64 = 1 << 1;

/// `UFFDIO_COPY_MODE_DONTWAKE`.
pub const UFFDIO_COPY_MODE_DONTWAKE: u64 = 1 << 0;
/// `UFFDIO_COPY_MODE_WP`: install the pages write-protected.
pub const UFFDIO_COPY_MODE_WP: u64 = 1 << 1;
/// `UFFDIO_WRITEPROTECT_MODE_WP`: protect (without it: unprotect).
pub const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;
/// `UFFDIO_WRITEPROTECT_MODE_DONTWAKE`.
pub const UFFDIO_WRITEPROTECT_MODE_DONTWAKE: u64 = 1 << 1;
/// `UFFDIO_POISON_MODE_DONTWAKE`.
pub const UFFDIO_POISON_MODE_DONTWAKE: u64 = 1 << 0;

/// Bit of `_UFFDIO_WRITEPROTECT` in a register reply's `ioctls`.
pub const UFFDIO_BIT_WRITEPROTECT: u64 = 1 << 0x06;
/// Bit of `_UFFDIO_POISON` in a register reply's `ioctls`.
pub const UFFDIO_BIT_POISON: u64 = 1 << 0x08;

/// `struct uffdio_api`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct UffdioApi {
    /// `UFFD_API`.
    pub api: u64,
    /// In: features asked for. Out: features supported.
    pub features: u64,
    /// Out: ioctls available on the fd.
    pub ioctls: u64,
}

/// `struct uffdio_range`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct UffdioRange {
    /// Start address (page-aligned).
    pub start: u64,
    /// Length in bytes (a multiple of the page size).
    pub len: u64,
}

/// `struct uffdio_register`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct UffdioRegister {
    /// The range to register.
    pub range: UffdioRange,
    /// `UFFDIO_REGISTER_MODE_*`.
    pub mode: u64,
    /// Out: ioctls available on the range.
    pub ioctls: u64,
}

/// `struct uffdio_copy`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct UffdioCopy {
    /// Destination address.
    pub dst: u64,
    /// Source address (in the caller's address space).
    pub src: u64,
    /// Bytes to copy.
    pub len: u64,
    /// `UFFDIO_COPY_MODE_*`.
    pub mode: u64,
    /// Out: bytes copied, or a negated errno.
    pub copy: i64,
}

/// `struct uffdio_continue`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct UffdioContinue {
    /// The range to map from the page cache.
    pub range: UffdioRange,
    /// `UFFDIO_CONTINUE_MODE_*`.
    pub mode: u64,
    /// Out: bytes mapped, or a negated errno.
    pub mapped: i64,
}

/// `struct uffdio_writeprotect`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct UffdioWriteprotect {
    /// The range.
    pub range: UffdioRange,
    /// `UFFDIO_WRITEPROTECT_MODE_*`.
    pub mode: u64,
}

/// `struct uffdio_poison`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct UffdioPoison {
    /// The range.
    pub range: UffdioRange,
    /// `UFFDIO_POISON_MODE_*`.
    pub mode: u64,
    /// Out: bytes poisoned, or a negated errno.
    pub updated: i64,
}

/// `struct uffd_msg` (packed, 32 bytes; every field is naturally aligned, so `repr(C)` gives
/// the same layout). `event` at 0; the argument union at 8..32:
/// - pagefault: `flags` (arg0), `address` (arg1), `ptid` (low half of arg2);
/// - remove / unmap: `start` (arg0), `end` (arg1);
/// - remap: `from`, `to`, `len`; fork: `ufd` (low half of arg0).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct UffdMsg {
    /// `UFFD_EVENT_*`.
    pub event: u8,
    /// Reserved.
    pub reserved1: u8,
    /// Reserved.
    pub reserved2: u16,
    /// Reserved.
    pub reserved3: u32,
    /// First word of the union.
    pub arg0: u64,
    /// Second word of the union.
    pub arg1: u64,
    /// Third word of the union.
    pub arg2: u64,
}

/// `UFFDIO_API`.
pub const UFFDIO_API: u64 = ioc(IOC_READ | IOC_WRITE, 0xAA, 0x3F, 24);
/// `UFFDIO_REGISTER`.
pub const UFFDIO_REGISTER: u64 = ioc(IOC_READ | IOC_WRITE, 0xAA, 0x00, 32);
/// `UFFDIO_UNREGISTER`.
pub const UFFDIO_UNREGISTER: u64 = ioc(IOC_READ, 0xAA, 0x01, 16);
/// `UFFDIO_WAKE`.
pub const UFFDIO_WAKE: u64 = ioc(IOC_READ, 0xAA, 0x02, 16);
/// `UFFDIO_COPY`.
pub const UFFDIO_COPY: u64 = ioc(IOC_READ | IOC_WRITE, 0xAA, 0x03, 40);
/// `UFFDIO_WRITEPROTECT`.
pub const UFFDIO_WRITEPROTECT: u64 = ioc(IOC_READ | IOC_WRITE, 0xAA, 0x06, 24);
/// `UFFDIO_POISON`.
pub const UFFDIO_POISON: u64 = ioc(IOC_READ | IOC_WRITE, 0xAA, 0x08, 32);
/// `UFFDIO_MOVE` (Linux 6.8+, `UFFD_FEATURE_MOVE`).
pub const UFFDIO_MOVE: u64 = ioc(IOC_READ | IOC_WRITE, 0xAA, 0x05, 40);

/// `UFFDIO_CONTINUE`.
pub const UFFDIO_CONTINUE: u64 = ioc(IOC_READ | IOC_WRITE, 0xAA, 0x07, 32);
/// `UFFDIO_ZEROPAGE`: map the shared zero page at missing pages.
pub const UFFDIO_ZEROPAGE: u64 = ioc(IOC_READ | IOC_WRITE, 0xAA, 0x04, 32);
/// `UFFDIO_ZEROPAGE_MODE_DONTWAKE`.
pub const UFFDIO_ZEROPAGE_MODE_DONTWAKE: u64 = 1 << 0;

/// `struct uffdio_zeropage`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct UffdioZeropage {
    /// The range.
    pub range: UffdioRange,
    /// `UFFDIO_ZEROPAGE_MODE_*`.
    pub mode: u64,
    /// Out: bytes mapped, or a negated errno.
    pub zeropage: i64,
}

/// `UFFDIO_MOVE_MODE_DONTWAKE`: do not wake the threads waiting on the destination.
pub const UFFDIO_MOVE_MODE_DONTWAKE: u64 = 1 << 0;
/// `UFFDIO_MOVE_MODE_ALLOW_SRC_HOLES`: skip missing source pages instead of failing.
pub const UFFDIO_MOVE_MODE_ALLOW_SRC_HOLES: u64 = 1 << 1;

/// `struct uffdio_move`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct UffdioMove {
    /// Destination address.
    pub dst: u64,
    /// Source address.
    pub src: u64,
    /// Bytes to move.
    pub len: u64,
    /// `UFFDIO_MOVE_MODE_*`.
    pub mode: u64,
    /// Out: bytes moved, or a negative errno.
    pub moved: i64,
}

/// `PAGE_IS_WPALLOWED`.
pub const PAGE_IS_WPALLOWED: u64 = 1 << 0;
/// `PAGE_IS_WRITTEN`: not write-protected (written since last protected, or never protected).
pub const PAGE_IS_WRITTEN: u64 = 1 << 1;
/// `PAGE_IS_FILE`.
pub const PAGE_IS_FILE: u64 = 1 << 2;
/// `PAGE_IS_PRESENT`.
pub const PAGE_IS_PRESENT: u64 = 1 << 3;
/// `PAGE_IS_SWAPPED`.
pub const PAGE_IS_SWAPPED: u64 = 1 << 4;
/// `PAGE_IS_PFNZERO`.
pub const PAGE_IS_PFNZERO: u64 = 1 << 5;

/// `PM_SCAN_WP_MATCHING`: write-protect the matching pages.
pub const PM_SCAN_WP_MATCHING: u64 = 1 << 0;
/// `PM_SCAN_CHECK_WPASYNC`: fail unless the range is registered with WP_ASYNC.
pub const PM_SCAN_CHECK_WPASYNC: u64 = 1 << 1;

/// `struct page_region`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PageRegion {
    /// Start address.
    pub start: u64,
    /// End address (exclusive).
    pub end: u64,
    /// The `PAGE_IS_*` categories of every page of the region (masked by `return_mask`).
    pub categories: u64,
}

/// `struct pm_scan_arg`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct PmScanArg {
    /// `size_of::<PmScanArg>()` (96).
    pub size: u64,
    /// `PM_SCAN_*`.
    pub flags: u64,
    /// Start address.
    pub start: u64,
    /// End address (exclusive).
    pub end: u64,
    /// Out: where the walk stopped (continue from here when it is below `end`).
    pub walk_end: u64,
    /// Address of a `PageRegion` array.
    pub vec: u64,
    /// Its length.
    pub vec_len: u64,
    /// Most pages to report (0: no limit).
    pub max_pages: u64,
    /// Categories whose sense is inverted before matching.
    pub category_inverted: u64,
    /// Categories that must all be set.
    pub category_mask: u64,
    /// Categories of which at least one must be set.
    pub category_anyof_mask: u64,
    /// Categories reported.
    pub return_mask: u64,
}

/// `PAGEMAP_SCAN` (on `/proc/<pid>/pagemap`).
pub const PAGEMAP_SCAN: u64 = ioc(IOC_READ | IOC_WRITE, b'f' as u64, 16, 96);

const _: () = {
    use std::mem::size_of;
    assert!(size_of::<UffdioApi>() == 24);
    assert!(size_of::<UffdioRange>() == 16);
    assert!(size_of::<UffdioRegister>() == 32);
    assert!(size_of::<UffdioCopy>() == 40);
    assert!(size_of::<UffdioWriteprotect>() == 24);
    assert!(size_of::<UffdioPoison>() == 32);
    assert!(size_of::<UffdioContinue>() == 32);
    assert!(size_of::<UffdioMove>() == 40);
    assert!(UFFDIO_MOVE == 0xC028_AA05);
    assert!(size_of::<UffdMsg>() == 32);
    assert!(size_of::<PageRegion>() == 24);
    assert!(size_of::<PmScanArg>() == 96);
    assert!(UFFDIO_API == 0xC018_AA3F);
    assert!(UFFDIO_REGISTER == 0xC020_AA00);
    assert!(UFFDIO_UNREGISTER == 0x8010_AA01);
    assert!(UFFDIO_WAKE == 0x8010_AA02);
    assert!(UFFDIO_COPY == 0xC028_AA03);
    assert!(UFFDIO_ZEROPAGE == 0xC020_AA04);
    assert!(UFFDIO_WRITEPROTECT == 0xC018_AA06);
    assert!(UFFDIO_POISON == 0xC020_AA08);
    assert!(PAGEMAP_SCAN == 0xC060_6610);
    assert!(USERFAULTFD_IOC_NEW == 0xAA00);
};

/// Calls `ioctl(fd, req, arg)`; returns the non-negative result or the `errno`.
///
/// # Safety
/// `arg` must point to a live, properly initialized value of the type request `req` expects
/// (the ioctl numbers above encode its size), valid for reads and writes for the whole call,
/// and every pointer stored inside it must be valid as the request requires (a
/// `UffdioCopy::src` readable for `len` bytes, a `PmScanArg::vec` writable for `vec_len`
/// entries). Requests that change memory (copy, poison, write-protect, register) must only
/// name ranges whose owner expects that change: see the callers' own safety contracts.
pub(crate) unsafe fn ioctl<T>(fd: RawFd, req: u64, arg: *mut T) -> Result<i32, i32> {
    // SAFETY: forwarded to the caller's contract above.
    let r = unsafe { libc::ioctl(fd, req as libc::c_ulong, arg) };
    if r < 0 {
        Err(errno())
    } else {
        Ok(r)
    }
}

/// One `PAGEMAP_SCAN` call on a pagemap file: fills `vec` with the runs of `arg.start..arg.end`
/// (`arg.vec` and `arg.vec_len` are set here, from `vec`) and returns how many entries it
/// filled; `arg.walk_end` says where the walk stopped. With [`PM_SCAN_WP_MATCHING`],
/// [`PM_SCAN_CHECK_WPASYNC`] is always added: only ranges registered with userfaultfd's
/// `WP_ASYNC` are write-protected (anything else fails).
pub(crate) fn pagemap_scan(
    pagemap: BorrowedFd<'_>,
    arg: &mut PmScanArg,
    vec: &mut [PageRegion],
) -> Result<usize, i32> {
    arg.size = std::mem::size_of::<PmScanArg>() as u64;
    arg.vec = vec.as_mut_ptr() as u64;
    arg.vec_len = vec.len() as u64;
    if arg.flags & PM_SCAN_WP_MATCHING != 0 {
        arg.flags |= PM_SCAN_CHECK_WPASYNC;
    }
    // SAFETY: `arg` is a live PmScanArg, the type PAGEMAP_SCAN takes, whose `vec` points to
    // `vec_len` writable PageRegions (plain old data: any bytes are a valid value) borrowed
    // for the call. The only change a scan makes is write-protecting pages with WP_MATCHING,
    // which CHECK_WPASYNC (always added above) restricts to memory registered with
    // userfaultfd's WP_ASYNC, whose registrant accepted write protection
    // (`Uffd::register`'s contract): in that mode it only affects tracking.
    let n = unsafe { ioctl(pagemap.as_raw_fd(), PAGEMAP_SCAN, arg) }?;
    Ok((n as usize).min(vec.len()))
}

pub(crate) use farmap_memory::sys::{errno, page_size};
