//! proptest strategies for byte-range operation sequences.

use proptest::prelude::*;

/// One operation of a model test on a byte-addressed region.
#[derive(Debug, Clone)]
pub enum ByteOp {
    /// Read `len` bytes at `offset`.
    Read {
        /// Start of the read.
        offset: u64,
        /// Length of the read.
        len: usize,
    },
    /// Write `data` at `offset`.
    Write {
        /// Start of the write.
        offset: u64,
        /// The bytes written.
        data: Vec<u8>,
    },
    /// Flush.
    Flush,
}

/// Operations over a region of `size` bytes, biased towards small ranges that straddle chunk
/// boundaries of `chunk` bytes, with occasional ranges spanning several chunks.
pub fn byte_ops(size: u64, chunk: u64, max_ops: usize) -> impl Strategy<Value = Vec<ByteOp>> {
    let max_len = (chunk * 3).min(size) as usize;
    let range = (0..size).prop_flat_map(move |offset| {
        let room = (size - offset) as usize;
        let boundary = (offset / chunk + 1) * chunk;
        let near = (boundary.saturating_sub(offset)) as usize;
        let lens = prop_oneof![
            1..=room.min(64),
            Just(near.clamp(1, room)),
            1..=room.min(max_len),
        ];
        (Just(offset), lens)
    });
    let op = prop_oneof![
        4 => range.clone().prop_map(|(offset, len)| ByteOp::Read { offset, len }),
        4 => range.prop_flat_map(|(offset, len)| {
            proptest::collection::vec(any::<u8>(), len)
                .prop_map(move |data| ByteOp::Write { offset, data })
        }),
        1 => Just(ByteOp::Flush),
    ];
    proptest::collection::vec(op, 1..max_ops)
}

/// A seed for deterministic workloads inside a property.
pub fn seed() -> impl Strategy<Value = u64> {
    any::<u64>()
}
