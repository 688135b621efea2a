//! [`ForeignSpace`]: the address space of a program whose region this process serves: what
//! reads it (the program's `/proc/self/mem`, received from it), what moves and discards its
//! pages (its reaper), and whether it still lives ([`End`]).
//!
//! What the kernel does, tested with a real program in `tests/foreign_kernel.rs`:
//! - A `pread` of the mem fd reads the program's pages. A missing page of its region fails
//!   with `EIO` at once, and raises no fault: a read from another process may not wait for
//!   a handler. A hole anywhere else reads as zeros and maps the shared zero page there,
//!   which a later move into that page then finds present.
//! - Once the program's mm is gone (it exited, or it exec'd and lives on as another image),
//!   every read returns 0 bytes, at any address. While the mm lives, a read of an address
//!   nothing maps fails with `EIO`.
//! - The region's userfaultfd says nothing when the mm goes (no `POLLHUP`, no `POLLERR`);
//!   its ioctls and `PAGEMAP_SCAN` fail with `ESRCH` from then on.
//!
//! Hence [`ForeignSpace::watch`], run on a thread of its own: it waits on the pidfd (the
//! program exited), on the reaper's socket (a hang-up) and on a kick from any user that saw
//! the mm go, and probes the mm every [`PROBE_EVERY`] in any case, since an exec that keeps
//! the reaper's socket open (a program that cleared its close-on-exec flag) shows nowhere
//! else. The probe reads one byte where nothing is served (see
//! [`mm_alive`](ForeignSpace::mm_alive)).

use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use farmap_run_proto::Op;
use parking_lot::{Condvar, Mutex};
use rustix::event::{eventfd, poll, EventfdFlags, PollFd, PollFlags, Timespec};
use rustix::process::Signal;

use super::reaper::{Reaper, ReaperError};

/// How often the watcher probes the program's mm when nothing else wakes it.
pub(crate) const PROBE_EVERY: Duration = Duration::from_millis(100);
/// How long a program whose mm is gone has to show that it exited (its pidfd) or that it
/// runs a new image (a new mm), before it counts as exited: the teardown of a large mm runs
/// between the two.
const GONE_GRACE: Duration = Duration::from_secs(2);
/// How long a program whose reaper is lost, or hung up, has to show that it is on its way
/// out before it is killed: an exit closes the socket after the mm goes, but a read of ours
/// may hold the mm a moment longer.
const LOST_GRACE: Duration = Duration::from_millis(200);
/// The step of the waits above.
const GRACE_STEP: Duration = Duration::from_millis(10);

/// How a program's session ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// The program exited.
    Exited,
    /// The program exec'd: its pid lives on, but the memory served is gone.
    Replaced,
    /// The program was killed by this side: its reaper was lost while its memory lived, so
    /// its memory could no longer be kept under its limit.
    Killed {
        /// What was wrong.
        why: String,
    },
}

/// The address space of a program whose region this process serves (see the module docs).
///
/// - Reads, discards and moves fail fast once the session ended ([`is_alive`](Self::is_alive)
///   false).
/// - A read that finds the mm gone, and a lost reaper, kick the watcher.
#[derive(Debug)]
pub(crate) struct ForeignSpace {
    pid: u32,
    pidfd: OwnedFd,
    mem: File,
    reaper: Reaper,
    /// False once the watcher saw the session end.
    alive: AtomicBool,
    /// Where the probe reads: an address nothing maps, or one that is never served.
    probe_addr: u64,
    /// How the session ended, once its end is recorded; `ended` is signalled then.
    end: Mutex<Option<End>>,
    ended: Condvar,
    /// The last failure seen, for the end's report.
    last_error: Mutex<Option<String>>,
    /// A reaper request was lost (the reaper is not used again).
    reaper_lost: AtomicBool,
    /// An eventfd that wakes the watcher.
    kick: OwnedFd,
    /// Set by [`stop_watch`](Self::stop_watch).
    stop: AtomicBool,
}

/// What woke the watcher.
#[derive(Debug, Clone, Copy)]
struct News {
    exited: bool,
    hung_up: bool,
}

