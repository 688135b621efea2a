//! The session with `farmap run`: the handshake on `FARMAP_RUN_SOCK` (docs/design/farmap-run.md
//! §2.1) and, after the verdict, the reaper thread on the same socket (§2.2, §2.5).
//!
//! ```text
//! Hello{token, pid} ──▶            ◀── Config{region_len, chunk_size, trash_len, features}
//! map + register region (MISSING|WP) and staging+trash (WP), MADV_DONTFORK (region: unless
//! it has fork events)
//! Registered{areas} + [region uffd, staging uffd, pagemap, mem] ──▶
//!                                  ◀── Verdict{0} (or a refusal)
//! reaper:                          ◀── Request{id, Discard|Move}
//!         Done{id, errno, bytes} ──▶
//! ```
//!
//! Requests that arrive before the verdict are served by the thread doing the handshake
//! (the handler may start its pager before it answers). Nothing here allocates.

use core::ffi::{c_void, CStr};
use core::fmt;
use core::mem::MaybeUninit;
use core::ptr;
use core::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use core::time::Duration;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, IntoRawFd, OwnedFd};

use farmap_run_proto::{
    decode, Config, Done, ForkPrepare, Hello, Msg, Op, Refusal, Registered, Request, Verdict,
    DONE_LEN, MAX_MSG_LEN, MAX_PIPELINE, TOKEN_LEN,
};
use rustix::io::Errno;
use rustix::mm::Advice;
use rustix::net::{
    AddressFamily, SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketType,
};

use crate::sys;

/// How long the handshake waits for each of the handler's answers.
const HANDSHAKE_WAIT: Duration = Duration::from_secs(30);

/// Why a session could not be opened.
#[derive(Debug, Clone, Copy)]
pub(crate) enum SessionError {
    /// `FARMAP_RUN_TOKEN` is missing or not 64 hex digits.
    Token,
    /// A system call failed: what it was for.
    Sys(&'static str, Errno),
    /// The handler sent bytes that are not a message.
    Proto(farmap_run_proto::Error),
    /// The handler sent a message out of turn: what was expected.
    Unexpected(&'static str),
    /// The handler closed the socket.
    Closed,
    /// The handler refused (a [`Refusal`] code).
    Refused(u16),
}

impl fmt::Display for SessionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Token => f.write_str("FARMAP_RUN_TOKEN is not 64 hex digits"),
            Self::Sys(what, e) => write!(f, "{what}: {e}"),
            Self::Proto(e) => write!(f, "farmap run sent a bad message: {e}"),
            Self::Unexpected(what) => write!(f, "farmap run did not send {what}"),
            Self::Closed => f.write_str("farmap run closed the session's socket"),
            Self::Refused(code) => match Refusal::from_status(*code) {
                Some(r) => write!(f, "farmap run refused this program: {r:?}"),
                None => write!(f, "farmap run refused this program (status {code})"),
            },
        }
    }
}

fn sys_err(what: &'static str) -> impl Fn(Errno) -> SessionError {
    move |e| SessionError::Sys(what, e)
}

/// One of the program's two areas (the region; the staging area with its trash).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Area {
    pub(crate) start: u64,
    pub(crate) len: u64,
}

impl Area {
    fn holds(&self, start: u64, len: u64) -> bool {
        len > 0
            && start >= self.start
            && start
                .checked_add(len)
                .is_some_and(|end| end <= self.start + self.len)
    }
}

/// What a valid request does: which area (index) a move's destination is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Action {
    Discard {
        start: u64,
        len: u64,
    },
    Touch {
        start: u64,
        len: u64,
    },
    Move {
        src: u64,
        dst: u64,
        len: u64,
        dst_area: usize,
    },
}

