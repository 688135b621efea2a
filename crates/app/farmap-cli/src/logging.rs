//! Logs of the libraries (`tracing`) on stderr: results stay alone on stdout.
//!
//! `FARMAP_LOG` takes `tracing_subscriber`'s filter syntax (`debug`, `farmap_net=trace`, ...);
//! by default farmap's own crates log at `info` and everything else at `warn`.
//!
//! `--log-format json` (or `FARMAP_LOG_FORMAT=json`) writes one JSON object per line
//! instead: `timestamp`, `level`, `target`, `fields` (with `message`), and the spans the
//! event happened in (`span` and `spans`: a connection's server and peer, a migration's
//! side, a mount's directory, a `farmap run` program's pid). The command's own status lines
//! become events of target `farmap::status`, which `FARMAP_LOG` does not filter out.

use tracing_subscriber::EnvFilter;

/// The filter used when `FARMAP_LOG` is unset. The CQL driver logs a failed connection at
/// `error` before returning the same error, which farmap prints with its context, so its logs
/// are off unless asked for (`FARMAP_LOG=scylla=warn`).
const DEFAULT_FILTER: &str = "warn,farmap=info,farmap_cli=info,farmap_core=info,\
farmap_store=info,farmap_pipeline=info,farmap_uffd=info,farmap_wire=info,farmap_net=info,\
farmap_grpc=info,farmap_migrate=info,farmap_nbd=info,farmap_nbd_proto=info,farmap_ublk=info,\
farmap_fuse=info,farmap_redis=info,farmap_s3=info,farmap_cql=info,scylla=off";

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// One line of text per event, for people.
    #[default]
    Text,
    /// One JSON object per event, for machines.
    Json,
}

/// Installs the stderr subscriber (once; later calls do nothing). `quiet` raises the default
/// level of farmap's crates to `warn`.
pub fn init(quiet: bool, format: LogFormat) {
    let filter = match std::env::var("FARMAP_LOG") {
        Ok(s) if !s.trim().is_empty() => EnvFilter::new(s),
        _ if quiet => EnvFilter::new("warn"),
        _ => EnvFilter::new(DEFAULT_FILTER),
    };
    match format {
        LogFormat::Text => {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_writer(|| QuietStderr)
                .with_target(false)
                .without_time()
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .try_init();
        }
        LogFormat::Json => {
            farmap_cli_kit::output::set_json_status();
            let status = "farmap::status=info".parse().expect("a valid directive");
            let _ = tracing_subscriber::fmt()
                .json()
                .with_current_span(true)
                .with_span_list(true)
                .with_env_filter(filter.add_directive(status))
                .with_writer(|| QuietStderr)
                .try_init();
        }
    }
}

/// stderr for logs, where a failed write is dropped: tracing-subscriber reports a writer error
/// with `eprintln!`, which panics when the parent has closed our stderr pipe, and a log line
/// must never take a daemon's connection (or its shutdown flush) down with it.
struct QuietStderr;

impl std::io::Write for QuietStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = std::io::stderr().write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let _ = std::io::stderr().flush();
        Ok(())
    }
}
