//! `cql://[user[:pass]@]host:port[,host:port]/keyspace?table=..&region=..`: a region in a
//! Cassandra or ScyllaDB table, one row per chunk ([`farmap_cql`], which parses the spec).

use std::sync::Arc;

use farmap_core::{BoxFuture, Store};
use farmap_cql::{CqlSpec, CqlSpecError, CqlStore, CqlTarget};

use super::common::size_option;
use super::model::{OpenError, SpecError, SpecKind, StoreSpec};
use super::scheme::Scheme;

/// `cql://`.
#[derive(Debug)]
pub(super) struct Cql;

impl Scheme for Cql {
    fn names(&self) -> &'static [&'static str] {
        &["cql"]
    }

    fn parse(&self, _: &str, _: &str, spec: &str, _: usize) -> Result<StoreSpec, SpecError> {
        let cql: CqlSpec = spec.parse().map_err(|e: CqlSpecError| SpecError::Cql {
            spec: spec.to_owned(),
            reason: e.to_string(),
        })?;
        Ok(StoreSpec {
            kind: SpecKind::Cql(Box::new(cql.target)),
            size: cql.size,
            chunk_size: cql.chunk_size,
            read_only: cql.read_only,
        })
    }

    fn display_parts(&self, spec: &StoreSpec, secrets: bool) -> (String, Vec<String>) {
        let SpecKind::Cql(target) = &spec.kind else {
            unreachable!("not a cql:// spec: {spec:?}")
        };
        // The password as `***` unless asked for, as for Redis.
        let head = if secrets {
            target.base()
        } else {
            target.shown()
        };
        let mut opts = target.options();
        opts.extend(size_option(spec.size));
        (head, opts)
    }

    fn open<'a>(&'a self, spec: &'a StoreSpec) -> BoxFuture<'a, Result<Arc<dyn Store>, OpenError>> {
        Box::pin(async move {
            let SpecKind::Cql(target) = &spec.kind else {
                unreachable!("not a cql:// spec: {spec:?}")
            };
            let cql = CqlSpec {
                target: (**target).clone(),
                size: spec.size,
                chunk_size: spec.chunk_size,
                read_only: spec.read_only,
            };
            // The password stays out of the message.
            let shown = StoreSpec {
                kind: SpecKind::Cql(Box::new(CqlTarget {
                    password: None,
                    ..(**target).clone()
                })),
                ..spec.clone()
            };
            let store = CqlStore::open(&cql)
                .await
                .map_err(|source| OpenError::Store {
                    spec: shown.to_string(),
                    source,
                })?;
            Ok(Arc::new(store) as Arc<dyn Store>)
        })
    }

    fn creates(&self, spec: &StoreSpec) -> bool {
        matches!(&spec.kind, SpecKind::Cql(t) if t.create)
    }
}
