//! `http://` and `https://`: a file on a web server as a read-only region, one range request
//! per chunk ([`farmap_http`]).

use std::sync::Arc;

use farmap_core::{BoxFuture, Store};
use farmap_http::{HttpLocation, HttpOptions, HttpSpecError, HttpStore};

use super::common::{size_option, Parts};
use super::model::{store_error, OpenError, SpecError, SpecKind, StoreSpec};
use super::scheme::Scheme;

/// `http://`, `https://`.
#[derive(Debug)]
pub(super) struct Http;

impl Scheme for Http {
    fn names(&self) -> &'static [&'static str] {
        &["http", "https"]
    }

    fn takes(&self, _: &str) -> &'static str {
        "size, chunk, ro, connections, timeout, retries"
    }

    fn kind(&self, scheme: &str, p: &mut Parts<'_>) -> Result<SpecKind, SpecError> {
        let bad = |e: HttpSpecError| match e.option {
            "path" => SpecError::EmptyPath {
                spec: p.spec.to_owned(),
            },
            option => p.bad(option, e.reason),
        };
        let mut location = HttpLocation::parse(scheme, p.body).map_err(bad)?;
        for (key, value) in &p.options {
            location.set(key, value).map_err(bad)?;
        }
        Ok(SpecKind::Http { location })
    }

    fn display_parts(&self, spec: &StoreSpec, _: bool) -> (String, Vec<String>) {
        let SpecKind::Http { location } = &spec.kind else {
            unreachable!("not an http:// spec: {spec:?}")
        };
        let (head, mut opts) = location.display_parts();
        opts.extend(size_option(spec.size));
        (head, opts)
    }

    fn open<'a>(&'a self, spec: &'a StoreSpec) -> BoxFuture<'a, Result<Arc<dyn Store>, OpenError>> {
        Box::pin(async move {
            let SpecKind::Http { location } = &spec.kind else {
                unreachable!("not an http:// spec: {spec:?}")
            };
            let store = HttpStore::open(HttpOptions {
                location: location.clone(),
                size: spec.size,
                chunk_size: spec.chunk_size,
            })
            .await
            .map_err(store_error(spec))?;
            Ok(Arc::new(store) as Arc<dyn Store>)
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::spec::{SpecError, StoreSpec};

    #[test]
    fn specs_parse_print_and_refuse() {
        let spec: StoreSpec = "https://example.com/a/disk.img?chunk=1MiB&timeout=2s&ro"
            .parse()
            .unwrap();
        assert_eq!(
            spec.to_string(),
            "https://example.com/a/disk.img?timeout=2s&chunk=1MiB&ro"
        );
        let again: StoreSpec = spec.to_string().parse().unwrap();
        assert_eq!(again, spec);
        let err = "http://example.com".parse::<StoreSpec>().unwrap_err();
        assert!(matches!(err, SpecError::EmptyPath { .. }), "{err}");
        let err = "http://example.com/f?endpoint=x"
            .parse::<StoreSpec>()
            .unwrap_err();
        assert!(matches!(err, SpecError::UnknownOption { .. }), "{err}");
        let err = "http://u:pw@example.com/f"
            .parse::<StoreSpec>()
            .unwrap_err();
        assert!(err.to_string().contains("credentials"), "{err}");
    }
}
