use proptest::prelude::*;

use super::*;

fn page_range() -> impl Strategy<Value = (u64, u64)> {
    // A start and a length, both pages, within the address space.
    (0u64..(MAX_ADDRESS / PAGE - (1 << 20)), 1u64..(1 << 20))
        .prop_map(|(s, l)| (s * PAGE, l * PAGE))
}

fn msg() -> impl Strategy<Value = Msg> {
    prop_oneof![
        (any::<[u8; TOKEN_LEN]>(), 1u32..=i32::MAX as u32)
            .prop_map(|(token, pid)| Msg::Hello(Hello { token, pid })),
        (
            any::<[u8; TOKEN_LEN]>(),
            1u32..=i32::MAX as u32,
            page_range()
        )
            .prop_map(|(token, pid, (region, _))| Msg::ForkPrepare(ForkPrepare {
                token,
                pid,
                region
            })),
        (12u32..=22, 1u64..1 << 20, 0u64..1 << 20, any::<u64>()).prop_map(
            |(shift, chunks, trash, features)| Msg::Config(Config {
                region_len: chunks << shift,
                chunk_size: 1 << shift,
                trash_len: trash * PAGE,
                features,
            })
        ),
        (page_range(), any::<u64>()).prop_map(|((region, len), features)| {
            let staging = region + len;
            Msg::Registered(Registered {
                region,
                region_len: len,
                staging: staging.min(MAX_ADDRESS - len) & !(PAGE - 1),
                staging_len: len,
                features,
            })
        }),
        any::<u16>().prop_map(|status| Msg::Verdict(Verdict { status })),
        (any::<u32>(), page_range()).prop_map(|(id, (start, len))| Msg::Request(Request {
            id,
            op: Op::Discard { start, len }
        })),
        (any::<u32>(), page_range()).prop_map(|(id, (start, len))| Msg::Request(Request {
            id,
            op: Op::Touch { start, len }
        })),
        (any::<u32>(), page_range(), 1u64..64).prop_map(|(id, (src, len), gap)| {
            Msg::Request(Request {
                id,
                op: Op::Move {
                    src,
                    dst: (src + len + gap * PAGE).min(MAX_ADDRESS - len) & !(PAGE - 1),
                    len,
                },
            })
        }),
        (any::<u32>(), 0i32..4096, 0u64..=MAX_LEN).prop_map(|(id, errno, bytes)| Msg::Done(Done {
            id,
            errno,
            bytes
        })),
    ]
}

fn encoded(m: &Msg) -> Vec<u8> {
    let mut out = [0u8; MAX_MSG_LEN];
    let n = m.encode(&mut out).expect("a valid message encodes");
    out[..n].to_vec()
}

proptest! {
    /// What encodes decodes to itself, after every prefix said "more".
    #[test]
    fn messages_round_trip(m in msg()) {
        // Some generated areas overlap at the top of the address space: those are refused
        // by both sides alike.
        prop_assume!(m.validate().is_ok());
        let bytes = encoded(&m);
        for n in 0..bytes.len() {
            prop_assert_eq!(decode(&bytes[..n]), Ok(None));
        }
        let mut more = bytes.clone();
        more.extend_from_slice(b"next");
        prop_assert_eq!(decode(&more), Ok(Some((m, bytes.len()))));
    }

    /// A changed byte is refused, or is another message that encodes to exactly those
    /// bytes (decoding is strict: one encoding per value).
    #[test]
    fn a_changed_byte_is_refused_or_canonical(m in msg(), at in any::<prop::sample::Index>(), x in 1u8..) {
        prop_assume!(m.validate().is_ok());
        let mut bytes = encoded(&m);
        let i = at.index(bytes.len());
        bytes[i] ^= x;
        if let Ok(Some((other, n))) = decode(&bytes) {
            prop_assert_eq!(n, bytes.len());
            prop_assert_eq!(encoded(&other), bytes);
        }
    }

    /// Arbitrary bytes never panic the decoder.
    #[test]
    fn arbitrary_bytes_do_not_panic(data in prop::collection::vec(any::<u8>(), 0..80)) {
        fuzz(&data);
    }
}

