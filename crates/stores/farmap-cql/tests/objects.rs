//! [`CqlObjects`] against the real Apache Cassandra 5.0 node of `scripts/services/cassandra.sh`
//! (started once for this binary): the objects contract, one winner among creators in
//! separate sessions, folders of folders, sizes refused before they are sent, rows planted
//! behind farmap's back, and a versioned region over CQL (versions reopened with their bytes,
//! a second writer fenced, a garbage collection). Each test has a table of its own in the
//! keyspace `farmap_test`.

use std::sync::Arc;

use bytes::Bytes;
use farmap_core::{ErrorKind, Objects};
use farmap_cql::{CqlObjects, CqlSpec, CqlTarget, MAX_OBJECT_LEN};
use farmap_testkit::versioned::{check_nested_folders, check_versioned};
use farmap_testkit::{skip, unique_name, Service};

const KEYSPACE: &str = "farmap_test";

/// The shared node, or `None` after recording why the test cannot run.
fn cassandra(test: &str) -> Option<&'static Service> {
    skip::unless(test, Service::shared("cassandra"))
}

/// The target of a table no other test (nor an earlier run) uses, created, with `extra`
/// options.
fn fresh_target(svc: &Service, tag: &str, extra: &str) -> CqlTarget {
    let table = unique_name(tag).replace('-', "_");
    let text = format!(
        "{}/{KEYSPACE}?table={table}&create=true{extra}",
        svc.var("SPEC_BASE")
    );
    let spec: CqlSpec = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
    spec.target
}

