//! Prometheus metrics of a long-running command (`farmap serve`, `farmap mount`...):
//! `--metrics-listen ADDR` ([`MetricsArgs`]) serves `GET /metrics` in the text exposition
//! format (see docs/design/metrics.md for the names).
//!
//! - [`Metrics`]: the process's registry. Off (every method does nothing, stores are not
//!   wrapped) unless `--metrics-listen` was given.
//! - [`Metrics::meter`]: a store wrapped in [`Metered`], counting its operations.
//! - [`Metrics::counter`], [`Metrics::gauge`]: values read at scrape time from counters the
//!   code keeps anyway ([`Metrics::connections`], [`Metrics::managed`]).
//! - [`MetricsArgs::serve`]: the endpoint (HTTP or HTTPS, optionally requiring client
//!   certificates), bounded against hostile peers (see `http`).

mod http;
mod readings;
mod store;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};

use anyhow::Context;
use farmap::{Managed, Store, StoreSpec};
use farmap_net::ConnectionStats;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

pub use http::{EXCHANGE_TIMEOUT, MAX_HEAD, MAX_SCRAPES};
pub use readings::Labels;
pub use store::Metered;

use readings::Readings;
use store::{StoreFamilies, StoreLabels};

/// The flags of the metrics endpoint, for every long-running command.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct MetricsArgs {
    /// Serve Prometheus metrics (text exposition format) at http://ADDR/metrics, ADDR being
    /// IP:PORT; port 0 picks a free port (the URL is printed on stderr). Off by default.
    /// Use a loopback address (127.0.0.1:9400) unless other hosts must scrape it, and then
    /// --metrics-tls-cert with --metrics-client-ca.
    #[arg(long, value_name = "IP:PORT")]
    pub metrics_listen: Option<SocketAddr>,
    /// Serve the metrics over TLS (https://) with this certificate chain (PEM).
    #[arg(long, value_name = "PEM", requires_all = ["metrics_tls_key", "metrics_listen"])]
    pub metrics_tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --metrics-tls-cert.
    #[arg(long, value_name = "PEM", requires = "metrics_tls_cert")]
    pub metrics_tls_key: Option<PathBuf>,
    /// Answer only scrapers that present a client certificate issued by this CA (PEM);
    /// needs --metrics-tls-cert.
    #[arg(long, value_name = "PEM", requires = "metrics_tls_cert")]
    pub metrics_client_ca: Option<PathBuf>,
}

/// A running metrics endpoint; it stops when dropped.
#[derive(Debug)]
pub struct Endpoint {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Endpoint {
    /// The address it listens on (the real port when port 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl MetricsArgs {
    /// The process's metrics: on when `--metrics-listen` was given, else off.
    pub fn metrics(&self) -> Metrics {
        if self.metrics_listen.is_some() {
            Metrics::new()
        } else {
            Metrics::default()
        }
    }

    /// Starts the endpoint serving `metrics` when `--metrics-listen` was given, and says on
    /// stderr where: "farmap CMD: metrics on http://ADDR/metrics".
    pub async fn serve(&self, cmd: &str, metrics: &Metrics) -> anyhow::Result<Option<Endpoint>> {
        let Some(listen) = self.metrics_listen else {
            return Ok(None);
        };
        let tls = match (&self.metrics_tls_cert, &self.metrics_tls_key) {
            (Some(cert), Some(key)) => {
                let config = farmap_net::TlsServerConfig {
                    cert: cert.clone(),
                    key: key.clone(),
                    client_ca: self.metrics_client_ca.clone(),
                };
                let config = config.build().context("the metrics endpoint's TLS")?;
                Some(tokio_rustls::TlsAcceptor::from(config))
            }
            _ => None,
        };
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("cannot listen for metrics on {listen}"))?;
        let addr = listener.local_addr()?;
        crate::status!(
            "farmap {cmd}: metrics on {}{}",
            http::url(addr, tls.is_some()),
            match (&tls, &self.metrics_client_ca) {
                (None, _) => "",
                (Some(_), None) => " (TLS)",
                (Some(_), Some(_)) => " (mutual TLS)",
            }
        );
        let metrics = metrics.clone();
        let render: http::Render = Arc::new(move || metrics.encode());
        let task = tokio::spawn(http::serve(listener, tls, render));
        Ok(Some(Endpoint { addr, task }))
    }
}

