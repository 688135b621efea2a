//! Shared pieces of the Redis tests: the real servers and fresh prefixes.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use farmap_core::{Geometry, Store};
use farmap_redis::{RedisConfig, RedisStore};
use farmap_testkit::Service;

/// The shared service `name`, or `None` after recording a skip for `test`.
pub fn service(name: &'static str, test: &str) -> Option<&'static Service> {
    match Service::shared(name) {
        Ok(s) => Some(s),
        Err(e) => {
            farmap_testkit::skip(test, e);
            None
        }
    }
}

/// A prefix no other check of this run uses.
pub fn fresh_prefix(what: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "t-{what}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// The config for `spec_base` (`redis://h:p` or `redis+cluster://a,b,c/`) with `opts`.
pub fn config(spec_base: &str, opts: &[(&str, &str)]) -> RedisConfig {
    let (scheme, body) = spec_base.split_once(':').expect("a scheme");
    RedisConfig::parse(scheme, body, opts).expect("a valid spec")
}

/// A fresh, empty store of geometry `g` under a new prefix.
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
pub async fn fresh_dyn(spec_base: &str, g: Geometry) -> Arc<dyn Store> {
    Arc::new(fresh_store(spec_base, g, &[]).await)
}

/// A plain client to one server, for setting up what the store must cope with.
pub async fn raw(addr: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(format!("redis://{addr}"))
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("connect")
}

/// A fresh, empty store of geometry `g` with `extra` options, as an `Arc<dyn Store>`.
pub async fn fresh_dyn_with(
    spec_base: &str,
    g: Geometry,
    extra: &[(&str, &str)],
) -> Arc<dyn Store> {
    Arc::new(fresh_store(spec_base, g, extra).await)
}
