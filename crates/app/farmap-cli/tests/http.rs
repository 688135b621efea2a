//! `farmap cp` and `farmap info` with an `http://` store, against a real nginx
//! (scripts/services/nginx.sh).

use farmap_testkit::{skip, Service};

mod common;

#[test]
fn cp_and_info_read_a_file_over_http() {
    let test = "cp_and_info_read_a_file_over_http";
    let Some(svc) = skip::unless(test, Service::shared("nginx")) else {
        return;
    };
    // 5 MiB and a bit, in 1 MiB chunks: a short last chunk.
    let data: Vec<u8> = farmap_testkit::XorShift(0x5eed)
        .take((5 << 20) + 777)
        .map(|x| x as u8)
        .collect();
    std::fs::write(
        std::path::Path::new(svc.var("ROOT")).join("disk.img"),
        &data,
    )
    .unwrap();
    let url = format!("{}/disk.img", svc.var("URL_BASE"));
    let info = common::farmap().ok(&["info", "--json", &format!("{url}?chunk=1MiB")]);
    let info: serde_json::Value = serde_json::from_str(info.trim()).expect("one JSON line");
    assert_eq!(info["size_bytes"], data.len() as u64, "{info}");
    assert_eq!(info["chunk_bytes"], 1 << 20, "{info}");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("copy.img");
    common::farmap().ok(&[
        "cp",
        "-q",
        &format!("{url}?chunk=1MiB"),
        &format!("file:{}", out.display()),
    ]);
    assert!(std::fs::read(&out).unwrap() == data, "the copy differs");
    // Errors name the problem in one sentence.
    let err = common::farmap().fails(&["info", &format!("{}/nope.img", svc.var("URL_BASE"))]);
    assert!(
        err.contains("no such file on the server (404 Not Found)"),
        "{err}"
    );
    let src = format!("file:{}", out.display());
    let err = common::farmap().fails(&["cp", "-q", &src, &url]);
    assert!(err.contains("read-only"), "{err}");
}
