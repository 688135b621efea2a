//! Safe wrappers of a userfaultfd: [`Uffd`] (the file descriptor: open, negotiate, register,
//! read messages) and [`UffdRange`] (a registered range: copy, wake, write-protect, poison,
//! each bounds-checked, with the kernel's `EEXIST`/`EAGAIN` answers mapped to our own enums as
//! Firecracker's handler does).

use std::fmt;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::sys::{self, UffdMsg};

/// A userfaultfd, opened `O_CLOEXEC | O_NONBLOCK`, past its `UFFDIO_API` handshake.
pub struct Uffd {
    fd: OwnedFd,
    features: u64,
    /// With `UFFD_FEATURE_SIGBUS` no thread waits in the kernel: faulting threads wait on
    /// this word, bumped by every operation that would have woken them.
    wakeups: Wakeups,
}

impl Uffd {
    /// The features this kernel supports, from a throwaway fd (`UFFDIO_API` with features 0
    /// reports the whole supported set; a second handshake on one fd is refused, hence the
    /// throwaway).
    pub fn probe() -> io::Result<u64> {
        let fd = open_raw()?;
        api(&fd, 0).map(|a| a.features)
    }

    /// Opens a userfaultfd and enables `features` (which must all be supported).
    pub fn open(features: u64) -> io::Result<Uffd> {
        let fd = open_raw()?;
        api(&fd, features)?;
        Ok(Uffd::from_owned(fd, features))
    }

    /// Adopts a userfaultfd that is already past its handshake (received from the process
    /// that opened it), with the features that process enabled.
    pub fn from_owned(fd: OwnedFd, features: u64) -> Uffd {
        Uffd {
            fd,
            features,
            wakeups: Wakeups::default(),
        }
    }

    /// What threads waiting for faults of this fd in a signal handler wait on
    /// (`UFFD_FEATURE_SIGBUS`; see the `signal` module).
    pub(crate) fn wakeups(&self) -> &Wakeups {
        &self.wakeups
    }

    /// Tells the threads waiting in a signal handler that pages may have arrived (with
    /// `UFFD_FEATURE_SIGBUS`; nothing otherwise: the kernel wakes its own waiters).
    fn woke(&self) {
        if self.features & sys::UFFD_FEATURE_SIGBUS != 0 {
            self.wakeups.bump();
        }
    }

    /// The features enabled at the handshake.
    pub fn features(&self) -> u64 {
        self.features
    }

    /// Registers `len` bytes at `start` in `mode` (`UFFDIO_REGISTER_MODE_*`); returns the
    /// ioctls available on the range (`1 << _UFFDIO_*` bits).
    ///
    /// # Safety
    /// `start..start+len` must be a page-aligned anonymous private mapping of this process
    /// owned by the caller, whose memory no Rust reference (`&`/`&mut`) covers while it is
    /// registered: once registered, anyone holding this fd (here or in a process it is sent
    /// to) may fill its missing pages, write-protect and unprotect it, and poison pages
    /// (touching them raises SIGBUS); touching a missing page blocks until a handler of this
    /// fd resolves it, and writes wait out write protection; present pages may be moved out
    /// (`UFFDIO_MOVE`: they are missing again and fault on the next touch) and missing ones
    /// filled by a move from another range of this fd. [`UffdRange`]'s safe methods rely
    /// on this contract for every range the kernel accepts.
    pub unsafe fn register(&self, start: usize, len: usize, mode: u64) -> io::Result<u64> {
        let mut reg = sys::UffdioRegister {
            range: sys::UffdioRange {
                start: start as u64,
                len: len as u64,
            },
            mode,
            ioctls: 0,
        };
        // SAFETY: `reg` is a live UffdioRegister, the type UFFDIO_REGISTER takes; the caller
        // vouches for the range (see above).
        unsafe { sys::ioctl(self.fd.as_raw_fd(), sys::UFFDIO_REGISTER, &mut reg) }
            .map_err(io::Error::from_raw_os_error)?;
        Ok(reg.ioctls)
    }

