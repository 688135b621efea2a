//! `farmap serve --nbd`: serve stores as NBD exports.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use farmap::spec::open_store_async;
use farmap::{ManagedOptions, StoreSpec};
use farmap_nbd::{serve_nbd, Export, NbdServeOptions};
use farmap_net::Listener;

use farmap_cli_kit::metrics::Metrics;

use crate::serve_args::ServeArgs;
use crate::stop::stop_signal;

/// Parses `NAME=SPEC`.
fn parse_export(s: &str) -> anyhow::Result<(String, StoreSpec)> {
    let (name, spec) = s
        .split_once('=')
        .with_context(|| format!("--export {s:?}: write NAME=SPEC (e.g. disk2=memory:1GiB)"))?;
    let spec: StoreSpec = spec
        .parse()
        .with_context(|| format!("--export {name}: the store spec {spec:?}"))?;
    Ok((name.to_owned(), spec))
}

/// Opens the stores of `--export NAME=SPEC` (each counted in `metrics` as
/// `store="export:NAME"`) and adds them to `exports`: the specs of every export, the
/// default one first.
async fn more_exports(
    args: &ServeArgs,
    metrics: &Metrics,
    exports: &mut Vec<Export>,
) -> anyhow::Result<Vec<StoreSpec>> {
    let mut specs = vec![args.store().clone()];
    for e in &args.exports {
        let (name, spec) = parse_export(e)?;
        specs.push(spec.clone());
        let store = open_store_async(&spec)
            .await
            .with_context(|| format!("opening the store of export {name:?}"))?;
        let store = metrics.meter(&format!("export:{name}"), &spec, store);
        exports.push(Export {
            name,
            description: spec.to_string(),
            store,
            read_only: args.read_only,
        });
    }
    Ok(specs)
}

pub async fn run(
    args: ServeArgs,
    store: Arc<dyn farmap::Store>,
    metrics: Metrics,
) -> anyhow::Result<ExitCode> {
    let managed = if args.managed {
        let m =
            crate::mount::open_managed(store.clone(), ManagedOptions::default(), args.cache_max)
                .context("starting the managed (cached) store")?;
        let m = Arc::new(m);
        metrics.managed(&m);
        Some(m)
    } else {
        None
    };
    let served: Arc<dyn farmap::Store> = match &managed {
        Some(m) => m.clone(),
        None => store,
    };
    let mut exports = vec![Export {
        name: String::new(),
        description: if managed.is_some() {
            format!("{} (managed)", args.store())
        } else {
            args.store().to_string()
        },
        store: served,
        read_only: args.read_only,
    }];
    let specs = more_exports(&args, &metrics, &mut exports).await?;
    let listen = args.listen("127.0.0.1:10809");
    let listener = Listener::bind(&listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    let defaults = NbdServeOptions::default();
    let opts = NbdServeOptions {
        max_connections: args.max_connections as usize,
        max_in_flight_per_conn: args.max_in_flight as usize,
        max_running: args.max_running(specs.iter()),
        tls: args.tls.config(),
        idle_timeout: args.idle_timeout,
        handshake_timeout: args.handshake_timeout.unwrap_or(defaults.handshake_timeout),
        log: !args.quiet,
        total_budget: args.max_memory.map_or(defaults.total_budget, |m| {
            usize::try_from(m).unwrap_or(usize::MAX)
        }),
        ..defaults
    };
    let described: Vec<String> = exports
        .iter()
        .map(|e| format!("{:?} = {} ({})", e.name, e.description, e.store.geometry()))
        .collect();
    let local = listener
        .local_addr()
        .context("reading the address listened on")?;
    let security = match (&args.tls.tls_cert, &args.tls.tls_client_ca) {
        (None, _) => "no TLS",
        (Some(_), None) => "TLS required",
        (Some(_), Some(_)) => "mutual TLS required",
    };
    // Said before the first connection can be accepted (and logged): tools wait for this
    // line first.
    status!(
        "farmap serve: listening on {local} (NBD, {security}{}), exports: {}",
        if args.read_only { ", read-only" } else { "" },
        described.join(", "),
    );
    if let (Some(m), Some(max)) = (&managed, args.cache_max) {
        // After the banner: tools wait for that line first.
        let size = farmap::Store::geometry(&**m).size();
        status!("{}", crate::mount::cache_max_note(size, max));
    }
    let server = serve_nbd(exports, listener, opts).context("starting the NBD server")?;
    metrics.connections("nbd", server.connection_stats());
    let _endpoint = args.metrics.serve("serve", &metrics).await?;
    stop_signal().await?;
    status!("farmap serve: shutting down: answering requests in flight, flushing the stores");
    server
        .shutdown()
        .await
        .context("shutting the NBD server down")?;
    if let Some(m) = managed {
        crate::mount::report_evictions(&m);
        status!("farmap serve: pushing what the managed store still holds");
        farmap::Store::flush(&*m)
            .await
            .context("pushing the last writes to the remote store")?;
    }
    status!("farmap serve: stopped");
    Ok(ExitCode::SUCCESS)
}
