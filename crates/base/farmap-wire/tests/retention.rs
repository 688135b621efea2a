//! Decoded chunk payloads own exactly their bytes: keeping them never keeps the receive
//! buffer they arrived in alive.
//!
//! Measured, not assumed: the test kit's counting global allocator counts the bytes allocated
//! and not yet freed on the test's thread (this file is a test binary of its own, so the
//! allocator counts for these tests only).

use bytes::{Bytes, BytesMut};
use farmap_core::ChunkIdx;
use farmap_testkit::alloc::{live_bytes, CountingAlloc};
use farmap_wire::{Frame, FrameDecoder, Limits, Message, Payload};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

const CHUNK: usize = 4096;
const ROUNDS: usize = 64;
/// A receive buffer as large as a connection's read-ahead.
const RECEIVE_BUFFER: usize = 256 * 1024;

/// Decodes one frame out of a fresh, large receive buffer (followed by more bytes, as a
/// connection's buffer would be) and returns the frame; the buffer itself is dropped.
fn decode_from_big_buffer(frame: &Frame) -> Frame {
    let mut buf = BytesMut::with_capacity(RECEIVE_BUFFER);
    frame.encode(&mut buf);
    // The start of a next frame that never completes.
    buf.extend_from_slice(&[0, 0, 0, 9, 3]);
    let mut d = FrameDecoder::new(Limits::default());
    d.decode(&mut buf).unwrap().unwrap()
}

fn kept_bytes(make: impl Fn(u8) -> Frame, payload_of: impl Fn(Frame) -> Bytes) -> isize {
    let before = live_bytes();
    let mut kept = Vec::with_capacity(ROUNDS);
    let base = live_bytes();
    for i in 0..ROUNDS {
        kept.push(payload_of(decode_from_big_buffer(&make(i as u8))));
    }
    let grown = live_bytes() - base;
    assert!(kept.iter().all(|k| k.len() == CHUNK));
    drop(kept);
    assert!(
        live_bytes() <= before,
        "everything is freed once the payloads are"
    );
    grown
}

#[test]
fn kept_write_payloads_do_not_keep_their_receive_buffers() {
    let grown = kept_bytes(
        |b| {
            Frame::new(
                1,
                Message::Write {
                    idx: ChunkIdx(u64::from(b)),
                    data: Payload::Data(Bytes::from(vec![b | 1; CHUNK])),
                },
            )
        },
        |f| match f.msg {
            Message::Write {
                data: Payload::Data(d),
                ..
            } => d,
            other => panic!("decoded {other:?}"),
        },
    );
    let budget = (2 * ROUNDS * CHUNK) as isize;
    println!("{ROUNDS} kept write payloads of {CHUNK} bytes hold {grown} bytes (budget {budget}; without copies {} would stay)", ROUNDS * RECEIVE_BUFFER);
    assert!(
        grown <= budget,
        "{grown} bytes held for {ROUNDS} chunks of {CHUNK} bytes"
    );
}

#[test]
fn kept_read_reply_payloads_do_not_keep_their_receive_buffers() {
    let grown = kept_bytes(
        |b| {
            Frame::new(
                1,
                Message::ReadOk(vec![Payload::Data(Bytes::from(vec![b | 1; CHUNK]))]),
            )
        },
        |f| match f.msg {
            Message::ReadOk(mut chunks) => match chunks.pop() {
                Some(Payload::Data(d)) => d,
                other => panic!("decoded {other:?}"),
            },
            other => panic!("decoded {other:?}"),
        },
    );
    let budget = (2 * ROUNDS * CHUNK) as isize;
    println!("{ROUNDS} kept read payloads of {CHUNK} bytes hold {grown} bytes (budget {budget})");
    assert!(
        grown <= budget,
        "{grown} bytes held for {ROUNDS} chunks of {CHUNK} bytes"
    );
}