/// The metrics of a process: cheap to clone (all clones share one registry).
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    inner: Option<Arc<Inner>>,
}

#[derive(Debug)]
struct Inner {
    registry: Mutex<Registry>,
    stores: StoreFamilies,
    readings: Arc<Readings>,
}

impl Metrics {
    /// Metrics that are on: a registry with the store families, and no values yet.
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let stores = StoreFamilies::register(&mut registry);
        let readings = Arc::new(Readings::default());
        registry.register_collector(Box::new(readings.clone()));
        Metrics {
            inner: Some(Arc::new(Inner {
                registry: Mutex::new(registry),
                stores,
                readings,
            })),
        }
    }

    /// Whether these metrics are on.
    pub fn is_on(&self) -> bool {
        self.inner.is_some()
    }

    /// `store` counted under the labels `store=ROLE` (what it is to the command: `served`,
    /// `store`...) and `kind=SCHEME` (`spec`'s scheme, never the spec, which may hold a
    /// password); `store` itself when the metrics are off.
    pub fn meter(&self, role: &str, spec: &StoreSpec, store: Arc<dyn Store>) -> Arc<dyn Store> {
        let Some(inner) = &self.inner else {
            return store;
        };
        let labels = StoreLabels {
            store: role.to_owned(),
            kind: store_kind(spec),
        };
        Arc::new(Metered::new(store, &inner.stores, &labels))
    }

    /// Adds a counter `NAME_total` labelled `labels` whose value `read` gives at each scrape.
    pub fn counter(
        &self,
        name: &'static str,
        help: &'static str,
        labels: Labels,
        read: impl Fn() -> u64 + Send + Sync + 'static,
    ) {
        if let Some(inner) = &self.inner {
            let read = Box::new(read);
            (inner.readings).add(name, help, MetricType::Counter, labels, read);
        }
    }

    /// Adds a gauge `NAME` labelled `labels` whose value `read` gives at each scrape.
    pub fn gauge(
        &self,
        name: &'static str,
        help: &'static str,
        labels: Labels,
        read: impl Fn() -> u64 + Send + Sync + 'static,
    ) {
        if let Some(inner) = &self.inner {
            let read = Box::new(read);
            (inner.readings).add(name, help, MetricType::Gauge, labels, read);
        }
    }

    /// A server's connections, labelled `protocol=PROTOCOL`: `farmap_connections` (being
    /// served), `farmap_connections_accepted_total`, `farmap_connections_refused_total`.
    pub fn connections(&self, protocol: &'static str, stats: Arc<ConnectionStats>) {
        let labels = || vec![("protocol", protocol.to_owned())];
        let s = stats.clone();
        self.gauge(
            "farmap_connections",
            "Connections being served.",
            labels(),
            move || s.open() as u64,
        );
        let s = stats.clone();
        self.counter(
            "farmap_connections_accepted",
            "Connections accepted and served.",
            labels(),
            move || s.accepted(),
        );
        self.counter(
            "farmap_connections_refused",
            "Connections refused at the connection limit.",
            labels(),
            move || stats.refused(),
        );
    }

    /// A managed front's cache and write-back (read through a weak reference: the metrics
    /// never keep it alive).
    pub fn managed(&self, m: &Arc<Managed>) {
        let read = |f: fn(&Managed) -> u64| {
            let weak: Weak<Managed> = Arc::downgrade(m);
            move || weak.upgrade().map_or(0, |m| f(&m))
        };
        let gauges: [ManagedReading; 3] = [
            (
                "farmap_cache_present_chunks",
                "Chunks held in the local cache.",
                |m| m.present_count(),
            ),
            (
                "farmap_cache_dirty_chunks",
                "Chunks written and not yet taken for a push.",
                |m| m.dirty_count(),
            ),
            (
                "farmap_cache_max_chunks",
                "The bound on chunks held (0: unbounded).",
                |m| m.evict_stats().map_or(0, |s| s.max_chunks),
            ),
        ];
        for (name, help, f) in gauges {
            self.gauge(name, help, Vec::new(), read(f));
        }
        let counters: [ManagedReading; 6] = [
            (
                "farmap_push_chunks",
                "Chunks pushed (written back) to the store.",
                |m| m.push_stats().pushed_chunks,
            ),
            ("farmap_push_bytes", "Bytes pushed to the store.", |m| {
                m.push_stats().pushed_bytes
            }),
            (
                "farmap_push_failures",
                "Pushes that failed after their retries.",
                |m| m.push_stats().failed_pushes,
            ),
            (
                "farmap_pull_chunks",
                "Chunks pulled from the store in the background.",
                |m| m.pull_progress().map_or(0, |p| p.fetched_chunks),
            ),
            (
                "farmap_pull_bytes",
                "Bytes pulled from the store in the background.",
                |m| m.pull_progress().map_or(0, |p| p.fetched_bytes),
            ),
            (
                "farmap_cache_evicted_chunks",
                "Chunks dropped from the bounded cache.",
                |m| m.evict_stats().map_or(0, |s| s.evicted_chunks),
            ),
        ];
        for (name, help, f) in counters {
            self.counter(name, help, Vec::new(), read(f));
        }
    }

    /// Every metric now, in the text exposition format (empty when off).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Some(inner) = &self.inner {
            let registry = inner.registry.lock().unwrap_or_else(|e| e.into_inner());
            // Writing into a String cannot fail.
            let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &registry);
        }
        out
    }
}

