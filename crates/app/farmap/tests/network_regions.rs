//! `open_region` over network stores: a userfaultfd region whose chunks live in a real Redis.

use farmap::spec::open_store_async;
use farmap::{open_region, RegionOptions, StoreSpec};
use farmap_testkit::{skip, Service};

#[test]
fn a_region_over_redis_writes_reach_redis_and_read_back() {
    let test = "a_region_over_redis_writes_reach_redis_and_read_back";
    if skip::unless(test, farmap_uffd::probe()).is_none() {
        return;
    }
    let Some(svc) = skip::unless(test, Service::shared("redis")) else {
        return;
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

#[test]
fn a_region_over_an_nbd_export_writes_reach_the_server_and_read_back() {
    let test = "a_region_over_an_nbd_export_writes_reach_the_server_and_read_back";
    if skip::unless(test, farmap_uffd::probe()).is_none() {
        return;
    }
    // farmap's own NBD server over a memory store, on a runtime of its own.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nbd.sock");
    let backing: std::sync::Arc<dyn farmap::Store> = std::sync::Arc::new(
        farmap_store::MemoryStore::new(farmap::Geometry::new(4 << 20, 65536).unwrap()),
    );
    let server = rt.block_on(async {
        let addr: farmap_net::ListenAddr = format!("unix:{}", sock.display()).parse().unwrap();
        let listener = farmap_net::Listener::bind(&addr).await.unwrap();
        let export = farmap_nbd::Export {
            name: "vm".into(),
            description: String::new(),
            store: backing.clone(),
            read_only: false,
        };
        let opts = farmap_nbd::NbdServeOptions {
            log: false,
            ..Default::default()
        };
        farmap_nbd::serve_nbd(vec![export], listener, opts).unwrap()
    });
    let spec: StoreSpec = format!("nbd+unix:///vm?socket={}", sock.display())
        .parse()
        .unwrap();
    let pattern: Vec<u8> = (0..1 << 20).map(|i| (i % 239) as u8 | 1).collect();
    {
        let region = open_region(&spec, RegionOptions::default()).expect("a region over NBD");
        assert_eq!(region.len(), 4 << 20, "the export's size");
        region.memory().write_from(1 << 20, &pattern).unwrap();
        region.sync().expect("sync writes to the NBD server");
        region.close().expect("close");
    }
    let (written, untouched) = rt.block_on(async {
        let u = farmap::pipeline::Unaligned::new(backing.clone());
        (
            u.read_bytes(1 << 20, 1 << 20).await.unwrap(),
            u.read_bytes(0, 1 << 20).await.unwrap(),
        )
    });
    assert_eq!(
        &written[..],
        &pattern[..],
        "the server's store holds the writes"
    );
    assert!(untouched.iter().all(|b| *b == 0));
    let region = open_region(&spec, RegionOptions::default()).unwrap();
    let mut back = vec![0u8; 1 << 20];
    region.memory().read_into(1 << 20, &mut back).unwrap();
    assert_eq!(back, pattern);
    drop(region);
    drop(server);
}
