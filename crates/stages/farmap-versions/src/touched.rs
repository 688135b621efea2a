//! Working sets: the order in which a run first read each chunk, kept with the version it ran
//! on, and read ahead in that order when the region opens again. Under a cache that reads
//! ahead itself (a managed mount's pull), the run's order is the one the cache reports
//! (`Store::reports_touches`): the application's first reads and writes.
//!
//! ```text
//!   regions/NAME/touched/SEQ.COUNT     magic "FMTOUCH1" | count u64 | count × chunk u64
//! ```
//!
//! Integers are little-endian, chunks are distinct and within the region. A writable opening
//! saves its order at each flush that found it grown (under the version it runs on, whether
//! or not the flush made a new one); an opening reads the longest order of the latest version
//! at or before its own. Read-only openings (copies out, scrubs) record nothing: their order
//! is not an application's.

use std::collections::HashSet;

use bytes::Bytes;
use farmap_core::{ErrorKind, Objects, StoreError, StoreResult};

const MAGIC: &[u8; 8] = b"FMTOUCH1";

/// Chunks a working set records at most (the first ones read): its object stays under
/// 8 MB, and 1,000,000 chunks is 64 GB of a region in 64 KiB chunks to read ahead.
pub const MAX_CHUNKS: usize = 1_000_000;

/// The folder of a region's working sets.
pub(crate) fn touched_dir(region: &str) -> String {
    format!("regions/{region}/touched")
}

/// The bytes of `order`.
pub fn encode(order: &[u64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + order.len() * 8);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(order.len() as u64).to_le_bytes());
    for c in order {
        out.extend_from_slice(&c.to_le_bytes());
    }
    out
}

/// The order `data` holds, for a region of `chunks` chunks: every chunk below `chunks`, each
/// once. Allocates no more than the input calls for.
pub fn decode(data: &[u8], chunks: u64) -> StoreResult<Vec<u64>> {
    let bad = |why: &str| StoreError::new(ErrorKind::Corrupt, format!("a working set {why}"));
    let rest = data
        .strip_prefix(MAGIC)
        .ok_or_else(|| bad("does not start with FMTOUCH1"))?;
    let (count, rest) = rest
        .split_first_chunk::<8>()
        .ok_or_else(|| bad("is cut short"))?;
    let count = u64::from_le_bytes(*count);
    if count.checked_mul(8) != Some(rest.len() as u64) {
        return Err(bad("does not hold the chunks it counts"));
    }
    let mut seen = HashSet::with_capacity(rest.len() / 8);
    let mut order = Vec::with_capacity(rest.len() / 8);
    for c in rest.chunks_exact(8) {
        let c = u64::from_le_bytes(c.try_into().expect("8 bytes"));
        if c >= chunks || !seen.insert(c) {
            return Err(bad("names a chunk twice or outside the region"));
        }
        order.push(c);
    }
    Ok(order)
}

/// The key of a working set of `count` chunks recorded on version `seq`.
pub(crate) fn key(region: &str, seq: u64, count: usize) -> String {
    format!("{}/{seq:020}.{count}", touched_dir(region))
}

/// The working set to read ahead for version `seq`: the longest one of the latest version at
/// or before it, `None` when there is none (or it cannot be read: reading ahead is only
/// ever a gain).
pub(crate) async fn find(
    objects: &dyn Objects,
    region: &str,
    seq: u64,
    chunks: u64,
) -> Option<Vec<u64>> {
    let names = match objects.list(&touched_dir(region)).await {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!(region, "cannot list the working sets: {e}");
            return None;
        }
    };
    let best = names
        .iter()
        .filter_map(|n| {
            let (s, c) = n.split_once('.')?;
            Some((s.parse::<u64>().ok()?, c.parse::<u64>().ok()?, n))
        })
        .filter(|(s, _, _)| *s <= seq)
        .max_by_key(|(s, c, _)| (*s, *c))?;
    let key = format!("{}/{}", touched_dir(region), best.2);
    match objects.get(&key).await {
        Ok(Some(b)) => match decode(&b, chunks) {
            Ok(order) => Some(order),
            Err(e) => {
                tracing::warn!(region, "{key}: {e}");
                None
            }
        },
        Ok(None) => None,
        Err(e) => {
            tracing::warn!(region, "cannot read {key}: {e}");
            None
        }
    }
}

/// Saves `order` as recorded on version `seq` (a name already taken holds the same order).
pub(crate) async fn save(
    objects: &dyn Objects,
    region: &str,
    seq: u64,
    order: &[u64],
) -> StoreResult<()> {
    objects
        .create(&key(region, seq, order.len()), Bytes::from(encode(order)))
        .await
        .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_damage() {
        let order = vec![5, 1, 9, 0];
        assert_eq!(decode(&encode(&order), 10).unwrap(), order);
        assert!(decode(&encode(&order), 9).is_err(), "outside the region");
        assert!(decode(&encode(&[1, 1]), 10).is_err(), "twice");
        let mut cut = encode(&order);
        cut.pop();
        assert!(decode(&cut, 10).is_err());
        let mut lying = encode(&order);
        lying[8] = 200;
        assert!(decode(&lying, 10).is_err(), "a count the bytes do not hold");
        assert!(decode(b"FMTOUCH0", 10).is_err());
    }
}
