//! Store specs: how a user names a store on the command line or in configuration
//! (`memory:256MiB`, `dir:./chunks?size=1GiB`, `redis://host/0?size=1GiB`, ...). The
//! reference of every scheme and option is `docs/store-specs.md` (what `farmap help stores`
//! prints).
//!
//! One module per family of schemes, each implementing the `Scheme` trait (`scheme.rs`: parse,
//! print, open); `registry.rs` lists them, so adding a scheme is one new module, one line there
//! and a [`SpecKind`] variant for its settings. Stage and tier specs contain specs: parsing,
//! printing and opening them recurse through the registry (the one import cycle of this
//! module, `scripts/check-layers.py` allows it):
//!
//! | module | schemes |
//! |---|---|
//! | `local` | `memory:`, `file:`, `dir:` ([`farmap_store`]) |
//! | `remote` | `farmap://`, `farmaps://`, `farmap+unix:` ([`farmap_net`]) |
//! | `grpc` | `farmap+grpc://` (feature `grpc`) |
//! | `redis` | `redis://`, `rediss://`, `redis+cluster://` (feature `redis`) |
//! | `s3` | `s3://` (feature `s3`) |
//! | `http` | `http://`, `https://`: a file on a web server, read-only (feature `http`) |
//! | `cql` | `cql://` (feature `cql`) |
//! | `nbd` | `nbd://`, `nbds://`, `nbd+unix://`, `nbds+unix://` (feature `nbd`) |
//! | `tier` | `tier:(SPEC?cap=SIZE)(SPEC)...` |
//! | [`stage`] | `verified:(SPEC)`, `mirror:(PRIMARY)(MIRROR)` |
//! | `versioned` | `versioned:(dir:PATH)/REGION[@VERSION]`, objects also in `s3://` or `redis://` ([`farmap_versions`]) |
//!
//! Options go after `?`, separated by `&` ([`farmap_core::query`]); `size=`, `chunk=` (a
//! power of two from 4KiB to 4MiB, default 64KiB) and `ro` mean the same in every scheme that
//! takes them. Sizes take binary suffixes; a region has at most
//! [`MAX_CHUNKS`](farmap_core::MAX_CHUNKS) chunks, so `memory:1PiB` is refused (use
//! `chunk=4MiB`). Durations need a unit ([`farmap_core::parse_duration`]). Network stores are
//! opened with [`open_store_async`] (or [`open_store_blocking`]).

use std::fmt;
use std::path::Path;
use std::str::FromStr;

mod absent;
mod blocking;
mod common;
#[cfg(feature = "cql")]
mod cql;
#[cfg(feature = "grpc")]
mod grpc;
#[cfg(feature = "http")]
mod http;
mod local;
mod model;
#[cfg(feature = "nbd")]
mod nbd;
mod nest;
mod open;
#[cfg(feature = "redis")]
mod redis;
mod registry;
mod remote;
#[cfg(feature = "s3")]
mod s3;
mod scheme;
pub mod stage;
mod tier;
mod versioned;

pub use blocking::open_store_blocking;
pub use model::{OpenError, SpecError, SpecKind, StoreSpec, TierSpec};
pub use open::{mirror_journal_path, open_mirror, open_store, open_store_async};
pub use tier::map_path as tier_map_path;
pub use versioned::open_objects;

impl StoreSpec {
    /// The path of a file or dir store (also under a stage: a mirror's primary).
    pub fn path(&self) -> Option<&Path> {
        self.kind.scheme().path(self)
    }

    /// Whether opening this spec would create something new (a memory store, or a file or
    /// directory store whose path does not exist yet). A remote store is never created; a
    /// `cql://` region may be, when the spec says `create=true`. A Redis region may be: it is
    /// created when its record is missing (and an existing record must match a size given
    /// anyway), so this says yes. An S3 region may be, but only the server can tell: this
    /// says `false`.
    pub fn creates(&self) -> bool {
        self.kind.scheme().creates(self)
    }

