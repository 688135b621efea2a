//! `farmap bench vm --quick`: the floor, farmap's two migration rows and its lazy start run,
//! and every guest checks out
//! (the QEMU anchors are left to the suite: they add a minute of emulation). Needs root,
//! /dev/fuse and QEMU: a missing one is a skip with its reason (never under CI=true).

mod common;
use common::farmap;
use farmap_testkit::skip;

#[test]
fn bench_vm_quick_rows_are_verified() {
    let test = "bench_vm_quick_rows_are_verified";
    if !skip::is_root() {
        skip::skip(test, "needs root (FUSE mounts, the guest's kernel)");
        return;
    }
    if !skip::fuse_mountable(test) || !skip::program(test, "qemu-system-x86_64", &["--version"]) {
        return;
    }
    let rows = farmap().json_lines(&[
        "bench",
        "vm",
        "--quick",
        "--json",
        "--systems",
        "shared-floor,farmap-instant,farmap-precopy,farmap-lazy-start",
    ]);
    let systems: Vec<&str> = rows.iter().map(|r| r["system"].as_str().unwrap()).collect();
    assert_eq!(
        systems,
        [
            "shared-floor",
            "farmap-instant",
            "farmap-precopy",
            "farmap-lazy-start"
        ]
    );
    let (moves, lazy) = rows.split_at(3);
    // The lazy start: the guest ran again from its saved device state (no RAM in it), and
    // its first instruction came before it was back to full speed.
    let l = &lazy[0];
    assert_eq!(l["verified"], true, "{l}");
    assert!(l["error"].is_null(), "{l}");
    assert!(l["bytes_moved"].as_u64().unwrap() < 1 << 20, "{l}");
    let first = l["time_to_first_instruction_ms"].as_f64().unwrap();
    let warm = l["time_to_warm_ms"].as_f64().unwrap();
    assert!(first > 0.0 && first <= warm, "{l}");
    for r in moves {
        assert_eq!(r["bench"], "vm", "{r}");
        assert_eq!(r["guest_mib"], 128, "{r}");
        assert_eq!(r["verified"], true, "{r}");
        assert!(r["error"].is_null(), "{r}");
        for key in ["downtime_ms", "guest_max_gap_ms", "total_ms", "bytes_moved"] {
            assert!(r[key].as_f64().is_some_and(|v| v > 0.0), "{key}: {r}");
        }
        assert!(
            r["qemu_version"].as_str().is_some_and(|v| !v.is_empty()),
            "{r}"
        );
        assert!(r.get("time_to_first_instruction_ms").is_some(), "{r}");
    }
    // The floor moves device state only; farmap's instant move sends under 1% of the RAM
    // before the guest resumes.
    assert!(
        rows[0]["bytes_moved"].as_u64().unwrap() < 1 << 20,
        "{}",
        rows[0]
    );
    let before = rows[1]["bytes_before_resume"].as_u64().unwrap();
    assert!(before < (128 << 20) / 100, "{}", rows[1]);
}
