//! The migration control messages on arbitrary bytes: a frame header, then its payload. The
//! decoders must never panic; every message they accept must encode to a frame that decodes
//! to the same message (an `Abort` reason is decoded lossily, so it is compared re-decoded).
#![no_main]

use farmap_migrate::msg::{decode_header, Msg, HEADER_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first byte, if the rest is too short for a header, is a kind for a bare payload:
    // this reaches every payload decoder without the fuzzer having to find the magic first.
    let Some((&kind, rest)) = data.split_first() else {
        return;
    };
    let (kind, payload) = match data.get(..HEADER_LEN) {
        Some(h) => match decode_header(h.try_into().expect("header length")) {
            Ok(h) => {
                let payload = &data[HEADER_LEN..];
                (h.kind, &payload[..payload.len().min(h.len as usize)])
            }
            Err(_) => (kind % 18, rest),
        },
        None => (kind % 18, rest),
    };
    let Ok(msg) = Msg::decode(kind, payload) else {
        return;
    };
    let frame = msg.encode();
    let header = decode_header(frame[..HEADER_LEN].try_into().expect("header length"))
        .expect("an encoded header decodes");
    assert_eq!(header.len as usize, frame.len() - HEADER_LEN);
    let back = Msg::decode(header.kind, &frame[HEADER_LEN..]).expect("an encoded message decodes");
    match msg {
        Msg::Abort { .. } => {
            let again = Msg::decode(header.kind, &back.encode()[HEADER_LEN..]).expect("decodes");
            assert_eq!(again, back, "an Abort re-encodes stably");
        }
        _ => assert_eq!(back, msg, "the message survives a round trip"),
    }
});
