//! NBD store specs, in the URI forms libnbd and qemu use: `nbd://host[:port]/export`,
//! `nbds://host[:port]/export?ca=...` (TLS), `nbd+unix:///export?socket=/path` and
//! `nbds+unix:///export?socket=/path&ca=...`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use farmap_core::{BoxFuture, Store};
use farmap_nbd::client::{decode_export, encode_export};
use farmap_nbd::{NbdClientOptions, NbdStore, NbdTarget, NBD_PORT};
use farmap_net::RemoteAddr;

use super::common::Parts;
use super::model::{store_error, OpenError, SpecError, SpecKind, StoreSpec};
use super::remote::{display_options, RemoteOptions};
use super::scheme::Scheme;

/// `nbd://`, `nbds://`, `nbd+unix://`, `nbds+unix://`.
#[derive(Debug)]
pub(super) struct Nbd;

impl Scheme for Nbd {
    fn names(&self) -> &'static [&'static str] {
        &["nbd", "nbds", "nbd+unix", "nbds+unix"]
    }

    fn takes(&self, scheme: &str) -> &'static str {
        match scheme {
            "nbd" => "chunk, ro, connections, timeout",
            "nbds" => "chunk, ro, connections, timeout, ca, cert, key, name, tls-certificates",
            "nbd+unix" => "socket, chunk, ro, connections, timeout",
            _ => "socket, chunk, ro, connections, timeout, ca, cert, key, name, tls-certificates",
        }
    }

    fn kind(&self, scheme: &str, p: &mut Parts<'_>) -> Result<SpecKind, SpecError> {
        let remote = RemoteOptions::from_parts(p)?;
        let mut nbd = NbdOptions::default();
        for (key, value) in &p.options {
            if matches!(*key, "socket" | "tls-certificates") {
                nbd.set(key, value, p.spec)?;
            }
        }
        into_kind(scheme, p.body, remote, nbd, p.spec)
    }

    fn display_parts(&self, spec: &StoreSpec, _: bool) -> (String, Vec<String>) {
        let (target, connections, timeout) = nbd_fields(spec);
        display_parts(target, connections, timeout)
    }

    fn open<'a>(&'a self, spec: &'a StoreSpec) -> BoxFuture<'a, Result<Arc<dyn Store>, OpenError>> {
        Box::pin(async move {
            let (target, connections, timeout) = nbd_fields(spec);
            let opts = client_options(spec.chunk_size, spec.read_only, connections, timeout);
            let store = NbdStore::connect(target.clone(), opts)
                .await
                .map_err(store_error(spec))?;
            Ok(Arc::new(store) as Arc<dyn Store>)
        })
    }
}

/// The settings of an `nbd://` spec (one this scheme parsed).
fn nbd_fields(spec: &StoreSpec) -> (&NbdTarget, Option<usize>, Option<Duration>) {
    let SpecKind::Nbd {
        target,
        connections,
        timeout,
    } = &spec.kind
    else {
        unreachable!("not an nbd:// spec: {spec:?}")
    };
    (target, *connections, *timeout)
}

/// The options only NBD specs take (`socket=`, `tls-certificates=`), gathered while the
/// query is read.
#[derive(Debug, Default)]
struct NbdOptions {
    socket: Option<PathBuf>,
    tls_dir: Option<PathBuf>,
}

impl NbdOptions {
    fn set(&mut self, key: &str, value: &str, spec: &str) -> Result<(), SpecError> {
        if value.is_empty() {
            return Err(SpecError::BadOption {
                option: if key == "socket" {
                    "socket"
                } else {
                    "tls-certificates"
                },
                spec: spec.to_owned(),
                reason: "a path is needed".into(),
            });
        }
        match key {
            "socket" => self.socket = Some(PathBuf::from(value)),
            _ => self.tls_dir = Some(PathBuf::from(value)),
        }
        Ok(())
    }
}

