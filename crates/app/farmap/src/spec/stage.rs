//! Stage specs: a stage over stores named by specs in parentheses, like `verified:(SPEC)`
//! (checksums, [`farmap_pipeline::Verified`]) or `mirror:(PRIMARY)(MIRROR)` (every write to
//! both, reads failing over, [`farmap_pipeline::Mirrored`]).
//!
//! `mirror:` options: `policy=both|primary-first` (default `both`), `timeout=DURATION` (a
//! primary operation slower than this marks it down; default 2s), `backlog=N` (chunks queued
//! for the mirror under `primary-first`; default 1024), `probe=DURATION` (how often a down
//! primary is tried; default 200ms).
//!
//! The inner specs are written whole between parentheses, options and all; the stage's own
//! options follow the last parenthesis after `?`. Parentheses nest (`verified:(verified:(memory:1GiB))`
//! parses), up to [`MAX_DEPTH`] stages deep.

use std::path::Path;
use std::sync::Arc;

use farmap_core::option::{parse_count, parse_timeout};
use farmap_core::{query, BoxFuture, Store};
use farmap_pipeline::{MirrorOptions, MirrorPolicy};

use super::model::{store_error, OpenError, SpecError, SpecKind, StoreSpec};
use super::nest;
use super::open::{open_mirror, open_store_async};
use super::scheme::Scheme;

pub use super::nest::MAX_DEPTH;

/// `verified:`, `mirror:`.
#[derive(Debug)]
pub(super) struct Stages;

impl Scheme for Stages {
    fn names(&self) -> &'static [&'static str] {
        &["verified", "mirror"]
    }

    fn parse(
        &self,
        scheme: &str,
        rest: &str,
        spec: &str,
        depth: usize,
    ) -> Result<StoreSpec, SpecError> {
        parse(scheme, rest, spec, depth)
    }

    fn display_parts(&self, spec: &StoreSpec, secrets: bool) -> (String, Vec<String>) {
        match &spec.kind {
            SpecKind::Verified { inner } => {
                (format!("verified:({})", inner.render(secrets)), vec![])
            }
            SpecKind::Mirror {
                primary,
                mirror,
                options,
            } => (
                format!(
                    "mirror:({})({})",
                    primary.render(secrets),
                    mirror.render(secrets)
                ),
                mirror_options(options),
            ),
            other => unreachable!("not a stage spec: {other:?}"),
        }
    }

    fn open<'a>(&'a self, spec: &'a StoreSpec) -> BoxFuture<'a, Result<Arc<dyn Store>, OpenError>> {
        Box::pin(async move {
            Ok(match &spec.kind {
                SpecKind::Verified { inner } => {
                    let store = Box::pin(open_store_async(inner)).await?;
                    let verified = farmap_pipeline::Verified::open(store, None)
                        .await
                        .map_err(store_error(spec))?;
                    Arc::new(verified) as Arc<dyn Store>
                }
                SpecKind::Mirror {
                    primary,
                    mirror,
                    options,
                } => Arc::new(open_mirror(spec, primary, mirror, *options).await?),
                other => unreachable!("not a stage spec: {other:?}"),
            })
        })
    }

    fn path<'a>(&self, spec: &'a StoreSpec) -> Option<&'a Path> {
        match &spec.kind {
            SpecKind::Verified { inner } => inner.path(),
            SpecKind::Mirror { primary, .. } => primary.path(),
            _ => None,
        }
    }

    fn creates(&self, spec: &StoreSpec) -> bool {
        members(spec).into_iter().any(StoreSpec::creates)
    }

    fn is_remote(&self, spec: &StoreSpec) -> bool {
        members(spec).into_iter().any(StoreSpec::is_remote)
    }
}

/// The specs a stage spec stands over, in order (a mirror's primary first).
fn members(spec: &StoreSpec) -> Vec<&StoreSpec> {
    match &spec.kind {
        SpecKind::Verified { inner } => vec![&**inner],
        SpecKind::Mirror {
            primary, mirror, ..
        } => vec![&**primary, &**mirror],
        _ => vec![],
    }
}

