//! Opening the store a parsed spec names: local stores from any code, network stores and
//! stages on an async runtime (or a runtime of their own, [`open_store_blocking`]).

use std::sync::Arc;

use farmap_core::Store;

use super::model::{store_error, OpenError, StoreSpec};

/// Opens (or creates) the store a spec names: any spec, local or remote (a remote store
/// connects now; its failure to connect is the error).
pub async fn open_store_async(spec: &StoreSpec) -> Result<Arc<dyn Store>, OpenError> {
    match spec.kind.scheme().open_local(spec) {
        Some(opened) => opened,
        None => spec.kind.scheme().open(spec).await,
    }
}

/// Opens both stores of a `mirror:` spec and the stage over them (on the current runtime,
/// which runs its resync and backlog tasks).
pub async fn open_mirror(
    spec: &StoreSpec,
    primary: &StoreSpec,
    mirror: &StoreSpec,
    options: farmap_pipeline::MirrorOptions,
) -> Result<farmap_pipeline::Mirrored, OpenError> {
    let p = Box::pin(open_store_async(primary)).await?;
    let m = Box::pin(open_store_async(mirror)).await?;
    farmap_pipeline::Mirrored::new(p, m, options).map_err(store_error(spec))
}

/// Opens (or creates) the local store a spec names; remote and stage specs need
/// [`open_store_async`] (or [`open_store_blocking`](super::open_store_blocking)).
pub fn open_store(spec: &StoreSpec) -> Result<Arc<dyn Store>, OpenError> {
    spec.kind.scheme().open_local(spec).unwrap_or_else(|| {
        Err(OpenError::NeedsAsync {
            spec: spec.to_string(),
        })
    })
}
