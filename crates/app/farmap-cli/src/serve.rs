//! `farmap serve`: serve a store to other hosts over farmap's protocol.

use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use std::time::Duration;

use farmap::spec::open_store_async;
use farmap::{Caps, StoreSpec};
use farmap_net::{serve, ListenAddr, Listener, ServeOptions};

use farmap_cli_kit::args::{parse_duration, parse_size_arg};
use farmap_cli_kit::output::ServerTlsArgs;

use crate::stop::{listen_for_stop, stop_signal};

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// The store to serve (any spec, even a remote one: the server then relays).
    pub(crate) store: StoreSpec,
    /// Where to listen: IP:PORT, or unix:/path for a Unix socket. Port 0 picks a free port
    /// (the address is printed on stderr). Default 127.0.0.1:7400 (127.0.0.1:10809 with
    /// --nbd).
    #[arg(long)]
    pub(crate) listen: Option<ListenAddr>,
    #[command(flatten)]
    pub(crate) tls: ServerTlsArgs,
    /// Refuse writes and trims.
    #[arg(long)]
    pub(crate) read_only: bool,
    /// Clients served at once; more are refused with a clear reason.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub(crate) max_connections: u32,
    /// Requests worked on at once per connection (more wait in the socket).
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub(crate) max_in_flight: u32,
    /// Close a connection that sends nothing for this long with nothing in flight, or whose
    /// replies have not been read for this long (e.g. 30s, 2m is 120s).
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    pub(crate) idle_timeout: Duration,
    /// Time a client has to finish the TLS and farmap handshakes (native protocol only).
    #[arg(long, value_parser = parse_duration)]
    pub(crate) handshake_timeout: Option<Duration>,
    /// Bytes of requests in flight and replies not yet sent, over all connections (native
    /// protocol only; each connection also has its own budget of 32 MiB). Default 256MiB.
    #[arg(long, value_parser = parse_size_arg)]
    pub(crate) max_memory: Option<u64>,
    /// Serve the gRPC service (`farmap.v1.Store`, for other languages and tools) instead of
    /// farmap's native protocol; clients use `farmap+grpc://HOST:PORT`. TCP only, no TLS.
    #[arg(long, conflicts_with_all = ["tls_cert", "tls_key", "tls_client_ca"])]
    grpc: bool,
    /// Serve NBD (for qemu, nbdinfo/nbdcopy, nbdkit, the kernel's nbd-client) instead of
    /// farmap's protocol: STORE is the default export (named ""); TLS by STARTTLS.
    #[arg(long, conflicts_with = "grpc")]
    pub(crate) nbd: bool,
    /// With --nbd: another export, NAME=SPEC (repeatable).
    #[arg(long = "export", value_name = "NAME=SPEC", requires = "nbd")]
    pub(crate) exports: Vec<String>,
    /// With --nbd: serve STORE (typically a remote one, farmap://HOST:PORT) through a local
    /// cache: chunks are pulled in the background and on demand, writes are pushed back on
    /// an interval, and an NBD flush (or FUA) returns once everything written is pushed and
    /// flushed at the remote. Shutdown pushes what is left.
    #[arg(long, requires = "nbd")]
    pub(crate) managed: bool,
    /// With --managed: most of the region held in local memory, SIZE (64MiB) or N% of the
    /// region. Over it, chunks are dropped (modified ones pushed first) and fetched again
    /// when read; there is no background pull then.
    #[arg(long, value_name = "SIZE|N%", value_parser = crate::cache_max::parse_cache_max, requires = "managed")]
    pub(crate) cache_max: Option<crate::cache_max::CacheMax>,
    /// Do not log connections: only warnings and errors (the listening address and shutdown
    /// are still printed). `FARMAP_LOG` overrides it.
    #[arg(long, short)]
    pub(crate) quiet: bool,
}

impl ServeArgs {
    /// `--listen`, or `default`.
    pub(crate) fn listen(&self, default: &str) -> ListenAddr {
        self.listen
            .clone()
            .unwrap_or_else(|| default.parse().expect("a valid default address"))
    }
}

