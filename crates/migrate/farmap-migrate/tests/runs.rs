//! Migration in large units: a region with zero pages, half-zero chunks and chunks of data,
//! written during the migration in isolated pages, runs, whole chunks and pages made zero,
//! arrives byte for byte; zero pages cost no bytes on the wire.

mod common;
use common::uffd;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use farmap_core::{Geometry, Store};
use farmap_migrate::{LeechReport, WriterGate};
use farmap_store::MemoryStore;
use farmap_uffd::Region;

const PAGE: u64 = 4096;
const CHUNK: u64 = 64 << 10;
const CHUNKS: u64 = 64;
const SIZE: u64 = CHUNK * CHUNKS;
const PER_CHUNK: u64 = CHUNK / PAGE;

/// Whether page `p` starts as zeros: every page of chunks 0, 4, 8..., every other page of
/// chunks 1, 5, 9...
fn starts_zero(p: u64) -> bool {
    let c = p / PER_CHUNK;
    c.is_multiple_of(4) || (c % 4 == 1 && p % 2 == 1)
}

fn page_of(p: u64, salt: u8) -> Vec<u8> {
    (0..PAGE)
        .map(|i| (i as u8).wrapping_mul(31) ^ (p as u8) ^ salt | 1)
        .collect()
}

/// The source: a region holding the mix above, and its writer gate.
async fn source() -> (Arc<Region>, Arc<WriterGate>) {
    let g = Geometry::new(SIZE, CHUNK).unwrap();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(g));
    common::source_region(store, None, |region| {
        for p in 0..SIZE / PAGE {
            if !starts_zero(p) {
                region
                    .write_at((p * PAGE) as usize, &page_of(p, 0))
                    .unwrap();
            }
        }
    })
    .await
}

async fn migrate(region: Arc<Region>, gate: Arc<WriterGate>) -> LeechReport {
    common::migrate(region, gate, farmap_migrate::seed::PUSH_BUDGET, |o| o).await
}

fn assert_same(source: &Region, dest: &Region) {
    let mut want = vec![0u8; SIZE as usize];
    let mut got = vec![0u8; SIZE as usize];
    source.read_at(0, &mut want).unwrap();
    dest.read_at(0, &mut got).unwrap();
    for p in 0..SIZE / PAGE {
        let r = (p * PAGE) as usize..((p + 1) * PAGE) as usize;
        assert!(
            want[r.clone()] == got[r],
            "page {p} differs after the migration"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_pages_cost_no_bytes_on_the_wire() {
    if !uffd("zero_pages_cost_no_bytes_on_the_wire") {
        return;
    }
    let (region, gate) = source().await;
    let zero_pages = (0..SIZE / PAGE).filter(|p| starts_zero(*p)).count() as u64;
    assert!(zero_pages > 0 && zero_pages < SIZE / PAGE);
    let report = migrate(region.clone(), gate).await;
    assert_same(&region, &report.region);
    // Nothing was written during the migration: every byte fetched is a page of data, and
    // the zero pages (a quarter and an eighth of the region) took none.
    assert_eq!(
        report.bytes_precopy + report.bytes_postcopy,
        (SIZE / PAGE - zero_pages) * PAGE,
        "bytes fetched: {} before and {} after the hand-over",
        report.bytes_precopy,
        report.bytes_postcopy
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_written_in_pages_runs_chunks_and_zeros_arrives_byte_for_byte() {
    if !uffd("a_region_written_in_pages_runs_chunks_and_zeros_arrives_byte_for_byte") {
        return;
    }
    let (region, gate) = source().await;
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (region, gate, stop) = (region.clone(), gate.clone(), stop.clone());
        std::thread::spawn(move || {
            let pages = SIZE / PAGE;
            let mut writes = 0u64;
            for i in 1u64.. {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(_pass) = gate.enter(Duration::from_millis(50)) else {
                    break; // Ownership moved.
                };
                let salt = i as u8 | 1;
                match i % 4 {
                    // An isolated page.
                    0 => {
                        let p = (i * 37) % pages;
                        region
                            .write_at((p * PAGE) as usize, &page_of(p, salt))
                            .unwrap();
                    }
                    // A run of five pages, across a chunk boundary now and then.
                    1 => {
                        let p = (i * 101) % (pages - 5);
                        for k in p..p + 5 {
                            region
                                .write_at((k * PAGE) as usize, &page_of(k, salt))
                                .unwrap();
                        }
                    }
                    // A whole chunk.
                    2 => {
                        let c = (i * 7) % CHUNKS;
                        let data: Vec<u8> = (c * PER_CHUNK..(c + 1) * PER_CHUNK)
                            .flat_map(|p| page_of(p, salt))
                            .collect();
                        region.write_at((c * CHUNK) as usize, &data).unwrap();
                    }
                    // A page of data made zero again.
                    _ => {
                        let p = (i * 53) % pages;
                        region
                            .write_at((p * PAGE) as usize, &[0u8; PAGE as usize])
                            .unwrap();
                    }
                }
                writes += 1;
                drop(_pass);
                std::thread::sleep(Duration::from_micros(300));
            }
            writes
        })
    };
    let report = migrate(region.clone(), gate).await;
    stop.store(true, Ordering::Relaxed);
    let writes = writer.join().unwrap();
    assert!(writes > 0, "the writer wrote during the migration");
    assert!(
        report.dirty_pages > 0,
        "pages were written during the migration"
    );
    assert_same(&region, &report.region);
}
