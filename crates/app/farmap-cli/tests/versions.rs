//! `versioned:` regions through the CLI: copies make versions, snapshots name them, old
//! versions read back as they were, equal chunks are stored once, and a mount on top saves
//! a version when it is unmounted.

use std::io::{BufRead, BufReader, Seek, SeekFrom, Write};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use farmap_testkit::pattern_bytes;
use farmap_testkit::process::terminate;
use farmap_testkit::skip;

mod common;
use common::farmap;

const MIB: usize = 1 << 20;

fn random(seed: u64, len: usize) -> Vec<u8> {
    pattern_bytes(seed, 0, len)
}

/// Files under `p`, recursively.
fn files(p: &Path) -> usize {
    std::fs::read_dir(p)
        .map(|d| {
            d.map(|e| {
                let e = e.unwrap();
                if e.file_type().unwrap().is_dir() {
                    files(&e.path())
                } else {
                    1
                }
            })
            .sum()
        })
        .unwrap_or(0)
}

#[test]
fn copies_make_versions_and_snapshots_name_them() {
    let dir = tempfile::tempdir().unwrap();
    let objects = dir.path().join("objects");
    let spec = format!("versioned:(dir:{})/r", objects.display());
    let one = random(1, 4 * MIB);
    let mut two = one.clone();
    two[MIB..MIB + 4096].fill(0xee);
    let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
    std::fs::write(&a, &one).unwrap();
    std::fs::write(&b, &two).unwrap();
    let file = |p: &Path| format!("file:{}", p.display());

    farmap().ok(&["cp", &file(&a), &spec]);
    let chunks_after_one = files(&objects.join("chunks"));
    assert_eq!(chunks_after_one, 64, "4 MiB of 64 KiB chunks");
    let snap = farmap().json(&["snapshot", &spec, "first", "--json"]);
    assert_eq!(snap["version"], 1, "{snap}");
    assert_eq!(snap["name"], "first");
    farmap().ok(&["cp", &file(&b), &spec]);
    assert_eq!(
        files(&objects.join("chunks")),
        chunks_after_one + 1,
        "the second copy stores only the chunk that changed"
    );

    let rows = farmap().json_lines(&["versions", &spec, "--json"]);
    let versions: Vec<u64> = rows
        .iter()
        .map(|r| r["version"].as_u64().unwrap())
        .collect();
    assert_eq!(versions, [0, 1, 2], "{rows:?}");
    assert_eq!(rows[1]["names"][0], "first");
    assert_eq!(
        rows[2]["chunks"], 1,
        "version 2 lists the one chunk that changed"
    );
    assert_eq!(rows[2]["size"], 4 * MIB as u64);

    let out = dir.path().join("out.img");
    farmap().ok(&["cp", &format!("{spec}@first"), &file(&out)]);
    assert!(
        std::fs::read(&out).unwrap() == one,
        "@first reads as the first copy"
    );
    std::fs::remove_file(&out).unwrap();
    farmap().ok(&["cp", &spec, &file(&out)]);
    assert!(
        std::fs::read(&out).unwrap() == two,
        "the latest reads as the second"
    );

    let forks = farmap().json_lines(&["fork", &format!("{spec}@first"), "f1", "f2", "--json"]);
    assert_eq!(forks.len(), 2, "{forks:?}");
    assert_eq!(forks[0]["version"], 1);
    let fork = format!("versioned:(dir:{})/f2", objects.display());
    std::fs::remove_file(&out).unwrap();
    farmap().ok(&["cp", &fork, &file(&out)]);
    assert!(
        std::fs::read(&out).unwrap() == one,
        "a fork of @first reads as the first copy"
    );
    let rows = farmap().json_lines(&["versions", &fork, "--json"]);
    assert_eq!(
        rows[0]["from"], "r@1",
        "a fork names where it starts: {rows:?}"
    );
    assert_eq!(rows[0]["chunks"], 0, "and lists no chunk: {rows:?}");

    let err = farmap().fails(&["snapshot", &spec, "first"]);
    assert!(err.contains("already has a snapshot"), "{err}");
    let err = farmap().fails(&["cp", &file(&a), &format!("{spec}@1")]);
    assert!(
        err.contains("read-only") || err.contains("not the latest"),
        "{err}"
    );
    let err = farmap().fails(&["versions", &file(&a)]);
    assert!(err.contains("not a versioned region"), "{err}");
}

