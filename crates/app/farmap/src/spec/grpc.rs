//! `farmap+grpc://HOST:PORT`: a region served by `farmap serve --grpc` ([`farmap_grpc`]).

use std::sync::Arc;

use farmap_core::{BoxFuture, Store};
use farmap_grpc::{GrpcClientOptions, GrpcStore};
use farmap_net::RemoteAddr;

use super::common::Parts;
use super::model::{store_error, OpenError, SpecError, SpecKind, StoreSpec};
use super::remote::{display_parts, RemoteOptions};
use super::scheme::Scheme;

/// `farmap+grpc://`.
#[derive(Debug)]
pub(super) struct Grpc;

impl Scheme for Grpc {
    fn names(&self) -> &'static [&'static str] {
        &["farmap+grpc"]
    }

    fn parse(&self, _: &str, rest: &str, spec: &str, _: usize) -> Result<StoreSpec, SpecError> {
        let p = Parts::parse(rest, spec, "connections, timeout")?;
        let kind = match RemoteOptions::from_parts(&p)?.into_kind("farmap", p.body, spec)? {
            SpecKind::Remote {
                addr: RemoteAddr::Tcp(addr),
                connections,
                timeout,
                ..
            } => SpecKind::Grpc {
                addr,
                connections,
                timeout,
            },
            _ => unreachable!("farmap:// always parses to a TCP address"),
        };
        p.finish(kind)
    }

    fn display_parts(&self, spec: &StoreSpec, _: bool) -> (String, Vec<String>) {
        let SpecKind::Grpc {
            addr,
            connections,
            timeout,
        } = &spec.kind
        else {
            unreachable!("not a farmap+grpc:// spec: {spec:?}")
        };
        let tcp = RemoteAddr::Tcp(addr.clone());
        let (_, opts) = display_parts(&tcp, &None, *connections, *timeout);
        (format!("farmap+grpc://{addr}"), opts)
    }

    fn open<'a>(&'a self, spec: &'a StoreSpec) -> BoxFuture<'a, Result<Arc<dyn Store>, OpenError>> {
        Box::pin(async move {
            let SpecKind::Grpc {
                addr,
                connections,
                timeout,
            } = &spec.kind
            else {
                unreachable!("not a farmap+grpc:// spec: {spec:?}")
            };
            let mut opts = GrpcClientOptions::default();
            if let Some(n) = connections {
                opts.connections = *n;
            }
            if let Some(t) = timeout {
                opts.request_timeout = Some(*t);
            }
            let store = GrpcStore::connect_with(&format!("http://{addr}"), opts)
                .await
                .map_err(store_error(spec))?;
            Ok(Arc::new(store) as Arc<dyn Store>)
        })
    }
}
