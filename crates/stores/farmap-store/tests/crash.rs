//! Crash durability of the file and dir stores, with a real process crash: a writer child
//! process writes and flushes chunks and reports every flush that returned; the test kills it
//! with SIGKILL at a random point, reopens the store, and checks that every acknowledged chunk
//! reads back exactly (or as a later write of it, which a process crash may also keep).
//!
//! The child is `crash_writer_child`, an `#[ignore]`d test this binary runs in a new process
//! with `--ignored --exact`; on its own it does nothing and passes nothing.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use farmap_core::{ChunkIdx, Store};
use farmap_store::{DirOptions, DirStore, FileOptions, FileStore};

const CHUNK: u32 = 16 * 1024;
const CHUNKS: u64 = 32;
const PAGE: usize = 4096;
/// Chunks written between two flushes.
const PER_FLUSH: usize = 4;
const ROUNDS: usize = 50;

const ENV_STORE: &str = "FARMAP_CRASH_STORE";
const ENV_FROM: &str = "FARMAP_CRASH_FROM";
const ENV_SEED: &str = "FARMAP_CRASH_SEED";
const MARK: &str = "FLUSHED ";

/// A small xorshift generator: no dependency, reproducible from the seed the test prints.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Chunk `idx` as written at `version`: 16-byte records of (idx, version), little endian.
fn content(idx: u64, version: u64) -> Bytes {
    let mut out = Vec::with_capacity(CHUNK as usize);
    while out.len() < CHUNK as usize {
        out.extend_from_slice(&idx.to_le_bytes());
        out.extend_from_slice(&version.to_le_bytes());
    }
    Bytes::from(out)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    File,
    Dir,
}

fn open(kind: Kind, path: &Path, read_only: bool) -> Arc<dyn Store> {
    match kind {
        Kind::File => Arc::new(
            FileStore::open(
                path,
                FileOptions {
                    size: Some(u64::from(CHUNK) * CHUNKS),
                    chunk_size: CHUNK,
                    read_only,
                },
            )
            .unwrap(),
        ),
        Kind::Dir => Arc::new(
            DirStore::open(
                path,
                DirOptions {
                    size: Some(u64::from(CHUNK) * CHUNKS),
                    chunk_size: Some(CHUNK),
                    read_only,
                    ..DirOptions::default()
                },
            )
            .unwrap(),
        ),
    }
}

/// The writer: writes `PER_FLUSH` random chunks at each version (from `ENV_FROM` on),
/// flushes, and prints `FLUSHED <version> <idx>,<idx>,...` once the flush returned. Runs until
/// it is killed (or for a bounded number of versions).
#[test]
#[ignore = "child process of kill_writers_at_random_points; run only by it"]
fn crash_writer_child() {
    let Ok(spec) = std::env::var(ENV_STORE) else {
        panic!("{ENV_STORE} is not set: this is a child process of kill_writers_at_random_points");
    };
    let (kind, path) = match spec.split_once(':') {
        Some(("file", p)) => (Kind::File, PathBuf::from(p)),
        Some(("dir", p)) => (Kind::Dir, PathBuf::from(p)),
        _ => panic!("bad {ENV_STORE} {spec:?}"),
    };
    let from: u64 = std::env::var(ENV_FROM).unwrap().parse().unwrap();
    let seed: u64 = std::env::var(ENV_SEED).unwrap().parse().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let store = open(kind, &path, false);
        let mut rng = Rng(seed | 1);
        for version in from..from + 10_000 {
            let mut chunks: Vec<u64> = Vec::new();
            while chunks.len() < PER_FLUSH {
                let idx = rng.below(CHUNKS);
                if !chunks.contains(&idx) {
                    chunks.push(idx);
                }
            }
            let writes = chunks.iter().map(|&idx| {
                let store = store.clone();
                tokio::spawn(async move { store.write(ChunkIdx(idx), content(idx, version)).await })
            });
            for w in writes.collect::<Vec<_>>() {
                w.await.unwrap().unwrap();
            }
            store.flush().await.unwrap();
            let list: Vec<String> = chunks.iter().map(u64::to_string).collect();
            let mut out = std::io::stdout().lock();
            writeln!(out, "{MARK}{version} {}", list.join(",")).unwrap();
            out.flush().unwrap();
        }
    });
}

/// What the parent knows: for each chunk, the version of its last acknowledged write.
struct Acked {
    versions: HashMap<u64, u64>,
    /// Highest version acknowledged so far.
    last: u64,
}

