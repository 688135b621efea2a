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
//! - `relay`: `--relay-bytes` sent one way through the proxy at 0 ms with no bandwidth limit,
//!   and through a plain relay (two threads copying between sockets, nothing else) in the
//!   same run: the CPU the whole process spends per byte (sender and receiver included,
//!   the same for both) and the rate, for each; `cpu_ratio` is the proxy's CPU per byte over
//!   the plain relay's (the reference for the proxy's cost). Every byte is checked.

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
    /// Bytes sent through each relay in the `relay` case (0: skip the case).
    #[arg(long, default_value = "256MiB", value_parser = parse_size_arg)]
    relay_bytes: u64,
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

#[derive(Debug, Serialize)]
struct RelayResult {
    bench: &'static str,
    case: &'static str,
    bytes: u64,
    mb_per_s: f64,
    cpu_ns_per_byte: f64,
    relay_mb_per_s: f64,
    relay_cpu_ns_per_byte: f64,
    cpu_ratio: f64,
    verified: bool,
}

fn us(d: Duration) -> f64 {
    output::round1(d.as_secs_f64() * 1e6)
}

/// A deterministic, non-periodic byte stream.
fn pattern(i: u64) -> u8 {
    (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8
}

/// A receiver that reads to EOF and checks every byte against [`pattern`]; sends what it
/// saw (bytes, intact, the first read's time and length, the last read's time).
fn checking_receiver(
    tx: tokio::sync::oneshot::Sender<(u64, bool, (Instant, usize), Instant)>,
) -> anyhow::Result<SocketAddr> {
    server(move |mut s| {
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
    })
}

/// Sends `len` bytes of [`pattern`] to `to` and closes the sending half.
fn send_pattern(to: SocketAddr, len: u64) -> anyhow::Result<()> {
    let mut s = connect(to)?;
    let mut buf = vec![0u8; 64 << 10];
    let mut off = 0u64;
    while off < len {
        let n = (len - off).min(buf.len() as u64) as usize;
        for (i, b) in buf[..n].iter_mut().enumerate() {
            *b = pattern(off + i as u64);
        }
        s.write_all(&buf[..n])
            .context("sending through the relay")?;
        off += n as u64;
    }
    s.shutdown(Shutdown::Write)?;
    Ok(())
}

/// The relay case's bytes: 64 KiB blocks of one fixed pattern, each stamped with its index
/// in its first 8 bytes (cheap to make and to check, so that the relays' own CPU shows).
const BLOCK: usize = 64 << 10;

fn block(index: u64) -> Vec<u8> {
    let mut b: Vec<u8> = (0..BLOCK as u64).map(pattern).collect();
    b[..8].copy_from_slice(&index.to_le_bytes());
    b
}

/// Sends `len` bytes of stamped blocks to `to` and closes the sending half.
fn send_blocks(to: SocketAddr, len: u64) -> anyhow::Result<()> {
    let mut s = connect(to)?;
    let mut buf = block(0);
    let mut off = 0u64;
    while off < len {
        buf[..8].copy_from_slice(&(off / BLOCK as u64).to_le_bytes());
        let n = (len - off).min(BLOCK as u64) as usize;
        s.write_all(&buf[..n])
            .context("sending through the relay")?;
        off += n as u64;
    }
    s.shutdown(Shutdown::Write)?;
    Ok(())
}

/// Reads stamped blocks to EOF, checking each whole; sends (bytes, intact, the last read's
/// time) on `tx`.
fn block_receiver(
    tx: tokio::sync::oneshot::Sender<(u64, bool, Instant)>,
) -> anyhow::Result<SocketAddr> {
    server(move |mut s| {
        let mut want = block(0);
        let mut buf = vec![0u8; BLOCK];
        let (mut off, mut intact, mut last) = (0u64, true, Instant::now());
        loop {
            // One block (or the stream's short last one).
            let mut filled = 0;
            while filled < BLOCK {
                match s.read(&mut buf[filled..]) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => filled += n,
                }
            }
            if filled == 0 {
                break;
            }
            last = Instant::now();
            want[..8].copy_from_slice(&(off / BLOCK as u64).to_le_bytes());
            intact &= buf[..filled] == want[..filled];
            off += filled as u64;
            if filled < BLOCK {
                break;
            }
        }
        let _ = tx.send((off, intact, last));
    })
}

