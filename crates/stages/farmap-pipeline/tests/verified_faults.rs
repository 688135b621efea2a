//! The data-safety bar of `Verified`: with 100,000 injected data faults (flipped bits, torn
//! writes, lost writes, stale reads) under it, no read returns anything but the newest
//! acknowledged content of its chunk; without it, the same run serves bad chunks.

use std::sync::Arc;

use bytes::Bytes;
use farmap_core::{ChunkIdx, ErrorKind, Geometry, Store};
use farmap_pipeline::{DataFaults, Faulty, Verified, VerifiedLayout};
use farmap_store::MemoryStore;
use farmap_testkit::versioned_chunk;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const FAULTS: u64 = 100_000;

#[derive(Debug, Default)]
struct Outcome {
    reads: u64,
    bad_served: u64,
    refused: u64,
    injected: u64,
}

async fn run(verified: bool) -> Outcome {
    let g = Geometry::new(128 * 4096, 4096).unwrap();
    let faults = DataFaults {
        corrupt_reads: 100_000,
        torn_writes: 100_000,
        lost_writes: 100_000,
        stale_reads: 100_000,
        seed: 0x5afe,
    };
    let faulty = Arc::new(Faulty::with_data_faults(
        MemoryStore::new(VerifiedLayout::inner_geometry_for(g)),
        faults,
    ));
    let store: Arc<dyn Store> = if verified {
        Arc::new(
            Verified::open(faulty.clone(), Some(g.size()))
                .await
                .unwrap(),
        )
    } else {
        faulty.clone()
    };
    if verified {
        assert_eq!(
            store.geometry(),
            g,
            "the verified region is exactly the one asked for"
        );
    }
    let mut model: Vec<Bytes> = (0..g.chunk_count())
        .map(|_| Bytes::from(vec![0u8; 4096]))
        .collect();
    let mut rng = SmallRng::seed_from_u64(42);
    let mut out = Outcome::default();
    let mut version = 0u64;
    while faulty.data_injected().total() < FAULTS {
        let idx = rng.gen_range(0..g.chunk_count());
        if rng.gen_bool(0.5) {
            version += 1;
            let data = versioned_chunk(idx, version, 4096);
            store.write(ChunkIdx(idx), data.clone()).await.unwrap();
            model[idx as usize] = data;
        } else {
            out.reads += 1;
            match store.read(ChunkIdx(idx)).await {
                Ok(data) => {
                    if data != model[idx as usize] {
                        out.bad_served += 1;
                    }
                }
                Err(e) => {
                    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
                    out.refused += 1;
                }
            }
        }
        if version % 5000 == 4999 {
            store.flush().await.unwrap();
        }
    }
    let counts = faulty.data_injected();
    out.injected = counts.total();
    assert!(
        counts.corrupted > 10_000
            && counts.torn > 10_000
            && counts.lost > 10_000
            && counts.stale > 10_000,
        "every kind of fault is exercised: {counts:?}"
    );
    out
}

#[tokio::test]
async fn verified_serves_no_bad_chunk_under_100k_faults() {
    let with = run(true).await;
    assert!(with.injected >= FAULTS);
    assert_eq!(with.bad_served, 0, "{with:?}");
    assert!(
        with.refused > 0,
        "faults were caught, not avoided: {with:?}"
    );

    let without = run(false).await;
    assert!(
        without.bad_served > 1000,
        "without Verified the same faults serve bad chunks: {without:?}"
    );
    assert_eq!(without.refused, 0);
    eprintln!("with Verified: {with:?}; without: {without:?}");
}