/// A value of a managed front: name, help, and how to read it.
type ManagedReading = (&'static str, &'static str, fn(&Managed) -> u64);

/// The kind of store a spec names, for a label: its scheme (`redis`, `s3`, `farmaps`,
/// `verified`...), never what follows (a password, a path).
fn store_kind(spec: &StoreSpec) -> String {
    let shown = spec.to_string();
    let scheme: String = shown
        .split(':')
        .next()
        .unwrap_or_default()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '_' | '.'))
        .collect();
    if scheme.is_empty() {
        "unknown".to_owned()
    } else {
        scheme.to_ascii_lowercase()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_kind_is_its_scheme_and_nothing_else() {
        let kind = |s: &str| store_kind(&s.parse().unwrap());
        assert_eq!(kind("memory:1MiB"), "memory");
        assert_eq!(kind("dir:/tmp/x?size=1MiB"), "dir");
        assert_eq!(kind("farmap://127.0.0.1:7400"), "farmap");
        assert_eq!(
            kind("redis://user:secret@127.0.0.1:6379/0?prefix=a"),
            "redis"
        );
    }

    #[tokio::test]
    async fn a_metered_store_shows_in_the_exposition() {
        let metrics = Metrics::new();
        let spec: StoreSpec = "memory:64KiB?chunk=16KiB".parse().unwrap();
        let inner = farmap::open_store(&spec).unwrap();
        let store = metrics.meter("served", &spec, inner);
        store
            .write(farmap::ChunkIdx(1), bytes::Bytes::from(vec![7u8; 16384]))
            .await
            .unwrap();
        store.read(farmap::ChunkIdx(1)).await.unwrap();
        assert!(store.read(farmap::ChunkIdx(9)).await.is_err());
        let text = metrics.encode();
        for line in [
            r#"farmap_store_written_bytes_total{store="served",kind="memory"} 16384"#,
            r#"farmap_store_read_bytes_total{store="served",kind="memory"} 16384"#,
            r#"farmap_store_operations_total{store="served",kind="memory",op="read"} 2"#,
            r#"farmap_store_errors_total{store="served",kind="memory",op="read",error="out_of_range"} 1"#,
            r#"farmap_store_operation_duration_seconds_count{store="served",kind="memory",op="write"} 1"#,
        ] {
            assert!(text.contains(line), "no {line} in\n{text}");
        }
    }

    #[test]
    fn metrics_that_are_off_wrap_nothing() {
        let metrics = Metrics::default();
        let spec: StoreSpec = "memory:64KiB".parse().unwrap();
        let store = metrics.meter("served", &spec, farmap::open_store(&spec).unwrap());
        assert!(!format!("{store:?}").starts_with("Metered"), "{store:?}");
        metrics.gauge("farmap_x", "x.", Vec::new(), || 1);
        assert_eq!(metrics.encode(), "");
    }
}
