//! `farmap cp` and `farmap info` with an S3 store, against a real MinIO
//! (scripts/services/minio.sh).

use farmap_testkit::cli::Cli;
use farmap_testkit::{skip, Service};

mod common;

/// `farmap` with `svc`'s keys in its environment, and none of this machine's AWS settings.
fn farmap(svc: &Service) -> Cli {
    common::farmap()
        .env("AWS_ACCESS_KEY_ID", svc.var("ACCESS_KEY"))
        .env("AWS_SECRET_ACCESS_KEY", svc.var("SECRET_KEY"))
        .env_remove("AWS_PROFILE")
        .env_remove("AWS_ENDPOINT_URL")
        .env_remove("AWS_ENDPOINT_URL_S3")
}

#[test]
fn cp_to_s3_and_back_gives_identical_bytes() {
    let svc = match Service::shared("minio") {
        Ok(s) => s,
        Err(e) => return skip("cp_to_s3_and_back_gives_identical_bytes", e),
    };
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.img");
    let output = dir.path().join("out.img");
    // 64 MiB: random-looking data with zero stretches (skipped chunks) in between.
    let mut data = vec![0u8; 64 << 20];
    let mut x = farmap_testkit::XorShift(0x9e37_79b9_7f4a_7c15);
    for (i, block) in data.chunks_mut(1 << 20).enumerate() {
        if i % 5 == 3 {
            continue;
        }
        for (b, x) in block.iter_mut().zip(&mut x) {
            *b = x as u8;
        }
    }
    std::fs::write(&input, &data).unwrap();
    let prefix = format!("cli/cp-{}", std::process::id());
    let base = format!(
        "s3://{}/{prefix}?endpoint={}",
        svc.var("BUCKET"),
        svc.var("ENDPOINT")
    );
    let src = format!("file:{}", input.display());
    farmap(svc).ok(&["cp", "-q", &src, &format!("{base}&size=64MiB")]);
    // The region's geometry is stored with it: no size= from here on.
    let info = farmap(svc).ok(&["info", "--json", &base]);
    let info: serde_json::Value = serde_json::from_str(info.trim()).expect("one JSON line");
    assert_eq!(info["size_bytes"], 64u64 << 20, "{info}");
    assert_eq!(info["chunk_bytes"], 65536, "{info}");
    assert_eq!(info["data_chunks"], 1024 - 13 * 16, "{info}");
    let dst = format!("file:{}", output.display());
    farmap(svc).ok(&["cp", "-q", &base, &dst]);
    let back = std::fs::read(&output).unwrap();
    assert!(back == data, "the copy back differs");
    // Errors reach the user as one sentence naming the problem.
    let err = farmap(svc).fails(&[
        "info",
        &format!(
            "s3://no-such-bucket-x/{prefix}?endpoint={}",
            svc.var("ENDPOINT")
        ),
    ]);
    assert!(
        err.contains("bucket no-such-bucket-x does not exist"),
        "{err}"
    );
    let err = farmap(svc).fails(&["info", &format!("{base}&size=1GiB")]);
    assert!(err.contains("holds a region of 64MiB"), "{err}");
}

/// A versioned region whose objects live in S3: copies make versions, read back whole.
#[test]
fn versioned_regions_live_in_s3_too() {
    let svc = match Service::shared("minio") {
        Ok(s) => s,
        Err(e) => return skip("versioned_regions_live_in_s3_too", e),
    };
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.img");
    let data = farmap_testkit::pattern_with_zeros(5, 4 << 20);
    std::fs::write(&input, &data).unwrap();
    let spec = format!(
        "versioned:(s3://{}/cli/versioned-{}?endpoint={})/r",
        svc.var("BUCKET"),
        std::process::id(),
        svc.var("ENDPOINT")
    );
    farmap(svc).ok(&["cp", "-q", &format!("file:{}", input.display()), &spec]);
    let snap = farmap(svc).json(&["snapshot", &spec, "one", "--json"]);
    assert_eq!(snap["version"], 1, "{snap}");
    let rows = farmap(svc).json_lines(&["versions", &spec, "--json"]);
    assert_eq!(rows.len(), 2, "{rows:?}");
    let out = dir.path().join("out.img");
    farmap(svc).ok(&[
        "cp",
        "-q",
        &format!("{spec}@one"),
        &format!("file:{}", out.display()),
    ]);
    assert!(
        std::fs::read(&out).unwrap() == data,
        "the copy back differs"
    );
}
