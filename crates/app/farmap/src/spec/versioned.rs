//! `versioned:(OBJECTS)/REGION[@VERSION]?size=SIZE&chunk=SIZE&ro`: a region kept as versions
//! of content-addressed chunks ([`farmap_versions::Versioned`]) in an object store.
//!
//! `OBJECTS` is where the objects live: `dir:PATH` (a directory), `s3://BUCKET/PREFIX`
//! (with its options: `endpoint=`...), `redis://HOST:PORT/DB?prefix=P` (also `rediss://`
//! and `redis+cluster://`, with their options), `cql://HOST:PORT/KEYSPACE?table=T` (the
//! table `T_objects`, created with `create=true`) or `farmap://HOST:PORT` (also
//! `farmaps://`, `farmap+unix:`: a `farmap serve --objects` server), shared by every region kept there, so
//! equal chunks are stored once. `REGION` names the region; `@N` opens version
//! `N`, `@NAME` the version a snapshot was named, read-only (a region opens writable only at
//! its latest version). `size=` (and `chunk=`) create the region when it has no version yet.

use std::sync::Arc;

use farmap_core::{BoxFuture, Geometry, Objects, Store};
use farmap_store::DirObjects;
use farmap_versions::{check_name, At, Versioned, VersionedOptions};

use super::common::{size_option, Parts};
use super::model::{store_error, OpenError, SpecError, SpecKind, StoreSpec};
use super::nest;
use super::scheme::Scheme;

/// `versioned:`.
#[derive(Debug)]
pub(super) struct Versions;

impl Scheme for Versions {
    fn names(&self) -> &'static [&'static str] {
        &["versioned"]
    }

    fn parse(&self, _: &str, rest: &str, spec: &str, depth: usize) -> Result<StoreSpec, SpecError> {
        parse(rest, spec, depth)
    }

    fn display_parts(&self, spec: &StoreSpec, secrets: bool) -> (String, Vec<String>) {
        let (objects, region, at) = parts(spec);
        let at = match at {
            At::Latest => String::new(),
            At::Seq(n) => format!("@{n}"),
            At::Tag(t) => format!("@{t}"),
        };
        (
            format!("versioned:({})/{region}{at}", objects.render(secrets)),
            size_option(spec.size).into_iter().collect(),
        )
    }

    fn open<'a>(&'a self, spec: &'a StoreSpec) -> BoxFuture<'a, Result<Arc<dyn Store>, OpenError>> {
        Box::pin(async move {
            let (objects, region, at) = parts(spec);
            let objects = open_objects(objects).await.map_err(store_error(spec))?;
            let create = match spec.size {
                Some(size) => Some(
                    Geometry::new(size, u64::from(spec.chunk_size_or_default())).map_err(
                        |source| OpenError::Geometry {
                            spec: spec.to_string(),
                            source,
                        },
                    )?,
                ),
                None => None,
            };
            let v = Versioned::open(
                objects,
                VersionedOptions {
                    region: region.to_owned(),
                    at: at.clone(),
                    // A version other than the latest only reads.
                    read_only: spec.read_only || *at != At::Latest,
                    create,
                    grace: None,
                    read_ahead: true,
                },
            )
            .await
            .map_err(store_error(spec))?;
            Ok(Arc::new(v) as Arc<dyn Store>)
        })
    }

    fn creates(&self, spec: &StoreSpec) -> bool {
        match &spec.kind {
            SpecKind::Versioned {
                objects, region, ..
            } => objects
                .path()
                .is_none_or(|p| !p.join("regions").join(region).join("versions").exists()),
            _ => false,
        }
    }

    fn is_remote(&self, spec: &StoreSpec) -> bool {
        matches!(&spec.kind, SpecKind::Versioned { objects, .. } if objects.is_remote())
    }
}

/// The object store, region and version of a spec this module parsed.
fn parts(spec: &StoreSpec) -> (&StoreSpec, &str, &At) {
    match &spec.kind {
        SpecKind::Versioned {
            objects,
            region,
            at,
        } => (objects, region, at),
        other => unreachable!("not a versioned: spec: {other:?}"),
    }
}

