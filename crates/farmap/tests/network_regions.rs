//! `open_region` over network stores: a userfaultfd region whose chunks live in a real Redis.

use farmap::spec::open_store_async;
use farmap::{open_region, RegionOptions, StoreSpec};
use farmap_testkit::{skip, Service};

#[test]
fn a_region_over_redis_writes_reach_redis_and_read_back() {
    let test = "a_region_over_redis_writes_reach_redis_and_read_back";
    if let Err(e) = farmap_uffd::probe() {
        return skip(test, format!("userfaultfd: {e}"));
    }
    let svc = match Service::shared("redis") {
        Ok(s) => s,
        Err(e) => return skip(test, e),
    };
    let spec: StoreSpec = format!("{}/0?size=4MiB&prefix=region-test", svc.var("SPEC_BASE"))
        .parse()
        .unwrap();
    let pattern: Vec<u8> = (0..1 << 20).map(|i| (i % 241) as u8 | 1).collect();
    {
        let region =
            open_region(&spec, RegionOptions::default()).expect("open a region over redis");
        assert_eq!(region.len(), 4 << 20);
        region.memory().write_from(1 << 20, &pattern).unwrap();
        region.sync().expect("sync pushes to redis");
        region.close().expect("close");
    }
    // A separate client sees what the region wrote.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (written, untouched) = rt.block_on(async {
        let store = open_store_async(&spec).await.unwrap();
        let u = farmap::pipeline::Unaligned::new(store);
        (
            u.read_bytes(1 << 20, 1 << 20).await.unwrap(),
            u.read_bytes(0, 1 << 20).await.unwrap(),
        )
    });
    assert_eq!(&written[..], &pattern[..]);
    assert!(untouched.iter().all(|b| *b == 0));
    // A second region over the same spec reads the data on touch.
    let region = open_region(&spec, RegionOptions::default()).unwrap();
    let mut back = vec![0u8; 1 << 20];
    region.memory().read_into(1 << 20, &mut back).unwrap();
    assert_eq!(back, pattern);
}