/// Checks a request against the program's areas: each range wholly inside one of them
/// (else `EINVAL`, and nothing is done).
pub(crate) fn validate(areas: &[Area; 2], op: Op) -> Result<Action, i32> {
    let area_of = |start: u64, len: u64| areas.iter().position(|a| a.holds(start, len));
    match op {
        Op::Discard { start, len } => area_of(start, len)
            .map(|_| Action::Discard { start, len })
            .ok_or(libc::EINVAL),
        // The region only: the staging area's pages are never shared with a child.
        Op::Touch { start, len } => (area_of(start, len) == Some(0))
            .then_some(Action::Touch { start, len })
            .ok_or(libc::EINVAL),
        Op::Move { src, dst, len } => match (area_of(src, len), area_of(dst, len)) {
            (Some(_), Some(dst_area)) => Ok(Action::Move {
                src,
                dst,
                len,
                dst_area,
            }),
            _ => Err(libc::EINVAL),
        },
    }
}

/// The socket with what was read past the last message.
#[derive(Debug)]
struct Conn {
    fd: OwnedFd,
    /// Room for a whole group of pipelined requests (read at once, answered at once).
    buf: [u8; MAX_PIPELINE * MAX_MSG_LEN],
    len: usize,
}

impl Conn {
    fn send(&self, msg: &Msg) -> Result<(), SessionError> {
        let mut out = [0u8; MAX_MSG_LEN];
        let n = msg.encode(&mut out).map_err(SessionError::Proto)?;
        self.send_bytes(&out[..n])
    }

    fn send_bytes(&self, mut bytes: &[u8]) -> Result<(), SessionError> {
        while !bytes.is_empty() {
            // NOSIGNAL: a closed peer is an error here, not a SIGPIPE for the program.
            let k = match rustix::net::send(&self.fd, bytes, SendFlags::NOSIGNAL) {
                Err(Errno::INTR) => continue,
                r => r.map_err(sys_err("writing to farmap run"))?,
            };
            bytes = &bytes[k..];
        }
        Ok(())
    }

    /// The next message already read, if a whole one is.
    fn buffered(&mut self) -> Result<Option<Msg>, SessionError> {
        let Some((msg, used)) = decode(&self.buf[..self.len]).map_err(SessionError::Proto)? else {
            return Ok(None);
        };
        self.buf.copy_within(used..self.len, 0);
        self.len -= used;
        Ok(Some(msg))
    }

    fn recv(&mut self) -> Result<Msg, SessionError> {
        loop {
            if let Some(msg) = self.buffered()? {
                return Ok(msg);
            }
            let n = loop {
                match rustix::io::read(&self.fd, &mut self.buf[self.len..]) {
                    Err(Errno::INTR) => continue,
                    r => break r.map_err(sys_err("reading from farmap run"))?,
                }
            };
            if n == 0 {
                return Err(SessionError::Closed);
            }
            self.len += n;
        }
    }
}

/// An open session: the areas, the program's own copies of the userfaultfds (closing the
/// last copy would unregister the areas and let faults through as zeros), the socket.
#[derive(Debug)]
pub(crate) struct Session {
    areas: [Area; 2],
    uffds: [OwnedFd; 2],
    conn: Conn,
    /// The region's userfaultfd has fork events: a forked child inherits the region.
    fork_events: bool,
}

impl Session {
    /// The region: its first byte and length.
    pub(crate) fn region(&self) -> (*mut u8, usize) {
        (
            ptr::with_exposed_provenance_mut(self.areas[0].start as usize),
            self.areas[0].len as usize,
        )
    }

