//! `farmap doctor`: every check is there with what it found, what it enables and, when it
//! failed, how to fix it; what it says agrees with what the tests find themselves; and run
//! as a user without privileges, it says userfaultfd is refused (on machines that refuse
//! it to such users) and why the features it gates are unknown.

mod common;
use common::farmap;

use serde_json::Value;

const NAMES: [&str; 15] = [
    "userfaultfd",
    "wp-async",
    "uffdio-move",
    "uffd-minor-shmem",
    "pagemap-scan",
    "fuse",
    "nbd",
    "ublk",
    "io_uring",
    "memory-cgroup",
    "swap",
    "open-files",
    "memlock",
    "overcommit",
    // Not a check: the report's other key, checked below.
    "root",
];

fn check<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no check {name} in {report}"))
}

#[test]
fn doctor_reports_every_check_and_agrees_with_what_the_test_finds() {
    let report = farmap().json(&["doctor", "--json"]);
    let checks = report["checks"].as_array().expect("checks");
    assert_eq!(checks.len(), NAMES.len() - 1, "{report}");
    for name in &NAMES[..NAMES.len() - 1] {
        let c = check(&report, name);
        let ok = c["ok"].as_bool().expect("ok is a boolean");
        assert!(!c["detail"].as_str().unwrap_or("").is_empty(), "{c}");
        assert!(!c["enables"].as_str().unwrap_or("").is_empty(), "{c}");
        // Every check that can be fixed says how when it failed (memlock is informative).
        if !ok && *name != "memlock" {
            assert!(!c["fix"].as_str().unwrap_or("").is_empty(), "{c}");
        }
        if ok {
            assert!(c.get("fix").is_none(), "{c}");
        }
    }
    let root = rustix::process::geteuid().is_root();
    assert_eq!(report["root"], root);
    assert_eq!(
        check(&report, "userfaultfd")["ok"],
        farmap_uffd::probe().is_ok(),
        "{report}"
    );
    let fuse = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .is_ok();
    assert_eq!(check(&report, "fuse")["ok"], fuse, "{report}");
    assert_eq!(
        check(&report, "ublk")["ok"],
        std::path::Path::new("/dev/ublk-control").exists() && root,
        "{report}"
    );

    // For people: one line per check, yes or no first.
    let text = farmap().ok(&["doctor"]);
    assert!(text.starts_with("farmap doctor: as "), "{text}");
    for name in &NAMES[..NAMES.len() - 1] {
        assert!(
            text.lines()
                .any(|l| (l.starts_with("  yes  ") || l.starts_with("  no   "))
                    && l[7..].starts_with(name)),
            "no line for {name}: {text}"
        );
    }
}

#[test]
fn doctor_run_by_a_user_without_privileges_says_what_it_cannot_do() {
    let test = "doctor_run_by_a_user_without_privileges_says_what_it_cannot_do";
    if !rustix::process::geteuid().is_root() {
        farmap_testkit::skip(test, "needs root to run the binary as another user");
        return;
    }
    let Some(setpriv) = farmap_testkit::tools::which("setpriv") else {
        farmap_testkit::skip(test, "setpriv (util-linux) is not installed");
        return;
    };
    // A copy of the binary that user 65534 can run.
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("farmap");
    std::fs::copy(env!("CARGO_BIN_EXE_farmap"), &bin).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = farmap_testkit::process::stdout_of(
        std::process::Command::new(setpriv)
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(&bin)
            .args(["doctor", "--json"]),
    );
    let report: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["root"], false);
    assert_eq!(check(&report, "swap")["detail"], "swapon needs root");
    let refused = std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd")
        .is_ok_and(|v| v.trim() == "0");
    if refused {
        let uffd = check(&report, "userfaultfd");
        assert_eq!(uffd["ok"], false, "{report}");
        assert!(uffd["fix"]
            .as_str()
            .unwrap()
            .contains("unprivileged_userfaultfd"));
        let mv = check(&report, "uffdio-move");
        assert!(
            mv["detail"].as_str().unwrap().contains("unknown"),
            "a feature behind a refused userfaultfd is unknown, not missing: {mv}"
        );
    }
}