pub async fn run(args: ServeArgs) -> anyhow::Result<ExitCode> {
    listen_for_stop()?;
    let store = open_store_async(&args.store)
        .await
        .context("opening the store to serve")?;
    if args.grpc {
        return run_grpc(args, store).await;
    }
    if args.nbd {
        return crate::serve_nbd::run(args, store).await;
    }
    let tls = args.tls.config();
    let listen = args.listen("127.0.0.1:7400");
    let listener = Listener::bind(&listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    let defaults = ServeOptions::default();
    let opts = ServeOptions {
        read_only: args.read_only,
        max_connections: args.max_connections as usize,
        max_in_flight_per_conn: args.max_in_flight as usize,
        tls,
        idle_timeout: args.idle_timeout,
        handshake_timeout: args.handshake_timeout.unwrap_or(defaults.handshake_timeout),
        total_budget: args.max_memory.map_or(defaults.total_budget, |m| {
            usize::try_from(m).unwrap_or(usize::MAX)
        }),
        log: !args.quiet,
        ..defaults
    };
    let geometry = store.geometry();
    let caps = served_caps(store.caps(), args.read_only);
    let local = listener
        .local_addr()
        .context("reading the address listened on")?;
    let security = match (&args.tls.tls_cert, &args.tls.tls_client_ca) {
        (None, _) => "no TLS",
        (Some(_), None) => "TLS",
        (Some(_), Some(_)) => "mutual TLS",
    };
    // Said before the first connection can be accepted (and logged): tools wait for this
    // line first.
    status!(
        "farmap serve: listening on {local} ({security}{}), serving {} ({geometry}, {caps})",
        if args.read_only { ", read-only" } else { "" },
        args.store,
    );
    let server = serve(store, listener, opts).context("starting the server")?;
    stop_signal().await?;
    status!("farmap serve: shutting down: answering requests in flight, flushing the store");
    server
        .shutdown()
        .await
        .context("shutting the server down")?;
    status!("farmap serve: stopped");
    Ok(ExitCode::SUCCESS)
}

/// What clients are told the store can do.
fn served_caps(caps: Caps, read_only: bool) -> Caps {
    if read_only {
        caps.without(Caps::WRITE | Caps::TRIM)
    } else {
        caps
    }
}

async fn run_grpc(
    args: ServeArgs,
    store: std::sync::Arc<dyn farmap::Store>,
) -> anyhow::Result<ExitCode> {
    let listen = args.listen("127.0.0.1:7400");
    let ListenAddr::Tcp(addr) = &listen else {
        anyhow::bail!("--grpc listens on TCP only (IP:PORT), not {listen}");
    };
    if args.max_memory.is_some() {
        anyhow::bail!(
            "--max-memory applies to farmap's native protocol only; a gRPC server's memory is \
             bounded by --max-connections × --max-in-flight × its largest message"
        );
    }
    if args.handshake_timeout.is_some() {
        anyhow::bail!(
            "--handshake-timeout applies to farmap's native protocol only; a gRPC connection \
             that moves no bytes is closed after --idle-timeout"
        );
    }
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let local = listener.local_addr()?;
    status!(
        "farmap serve: listening on {local} (gRPC{}), serving {} ({}, {})",
        if args.read_only { ", read-only" } else { "" },
        args.store,
        store.geometry(),
        served_caps(store.caps(), args.read_only),
    );
    let opts = farmap_grpc::GrpcServerOptions {
        read_only: args.read_only,
        max_connections: args.max_connections as usize,
        max_in_flight: args.max_in_flight,
        idle_timeout: args.idle_timeout,
        log: !args.quiet,
        ..farmap_grpc::GrpcServerOptions::default()
    };
    let flush = store.clone();
    farmap_grpc::serve_grpc_with_shutdown(store, listener, opts, async {
        let _ = stop_signal().await;
    })
    .await
    .context("the gRPC server failed")?;
    flush
        .flush()
        .await
        .context("flushing the store at shutdown")?;
    status!("farmap serve: stopped; the store is flushed");
    Ok(ExitCode::SUCCESS)
}