    /// Does one request and says how it went.
    fn serve(&self, req: Request) -> Done {
        let (bytes, errno) = match validate(&self.areas, req.op) {
            Err(errno) => (0, errno),
            Ok(Action::Discard { start, len }) => {
                let p = ptr::with_exposed_provenance_mut::<u8>(start as usize);
                // SAFETY: the range lies in this program's region or staging area (checked
                // above), whose pages the handler may drop at any time: the region's
                // come back through it (a REMOVE event it reads), staging pages are its own.
                match unsafe { sys::madvise(p, len as usize, Advice::LinuxDontNeed) } {
                    Ok(()) => (len, 0),
                    Err(e) => (0, e.raw_os_error()),
                }
            }
            Ok(Action::Touch { start, len }) => {
                for page in (start..start + len).step_by(farmap_run_proto::PAGE as usize) {
                    let word = ptr::with_exposed_provenance::<AtomicU64>(page as usize);
                    // SAFETY: a page of this program's region (checked above), mapped
                    // read-write for the heap's whole life. A compare-and-swap of a value
                    // with itself changes no value any thread can see, and is atomic against
                    // their writes; it is a write to the kernel, which gives this process a
                    // page of its own if a fork shared it. (Not an atomic add of 0: the
                    // compiler makes that a fenced load, which writes nothing.) farmap run
                    // asks only for pages it found present; one discarded meanwhile faults,
                    // and farmap run serves that fault without this thread (it holds the
                    // pager still while it asks).
                    let word = unsafe { &*word };
                    let mut v = word.load(Ordering::Relaxed);
                    while let Err(now) =
                        word.compare_exchange_weak(v, v, Ordering::Relaxed, Ordering::Relaxed)
                    {
                        v = now;
                    }
                }
                (len, 0)
            }
            Ok(Action::Move {
                src,
                dst,
                len,
                dst_area,
            }) => {
                // SAFETY: both ranges lie in the two registered areas (checked above), whose
                // pages the handler moves as it likes (it serves every access to them).
                unsafe { sys::uffd_move(&self.uffds[dst_area], src, dst, len) }
            }
        };
        Done {
            id: req.id,
            errno,
            bytes,
        }
    }
}

/// Unmaps the areas unless the session opened.
struct Mapped([(*mut u8, usize); 2]);

impl Drop for Mapped {
    fn drop(&mut self) {
        for (p, len) in self.0 {
            if !p.is_null() {
                // SAFETY: mappings made by `open` that nothing uses (the session failed).
                unsafe { sys::unmap(p, len) };
            }
        }
    }
}

/// `fd` moved to the lowest free number from `base` (close-on-exec), or left as it is. Never
/// below 3: a program started with stdin, stdout or stderr closed would otherwise write
/// its output into the session.
fn placed(fd: OwnedFd, base: Option<i32>) -> Result<OwnedFd, SessionError> {
    let min = base.unwrap_or(3).max(3);
    if fd.as_raw_fd() < min {
        rustix::io::fcntl_dupfd_cloexec(&fd, min).map_err(sys_err("moving an fd up"))
    } else {
        Ok(fd)
    }
}

/// Where and as whom a session opens, read from the environment at start-up: copies, since
/// the environment's own strings may be overwritten later (redis writes its process title
/// over them) and the session may open long after start-up.
pub(crate) struct Target {
    addr: rustix::net::SocketAddrUnix,
    token: [u8; TOKEN_LEN],
    fd_base: Option<i32>,
}

impl Target {
    /// The target of `FARMAP_RUN_SOCK` (`path`), `FARMAP_RUN_TOKEN` (`token`, as it is) and
    /// `FARMAP_RUN_FD_BASE`.
    pub(crate) fn new(
        path: &CStr,
        token: Option<&[u8]>,
        fd_base: Option<i32>,
    ) -> Result<Target, SessionError> {
        let token = token
            .and_then(crate::env::parse_token)
            .ok_or(SessionError::Token)?;
        let addr = rustix::net::SocketAddrUnix::new(path).map_err(sys_err("FARMAP_RUN_SOCK"))?;
        Ok(Target {
            addr,
            token,
            fd_base,
        })
    }
}

