//! `farmap serve`: serve a store to other hosts over farmap's protocol.

use std::process::ExitCode;

use anyhow::Context;

use farmap::spec::open_store_async;
use farmap::Caps;
use farmap_cli_kit::metrics::Metrics;
use farmap_net::{serve, serve_objects, ListenAddr, Listener, ServeOptions};

pub use crate::serve_args::ServeArgs;
use crate::stop::{listen_for_stop, stop_signal};

pub async fn run(args: ServeArgs) -> anyhow::Result<ExitCode> {
    listen_for_stop()?;
    if let Some(objects) = args.objects.clone() {
        return run_objects(args, objects).await;
    }
    let metrics = args.metrics.metrics();
    let store = open_store_async(args.store())
        .await
        .context("opening the store to serve")?;
    let store = metrics.meter("served", args.store(), store);
    if args.grpc {
        return run_grpc(args, store, metrics).await;
    }
    if args.nbd {
        return crate::serve_nbd::run(args, store, metrics).await;
    }
    let (listener, opts) = native_listener(&args, args.store()).await?;
    let geometry = store.geometry();
    let caps = served_caps(store.caps(), args.read_only);
    // Said before the first connection can be accepted (and logged): tools wait for this
    // line first.
    status!(
        "farmap serve: listening on {} ({}{}), serving {} ({geometry}, {caps})",
        local_addr(&listener)?,
        security(&args),
        if args.read_only { ", read-only" } else { "" },
        args.store(),
    );
    let server = serve(store, listener, opts).context("starting the server")?;
    metrics.connections("native", server.connection_stats());
    let _endpoint = args.metrics.serve("serve", &metrics).await?;
    until_stopped(server, ", flushing the store").await
}

/// `farmap serve --objects SPEC`: the named objects of a versioned layout, for
/// `versioned:(farmap://HOST:PORT)/REGION` on other hosts.
async fn run_objects(args: ServeArgs, spec: farmap::StoreSpec) -> anyhow::Result<ExitCode> {
    let objects = farmap::spec::open_objects(&spec)
        .await
        .with_context(|| format!("opening the objects to serve ({spec})"))?;
    let (listener, opts) = native_listener(&args, &spec).await?;
    let local = local_addr(&listener)?;
    status!(
        "farmap serve: listening on {local} ({}{}), serving the objects in {spec} (open a \
         region in them as versioned:(farmap://{local})/REGION)",
        security(&args),
        if args.read_only { ", read-only" } else { "" },
    );
    let server = serve_objects(objects, listener, opts).context("starting the server")?;
    let metrics = args.metrics.metrics();
    metrics.connections("native", server.connection_stats());
    let _endpoint = args.metrics.serve("serve", &metrics).await?;
    until_stopped(server, "").await
}

/// Runs `server` until SIGTERM or Ctrl-C, then shuts it down cleanly (`also`: what its
/// shutdown does besides answering the requests in flight, for the message).
async fn until_stopped(server: farmap_net::Server, also: &str) -> anyhow::Result<ExitCode> {
    stop_signal().await?;
    status!("farmap serve: shutting down: answering requests in flight{also}");
    server
        .shutdown()
        .await
        .context("shutting the server down")?;
    status!("farmap serve: stopped");
    Ok(ExitCode::SUCCESS)
}

/// The listener and options of farmap's native protocol, serving `spec`.
async fn native_listener(
    args: &ServeArgs,
    spec: &farmap::StoreSpec,
) -> anyhow::Result<(Listener, ServeOptions)> {
    let listen = args.listen("127.0.0.1:7400");
    let listener = Listener::bind(&listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    let defaults = ServeOptions::default();
    let opts = ServeOptions {
        read_only: args.read_only,
        max_connections: args.max_connections as usize,
        max_in_flight_per_conn: args.max_in_flight as usize,
        max_running: args.max_running(std::iter::once(spec)),
        tls: args.tls.config(),
        idle_timeout: args.idle_timeout,
        handshake_timeout: args.handshake_timeout.unwrap_or(defaults.handshake_timeout),
        total_budget: args.max_memory.map_or(defaults.total_budget, |m| {
            usize::try_from(m).unwrap_or(usize::MAX)
        }),
        log: !args.quiet,
        ..defaults
    };
    Ok((listener, opts))
}

fn local_addr(listener: &Listener) -> anyhow::Result<ListenAddr> {
    listener
        .local_addr()
        .context("reading the address listened on")
}

/// How connections are secured, in words.
fn security(args: &ServeArgs) -> &'static str {
    match (&args.tls.tls_cert, &args.tls.tls_client_ca) {
        (None, _) => "no TLS",
        (Some(_), None) => "TLS",
        (Some(_), Some(_)) => "mutual TLS",
    }
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
    metrics: Metrics,
) -> anyhow::Result<ExitCode> {
    let listen = args.listen("127.0.0.1:7400");
    let ListenAddr::Tcp(addr) = &listen else {
        anyhow::bail!("--grpc listens on TCP only (IP:PORT), not {listen}");
    };
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
        args.store(),
        store.geometry(),
        served_caps(store.caps(), args.read_only),
    );
    let _endpoint = args.metrics.serve("serve", &metrics).await?;
    let defaults = farmap_grpc::GrpcServerOptions::default();
    let opts = farmap_grpc::GrpcServerOptions {
        read_only: args.read_only,
        max_connections: args.max_connections as usize,
        max_in_flight: args.max_in_flight,
        max_running: args.max_running(std::iter::once(args.store())),
        idle_timeout: args.idle_timeout,
        log: !args.quiet,
        total_budget: args.max_memory.map_or(defaults.total_budget, |m| {
            usize::try_from(m).unwrap_or(usize::MAX)
        }),
        ..defaults
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
