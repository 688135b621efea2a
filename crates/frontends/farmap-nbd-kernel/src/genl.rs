//! Generic netlink messages for the kernel's NBD family, built and parsed with no I/O.
//!
//! The layouts are the uapi's (`linux/netlink.h`, `linux/genetlink.h`, `linux/nbd-netlink.h`):
//! a message is a 16-byte `nlmsghdr` (length, type, flags, sequence, port id; host byte
//! order), a 4-byte `genlmsghdr` (command, version, reserved), then attributes, each a
//! `u16` length (header included), a `u16` type, and the payload padded to 4 bytes.
//!
//! [`decode`] takes a whole datagram from the kernel and checks every length against what
//! is left of it before using it; it never allocates for what it reads.

/// Netlink and generic-netlink numbers from the uapi headers.
pub mod consts {
    /// `sizeof(struct nlmsghdr)`.
    pub const NLMSG_HDRLEN: usize = 16;
    /// `GENL_HDRLEN`.
    pub const GENL_HDRLEN: usize = 4;
    /// `NLA_HDRLEN`.
    pub const NLA_HDRLEN: usize = 4;
    /// `NLM_F_REQUEST`.
    pub const NLM_F_REQUEST: u16 = 0x01;
    /// `NLM_F_ACK`.
    pub const NLM_F_ACK: u16 = 0x04;
    /// `NLMSG_NOOP`.
    pub const NLMSG_NOOP: u16 = 1;
    /// `NLMSG_ERROR` (an error, or with error 0 an acknowledgement).
    pub const NLMSG_ERROR: u16 = 2;
    /// `NLMSG_DONE`.
    pub const NLMSG_DONE: u16 = 3;
    /// `NLA_F_NESTED`.
    pub const NLA_F_NESTED: u16 = 1 << 15;
    /// `NLA_F_NET_BYTEORDER`.
    pub const NLA_F_NET_BYTEORDER: u16 = 1 << 14;
    /// `NLA_TYPE_MASK`.
    pub const NLA_TYPE_MASK: u16 = !(NLA_F_NESTED | NLA_F_NET_BYTEORDER);

    /// `GENL_ID_CTRL`: the controller family, which resolves names to ids.
    pub const GENL_ID_CTRL: u16 = 0x10;
    /// `CTRL_CMD_NEWFAMILY` (the controller's reply).
    pub const CTRL_CMD_NEWFAMILY: u8 = 1;
    /// `CTRL_CMD_GETFAMILY`.
    pub const CTRL_CMD_GETFAMILY: u8 = 3;
    /// `CTRL_ATTR_FAMILY_ID` (u16).
    pub const CTRL_ATTR_FAMILY_ID: u16 = 1;
    /// `CTRL_ATTR_FAMILY_NAME` (string).
    pub const CTRL_ATTR_FAMILY_NAME: u16 = 2;
    /// `CTRL_ATTR_MCAST_GROUPS` (nested: groups, each nested).
    pub const CTRL_ATTR_MCAST_GROUPS: u16 = 7;
    /// `CTRL_ATTR_MCAST_GRP_NAME` (string).
    pub const CTRL_ATTR_MCAST_GRP_NAME: u16 = 1;
    /// `CTRL_ATTR_MCAST_GRP_ID` (u32).
    pub const CTRL_ATTR_MCAST_GRP_ID: u16 = 2;

