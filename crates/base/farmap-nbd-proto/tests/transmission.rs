//! Requests and replies against byte sequences written from the protocol document, and
//! random bytes fed to every decoder.

use bytes::{BufMut, Bytes, BytesMut};
use farmap_nbd_proto::consts::{cflag, errno, opt};
use farmap_nbd_proto::*;
use proptest::prelude::*;

fn write_header(len: u32) -> Vec<u8> {
    // magic, flags FUA, type WRITE, cookie, offset 4096, length
    let mut v = vec![0x25, 0x60, 0x95, 0x13, 0, 1, 0, 1];
    v.extend_from_slice(&0x1122334455667788u64.to_be_bytes());
    v.extend_from_slice(&4096u64.to_be_bytes());
    v.extend_from_slice(&len.to_be_bytes());
    v
}

#[test]
fn a_write_arrives_whole_after_its_payload() {
    let mut d = RequestDecoder::new(1 << 20);
    let mut buf = BytesMut::from(&write_header(5)[..]);
    assert_eq!(d.decode(&mut buf), Ok(None));
    assert_eq!(d.awaiting_payload(), Some(5));
    buf.put_slice(b"hel");
    assert_eq!(d.decode(&mut buf), Ok(None));
    buf.put_slice(b"lo");
    let header = RequestHeader {
        flags: cflag::FUA,
        command: Command::Write,
        cookie: 0x1122334455667788,
        offset: 4096,
        length: 5,
    };
    assert_eq!(
        d.decode(&mut buf),
        Ok(Some(Incoming::Request {
            header,
            payload: Bytes::from_static(b"hello")
        }))
    );
    assert_eq!(&header.to_bytes()[..], &write_header(5)[..]);
}

#[test]
fn an_oversized_write_is_reported_at_once_and_skipped_without_buffering() {
    let mut d = RequestDecoder::new(1 << 20);
    let mut buf = BytesMut::from(&write_header(u32::MAX)[..]);
    match d.decode(&mut buf) {
        Ok(Some(Incoming::Oversized(h))) => assert_eq!(h.length, u32::MAX),
        other => panic!("{other:?}"),
    }
    assert_eq!(d.awaiting_payload(), None);
    let piece = vec![7u8; 1 << 20];
    let mut fed = 0u64;
    while fed + piece.len() as u64 <= u64::from(u32::MAX) {
        buf.put_slice(&piece);
        fed += piece.len() as u64;
        assert_eq!(d.decode(&mut buf), Ok(None));
        assert!(buf.is_empty(), "skipped bytes are not kept");
    }
    // The rest of the payload, then a read request right behind it.
    buf.put_bytes(7, (u64::from(u32::MAX) - fed) as usize);
    let read = RequestHeader {
        flags: 0,
        command: Command::Read,
        cookie: 9,
        offset: 0,
        length: 512,
    };
    read.encode(&mut buf);
    assert_eq!(
        d.decode(&mut buf),
        Ok(Some(Incoming::Request {
            header: read,
            payload: Bytes::new()
        }))
    );
}

