//! [`Reaper`]: asks a program's reaper thread to move or discard pages of its own address
//! space, one request at a time, over a Unix socket, in farmap-run-proto's messages.

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use farmap_run_proto::{decode, Done, Msg, Op, Request, MAX_MSG_LEN};
use parking_lot::Mutex;

/// Why a request to the reaper failed.
#[derive(Debug, thiserror::Error)]
pub enum ReaperError {
    /// The reaper did what it could and stopped: `bytes` were done before `errno` (for a
    /// move, `EAGAIN` and `EBUSY` mean: try again later; `EEXIST`: a destination page is
    /// present; `ENOENT`: a source page is missing).
    #[error("the reaper stopped after {bytes} bytes: {}", io::Error::from_raw_os_error(*errno))]
    Stopped {
        /// Bytes done.
        bytes: u64,
        /// The errno that stopped it.
        errno: i32,
    },
    /// A request out of the protocol's limits (unaligned, outside the address space): not
    /// sent.
    #[error("not a request the reaper can take: {0}")]
    Invalid(farmap_run_proto::Error),
    /// The reaper is gone, silent past the deadline, or spoke out of turn: the program can
    /// no longer be served (its memory cannot shrink), and the session must end.
    #[error("the program's reaper is lost: {0}")]
    Lost(#[source] io::Error),
}

/// This side of a program's reaper (see the module docs). Requests are serialized: the
/// reaper is one thread, and each reply names its request.
#[derive(Debug)]
pub struct Reaper {
    conn: Mutex<Conn>,
    /// A second handle on the socket, polled (never read) for the program's hang-up.
    watch: UnixStream,
}

#[derive(Debug)]
struct Conn {
    sock: UnixStream,
    next_id: u32,
    /// A request failed (lost, or an answer out of turn): the connection is not used again.
    broken: bool,
}

impl Reaper {
    /// Talks to the reaper on `sock`; a request not answered within `deadline` loses it.
    pub fn new(sock: UnixStream, deadline: Duration) -> io::Result<Reaper> {
        sock.set_read_timeout(Some(deadline))?;
        sock.set_write_timeout(Some(deadline))?;
        Ok(Reaper {
            watch: sock.try_clone()?,
            conn: Mutex::new(Conn {
                sock,
                next_id: 1,
                broken: false,
            }),
        })
    }

    /// The socket, to poll for the program's hang-up (`POLLRDHUP`) while requests go on:
    /// never to read or write.
    pub(crate) fn socket(&self) -> BorrowedFd<'_> {
        self.watch.as_fd()
    }

    /// `madvise(MADV_DONTNEED)` of `len` bytes at `start` in the program.
    pub fn discard(&self, start: u64, len: u64) -> Result<(), ReaperError> {
        self.call(Op::Discard { start, len }).map(|_| ())
    }

    /// `UFFDIO_MOVE` of `len` bytes from `src` to `dst` in the program (issued there on the
    /// destination's userfaultfd); the bytes moved.
    pub fn move_pages(&self, src: u64, dst: u64, len: u64) -> Result<u64, ReaperError> {
        self.call(Op::Move { src, dst, len })
    }

    fn call(&self, op: Op) -> Result<u64, ReaperError> {
        let mut conn = self.conn.lock();
        if conn.broken {
            return Err(lost("an earlier request failed"));
        }
        let id = conn.next_id;
        let mut out = [0u8; MAX_MSG_LEN];
        let n = Msg::Request(Request { id, op })
            .encode(&mut out)
            .map_err(ReaperError::Invalid)?;
        conn.next_id = conn.next_id.wrapping_add(1);
        let done = conn.exchange(id, &out[..n]);
        if done.is_err() {
            conn.broken = true;
        }
        match done? {
            Done {
                errno: 0, bytes, ..
            } => Ok(bytes),
            Done { errno, bytes, .. } => Err(ReaperError::Stopped { bytes, errno }),
        }
    }
}

