//! Bounds-checked reading of big-endian fields from a received message.

/// Reads fields off the front of a byte slice; every read fails (`None`) rather than run
/// past the end.
#[derive(Debug)]
pub(crate) struct Cursor<'a>(pub(crate) &'a [u8]);

impl<'a> Cursor<'a> {
    pub(crate) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Some(head)
    }

    pub(crate) fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }

    pub(crate) fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    pub(crate) fn u64(&mut self) -> Option<u64> {
        self.take(8).map(|b| {
            let mut a = [0u8; 8];
            a.copy_from_slice(b);
            u64::from_be_bytes(a)
        })
    }

    /// A string of `len` bytes (at most [`MAX_STRING`](crate::consts::MAX_STRING)), UTF-8.
    pub(crate) fn string(&mut self, len: usize) -> Option<&'a str> {
        if len > crate::consts::MAX_STRING {
            return None;
        }
        std::str::from_utf8(self.take(len)?).ok()
    }

    pub(crate) fn rest(&self) -> usize {
        self.0.len()
    }
}

/// Reads a big-endian `u32` at `at` of a slice known to be long enough.
pub(crate) fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Reads a big-endian `u16` at `at` of a slice known to be long enough.
pub(crate) fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

/// Reads a big-endian `u64` at `at` of a slice known to be long enough.
pub(crate) fn be64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}
