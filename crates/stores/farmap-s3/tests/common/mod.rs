//! A MinIO server for the tests (scripts/services/minio.sh, one per test binary) and stores on
//! fresh prefixes of its bucket.

use std::collections::HashMap;

use farmap_core::{Geometry, StoreResult};
use farmap_s3::{S3Location, S3Options, S3Store};
use farmap_testkit::Service;

/// The shared MinIO, or `None` after recording why the test is skipped.
pub fn minio(test: &str) -> Option<&'static Service> {
    farmap_testkit::skip::unless(test, Service::shared("minio"))
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
    farmap_testkit::unique_name(&format!("t/{name}"))
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