    /// Reads pending messages into `buf`; returns how many (0 when none is pending).
    pub fn read_messages(&self, buf: &mut [UffdMsg]) -> io::Result<usize> {
        let bytes = std::mem::size_of_val(buf);
        // SAFETY: `buf` is valid for writes of `bytes` bytes, and UffdMsg is plain old data:
        // any bytes the kernel writes form a valid value.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), bytes) };
        if n < 0 {
            let e = sys::errno();
            return if e == libc::EAGAIN || e == libc::EINTR {
                Ok(0)
            } else {
                Err(io::Error::from_raw_os_error(e))
            };
        }
        Ok(n as usize / std::mem::size_of::<UffdMsg>())
    }
}

/// The child's userfaultfd a `UFFD_EVENT_FORK` message carries (`None` for other messages),
/// owned from here: the kernel installed it in this process's fd table when the message was
/// read from a userfaultfd of this process, and only this message names it. Call once per
/// message read.
pub(crate) fn fork_event_fd(msg: &UffdMsg) -> Option<OwnedFd> {
    if msg.event != sys::UFFD_EVENT_FORK {
        return None;
    }
    let fd = msg.arg0 as u32 as RawFd;
    // SAFETY: see above; a message read once is turned into an OwnedFd once (the callers
    // hold the only copy of the message).
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
}

impl AsFd for Uffd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for Uffd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl fmt::Debug for Uffd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Uffd")
            .field("fd", &self.fd.as_raw_fd())
            .field("features", &format_args!("{:#x}", self.features))
            .finish()
    }
}

fn open_raw() -> io::Result<OwnedFd> {
    let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
    // SAFETY: the userfaultfd syscall takes one int of flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
    if fd >= 0 {
        // SAFETY: the kernel just returned this fd to us; nobody else owns it.
        return Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) });
    }
    let syscall_err = io::Error::last_os_error();
    // Without privilege (vm.unprivileged_userfaultfd = 0), /dev/userfaultfd may still work.
    open_dev(flags).map_err(|_| syscall_err)
}