    /// `NBD_GENL_FAMILY_NAME`.
    pub const NBD_FAMILY: &str = "nbd";
    /// `NBD_GENL_VERSION`.
    pub const NBD_GENL_VERSION: u8 = 1;
    /// `NBD_CMD_CONNECT`.
    pub const NBD_CMD_CONNECT: u8 = 1;
    /// `NBD_CMD_DISCONNECT`.
    pub const NBD_CMD_DISCONNECT: u8 = 2;
    /// `NBD_ATTR_INDEX` (u32).
    pub const NBD_ATTR_INDEX: u16 = 1;
    /// `NBD_ATTR_SIZE_BYTES` (u64).
    pub const NBD_ATTR_SIZE_BYTES: u16 = 2;
    /// `NBD_ATTR_BLOCK_SIZE_BYTES` (u64).
    pub const NBD_ATTR_BLOCK_SIZE_BYTES: u16 = 3;
    /// `NBD_ATTR_TIMEOUT` (u64 seconds).
    pub const NBD_ATTR_TIMEOUT: u16 = 4;
    /// `NBD_ATTR_SERVER_FLAGS` (u64: the handshake's transmission flags).
    pub const NBD_ATTR_SERVER_FLAGS: u16 = 5;
    /// `NBD_ATTR_CLIENT_FLAGS` (u64: `NBD_CFLAG_*`).
    pub const NBD_ATTR_CLIENT_FLAGS: u16 = 6;
    /// `NBD_ATTR_SOCKETS` (nested `NBD_SOCK_ITEM`s).
    pub const NBD_ATTR_SOCKETS: u16 = 7;
    /// `NBD_ATTR_DEAD_CONN_TIMEOUT` (u64 seconds).
    pub const NBD_ATTR_DEAD_CONN_TIMEOUT: u16 = 8;
    /// `NBD_ATTR_BACKEND_IDENTIFIER` (string, shown in `/sys/block/nbdN/backend`).
    pub const NBD_ATTR_BACKEND_IDENTIFIER: u16 = 10;
    /// `NBD_SOCK_ITEM` (nested).
    pub const NBD_SOCK_ITEM: u16 = 1;
    /// `NBD_SOCK_FD` (u32).
    pub const NBD_SOCK_FD: u16 = 1;
    /// `NBD_CFLAG_DESTROY_ON_DISCONNECT`: the device goes away at disconnect.
    pub const NBD_CFLAG_DESTROY_ON_DISCONNECT: u64 = 1 << 0;
    /// `NBD_CFLAG_DISCONNECT_ON_CLOSE`: disconnect when the last opener closes the device.
    pub const NBD_CFLAG_DISCONNECT_ON_CLOSE: u64 = 1 << 1;
}

use consts::*;

/// Longest string attribute read from a reply (family and group names are under 16 bytes).
pub const MAX_STRING: usize = 256;

/// Builds one generic netlink request.
#[derive(Debug, Clone)]
pub struct MessageBuilder {
    buf: Vec<u8>,
}

impl MessageBuilder {
    /// A message to family `family` (its id), command `cmd`.
    pub fn new(family: u16, flags: u16, seq: u32, cmd: u8, version: u8) -> Self {
        let mut buf = Vec::with_capacity(256);
        buf.extend_from_slice(&0u32.to_ne_bytes()); // length, set by `finish`
        buf.extend_from_slice(&family.to_ne_bytes());
        buf.extend_from_slice(&flags.to_ne_bytes());
        buf.extend_from_slice(&seq.to_ne_bytes());
        buf.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel fills it in
        buf.extend_from_slice(&[cmd, version, 0, 0]);
        Self { buf }
    }

    fn attr(&mut self, ty: u16, payload: &[u8]) -> &mut Self {
        let len = u16::try_from(NLA_HDRLEN + payload.len()).expect("attribute under 64 KiB");
        self.buf.extend_from_slice(&len.to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(payload);
        self.pad();
        self
    }

    fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }

    /// A `u16` attribute.
    pub fn u16(&mut self, ty: u16, v: u16) -> &mut Self {
        self.attr(ty, &v.to_ne_bytes())
    }

    /// A `u32` attribute.
    pub fn u32(&mut self, ty: u16, v: u32) -> &mut Self {
        self.attr(ty, &v.to_ne_bytes())
    }

    /// A `u64` attribute.
    pub fn u64(&mut self, ty: u16, v: u64) -> &mut Self {
        self.attr(ty, &v.to_ne_bytes())
    }

    /// A NUL-terminated string attribute.
    pub fn string(&mut self, ty: u16, s: &str) -> &mut Self {
        let mut v = Vec::with_capacity(s.len() + 1);
        v.extend_from_slice(s.as_bytes());
        v.push(0);
        self.attr(ty, &v)
    }

