//! The `farmap` binary and library with a CQL store, against a real Apache Cassandra 5.0 node
//! (`scripts/services/cassandra.sh`): `farmap cp` of a 64 MiB file into a region and back,
//! `farmap info` without `size=`, a versioned region whose objects live in CQL, and a
//! password that never shows in an error. The store's
//! own tests are farmap-cql's (`crates/stores/farmap-cql/tests/cql.rs`).

use farmap_testkit::{skip, unique_name, Service};

mod common;
use common::farmap;

const KEYSPACE: &str = "farmap_test";

#[test]
fn cp_into_a_region_and_back_gives_identical_bytes() {
    let test = "cp_into_a_region_and_back_gives_identical_bytes";
    let Some(svc) = skip::unless(test, Service::shared("cassandra")) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let input = dir.path().join("in.img");
    let output = dir.path().join("out.img");
    // 64 MiB: varied bytes, with a zero stretch that cp may skip.
    let mut data = vec![0u8; 64 << 20];
    let mut x = farmap_testkit::XorShift(0x9e37_79b9_7f4a_7c15);
    for (i, b) in data.iter_mut().enumerate() {
        if (20 << 20..24 << 20).contains(&i) {
            continue;
        }
        *b = x.next().unwrap() as u8;
    }
    std::fs::write(&input, &data).expect("write input");
    let region = unique_name("cp");
    let base = format!(
        "{}/{KEYSPACE}?table=t&region={region}",
        svc.var("SPEC_BASE")
    );
    let dst = format!("{base}&size=64MiB&create=true");
    farmap().ok(&["cp", "-q", &format!("file:{}", input.display()), &dst]);
    // info needs no size: the region row has it.
    let info = farmap().ok(&["info", "--json", &base]);
    let info: serde_json::Value = serde_json::from_str(&info).expect("info json");
    assert_eq!(info["size_bytes"], 64u64 << 20, "{info}");
    farmap().ok(&["cp", "-q", &base, &format!("file:{}", output.display())]);
    let back = std::fs::read(&output).expect("read output");
    assert!(back == data, "the region read back differs from the file");
}

/// A versioned region whose objects live in a CQL table: a copy makes a version, a snapshot
/// names it, `versions --json` lists them, and copies back give the bytes of each version.
#[test]
fn versioned_regions_live_in_cql_too() {
    let test = "versioned_regions_live_in_cql_too";
    let Some(svc) = skip::unless(test, Service::shared("cassandra")) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.img");
    let first = farmap_testkit::pattern_with_zeros(5, 4 << 20);
    std::fs::write(&input, &first).unwrap();
    let table = unique_name("v").replace('-', "_");
    let spec = format!(
        "versioned:({}/{KEYSPACE}?table={table}&create=true)/r",
        svc.var("SPEC_BASE")
    );
    let file = |p: &std::path::Path| format!("file:{}", p.display());
    farmap().ok(&["cp", "-q", &file(&input), &format!("{spec}?size=4MiB")]);
    let snap = farmap().json(&["snapshot", &spec, "one", "--json"]);
    assert_eq!(snap["version"], 1, "{snap}");
    // A second copy of other bytes makes the next version.
    let second = farmap_testkit::pattern_with_zeros(6, 4 << 20);
    std::fs::write(&input, &second).unwrap();
    farmap().ok(&["cp", "-q", &file(&input), &spec]);
    let rows = farmap().json_lines(&["versions", &spec, "--json"]);
    let seqs: Vec<u64> = rows
        .iter()
        .map(|r| r["version"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, [0, 1, 2], "{rows:?}");
    assert_eq!(rows[1]["names"], serde_json::json!(["one"]), "{rows:?}");
    for (at, want) in [("@one", &first), ("@1", &first), ("", &second)] {
        let out = dir.path().join(format!("out{at}.img"));
        farmap().ok(&["cp", "-q", &format!("{spec}{at}"), &file(&out)]);
        assert!(
            std::fs::read(&out).unwrap() == *want,
            "the copy back of {spec}{at} differs"
        );
    }
}

/// Opened through the library's specs (as the binary opens them), a region whose node
/// requires a password fails without the password in the message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_never_shows_in_an_open_error() {
    // A node that requires a password (PasswordAuthenticator, cassandra/cassandra).
    let svc = match Service::start("cassandra", &["auth"]) {
        Ok(s) => s,
        Err(e) => return skip("a_password_never_shows_in_an_open_error", e),
    };
    let port = svc.var("PORT");
    let spec: farmap::StoreSpec = format!("cql://cassandra:cassandra@127.0.0.1:{port}/nosuch_ks")
        .parse()
        .expect("spec");
    let e = farmap::spec::open_store_async(&spec)
        .await
        .map(|_| ())
        .expect_err("missing keyspace");
    assert!(!format!("{e}").contains(":cassandra@"), "{e}");
}
