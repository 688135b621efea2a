//! `farmap-fuzz-seeds [DIR]`: writes the seed corpus of every fuzz target to `DIR`
//! (default `fuzz/corpus`, run from the repository's root) as `DIR/<target>/seed-<name>`.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let dir = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "fuzz/corpus".into()),
    );
    match farmap_fuzz_seeds::write_all(&dir) {
        Ok(n) => {
            println!("wrote {n} seeds to {}", dir.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("farmap-fuzz-seeds: cannot write to {}: {e}", dir.display());
            ExitCode::FAILURE
        }
    }
}