    /// A nested attribute (`NLA_F_NESTED` set) holding what `inner` adds.
    pub fn nested(&mut self, ty: u16, inner: impl FnOnce(&mut Self)) -> &mut Self {
        let start = self.buf.len();
        self.buf.extend_from_slice(&[0, 0]);
        self.buf
            .extend_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
        inner(self);
        let len = u16::try_from(self.buf.len() - start).expect("attribute under 64 KiB");
        self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
        self
    }

    /// The finished message.
    pub fn finish(mut self) -> Vec<u8> {
        let len = self.buf.len() as u32;
        self.buf[..4].copy_from_slice(&len.to_ne_bytes());
        self.buf
    }
}

/// What the kernel answers request `seq` with when it is done with it: an `NLMSG_ERROR`
/// message with `code` (0 for an ack, else a negative errno), echoing an empty request
/// header. For tests and fuzz seeds.
pub fn ack(seq: u32, code: i32) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&36u32.to_ne_bytes());
    v.extend_from_slice(&NLMSG_ERROR.to_ne_bytes());
    v.extend_from_slice(&0u16.to_ne_bytes());
    v.extend_from_slice(&seq.to_ne_bytes());
    v.extend_from_slice(&0u32.to_ne_bytes());
    v.extend_from_slice(&code.to_ne_bytes());
    v.extend_from_slice(&[0; 16]); // the request's header, echoed
    v
}

/// `CTRL_CMD_GETFAMILY` for `name`.
pub fn get_family(seq: u32, name: &str) -> Vec<u8> {
    let mut m = MessageBuilder::new(
        GENL_ID_CTRL,
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
        CTRL_CMD_GETFAMILY,
        1,
    );
    m.string(CTRL_ATTR_FAMILY_NAME, name);
    m.finish()
}

/// What `NBD_CMD_CONNECT` asks of the kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connect {
    /// The device's size in bytes.
    pub size: u64,
    /// Its logical block size (a power of two, 512..=4096).
    pub block_size: u64,
    /// Seconds before a request with no reply fails (0: the kernel's default).
    pub timeout_s: u64,
    /// Seconds to wait for new sockets after a connection dies (0: fail at once).
    pub dead_conn_timeout_s: u64,
    /// The transmission flags the server announced.
    pub server_flags: u64,
    /// `NBD_CFLAG_*`.
    pub client_flags: u64,
    /// The connected sockets' descriptors (in this process).
    pub sockets: Vec<u32>,
    /// A device number to use; the kernel picks a free one when `None`.
    pub index: Option<u32>,
    /// Shown in `/sys/block/nbdN/backend`.
    pub backend: Option<String>,
}

/// `NBD_CMD_CONNECT` to the nbd family `family`.
pub fn connect(family: u16, seq: u32, c: &Connect) -> Vec<u8> {
    let mut m = MessageBuilder::new(
        family,
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
        NBD_CMD_CONNECT,
        NBD_GENL_VERSION,
    );
    if let Some(index) = c.index {
        m.u32(NBD_ATTR_INDEX, index);
    }
    m.u64(NBD_ATTR_SIZE_BYTES, c.size)
        .u64(NBD_ATTR_BLOCK_SIZE_BYTES, c.block_size)
        .u64(NBD_ATTR_TIMEOUT, c.timeout_s)
        .u64(NBD_ATTR_DEAD_CONN_TIMEOUT, c.dead_conn_timeout_s)
        .u64(NBD_ATTR_SERVER_FLAGS, c.server_flags)
        .u64(NBD_ATTR_CLIENT_FLAGS, c.client_flags);
    if let Some(backend) = &c.backend {
        m.string(NBD_ATTR_BACKEND_IDENTIFIER, backend);
    }
    m.nested(NBD_ATTR_SOCKETS, |m| {
        for &fd in &c.sockets {
            m.nested(NBD_SOCK_ITEM, |m| {
                m.u32(NBD_SOCK_FD, fd);
            });
        }
    });
    m.finish()
}

