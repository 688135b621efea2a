//! Random bytes never make the hand-over hello and reply decoders panic (the stable-toolchain
//! smoke test of `fuzz/fuzz_targets/handover_hello.rs`, which CI can only build), and every
//! hello they accept survives a round trip. No userfaultfd is needed: the decoders do no I/O.

use farmap_uffd::handover::message::{fuzz_hello, Hello, HEADER_LEN};
use proptest::prelude::*;

/// The fuzz target's check: no panic, and an accepted hello survives a round trip.
fn check(data: &[u8]) {
    fuzz_hello(data);
}

/// A valid hello's bytes for a region of `chunks` chunks of 64 KiB.
fn valid(chunks: u64, spec: &str) -> Vec<u8> {
    Hello {
        flags: 1,
        base: 0x7f00_0000_0000,
        len: chunks << 16,
        page_size: 4096,
        chunk_size: 1 << 16,
        features: 0,
        spec: spec.into(),
        present: vec![0xa5; chunks.div_ceil(8) as usize],
    }
    .encode()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    #[test]
    fn random_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..200)) {
        check(&data);
    }

    /// A valid hello with a few bytes overwritten: most fields stay plausible, so the checks
    /// past the magic and version are reached.
    #[test]
    fn mutated_hellos_never_panic(
        chunks in 1u64..64,
        edits in proptest::collection::vec((0usize..100, any::<u8>()), 1..6),
        cut in 0usize..100,
    ) {
        let mut b = valid(chunks, "file:/tmp/x.img");
        for (at, v) in edits {
            if let Some(x) = b.get_mut(at) {
                *x = v;
            }
        }
        b.truncate(b.len().saturating_sub(cut % 4));
        check(&b);
    }
}

#[test]
fn a_valid_hello_passes_the_check() {
    let b = valid(17, "memory:1MiB");
    let header = Hello::decode_header(b[..HEADER_LEN].try_into().unwrap()).unwrap();
    assert_eq!((header.spec_len, header.bitmap_len), (11, 3));
    check(&b);
}
