//! What several benchmarks share: the memcpy reference, the process's page faults, the
//! `--chunk` flag, and the one parser of sizes and durations.

pub use farmap_cli_kit::args::{parse_duration, parse_size_arg};

/// The memcpy reference of the benchmarks, in MB/s: `chunk`-sized copies out of `src` into
/// a pre-touched buffer (best of three passes over up to 256 MiB of `src`).
pub fn measure_memcpy(src: &[u8], chunk: usize) -> f64 {
    let n = src.len().min(256 << 20);
    let src = &src[..n];
    let mut dst = vec![0xa5u8; n];
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = std::time::Instant::now();
        for (d, s) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
            d.copy_from_slice(std::hint::black_box(s));
        }
        std::hint::black_box(&mut dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    n as f64 / best / 1e6
}

/// Page faults of this process so far.
#[derive(Debug, Clone, Copy)]
pub struct SelfFaults {
    pub minor: u64,
    pub major: u64,
}

/// Reads this process's page faults from `/proc/self/stat`.
pub fn self_faults() -> anyhow::Result<SelfFaults> {
    use anyhow::Context;
    let stat = std::fs::read_to_string("/proc/self/stat").context("reading /proc/self/stat")?;
    // The fields after the command name (which may hold spaces) start after the last ')'.
    let after = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .context("/proc/self/stat has no ')'")?;
    let fields: Vec<&str> = after.split_whitespace().collect();
    // state(3) ppid pgrp session tty_nr tpgid flags minflt(10) cminflt majflt(12)
    let field = |n: usize| -> anyhow::Result<u64> {
        fields
            .get(n - 3)
            .and_then(|f| f.parse().ok())
            .with_context(|| format!("field {n} of /proc/self/stat"))
    };
    Ok(SelfFaults {
        minor: field(10)?,
        major: field(12)?,
    })
}

/// Applies a `--chunk` flag to `spec` (a power of two from 4 KiB to 4 MiB).
pub fn set_chunk(spec: &mut farmap::StoreSpec, chunk: Option<u64>) -> anyhow::Result<()> {
    if let Some(c) = chunk {
        spec.chunk_size = Some(
            u32::try_from(c)
                .ok()
                .filter(|c| farmap::Geometry::new(1, u64::from(*c)).is_ok())
                .ok_or_else(|| {
                    anyhow::anyhow!("--chunk {c} is not a power of two from 4KiB to 4MiB")
                })?,
        );
    }
    Ok(())
}

/// The memcpy reference for `g`'s chunk size (over up to 256 MiB), measured on a blocking
/// thread.
pub async fn memcpy_reference(g: farmap::Geometry) -> anyhow::Result<f64> {
    use anyhow::Context;
    let chunk = g.chunk_size() as usize;
    tokio::task::spawn_blocking(move || {
        let n = (g.size().min(256 << 20) as usize).max(chunk);
        measure_memcpy(&vec![0x5au8; n], chunk)
    })
    .await
    .context("measuring memcpy")
}

/// `store` with `latency` added to every call (an emulated round trip), no bandwidth limit.
pub fn delayed(
    store: std::sync::Arc<dyn farmap::Store>,
    latency: std::time::Duration,
) -> farmap::pipeline::Delayed<std::sync::Arc<dyn farmap::Store>> {
    farmap::pipeline::Delayed::new(
        store,
        farmap::pipeline::DelayOptions {
            latency,
            bandwidth: None,
        },
    )
}
