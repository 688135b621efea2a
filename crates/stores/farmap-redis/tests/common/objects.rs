//! Pieces of the [`RedisObjects`] tests that the single-server and the cluster tests share;
//! the checks themselves are farmap-testkit's (`versioned`), shared with the CQL tests.

use farmap_redis::{RedisConfig, RedisObjects};

/// Objects under a fresh prefix on the server of `base`, with `extra` options.
pub async fn fresh_objects(base: &str, what: &str, extra: &[(&str, &str)]) -> RedisObjects {
    let prefix = super::fresh_prefix(what);
    let mut opts = vec![("prefix", prefix.as_str())];
    opts.extend_from_slice(extra);
    let cfg: RedisConfig = super::config(base, &opts);
    RedisObjects::open(&cfg).await.expect("open redis objects")
}
