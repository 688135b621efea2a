//! [`S3Objects`]: named objects under an S3 prefix, for the versioned layout.

use std::fmt;

use bytes::Bytes;
use farmap_core::{check_key, BoxFuture, ErrorKind, Objects, StoreError, StoreResult};
use object_store::aws::AmazonS3;
use object_store::path::Path;
use object_store::{GetOptions, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use tokio::sync::Semaphore;

use crate::errors::{Describe, Failure};
use crate::store::connect;
use crate::S3Location;

/// The largest object read: a version manifest of 6.7 million chunks (a 400 GiB region in
/// 64 KiB chunks); a larger one is refused before its body is read.
pub const MAX_OBJECT_LEN: u64 = 256 << 20;

/// Objects under `s3://BUCKET/PREFIX/`: `KEY` is the object `PREFIX/KEY`.
///
/// [`create`](Objects::create) is a conditional PUT (`If-None-Match: *`): a server without
/// conditional writes is refused at the first create rather than letting two writers
/// overwrite each other. An acknowledged PUT is durable (see the crate documentation).
pub struct S3Objects {
    client: AmazonS3,
    base: String,
    limit: Semaphore,
    describe: Describe,
}

impl fmt::Debug for S3Objects {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Objects")
            .field("location", &self.describe.location)
            .field("endpoint", &self.describe.endpoint)
            .finish()
    }
}

impl S3Objects {
    /// Objects at `location`, with endpoint, region and credentials as [`crate::S3Store`]
    /// finds them. Nothing is requested until the first operation.
    pub fn open(location: &S3Location) -> StoreResult<Self> {
        Self::open_with_env(location, &|k| std::env::var(k).ok())
    }

    /// [`S3Objects::open`] reading the environment through `env`.
    pub fn open_with_env(
        location: &S3Location,
        env: &(dyn Fn(&str) -> Option<String> + Sync),
    ) -> StoreResult<Self> {
        let conn = connect(location, env)?;
        let base = if location.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", location.prefix)
        };
        Ok(Self {
            client: conn.client,
            base,
            limit: Semaphore::new(conn.connections),
            describe: conn.describe,
        })
    }

    fn path(&self, key: &str) -> StoreResult<Path> {
        check_key(key)?;
        Ok(Path::from(format!("{}{key}", self.base)))
    }

    async fn permit(&self) -> StoreResult<tokio::sync::SemaphorePermit<'_>> {
        self.limit
            .acquire()
            .await
            .map_err(|_| StoreError::new(ErrorKind::Closed, "the S3 objects were closed"))
    }
}

impl Objects for S3Objects {
    fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, StoreResult<Option<Bytes>>> {
        Box::pin(async move {
            let path = self.path(key)?;
            let doing = format!("reading object {path}");
            let _p = self.permit().await?;
            let got = match self.client.get_opts(&path, GetOptions::default()).await {
                Ok(g) => g,
                Err(e) if Failure::of(&e).is_missing_object() => return Ok(None),
                Err(e) => return Err(self.describe.error(&doing, e)),
            };
            if got.meta.size > MAX_OBJECT_LEN {
                return Err(StoreError::new(
                    ErrorKind::Corrupt,
                    format!(
                        "object {path} is {} bytes, more than the {MAX_OBJECT_LEN} farmap reads",
                        got.meta.size
                    ),
                ));
            }
            let data = got
                .bytes()
                .await
                .map_err(|e| self.describe.error(&doing, e))?;
            Ok(Some(data))
        })
    }

    fn exists<'a>(&'a self, key: &'a str) -> BoxFuture<'a, StoreResult<bool>> {
        Box::pin(async move {
            let path = self.path(key)?;
            let _p = self.permit().await?;
            match self.client.head(&path).await {
                Ok(_) => Ok(true),
                Err(e) if Failure::of(&e).is_missing_object() => Ok(false),
                Err(e) => Err(self.describe.error(&format!("looking up object {path}"), e)),
            }
        })
    }

    fn create<'a>(&'a self, key: &'a str, data: Bytes) -> BoxFuture<'a, StoreResult<bool>> {
        Box::pin(async move {
            let path = self.path(key)?;
            let put = PutOptions {
                mode: PutMode::Create,
                ..PutOptions::default()
            };
            let _p = self.permit().await?;
            match self
                .client
                .put_opts(&path, PutPayload::from(data), put)
                .await
            {
                Ok(_) => Ok(true),
                Err(object_store::Error::AlreadyExists { .. })
                | Err(object_store::Error::Precondition { .. }) => Ok(false),
                Err(object_store::Error::NotImplemented { .. }) => Err(StoreError::new(
                    ErrorKind::Unsupported,
                    format!(
                        "{} does not do conditional writes (If-None-Match), which versioned \
                         regions need to keep one writer",
                        self.describe.endpoint
                    ),
                )),
                Err(e) => Err(self.describe.error(&format!("creating object {path}"), e)),
            }
        })
    }

    fn list<'a>(&'a self, dir: &'a str) -> BoxFuture<'a, StoreResult<Vec<String>>> {
        Box::pin(async move {
            let prefix = self.path(dir)?;
            let _p = self.permit().await?;
            let listed = self
                .client
                .list_with_delimiter(Some(&prefix))
                .await
                .map_err(|e| self.describe.error(&format!("listing {prefix}/"), e))?;
            let last = |p: &Path| p.parts().next_back().map(|s| s.as_ref().to_owned());
            let mut names: Vec<String> = listed
                .common_prefixes
                .iter()
                .filter_map(last)
                .chain(listed.objects.iter().filter_map(|o| last(&o.location)))
                .filter(|n| check_key(n).is_ok())
                .collect();
            names.sort();
            names.dedup();
            Ok(names)
        })
    }

    fn delete<'a>(&'a self, key: &'a str) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(async move {
            let path = self.path(key)?;
            let _p = self.permit().await?;
            match self.client.delete(&path).await {
                Ok(()) => Ok(()),
                Err(e) if Failure::of(&e).is_missing_object() => Ok(()),
                Err(e) => Err(self.describe.error(&format!("deleting object {path}"), e)),
            }
        })
    }

    fn location(&self) -> String {
        self.describe.location.clone()
    }
}
