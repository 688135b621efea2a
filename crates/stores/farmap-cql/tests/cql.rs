//! The CQL store against a real Apache Cassandra 5.0 node, started once for this test binary
//! by `scripts/services/cassandra.sh` (a node takes 7–13 s and 1 GB; the CLI's
//! `tests/cql_cli.rs` is the only other binary that starts one). Each test uses regions of its
//! own in the keyspace `farmap_test`, so they run side by side on the one node.
//!
//! - the conformance suite (chunks up to 1 MiB: a CQL row holds at most that) and two model
//!   tests against a plain vector (chunk operations with trims across partitions; unaligned
//!   byte ranges through `Unaligned`);
//! - trims, geometry kept in the region row, read-only opening;
//! - errors: an unreachable node, a missing keyspace/table/region without `create=true`, a
//!   blob of the wrong length planted with a raw CQL insert, refused credentials (a second
//!   node with a password).

use std::sync::Arc;

use farmap_core::{ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, Store, StoreError};
use farmap_cql::{CqlSpec, CqlStore, PASSWORD_ENV};
use farmap_pipeline::Unaligned;
use farmap_testkit::conformance::chunk_content;
use farmap_testkit::strategies::{byte_ops, ByteOp};
use farmap_testkit::wait::runtime;
use farmap_testkit::{run_conformance_with, skip, unique_name, ModelStore, Service};
use proptest::prelude::*;

const KEYSPACE: &str = "farmap_test";

/// The shared node, or `None` after recording why the test cannot run.
fn cassandra(test: &str) -> Option<&'static Service> {
    skip::unless(test, Service::shared("cassandra"))
}

/// A region name no other test (or earlier run against the same node) uses.
fn fresh_region(tag: &str) -> String {
    unique_name(tag)
}

/// `cql://127.0.0.1:PORT/farmap_test?table=chunks&region=REGION&create=true` + `extra`.
fn spec_text(svc: &Service, region: &str, extra: &str) -> String {
    format!(
        "{}/{KEYSPACE}?table=chunks&region={region}&create=true{extra}",
        svc.var("SPEC_BASE")
    )
}

async fn open(spec: &str) -> Result<CqlStore, StoreError> {
    let spec: CqlSpec = spec.parse().unwrap_or_else(|e| panic!("{spec}: {e}"));
    CqlStore::open(&spec).await
}

