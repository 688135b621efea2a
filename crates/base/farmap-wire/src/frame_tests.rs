use bytes::{BufMut, Bytes, BytesMut};
use farmap_core::{Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry};
use proptest::prelude::*;

use super::*;

fn encode(f: &Frame) -> BytesMut {
    let mut b = BytesMut::new();
    f.encode(&mut b);
    assert_eq!(b.len(), f.encoded_len(), "encoded_len matches for {f:?}");
    // The pieces of encode_parts are the same bytes.
    let mut parts = Vec::new();
    f.encode_parts(&mut parts);
    assert_eq!(
        parts.concat(),
        b[..],
        "encode_parts matches encode for {f:?}"
    );
    b
}

fn decode_all(limits: Limits, mut wire: BytesMut) -> Result<Vec<Frame>, WireError> {
    let mut d = FrameDecoder::new(limits);
    let mut out = Vec::new();
    while let Some(f) = d.decode(&mut wire)? {
        out.push(f);
    }
    assert!(wire.is_empty(), "{} bytes left over", wire.len());
    Ok(out)
}

fn sample_frames() -> Vec<Frame> {
    let g = Geometry::new(1 << 20, 4096).unwrap();
    vec![
        Frame::new(
            1,
            Message::Read(vec![ChunkIdx(0), ChunkIdx(7), ChunkIdx(3)]),
        ),
        Frame::new(
            2,
            Message::Write {
                idx: ChunkIdx(5),
                data: Payload::Data(Bytes::from(vec![7u8; 4096])),
            },
        ),
        Frame::new(
            3,
            Message::Write {
                idx: ChunkIdx(6),
                data: Payload::Zero,
            },
        ),
        Frame::new(4, Message::Flush),
        Frame::new(5, Message::Trim(ChunkRange::new(ChunkIdx(2), ChunkIdx(9)))),
        Frame::new(6, Message::Status(ChunkIdx(1))),
        Frame::new(7, Message::Geometry),
        Frame::new(
            1,
            Message::ReadOk(vec![
                Payload::Zero,
                Payload::Data(Bytes::from_static(b"abc")),
                Payload::Zero,
            ]),
        ),
        Frame::new(
            10,
            Message::ReadRun {
                start: ChunkIdx(5),
                count: 9,
            },
        ),
        Frame::new(
            10,
            Message::ReadRunOk(RunData::new(
                &[false, true, true, false, false, true, false, true, true],
                vec![
                    Bytes::from_static(b"ab"),
                    Bytes::from(vec![9u8; 10_000]),
                    Bytes::new(),
                    Bytes::from_static(b"c"),
                ],
            )),
        ),
        Frame::new(
            11,
            Message::ReadRunOk(RunData::new(&[true; 16], Vec::new())),
        ),
        Frame::new(12, Message::ObjGet("chunks/ab/0123".into())),
        Frame::new(13, Message::ObjExists("regions/r/tags/t".into())),
        Frame::new(
            14,
            Message::ObjCreate {
                key: "regions/r/versions/00000000000000000001".into(),
                data: Bytes::from(vec![5u8; 20_000]),
            },
        ),
        Frame::new(
            15,
            Message::ObjCreate {
                key: "gc/grace".into(),
                data: Bytes::new(),
            },
        ),
        Frame::new(
            16,
            Message::ObjList {
                dir: "chunks".into(),
                after: String::new(),
            },
        ),
        Frame::new(
            16,
            Message::ObjList {
                dir: "chunks/ab".into(),
                after: "0123".into(),
            },
        ),
        Frame::new(17, Message::ObjDelete("chunks/ab/0123".into())),
        Frame::new(12, Message::ObjData(Some(Bytes::from_static(b"manifest")))),
        Frame::new(12, Message::ObjData(Some(Bytes::new()))),
        Frame::new(12, Message::ObjData(None)),
        Frame::new(13, Message::ObjBool(true)),
        Frame::new(14, Message::ObjBool(false)),
        Frame::new(
            16,
            Message::ObjNames {
                names: vec!["00".into(), "ab".into(), "ff".into()],
                more: true,
            },
        ),
        Frame::new(
            16,
            Message::ObjNames {
                names: Vec::new(),
                more: false,
            },
        ),
        Frame::new(2, Message::Done),
        Frame::new(6, Message::StatusOk(ChunkStatus::Zero)),
        Frame::new(
            7,
            Message::GeometryOk(RegionInfo {
                geometry: g,
                caps: Caps::WRITE | Caps::TRIM,
                read_only: true,
            }),
        ),
        Frame::new(
            9,
            Message::Error(RemoteError {
                kind: ErrorKind::OutOfRange,
                message: "chunk 300 is past the end".into(),
            }),
        ),
        Frame::new(
            0,
            Message::Error(RemoteError {
                kind: ErrorKind::InvalidInput,
                message: "closing: garbage".into(),
            }),
        ),
    ]
}