/// Opens a session with the handler at `target` (see the module docs); the long-lived fds
/// (socket, userfaultfds) are moved to its fd base or above if it has one, out of the way of
/// programs that `dup2` onto low numbers.
pub(crate) fn open(target: &Target) -> Result<Session, SessionError> {
    let (token, fd_base) = (target.token, target.fd_base);
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .map_err(sys_err("creating a socket"))?;
    let fd = placed(fd, fd_base)?;
    rustix::net::connect(&fd, &target.addr).map_err(sys_err("connecting to FARMAP_RUN_SOCK"))?;
    let timeout =
        |v| rustix::net::sockopt::set_socket_timeout(&fd, rustix::net::sockopt::Timeout::Recv, v);
    timeout(Some(HANDSHAKE_WAIT)).map_err(sys_err("setting the socket's timeout"))?;
    let mut conn = Conn {
        fd,
        buf: [0; MAX_PIPELINE * MAX_MSG_LEN],
        len: 0,
    };
    let pid = rustix::process::getpid().as_raw_nonzero().get() as u32;
    conn.send(&Msg::Hello(Hello { token, pid }))?;
    let Msg::Config(config) = conn.recv()? else {
        return Err(SessionError::Unexpected("a Config"));
    };
    let (session, mapped) = register(conn, &config, fd_base)?;
    let session = finish(session)?;
    if session.fork_events {
        let _ = FORK_TARGET.set(ForkTarget {
            addr: target.addr.clone(),
            token,
            region: session.areas[0].start,
        });
    }
    // Serving: the areas are the session's for the rest of the process.
    core::mem::forget(mapped);
    let timeout = |v| {
        rustix::net::sockopt::set_socket_timeout(
            &session.conn.fd,
            rustix::net::sockopt::Timeout::Recv,
            v,
        )
    };
    timeout(None).map_err(sys_err("clearing the socket's timeout"))?;
    Ok(session)
}

