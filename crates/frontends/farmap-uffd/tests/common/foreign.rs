//! The program of the foreign tests (this test binary re-run), and its reaper thread, which
//! moves and discards pages in the program for the handler (farmap-run-proto's requests).
//! Its fds travel with `farmap_testkit::fds`.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};

use farmap_uffd::uffd::UffdRange;

/// The program's reaper thread: reads requests on `sock` and does them in this process, on
/// the destination's userfaultfd for a move; returns when the socket ends (or a reply
/// cannot be sent).
pub fn reaper_thread(sock: UnixStream, areas: [UffdRange; 2]) {
    use farmap_run_proto::{decode, Done, Msg, Op, MAX_MSG_LEN};
    use std::io::Read;
    let mut out = sock.try_clone().unwrap();
    let mut sock = sock;
    let mut buf = Vec::new();
    let mut chunk = [0u8; MAX_MSG_LEN];
    loop {
        let Ok(n) = sock.read(&mut chunk) else { return };
        if n == 0 {
            return;
        }
        buf.extend_from_slice(&chunk[..n]);
        while let Some((msg, used)) = decode(&buf).expect("a request") {
            buf.drain(..used);
            let Msg::Request(req) = msg else {
                panic!("not a request: {msg:?}")
            };
            let (bytes, errno) = match req.op {
                Op::Discard { start, len } => {
                    // SAFETY: a range of this program's own areas, which may go (the
                    // registrations' contract); madvise checks the rest.
                    let r = unsafe {
                        libc::madvise(start as usize as *mut _, len as usize, libc::MADV_DONTNEED)
                    };
                    if r == 0 {
                        (len, 0)
                    } else {
                        (
                            0,
                            std::io::Error::last_os_error()
                                .raw_os_error()
                                .unwrap_or(libc::EIO),
                        )
                    }
                }
                Op::Touch { start, len } => {
                    for page in (start..start + len).step_by(4096) {
                        // SAFETY: a page of this program's region, which the test's handler
                        // serves; a compare-and-swap of a value with itself changes nothing
                        // a thread of it sees (an add of 0 would compile to a load).
                        let word =
                            unsafe { &*(page as usize as *const std::sync::atomic::AtomicU64) };
                        let relaxed = std::sync::atomic::Ordering::Relaxed;
                        let mut v = word.load(relaxed);
                        while let Err(now) = word.compare_exchange_weak(v, v, relaxed, relaxed) {
                            v = now;
                        }
                    }
                    (len, 0)
                }
                Op::Move { src, dst, len } => {
                    let find = |a: u64| {
                        areas
                            .iter()
                            .find(|r| r.contains(a as usize))
                            .expect("an address in the program's areas")
                    };
                    let (from, to) = (find(src), find(dst));
                    let (src_off, dst_off) = (src as usize - from.base(), dst as usize - to.base());
                    match from.move_to(src_off, to, dst_off, len as usize, 0) {
                        Ok(n) => (n as u64, 0),
                        Err((n, e)) => (n as u64, e),
                    }
                }
            };
            let mut reply = [0u8; MAX_MSG_LEN];
            let done = Msg::Done(Done {
                id: req.id,
                errno,
                bytes,
            });
            let n = done.encode(&mut reply).unwrap();
            if out.write_all(&reply[..n]).is_err() {
                return;
            }
        }
    }
}

/// Re-runs this test binary as a program: its ignored test `entry`, with `env` set, its
/// stdout dropped, and two sockets on fds 3 (control) and 4 (its reaper's); returns the
/// child and this side's ends of the two sockets.
pub fn spawn_program(entry: &str, env: (&str, &str)) -> (Child, UnixStream, UnixStream) {
    let (ours, theirs) = UnixStream::pair().unwrap();
    let (reaper, reaper_theirs) = UnixStream::pair().unwrap();
    let (fd, reaper_fd) = (theirs.as_raw_fd(), reaper_theirs.as_raw_fd());
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        entry,
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(env.0, env.1)
    .stdout(Stdio::null());
    // SAFETY: between fork and exec the child only calls dup2 (async-signal-safe); the
    // copies on fds 3 and 4 have no close-on-exec flag, so exactly this child inherits the
    // sockets.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(fd, 3) < 0 || libc::dup2(reaper_fd, 4) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().unwrap();
    drop((theirs, reaper_theirs));
    (child, ours, reaper)
}