#[test]
fn every_message_round_trips_and_decodes_byte_by_byte() {
    for f in sample_frames() {
        let wire = encode(&f);
        assert_eq!(
            decode_all(Limits::default(), wire.clone()).unwrap(),
            vec![f.clone()]
        );
        let mut d = FrameDecoder::default();
        let mut buf = BytesMut::new();
        let mut got = None;
        for (i, b) in wire.iter().enumerate() {
            assert!(got.is_none(), "frame complete before its last byte");
            buf.put_u8(*b);
            got = d.decode(&mut buf).unwrap();
            if i + 1 < wire.len() {
                assert!(got.is_none());
            }
        }
        assert_eq!(got, Some(f));
    }
}

#[test]
fn large_payloads_are_not_copied_by_encode_parts() {
    let payload = Bytes::from(vec![3u8; 64 * 1024]);
    let f = Frame::new(
        4,
        Message::ReadOk(vec![Payload::Data(payload.clone()), Payload::Zero]),
    );
    let mut parts = Vec::new();
    f.encode_parts(&mut parts);
    assert_eq!(parts.len(), 3, "head, payload, tail");
    assert_eq!(parts[1].as_ptr(), payload.as_ptr(), "the payload is shared");
    assert_eq!(parts.concat(), encode(&f)[..]);
}

#[test]
fn zero_chunks_carry_no_payload() {
    let data = Frame::new(
        1,
        Message::ReadOk(vec![Payload::Data(Bytes::from(vec![1u8; 65536]))]),
    );
    let zero = Frame::new(1, Message::ReadOk(vec![Payload::Zero]));
    assert!(encode(&data).len() > 65536);
    assert_eq!(encode(&zero).len(), HEADER_LEN + 4 + 1);
}

#[test]
fn header_fields_are_checked_before_the_body_arrives() {
    let limits = Limits {
        max_frame: 1 << 16,
        max_batch: 8,
    };
    let mut d = FrameDecoder::new(limits);
    // Over the frame limit: refused from its 4 length bytes alone, nothing reserved.
    let mut buf = BytesMut::from(&(1u32 << 30).to_be_bytes()[..]);
    let cap = buf.capacity();
    assert!(matches!(
        d.decode(&mut buf),
        Err(WireError::FrameTooLarge { .. })
    ));
    assert_eq!(buf.capacity(), cap);
    // Too short to hold op and id.
    let mut buf = BytesMut::from(&3u32.to_be_bytes()[..]);
    assert_eq!(d.decode(&mut buf), Err(WireError::FrameTooShort { len: 3 }));
    // Op code 0 and unknown op codes, from the fifth byte.
    let mut buf = BytesMut::from(&[0, 0, 0, 9, 0][..]);
    assert_eq!(d.decode(&mut buf), Err(WireError::ZeroOp));
    let mut buf = BytesMut::from(&[0, 0, 0, 9, 0x42][..]);
    assert_eq!(d.decode(&mut buf), Err(WireError::UnknownOp(0x42)));
}

fn raw(op: u8, id: u64, body: &[u8]) -> BytesMut {
    let mut b = BytesMut::new();
    b.put_u32((9 + body.len()) as u32);
    b.put_u8(op);
    b.put_u64(id);
    b.put_slice(body);
    b
}

