//! [`UblkDevice`]: creating, running and tearing down one `/dev/ublkbN`.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use farmap_core::{Caps, Store, StoreError};
use farmap_pipeline::Unaligned;
use libublk::ctrl::{UblkCtrl, UblkCtrlBuilder};
use libublk::io::UblkDev;
use libublk::{UblkError, UblkFlags};

use crate::queue::{run_queue, Shared};

/// The ublk driver's control device; it exists when `ublk_drv` is loaded.
pub const UBLK_CONTROL: &str = "/dev/ublk-control";

/// Sector size of the device (the block layer's unit for offsets and lengths).
const SECTOR_SHIFT: u32 = 9;

/// Largest discard or write-zeroes request the kernel sends in one piece (they move no data).
const MAX_DISCARD_BYTES: u32 = 1 << 30;

/// How a ublk device is shaped.
#[derive(Debug, Clone)]
pub struct UblkOptions {
    /// Hardware queues, each served by its own thread and io_uring (default: one per CPU,
    /// at most 16).
    pub queues: u16,
    /// Requests in flight per queue (default 64).
    pub depth: u16,
    /// Largest read or write the kernel sends in one request (default 512 KiB; a buffer of
    /// this size is kept per request slot).
    pub max_io_bytes: u32,
}

impl Default for UblkOptions {
    fn default() -> Self {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self {
            queues: cpus.clamp(1, 16) as u16,
            depth: 64,
            max_io_bytes: 512 << 10,
        }
    }
}

/// Why a ublk device could not be created, run or torn down.
#[derive(Debug, thiserror::Error)]
pub enum UblkDeviceError {
    /// The kernel has no ublk driver loaded.
    #[error(
        "no ublk driver: {UBLK_CONTROL} is missing (load the ublk_drv module: `modprobe \
         ublk_drv`; it needs Linux 6.0 or newer built with CONFIG_BLK_DEV_UBLK)"
    )]
    NoDriver,
    /// The store cannot be a block device as it is.
    #[error("the store's size, {size} bytes, is not a whole number of 512-byte sectors")]
    SizeNotSectors {
        /// The store's size in bytes.
        size: u64,
    },
    /// The options are out of range.
    #[error("invalid ublk options: {0}")]
    Options(String),
    /// The driver refused to create the device.
    #[error("cannot create a ublk device through {UBLK_CONTROL}")]
    Create(#[source] UblkError),
    /// The device was created but did not start.
    #[error("ublk device {dev_id} did not start")]
    Start {
        /// The device's number.
        dev_id: u32,
        /// What failed.
        #[source]
        source: UblkError,
    },
    /// Stopping the device failed.
    #[error("cannot stop ublk device {dev_id}")]
    Stop {
        /// The device's number.
        dev_id: u32,
        /// What failed.
        #[source]
        source: UblkError,
    },
    /// The store's flush at teardown failed: writes the kernel was told are done may not be
    /// durable.
    #[error("flushing the store behind ublk device {dev_id} at teardown failed")]
    Flush {
        /// The device's number.
        dev_id: u32,
        /// The store's error.
        #[source]
        source: StoreError,
    },
    /// The device's thread panicked.
    #[error("the thread running ublk device {dev_id} panicked")]
    Panicked {
        /// The device's number (`u32::MAX` when it panicked before the device existed).
        dev_id: u32,
    },
}

/// A running `/dev/ublkbN` over a store. Dropping it tears it down like
/// [`shutdown`](Self::shutdown), logging a failure instead of returning it.
#[derive(Debug)]
pub struct UblkDevice {
    dev_id: u32,
    thread: Option<JoinHandle<Result<(), UblkDeviceError>>>,
}

