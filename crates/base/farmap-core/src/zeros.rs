//! Zero chunks without allocation, and a fast all-zero test.

use bytes::Bytes;

use crate::MAX_CHUNK_SIZE;

static ZEROS: [u8; MAX_CHUNK_SIZE as usize] = [0; MAX_CHUNK_SIZE as usize];

/// A chunk of `len` zero bytes that shares one static buffer (no allocation, no copy).
///
/// # Panics
/// If `len` exceeds [`MAX_CHUNK_SIZE`].
pub fn zero_chunk(len: usize) -> Bytes {
    Bytes::from_static(&ZEROS[..len])
}

/// Whether every byte of `data` is zero.
pub fn is_zero(data: &[u8]) -> bool {
    // OR-fold 64-byte blocks (the compiler vectorizes the fold) and stop at the first non-zero.
    let mut blocks = data.chunks_exact(64);
    for block in blocks.by_ref() {
        if block.iter().fold(0u8, |acc, &b| acc | b) != 0 {
            return false;
        }
    }
    blocks.remainder().iter().all(|&b| b == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_detection() {
        assert!(is_zero(&[]));
        assert!(is_zero(&[0; 4097]));
        let mut v = vec![0u8; 4097];
        v[4096] = 1;
        assert!(!is_zero(&v));
        v[4096] = 0;
        v[7] = 9;
        assert!(!is_zero(&v));
        assert_eq!(zero_chunk(4096).len(), 4096);
        assert!(is_zero(&zero_chunk(65536)));
    }
}
