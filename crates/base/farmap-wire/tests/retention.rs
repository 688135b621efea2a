//! Decoded chunk payloads own exactly their bytes: keeping them never keeps the receive
//! buffer they arrived in alive.
//!
//! Measured, not assumed: a global allocator wrapper counts the bytes allocated and not yet
//! freed on the test's thread. This file is a test binary of its own, so the `unsafe` the
//! allocator trait needs stays out of the crate (which forbids it).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use bytes::{Bytes, BytesMut};
use farmap_core::ChunkIdx;
use farmap_wire::{Frame, FrameDecoder, Limits, Message, Payload};

struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
}

fn add(delta: isize) {
    // `try_with`: the thread-local may be gone while a thread shuts down.
    let _ = LIVE.try_with(|l| l.set(l.get() + delta));
}

// SAFETY: every call forwards to `System` with the same arguments; the wrapper only counts
// sizes in a const-initialized thread-local, which never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        add(layout.size() as isize);
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, passed on unchanged.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        add(-(layout.size() as isize));
        // SAFETY: `ptr` was allocated by `System` with `layout` (every allocation goes there).
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        add(new_size as isize - layout.size() as isize);
        // SAFETY: as for `dealloc`; the caller upholds `realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn live() -> isize {
    LIVE.with(|l| l.get())
}

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
    let before = live();
    let mut kept = Vec::with_capacity(ROUNDS);
    let base = live();
    for i in 0..ROUNDS {
        kept.push(payload_of(decode_from_big_buffer(&make(i as u8))));
    }
    let grown = live() - base;
    assert!(kept.iter().all(|k| k.len() == CHUNK));
    drop(kept);
    assert!(
        live() <= before,
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