impl ForeignSpace {
    /// The address space of program `pid`: its pidfd, its mem fd (opened by the program),
    /// its reaper. The probe reads one byte at `probe_addr`: best an address nothing maps
    /// (page 0), never one of the areas served (see the module docs).
    pub fn new(
        pid: u32,
        pidfd: OwnedFd,
        mem: OwnedFd,
        reaper: Reaper,
        probe_addr: u64,
    ) -> io::Result<ForeignSpace> {
        Ok(ForeignSpace {
            pid,
            pidfd,
            mem: File::from(mem),
            reaper,
            alive: AtomicBool::new(true),
            probe_addr,
            end: Mutex::new(None),
            ended: Condvar::new(),
            last_error: Mutex::new(None),
            reaper_lost: AtomicBool::new(false),
            kick: eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?,
            stop: AtomicBool::new(false),
        })
    }

    /// The program's pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether the session goes on (the watcher has not seen it end).
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    /// Reads `dst.len()` bytes of the program's memory at `addr`. `ESRCH` once the session
    /// ended, or when the mm is gone (which kicks the watcher); other errors as the kernel
    /// gives them (`EIO`: a missing page of the region, or nothing mapped there). Never
    /// fewer bytes: a short read is an error, never zeros.
    pub fn read_at(&self, addr: u64, dst: &mut [u8]) -> io::Result<()> {
        if !self.is_alive() {
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
        let mut done = 0;
        while done < dst.len() {
            let at = addr + done as u64;
            match rustix::io::pread(&self.mem, &mut dst[done..], at) {
                Ok(0) => {
                    self.kick();
                    return Err(io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(n) => done += n,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => {
                    let len = dst.len();
                    self.note(format!("reading {len} bytes at {addr:#x}: {e}"));
                    return Err(e.into());
                }
            }
        }
        Ok(())
    }

    /// `madvise(MADV_DONTNEED)` of `len` bytes at `addr` in the program, by its reaper. The
    /// reaper's refusal comes back as its errno (`EINVAL` for a request out of the
    /// protocol's limits); a lost reaper as `ESRCH`, and the session ends.
    pub fn discard(&self, addr: u64, len: u64) -> io::Result<()> {
        let op = Op::Discard { start: addr, len };
        match self.run(&[op]).pop().expect("one outcome per request") {
            Ok(_) => Ok(()),
            Err((_, errno)) => Err(io::Error::from_raw_os_error(errno)),
        }
    }

    /// Does `ops` in order through the reaper, a group of them to a round trip
    /// ([`Reaper::run`]): each one's bytes, or those done before it stopped and the errno
    /// (`EINVAL` for a request out of the protocol's limits; `ESRCH` once the session ended
    /// or the reaper is lost, which ends it).
    pub fn run(&self, ops: &[Op]) -> Vec<Result<u64, (u64, i32)>> {
        if !self.is_alive() {
            return ops.iter().map(|_| Err((0, libc::ESRCH))).collect();
        }
        self.reaper
            .run(ops)
            .into_iter()
            .map(|r| r.map_err(|e| self.errno_of(e)))
            .collect()
    }

    /// A reaper's failure as `(bytes done, errno)`; a lost reaper is noted, and kicks the
    /// watcher.
    fn errno_of(&self, e: ReaperError) -> (u64, i32) {
        match e {
            ReaperError::Stopped { bytes, errno } => (bytes, errno),
            ReaperError::Invalid(_) => (0, libc::EINVAL),
            ReaperError::Lost(_) => {
                self.note(e.to_string());
                self.reaper_lost.store(true, Ordering::Release);
                self.kick();
                (0, libc::ESRCH)
            }
        }
    }

    /// Whether the program's mm lives: a 1-byte read at the probe address returns 0 bytes
    /// once it is gone. While it lives the read returns its byte, or fails with `EIO` where
    /// nothing is mapped. Any other error is returned.
    pub fn mm_alive(&self) -> io::Result<bool> {
        let mut byte = [0u8; 1];
        match rustix::io::pread(&self.mem, &mut byte, self.probe_addr) {
            Ok(n) => Ok(n > 0),
            Err(rustix::io::Errno::IO) => Ok(true),
            Err(e) => Err(e.into()),
        }
    }

    /// Waits up to `timeout` for the program to be gone (its pidfd readable); whether it
    /// is.
    pub fn wait_gone(&self, timeout: Duration) -> bool {
        let mut fds = [PollFd::new(&self.pidfd, PollFlags::IN)];
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let t = Timespec::try_from(left).ok();
            match poll(&mut fds, t.as_ref()) {
                Ok(n) if n > 0 => return true,
                Err(rustix::io::Errno::INTR) => {}
                _ if Instant::now() >= deadline => return false,
                _ => {}
            }
        }
    }

    /// Kills the program (`SIGKILL` through its pidfd: never another process of that pid).
    pub fn kill(&self) -> io::Result<()> {
        Ok(rustix::process::pidfd_send_signal(
            &self.pidfd,
            Signal::KILL,
        )?)
    }

    /// The last failure seen (a read, a lost reaper, a probe).
    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().clone()
    }

    fn note(&self, what: String) {
        *self.last_error.lock() = Some(what);
    }

    /// Wakes the watcher, to look at the program now.
    fn kick(&self) {
        // Only fails if the counter would overflow, which the watcher's reads prevent.
        let _ = rustix::io::write(&self.kick, &1u64.to_ne_bytes());
    }
}

/// The watcher, and the end of the session.
impl ForeignSpace {
    /// Watches the program until its session ends (see the module docs), and returns how
    /// it ended, with [`is_alive`](Self::is_alive) false already; a program whose reaper is
    /// lost while its mm lives is killed first. `None` once [`stop_watch`](Self::stop_watch)
    /// was called. Blocks: run it on a thread of its own.
    pub fn watch(&self) -> Option<End> {
        loop {
            let news = self.wait_for_news()?;
            if let Some(end) = self.assess(news) {
                self.alive.store(false, Ordering::Release);
                return Some(end);
            }
        }
    }

