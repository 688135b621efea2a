//! The `farmap` binary, run for real.

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

mod common;
use common::farmap;

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn file_spec(p: &Path, opts: &str) -> String {
    format!("file:{}{opts}", p.display())
}

#[test]
fn help_explains_every_command_and_specs() {
    let o = farmap().run(&["--help"]);
    assert!(o.status.success());
    let out = stdout(&o);
    for word in ["info", "cp", "bench", "STORE SPECS", "memory:SIZE", "KiB"] {
        assert!(out.contains(word), "--help lacks {word:?}:\n{out}");
    }
    let o = farmap().run(&["bench", "pull", "--help"]);
    assert!(o.status.success());
    for word in ["--rtt", "--workers", "--chunk", "--json", "--store"] {
        assert!(stdout(&o).contains(word), "bench pull --help lacks {word}");
    }
}

#[test]
fn bad_specs_give_one_line_errors() {
    for (spec, want) in [
        ("nope:1G", "unknown store scheme"),
        ("memory:12XB", "unknown suffix"),
        ("memory:1GiB?size=2GiB", "conflicting sizes"),
        ("file:/nonexistent-dir/x.img", "x.img"),
    ] {
        let o = farmap().run(&["info", spec]);
        assert!(!o.status.success(), "{spec} should fail");
        let err = stderr(&o);
        // The problem is named on the first line (clap may add its "try --help" hint after).
        let first = err.lines().next().unwrap_or_default();
        assert!(
            first.contains(want),
            "{spec}: {err:?} lacks {want:?} on its first line"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn cp_round_trips_file_to_dir_to_file_and_skips_zeros() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.img");
    // 1 MiB + 1000 bytes: a short last chunk; data in the first and last 64 KiB only.
    let size = (1 << 20) + 1000;
    let mut content = vec![0u8; size];
    for (i, b) in content.iter_mut().enumerate().take(65536) {
        *b = (i % 251) as u8 + 1;
    }
    for b in content.iter_mut().skip(size - 70000) {
        *b = 7;
    }
    std::fs::write(&a, &content).unwrap();
    let chunks = dir.path().join("chunks");
    let o = farmap().run(&[
        "cp",
        "--json",
        &file_spec(&a, "?chunk=4KiB"),
        &format!("dir:{}?chunk=64KiB", chunks.display()),
    ]);
    assert!(o.status.success(), "cp to dir: {}", stderr(&o));
    let report: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(report["size_bytes"], size as u64);
    assert_eq!(report["complete"], true);
    assert!(
        report["skipped_zero_bytes"].as_u64().unwrap() >= 800_000,
        "zero blocks must be skipped: {report}"
    );
    let b = dir.path().join("b.img");
    let o = farmap().run(&[
        "cp",
        "-q",
        &format!("dir:{}", chunks.display()),
        &file_spec(&b, ""),
    ]);
    assert!(o.status.success(), "cp back: {}", stderr(&o));
    assert!(stdout(&o).contains("copied"));
    assert_eq!(
        std::fs::read(&b).unwrap(),
        content,
        "round trip must be exact"
    );

    // A destination of another size is refused and left alone.
    let c = dir.path().join("c.img");
    std::fs::write(&c, vec![9u8; 8192]).unwrap();
    let o = farmap().run(&["cp", &file_spec(&a, ""), &file_spec(&c, "")]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("sizes differ"), "{}", stderr(&o));
    assert_eq!(std::fs::read(&c).unwrap(), vec![9u8; 8192]);
}

#[test]
fn cp_overwrites_stale_data_with_zeros() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.img");
    let b = dir.path().join("b.img");
    std::fs::write(&a, vec![0u8; 256 << 10]).unwrap();
    std::fs::write(&b, vec![0xffu8; 256 << 10]).unwrap();
    let o = farmap().run(&["cp", "-q", &file_spec(&a, ""), &file_spec(&b, "")]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(std::fs::read(&b).unwrap().iter().all(|&x| x == 0));
}

#[test]
fn bench_pull_prints_one_json_line_per_run() {
    let o = farmap().run(&[
        "bench",
        "pull",
        "--store",
        "memory:16MiB",
        "--chunk",
        "64KiB",
        "--rtt",
        "1ms",
        "--workers",
        "32",
        "--runs",
        "2",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let lines: Vec<_> = stdout(&o).lines().map(str::to_owned).collect();
    assert_eq!(lines.len(), 2, "one line per run: {lines:?}");
    for line in lines {
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        for key in [
            "bench",
            "case",
            "store",
            "size_bytes",
            "chunk_bytes",
            "rtt_ms",
            "workers",
            "mb_per_s",
            "memcpy_mb_per_s",
            "ideal_mb_per_s",
        ] {
            assert!(v.get(key).is_some(), "{key} missing from {v}");
        }
        assert_eq!(v["bench"], "pull");
        assert_eq!(v["size_bytes"], 16u64 << 20);
        assert_eq!(v["chunk_bytes"], 65536);
        assert_eq!(v["verified"], true);
        let ideal = v["ideal_mb_per_s"].as_f64().unwrap();
        // 32 workers × 64 KiB / 1 ms ≈ 2097 MB/s, unless memcpy is slower.
        assert!(ideal > 0.0 && ideal <= 2097.2, "{v}");
        assert!(v["mb_per_s"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn bench_push_with_a_mirror_prints_both_cases_and_the_cost() {
    for bench in ["push", "pull"] {
        let o = farmap().run(&[
            "bench",
            bench,
            "--store",
            "memory:8MiB",
            "--rtt",
            "0ms",
            "--runs",
            "2",
            "--mirror-delay",
            "20us",
            "--json",
        ]);
        assert!(o.status.success(), "{bench}: {}", stderr(&o));
        let lines: Vec<serde_json::Value> = stdout(&o)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        // Per run: unmirrored, then mirrored; then the summary.
        assert_eq!(lines.len(), 5, "{bench}: {lines:?}");
        for (i, v) in lines[..4].iter().enumerate() {
            assert_eq!(v["bench"], bench);
            assert_eq!(v["run"], (i / 2 + 1) as u64, "{v}");
            assert_eq!(v["verified"], true, "{v}");
            assert_eq!(v["mirror_delay_us"], 20.0, "{v}");
            let mirrored = i % 2 == 1;
            assert_eq!(v["mirror"], if mirrored { "both" } else { "none" }, "{v}");
            assert_eq!(v.get("mirror_cost").is_some(), mirrored, "{v}");
            assert!(v["page_faults"].is_u64(), "{v}");
            if bench == "push" {
                // The timed push ran on some thread of the process.
                assert!(v["cpu_ms"].as_f64().is_some_and(|ms| ms > 0.0), "{v}");
            }
        }
        // mirror_cost = 1 - mirrored / unmirrored, from rates printed to 0.1 MB/s.
        let cost = lines[1]["mirror_cost"].as_f64().unwrap();
        let (m, u) = (
            lines[1]["mb_per_s"].as_f64().unwrap(),
            lines[0]["mb_per_s"].as_f64().unwrap(),
        );
        assert!(
            farmap_testkit::printed::ratio_agrees(1.0 - cost, 0.001, m, u, 0.1),
            "{cost} against 1 - {m} / {u}"
        );
        let s = &lines[4];
        assert_eq!(
            (s["case"].as_str(), s["mirror"].as_str()),
            (Some("summary"), Some("both")),
            "{s}"
        );
        assert_eq!(s["runs"], 2);
        assert!(s["mirror_cost"].is_f64(), "{s}");
    }
}

#[test]
fn bench_pull_refuses_to_overwrite_an_existing_file() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("precious.img");
    std::fs::write(&a, vec![1u8; 65536]).unwrap();
    let o = farmap().run(&["bench", "pull", "--store", &file_spec(&a, ""), "--json"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--overwrite"), "{}", stderr(&o));
    assert_eq!(std::fs::read(&a).unwrap(), vec![1u8; 65536]);
}

#[test]
fn permission_errors_name_the_path() {
    // Root ignores permission bits, so run farmap as `nobody` (setpriv is part of util-linux).
    use std::os::unix::fs::PermissionsExt;
    if Command::new("setpriv").arg("--version").output().is_err() {
        farmap_testkit::skip(
            "permission_errors_name_the_path",
            "setpriv (util-linux) is not installed",
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = dir.path().join("locked.img");
    std::fs::write(&path, vec![0u8; 65536]).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    let o = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(env!("CARGO_BIN_EXE_farmap"))
        .args(["info", &file_spec(&path, "")])
        .output()
        .unwrap();
    if !stderr(&o).contains("farmap: ") {
        panic!("farmap could not be started as nobody: {}", stderr(&o));
    }
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("locked.img"), "{err}");
    assert!(err.contains("permission denied"), "{err}");
}

#[test]
fn info_reads_a_dir_store_that_a_writer_holds() {
    let tmp = tempfile::TempDir::new().unwrap();
    let dir = tmp.path().join("chunks");
    let spec = format!("dir:{}?size=1MiB", dir.display());
    assert!(farmap().run(&["cp", "memory:1MiB", &spec]).status.success());
    // A writer holds the directory (as a running `farmap cp` or `serve` would).
    let writer = farmap::store::DirStore::open(&dir, farmap::store::DirOptions::default())
        .expect("the writer opens the store");
    let o = farmap().run(&["info", &format!("dir:{}", dir.display())]);
    assert!(o.status.success(), "info reads meanwhile: {}", stderr(&o));
    assert!(stdout(&o).contains("1MiB"), "{}", stdout(&o));
    let o = farmap().run(&["cp", "memory:1MiB", &format!("dir:{}", dir.display())]);
    assert!(!o.status.success(), "a second writer is refused");
    let err = stderr(&o);
    assert!(
        err.contains("in use") && err.contains(&dir.display().to_string()),
        "the refusal names the directory: {err}"
    );
    drop(writer);
    // Closing releases the lock, but a child that another test of this binary forks at that
    // moment holds a copy of the descriptor until its exec: allow for that window.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let o = farmap().run(&["cp", "memory:1MiB", &format!("dir:{}", dir.display())]);
        if o.status.success() {
            break;
        }
        assert!(
            Instant::now() < deadline && stderr(&o).contains("in use"),
            "{}",
            stderr(&o)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn durations_need_a_unit_and_huge_regions_say_how_to_fit() {
    let o = farmap().run(&[
        "proxy",
        "--listen",
        "127.0.0.1:0",
        "--to",
        "127.0.0.1:1",
        "--rtt",
        "30",
    ]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(
        err.contains("a unit is required") && err.contains("ms"),
        "{err}"
    );
    let o = farmap().run(&["info", "farmap://127.0.0.1:1?timeout=30"]);
    assert!(stderr(&o).contains("a unit is required"), "{}", stderr(&o));
    let o = farmap().run(&["info", "memory:1PiB"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("larger chunk size"), "{}", stderr(&o));
}

#[test]
fn verify_scrubs_a_verified_region_and_names_bad_chunks() {
    let dir = tempfile::tempdir().unwrap();
    // 256 chunks of 4 KiB under the stage: 254 of data and 1 of checksums (one unused).
    let region = 254 * 4096;
    let src = dir.path().join("src.img");
    let content: Vec<u8> = (0..region).map(|i| (i % 253) as u8 + 1).collect();
    std::fs::write(&src, &content).unwrap();
    let img = dir.path().join("v.img");
    let verified = format!("verified:({})", file_spec(&img, "?size=1MiB&chunk=4KiB"));
    let o = farmap().run(&["cp", "-q", &file_spec(&src, "?chunk=4KiB"), &verified]);
    assert!(
        o.status.success(),
        "cp into a verified region: {}",
        stderr(&o)
    );

    let o = farmap().run(&["verify", "--json", &verified]);
    assert!(o.status.success(), "a good region: {}", stderr(&o));
    let r: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(r["chunks"], 254);
    assert_eq!(r["checked"], 254);
    assert_eq!(r["bad_chunks"], 0);
    assert_eq!(r["ok"], true);

    // Two chunks change behind the region's back: a flipped bit, and one written over.
    let mut raw = std::fs::read(&img).unwrap();
    raw[7 * 4096 + 100] ^= 0x10;
    raw[200 * 4096..201 * 4096].fill(0xAB);
    std::fs::write(&img, &raw).unwrap();
    // The plain spec is read as the verified region it holds.
    let o = farmap().run(&["verify", "--json", &file_spec(&img, "?chunk=4KiB")]);
    assert_eq!(
        o.status.code(),
        Some(2),
        "bad chunks: exit 2; {}",
        stderr(&o)
    );
    let r: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(r["bad_chunks"], 2, "{r}");
    assert_eq!(r["bad"], serde_json::json!([7, 200]));
    assert_eq!(r["ok"], false);
    // Read through the stage, a bad chunk is an error, never data.
    let out = dir.path().join("out.img");
    let o = farmap().run(&["cp", "-q", &verified, &file_spec(&out, "")]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("corrupt"), "{}", stderr(&o));
}

#[test]
fn info_shows_a_mirrors_state() {
    let dir = tempfile::tempdir().unwrap();
    let spec = format!(
        "mirror:({})({})?policy=primary-first",
        file_spec(&dir.path().join("p.img"), "?size=1MiB"),
        file_spec(&dir.path().join("m.img"), "?size=1MiB")
    );
    let o = farmap().run(&["info", "--json", &spec]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(r["mirror"]["policy"], "primary-first", "{r}");
    assert_eq!(r["mirror"]["primary"], "up", "{r}");
    assert_eq!(r["mirror"]["to_resync"], 0, "{r}");
    let o = farmap().run(&["info", &spec]);
    assert!(
        stdout(&o).contains("mirror:   policy primary-first, primary up"),
        "{}",
        stdout(&o)
    );
}

/// `--log-format json` (or `FARMAP_LOG_FORMAT=json`): every line on stderr is one JSON
/// object; the command's own status and error lines are events of target `farmap::status`;
/// a server's log lines about a connection carry its span (server and peer).
#[test]
fn json_logs_are_one_object_per_line_with_levels_and_spans() {
    let parse = |o: &Output| -> Vec<serde_json::Value> {
        stderr(o)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
            .collect()
    };
    let failed = farmap().run(&["--log-format", "json", "info", "dir:/nonexistent/farmap"]);
    assert!(!failed.status.success());
    let lines = parse(&failed);
    assert_eq!(lines.len(), 1, "{}", stderr(&failed));
    assert_eq!(lines[0]["level"], "ERROR");
    assert_eq!(lines[0]["target"], "farmap::status");
    assert!(lines[0]["fields"]["message"]
        .as_str()
        .unwrap()
        .contains("/nonexistent/farmap"));
    assert!(lines[0]["timestamp"].as_str().unwrap().ends_with('Z'));
    // The environment variable does the same; and a hostile peer of a server is logged in
    // the span of its connection.
    let mut server = farmap().env("FARMAP_LOG_FORMAT", "json").listening(&[
        "serve",
        "memory:4MiB",
        "--listen",
        "127.0.0.1:0",
    ]);
    let log = server.log_stderr();
    let addr = server.addr().to_owned();
    let mut peer = std::net::TcpStream::connect(&addr).unwrap();
    std::io::Write::write_all(&mut peer, b"GARBAGE GARBAGE GARBAGE").unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let warned = loop {
        let found = log
            .lock()
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|v| v["level"] == "WARN");
        if let Some(v) = found {
            break v;
        }
        assert!(
            Instant::now() < deadline,
            "no warning: {}",
            log.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(warned["span"]["name"], "connection", "{warned}");
    assert_eq!(
        warned["span"]["peer"].as_str().unwrap(),
        peer.local_addr().unwrap().to_string(),
        "{warned}"
    );
}
