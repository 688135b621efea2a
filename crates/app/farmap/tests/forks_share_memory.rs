//! Forks of one version share their clean pages in memory: regions opened over forks of a
//! `versioned:` region (in this process and in another one) keep one copy of each clean chunk,
//! and what one fork writes stays its own.

use std::path::Path;
use std::process::Command;

use farmap::versions::{fork, At};
use farmap::{open_region, Region, RegionOptions, StoreSpec};
use farmap_testkit::block_on;

const SIZE: usize = 8 << 20;
const CHILD: &str = "FARMAP_TEST_FORK_CHILD";

fn uffd_available(test: &str) -> bool {
    farmap_testkit::skip::unless(test, farmap_uffd::probe()).is_some()
}

fn spec(objects: &Path, region: &str) -> StoreSpec {
    format!("versioned:(dir:{})/{region}?size=8MiB", objects.display())
        .parse()
        .unwrap()
}

fn opts(shared: &Path) -> RegionOptions {
    RegionOptions {
        shared_dir: Some(shared.to_owned()),
        ..RegionOptions::direct()
    }
}

fn read_all(region: &Region) -> Vec<u8> {
    let mut out = vec![0u8; region.len()];
    region.memory().read_into(0, &mut out).unwrap();
    out
}

fn pattern() -> Vec<u8> {
    (0..SIZE as u64)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect()
}

/// Run as a child process: opens fork `c2`, reads it all, checks it against the base and
/// prints what it filled and mapped.
fn child(objects: &str, shared: &str) {
    let r = open_region(&spec(Path::new(objects), "c2"), opts(Path::new(shared))).unwrap();
    assert_eq!(read_all(&r), pattern(), "the child reads the base");
    let s = r.stats().shared.expect("the child shares");
    println!(
        "child filled={} mapped={}",
        s.filled_chunks, s.mapped_chunks
    );
}

/// A base region written and saved, forked three times. Fork 1 opened here reads everything
/// (fetching and filling the shared file); fork 2, opened in another process, maps every
/// chunk from the file and fills none; fork 3 here maps them too. Fork 1 writes and syncs:
/// its versions hold the write, fork 3 still reads the base, and the file is unchanged.
#[test]
fn forks_share_clean_pages_across_processes() {
    if let (Ok(objects), Ok(shared)) = (std::env::var(CHILD), std::env::var("FARMAP_SHARED")) {
        return child(&objects, &shared);
    }
    if !uffd_available("forks_share_clean_pages_across_processes") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let objects = dir.path().join("objects");
    std::fs::create_dir(&objects).unwrap();
    let shm = tempfile::tempdir_in("/dev/shm").unwrap();
    let shared = shm.path().join("bases");
    let base = pattern();
    {
        let r = open_region(&spec(&objects, "base"), opts(&shared)).unwrap();
        r.memory().write_from(0, &base).unwrap();
        r.sync().unwrap();
        r.close().unwrap();
    }
    let store = block_on(farmap::spec::open_objects(
        &format!("dir:{}", objects.display()).parse().unwrap(),
    ))
    .unwrap();
    let names: Vec<String> = ["c1", "c2", "c3"].map(String::from).to_vec();
    block_on(fork(&*store, "base", &At::Latest, &names)).unwrap();

    let c1 = open_region(&spec(&objects, "c1"), opts(&shared)).unwrap();
    let file = c1.shared_base().expect("a fork shares its base").to_owned();
    assert_eq!(read_all(&c1), base);
    let chunks = c1.geometry().chunk_count();
    let s1 = c1.stats().shared.unwrap();
    assert_eq!((s1.filled_chunks, s1.mapped_chunks), (chunks, chunks));

    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "forks_share_clean_pages_across_processes",
            "--nocapture",
        ])
        .env(CHILD, &objects)
        .env("FARMAP_SHARED", &shared)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(&format!("child filled=0 mapped={chunks}")),
        "the child mapped every chunk from the file and fetched none: {stdout}"
    );

    let c3 = open_region(&spec(&objects, "c3"), opts(&shared)).unwrap();
    assert_eq!(c3.shared_base(), Some(file.as_path()));
    c1.memory().write_from(4096, b"c1 was here").unwrap();
    c1.sync().unwrap();
    let mut expect = base.clone();
    expect[4096..4096 + 11].copy_from_slice(b"c1 was here");
    assert_eq!(read_all(&c1), expect);
    assert_eq!(read_all(&c3), base, "c3 still reads the base");
    let s3 = c3.stats().shared.unwrap();
    assert_eq!((s3.filled_chunks, s3.mapped_chunks), (0, chunks));
    let in_file = std::fs::read(&file).unwrap();
    assert_eq!(
        &in_file[..SIZE],
        &base[..],
        "the shared file holds the base"
    );
    c1.close().unwrap();
    c3.close().unwrap();
    assert!(!file.exists(), "the last region removed the file");

    // c1's write is in its own versions; c3's store still holds the base.
    let again = open_region(&spec(&objects, "c1"), opts(&shared)).unwrap();
    assert_eq!(read_all(&again), expect, "c1 reopened");
    let c3 = open_region(&spec(&objects, "c3"), opts(&shared)).unwrap();
    assert_eq!(read_all(&c3), base, "c3 reopened");
}
