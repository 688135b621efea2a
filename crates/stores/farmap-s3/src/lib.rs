//! farmap's S3 store: a region in any S3-compatible object store (AWS S3, MinIO, ...), one
//! object per chunk.
//!
//! ```text
//! s3://BUCKET/PREFIX?endpoint=http://127.0.0.1:9000&region=us-east-1&size=1GiB&chunk=1MiB
//! ```
//!
//! # Layout in the bucket
//! - Chunk `i` is the object `PREFIX/<i in 12 decimal digits>` (`vm1/000000000042`): zero
//!   padded so that a listing (which S3 returns in key order) is in chunk order, and a large
//!   trim can list from its first chunk instead of naming every key.
//! - `PREFIX/farmap-meta` holds the region's geometry ([`mod@meta`]). It is written when the
//!   region is created (the first open with `size=`, as a conditional PUT so that two creators
//!   cannot disagree) and checked on every later open: a `size=` or `chunk=` that differs is an
//!   error, and no `size=` is needed (`farmap info s3://bucket/vm1` works).
//! - A chunk never written (no object: 404) reads as zeros; trim deletes objects
//!   (`DeleteObjects`, up to 1000 keys a request); status is a HEAD request (Data or Zero).
//! - An object whose size is not its chunk's length is refused as
//!   [`Corrupt`](farmap_core::ErrorKind::Corrupt), naming the key, and never served; the size is
//!   checked from the answer's headers before its body is read.
//!
//! # Durability
//! A PUT returns once S3 (or MinIO) acknowledged it, and an acknowledged PUT is stored
//! durably: [`Store::flush`](farmap_core::Store::flush) has nothing left to do and returns at
//! once ([`Caps::FLUSH`](farmap_core::Caps::FLUSH) holds). A write is whole-object: a reader
//! sees the old or the new chunk, never a mix.
//!
//! # Connections, retries, timeouts
//! - At most `connections=` requests (default [`DEFAULT_CONNECTIONS`]) are in flight; the
//!   HTTP/1.1 connection pool keeps as many idle connections, so a store under load reuses
//!   them (TCP_NODELAY on). Throughput comes from many requests at once: a managed mount's
//!   puller (`Cached` + `Puller`) keeps the pool busy.
//! - A request that fails with a 5xx status (`503 SlowDown`, `500 InternalError`), 429, a
//!   connection error or a timeout of a read is retried with exponential backoff (50 ms,
//!   doubling, at most 2 s, with jitter), at most `retries=` times (default
//!   [`DEFAULT_RETRIES`]) and for at most [`RETRY_TOTAL`] in all; then the error says what
//!   the server kept answering. The first request of [`S3Store::open`] retries at most twice,
//!   so that a wrong endpoint is reported quickly.
//! - `timeout=` bounds each HTTP request (default [`DEFAULT_TIMEOUT`]); connecting is bounded
//!   by 5 s.
//! - No HTTP proxy is used (`HTTP_PROXY` is ignored). `https://` endpoints use rustls (ring)
//!   and the system's root certificates.
//!
//! # Credentials, region, endpoint
//! From the spec (`endpoint=`, `region=`, `profile=`), the standard AWS environment variables
//! (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`,
//! `AWS_DEFAULT_REGION`, `AWS_ENDPOINT_URL_S3`, `AWS_ENDPOINT_URL`, `AWS_PROFILE`) and the AWS
//! profile files (`~/.aws/credentials`, `~/.aws/config`); the order is in [`config`]. Secrets
//! never appear in a spec, a log line or an error; errors name the access key id and where it
//! came from. Requests use path-style URLs (`ENDPOINT/BUCKET/KEY`), which every
//! S3-compatible server accepts.
//!
//! # Errors
//! - Unreachable endpoint: [`Unavailable`](farmap_core::ErrorKind::Unavailable), "cannot reach
//!   http://...".
//! - Unknown access key id, wrong secret key, expired token, access denied:
//!   [`PermissionDenied`](farmap_core::ErrorKind::PermissionDenied), naming the key id.
//! - Missing bucket: [`NotFound`](farmap_core::ErrorKind::NotFound), saying how to create it.
//! - A region that does not exist yet opened without `size=`: `NotFound`, "give size=".
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod config;
mod errors;
mod http;
mod location;
pub mod meta;
mod objects;
mod store;

pub use config::DEFAULT_REGION;
pub use location::{S3Location, S3SpecError, MAX_CONNECTIONS, MAX_RETRIES, OPTIONS};
pub use objects::{S3Objects, MAX_OBJECT_LEN};
pub use store::{
    S3Options, S3Store, DEFAULT_CONNECTIONS, DEFAULT_RETRIES, DEFAULT_TIMEOUT, RETRY_TOTAL,
};

/// The `## s3` section of `farmap help stores`.
pub const HELP: &str = "\
## s3
s3://BUCKET/PREFIX?endpoint=URL&region=R&size=SIZE&chunk=SIZE
  A region in an S3 bucket (AWS S3, MinIO, any S3-compatible server): chunk i is the
  object PREFIX/<i in 12 digits> (PREFIX/000000000042), so listings are in chunk order;
  PREFIX/farmap-meta records size and chunk size. size= is needed only to create a
  region; later opens read it (and refuse a size= or chunk= that differs).
  A missing object reads as zeros; trim deletes objects; flush has nothing to do (S3
  stores a PUT durably before acknowledging it). An object of the wrong size is refused
  as corrupt, naming its key.
  Options: endpoint= (server URL; default AWS, or AWS_ENDPOINT_URL), region= (default
  AWS_REGION, AWS_DEFAULT_REGION, the profile, us-east-1), profile= (of ~/.aws/credentials
  and ~/.aws/config), connections=N (requests in flight, default 64), timeout=DURATION
  (per request, default 30s), retries=N (on 5xx, 503 SlowDown, 429 and connection errors,
  exponential backoff from 50ms to 2s, at most 60s in all; default 10), ro.
  Credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), or a
  profile (AWS_PROFILE or profile=). Never in the spec.
  Example (MinIO on this host):
    AWS_ACCESS_KEY_ID=minioadmin AWS_SECRET_ACCESS_KEY=minioadmin \\
    farmap cp file:disk.img 's3://vms/disk1?endpoint=http://127.0.0.1:9000&size=1GiB'
  The bucket must exist (aws s3 mb s3://vms --endpoint-url http://127.0.0.1:9000, or
  mc mb).
";