#[test]
fn bodies_are_checked() {
    let limits = Limits {
        max_frame: 1 << 20,
        max_batch: 4,
    };
    let check = |wire: BytesMut, want: WireError| {
        assert_eq!(decode_all(limits, wire), Err(want));
    };
    check(raw(op::FLUSH, 0, &[]), WireError::ZeroId { op: op::FLUSH });
    check(raw(op::READ, 1, &0u32.to_be_bytes()), WireError::EmptyBatch);
    check(
        raw(op::READ, 1, &5u32.to_be_bytes()),
        WireError::BatchTooLarge { count: 5, max: 4 },
    );
    // A batch count that promises more entries than the body holds.
    check(
        raw(op::READ_OK, 1, &4u32.to_be_bytes()),
        WireError::Truncated { op: "read reply" },
    );
    let mut body = 2u32.to_be_bytes().to_vec();
    body.extend_from_slice(&[0; 8]);
    check(raw(op::READ, 1, &body), WireError::Truncated { op: "read" });
    let mut body = 1u32.to_be_bytes().to_vec();
    body.extend_from_slice(&[0; 16]);
    check(
        raw(op::READ, 1, &body),
        WireError::BodyLength {
            op: "read",
            len: 16,
            expected: 8,
        },
    );
    check(
        raw(op::FLUSH, 1, &[1]),
        WireError::BodyLength {
            op: "flush",
            len: 1,
            expected: 0,
        },
    );
    let mut body = vec![0; 8];
    body.push(2);
    check(
        raw(op::WRITE, 1, &body),
        WireError::BadFlags {
            op: "write",
            flags: 2,
        },
    );
    let mut body = vec![0; 8];
    body.extend_from_slice(&[1, 0xaa]);
    check(
        raw(op::WRITE, 1, &body),
        WireError::TrailingBytes {
            op: "write",
            extra: 1,
        },
    );
    let mut body = 1u32.to_be_bytes().to_vec();
    body.push(0);
    body.extend_from_slice(&(8u32 << 20).to_be_bytes());
    check(
        raw(op::READ_OK, 1, &body),
        WireError::ChunkTooLarge {
            len: 8 << 20,
            max: farmap_core::MAX_CHUNK_SIZE,
        },
    );
    let mut body = 9u64.to_be_bytes().to_vec();
    body.extend_from_slice(&2u64.to_be_bytes());
    check(
        raw(op::TRIM, 1, &body),
        WireError::BadRange { start: 9, end: 2 },
    );
    check(raw(op::STATUS_OK, 1, &[4]), WireError::BadStatus(4));
    let mut body = vec![4];
    body.extend_from_slice(&[b'x'; MAX_MESSAGE + 1]);
    check(
        raw(op::ERROR, 1, &body),
        WireError::MessageTooLong {
            len: MAX_MESSAGE + 1,
            max: MAX_MESSAGE,
        },
    );
    let mut body = [0u8; 20];
    body[8..12].copy_from_slice(&3000u32.to_be_bytes());
    body[7] = 1;
    assert!(matches!(
        decode_all(limits, raw(op::GEOMETRY_OK, 1, &body)),
        Err(WireError::BadGeometry(_))
    ));
}

#[test]
fn unknown_error_codes_are_io_and_long_messages_are_cut() {
    let mut body = vec![250];
    body.extend_from_slice(b"strange");
    let got = decode_all(Limits::default(), raw(op::ERROR, 3, &body)).unwrap();
    assert_eq!(
        got[0].msg,
        Message::Error(RemoteError {
            kind: ErrorKind::Io,
            message: "strange".into()
        })
    );
    let long = "é".repeat(MAX_MESSAGE);
    let f = Frame::new(
        1,
        Message::Error(RemoteError {
            kind: ErrorKind::Io,
            message: long,
        }),
    );
    let got = decode_all(Limits::default(), encode(&f)).unwrap();
    let Message::Error(e) = &got[0].msg else {
        panic!("{got:?}")
    };
    assert_eq!(e.message.len(), MAX_MESSAGE);
}

fn kind() -> impl Strategy<Value = ErrorKind> {
    prop::sample::select(ErrorKind::ALL.to_vec())
}

fn payload() -> impl Strategy<Value = Payload> {
    prop_oneof![
        Just(Payload::Zero),
        prop::collection::vec(any::<u8>(), 0..300).prop_map(|v| Payload::Data(Bytes::from(v))),
    ]
}