impl Conn {
    /// Sends request `id` (encoded: `request`) and reads its `Done`.
    fn exchange(&mut self, id: u32, request: &[u8]) -> Result<Done, ReaperError> {
        self.sock.write_all(request).map_err(ReaperError::Lost)?;
        // The answer is a Done, of a fixed length: exactly that is read, never past it.
        let mut buf = [0u8; DONE_LEN];
        self.sock.read_exact(&mut buf).map_err(|e| match e.kind() {
            io::ErrorKind::UnexpectedEof => {
                lost("the reaper closed its socket (the program ended)")
            }
            _ => ReaperError::Lost(e),
        })?;
        match decode(&buf) {
            Ok(Some((Msg::Done(d), DONE_LEN))) if d.id == id => Ok(d),
            Ok(other) => Err(lost(format!("an answer out of turn: {other:?}"))),
            Err(e) => Err(lost(format!("a bad answer: {e}"))),
        }
    }
}

/// A `Done`'s length: the header and its 16-byte body.
const DONE_LEN: usize = farmap_run_proto::HEADER_LEN + 16;

fn lost(why: impl Into<String>) -> ReaperError {
    ReaperError::Lost(io::Error::other(why.into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn reaper(deadline: Duration) -> (Reaper, UnixStream) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        (Reaper::new(ours, deadline).unwrap(), theirs)
    }

    /// Answers the next request with `answer(request id)`.
    fn answer_with(mut peer: UnixStream, answer: impl FnOnce(u32) -> Vec<u8> + Send + 'static) {
        std::thread::spawn(move || {
            let mut req = [0u8; farmap_run_proto::HEADER_LEN + 32];
            peer.read_exact(&mut req).unwrap();
            let Ok(Some((Msg::Request(r), _))) = decode(&req) else {
                panic!("not a request")
            };
            let _ = peer.write_all(&answer(r.id));
            std::thread::sleep(Duration::from_millis(200));
        });
    }

    fn done(id: u32, errno: i32, bytes: u64) -> Vec<u8> {
        let mut out = [0u8; MAX_MSG_LEN];
        let n = Msg::Done(Done { id, errno, bytes })
            .encode(&mut out)
            .unwrap();
        out[..n].to_vec()
    }

    #[test]
    fn a_silent_reaper_is_lost_at_the_deadline() {
        let (r, _peer) = reaper(Duration::from_millis(100));
        let t = Instant::now();
        assert!(matches!(r.discard(4096, 4096), Err(ReaperError::Lost(_))));
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    }

    #[test]
    fn an_answer_to_another_request_loses_the_reaper_for_good() {
        let (r, peer) = reaper(Duration::from_secs(5));
        answer_with(peer, |id| done(id + 1, 0, 4096));
        assert!(matches!(r.discard(4096, 4096), Err(ReaperError::Lost(_))));
        let again = r.discard(4096, 4096).unwrap_err().to_string();
        assert!(again.contains("an earlier request failed"), "{again}");
    }

    #[test]
    fn garbage_or_a_closed_socket_is_lost_and_a_refusal_is_not() {
        let (r, peer) = reaper(Duration::from_secs(5));
        answer_with(peer, |_| vec![0xff; DONE_LEN]);
        assert!(matches!(r.discard(4096, 4096), Err(ReaperError::Lost(_))));

        let (r, peer) = reaper(Duration::from_secs(5));
        answer_with(peer, |_| Vec::new());
        let e = r.move_pages(4096, 1 << 20, 4096).unwrap_err().to_string();
        assert!(e.contains("closed its socket"), "{e}");

        let (r, peer) = reaper(Duration::from_secs(5));
        answer_with(peer, |id| done(id, libc::EBUSY, 0));
        assert!(matches!(
            r.move_pages(4096, 1 << 20, 4096),
            Err(ReaperError::Stopped {
                bytes: 0,
                errno: libc::EBUSY
            })
        ));
    }
}