/// Maps and registers the areas, sends them with the four fds.
fn register(
    conn: Conn,
    config: &Config,
    fd_base: Option<i32>,
) -> Result<(Session, Mapped), SessionError> {
    // Fork events need CAP_SYS_PTRACE: without it, go without them (the region is then not
    // inherited by a forked child, which gets a heap of its own).
    let fork = sys::UFFD_FEATURE_EVENT_FORK;
    let (region_uffd, features) = match sys::uffd_open(config.features) {
        Err(Errno::PERM) if config.features & fork != 0 => {
            let features = config.features & !fork;
            (sys::uffd_open(features), features)
        }
        r => (r, config.features),
    };
    let region_uffd = region_uffd.map_err(sys_err("the region's userfaultfd"))?;
    let region_uffd = placed(region_uffd, fd_base)?;
    let staging_uffd = sys::uffd_open(sys::UFFD_FEATURE_MOVE)
        .map_err(sys_err("the staging area's userfaultfd"))?;
    let staging_uffd = placed(staging_uffd, fd_base)?;
    let region_len = usize::try_from(config.region_len)
        .map_err(|_| SessionError::Unexpected("a region that fits"))?;
    let staging_len = config
        .region_len
        .checked_add(config.trash_len)
        .and_then(|l| usize::try_from(l).ok())
        .ok_or(SessionError::Unexpected("a staging area that fits"))?;
    let mut mapped = Mapped([(ptr::null_mut(), 0); 2]);
    for (i, len) in [region_len, staging_len].into_iter().enumerate() {
        let p = sys::map_anon(len);
        if p.is_null() {
            return Err(SessionError::Sys("mapping the region", Errno::NOMEM));
        }
        mapped.0[i] = (p, len);
    }
    let [(region, _), (staging, _)] = mapped.0;
    // SAFETY: both are fresh private anonymous mappings of ours that nothing has touched;
    // from now on the handler serves their faults (that is the point of the session).
    unsafe {
        sys::uffd_register(
            region_uffd.as_fd(),
            region.addr(),
            region_len,
            sys::MODE_MISSING | sys::MODE_WP,
        )
        .map_err(sys_err("registering the region"))?;
        sys::uffd_register(
            staging_uffd.as_fd(),
            staging.addr(),
            staging_len,
            sys::MODE_WP,
        )
        .map_err(sys_err("registering the staging area"))?;
    }
    for (i, (p, len)) in mapped.0.into_iter().enumerate() {
        if i == 0 && features & fork != 0 {
            // A forked child inherits the region: farmap run makes its copy whole.
            continue;
        }
        // SAFETY: DONTFORK changes only what a forked child inherits (not these areas).
        unsafe { sys::madvise(p, len, Advice::LinuxDontFork) }.map_err(sys_err("MADV_DONTFORK"))?;
    }
    let proc_file = |path: &CStr| {
        rustix::fs::openat(
            rustix::fs::CWD,
            path,
            rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
    };
    let pagemap =
        proc_file(c"/proc/self/pagemap").map_err(sys_err("opening /proc/self/pagemap"))?;
    let mem = proc_file(c"/proc/self/mem").map_err(sys_err("opening /proc/self/mem"))?;
    let areas = [
        Area {
            start: region.addr() as u64,
            len: region_len as u64,
        },
        Area {
            start: staging.addr() as u64,
            len: staging_len as u64,
        },
    ];
    let msg = Msg::Registered(Registered {
        region: areas[0].start,
        region_len: areas[0].len,
        staging: areas[1].start,
        staging_len: areas[1].len,
        features,
    });
    let fds = [
        region_uffd.as_fd(),
        staging_uffd.as_fd(),
        pagemap.as_fd(),
        mem.as_fd(),
    ];
    send_with_fds(conn.fd.as_fd(), &msg, &fds)?;
    drop((pagemap, mem));
    Ok((
        Session {
            areas,
            uffds: [region_uffd, staging_uffd],
            conn,
            fork_events: features & fork != 0,
        },
        mapped,
    ))
}

/// Sends `msg` with `fds` (SCM_RIGHTS).
fn send_with_fds(
    sock: BorrowedFd<'_>,
    msg: &Msg,
    fds: &[BorrowedFd<'_>; 4],
) -> Result<(), SessionError> {
    let mut out = [0u8; MAX_MSG_LEN];
    let n = msg.encode(&mut out).map_err(SessionError::Proto)?;
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(SessionError::Sys("packing the fds", Errno::NOBUFS));
    }
    let iov = [std::io::IoSlice::new(&out[..n])];
    let sent = loop {
        match rustix::net::sendmsg(sock, &iov, &mut control, SendFlags::NOSIGNAL) {
            Err(Errno::INTR) => continue,
            r => break r.map_err(sys_err("sending the areas to farmap run"))?,
        }
    };
    if sent != n {
        // The fds went with the first byte; the rest of the message follows.
        let mut rest = &out[sent..n];
        while !rest.is_empty() {
            let k = match rustix::net::send(sock, rest, SendFlags::NOSIGNAL) {
                Err(Errno::INTR) => continue,
                r => r.map_err(sys_err("writing to farmap run"))?,
            };
            rest = &rest[k..];
        }
    }
    Ok(())
}

/// Waits for the verdict, serving requests that come before it.
fn finish(mut session: Session) -> Result<Session, SessionError> {
    loop {
        match session.conn.recv()? {
            Msg::Request(req) => {
                let done = session.serve(req);
                session.conn.send(&Msg::Done(done))?;
            }
            Msg::Verdict(v) if v.status == 0 => break,
            Msg::Verdict(v) => return Err(SessionError::Refused(v.status)),
            _ => return Err(SessionError::Unexpected("a Verdict")),
        }
    }
    Ok(session)
}

/// The session's fds, for a forked child to close (it has no reaper, and its own areas are
/// gone: `MADV_DONTFORK`); -1 when none.
static FDS: [AtomicI32; 3] = [AtomicI32::new(-1), AtomicI32::new(-1), AtomicI32::new(-1)];

/// The session, owned by the reaper thread once it runs.
struct Slot(core::cell::UnsafeCell<MaybeUninit<Session>>);
// SAFETY: written once by `start_reaper` before the reaper thread exists, then only read by
// that thread.
unsafe impl Sync for Slot {}
static REAPER: Slot = Slot(core::cell::UnsafeCell::new(MaybeUninit::uninit()));

/// Starts the reaper thread (all signals blocked) on the session, which lives as long as the
/// process. Called once.
pub(crate) fn start_reaper(session: Session) -> Result<(), Errno> {
    FDS[0].store(session.uffds[0].as_raw_fd(), Ordering::Relaxed);
    FDS[1].store(session.uffds[1].as_raw_fd(), Ordering::Relaxed);
    FDS[2].store(session.conn.fd.as_raw_fd(), Ordering::Relaxed);
    // SAFETY: called once, before the thread that reads the slot exists.
    unsafe { (*REAPER.0.get()).write(session) };
    // SAFETY: plain libc calls on local, initialized signal sets and thread handle; the new
    // thread inherits the blocked mask, so no signal is ever delivered to it; the slot it
    // reads was written above.
    unsafe {
        let mut all = MaybeUninit::<libc::sigset_t>::uninit();
        let mut old = MaybeUninit::<libc::sigset_t>::uninit();
        libc::sigfillset(all.as_mut_ptr());
        libc::pthread_sigmask(libc::SIG_SETMASK, all.as_ptr(), old.as_mut_ptr());
        let mut thread = MaybeUninit::<libc::pthread_t>::uninit();
        let r = libc::pthread_create(
            thread.as_mut_ptr(),
            ptr::null(),
            reaper_main,
            ptr::null_mut(),
        );
        libc::pthread_sigmask(libc::SIG_SETMASK, old.as_ptr(), ptr::null_mut());
        if r != 0 {
            return Err(Errno::from_raw_os_error(r));
        }
        libc::pthread_detach(thread.assume_init());
        libc::pthread_setname_np(thread.assume_init(), c"farmap-reaper".as_ptr());
    }
    Ok(())
}

extern "C" fn reaper_main(_: *mut c_void) -> *mut c_void {
    // SAFETY: `start_reaper` wrote the slot before creating this thread, the only user.
    let session = unsafe { (*REAPER.0.get()).assume_init_mut() };
    // The answers to the requests read so far, sent with one write: the handler sends a
    // group of requests at once (up to MAX_PIPELINE) and waits for all their answers.
    let mut out = [0u8; MAX_PIPELINE * DONE_LEN];
    loop {
        let mut req = match session.conn.recv() {
            Ok(Msg::Request(req)) => req,
            // The handler is gone (or speaks out of turn): nobody serves this program's
            // faults any more, and it must not run on reading zeros.
            _ => sys::kill_self(),
        };
        let mut len = 0;
        loop {
            let done = session.serve(req);
            let mut one = [0u8; MAX_MSG_LEN];
            match Msg::Done(done).encode(&mut one) {
                Ok(DONE_LEN) => out[len..len + DONE_LEN].copy_from_slice(&one[..DONE_LEN]),
                _ => sys::kill_self(),
            }
            len += DONE_LEN;
            if len == out.len() {
                break;
            }
            req = match session.conn.buffered() {
                Ok(Some(Msg::Request(req))) => req,
                // Nothing more read yet: answer what was.
                Ok(None) => break,
                _ => sys::kill_self(),
            };
        }
        if session.conn.send_bytes(&out[..len]).is_err() {
            sys::kill_self();
        }
    }
}

/// Where to announce a fork (the session's socket path and token), set when the region has
/// fork events.
struct ForkTarget {
    /// A copy: the environment's own string may be gone by the time of a fork (redis
    /// writes its process title over the original environment).
    addr: rustix::net::SocketAddrUnix,
    token: [u8; TOKEN_LEN],
    region: u64,
}

static FORK_TARGET: std::sync::OnceLock<ForkTarget> = std::sync::OnceLock::new();

/// The connection of the fork in progress, announced and paused for (-1: none).
static FORK_CONN: AtomicI32 = AtomicI32::new(-1);

/// How long a fork's announcement waits for farmap run to pause the pager; past it, the
/// fork goes on unannounced (farmap run still copies the child, from what it finds then).
const FORK_PREPARE_WAIT: Duration = Duration::from_secs(10);
/// How long a forked child waits for its heap to be whole (farmap run waits 600 s).
const FORK_CHILD_WAIT: Duration = Duration::from_secs(610);

/// Whether a forked child inherits the region (the session has fork events).
pub(crate) fn fork_events() -> bool {
    FORK_TARGET.get().is_some()
}

/// Before a fork (every heap lock held, nothing allocated): tells farmap run on a
/// connection of its own, and waits until it has paused the pager. On any failure the fork
/// goes on unannounced.
pub(crate) fn fork_prepare() {
    let Some(target) = FORK_TARGET.get() else {
        return;
    };
    match announce_fork(target) {
        Ok(fd) => FORK_CONN.store(fd.into_raw_fd(), Ordering::Relaxed),
        Err(e) => sys::say(format_args!(
            "announcing a fork to farmap run: {e}; forking unannounced"
        )),
    }
}

fn announce_fork(target: &ForkTarget) -> Result<OwnedFd, SessionError> {
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .map_err(sys_err("creating a socket"))?;
    rustix::net::connect(&fd, &target.addr).map_err(sys_err("connecting to FARMAP_RUN_SOCK"))?;
    rustix::net::sockopt::set_socket_timeout(
        &fd,
        rustix::net::sockopt::Timeout::Recv,
        Some(FORK_PREPARE_WAIT),
    )
    .map_err(sys_err("setting the socket's timeout"))?;
    let mut conn = Conn {
        fd,
        buf: [0; MAX_PIPELINE * MAX_MSG_LEN],
        len: 0,
    };
    let pid = rustix::process::getpid().as_raw_nonzero().get() as u32;
    conn.send(&Msg::ForkPrepare(ForkPrepare {
        token: target.token,
        pid,
        region: target.region,
    }))?;
    match conn.recv()? {
        Msg::Verdict(Verdict { status: 0 }) => Ok(conn.fd),
        Msg::Verdict(v) => Err(SessionError::Refused(v.status)),
        _ => Err(SessionError::Unexpected("a Verdict")),
    }
}

/// After a fork, in the parent: the announcement is over (its connection closes here; the
/// child holds its own copy until its heap is whole).
pub(crate) fn fork_parent() {
    let fd = FORK_CONN.swap(-1, Ordering::Relaxed);
    if fd >= 0 {
        // SAFETY: the fd `fork_prepare` stored, owned by nobody else in this process.
        drop(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) });
    }
}