/// The store kind for an NBD `scheme:body`.
fn into_kind(
    scheme: &str,
    body: &str,
    mut remote: RemoteOptions,
    nbd: NbdOptions,
    spec: &str,
) -> Result<SpecKind, SpecError> {
    let unix = scheme.ends_with("+unix");
    let tls = scheme.starts_with("nbds");
    let hint = match (unix, tls) {
        (false, false) => "nbd://HOST[:PORT]/EXPORT",
        (false, true) => "nbds://HOST[:PORT]/EXPORT?ca=CA.pem",
        (true, false) => "nbd+unix:///EXPORT?socket=/PATH",
        (true, true) => "nbds+unix:///EXPORT?socket=/PATH&ca=CA.pem",
    };
    let bad = || SpecError::BadAddress {
        spec: spec.to_owned(),
        hint,
    };
    let rest = body.strip_prefix("//").ok_or_else(bad)?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i + 1..]),
        None => (rest, ""),
    };
    let export = decode_export(path).ok_or_else(|| SpecError::BadOption {
        option: "export",
        spec: spec.to_owned(),
        reason: "a % in the export name is not followed by two hex digits of UTF-8".into(),
    })?;
    let addr = if unix {
        // libnbd allows a user name before an empty host (`nbd+unix://alice@/`).
        if !(authority.is_empty() || authority.ends_with('@')) {
            return Err(bad());
        }
        let socket = nbd.socket.ok_or_else(|| SpecError::MissingOption {
            option: "socket",
            spec: spec.to_owned(),
            why: "the path of the server's Unix socket",
        })?;
        RemoteAddr::Unix(socket)
    } else {
        let host_port = authority.rsplit('@').next().unwrap_or(authority);
        RemoteAddr::Tcp(with_port(host_port).ok_or_else(bad)?)
    };
    let tls = if tls {
        let dir = nbd.tls_dir.as_deref();
        let ca = remote
            .ca
            .take()
            .or_else(|| dir.map(|d| d.join("ca-cert.pem")))
            .ok_or_else(|| SpecError::MissingOption {
                option: "ca",
                spec: spec.to_owned(),
                why: "the PEM file of the CA that signed the server's certificate (or \
                      tls-certificates=DIR holding ca-cert.pem)",
            })?;
        if let (None, None, Some(d)) = (&remote.cert, &remote.key, dir) {
            if d.join("client-cert.pem").exists() && d.join("client-key.pem").exists() {
                remote.cert = Some(d.join("client-cert.pem"));
                remote.key = Some(d.join("client-key.pem"));
            }
        }
        Some(remote.tls(ca, spec)?)
    } else {
        None
    };
    Ok(SpecKind::Nbd {
        target: NbdTarget { addr, export, tls },
        connections: remote.connections,
        timeout: remote.timeout,
    })
}

/// `host:port` with NBD's port when none is given; `None` for an empty host or a bad port.
fn with_port(hp: &str) -> Option<String> {
    if hp.is_empty() {
        return None;
    }
    // `[v6]`, `[v6]:port`, `host`, `host:port`.
    let (host, port) = if let Some(rest) = hp.strip_prefix('[') {
        let (h, after) = rest.split_once(']')?;
        let port = match after {
            "" => None,
            p => Some(p.strip_prefix(':')?),
        };
        (format!("[{h}]"), port)
    } else {
        match hp.rsplit_once(':') {
            Some((h, p)) => (h.to_owned(), Some(p)),
            None => (hp.to_owned(), None),
        }
    };
    if host.is_empty() || host == "[]" {
        return None;
    }
    let port = match port {
        Some(p) => p.parse::<u16>().ok().filter(|p| *p != 0)?,
        None => NBD_PORT,
    };
    Some(format!("{host}:{port}"))
}

/// The spec's text before its options, and its options.
fn display_parts(
    target: &NbdTarget,
    connections: Option<usize>,
    timeout: Option<Duration>,
) -> (String, Vec<String>) {
    let s = if target.tls.is_some() { "s" } else { "" };
    let export = encode_export(&target.export);
    let mut opts = Vec::new();
    let head = match &target.addr {
        RemoteAddr::Tcp(hp) => format!("nbd{s}://{hp}/{export}"),
        RemoteAddr::Unix(p) => {
            opts.push(format!("socket={}", p.display()));
            format!("nbd{s}+unix:///{export}")
        }
    };
    opts.extend(display_options(&target.tls, connections, timeout));
    (head, opts)
}

/// The client options a spec asks for.
fn client_options(
    chunk_size: Option<u32>,
    read_only: bool,
    connections: Option<usize>,
    timeout: Option<Duration>,
) -> NbdClientOptions {
    let mut o = NbdClientOptions {
        chunk_size,
        connections,
        read_only,
        ..NbdClientOptions::default()
    };
    if let Some(t) = timeout {
        o.request_timeout = t;
        o.connect_timeout = t;
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_default_to_nbds() {
        assert_eq!(with_port("h").as_deref(), Some("h:10809"));
        assert_eq!(with_port("h:1").as_deref(), Some("h:1"));
        assert_eq!(with_port("[::1]").as_deref(), Some("[::1]:10809"));
        assert_eq!(with_port("[::1]:7").as_deref(), Some("[::1]:7"));
        for bad in ["", ":1", "h:x", "h:0", "h:99999", "[::1]x", "[]:1"] {
            assert_eq!(with_port(bad), None, "{bad}");
        }
    }
}
