//! The farmap frame decoder on arbitrary bytes (run reads and their replies included): it
//! must never panic, every frame it accepts must encode back to exactly the bytes it was
//! decoded from, and must decode the same from a buffer of its own (`decode_own`).
#![no_main]

use bytes::{Bytes, BytesMut};
use farmap_wire::{FrameDecoder, Limits, Message};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first byte picks how the stream is cut into reads (1..=256 bytes each).
    let Some((&piece, data)) = data.split_first() else {
        return;
    };
    let piece = usize::from(piece) + 1;
    let mut decoder = FrameDecoder::new(Limits {
        max_frame: 1 << 20,
        max_batch: 64,
    });
    let mut buf = BytesMut::new();
    let mut consumed = 0usize;
    for part in data.chunks(piece) {
        buf.extend_from_slice(part);
        loop {
            let before = buf.len();
            match decoder.decode(&mut buf) {
                Ok(Some(frame)) => {
                    let used = before - buf.len();
                    let mut again = BytesMut::new();
                    frame.encode(&mut again);
                    assert_eq!(frame.encoded_len(), again.len());
                    let mut parts = Vec::new();
                    frame.encode_parts(&mut parts);
                    assert_eq!(
                        parts.concat(),
                        again[..],
                        "encode_parts differs from encode"
                    );
                    let original = &data[consumed..consumed + used];
                    // The same frame in a buffer of its own decodes the same (without copies).
                    let own = decoder
                        .decode_own(Bytes::copy_from_slice(original))
                        .expect("a frame decoded from a stream decodes in its own buffer");
                    assert_eq!(own, frame, "decode_own differs from decode");
                    match &frame.msg {
                        // Messages are decoded lossily (invalid UTF-8 is replaced, which may
                        // lengthen them past the cap) and unknown cap/flag bits are dropped:
                        // those frames must decode again, the rest must be byte-identical.
                        Message::Error(_) | Message::GeometryOk(_) => {
                            let back = FrameDecoder::new(Limits::default())
                                .decode(&mut again)
                                .expect("a decoded frame re-encodes validly")
                                .expect("whole");
                            if let Message::GeometryOk(_) = frame.msg {
                                assert_eq!(back, frame);
                            }
                        }
                        _ => assert_eq!(&again[..], original, "re-encoding differs: {frame:?}"),
                    }
                    consumed += used;
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
});
