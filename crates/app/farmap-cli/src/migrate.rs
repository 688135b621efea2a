//! `farmap seed` and `farmap leech`: drive a live migration through the migration agents of
//! the applications that hold (or will hold) the region.
//!
//! Each command connects to an agent's Unix socket, sends one request, shows the agent's
//! progress on stderr and prints the result on stdout. Its connection bounds the migration:
//! Ctrl-C (or the command dying) before the hand-over abandons it and leaves the source
//! running untouched; after the hand-over the migration always finishes.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::bail;
use clap::Args;
use farmap_migrate::agent::{ClientTls, FailKind, LeechRequest, Request, SeedRequest, ServerTls};
use farmap_net::{ListenAddr, RemoteAddr};
use serde_json::{Map, Value};

use farmap_cli_kit::args::{parse_duration, PullArgs};
use farmap_cli_kit::drive::{drive, Outcome, Ui};
use farmap_cli_kit::output::{self, ServerTlsArgs};

const AGENT_HELP: &str = "\
THE AGENT:
  The application that holds the region runs a migration agent on a Unix socket
  (farmap_migrate::agent::serve in Rust); --app names that socket. The destination
  application runs one too, holding no region yet. Only the socket's owner can use it.
  A mounted file has one with `farmap mount DIR STORE --agent SOCKET`; its destination
  is `farmap mount DIR2 --agent SOCKET2` (no store: it mounts when the file arrives).

  Ctrl-C before the hand-over abandons the migration: the leecher is told, write
  tracking stops and the source keeps running untouched. After the hand-over the
  migration finishes (ownership has moved); a second Ctrl-C only stops watching.

THE KEY:
  Seeder and leecher prove to each other that they hold the same secret (HMAC
  challenges; the secret never travels), so nobody else who reaches the control port
  can take the migration or read the region's pages. It lives in a key file:
  --key-file, else $FARMAP_KEY_FILE, else $XDG_CONFIG_HOME/farmap/key, else
  ~/.config/farmap/key. The first `farmap seed` creates it (a random 256-bit secret,
  mode 0600); copy it to the destination host (same user, mode 0600). A key file that
  other users can read is refused. TLS (--tls-*) encrypts the traffic on top.";

fn parse_mode(s: &str) -> Result<farmap_migrate::Mode, String> {
    s.parse()
}

