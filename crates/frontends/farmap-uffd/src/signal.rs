//! In-thread fault resolution (`UFFD_FEATURE_SIGBUS`): the faulting thread moves a staged
//! chunk back itself, with no other thread involved.
//!
//! A fault served by the reader thread costs two wake-ups: the reader's (woken by the
//! fault) and the faulting thread's (woken by the copy or move). On a VM each is tens of µs
//! when the woken CPU was idle. A bounded region's staged chunks need no I/O to come back (one
//! `UFFDIO_MOVE`), so waking anyone is most of their cost. With
//! [`PagingOptions::in_thread`](crate::PagingOptions) the region's userfaultfd is opened with
//! `UFFD_FEATURE_SIGBUS`: a missing page raises `SIGBUS` in the faulting thread instead of
//! queueing a message, and this module's handler resolves it there:
//!
//! ```text
//!   faulting thread: SIGBUS (BUS_ADRERR, si_addr in a registered region)
//!     ├─ staged chunk, pager lock free ─▶ UFFDIO_MOVE back, re-protect, mark dirty: return
//!     │                                   (the access is retried and finds its page)
//!     └─ anything else ─▶ post {addr, tid} on the region's pipe ─▶ the reader thread handles
//!                          it like a fault message (fetch, zero fill, wait for room …)
//!        wait: spin (a poll window) or futex-wait on the fd's wake-up word ◀─ bumped by every
//!        copy, move, zero fill, wake and poison; then return, and the access is retried
//! ```
//!
//! A thread that returns too early (another page's install woke it) faults again and posts
//! again; the reader finds its fault in flight or served. Signals with other codes (a
//! poisoned page: `BUS_MCEERR_AR`), or at addresses outside every registered region, go to
//! the handler installed before farmap's (the default one kills the process, as it would
//! have without farmap).
//!
//! # What the mode costs
//! - Kernel-mode accesses do not wait: a system call that reads or writes a missing page of
//!   the region (`read(2)` into it, for example) fails with `EFAULT` instead of blocking
//!   until the page arrives. Only plain loads and stores are served.
//! - `SIGBUS` is process-wide: a handler installed after the region opened (and not chaining
//!   to the one it replaced) takes the faults away, and the application dies on its first
//!   fault. Handlers installed before are chained to.
//! - The handler runs on the faulting thread's stack, and takes the pager's lock only with a
//!   `try_lock`: a thread whose stack lives in the region, or that faults while holding the
//!   pager's lock (farmap's own threads never do), is not served.
//!
//! What the handler does is async-signal-safe: atomics, a `try_lock`, ioctls, `write(2)`,
//! `futex(2)`, `gettid`; no allocation (the active FIFO's capacity is reserved up front, and
//! a full one sends the fault to the reader) and no lock that it could wait on. `errno` is
//! saved and restored.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::paging::{InThread, Pager};
use crate::stats::Counters;
use crate::sys::{self, UffdMsg};
use crate::uffd::{Uffd, UffdRange};

/// How long a thread waits in `futex(2)` before it retries its access (and posts its fault
/// again): only a safety net, every install wakes it.
const WAIT_TIMEOUT: Duration = Duration::from_millis(10);

/// One fault posted to the reader: `[address, thread id]`, native endian.
const POST_LEN: usize = 16;

/// A region served in the faulting thread.
pub(crate) struct SignalPath {
    base: usize,
    len: usize,
    page: usize,
    chunk_shift: u32,
    pager: Arc<Pager>,
    uffd: Arc<Uffd>,
    counters: Arc<Counters>,
    /// How long a thread spins for its page before it sleeps (the poll window, or 0).
    spin: Duration,
    /// Write end of the pipe the reader reads faults it must serve from.
    post: OwnedFd,
    /// Read end (the reader's).
    posted: OwnedFd,
}

impl SignalPath {
    /// Serves faults of `region` (chunks of `1 << chunk_shift` bytes) for `pager`.
    pub fn new(
        region: &UffdRange,
        chunk_shift: u32,
        pager: Arc<Pager>,
        counters: Arc<Counters>,
        spin: Duration,
    ) -> io::Result<SignalPath> {
        let mut fds = [0; 2];
        // SAFETY: pipe2 writes two fds into a live array of two ints.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the kernel just returned these fds to us; nobody else owns them.
        let (posted, post) =
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        Ok(SignalPath {
            base: region.base(),
            len: region.len(),
            page: region.page_size(),
            chunk_shift,
            pager,
            uffd: region.uffd().clone(),
            counters,
            spin,
            post,
            posted,
        })
    }

