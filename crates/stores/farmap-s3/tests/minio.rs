//! The S3 store against a real MinIO server (started by scripts/services/minio.sh): the
//! conformance suite, a model test, the region description, the errors, and the objects of
//! the versioned layout (a conditional PUT has one winner; a second writer is fenced).

mod common;

use std::sync::Arc;

use bytes::Bytes;
use common::{env_of, fresh_prefix, location, minio, open_with};
use farmap_core::{
    error_chain, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, Store, StoreError,
};
use farmap_s3::{S3Objects, S3Store};
use farmap_testkit::{ModelStore, Service};
use object_store::aws::AmazonS3Builder;
use object_store::path::Path;
use object_store::{ObjectStoreExt, PutPayload};
use proptest::prelude::*;

fn chain(e: &StoreError) -> String {
    error_chain(e)
}

/// A new, empty region of geometry `g` on a fresh prefix.
async fn fresh_store(svc: &Service, name: &str, g: Geometry) -> S3Store {
    let loc = location(svc, svc.var("ENDPOINT"), &fresh_prefix(name));
    open_with(loc, Some(g), false, &env_of(svc))
        .await
        .unwrap_or_else(|e| panic!("opening a fresh S3 region: {}", chain(&e)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_store_conforms() {
    let Some(svc) = minio("s3_store_conforms") else {
        return;
    };
    farmap_testkit::run_conformance(|g| async move {
        Arc::new(fresh_store(svc, "conformance", g).await) as Arc<dyn Store>
    })
    .await;
}

/// One operation of the model test, on chunks.
#[derive(Debug, Clone)]
enum Op {
    Write(u64, u8),
    Read(u64),
    Trim(u64, u64),
    Status(u64),
}

fn ops(chunks: u64) -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        4 => (0..chunks, any::<u8>()).prop_map(|(i, v)| Op::Write(i, v)),
        4 => (0..chunks).prop_map(Op::Read),
        1 => (0..chunks, 0..=chunks).prop_map(move |(s, n)| Op::Trim(s, n.min(chunks - s))),
        2 => (0..chunks).prop_map(Op::Status),
    ];
    proptest::collection::vec(op, 1..24)
}

/// Applies `ops` to an S3 region and to [`ModelStore`]: every read and status must agree, and
/// so must the whole region at the end.
async fn check_against_model(
    svc: &'static farmap_testkit::Service,
    g: Geometry,
    ops: Vec<Op>,
) -> Result<(), TestCaseError> {
    let s3 = fresh_store(svc, "model", g).await;
    let model = ModelStore::new(g);
    for op in ops {
        match op {
            Op::Write(i, v) => {
                let idx = ChunkIdx(i);
                let mut data = vec![v; g.chunk_len(idx)];
                data[0] = i as u8;
                let data = Bytes::from(data);
                s3.write(idx, data.clone()).await.expect("s3 write");
                model.write(idx, data).await.expect("model write");
            }
            Op::Read(i) => {
                let got = s3.read(ChunkIdx(i)).await.expect("s3 read");
                let want = model.read(ChunkIdx(i)).await.expect("model read");
                prop_assert!(got == want, "chunk {} differs", i);
            }
            Op::Trim(s, n) => {
                let r = ChunkRange::new(ChunkIdx(s), ChunkIdx(s + n));
                s3.trim(r).await.expect("s3 trim");
                model.trim(r).await.expect("model trim");
            }
            Op::Status(i) => {
                let got = s3.status(ChunkIdx(i)).await.expect("s3 status");
                let want = model.status(ChunkIdx(i)).await.expect("model status");
                prop_assert_eq!(got, want, "status of chunk {}", i);
            }
        }
    }
    for idx in g.all().iter() {
        let got = s3.read(idx).await.expect("s3 read");
        prop_assert!(
            got == model.read(idx).await.expect("model"),
            "final {}",
            idx
        );
    }
    Ok(())
}

#[test]
fn s3_store_matches_the_model() {
    let Some(svc) = minio("s3_store_matches_the_model") else {
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let g = Geometry::new(6 * 4096 + 1234, 4096).expect("geometry");
    let config = ProptestConfig {
        cases: 24,
        ..ProptestConfig::default()
    };
    proptest!(config, |(ops in ops(g.chunk_count()))| {
        rt.block_on(check_against_model(svc, g, ops))?;
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_region_description_is_kept_and_checked() {
    let Some(svc) = minio("the_region_description_is_kept_and_checked") else {
        return;
    };
    let env = env_of(svc);
    let endpoint = svc.var("ENDPOINT");
    let prefix = fresh_prefix("meta");
    let loc = || location(svc, endpoint, &prefix);
    // Nothing there yet: without a size (or read-only) nothing is created.
    let e = open_with(loc(), None, false, &env).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    assert!(e.to_string().contains("give size="), "{e}");
    let g = Geometry::new(10 * 65536 + 5, 65536).unwrap();
    let e = open_with(loc(), Some(g), true, &env).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    // Created with a size; data written survives reopening without one.
    let s = open_with(loc(), Some(g), false, &env).await.unwrap();
    assert_eq!(s.meta_key(), format!("{prefix}/farmap-meta"));
    assert_eq!(s.chunk_key(ChunkIdx(42)), format!("{prefix}/000000000042"));
    let data = Bytes::from(vec![7u8; g.chunk_len(ChunkIdx(10))]);
    s.write(ChunkIdx(10), data.clone()).await.unwrap();
    drop(s);
    let again = open_with(loc(), None, false, &env).await.unwrap();
    assert_eq!(again.geometry(), g);
    assert_eq!(again.read(ChunkIdx(10)).await.unwrap(), data);
    // Read-only: reads work, writes and trims are refused, nothing changes.
    let ro = open_with(loc(), None, true, &env).await.unwrap();
    assert_eq!(ro.read(ChunkIdx(10)).await.unwrap(), data);
    let e = ro
        .write(ChunkIdx(0), Bytes::from(vec![1u8; 65536]))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ReadOnly);
    let e = ro.trim(g.all()).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ReadOnly);
    assert_eq!(ro.read(ChunkIdx(10)).await.unwrap(), data);
    // A different size or chunk size is refused with both numbers.
    let other = Geometry::new(1 << 20, 65536).unwrap();
    let e = open_with(loc(), Some(other), false, &env)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    let msg = e.to_string();
    assert!(
        msg.contains("asks for size 1MiB") && msg.contains("farmap-meta"),
        "{msg}"
    );
    let other = Geometry::new(g.size(), 4096).unwrap();
    let e = open_with(loc(), Some(other), false, &env)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("asks for chunk 4KiB"), "{e}");
}

/// A client of the test bucket for planting objects behind the store's back.
fn raw_client(svc: &farmap_testkit::Service) -> object_store::aws::AmazonS3 {
    // object_store's own HTTP client needs a process-wide rustls provider (the store builds
    // its client with one of its own).
    let _ = rustls::crypto::ring::default_provider().install_default();
    AmazonS3Builder::new()
        .with_bucket_name(svc.var("BUCKET"))
        .with_endpoint(svc.var("ENDPOINT"))
        .with_allow_http(true)
        .with_region("us-east-1")
        .with_access_key_id(svc.var("ACCESS_KEY"))
        .with_secret_access_key(svc.var("SECRET_KEY"))
        .build()
        .expect("raw client")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objects_of_the_wrong_size_are_refused() {
    let Some(svc) = minio("objects_of_the_wrong_size_are_refused") else {
        return;
    };
    let g = Geometry::new(4 * 4096 + 100, 4096).unwrap();
    let s = fresh_store(svc, "corrupt", g).await;
    let raw = raw_client(svc);
    // Too short, too long, and the short last chunk's object at full chunk length.
    for (idx, len) in [(1u64, 4095usize), (2, 8192), (4, 4096)] {
        let idx = ChunkIdx(idx);
        let key = s.chunk_key(idx);
        raw.put(&Path::from(key.as_str()), PutPayload::from(vec![9u8; len]))
            .await
            .unwrap();
        for e in [
            s.read(idx).await.unwrap_err(),
            s.status(idx).await.unwrap_err(),
        ] {
            assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
            let msg = e.to_string();
            assert!(
                msg.contains(&key) && msg.contains(&format!("is {len} bytes")),
                "{msg}"
            );
        }
    }
    // The right size is served; writing a chunk replaces a bad object.
    s.write(ChunkIdx(1), Bytes::from(vec![3u8; 4096]))
        .await
        .unwrap();
    assert_eq!(s.read(ChunkIdx(1)).await.unwrap(), vec![3u8; 4096]);
    // A description that is not one is refused on open, naming the object.
    let prefix = fresh_prefix("badmeta");
    raw.put(
        &Path::from(format!("{prefix}/farmap-meta")),
        PutPayload::from_static(b"hello"),
    )
    .await
    .unwrap();
    let e = open_with(
        location(svc, svc.var("ENDPOINT"), &prefix),
        None,
        false,
        &env_of(svc),
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt);
    assert!(
        e.to_string().contains(&format!("{prefix}/farmap-meta")),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_trim_lists_and_deletes_only_its_range() {
    let Some(svc) = minio("a_large_trim_lists_and_deletes_only_its_range") else {
        return;
    };
    // More chunks than a trim deletes by naming keys: the listing path.
    let g = Geometry::new(10_000 * 4096, 4096).unwrap();
    let s = fresh_store(svc, "bigtrim", g).await;
    let written = [0u64, 1, 2, 999, 1000, 5000, 8999, 9000, 9999];
    for i in written {
        s.write(ChunkIdx(i), Bytes::from(vec![i as u8 | 1; 4096]))
            .await
            .unwrap();
    }
    s.trim(ChunkRange::new(ChunkIdx(1), ChunkIdx(9000)))
        .await
        .unwrap();
    for i in written {
        let st = s.status(ChunkIdx(i)).await.unwrap();
        let inside = (1..9000).contains(&i);
        let want = if inside {
            ChunkStatus::Zero
        } else {
            ChunkStatus::Data
        };
        assert_eq!(st, want, "chunk {i}");
        let data = s.read(ChunkIdx(i)).await.unwrap();
        assert_eq!(data[0], if inside { 0 } else { i as u8 | 1 }, "chunk {i}");
    }
    // The whole region from 0, then the description is still there.
    s.trim(g.all()).await.unwrap();
    for i in written {
        assert_eq!(s.status(ChunkIdx(i)).await.unwrap(), ChunkStatus::Zero);
    }
    let loc = location(
        svc,
        svc.var("ENDPOINT"),
        s.location().strip_prefix("s3://farmap-test/").unwrap(),
    );
    let again = open_with(loc, None, false, &env_of(svc)).await.unwrap();
    assert_eq!(again.geometry(), g);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_requests_in_flight_share_few_connections() {
    let Some(svc) = minio("many_requests_in_flight_share_few_connections") else {
        return;
    };
    let g = Geometry::new(64 * 4096, 4096).unwrap();
    let mut loc = location(svc, svc.var("ENDPOINT"), &fresh_prefix("inflight"));
    loc.set("connections", "3").unwrap();
    let s = Arc::new(open_with(loc, Some(g), false, &env_of(svc)).await.unwrap());
    let tasks: Vec<_> = g
        .all()
        .iter()
        .map(|idx| {
            let s = s.clone();
            tokio::spawn(async move {
                let data = Bytes::from(vec![idx.0 as u8 + 1; 4096]);
                s.write(idx, data.clone()).await.unwrap();
                assert_eq!(s.read(idx).await.unwrap(), data);
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_credentials_name_the_key_id() {
    let Some(svc) = minio("bad_credentials_name_the_key_id") else {
        return;
    };
    let g = Some(Geometry::new(1 << 20, 65536).unwrap());
    let loc = || location(svc, svc.var("ENDPOINT"), &fresh_prefix("creds"));
    let mut env = env_of(svc);
    env.insert("AWS_ACCESS_KEY_ID".into(), "NOSUCHKEY".into());
    let e = open_with(loc(), g, false, &env).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{}", chain(&e));
    let msg = e.to_string();
    assert!(
        msg.contains("does not know access key id NOSUCHKEY (from AWS_ACCESS_KEY_ID)"),
        "{msg}"
    );
    let mut env = env_of(svc);
    env.insert("AWS_SECRET_ACCESS_KEY".into(), "wrong-secret".into());
    let e = open_with(loc(), g, false, &env).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{}", chain(&e));
    let msg = e.to_string();
    assert!(
        msg.contains("access key id farmap-test") && msg.contains("secret access key is wrong"),
        "{msg}"
    );
    assert!(
        !chain(&e).contains("wrong-secret"),
        "the secret stays out of errors"
    );
    // No credentials at all.
    let env = std::collections::HashMap::from([("HOME".to_string(), "/nonexistent".to_string())]);
    let e = open_with(loc(), g, false, &env).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PermissionDenied);
    assert!(e.to_string().contains("AWS_ACCESS_KEY_ID"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_bucket_says_how_to_create_it() {
    let Some(svc) = minio("a_missing_bucket_says_how_to_create_it") else {
        return;
    };
    let endpoint = svc.var("ENDPOINT");
    let mut loc = farmap_s3::S3Location::parse("//no-such-bucket-here/x").unwrap();
    loc.set("endpoint", endpoint).unwrap();
    let g = Some(Geometry::new(1 << 20, 65536).unwrap());
    let e = open_with(loc, g, false, &env_of(svc)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{}", chain(&e));
    let msg = e.to_string();
    assert!(
        msg.contains(&format!(
            "bucket no-such-bucket-here does not exist at {endpoint}"
        )) && msg.contains("aws s3 mb s3://no-such-bucket-here"),
        "{msg}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_endpoint_is_reported_quickly() {
    // Needs no server: a port nothing listens on (bound, then released).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut loc = farmap_s3::S3Location::parse("//bucket/x").unwrap();
    let endpoint = format!("http://127.0.0.1:{port}");
    loc.set("endpoint", &endpoint).unwrap();
    let env = std::collections::HashMap::from([
        ("AWS_ACCESS_KEY_ID".to_string(), "k".to_string()),
        ("AWS_SECRET_ACCESS_KEY".to_string(), "s".to_string()),
        ("HOME".to_string(), "/nonexistent".to_string()),
    ]);
    // (The first request of an open retries twice, from 50 ms: this fails in well under a
    // second, where a data request would retry for up to a minute.)
    let e = open_with(
        loc,
        Some(Geometry::new(1 << 20, 65536).unwrap()),
        false,
        &env,
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{}", chain(&e));
    assert!(
        e.to_string().contains(&format!("cannot reach {endpoint}")),
        "{}",
        chain(&e)
    );
}

// The objects of the versioned layout (S3Objects) and a versioned region over them.

fn objects(svc: &farmap_testkit::Service, name: &str) -> Arc<S3Objects> {
    let env = env_of(svc);
    let loc = location(svc, svc.var("ENDPOINT"), &fresh_prefix(name));
    Arc::new(S3Objects::open_with_env(&loc, &|k| env.get(k).cloned()).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_objects_keep_the_contract() {
    let Some(svc) = minio("s3_objects_keep_the_contract") else {
        return;
    };
    farmap_testkit::check_objects_contract(objects(svc, "objects")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versioned_regions_over_s3_keep_versions_and_one_writer() {
    let Some(svc) = minio("versioned_regions_over_s3_keep_versions_and_one_writer") else {
        return;
    };
    farmap_testkit::versioned::check_versioned(objects(svc, "versioned")).await;
}
