//! Programs a test runs (nbdkit, qemu-nbd, libnbd's tools...), installed when missing.

use std::path::PathBuf;
use std::process::Command;

/// Where `bin` is on `PATH`, if it is.
pub fn which(bin: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join(bin))
            .find(|p| p.is_file())
    })
}

/// Makes sure the programs of `tools` (`(program, Debian package)` pairs) are installed:
/// the packages of the missing ones are installed with apt-get, under a lock shared by every
/// test. `false` (after recording that `test` is skipped, naming what is missing) when they
/// cannot be.
pub fn need(test: &str, tools: &[(&str, &str)]) -> bool {
    let mut missing: Vec<&str> = tools
        .iter()
        .filter(|(bin, _)| which(bin).is_none())
        .map(|(_, pkg)| *pkg)
        .collect();
    if missing.is_empty() {
        return true;
    }
    missing.sort_unstable();
    missing.dedup();
    let script = format!(
        "flock /tmp/farmap-apt.lock sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
         apt-get install -y -qq --no-install-recommends {}'",
        missing.join(" ")
    );
    // Whether apt-get succeeded matters less than whether the programs are there now.
    let _ = Command::new("sh").arg("-c").arg(script).output();
    let still: Vec<String> = tools
        .iter()
        .filter(|(bin, _)| which(bin).is_none())
        .map(|(bin, pkg)| format!("{bin} ({pkg})"))
        .collect();
    if still.is_empty() {
        return true;
    }
    crate::skip(
        test,
        format!("{} missing and could not be installed", still.join(", ")),
    );
    false
}
