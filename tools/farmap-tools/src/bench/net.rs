//! `farmap bench net`: farmap's transports through an emulated link, against a plain TCP
//! stream through the same link.
//!
//! Everything runs in this process on loopback: a server (native protocol and gRPC) over a
//! memory store filled with random data, one [`Proxy`] per server that delays each
//! direction by rtt/2, and the clients. At an RTT of 0 there is no proxy: the clients
//! connect to the servers directly (a proxy adds a copy and thread wake-ups that no real
//! link costs the hosts, so through it the ratios would partly measure the proxy; `proxied`
//! in each result says which). Cases, per RTT:
//! - `tcp-raw`: one plain TCP stream through the proxy: the emulated link's capacity. Both
//!   ends reuse one 1 MiB buffer, which stays in the CPU's caches.
//! - `tcp-region`: the same stream, sent from the source region's chunks and received into a
//!   region-sized buffer (touched before the clock starts): the link's capacity for moving a
//!   region, whose bytes come from and go to memory rather than the caches.
//! - `tcp-proxied`: `tcp-raw` through a proxy even at an RTT of 0: what the proxy itself
//!   costs (compare with `tcp-raw` at 0).
//! - `direct-native`: one request at a time over the native protocol.
//! - `managed-native`: `Cached` + `Puller` over the native protocol, many requests in flight.
//! - `managed-grpc`: the same over gRPC.
//!
//! `cpu_ms` is the CPU time the whole process (servers, proxy, clients) spent during the
//! timed part: what a case costs the hosts, steadier than its rate on a shared machine.
//!
//! `ratio_to_tcp_region` (when `tcp-region` ran before the case at the same RTT) is the
//! case's rate over `tcp-region`'s: the reference for moving a region, since both land
//! every byte in fresh memory (`tcp-raw` stays in the caches).
//!
//! `first_chunk_us` is the time from the first request on an established connection to its
//! reply (for `tcp-raw`: from a one-byte request to the first byte of the stream).

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::Args;
use farmap::net::{
    serve, write_all_vectored, ClientOptions, ListenAddr, Listener, RemoteAddr, RemoteStore,
    ServeOptions,
};
use farmap::pipeline::{Cached, PullOptions, PullOrder, Puller};
use farmap::store::{DenseMemoryStore, MemoryStore};
use farmap::{format_size, ChunkIdx, Geometry, Store};
use farmap_grpc::{serve_grpc_with_shutdown, GrpcClientOptions, GrpcServerOptions, GrpcStore};
use farmap_migrate::budget::process_cpu;
use farmap_proxy::{Proxy, ProxyHandle, ProxyOptions};
use rand::{RngCore, SeedableRng};
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::common::{parse_duration, parse_size_arg};
use crate::output;

const CASES: [&str; 6] = [
    "tcp-raw",
    "tcp-region",
    "tcp-proxied",
    "direct-native",
    "managed-native",
    "managed-grpc",
];
/// The cases run when none are named (`tcp-proxied` on request). `tcp-region` comes before
/// the farmap cases: it is their reference (`ratio_to_tcp_region`).
const DEFAULT_CASES: [&str; 5] = [
    "tcp-raw",
    "tcp-region",
    "direct-native",
    "managed-native",
    "managed-grpc",
];

#[derive(Debug, Args)]
pub struct NetArgs {
    /// Emulated round-trip times, comma-separated (each direction is delayed by half).
    #[arg(long, default_value = "0ms,2ms,10ms,40ms", value_delimiter = ',', value_parser = parse_duration)]
    rtt: Vec<Duration>,
    /// Region size pulled by the managed cases (and streamed by tcp-raw).
    #[arg(long, default_value = "256MiB", value_parser = parse_size_arg)]
    size: u64,
    /// Chunk size.
    #[arg(long, default_value = "64KiB", value_parser = parse_size_arg)]
    chunk: u64,
    /// Pull workers (requests in flight) of the managed cases. Default: a pull's own choice
    /// (native: runs of 1 MiB, as many in flight as keep the link busy, up to 16 MiB;
    /// gRPC: 16 MiB of single chunks, 256 of 64 KiB).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=65536))]
    workers: Option<u64>,
    /// Connections of the native client's pool (and gRPC channels). Default: the clients'.
    #[arg(long, default_value_t = ClientOptions::default().connections)]
    connections: usize,
    /// How long the one-request-at-a-time case runs at most per RTT.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    direct_time: Duration,
    /// Cases to run, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = DEFAULT_CASES.map(String::from))]
    case: Vec<String>,
    /// One JSON object per case and RTT on stdout.
    #[arg(long)]
    json: bool,
}

