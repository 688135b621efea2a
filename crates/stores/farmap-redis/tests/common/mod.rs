//! Shared pieces of the Redis tests: the real servers and fresh prefixes.
// Not every test binary uses every helper.
#![allow(dead_code)]

pub mod objects;

use std::sync::Arc;

use farmap_core::{Geometry, Store};
use farmap_redis::{RedisConfig, RedisStore};
use farmap_testkit::Service;

/// The shared service `name`, or `None` after recording a skip for `test`.
pub fn service(name: &'static str, test: &str) -> Option<&'static Service> {
    farmap_testkit::skip::unless(test, Service::shared(name))
}

/// A prefix no other check of this run (nor an earlier run) uses.
pub fn fresh_prefix(what: &str) -> String {
    farmap_testkit::unique_name(&format!("t-{what}"))
}

/// The config for `spec_base` (`redis://h:p` or `redis+cluster://a,b,c/`) with `opts`.
pub fn config(spec_base: &str, opts: &[(&str, &str)]) -> RedisConfig {
    let (scheme, body) = spec_base.split_once(':').expect("a scheme");
    RedisConfig::parse(scheme, body, opts).expect("a valid spec")
}

/// A fresh, empty store of geometry `g` under a new prefix, with `extra` options.
pub async fn fresh_store(spec_base: &str, g: Geometry, extra: &[(&str, &str)]) -> RedisStore {
    let prefix = fresh_prefix("s");
    let mut opts = vec![("prefix", prefix.as_str())];
    opts.extend_from_slice(extra);
    RedisStore::open(
        &config(spec_base, &opts),
        Some(g.size()),
        Some(g.chunk_size()),
    )
    .await
    .expect("open a fresh redis store")
}

/// The same as an `Arc<dyn Store>`.
pub async fn fresh_dyn(spec_base: &str, g: Geometry, extra: &[(&str, &str)]) -> Arc<dyn Store> {
    Arc::new(fresh_store(spec_base, g, extra).await)
}

/// A plain client to one server, for setting up what the store must cope with.
pub async fn raw(addr: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(format!("redis://{addr}"))
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("connect")
}
