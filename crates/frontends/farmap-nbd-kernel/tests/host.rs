//! What the kernel client does on a kernel without the nbd driver (this test machine's): a
//! clear error, before any server is started. The device itself is tested in the VM
//! (`crates/app/farmap-cli/tests/kernel_vm.rs`).

use std::sync::Arc;

use farmap_core::{Geometry, Store};
use farmap_nbd_kernel::{kernel_has_nbd, NbdKernelError, NbdMount, NbdMountOptions};
use farmap_store::MemoryStore;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_driver_the_error_says_so() {
    const NAME: &str = "without_the_driver_the_error_says_so";
    if kernel_has_nbd() {
        return farmap_testkit::skip(
            NAME,
            "this kernel has the nbd driver (the VM test covers it)",
        );
    }
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Geometry::new(1 << 20, 65536).unwrap()));
    let err = NbdMount::start(store, &NbdMountOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(err, NbdKernelError::NoDriver), "{err:?}");
    assert_eq!(
        err.to_string(),
        "the kernel has no nbd driver (modprobe nbd)"
    );
}

#[tokio::test]
async fn options_out_of_range_are_refused() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Geometry::new(1 << 20, 65536).unwrap()));
    for opts in [
        NbdMountOptions {
            connections: 0,
            ..NbdMountOptions::default()
        },
        NbdMountOptions {
            connections: 65,
            ..NbdMountOptions::default()
        },
        NbdMountOptions {
            io_timeout: std::time::Duration::ZERO,
            ..NbdMountOptions::default()
        },
    ] {
        let err = NbdMount::start(store.clone(), &opts).await.unwrap_err();
        assert!(
            matches!(err, NbdKernelError::BadOption(_)),
            "{opts:?}: {err:?}"
        );
    }
}
