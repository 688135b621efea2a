//! Every store scheme farmap knows, and the dispatch from a spec to its scheme's module:
//! parsing a spec's text, printing a spec back, finding the module of a [`SpecKind`].

use super::model::{SpecError, SpecKind, StoreSpec};
use super::scheme::Scheme;

/// Every scheme farmap knows, in the order messages list them.
static SCHEMES: &[&dyn Scheme] = &[
    &super::local::Local,
    &super::remote::Remote,
    #[cfg(feature = "grpc")]
    &super::grpc::Grpc,
    #[cfg(feature = "redis")]
    &super::redis::Redis,
    #[cfg(feature = "s3")]
    &super::s3::S3,
    #[cfg(feature = "http")]
    &super::http::Http,
    #[cfg(feature = "cql")]
    &super::cql::Cql,
    #[cfg(feature = "nbd")]
    &super::nbd::Nbd,
    &super::tier::Tiers,
    &super::stage::Stages,
    &super::versioned::Versions,
];

/// The scheme module that parses `name` (lowercase).
pub(super) fn find(name: &str) -> Option<&'static dyn Scheme> {
    SCHEMES
        .iter()
        .copied()
        .find(|s| s.names().contains(&name) || s.aliases().contains(&name))
}

/// The known schemes, for messages: `memory, file, dir, farmap, ...`.
fn known() -> String {
    SCHEMES
        .iter()
        .flat_map(|s| s.names().iter().copied())
        .collect::<Vec<_>>()
        .join(", ")
}

impl SpecKind {
    /// The module of this kind's scheme.
    pub(super) fn scheme(&self) -> &'static dyn Scheme {
        match self {
            SpecKind::Memory | SpecKind::File { .. } | SpecKind::Dir { .. } => &super::local::Local,
            SpecKind::Remote { .. } => &super::remote::Remote,
            #[cfg(feature = "grpc")]
            SpecKind::Grpc { .. } => &super::grpc::Grpc,
            #[cfg(feature = "redis")]
            SpecKind::Redis(_) => &super::redis::Redis,
            #[cfg(feature = "s3")]
            SpecKind::S3 { .. } => &super::s3::S3,
            #[cfg(feature = "http")]
            SpecKind::Http { .. } => &super::http::Http,
            #[cfg(feature = "cql")]
            SpecKind::Cql(_) => &super::cql::Cql,
            #[cfg(feature = "nbd")]
            SpecKind::Nbd { .. } => &super::nbd::Nbd,
            SpecKind::Tier(_) => &super::tier::Tiers,
            SpecKind::Verified { .. } | SpecKind::Mirror { .. } => &super::stage::Stages,
            SpecKind::Versioned { .. } => &super::versioned::Versions,
        }
    }
}

/// Parses a spec found `depth` stages deep: its scheme's module does the rest.
pub(super) fn parse(spec: &str, depth: usize) -> Result<StoreSpec, SpecError> {
    let (scheme, rest) = spec.split_once(':').ok_or_else(|| SpecError::NoScheme {
        spec: spec.to_owned(),
    })?;
    let name = scheme.to_ascii_lowercase();
    let found = find(&name).ok_or_else(|| SpecError::UnknownScheme {
        scheme: scheme.to_owned(),
        spec: spec.to_owned(),
        known: known(),
    })?;
    found.parse(&name, rest, spec, depth)
}

impl StoreSpec {
    /// The canonical text: the scheme's part, then `chunk=` and `ro`; passwords only with
    /// `secrets`.
    pub(super) fn render(&self, secrets: bool) -> String {
        let (head, mut opts) = self.kind.scheme().display_parts(self, secrets);
        if let Some(c) = self.chunk_size {
            opts.push(format!("chunk={}", farmap_core::format_size(u64::from(c))));
        }
        if self.read_only {
            opts.push("ro".into());
        }
        if opts.is_empty() {
            head
        } else {
            format!("{head}?{}", opts.join("&"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_is_parsed_by_one_scheme() {
        let mut seen = std::collections::HashSet::new();
        for s in SCHEMES {
            for name in s.names().iter().chain(s.aliases()) {
                assert!(seen.insert(*name), "{name} is claimed twice");
                assert!(std::ptr::addr_eq(find(name).unwrap(), *s), "{name}");
            }
        }
        assert_eq!(find("nosuch").map(|_| ()), None);
    }
}
