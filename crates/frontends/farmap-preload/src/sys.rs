//! Raw system calls through rustix's `linux_raw` backend: no libc symbol (which this library
//! may itself export, or which may allocate), no `errno` (so `free` keeps the caller's).

use core::ffi::c_void;
use core::fmt::{self, Write as _};
use core::ptr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::io::Errno;
use rustix::ioctl::{self, opcode, Opcode, Updater};
use rustix::mm::{Advice, MapFlags, ProtFlags};

/// Maps `len` bytes of private anonymous memory (`MAP_NORESERVE`: it costs what is touched);
/// null on failure.
pub(crate) fn map_anon(len: usize) -> *mut u8 {
    // SAFETY: a new private anonymous mapping at an address the kernel picks: it replaces
    // nothing, and nothing else refers to it yet.
    let p = unsafe {
        rustix::mm::mmap_anonymous(
            ptr::null_mut(),
            len,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::PRIVATE | MapFlags::NORESERVE,
        )
    };
    p.map_or(ptr::null_mut(), |p| p.cast())
}

/// Unmaps what [`map_anon`] returned.
///
/// # Safety
/// `p..p + len` is a mapping of this library that nothing uses any more.
pub(crate) unsafe fn unmap(p: *mut u8, len: usize) {
    // SAFETY: the caller's contract.
    let _ = unsafe { rustix::mm::munmap(p.cast(), len) };
}

/// `madvise(p, len, advice)`.
///
/// # Safety
/// Whatever the advice does to `p..p + len` (for `DONTNEED`: its pages read as zeros, or
/// fault to the region's handler) is acceptable to every user of that memory.
pub(crate) unsafe fn madvise(p: *mut u8, len: usize, advice: Advice) -> Result<(), Errno> {
    // SAFETY: the caller's contract.
    unsafe { rustix::mm::madvise(p.cast::<c_void>(), len, advice) }
}

/// Writes all of `bytes` to stderr (fd 2), ignoring errors.
pub(crate) fn write_stderr(mut bytes: &[u8]) {
    // SAFETY: fd 2 is borrowed for the calls below only; if the program closed it, the
    // writes fail harmlessly (or go wherever it points, as any stderr write would).
    let fd = unsafe { BorrowedFd::borrow_raw(2) };
    while !bytes.is_empty() {
        match rustix::io::write(fd, bytes) {
            Ok(0) | Err(_) => return,
            Ok(n) => bytes = &bytes[n..],
        }
    }
}

/// A line formatted on the stack (no allocation), cut at its capacity.
pub(crate) struct Line {
    buf: [u8; 512],
    len: usize,
}

impl Line {
    pub(crate) const fn new() -> Self {
        Self {
            buf: [0; 512],
            len: 0,
        }
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl fmt::Write for Line {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let n = s.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

/// Prints `farmap-preload: ARGS` and a newline on stderr, with no allocation.
pub(crate) fn say(args: fmt::Arguments<'_>) {
    let mut line = Line::new();
    let _ = line.write_str("farmap-preload: ");
    let _ = line.write_fmt(args);
    let _ = line.write_str("\n");
    write_stderr(line.as_bytes());
}

/// Ends the process at once with `status` (`_exit`: no atexit handlers, no flushing).
pub(crate) fn exit_now(status: i32) -> ! {
    // SAFETY: `_exit` is always safe to call; it does not return.
    unsafe { libc::_exit(status) }
}

/// Kills this process with `SIGKILL` (the handler is gone: nobody would serve its faults).
pub(crate) fn kill_self() -> ! {
    let _ = rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
    exit_now(137)
}

/// `struct uffdio_api`.
#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

/// `struct uffdio_register`.
#[repr(C)]
struct UffdioRegister {
    start: u64,
    len: u64,
    mode: u64,
    ioctls: u64,
}

/// `struct uffdio_move`.
#[repr(C)]
struct UffdioMove {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    moved: i64,
}

const UFFD_API: u64 = 0xAA;
const UFFDIO_API: Opcode = opcode::read_write::<UffdioApi>(0xAA, 0x3F);
const UFFDIO_REGISTER: Opcode = opcode::read_write::<UffdioRegister>(0xAA, 0x00);
const UFFDIO_MOVE: Opcode = opcode::read_write::<UffdioMove>(0xAA, 0x05);
const _: () = assert!(UFFDIO_API as u64 == 0xC018_AA3F);
const _: () = assert!(UFFDIO_REGISTER as u64 == 0xC020_AA00);
const _: () = assert!(UFFDIO_MOVE as u64 == 0xC028_AA05);

/// `UFFD_FEATURE_MOVE`.
pub(crate) const UFFD_FEATURE_MOVE: u64 = 1 << 16;
/// `UFFD_FEATURE_EVENT_FORK`.
pub(crate) const UFFD_FEATURE_EVENT_FORK: u64 = 1 << 1;
/// `UFFDIO_REGISTER_MODE_MISSING`.
pub(crate) const MODE_MISSING: u64 = 1 << 0;
/// `UFFDIO_REGISTER_MODE_WP`.
pub(crate) const MODE_WP: u64 = 1 << 1;

/// A userfaultfd (close-on-exec, non-blocking) with `features` enabled.
pub(crate) fn uffd_open(features: u64) -> Result<OwnedFd, Errno> {
    use rustix::mm::UserfaultfdFlags;
    // SAFETY: creating a userfaultfd has no effect on memory until ranges are registered.
    let fd =
        unsafe { rustix::mm::userfaultfd(UserfaultfdFlags::CLOEXEC | UserfaultfdFlags::NONBLOCK)? };
    let mut api = UffdioApi {
        api: UFFD_API,
        features,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_API takes a `struct uffdio_api`, which `UffdioApi` lays out.
    unsafe { ioctl::ioctl(&fd, Updater::<UFFDIO_API, UffdioApi>::new(&mut api))? };
    Ok(fd)
}

/// Registers `start..start + len` with `uffd` in `mode`.
///
/// # Safety
/// The range is a private anonymous mapping of this library that nothing has touched, and
/// whose faults (and moves) may from now on be served by whoever holds the fd.
pub(crate) unsafe fn uffd_register(
    uffd: BorrowedFd<'_>,
    start: usize,
    len: usize,
    mode: u64,
) -> Result<(), Errno> {
    let mut reg = UffdioRegister {
        start: start as u64,
        len: len as u64,
        mode,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_REGISTER takes a `struct uffdio_register`; the range's contract is
    // the caller's.
    unsafe {
        ioctl::ioctl(
            uffd,
            Updater::<UFFDIO_REGISTER, UffdioRegister>::new(&mut reg),
        )
    }
}

/// `UFFDIO_MOVE` of `len` bytes from `src` to `dst`, issued on `uffd` (the destination's);
/// the bytes moved, and the errno that stopped it (0 when all moved).
///
/// # Safety
/// Both ranges lie in areas registered by this library, whose users accept that present
/// pages go away and missing ones get filled (the handler's contract).
pub(crate) unsafe fn uffd_move(uffd: impl AsFd, src: u64, dst: u64, len: u64) -> (u64, i32) {
    let mut m = UffdioMove {
        dst,
        src,
        len,
        mode: 0,
        moved: 0,
    };
    // SAFETY: UFFDIO_MOVE takes a `struct uffdio_move`; the ranges' contract is the caller's.
    match unsafe { ioctl::ioctl(uffd, Updater::<UFFDIO_MOVE, UffdioMove>::new(&mut m)) } {
        Ok(()) => (len, 0),
        Err(e) => (m.moved.max(0) as u64, e.raw_os_error()),
    }
}