    /// Ends the session for everything that reads or moves the program's memory (they fail
    /// with `ESRCH` from now on), as the watcher does when it sees the end: for the region's
    /// drop, whose watcher may have been stopped before it saw the program it killed go (a
    /// write-back would otherwise retry its reads of the dead program forever).
    pub fn end_serving(&self) {
        self.alive.store(false, Ordering::Release);
    }

    /// Makes [`watch`](Self::watch) return `None` soon.
    pub fn stop_watch(&self) {
        self.stop.store(true, Ordering::Release);
        self.kick();
    }

    /// Records how the session ended (once: a later call is ignored) and wakes
    /// [`wait_end`](Self::wait_end).
    pub fn finish(&self, end: End) {
        let mut slot = self.end.lock();
        if slot.is_none() {
            *slot = Some(end);
            self.ended.notify_all();
        }
    }

    /// How the session ended, once recorded.
    pub fn ended(&self) -> Option<End> {
        self.end.lock().clone()
    }

    /// Waits up to `timeout` for the end to be recorded.
    pub fn wait_end(&self, timeout: Duration) -> Option<End> {
        let deadline = Instant::now() + timeout;
        let mut slot = self.end.lock();
        while slot.is_none() {
            if self.ended.wait_until(&mut slot, deadline).timed_out() {
                break;
            }
        }
        slot.clone()
    }

    /// Waits up to [`PROBE_EVERY`] for the pidfd, a hang-up of the reaper or a kick; `None`
    /// once stopped.
    fn wait_for_news(&self) -> Option<News> {
        let sock = self.reaper.socket();
        let mut fds = [
            PollFd::new(&self.pidfd, PollFlags::IN),
            PollFd::new(&sock, PollFlags::RDHUP),
            PollFd::new(&self.kick, PollFlags::IN),
        ];
        let timeout = Timespec::try_from(PROBE_EVERY).ok();
        // EINTR, or anything else: look anyway.
        let _ = poll(&mut fds, timeout.as_ref());
        let mut count = [0u8; 8];
        let _ = rustix::io::read(&self.kick, &mut count);
        if self.stop.load(Ordering::Acquire) {
            return None;
        }
        let hangup = PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR;
        Some(News {
            exited: !fds[0].revents().is_empty(),
            hung_up: fds[1].revents().intersects(hangup),
        })
    }