#[test]
fn bad_request_magic_is_fatal_and_unknown_commands_decode() {
    let mut d = RequestDecoder::new(1024);
    let mut buf = BytesMut::from(&b"GET / HTTP/1.1\r\nHost: x\r\n\r\n\r\n"[..]);
    assert_eq!(
        d.decode(&mut buf),
        Err(RequestError::BadMagic { found: 0x47455420 })
    );
    let mut buf = BytesMut::new();
    RequestHeader {
        flags: 0x8000,
        command: Command::Other(42),
        cookie: 1,
        offset: 2,
        length: 3,
    }
    .encode(&mut buf);
    match d.decode(&mut buf) {
        Ok(Some(Incoming::Request { header, .. })) => {
            assert_eq!(header.command, Command::Other(42))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn reply_encoders_match_the_document() {
    assert_eq!(
        simple_reply(0x0102030405060708, errno::EINVAL),
        [0x67, 0x44, 0x66, 0x98, 0, 0, 0, 22, 1, 2, 3, 4, 5, 6, 7, 8]
    );
    let hole = offset_hole_chunk(5, 0x1000, 0x200, true);
    assert_eq!(
        &hole[..],
        &[
            0x66, 0x8e, 0x33, 0xef, 0, 1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 12, 0, 0, 0, 0, 0,
            0, 0x10, 0, 0, 0, 2, 0
        ][..]
    );
    let none = none_chunk(5);
    assert_eq!(&none[4..8], &[0, 1, 0, 0]);
    let e = error_offset_chunk(5, errno::EIO, "bad", 77, true);
    assert_eq!(&e[6..8], &[0x80, 0x02]);
    assert_eq!(&e[16..20], &[0, 0, 0, 17]);
    assert_eq!(&e[20..29], &[0, 0, 0, 5, 0, 3, b'b', b'a', b'd']);
    let long = "é".repeat(3000);
    let e = error_chunk(1, errno::EIO, &long, true);
    let mlen = u16::from_be_bytes([e[24], e[25]]) as usize;
    assert!(mlen <= 4096 && std::str::from_utf8(&e[26..26 + mlen]).is_ok());
}

#[test]
fn replies_decode_back() {
    let mut buf = BytesMut::new();
    buf.put_slice(&simple_reply(1, 0));
    buf.put_slice(b"abcd");
    buf.put_slice(&simple_reply(2, errno::EPERM));
    buf.put_slice(&offset_data_header(3, 100, 3, false));
    buf.put_slice(b"xyz");
    buf.put_slice(&offset_hole_chunk(3, 103, 9, false));
    buf.put_slice(&none_chunk(3));
    buf.put_slice(&block_status_chunk(
        4,
        1,
        &[
            Extent {
                length: 4096,
                flags: 3,
            },
            Extent {
                length: 512,
                flags: 0,
            },
        ],
        true,
    ));
    buf.put_slice(&error_offset_chunk(5, errno::EIO, "disk on fire", 8, true));
    let mut d = ReplyDecoder::new(1 << 20);
    let lens = |c: u64| (c == 1).then_some(4);
    let mut got = Vec::new();
    while let Some(r) = d.decode(&mut buf, lens).unwrap() {
        got.push(r);
    }
    assert!(buf.is_empty());
    assert_eq!(
        got[0],
        Reply::Simple {
            cookie: 1,
            error: 0,
            data: Some(Bytes::from_static(b"abcd"))
        }
    );
    assert_eq!(
        got[1],
        Reply::Simple {
            cookie: 2,
            error: 1,
            data: None
        }
    );
    assert_eq!(
        got[2],
        Reply::Chunk {
            cookie: 3,
            done: false,
            chunk: Chunk::OffsetData {
                offset: 100,
                data: Bytes::from_static(b"xyz")
            }
        }
    );
    assert_eq!(
        got[3],
        Reply::Chunk {
            cookie: 3,
            done: false,
            chunk: Chunk::OffsetHole {
                offset: 103,
                length: 9
            }
        }
    );
    assert!(got[4].is_final());
    match &got[5] {
        Reply::Chunk {
            chunk: Chunk::BlockStatus { context, extents },
            ..
        } => assert_eq!((*context, extents.len(), extents[0].flags), (1, 2, 3)),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        got[6],
        Reply::Chunk {
            cookie: 5,
            done: true,
            chunk: Chunk::Error {
                errno: 5,
                message: "disk on fire".into(),
                offset: Some(8)
            }
        }
    );
}

#[test]
fn oversized_and_malformed_replies_are_refused() {
    let mut d = ReplyDecoder::new(4096);
    let mut buf = BytesMut::from(&offset_data_header(1, 0, 1 << 30, true)[..]);
    assert!(matches!(
        d.decode(&mut buf, |_| None),
        Err(ReplyError::TooLarge { .. })
    ));
    let mut buf = BytesMut::from(&chunk_header(0, 0, 1, 0)[..]);
    assert!(matches!(
        d.decode(&mut buf, |_| None),
        Err(ReplyError::Malformed { .. })
    ));
    let mut buf = BytesMut::from(&chunk_header(1, 77, 1, 0)[..]);
    assert!(matches!(
        d.decode(&mut buf, |_| None),
        Err(ReplyError::Malformed { .. })
    ));
    let mut buf = BytesMut::from(&simple_reply(1, 0)[..]);
    assert!(matches!(
        d.decode(&mut buf, |_| Some(1 << 20)),
        Err(ReplyError::TooLarge { .. })
    ));
}

fn pieces(data: &[u8], cut: usize) -> impl Iterator<Item = &[u8]> {
    data.chunks(cut.max(1))
}

proptest! {
    #[test]
    fn the_server_handshake_survives_random_bytes(
        data in proptest::collection::vec(any::<u8>(), 0..2048),
        cut in 1usize..64,
        prefix in any::<bool>(),
    ) {
        let mut s = ServerHandshake::new(ServerConfig {
            exports: vec![ExportInfo {
                name: "".into(),
                description: String::new(),
                size: 1 << 20,
                flags: 0,
                block: BlockSize { min: 1, preferred: 4096, max: 1 << 25 },
            }],
            tls: TlsMode::Off,
        });
        let mut inp = BytesMut::new();
        if prefix {
            // A valid start, so that random options are reached.
            inp.put_u32(1);
            inp.put_slice(b"IHAVEOPT");
            inp.put_u32(opt::STRUCTURED_REPLY);
            inp.put_u32(0);
        }
        let mut out = BytesMut::new();
        for p in pieces(&data, cut) {
            inp.put_slice(p);
            match s.step(&mut inp, &mut out) {
                Ok(ServerStep::NeedMore) | Ok(ServerStep::StartTls) => {}
                _ => break,
            }
            prop_assert!(out.len() < 1 << 20);
        }
    }

    #[test]
    fn the_client_handshake_survives_random_bytes(
        data in proptest::collection::vec(any::<u8>(), 0..2048),
        cut in 1usize..64,
    ) {
        let mut c = ClientHandshake::new(ClientConfig {
            export: "".into(), tls: false, structured: true, allocation: true,
        });
        let mut inp = BytesMut::from(&b"NBDMAGICIHAVEOPT\x00\x03"[..]);
        let mut out = BytesMut::new();
        for p in pieces(&data, cut) {
            inp.put_slice(p);
            match c.step(&mut inp, &mut out) {
                Ok(ClientStep::NeedMore) => {}
                _ => break,
            }
        }
    }

    #[test]
    fn the_request_decoder_survives_random_bytes(
        data in proptest::collection::vec(any::<u8>(), 0..4096),
        cut in 1usize..64,
        magic in any::<bool>(),
    ) {
        let mut d = RequestDecoder::new(1024);
        let mut buf = BytesMut::new();
        let mut data = data;
        if magic && data.len() >= 4 {
            data[..4].copy_from_slice(&[0x25, 0x60, 0x95, 0x13]);
        }
        for p in pieces(&data, cut) {
            buf.put_slice(p);
            loop {
                match d.decode(&mut buf) {
                    Ok(Some(Incoming::Request { header, payload })) => {
                        prop_assert!(payload.len() <= 1024);
                        if header.command == Command::Write {
                            prop_assert_eq!(payload.len(), header.length as usize);
                        }
                    }
                    Ok(Some(Incoming::Oversized(h))) => prop_assert!(h.length > 1024),
                    Ok(None) => break,
                    Err(_) => return Ok(()),
                }
            }
            prop_assert!(buf.len() < 1024 + 28 + 64);
        }
    }

    #[test]
    fn the_reply_decoder_survives_random_bytes(
        data in proptest::collection::vec(any::<u8>(), 0..4096),
        cut in 1usize..64,
        structured in any::<bool>(),
    ) {
        let mut d = ReplyDecoder::new(1024);
        let mut buf = BytesMut::new();
        let mut data = data;
        if data.len() >= 4 {
            let m: [u8; 4] = if structured { [0x66, 0x8e, 0x33, 0xef] } else { [0x67, 0x44, 0x66, 0x98] };
            data[..4].copy_from_slice(&m);
        }
        for p in pieces(&data, cut) {
            buf.put_slice(p);
            loop {
                match d.decode(&mut buf, |c| (c % 2 == 0).then_some((c % 2048) as u32)) {
                    Ok(Some(_)) => {}
                    Ok(None) => break,
                    Err(_) => return Ok(()),
                }
            }
        }
    }
}
