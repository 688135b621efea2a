//! The handshake: the client's hello and the server's answer (accepted, with the region and
//! the server's limits, or refused, with a reason).

use bytes::{Buf, BufMut, BytesMut};
use farmap_core::ErrorKind;

use crate::codes::{kind_from_code, kind_to_code, Features};
use crate::frame::{
    get_region, put_region, Body, RegionInfo, HEADER_LEN, MAX_BATCH_LIMIT, MAX_FRAME_LIMIT,
    MAX_MESSAGE,
};
use crate::WireError;

/// The first eight bytes of every hello: a non-ASCII byte (catches 7-bit channels), the name,
/// and a newline (catches line-ending translation).
pub const MAGIC: [u8; 8] = *b"\x89FARMAP\n";
/// The protocol version this crate speaks. Version 0 is never valid.
pub const VERSION: u16 = 1;
/// Bytes of a client hello (the same for every version).
pub const CLIENT_HELLO_LEN: usize = 16;
/// Bytes of a server hello's fixed part, before its body.
pub const SERVER_HELLO_HEADER_LEN: usize = 16;
/// Longest server hello body accepted.
pub const MAX_HELLO_BODY: u32 = 4096;
/// Most requests in flight a server may announce.
pub const MAX_IN_FLIGHT_LIMIT: u32 = 1 << 16;

const STATUS_ACCEPTED: u8 = 1;
const STATUS_REFUSED: u8 = 2;
const STATUS_CHALLENGE: u8 = 3;
/// Bytes of a challenge's nonce, and of the client's answer (an HMAC-SHA256 proof).
pub const CHALLENGE_LEN: usize = 32;
/// What a client proves with its answer to a challenge: the label of the HMAC over the
/// server's nonce (see `farmap_net::auth`).
pub const CHALLENGE_LABEL: &str = "farmap native protocol v1: client";
const ACCEPTED_LEN: usize = 4 + 20 + 12;
const REFUSED_MIN_LEN: usize = 5;

/// What the client sends first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientHello {
    /// The protocol version the client speaks (never 0).
    pub version: u16,
    /// Optional features the client asks for.
    pub features: Features,
}

impl ClientHello {
    /// A hello for this crate's [`VERSION`], asking for every feature it implements.
    pub fn current() -> Self {
        Self {
            version: VERSION,
            features: Features::ALL,
        }
    }

    /// Appends the hello to `dst`.
    pub fn encode(&self, dst: &mut BytesMut) {
        dst.reserve(CLIENT_HELLO_LEN);
        dst.put_slice(&MAGIC);
        dst.put_u16(self.version);
        dst.put_u16(0);
        dst.put_u32(self.features.bits());
    }
}

/// The server's announcement when it accepts a client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerInfo {
    /// The protocol version of the session.
    pub version: u16,
    /// The features granted (a subset of those asked for).
    pub features: Features,
    /// The region served.
    pub region: RegionInfo,
    /// Largest frame the server accepts and sends, header included.
    pub max_frame: u32,
    /// Most requests the server works on at once for this connection; more are queued in the
    /// socket (the client should not send more).
    pub max_in_flight: u32,
    /// Most chunks in one read request.
    pub max_batch: u32,
    /// Random at each start of the server (0: a server that does not say): a client that
    /// reconnects and sees another instance knows the server restarted, and with it
    /// perhaps lost what it had not made durable.
    pub instance: u64,
}

/// The server's answer when it refuses a client (version mismatch, too many connections...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The protocol version the server would have spoken.
    pub version: u16,
    /// Oldest version the server speaks.
    pub min_version: u16,
    /// Newest version the server speaks.
    pub max_version: u16,
    /// Why, as a kind (`Unsupported` for a version mismatch, `Unavailable` when full).
    pub kind: ErrorKind,
    /// Why, as a sentence (at most [`MAX_MESSAGE`] bytes travel).
    pub message: String,
}

/// What the server answers a client hello with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerHello {
    /// The session starts: frames follow.
    Accepted(ServerInfo),
    /// The server closes the connection after this.
    Refused(Refusal),
    /// The server requires a key (the client asked with [`Features::AUTH`]): the client
    /// answers with the [`CHALLENGE_LEN`] bytes of its proof over this nonce, and the server
    /// then sends its `Accepted` or `Refused` hello.
    Challenge([u8; CHALLENGE_LEN]),
}