/// `NBD_CMD_DISCONNECT` of device `index`.
pub fn disconnect(family: u16, seq: u32, index: u32) -> Vec<u8> {
    let mut m = MessageBuilder::new(
        family,
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
        NBD_CMD_DISCONNECT,
        NBD_GENL_VERSION,
    );
    m.u32(NBD_ATTR_INDEX, index);
    m.finish()
}

/// A reply from the kernel that does not follow the netlink layout.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed netlink reply from the kernel: {what} (at byte {at})")]
pub struct DecodeError {
    /// What was wrong.
    pub what: &'static str,
    /// Where, in the datagram or the attribute block.
    pub at: usize,
}

fn err(what: &'static str, at: usize) -> DecodeError {
    DecodeError { what, at }
}

fn ne_u16(b: &[u8], at: usize) -> u16 {
    u16::from_ne_bytes([b[at], b[at + 1]])
}

fn ne_u32(b: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// One message of a datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Message<'a> {
    /// `NLMSG_ERROR` with error 0: request `seq` succeeded.
    Ack {
        /// The request's sequence number.
        seq: u32,
    },
    /// `NLMSG_ERROR`: request `seq` failed with `errno` (positive).
    Error {
        /// The request's sequence number.
        seq: u32,
        /// The error number.
        errno: i32,
    },
    /// `NLMSG_DONE` (end of a dump).
    Done {
        /// The request's sequence number.
        seq: u32,
    },
    /// A generic netlink message.
    Genl {
        /// The message type: the family's id.
        family: u16,
        /// The request's sequence number.
        seq: u32,
        /// The command.
        cmd: u8,
        /// Its attributes, to read with [`attrs`].
        attrs: &'a [u8],
    },
    /// Anything else (`NLMSG_NOOP`, ...), to be ignored.
    Other {
        /// The message type.
        ty: u16,
        /// The request's sequence number.
        seq: u32,
    },
}

/// Splits a datagram into its messages (at most `limit` of them: the rest are refused).
pub fn decode(datagram: &[u8]) -> Result<Vec<Message<'_>>, DecodeError> {
    const LIMIT: usize = 1024;
    let mut out = Vec::new();
    let mut at = 0;
    while at < datagram.len() {
        let rest = &datagram[at..];
        if rest.len() < NLMSG_HDRLEN {
            return Err(err("a message header is cut short", at));
        }
        let len = ne_u32(rest, 0) as usize;
        if len < NLMSG_HDRLEN || len > rest.len() {
            return Err(err("a message length is out of bounds", at));
        }
        if out.len() == LIMIT {
            return Err(err("more than 1024 messages in one datagram", at));
        }
        let ty = ne_u16(rest, 4);
        let seq = ne_u32(rest, 8);
        let body = &rest[NLMSG_HDRLEN..len];
        let msg = match ty {
            NLMSG_ERROR => {
                if body.len() < 4 {
                    return Err(err("an error message has no error number", at));
                }
                let code = i32::from_ne_bytes([body[0], body[1], body[2], body[3]]);
                match code {
                    0 => Message::Ack { seq },
                    c if c < 0 && c > -4096 => Message::Error { seq, errno: -c },
                    _ => return Err(err("an error number out of range", at)),
                }
            }
            NLMSG_DONE => Message::Done { seq },
            ty if ty >= GENL_ID_CTRL => {
                if body.len() < GENL_HDRLEN {
                    return Err(err("a generic netlink header is cut short", at));
                }
                Message::Genl {
                    family: ty,
                    seq,
                    cmd: body[0],
                    attrs: &body[GENL_HDRLEN..],
                }
            }
            ty => Message::Other { ty, seq },
        };
        out.push(msg);
        // Messages are aligned to 4 bytes; the last one may end the datagram unpadded.
        at += len.next_multiple_of(4).min(rest.len());
    }
    Ok(out)
}

/// One attribute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr<'a> {
    /// Its type, without the flag bits.
    pub ty: u16,
    /// Its payload.
    pub payload: &'a [u8],
}