fn open_dev(flags: i32) -> io::Result<OwnedFd> {
    // SAFETY: a NUL-terminated path and plain flags.
    let dev = unsafe { libc::open(c"/dev/userfaultfd".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if dev < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `dev` was just opened by us.
    let dev = unsafe { OwnedFd::from_raw_fd(dev) };
    // SAFETY: USERFAULTFD_IOC_NEW takes its flags as the plain integer argument.
    let fd = unsafe {
        libc::ioctl(
            dev.as_raw_fd(),
            sys::USERFAULTFD_IOC_NEW as libc::c_ulong,
            libc::c_long::from(flags),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this fd to us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn api(fd: &OwnedFd, features: u64) -> io::Result<sys::UffdioApi> {
    let mut a = sys::UffdioApi {
        api: sys::UFFD_API,
        features,
        ioctls: 0,
    };
    // SAFETY: `a` is a live UffdioApi, the type UFFDIO_API takes; it changes no memory.
    unsafe { sys::ioctl(fd.as_raw_fd(), sys::UFFDIO_API, &mut a) }
        .map_err(io::Error::from_raw_os_error)?;
    Ok(a)
}

/// Why a `UFFDIO_COPY` stopped (the kernel's answers, named).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyError {
    /// `EEXIST`: the first page of the range is already present.
    Exists,
    /// `EAGAIN` after copying this many bytes: continue after them.
    Partial(usize),
    /// `EAGAIN` with nothing copied: a non-cooperative event (a remove) is pending; the events
    /// must be read before copies succeed again.
    EventPending,
    /// `ENOENT` / `ESRCH`: the range is no longer registered, or its process has exited.
    Gone,
    /// Any other errno.
    Os(i32),
}

impl CopyError {
    /// The kernel's answer to a copy or continue of `len` bytes (`r`), `done` being the
    /// bytes it reports done (or a negated errno).
    fn answer(r: Result<i32, i32>, done: i64, len: usize) -> Result<usize, CopyError> {
        match r {
            Ok(_) => Ok(len),
            Err(libc::EAGAIN) if done > 0 => {
                let n = done as usize;
                if n >= len {
                    Ok(n)
                } else {
                    Err(CopyError::Partial(n))
                }
            }
            Err(libc::EAGAIN) => Err(CopyError::EventPending),
            Err(libc::EEXIST) => Err(CopyError::Exists),
            Err(libc::ENOENT | libc::ESRCH) => Err(CopyError::Gone),
            Err(e) => Err(CopyError::Os(e)),
        }
    }
}

/// Why [`UffdRange::install`] stopped before the end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InstallError {
    /// An event is pending: read the events, then call `install` again from `done`.
    EventPending {
        /// Bytes of the range handled so far (installed, or found present).
        done: usize,
    },
    /// The range is gone (unmapped, or its process exited).
    Gone,
    /// Any other errno.
    Os(i32),
}

/// What [`UffdRange::install`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Installed {
    /// Pages copied in.
    pub copied_pages: usize,
    /// Pages left alone because they were already present.
    pub present_pages: usize,
}

/// A range registered with a userfaultfd, in this process or in the one that sent the fd.
///
/// Every method takes offsets relative to the range and checks them; copies never overwrite
/// a present page (the kernel only fills missing ones).
#[derive(Clone)]
pub struct UffdRange {
    uffd: Arc<Uffd>,
    base: usize,
    len: usize,
    page: usize,
}

impl UffdRange {
    /// The range `base..base+len` (page-aligned), registered with `uffd` in the address space
    /// the fd belongs to (this process's, or the one that sent the fd).
    ///
    /// This is safe: every method is an ioctl that the kernel refuses (`ENOENT`, `EINVAL`)
    /// on addresses `uffd` has not registered, and on registered memory it only does what
    /// [`Uffd::register`]'s contract made the registrant accept (filling missing pages, waking,
    /// write protection, poisoning). Wrong bounds only make those calls fail.
    pub fn new(uffd: Arc<Uffd>, base: usize, len: usize) -> UffdRange {
        let page = sys::page_size();
        debug_assert!(
            base.is_multiple_of(page) && len.is_multiple_of(page),
            "unaligned uffd range"
        );
        UffdRange {
            uffd,
            base,
            len,
            page,
        }
    }

    /// The userfaultfd.
    pub fn uffd(&self) -> &Arc<Uffd> {
        &self.uffd
    }

    /// Start address.
    pub fn base(&self) -> usize {
        self.base
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The page size.
    pub fn page_size(&self) -> usize {
        self.page
    }

    /// Whether `addr` lies in the range.
    pub fn contains(&self, addr: usize) -> bool {
        addr >= self.base && addr - self.base < self.len
    }

    fn check(&self, offset: usize, len: usize) -> sys::UffdioRange {
        assert!(
            offset.is_multiple_of(self.page)
                && len.is_multiple_of(self.page)
                && offset.checked_add(len).is_some_and(|end| end <= self.len),
            "uffd range operation at {offset:#x}+{len:#x} outside 0+{:#x} or unaligned",
            self.len
        );
        sys::UffdioRange {
            start: (self.base + offset) as u64,
            len: len as u64,
        }
    }

    /// One `UFFDIO_COPY` of `src` to `offset` (`mode`: `UFFDIO_COPY_MODE_*`); returns the
    /// bytes copied (all of them) or why it stopped.
    ///
    /// # Panics
    /// If the destination is unaligned or outside the range.
    pub fn copy(&self, offset: usize, src: &[u8], mode: u64) -> Result<usize, CopyError> {
        let r = self.check(offset, src.len());
        let mut c = sys::UffdioCopy {
            dst: r.start,
            src: src.as_ptr() as u64,
            len: r.len,
            mode,
            copy: 0,
        };
        // SAFETY: `c` is a live UffdioCopy; `src` is a live slice, readable for `len` bytes for
        // the call. The kernel copies only into missing pages of memory registered with this
        // fd (anything else fails), whose registrant accepted them being filled
        // (`Uffd::register`'s contract); it never overwrites a present page.
        let r = unsafe { sys::ioctl(self.uffd.as_raw_fd(), sys::UFFDIO_COPY, &mut c) };
        if mode & sys::UFFDIO_COPY_MODE_DONTWAKE == 0 {
            self.uffd.woke();
        }
        CopyError::answer(r, c.copy, src.len())
    }

    /// Installs `data` at `offset` page by page where pages are missing, starting `from`
    /// bytes into it (0, or the `done` of an earlier [`InstallError::EventPending`]);
    /// `write_protect` installs the pages write-protected, so that only later writes count
    /// as written. Pages already present are left as they are (they hold newer data), and the
    /// range is woken if any was found, so that a thread that faulted on one goes on.
    ///
    /// # Panics
    /// If the destination is unaligned or outside the range, or `from` is past `data`.
    pub fn install(
        &self,
        offset: usize,
        data: &[u8],
        from: usize,
        write_protect: bool,
    ) -> Result<Installed, InstallError> {
        assert!(
            from <= data.len() && from.is_multiple_of(self.page),
            "bad resume offset"
        );
        let mode = if write_protect {
            sys::UFFDIO_COPY_MODE_WP
        } else {
            0
        };
        self.fill_missing(offset, data.len(), from, |at| {
            self.copy(offset + at, &data[at..], mode)
        })
    }

    /// Fills the missing pages of `offset..offset+len` from `from` bytes in, with `step(at)`
    /// (one ioctl from `at` bytes in to the end), skipping pages found present: the loop of
    /// [`install`](Self::install) and [`map_cached`](Self::map_cached).
    fn fill_missing(
        &self,
        offset: usize,
        len: usize,
        from: usize,
        step: impl Fn(usize) -> Result<usize, CopyError>,
    ) -> Result<Installed, InstallError> {
        let mut done = from;
        let mut report = Installed::default();
        while done < len {
            match step(done) {
                Ok(n) | Err(CopyError::Partial(n)) => {
                    report.copied_pages += n / self.page;
                    done += n;
                }
                Err(CopyError::Exists) => {
                    report.present_pages += 1;
                    done += self.page;
                }
                Err(CopyError::EventPending) => return Err(InstallError::EventPending { done }),
                Err(CopyError::Gone) => return Err(InstallError::Gone),
                Err(CopyError::Os(e)) => return Err(InstallError::Os(e)),
            }
        }
        if report.present_pages > 0 {
            // A page someone else installed was woken by their copy; waking again is cheap
            // insurance against a waiter that raced with it.
            let _ = self.wake(offset, len);
        }
        Ok(report)
    }

    /// One `UFFDIO_CONTINUE` of `offset..offset+len`: maps the pages the backing file's page
    /// cache holds there (`mode`: `UFFDIO_CONTINUE_MODE_*`); returns the bytes mapped (all of
    /// them) or why it stopped ([`CopyError::Exists`]: the first page is mapped already;
    /// [`CopyError::Os`] with `EFAULT`: the page cache lacks it).
    ///
    /// # Panics
    /// If the range is unaligned or outside the registered one.
    pub fn continue_pages(&self, offset: usize, len: usize, mode: u64) -> Result<usize, CopyError> {
        let range = self.check(offset, len);
        let mut c = sys::UffdioContinue {
            range,
            mode,
            mapped: 0,
        };
        // SAFETY: `c` is a live UffdioContinue. The kernel maps, into pages of memory
        // registered with this fd for minor faults and not mapped yet, what the page cache of
        // the mapped file holds there; it never replaces a mapped page.
        let r = unsafe { sys::ioctl(self.uffd.as_raw_fd(), sys::UFFDIO_CONTINUE, &mut c) };
        if mode & sys::UFFDIO_CONTINUE_MODE_DONTWAKE == 0 {
            self.uffd.woke();
        }
        CopyError::answer(r, c.mapped, len)
    }

    /// [`install`](Self::install) from the page cache of the mapped file: maps
    /// `offset..offset+len` page by page where pages are missing, starting `from` bytes in,
    /// with `UFFDIO_CONTINUE` (the file must hold every page of the range).
    ///
    /// # Panics
    /// If the range is unaligned or outside the registered one, or `from` is past it.
    pub fn map_cached(
        &self,
        offset: usize,
        len: usize,
        from: usize,
        write_protect: bool,
    ) -> Result<Installed, InstallError> {
        assert!(
            from <= len && from.is_multiple_of(self.page),
            "bad resume offset"
        );
        let mode = if write_protect {
            sys::UFFDIO_CONTINUE_MODE_WP
        } else {
            0
        };
        self.fill_missing(offset, len, from, |at| {
            self.continue_pages(offset + at, len - at, mode)
        })
    }

    /// Wakes the threads blocked on faults in `offset..offset+len`.
    ///
    /// # Panics
    /// If the range is unaligned or outside the registered one.
    pub fn wake(&self, offset: usize, len: usize) -> io::Result<()> {
        let mut r = self.check(offset, len);
        // SAFETY: `r` is a live UffdioRange; waking changes no memory.
        let woken = unsafe { sys::ioctl(self.uffd.as_raw_fd(), sys::UFFDIO_WAKE, &mut r) };
        self.uffd.woke();
        woken.map(|_| ()).map_err(io::Error::from_raw_os_error)
    }

    /// Write-protects (`protect`) or unprotects `offset..offset+len`; when unprotecting,
    /// `wake` wakes the threads blocked on it. `Err(EAGAIN)` while an event is pending.
    ///
    /// # Panics
    /// If the range is unaligned or outside the registered one.
    pub fn write_protect(
        &self,
        offset: usize,
        len: usize,
        protect: bool,
        wake: bool,
    ) -> Result<(), i32> {
        let mut mode = 0;
        if protect {
            mode |= sys::UFFDIO_WRITEPROTECT_MODE_WP;
        }
        // Protecting wakes nobody, and the kernel refuses DONTWAKE with it (EINVAL).
        if !wake && !protect {
            mode |= sys::UFFDIO_WRITEPROTECT_MODE_DONTWAKE;
        }
        let mut w = sys::UffdioWriteprotect {
            range: self.check(offset, len),
            mode,
        };
        // SAFETY: `w` is a live UffdioWriteprotect; the kernel only changes the protection of
        // memory registered with this fd in write-protect mode, whose registrant accepted it
        // (`Uffd::register`'s contract); no content changes.
        let r = unsafe { sys::ioctl(self.uffd.as_raw_fd(), sys::UFFDIO_WRITEPROTECT, &mut w) };
        if wake && !protect {
            self.uffd.woke();
        }
        r.map(|_| ())
    }

    /// Poisons the missing pages of `offset..offset+len` and wakes their waiters: touching
    /// them raises SIGBUS. `Err(EEXIST)` if a page is present, `Err(EAGAIN)` while an event
    /// is pending.
    ///
    /// # Panics
    /// If the range is unaligned or outside the registered one.
    pub fn poison(&self, offset: usize, len: usize) -> Result<(), i32> {
        let mut p = sys::UffdioPoison {
            range: self.check(offset, len),
            mode: 0,
            updated: 0,
        };
        // SAFETY: `p` is a live UffdioPoison; the kernel only poisons missing pages of memory
        // registered with this fd, whose registrant accepted that (`Uffd::register`'s
        // contract): touching them raises SIGBUS, no content changes.
        let r = unsafe { sys::ioctl(self.uffd.as_raw_fd(), sys::UFFDIO_POISON, &mut p) };
        self.uffd.woke();
        r.map(|_| ())
    }

    /// Maps the shared zero page at the missing pages of `offset..offset+len` with one
    /// `UFFDIO_ZEROPAGE` (`dontwake`: without waking the threads waiting on them). Returns
    /// why it stopped, as [`copy`](Self::copy) does (`Exists`: the first page is not empty,
    /// a write-protect marker included; `Partial`; `EventPending`; `Gone`).
    ///
    /// # Panics
    /// If the range is unaligned or outside the registered one.
    pub fn zeropage(&self, offset: usize, len: usize, dontwake: bool) -> Result<usize, CopyError> {
        let mut z = sys::UffdioZeropage {
            range: self.check(offset, len),
            mode: if dontwake {
                sys::UFFDIO_ZEROPAGE_MODE_DONTWAKE
            } else {
                0
            },
            zeropage: 0,
        };
        // SAFETY: `z` is a live UffdioZeropage. The kernel only maps the zero page at missing
        // pages of memory registered with this fd, whose registrant accepted them being
        // filled (`Uffd::register`'s contract); it never replaces a present page.
        let r = unsafe { sys::ioctl(self.uffd.as_raw_fd(), sys::UFFDIO_ZEROPAGE, &mut z) };
        if !dontwake {
            self.uffd.woke();
        }
        match r {
            Ok(_) => Ok(len),
            Err(libc::EAGAIN) if z.zeropage > 0 => Err(CopyError::Partial(z.zeropage as usize)),
            Err(libc::EAGAIN) => Err(CopyError::EventPending),
            Err(libc::EEXIST) => Err(CopyError::Exists),
            Err(libc::ENOENT | libc::ESRCH) => Err(CopyError::Gone),
            Err(e) => Err(CopyError::Os(e)),
        }
    }

    /// Moves the pages of `offset..offset+len` to `dst_offset` in `dst` with one
    /// `UFFDIO_MOVE` (`mode`: `UFFDIO_MOVE_MODE_*`): they become missing here (the next touch
    /// faults) and present there, with no copy. The ioctl is issued on the destination's
    /// userfaultfd: the kernel requires the destination to be registered with the fd the
    /// ioctl is issued on, and checks nothing of the kind for the source (another
    /// userfaultfd's range works; the test `moves_cross_userfaultfds_and_quiet_discards_raise_no_event`).
    /// The destination pages must be missing.
    /// Returns the bytes moved, or how many were moved before it stopped and the errno
    /// (`EEXIST`: a destination page is present; `ENOENT`: a source page is missing;
    /// `EAGAIN`: an event is pending, or a page is busy; `EBUSY`: a shared page).
    ///
    /// # Panics
    /// If either range is unaligned or outside its registered range.
    pub fn move_to(
        &self,
        offset: usize,
        dst: &UffdRange,
        dst_offset: usize,
        len: usize,
        mode: u64,
    ) -> Result<usize, (usize, i32)> {
        let src = self.check(offset, len);
        let to = dst.check(dst_offset, len);
        let mut m = sys::UffdioMove {
            dst: to.start,
            src: src.start,
            len: len as u64,
            mode,
            moved: 0,
        };
        // SAFETY: `m` is a live UffdioMove. The kernel moves pages only between ranges
        // registered with this fd (anything else fails), whose registrants accepted that their
        // present pages may be taken away (they fault again, `Uffd::register`'s contract) and
        // their missing pages filled; no page is duplicated or exposed elsewhere.
        let r = unsafe { sys::ioctl(dst.uffd.as_raw_fd(), sys::UFFDIO_MOVE, &mut m) };
        if mode & sys::UFFDIO_MOVE_MODE_DONTWAKE == 0 {
            dst.uffd.woke();
        }
        match r {
            Ok(_) => Ok(len),
            Err(e) => Err((m.moved.max(0) as usize, e)),
        }
    }
}

impl fmt::Debug for UffdRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UffdRange")
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.len)
            .field("uffd", &self.uffd)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mapping::{Mapping, OwnedMapping};
    use crate::pagemap::Pagemap;

    const PAGE: usize = 4096;

    /// A registered 64 KiB mapping, or `None` (a recorded skip) where userfaultfd is refused.
    fn registered(test: &str) -> Option<(OwnedMapping, UffdRange)> {
        let uffd = match Uffd::open(0) {
            Ok(u) => u,
            Err(e) => {
                farmap_testkit::skip(test, format!("userfaultfd: {e}"));
                return None;
            }
        };
        let mapping = OwnedMapping::new(16 * PAGE, None).unwrap();
        mapping
            .register(&uffd, sys::UFFDIO_REGISTER_MODE_MISSING)
            .unwrap();
        let range = UffdRange::new(Arc::new(uffd), mapping.addr(), mapping.len());
        Some((mapping, range))
    }

    fn discard(mapping: &Mapping, page: usize) {
        mapping.discard(page * PAGE, PAGE).unwrap().unwrap();
    }

    #[test]
    fn copies_map_the_kernel_answers() {
        let Some((mapping, range)) = registered("uffd::copies_map_the_kernel_answers") else {
            return;
        };
        let data: Vec<u8> = (0..16 * PAGE).map(|i| (i / PAGE) as u8 + 1).collect();
        assert_eq!(range.copy(5 * PAGE, &data[..PAGE], 0), Ok(PAGE));
        assert_eq!(
            range.copy(5 * PAGE, &data[..PAGE], 0),
            Err(CopyError::Exists)
        );
        assert_eq!(range.copy(0, &data, 0), Err(CopyError::Partial(5 * PAGE)));
        // install goes on past present pages (0..=5 now), and does not overwrite them.
        let done = range.install(0, &data, 0, false).unwrap();
        assert_eq!(
            done,
            Installed {
                copied_pages: 10,
                present_pages: 6
            }
        );
        let mut page5 = vec![0u8; PAGE];
        assert!(mapping.read(5 * PAGE, &mut page5));
        assert!(
            page5.iter().all(|&b| b == 1),
            "page 5 kept its first content"
        );
        let again = range.install(0, &data, 0, false).unwrap();
        assert_eq!(
            again,
            Installed {
                copied_pages: 0,
                present_pages: 16
            }
        );
        // A discarded page is filled again, alone.
        discard(&mapping, 9);
        let pm = Pagemap::open_self().unwrap();
        let (base, end) = (range.base(), range.base() + range.len());
        assert!(!pm.all_present(base, end).unwrap());
        assert!(pm.all_present(base, base + 9 * PAGE).unwrap());
        assert_eq!(range.install(0, &data, 0, false).unwrap().copied_pages, 1);
        assert!(pm.all_present(base, end).unwrap());
        let mut all = vec![0u8; 16 * PAGE];
        assert!(mapping.read(0, &mut all));
        let mut want = data.clone();
        want[5 * PAGE..6 * PAGE].fill(1);
        assert!(all == want);
    }

    #[test]
    fn poisoned_pages_can_be_filled_later() {
        let test = "uffd::poisoned_pages_can_be_filled_later";
        let Some((mapping, range)) = registered(test) else {
            return;
        };
        if range.poison(3 * PAGE, PAGE) == Err(libc::EINVAL) {
            farmap_testkit::skip(test, "UFFDIO_POISON is not supported here");
            return;
        }
        assert_eq!(
            range.poison(3 * PAGE, PAGE),
            Err(libc::EEXIST),
            "a poisoned page is not missing"
        );
        let data = vec![7u8; 16 * PAGE];
        // A later successful fetch replaces the poison (the store recovered).
        assert_eq!(range.install(0, &data, 0, false).unwrap().copied_pages, 16);
        let mut page = vec![0u8; PAGE];
        assert!(mapping.read(3 * PAGE, &mut page));
        assert!(page.iter().all(|&b| b == 7));
        assert_eq!(
            range.poison(3 * PAGE, PAGE),
            Err(libc::EEXIST),
            "present pages are not poisoned"
        );
    }

    #[test]
    fn out_of_range_copies_panic() {
        let Some((_mapping, range)) = registered("uffd::out_of_range_copies_panic") else {
            return;
        };
        for (offset, len) in [(16 * PAGE, PAGE), (15 * PAGE, 2 * PAGE), (PAGE / 2, PAGE)] {
            let panic = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                range.copy(offset, &vec![0u8; len], 0)
            }))
            .expect_err("a copy outside the range or unaligned must panic");
            let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
            assert!(message.contains("outside"), "panic message: {message:?}");
        }
    }
}