    /// Whether this spec names a store on another host (opened with [`open_store_async`]).
    pub fn is_remote(&self) -> bool {
        self.kind.scheme().is_remote(self)
    }

    /// Whether this spec is a stage over other specs (`verified:(SPEC)`).
    pub fn is_stage(&self) -> bool {
        matches!(
            self.kind,
            SpecKind::Verified { .. } | SpecKind::Mirror { .. }
        )
    }

    /// Whether opening this spec needs an async runtime ([`open_store_async`]): remote
    /// stores and stages (which read their metadata when opened).
    pub fn needs_async(&self) -> bool {
        self.is_remote()
            || self.is_stage()
            || matches!(self.kind, SpecKind::Tier(_) | SpecKind::Versioned { .. })
    }

    /// Opens the spec read-only where that means something (file and dir stores, also under
    /// stages), for commands that only look.
    pub fn set_read_only_where_possible(&mut self) {
        match &mut self.kind {
            SpecKind::Verified { inner } => inner.set_read_only_where_possible(),
            // A mirror's stores take writes from resync; left as they are.
            SpecKind::Mirror { .. } => {}
            SpecKind::Versioned { .. } => self.read_only = true,
            _ => {
                if self.path().is_some() {
                    self.read_only = true;
                }
            }
        }
    }

    /// Sets the size when the spec has none and would create its store (used by `cp` so that
    /// `farmap cp SRC file:./new.img` takes the source's size).
    pub fn default_size_for_new(&mut self, size: u64) {
        if self.size.is_none() && self.creates() {
            self.size = Some(size);
        }
    }

    /// The spec with its passwords, so that it opens the store again where it is parsed (a
    /// region handed to another process). Keep it out of logs and messages: `Display` shows
    /// passwords as `***`.
    pub fn to_secret_string(&self) -> String {
        self.render(true)
    }
}

impl FromStr for StoreSpec {
    type Err = SpecError;

    fn from_str(spec: &str) -> Result<Self, SpecError> {
        registry::parse(spec, 0)
    }
}

impl fmt::Display for StoreSpec {
    /// The spec as people see it: passwords as `***` (see [`StoreSpec::to_secret_string`]).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.render(false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use farmap_net::RemoteAddr;
    use std::path::PathBuf;
    use std::time::Duration;

    /// The error parsing `spec` gives, which must contain `want`.
    fn refused(spec: &str, want: &str) -> String {
        let err = parse(spec).expect_err(spec).to_string();
        assert!(
            err.contains(want),
            "{spec}: {err:?} should contain {want:?}"
        );
        err
    }

    fn parse(s: &str) -> Result<StoreSpec, SpecError> {
        s.parse()
    }

    /// The property the `store_spec` fuzz target checks, on inputs picked to be awkward.
    #[test]
    fn the_secret_form_keeps_passwords_and_display_hides_them() {
        for (text, password) in [
            ("redis://u:pa@ss:w@127.0.0.1:6379/2?size=1MiB", "pa@ss:w"),
            ("rediss://:pw@h:1/0?size=1MiB&prefix=p", "pw"),
            ("redis+cluster://:pw@h:1,h:2/?size=1MiB", "pw"),
            ("cql://u:p%3Aw@h:1/ks?table=t&size=1MiB", "p:w"),
        ] {
            let spec: StoreSpec = text.parse().unwrap();
            let shown = spec.to_string();
            assert!(
                !shown.contains(password) && shown.contains("***"),
                "{text} shown as {shown}"
            );
            let secret = spec.to_secret_string();
            let again: StoreSpec = secret.parse().unwrap();
            assert_eq!(again, spec, "{text} → {secret}");
            assert_eq!(again.to_secret_string(), secret);
            assert_eq!(again.to_string(), shown);
        }
        // Without a password, both forms are the same.
        let plain: StoreSpec = "redis://h:1/0?size=1MiB".parse().unwrap();
        assert_eq!(plain.to_secret_string(), plain.to_string());
    }