impl ServerHello {
    /// Appends the hello to `dst`. A refusal's message is cut to [`MAX_MESSAGE`] bytes.
    pub fn encode(&self, dst: &mut BytesMut) {
        dst.put_slice(&MAGIC);
        match self {
            ServerHello::Accepted(info) => {
                dst.put_u16(info.version);
                dst.put_u8(STATUS_ACCEPTED);
                dst.put_u8(0);
                dst.put_u32((ACCEPTED_LEN + 8) as u32);
                dst.put_u32(info.features.bits());
                put_region(dst, &info.region);
                dst.put_u32(info.max_frame);
                dst.put_u32(info.max_in_flight);
                dst.put_u32(info.max_batch);
                dst.put_u64(info.instance);
            }
            ServerHello::Refused(r) => {
                let mut end = r.message.len().min(MAX_MESSAGE);
                while !r.message.is_char_boundary(end) {
                    end -= 1;
                }
                let message = &r.message.as_bytes()[..end];
                dst.put_u16(r.version);
                dst.put_u8(STATUS_REFUSED);
                dst.put_u8(0);
                dst.put_u32((REFUSED_MIN_LEN + message.len()) as u32);
                dst.put_u16(r.min_version);
                dst.put_u16(r.max_version);
                dst.put_u8(kind_to_code(r.kind));
                dst.put_slice(message);
            }
            ServerHello::Challenge(nonce) => {
                dst.put_u16(VERSION);
                dst.put_u8(STATUS_CHALLENGE);
                dst.put_u8(0);
                dst.put_u32(CHALLENGE_LEN as u32);
                dst.put_slice(nonce);
            }
        }
    }
}

/// Checks the magic bytes received so far (fails as soon as one differs).
fn check_magic(buf: &[u8]) -> Result<(), WireError> {
    let n = buf.len().min(MAGIC.len());
    if buf[..n] == MAGIC[..n] {
        return Ok(());
    }
    let mut found = [0u8; 8];
    found[..n].copy_from_slice(&buf[..n]);
    Err(WireError::BadMagic { found })
}

/// Takes a client hello off the front of `buf`, or `Ok(None)` until all 16 bytes arrived.
///
/// The version is checked to be non-zero, not to be [`VERSION`]: a server answers a version
/// it does not speak with a [`Refusal`] naming both.
pub fn decode_client_hello(buf: &mut BytesMut) -> Result<Option<ClientHello>, WireError> {
    check_magic(buf)?;
    if buf.len() < CLIENT_HELLO_LEN {
        return Ok(None);
    }
    let mut hello = buf.split_to(CLIENT_HELLO_LEN);
    hello.advance(MAGIC.len());
    let version = hello.get_u16();
    let _reserved = hello.get_u16();
    let features = Features::from_bits(hello.get_u32());
    if version == 0 {
        return Err(WireError::ZeroVersion);
    }
    Ok(Some(ClientHello { version, features }))
}

fn check_limit(what: &'static str, value: u32, min: u64, max: u64) -> Result<u32, WireError> {
    if (min..=max).contains(&u64::from(value)) {
        Ok(value)
    } else {
        Err(WireError::BadLimit {
            what,
            value: u64::from(value),
            min,
            max,
        })
    }
}