    /// Whether the session ends, from `news` and a probe of the mm.
    fn assess(&self, news: News) -> Option<End> {
        if news.exited {
            return Some(End::Exited);
        }
        match self.mm_alive() {
            Ok(false) => return Some(self.mm_gone()),
            Ok(true) => {}
            Err(e) => self.note(format!("probing the program's memory: {e}")),
        }
        let lost = self.reaper_lost.load(Ordering::Acquire);
        if !news.hung_up && !lost {
            return None;
        }
        if let Some(end) = self.settle(LOST_GRACE) {
            return Some(end);
        }
        let mut why = if news.hung_up && !lost {
            "the program's reaper hung up while its memory lived".to_owned()
        } else {
            "the program's reaper is lost while its memory lives".to_owned()
        };
        if let Some(e) = self.last_error() {
            why = format!("{why} ({e})");
        }
        if let Err(e) = self.kill() {
            why = format!("{why}; killing it failed: {e}");
        }
        Some(End::Killed { why })
    }

    /// The end of a program whose mm is gone: it exited, or it runs a new image.
    fn mm_gone(&self) -> End {
        self.settle(GONE_GRACE).unwrap_or(End::Exited)
    }

    /// Waits up to `grace` for the program to exit ([`End::Exited`]) or to run a new image
    /// with its old mm gone ([`End::Replaced`]); `None` if neither happened.
    fn settle(&self, grace: Duration) -> Option<End> {
        let deadline = Instant::now() + grace;
        loop {
            if self.exited_within(GRACE_STEP) {
                return Some(End::Exited);
            }
            if self.mm_alive().ok() == Some(false) && self.has_an_mm() {
                // The mm of the check above is a new one, unless the program exited since.
                return Some(if self.exited_within(Duration::ZERO) {
                    End::Exited
                } else {
                    End::Replaced
                });
            }
            if Instant::now() >= deadline {
                return None;
            }
        }
    }

    /// Whether the pidfd says the program exited, waiting up to `wait`.
    fn exited_within(&self, wait: Duration) -> bool {
        let mut fds = [PollFd::new(&self.pidfd, PollFlags::IN)];
        let timeout = Timespec::try_from(wait).ok();
        matches!(poll(&mut fds, timeout.as_ref()), Ok(n) if n > 0)
    }

    /// Whether the process of our pid has an mm now (its `statm` counts pages: an exiting
    /// process has none left, one that exec'd has its new image's).
    fn has_an_mm(&self) -> bool {
        let Ok(statm) = std::fs::read_to_string(format!("/proc/{}/statm", self.pid)) else {
            return false;
        };
        let size = statm.split_whitespace().next().and_then(|s| s.parse().ok());
        size.is_some_and(|pages: u64| pages > 0)
    }
}

/// Spaces over real processes and a reaper's stand-in, for the unit tests here and in
/// `crate::space`.
#[cfg(test)]
pub(crate) mod testing {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;
    use std::thread::JoinHandle;

    use farmap_run_proto::{decode, Done, Msg, HEADER_LEN, MAX_MSG_LEN};
    use rustix::process::{pidfd_open, Pid, PidfdFlags};

    use super::*;

    /// The space of process `pid` (probing `probe`), with a reaper whose other end is
    /// returned, lost after `deadline`; `None` (a recorded skip) if its mem cannot be opened.
    pub fn space_of(
        test: &str,
        pid: u32,
        probe: u64,
        deadline: Duration,
    ) -> Option<(ForeignSpace, UnixStream)> {
        let mem = match File::open(format!("/proc/{pid}/mem")) {
            Ok(f) => f,
            Err(e) => {
                farmap_testkit::skip(test, format!("opening /proc/{pid}/mem: {e}"));
                return None;
            }
        };
        let pid_ = Pid::from_raw(pid as i32).expect("a pid");
        let pidfd = pidfd_open(pid_, PidfdFlags::empty()).expect("pidfd_open");
        let (ours, theirs) = UnixStream::pair().unwrap();
        let reaper = Reaper::new(ours, deadline).unwrap();
        let space = ForeignSpace::new(pid, pidfd, mem.into(), reaper, probe).unwrap();
        Some((space, theirs))
    }

