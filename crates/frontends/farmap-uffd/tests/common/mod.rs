//! Helpers shared by the userfaultfd tests.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use farmap_core::{ChunkIdx, Geometry, Store};
use farmap_pipeline::PushOptions;
use farmap_store::MemoryStore;
use farmap_testkit::pattern_bytes;
use farmap_uffd::{Region, RegionOptions, WriteTracking};

/// Whether userfaultfd works here. Records a skip (`farmap_testkit::skip`) when it does not;
/// under CI=true that fails the test instead (CI machines support everything).
pub fn uffd_available(test: &str) -> bool {
    match farmap_uffd::probe() {
        Ok(_) => true,
        Err(e) => {
            farmap_testkit::skip(test, e);
            false
        }
    }
}

/// Runs a future to completion on a throwaway runtime.
pub fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
        .block_on(f)
}

/// A writable memory store holding the pattern with `seed`.
pub fn pattern_memory(g: Geometry, seed: u64) -> Arc<MemoryStore> {
    let store = Arc::new(MemoryStore::new(g));
    block_on(async {
        for idx in g.all().iter() {
            let data = pattern_bytes(seed, g.offset_of(idx), g.chunk_len(idx));
            store.write(idx, Bytes::from(data)).await.unwrap();
        }
    });
    store
}

/// The whole content of a store.
pub fn snapshot(store: &dyn Store) -> Vec<u8> {
    let g = store.geometry();
    block_on(async {
        let mut out = Vec::with_capacity(g.size() as usize);
        for idx in g.all().iter() {
            out.extend_from_slice(&store.read(idx).await.unwrap());
        }
        out
    })
}

/// Direct mode, no background push, the given tracking.
pub fn direct(tracking: WriteTracking) -> RegionOptions {
    RegionOptions {
        tracking,
        push: PushOptions {
            interval: None,
            ..PushOptions::default()
        },
        ..RegionOptions::direct()
    }
}

/// Both tracking modes this kernel offers (synchronous always; asynchronous if present).
pub fn tracking_modes() -> Vec<WriteTracking> {
    let mut modes = vec![WriteTracking::SyncFaults];
    if farmap_uffd::probe().is_ok_and(|s| s.tracking == farmap_uffd::TrackingMode::Async) {
        modes.insert(0, WriteTracking::Async);
    }
    modes
}

/// Reads one byte of region memory (a volatile load).
pub fn peek(region: &Region, offset: usize) -> u8 {
    region.memory().load_u8(offset).unwrap()
}

/// Writes one byte of region memory (a volatile store).
pub fn poke(region: &Region, offset: usize, v: u8) {
    region.memory().store_u8(offset, v).unwrap()
}

/// Runs `f` on a thread and waits at most `limit` for it: a hang fails the test instead of
/// hanging it.
pub fn within<T: Send + 'static>(
    limit: Duration,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("{what} did not finish within {limit:?}"))
}

pub fn chunk(i: u64) -> ChunkIdx {
    ChunkIdx(i)
}

/// Waits up to a second for `cond` (counters are bumped just after the faulting thread is
/// woken, so they may lag the memory by a moment).
pub fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(1);
    while !cond() {
        assert!(std::time::Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}
