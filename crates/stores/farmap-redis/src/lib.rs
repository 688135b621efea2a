//! farmap's Redis store: a region kept in Redis or a Redis Cluster, one key per chunk.
//!
//! | spec | store |
//! |---|---|
//! | `redis://127.0.0.1:6379/0?size=1GiB&prefix=vm1` | one server, database 0 |
//! | `redis://user:password@host:6379/2?size=1GiB` | with ACL credentials (or `:password@` alone) |
//! | `rediss://host:6380/0?size=1GiB&ca=ca.pem` | over TLS; `ca=` the PEM of the server's CA (default: the system's roots) |
//! | `redis+cluster://h1:7000,h2:7001,h3:7002/?size=1GiB` | a Redis Cluster, from any seed nodes |
//!
//! Layout: chunk `i` is the key `<prefix>:<i>` whose value is exactly the chunk's bytes (the
//! last chunk may be short); a missing key reads as zeros, a trim deletes keys (`UNLINK`), and
//! `status` asks `EXISTS`. The key `<prefix>:meta` records the region's size and chunk size
//! (`farmap-redis 1 size=.. chunk=..`): it is written when a region is created (which needs
//! `size=`) and checked on every later open, so `farmap info redis://...` needs no size and a
//! spec that disagrees with the record is refused. Keys carry no hash tag, so a cluster spreads
//! chunks over all its slots; the cluster client follows `MOVED` and `ASK`.
//!
//! Options: `prefix=` (default `farmap`), `connections=` (multiplexed connections in the pool,
//! default 4; each pipelines every request in flight on it), `timeout=` (per request and per
//! connection attempt, default 30s), `flush=none|wait|fsync` (see [`FlushPolicy`] for exactly
//! what each promises) with `replicas=N` for `wait`, and for `rediss://` `ca=`.
//!
//! A value of the wrong length is refused as corrupt, naming its key, and never served.
//!
//! [`RedisObjects`] keeps the objects of farmap's versioned layout
//! (`versioned:(redis://HOST:PORT/DB?prefix=P)/REGION`) on the same servers, specs and
//! connections: object `FOLDER/NAME` is the key `<prefix>:obj:{FOLDER}/NAME`, and each folder
//! has a sorted-set index `<prefix>:dir:{FOLDER}` kept by the same Lua script that creates
//! the object (`SET NX`), the folder as hash tag so that both share a cluster slot.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod config;
mod conn;
mod meta;
mod objects;
mod store;

pub use config::{
    FlushPolicy, RedisConfig, RedisSpecError, Target, DEFAULT_CONNECTIONS, DEFAULT_PREFIX,
    DEFAULT_TIMEOUT, OPTIONS, TLS_OPTIONS,
};
pub use objects::{RedisObjects, MAX_OBJECT_LEN};
pub use store::RedisStore;
