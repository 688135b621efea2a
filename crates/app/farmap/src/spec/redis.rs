//! `redis://`, `rediss://` (TLS) and `redis+cluster://`: a region in Redis, one key per chunk
//! ([`farmap_redis`]).

use std::sync::Arc;

use farmap_core::{BoxFuture, Store};
use farmap_redis::{RedisConfig, RedisSpecError, RedisStore};

use super::common::{size_option, Parts};
use super::model::{store_error, OpenError, SpecError, SpecKind, StoreSpec};
use super::scheme::Scheme;

/// `redis://`, `rediss://`, `redis+cluster://`.
#[derive(Debug)]
pub(super) struct Redis;

impl Scheme for Redis {
    fn names(&self) -> &'static [&'static str] {
        &["redis", "rediss", "redis+cluster"]
    }

    fn takes(&self, scheme: &str) -> &'static str {
        if scheme == "rediss" {
            "size, chunk, prefix, connections, timeout, flush, replicas, ca"
        } else {
            "size, chunk, prefix, connections, timeout, flush, replicas"
        }
    }

    fn kind(&self, scheme: &str, p: &mut Parts<'_>) -> Result<SpecKind, SpecError> {
        let config = RedisConfig::parse(scheme, p.body, &p.options).map_err(|e| match e {
            RedisSpecError::BadAddress { hint, .. } => SpecError::BadAddress {
                spec: p.spec.to_owned(),
                hint,
            },
            RedisSpecError::BadOption { option, reason } => p.bad(option, reason),
            other => p.bad("spec", other.to_string()),
        })?;
        Ok(SpecKind::Redis(config))
    }

    fn display_parts(&self, spec: &StoreSpec, secrets: bool) -> (String, Vec<String>) {
        let SpecKind::Redis(config) = &spec.kind else {
            unreachable!("not a redis:// spec: {spec:?}")
        };
        let (head, redis_opts) = if secrets {
            config.display_parts_with_password()
        } else {
            config.display_parts()
        };
        let mut opts: Vec<String> = size_option(spec.size).into_iter().collect();
        opts.extend(redis_opts);
        (head, opts)
    }

    fn open<'a>(&'a self, spec: &'a StoreSpec) -> BoxFuture<'a, Result<Arc<dyn Store>, OpenError>> {
        Box::pin(async move {
            let SpecKind::Redis(config) = &spec.kind else {
                unreachable!("not a redis:// spec: {spec:?}")
            };
            let store = RedisStore::open(config, spec.size, spec.chunk_size)
                .await
                .map_err(store_error(spec))?;
            Ok(Arc::new(store) as Arc<dyn Store>)
        })
    }

    fn creates(&self, _: &StoreSpec) -> bool {
        true
    }
}