    /// The fd the reader polls for posted faults.
    pub fn posted(&self) -> BorrowedFd<'_> {
        self.posted.as_fd()
    }

    /// Reads posted faults into `msgs` as fault messages (non-blocking); returns how many.
    pub fn read_posted(&self, msgs: &mut [UffdMsg]) -> usize {
        let mut buf = [0u8; POST_LEN * 64];
        let max = msgs.len().min(64) * POST_LEN;
        // SAFETY: `buf` is valid for writes of `max` bytes.
        let n = unsafe { libc::read(self.posted.as_raw_fd(), buf.as_mut_ptr().cast(), max) };
        if n <= 0 {
            return 0;
        }
        // Posts are written whole (16 bytes < PIPE_BUF), so reads see whole posts.
        let count = n as usize / POST_LEN;
        for (m, post) in msgs.iter_mut().zip(buf.chunks_exact(POST_LEN)).take(count) {
            let word = |i: usize| u64::from_ne_bytes(post[i..i + 8].try_into().unwrap());
            *m = UffdMsg {
                event: sys::UFFD_EVENT_PAGEFAULT,
                arg0: 0,
                arg1: word(0),
                arg2: word(8),
                ..UffdMsg::default()
            };
        }
        count
    }

    fn contains(&self, addr: usize) -> bool {
        addr >= self.base && addr < self.base + self.len
    }

    /// Serves a fault at `addr` (in the region) on the faulting thread; called in the
    /// signal handler.
    fn resolve(&self, addr: usize) {
        let page = (addr - self.base) & !(self.page - 1);
        let idx = (page as u64) >> self.chunk_shift;
        match self.pager.move_back_in_thread(idx) {
            InThread::Done => {
                Counters::add(&self.counters.faults_in_thread, 1);
                return;
            }
            InThread::Elsewhere => {}
        }
        let wakeups = self.uffd.wakeups();
        let seen = wakeups.current();
        // SAFETY: gettid takes nothing.
        let tid = unsafe { libc::gettid() } as u64;
        let mut post = [0u8; POST_LEN];
        post[..8].copy_from_slice(&(addr as u64).to_ne_bytes());
        post[8..].copy_from_slice(&tid.to_ne_bytes());
        // SAFETY: `post` is readable for POST_LEN bytes. A full pipe (EAGAIN) only delays
        // the fault: the thread waits out the timeout and posts again.
        unsafe { libc::write(self.post.as_raw_fd(), post.as_ptr().cast(), POST_LEN) };
        Counters::add(&self.counters.faults_signalled, 1);
        wakeups.wait_past(seen, self.spin, WAIT_TIMEOUT);
    }
}

/// The regions served in their faulting threads, looked up by the handler without a lock.
struct Slot {
    path: AtomicPtr<SignalPath>,
    /// Handlers using `path` now: unregistering waits for them.
    users: AtomicUsize,
}

const SLOTS: usize = 64;

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Slot = Slot {
    path: AtomicPtr::new(std::ptr::null_mut()),
    users: AtomicUsize::new(0),
};

static REGISTRY: [Slot; SLOTS] = [EMPTY; SLOTS];

/// The SIGBUS action installed before farmap's (chained to for other signals).
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

/// A region registered with the handler; unregisters on drop (waiting for handlers using it).
pub(crate) struct Registration {
    slot: usize,
    /// Kept alive while the registry points at it.
    _path: Arc<SignalPath>,
}