/// The options of a `mirror:` spec that differ from the defaults, as `key=value`.
fn mirror_options(o: &MirrorOptions) -> Vec<String> {
    let d = MirrorOptions::default();
    let mut v = Vec::new();
    if o.policy != d.policy {
        v.push(format!("policy={}", o.policy.as_str()));
    }
    if o.timeout != d.timeout {
        v.push(format!(
            "timeout={}",
            farmap_core::format_duration(o.timeout)
        ));
    }
    if o.backlog != d.backlog {
        v.push(format!("backlog={}", o.backlog));
    }
    if o.probe != d.probe {
        v.push(format!("probe={}", farmap_core::format_duration(o.probe)));
    }
    v
}

/// Parses the part after `scheme:` of a stage spec.
fn parse(scheme: &str, rest: &str, spec: &str, depth: usize) -> Result<StoreSpec, SpecError> {
    let bad = |reason: String| SpecError::BadOption {
        option: "spec",
        spec: spec.to_owned(),
        reason,
    };
    nest::check_depth(depth).map_err(bad)?;
    let (inner, q) = nest::groups(rest).map_err(bad)?;
    let takes = match scheme {
        "verified" => "",
        "mirror" => "policy, timeout, backlog, probe",
        _ => unreachable!("checked by is_stage"),
    };
    let mut mirror = MirrorOptions::default();
    for (key, value) in q.into_iter().flat_map(query::pairs) {
        // `"".split(", ")` yields `""`: without the first test, an empty option name
        // (`verified:?=`) passed for one of `verified:`'s (none) and reached `unreachable!`.
        if takes.is_empty() || !takes.split(", ").any(|k| k == key) {
            return Err(SpecError::UnknownOption {
                option: key.to_owned(),
                spec: spec.to_owned(),
                takes: if takes.is_empty() {
                    "no options"
                } else {
                    takes
                },
            });
        }
        let bad = |option: &'static str, reason: String| SpecError::BadOption {
            option,
            spec: spec.to_owned(),
            reason,
        };
        match key {
            "policy" => {
                mirror.policy = match value {
                    "both" => MirrorPolicy::Both,
                    "primary-first" => MirrorPolicy::PrimaryFirst,
                    _ => {
                        return Err(bad(
                            "policy",
                            format!("{value:?} is not both or primary-first"),
                        ))
                    }
                }
            }
            "timeout" => mirror.timeout = parse_timeout(value).map_err(|w| bad("timeout", w))?,
            "probe" => mirror.probe = parse_timeout(value).map_err(|w| bad("probe", w))?,
            "backlog" => {
                mirror.backlog =
                    parse_count(value, 1..=1_048_576usize).map_err(|w| bad("backlog", w))?
            }
            _ => unreachable!("checked against the stage's options"),
        }
    }
    let (want, form) = match scheme {
        "verified" => (1, "verified:(SPEC)"),
        _ => (2, "mirror:(PRIMARY)(MIRROR)"),
    };
    if inner.len() != want {
        return Err(SpecError::BadOption {
            option: "spec",
            spec: spec.to_owned(),
            reason: format!(
                "{scheme}: takes {want} store{} in parentheses, got {}: write {form}",
                if want == 1 { "" } else { "s" },
                inner.len()
            ),
        });
    }
    let inner: Vec<StoreSpec> = inner
        .iter()
        .map(|s| {
            nest::parse_inner(s, depth).map_err(|e| match e {
                nest::InnerError::Spec(e) => e,
                nest::InnerError::Reason(r) => bad(r),
            })
        })
        .collect::<Result<_, _>>()?;
    let mut inner = inner.into_iter();
    let first = Box::new(inner.next().expect("one"));
    let kind = match scheme {
        "verified" => SpecKind::Verified { inner: first },
        _ => SpecKind::Mirror {
            primary: first,
            mirror: Box::new(inner.next().expect("two")),
            options: mirror,
        },
    };
    Ok(StoreSpec {
        kind,
        size: None,
        chunk_size: None,
        read_only: false,
    })
}