    #[test]
    fn canonical_forms_read_back() {
        for text in [
            "memory:1G?chunk=4K",
            "mem:?size=3.5MiB",
            "file:./a&b.img?size=1GiB&ro=yes",
            "dir:/x?size=1PiB&chunk=4MiB&max-open=3&ro",
            "dir:./x?&&size=5000",
            "farmaps://h:1?ca=a&cert=c&key=k&name=n&timeout=1500ms&connections=2",
            "farmap+unix:/s?timeout=0.5s",
            "farmap+grpc://h:2?timeout=90s",
            "cql://u@h:1,h2/ks?table=t&region=r&size=3MiB&chunk=1MiB&create=true&ro",
            "cql://h/ks?consistency=one&timeout=2s&connections=3&replication=2",
            "s3://bucket/a/b?endpoint=http://127.0.0.1:9000&region=eu-west-1&profile=p&connections=8&timeout=2s&retries=3&size=64MiB&chunk=1MiB&ro",
            "s3://my.bucket?size=1GiB",
            "s3://bucket/x/?retries=0&endpoint=https://s3.example:443/",
            "nbd://h/disk%20one?chunk=1MiB&ro&connections=2&timeout=5s",
            "nbd://[::1]:7/",
            "nbds+unix:///e?socket=/s&ca=a&cert=c&key=k&name=n",
            "versioned:(dir:./objects)/vm-1?size=1GiB&chunk=1MiB",
            "versioned:(dir:/o)/r@12?ro",
            "versioned:(dir:/o)/r@before.upgrade",
            "versioned:(redis://h:1/2?prefix=objs&flush=wait)/r@3",
            "versioned:(redis+cluster://a:1,b:2/?timeout=5s)/r?size=1GiB",
            "versioned:(cql://u@h:1,h2/ks?table=t&create=true&consistency=quorum)/r@3",
        ] {
            let spec = parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            let shown = spec.to_string();
            assert_eq!(parse(&shown), Ok(spec), "{text} -> {shown}");
        }
    }

    #[test]
    fn cql_specs() {
        let c = parse("cql://127.0.0.1:9042/ks?table=t&region=vm1&size=64MiB&create=true").unwrap();
        let SpecKind::Cql(t) = &c.kind else {
            panic!("{c:?}")
        };
        assert_eq!((t.keyspace.as_str(), t.table.as_str()), ("ks", "t"));
        assert_eq!(t.region, "vm1");
        assert_eq!(c.size, Some(64 << 20));
        assert!(c.is_remote() && c.creates() && c.path().is_none());
        assert!(matches!(open_store(&c), Err(OpenError::NeedsAsync { .. })));
        let mut without = parse("cql://h/ks?create=true").unwrap();
        without.default_size_for_new(1 << 20);
        assert_eq!(
            without.size,
            Some(1 << 20),
            "cp gives a new region the source's size"
        );
        assert!(!parse("cql://h/ks").unwrap().creates());
        // The password is not shown (as for Redis).
        let p = parse("cql://u:hunter2@h/ks?size=1MiB").unwrap();
        assert!(
            p.to_string().starts_with("cql://u:***@h:9042/ks?")
                && !p.to_string().contains("hunter2"),
            "{p}"
        );
        for (spec, want) in [
            ("cql://h/ks?chunk=4MiB", "from 4KiB to 1MiB"),
            ("cql://h/ks?ca=x", "unknown option \"ca\""),
            ("cql://h", "no keyspace"),
        ] {
            let err = parse(spec).expect_err(spec).to_string();
            assert!(
                err.contains(want) && err.contains("bad cql spec"),
                "{spec}: {err}"
            );
            assert!(!err.contains('\n'), "one-line errors: {err:?}");
        }
    }

