//! `s3://BUCKET/PREFIX`: a region in an S3 bucket, one object per chunk ([`farmap_s3`]).

use std::sync::Arc;

use farmap_core::{BoxFuture, Store};
use farmap_s3::{S3Location, S3Options, S3SpecError, S3Store};

use super::common::{size_option, Parts};
use super::model::{store_error, OpenError, SpecError, SpecKind, StoreSpec};
use super::scheme::Scheme;

/// `s3://`.
#[derive(Debug)]
pub(super) struct S3;

impl Scheme for S3 {
    fn names(&self) -> &'static [&'static str] {
        &["s3"]
    }

    fn takes(&self, _: &str) -> &'static str {
        "size, chunk, ro, endpoint, region, profile, connections, timeout, retries"
    }

    fn kind(&self, _: &str, p: &mut Parts<'_>) -> Result<SpecKind, SpecError> {
        let bad = |e: S3SpecError| p.bad(e.option, e.reason);
        let mut location = S3Location::parse(p.body).map_err(bad)?;
        for (key, value) in &p.options {
            location.set(key, value).map_err(bad)?;
        }
        Ok(SpecKind::S3 { location })
    }

    fn display_parts(&self, spec: &StoreSpec, _: bool) -> (String, Vec<String>) {
        let SpecKind::S3 { location } = &spec.kind else {
            unreachable!("not an s3:// spec: {spec:?}")
        };
        let (head, mut opts) = location.display_parts();
        opts.extend(size_option(spec.size));
        (head, opts)
    }

    fn open<'a>(&'a self, spec: &'a StoreSpec) -> BoxFuture<'a, Result<Arc<dyn Store>, OpenError>> {
        Box::pin(async move {
            let SpecKind::S3 { location } = &spec.kind else {
                unreachable!("not an s3:// spec: {spec:?}")
            };
            let store = S3Store::open(S3Options {
                location: location.clone(),
                size: spec.size,
                chunk_size: spec.chunk_size,
                read_only: spec.read_only,
            })
            .await
            .map_err(store_error(spec))?;
            Ok(Arc::new(store) as Arc<dyn Store>)
        })
    }
}
