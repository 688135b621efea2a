//! The flags of `farmap serve`, for every protocol it serves (native, gRPC, NBD).

use std::time::Duration;

use clap::Args;
use farmap::StoreSpec;
use farmap_cli_kit::args::{parse_duration, parse_size_arg};
use farmap_cli_kit::metrics::MetricsArgs;
use farmap_cli_kit::output::ServerTlsArgs;
use farmap_net::ListenAddr;

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// The store to serve (any spec, even a remote one: the server then relays).
    #[arg(required_unless_present = "objects")]
    pub(crate) store: Option<StoreSpec>,
    /// Serve the named objects of a versioned layout kept in SPEC (dir:PATH, s3://...,
    /// redis://..., cql://...) instead of a region: other hosts then keep versioned regions
    /// here as versioned:(farmap://HOST:PORT)/REGION, each writer fenced by this server's
    /// atomic creates. Keys clients send are checked before anything is opened.
    #[arg(long, value_name = "SPEC", conflicts_with_all = ["store", "grpc", "nbd"])]
    pub(crate) objects: Option<StoreSpec>,
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
    /// Requests working on the store at once over all connections, taken from each
    /// connection in turn, so that clients with long queues do not slow one that asks one
    /// request at a time. Default: the number of CPUs for a store on this host, 64 when the
    /// store (or one of an NBD server's exports) is on another host.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub(crate) max_running: Option<u32>,
    /// Close a connection that sends nothing for this long with nothing in flight, or whose
    /// replies have not been read for this long (e.g. 30s, 2m is 120s).
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    pub(crate) idle_timeout: Duration,
    /// Time a client has to finish the TLS and farmap handshakes (native protocol only).
    #[arg(long, value_parser = parse_duration)]
    pub(crate) handshake_timeout: Option<Duration>,
    /// Bytes of requests in flight and replies not yet sent, over all connections (native
    /// protocol, gRPC and NBD; each connection also has its own budget: 32 MiB native, two
    /// of its largest requests gRPC, 64 MiB NBD; a total under it is raised to it).
    /// Default 256MiB.
    #[arg(long, value_parser = parse_size_arg)]
    pub(crate) max_memory: Option<u64>,
    /// Serve the gRPC service (`farmap.v1.Store`, for other languages and tools) instead of
    /// farmap's native protocol; clients use `farmap+grpc://HOST:PORT`. TCP only, no TLS.
    #[arg(long, conflicts_with_all = ["tls_cert", "tls_key", "tls_client_ca"])]
    pub(crate) grpc: bool,
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
    #[command(flatten)]
    pub(crate) metrics: MetricsArgs,
}

impl ServeArgs {
    /// The store to serve (present unless `--objects` is: clap checks it).
    pub(crate) fn store(&self) -> &StoreSpec {
        self.store
            .as_ref()
            .expect("clap requires STORE unless --objects is given")
    }

    /// `--max-running`, or the default for stores of `specs`.
    pub(crate) fn max_running<'a>(&self, mut specs: impl Iterator<Item = &'a StoreSpec>) -> usize {
        match self.max_running {
            Some(n) => n as usize,
            None if specs.any(StoreSpec::is_remote) => farmap_net::fair::REMOTE_LIMIT,
            None => farmap_net::fair::local_limit(),
        }
    }

    /// `--listen`, or `default`.
    pub(crate) fn listen(&self, default: &str) -> ListenAddr {
        self.listen
            .clone()
            .unwrap_or_else(|| default.parse().expect("a valid default address"))
    }
}
