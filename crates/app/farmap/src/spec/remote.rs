//! Remote store specs: `farmap://host:port`, `farmaps://host:port?ca=...`, `farmap+unix:/path`.

use std::path::PathBuf;
use std::time::Duration;

use std::sync::Arc;

use farmap_core::option::{parse_count, parse_timeout};
use farmap_core::{BoxFuture, Store};
use farmap_net::{ClientOptions, RemoteAddr, RemoteStore, TlsClientConfig};

use super::common::Parts;
use super::model::{store_error, OpenError, SpecError, SpecKind, StoreSpec};
use super::scheme::Scheme;

/// `farmap://`, `farmaps://`, `farmap+unix:`.
#[derive(Debug)]
pub(super) struct Remote;

impl Scheme for Remote {
    fn names(&self) -> &'static [&'static str] {
        &["farmap", "farmaps", "farmap+unix"]
    }

    fn takes(&self, scheme: &str) -> &'static str {
        if scheme == "farmaps" {
            "ca, cert, key, name, connections, timeout"
        } else {
            "connections, timeout"
        }
    }

    fn kind(&self, scheme: &str, p: &mut Parts<'_>) -> Result<SpecKind, SpecError> {
        RemoteOptions::from_parts(p)?.into_kind(scheme, p.body, p.spec)
    }

    fn display_parts(&self, spec: &StoreSpec, _: bool) -> (String, Vec<String>) {
        let (addr, tls, connections, timeout) = remote_fields(spec);
        let head = match (addr, tls) {
            (RemoteAddr::Unix(p), _) => format!("farmap+unix:{}", p.display()),
            (RemoteAddr::Tcp(hp), None) => format!("farmap://{hp}"),
            (RemoteAddr::Tcp(hp), Some(_)) => format!("farmaps://{hp}"),
        };
        (head, display_options(tls, connections, timeout))
    }

    fn open<'a>(&'a self, spec: &'a StoreSpec) -> BoxFuture<'a, Result<Arc<dyn Store>, OpenError>> {
        Box::pin(async move {
            let (addr, tls, connections, timeout) = remote_fields(spec);
            let opts = client_options(tls, connections, timeout);
            let store = RemoteStore::connect(addr.clone(), opts)
                .await
                .map_err(store_error(spec))?;
            Ok(Arc::new(store) as Arc<dyn Store>)
        })
    }
}

/// The settings of a `farmap://` spec (one this scheme parsed).
pub(super) fn remote_fields(
    spec: &StoreSpec,
) -> (
    &RemoteAddr,
    &Option<TlsClientConfig>,
    Option<usize>,
    Option<Duration>,
) {
    let SpecKind::Remote {
        addr,
        tls,
        connections,
        timeout,
    } = &spec.kind
    else {
        unreachable!("not a farmap:// spec: {spec:?}")
    };
    (addr, tls, *connections, *timeout)
}

/// The options of a remote spec, gathered while its query is read.
#[derive(Debug, Default)]
pub(super) struct RemoteOptions {
    pub(super) connections: Option<usize>,
    pub(super) timeout: Option<Duration>,
    pub(super) ca: Option<PathBuf>,
    pub(super) cert: Option<PathBuf>,
    pub(super) key: Option<PathBuf>,
    pub(super) name: Option<String>,
}

/// A timeout in the shortest exact form `parse_timeout` reads back.
pub(super) fn format_timeout(d: Duration) -> String {
    farmap_core::format_duration(d)
}

impl RemoteOptions {
    /// The remote options among a spec's options (`connections`, `timeout`, `ca`, `cert`,
    /// `key`, `name`); the scheme checked which it takes.
    pub(super) fn from_parts(p: &Parts<'_>) -> Result<Self, SpecError> {
        let mut o = RemoteOptions::default();
        for (key, value) in &p.options {
            if matches!(
                *key,
                "connections" | "timeout" | "ca" | "cert" | "key" | "name"
            ) {
                o.set(key, value, p.spec)?;
            }
        }
        Ok(o)
    }