impl UblkDevice {
    /// Creates and starts a ublk device whose I/O goes to `store`, with the store's futures
    /// run on `runtime`. Returns once `/dev/ublkbN` exists. Blocks (call it from a blocking
    /// thread in async code).
    pub fn start(
        store: Arc<dyn Store>,
        opts: &UblkOptions,
        runtime: tokio::runtime::Handle,
    ) -> Result<UblkDevice, UblkDeviceError> {
        let geometry = store.geometry();
        let size = geometry.size();
        if size == 0 || !size.is_multiple_of(1 << SECTOR_SHIFT) {
            return Err(UblkDeviceError::SizeNotSectors { size });
        }
        if opts.queues == 0 || opts.depth == 0 || opts.depth > 4096 {
            return Err(UblkDeviceError::Options(format!(
                "queues must be at least 1 and depth 1..=4096 (got {} queues, depth {})",
                opts.queues, opts.depth
            )));
        }
        if opts.max_io_bytes < 4096 || !opts.max_io_bytes.is_power_of_two() {
            return Err(UblkDeviceError::Options(format!(
                "the largest request must be a power of two of at least 4096 bytes (got {})",
                opts.max_io_bytes
            )));
        }
        if !Path::new(UBLK_CONTROL).exists() {
            return Err(UblkDeviceError::NoDriver);
        }
        let caps = store.caps();
        let chunk_shift = geometry.chunk_size().trailing_zeros();
        let shared = Arc::new(Shared {
            dev: Unaligned::new(store),
            runtime,
        });
        let opts = opts.clone();
        let (started_tx, started_rx) = mpsc::channel::<u32>();
        let thread = std::thread::Builder::new()
            .name("farmap-ublk".into())
            .spawn(move || run_device(shared, opts, caps, chunk_shift, size, started_tx))
            .map_err(|e| UblkDeviceError::Create(UblkError::IOError(e)))?;
        match started_rx.recv() {
            Ok(dev_id) => {
                tracing::info!(dev_id, "ublk device started");
                Ok(UblkDevice {
                    dev_id,
                    thread: Some(thread),
                })
            }
            // The thread ended before the device started: its result says why.
            Err(_) => match thread.join() {
                Ok(Err(e)) => Err(e),
                Ok(Ok(())) => Err(UblkDeviceError::Create(UblkError::OtherError(-libc::EIO))),
                Err(_) => Err(UblkDeviceError::Panicked { dev_id: u32::MAX }),
            },
        }
    }

    /// The device's number `N`.
    pub fn id(&self) -> u32 {
        self.dev_id
    }

    /// The block device, `/dev/ublkbN`.
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/dev/ublkb{}", self.dev_id))
    }

    /// Stops the device (the kernel writes back its cache first; requests in flight finish),
    /// waits for its queues, flushes the store and deletes the device. Blocks.
    pub fn shutdown(mut self) -> Result<(), UblkDeviceError> {
        self.teardown()
    }

    fn teardown(&mut self) -> Result<(), UblkDeviceError> {
        let Some(thread) = self.thread.take() else {
            return Ok(());
        };
        let dev_id = self.dev_id;
        let stop = UblkCtrl::new_simple(dev_id as i32).and_then(|ctrl| ctrl.kill_dev());
        if let Err(source) = stop {
            // The device may already be gone (deleted by another tool); the thread then
            // ends by itself. Anything else leaves the thread running: report it.
            if !matches!(source, UblkError::OtherError(e) if e == -libc::ENOENT) {
                tracing::warn!(dev_id, error = %source, "stopping the ublk device failed");
                return Err(UblkDeviceError::Stop { dev_id, source });
            }
        }
        match thread.join() {
            Ok(r) => r,
            Err(_) => Err(UblkDeviceError::Panicked { dev_id }),
        }
    }
}

impl Drop for UblkDevice {
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            tracing::error!(dev_id = self.dev_id, error = %e, "tearing the ublk device down failed");
        }
    }
}