    #[test]
    fn redis_specs() {
        let r =
            parse("redis://127.0.0.1:6379/2?size=64MiB&prefix=x&chunk=4KiB&flush=wait").unwrap();
        let SpecKind::Redis(c) = &r.kind else {
            panic!("{r:?}")
        };
        assert_eq!(c.prefix, "x");
        assert_eq!(c.flush, farmap_redis::FlushPolicy::Wait { replicas: 1 });
        assert_eq!((r.size, r.chunk_size), (Some(64 << 20), Some(4096)));
        assert!(r.is_remote() && r.creates() && r.path().is_none());
        assert_eq!(parse(&r.to_string()).unwrap(), r, "display round-trips");
        assert!(matches!(open_store(&r), Err(OpenError::NeedsAsync { .. })));
        let c = parse("redis+cluster://a:1,b:2/?size=1GiB&connections=2").unwrap();
        assert_eq!(parse(&c.to_string()).unwrap(), c);
        let t = parse("rediss://h:1/0?ca=ca.pem").unwrap();
        assert_eq!(parse(&t.to_string()).unwrap(), t);
        // The password is not shown.
        let p = parse("redis://u:hunter2@h:1/0?size=1MiB").unwrap();
        assert!(!p.to_string().contains("hunter2"), "{p}");
        for (spec, want) in [
            ("redis://h:1?ca=x", "unknown option \"ca\""),
            ("redis://h?size=1G", "names no server"),
            ("redis://h:1?flush=sometimes", "bad value for flush"),
            ("redis+cluster://a:1,b/", "names no server"),
            ("redis://h:1?bogus=1", "unknown option \"bogus\""),
        ] {
            refused(spec, want);
        }
    }

