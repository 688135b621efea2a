//! [`RedisObjects`] against a real redis-server (scripts/services/redis.sh): the objects
//! contract, one winner among creators in separate connections, folders of folders, values
//! too large refused before they are sent, and a versioned region over Redis (versions
//! reopened with their bytes, a second writer fenced).

mod common;

use std::sync::Arc;

use bytes::Bytes;
use common::objects::fresh_objects;
use common::{config, fresh_prefix, raw, service};
use farmap_core::{ErrorKind, Objects};
use farmap_redis::{RedisObjects, MAX_OBJECT_LEN};
use farmap_testkit::versioned::{check_nested_folders, check_versioned};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_objects_keep_the_contract() {
    let Some(svc) = service("redis", "redis_objects_keep_the_contract") else {
        return;
    };
    let o = fresh_objects(svc.var("SPEC_BASE"), "objects", &[]).await;
    assert!(o.location().starts_with("redis://127.0.0.1:"), "{o:?}");
    farmap_testkit::check_objects_contract(Arc::new(o)).await;
}

/// Eight creators of one key, each with its own connections (as eight processes would be):
/// exactly one wins, and its bytes are what every one of them reads back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_creators_in_separate_connections_have_one_winner() {
    let Some(svc) = service(
        "redis",
        "racing_creators_in_separate_connections_have_one_winner",
    ) else {
        return;
    };
    let base = svc.var("SPEC_BASE");
    let prefix = fresh_prefix("race");
    let cfg = config(base, &[("prefix", &prefix), ("connections", "1")]);
    let mut racers = Vec::new();
    for _ in 0..8 {
        racers.push(Arc::new(RedisObjects::open(&cfg).await.unwrap()));
    }
    let barrier = Arc::new(tokio::sync::Barrier::new(racers.len()));
    let tasks: Vec<_> = racers
        .iter()
        .enumerate()
        .map(|(i, o)| {
            let (o, barrier) = (o.clone(), barrier.clone());
            tokio::spawn(async move {
                let data = Bytes::from(vec![i as u8 + 1; 65536]);
                barrier.wait().await;
                (i, o.create("regions/r/versions/1", data).await.unwrap())
            })
        })
        .collect();
    let mut winners = Vec::new();
    for t in tasks {
        let (i, won) = t.await.unwrap();
        if won {
            winners.push(i);
        }
    }
    assert_eq!(winners.len(), 1, "exactly one creator wins: {winners:?}");
    let want = vec![winners[0] as u8 + 1; 65536];
    for o in &racers {
        let got = o.get("regions/r/versions/1").await.unwrap().unwrap();
        assert!(got == want, "every reader sees the winner's bytes");
        assert_eq!(o.list("regions/r/versions").await.unwrap(), ["1"]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn folders_of_folders_list_their_subfolders() {
    let Some(svc) = service("redis", "folders_of_folders_list_their_subfolders") else {
        return;
    };
    let o = fresh_objects(svc.var("SPEC_BASE"), "nested", &[]).await;
    check_nested_folders(&o).await;
}

/// A value longer than [`MAX_OBJECT_LEN`] (written behind farmap's back) is refused as
/// corrupt by the server-side read, without being sent; so is creating one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_longer_than_an_object_are_refused_unread() {
    let Some(svc) = service("redis", "values_longer_than_an_object_are_refused_unread") else {
        return;
    };
    let o = fresh_objects(svc.var("SPEC_BASE"), "huge", &[]).await;
    let key = o.object_key("a/huge");
    let mut c = raw(svc.var("SPEC_BASE").trim_start_matches("redis://")).await;
    let _: u64 = redis::cmd("SETRANGE")
        .arg(&key)
        .arg(MAX_OBJECT_LEN)
        .arg("x")
        .query_async(&mut c)
        .await
        .unwrap();
    let e = o.get("a/huge").await.unwrap_err();
    let _: u64 = redis::cmd("DEL")
        .arg(&key)
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    let msg = farmap_core::error_chain(&e);
    assert!(msg.contains(&key) && msg.contains("more than"), "{msg}");
    let e = o
        .create("a/huge", Bytes::from(vec![0u8; MAX_OBJECT_LEN + 1]))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    // A key of another type is corrupt too, named.
    let _: u64 = redis::cmd("LPUSH")
        .arg(o.object_key("a/list"))
        .arg("x")
        .query_async(&mut c)
        .await
        .unwrap();
    let e = o.get("a/list").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
}

/// A versioned region over Redis: versions reopen with their bytes, a snapshot names one,
/// and a second writer is fenced at its flush.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versioned_regions_over_redis_keep_versions_and_one_writer() {
    let Some(svc) = service(
        "redis",
        "versioned_regions_over_redis_keep_versions_and_one_writer",
    ) else {
        return;
    };
    let o: Arc<dyn Objects> = Arc::new(fresh_objects(svc.var("SPEC_BASE"), "versioned", &[]).await);
    check_versioned(o).await;
}
