//! Direct and managed read throughput of a CQL region (used to check the managed ≥ 3 × direct
//! bar; `farmap bench stores` measures every store the same way).
//!
//! ```text
//! cargo run --release -p farmap-cql --example read_bench -- \
//!     "cql://127.0.0.1:9042/bench?table=t&region=r&size=256MiB&create=true" [WORKERS...]
//! ```
//! Setup (untimed): with `create=true` the region is filled with random data (without, an
//! existing region is read as it is). Then, timed:
//! - `direct-read`: every chunk read in order, one request at a time (what a direct mount
//!   does for a program reading the region front to back);
//! - `managed-read`: `Cached` (dense local memory) + `Puller` with N workers, from the
//!   first request to the last chunk in local memory, for each N given (default 64).

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use farmap_core::{format_size, Store};
use farmap_cql::{CqlSpec, CqlStore};
use farmap_pipeline::{Cached, PullOptions, PullOrder, Puller};
use farmap_store::DenseMemoryStore;
use futures::stream::{self, StreamExt, TryStreamExt};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let spec: CqlSpec = args
        .next()
        .ok_or("usage: read_bench CQL_SPEC [WORKERS...]")?
        .parse()?;
    let workers: Vec<usize> = args.map(|a| a.parse()).collect::<Result<_, _>>()?;
    let workers = if workers.is_empty() {
        vec![64]
    } else {
        workers
    };
    let store = Arc::new(CqlStore::open(&spec).await?);
    let g = store.geometry();
    let mb = |secs: f64| g.size() as f64 / secs / 1e6;

    let started = Instant::now();
    let fill = spec.target.create;
    stream::iter(g.all().iter().filter(|_| fill))
        .map(|idx| {
            let store = store.clone();
            async move {
                let seed = idx.0.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                let data: Vec<u8> = farmap_testkit::XorShift(seed)
                    .take(g.chunk_len(idx))
                    .map(|x| x as u8)
                    .collect();
                store.write(idx, Bytes::from(data)).await
            }
        })
        .buffer_unordered(32)
        .try_collect::<()>()
        .await?;
    println!(
        "{} {} in {} chunks ({} per partition): {:.1} MB/s",
        if fill { "fill" } else { "(no fill)" },
        format_size(g.size()),
        format_size(g.chunk_size().into()),
        store.part_chunks(),
        mb(started.elapsed().as_secs_f64())
    );

    for _ in 0..2 {
        let started = Instant::now();
        for idx in g.all().iter() {
            store.read(idx).await?;
        }
        println!(
            "direct-read: {:.1} MB/s",
            mb(started.elapsed().as_secs_f64())
        );
    }

    for w in workers {
        let cached = Arc::new(Cached::new(DenseMemoryStore::new(g), store.clone())?);
        let started = Instant::now();
        let puller = Puller::start(
            cached.clone(),
            PullOptions {
                workers: w,
                order: PullOrder::Sequential,
                ..PullOptions::default()
            },
        );
        let report = puller.wait().await;
        let secs = started.elapsed().as_secs_f64();
        assert!(cached.is_complete(), "pull incomplete: {report:?}");
        println!("managed-read ({w} workers): {:.1} MB/s", mb(secs));
    }
    Ok(())
}