/// Runs one writer until a random point, kills it, and returns the flushes it reported.
fn run_and_kill(kind: Kind, path: &Path, from: u64, rng: &mut Rng, acked: &mut Acked) {
    let spec = match kind {
        Kind::File => format!("file:{}", path.display()),
        Kind::Dir => format!("dir:{}", path.display()),
    };
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "crash_writer_child",
            "--ignored",
            "--exact",
            "--nocapture",
            "-q",
        ])
        .env(ENV_STORE, &spec)
        .env(ENV_FROM, from.to_string())
        .env(ENV_SEED, rng.next().to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    // Kill after a random number of acknowledged flushes (0: possibly before the store is
    // even open), plus a random delay, so the kill lands anywhere in a write or flush.
    let flushes_before_kill = rng.below(12);
    let mut seen = 0;
    let record = |line: &str, acked: &mut Acked| {
        let Some(rest) = line.split(MARK).nth(1) else {
            return false;
        };
        let (version, chunks) = rest.trim().split_once(' ').expect("a flush line");
        let version: u64 = version.parse().unwrap();
        for idx in chunks.split(',') {
            acked.versions.insert(idx.parse().unwrap(), version);
        }
        acked.last = acked.last.max(version);
        true
    };
    while seen < flushes_before_kill {
        let Some(line) = lines.next() else {
            break;
        };
        if record(&line.unwrap(), acked) {
            seen += 1;
        }
    }
    std::thread::sleep(Duration::from_micros(rng.below(3000)));
    child.kill().unwrap();
    // Every line the child finished printing is a flush that returned before the kill.
    for line in lines {
        let Ok(line) = line else { break };
        record(&line, acked);
    }
    let status = child.wait().unwrap();
    assert!(
        !status.success(),
        "the writer must have been killed, not finished: {status}"
    );
}

/// Reopens the store (read-only) and checks every chunk against what was acknowledged.
async fn check(kind: Kind, path: &Path, acked: &Acked, round: usize) {
    let store = open(kind, path, true);
    for idx in 0..CHUNKS {
        let data = store.read(ChunkIdx(idx)).await.unwrap_or_else(|e| {
            panic!("round {round}: {kind:?} chunk {idx} cannot be read after the crash: {e}")
        });
        assert_eq!(data.len(), CHUNK as usize);
        let want = acked.versions.get(&idx).copied().unwrap_or(0);
        // A process crash may keep writes after the last acknowledged flush; they carry
        // versions up to one past the last acknowledged one.
        let version_ok = |v: u64| v >= want && v <= acked.last + 1;
        let mut chunk_versions = Vec::new();
        for page in data.chunks(PAGE) {
            let mut page_version = None;
            for rec in page.chunks(16) {
                let (i, v) = (
                    u64::from_le_bytes(rec[..8].try_into().unwrap()),
                    u64::from_le_bytes(rec[8..].try_into().unwrap()),
                );
                let ok = (i, v) == (0, 0) && want == 0 || i == idx && v != 0 && version_ok(v);
                assert!(
                    ok,
                    "round {round}: {kind:?} chunk {idx} holds record ({i}, version {v}); the \
                     last acknowledged write was version {want} (last flush {})",
                    acked.last
                );
                assert!(
                    *page_version.get_or_insert(v) == v,
                    "round {round}: {kind:?} chunk {idx} has a page mixing two writes"
                );
            }
            chunk_versions.push(page_version.unwrap());
        }
        if kind == Kind::Dir {
            // A dir store chunk is always one whole write.
            assert!(
                chunk_versions.windows(2).all(|w| w[0] == w[1]),
                "round {round}: dir chunk {idx} mixes writes: {chunk_versions:?}"
            );
        }
    }
}

#[tokio::test]
async fn kill_writers_at_random_points() {
    let seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    println!("seed {seed}");
    let mut rng = Rng(seed | 1);
    let dir = tempfile::TempDir::new().unwrap();
    let started = Instant::now();
    for kind in [Kind::File, Kind::Dir] {
        let path = dir.path().join(format!("{kind:?}"));
        // Created here, so that a kill before the child's open still leaves a store to check.
        drop(open(kind, &path, false));
        let mut acked = Acked {
            versions: HashMap::new(),
            last: 0,
        };
        let mut total_flushes = 0;
        for round in 0..ROUNDS {
            // Versions keep growing across rounds, above anything a killed writer may have
            // left behind (at most one past its last acknowledged flush); the new writer
            // starts as if `from - 1` had just been acknowledged.
            let from = acked.last + 2;
            acked.last = from - 1;
            run_and_kill(kind, &path, from, &mut rng, &mut acked);
            total_flushes += usize::from(acked.last >= from);
            check(kind, &path, &acked, round).await;
        }
        assert!(
            total_flushes > ROUNDS / 4,
            "{kind:?}: too few rounds acknowledged a flush ({total_flushes}) to test anything"
        );
        println!(
            "{kind:?}: {ROUNDS} rounds killed, {} chunks acknowledged, {:?} so far",
            acked.versions.len(),
            started.elapsed()
        );
    }
}