async fn open(target: &CqlTarget) -> CqlObjects {
    CqlObjects::open(target)
        .await
        .unwrap_or_else(|e| panic!("{target:?}: {}", farmap_core::error_chain(&e)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cql_objects_keep_the_contract() {
    let Some(svc) = cassandra("cql_objects_keep_the_contract") else {
        return;
    };
    let o = open(&fresh_target(svc, "oc", "")).await;
    assert!(o.location().starts_with("cql://127.0.0.1:"), "{o:?}");
    assert!(o.table().starts_with("farmap_test.oc_"), "{o:?}");
    farmap_testkit::check_objects_contract(Arc::new(o)).await;
}

/// Eight creators of one key, each with its own session (as eight processes would be):
/// exactly one wins, and its bytes are what every one of them reads back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_creators_in_separate_sessions_have_one_winner() {
    let Some(svc) = cassandra("racing_creators_in_separate_sessions_have_one_winner") else {
        return;
    };
    let target = fresh_target(svc, "race", "&connections=1");
    let mut racers = Vec::new();
    for _ in 0..8 {
        racers.push(Arc::new(open(&target).await));
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
                (i, o.create("regions/r/versions/1", data).await)
            })
        })
        .collect();
    let mut winners = Vec::new();
    for t in tasks {
        let (i, won) = t.await.unwrap();
        if won.unwrap_or_else(|e| panic!("creator {i}: {}", farmap_core::error_chain(&e))) {
            winners.push(i);
        }
    }
    assert_eq!(winners.len(), 1, "exactly one creator wins: {winners:?}");
    let want = vec![winners[0] as u8 + 1; 65536];
    for o in &racers {
        let got = o.get("regions/r/versions/1").await.unwrap().unwrap();
        assert!(got == want, "every reader sees the winner's bytes");
        assert_eq!(o.list("regions/r/versions").await.unwrap(), ["1"]);
        assert_eq!(o.list("regions/r").await.unwrap(), ["versions"]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn folders_of_folders_list_their_subfolders() {
    let Some(svc) = cassandra("folders_of_folders_list_their_subfolders") else {
        return;
    };
    let o = open(&fresh_target(svc, "nest", "")).await;
    check_nested_folders(&o).await;
    // A folder that becomes an object keeps being a folder; the object reads as one.
    assert!(o.create("p/q/r", Bytes::from_static(b"1")).await.unwrap());
    assert_eq!(
        o.get("p/q").await.unwrap(),
        None,
        "a folder is not an object"
    );
    assert!(!o.exists("p/q").await.unwrap());
    assert!(o.create("p/q", Bytes::from_static(b"2")).await.unwrap());
    assert_eq!(o.get("p/q").await.unwrap().unwrap(), &b"2"[..]);
    assert!(o.exists("p/q").await.unwrap());
    assert_eq!(o.list("p").await.unwrap(), ["q"]);
    // Deleted and created again (as the collector restores a chunk): the new bytes.
    o.delete("p/q").await.unwrap();
    assert!(o.create("p/q", Bytes::from_static(b"3")).await.unwrap());
    assert_eq!(o.get("p/q").await.unwrap().unwrap(), &b"3"[..]);
    // A key with no folder.
    assert!(o.create("top", Bytes::from_static(b"4")).await.unwrap());
    assert_eq!(o.get("top").await.unwrap().unwrap(), &b"4"[..]);
}

/// The largest object goes in and comes back; one byte more is refused before it is sent;
/// a row planted with a length that does not match its bytes is refused as corrupt; a
/// consistency below a quorum is refused at opening.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sizes_are_capped_and_bad_rows_refused() {
    let Some(svc) = cassandra("sizes_are_capped_and_bad_rows_refused") else {
        return;
    };
    let target = fresh_target(svc, "size", "");
    let o = open(&target).await;
    let big = Bytes::from(
        (0..MAX_OBJECT_LEN)
            .map(|i| (i * 7 % 251) as u8)
            .collect::<Vec<_>>(),
    );
    assert!(o
        .create("big/one", big.clone())
        .await
        .unwrap_or_else(|e| panic!("{}", farmap_core::error_chain(&e))));
    assert!(o.get("big/one").await.unwrap().unwrap() == big);
    let e = o
        .create("big/two", Bytes::from(vec![0u8; MAX_OBJECT_LEN + 1]))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert!(!o.exists("big/two").await.unwrap());

    // A row whose length does not match its bytes, planted with raw CQL.
    let session = scylla::client::session_builder::SessionBuilder::new()
        .known_node(target.nodes[0].as_str())
        .build()
        .await
        .expect("a raw session");
    session
        .query_unpaged(
            format!(
                "UPDATE {} SET data = ?, len = ? WHERE folder = 'bad' AND name = 'row'",
                o.table()
            ),
            (vec![1u8, 2, 3], 4i64),
        )
        .await
        .expect("plant a bad row");
    let e = o.get("bad/row").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    let msg = farmap_core::error_chain(&e);
    assert!(
        msg.contains("bad/row") && msg.contains("records 4"),
        "{msg}"
    );

    let mut weak = target.clone();
    weak.consistency = "one".parse().unwrap();
    let e = CqlObjects::open(&weak).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert!(e.to_string().contains("consistency=quorum"), "{e}");
}

/// A missing table without `create=true` names the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_table_says_to_create_it() {
    let Some(svc) = cassandra("a_missing_table_says_to_create_it") else {
        return;
    };
    // Make sure the keyspace exists (another test may not have made it yet).
    drop(open(&fresh_target(svc, "ks", "")).await);
    let mut target = fresh_target(svc, "gone", "");
    target.create = false;
    let e = CqlObjects::open(&target).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains(&format!("table {KEYSPACE}.{}_objects", target.table))
            && msg.contains("create=true"),
        "{msg}"
    );
}

/// A versioned region over CQL: versions reopen with their bytes, a snapshot names one, a
/// second writer is fenced at its flush, and the collector takes what it stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versioned_regions_over_cql_keep_versions_and_one_writer() {
    let Some(svc) = cassandra("versioned_regions_over_cql_keep_versions_and_one_writer") else {
        return;
    };
    let o: Arc<dyn Objects> = Arc::new(open(&fresh_target(svc, "ver", "")).await);
    check_versioned(o).await;
}
