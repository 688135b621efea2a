//! A stored chunk: one byte saying how it is kept, then its bytes.
//!
//! ```text
//!   0 | the chunk as it is          (zstd did not make it smaller)
//!   1 | a zstd frame of the chunk
//! ```
//!
//! Reading decompresses into at most the chunk's length (a frame that claims more is
//! refused, not allocated) and checks the content against the hash it is stored under.

use bytes::Bytes;
use farmap_core::{ErrorKind, Objects, StoreError, StoreResult};

use crate::Hash;

const RAW: u8 = 0;
const ZSTD: u8 = 1;

/// The zstd level chunks are written with: the fastest of the standard levels, since a
/// flush compresses every chunk written since the last.
pub const LEVEL: i32 = 1;

/// Where a collector moves chunks before it deletes them (see [`gc`](crate::gc)).
pub(crate) const TRASH: &str = "trash";

/// The key of the chunk whose content hashes to `hash`.
pub fn key(hash: &Hash) -> String {
    let hex = hash.hex();
    format!("chunks/{}/{hex}", &hex[..2])
}

/// The stored form of `data`: compressed when that is smaller.
pub fn encode(data: &[u8]) -> Vec<u8> {
    if let Ok(z) = zstd::bulk::compress(data, LEVEL) {
        if z.len() + 1 < data.len() {
            let mut out = Vec::with_capacity(z.len() + 1);
            out.push(ZSTD);
            out.extend_from_slice(&z);
            return out;
        }
    }
    let mut out = Vec::with_capacity(data.len() + 1);
    out.push(RAW);
    out.extend_from_slice(data);
    out
}

/// The chunk of length `len` stored as `stored` under `hash`, checked.
pub fn decode(stored: &[u8], len: usize, hash: &Hash) -> StoreResult<Bytes> {
    let data = decode_within(stored, len, hash)?;
    if data.len() != len {
        return Err(StoreError::new(
            ErrorKind::Corrupt,
            format!(
                "the stored chunk {} holds {} bytes, not {len}",
                hash.hex(),
                data.len()
            ),
        ));
    }
    Ok(data)
}

/// The object of at most `max` bytes stored as `stored` under `hash` (a chunk, or a page of
/// a chunk map), checked. Nothing beyond `max` is allocated.
pub fn decode_within(stored: &[u8], max: usize, hash: &Hash) -> StoreResult<Bytes> {
    let bad = |why: String| {
        StoreError::new(
            ErrorKind::Corrupt,
            format!("the stored chunk {} {why}", hash.hex()),
        )
    };
    let data = match stored.split_first() {
        Some((&RAW, rest)) if rest.len() <= max => rest.to_vec(),
        Some((&RAW, rest)) => {
            return Err(bad(format!("holds {} bytes, more than {max}", rest.len())))
        }
        Some((&ZSTD, rest)) => zstd::bulk::decompress(rest, max)
            .map_err(|e| bad(format!("does not decompress within {max} bytes: {e}")))?,
        Some((tag, _)) => return Err(bad(format!("has an unknown form {tag}"))),
        None => return Err(bad("is empty".into())),
    };
    if Hash::of(&data) != *hash {
        return Err(bad("does not match its hash".into()));
    }
    Ok(Bytes::from(data))
}

/// The trash entry of `hash` stamped `stamp`.
pub(crate) fn trash_key(hash: &Hash, stamp: u64) -> String {
    let hex = hash.hex();
    format!("{TRASH}/{}/{hex}.{stamp}", &hex[..2])
}

/// The stored bytes of chunk `hash` from the trash, `None` when it holds none.
pub(crate) async fn from_trash(objects: &dyn Objects, hash: &Hash) -> StoreResult<Option<Bytes>> {
    let hex = hash.hex();
    let dir = format!("{TRASH}/{}", &hex[..2]);
    for name in objects.list(&dir).await? {
        if name
            .strip_prefix(hex.as_str())
            .is_some_and(|s| s.starts_with('.'))
        {
            if let Some(b) = objects.get(&format!("{dir}/{name}")).await? {
                return Ok(Some(b));
            }
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_compressed_and_raw() {
        let text: Vec<u8> = b"farmap ".iter().copied().cycle().take(65536).collect();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let noise: Vec<u8> = (0..65536)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        for data in [text, noise] {
            let h = Hash::of(&data);
            let stored = encode(&data);
            assert_eq!(&decode(&stored, data.len(), &h).unwrap()[..], &data[..]);
        }
        let text: Vec<u8> = b"ab".repeat(32768);
        assert!(encode(&text).len() < 1000, "text compresses");
    }

    #[test]
    fn damage_and_bombs_are_refused() {
        let data = vec![7u8; 65536];
        let h = Hash::of(&data);
        let stored = encode(&data);
        assert!(decode(&stored, 4096, &h).is_err(), "more than the chunk");
        assert!(decode(&stored, data.len(), &Hash::of(b"x")).is_err());
        assert!(decode(&[], data.len(), &h).is_err());
        assert!(decode(&[9, 1, 2], data.len(), &h).is_err());
        let mut raw = vec![RAW];
        raw.extend_from_slice(&data[..100]);
        assert!(decode(&raw, data.len(), &h).is_err());
    }
}
