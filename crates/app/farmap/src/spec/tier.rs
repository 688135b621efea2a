//! `tier:(SPEC?cap=SIZE)(SPEC?cap=SIZE)...[?map=PATH&demote=DURATION]`: a [`Tiered`] store
//! over the stores of the inner specs, highest priority first.
//!
//! Each inner spec is any spec, plus `cap=SIZE` (bytes of the region that tier holds,
//! rounded down to whole chunks; the last tier may leave it out: the whole region). Inner
//! specs are written in parentheses, which nest (a parenthesis inside one must be
//! balanced). Options of the tiered store itself follow the last parenthesis: `map=PATH`,
//! where the placement map is kept (default: beside the first tier that has a path,
//! `PATH.tiers`; none when no tier has one), and `demote=DURATION` (how often cold chunks
//! are demoted; default 1s, `0s` for never).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;

use farmap_core::{format_duration, format_size, query, BoxFuture, Store};
use farmap_pipeline::{Tier, TierOptions, Tiered};

use super::model::{store_error, OpenError, SpecError, SpecKind, StoreSpec, TierSpec};
use super::nest;
use super::open::open_store_async;
use super::scheme::Scheme;

/// `tier:`.
#[derive(Debug)]
pub(super) struct Tiers;

impl Scheme for Tiers {
    fn names(&self) -> &'static [&'static str] {
        &["tier"]
    }

    fn parse(&self, _: &str, rest: &str, spec: &str, depth: usize) -> Result<StoreSpec, SpecError> {
        parse(spec, rest, depth)
    }

    fn display_parts(&self, spec: &StoreSpec, secrets: bool) -> (String, Vec<String>) {
        let SpecKind::Tier(t) = &spec.kind else {
            unreachable!("not a tier: spec: {spec:?}")
        };
        render(t, secrets)
    }

    fn open<'a>(&'a self, spec: &'a StoreSpec) -> BoxFuture<'a, Result<Arc<dyn Store>, OpenError>> {
        Box::pin(async move {
            let SpecKind::Tier(t) = &spec.kind else {
                unreachable!("not a tier: spec: {spec:?}")
            };
            open(spec, t).await
        })
    }

    fn creates(&self, spec: &StoreSpec) -> bool {
        matches!(&spec.kind, SpecKind::Tier(t) if t.tiers.iter().any(|(s, _)| s.creates()))
    }

    fn is_remote(&self, spec: &StoreSpec) -> bool {
        matches!(&spec.kind, SpecKind::Tier(t) if t.tiers.iter().any(|(s, _)| s.is_remote()))
    }
}

fn bad(spec: &str, reason: impl Into<String>) -> SpecError {
    SpecError::Tier {
        spec: spec.to_owned(),
        reason: reason.into(),
    }
}

/// Parses the part of `spec` after `tier:`, found `depth` deep.
fn parse(spec: &str, rest: &str, depth: usize) -> Result<StoreSpec, SpecError> {
    nest::check_depth(depth).map_err(|r| bad(spec, r))?;
    let (groups, q) = nest::groups(rest).map_err(|r| bad(spec, r))?;
    let tiers = groups
        .into_iter()
        .map(|inner| parse_tier(spec, inner, depth))
        .collect::<Result<Vec<_>, _>>()?;
    if tiers.is_empty() {
        return Err(bad(
            spec,
            "write the tiers in parentheses: tier:(memory:1GiB?cap=256MiB)(dir:./chunks?size=1GiB)",
        ));
    }
    let mut map = None;
    let mut demote = None;
    if let Some(q) = q {
        for (key, v) in query::pairs(q) {
            match (key, v) {
                ("map", v) if !v.is_empty() => map = Some(PathBuf::from(v)),
                ("demote", v) => {
                    demote = Some(
                        farmap_core::parse_duration(v)
                            .map_err(|e| bad(spec, format!("demote={v}: {e}")))?,
                    )
                }
                _ => {
                    return Err(bad(
                        spec,
                        format!("unknown option {key:?} (a tiered store takes map, demote)"),
                    ))
                }
            }
        }
    }
    let last = tiers.len() - 1;
    if let Some(i) = tiers[..last].iter().position(|(_, cap)| cap.is_none()) {
        return Err(bad(
            spec,
            format!("tier {i} needs a cap=SIZE (only the last may leave it out)"),
        ));
    }
    Ok(StoreSpec {
        kind: SpecKind::Tier(Box::new(TierSpec { tiers, map, demote })),
        size: None,
        chunk_size: None,
        read_only: false,
    })
}