#[derive(Debug, Args)]
#[command(after_help = AGENT_HELP)]
pub struct SeedArgs {
    /// The source application's migration agent (a Unix socket path).
    #[arg(long, value_name = "SOCKET")]
    app: PathBuf,
    /// Where leechers connect for control: IP:PORT or unix:/path.
    #[arg(long, default_value = "127.0.0.1:7100")]
    listen: ListenAddr,
    /// Where the data plane (the region's pages) listens. Port 0 picks a free port, which
    /// leechers learn over the control connection. With a unix: control socket, leechers
    /// look for the data plane at the same path with the extension .data unless told.
    #[arg(long, default_value = "127.0.0.1:0")]
    data_listen: ListenAddr,
    /// TLS for both listeners (leechers connect with --tls-ca, and for mutual TLS
    /// --tls-cert and --tls-key).
    #[command(flatten)]
    tls: ServerTlsArgs,
    /// How long to wait for a leecher that lost its connection after the hand-over.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    reconnect_wait: Duration,
    #[command(flatten)]
    pull: PullArgs,
    /// Instant migrations (`farmap leech --mode instant`): how long the source pushes what
    /// the shared store lacks while the application still runs, before it suspends.
    /// Whatever is left is fetched from the source after the hand-over.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    push_budget: Duration,
    /// The migration key file (default: $FARMAP_KEY_FILE, else
    /// $XDG_CONFIG_HOME/farmap/key, else ~/.config/farmap/key). Created if missing.
    #[arg(long, value_name = "PATH")]
    key_file: Option<PathBuf>,
    /// Print the result as one JSON line.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
#[command(after_help = AGENT_HELP)]
pub struct LeechArgs {
    /// The destination application's migration agent (a Unix socket path).
    #[arg(long, value_name = "SOCKET")]
    app: PathBuf,
    /// The seeder's control address: HOST:PORT or unix:/path.
    #[arg(long, value_name = "ADDR")]
    from: RemoteAddr,
    /// The seeder's data plane, if it is not reachable at the control host with the port the
    /// seeder announces (through a proxy or NAT, for example).
    #[arg(long, value_name = "ADDR")]
    data: Option<RemoteAddr>,
    /// How the region moves. precopy: pull it while the source runs, then pause for the
    /// last changes (--max-downtime). postcopy: hand over at once; every chunk comes from
    /// the source afterwards, faulted chunks first. instant: for a region that lives in a
    /// store both hosts reach (redis://, s3://, cql://, farmap://): the source pushes what
    /// the store lacks, pauses, and sends a manifest (per chunk: in the store with its
    /// checksum, or only at the source); the destination resumes at once, reads the store,
    /// checks every chunk, and takes from the source only what the store lacks.
    #[arg(long, default_value = "precopy", value_parser = parse_mode)]
    mode: farmap_migrate::Mode,
    /// Instant mode: the shared store to open here instead of the spec the source announces
    /// (another address for it, or this host's credentials).
    #[arg(long, value_name = "SPEC")]
    store: Option<String>,
    /// Downtime budget: pre-copy rounds go on until the last changes fit in it (or stop
    /// shrinking, or --max-rounds is reached).
    #[arg(long, default_value = "10ms", value_parser = parse_duration)]
    max_downtime: Duration,
    /// Most pre-copy rounds before finalizing anyway.
    #[arg(long, default_value_t = 30)]
    max_rounds: u32,
    /// Background pull workers.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=4096))]
    workers: u32,
    /// Data-plane connections.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=256))]
    connections: u32,
    /// TLS: the CA the seeder's certificate must be issued by (PEM).
    #[arg(long)]
    tls_ca: Option<PathBuf>,
    /// Mutual TLS: this leecher's certificate chain (PEM).
    #[arg(long, requires = "tls_ca", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// Mutual TLS: its private key (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// TLS: the name the seeder's certificate must hold (default: the host of --from).
    #[arg(long, requires = "tls_ca")]
    tls_server_name: Option<String>,
    /// How long to keep reconnecting to the seeder after the hand-over.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    reconnect_for: Duration,
    #[command(flatten)]
    pull: PullArgs,
    /// The migration key file (default: $FARMAP_KEY_FILE, else
    /// $XDG_CONFIG_HOME/farmap/key, else ~/.config/farmap/key). It must hold the
    /// seeder's secret.
    #[arg(long, value_name = "PATH")]
    key_file: Option<PathBuf>,
    /// Print the result as one JSON line.
    #[arg(long)]
    json: bool,
}

fn finish(
    role: &str,
    outcome: Outcome,
    json: bool,
    human: impl Fn(&Map<String, Value>) -> String,
) -> anyhow::Result<ExitCode> {
    match outcome {
        Outcome::Done(mut report) => {
            if json {
                report.insert("role".into(), Value::from(role));
                output::json_line(&report)?;
            } else {
                println!("{}", human(&report));
            }
            Ok(ExitCode::SUCCESS)
        }
        Outcome::Failed(FailKind::Cancelled, message) => {
            status!("farmap {role}: {message}");
            Ok(ExitCode::from(130))
        }
        Outcome::Failed(_, message) => bail!("{message}"),
    }
}

/// The migration key's secret from `given` or the default key file; a seeder creates the file
/// when there is none, and says so as `who`.
pub(crate) fn key_secret(
    given: Option<PathBuf>,
    create: bool,
    who: &str,
) -> anyhow::Result<String> {
    use farmap_net::auth::{default_key_file, read_or_create_secret, read_secret};
    let path = match given {
        Some(p) => p,
        None => default_key_file()?,
    };
    if !create {
        return Ok(read_secret(&path)?);
    }
    let (secret, created) = read_or_create_secret(&path)?;
    if created {
        status!(
            "{who}: created the migration key {}: copy it to the destination host \
             (same user, mode 600)",
            path.display()
        );
    }
    Ok(secret)
}

pub async fn seed(args: SeedArgs) -> anyhow::Result<ExitCode> {
    let key = key_secret(args.key_file, true, "farmap seed")?;
    let request = Request::Seed(SeedRequest {
        listen: args.listen.to_string(),
        data_listen: args.data_listen.to_string(),
        tls: args.tls.config().map(|c| ServerTls {
            cert: c.cert,
            key: c.key,
            client_ca: c.client_ca,
        }),
        reconnect_ms: args.reconnect_wait.as_millis() as u64,
        pull: args.pull.budget(),
        push_budget_ms: args.push_budget.as_millis() as u64,
        key: Some(key),
    });
    let ui = Ui {
        prefix: "farmap seed",
        notes: true,
        bar: false,
    };
    let outcome = drive(&args.app, request, ui, |_, _| {}).await?;
    finish("seed", outcome, args.json, |r| {
        format!(
            "seeded: handed over and released after {} ms; {} dirty sets, {} pages re-sent",
            r["elapsed_ms"], r["dirty_sets"], r["dirty_pages"]
        )
    })
}

pub async fn leech(args: LeechArgs) -> anyhow::Result<ExitCode> {
    if args.store.is_some() && args.mode != farmap_migrate::Mode::Instant {
        bail!("--store names the shared store of an instant migration: add --mode instant");
    }
    let key = key_secret(args.key_file, false, "farmap leech")?;
    let request = Request::Leech(LeechRequest {
        from: args.from.to_string(),
        data: args.data.map(|d| d.to_string()),
        tls: args.tls_ca.map(|ca| ClientTls {
            ca,
            cert: args.tls_cert,
            key: args.tls_key,
            server_name: args.tls_server_name,
        }),
        max_downtime_us: args.max_downtime.as_micros() as u64,
        max_rounds: args.max_rounds,
        workers: args.workers as usize,
        connections: args.connections as usize,
        reconnect_ms: args.reconnect_for.as_millis() as u64,
        pull: args.pull.budget(),
        mode: args.mode,
        store: args.store,
        key: Some(key),
    });
    let ui = Ui {
        prefix: "farmap leech",
        notes: true,
        bar: !args.json,
    };
    let outcome = drive(&args.app, request, ui, |_, _| {}).await?;
    if let Outcome::Done(r) = &outcome {
        warn_unless_converged(r);
    }
    finish("leech", outcome, args.json, |r| {
        let mb = |k: &str| r[k].as_u64().unwrap_or(0) as f64 / 1e6;
        let mut line = format!(
            "leeched ({}): downtime {} ms, total {} ms, {} rounds, {:.1} MB before resuming, \
             pre-copy {:.1} MB + post-copy {:.1} MB of a {:.1} MB region",
            r["mode"].as_str().unwrap_or("precopy"),
            r["downtime_ms"],
            r["total_ms"],
            r["rounds"],
            mb("bytes_before_resume"),
            mb("bytes_precopy"),
            mb("bytes_postcopy"),
            mb("region_bytes"),
        );
        if r["mode"] == "instant" {
            line += &format!(
                "; chunks: {} from the shared store, {} from the source, {} failed their check",
                r["chunks_from_store"], r["chunks_from_source"], r["verify_failures"]
            );
        } else {
            line += &format!(", source dirtying {} MB/s", r["dirty_rate_mb_per_s"]);
        }
        line
    })
}

/// Warns on stderr when pre-copy did not converge or the downtime exceeded its budget (the
/// JSON result says so too: `converged`, `downtime_over_budget`).
fn warn_unless_converged(r: &Map<String, Value>) {
    if r.get("converged") == Some(&Value::Bool(false)) {
        status!(
            "farmap leech: warning: pre-copy did not converge after {} rounds (the last dirty \
             set did not fit the downtime budget); it finalized anyway",
            r.get("rounds").unwrap_or(&Value::Null)
        );
    }
    if r.get("downtime_over_budget") == Some(&Value::Bool(true)) {
        status!(
            "farmap leech: warning: the downtime of {} ms exceeded its budget of {} ms",
            r.get("downtime_ms").unwrap_or(&Value::Null),
            r.get("max_downtime_ms").unwrap_or(&Value::Null)
        );
    }
}