/// Copies `from` to `to` through one 256 KiB buffer until EOF, then closes `to`'s sending half.
fn pump(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = vec![0u8; 256 << 10];
    while let Ok(n) = from.read(&mut buf) {
        if n == 0 || to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

/// A plain relay: accepts once, connects to `to`, and copies each way on a thread of its own
/// (read, then write the same buffer: nothing else).
fn plain_relay(to: SocketAddr) -> anyhow::Result<SocketAddr> {
    server(move |client| {
        let Ok(upstream) = TcpStream::connect(to) else {
            return;
        };
        let _ = upstream.set_nodelay(true);
        let (Ok(c2), Ok(u2)) = (client.try_clone(), upstream.try_clone()) else {
            return;
        };
        let back = thread::spawn(move || pump(u2, c2));
        pump(client, upstream);
        let _ = back.join();
    })
}

/// `len` bytes through one relay (reached at `via`, relaying to the receiver that `rx`
/// reports on): (MB/s, process CPU ns per byte, verified).
async fn relay_once(
    via: SocketAddr,
    len: u64,
    rx: tokio::sync::oneshot::Receiver<(u64, bool, Instant)>,
) -> anyhow::Result<(f64, f64, bool)> {
    let (cpu, start) = (farmap_migrate::budget::process_cpu(), Instant::now());
    tokio::task::spawn_blocking(move || send_blocks(via, len))
        .await
        .context("the sending thread failed")??;
    let (got, intact, last) = rx.await.context("the receiving server failed")?;
    let cpu = farmap_migrate::budget::process_cpu().saturating_sub(cpu);
    let elapsed = last.saturating_duration_since(start);
    Ok((
        output::round1(got as f64 / elapsed.as_secs_f64().max(1e-9) / 1e6),
        (cpu.as_nanos() as f64 / got.max(1) as f64 * 1000.0).round() / 1000.0,
        got == len && intact,
    ))
}

async fn relay(len: u64) -> anyhow::Result<RelayResult> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let plain = plain_relay(block_receiver(tx)?)?;
    let (relay_mb, relay_cpu, relay_ok) = relay_once(plain, len, rx).await?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    let proxy = start(block_receiver(tx)?, ProxyOptions::default()).await?;
    let (mb, cpu, ok) = relay_once(proxy.local_addr(), len, rx).await?;
    proxy.shutdown().await;
    Ok(RelayResult {
        bench: "proxy",
        case: "relay",
        bytes: len,
        mb_per_s: mb,
        cpu_ns_per_byte: cpu,
        relay_mb_per_s: relay_mb,
        relay_cpu_ns_per_byte: relay_cpu,
        cpu_ratio: (cpu / relay_cpu.max(1e-9) * 1000.0).round() / 1000.0,
        verified: ok && relay_ok,
    })
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
    let upstream = checking_receiver(tx)?;
    let options = ProxyOptions {
        rtt: Duration::from_millis(2),
        bandwidth: Some(bandwidth),
        queue_limit: None,
    };
    let proxy = start(upstream, options).await?;
    let to = proxy.local_addr();
    tokio::task::spawn_blocking(move || send_pattern(to, len))
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
    if args.relay_bytes > 0 {
        let r = relay(args.relay_bytes).await?;
        if args.json {
            output::json_line(&r)?;
        } else {
            println!(
                "relay {}: the proxy {} MB/s at {} ns of CPU a byte, a plain relay {} MB/s at {} ns: {} × its CPU{}",
                format_size(r.bytes),
                r.mb_per_s,
                r.cpu_ns_per_byte,
                r.relay_mb_per_s,
                r.relay_cpu_ns_per_byte,
                r.cpu_ratio,
                if r.verified { ", verified" } else { ", VERIFICATION FAILED" }
            );
        }
        if !r.verified {
            bail!("the bytes through a relay differ from the bytes sent");
        }
    }
    if early > 0 {
        bail!("{early} round trips through the proxy were shorter than the rtt");
    }
    if !b.verified {
        bail!("the bytes through the proxy differ from the bytes sent");
    }
    Ok(ExitCode::SUCCESS)
}
