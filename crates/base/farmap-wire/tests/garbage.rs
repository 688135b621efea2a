//! Random bytes never make a decoder panic, and never make it allocate more than its caps
//! allow, however large the lengths the bytes claim.
//!
//! The allocation bound is measured, not assumed: the test kit's counting global allocator
//! records the largest single allocation made on the test's thread while a decoder runs (this
//! file is a test binary of its own, so the allocator counts for these tests only).

use bytes::{BufMut, BytesMut};
use farmap_testkit::alloc::{largest_allocation, CountingAlloc};
use farmap_wire::{
    decode_client_hello, decode_server_hello, op, FrameDecoder, Limits, MAX_HELLO_BODY,
    SERVER_HELLO_HEADER_LEN,
};
use proptest::prelude::*;

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

const LIMITS: Limits = Limits {
    max_frame: 1 << 20,
    max_batch: 64,
};

/// Feeds `bytes` to a frame decoder in pieces, as a connection would, until it errors or
/// runs out of input.
fn feed_frames(bytes: &[u8], piece: usize) {
    let mut d = FrameDecoder::new(LIMITS);
    let mut buf = BytesMut::with_capacity(64);
    for part in bytes.chunks(piece.max(1)) {
        buf.put_slice(part);
        loop {
            match d.decode(&mut buf) {
                Ok(Some(_)) => continue,
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
}

fn feed_hellos(bytes: &[u8]) {
    let mut buf = BytesMut::from(bytes);
    let _ = decode_client_hello(&mut buf);
    let mut buf = BytesMut::from(bytes);
    let _ = decode_server_hello(&mut buf);
}

/// Garbage that looks like frames: a plausible header (any length, a valid op code) followed
/// by random bytes, so that the decoder gets past the first checks.
fn framed_garbage() -> impl Strategy<Value = Vec<u8>> {
    (
        any::<u32>(),
        prop::sample::select(vec![
            op::READ,
            op::WRITE,
            op::TRIM,
            op::READ_OK,
            op::ERROR,
            op::GEOMETRY_OK,
            op::STATUS_OK,
            op::READ_RUN,
            op::READ_RUN_OK,
        ]),
        1u64..,
        prop::collection::vec(any::<u8>(), 0..2048),
        any::<bool>(),
    )
        .prop_map(|(len, code, id, rest, small)| {
            let len = if small { len % 4096 } else { len };
            let mut v = len.to_be_bytes().to_vec();
            v.push(code);
            v.extend_from_slice(&id.to_be_bytes());
            v.extend_from_slice(&rest);
            v
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn random_bytes_never_panic_nor_allocate_past_the_cap(
        bytes in prop_oneof![prop::collection::vec(any::<u8>(), 0..4096), framed_garbage()],
        piece in 1usize..512,
    ) {
        let cap = LIMITS.max_frame as usize;
        let largest = largest_allocation(|| feed_frames(&bytes, piece));
        prop_assert!(largest <= cap, "frame decoder allocated {largest} bytes (cap {cap})");
        let hello_cap = SERVER_HELLO_HEADER_LEN + MAX_HELLO_BODY as usize + bytes.len();
        let largest = largest_allocation(|| feed_hellos(&bytes));
        prop_assert!(largest <= hello_cap, "hello decoders allocated {largest} bytes");
    }
}

#[test]
fn a_huge_claimed_length_allocates_nothing_big() {
    for len in [u32::MAX, LIMITS.max_frame, LIMITS.max_frame - 3] {
        let mut v = len.to_be_bytes().to_vec();
        v.push(op::WRITE);
        v.extend_from_slice(&1u64.to_be_bytes());
        let largest = largest_allocation(|| feed_frames(&v, 7));
        assert!(largest <= LIMITS.max_frame as usize, "{len}: {largest}");
    }
    // A read batch count far past the cap is refused before the index vector is allocated.
    let mut v = Vec::new();
    v.extend_from_slice(&13u32.to_be_bytes());
    v.push(op::READ);
    v.extend_from_slice(&1u64.to_be_bytes());
    v.extend_from_slice(&u32::MAX.to_be_bytes());
    let largest = largest_allocation(|| feed_frames(&v, 100));
    assert!(largest < 1024, "{largest}");
}

#[test]
fn the_tracker_sees_allocations() {
    let largest = largest_allocation(|| {
        std::hint::black_box(Vec::<u8>::with_capacity(3 << 20));
    });
    assert!(largest >= 3 << 20, "{largest}");
    // A frame that is allowed and arrives whole is reserved for once: up to the cap.
    let mut v = (LIMITS.max_frame - 4).to_be_bytes().to_vec();
    v.push(op::WRITE);
    v.extend_from_slice(&1u64.to_be_bytes());
    let largest = largest_allocation(|| feed_frames(&v, 13));
    assert!(largest > LIMITS.max_frame as usize / 2, "{largest}");
}