impl NetArgs {
    /// `--workers`, if given.
    fn pull_workers(&self) -> Option<usize> {
        self.workers.map(|w| w as usize)
    }
}

#[derive(Debug, Serialize)]
struct NetResult {
    bench: &'static str,
    case: String,
    rtt_ms: f64,
    size_bytes: u64,
    chunk_bytes: u64,
    /// Fetches in flight of a managed case: what the pull settled on (its window of runs,
    /// or `--workers`).
    workers: usize,
    /// Chunks one fetch of a managed case asked for (runs read in one request).
    #[serde(skip_serializing_if = "Option::is_none")]
    run_chunks: Option<u64>,
    mb_per_s: f64,
    first_chunk_us: f64,
    elapsed_ms: f64,
    /// CPU time of the whole process (servers, proxy and clients) over the case, in ms: the
    /// work a case costs, less noisy than its rate on a shared machine.
    cpu_ms: f64,
    verified: bool,
    /// Whether the case ran through the delay proxy (not at an RTT of 0).
    proxied: bool,
    /// The rate over `tcp-region`'s at the same RTT, when that ran before.
    #[serde(skip_serializing_if = "Option::is_none")]
    ratio_to_tcp_region: Option<f64>,
}

/// How long a timed part of a case took, and the CPU time the whole process spent meanwhile.
#[derive(Debug, Clone, Copy)]
pub(super) struct Timed {
    pub(super) elapsed: Duration,
    pub(super) cpu_ns: u64,
}

/// A running clock of wall and CPU time (see [`Timed`]).
struct Clock {
    started: Instant,
    cpu: Duration,
}

impl Clock {
    fn start() -> Clock {
        Clock {
            cpu: process_cpu(),
            started: Instant::now(),
        }
    }

    fn stop(&self) -> Timed {
        Timed {
            elapsed: self.started.elapsed(),
            cpu_ns: process_cpu().saturating_sub(self.cpu).as_nanos() as u64,
        }
    }
}

/// The request byte of a raw stream: its bytes from one reused 1 MiB buffer.
const FROM_BUFFER: u8 = 1;
/// The request byte of a raw stream: the region's chunks, in order.
const FROM_REGION: u8 = 2;
/// Chunks gathered into one vectored write of a region stream (1 MiB of 64 KiB chunks).
const REGION_GATHER: usize = 16;

/// A server streaming `size` bytes to every client after it sends one byte: from a reused
/// buffer ([`FROM_BUFFER`]) or from `region`'s chunks ([`FROM_REGION`]).
async fn raw_source(size: u64, region: Arc<dyn Store>) -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let region = region.clone();
            tokio::spawn(async move {
                let _ = sock.set_nodelay(true);
                let mut go = [0u8; 1];
                if sock.read_exact(&mut go).await.is_err() {
                    return;
                }
                if go[0] == FROM_REGION {
                    let _ = stream_region(&mut sock, region.as_ref()).await;
                    return;
                }
                let buf = vec![0x5au8; 1 << 20];
                let mut left = size;
                while left > 0 {
                    let n = left.min(buf.len() as u64) as usize;
                    if sock.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                    left -= n as u64;
                }
            });
        }
    });
    Ok(addr)
}

/// Writes every chunk of `region` to `sock`, [`REGION_GATHER`] chunks per vectored write (the
/// chunks are not copied on their way to the kernel).
async fn stream_region(sock: &mut TcpStream, region: &dyn Store) -> anyhow::Result<()> {
    let mut batch = Vec::with_capacity(REGION_GATHER);
    for idx in region.geometry().all().iter() {
        batch.push(region.read(idx).await?);
        if batch.len() == REGION_GATHER {
            write_all_vectored(sock, &mut batch, None).await?;
        }
    }
    write_all_vectored(sock, &mut batch, None).await?;
    Ok(())
}

/// The link to `to` at `rtt`: a proxy, or none at 0 (a direct connection). `farmap bench
/// paging` reaches its remote store through one too.
pub(super) struct Link {
    addr: SocketAddr,
    proxy: Option<ProxyHandle>,
}

impl Link {
    pub(super) async fn to(to: SocketAddr, rtt: Duration) -> anyhow::Result<Link> {
        if rtt.is_zero() {
            return Ok(Link {
                addr: to,
                proxy: None,
            });
        }
        Link::through_proxy(to, rtt).await
    }

