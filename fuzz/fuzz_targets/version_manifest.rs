//! The versioned layout's decoders on arbitrary bytes: a version manifest (what another
//! writer, or a damaged object store, left), a page of a chunk map, a stored chunk and a
//! working set. None may panic or allocate more than its input (and the chunk's length) calls
//! for; a manifest, page or working set that decodes encodes back to the same bytes, and a
//! chunk that decodes matches its hash.
#![no_main]

use farmap_versions::page::{Page, PAGE_CHUNKS};
use farmap_versions::{chunk, touched, Hash, Manifest};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = Manifest::decode(data) {
        assert_eq!(m.encode(), data, "{m:?} encodes differently");
    }
    if let Ok(page) = Page::decode(data, PAGE_CHUNKS) {
        assert_eq!(page.encode(), data, "{page:?} encodes differently");
    }
    if let Ok(order) = touched::decode(data, 1 << 20) {
        assert_eq!(touched::encode(&order), data);
    }
    // A stored chunk of at most 64 KiB, its length from the first two bytes.
    if let Some((len, stored)) = data.split_first_chunk::<2>() {
        let len = usize::from(u16::from_le_bytes(*len)) + 1;
        let hash = Hash::of(stored);
        if let Ok(back) = chunk::decode(stored, len, &hash) {
            assert_eq!(back.len(), len);
        }
    }
});