impl Registration {
    /// Installs the handler (once per process) and registers `path`.
    pub fn new(path: Arc<SignalPath>) -> io::Result<Registration> {
        install_handler()?;
        let ptr = Arc::as_ptr(&path).cast_mut();
        for (slot, s) in REGISTRY.iter().enumerate() {
            if s.path
                .compare_exchange(
                    std::ptr::null_mut(),
                    ptr,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                )
                .is_ok()
            {
                return Ok(Registration { slot, _path: path });
            }
        }
        Err(io::Error::other(format!(
            "at most {SLOTS} regions per process can resolve faults in the faulting thread"
        )))
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let s = &REGISTRY[self.slot];
        s.path.store(std::ptr::null_mut(), Ordering::SeqCst);
        // A handler that loaded the pointer before it was cleared has counted itself in
        // `users`: wait for it (it waits WAIT_TIMEOUT at most, then returns).
        while s.users.load(Ordering::SeqCst) > 0 {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("slot", &self.slot)
            .finish()
    }
}

fn install_handler() -> io::Result<()> {
    static INSTALLED: OnceLock<Result<(), i32>> = OnceLock::new();
    INSTALLED
        .get_or_init(|| {
            // SAFETY: plain-old-data structs filled before use; sigaction installs a handler
            // that only does async-signal-safe work (see the module docs).
            unsafe {
                let mut act: libc::sigaction = std::mem::zeroed();
                act.sa_sigaction = on_sigbus as *const () as usize;
                // SA_NODEFER with an empty mask: delivering the signal leaves the thread's
                // signal mask as it was, so neither the delivery nor the return
                // (`rt_sigreturn`) takes the signal lock to change it (measured: 0.1 µs of a
                // 5 µs re-fault). The handler raises no SIGBUS of its own. A chained handler
                // that raises one re-enters this one, is chained to again, and so on until
                // the stack overflows: the process dies, as it would have with the signal
                // blocked (the kernel kills a thread whose blocked SIGBUS it must deliver).
                act.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART | libc::SA_NODEFER;
                libc::sigemptyset(&mut act.sa_mask);
                let mut old: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(libc::SIGBUS, &act, &mut old) != 0 {
                    return Err(sys::errno());
                }
                let _ = PREVIOUS.set(old);
            }
            Ok(())
        })
        .map_err(io::Error::from_raw_os_error)
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: errno is this thread's; restored before returning to the interrupted code.
    let errno = unsafe { *libc::__errno_location() };
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler.
    let served = unsafe { serve(&*info) };
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
    if !served {
        chain(sig, info, ctx);
    }
}

/// Serves the fault if it is a userfaultfd SIGBUS in a registered region.
///
/// # Safety
/// `info` is the siginfo of a SIGBUS being handled.
unsafe fn serve(info: &libc::siginfo_t) -> bool {
    if info.si_code != libc::BUS_ADRERR {
        return false;
    }
    // SAFETY: SIGBUS's siginfo carries si_addr.
    let addr = unsafe { info.si_addr() } as usize;
    for s in &REGISTRY {
        if s.path.load(Ordering::Relaxed).is_null() {
            continue;
        }
        s.users.fetch_add(1, Ordering::SeqCst);
        let p = s.path.load(Ordering::SeqCst);
        // SAFETY: a registered pointer stays valid while `users` counts us (unregistering
        // clears it, then waits for users to leave).
        let path = (!p.is_null()).then(|| unsafe { &*p });
        let served = path.is_some_and(|path| path.contains(addr));
        if let (true, Some(path)) = (served, path) {
            path.resolve(addr);
        }
        s.users.fetch_sub(1, Ordering::SeqCst);
        if served {
            return true;
        }
    }
    false
}

/// Hands a SIGBUS that is not ours to the action installed before farmap's; with none (or
/// the default), restores the default action: returning retries the access, which raises
/// the signal again and kills the process, as it would have without farmap.
fn chain(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let Some(old) = PREVIOUS.get() else {
        return;
    };
    let handler = old.sa_sigaction;
    if handler == libc::SIG_DFL || handler == libc::SIG_IGN {
        // SAFETY: restores the default action for SIGBUS; async-signal-safe.
        unsafe {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut());
        }
        return;
    }
    if old.sa_flags & libc::SA_SIGINFO != 0 {
        // SAFETY: the previous action registered this function with SA_SIGINFO.
        let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
            unsafe { std::mem::transmute(handler) };
        f(sig, info, ctx);
    } else {
        // SAFETY: the previous action registered this function without SA_SIGINFO.
        let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(handler) };
        f(sig);
    }
}
