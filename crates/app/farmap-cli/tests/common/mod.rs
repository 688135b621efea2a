//! The `farmap` binary of this crate, for the tests that run it (the helpers they share are
//! in farmap-testkit: `cli`, `process`, `tls`...).

use farmap_testkit::cli::Cli;

pub mod hostile;

/// The `farmap` binary built for these tests.
pub fn farmap() -> Cli {
    Cli::new(env!("CARGO_BIN_EXE_farmap"))
}