fn message() -> impl Strategy<Value = Message> {
    let idx = any::<u64>().prop_map(ChunkIdx);
    prop_oneof![
        prop::collection::vec(idx.clone(), 1..20).prop_map(Message::Read),
        (idx.clone(), payload()).prop_map(|(idx, data)| Message::Write { idx, data }),
        Just(Message::Flush),
        (any::<u64>(), any::<u64>()).prop_map(|(a, b)| Message::Trim(ChunkRange::new(
            ChunkIdx(a.min(b)),
            ChunkIdx(a.max(b))
        ))),
        idx.prop_map(Message::Status),
        Just(Message::Geometry),
        prop::collection::vec(payload(), 1..20).prop_map(Message::ReadOk),
        Just(Message::Done),
        prop::sample::select(vec![
            ChunkStatus::Zero,
            ChunkStatus::Data,
            ChunkStatus::Unknown
        ])
        .prop_map(Message::StatusOk),
        (1u64..1 << 40, 12u32..=22, 0u32..32, any::<bool>()).prop_map(|(size, shift, caps, ro)| {
            Message::GeometryOk(RegionInfo {
                geometry: Geometry::new(size, 1 << shift).unwrap(),
                caps: crate::caps_from_bits(caps),
                read_only: ro,
            })
        }),
        (kind(), ".{0,200}")
            .prop_map(|(kind, message)| Message::Error(RemoteError { kind, message })),
        "[a-z0-9/._-]{1,60}".prop_map(Message::ObjGet),
        (
            "[a-z0-9/]{1,60}",
            prop::collection::vec(any::<u8>(), 0..300)
        )
            .prop_map(|(key, d)| Message::ObjCreate {
                key,
                data: Bytes::from(d)
            }),
        ("[a-z/]{1,20}", "[a-z0-9]{0,20}").prop_map(|(dir, after)| Message::ObjList { dir, after }),
        prop::option::of(prop::collection::vec(any::<u8>(), 0..300))
            .prop_map(|d| Message::ObjData(d.map(Bytes::from))),
        (prop::collection::vec(".{1,30}", 0..20), any::<bool>())
            .prop_map(|(names, more)| Message::ObjNames { names, more }),
    ]
}

#[test]
fn object_frames_are_checked() {
    let check = |wire: BytesMut, want: WireError| {
        assert_eq!(decode_all(Limits::default(), wire), Err(want));
    };
    let bad_key = |op, len| WireError::BadKey { op, len };
    check(raw(op::OBJ_GET, 1, b""), bad_key("object get", 0));
    check(
        raw(op::OBJ_DELETE, 1, &[b'a'; 1025]),
        bad_key("object delete", 1025),
    );
    check(
        raw(op::OBJ_EXISTS, 1, b"\xff\xfe"),
        bad_key("object exists", 2),
    );
    // A create whose key length runs past the body, or names nothing.
    check(
        raw(op::OBJ_CREATE, 1, &[0, 9, b'a']),
        WireError::Truncated {
            op: "object create",
        },
    );
    check(raw(op::OBJ_CREATE, 1, &[0, 0]), bad_key("object create", 0));
    check(
        raw(op::OBJ_DATA, 1, &[0, 1]),
        WireError::BodyLength {
            op: "object data reply",
            len: 1,
            expected: 0,
        },
    );
    check(
        raw(op::OBJ_DATA, 1, &[2]),
        WireError::BadFlags {
            op: "object data reply",
            flags: 2,
        },
    );
    check(
        raw(op::OBJ_BOOL, 1, &[7]),
        WireError::BadFlags {
            op: "object yes-or-no reply",
            flags: 7,
        },
    );
    // A name count over the cap, or more than the body can hold: refused before any name
    // is kept.
    let mut names = vec![0u8];
    names.extend_from_slice(&(MAX_NAMES + 1).to_be_bytes());
    check(
        raw(op::OBJ_NAMES, 1, &names),
        WireError::BatchTooLarge {
            count: MAX_NAMES + 1,
            max: MAX_NAMES,
        },
    );
    let mut names = vec![1u8];
    names.extend_from_slice(&1000u32.to_be_bytes());
    names.extend_from_slice(&[0, 1, b'a']);
    check(
        raw(op::OBJ_NAMES, 1, &names),
        WireError::Truncated {
            op: "object names reply",
        },
    );
    let mut names = vec![0u8];
    names.extend_from_slice(&1u32.to_be_bytes());
    names.extend_from_slice(&[0, 0, 0]);
    check(
        raw(op::OBJ_NAMES, 1, &names),
        bad_key("object names reply", 0),
    );
}

