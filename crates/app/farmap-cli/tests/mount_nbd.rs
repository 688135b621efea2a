//! `farmap mount --nbd` on this machine, whose kernel has no nbd driver: a clear error, no
//! hang. The device itself is tested in the VM (`kernel_vm.rs`).

use std::time::{Duration, Instant};

mod common;
use common::farmap;

#[test]
fn mount_nbd_without_the_driver_says_so() {
    const NAME: &str = "mount_nbd_without_the_driver_says_so";
    if farmap_nbd_kernel::kernel_has_nbd() {
        return farmap_testkit::skip(
            NAME,
            "this kernel has the nbd driver (the VM test covers it)",
        );
    }
    let start = Instant::now();
    let out = farmap().run(&["mount", "--nbd", "memory:1MiB", "--connections", "2"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "mount --nbd succeeded without a driver"
    );
    assert!(
        stderr.contains("the kernel has no nbd driver (modprobe nbd)"),
        "stderr: {stderr}"
    );
    assert!(out.stdout.is_empty(), "printed a device: {:?}", out.stdout);
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "took {:?}",
        start.elapsed()
    );
    // The driver is checked before the store is opened: a remote store (here one that does
    // not answer) is not contacted for nothing.
    let stderr = farmap().fails(&["mount", "--nbd", "farmap://127.0.0.1:1"]);
    assert!(
        stderr.contains("the kernel has no nbd driver (modprobe nbd)"),
        "stderr: {stderr}"
    );
}

#[test]
fn mount_nbd_refuses_a_mount_point_and_bad_options() {
    for (args, want) in [
        (
            &["mount", "--nbd", "memory:1MiB", "/mnt"][..],
            "takes only a store",
        ),
        (
            &["mount", "--nbd", "memory:1MiB", "--connections", "0"][..],
            "--connections",
        ),
        (
            &["mount", "--nbd", "--ublk", "memory:1MiB"][..],
            "cannot be used with",
        ),
    ] {
        let stderr = farmap().fails(args);
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
}
