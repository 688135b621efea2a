//! Every stage's conformance suite over the real local stores (sparse memory, file, dir), not
//! only over the single-mutex model store: the stages must keep the Store contract whatever
//! backs them (stores that run on the blocking pool, replace files by rename, punch holes).

use std::sync::Arc;
use std::time::Duration;

use farmap_core::{ErrorKind, Store};
use farmap_pipeline::pusher::{PushOptions, Pusher};
use farmap_pipeline::retry::RetryPolicy;
use farmap_pipeline::{
    Cached, Counting, DelayOptions, Delayed, FaultPlan, FaultTrigger, Faulty, GateState, Gated,
    OpSet, Tracked, Unaligned,
};
use parking_lot::Mutex;
use tempfile::TempDir;

mod common;
use common::Backing;

/// Runs the conformance suite over the stage `wrap` builds around a fresh `kind` store.
async fn conforms<F>(kind: Backing, wrap: F)
where
    F: Fn(Arc<dyn Store>, Arc<dyn Store>) -> Arc<dyn Store>,
{
    // The temporary directories of file and dir stores live until the suite is done.
    let dirs: Mutex<Vec<TempDir>> = Mutex::new(Vec::new());
    farmap_testkit::run_conformance(|g| {
        let (store, dir) = common::new_store(kind, g);
        let (second, dir2) = common::new_store(kind, g);
        dirs.lock().extend(dir.into_iter().chain(dir2));
        let stage = wrap(store, second);
        async move { stage }
    })
    .await;
}

async fn every_stage_over(kind: Backing) {
    conforms(kind, |s, _| Arc::new(Counting::new(s))).await;
    let never = FaultPlan {
        ops: OpSet::ALL,
        trigger: FaultTrigger::Never,
        kind: ErrorKind::Io,
    };
    conforms(kind, |s, _| Arc::new(Faulty::new(s, never))).await;
    let delay = DelayOptions {
        latency: Duration::from_micros(50),
        bandwidth: None,
    };
    conforms(kind, |s, _| Arc::new(Delayed::new(s, delay))).await;
    conforms(kind, |s, _| Arc::new(Gated::new(s, GateState::Open))).await;
    conforms(kind, |s, _| Arc::new(Unaligned::new(s))).await;
    conforms(kind, |s, _| Arc::new(Tracked::new(s))).await;
    conforms(kind, |local, remote| {
        Arc::new(Cached::new(local, remote).expect("equal geometries"))
    })
    .await;
    conforms(kind, |local, remote| {
        let opts = PushOptions {
            checkpoint_every: None,
            workers: 4,
            interval: Some(Duration::from_millis(1)),
            retry: RetryPolicy::none(),
        };
        Arc::new(Pusher::new(local, remote, opts).expect("equal geometries"))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stages_conform_over_the_memory_store() {
    every_stage_over(Backing::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stages_conform_over_the_file_store() {
    every_stage_over(Backing::File).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stages_conform_over_the_dir_store() {
    every_stage_over(Backing::Dir).await;
}