proptest! {
    #[test]
    fn frames_round_trip_whatever_the_read_boundaries(
        msgs in prop::collection::vec((1u64.., message()), 1..12),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..8),
    ) {
        let frames: Vec<Frame> = msgs.into_iter().map(|(id, m)| Frame::new(id, m)).collect();
        let mut wire = BytesMut::new();
        for f in &frames {
            f.encode(&mut wire);
        }
        // Feed the stream in pieces cut at arbitrary points.
        let mut points: Vec<usize> = cuts.iter().map(|c| c.index(wire.len() + 1)).collect();
        points.push(wire.len());
        points.sort_unstable();
        let mut d = FrameDecoder::new(Limits::default());
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        let mut from = 0;
        for p in points {
            buf.extend_from_slice(&wire[from..p]);
            from = p;
            while let Some(f) = d.decode(&mut buf).unwrap() {
                got.push(f);
            }
        }
        prop_assert!(buf.is_empty());
        prop_assert_eq!(got, frames);
    }
}

#[test]
fn run_replies_carry_zero_chunks_as_bits_and_share_large_pieces() {
    let page = Bytes::from(vec![5u8; 4096]);
    let big = Bytes::from(vec![6u8; 3 * 4096]);
    // 1 data, 1 zero, 3 data: a bitmap of one byte and 16 KiB of data.
    let run = RunData::new(
        &[false, true, false, false, false],
        vec![page.clone(), big.clone()],
    );
    assert_eq!(run.count(), 5);
    assert!(run.is_zero(1) && !run.is_zero(0) && !run.is_zero(4) && !run.is_zero(5));
    assert_eq!(run.data_len(), 4 * 4096);
    let f = Frame::new(3, Message::ReadRunOk(run));
    let wire = encode(&f);
    assert_eq!(wire.len(), run_reply_overhead(5) + 4 * 4096);
    let mut parts = Vec::new();
    f.encode_parts(&mut parts);
    assert!(
        parts.iter().any(|p| p.as_ptr() == big.as_ptr()),
        "a large piece is sent as it is"
    );
    let back = decode_all(Limits::default(), wire).unwrap();
    let Message::ReadRunOk(got) = &back[0].msg else {
        panic!("not a run reply: {:?}", back[0]);
    };
    assert_eq!(got.pieces().len(), 1, "a received run is one piece");
    assert_eq!(&got.data()[..4096], &page[..]);
    assert_eq!(&got.data()[4096..], &big[..]);
    // All zero: no data at all.
    let zero = Frame::new(3, Message::ReadRunOk(RunData::new(&[true; 64], Vec::new())));
    assert_eq!(encode(&zero).len(), run_reply_overhead(64));
}

#[test]
fn bad_run_frames_are_refused() {
    let decode = |msg_body: &[u8], code: u8| {
        let mut b = BytesMut::new();
        b.put_u32((HEADER_LEN - 4 + msg_body.len()) as u32);
        b.put_u8(code);
        b.put_u64(1);
        b.put_slice(msg_body);
        FrameDecoder::new(Limits::default()).decode(&mut b)
    };
    let req = |start: u64, count: u32| {
        let mut v = start.to_be_bytes().to_vec();
        v.extend_from_slice(&count.to_be_bytes());
        v
    };
    assert_eq!(decode(&req(0, 0), op::READ_RUN), Err(WireError::EmptyBatch));
    assert!(matches!(
        decode(&req(0, MAX_RUN_LIMIT + 1), op::READ_RUN),
        Err(WireError::BatchTooLarge { .. })
    ));
    assert!(matches!(
        decode(&req(u64::MAX - 2, 5), op::READ_RUN),
        Err(WireError::RunOverflow { .. })
    ));
    let reply = |count: u32, data_len: u32, bits: &[u8], data: &[u8]| {
        let mut v = count.to_be_bytes().to_vec();
        v.extend_from_slice(&data_len.to_be_bytes());
        v.extend_from_slice(bits);
        v.extend_from_slice(data);
        v
    };
    // A huge count is refused before anything is allocated for it.
    assert!(matches!(
        decode(&reply(u32::MAX, 0, &[], &[]), op::READ_RUN_OK),
        Err(WireError::BatchTooLarge { .. })
    ));
    // The bitmap is missing.
    assert!(matches!(
        decode(&reply(64, 0, &[0; 3], &[]), op::READ_RUN_OK),
        Err(WireError::Truncated { .. })
    ));
    // Bits past the count.
    assert!(matches!(
        decode(&reply(3, 0, &[0b1111], &[]), op::READ_RUN_OK),
        Err(WireError::BadFlags { .. })
    ));
    // The data is shorter or longer than announced.
    assert!(matches!(
        decode(&reply(3, 10, &[0b111], &[1; 4]), op::READ_RUN_OK),
        Err(WireError::BodyLength { .. })
    ));
    assert!(matches!(
        decode(&reply(3, 1, &[0], &[1; 4]), op::READ_RUN_OK),
        Err(WireError::BodyLength { .. })
    ));
    assert!(decode(&reply(3, 4, &[0b010], &[1; 4]), op::READ_RUN_OK)
        .unwrap()
        .is_some());
}

