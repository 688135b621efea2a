//! A MinIO server for the tests (scripts/services/minio.sh, one per test binary) and stores on
//! fresh prefixes of its bucket.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use farmap_core::{Geometry, StoreResult};
use farmap_s3::{S3Location, S3Options, S3Store};
use farmap_testkit::{skip, Service};

/// The shared MinIO, or `None` after recording why the test is skipped.
pub fn minio(test: &str) -> Option<&'static Service> {
    match Service::shared("minio") {
        Ok(s) => Some(s),
        Err(e) => {
            skip(test, e);
            None
        }
    }
}

/// The environment a client of `svc` sees: its keys, and no profile files.
pub fn env_of(svc: &Service) -> HashMap<String, String> {
    HashMap::from([
        ("AWS_ACCESS_KEY_ID".into(), svc.var("ACCESS_KEY").into()),
        ("AWS_SECRET_ACCESS_KEY".into(), svc.var("SECRET_KEY").into()),
        ("HOME".into(), "/nonexistent".into()),
    ])
}

/// A prefix no other test (or earlier run) uses.
pub fn fresh_prefix(name: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "t/{name}-{}-{}-{nanos}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// The location `prefix` of the service's bucket, through `endpoint`.
pub fn location(svc: &Service, endpoint: &str, prefix: &str) -> S3Location {
    let mut loc = S3Location::parse(&format!("//{}/{prefix}", svc.var("BUCKET"))).unwrap();
    loc.set("endpoint", endpoint).unwrap();
    loc
}

/// Opens `loc` with `env`.
pub async fn open_with(
    loc: S3Location,
    geometry: Option<Geometry>,
    read_only: bool,
    env: &HashMap<String, String>,
) -> StoreResult<S3Store> {
    S3Store::open_with_env(
        S3Options {
            location: loc,
            size: geometry.map(|g| g.size()),
            chunk_size: geometry.map(|g| g.chunk_size()),
            read_only,
        },
        &|k| env.get(k).cloned(),
    )
    .await
}

/// A new, empty region of geometry `g` on a fresh prefix.
pub async fn fresh_store(svc: &Service, name: &str, g: Geometry) -> S3Store {
    let loc = location(svc, svc.var("ENDPOINT"), &fresh_prefix(name));
    open_with(loc, Some(g), false, &env_of(svc))
        .await
        .unwrap_or_else(|e| {
            panic!(
                "opening a fresh S3 region: {}",
                farmap_core::error_chain(&e)
            )
        })
}
