//! The hand-over hello and reply on arbitrary bytes, read as the handler reads them: the
//! fixed header, then (at the header's length) the spec and the presence bitmap. Decoding
//! must never panic; an accepted hello must encode to bytes that decode to the same hello
//! (`farmap_uffd::handover::message::fuzz_hello`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    farmap_uffd::handover::message::fuzz_hello(data);
});