proptest! {
    /// Random bodies of run frames never panic, and what decodes encodes back to the same bytes.
    #[test]
    fn random_run_frames_never_panic_and_round_trip(
        code in prop_oneof![Just(op::READ_RUN), Just(op::READ_RUN_OK)],
        body in proptest::collection::vec(any::<u8>(), 0..600),
        count in 0u32..200,
        use_count in any::<bool>(),
    ) {
        let mut body = body;
        if use_count && body.len() >= 8 {
            // Often a plausible count and data length, so that decoding gets past them.
            body[..4].copy_from_slice(&count.to_be_bytes());
            let rest = body.len().saturating_sub(8 + count.div_ceil(8) as usize) as u32;
            body[4..8].copy_from_slice(&rest.to_be_bytes());
        }
        let mut b = BytesMut::new();
        b.put_u32((HEADER_LEN - 4 + body.len()) as u32);
        b.put_u8(code);
        b.put_u64(1);
        b.put_slice(&body);
        let wire = b.clone().freeze();
        if let Ok(Some(f)) = FrameDecoder::new(Limits::default()).decode(&mut b) {
            let mut again = BytesMut::new();
            f.encode(&mut again);
            prop_assert_eq!(&again[..], &wire[..]);
        }
    }
}

#[test]
fn a_frame_in_its_own_buffer_is_decoded_without_copying_its_payloads() {
    let payload = Bytes::from(vec![4u8; 64 * 1024]);
    let f = Frame::new(9, Message::ReadOk(vec![Payload::Data(payload.clone())]));
    let wire = encode(&f).freeze();
    let mut d = FrameDecoder::default();
    let got = d.decode_own(wire.clone()).unwrap();
    assert_eq!(got, f);
    let Message::ReadOk(chunks) = &got.msg else {
        panic!("not a read reply");
    };
    let Payload::Data(data) = &chunks[0] else {
        panic!("not data");
    };
    let inside = wire.as_ptr() as usize..wire.as_ptr() as usize + wire.len();
    assert!(
        inside.contains(&(data.as_ptr() as usize)),
        "the payload is a slice of the frame"
    );
    // The shared-buffer decoder copies it.
    let mut buf = BytesMut::from(&wire[..]);
    let copied = d.decode(&mut buf).unwrap().unwrap();
    let Message::ReadOk(chunks) = &copied.msg else {
        panic!("not a read reply");
    };
    let Payload::Data(data) = &chunks[0] else {
        panic!("not data");
    };
    assert_eq!(data.len(), 64 * 1024);
    // A buffer that is not exactly one frame, or a frame over the limit, is refused.
    assert!(d.decode_own(wire.slice(..wire.len() - 1)).is_err());
    let mut longer = wire.to_vec();
    longer.push(0);
    assert!(d.decode_own(Bytes::from(longer)).is_err());
    let mut small = FrameDecoder::new(Limits {
        max_frame: 1024,
        max_batch: 4,
    });
    assert!(matches!(
        small.decode_own(wire),
        Err(WireError::FrameTooLarge { .. })
    ));
    assert!(d.decode_own(Bytes::from_static(&[0, 0])).is_err());
}
