//! The geometry record kept in `<prefix>:meta`: a region's size and chunk size, written when
//! the region is created and checked on every later open.

use farmap_core::{format_size, Geometry};

/// The record's first word and format version.
const MAGIC: &str = "farmap-redis 1";
/// The longest record accepted (a real one is about 50 bytes).
pub(crate) const MAX_LEN: usize = 256;

/// The record for `g`: `farmap-redis 1 size=<bytes> chunk=<bytes>`.
pub(crate) fn encode(g: Geometry) -> String {
    format!("{MAGIC} size={} chunk={}", g.size(), g.chunk_size())
}

/// The geometry in a record, or why it is not one.
pub(crate) fn decode(raw: &[u8]) -> Result<Geometry, String> {
    if raw.len() > MAX_LEN {
        return Err(format!(
            "{} bytes, more than a record's {MAX_LEN}",
            raw.len()
        ));
    }
    let text = std::str::from_utf8(raw).map_err(|_| "not text".to_string())?;
    let rest = text
        .strip_prefix(MAGIC)
        .and_then(|r| r.strip_prefix(' '))
        .ok_or_else(|| format!("{text:?} does not start with {MAGIC:?}"))?;
    let mut size = None;
    let mut chunk = None;
    for word in rest.split(' ') {
        match word.split_once('=') {
            Some(("size", v)) => size = v.parse::<u64>().ok(),
            Some(("chunk", v)) => chunk = v.parse::<u64>().ok(),
            _ => return Err(format!("unexpected {word:?} in {text:?}")),
        }
    }
    let (Some(size), Some(chunk)) = (size, chunk) else {
        return Err(format!("{text:?} lacks a size or a chunk size"));
    };
    Geometry::new_bounded(size, chunk).map_err(|e| format!("{text:?}: {e}"))
}

/// `64 MiB in chunks of 64 KiB`, for messages.
pub(crate) fn describe(g: Geometry) -> String {
    format!(
        "{} in chunks of {}",
        format_size(g.size()),
        format_size(u64::from(g.chunk_size()))
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip_and_refusals() {
        let g = Geometry::new(7 * 4096 + 1000, 4096).unwrap();
        assert_eq!(decode(encode(g).as_bytes()), Ok(g));
        for bad in [
            &b"farmap-redis 2 size=1 chunk=4096"[..],
            b"farmap-redis 1 size=1",
            b"farmap-redis 1 size=0 chunk=4096",
            b"farmap-redis 1 size=4096 chunk=3000",
            b"farmap-redis 1 size=4096 chunk=4096 x=1",
            b"\xff\xfe",
            &[b'a'; 300],
        ] {
            assert!(decode(bad).is_err(), "{bad:?}");
        }
    }

    proptest! {
        /// Random bytes (the key's value comes from the server) never panic the decoder.
        #[test]
        fn random_records_do_not_panic(raw in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = decode(&raw);
        }
    }
}
