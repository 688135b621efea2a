//! The Redis store against a real 3-node Redis Cluster (scripts/services/redis-cluster.sh):
//! conformance, chunks spread over every node, a lost node reported, not waited on, and
//! the objects of the versioned layout (each folder in its own slot, its index with it).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::objects::fresh_objects;
use common::{config, fresh_store, raw, service};
use farmap_core::{ChunkIdx, ErrorKind, Geometry, Objects, Store};
use farmap_redis::RedisStore;
use farmap_testkit::versioned::{check_nested_folders, check_versioned};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_conforms() {
    let Some(svc) = service("redis-cluster", "cluster_conforms") else {
        return;
    };
    let base = svc.var("SPEC_BASE").to_owned();
    farmap_testkit::run_conformance(|g| common::fresh_dyn(&base, g, &[])).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_spread_over_every_node_and_one_seed_finds_them_all() {
    let Some(svc) = service("redis-cluster", "chunks_spread_over_every_node") else {
        return;
    };
    let g = Geometry::new(64 * 4096, 4096).unwrap();
    let s = fresh_store(svc.var("SPEC_BASE"), g, &[]).await;
    for i in g.all().iter() {
        s.write(i, Bytes::from(vec![i.0 as u8 | 1; 4096]))
            .await
            .unwrap();
    }
    // Each node holds some of the chunks (no hash tag pins them to one slot).
    let nodes: Vec<String> = svc.var("NODES").split(',').map(str::to_owned).collect();
    for n in &nodes {
        let mut c = raw(n).await;
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}*", s.key(ChunkIdx(0)).trim_end_matches(":0")))
            .query_async(&mut c)
            .await
            .unwrap();
        assert!(
            keys.len() > 1 && keys.len() < 64,
            "node {n} holds {} of 64",
            keys.len()
        );
    }
    // A client given one seed node only learns the others and reads every chunk (requests
    // that reach the wrong node are redirected by MOVED).
    let prefix = s.key(ChunkIdx(0));
    let prefix = prefix.trim_end_matches(":0");
    let one = config(
        &format!("redis+cluster://{}/", nodes[1]),
        &[("prefix", prefix)],
    );
    let t = RedisStore::open(&one, None, None).await.unwrap();
    assert_eq!(t.geometry(), g);
    for i in g.all().iter() {
        assert_eq!(
            t.read(i).await.unwrap()[..],
            vec![i.0 as u8 | 1; 4096][..],
            "{i}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_node_is_an_error_naming_the_unavailability_not_a_hang() {
    // Its own cluster: one node is killed.
    let svc = match farmap_testkit::Service::start("redis-cluster", &[]) {
        Ok(s) => s,
        Err(e) => return farmap_testkit::skip("a_lost_node_is_an_error", e),
    };
    let g = Geometry::new(48 * 4096, 4096).unwrap();
    let s = Arc::new(fresh_store(svc.var("SPEC_BASE"), g, &[("timeout", "2s")]).await);
    for i in g.all().iter() {
        s.write(i, Bytes::from(vec![i.0 as u8 | 1; 4096]))
            .await
            .unwrap();
    }
    let pid = svc.var("PID3");
    let killed = std::process::Command::new("kill")
        .args(["-KILL", pid])
        .status()
        .unwrap();
    assert!(killed.success());
    let started = Instant::now();
    let reads = g.all().iter().map(|i| {
        let s = s.clone();
        async move { (i, s.read(i).await) }
    });
    let results = tokio::time::timeout(Duration::from_secs(60), futures::future::join_all(reads))
        .await
        .expect("reads must end (with data or an error), not hang");
    let (mut ok, mut failed) = (0, 0);
    for (i, r) in results {
        match r {
            Ok(data) => {
                assert_eq!(data[..], vec![i.0 as u8 | 1; 4096][..], "{i}");
                ok += 1;
            }
            Err(e) => {
                assert!(
                    matches!(e.kind(), ErrorKind::Unavailable | ErrorKind::Timeout),
                    "{i}: {}",
                    farmap_core::error_chain(&e)
                );
                let msg = farmap_core::error_chain(&e);
                assert!(msg.contains(&s.key(i)), "the key is named: {msg}");
                assert!(
                    msg.contains("unavailable") || msg.contains("no answer"),
                    "{msg}"
                );
                failed += 1;
            }
        }
    }
    assert!(failed > 0, "the chunks on the killed node cannot be read");
    assert!(ok > 0, "the chunks on the other nodes still are");
    eprintln!("{ok} read, {failed} failed, in {:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_objects_keep_the_contract_and_list_folders_across_slots() {
    let Some(svc) = service(
        "redis-cluster",
        "cluster_objects_keep_the_contract_and_list_folders_across_slots",
    ) else {
        return;
    };
    let base = svc.var("SPEC_BASE");
    farmap_testkit::check_objects_contract(Arc::new(fresh_objects(base, "objects", &[]).await))
        .await;
    let o = fresh_objects(base, "nested", &[]).await;
    check_nested_folders(&o).await;
    // The folders' indexes are spread over the nodes, each beside its objects.
    let mut c = raw(svc.var("NODES").split(',').next().unwrap()).await;
    let mut slots = std::collections::BTreeSet::new();
    for folder in ["chunks/ab", "chunks/cd", "regions/r/versions", "big"] {
        let slot = |key: String| {
            let mut cmd = redis::cmd("CLUSTER");
            cmd.arg("KEYSLOT").arg(key);
            cmd
        };
        let of_index: u16 = slot(o.index_key(folder)).query_async(&mut c).await.unwrap();
        let of_object: u16 = slot(o.object_key(&format!("{folder}/x")))
            .query_async(&mut c)
            .await
            .unwrap();
        assert_eq!(of_index, of_object, "{folder}");
        slots.insert(of_index);
    }
    assert_eq!(slots.len(), 4, "one slot per folder: {slots:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versioned_regions_over_a_cluster_keep_versions_and_one_writer() {
    let Some(svc) = service(
        "redis-cluster",
        "versioned_regions_over_a_cluster_keep_versions_and_one_writer",
    ) else {
        return;
    };
    let o: Arc<dyn Objects> = Arc::new(fresh_objects(svc.var("SPEC_BASE"), "versioned", &[]).await);
    check_versioned(o).await;
}