/// The object store an inner spec names (a Redis or CQL one is connected to at once).
pub async fn open_objects(spec: &StoreSpec) -> Result<Arc<dyn Objects>, farmap_core::StoreError> {
    match &spec.kind {
        SpecKind::Dir { path, .. } => Ok(Arc::new(DirObjects::open(path.clone())?)),
        #[cfg(feature = "s3")]
        SpecKind::S3 { location } => Ok(Arc::new(farmap_s3::S3Objects::open(location)?)),
        #[cfg(feature = "redis")]
        SpecKind::Redis(config) => Ok(Arc::new(farmap_redis::RedisObjects::open(config).await?)),
        #[cfg(feature = "cql")]
        SpecKind::Cql(target) => Ok(Arc::new(farmap_cql::CqlObjects::open(target).await?)),
        SpecKind::Remote { .. } => {
            let (addr, tls, connections, timeout) = super::remote::remote_fields(spec);
            let opts = super::remote::client_options(tls, connections, timeout);
            Ok(Arc::new(
                farmap_net::RemoteObjects::connect(addr.clone(), opts).await?,
            ))
        }
        _ => Err(farmap_core::StoreError::new(
            farmap_core::ErrorKind::Unsupported,
            format!(
                "versioned: keeps its objects in dir:PATH, s3://, redis://, cql:// or \
                 farmap:// (a `farmap serve --objects` server); {spec} cannot hold them"
            ),
        )),
    }
}

/// Whether a store of this kind can keep a versioned region's objects.
fn holds_objects(kind: &SpecKind) -> bool {
    match kind {
        SpecKind::Dir { .. } | SpecKind::Remote { .. } => true,
        #[cfg(feature = "s3")]
        SpecKind::S3 { .. } => true,
        #[cfg(feature = "redis")]
        SpecKind::Redis(_) => true,
        #[cfg(feature = "cql")]
        SpecKind::Cql(_) => true,
        _ => false,
    }
}

/// Parses the part of `spec` after `versioned:`.
fn parse(rest: &str, spec: &str, depth: usize) -> Result<StoreSpec, SpecError> {
    let bad = |reason: String| SpecError::BadOption {
        option: "spec",
        spec: spec.to_owned(),
        reason,
    };
    let form =
        "write versioned:(dir:PATH)/REGION[@VERSION]?size=SIZE (or (s3://BUCKET/PREFIX?...), \
                (redis://HOST:PORT/DB?prefix=P) or (cql://HOST:PORT/KEYSPACE?table=T))";
    nest::check_depth(depth).map_err(bad)?;
    let (inner, after) = nest::group(rest).ok_or_else(|| bad(form.into()))?;
    let objects = nest::parse_inner(inner, depth).map_err(|e| match e {
        nest::InnerError::Spec(e) => e,
        nest::InnerError::Reason(r) => bad(r),
    })?;
    if !holds_objects(&objects.kind) {
        return Err(bad(format!(
            "the objects of a versioned region live in dir:PATH, s3://BUCKET/PREFIX, \
             redis://HOST:PORT/DB?prefix=P, cql://HOST:PORT/KEYSPACE?table=T or \
             farmap://HOST:PORT (`farmap serve --objects`), not {objects}"
        )));
    }
    #[cfg(feature = "cql")]
    if let SpecKind::Cql(t) = &objects.kind {
        if t.region != farmap_cql::DEFAULT_REGION {
            return Err(bad(format!(
                "the region of a versioned spec follows its ')': write \
                 versioned:(cql://...)/{} rather than region= in the cql:// spec",
                t.region
            )));
        }
    }
    if objects.size.is_some() || objects.chunk_size.is_some() || objects.read_only {
        return Err(bad(
            "give size=, chunk= and ro to versioned:, not to its object store".into(),
        ));
    }
    let after = after.strip_prefix('/').ok_or_else(|| {
        bad(format!(
            "the region's name follows the ')' after a '/': {form}"
        ))
    })?;
    let parts = Parts::parse(after, spec, "size, chunk, ro")?;
    let (region, at) = match parts.body.split_once('@') {
        Some((r, "latest")) => (r, At::Latest),
        Some((r, v)) if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) => (
            r,
            At::Seq(
                v.parse()
                    .map_err(|_| bad(format!("version {v} is too large")))?,
            ),
        ),
        Some((r, v)) => {
            check_name("snapshot", v).map_err(bad)?;
            (r, At::Tag(v.to_owned()))
        }
        None => (parts.body, At::Latest),
    };
    check_name("region", region).map_err(bad)?;
    let region = region.to_owned();
    parts.finish(SpecKind::Versioned {
        objects: Box::new(objects),
        region,
        at,
    })
}
