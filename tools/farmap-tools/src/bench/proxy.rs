//! `farmap bench proxy`: how faithfully the delay proxy (`farmap proxy`) emulates a link.
//! Tests only assert that it is never early and never faster than its bandwidth; what it adds
//! to a round trip, and how close to its bandwidth it runs, is measured here.
//!
//! Cases, one JSON line each with `--json`:
//! - `round-trip`, per `--rtt`: `--pings` 8-byte pings echoed through the proxy, one at a
//!   time. The reference is a direct connection whose peers idle as long between pings as the
//!   proxy makes them wait (a VM takes longer to wake an idle thread); `added_us` is the
//!   proxied median minus the direct median minus the RTT (ideal 0). `early` counts round
//!   trips shorter than the RTT (must be 0).
//! - `bulk`: `--bytes` sent one way through a proxy limited to `--bandwidth`; the rate seen by
//!   the receiver after its first read, against the bandwidth (`ratio_to_link`, ideal 1,
//!   never above it). Every byte is checked.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::process::ExitCode;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use farmap::format_size;
use farmap_proxy::{Bandwidth, Proxy, ProxyHandle, ProxyOptions};
use serde::Serialize;

use super::common::{parse_duration, parse_size_arg};
use crate::output;

#[derive(Debug, Args)]
pub struct ProxyArgs {
    /// Round-trip times of the `round-trip` case, comma-separated.
    #[arg(long, default_value = "0ms,2ms,10ms", value_delimiter = ',', value_parser = parse_duration)]
    rtt: Vec<Duration>,
    /// Pings per round-trip time (after 5 untimed ones).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pings: u32,
    /// Bandwidth of the `bulk` case, e.g. 100Mbit or 12MB/s.
    #[arg(long, default_value = "100Mbit")]
    bandwidth: Bandwidth,
    /// Bytes sent in the `bulk` case.
    #[arg(long, default_value = "8MiB", value_parser = parse_size_arg)]
    bytes: u64,
    /// One JSON object per case on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct RoundTripResult {
    bench: &'static str,
    case: &'static str,
    rtt_ms: f64,
    pings: u32,
    median_us: f64,
    min_us: f64,
    direct_median_us: f64,
    added_us: f64,
    early: u32,
}

#[derive(Debug, Serialize)]
struct BulkResult {
    bench: &'static str,
    case: &'static str,
    bytes: u64,
    link_mb_per_s: f64,
    mb_per_s: f64,
    ratio_to_link: f64,
    elapsed_ms: f64,
    verified: bool,
}

fn us(d: Duration) -> f64 {
    output::round1(d.as_secs_f64() * 1e6)
}