/// Where the query of `spec` starts: its first '?' outside parentheses (a nested tier's
/// tiers have their own).
fn query_start(spec: &str) -> Option<usize> {
    let mut depth = 0usize;
    spec.char_indices().find_map(|(i, c)| {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            '?' if depth == 0 => return Some(i),
            _ => {}
        }
        None
    })
}

/// One inner spec: its own spec with `cap=SIZE` taken out of its query.
fn parse_tier(
    spec: &str,
    inner: &str,
    depth: usize,
) -> Result<(StoreSpec, Option<u64>), SpecError> {
    let (body, query) = match query_start(inner) {
        Some(i) => (&inner[..i], Some(&inner[i + 1..])),
        None => (inner, None),
    };
    let mut cap = None;
    let mut kept = Vec::new();
    for pair in query.into_iter().flat_map(|q| q.split('&')) {
        match pair.strip_prefix("cap=") {
            Some(v) => {
                let bytes = farmap_core::parse_size(v)
                    .map_err(|e| bad(spec, format!("cap={v} in ({inner}): {e}")))?;
                cap = Some(bytes);
            }
            None => kept.push(pair),
        }
    }
    let rebuilt = if kept.is_empty() {
        body.to_owned()
    } else {
        format!("{body}?{}", kept.join("&"))
    };
    let parsed = nest::parse_inner(&rebuilt, depth).map_err(|e| match e {
        nest::InnerError::Spec(e) => e,
        nest::InnerError::Reason(r) => bad(spec, r),
    })?;
    Ok((parsed, cap))
}

/// `t` as a spec: the tiers, each with its cap, then the tiered store's own options.
fn render(t: &TierSpec, secrets: bool) -> (String, Vec<String>) {
    let mut head = String::from("tier:");
    for (inner, cap) in &t.tiers {
        let shown = inner.render(secrets);
        let _ = match cap {
            Some(c) => {
                let sep = if query_start(&shown).is_some() {
                    '&'
                } else {
                    '?'
                };
                write!(head, "({shown}{sep}cap={})", format_size(*c))
            }
            None => write!(head, "({shown})"),
        };
    }
    let mut opts = Vec::new();
    if let Some(m) = &t.map {
        opts.push(format!("map={}", m.display()));
    }
    if let Some(d) = t.demote {
        opts.push(format!("demote={}", format_duration(d)));
    }
    (head, opts)
}

/// Where the placement map of `t` is kept.
pub fn map_path(t: &TierSpec) -> Option<PathBuf> {
    t.map.clone().or_else(|| {
        t.tiers.iter().find_map(|(s, _)| {
            s.path().map(|p| {
                let mut os = p.as_os_str().to_owned();
                os.push(".tiers");
                PathBuf::from(os)
            })
        })
    })
}

