//! `farmap cp` and `farmap info` with Redis and Redis Cluster stores, and versioned regions
//! whose objects live in Redis, against real servers (scripts/services/redis.sh and
//! redis-cluster.sh).

use farmap_testkit::{pattern_bytes, Service};

mod common;
use common::farmap;

/// `farmap cp file:in SPEC` and back gives identical bytes; `info` needs no size afterwards.
fn round_trip(service: &'static str, spec_of: impl Fn(&Service, &str) -> String) {
    let svc = match Service::shared(service) {
        Ok(s) => s,
        Err(e) => return farmap_testkit::skip(&format!("cp_round_trip_{service}"), e),
    };
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.img");
    let output = dir.path().join("out.img");
    let size = 64usize << 20;
    // Data with holes: a few zero stretches so the copy's zero handling is exercised.
    let mut data = pattern_bytes(11, 0, size);
    data[(3 << 20)..(5 << 20)].fill(0);
    data[size - 4096..].fill(0);
    std::fs::write(&input, &data).unwrap();
    let prefix = format!("cli-{service}-{}", std::process::id());
    let spec = spec_of(svc, &format!("size=64MiB&prefix={prefix}"));
    farmap().ok(&["cp", "-q", &format!("file:{}", input.display()), &spec]);
    // Without size=: the region's record gives it.
    let bare = spec_of(svc, &format!("prefix={prefix}"));
    let info = farmap().ok(&["info", "--json", &bare]);
    let v: serde_json::Value = serde_json::from_str(&info).unwrap();
    assert_eq!(v["size_bytes"], size as u64, "{info}");
    farmap().ok(&["cp", "-q", &bare, &format!("file:{}", output.display())]);
    let back = std::fs::read(&output).unwrap();
    assert!(back == data, "the bytes that came back differ");
}

#[test]
fn cp_round_trip_through_redis() {
    round_trip("redis", |svc, opts| {
        format!("redis://127.0.0.1:{}/0?{opts}", svc.var("PORT"))
    });
}

#[test]
fn cp_round_trip_through_redis_over_tls() {
    round_trip("redis-tls", |svc, opts| {
        format!("{}/0?ca={}&{opts}", svc.var("SPEC_BASE"), svc.var("CA"))
    });
}

/// `rediss://` with a CA that did not sign the server's certificate: refused, and the message
/// says why and what to check.
#[test]
fn rediss_with_the_wrong_ca_is_refused_clearly() {
    let svc = match Service::shared("redis-tls") {
        Ok(s) => s,
        Err(e) => return farmap_testkit::skip("rediss_with_the_wrong_ca_is_refused_clearly", e),
    };
    let spec = format!(
        "{}/0?ca={}&size=1MiB&prefix=wrong-ca",
        svc.var("SPEC_BASE"),
        svc.var("WRONG_CA")
    );
    let o = farmap().run(&["info", &spec]);
    assert!(!o.status.success(), "a server from another CA was accepted");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("TLS certificate is not trusted") && err.contains(svc.var("PORT")),
        "{err}"
    );
}

#[test]
fn cp_round_trip_through_a_redis_cluster() {
    round_trip("redis-cluster", |svc, opts| {
        format!("{}?{opts}", svc.var("SPEC_BASE"))
    });
}

/// A versioned region whose objects live in Redis: a copy makes a version, a snapshot names
/// it, `versions --json` lists them, and copies back give the bytes of each version.
#[test]
fn versioned_regions_live_in_redis_too() {
    let svc = match Service::shared("redis") {
        Ok(s) => s,
        Err(e) => return farmap_testkit::skip("versioned_regions_live_in_redis_too", e),
    };
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.img");
    let first = farmap_testkit::pattern_with_zeros(5, 4 << 20);
    std::fs::write(&input, &first).unwrap();
    let spec = format!(
        "versioned:(redis://127.0.0.1:{}/0?prefix=cli-versioned-{})/r",
        svc.var("PORT"),
        std::process::id()
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

#[test]
fn redis_errors_name_the_problem() {
    let svc = match Service::shared("redis") {
        Ok(s) => s,
        Err(e) => return farmap_testkit::skip("redis_errors_name_the_problem", e),
    };
    let prefix = format!("cli-missing-{}", std::process::id());
    let spec = format!("redis://127.0.0.1:{}/0?prefix={prefix}", svc.var("PORT"));
    let o = farmap().run(&["info", &spec]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("no farmap region") && err.contains("size="),
        "{err}"
    );
}

#[test]
fn help_stores_lists_every_scheme_with_an_example() {
    for args in [&["help", "stores"][..], &["stores"][..]] {
        let out = farmap().ok(args);
        for section in [
            "## memory",
            "## file",
            "## dir",
            "## farmap",
            "## redis",
            "## s3",
            "## cql",
        ] {
            assert!(out.contains(section), "{args:?} lacks {section}:\n{out}");
        }
        for example in [
            "redis://127.0.0.1:6379/0?size=64MiB",
            "rediss://",
            "redis+cluster://",
            "flush=fsync",
        ] {
            assert!(out.contains(example), "{args:?} lacks {example}");
        }
    }
}

#[test]
fn bench_stores_reports_every_case_for_memory_and_redis() {
    let svc = match Service::shared("redis") {
        Ok(s) => s,
        Err(e) => return farmap_testkit::skip("bench_stores_reports_every_case", e),
    };
    let spec = format!(
        "redis://127.0.0.1:{}/0?prefix=bench-{}",
        svc.var("PORT"),
        std::process::id()
    );
    let out = farmap().ok(&[
        "bench",
        "stores",
        "--json",
        "--size",
        "2MiB",
        "--samples",
        "20",
        "--store",
        &spec,
    ]);
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    assert_eq!(lines.len(), 6, "{out}");
    for (i, v) in lines.iter().enumerate() {
        let store = if i < 3 { "memory" } else { "redis" };
        let case = ["direct-read", "managed-read", "read-4k"][i % 3];
        assert_eq!(v["bench"], "stores");
        assert_eq!(v["store"], store, "{v}");
        assert_eq!(v["case"], case, "{v}");
        assert_eq!(v["verified"], true, "{v}");
        assert!(v["mb_per_s"].as_f64().is_some_and(|x| x > 0.0), "{v}");
        assert!(
            v.get("p50_us").is_some() && v.get("p99_us").is_some(),
            "{v}"
        );
    }
}
