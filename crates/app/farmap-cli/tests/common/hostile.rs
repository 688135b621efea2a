//! What the `hostile_*` tests share: a big, mostly sparse file served with a memory budget,
//! and the check that the server's resident memory stayed within it.
#![allow(dead_code)] // only the hostile_* test binaries use these

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use farmap_testkit::cli::Listening;

const MIB: u64 = 1 << 20;

/// `big.img` in `dir`: `size` bytes, of which the first `filled` are written in pieces of
/// `piece` bytes, each piece all `byte(its offset)`; the rest is a hole.
pub fn big_file(
    dir: &Path,
    size: u64,
    filled: u64,
    piece: usize,
    byte: impl Fn(u64) -> u8,
) -> PathBuf {
    let path = dir.join("big.img");
    let mut f = std::fs::File::create(&path).unwrap();
    for at in (0..filled).step_by(piece) {
        f.write_all(&vec![byte(at); piece]).unwrap();
    }
    f.set_len(size).unwrap();
    path
}

/// `farmap serve` of `spec` over `protocol` (`--grpc`, `--nbd`) on a loopback port, with
/// `--max-memory` of `max_memory` bytes (whole MiB), its stderr drained.
pub fn serve_with_budget(protocol: &str, spec: &str, max_memory: u64) -> Listening {
    let budget = format!("{}MiB", max_memory / MIB);
    super::farmap()
        .listening(&[
            "serve",
            protocol,
            "-q",
            spec,
            "--listen",
            "127.0.0.1:0",
            "--max-memory",
            &budget,
        ])
        .drained()
}

/// Asserts that the server's resident memory, at its `peak`, stayed below `max_memory`
/// (its `--max-memory`) + `overhead` (the process itself and the connections' reserves).
pub fn assert_peak_within(peak: u64, max_memory: u64, overhead: u64) {
    assert!(
        peak < max_memory + overhead,
        "VmRSS peaked at {} MiB, over --max-memory {} MiB + {} MiB",
        peak / MIB,
        max_memory / MIB,
        overhead / MIB
    );
}

/// The bar for a good client under attack: at least half its unloaded rate, i.e.
/// `attacked` (the median time of its rounds under attack) under twice `alone` (the same
/// rounds' median with no attack), with 20 ms of slack (a round takes milliseconds).
pub fn keeps_half_rate(alone: Duration, attacked: Duration) -> bool {
    attacked < alone * 2 + Duration::from_millis(20)
}