/// Takes a server hello off the front of `buf`, or `Ok(None)` until it has all arrived.
///
/// An accepted hello is checked: valid geometry, a frame limit that holds at least one
/// chunk and no more than [`MAX_FRAME_LIMIT`], batch and in-flight limits within theirs.
pub fn decode_server_hello(buf: &mut BytesMut) -> Result<Option<ServerHello>, WireError> {
    check_magic(buf)?;
    if buf.len() < SERVER_HELLO_HEADER_LEN {
        return Ok(None);
    }
    let version = u16::from_be_bytes([buf[8], buf[9]]);
    let status = buf[10];
    let body_len = u32::from_be_bytes([buf[12], buf[13], buf[14], buf[15]]);
    if version == 0 {
        return Err(WireError::ZeroVersion);
    }
    if ![STATUS_ACCEPTED, STATUS_REFUSED, STATUS_CHALLENGE].contains(&status) {
        return Err(WireError::BadHelloStatus(status));
    }
    if body_len > MAX_HELLO_BODY {
        return Err(WireError::HelloTooLarge {
            len: body_len,
            max: MAX_HELLO_BODY,
        });
    }
    let total = SERVER_HELLO_HEADER_LEN + body_len as usize;
    if buf.len() < total {
        buf.reserve(total - buf.len());
        return Ok(None);
    }
    let mut hello = buf.split_to(total).freeze();
    hello.advance(SERVER_HELLO_HEADER_LEN);
    if status == STATUS_CHALLENGE {
        if hello.len() != CHALLENGE_LEN {
            return Err(WireError::Truncated {
                op: "server challenge",
            });
        }
        let mut nonce = [0u8; CHALLENGE_LEN];
        nonce.copy_from_slice(&hello);
        return Ok(Some(ServerHello::Challenge(nonce)));
    }
    if status == STATUS_ACCEPTED {
        let mut body = Body::new(hello, "server hello");
        if body.len() < ACCEPTED_LEN {
            return Err(WireError::Truncated { op: "server hello" });
        }
        let features = Features::from_bits(body.u32()?);
        let region = get_region(&mut body)?;
        // One chunk must fit a read reply, whatever the batch limit.
        let min_frame = (HEADER_LEN + 4 + 5) as u64 + u64::from(region.geometry.chunk_size());
        let max_frame = check_limit(
            "frame limit",
            body.u32()?,
            min_frame,
            MAX_FRAME_LIMIT.into(),
        )?;
        let max_in_flight = check_limit(
            "limit of requests in flight",
            body.u32()?,
            1,
            MAX_IN_FLIGHT_LIMIT.into(),
        )?;
        let max_batch = check_limit("read batch limit", body.u32()?, 1, MAX_BATCH_LIMIT.into())?;
        // Appended in a later revision: absent from older servers.
        let instance = if body.len() >= 8 { body.u64()? } else { 0 };
        // Later minor revisions may append fields: the rest of the body is ignored.
        Ok(Some(ServerHello::Accepted(ServerInfo {
            version,
            features,
            region,
            max_frame,
            max_in_flight,
            max_batch,
            instance,
        })))
    } else {
        let mut body = Body::new(hello, "server hello");
        let min_version = body.u16()?;
        let max_version = body.u16()?;
        let kind = kind_from_code(body.u8()?);
        let text = body.rest();
        Ok(Some(ServerHello::Refused(Refusal {
            version,
            min_version,
            max_version,
            kind,
            message: String::from_utf8_lossy(&text).into_owned(),
        })))
    }
}

#[cfg(test)]
mod tests {
    use farmap_core::{Caps, Geometry};

    use super::*;

    fn info() -> ServerInfo {
        ServerInfo {
            version: VERSION,
            features: Features::ALL,
            region: RegionInfo {
                geometry: Geometry::new(10 << 20, 65536).unwrap(),
                caps: Caps::WRITE | Caps::FLUSH,
                read_only: false,
            },
            max_frame: 1 << 20,
            max_in_flight: 64,
            max_batch: 16,
            instance: 0x1234_5678_9abc_def0,
        }
    }

