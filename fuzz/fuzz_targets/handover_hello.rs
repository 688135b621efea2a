//! The hand-over hello and reply on arbitrary bytes, read as the handler reads them: the
//! fixed header, then (at the header's length) the spec and the presence bitmap. Decoding
//! must never panic; an accepted hello must encode to bytes that decode to the same hello.
#![no_main]

use farmap_uffd::handover::message::{decode_reply, Hello, HEADER_LEN, REPLY_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(r) = data.get(..REPLY_LEN) {
        let _ = decode_reply(r.try_into().expect("reply length"));
    }
    let Some(h) = data.get(..HEADER_LEN) else {
        return;
    };
    let Ok(header) = Hello::decode_header(h.try_into().expect("header length")) else {
        return;
    };
    let Some(rest) = data
        .get(header.header_len..)
        .and_then(|r| r.get(..header.spec_len + header.bitmap_len))
    else {
        return;
    };
    let Ok(hello) = Hello::from_parts(&header, rest) else {
        return;
    };
    let bytes = hello.encode();
    let again = Hello::decode_header(bytes[..HEADER_LEN].try_into().expect("header length"))
        .expect("an encoded hello's header decodes");
    let back = Hello::from_parts(&again, &bytes[again.header_len..]).expect("it decodes");
    assert_eq!(back, hello, "the hello survives a round trip");
});
