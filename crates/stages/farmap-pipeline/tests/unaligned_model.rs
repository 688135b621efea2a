//! [`Unaligned`] against a plain `Vec<u8>`: random byte-range operations must leave both with
//! the same content, and concurrent partial writes to one chunk must never lose each other.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use farmap_core::{ErrorKind, Geometry, Store};
use farmap_pipeline::{DelayOptions, Delayed, Unaligned};
use farmap_testkit::strategies::{byte_ops, ByteOp};
use farmap_testkit::ModelStore;
use proptest::prelude::*;

/// Applies `ops` to an `Unaligned<ModelStore>` and to a vector, alternating between the
/// borrowed and the owned (`Bytes`) forms of reads and writes.
fn check_against_vec(g: Geometry, ops: Vec<ByteOp>) -> Result<(), TestCaseError> {
    farmap_testkit::block_on(async {
        let u = Unaligned::new(ModelStore::new(g));
        let mut model = vec![0u8; g.size() as usize];
        for (i, op) in ops.into_iter().enumerate() {
            match op {
                ByteOp::Read { offset, len } => {
                    let want = &model[offset as usize..offset as usize + len];
                    if i % 2 == 0 {
                        let mut buf = vec![0xAA; len];
                        u.read_at(offset, &mut buf).await.expect("read_at");
                        prop_assert_eq!(&buf[..], want, "read_at({}, {})", offset, len);
                    } else {
                        let got = u.read_bytes(offset, len).await.expect("read_bytes");
                        prop_assert_eq!(&got[..], want, "read_bytes({}, {})", offset, len);
                    }
                }
                ByteOp::Write { offset, data } => {
                    model[offset as usize..offset as usize + data.len()].copy_from_slice(&data);
                    if i % 2 == 0 {
                        u.write_at(offset, &data).await.expect("write_at");
                    } else {
                        u.write_bytes(offset, Bytes::from(data))
                            .await
                            .expect("write_bytes");
                    }
                }
                ByteOp::Flush => u.flush().await.expect("flush"),
            }
        }
        prop_assert!(u.inner().snapshot() == model, "final content differs");
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn small_chunks_with_a_short_last_one(ops in byte_ops(6 * 4096 + 1234, 4096, 40)) {
        check_against_vec(Geometry::new(6 * 4096 + 1234, 4096).expect("geometry"), ops)?;
    }

    #[test]
    fn large_chunks(ops in byte_ops(4 * 65536, 65536, 24)) {
        check_against_vec(Geometry::new(4 * 65536, 65536).expect("geometry"), ops)?;
    }
}

#[tokio::test]
async fn ranges_outside_the_region_change_nothing() {
    let g = Geometry::new(3 * 4096 + 10, 4096).expect("geometry");
    let u = Unaligned::new(ModelStore::new(g));
    let size = g.size();
    let mut buf = [0u8; 20];
    for (offset, len) in [(size - 10, 20), (size, 1), (u64::MAX - 5, 20)] {
        let e = u.read_at(offset, &mut buf[..len]).await.expect_err("read");
        assert_eq!(e.kind(), ErrorKind::OutOfRange);
        let e = u.read_bytes(offset, len).await.expect_err("read_bytes");
        assert_eq!(e.kind(), ErrorKind::OutOfRange);
        let e = u
            .write_at(offset, &[7; 20][..len])
            .await
            .expect_err("write");
        assert_eq!(e.kind(), ErrorKind::OutOfRange);
        let e = u
            .write_bytes(offset, Bytes::from(vec![7; len]))
            .await
            .expect_err("write_bytes");
        assert_eq!(e.kind(), ErrorKind::OutOfRange);
        let e = u.trim_at(offset, len as u64).await.expect_err("trim");
        assert_eq!(e.kind(), ErrorKind::OutOfRange);
    }
    assert!(u.inner().snapshot().iter().all(|b| *b == 0));
    // The very last byte and empty ranges are fine.
    u.write_at(size - 1, &[9]).await.expect("last byte");
    assert_eq!(&u.read_bytes(size - 1, 1).await.expect("read")[..], &[9]);
    u.write_at(size, &[]).await.expect("empty write at the end");
    assert!(u.read_bytes(size, 0).await.expect("empty read").is_empty());
}

#[tokio::test]
async fn reads_within_a_chunk_share_its_buffer() {
    let g = Geometry::new(4 * 4096, 4096).expect("geometry");
    let u = Unaligned::new(ModelStore::new(g));
    let chunk = Bytes::from(vec![5u8; 4096]);
    u.write_bytes(4096, chunk.clone()).await.expect("write");
    let part = u.read_bytes(4096 + 100, 50).await.expect("read");
    // The model store keeps the very `Bytes` it was given, so a zero-copy path points into it.
    let inside = chunk.as_ptr_range();
    assert!(inside.contains(&part.as_ptr()), "the read copied");
}

#[tokio::test]
async fn trim_at_zeros_exactly_the_range() {
    let g = Geometry::new(5 * 4096, 4096).expect("geometry");
    let u = Unaligned::new(ModelStore::new(g));
    u.write_at(0, &vec![3u8; 5 * 4096]).await.expect("fill");
    u.trim_at(1000, 3 * 4096).await.expect("trim");
    let mut want = vec![3u8; 5 * 4096];
    want[1000..1000 + 3 * 4096].fill(0);
    assert!(u.inner().snapshot() == want);
    // Chunks 1 and 2 were covered whole: trimmed, not written.
    let st = u
        .inner()
        .status(farmap_core::ChunkIdx(1))
        .await
        .expect("status");
    assert_eq!(st, farmap_core::ChunkStatus::Zero);
}

#[test]
fn byte_range_futures_are_send() {
    fn send<T: Send>(_: &T) {}
    let u = Unaligned::new(ModelStore::new(
        Geometry::new(4096, 4096).expect("geometry"),
    ));
    let mut buf = [0u8; 4];
    send(&u.write_at(0, &[1, 2]));
    send(&u.write_bytes(0, Bytes::new()));
    send(&u.read_at(0, &mut buf));
    send(&u.read_bytes(0, 4));
    send(&u.trim_at(0, 4));
}

/// Many tasks write different byte ranges of the same few chunks at once, over a store slow
/// enough that every read-modify-write overlaps others: none may be lost. Without the stripe
/// lock, two tasks would read the same old chunk and the later write would drop the earlier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_partial_writes_to_one_chunk_are_all_kept() {
    const CHUNKS: u64 = 3;
    const PER_CHUNK: u64 = 32;
    const CHUNK: u64 = 65536;
    const SLICE: u64 = CHUNK / PER_CHUNK;
    let g = Geometry::new(CHUNKS * CHUNK, CHUNK).expect("geometry");
    let slow = Delayed::new(
        ModelStore::new(g),
        DelayOptions {
            latency: Duration::from_micros(300),
            bandwidth: None,
        },
    );
    let u = Arc::new(Unaligned::new(slow));
    let tasks: Vec<_> = (0..CHUNKS * PER_CHUNK)
        .map(|n| {
            let u = u.clone();
            tokio::spawn(async move {
                // Task n owns slice n: rounds of writes, each with a new value.
                for round in 1..=3u8 {
                    let value = (n as u8).wrapping_mul(7).wrapping_add(round) | 1;
                    let data = vec![value; SLICE as usize];
                    if n % 2 == 0 {
                        u.write_at(n * SLICE, &data).await.expect("write_at");
                    } else {
                        u.write_bytes(n * SLICE, Bytes::from(data))
                            .await
                            .expect("write_bytes");
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("writer");
    }
    let content = u.inner().inner().snapshot();
    for n in 0..CHUNKS * PER_CHUNK {
        let want = (n as u8).wrapping_mul(7).wrapping_add(3) | 1;
        let slice = &content[(n * SLICE) as usize..((n + 1) * SLICE) as usize];
        assert!(
            slice.iter().all(|b| *b == want),
            "the last write of slice {n} was lost"
        );
    }
}

#[tokio::test]
async fn trims_of_every_shape_zero_exactly_their_range() {
    // Edges inside, on and across chunk boundaries, and the short last chunk.
    let size = 6 * 4096 + 1234;
    let g = Geometry::new(size as u64, 4096).expect("geometry");
    let points: Vec<usize> = [
        0,
        1,
        4095,
        4096,
        4097,
        8192,
        12000,
        6 * 4096,
        size - 1,
        size,
    ]
    .into_iter()
    .collect();
    for &start in &points {
        for &end in points.iter().filter(|e| **e >= start) {
            let u = Unaligned::new(ModelStore::new(g));
            u.write_at(0, &vec![7u8; size]).await.expect("fill");
            u.trim_at(start as u64, (end - start) as u64)
                .await
                .expect("trim");
            let mut want = vec![7u8; size];
            want[start..end].fill(0);
            assert!(
                u.inner().snapshot() == want,
                "trim of {start}..{end} zeroed something else"
            );
        }
    }
}
