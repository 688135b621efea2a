//! `farmap serve`: serve a store to other hosts over farmap's protocol.

use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use farmap::spec::open_store_async;
use farmap::StoreSpec;
use farmap_net::{serve, ListenAddr, Listener, ServeOptions};

use crate::output::ServerTlsArgs;

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// The store to serve (any spec, even a remote one: the server then relays).
    store: StoreSpec,
    /// Where to listen: IP:PORT, or unix:/path for a Unix socket. Port 0 picks a free port
    /// (the address is printed on stderr).
    #[arg(long, default_value = "127.0.0.1:7400")]
    listen: ListenAddr,
    #[command(flatten)]
    tls: ServerTlsArgs,
    /// Refuse writes and trims.
    #[arg(long)]
    read_only: bool,
    /// Clients served at once; more are refused with a clear reason.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    max_connections: u32,
    /// Requests worked on at once per connection (more wait in the socket).
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..=65536))]
    max_in_flight: u32,
    /// Serve the gRPC service (`farmap.v1.Store`, for other languages and tools) instead of
    /// farmap's native protocol; clients use `farmap+grpc://HOST:PORT`. TCP only, no TLS.
    #[arg(long, conflicts_with_all = ["tls_cert", "tls_key", "tls_client_ca"])]
    grpc: bool,
    /// Do not log connections (the listening address and shutdown are still printed).
    #[arg(long, short)]
    quiet: bool,
}

/// Resolves on Ctrl-C or SIGTERM.
async fn stop_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("listening for SIGTERM")?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r.context("listening for Ctrl-C")?,
        _ = term.recv() => {}
    }
    Ok(())
}

pub async fn run(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let store = open_store_async(&args.store)
        .await
        .context("opening the store to serve")?;
    if args.grpc {
        return run_grpc(args, store).await;
    }
    let tls = args.tls.config();
    let listener = Listener::bind(&args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let opts = ServeOptions {
        read_only: args.read_only,
        max_connections: args.max_connections as usize,
        max_in_flight_per_conn: args.max_in_flight as usize,
        tls,
        log: !args.quiet,
        ..ServeOptions::default()
    };
    let geometry = store.geometry();
    let caps = store.caps();
    let server = serve(store, listener, opts).context("starting the server")?;
    let security = match (&args.tls.tls_cert, &args.tls.tls_client_ca) {
        (None, _) => "no TLS",
        (Some(_), None) => "TLS",
        (Some(_), Some(_)) => "mutual TLS",
    };
    eprintln!(
        "farmap serve: listening on {} ({security}{}), serving {} ({geometry}, {caps})",
        server.local_addr(),
        if args.read_only { ", read-only" } else { "" },
        args.store,
    );
    stop_signal().await?;
    eprintln!("farmap serve: shutting down: answering requests in flight, flushing the store");
    server
        .shutdown()
        .await
        .context("shutting the server down")?;
    eprintln!("farmap serve: stopped");
    Ok(ExitCode::SUCCESS)
}

async fn run_grpc(
    args: ServeArgs,
    store: std::sync::Arc<dyn farmap::Store>,
) -> anyhow::Result<ExitCode> {
    let ListenAddr::Tcp(addr) = &args.listen else {
        anyhow::bail!("--grpc listens on TCP only (IP:PORT), not {}", args.listen);
    };
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let local = listener.local_addr()?;
    eprintln!(
        "listening on {local} (gRPC), serving {} ({}){}",
        args.store,
        store.geometry(),
        if args.read_only { ", read-only" } else { "" }
    );
    let opts = farmap_grpc::GrpcServerOptions {
        read_only: args.read_only,
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
    eprintln!("stopped; the store is flushed");
    Ok(ExitCode::SUCCESS)
}