/// A deterministic, non-periodic byte stream.
fn pattern(i: u64) -> u8 {
    (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8
}

/// A server that accepts once and hands the connection to `serve` on a thread.
fn server(serve: impl FnOnce(TcpStream) + Send + 'static) -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").context("binding a local server")?;
    let addr = listener.local_addr()?;
    thread::spawn(move || {
        if let Ok((stream, _)) = listener.accept() {
            let _ = stream.set_nodelay(true);
            serve(stream);
        }
    });
    Ok(addr)
}

fn echo_server() -> anyhow::Result<SocketAddr> {
    server(|mut s| {
        let mut b = [0u8; 8];
        while s.read_exact(&mut b).is_ok() {
            if s.write_all(&b).is_err() {
                break;
            }
        }
    })
}

fn connect(addr: SocketAddr) -> anyhow::Result<TcpStream> {
    let s = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    Ok(s)
}

/// Round trips of 8-byte pings, each after `idle` without traffic, sorted (5 untimed first).
fn ping_pong(c: &mut TcpStream, pings: u32, idle: Duration) -> anyhow::Result<Vec<Duration>> {
    let mut times = Vec::with_capacity(pings as usize);
    for i in 0..pings + 5 {
        thread::sleep(idle);
        let ping = u64::from(i).to_le_bytes();
        let start = Instant::now();
        c.write_all(&ping).context("sending a ping")?;
        let mut pong = [0u8; 8];
        c.read_exact(&mut pong).context("receiving a pong")?;
        let took = start.elapsed();
        if pong != ping {
            bail!("ping {i} came back as {pong:?}");
        }
        if i >= 5 {
            times.push(took);
        }
    }
    times.sort();
    Ok(times)
}

async fn start(to: SocketAddr, options: ProxyOptions) -> anyhow::Result<ProxyHandle> {
    Ok(Proxy::bind("127.0.0.1:0", to, options)
        .await
        .context("starting the delay proxy")?
        .spawn())
}

async fn round_trip(rtt: Duration, pings: u32) -> anyhow::Result<RoundTripResult> {
    let options = ProxyOptions {
        rtt,
        ..ProxyOptions::default()
    };
    let proxy = start(echo_server()?, options).await?;
    let (direct, proxied) = (echo_server()?, proxy.local_addr());
    let (base, times) = tokio::task::spawn_blocking(move || {
        let base = ping_pong(&mut connect(direct)?, pings, rtt)?;
        let times = ping_pong(&mut connect(proxied)?, pings, Duration::ZERO)?;
        anyhow::Ok((base, times))
    })
    .await
    .context("the ping thread failed")??;
    proxy.shutdown().await;
    let median = times[times.len() / 2];
    let direct_median = base[base.len() / 2];
    Ok(RoundTripResult {
        bench: "proxy",
        case: "round-trip",
        rtt_ms: output::round1(rtt.as_secs_f64() * 1e3),
        pings,
        median_us: us(median),
        min_us: us(times[0]),
        direct_median_us: us(direct_median),
        added_us: output::round1(
            (median.as_secs_f64() - direct_median.as_secs_f64() - rtt.as_secs_f64()) * 1e6,
        ),
        early: times.iter().filter(|t| **t < rtt).count() as u32,
    })
}

async fn bulk(bandwidth: Bandwidth, len: u64) -> anyhow::Result<BulkResult> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let upstream = server(move |mut s| {
        // Reads to EOF and checks every byte: (bytes, intact, first byte at, last byte at).
        let mut buf = vec![0u8; 64 << 10];
        let (mut off, mut intact) = (0u64, true);
        let (mut first, mut last) = (None, Instant::now());
        while let Ok(n) = s.read(&mut buf) {
            if n == 0 {
                break;
            }
            last = Instant::now();
            first.get_or_insert((last, n));
            intact &= buf[..n]
                .iter()
                .enumerate()
                .all(|(i, b)| *b == pattern(off + i as u64));
            off += n as u64;
        }
        let _ = tx.send((off, intact, first.unwrap_or((last, 0)), last));
    })?;
    let options = ProxyOptions {
        rtt: Duration::from_millis(2),
        bandwidth: Some(bandwidth),
        queue_limit: None,
    };
    let proxy = start(upstream, options).await?;
    let to = proxy.local_addr();
    tokio::task::spawn_blocking(move || {
        let mut s = connect(to)?;
        let mut buf = vec![0u8; 64 << 10];
        let mut off = 0u64;
        while off < len {
            let n = (len - off).min(buf.len() as u64) as usize;
            for (i, b) in buf[..n].iter_mut().enumerate() {
                *b = pattern(off + i as u64);
            }
            s.write_all(&buf[..n])
                .context("sending through the proxy")?;
            off += n as u64;
        }
        s.shutdown(Shutdown::Write)?;
        anyhow::Ok(())
    })
    .await
    .context("the sending thread failed")??;
    let (got, intact, (first, first_len), last) =
        rx.await.context("the receiving server failed")?;
    proxy.shutdown().await;
    // Bytes after the first read, over the time they took to arrive.
    let elapsed = last - first;
    let rate = (got - first_len as u64) as f64 / elapsed.as_secs_f64().max(1e-9);
    let link = bandwidth.bytes_per_sec() as f64;
    Ok(BulkResult {
        bench: "proxy",
        case: "bulk",
        bytes: len,
        link_mb_per_s: output::round1(link / 1e6),
        mb_per_s: output::round1(rate / 1e6),
        ratio_to_link: (rate / link * 1000.0).round() / 1000.0,
        elapsed_ms: output::round1(elapsed.as_secs_f64() * 1e3),
        verified: got == len && intact,
    })
}

pub async fn run(args: ProxyArgs) -> anyhow::Result<ExitCode> {
    let mut early = 0;
    for rtt in &args.rtt {
        let r = round_trip(*rtt, args.pings).await?;
        early += r.early;
        if args.json {
            output::json_line(&r)?;
        } else {
            println!(
                "round trip {} ms: median {} µs (min {} µs), direct {} µs, added {} µs over the rtt{}",
                r.rtt_ms,
                r.median_us,
                r.min_us,
                r.direct_median_us,
                r.added_us,
                if r.early > 0 { ", SOME EARLY" } else { "" }
            );
        }
    }
    let b = bulk(args.bandwidth, args.bytes).await?;
    if args.json {
        output::json_line(&b)?;
    } else {
        println!(
            "bulk {} through {} MB/s: {} MB/s = {} × the link{}",
            format_size(b.bytes),
            b.link_mb_per_s,
            b.mb_per_s,
            b.ratio_to_link,
            if b.verified {
                ", verified"
            } else {
                ", VERIFICATION FAILED"
            }
        );
    }
    if early > 0 {
        bail!("{early} round trips through the proxy were shorter than the rtt");
    }
    if !b.verified {
        bail!("the bytes through the proxy differ from the bytes sent");
    }
    Ok(ExitCode::SUCCESS)
}