    #[test]
    fn s3_specs() {
        let s = parse("s3://farmap-test/vm1?endpoint=http://127.0.0.1:9000&size=64MiB").unwrap();
        let SpecKind::S3 { location } = &s.kind else {
            panic!("{s:?}")
        };
        assert_eq!(location.bucket, "farmap-test");
        assert_eq!(location.prefix, "vm1");
        assert_eq!(location.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
        assert_eq!(s.size, Some(64 << 20));
        assert!(s.is_remote() && !s.creates() && s.path().is_none());
        assert_eq!(
            s.to_string(),
            "s3://farmap-test/vm1?endpoint=http://127.0.0.1:9000&size=64MiB"
        );
        assert!(matches!(open_store(&s), Err(OpenError::NeedsAsync { .. })));
        for (spec, want) in [
            ("s3:bucket/x", "write s3://BUCKET/PREFIX"),
            ("s3://", "names no bucket"),
            ("s3://B/x", "not a bucket name"),
            ("s3://bucket/a//b", "bad value for prefix"),
            ("s3://bucket/x?endpoint=ftp://h", "bad value for endpoint"),
            ("s3://bucket/x?connections=0", "bad value for connections"),
            ("s3://bucket/x?retries=many", "bad value for retries"),
            ("s3://bucket/x?secret=abc", "unknown option \"secret\""),
            ("s3://bucket/x?max-open=3", "unknown option \"max-open\""),
            ("s3://bucket/x?size=0", "cannot be empty"),
        ] {
            let err = refused(spec, want);
            assert!(!err.contains('\n'), "one-line errors: {err:?}");
        }
    }

    #[test]
    fn nbd_specs() {
        let n = parse("nbd://127.0.0.1:10810/disk?chunk=256KiB&connections=2&timeout=3s").unwrap();
        let SpecKind::Nbd {
            target,
            connections,
            timeout,
        } = &n.kind
        else {
            panic!("{n:?}")
        };
        assert_eq!(target.addr, RemoteAddr::Tcp("127.0.0.1:10810".into()));
        assert_eq!(target.export, "disk");
        assert!(target.tls.is_none());
        assert_eq!(
            (*connections, *timeout, n.chunk_size),
            (Some(2), Some(Duration::from_secs(3)), Some(256 << 10))
        );
        assert!(n.is_remote() && !n.creates() && n.path().is_none());
        assert!(matches!(open_store(&n), Err(OpenError::NeedsAsync { .. })));
        assert_eq!(
            n.to_string(),
            "nbd://127.0.0.1:10810/disk?connections=2&timeout=3s&chunk=256KiB"
        );
        // The default port and the default export, as libnbd writes them.
        let d = parse("nbd://example.com").unwrap();
        assert_eq!(d.to_string(), "nbd://example.com:10809/");
        let SpecKind::Nbd { target, .. } = &d.kind else {
            panic!()
        };
        assert_eq!(target.export, "");
        // Unix sockets: the export is the path, the socket an option.
        let u = parse("nbd+unix:///foo?socket=/tmp/nbd.sock").unwrap();
        let SpecKind::Nbd { target, .. } = &u.kind else {
            panic!()
        };
        assert_eq!(target.addr, RemoteAddr::Unix("/tmp/nbd.sock".into()));
        assert_eq!(target.export, "foo");
        assert_eq!(u.to_string(), "nbd+unix:///foo?socket=/tmp/nbd.sock");
        // TLS: ca= like farmaps://, or libnbd's tls-certificates=DIR.
        let t = parse("nbds://h/e?ca=ca.pem&cert=c.pem&key=k.pem").unwrap();
        let SpecKind::Nbd { target, .. } = &t.kind else {
            panic!()
        };
        let tls = target.tls.as_ref().unwrap();
        assert_eq!(
            (tls.ca.to_str(), tls.cert.as_deref(), tls.key.as_deref()),
            (
                Some("ca.pem"),
                Some(Path::new("c.pem")),
                Some(Path::new("k.pem"))
            )
        );
        let dir = tempfile::tempdir().unwrap();
        for f in ["ca-cert.pem", "client-cert.pem", "client-key.pem"] {
            std::fs::write(dir.path().join(f), "x").unwrap();
        }
        let l = parse(&format!(
            "nbds+unix:///?socket=/s&tls-certificates={}",
            dir.path().display()
        ))
        .unwrap();
        let SpecKind::Nbd { target, .. } = &l.kind else {
            panic!()
        };
        let tls = target.tls.as_ref().unwrap();
        assert_eq!(tls.ca, dir.path().join("ca-cert.pem"));
        assert_eq!(
            tls.key.as_deref(),
            Some(&*dir.path().join("client-key.pem"))
        );
        assert_eq!(parse(&l.to_string()).unwrap(), l, "display round-trips");
        for (spec, want) in [
            ("nbd:host/x", "write nbd://HOST[:PORT]/EXPORT"),
            ("nbd://:1/x", "names no server"),
            ("nbd://h:0/x", "names no server"),
            ("nbd://h/x?size=1G", "unknown option \"size\""),
            ("nbd://h/x?socket=/s", "unknown option \"socket\""),
            ("nbd://h/x?ca=a", "unknown option \"ca\""),
            ("nbds://h/x", "needs ca="),
            ("nbds://h/x?ca=a&cert=c", "needs key="),
            ("nbd+unix:///x", "needs socket="),
            (
                "nbd+unix://host/x?socket=/s",
                "write nbd+unix:///EXPORT?socket=/PATH",
            ),
            ("nbd://h/%zz", "bad value for export"),
            ("nbd://h/x?connections=0", "bad value for connections"),
            ("nbd://h/x?timeout=5", "bad value for timeout"),
            ("nbd://h/x?chunk=3KiB", "not a power of two"),
        ] {
            let err = refused(spec, want);
            assert!(!err.contains('\n'), "one-line errors: {err:?}");
        }
    }

    #[test]
    fn stage_specs() {
        let v = parse("verified:(file:./x.img?size=1GiB&chunk=4KiB)").unwrap();
        let SpecKind::Verified { inner } = &v.kind else {
            panic!("{v:?}")
        };
        assert_eq!(inner.size, Some(1 << 30));
        assert_eq!(inner.chunk_size, Some(4096));
        assert_eq!(v.path(), Some(Path::new("./x.img")));
        assert!(v.is_stage() && v.needs_async() && !v.is_remote());
        assert_eq!(
            v.to_string(),
            "verified:(file:./x.img?size=1GiB&chunk=4KiB)"
        );
        assert_eq!(parse(&v.to_string()).unwrap(), v, "display round-trips");
        assert!(matches!(open_store(&v), Err(OpenError::NeedsAsync { .. })));
        let nested = parse("VERIFIED:(verified:(farmap://h:1))").unwrap();
        assert!(nested.is_remote());
        assert_eq!(nested.to_string(), "verified:(verified:(farmap://h:1))");
        let m = parse("mirror:(file:a.img?size=1MiB)(farmap://h:1?timeout=1s)?policy=primary-first&backlog=64&timeout=500ms").unwrap();
        let SpecKind::Mirror {
            primary, options, ..
        } = &m.kind
        else {
            panic!("{m:?}")
        };
        assert_eq!(primary.size, Some(1 << 20));
        assert_eq!(options.policy, farmap_pipeline::MirrorPolicy::PrimaryFirst);
        assert_eq!(
            (options.backlog, options.timeout),
            (64, Duration::from_millis(500))
        );
        assert!(m.is_remote() && m.is_stage());
        assert_eq!(parse(&m.to_string()).unwrap(), m, "display round-trips");
        assert_eq!(
            parse("mirror:(memory:1MiB)(memory:1MiB)")
                .unwrap()
                .to_string(),
            "mirror:(memory:1MiB)(memory:1MiB)"
        );
        for (spec, want) in [
            ("mirror:(memory:1MiB)", "takes 2 stores"),
            (
                "mirror:(memory:1MiB)(memory:1MiB)?policy=later",
                "bad value for policy",
            ),
            (
                "mirror:(memory:1MiB)(memory:1MiB)?backlog=0",
                "bad value for backlog",
            ),
            (
                "mirror:(memory:1MiB)(memory:1MiB)?ro",
                "unknown option \"ro\"",
            ),
        ] {
            refused(spec, want);
        }
        let deep = format!("{}memory:1MiB{}", "verified:(".repeat(9), ")".repeat(9));
        for (spec, want) in [
            ("verified:", "takes 1 store"),
            ("verified:(memory:1MiB)(memory:1MiB)", "takes 1 store"),
            ("verified:(memory:1MiB", "not closed"),
            ("verified:(memory:1MiB)x", "options go after"),
            ("verified:(memory:1MiB)?size=1G", "unknown option \"size\""),
            // An empty option name panicked (found by the store_spec fuzz target).
            ("verified:?=", "unknown option \"\""),
            ("verified:(memory:1MiB)?=x", "unknown option \"\""),
            ("mirror:(memory:1MiB)(memory:1MiB)?=", "unknown option \"\""),
            ("verified:(nope:1)", "unknown store scheme"),
            (deep.as_str(), "nest at most"),
        ] {
            refused(spec, want);
        }
    }

    #[tokio::test]
    async fn opens_verified_specs() {
        let v = open_store_async(&parse("verified:(memory:64MiB)").unwrap())
            .await
            .unwrap();
        // One chunk of checksums for up to 4094 chunks of 64 KiB: the region says so.
        assert_eq!(v.geometry().chunk_count(), 1023);
        let small = open_store_async(&parse("verified:(memory:64KiB)").unwrap())
            .await
            .map(|_| ())
            .unwrap_err();
        assert!(
            small.to_string().contains("verified:(memory:64KiB)"),
            "{small}"
        );
    }

    #[test]
    fn grpc_specs() {
        let g = parse("farmap+grpc://127.0.0.1:7401?connections=2&timeout=5s").unwrap();
        assert_eq!(
            g.kind,
            SpecKind::Grpc {
                addr: "127.0.0.1:7401".into(),
                connections: Some(2),
                timeout: Some(Duration::from_secs(5)),
            }
        );
        assert!(g.is_remote());
        assert!(!g.creates());
        assert_eq!(parse(&g.to_string()).unwrap(), g, "display round-trips");
        assert!(parse("farmap+grpc://nohost").is_err());
        let err = parse("farmap+grpc://h:1?ca=x").unwrap_err().to_string();
        assert!(err.contains("unknown option"), "{err}");
    }

    #[test]
    fn good_specs() {
        let m = parse("memory:256MiB").unwrap();
        assert_eq!(m.kind, SpecKind::Memory);
        assert_eq!(m.size, Some(256 << 20));
        assert_eq!(m.chunk_size, None);
        assert_eq!(m.to_string(), "memory:256MiB");

        let e = parse("memory:1PiB").unwrap_err().to_string();
        assert!(
            e.contains("more than the 268435456") && e.contains("larger chunk size"),
            "{e}"
        );
        assert!(parse("dir:/x?size=17TiB").is_err());
        let big = parse("memory:1PiB?chunk=4MiB").unwrap();
        assert_eq!(big.size, Some(1 << 50));
        let m = parse("memory:1G?chunk=4K").unwrap();
        assert_eq!(m.size, Some(1 << 30));
        assert_eq!(m.chunk_size, Some(4096));
        assert_eq!(m.to_string(), "memory:1GiB?chunk=4KiB");

        let f = parse("file:./disk.img").unwrap();
        assert_eq!(
            f.kind,
            SpecKind::File {
                path: "./disk.img".into()
            }
        );
        assert_eq!(f.size, None);

        let f = parse("file:./disk.img?size=1GiB&chunk=1MiB&ro").unwrap();
        assert_eq!(f.size, Some(1 << 30));
        assert_eq!(f.chunk_size, Some(1 << 20));
        assert!(f.read_only);

        let d = parse("dir:/tmp/chunks?size=1GiB&max-open=32").unwrap();
        assert_eq!(
            d.kind,
            SpecKind::Dir {
                path: "/tmp/chunks".into(),
                max_open_files: Some(32)
            }
        );
        assert_eq!(parse(&d.to_string()).unwrap(), d, "display round-trips");
        assert_eq!(
            parse("memory:1GiB?size=1024MiB").unwrap().size,
            Some(1 << 30)
        );
    }

    #[test]
    fn bad_specs_name_the_problem() {
        let cases = [
            ("nope:1G", "unknown store scheme \"nope\""),
            ("./disk.img", "has no scheme"),
            ("versioned:dir:./o/r", "write versioned:(dir:PATH)/REGION"),
            ("versioned:(dir:./o)r", "after a '/'"),
            ("versioned:(memory:1GiB)/r", "live in dir:PATH"),
            ("versioned:(dir:./o?size=1GiB)/r", "give size="),
            ("versioned:(cql://h/ks?region=x)/r", "rather than region="),
            ("versioned:(cql://h/ks?size=1GiB)/r", "give size="),
            ("versioned:(dir:./o)/a/b", "region \"a/b\""),
            ("versioned:(dir:./o)/r@.x", "snapshot \".x\""),
            (
                "versioned:(dir:./o)/r?max-open=3",
                "unknown option \"max-open\"",
            ),
            ("memory:", "needs a size"),
            ("memory:12XB", "unknown suffix"),
            ("memory:1GiB?size=2GiB", "conflicting sizes"),
            ("memory:1GiB?chunk=3KiB", "not a power of two"),
            ("memory:1GiB?chunk=8MiB", "not a power of two"),
            ("memory:1GiB?ro", "unknown option \"ro\""),
            ("file:?size=1G", "names no path"),
            ("file:x?bogus=1", "unknown option \"bogus\""),
            ("dir:x?max-open=0", "bad value for max-open"),
            ("file:x?size=0", "cannot be empty"),
        ];
        for (spec, want) in cases {
            let err = refused(spec, want);
            assert!(!err.contains('\n'), "one-line errors: {err:?}");
        }
    }

    #[test]
    fn remote_specs() {
        let r = parse("farmap://127.0.0.1:7400").unwrap();
        assert_eq!(
            r.kind,
            SpecKind::Remote {
                addr: RemoteAddr::Tcp("127.0.0.1:7400".into()),
                tls: None,
                connections: None,
                timeout: None,
            }
        );
        assert!(r.is_remote() && !r.creates() && r.path().is_none());
        assert_eq!(r.to_string(), "farmap://127.0.0.1:7400");

        let t = parse("farmaps://db.example:7400?ca=ca.pem&cert=c.pem&key=k.pem&name=srv&timeout=5s&connections=2").unwrap();
        let SpecKind::Remote {
            addr,
            tls,
            connections,
            timeout,
        } = &t.kind
        else {
            panic!("{t:?}")
        };
        assert_eq!(addr.host(), "db.example");
        let tls = tls.as_ref().unwrap();
        assert_eq!(tls.ca, PathBuf::from("ca.pem"));
        assert_eq!(tls.server_name.as_deref(), Some("srv"));
        assert_eq!(
            (*connections, *timeout),
            (Some(2), Some(Duration::from_secs(5)))
        );
        assert_eq!(parse(&t.to_string()).unwrap(), t, "display round-trips");

        let u = parse("farmap+unix:/run/farmap.sock?timeout=250ms").unwrap();
        assert_eq!(u.to_string(), "farmap+unix:/run/farmap.sock?timeout=250ms");
        assert_eq!(parse(&u.to_string()).unwrap(), u);
        assert!(matches!(open_store(&u), Err(OpenError::NeedsAsync { .. })));

        for (spec, want) in [
            ("farmap:127.0.0.1:7400", "names no server"),
            ("farmap://127.0.0.1", "names no server"),
            ("farmap://:7400", "names no server"),
            ("farmap://h:99999", "names no server"),
            ("farmaps://h:7400", "needs ca="),
            ("farmaps://h:7400?ca=a.pem&cert=c.pem", "needs key="),
            ("farmap://h:7400?ca=a.pem", "unknown option \"ca\""),
            ("farmap://h:7400?size=1G", "unknown option \"size\""),
            ("farmap://h:7400?timeout=soon", "bad value for timeout"),
            ("farmap://h:7400?connections=0", "bad value for connections"),
            ("farmap+unix:", "names no path"),
        ] {
            let err = refused(spec, want);
            assert!(!err.contains('\n'), "one-line errors: {err:?}");
        }
    }

    #[tokio::test]
    async fn remote_open_errors_are_one_sentence() {
        // A port nothing listens on (bound, then released).
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let spec = parse(&format!("farmap://127.0.0.1:{port}")).unwrap();
        let err = open_store_async(&spec).await.map(|_| ()).unwrap_err();
        let chain = format!("{err}: {}", std::error::Error::source(&err).unwrap());
        assert!(
            chain.contains(&format!(
                "cannot connect to 127.0.0.1:{port}: connection refused"
            )),
            "{chain}"
        );
        assert!(!chain.contains('\n'));
        // Local specs open through the async entry point too.
        let m = open_store_async(&parse("memory:1MiB").unwrap())
            .await
            .unwrap();
        assert_eq!(m.geometry().size(), 1 << 20);
    }

    #[tokio::test]
    async fn opens_file_and_dir_specs() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("disk.img");
        let spec = parse(&format!("file:{}?size=1MiB&chunk=4KiB", file.display())).unwrap();
        assert!(spec.creates());
        let s = open_store(&spec).unwrap();
        assert_eq!(s.geometry().size(), 1 << 20);
        assert_eq!(s.geometry().chunk_size(), 4096);
        // Reopening without a size takes the file's length (once the first writer is gone).
        drop(s);
        let again = open_store(&parse(&format!("file:{}", file.display())).unwrap()).unwrap();
        assert_eq!(again.geometry().size(), 1 << 20);
        // A missing file without size is a clear error naming the path.
        let missing = dir.path().join("missing.img");
        let err = open_store(&parse(&format!("file:{}", missing.display())).unwrap())
            .map(|_| ())
            .unwrap_err();
        let chain = format!("{err}: {}", std::error::Error::source(&err).unwrap());
        assert!(chain.contains("missing.img"), "{chain}");

        let chunks = dir.path().join("chunks");
        let d =
            open_store(&parse(&format!("dir:{}?size=1MiB", chunks.display())).unwrap()).unwrap();
        assert_eq!(d.geometry().size(), 1 << 20);
    }
}
