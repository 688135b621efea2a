//! The `farmap` binary of this crate, for the tests that run it (the helpers they share are
//! in farmap-testkit: `cli`, `process`, `tls`...).

use farmap_testkit::cli::Cli;

pub mod hostile;

/// The `farmap` binary built for these tests.
pub fn farmap() -> Cli {
    Cli::new(env!("CARGO_BIN_EXE_farmap"))
}

/// The interposition library `farmap run` loads, from this build (`cargo test --workspace`
/// builds it, `cargo build -p farmap-preload` too): beside the binary, or in the build's
/// `deps`, where `farmap run` looks by default. `None` (a recorded skip) when it is missing
/// or bounded userfaultfd regions are not available.
#[allow(dead_code)] // not every test binary runs programs under farmap run
pub fn preload_library(test: &str) -> Option<std::path::PathBuf> {
    use farmap_testkit::skip::skip;
    let bin = std::path::PathBuf::from(env!("CARGO_BIN_EXE_farmap"));
    let beside = bin.with_file_name("libfarmap_preload.so");
    let deps = bin.with_file_name("deps").join("libfarmap_preload.so");
    let so = if !beside.is_file() && deps.is_file() {
        deps
    } else {
        beside
    };
    if !so.is_file() {
        skip(
            test,
            format!(
                "{} is missing: build it with `cargo build -p farmap-preload`",
                so.display()
            ),
        );
        return None;
    }
    if let Err(e) = farmap_uffd::probe_paging() {
        skip(
            test,
            format!("bounded userfaultfd regions are not available here: {e}"),
        );
        return None;
    }
    Some(so)
}