/// The device's own thread: creates the device, runs its queues until it is stopped, then
/// flushes the store and deletes the device.
fn run_device(
    shared: Arc<Shared>,
    opts: UblkOptions,
    caps: Caps,
    chunk_shift: u32,
    size: u64,
    started: mpsc::Sender<u32>,
) -> Result<(), UblkDeviceError> {
    let ctrl = UblkCtrlBuilder::default()
        .name("farmap")
        .id(-1)
        .nr_queues(opts.queues)
        .depth(opts.depth)
        .io_buf_bytes(opts.max_io_bytes)
        .dev_flags(UblkFlags::UBLK_DEV_F_ADD_DEV)
        .build()
        .map_err(UblkDeviceError::Create)?;
    let dev_id = ctrl.dev_info().dev_id;
    let depth = opts.depth;
    let tgt_init = move |dev: &mut UblkDev| {
        dev.set_default_params(size);
        // One more entry per queue ring than there are request slots: the eventfd poll
        // that wakes the ring when the store completes a request.
        dev.tgt.sq_depth = depth.saturating_add(8);
        dev.tgt.cq_depth = depth.saturating_add(8).saturating_mul(2);
        let p = &mut dev.tgt.params;
        p.types |= libublk::sys::UBLK_PARAM_TYPE_DISCARD;
        p.basic.io_min_shift = SECTOR_SHIFT as u8;
        p.basic.io_opt_shift = chunk_shift.clamp(SECTOR_SHIFT, 20) as u8;
        if !caps.contains(Caps::WRITE) {
            p.basic.attrs |= libublk::sys::UBLK_ATTR_READ_ONLY;
        }
        p.discard = libublk::sys::ublk_param_discard {
            discard_alignment: 0,
            discard_granularity: 1 << SECTOR_SHIFT,
            max_discard_sectors: MAX_DISCARD_BYTES >> SECTOR_SHIFT,
            max_write_zeroes_sectors: MAX_DISCARD_BYTES >> SECTOR_SHIFT,
            max_discard_segments: 1,
            reserved0: 0,
        };
        Ok(())
    };
    let queue_shared = shared.clone();
    let q_fn = move |qid: u16, dev: &UblkDev| run_queue(qid, dev, queue_shared.clone());
    let on_started = move |ctrl: &UblkCtrl| {
        let _ = started.send(ctrl.dev_info().dev_id);
    };
    let ran = ctrl.run_target(tgt_init, q_fn, on_started);
    // The queues have ended (the device was stopped, or never started). Everything the
    // kernel was told is written reached the store; make it durable, then remove the device.
    let flushed = shared.runtime.block_on(shared.dev.flush());
    if let Err(e) = ctrl.del_dev() {
        tracing::debug!(dev_id, error = %e, "deleting the ublk device (it may be gone already)");
    }
    ran.map_err(|source| UblkDeviceError::Start { dev_id, source })?;
    flushed.map_err(|source| UblkDeviceError::Flush { dev_id, source })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use farmap_core::Geometry;
    use farmap_store::MemoryStore;

    fn store(size: u64) -> Arc<dyn Store> {
        Arc::new(MemoryStore::new(Geometry::new(size, 4096).unwrap()))
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
    }

    #[test]
    fn a_size_that_is_not_whole_sectors_is_refused() {
        let rt = runtime();
        let err = UblkDevice::start(
            store(4096 + 100),
            &UblkOptions::default(),
            rt.handle().clone(),
        )
        .unwrap_err();
        assert!(
            matches!(err, UblkDeviceError::SizeNotSectors { size: 4196 }),
            "{err:?}"
        );
    }

    #[test]
    fn bad_options_are_refused_before_the_driver_is_asked() {
        let rt = runtime();
        for opts in [
            UblkOptions {
                queues: 0,
                ..UblkOptions::default()
            },
            UblkOptions {
                depth: 0,
                ..UblkOptions::default()
            },
            UblkOptions {
                max_io_bytes: 3000,
                ..UblkOptions::default()
            },
        ] {
            let err = UblkDevice::start(store(1 << 20), &opts, rt.handle().clone()).unwrap_err();
            assert!(
                matches!(err, UblkDeviceError::Options(_)),
                "{opts:?}: {err:?}"
            );
        }
    }

    #[test]
    fn without_the_driver_the_error_says_so() {
        if Path::new(UBLK_CONTROL).exists() {
            // The kernel tests (crates/app/farmap-cli/tests/kernel_vm.rs) run a device for real.
            return farmap_testkit::skip(
                "without_the_driver_the_error_says_so",
                "this kernel has ublk_drv loaded, so the missing-driver error cannot happen",
            );
        }
        let rt = runtime();
        let err = UblkDevice::start(store(1 << 20), &UblkOptions::default(), rt.handle().clone())
            .unwrap_err();
        assert!(matches!(err, UblkDeviceError::NoDriver), "{err:?}");
        let msg = err.to_string();
        assert!(
            msg.contains("ublk_drv") && msg.contains(UBLK_CONTROL),
            "{msg}"
        );
    }
}
