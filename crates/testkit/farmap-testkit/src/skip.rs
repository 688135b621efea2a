//! Skipped tests are counted, never silent.
//!
//! A test that cannot run here (no userfaultfd, no server, not root) calls [`skip`] and
//! returns. [`skip`] prints `skipped: <test>: <why>` and appends the same line to the file
//! named by `FARMAP_SKIP_LOG` (set by `scripts/test.sh`, which prints how many tests skipped
//! and fails under `CI=true` if any did). Under `CI=true`, [`skip`] panics instead: the CI
//! machine has everything the suite needs, so a skip there is a failure.
//!
//! The checks a test makes first: [`unless`] (a probe or a service that may fail),
//! [`fuse_mountable`], [`program`]; [`tools::need`](crate::tools::need) installs Debian
//! packages a test needs.

use std::io::Write;

/// Whether this run is CI (`CI=true`), where nothing may be skipped.
pub fn is_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// Records that `test` is skipped because of `why` (see the [module docs](self)).
///
/// # Panics
/// Under `CI=true`: nothing that this machine can run may be skipped there.
pub fn skip(test: &str, why: impl std::fmt::Display) {
    let line = format!("skipped: {test}: {why}");
    if let Some(path) = std::env::var_os("FARMAP_SKIP_LOG") {
        append(std::path::Path::new(&path), &line);
    }
    if is_ci() {
        panic!("{line} (under CI=true nothing may be skipped)");
    }
    println!("{line}");
}

/// The value of `ready`, or `None` after recording (see [`skip`]) that `test` is skipped
/// because of its error: what a test that needs something of this machine or a service
/// calls first.
///
/// ```text
/// let Some(support) = skip::unless(test, farmap_uffd::probe()) else { return };
/// let Some(redis) = skip::unless(test, Service::shared("redis")) else { return };
/// ```
pub fn unless<T, E: std::fmt::Display>(test: &str, ready: Result<T, E>) -> Option<T> {
    match ready {
        Ok(v) => Some(v),
        Err(e) => {
            skip(test, e);
            None
        }
    }
}

/// Whether this process runs as root (effective user id 0).
pub fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// Whether FUSE file systems can be mounted here (`/dev/fuse`, and root: the mounts are made
/// without fusermount3); records that `test` is skipped, and why, when not.
pub fn fuse_mountable(test: &str) -> bool {
    if !std::path::Path::new("/dev/fuse").exists() {
        skip(test, "/dev/fuse is missing (no FUSE in this kernel)");
        return false;
    }
    if !is_root() {
        skip(test, "mounting FUSE without fusermount3 needs root");
        return false;
    }
    true
}

/// Whether `program ARGS` can be started here (its exit status does not matter); records
/// that `test` is skipped because `program` is missing when not.
pub fn program(test: &str, program: &str, args: &[&str]) -> bool {
    if std::process::Command::new(program)
        .args(args)
        .output()
        .is_ok()
    {
        return true;
    }
    skip(test, format!("{program} is missing"));
    false
}

/// Appends `line` to the skip log at `path` (best effort: a log that cannot be written must
/// not fail the test that skips; `scripts/test.sh` creates it before the run).
fn append(path: &std::path::Path, line: &str) {
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        // One write per line (O_APPEND): lines from parallel tests do not interleave.
        let _ = f.write_all(format!("{line}\n").as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_appended_whole() {
        let dir = std::env::temp_dir().join(format!("farmap-skip-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("log");
        let threads: Vec<_> = (0..8)
            .map(|i| {
                let log = log.clone();
                std::thread::spawn(move || {
                    for j in 0..50 {
                        append(&log, &format!("skipped: t{i}: reason {j}"));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let text = std::fs::read_to_string(&log).unwrap();
        assert_eq!(text.lines().count(), 400);
        assert!(text
            .lines()
            .all(|l| l.starts_with("skipped: t") && l.contains(": reason ")));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