#[cfg(test)]
mod quiet_staging {
    use super::*;
    use crate::mapping::OwnedMapping;

    const PAGE: usize = 4096;

    /// The kernel facts the pager's staging area rests on: `UFFDIO_MOVE` checks only that
    /// the destination is registered with the userfaultfd the ioctl is issued on, so pages
    /// move between a range of one userfaultfd and a range of another; and discarding a
    /// range whose userfaultfd has no `UFFD_FEATURE_EVENT_REMOVE` raises no event on the
    /// other one (copies into the first never see `EAGAIN` for it).
    #[test]
    fn moves_cross_userfaultfds_and_quiet_discards_raise_no_event() {
        let support = match Uffd::probe() {
            Ok(f) => f,
            Err(e) => {
                farmap_testkit::skip("quiet_staging", format!("userfaultfd: {e}"));
                return;
            }
        };
        if support & sys::UFFD_FEATURE_MOVE == 0 {
            farmap_testkit::skip("quiet_staging", "no UFFDIO_MOVE");
            return;
        }
        let loud =
            Arc::new(Uffd::open(sys::UFFD_FEATURE_EVENT_REMOVE | sys::UFFD_FEATURE_MOVE).unwrap());
        let quiet = Arc::new(Uffd::open(sys::UFFD_FEATURE_MOVE).unwrap());
        let region = OwnedMapping::new(4 * PAGE, None).unwrap();
        region
            .register(
                &loud,
                sys::UFFDIO_REGISTER_MODE_MISSING | sys::UFFDIO_REGISTER_MODE_WP,
            )
            .unwrap();
        let staging = OwnedMapping::new(4 * PAGE, None).unwrap();
        staging
            .register(&quiet, sys::UFFDIO_REGISTER_MODE_WP)
            .unwrap();
        let r_loud = UffdRange::new(loud.clone(), region.addr(), region.len());
        let s_quiet = UffdRange::new(quiet.clone(), staging.addr(), staging.len());
        let data = vec![7u8; 2 * PAGE];
        r_loud.copy(0, &data, 0).unwrap();
        // Region → staging: issued on the staging's (quiet) fd.
        assert_eq!(
            r_loud.move_to(0, &s_quiet, 0, 2 * PAGE, sys::UFFDIO_MOVE_MODE_DONTWAKE),
            Ok(2 * PAGE)
        );
        assert_eq!(staging.slice().load_u8(PAGE + 5).unwrap(), 7);
        // Staging → region: issued on the region's (loud) fd.
        assert_eq!(
            s_quiet.move_to(0, &r_loud, 0, PAGE, sys::UFFDIO_MOVE_MODE_DONTWAKE),
            Ok(PAGE)
        );
        assert_eq!(region.slice().load_u8(5).unwrap(), 7);
        // Discarding the staging area raises nothing on the loud fd, and a hole of a range
        // registered for write protection only reads as zeros (no fault waits).
        staging.discard(PAGE, PAGE).unwrap().unwrap();
        let mut msgs = [UffdMsg::default(); 4];
        assert_eq!(loud.read_messages(&mut msgs).unwrap(), 0, "no remove event");
        assert_eq!(staging.slice().load_u8(PAGE + 5).unwrap(), 0);
    }
}

