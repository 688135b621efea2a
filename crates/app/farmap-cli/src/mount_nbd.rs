//! `farmap mount --nbd STORE`: a `/dev/nbdN` block device over any store, through the
//! kernel's NBD client, with farmap's NBD server in this process; until Ctrl-C or SIGTERM.
//!
//! The device path is printed on stdout once the device is ready (`--json`: one object with
//! `device`); at the end the device is flushed (fsync: page cache to the store, then a store
//! flush), disconnected and destroyed.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use farmap::Store;
use farmap_nbd_kernel::{NbdMount, NbdMountOptions};
use serde::Serialize;

use crate::stop::stop_signal;
use farmap_cli_kit::args::parse_duration;

/// Options of an NBD mount.
#[derive(Debug, Clone, Args)]
pub struct NbdMountOpts {
    /// Sockets between the kernel and this process (--nbd).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub connections: u32,
    /// A request not answered within this time fails, and the device with it (--nbd).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// Print the device as one JSON object: {"device": "/dev/nbdN", ...} (--nbd).
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct Ready<'a> {
    device: &'a str,
    index: u32,
    size: u64,
    block_size: u32,
    connections: usize,
    read_only: bool,
}

/// Serves `store` (`shown` names it in messages) as `/dev/nbdN`: prints the device, serves
/// until SIGINT/SIGTERM, then flushes, disconnects and stops.
pub async fn serve(
    store: Arc<dyn Store>,
    shown: &str,
    read_only: bool,
    opts: &NbdMountOpts,
) -> anyhow::Result<()> {
    let options = NbdMountOptions {
        connections: opts.connections as usize,
        io_timeout: opts.timeout,
        read_only,
        ..NbdMountOptions::default()
    };
    let mount = NbdMount::start(store, &options)
        .await
        .context("setting up the kernel NBD device")?;
    let device = mount.path().display().to_string();
    if opts.json {
        crate::output::json_line(&Ready {
            device: &device,
            index: mount.index(),
            size: mount.geometry().size(),
            block_size: mount.block_size(),
            connections: mount.connections(),
            read_only: mount.is_read_only(),
        })?;
    } else {
        println!("{device}");
    }
    status!(
        "farmap mount: {device} serves {shown} ({}, {} connections, block size {}{}); Ctrl-C or \
         SIGTERM stops it",
        mount.geometry(),
        mount.connections(),
        mount.block_size(),
        if mount.is_read_only() {
            ", read-only"
        } else {
            ""
        },
    );
    stop_signal().await?;
    status!("farmap mount: flushing {device}, then disconnecting it");
    mount
        .shutdown()
        .await
        .with_context(|| format!("tearing {device} down"))?;
    status!("farmap mount: {device} is disconnected; the store is flushed");
    Ok(())
}