    /// The link to `to` through a proxy, even at an RTT of 0.
    async fn through_proxy(to: SocketAddr, rtt: Duration) -> anyhow::Result<Link> {
        let p = proxy(to, rtt).await?;
        Ok(Link {
            addr: p.local_addr(),
            proxy: Some(p),
        })
    }

    pub(super) fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub(super) async fn shutdown(self) {
        if let Some(p) = self.proxy {
            p.shutdown().await;
        }
    }
}

async fn proxy(to: SocketAddr, rtt: Duration) -> anyhow::Result<ProxyHandle> {
    let opts = ProxyOptions {
        rtt,
        ..ProxyOptions::default()
    };
    Ok(Proxy::bind("127.0.0.1:0", to, opts)
        .await
        .context("starting the delay proxy")?
        .spawn())
}

/// Receives a raw stream of `size` bytes: into one reused 1 MiB buffer, or (`region`: the
/// region the stream comes from) into a region-sized buffer touched before the clock starts,
/// 1 MiB per read, and checked against the region after the clock stopped. Returns the time to
/// the first bytes (µs), the time of the whole stream, and whether the check passed.
async fn run_tcp_raw(
    to: SocketAddr,
    size: u64,
    region: Option<&dyn Store>,
) -> anyhow::Result<(f64, Timed, bool)> {
    let into_region = region.is_some();
    const READ: usize = 1 << 20;
    let mut sock = TcpStream::connect(to).await?;
    sock.set_nodelay(true)?;
    let len = if into_region {
        usize::try_from(size).context("the region does not fit this machine's memory")?
    } else {
        READ
    };
    // Filled with ones, so that every page has its own frame before the clock starts.
    let mut buf = vec![1u8; len];
    let go = if into_region {
        FROM_REGION
    } else {
        FROM_BUFFER
    };
    let clock = Clock::start();
    let started = clock.started;
    sock.write_all(&[go]).await?;
    let mut got = 0u64;
    let mut first = None;
    while got < size {
        let at = if into_region { got as usize } else { 0 };
        let end = (at + READ).min(buf.len());
        let n = sock.read(&mut buf[at..end]).await?;
        if n == 0 {
            bail!("the raw stream ended after {got} of {size} bytes");
        }
        first.get_or_insert_with(|| started.elapsed());
        got += n as u64;
    }
    let timed = clock.stop();
    let first = first.unwrap_or_default();
    let mut verified = true;
    if let Some(region) = region {
        let g = region.geometry();
        for idx in g.all().iter() {
            let at = g.offset_of(idx) as usize;
            let chunk = region.read(idx).await?;
            if buf[at..at + chunk.len()] != chunk[..] {
                verified = false;
                break;
            }
        }
    }
    Ok((first.as_secs_f64() * 1e6, timed, verified))
}

