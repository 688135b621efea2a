//! Helpers shared by the userfaultfd tests.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use farmap_core::{ChunkIdx, Geometry, Store};
use farmap_pipeline::PushOptions;
use farmap_store::MemoryStore;
use farmap_testkit::pattern_bytes;
use farmap_uffd::{RegionOptions, WriteTracking};

/// Whether userfaultfd works here. Prints "skipped: <why>" when it does not; under CI=true a
/// missing userfaultfd fails the test instead (CI machines support everything).
pub fn uffd_available(test: &str) -> bool {
    match farmap_uffd::probe() {
        Ok(_) => true,
        Err(e) => {
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("{test}: userfaultfd must work under CI=true: {e}");
            }
            println!("skipped: {test}: {e}");
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

/// Reads one byte of region memory through a raw pointer (for threads sharing a region).
pub fn peek(base: *mut u8, offset: usize) -> u8 {
    // SAFETY: the callers pass offsets inside a live region; volatile because other threads
    // write the same memory.
    unsafe { base.add(offset).read_volatile() }
}

/// Writes one byte of region memory through a raw pointer.
pub fn poke(base: *mut u8, offset: usize, v: u8) {
    // SAFETY: as in `peek`.
    unsafe { base.add(offset).write_volatile(v) }
}

/// A pointer that may cross threads (the region outlives the threads in every test).
#[derive(Clone, Copy)]
pub struct SendPtr(pub *mut u8);
// SAFETY: region memory is shared memory; the tests join their threads before the region drops.
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

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