/// A word that faulting threads wait on in a signal handler, bumped by every operation that
/// would wake a thread blocked in the kernel.
#[derive(Debug, Default)]
pub(crate) struct Wakeups {
    generation: AtomicU32,
    sleepers: AtomicU32,
}

impl Wakeups {
    /// Bumps the word, and wakes the threads in `futex(2)` on it if there are any.
    pub fn bump(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            // SAFETY: FUTEX_WAKE on a live, aligned u32; changes no memory.
            unsafe {
                libc::syscall(
                    libc::SYS_futex,
                    self.generation.as_ptr(),
                    libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
                    i32::MAX,
                );
            }
        }
    }

    pub(crate) fn current(&self) -> u32 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Waits until the word moves past `seen`: spinning for up to `spin`, then in `futex(2)`
    /// for up to `timeout` (a thread that returns without its page faults again).
    pub(crate) fn wait_past(&self, seen: u32, spin: Duration, timeout: Duration) {
        if !spin.is_zero() {
            let until = Instant::now() + spin;
            while self.current() == seen {
                if Instant::now() >= until {
                    break;
                }
                std::hint::spin_loop();
            }
            if self.current() != seen {
                return;
            }
        }
        let ts = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        // SAFETY: FUTEX_WAIT on a live, aligned u32 with a live timespec; it only sleeps.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                self.generation.as_ptr(),
                libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
                seen,
                &ts as *const libc::timespec,
            );
        }
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
    }
}