    #[test]
    fn a_hello_without_an_instance_reads_as_instance_0() {
        // A server of the first revision: the body ends after the batch limit.
        let mut wire = BytesMut::new();
        ServerHello::Accepted(info()).encode(&mut wire);
        let body_len = u32::from_be_bytes(wire[12..16].try_into().unwrap());
        wire[12..16].copy_from_slice(&(body_len - 8).to_be_bytes());
        wire.truncate(wire.len() - 8);
        match decode_server_hello(&mut wire).unwrap() {
            Some(ServerHello::Accepted(i)) => assert_eq!(i.instance, 0),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn client_hello_round_trips_byte_by_byte() {
        let mut wire = BytesMut::new();
        ClientHello::current().encode(&mut wire);
        assert_eq!(wire.len(), CLIENT_HELLO_LEN);
        assert_eq!(&wire[..8], &MAGIC);
        let mut buf = BytesMut::new();
        for (i, b) in wire.iter().enumerate() {
            buf.put_u8(*b);
            let got = decode_client_hello(&mut buf).unwrap();
            assert_eq!(got.is_some(), i == CLIENT_HELLO_LEN - 1);
            if let Some(h) = got {
                assert_eq!(h, ClientHello::current());
            }
        }
    }

    #[test]
    fn bad_magic_fails_at_the_first_wrong_byte_and_version_zero_is_invalid() {
        let mut buf = BytesMut::from(&b"\x89FAR"[..]);
        assert_eq!(decode_client_hello(&mut buf), Ok(None));
        let mut buf = BytesMut::from(&b"GET / HTTP/1.1\r\n"[..]);
        assert!(matches!(
            decode_client_hello(&mut buf),
            Err(WireError::BadMagic { .. })
        ));
        let mut wire = BytesMut::new();
        ClientHello {
            version: 0,
            features: Features::NONE,
        }
        .encode(&mut wire);
        assert_eq!(decode_client_hello(&mut wire), Err(WireError::ZeroVersion));
    }

    #[test]
    fn server_hellos_round_trip() {
        let refused = ServerHello::Refused(Refusal {
            version: VERSION,
            min_version: 1,
            max_version: 1,
            kind: ErrorKind::Unsupported,
            message: "this server speaks version 1; the client asked for 7".into(),
        });
        let challenge = ServerHello::Challenge([7; CHALLENGE_LEN]);
        for hello in [ServerHello::Accepted(info()), refused, challenge] {
            let mut wire = BytesMut::new();
            hello.encode(&mut wire);
            let mut part = wire.split_to(wire.len() - 1);
            assert_eq!(decode_server_hello(&mut part), Ok(None));
            part.unsplit(wire);
            assert_eq!(decode_server_hello(&mut part), Ok(Some(hello)));
            assert!(part.is_empty());
        }
    }

    #[test]
    fn a_challenge_is_exactly_one_nonce() {
        let mut wire = BytesMut::new();
        ServerHello::Challenge([1; CHALLENGE_LEN]).encode(&mut wire);
        wire[15] = (CHALLENGE_LEN - 1) as u8;
        wire.truncate(wire.len() - 1);
        assert!(matches!(
            decode_server_hello(&mut wire),
            Err(WireError::Truncated { .. })
        ));
    }

    #[test]
    fn server_limits_are_checked() {
        type Edit = fn(&mut ServerInfo);
        let edits: [(Edit, &str); 4] = [
            (|i: &mut ServerInfo| i.max_frame = 1000, "frame limit"),
            (|i: &mut ServerInfo| i.max_frame = u32::MAX, "frame limit"),
            (|i: &mut ServerInfo| i.max_batch = 0, "read batch limit"),
            (
                |i: &mut ServerInfo| i.max_in_flight = 0,
                "requests in flight",
            ),
        ];
        for (edit, what) in edits {
            let mut i = info();
            edit(&mut i);
            let mut wire = BytesMut::new();
            ServerHello::Accepted(i).encode(&mut wire);
            let err = decode_server_hello(&mut wire).unwrap_err();
            assert!(err.to_string().contains(what), "{err}");
        }
        let mut wire = BytesMut::new();
        ServerHello::Accepted(info()).encode(&mut wire);
        wire[12..16].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(
            decode_server_hello(&mut wire),
            Err(WireError::HelloTooLarge { .. })
        ));
    }
    #[test]
    fn a_server_cannot_announce_more_chunks_than_farmap_allows() {
        // 2^60 bytes in 4 KiB chunks: a valid geometry, but 2^48 chunks of per-chunk client
        // state. Refused as a bad geometry before the client sizes anything by it.
        let mut i = info();
        i.region.geometry = Geometry::new(1 << 60, 4096).unwrap();
        let mut wire = BytesMut::new();
        ServerHello::Accepted(i).encode(&mut wire);
        assert!(matches!(
            decode_server_hello(&mut wire),
            Err(WireError::BadGeometry(
                farmap_core::GeometryError::TooManyChunks { .. }
            ))
        ));
    }
}