/// Opens every tier, then the tiered store over them.
async fn open(spec: &StoreSpec, t: &TierSpec) -> Result<Arc<dyn Store>, OpenError> {
    let mut tiers = Vec::new();
    let mut lost_on_restart = Vec::new();
    for (i, (inner, cap)) in t.tiers.iter().enumerate() {
        if matches!(inner.kind, SpecKind::Memory) {
            lost_on_restart.push(i);
        }
        let store = Box::pin(open_store_async(inner)).await?;
        let g = store.geometry();
        let capacity = match cap {
            Some(bytes) => bytes / u64::from(g.chunk_size()),
            None => g.chunk_count(),
        };
        tiers.push(Tier { store, capacity });
    }
    let opts = TierOptions {
        map: map_path(t),
        demote_every: match t.demote {
            Some(d) if d.is_zero() => None,
            Some(d) => Some(d),
            None => TierOptions::default().demote_every,
        },
        lost_on_restart,
        ..TierOptions::default()
    };
    let store = Tiered::open(tiers, opts).map_err(store_error(spec))?;
    Ok(Arc::new(store))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn tier_specs_parse_and_print_back() {
        let spec: StoreSpec = "tier:(memory:64MiB?cap=16MiB)(dir:/tmp/x?size=64MiB&cap=64MiB)"
            .parse()
            .unwrap();
        let SpecKind::Tier(t) = &spec.kind else {
            panic!("{spec:?}")
        };
        assert_eq!(t.tiers.len(), 2);
        assert_eq!(t.tiers[0].1, Some(16 << 20));
        assert_eq!(t.tiers[1].0.to_string(), "dir:/tmp/x?size=64MiB");
        assert_eq!(map_path(t), Some(PathBuf::from("/tmp/x.tiers")));
        let again: StoreSpec = spec.to_string().parse().unwrap();
        assert_eq!(again, spec, "{spec}");
        // Nested parentheses, options, a last tier without a cap.
        let spec: StoreSpec = "tier:(tier:(memory:1MiB?cap=64KiB)(memory:1MiB)?cap=512KiB)(memory:1MiB)?map=/m&demote=5s"
            .parse()
            .unwrap();
        let SpecKind::Tier(t) = &spec.kind else {
            panic!("{spec:?}")
        };
        assert!(matches!(t.tiers[0].0.kind, SpecKind::Tier(_)));
        assert_eq!(t.tiers[0].1, Some(512 << 10));
        assert_eq!(t.demote, Some(Duration::from_secs(5)));
        assert_eq!(t.map, Some(PathBuf::from("/m")));
        assert_eq!(spec.to_string().parse::<StoreSpec>().unwrap(), spec);
        // `demote=` prints exactly: in whole milliseconds, `1.00000005s` read back as 1s
        // (found by the store_spec fuzz target).
        for (text, shown) in [
            (
                "tier:(memory:1MiB)?demote=1.00000005s",
                "demote=1000000050ns",
            ),
            ("tier:(memory:1MiB)?demote=5s", "demote=5s"),
            ("tier:(memory:1MiB)?demote=0s", "demote=0s"),
        ] {
            let spec: StoreSpec = text.parse().unwrap();
            assert!(spec.to_string().ends_with(shown), "{text} -> {spec}");
            assert_eq!(
                spec.to_string().parse::<StoreSpec>().unwrap(),
                spec,
                "{text}"
            );
        }
        for bad in [
            "tier:",
            "tier:(memory:1MiB",
            "tier:(memory:1MiB)(memory:1MiB)",
            "tier:(memory:1MiB?cap=1MiB)x",
            "tier:(memory:1MiB?cap=lots)",
            "tier:(memory:1MiB)?colour=blue",
            "tier:(nosuch:1)",
        ] {
            assert!(bad.parse::<StoreSpec>().is_err(), "{bad}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tier_spec_opens_and_keeps_its_map_beside_the_dir() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("chunks");
        let text = format!(
            "tier:(memory:1MiB?chunk=64KiB&cap=128KiB)(dir:{}?size=1MiB&chunk=64KiB)",
            dir.display()
        );
        let spec: StoreSpec = text.parse().unwrap();
        let store = super::super::open_store_async(&spec).await.unwrap();
        for i in 0..4u64 {
            store
                .write(farmap_core::ChunkIdx(i), vec![i as u8 + 1; 65536].into())
                .await
                .unwrap();
        }
        store.flush().await.unwrap();
        assert!(tmp.path().join("chunks.tiers").exists());
        assert_eq!(store.read(farmap_core::ChunkIdx(3)).await.unwrap()[0], 4);
    }
}
