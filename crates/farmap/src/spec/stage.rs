//! Stage specs: a stage over stores named by specs in parentheses, like `verified:(SPEC)`
//! (checksums, [`farmap_pipeline::Verified`]).
//!
//! The inner specs are written whole between parentheses, options and all; the stage's own
//! options follow the last parenthesis after `?`. Parentheses nest (`verified:(verified:(memory:1GiB))`
//! parses), up to [`MAX_DEPTH`] stages deep.

use super::{SpecError, SpecKind, StoreSpec};

/// How deeply stage specs may nest.
pub const MAX_DEPTH: usize = 8;

/// Whether `scheme` (lowercase) names a stage.
pub(super) fn is_stage(scheme: &str) -> bool {
    scheme == "verified"
}

/// Splits `(A)(B)?q` into `["A", "B"]` and `Some("q")`.
fn groups<'a>(rest: &'a str, spec: &str) -> Result<(Vec<&'a str>, Option<&'a str>), SpecError> {
    let bad = |reason: String| SpecError::BadOption {
        option: "spec",
        spec: spec.to_owned(),
        reason,
    };
    let mut out = Vec::new();
    let mut s = rest;
    while let Some(body) = s.strip_prefix('(') {
        let mut depth = 1usize;
        let mut end = None;
        for (i, ch) in body.char_indices() {
            match ch {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        end = Some(i);
                        break;
                    }
                }
                _ => {}
            }
        }
        let end = end.ok_or_else(|| bad("a '(' is not closed".into()))?;
        out.push(&body[..end]);
        s = &body[end + 1..];
    }
    let query = match s {
        "" => None,
        q => Some(
            q.strip_prefix('?')
                .ok_or_else(|| bad(format!("{q:?} after the stores: options go after '?'")))?,
        ),
    };
    Ok((out, query))
}

/// Parses the part after `scheme:` of a stage spec.
pub(super) fn parse(
    scheme: &str,
    rest: &str,
    spec: &str,
    depth: usize,
) -> Result<StoreSpec, SpecError> {
    if depth >= MAX_DEPTH {
        return Err(SpecError::BadOption {
            option: "spec",
            spec: spec.to_owned(),
            reason: format!("stages nest at most {MAX_DEPTH} deep"),
        });
    }
    let (inner, query) = groups(rest, spec)?;
    let takes = match scheme {
        "verified" => "",
        _ => unreachable!("checked by is_stage"),
    };
    if let Some(pair) = query.into_iter().flat_map(|q| q.split('&')).find(|p| !p.is_empty()) {
        let key = pair.split_once('=').map_or(pair, |(k, _)| k);
        return Err(SpecError::UnknownOption {
            option: key.to_owned(),
            spec: spec.to_owned(),
            takes: if takes.is_empty() { "no options" } else { takes },
        });
    }
    let want = match scheme {
        "verified" => 1,
        _ => unreachable!(),
    };
    if inner.len() != want {
        return Err(SpecError::BadOption {
            option: "spec",
            spec: spec.to_owned(),
            reason: format!(
                "{scheme}: takes {want} store{} in parentheses, got {}: write verified:(SPEC)",
                if want == 1 { "" } else { "s" },
                inner.len()
            ),
        });
    }
    let inner: Vec<StoreSpec> = inner
        .iter()
        .map(|s| StoreSpec::parse_nested(s, depth + 1))
        .collect::<Result<_, _>>()?;
    let mut inner = inner.into_iter();
    let kind = SpecKind::Verified {
        inner: Box::new(inner.next().expect("one")),
    };
    Ok(StoreSpec {
        kind,
        size: None,
        chunk_size: None,
        read_only: false,
    })
}
