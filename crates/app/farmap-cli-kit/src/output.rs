//! Output conventions: results on stdout (human or one JSON object per line), progress on
//! stderr, errors as one line with their causes.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;

/// A status line on stderr (`eprintln!` without its panic): a daemon whose stderr pipe was
/// closed by its parent must still flush and stop cleanly at SIGTERM, so a failed write of
/// a status line is ignored.
///
/// With `--log-format json` ([`set_json_status`]) it is a log event instead (target
/// `farmap::status`, level info), written as one JSON object like every other log line.
#[macro_export]
macro_rules! status {
    ($($arg:tt)*) => {{
        if $crate::output::json_status() {
            // Formatted out here: the caller's names must not meet the event macro's.
            let line = format!($($arg)*);
            $crate::tracing::info!(target: "farmap::status", "{}", line);
        } else {
            use std::io::Write as _;
            let _ = writeln!(std::io::stderr(), $($arg)*);
        }
    }};
}

static JSON_STATUS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes [`status!`] lines log events (`--log-format json`).
pub fn set_json_status() {
    JSON_STATUS.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Whether [`status!`] lines are log events.
pub fn json_status() -> bool {
    JSON_STATUS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Prints `value` as one JSON line on stdout.
pub fn json_line<T: Serialize>(value: &T) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer(&mut out, value)?;
    out.write_all(b"\n")?;
    out.flush()?;
    Ok(())
}

/// An error with its whole chain of causes on one line: "a: b: c".
pub fn error_chain(err: &anyhow::Error) -> String {
    farmap::error_chain(err.as_ref())
}

/// A byte progress bar on stderr, hidden when stderr is not a terminal or when `quiet`.
pub fn byte_bar(total: u64, what: &str, quiet: bool) -> ProgressBar {
    if quiet || json_status() || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr_with_hz(10));
    bar.set_style(
        ProgressStyle::with_template(
            "{msg} [{bar:40}] {decimal_bytes}/{decimal_total_bytes} {decimal_bytes_per_sec} eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_message(what.to_owned());
    bar.enable_steady_tick(Duration::from_millis(100));
    bar
}

/// Megabytes (10^6 bytes) per second, rounded to 0.1.
pub fn mb_per_s(bytes: u64, elapsed: Duration) -> f64 {
    let secs = elapsed.as_secs_f64();
    if secs == 0.0 {
        return 0.0;
    }
    round1(bytes as f64 / secs / 1e6)
}

/// Rounds to one decimal.
pub fn round1(v: f64) -> f64 {
    (v * 10.0).round() / 10.0
}

/// The TLS options of every command that listens on a network.
#[derive(Debug, Clone, clap::Args)]
pub struct ServerTlsArgs {
    /// TLS: the certificate chain (PEM) presented to clients.
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// TLS: its private key (PEM).
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Mutual TLS: clients must present a certificate issued by this CA (PEM); others are
    /// refused.
    #[arg(long, requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
}

impl ServerTlsArgs {
    /// The configuration, if TLS was asked for.
    pub fn config(&self) -> Option<farmap_net::TlsServerConfig> {
        let cert = self.tls_cert.clone()?;
        Some(farmap_net::TlsServerConfig {
            cert,
            key: self
                .tls_key
                .clone()
                .expect("clap requires --tls-key with --tls-cert"),
            client_ca: self.tls_client_ca.clone(),
        })
    }
}
