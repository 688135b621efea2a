//! A whole store's bytes, read or written chunk by chunk.

use std::sync::Arc;

use bytes::Bytes;
use farmap_core::Store;

use crate::{block_on, pattern_bytes};

/// The whole region's bytes, read chunk by chunk.
///
/// # Panics
/// If a read fails.
pub async fn read_all(store: &dyn Store) -> Vec<u8> {
    let g = store.geometry();
    let mut out = Vec::with_capacity(g.size() as usize);
    for idx in g.all().iter() {
        let data = store
            .read(idx)
            .await
            .unwrap_or_else(|e| panic!("reading {idx} of the whole region: {e}"));
        out.extend_from_slice(&data);
    }
    out
}

/// Writes the pattern with `seed` ([`pattern_bytes`]) to every chunk of `store`, so that its
/// byte at offset `o` is [`pattern_byte`](crate::pattern_byte)`(seed, o)`.
///
/// # Panics
/// If a write fails.
pub async fn write_pattern(store: &dyn Store, seed: u64) {
    let g = store.geometry();
    for idx in g.all().iter() {
        let data = pattern_bytes(seed, g.offset_of(idx), g.chunk_len(idx));
        store
            .write(idx, Bytes::from(data))
            .await
            .unwrap_or_else(|e| panic!("writing the pattern to {idx}: {e}"));
    }
}

/// [`read_all`] for a synchronous test (it runs a runtime of its own: not to be called on a
/// runtime's thread).
pub fn snapshot(store: &dyn Store) -> Vec<u8> {
    block_on(read_all(store))
}

/// `store` holding the pattern with `seed` (see [`write_pattern`]), shared: for a
/// synchronous test (it runs a runtime of its own to write).
pub fn with_pattern<S: Store>(store: S, seed: u64) -> Arc<S> {
    block_on(write_pattern(&store, seed));
    Arc::new(store)
}
