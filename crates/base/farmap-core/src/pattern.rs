//! A deterministic byte pattern: every byte a pure function of a seed and its offset, so a
//! writer and a checker in different processes (the kernel tests' guest, `farmap demo`, the
//! tests) agree on what a region must hold without sharing anything but the seed.

/// The byte at `offset` of the pattern with `seed`: a hash of the 8-byte word it lies in.
pub fn pattern_byte(seed: u64, offset: u64) -> u8 {
    word(seed, offset / 8).to_le_bytes()[(offset % 8) as usize]
}

fn word(seed: u64, w: u64) -> u64 {
    // splitmix64 of (seed, word index): cheap, and every word differs.
    let mut z = w
        .wrapping_add(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The pattern bytes `offset..offset+len` for `seed`.
pub fn pattern_bytes(seed: u64, offset: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut o = offset;
    let end = offset + len as u64;
    while o < end && !o.is_multiple_of(8) {
        out.push(pattern_byte(seed, o));
        o += 1;
    }
    while o + 8 <= end {
        out.extend_from_slice(&word(seed, o / 8).to_le_bytes());
        o += 8;
    }
    while o < end {
        out.push(pattern_byte(seed, o));
        o += 1;
    }
    out
}
