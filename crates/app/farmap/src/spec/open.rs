//! Opening the store a parsed spec names: local stores from any code, network stores and
//! stages on an async runtime (or a runtime of their own, [`open_store_blocking`]).

use std::sync::Arc;

use farmap_core::Store;

use super::absent::{Opener, Reopening};
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
///
/// One side that cannot be reached (a server down) does not stop it: the stage starts with
/// that side down (a warning names it), serves from the other, notes what the missing side
/// is owed, and tries to reach it again in the background. What is owed is kept in a journal
/// ([`mirror_journal_path`]) so that it outlives this process.
pub async fn open_mirror(
    spec: &StoreSpec,
    primary: &StoreSpec,
    mirror: &StoreSpec,
    options: farmap_pipeline::MirrorOptions,
) -> Result<farmap_pipeline::Mirrored, OpenError> {
    let p = Box::pin(open_store_async(primary)).await;
    let m = Box::pin(open_store_async(mirror)).await;
    let every = options.probe.max(std::time::Duration::from_secs(1));
    let absent = |side: &StoreSpec, other: &Arc<dyn Store>, e: &OpenError| -> Arc<dyn Store> {
        let spec = side.clone();
        let open: Opener = Arc::new(move || {
            let spec = spec.clone();
            Box::pin(async move {
                Box::pin(open_store_async(&spec))
                    .await
                    .map_err(|e| farmap_core::error_chain(&e))
            })
        });
        Arc::new(Reopening::new(
            side.to_string(),
            open,
            other.geometry(),
            other.caps(),
            farmap_core::error_chain(e),
            every,
        ))
    };
    let (p, m) = match (p, m) {
        (Ok(p), Ok(m)) => (p, m),
        (Err(e), Ok(m)) if unreachable(&e) => {
            tracing::warn!(
                "mirror: the primary {primary} cannot be reached ({}): serving from the mirror \
                 {mirror}; writes are noted for the primary's resync",
                farmap_core::error_chain(&e)
            );
            (absent(primary, &m, &e), m)
        }
        (Ok(p), Err(e)) if unreachable(&e) => {
            tracing::warn!(
                "mirror: the mirror {mirror} cannot be reached ({}): serving from the primary \
                 {primary}; chunks written meanwhile are refused if the primary fails before \
                 they are written again",
                farmap_core::error_chain(&e)
            );
            let m = absent(mirror, &p, &e);
            (p, m)
        }
        (Err(e), _) | (_, Err(e)) => return Err(e),
    };
    let journal = mirror_journal_path(primary, mirror);
    farmap_pipeline::Mirrored::with_journal(p, m, options, journal.as_deref())
        .map_err(store_error(spec))
}

/// Whether opening failed because the store could not be reached (rather than refused).
fn unreachable(e: &OpenError) -> bool {
    use farmap_core::ErrorKind as K;
    matches!(
        e,
        OpenError::Store { source, .. }
            if matches!(source.kind(), K::Unavailable | K::Timeout | K::Closed | K::Io)
    )
}

/// Where a `mirror:` of `primary` and `mirror` keeps what its stores are owed:
/// `$XDG_STATE_HOME/farmap/mirror/<hash>.journal` (else `~/.local/state/...`), the hash
/// (64-bit FNV-1a) of the two specs; `None` without either variable. The file exists only
/// while something is owed.
pub fn mirror_journal_path(primary: &StoreSpec, mirror: &StoreSpec) -> Option<std::path::PathBuf> {
    let state = match std::env::var_os("XDG_STATE_HOME").filter(|v| !v.is_empty()) {
        Some(dir) => std::path::PathBuf::from(dir),
        None => std::path::PathBuf::from(std::env::var_os("HOME")?).join(".local/state"),
    };
    let key = format!("{primary}\n{mirror}");
    let hash = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    Some(state.join(format!("farmap/mirror/{hash:016x}.journal")))
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