/// Time of one read on an established connection: every pooled connection is used once
/// first, then the median of nine sequential reads is taken.
async fn first_chunk(store: &dyn Store, connections: usize) -> anyhow::Result<f64> {
    let g = store.geometry();
    let n = g.chunk_count();
    futures::future::try_join_all(
        (0..connections.max(1) as u64).map(|i| store.read(ChunkIdx(i % n))),
    )
    .await?;
    let mut times = Vec::with_capacity(9);
    for i in 0..9u64 {
        let t = Instant::now();
        store.read(ChunkIdx((i * 7) % n)).await?;
        times.push(t.elapsed().as_secs_f64() * 1e6);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Reads chunks one at a time until `budget` is spent or the region ends.
async fn run_direct(store: &dyn Store, budget: Duration) -> anyhow::Result<(u64, Timed)> {
    let g = store.geometry();
    let clock = Clock::start();
    let started = clock.started;
    let mut bytes = 0u64;
    for idx in g.all().iter() {
        bytes += store.read(idx).await?.len() as u64;
        if started.elapsed() >= budget {
            break;
        }
    }
    Ok((bytes, clock.stop()))
}

/// Pulls the whole region with `Cached` + `Puller` (`workers` in flight, or the pull's own
/// choice, in order); returns the time (wall and CPU), whether every local chunk equals
/// `expected(idx)` (checked after the clock stopped) and what the pull settled on.
/// `farmap bench stores` measures its managed case with it too.
pub(super) async fn run_managed<F, Fut>(
    remote: Arc<dyn Store>,
    workers: Option<usize>,
    expected: F,
) -> anyhow::Result<(Timed, bool, PullShape)>
where
    F: Fn(ChunkIdx) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Bytes>>,
{
    let g = remote.geometry();
    let cached = Arc::new(Cached::new(DenseMemoryStore::new(g), remote)?);
    let clock = Clock::start();
    let puller = Puller::start(
        cached.clone(),
        PullOptions {
            workers: workers.unwrap_or(0),
            order: PullOrder::Sequential,
            ..PullOptions::default()
        },
    );
    let report = puller.wait().await;
    let timed = clock.stop();
    let mut verified = report.is_complete();
    for idx in g.all().iter() {
        if !verified {
            break;
        }
        verified = cached.local().read(idx).await? == expected(idx).await?;
    }
    Ok((timed, verified, (report.run_chunks, report.in_flight)))
}

/// What a pull settled on: chunks a fetch asked for, fetches in flight at the end.
pub(super) type PullShape = (u64, usize);

/// One run of a case: the bytes moved, the timed part, the time to the first chunk (µs),
/// whether the data checked out, and what a managed case's pull settled on.
type CaseRun = (u64, Timed, f64, bool, Option<PullShape>);

/// What `source` holds at `idx`, for [`run_managed`]'s check.
async fn read_source(source: &dyn Store, idx: ChunkIdx) -> anyhow::Result<Bytes> {
    Ok(source.read(idx).await?)
}

/// The source region and where each kind of server serves it.
struct Servers {
    store: Arc<dyn Store>,
    raw_addr: SocketAddr,
    native_addr: SocketAddr,
    grpc_addr: SocketAddr,
}

impl Servers {
    /// Runs `case` once at `rtt`: the bytes moved, the timed part, the time to the first
    /// chunk (µs) and whether the data checked out.
    async fn case(&self, args: &NetArgs, case: &str, rtt: Duration) -> anyhow::Result<CaseRun> {
        match case {
            "tcp-raw" | "tcp-region" | "tcp-proxied" => {
                let p = if case == "tcp-proxied" {
                    Link::through_proxy(self.raw_addr, rtt).await?
                } else {
                    Link::to(self.raw_addr, rtt).await?
                };
                let region = (case == "tcp-region").then_some(self.store.as_ref());
                let (first, timed, ok) = run_tcp_raw(p.local_addr(), args.size, region).await?;
                p.shutdown().await;
                Ok((args.size, timed, first, ok, None))
            }
            "direct-native" | "managed-native" => self.native(args, case, rtt).await,
            _ => self.grpc(args, rtt).await,
        }
    }

    /// A case through the native protocol: one connection read chunk by chunk
    /// (`direct-native`), or a managed pull over `--connections`.
    async fn native(&self, args: &NetArgs, case: &str, rtt: Duration) -> anyhow::Result<CaseRun> {
        let p = Link::to(self.native_addr, rtt).await?;
        let connections = if case == "direct-native" {
            1
        } else {
            args.connections
        };
        let opts = ClientOptions {
            connections,
            ..ClientOptions::default()
        };
        let remote: Arc<dyn Store> = Arc::new(
            RemoteStore::connect(RemoteAddr::Tcp(p.local_addr().to_string()), opts).await?,
        );
        let first = first_chunk(remote.as_ref(), connections).await?;
        let r = if case == "direct-native" {
            let (bytes, elapsed) = run_direct(remote.as_ref(), args.direct_time).await?;
            (bytes, elapsed, first, true, None)
        } else {
            let (elapsed, ok, pull) = run_managed(remote.clone(), args.pull_workers(), |i| {
                read_source(self.store.as_ref(), i)
            })
            .await?;
            (args.size, elapsed, first, ok, Some(pull))
        };
        drop(remote);
        p.shutdown().await;
        Ok(r)
    }

    /// A managed pull through gRPC over `--connections`.
    async fn grpc(&self, args: &NetArgs, rtt: Duration) -> anyhow::Result<CaseRun> {
        let p = Link::to(self.grpc_addr, rtt).await?;
        let remote: Arc<dyn Store> = Arc::new(
            GrpcStore::connect_with(
                &format!("http://{}", p.local_addr()),
                GrpcClientOptions {
                    connections: args.connections,
                    ..GrpcClientOptions::default()
                },
            )
            .await?,
        );
        let first = first_chunk(remote.as_ref(), args.connections).await?;
        let (elapsed, ok, pull) = run_managed(remote.clone(), args.pull_workers(), |i| {
            read_source(self.store.as_ref(), i)
        })
        .await?;
        drop(remote);
        p.shutdown().await;
        Ok((args.size, elapsed, first, ok, Some(pull)))
    }
}

pub async fn run(args: NetArgs) -> anyhow::Result<ExitCode> {
    for c in &args.case {
        if !CASES.contains(&c.as_str()) {
            bail!("unknown case {c:?} (cases: {})", CASES.join(", "));
        }
    }
    let g = Geometry::new(args.size, args.chunk)
        .with_context(|| format!("--size {} with --chunk {}", args.size, args.chunk))?;
    // The source region, filled with random data (setup, untimed).
    let source = Arc::new(MemoryStore::new(g));
    let mut rng = rand::rngs::SmallRng::seed_from_u64(0xbe7c4);
    for idx in g.all().iter() {
        let mut buf = vec![0u8; g.chunk_len(idx)];
        rng.fill_bytes(&mut buf);
        source.write(idx, Bytes::from(buf)).await?;
    }
    let store: Arc<dyn Store> = source.clone();

    // Servers, each behind its own proxy per RTT.
    let native = serve(
        store.clone(),
        Listener::bind(&ListenAddr::Tcp("127.0.0.1:0".parse()?)).await?,
        ServeOptions {
            log: false,
            ..ServeOptions::default()
        },
    )?;
    let ListenAddr::Tcp(native_addr) = native.local_addr().clone() else {
        bail!("the native server did not listen on TCP");
    };
    let grpc_listener = TcpListener::bind("127.0.0.1:0").await?;
    let grpc_addr = grpc_listener.local_addr()?;
    let (grpc_stop, grpc_stopped) = tokio::sync::oneshot::channel::<()>();
    let grpc_task = tokio::spawn(serve_grpc_with_shutdown(
        store.clone(),
        grpc_listener,
        GrpcServerOptions {
            log: false,
            ..GrpcServerOptions::default()
        },
        async move {
            let _ = grpc_stopped.await;
        },
    ));
    let raw_addr = raw_source(args.size, store.clone()).await?;
    let servers = Servers {
        store: store.clone(),
        raw_addr,
        native_addr,
        grpc_addr,
    };

    let mut failed = false;
    for &rtt in &args.rtt {
        let mut tcp_region = None;
        for case in &args.case {
            if !args.json {
                eprintln!("running {case} at rtt {} ms", rtt.as_secs_f64() * 1e3);
            }
            let (bytes, timed, first_us, verified, pull) = servers.case(&args, case, rtt).await?;
            let elapsed = timed.elapsed;
            failed |= !verified;
            let mb_per_s = output::mb_per_s(bytes, elapsed);
            if case == "tcp-region" {
                tcp_region = Some(mb_per_s);
            }
            let result = NetResult {
                bench: "net",
                case: case.clone(),
                rtt_ms: rtt.as_secs_f64() * 1e3,
                size_bytes: bytes,
                chunk_bytes: args.chunk,
                workers: pull.map_or(1, |p| p.1),
                run_chunks: pull.map(|p| p.0),
                mb_per_s,
                first_chunk_us: output::round1(first_us),
                elapsed_ms: output::round1(elapsed.as_secs_f64() * 1e3),
                cpu_ms: output::round1(timed.cpu_ns as f64 / 1e6),
                verified,
                proxied: !rtt.is_zero() || case == "tcp-proxied",
                ratio_to_tcp_region: tcp_region
                    .filter(|_| case != "tcp-region")
                    .map(|r| (mb_per_s / r.max(1e-9) * 1000.0).round() / 1000.0),
            };
            if args.json {
                output::json_line(&result)?;
            } else {
                println!(
                    "{:<15} rtt {:>5.1} ms: {:>8.1} MB/s over {} in {:.1} ms ({:.0} ms of CPU), first chunk {:.0} us{}",
                    result.case,
                    result.rtt_ms,
                    result.mb_per_s,
                    format_size(bytes),
                    result.elapsed_ms,
                    result.cpu_ms,
                    result.first_chunk_us,
                    if verified { "" } else { ", VERIFICATION FAILED" }
                );
            }
        }
    }
    let _ = grpc_stop.send(());
    let _ = grpc_task.await;
    native.shutdown().await.ok();
    if failed {
        bail!("some pulled data differed from the source");
    }
    Ok(ExitCode::SUCCESS)
}