    /// Ends `space`'s session as the watcher would.
    pub fn end_session(space: &ForeignSpace) {
        space.alive.store(false, Ordering::Release);
    }

    /// Answers the next requests on `peer`, one `(errno, bytes)` each, then keeps the
    /// socket open until it is told to close it (the handle's channel dropped).
    pub fn serve(
        mut peer: UnixStream,
        answers: Vec<(i32, u64)>,
    ) -> (std::sync::mpsc::Sender<()>, JoinHandle<()>) {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let h = std::thread::spawn(move || {
            for (errno, bytes) in answers {
                let mut req = [0u8; HEADER_LEN + 32];
                peer.read_exact(&mut req).unwrap();
                let Ok(Some((Msg::Request(r), _))) = decode(&req) else {
                    panic!("not a request")
                };
                let mut out = [0u8; MAX_MSG_LEN];
                let done = Done {
                    id: r.id,
                    errno,
                    bytes,
                };
                let n = Msg::Done(done).encode(&mut out).unwrap();
                peer.write_all(&out[..n]).unwrap();
            }
            let _ = rx.recv();
        });
        (tx, h)
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::process::{Child, Command, Stdio};
    use std::sync::{mpsc, Arc};

    use super::testing::{serve, space_of};
    use super::*;

    const PAGE: u64 = 4096;
    const LONG: Duration = Duration::from_secs(10);

    /// A child running `sh -c script`, its stdin piped; killed and waited for on drop.
    struct Kid(Child);

    impl Drop for Kid {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    fn shell(script: &str) -> Kid {
        let child = Command::new("/bin/sh")
            .args(["-c", script])
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        Kid(child)
    }

    /// Runs the watcher of `space` on a thread; its answer comes on the channel.
    fn watching(space: &Arc<ForeignSpace>) -> mpsc::Receiver<Option<End>> {
        let (tx, rx) = mpsc::channel();
        let space = space.clone();
        std::thread::spawn(move || {
            let _ = tx.send(space.watch());
        });
        rx
    }

    fn killed_by_us(child: &mut Child) -> bool {
        use std::os::unix::process::ExitStatusExt;
        child.wait().unwrap().signal() == Some(libc::SIGKILL)
    }

    #[test]
    fn reads_and_the_reapers_answers_map_to_errnos() {
        let test = "foreign::space::reads_and_the_reapers_answers_map_to_errnos";
        let Some((space, peer)) = space_of(test, std::process::id(), 0, LONG) else {
            return;
        };
        let data: Vec<u8> = (0..3 * PAGE as usize).map(|i| (i % 251) as u8).collect();
        let mut buf = vec![0u8; data.len()];
        space.read_at(data.as_ptr() as u64, &mut buf).unwrap();
        assert!(buf == data, "read through the mem fd");
        let e = space.read_at(0, &mut buf[..1]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "nothing mapped at 0");
        assert!(space.last_error().unwrap().contains("at 0x0"));
        assert!(space.mm_alive().unwrap(), "EIO at the probe: alive");

        let (close, served) = serve(peer, vec![(0, PAGE), (libc::EAGAIN, PAGE)]);
        let (a, b) = (16 * PAGE, 64 * PAGE);
        space.discard(a, PAGE).unwrap();
        let mv = |len| {
            space
                .run(&[Op::Move {
                    src: a,
                    dst: b,
                    len,
                }])
                .pop()
                .unwrap()
        };
        assert_eq!(mv(2 * PAGE), Err((PAGE, libc::EAGAIN)));
        // Out of the protocol's limits: not sent.
        let e = space.discard(a + 1, PAGE).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EINVAL));
        assert!(!space.reaper_lost.load(Ordering::Acquire));
        drop(close);
        served.join().unwrap();
        assert_eq!(mv(PAGE), Err((0, libc::ESRCH)));
        assert!(space.reaper_lost.load(Ordering::Acquire));
        assert!(space.last_error().unwrap().contains("lost"));
        let e = space.discard(a, PAGE).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ESRCH));
        assert!(space.is_alive(), "only the watcher ends the session");
    }

    #[test]
    fn the_watcher_sees_the_program_exit() {
        let test = "foreign::space::the_watcher_sees_the_program_exit";
        let mut kid = shell("read x; exit 0");
        let Some((space, _peer)) = space_of(test, kid.0.id(), 0, LONG) else {
            return;
        };
        let space = Arc::new(space);
        assert!(space.mm_alive().unwrap());
        let watch = watching(&space);
        drop(kid.0.stdin.take());
        assert!(kid.0.wait().unwrap().success());
        assert_eq!(watch.recv_timeout(LONG).unwrap(), Some(End::Exited));
        assert!(!space.is_alive());
        assert!(!space.mm_alive().unwrap());
        let e = space.read_at(0, &mut [0u8; 1]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ESRCH));
    }

    #[test]
    fn the_watcher_sees_the_program_exec() {
        let test = "foreign::space::the_watcher_sees_the_program_exec";
        let mut kid = shell("read x; exec sleep 30");
        let Some((space, _peer)) = space_of(test, kid.0.id(), 0, LONG) else {
            return;
        };
        let space = Arc::new(space);
        let watch = watching(&space);
        kid.0.stdin.take().unwrap().write_all(b"go\n").unwrap();
        assert_eq!(watch.recv_timeout(LONG).unwrap(), Some(End::Replaced));
        assert!(kid.0.try_wait().unwrap().is_none(), "the pid lives on");
        kid.0.kill().unwrap();
        kid.0.wait().unwrap();
    }

    #[test]
    fn a_reaper_that_hangs_up_or_is_lost_gets_a_live_program_killed() {
        let test = "foreign::space::a_reaper_that_hangs_up_or_is_lost_gets_a_live_program_killed";
        for hang_up in [true, false] {
            let mut kid = shell("sleep 30");
            let deadline = Duration::from_millis(100);
            let Some((space, peer)) = space_of(test, kid.0.id(), 0, deadline) else {
                return;
            };
            let space = Arc::new(space);
            let watch = watching(&space);
            let _silent = if hang_up {
                drop(peer);
                None
            } else {
                // Silent past the deadline: lost.
                assert!(space.discard(PAGE, PAGE).is_err());
                Some(peer)
            };
            let Some(End::Killed { why }) = watch.recv_timeout(LONG).unwrap() else {
                panic!("not killed");
            };
            let said = if hang_up { "hung up" } else { "is lost" };
            assert!(why.contains(said), "{why}");
            assert!(killed_by_us(&mut kid.0));
        }
    }

    #[test]
    fn a_stopped_watcher_returns_nothing_and_the_end_is_recorded_once() {
        let test = "foreign::space::a_stopped_watcher_returns_nothing_and_the_end_is_recorded_once";
        let mut kid = shell("sleep 30");
        let Some((space, _peer)) = space_of(test, kid.0.id(), 0, LONG) else {
            return;
        };
        let space = Arc::new(space);
        let watch = watching(&space);
        space.stop_watch();
        assert_eq!(watch.recv_timeout(LONG).unwrap(), None);
        assert!(space.is_alive());
        assert_eq!(space.wait_end(Duration::from_millis(20)), None);
        let waiter = {
            let space = space.clone();
            std::thread::spawn(move || space.wait_end(LONG))
        };
        space.kill().unwrap();
        assert!(killed_by_us(&mut kid.0));
        space.finish(End::Exited);
        space.finish(End::Replaced);
        assert_eq!(waiter.join().unwrap(), Some(End::Exited));
        assert_eq!(space.ended(), Some(End::Exited));
    }
}
