//! The Redis store against a real redis-server (scripts/services/redis.sh): conformance,
//! model tests, and errors that name the problem.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{config, fresh_prefix, fresh_store, raw, service};
use farmap_core::{ChunkIdx, ChunkStatus, ErrorKind, Geometry, Store, StoreError};
use farmap_pipeline::Unaligned;
use farmap_redis::RedisStore;
use farmap_testkit::strategies::{byte_ops, ByteOp};
use farmap_testkit::ModelStore;
use proptest::prelude::*;

fn chain(e: &StoreError) -> String {
    farmap_core::error_chain(e)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conforms() {
    let Some(svc) = service("redis", "conforms") else {
        return;
    };
    let base = svc.var("SPEC_BASE").to_owned();
    farmap_testkit::run_conformance(|g| common::fresh_dyn(&base, g, &[])).await;
}

/// Byte-range operations through `Unaligned` over Redis against a vector, and chunk-level
/// trims and statuses against the model store.
fn check_against_model(base: &str, g: Geometry, ops: Vec<ByteOp>) -> Result<(), TestCaseError> {
    farmap_testkit::block_on(async {
        let u = Unaligned::new(fresh_store(base, g, &[("connections", "2")]).await);
        let model = Unaligned::new(ModelStore::new(g));
        for (i, op) in ops.into_iter().enumerate() {
            match op {
                ByteOp::Read { offset, len } => {
                    let got = u.read_bytes(offset, len).await.expect("read");
                    let want = model.read_bytes(offset, len).await.expect("model read");
                    prop_assert_eq!(&got[..], &want[..], "read({}, {})", offset, len);
                }
                ByteOp::Write { offset, data } => {
                    model.write_at(offset, &data).await.expect("model write");
                    u.write_bytes(offset, Bytes::from(data))
                        .await
                        .expect("write");
                }
                ByteOp::Flush => {
                    // Every few flushes, trim a chunk instead (and compare statuses).
                    let idx = ChunkIdx((i as u64 * 7) % g.chunk_count());
                    let range = farmap_core::ChunkRange::single(idx);
                    u.inner().trim(range).await.expect("trim");
                    model.inner().trim(range).await.expect("model trim");
                    u.flush().await.expect("flush");
                }
            }
        }
        for idx in g.all().iter() {
            let got = u.inner().read(idx).await.expect("final read");
            let want = model.inner().read(idx).await.expect("model");
            prop_assert!(got == want, "final content of {}", idx);
            let st = u.inner().status(idx).await.expect("status");
            let want_st = model.inner().status(idx).await.expect("model status");
            // A written chunk is Data in both; Redis keeps written zeros as Data too.
            prop_assert_eq!(st, want_st, "status of {}", idx);
        }
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn model_small_chunks(ops in byte_ops(6 * 4096 + 1234, 4096, 40)) {
        let Some(svc) = service("redis", "model_small_chunks") else { return Ok(()) };
        check_against_model(svc.var("SPEC_BASE"), Geometry::new(6 * 4096 + 1234, 4096).expect("g"), ops)?;
    }

    #[test]
    fn model_large_chunks(ops in byte_ops(4 * 65536, 65536, 24)) {
        let Some(svc) = service("redis", "model_large_chunks") else { return Ok(()) };
        check_against_model(svc.var("SPEC_BASE"), Geometry::new(4 * 65536, 65536).expect("g"), ops)?;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_geometry_is_recorded_and_checked() {
    let Some(svc) = service("redis", "the_geometry_is_recorded_and_checked") else {
        return;
    };
    let base = svc.var("SPEC_BASE");
    let prefix = fresh_prefix("meta");
    let cfg = config(base, &[("prefix", &prefix)]);
    // A new region needs a size.
    let e = RedisStore::open(&cfg, None, None).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    assert!(chain(&e).contains("give size="), "{}", chain(&e));
    let s = RedisStore::open(&cfg, Some(1 << 20), Some(4096))
        .await
        .unwrap();
    s.write(ChunkIdx(5), Bytes::from(vec![7u8; 4096]))
        .await
        .unwrap();
    // Reopened without size: the record's geometry.
    let again = RedisStore::open(&cfg, None, None).await.unwrap();
    assert_eq!(again.geometry(), Geometry::new(1 << 20, 4096).unwrap());
    assert_eq!(
        &again.read(ChunkIdx(5)).await.unwrap()[..],
        &[7u8; 4096][..]
    );
    // The same size again is fine; another size or chunk is refused, naming both.
    RedisStore::open(&cfg, Some(1 << 20), None).await.unwrap();
    let e = RedisStore::open(&cfg, Some(2 << 20), None)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    let msg = chain(&e);
    assert!(msg.contains("1 MiB") || msg.contains("1MiB"), "{msg}");
    assert!(msg.contains("2MiB") || msg.contains("2 MiB"), "{msg}");
    let e = RedisStore::open(&cfg, None, Some(65536)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{}", chain(&e));
    // A record that is not one is corrupt.
    let mut c = raw(svc.var("SPEC_BASE").trim_start_matches("redis://")).await;
    let bad = fresh_prefix("badmeta");
    let () = redis::cmd("SET")
        .arg(format!("{bad}:meta"))
        .arg("hello")
        .query_async(&mut c)
        .await
        .unwrap();
    let e = RedisStore::open(&config(base, &[("prefix", &bad)]), None, None)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt);
    assert!(chain(&e).contains(&format!("{bad}:meta")), "{}", chain(&e));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_of_the_wrong_length_or_type_are_refused_as_corrupt() {
    let Some(svc) = service("redis", "values_of_the_wrong_length_are_refused") else {
        return;
    };
    let base = svc.var("SPEC_BASE");
    let g = Geometry::new(8 * 4096, 4096).unwrap();
    let s = fresh_store(base, g, &[]).await;
    let mut c = raw(base.trim_start_matches("redis://")).await;
    let short = s.key(ChunkIdx(3));
    let () = redis::cmd("SET")
        .arg(&short)
        .arg(&[1u8; 10][..])
        .query_async(&mut c)
        .await
        .unwrap();
    let e = s.read(ChunkIdx(3)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt);
    let msg = chain(&e);
    assert!(msg.contains(&short) && msg.contains("10 bytes"), "{msg}");
    let list = s.key(ChunkIdx(4));
    let _: u64 = redis::cmd("LPUSH")
        .arg(&list)
        .arg("x")
        .query_async(&mut c)
        .await
        .unwrap();
    let e = s.read(ChunkIdx(4)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{}", chain(&e));
    assert!(chain(&e).contains(&list), "{}", chain(&e));
    // The other chunks are unaffected; a write replaces the bad value.
    assert!(s.read(ChunkIdx(2)).await.unwrap().iter().all(|b| *b == 0));
    s.write(ChunkIdx(3), Bytes::from(vec![9u8; 4096]))
        .await
        .unwrap();
    assert_eq!(s.read(ChunkIdx(3)).await.unwrap()[..], [9u8; 4096][..]);
    assert_eq!(s.status(ChunkIdx(3)).await.unwrap(), ChunkStatus::Data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_password_unreachable_server_and_wrong_db_are_named() {
    let Some(svc) = service("redis", "bad_password_unreachable_server_and_wrong_db") else {
        return;
    };
    let base = svc.var("SPEC_BASE");
    let addr = base.trim_start_matches("redis://");
    let mut c = raw(addr).await;
    let user = fresh_prefix("user");
    let () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg(&user)
        .arg("on")
        .arg(">right")
        .arg("~*")
        .arg("+@all")
        .query_async(&mut c)
        .await
        .unwrap();
    let prefix = fresh_prefix("auth");
    let good = config(
        &format!("redis://{user}:right@{addr}"),
        &[("prefix", &prefix)],
    );
    RedisStore::open(&good, Some(1 << 20), None)
        .await
        .expect("the right password");
    let wrong = config(
        &format!("redis://{user}:wrong@{addr}"),
        &[("prefix", &prefix)],
    );
    let e = RedisStore::open(&wrong, Some(1 << 20), None)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{}", chain(&e));
    let msg = chain(&e);
    assert!(
        msg.contains(addr) && msg.contains("password was refused"),
        "{msg}"
    );
    assert!(!msg.contains("wrong"), "the password is not shown: {msg}");

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let nowhere = config(&format!("redis://127.0.0.1:{port}"), &[("timeout", "2s")]);
    let started = std::time::Instant::now();
    let e = RedisStore::open(&nowhere, Some(1 << 20), None)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{}", chain(&e));
    assert!(
        chain(&e).contains(&format!("127.0.0.1:{port}")),
        "{}",
        chain(&e)
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "gave up in bounded time"
    );

    let e = RedisStore::open(&config(&format!("{base}/999"), &[]), Some(1 << 20), None)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{}", chain(&e));
    assert!(chain(&e).contains("no such database"), "{}", chain(&e));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_policies_do_what_they_promise() {
    let Some(svc) = service("redis", "flush_policies_do_what_they_promise") else {
        return;
    };
    let base = svc.var("SPEC_BASE");
    let g = Geometry::new(4 * 4096, 4096).unwrap();
    // No replica: WAIT 1 cannot be satisfied, and flush says so (after the timeout).
    let s = fresh_store(base, g, &[("flush", "wait"), ("timeout", "300ms")]).await;
    assert!(s.caps().contains(farmap_core::Caps::FLUSH));
    s.write(ChunkIdx(1), Bytes::from(vec![1u8; 4096]))
        .await
        .unwrap();
    let e = s.flush().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{}", chain(&e));
    assert!(chain(&e).contains("0 of the 1 replicas"), "{}", chain(&e));
    // The test server runs without an append-only file: flush=fsync is refused at open.
    let prefix = fresh_prefix("fsync");
    let cfg = config(base, &[("prefix", &prefix), ("flush", "fsync")]);
    let e = RedisStore::open(&cfg, Some(1 << 20), None)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported, "{}", chain(&e));
    assert!(chain(&e).contains("appendfsync always"), "{}", chain(&e));
    // flush=none promises nothing and does not claim the capability.
    let plain = fresh_store(base, g, &[]).await;
    assert!(!plain.caps().contains(farmap_core::Caps::FLUSH));
    plain.flush().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_fsync_opens_on_a_server_that_fsyncs_every_write() {
    let svc = match farmap_testkit::Service::start("redis", &[]) {
        Ok(s) => s,
        Err(e) => return farmap_testkit::skip("flush_fsync_opens", e),
    };
    let base = svc.var("SPEC_BASE");
    let mut c = raw(base.trim_start_matches("redis://")).await;
    for (k, v) in [("appendonly", "yes"), ("appendfsync", "always")] {
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(k)
            .arg(v)
            .query_async(&mut c)
            .await
            .unwrap();
    }
    let cfg = config(base, &[("flush", "fsync")]);
    let s = RedisStore::open(&cfg, Some(1 << 20), None).await.unwrap();
    assert!(s.caps().contains(farmap_core::Caps::FLUSH));
    s.write(ChunkIdx(0), Bytes::from(vec![3u8; 65536]))
        .await
        .unwrap();
    s.flush().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_reads_share_the_pool() {
    let Some(svc) = service("redis", "many_concurrent_reads_share_the_pool") else {
        return;
    };
    let g = Geometry::new(256 * 4096, 4096).unwrap();
    let s =
        std::sync::Arc::new(fresh_store(svc.var("SPEC_BASE"), g, &[("connections", "2")]).await);
    let writes = g.all().iter().map(|i| {
        let s = s.clone();
        async move {
            let v = vec![(i.0 % 251) as u8 | 1; 4096];
            s.write(i, Bytes::from(v)).await
        }
    });
    for r in futures::future::join_all(writes).await {
        r.unwrap();
    }
    let reads = g.all().iter().map(|i| {
        let s = s.clone();
        async move { (i, s.read(i).await) }
    });
    for (i, r) in futures::future::join_all(reads).await {
        let data = r.unwrap();
        assert!(data.iter().all(|b| *b == (i.0 % 251) as u8 | 1), "{i}");
    }
    // Trim the lot (batched UNLINK): every chunk reads as zeros again.
    s.trim(g.all()).await.unwrap();
    for i in g.all().iter() {
        assert_eq!(s.status(i).await.unwrap(), ChunkStatus::Zero, "{i}");
    }
}
