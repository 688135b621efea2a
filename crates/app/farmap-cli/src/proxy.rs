//! `farmap proxy`: a TCP proxy that emulates a slow link (round-trip time, bandwidth).

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use farmap_proxy::{Bandwidth, Proxy, ProxyOptions};

use farmap_cli_kit::args::{parse_duration, parse_size_arg};

#[derive(Debug, Args)]
pub struct ProxyArgs {
    /// Address to listen on (host:port; port 0 picks a free one, printed on stderr).
    #[arg(long, value_name = "ADDR")]
    listen: String,
    /// Address to forward each connection to (host:port).
    #[arg(long, value_name = "ADDR")]
    to: String,
    /// Round-trip time to add: each direction is delayed by half of it (20ms, 250us, 0).
    #[arg(long, value_parser = parse_duration, default_value = "0ms")]
    rtt: Duration,
    /// Rate of each direction of each connection, in bits (100Mbit, 1Gbit) or bytes per
    /// second (500MB/s, with MB = 10^6 bytes). Unlimited by default.
    #[arg(long)]
    bandwidth: Option<Bandwidth>,
    /// Most bytes queued per direction of a connection before the proxy stops reading from
    /// its sender (default: twice the bandwidth-delay product plus 4MiB; at least 4MiB).
    #[arg(long, value_name = "SIZE", value_parser = parse_size_arg)]
    queue_limit: Option<u64>,
}

pub async fn run(args: ProxyArgs) -> anyhow::Result<ExitCode> {
    let options = ProxyOptions {
        rtt: args.rtt,
        bandwidth: args.bandwidth,
        queue_limit: args
            .queue_limit
            .map(|q| usize::try_from(q).unwrap_or(usize::MAX)),
    };
    let proxy = Proxy::bind(args.listen.as_str(), args.to.as_str(), options)
        .await?
        .on_error(|e| status!("farmap proxy: {}", farmap::error_chain(e)));
    let bandwidth = args
        .bandwidth
        .map_or_else(|| "unlimited".to_owned(), |b| b.to_string());
    status!(
        "farmap proxy: listening on {}, forwarding to {} with rtt {:?}, bandwidth {bandwidth}",
        proxy.local_addr(),
        args.to,
        args.rtt,
    );
    proxy
        .run_until(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await;
    let stats = proxy.stats();
    status!(
        "farmap proxy: stopped after {} connections ({} failed), {} bytes up, {} bytes down",
        stats.accepted,
        stats.failed,
        stats.bytes_up,
        stats.bytes_down
    );
    Ok(ExitCode::SUCCESS)
}
