//! The [`Objects`] trait: named, immutable objects, for layouts that keep more than one
//! version of a region (content-addressed chunks and manifests).

use std::fmt;

use bytes::Bytes;

use crate::{BoxFuture, ErrorKind, StoreError, StoreResult};

/// A flat space of named objects that are written once: a directory, an S3 prefix, a Redis
/// key space. Keys are made by farmap (see [`check_key`]), never taken from a peer.
///
/// # Contract
/// - [`create`](Objects::create) is the one atomic step: of any number of callers creating
///   the same key at once, exactly one gets `true`, and what it wrote is what every later
///   [`get`](Objects::get) returns. It returns once the object is durable.
/// - An object is never changed in place; [`delete`](Objects::delete) removes it.
/// - [`list`](Objects::list) gives the names directly under a folder (`regions/a/versions`),
///   ascending, without the folder.
pub trait Objects: Send + Sync + fmt::Debug + 'static {
    /// The object named `key`, `None` when there is none.
    fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, StoreResult<Option<Bytes>>>;

    /// Whether `key` exists (without reading it, where the store can).
    fn exists<'a>(&'a self, key: &'a str) -> BoxFuture<'a, StoreResult<bool>> {
        Box::pin(async move { Ok(self.get(key).await?.is_some()) })
    }

    /// Creates `key` holding `data` unless it exists: `true` when this call created it.
    fn create<'a>(&'a self, key: &'a str, data: Bytes) -> BoxFuture<'a, StoreResult<bool>>;

    /// The names directly under the folder `dir` (no trailing `/`), ascending.
    fn list<'a>(&'a self, dir: &'a str) -> BoxFuture<'a, StoreResult<Vec<String>>>;

    /// Removes `key`; removing a key that does not exist succeeds.
    fn delete<'a>(&'a self, key: &'a str) -> BoxFuture<'a, StoreResult<()>>;

    /// Where the objects are, for messages (`dir:./objects`).
    fn location(&self) -> String;
}

/// Refuses a key that is not made of `/`-separated names of `[A-Za-z0-9._-]`, none empty,
/// `.` or `..`, none starting with `.`: what every [`Objects`] may assume of its keys.
pub fn check_key(key: &str) -> StoreResult<()> {
    let ok = !key.is_empty()
        && key.len() <= 1024
        && key.split('/').all(|part| {
            !part.is_empty()
                && !part.starts_with('.')
                && part
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        });
    if ok {
        Ok(())
    } else {
        Err(StoreError::new(
            ErrorKind::InvalidInput,
            format!("{key:?} is not an object key (names of [A-Za-z0-9._-] joined by '/')"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        for good in [
            "a",
            "chunks/ab/0123",
            "regions/r-1/versions/00000000000000000001",
        ] {
            check_key(good).unwrap();
        }
        for bad in [
            "", "/a", "a/", "a//b", "../a", "a/./b", ".hidden", "a b", "a\\b", "é",
        ] {
            assert!(check_key(bad).is_err(), "{bad:?}");
        }
    }
}
