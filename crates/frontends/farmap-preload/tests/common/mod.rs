//! What the tests of the library share: where the built `.so` is, running a program under
//! it, and reading its `FARMAP_PRELOAD_DEBUG` stats line.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

/// The library cargo built for these tests (`cargo test` builds the crate's cdylib next to
/// the test binaries, in `target/<profile>/deps`, and copies it to `target/<profile>`).
pub fn library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    for dir in [deps, deps.parent().unwrap()] {
        let so = dir.join("libfarmap_preload.so");
        if so.exists() {
            return so;
        }
    }
    panic!("libfarmap_preload.so not found next to {}", exe.display());
}

/// `program args...` with the library preloaded and its stats line on.
pub fn preloaded(program: &str) -> Command {
    let mut cmd = Command::new(program);
    cmd.env("LD_PRELOAD", library())
        .env("FARMAP_PRELOAD_DEBUG", "1")
        .env_remove("FARMAP_RUN_SOCK");
    cmd
}

/// The library's stats line (`farmap-preload: stats ...`) in a program's stderr, as
/// `key=value` pairs; panics if there is none.
pub fn stats(out: &Output) -> Vec<(String, String)> {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let line = stderr
        .lines()
        .rfind(|l| l.starts_with("farmap-preload: stats "))
        .unwrap_or_else(|| panic!("no stats line in stderr: {stderr}"));
    line.split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// One value of the stats line.
pub fn stat(stats: &[(String, String)], key: &str) -> String {
    stats
        .iter()
        .find(|(k, _)| k == key)
        .unwrap_or_else(|| panic!("no {key} in {stats:?}"))
        .1
        .clone()
}

/// One counter of the stats line.
pub fn count(stats: &[(String, String)], key: &str) -> u64 {
    stat(stats, key).parse().unwrap()
}

/// Fails with the program's output unless it exited with 0.
pub fn assert_success(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}: {:?}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A Python script that allocates `mib` MiB of tagged 64 KiB `bytearray`s and a list of
/// ints in each of `threads` threads, keeps them all, then checks every one; prints `ok`
/// or what was wrong.
pub fn python_tagged(threads: usize, mib: usize) -> String {
    format!(
        r#"
import struct, sys, threading
THREADS, MIB, SZ = {threads}, {mib}, 64 * 1024
PER = MIB * 1024 * 1024 // SZ // THREADS
bad = []
def pattern(t, i):
    return struct.pack('<QQ', t + 1, i) * (SZ // 16)
def work(t):
    bufs = [bytearray(pattern(t, i)) for i in range(PER)]
    ints = [t * 10**12 + i for i in range(100000)]
    for i, b in enumerate(bufs):
        if len(b) != SZ or b != pattern(t, i):
            bad.append(('buf', t, i))
            return
    for i, v in enumerate(ints):
        if v != t * 10**12 + i:
            bad.append(('int', t, i))
            return
ts = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
for t in ts: t.start()
for t in ts: t.join()
print('ok' if not bad else 'bad %r' % bad[:5])
"#
    )
}
