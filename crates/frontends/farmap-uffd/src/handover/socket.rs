//! File descriptors over a Unix stream socket (`SCM_RIGHTS`).

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
};

/// Most descriptors one message carries.
const MAX_FDS: usize = 4;

/// Sends `data` with `fds` attached to its first byte.
pub(crate) fn send_with_fds(
    sock: &UnixStream,
    data: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<()> {
    assert!(!data.is_empty() && fds.len() <= MAX_FDS);
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other(
            "the hand-over's descriptors do not fit a control message",
        ));
    }
    let sent = sendmsg(
        sock,
        &[IoSlice::new(data)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    // The descriptors went with the first byte; the rest is a plain write.
    (&*sock).write_all(&data[sent..])
}

/// Receives exactly `buf.len()` bytes, and the descriptors attached to them.
pub(crate) fn recv_with_fds(sock: &UnixStream, buf: &mut [u8]) -> io::Result<Vec<OwnedFd>> {
    assert!(!buf.is_empty());
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = recvmsg(
        sock,
        &mut [IoSliceMut::new(buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    if got.bytes == 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    let mut fds = Vec::new();
    for msg in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = msg {
            fds.extend(received);
        }
    }
    if got.flags.contains(ReturnFlags::CTRUNC) {
        return Err(io::Error::other(
            "too many file descriptors in a hand-over message",
        ));
    }
    (&*sock).read_exact(&mut buf[got.bytes..])?;
    Ok(fds)
}

/// Waits until `sock` is readable (or hung up), `stop` is readable, or `timeout_ms` passes
/// (-1: no limit). Returns (socket ready, stop ready).
pub(crate) fn wait_readable(
    sock: &UnixStream,
    stop: Option<BorrowedFd<'_>>,
    timeout: Option<Duration>,
) -> io::Result<(bool, bool)> {
    let timeout = timeout.map(|t| Timespec {
        tv_sec: t.as_secs() as i64,
        tv_nsec: i64::from(t.subsec_nanos()),
    });
    loop {
        let mut fds = vec![PollFd::new(sock, PollFlags::IN | PollFlags::RDHUP)];
        if let Some(stop) = &stop {
            fds.push(PollFd::from_borrowed_fd(*stop, PollFlags::IN));
        }
        match poll(&mut fds, timeout.as_ref()) {
            Ok(_) => {
                let ready = |i: usize| fds.get(i).is_some_and(|f| !f.revents().is_empty());
                return Ok((ready(0), ready(1)));
            }
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}
