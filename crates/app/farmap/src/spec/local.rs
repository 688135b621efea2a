//! The local stores: `memory:SIZE` (sparse memory), `file:PATH` and `dir:PATH`
//! ([`farmap_store`]).

use std::path::Path;
use std::sync::Arc;

use farmap_core::{format_size, BoxFuture, Geometry, Store};
use farmap_store::{DirOptions, DirStore, FileOptions, FileStore, MemoryStore};

use super::common::{size_option, Parts};
use super::model::{store_error, OpenError, SpecError, SpecKind, StoreSpec};
use super::scheme::Scheme;

/// `memory:`, `file:`, `dir:`.
#[derive(Debug)]
pub(super) struct Local;

impl Scheme for Local {
    fn names(&self) -> &'static [&'static str] {
        &["memory", "file", "dir"]
    }

    fn aliases(&self) -> &'static [&'static str] {
        &["mem"]
    }

    fn takes(&self, scheme: &str) -> &'static str {
        match scheme {
            "file" => "size, chunk, ro",
            "dir" => "size, chunk, ro, max-open",
            _ => "size, chunk",
        }
    }

    fn kind(&self, scheme: &str, p: &mut Parts<'_>) -> Result<SpecKind, SpecError> {
        Ok(match scheme {
            "file" => SpecKind::File { path: p.path()? },
            "dir" => {
                let mut max_open_files = None;
                for (_, value) in std::mem::take(&mut p.options) {
                    let n = value.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
                        p.bad(
                            "max-open",
                            format!("{value:?} is not a positive whole number"),
                        )
                    })?;
                    max_open_files = Some(n);
                }
                SpecKind::Dir {
                    path: p.path()?,
                    max_open_files,
                }
            }
            _ => {
                if !p.body.is_empty() {
                    p.set_size(p.body)?;
                }
                if p.size.is_none() {
                    return Err(SpecError::MissingSize {
                        spec: p.spec.to_owned(),
                        hint: "memory:256MiB".into(),
                    });
                }
                SpecKind::Memory
            }
        })
    }

    fn display_parts(&self, spec: &StoreSpec, _: bool) -> (String, Vec<String>) {
        match &spec.kind {
            SpecKind::Memory => (
                format!("memory:{}", format_size(spec.size.unwrap_or(0))),
                Vec::new(),
            ),
            SpecKind::File { path } => (
                format!("file:{}", path.display()),
                size_option(spec.size).into_iter().collect(),
            ),
            SpecKind::Dir {
                path,
                max_open_files,
            } => {
                let mut opts: Vec<String> = size_option(spec.size).into_iter().collect();
                if let Some(n) = max_open_files {
                    opts.push(format!("max-open={n}"));
                }
                (format!("dir:{}", path.display()), opts)
            }
            other => unreachable!("not a local spec: {other:?}"),
        }
    }

    fn open_local(&self, spec: &StoreSpec) -> Option<Result<Arc<dyn Store>, OpenError>> {
        Some(open(spec))
    }

    fn open<'a>(&'a self, spec: &'a StoreSpec) -> BoxFuture<'a, Result<Arc<dyn Store>, OpenError>> {
        Box::pin(async move { open(spec) })
    }

    fn path<'a>(&self, spec: &'a StoreSpec) -> Option<&'a Path> {
        match &spec.kind {
            SpecKind::File { path } | SpecKind::Dir { path, .. } => Some(path),
            _ => None,
        }
    }

    fn creates(&self, spec: &StoreSpec) -> bool {
        self.path(spec).is_none_or(|p| !p.exists())
    }

    fn is_remote(&self, _: &StoreSpec) -> bool {
        false
    }
}

/// Opens (or creates) a local store.
fn open(spec: &StoreSpec) -> Result<Arc<dyn Store>, OpenError> {
    let chunk = spec.chunk_size_or_default();
    let store_err = store_error(spec);
    Ok(match &spec.kind {
        SpecKind::File { path } => Arc::new(
            FileStore::open(
                path,
                FileOptions {
                    size: spec.size,
                    chunk_size: chunk,
                    read_only: spec.read_only,
                },
            )
            .map_err(store_err)?,
        ),
        SpecKind::Dir {
            path,
            max_open_files,
        } => {
            let mut opts = DirOptions {
                size: spec.size,
                chunk_size: spec.chunk_size,
                read_only: spec.read_only,
                ..DirOptions::default()
            };
            if let Some(n) = max_open_files {
                opts.max_open_files = *n;
            }
            Arc::new(DirStore::open(path, opts).map_err(store_err)?)
        }
        _ => {
            let size = spec.size.expect("memory specs always carry a size");
            let g =
                Geometry::new(size, u64::from(chunk)).map_err(|source| OpenError::Geometry {
                    spec: spec.to_string(),
                    source,
                })?;
            Arc::new(MemoryStore::new(g))
        }
    })
}