    /// Takes one `key=value` option (the key was checked against the scheme's options).
    pub(super) fn set(&mut self, key: &str, value: &str, spec: &str) -> Result<(), SpecError> {
        let bad = |option: &'static str, reason: String| SpecError::BadOption {
            option,
            spec: spec.to_owned(),
            reason,
        };
        let path = |option: &'static str| {
            if value.is_empty() {
                Err(bad(option, "a path is needed".into()))
            } else {
                Ok(PathBuf::from(value))
            }
        };
        match key {
            "connections" => {
                let n = parse_count(value, 1..=1024usize).map_err(|w| bad("connections", w))?;
                self.connections = Some(n);
            }
            "timeout" => {
                self.timeout = Some(parse_timeout(value).map_err(|why| bad("timeout", why))?)
            }
            "ca" => self.ca = Some(path("ca")?),
            "cert" => self.cert = Some(path("cert")?),
            "key" => self.key = Some(path("key")?),
            "name" => {
                if value.is_empty() {
                    return Err(bad("name", "a server name is needed".into()));
                }
                self.name = Some(value.to_owned());
            }
            _ => unreachable!("checked against the scheme's options"),
        }
        Ok(())
    }

    /// The TLS settings: `ca`, with the client certificate (`cert=` and `key=` come
    /// together) and the server name of these options.
    pub(super) fn tls(&mut self, ca: PathBuf, spec: &str) -> Result<TlsClientConfig, SpecError> {
        if self.cert.is_some() != self.key.is_some() {
            return Err(SpecError::MissingOption {
                option: if self.cert.is_some() { "key" } else { "cert" },
                spec: spec.to_owned(),
                why: "a client certificate needs both cert= and key=",
            });
        }
        Ok(TlsClientConfig {
            ca,
            cert: self.cert.take(),
            key: self.key.take(),
            server_name: self.name.take(),
        })
    }

    /// The store kind for `scheme:body`.
    pub(super) fn into_kind(
        mut self,
        scheme: &str,
        body: &str,
        spec: &str,
    ) -> Result<SpecKind, SpecError> {
        let addr = if scheme == "farmap+unix" {
            if body.is_empty() {
                return Err(SpecError::EmptyPath {
                    spec: spec.to_owned(),
                });
            }
            RemoteAddr::Unix(PathBuf::from(body))
        } else {
            let hint = if scheme == "farmaps" {
                "farmaps://HOST:PORT?ca=CA.pem"
            } else {
                "farmap://HOST:PORT"
            };
            let bad = || SpecError::BadAddress {
                spec: spec.to_owned(),
                hint,
            };
            let hp = body.strip_prefix("//").ok_or_else(bad)?;
            let (host, port) = hp.rsplit_once(':').ok_or_else(bad)?;
            if host.is_empty() || port.parse::<u16>().is_err() {
                return Err(bad());
            }
            RemoteAddr::Tcp(hp.to_owned())
        };
        let tls = if scheme == "farmaps" {
            let ca = self.ca.take().ok_or_else(|| SpecError::MissingOption {
                option: "ca",
                spec: spec.to_owned(),
                why: "the PEM file of the CA that signed the server's certificate",
            })?;
            Some(self.tls(ca, spec)?)
        } else {
            None
        };
        Ok(SpecKind::Remote {
            addr,
            tls,
            connections: self.connections,
            timeout: self.timeout,
        })
    }
}

/// The client options a remote spec asks for.
pub(super) fn client_options(
    tls: &Option<TlsClientConfig>,
    connections: Option<usize>,
    timeout: Option<Duration>,
) -> ClientOptions {
    let mut opts = ClientOptions {
        tls: tls.clone(),
        ..ClientOptions::default()
    };
    if let Some(n) = connections {
        opts.connections = n;
    }
    if let Some(t) = timeout {
        // One deadline for everything the spec asks of the server: each request, and each
        // connection attempt (TCP, TLS and the farmap handshake).
        opts.request_timeout = t;
        opts.connect_timeout = t;
    }
    opts
}

/// The options of a spec that connects to a server, in canonical order: `ca=`, `cert=`,
/// `key=`, `name=` (with TLS), `connections=`, `timeout=`.
pub(super) fn display_options(
    tls: &Option<TlsClientConfig>,
    connections: Option<usize>,
    timeout: Option<Duration>,
) -> Vec<String> {
    let mut opts = Vec::new();
    if let Some(t) = tls {
        opts.push(format!("ca={}", t.ca.display()));
        if let Some(c) = &t.cert {
            opts.push(format!("cert={}", c.display()));
        }
        if let Some(k) = &t.key {
            opts.push(format!("key={}", k.display()));
        }
        if let Some(n) = &t.server_name {
            opts.push(format!("name={n}"));
        }
    }
    if let Some(n) = connections {
        opts.push(format!("connections={n}"));
    }
    if let Some(t) = timeout {
        opts.push(format!("timeout={}", format_timeout(t)));
    }
    opts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts() {
        assert_eq!(parse_timeout("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_timeout("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_timeout("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_timeout("5h"), Ok(Duration::from_secs(5 * 3600)));
        // A bare number once meant seconds here and milliseconds in CLI flags.
        let e = parse_timeout("7").unwrap_err();
        assert!(e.contains("unit is required"), "{e}");
        for bad in ["", "0s", "25h", "ms", "-1s"] {
            assert!(parse_timeout(bad).is_err(), "{bad}");
        }
        for d in [Duration::from_millis(1500), Duration::from_secs(9)] {
            assert_eq!(parse_timeout(&format_timeout(d)), Ok(d));
        }
    }

    #[test]
    fn the_timeout_bounds_connects_as_well_as_requests() {
        let t = Duration::from_millis(700);
        let opts = client_options(&None, None, Some(t));
        assert_eq!(opts.request_timeout, t);
        assert_eq!(opts.connect_timeout, t);
        let defaults = client_options(&None, None, None);
        assert_eq!(
            defaults.connect_timeout,
            ClientOptions::default().connect_timeout
        );
    }
}
