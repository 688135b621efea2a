//! [`Reaper`]: asks a program's reaper thread to move or discard pages of its own address
//! space over a Unix socket, in farmap-run-proto's messages: one request, or a group of up
//! to [`MAX_PIPELINE`] sent with one write and answered with one (a round trip is two
//! context switches on a CPU the program shares: a group of moves pays them once).

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use farmap_run_proto::{
    decode, Done, Msg, Op, Request, DONE_LEN, MAX_MSG_LEN, MAX_PIPELINE, REQUEST_LEN,
};
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
        self.run(&[op])
            .pop()
            .unwrap_or_else(|| Err(lost("no answer")))
    }

    /// Does `ops` in order, [`MAX_PIPELINE`] to a round trip: each one's outcome (the bytes
    /// done, or why it stopped). Each is done whatever the ones before it came to; a request
    /// out of the protocol's limits is not sent (`Invalid`); once the reaper is lost, every
    /// request after is lost too.
    pub fn run(&self, ops: &[Op]) -> Vec<Result<u64, ReaperError>> {
        let mut outcomes = Vec::with_capacity(ops.len());
        let mut conn = self.conn.lock();
        let mut bytes = Vec::with_capacity(ops.len().min(MAX_PIPELINE) * REQUEST_LEN);
        for group in ops.chunks(MAX_PIPELINE) {
            if conn.broken {
                outcomes.extend(group.iter().map(|_| Err(lost("an earlier request failed"))));
                continue;
            }
            // Encoded first: a request that does not encode is answered here, not sent.
            bytes.clear();
            let first_id = conn.next_id;
            let at = outcomes.len();
            let mut sent = 0u32;
            for &op in group {
                let id = first_id.wrapping_add(sent);
                let mut out = [0u8; MAX_MSG_LEN];
                match Msg::Request(Request { id, op }).encode(&mut out) {
                    Ok(n) => {
                        bytes.extend_from_slice(&out[..n]);
                        sent += 1;
                        outcomes.push(Ok(0));
                    }
                    Err(e) => outcomes.push(Err(ReaperError::Invalid(e))),
                }
            }
            if sent == 0 {
                continue;
            }
            conn.next_id = first_id.wrapping_add(sent);
            let mut answers = match conn.exchange(first_id, sent as usize, &bytes) {
                Ok(a) => a.into_iter(),
                Err(e) => {
                    conn.broken = true;
                    let why = e.to_string();
                    let mut first = Some(e);
                    for o in outcomes[at..].iter_mut().filter(|o| o.is_ok()) {
                        *o = Err(first.take().unwrap_or_else(|| lost(why.clone())));
                    }
                    continue;
                }
            };
            for o in outcomes[at..].iter_mut().filter(|o| o.is_ok()) {
                *o = match answers.next() {
                    Some(Done {
                        errno: 0, bytes, ..
                    }) => Ok(bytes),
                    Some(Done { errno, bytes, .. }) => Err(ReaperError::Stopped { bytes, errno }),
                    None => Err(lost("no answer")),
                };
            }
        }
        outcomes
    }
}

impl Conn {
    /// Sends `n` requests numbered from `first_id` (encoded: `requests`) and reads their
    /// `Done`s, in order.
    fn exchange(
        &mut self,
        first_id: u32,
        n: usize,
        requests: &[u8],
    ) -> Result<Vec<Done>, ReaperError> {
        self.sock.write_all(requests).map_err(ReaperError::Lost)?;
        // The answers are `Done`s, of a fixed length: exactly those are read, never past.
        let mut buf = [0u8; MAX_PIPELINE * DONE_LEN];
        let buf = &mut buf[..n * DONE_LEN];
        self.sock.read_exact(buf).map_err(|e| match e.kind() {
            io::ErrorKind::UnexpectedEof => {
                lost("the reaper closed its socket (the program ended)")
            }
            _ => ReaperError::Lost(e),
        })?;
        let mut answers = Vec::with_capacity(n);
        for (k, one) in buf.chunks_exact(DONE_LEN).enumerate() {
            let id = first_id.wrapping_add(k as u32);
            match decode(one) {
                Ok(Some((Msg::Done(d), DONE_LEN))) if d.id == id => answers.push(d),
                Ok(other) => return Err(lost(format!("an answer out of turn: {other:?}"))),
                Err(e) => return Err(lost(format!("a bad answer: {e}"))),
            }
        }
        Ok(answers)
    }
}

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

    #[test]
    fn a_group_goes_in_one_write_and_each_request_has_its_outcome() {
        let (r, mut peer) = reaper(Duration::from_secs(5));
        // The stand-in reads all three requests before it answers any: a handler that
        // waited for the first answer would be stuck until its deadline.
        let peer_side = std::thread::spawn(move || {
            let mut reqs = [0u8; 3 * REQUEST_LEN];
            peer.read_exact(&mut reqs).unwrap();
            let mut answers = Vec::new();
            for (k, one) in reqs.chunks_exact(REQUEST_LEN).enumerate() {
                let Ok(Some((Msg::Request(q), _))) = decode(one) else {
                    panic!("not a request")
                };
                let errno = if k == 1 { libc::EAGAIN } else { 0 };
                answers.extend(done(q.id, errno, if k == 1 { 4096 } else { 8192 }));
            }
            peer.write_all(&answers).unwrap();
            peer
        });
        let ops = [
            Op::Move {
                src: 1 << 20,
                dst: 1 << 30,
                len: 8192,
            },
            Op::Move {
                src: 2 << 20,
                dst: (1 << 30) + 8192,
                len: 8192,
            },
            // Unaligned: answered here, never sent.
            Op::Discard {
                start: 4097,
                len: 4096,
            },
            Op::Discard {
                start: 1 << 20,
                len: 8192,
            },
        ];
        let out = r.run(&ops);
        assert!(matches!(out[0], Ok(8192)), "{out:?}");
        assert!(
            matches!(
                out[1],
                Err(ReaperError::Stopped {
                    bytes: 4096,
                    errno: libc::EAGAIN
                })
            ),
            "{out:?}"
        );
        assert!(matches!(out[2], Err(ReaperError::Invalid(_))), "{out:?}");
        assert!(matches!(out[3], Ok(8192)), "{out:?}");
        let _peer = peer_side.join().unwrap();
    }

    #[test]
    fn a_bad_answer_in_a_group_loses_every_request_of_it() {
        let (r, mut peer) = reaper(Duration::from_secs(5));
        std::thread::spawn(move || {
            let mut reqs = [0u8; 2 * REQUEST_LEN];
            peer.read_exact(&mut reqs).unwrap();
            let Ok(Some((Msg::Request(q), _))) = decode(&reqs) else {
                panic!("not a request")
            };
            // The first answer is right, the second names a request never sent.
            let mut answers = done(q.id, 0, 4096);
            answers.extend(done(q.id + 7, 0, 4096));
            peer.write_all(&answers).unwrap();
            std::thread::sleep(Duration::from_millis(200));
        });
        let op = Op::Discard {
            start: 4096,
            len: 4096,
        };
        let out = r.run(&[op, op]);
        assert!(
            out.iter().all(|o| matches!(o, Err(ReaperError::Lost(_)))),
            "{out:?}"
        );
        assert!(matches!(r.discard(4096, 4096), Err(ReaperError::Lost(_))));
    }
}
