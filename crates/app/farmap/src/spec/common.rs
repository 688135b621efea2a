//! What every simple scheme's spec shares: `BODY?key=value&...`, with `size=`, `chunk=` and
//! `ro` read alike everywhere, and the check that the region the spec names can exist.

use farmap_core::{format_size, parse_size, query, Geometry};

use super::model::{SpecError, SpecKind, StoreSpec};

/// A simple spec taken apart: its body, the options every scheme reads alike, and the
/// scheme's own options (checked against what it takes), in order.
#[derive(Debug)]
pub(super) struct Parts<'a> {
    /// The whole spec, for messages.
    pub spec: &'a str,
    /// The part between `scheme:` and `?`.
    pub body: &'a str,
    /// `size=` (or a size the scheme puts in its body).
    pub size: Option<u64>,
    /// `chunk=`.
    pub chunk_size: Option<u32>,
    /// `ro`.
    pub read_only: bool,
    /// The scheme's own options.
    pub options: Vec<(&'a str, &'a str)>,
}

impl<'a> Parts<'a> {
    /// Takes `rest` (what follows `scheme:`) apart; `takes` lists the options the scheme
    /// takes (`size, chunk, ro, max-open`): any other is refused, naming them.
    pub fn parse(rest: &'a str, spec: &'a str, takes: &'static str) -> Result<Self, SpecError> {
        let (body, q) = query::split_query(rest);
        let mut parts = Parts {
            spec,
            body,
            size: None,
            chunk_size: None,
            read_only: false,
            options: Vec::new(),
        };
        for (key, value) in q.into_iter().flat_map(query::pairs) {
            if !takes.split(", ").any(|k| k == key) {
                return Err(SpecError::UnknownOption {
                    option: key.to_owned(),
                    spec: spec.to_owned(),
                    takes,
                });
            }
            match key {
                "size" => parts.set_size(value)?,
                "chunk" => parts.chunk_size = Some(parse_chunk(value, spec)?),
                "ro" => {
                    parts.read_only =
                        query::parse_bool(value).map_err(|why| parts.bad("ro", why))?
                }
                _ => parts.options.push((key, value)),
            }
        }
        Ok(parts)
    }

    /// A bad value for `option`.
    pub fn bad(&self, option: &'static str, reason: impl Into<String>) -> SpecError {
        SpecError::BadOption {
            option,
            spec: self.spec.to_owned(),
            reason: reason.into(),
        }
    }

    /// Sets the size (from `size=` or the body); a second, different one is refused.
    pub fn set_size(&mut self, value: &str) -> Result<(), SpecError> {
        let bytes = parse_size(value).map_err(|source| SpecError::BadSize {
            what: "size",
            spec: self.spec.to_owned(),
            source,
        })?;
        if bytes == 0 {
            return Err(self.bad("size", "a region cannot be empty"));
        }
        match self.size {
            Some(prev) if prev != bytes => Err(SpecError::ConflictingSize {
                spec: self.spec.to_owned(),
                first: format_size(prev),
                second: format_size(bytes),
            }),
            _ => {
                self.size = Some(bytes);
                Ok(())
            }
        }
    }

    /// The body as a path; an empty one is refused.
    pub fn path(&self) -> Result<std::path::PathBuf, SpecError> {
        if self.body.is_empty() {
            Err(SpecError::EmptyPath {
                spec: self.spec.to_owned(),
            })
        } else {
            Ok(self.body.into())
        }
    }

    /// The spec of `kind` with these sizes; a region that cannot exist (too many chunks:
    /// `memory:1PiB`) is refused now, with the reason, rather than when it is opened.
    pub fn finish(self, kind: SpecKind) -> Result<StoreSpec, SpecError> {
        if let Some(size) = self.size {
            let chunk = u64::from(self.chunk_size.unwrap_or(farmap_core::DEFAULT_CHUNK_SIZE));
            Geometry::new_bounded(size, chunk).map_err(|e| self.bad("size", e.to_string()))?;
        }
        Ok(StoreSpec {
            kind,
            size: self.size,
            chunk_size: self.chunk_size,
            read_only: self.read_only,
        })
    }
}

/// A `chunk=` value: a power of two from 4 KiB to 4 MiB.
fn parse_chunk(value: &str, spec: &str) -> Result<u32, SpecError> {
    let bytes = parse_size(value).map_err(|source| SpecError::BadSize {
        what: "chunk size",
        spec: spec.to_owned(),
        source,
    })?;
    let ok = bytes.is_power_of_two()
        && (u64::from(farmap_core::MIN_CHUNK_SIZE)..=u64::from(farmap_core::MAX_CHUNK_SIZE))
            .contains(&bytes);
    if !ok {
        return Err(SpecError::BadChunk {
            chunk: value.to_owned(),
            spec: spec.to_owned(),
        });
    }
    Ok(bytes as u32)
}

/// `size=` as the canonical forms print it.
pub(super) fn size_option(size: Option<u64>) -> Option<String> {
    size.map(|s| format!("size={}", format_size(s)))
}