/// After a fork, in the child of an announced fork: waits until farmap run says the heap is
/// whole. If it cannot say so, the child must not run on a heap with holes: one line on
/// stderr, and exit status 127.
pub(crate) fn fork_child() {
    let fd = FORK_CONN.swap(-1, Ordering::Relaxed);
    if fd < 0 {
        return;
    }
    // SAFETY: this process's copy of the fd `fork_prepare` stored, owned by nobody else.
    let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let _ = rustix::net::sockopt::set_socket_timeout(
        &fd,
        rustix::net::sockopt::Timeout::Recv,
        Some(FORK_CHILD_WAIT),
    );
    let mut conn = Conn {
        fd,
        buf: [0; MAX_PIPELINE * MAX_MSG_LEN],
        len: 0,
    };
    match conn.recv() {
        Ok(Msg::Verdict(Verdict { status: 0 })) => {}
        Ok(Msg::Verdict(v)) => {
            sys::say(format_args!(
                "farmap run could not copy this forked child's heap ({})",
                SessionError::Refused(v.status)
            ));
            sys::exit_now(127);
        }
        Ok(_) => {
            sys::say(format_args!(
                "farmap run sent a forked child something other than a Verdict"
            ));
            sys::exit_now(127);
        }
        Err(e) => {
            sys::say(format_args!(
                "waiting for this forked child's heap to be copied: {e}"
            ));
            sys::exit_now(127);
        }
    }
}

