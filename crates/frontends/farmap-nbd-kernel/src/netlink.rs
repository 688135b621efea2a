//! The generic netlink socket: requests out, replies and acknowledgements in (blocking, with
//! a receive timeout).

use std::io;
use std::os::fd::OwnedFd;
use std::time::Duration;

use rustix::io::Errno;
use rustix::net::netlink::{SocketAddrNetlink, GENERIC};
use rustix::net::sockopt::{set_socket_timeout, Timeout};
use rustix::net::{
    bind, recv, sendto, socket_with, AddressFamily, RecvFlags, SendFlags, SocketFlags, SocketType,
};

use crate::genl::{self, DecodeError, Message};

/// How long a request waits for the kernel's answer.
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);
/// The receive buffer: netlink datagrams of these families are far smaller.
const RECV_BUF: usize = 64 * 1024;

/// Why a netlink request failed.
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    /// The socket could not be used.
    #[error("generic netlink socket I/O failed ({what})")]
    Io {
        /// What was being done.
        what: &'static str,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The kernel answered with an error.
    #[error("the kernel answered {0}")]
    Kernel(Errno),
    /// The answer could not be read.
    #[error(transparent)]
    Malformed(#[from] DecodeError),
    /// No acknowledgement came.
    #[error("the kernel did not answer within {0:?}")]
    Timeout(Duration),
}

fn io_err(what: &'static str) -> impl FnOnce(Errno) -> NetlinkError {
    move |e| NetlinkError::Io {
        what,
        source: e.into(),
    }
}

/// A `NETLINK_GENERIC` socket bound to a port the kernel picks.
#[derive(Debug)]
pub struct GenlSocket {
    fd: OwnedFd,
    seq: u32,
}

/// The generic messages of one request's answer (their attribute blocks, copied out).
#[derive(Debug, Default)]
pub struct Answer {
    /// `(command, attributes)` of each generic netlink message.
    pub messages: Vec<(u8, Vec<u8>)>,
}

impl GenlSocket {
    /// Opens and binds the socket.
    pub fn open() -> Result<Self, NetlinkError> {
        let fd = socket_with(
            AddressFamily::NETLINK,
            SocketType::RAW,
            SocketFlags::CLOEXEC,
            Some(GENERIC),
        )
        .map_err(io_err("socket(AF_NETLINK, NETLINK_GENERIC)"))?;
        bind(&fd, &SocketAddrNetlink::new(0, 0)).map_err(io_err("bind"))?;
        set_socket_timeout(&fd, Timeout::Recv, Some(REPLY_TIMEOUT))
            .map_err(io_err("setting SO_RCVTIMEO"))?;
        Ok(Self { fd, seq: 1 })
    }

    /// The next sequence number for a request.
    pub fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    /// Sends `msg` (built with sequence number `seq`, asking for an ack) and collects the
    /// generic messages answering it until its acknowledgement.
    pub fn request(&mut self, seq: u32, msg: &[u8]) -> Result<Answer, NetlinkError> {
        sendto(
            &self.fd,
            msg,
            SendFlags::empty(),
            &SocketAddrNetlink::new(0, 0),
        )
        .map_err(io_err("sendto"))?;
        let mut answer = Answer::default();
        let mut buf = vec![0u8; RECV_BUF];
        loop {
            let (n, full) = match recv(&self.fd, &mut buf[..], RecvFlags::TRUNC) {
                Ok((got, full)) => (got, full),
                Err(Errno::AGAIN) => return Err(NetlinkError::Timeout(REPLY_TIMEOUT)),
                Err(Errno::INTR) => continue,
                Err(e) => return Err(io_err("recv")(e)),
            };
            if full > n {
                return Err(DecodeError {
                    what: "a datagram larger than the 64 KiB receive buffer",
                    at: n,
                }
                .into());
            }
            for m in genl::decode(&buf[..n])? {
                match m {
                    Message::Ack { seq: s } if s == seq => return Ok(answer),
                    Message::Error { seq: s, errno } if s == seq => {
                        return Err(NetlinkError::Kernel(Errno::from_raw_os_error(errno)))
                    }
                    Message::Genl {
                        seq: s, cmd, attrs, ..
                    } if s == seq && answer.messages.len() < 64 => {
                        answer.messages.push((cmd, attrs.to_vec()));
                    }
                    // Answers to earlier requests, multicast notifications: not ours.
                    _ => {}
                }
            }
        }
    }
}
