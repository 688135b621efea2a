//! File descriptors over a Unix stream socket (`SCM_RIGHTS`), for tests that play both
//! sides of a hand-over: a program sending its userfaultfds and `/proc` files, a handler
//! receiving them.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

/// Most descriptors one message carries here.
pub const MAX_FDS: usize = 4;

/// Sends `data` with `fds` (at most [`MAX_FDS`]) attached, in one `sendmsg`.
pub fn send_fds(sock: &UnixStream, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    assert!(fds.len() <= MAX_FDS, "at most {MAX_FDS} descriptors");
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
    let sent = sendmsg(
        sock,
        &[IoSlice::new(data)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    if sent != data.len() {
        return Err(io::Error::other(format!(
            "sent {sent} of {} bytes",
            data.len()
        )));
    }
    Ok(())
}

/// Receives up to `data.len()` bytes and up to [`MAX_FDS`] descriptors (close-on-exec):
/// the bytes read and the descriptors.
pub fn recv_fds(sock: &UnixStream, data: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = recvmsg(
        sock,
        &mut [IoSliceMut::new(data)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    let mut fds = Vec::new();
    for msg in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = msg {
            fds.extend(received);
        }
    }
    Ok((got.bytes, fds))
}