/// Closes the session's fds (a forked child's copies).
pub(crate) fn close_inherited() {
    for fd in &FDS {
        let fd = fd.swap(-1, Ordering::Relaxed);
        if fd >= 0 {
            // SAFETY: a forked child's copy of a session fd, which nothing in the child
            // uses (it has no reaper thread and no areas).
            unsafe { libc::close(fd) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AREAS: [Area; 2] = [
        Area {
            start: 0x10_0000,
            len: 0x10_0000,
        },
        Area {
            start: 0x40_0000,
            len: 0x20_0000,
        },
    ];

    #[test]
    fn discards_inside_an_area_are_taken() {
        let op = Op::Discard {
            start: 0x10_0000,
            len: 0x10_0000,
        };
        assert_eq!(
            validate(&AREAS, op),
            Ok(Action::Discard {
                start: 0x10_0000,
                len: 0x10_0000
            })
        );
        let op = Op::Discard {
            start: 0x5f_f000,
            len: 0x1000,
        };
        assert!(validate(&AREAS, op).is_ok(), "the last page of staging");
    }

    #[test]
    fn ranges_outside_or_across_areas_are_einval() {
        for (start, len) in [
            (0x0f_f000, 0x1000),        // before the region
            (0x1f_f000, 0x2000),        // past the region's end
            (0x20_0000, 0x1000),        // between the areas
            (0x10_0000, 0x40_0000),     // across both
            (0x60_0000, 0x1000),        // after staging
            (0x10_0000, 0),             // empty
            (u64::MAX - 0xfff, 0x1000), // wraps
        ] {
            assert_eq!(
                validate(&AREAS, Op::Discard { start, len }),
                Err(libc::EINVAL),
                "{start:#x}+{len:#x}"
            );
        }
    }

    #[test]
    fn touches_are_for_the_region_only() {
        let op = |start, len| Op::Touch { start, len };
        assert_eq!(
            validate(&AREAS, op(0x10_0000, 0x2000)),
            Ok(Action::Touch {
                start: 0x10_0000,
                len: 0x2000
            })
        );
        // The staging area's pages are never shared with a child; outside both is refused.
        assert_eq!(validate(&AREAS, op(0x40_0000, 0x1000)), Err(libc::EINVAL));
        assert_eq!(validate(&AREAS, op(0x30_0000, 0x1000)), Err(libc::EINVAL));
        assert_eq!(validate(&AREAS, op(0x1f_f000, 0x2000)), Err(libc::EINVAL));
    }

    #[test]
    fn moves_go_to_the_destinations_area() {
        let out = Op::Move {
            src: 0x10_0000,
            dst: 0x40_0000,
            len: 0x1000,
        };
        assert_eq!(
            validate(&AREAS, out),
            Ok(Action::Move {
                src: 0x10_0000,
                dst: 0x40_0000,
                len: 0x1000,
                dst_area: 1
            })
        );
        let back = Op::Move {
            src: 0x40_0000,
            dst: 0x10_0000,
            len: 0x1000,
        };
        assert!(matches!(
            validate(&AREAS, back),
            Ok(Action::Move { dst_area: 0, .. })
        ));
        let outside = Op::Move {
            src: 0x10_0000,
            dst: 0x30_0000,
            len: 0x1000,
        };
        assert_eq!(validate(&AREAS, outside), Err(libc::EINVAL));
        let from_outside = Op::Move {
            src: 0x90_0000,
            dst: 0x10_0000,
            len: 0x1000,
        };
        assert_eq!(validate(&AREAS, from_outside), Err(libc::EINVAL));
    }
}
