//! `farmap+grpc://HOST:PORT`: a region served by `farmap serve --grpc` ([`farmap_grpc`]).

use std::sync::Arc;
use std::time::Duration;

use farmap_core::{BoxFuture, Store};
use farmap_grpc::{GrpcClientOptions, GrpcStore};
use farmap_net::RemoteAddr;

use super::common::Parts;
use super::model::{store_error, OpenError, SpecError, SpecKind, StoreSpec};
use super::remote::{display_options, RemoteOptions};
use super::scheme::Scheme;

/// `farmap+grpc://`.
#[derive(Debug)]
pub(super) struct Grpc;

impl Scheme for Grpc {
    fn names(&self) -> &'static [&'static str] {
        &["farmap+grpc"]
    }

    fn takes(&self, _: &str) -> &'static str {
        "connections, timeout"
    }

    fn kind(&self, _: &str, p: &mut Parts<'_>) -> Result<SpecKind, SpecError> {
        match RemoteOptions::from_parts(p)?.into_kind("farmap", p.body, p.spec)? {
            SpecKind::Remote {
                addr: RemoteAddr::Tcp(addr),
                connections,
                timeout,
                ..
            } => Ok(SpecKind::Grpc {
                addr,
                connections,
                timeout,
            }),
            _ => unreachable!("farmap:// always parses to a TCP address"),
        }
    }

    fn display_parts(&self, spec: &StoreSpec, _: bool) -> (String, Vec<String>) {
        let (addr, connections, timeout) = grpc_fields(spec);
        let opts = display_options(&None, connections, timeout);
        (format!("farmap+grpc://{addr}"), opts)
    }

    fn open<'a>(&'a self, spec: &'a StoreSpec) -> BoxFuture<'a, Result<Arc<dyn Store>, OpenError>> {
        Box::pin(async move {
            let (addr, connections, timeout) = grpc_fields(spec);
            let mut opts = GrpcClientOptions::default();
            if let Some(n) = connections {
                opts.connections = n;
            }
            if let Some(t) = timeout {
                opts.request_timeout = Some(t);
            }
            let store = GrpcStore::connect_with(&format!("http://{addr}"), opts)
                .await
                .map_err(store_error(spec))?;
            Ok(Arc::new(store) as Arc<dyn Store>)
        })
    }
}

/// The settings of a `farmap+grpc://` spec (one this scheme parsed).
fn grpc_fields(spec: &StoreSpec) -> (&str, Option<usize>, Option<Duration>) {
    let SpecKind::Grpc {
        addr,
        connections,
        timeout,
    } = &spec.kind
    else {
        unreachable!("not a farmap+grpc:// spec: {spec:?}")
    };
    (addr, *connections, *timeout)
}
