//! Random bytes never make the migration message decoders panic (the stable-toolchain smoke
//! test of `fuzz/fuzz_targets/migrate_msg.rs`, which CI can only build), and every message
//! they accept survives a round trip.

use farmap_migrate::msg::{decode_header, Msg, HEADER_LEN, MAGIC, VERSION};
use proptest::prelude::*;

/// Decodes `payload` as a message of `kind`; an accepted one must encode and decode back.
fn check(kind: u8, payload: &[u8]) {
    let Ok(msg) = Msg::decode(kind, payload) else {
        return;
    };
    let frame = msg.encode();
    let header = decode_header(frame[..HEADER_LEN].try_into().unwrap()).unwrap();
    assert_eq!(header.len as usize, frame.len() - HEADER_LEN);
    let back = Msg::decode(header.kind, &frame[HEADER_LEN..]).unwrap();
    if !matches!(msg, Msg::Abort { .. }) {
        // An Abort's reason is decoded lossily (invalid UTF-8 replaced).
        assert_eq!(back, msg);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    /// Random frames, half of them with a good magic and version so that the rest is read.
    #[test]
    fn random_frames_never_panic(
        mut data in proptest::collection::vec(any::<u8>(), 0..200),
        good_start in any::<bool>(),
    ) {
        if good_start && data.len() >= 6 {
            data[..4].copy_from_slice(&MAGIC);
            data[4..6].copy_from_slice(&VERSION.to_be_bytes());
        }
        if let Some(h) = data.get(..HEADER_LEN) {
            if let Ok(h) = decode_header(h.try_into().unwrap()) {
                let payload = &data[HEADER_LEN..];
                check(h.kind, &payload[..payload.len().min(h.len as usize)]);
            }
        }
    }

    /// Every kind (and a few undefined ones) over random payloads, most of them short enough
    /// to end early and some with lengths that claim far more than follows.
    #[test]
    fn random_payloads_never_panic(
        kind in 0u8..16,
        payload in proptest::collection::vec(any::<u8>(), 0..120),
    ) {
        check(kind, &payload);
    }

    /// Valid headers with random kinds and lengths: lengths past the cap are refused.
    #[test]
    fn random_headers_never_panic(kind in any::<u8>(), len in any::<u32>()) {
        let mut h = [0u8; HEADER_LEN];
        h[..4].copy_from_slice(&MAGIC);
        h[4..6].copy_from_slice(&VERSION.to_be_bytes());
        h[6] = kind;
        h[7..].copy_from_slice(&len.to_be_bytes());
        if let Ok(d) = decode_header(&h) {
            prop_assert_eq!((d.kind, d.len), (kind, len));
        }
    }
}
