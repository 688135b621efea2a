//! `farmap run`'s messages on arbitrary bytes, decoded as both ends decode them: decoding
//! never panics, and what decodes re-encodes to exactly its bytes
//! (`farmap_run_proto::fuzz`). Inputs are read as a stream of messages, one after another.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let Ok(Some((_, n))) = farmap_run_proto::decode(rest) {
        farmap_run_proto::fuzz(rest);
        rest = &rest[n..];
    }
    farmap_run_proto::fuzz(rest);
});