impl<'a> Attr<'a> {
    /// The payload as a `u16`.
    pub fn u16(&self) -> Result<u16, DecodeError> {
        match self.payload {
            [a, b] => Ok(u16::from_ne_bytes([*a, *b])),
            _ => Err(err("a u16 attribute is not 2 bytes long", 0)),
        }
    }

    /// The payload as a `u32`.
    pub fn u32(&self) -> Result<u32, DecodeError> {
        match self.payload {
            [a, b, c, d] => Ok(u32::from_ne_bytes([*a, *b, *c, *d])),
            _ => Err(err("a u32 attribute is not 4 bytes long", 0)),
        }
    }

    /// The payload as a string (up to its NUL, at most [`MAX_STRING`] bytes).
    pub fn string(&self) -> Result<&'a str, DecodeError> {
        let p = self.payload;
        let end = p.iter().position(|&b| b == 0).unwrap_or(p.len());
        if end > MAX_STRING {
            return Err(err("a string attribute is too long", 0));
        }
        std::str::from_utf8(&p[..end]).map_err(|_| err("a string attribute is not UTF-8", 0))
    }

    /// The attributes nested in this one.
    pub fn nested(&self) -> Attrs<'a> {
        attrs(self.payload)
    }
}

/// The attributes of a block, in order.
#[derive(Debug, Clone)]
pub struct Attrs<'a> {
    block: &'a [u8],
    at: usize,
}

/// Reads the attributes of `block` (a message's or a nested attribute's payload).
pub fn attrs(block: &[u8]) -> Attrs<'_> {
    Attrs { block, at: 0 }
}

impl<'a> Iterator for Attrs<'a> {
    type Item = Result<Attr<'a>, DecodeError>;

    fn next(&mut self) -> Option<Self::Item> {
        let rest = &self.block[self.at.min(self.block.len())..];
        if rest.is_empty() {
            return None;
        }
        let at = self.at;
        if rest.len() < NLA_HDRLEN {
            self.at = self.block.len();
            return Some(Err(err("an attribute header is cut short", at)));
        }
        let len = ne_u16(rest, 0) as usize;
        if len < NLA_HDRLEN || len > rest.len() {
            self.at = self.block.len();
            return Some(Err(err("an attribute length is out of bounds", at)));
        }
        let ty = ne_u16(rest, 2) & NLA_TYPE_MASK;
        self.at += len.next_multiple_of(4);
        Some(Ok(Attr {
            ty,
            payload: &rest[NLA_HDRLEN..len],
        }))
    }
}

/// What the controller says about a family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Family {
    /// The family's id (the message type of its requests).
    pub id: u16,
    /// Its multicast groups: name and id (at most 64 are kept).
    pub groups: Vec<(String, u32)>,
}

/// Reads a `CTRL_CMD_NEWFAMILY` reply's attributes.
pub fn family_reply(block: &[u8]) -> Result<Family, DecodeError> {
    let mut id = None;
    let mut groups = Vec::new();
    for a in attrs(block) {
        let a = a?;
        match a.ty {
            CTRL_ATTR_FAMILY_ID => id = Some(a.u16()?),
            CTRL_ATTR_MCAST_GROUPS => {
                for g in a.nested() {
                    let (mut name, mut gid) = (None, None);
                    for f in g?.nested() {
                        let f = f?;
                        match f.ty {
                            CTRL_ATTR_MCAST_GRP_NAME => name = Some(f.string()?),
                            CTRL_ATTR_MCAST_GRP_ID => gid = Some(f.u32()?),
                            _ => {}
                        }
                    }
                    if let (Some(n), Some(i)) = (name, gid) {
                        if groups.len() < 64 {
                            groups.push((n.to_owned(), i));
                        }
                    }
                }
            }
            _ => {}
        }
    }
    let id = id.ok_or(err("the family reply has no CTRL_ATTR_FAMILY_ID", 0))?;
    Ok(Family { id, groups })
}

