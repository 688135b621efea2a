//! A read-only store whose content is a pure function of the byte offset.

use bytes::{Bytes, BytesMut};
use farmap_core::{
    BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, Store, StoreError,
    StoreResult,
};

pub use farmap_core::pattern::{pattern_byte, pattern_bytes};

/// [`pattern_bytes`]`(seed, 0, len)` with a run of zeros (bytes `len / 3 .. len / 3 + len / 8`):
/// file content that differs along the file and has a stretch a copy may skip.
pub fn pattern_with_zeros(seed: u64, len: usize) -> Vec<u8> {
    let mut v = pattern_bytes(seed, 0, len);
    let z = len / 3;
    v[z..z + len / 8].fill(0);
    v
}

/// Xorshift64 (shifts 13, 7, 17): an endless stream of pseudo-random words from a seed, for
/// test data that must look random and be the same on every run. A zero seed gives only
/// zeros.
#[derive(Debug, Clone)]
pub struct XorShift(pub u64);

impl Iterator for XorShift {
    type Item = u64;

    fn next(&mut self) -> Option<u64> {
        let x = &mut self.0;
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        Some(*x)
    }
}

/// `len` bytes of chunk `idx` as written at `version`: every byte depends on both through a
/// 64-bit tag (so that a stale or torn chunk shows), and none is zero.
pub fn versioned_chunk(idx: u64, version: u64, len: usize) -> Bytes {
    let tag = idx.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ version.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    Bytes::from(
        (0..len)
            .map(|i| (tag.rotate_left((i % 64) as u32) as u8) ^ (i as u8) | 1)
            .collect::<Vec<u8>>(),
    )
}

/// A read-only store whose byte at offset `o` is [`pattern_byte`]`(seed, o)`: an oracle for
/// anything that moves data (pullers, caches, network transports, frontends).
#[derive(Debug, Clone)]
pub struct PatternStore {
    geometry: Geometry,
    seed: u64,
}

impl PatternStore {
    /// A pattern store of the given shape.
    pub fn new(geometry: Geometry, seed: u64) -> Self {
        Self { geometry, seed }
    }

    /// The seed of the pattern.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The expected content of `offset..offset+len`.
    pub fn expected(&self, offset: u64, len: usize) -> Vec<u8> {
        pattern_bytes(self.seed, offset, len)
    }
}

impl Store for PatternStore {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn caps(&self) -> Caps {
        Caps::STATUS | Caps::PARALLEL
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move {
            self.geometry.check_idx(idx)?;
            let len = self.geometry.chunk_len(idx);
            let mut buf = BytesMut::with_capacity(len);
            buf.extend_from_slice(&pattern_bytes(self.seed, self.geometry.offset_of(idx), len));
            Ok(buf.freeze())
        })
    }

    fn write(&self, idx: ChunkIdx, _data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            self.geometry.check_idx(idx)?;
            Err(StoreError::new(
                ErrorKind::ReadOnly,
                "the pattern store is read-only",
            ))
        })
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async { Ok(()) })
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move {
            self.geometry.check_range(range)?;
            Err(StoreError::new(
                ErrorKind::ReadOnly,
                "the pattern store is read-only",
            ))
        })
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        Box::pin(async move {
            self.geometry.check_idx(idx)?;
            Ok(ChunkStatus::Data)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_is_a_function_of_offset() {
        let a = pattern_bytes(7, 3, 100);
        for (i, b) in a.iter().enumerate() {
            assert_eq!(*b, pattern_byte(7, 3 + i as u64));
        }
        assert_ne!(pattern_bytes(7, 0, 64), pattern_bytes(8, 0, 64));
        assert_ne!(pattern_bytes(7, 0, 64), pattern_bytes(7, 64, 64));
    }
}