/// A fresh region of geometry `g`.
async fn fresh(svc: &Service, tag: &str, g: Geometry) -> CqlStore {
    let spec = spec_text(
        svc,
        &fresh_region(tag),
        &format!("&size={}&chunk={}", g.size(), g.chunk_size()),
    );
    let store = open(&spec)
        .await
        .unwrap_or_else(|e| panic!("{spec}: {}", farmap_core::error_chain(&e)));
    assert_eq!(store.geometry(), g);
    store
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cql_store_conforms() {
    let Some(svc) = cassandra("cql_store_conforms") else {
        return;
    };
    let geometries = farmap_testkit::conformance::geometries()
        .into_iter()
        .filter(|g| g.chunk_size() <= farmap_cql::MAX_CQL_CHUNK);
    run_conformance_with(geometries, |g| async move {
        Arc::new(fresh(svc, "conf", g).await) as Arc<dyn Store>
    })
    .await;
}

/// One chunk-level operation of the model test.
#[derive(Debug, Clone)]
enum ChunkOp {
    Write(u64, u8),
    Read(u64),
    Status(u64),
    Trim(u64, u64),
}

/// 600 chunks of 64 KiB (the last one short): 256 chunks per partition, so three
/// partitions, and trims that cover some whole and some in part.
fn model_geometry() -> Geometry {
    Geometry::new(600 * 65536 - 1000, 65536).expect("geometry")
}

fn chunk_ops() -> impl Strategy<Value = Vec<ChunkOp>> {
    let n = model_geometry().chunk_count();
    let op = prop_oneof![
        4 => (0..n, any::<u8>()).prop_map(|(i, s)| ChunkOp::Write(i, s)),
        3 => (0..n).prop_map(ChunkOp::Read),
        1 => (0..n).prop_map(ChunkOp::Status),
        1 => (0..n).prop_flat_map(move |a| (Just(a), a..=n)).prop_map(|(a, b)| ChunkOp::Trim(a, b)),
    ];
    proptest::collection::vec(op, 1..40)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Chunk writes, reads, status and trims (across partition boundaries) leave the CQL store
    /// and the model with the same content, chunk by chunk.
    #[test]
    fn cql_store_matches_the_model(ops in chunk_ops()) {
        let Some(svc) = cassandra("cql_store_matches_the_model") else {
            return Ok(());
        };
        runtime().block_on(async {
            let g = model_geometry();
            let store = fresh(svc, "model", g).await;
            prop_assert_eq!(store.part_chunks(), 256);
            let model = ModelStore::new(g);
            for op in ops {
                match op {
                    ChunkOp::Write(i, seed) => {
                        let data = chunk_content(g, ChunkIdx(i), u32::from(seed));
                        store.write(ChunkIdx(i), data.clone()).await.expect("write");
                        model.write(ChunkIdx(i), data).await.expect("model write");
                    }
                    ChunkOp::Read(i) => {
                        let got = store.read(ChunkIdx(i)).await.expect("read");
                        let want = model.read(ChunkIdx(i)).await.expect("model read");
                        prop_assert!(got == want, "chunk {} differs", i);
                    }
                    ChunkOp::Status(i) => {
                        let got = store.status(ChunkIdx(i)).await.expect("status");
                        let want = model.status(ChunkIdx(i)).await.expect("model status");
                        prop_assert_eq!(got, want, "status of chunk {}", i);
                    }
                    ChunkOp::Trim(a, b) => {
                        let r = ChunkRange::new(ChunkIdx(a), ChunkIdx(b));
                        store.trim(r).await.expect("trim");
                        model.trim(r).await.expect("model trim");
                    }
                }
            }
            let store = &store;
            let reads = futures::future::join_all(g.all().iter().map(|idx| async move {
                (idx, store.read(idx).await.expect("final read"))
            }))
            .await;
            for (idx, got) in reads {
                prop_assert!(got == model.read(idx).await.expect("model"), "final {} differs", idx);
            }
            Ok(())
        })?;
    }

    /// Unaligned byte ranges (reads and writes that straddle chunks, a short last chunk)
    /// through `Unaligned<CqlStore>` match a plain vector.
    #[test]
    fn unaligned_cql_store_matches_a_vector(ops in byte_ops(6 * 4096 + 1234, 4096, 30)) {
        let Some(svc) = cassandra("unaligned_cql_store_matches_a_vector") else {
            return Ok(());
        };
        runtime().block_on(async {
            let g = Geometry::new(6 * 4096 + 1234, 4096).expect("geometry");
            let u = Unaligned::new(fresh(svc, "bytes", g).await);
            let mut model = vec![0u8; g.size() as usize];
            for op in ops {
                match op {
                    ByteOp::Read { offset, len } => {
                        let got = u.read_bytes(offset, len).await.expect("read");
                        let want = &model[offset as usize..offset as usize + len];
                        prop_assert_eq!(&got[..], want, "read({}, {})", offset, len);
                    }
                    ByteOp::Write { offset, data } => {
                        model[offset as usize..offset as usize + data.len()].copy_from_slice(&data);
                        u.write_at(offset, &data).await.expect("write");
                    }
                    ByteOp::Flush => u.flush().await.expect("flush"),
                }
            }
            let all = u.read_bytes(0, g.size() as usize).await.expect("read all");
            prop_assert!(all[..] == model[..], "final content differs");
            Ok(())
        })?;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trims_delete_whole_and_partial_partitions() {
    let Some(svc) = cassandra("trims_delete_whole_and_partial_partitions") else {
        return;
    };
    let g = model_geometry();
    let store = fresh(svc, "trim", g).await;
    let written: Vec<ChunkIdx> = g
        .all()
        .iter()
        .filter(|i| i.0 % 5 == 0 || i.0 == 599)
        .collect();
    for &idx in &written {
        store
            .write(idx, chunk_content(g, idx, 7))
            .await
            .expect("write");
    }
    // 100..530 covers partition 1 (256..512) whole and partitions 0 and 2 in part.
    let range = ChunkRange::new(ChunkIdx(100), ChunkIdx(530));
    store.trim(range).await.expect("trim");
    // The last partition, from its middle to the region's end (its last chunk is short).
    store
        .trim(ChunkRange::new(ChunkIdx(590), ChunkIdx(600)))
        .await
        .expect("trim of the tail");
    for idx in g.all().iter() {
        let kept = written.contains(&idx) && !range.contains(idx) && idx.0 < 590;
        let data = store.read(idx).await.expect("read");
        let status = store.status(idx).await.expect("status");
        if kept {
            assert!(
                data == chunk_content(g, idx, 7),
                "{idx} outside the trims is kept"
            );
            assert_eq!(status, ChunkStatus::Data, "{idx}");
        } else {
            assert!(farmap_core::is_zero(&data), "{idx} reads as zeros");
            assert_eq!(status, ChunkStatus::Zero, "{idx}");
        }
    }
    // Written again after a partition delete, a chunk is back (timestamps order them).
    store
        .write(ChunkIdx(300), chunk_content(g, ChunkIdx(300), 9))
        .await
        .expect("write after trim");
    assert!(store.read(ChunkIdx(300)).await.expect("read") == chunk_content(g, ChunkIdx(300), 9));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_region_row_keeps_the_geometry() {
    let Some(svc) = cassandra("the_region_row_keeps_the_geometry") else {
        return;
    };
    let region = fresh_region("geom");
    let base = format!(
        "{}/{KEYSPACE}?table=chunks&region={region}",
        svc.var("SPEC_BASE")
    );
    let g = Geometry::new(3 << 20, 128 << 10).expect("geometry");
    let store = open(&format!("{base}&create=true&size=3MiB&chunk=128KiB"))
        .await
        .expect("create");
    assert_eq!(store.geometry(), g);
    store
        .write(ChunkIdx(5), chunk_content(g, ChunkIdx(5), 1))
        .await
        .expect("write");
    drop(store);
    // Reopened without size, chunk or create: the row says what the region is.
    let again = open(&base).await.expect("reopen");
    assert_eq!(again.geometry(), g);
    assert!(again.read(ChunkIdx(5)).await.expect("read") == chunk_content(g, ChunkIdx(5), 1));
    // A spec that disagrees with the row is refused, naming both.
    for (extra, want) in [
        ("&size=4MiB", "has size 3MiB, not the 4MiB"),
        ("&chunk=64KiB", "has chunk size 128KiB, not the 64KiB"),
    ] {
        let e = open(&format!("{base}{extra}")).await.expect_err(extra);
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{extra}: {e}");
        assert!(e.to_string().contains(want), "{extra}: {e}");
    }
    // The test server syncs its commit log periodically (the default): a flush cannot make
    // writes durable, and the store does not claim it can.
    assert!(
        !again.caps().contains(farmap_core::Caps::FLUSH),
        "commitlog_sync: periodic, yet FLUSH is claimed"
    );
    assert!(again.caps().contains(farmap_core::Caps::WRITE));
    // Read-only: reads work, writes and trims are refused.
    let ro = open(&format!("{base}&ro")).await.expect("open ro");
    assert!(!ro.caps().contains(farmap_core::Caps::WRITE));
    assert!(ro.read(ChunkIdx(5)).await.is_ok());
    let e = ro
        .write(ChunkIdx(1), chunk_content(g, ChunkIdx(1), 2))
        .await
        .expect_err("write to ro");
    assert_eq!(e.kind(), ErrorKind::ReadOnly);
    let e = ro.trim(g.all()).await.expect_err("trim of ro");
    assert_eq!(e.kind(), ErrorKind::ReadOnly);
    assert!(again.read(ChunkIdx(5)).await.expect("read") == chunk_content(g, ChunkIdx(5), 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_name_the_problem() {
    // An unreachable node (a port bound, then released): no server needed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let e = open(&format!("cql://127.0.0.1:{port}/ks?size=1MiB"))
        .await
        .expect_err("unreachable");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(
        e.to_string()
            .contains(&format!("cannot connect to 127.0.0.1:{port}")),
        "{e}"
    );

    let Some(svc) = cassandra("errors_name_the_problem") else {
        return;
    };
    let base = svc.var("SPEC_BASE");
    // A missing keyspace, table or region without create=true.
    let missing_ks = format!("nosuch_{}", std::process::id());
    let e = open(&format!("{base}/{missing_ks}?size=1MiB"))
        .await
        .expect_err("missing keyspace");
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains(&format!("keyspace {missing_ks} does not exist"))
            && msg.contains("create=true"),
        "{msg}"
    );
    // Make sure the keyspace exists (another test may not have made it yet).
    let made = fresh(svc, "errs", Geometry::new(1 << 20, 65536).unwrap()).await;
    drop(made);
    let e = open(&format!("{base}/{KEYSPACE}?table=nosuch_table"))
        .await
        .expect_err("missing table");
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    assert!(
        e.to_string()
            .contains(&format!("table {KEYSPACE}.nosuch_table does not exist")),
        "{e}"
    );
    let e = open(&format!(
        "{base}/{KEYSPACE}?table=chunks&region=nosuch-region"
    ))
    .await
    .expect_err("missing region");
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    assert!(
        e.to_string().contains("region nosuch-region is not in"),
        "{e}"
    );
    // create=true without a size cannot make a region.
    let e = open(&spec_text(svc, &fresh_region("nosize"), ""))
        .await
        .expect_err("no size");
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert!(e.to_string().contains("size="), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blob_of_the_wrong_length_is_corrupt_and_never_served() {
    let Some(svc) = cassandra("a_blob_of_the_wrong_length_is_corrupt_and_never_served") else {
        return;
    };
    let g = Geometry::new(4 * 65536 + 100, 65536).expect("geometry");
    let region = fresh_region("corrupt");
    let spec = spec_text(svc, &region, &format!("&size={}", g.size()));
    let store = open(&spec).await.expect("open");
    for i in 0..5 {
        store
            .write(ChunkIdx(i), chunk_content(g, ChunkIdx(i), 3))
            .await
            .expect("write");
    }
    // Plant rows behind the store's back: a short blob, a long one for the short last chunk,
    // an empty one, and a row with no blob at all.
    let session = scylla::client::session_builder::SessionBuilder::new()
        .known_node(format!("127.0.0.1:{}", svc.var("PORT")))
        .build()
        .await
        .expect("raw session");
    let insert =
        format!("INSERT INTO {KEYSPACE}.chunks (region, part, chunk, data) VALUES (?, 0, ?, ?)");
    for (chunk, len) in [(1i64, 65535usize), (4, 65536), (2, 0)] {
        session
            .query_unpaged(insert.as_str(), (region.as_str(), chunk, vec![7u8; len]))
            .await
            .expect("plant");
    }
    session
        .query_unpaged(
            format!(
                "INSERT INTO {KEYSPACE}.chunks (region, part, chunk, data) VALUES (?, 0, 3, null)"
            ),
            (region.as_str(),),
        )
        .await
        .expect("plant a row without a blob");
    for (i, want) in [
        (1, "holds 65535 bytes, not the chunk's 65536"),
        (4, "holds 65536 bytes, not the chunk's 100"),
        (2, "holds 0 bytes"),
        (3, "holds no blob"),
    ] {
        let e = match store.read(ChunkIdx(i)).await {
            Ok(data) => panic!("chunk {i}: {} bytes served from a corrupt row", data.len()),
            Err(e) => e,
        };
        assert_eq!(e.kind(), ErrorKind::Corrupt, "chunk {i}: {e}");
        let msg = e.to_string();
        assert!(
            msg.contains(want) && msg.contains(&format!("chunk {i} (region {region}")),
            "chunk {i}: {msg}"
        );
    }
    // The good row is still served.
    assert!(store.read(ChunkIdx(0)).await.expect("read") == chunk_content(g, ChunkIdx(0), 3));
    // Rewriting a corrupt chunk heals it.
    store
        .write(ChunkIdx(1), chunk_content(g, ChunkIdx(1), 4))
        .await
        .expect("rewrite");
    assert!(store.read(ChunkIdx(1)).await.expect("read") == chunk_content(g, ChunkIdx(1), 4));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_credentials_are_a_permission_error() {
    // A second node that requires a password (PasswordAuthenticator, cassandra/cassandra).
    let svc = match Service::start("cassandra", &["auth"]) {
        Ok(s) => s,
        Err(e) => return skip("refused_credentials_are_a_permission_error", e),
    };
    let port = svc.var("PORT");
    let e = open(&format!(
        "cql://cassandra:wrong@127.0.0.1:{port}/ks?size=1MiB"
    ))
    .await
    .expect_err("wrong password");
    assert_eq!(
        e.kind(),
        ErrorKind::PermissionDenied,
        "{}",
        farmap_core::error_chain(&e)
    );
    assert!(e.to_string().contains("refused the credentials"), "{e}");
    let e = open(&format!("cql://127.0.0.1:{port}/ks?size=1MiB"))
        .await
        .expect_err("no credentials");
    assert_eq!(
        e.kind(),
        ErrorKind::PermissionDenied,
        "{}",
        farmap_core::error_chain(&e)
    );
    if std::env::var_os(PASSWORD_ENV).is_none() {
        let e = open(&format!("cql://cassandra@127.0.0.1:{port}/ks?size=1MiB"))
            .await
            .expect_err("user without a password");
        assert_eq!(e.kind(), ErrorKind::PermissionDenied);
        assert!(e.to_string().contains(PASSWORD_ENV), "{e}");
    }
    // The right password works, and the message of a failure never shows it.
    let spec = format!(
        "{}/{KEYSPACE}?region=auth&size=1MiB&create=true",
        svc.var("SPEC_BASE")
    );
    let store = open(&spec).await.expect("right password");
    let g = store.geometry();
    store
        .write(ChunkIdx(2), chunk_content(g, ChunkIdx(2), 5))
        .await
        .expect("write");
    assert!(store.read(ChunkIdx(2)).await.expect("read") == chunk_content(g, ChunkIdx(2), 5));
    // That a failure's message never shows the password, opened through the `farmap`
    // library's specs, is checked by the CLI's tests/cql_cli.rs.
}
