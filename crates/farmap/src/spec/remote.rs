//! Remote store specs: `farmap://host:port`, `farmaps://host:port?ca=...`, `farmap+unix:/path`.

use std::path::PathBuf;
use std::time::Duration;

use farmap_net::{ClientOptions, RemoteAddr, TlsClientConfig};

use super::{SpecError, SpecKind};

/// The options of a remote spec, gathered while its query is read.
#[derive(Debug, Default)]
pub(super) struct RemoteOptions {
    connections: Option<usize>,
    timeout: Option<Duration>,
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    name: Option<String>,
}

/// `500ms`, `30s`, `2m`, or a number of seconds.
fn parse_timeout(value: &str) -> Option<Duration> {
    let (num, unit) = match value.find(|c: char| !c.is_ascii_digit() && c != '.') {
        Some(i) => value.split_at(i),
        None => (value, "s"),
    };
    let n: f64 = num.parse().ok()?;
    let secs = match unit {
        "ms" => n / 1e3,
        "s" => n,
        "m" | "min" => n * 60.0,
        _ => return None,
    };
    (secs > 0.0 && secs <= 86_400.0).then(|| Duration::from_secs_f64(secs))
}

/// A timeout in the shortest exact form `parse_timeout` reads back.
pub(super) fn format_timeout(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}ms", d.as_secs_f64() * 1e3)
    }
}

impl RemoteOptions {
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
                let n = value
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=1024).contains(n))
                    .ok_or_else(|| {
                        bad(
                            "connections",
                            format!("{value:?} is not a whole number from 1 to 1024"),
                        )
                    })?;
                self.connections = Some(n);
            }
            "timeout" => {
                self.timeout = Some(parse_timeout(value).ok_or_else(|| {
                    bad(
                        "timeout",
                        format!("{value:?} is not a duration like 500ms, 30s or 2m"),
                    )
                })?)
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

    /// The store kind for `scheme:body`.
    pub(super) fn into_kind(
        self,
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
            let ca = self.ca.ok_or_else(|| SpecError::MissingOption {
                option: "ca",
                spec: spec.to_owned(),
                why: "the PEM file of the CA that signed the server's certificate",
            })?;
            if self.cert.is_some() != self.key.is_some() {
                return Err(SpecError::MissingOption {
                    option: if self.cert.is_some() { "key" } else { "cert" },
                    spec: spec.to_owned(),
                    why: "a client certificate needs both cert= and key=",
                });
            }
            Some(TlsClientConfig {
                ca,
                cert: self.cert,
                key: self.key,
                server_name: self.name,
            })
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

/// The spec's text before its options, and its options.
pub(super) fn display_parts(
    addr: &RemoteAddr,
    tls: &Option<TlsClientConfig>,
    connections: Option<usize>,
    timeout: Option<Duration>,
) -> (String, Vec<String>) {
    let head = match (addr, tls) {
        (RemoteAddr::Unix(p), _) => format!("farmap+unix:{}", p.display()),
        (RemoteAddr::Tcp(hp), None) => format!("farmap://{hp}"),
        (RemoteAddr::Tcp(hp), Some(_)) => format!("farmaps://{hp}"),
    };
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
    (head, opts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts() {
        assert_eq!(parse_timeout("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_timeout("30s"), Some(Duration::from_secs(30)));
        assert_eq!(parse_timeout("2m"), Some(Duration::from_secs(120)));
        assert_eq!(parse_timeout("7"), Some(Duration::from_secs(7)));
        for bad in ["", "0", "5h", "ms", "-1s"] {
            assert_eq!(parse_timeout(bad), None, "{bad}");
        }
        for d in [Duration::from_millis(1500), Duration::from_secs(9)] {
            assert_eq!(parse_timeout(&format_timeout(d)), Some(d));
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