/// A mount with `--checkpoint-every` saves what programs wrote as versions while it runs
/// (no fsync needed), and a last one when it is unmounted.
#[test]
fn a_mount_on_a_versioned_region_saves_versions_as_it_runs() {
    let test = "a_mount_on_a_versioned_region_saves_versions_as_it_runs";
    if !skip::fuse_mountable(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let spec = format!(
        "versioned:(dir:{})/m?size=8MiB",
        dir.path().join("objects").display()
    );
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mut child = farmap()
        .command()
        .args([
            "mount",
            mnt.to_str().unwrap(),
            &spec,
            "--checkpoint-every",
            "200ms",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(!line.is_empty(), "farmap mount printed no path");
    let data = random(7, MIB);
    let plain = spec.split('?').next().unwrap().to_owned();
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(line.trim())
            .unwrap();
        f.seek(SeekFrom::Start(3 * MIB as u64)).unwrap();
        f.write_all(&data).unwrap();
        // No fsync: a checkpoint saves it.
        let mut last = 0;
        farmap_testkit::wait::eventually("a checkpoint", Duration::from_secs(20), || {
            let rows = farmap().json_lines(&["versions", &plain, "--json"]);
            last = rows.last().unwrap()["version"].as_u64().unwrap();
            last >= 1
        });
        let img = dir.path().join("checkpoint.img");
        farmap().ok(&[
            "cp",
            &format!("{plain}@{last}"),
            &format!("file:{}", img.display()),
        ]);
        let back = std::fs::read(&img).unwrap();
        assert!(
            back[3 * MIB..4 * MIB] == data[..],
            "the checkpoint holds what was written"
        );
        f.write_all(&data[..4096]).unwrap();
    }
    let out = farmap().run(&["umount", mnt.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let status = child.wait().unwrap();
    assert!(status.success(), "farmap mount exited with {status}");
    terminate(&mut child, Duration::from_secs(10));

    let plain = spec.split('?').next().unwrap();
    let rows = farmap().json_lines(&["versions", plain, "--json"]);
    assert!(rows.len() >= 2, "the sync saved a version: {rows:?}");
    let img = dir.path().join("out.img");
    farmap().ok(&["cp", plain, &format!("file:{}", img.display())]);
    let back = std::fs::read(&img).unwrap();
    assert!(
        back[3 * MIB..4 * MIB] == data[..],
        "what was written through the mount"
    );
    assert!(back[..3 * MIB].iter().all(|b| *b == 0));
}

#[test]
fn gc_moves_garbage_to_the_trash_then_deletes_it_and_keeps_every_version() {
    let dir = tempfile::tempdir().unwrap();
    let objects = dir.path().join("objects");
    let store = format!("dir:{}", objects.display());
    // A store that is not there is refused, and a dry run sets nothing up.
    let e = farmap().fails(&["gc", &store, "--dry-run", "--grace", "1s"]);
    assert!(e.contains("does not exist"), "{e}");
    let e = farmap().fails(&["gc", &store, "--grace", "1ms"]);
    assert!(e.contains("out of range"), "{e}");
    assert!(!objects.exists(), "a refused gc made nothing");
    // The first collection sets the store's grace, before any writer does.
    let set = farmap().json(&["gc", &store, "--grace", "1s", "--json"]);
    assert_eq!(set["grace_ms"], 1000, "{set}");
    assert_eq!(set["chunks"], 0);
    let spec = format!("versioned:({store})/r");
    let data = random(5, 2 * MIB);
    let a = dir.path().join("a.img");
    std::fs::write(&a, &data).unwrap();
    farmap().ok(&["cp", &format!("file:{}", a.display()), &spec]);
    // What a writer that died before its flush leaves: a chunk no version lists.
    let orphan = objects
        .join("chunks/ab")
        .join(format!("ab{}", "0".repeat(62)));
    std::fs::create_dir_all(orphan.parent().unwrap()).unwrap();
    std::fs::write(&orphan, b"\x00garbage").unwrap();

    let dry = farmap().json(&["gc", &store, "--dry-run", "--json"]);
    assert_eq!(
        (dry["trashed"].as_u64(), dry["dry_run"].as_bool()),
        (Some(1), Some(true))
    );
    assert_eq!(dry["chunks"], 33, "{dry}");
    assert_eq!(dry["referenced"], 32);
    assert!(orphan.exists(), "a dry run changes nothing");

    let first = farmap().json(&["gc", &spec, "--json"]);
    assert_eq!(
        (first["trashed"].as_u64(), first["deleted"].as_u64()),
        (Some(1), Some(0))
    );
    assert!(!orphan.exists());
    assert_eq!(files(&objects.join("trash")), 1);
    let e = farmap().fails(&["gc", &store, "--grace", "5s"]);
    assert!(e.contains("cannot change"), "{e}");
    std::thread::sleep(Duration::from_millis(1100));
    let second = farmap().json(&["gc", &store, "--json"]);
    assert_eq!(
        (second["deleted"].as_u64(), second["deleted_bytes"].as_u64()),
        (Some(1), Some(8))
    );
    assert_eq!(files(&objects.join("trash")), 0);

    let out = dir.path().join("out.img");
    farmap().ok(&["cp", &spec, &format!("file:{}", out.display())]);
    assert!(
        std::fs::read(&out).unwrap() == data,
        "the region reads as written"
    );
}

/// A running `farmap mount` of `spec` at `mnt`: the child and the path of its file.
fn mount(spec: &str, mnt: &Path) -> (std::process::Child, String) {
    std::fs::create_dir_all(mnt).unwrap();
    let mut child = farmap()
        .command()
        .args(["mount", mnt.to_str().unwrap(), spec])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(!line.is_empty(), "farmap mount printed no path");
    (child, line.trim().to_owned())
}

fn unmount(mut child: std::process::Child, mnt: &Path) {
    let _ = farmap().run(&["umount", mnt.to_str().unwrap()]);
    terminate(&mut child, Duration::from_secs(10));
}

/// Two processes write one versioned region at once (as two hosts would, each through its
/// own mount): the one that saves second is refused at that flush, every time, and what the
/// first saved stays.
#[test]
fn a_second_writer_in_another_process_is_refused_at_its_first_flush_every_time() {
    let test = "a_second_writer_in_another_process_is_refused_at_its_first_flush_every_time";
    if !skip::fuse_mountable(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let objects = format!("dir:{}", dir.path().join("objects").display());
    second_writers_are_refused(dir.path(), &objects);
}

/// The same through a farmap host (`farmap serve --objects`, a third process): two writers
/// on other "hosts" keep one region there, and the second to save is refused every time.
#[test]
fn a_second_writer_through_a_farmap_objects_server_is_refused_every_time() {
    let test = "a_second_writer_through_a_farmap_objects_server_is_refused_every_time";
    if !skip::fuse_mountable(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let served = format!("dir:{}", dir.path().join("objects").display());
    let server = farmap()
        .listening(&["serve", "--objects", &served, "--listen", "127.0.0.1:0"])
        .drained();
    assert!(
        server.banner().contains("serving the objects in"),
        "{}",
        server.banner()
    );
    second_writers_are_refused(dir.path(), &format!("farmap://{}", server.addr()));
    // A region client is told what this server is.
    let e = farmap().fails(&["info", &format!("farmap://{}", server.addr())]);
    assert!(e.contains("exports objects"), "{e}");
    // The objects are in the served directory, nowhere else.
    assert!(dir.path().join("objects/regions/r0/versions").is_dir());
}

/// Five tries in `dir` of two mounts of one region kept in `objects` (both orders of saving).
fn second_writers_are_refused(dir: &Path, objects: &str) {
    const TRIES: usize = 5;
    for t in 0..TRIES {
        let spec = format!("versioned:({objects})/r{t}?size=1MiB");
        let (one, two) = (dir.join(format!("a{t}")), dir.join(format!("b{t}")));
        let (a, file_a) = mount(&spec, &one);
        let (b, file_b) = mount(&spec, &two);
        let write = |path: &str, byte: u8| {
            let mut f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
            // Which of the two saves first is up to the try: both orders are checked.
            f.write_all(&[byte; 4096]).unwrap();
            f.sync_all()
        };
        let (first, second) = if t % 2 == 0 {
            ((&file_a, 0xaa), (&file_b, 0xbb))
        } else {
            ((&file_b, 0xbb), (&file_a, 0xaa))
        };
        write(first.0, first.1).expect("the first writer saves");
        let e = write(second.0, second.1).expect_err("the second writer is refused");
        assert_eq!(e.raw_os_error(), Some(ESTALE), "try {t}: {e}");
        unmount(a, &one);
        unmount(b, &two);
        let plain = spec.split('?').next().unwrap();
        let img = dir.join(format!("out{t}.img"));
        farmap().ok(&["cp", plain, &format!("file:{}", img.display())]);
        let back = std::fs::read(&img).unwrap();
        assert!(
            back[..4096].iter().all(|b| *b == first.1),
            "try {t}: what the first writer saved stays"
        );
    }
}

/// ESTALE on Linux: what a fenced flush fails with.
const ESTALE: i32 = 116;