fn header(kind: u16, len: u32) -> Vec<u8> {
    let mut b = MAGIC.to_vec();
    b.extend_from_slice(&VERSION.to_le_bytes());
    b.extend_from_slice(&kind.to_le_bytes());
    b.extend_from_slice(&len.to_le_bytes());
    b.extend_from_slice(&[0; 4]);
    b
}

#[test]
fn headers_are_checked_before_any_body() {
    assert_eq!(decode(b"FMRX"), Err(Error::BadMagic));
    assert_eq!(decode(b"X"), Err(Error::BadMagic));
    assert_eq!(decode(b"FM"), Ok(None));
    let mut v0 = header(HELLO, 40);
    v0[4] = 0;
    assert_eq!(decode(&v0), Err(Error::BadVersion(0)));
    assert_eq!(decode(&header(9, 8)), Err(Error::UnknownKind(9)));
    // A huge announced length is refused at once, never waited for.
    assert_eq!(
        decode(&header(HELLO, u32::MAX)),
        Err(Error::BadLength {
            kind: HELLO,
            len: u32::MAX
        })
    );
    let mut reserved = header(VERDICT, 8);
    reserved[15] = 1;
    assert_eq!(decode(&reserved), Err(Error::Reserved));
}

#[test]
fn fields_out_of_their_limits_are_refused_both_ways() {
    let bad = [
        (
            Msg::Config(Config {
                region_len: 1 << 20,
                chunk_size: 3000,
                trash_len: 0,
                features: 0,
            }),
            "chunk_size",
        ),
        (
            Msg::Registered(Registered {
                region: 1 << 30,
                region_len: 1 << 20,
                staging: (1 << 30) + 4096,
                staging_len: 1 << 20,
                features: 0,
            }),
            "staging",
        ),
        (
            Msg::Request(Request {
                id: 1,
                op: Op::Discard {
                    start: MAX_ADDRESS - PAGE,
                    len: 2 * PAGE,
                },
            }),
            "start",
        ),
        (
            Msg::Request(Request {
                id: 1,
                op: Op::Move {
                    src: 1 << 30,
                    dst: (1 << 30) + 4096,
                    len: 2 * PAGE,
                },
            }),
            "dst",
        ),
        (
            Msg::Hello(Hello {
                token: [0; TOKEN_LEN],
                pid: 0,
            }),
            "pid",
        ),
        (
            Msg::Done(Done {
                id: 1,
                errno: -1,
                bytes: 0,
            }),
            "errno",
        ),
    ];
    for (m, field) in bad {
        let mut out = [0u8; MAX_MSG_LEN];
        assert_eq!(m.encode(&mut out), Err(Error::BadField(field)), "{m:?}");
    }
    // The same refusals on the way in: a valid Discard with its start moved out of bounds.
    let good = Msg::Request(Request {
        id: 7,
        op: Op::Discard {
            start: 1 << 30,
            len: PAGE,
        },
    });
    let mut bytes = encoded(&good);
    bytes[HEADER_LEN + 8..HEADER_LEN + 16].copy_from_slice(&(MAX_ADDRESS).to_le_bytes());
    assert_eq!(decode(&bytes), Err(Error::BadField("start")));
}

#[test]
fn refusal_codes_name_their_refusals() {
    for r in [
        Refusal::Token,
        Refusal::Stranger,
        Refusal::Areas,
        Refusal::Descriptors,
        Refusal::Setup,
    ] {
        assert_eq!(Refusal::from_status(r as u16), Some(r));
    }
    assert_eq!(Refusal::from_status(0), None);
    assert_eq!(Refusal::from_status(99), None);
}

#[test]
fn requests_and_answers_have_their_announced_lengths() {
    let mut out = [0u8; MAX_MSG_LEN];
    let req = Msg::Request(Request {
        id: 7,
        op: Op::Move {
            src: PAGE,
            dst: 4 * PAGE,
            len: PAGE,
        },
    });
    assert_eq!(req.encode(&mut out), Ok(REQUEST_LEN));
    let done = Msg::Done(Done {
        id: 7,
        errno: 0,
        bytes: PAGE,
    });
    assert_eq!(done.encode(&mut out), Ok(DONE_LEN));
}