/// The `NBD_ATTR_INDEX` of a reply's attributes, if present.
pub fn nbd_index(block: &[u8]) -> Result<Option<u32>, DecodeError> {
    for a in attrs(block) {
        let a = a?;
        if a.ty == NBD_ATTR_INDEX {
            return a.u32().map(Some);
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `CTRL_CMD_GETFAMILY` for "nbd", laid out by hand from the uapi structs
    /// (little-endian).
    #[cfg(target_endian = "little")]
    #[test]
    fn get_family_bytes() {
        let want: &[u8] = &[
            28, 0, 0, 0, // nlmsg_len: 16 + 4 + 8
            0x10, 0, // GENL_ID_CTRL
            5, 0, // NLM_F_REQUEST | NLM_F_ACK
            7, 0, 0, 0, // seq
            0, 0, 0, 0, // pid
            3, 1, 0, 0, // CTRL_CMD_GETFAMILY, version 1
            8, 0, 2, 0, b'n', b'b', b'd', 0, // CTRL_ATTR_FAMILY_NAME "nbd\0"
        ];
        assert_eq!(get_family(7, "nbd"), want);
    }

    /// `NBD_CMD_CONNECT` with two sockets and an index.
    #[cfg(target_endian = "little")]
    #[test]
    fn connect_bytes() {
        let c = Connect {
            size: 64 << 20,
            block_size: 4096,
            timeout_s: 30,
            dead_conn_timeout_s: 0,
            server_flags: 0x1ed,
            client_flags: NBD_CFLAG_DESTROY_ON_DISCONNECT,
            sockets: vec![5, 9],
            index: Some(3),
            backend: None,
        };
        let got = connect(0x21, 2, &c);
        let mut want: Vec<u8> = vec![
            0, 0, 0, 0, // length, checked below
            0x21, 0, 5, 0, 2, 0, 0, 0, 0, 0, 0, 0, // type, flags, seq, pid
            1, 1, 0, 0, // NBD_CMD_CONNECT, version 1
            8, 0, 1, 0, 3, 0, 0, 0, // NBD_ATTR_INDEX 3
        ];
        for (ty, v) in [
            (2u8, 64u64 << 20),
            (3, 4096),
            (4, 30),
            (8, 0),
            (5, 0x1ed),
            (6, 1),
        ] {
            want.extend_from_slice(&[12, 0, ty, 0]);
            want.extend_from_slice(&v.to_le_bytes());
        }
        // NBD_ATTR_SOCKETS | NLA_F_NESTED: 4 + 2 * (4 + 8)
        want.extend_from_slice(&[28, 0, 7, 0x80]);
        for fd in [5u8, 9] {
            want.extend_from_slice(&[12, 0, 1, 0x80, 8, 0, 1, 0, fd, 0, 0, 0]);
        }
        let len = want.len() as u32;
        want[..4].copy_from_slice(&len.to_le_bytes());
        assert_eq!(got, want);
    }

    #[cfg(target_endian = "little")]
    #[test]
    fn disconnect_bytes() {
        let want: &[u8] = &[
            28, 0, 0, 0, 0x21, 0, 5, 0, 9, 0, 0, 0, 0, 0, 0, 0, // header
            2, 1, 0, 0, // NBD_CMD_DISCONNECT
            8, 0, 1, 0, 4, 0, 0, 0, // NBD_ATTR_INDEX 4
        ];
        assert_eq!(disconnect(0x21, 9, 4), want);
    }

    /// A controller reply as the kernel sends it (id, name, groups), then its ack.
    fn family_datagram(id: u16, seq: u32) -> Vec<u8> {
        let mut m = MessageBuilder::new(GENL_ID_CTRL, 0, seq, CTRL_CMD_NEWFAMILY, 2);
        m.string(CTRL_ATTR_FAMILY_NAME, "nbd")
            .u16(CTRL_ATTR_FAMILY_ID, id)
            .nested(CTRL_ATTR_MCAST_GROUPS, |m| {
                m.nested(1, |m| {
                    m.u32(CTRL_ATTR_MCAST_GRP_ID, 9)
                        .string(CTRL_ATTR_MCAST_GRP_NAME, "nbd_mc_group");
                });
            });
        let mut d = m.finish();
        d.extend_from_slice(&ack(seq, 0));
        d
    }

    #[test]
    fn decodes_a_family_reply_and_its_ack() {
        let d = family_datagram(0x1b, 4);
        let msgs = decode(&d).unwrap();
        assert_eq!(msgs.len(), 2);
        let Message::Genl {
            family, seq, attrs, ..
        } = msgs[0]
        else {
            panic!("{:?}", msgs[0]);
        };
        assert_eq!((family, seq), (GENL_ID_CTRL, 4));
        assert_eq!(
            family_reply(attrs).unwrap(),
            Family {
                id: 0x1b,
                groups: vec![("nbd_mc_group".into(), 9)]
            }
        );
        assert_eq!(msgs[1], Message::Ack { seq: 4 });
    }

    #[test]
    fn decodes_errors_and_refuses_bad_lengths() {
        let d = ack(3, -2);
        assert_eq!(
            decode(&d).unwrap(),
            vec![Message::Error { seq: 3, errno: 2 }]
        );
        let mut long = ack(3, 0);
        long[0] = 200; // longer than the datagram
        assert!(decode(&long).is_err());
        assert!(decode(&ack(3, 0)[..10]).is_err());
        let mut short = ack(3, 0);
        short[0] = 4; // shorter than a header
        assert!(decode(&short).is_err());
        // An attribute whose length runs past its block.
        let bad = [200u8, 0, 1, 0, 0, 0, 0, 0];
        assert!(attrs(&bad).next().unwrap().is_err());
        assert!(family_reply(&bad).is_err());
        // A family reply without the id.
        let mut m = MessageBuilder::new(GENL_ID_CTRL, 0, 1, CTRL_CMD_NEWFAMILY, 2);
        m.string(CTRL_ATTR_FAMILY_NAME, "nbd");
        let d = m.finish();
        let Message::Genl { attrs, .. } = decode(&d).unwrap()[0] else {
            panic!()
        };
        assert!(family_reply(attrs).is_err());
    }

    #[test]
    fn reads_the_index_of_a_connect_reply() {
        let mut m = MessageBuilder::new(0x21, 0, 5, NBD_CMD_CONNECT, 1);
        m.u32(NBD_ATTR_INDEX, 7);
        let d = m.finish();
        let Message::Genl { attrs, cmd, .. } = decode(&d).unwrap()[0] else {
            panic!()
        };
        assert_eq!(cmd, NBD_CMD_CONNECT);
        assert_eq!(nbd_index(attrs).unwrap(), Some(7));
        assert_eq!(nbd_index(&[]).unwrap(), None);
    }

    proptest! {
        /// Random datagrams never panic the decoder, and every attribute it yields lies
        /// within the datagram.
        #[test]
        fn random_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..512)) {
            if let Ok(msgs) = decode(&data) {
                for m in msgs {
                    if let Message::Genl { attrs: block, .. } = m {
                        prop_assert!(block.len() <= data.len());
                        let _ = family_reply(block);
                        let _ = nbd_index(block);
                        for a in attrs(block).take(1000).flatten() {
                            prop_assert!(a.payload.len() <= block.len());
                            let _ = a.string();
                            for n in a.nested().take(1000).flatten() {
                                let _ = n.u32();
                            }
                        }
                    }
                }
            }
        }

        /// A valid family reply survives any split of its tail: a cut one is an error,
        /// never a wrong id.
        #[test]
        fn truncated_replies_fail_cleanly(id in any::<u16>(), cut in 0usize..100) {
            let d = family_datagram(id, 1);
            let cut = cut.min(d.len());
            if let Ok(msgs) = decode(&d[..cut]) {
                for m in msgs {
                    if let Message::Genl { attrs, .. } = m {
                        if let Ok(f) = family_reply(attrs) {
                            prop_assert_eq!(f.id, id);
                        }
                    }
                }
            }
        }
    }
}
