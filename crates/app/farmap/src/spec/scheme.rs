//! What a module of `spec/` implements for its family of schemes; `registry.rs` lists them.

use std::path::Path;
use std::sync::Arc;

use farmap_core::{BoxFuture, Store};

use super::common::Parts;
use super::model::{OpenError, SpecError, SpecKind, StoreSpec};

/// One family of schemes (`redis`, `rediss`, `redis+cluster`): how its specs parse, print
/// and open. The methods that take a spec are only given specs this scheme parsed.
pub(super) trait Scheme: Sync {
    /// The scheme names it parses, lowercase, as listed in messages.
    fn names(&self) -> &'static [&'static str];

    /// Other names it parses that messages do not list (`mem` for `memory`).
    fn aliases(&self) -> &'static [&'static str] {
        &[]
    }

    /// Parses `rest`, the part of `spec` after `scheme:` (`scheme` in lowercase), found
    /// `depth` stages deep. This default reads a simple spec (`BODY?key=value&...`, see
    /// [`Parts`]): the options [`takes`](Self::takes) lists, the kind [`kind`](Self::kind)
    /// makes of them, then the check that the region can exist ([`Parts::finish`]).
    fn parse(
        &self,
        scheme: &str,
        rest: &str,
        spec: &str,
        _depth: usize,
    ) -> Result<StoreSpec, SpecError> {
        let mut parts = Parts::parse(rest, spec, self.takes(scheme))?;
        let kind = self.kind(scheme, &mut parts)?;
        parts.finish(kind)
    }

    /// The options a simple spec of `scheme` takes (`size, chunk, ro, max-open`), for the
    /// default [`parse`](Self::parse).
    fn takes(&self, _scheme: &str) -> &'static str {
        ""
    }

    /// The store kind a simple spec of `scheme` names, from its body and the scheme's own
    /// options; asked only by the default [`parse`](Self::parse).
    fn kind(&self, scheme: &str, _parts: &mut Parts<'_>) -> Result<SpecKind, SpecError> {
        unreachable!("{scheme}: this scheme parses its specs itself")
    }

    /// The spec's text before its options, and its own options in canonical order (`size=`
    /// among them where the scheme prints one); `chunk=` and `ro` follow them. Passwords
    /// appear only with `secrets`.
    fn display_parts(&self, spec: &StoreSpec, secrets: bool) -> (String, Vec<String>);

    /// Opens the store from synchronous code, where it can be (local stores): `None` for
    /// those that need [`open`](Self::open).
    fn open_local(&self, _spec: &StoreSpec) -> Option<Result<Arc<dyn Store>, OpenError>> {
        None
    }

    /// Opens (or creates) the store, connecting to it if it is on another host.
    fn open<'a>(&'a self, spec: &'a StoreSpec) -> BoxFuture<'a, Result<Arc<dyn Store>, OpenError>>;

    /// The path of a file or dir store (see [`StoreSpec::path`]).
    fn path<'a>(&self, _spec: &'a StoreSpec) -> Option<&'a Path> {
        None
    }

    /// Whether opening would create the store (see [`StoreSpec::creates`]).
    fn creates(&self, _spec: &StoreSpec) -> bool {
        false
    }

    /// Whether the store is on another host (see [`StoreSpec::is_remote`]).
    fn is_remote(&self, _spec: &StoreSpec) -> bool {
        true
    }
}
