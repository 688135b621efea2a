//! What a bounded region gets when its options say nothing: page-sized chunks when the
//! store's layout is farmap's choice, and sequential prefetch.

use farmap::{open_region, RegionOptions, StoreSpec};
use farmap_uffd::{LocalLimit, PagingOptions, Prefetch};

/// Whether bounded regions work here (userfaultfd with UFFDIO_MOVE and WP_ASYNC).
fn paging_available(test: &str) -> bool {
    farmap_testkit::skip::unless(test, farmap_uffd::probe_paging()).is_some()
}

fn bounded() -> RegionOptions {
    RegionOptions {
        paging: Some(PagingOptions::new(LocalLimit::Percent(50.0))),
        ..RegionOptions::direct()
    }
}

#[test]
fn a_bounded_region_pages_in_page_sized_chunks_unless_the_spec_says_otherwise() {
    assert_eq!(
        PagingOptions::new(LocalLimit::Percent(30.0)).prefetch,
        Prefetch::Sequential {
            max_chunks: farmap_uffd::DEFAULT_PREFETCH_CHUNKS
        },
        "prefetch is on by default"
    );
    let test = "a_bounded_region_pages_in_page_sized_chunks_unless_the_spec_says_otherwise";
    if !paging_available(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let file = format!("file:{}?size=1MiB", dir.path().join("r.img").display());
    let cases = [
        // (spec, bounded, chunk size the region gets)
        ("memory:1MiB", true, 4096),
        (file.as_str(), true, 4096),
        ("memory:1MiB?chunk=64KiB", true, 64 << 10),
        ("memory:1MiB", false, farmap::DEFAULT_CHUNK_SIZE),
    ];
    for (spec, paging, chunk) in cases {
        let parsed: StoreSpec = spec.parse().unwrap();
        let opts = if paging {
            bounded()
        } else {
            RegionOptions::direct()
        };
        let region = open_region(&parsed, opts).unwrap_or_else(|e| panic!("{spec}: {e}"));
        assert_eq!(
            region.geometry().chunk_size(),
            chunk,
            "{spec}, bounded: {paging}"
        );
        // Written through the bound and read back.
        let data: Vec<u8> = (0..(256u32 << 10)).map(|i| (i % 251) as u8).collect();
        region.memory().write_from(512 << 10, &data).unwrap();
        let mut back = vec![0u8; data.len()];
        region.memory().read_into(512 << 10, &mut back).unwrap();
        assert!(back == data, "{spec}");
        region.close().unwrap();
    }
}
