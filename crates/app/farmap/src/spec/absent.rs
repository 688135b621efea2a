//! [`Reopening`]: a side of a `mirror:` that could not be reached when the mirror was opened.
//! Every operation fails (`Unavailable`, naming the store and why) while it stays
//! unreachable, and it tries to open it again, at most once per interval, in the background;
//! once that works (with the same geometry), operations go to it. The mirror stage treats it
//! as a primary that is down: it serves from the mirror, notes writes for the resync, and
//! probes until this answers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use farmap_core::{
    BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, ErrorKind, Geometry, Store, StoreError,
    StoreResult,
};
use std::sync::Mutex;

/// Opens the store again: the store, or why not.
pub(super) type Opener =
    Arc<dyn Fn() -> BoxFuture<'static, Result<Arc<dyn Store>, String>> + Send + Sync>;

/// A store opened again and again until it can be (see the module docs).
pub(super) struct Reopening {
    /// The store's spec, for messages.
    spec: String,
    open: Opener,
    geometry: Geometry,
    caps: Caps,
    every: Duration,
    state: Arc<Mutex<Side>>,
}

struct Side {
    store: Option<Arc<dyn Store>>,
    /// Why it could not be opened last.
    why: String,
    last_try: Instant,
    trying: bool,
}

impl std::fmt::Debug for Reopening {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reopening")
            .field("spec", &self.spec)
            .field(
                "open",
                &self
                    .state
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .store
                    .is_some(),
            )
            .finish()
    }
}

impl Reopening {
    /// The store `spec` that `open` opens, which failed to open with `why`; it is expected
    /// to have `geometry` and `caps` (the other side's), and is tried again at most every
    /// `every`.
    pub(super) fn new(
        spec: String,
        open: Opener,
        geometry: Geometry,
        caps: Caps,
        why: String,
        every: Duration,
    ) -> Reopening {
        Reopening {
            spec,
            open,
            geometry,
            caps,
            every,
            state: Arc::new(Mutex::new(Side {
                store: None,
                why,
                last_try: Instant::now(),
                trying: false,
            })),
        }
    }

    /// The store, once open; else starts an attempt (when none runs and the last is older
    /// than the interval) and fails saying why.
    fn store(&self) -> StoreResult<Arc<dyn Store>> {
        let mut side = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = &side.store {
            return Ok(s.clone());
        }
        if !side.trying && side.last_try.elapsed() >= self.every {
            side.trying = true;
            side.last_try = Instant::now();
            let (spec, state, geometry) = (self.spec.clone(), self.state.clone(), self.geometry);
            let opening = (self.open)();
            tokio::spawn(async move {
                let opened = opening.await;
                let mut side = state.lock().unwrap_or_else(|e| e.into_inner());
                side.trying = false;
                match opened {
                    Ok(s) if s.geometry() == geometry => {
                        tracing::info!("{spec} can be reached again");
                        side.store = Some(s);
                    }
                    Ok(s) => {
                        side.why = format!(
                            "it answers with another geometry ({}, not {geometry})",
                            s.geometry()
                        );
                    }
                    Err(why) => side.why = why,
                }
            });
        }
        Err(StoreError::new(
            ErrorKind::Unavailable,
            format!("{} cannot be reached: {}", self.spec, side.why),
        ))
    }
}

impl Store for Reopening {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn caps(&self) -> Caps {
        match &self.state.lock().unwrap_or_else(|e| e.into_inner()).store {
            Some(s) => s.caps(),
            None => self.caps,
        }
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        Box::pin(async move { self.store()?.read(idx).await })
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move { self.store()?.write(idx, data).await })
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move { self.store()?.flush().await })
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        Box::pin(async move { self.store()?.trim(range).await })
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        Box::pin(async move { self.store()?.status(idx).await })
    }
}
