//! `farmap mount --ublk STORE` (and the hidden `farmap __mount-ublk STORE` the VM test
//! runs): a `/dev/ublkbN` block device over any store, until Ctrl-C or SIGTERM.
//!
//! The device path is printed on stdout once the device exists; at the end the device is
//! stopped, the store flushed and the device deleted.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;

use farmap::spec::open_store_async;
use farmap::{Store, StoreSpec};
use farmap_ublk::{UblkDevice, UblkOptions};

use crate::stop::stop_signal;

/// Options of a ublk mount.
#[derive(Debug, Clone, Args)]
pub struct UblkMountOpts {
    /// Hardware queues, each with its own thread and io_uring (default: one per CPU).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub queues: Option<u16>,
    /// Requests in flight per queue.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..=4096))]
    pub depth: u16,
}

#[derive(Debug, Args)]
pub struct MountUblkArgs {
    /// The store the device reads and writes.
    store: StoreSpec,
    #[command(flatten)]
    opts: UblkMountOpts,
}

/// The hidden subcommand's entry point.
pub async fn run_args(args: MountUblkArgs) -> anyhow::Result<ExitCode> {
    crate::stop::listen_for_stop()?;
    run(args.store, args.opts).await
}

/// Mounts `store` as `/dev/ublkbN`, prints the path, and serves it until SIGINT/SIGTERM.
pub async fn run(store: StoreSpec, opts: UblkMountOpts) -> anyhow::Result<ExitCode> {
    let opened = open_store_async(&store)
        .await
        .with_context(|| format!("opening {store}"))?;
    serve(opened, &store.to_string(), &opts).await?;
    Ok(ExitCode::SUCCESS)
}

/// Serves `store` (an opened store or stage stack; `shown` names it in messages) as
/// `/dev/ublkbN`: prints the path, serves until SIGINT/SIGTERM, then stops the device and
/// flushes the store.
pub async fn serve(store: Arc<dyn Store>, shown: &str, opts: &UblkMountOpts) -> anyhow::Result<()> {
    let defaults = UblkOptions::default();
    let options = UblkOptions {
        queues: opts.queues.unwrap_or(defaults.queues),
        depth: opts.depth,
        ..defaults
    };
    let runtime = tokio::runtime::Handle::current();
    let device = tokio::task::spawn_blocking(move || UblkDevice::start(store, &options, runtime))
        .await
        .context("the thread starting the ublk device failed")?
        .context("creating the ublk device")?;
    println!("{}", device.path().display());
    status!(
        "farmap mount: {} serves {shown}; Ctrl-C or SIGTERM stops it",
        device.path().display()
    );
    stop_signal().await?;
    status!(
        "farmap mount: stopping {}, flushing the store",
        device.path().display()
    );
    tokio::task::spawn_blocking(move || device.shutdown())
        .await
        .context("the thread stopping the ublk device failed")?
        .context("tearing the ublk device down")?;
    status!("farmap mount: stopped; the store is flushed");
    Ok(())
}
