//! `cql://` specs: which cluster, keyspace, table and region, and how to talk to them.
//!
//! ```text
//! cql://[user[:password]@]host[:port][,host[:port]...]/keyspace?table=T&region=R
//!       [&size=SIZE][&chunk=SIZE][&consistency=LEVEL][&create=true][&replication=N]
//!       [&connections=N][&timeout=DURATION][&ro]
//! ```
//!
//! Parsing checks everything that can be checked without a server: names are CQL identifiers,
//! the chunk size is a power of two from 4 KiB to [`MAX_CQL_CHUNK`] (1 MiB), and so on.
//! `Display` gives a canonical form that parses back to the same value.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use farmap_core::option::{parse_count, parse_timeout};
use farmap_core::{format_duration, format_size, parse_size, Geometry};

/// The largest chunk a CQL region takes: Cassandra and ScyllaDB handle blobs of up to a few
/// MiB, but large cells hurt their memory use and latency, and 1 MiB is the usual advice.
pub const MAX_CQL_CHUNK: u32 = 1 << 20;

/// The port when a node is given without one (CQL's native protocol port).
pub const DEFAULT_PORT: u16 = 9042;

/// The table when the spec names none.
pub const DEFAULT_TABLE: &str = "farmap_chunks";

/// The region when the spec names none.
pub const DEFAULT_REGION: &str = "default";

/// Environment variable holding the password of a spec that gives `user@` without one, so that
/// the password need not appear on a command line.
pub const PASSWORD_ENV: &str = "FARMAP_CQL_PASSWORD";

/// Longest table name: the region table is named `<table>_regions` (and the objects table
/// `<table>_objects`), and CQL names have at most 48 characters.
const MAX_TABLE_LEN: usize = 40;
/// Longest keyspace name (CQL's limit).
const MAX_KEYSPACE_LEN: usize = 48;
/// Longest region name.
const MAX_REGION_LEN: usize = 128;

/// The consistency level of every data request (reads, writes, deletes, status).
///
/// Reads and writes at the same level see each other when `R + W > RF`: `quorum` or
/// `local_quorum` for both (the default) does that for any replication factor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CqlConsistency {
    /// One replica.
    One,
    /// Two replicas.
    Two,
    /// Three replicas.
    Three,
    /// A majority of all replicas.
    Quorum,
    /// A majority of the replicas in the coordinator's data center (the default; the same as
    /// `quorum` in a single data center).
    #[default]
    LocalQuorum,
    /// A majority in every data center.
    EachQuorum,
    /// Every replica.
    All,
    /// One replica in the coordinator's data center.
    LocalOne,
}

impl CqlConsistency {
    const NAMES: [(CqlConsistency, &'static str); 8] = [
        (CqlConsistency::One, "one"),
        (CqlConsistency::Two, "two"),
        (CqlConsistency::Three, "three"),
        (CqlConsistency::Quorum, "quorum"),
        (CqlConsistency::LocalQuorum, "local_quorum"),
        (CqlConsistency::EachQuorum, "each_quorum"),
        (CqlConsistency::All, "all"),
        (CqlConsistency::LocalOne, "local_one"),
    ];

    /// The name as written in a spec (`local_quorum`).
    pub fn as_str(self) -> &'static str {
        Self::NAMES
            .iter()
            .find(|(c, _)| *c == self)
            .map(|(_, n)| *n)
            .expect("every level has a name")
    }

    /// The driver's level.
    pub(crate) fn to_driver(self) -> scylla::statement::Consistency {
        use scylla::statement::Consistency as C;
        match self {
            CqlConsistency::One => C::One,
            CqlConsistency::Two => C::Two,
            CqlConsistency::Three => C::Three,
            CqlConsistency::Quorum => C::Quorum,
            CqlConsistency::LocalQuorum => C::LocalQuorum,
            CqlConsistency::EachQuorum => C::EachQuorum,
            CqlConsistency::All => C::All,
            CqlConsistency::LocalOne => C::LocalOne,
        }
    }
}

impl fmt::Display for CqlConsistency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for CqlConsistency {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let lc = s.to_ascii_lowercase().replace('-', "_");
        Self::NAMES
            .iter()
            .find(|(_, n)| *n == lc)
            .map(|(c, _)| *c)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::NAMES.iter().map(|(_, n)| *n).collect();
                format!("{s:?} is not a consistency level ({})", names.join(", "))
            })
    }
}

/// Where a region lives and how to reach it: everything in a `cql://` spec but its geometry.
#[derive(Clone, PartialEq, Eq)]
pub struct CqlTarget {
    /// Contact points, `host:port` (the driver discovers the rest of the cluster).
    pub nodes: Vec<String>,
    /// User name, when the cluster requires a password.
    pub user: Option<String>,
    /// Password; with a user and no password, [`PASSWORD_ENV`] is read when connecting.
    pub password: Option<String>,
    /// Keyspace (lowercase).
    pub keyspace: String,
    /// Table of chunks (lowercase); its region table is `<table>_regions`.
    pub table: String,
    /// Region name: many regions share one table.
    pub region: String,
    /// Consistency level of data requests.
    pub consistency: CqlConsistency,
    /// Create the keyspace, the tables and the region when missing.
    pub create: bool,
    /// Replication factor of a keyspace this store creates (SimpleStrategy).
    pub replication: u32,
    /// Connections per node, if set (the driver's default is one per node, or per shard on
    /// ScyllaDB).
    pub connections: Option<usize>,
    /// Deadline of each request, if set (the driver's default is 30 s).
    pub timeout: Option<Duration>,
}

impl fmt::Debug for CqlTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CqlTarget")
            .field("nodes", &self.nodes)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "<hidden>"))
            .field("keyspace", &self.keyspace)
            .field("table", &self.table)
            .field("region", &self.region)
            .field("consistency", &self.consistency)
            .field("create", &self.create)
            .field("replication", &self.replication)
            .field("connections", &self.connections)
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// A parsed `cql://` spec: the target and the geometry options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CqlSpec {
    /// Where the region lives.
    pub target: CqlTarget,
    /// Region size: needed to create a region, checked against an existing one.
    pub size: Option<u64>,
    /// Chunk size: used to create a region (default 64 KiB), checked against an existing one.
    pub chunk_size: Option<u32>,
    /// Refuse writes and trims.
    pub read_only: bool,
}

/// Why a `cql://` spec could not be understood: one sentence naming the part at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CqlSpecError(String);

impl CqlSpecError {
    fn new(msg: impl Into<String>) -> Self {
        CqlSpecError(msg.into())
    }
}

/// The options a `cql://` spec takes.
pub const OPTIONS: &str =
    "table, region, size, chunk, consistency, create, replication, connections, timeout, ro";

fn is_identifier(s: &str, max: usize) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic())
        && s.len() <= max
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn parse_bool(option: &str, value: &str) -> Result<bool, CqlSpecError> {
    farmap_core::query::parse_bool(value)
        .map_err(|why| CqlSpecError::new(format!("bad value for {option}: {why}")))
}

/// Decodes `%XX` escapes (user names and passwords may hold `@`, `:`, `/`...).
fn percent_decode(s: &str, what: &str) -> Result<String, CqlSpecError> {
    farmap_core::query::percent_decode(s).ok_or_else(|| {
        CqlSpecError::new(format!(
            "the {what} has a % not followed by two hex digits, or is not UTF-8 once decoded"
        ))
    })
}

fn percent_encode(s: &str) -> String {
    farmap_core::query::percent_encode(s, |b| b.is_ascii_alphanumeric() || b"-._~".contains(&b))
}

/// `host`, `host:port`, `[v6]` or `[v6]:port` → `host:port`.
fn parse_node(node: &str) -> Result<String, CqlSpecError> {
    let bad = || {
        CqlSpecError::new(format!(
            "{node:?} is not a node: write host:port (port {DEFAULT_PORT} when left out)"
        ))
    };
    let (host, port) = if let Some(rest) = node.strip_prefix('[') {
        let (h, after) = rest.split_once(']').ok_or_else(bad)?;
        match after {
            "" => (format!("[{h}]"), None),
            _ => (
                format!("[{h}]"),
                Some(after.strip_prefix(':').ok_or_else(bad)?),
            ),
        }
    } else {
        match node.split_once(':') {
            Some((h, p)) => (h.to_owned(), Some(p)),
            None => (node.to_owned(), None),
        }
    };
    let host_ok = !host.is_empty()
        && host != "[]"
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-._:[]".contains(c));
    if !host_ok {
        return Err(bad());
    }
    let port = match port {
        None => DEFAULT_PORT,
        Some(p) => p.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(bad)?,
    };
    Ok(format!("{host}:{port}"))
}

impl CqlSpec {
    /// Applies one `key=value` of the spec's query.
    fn set_option(&mut self, key: &str, value: &str) -> Result<(), CqlSpecError> {
        let t = &mut self.target;
        let bad = |reason: String| CqlSpecError::new(format!("bad value for {key}: {reason}"));
        match key {
            "table" => {
                let v = value.to_ascii_lowercase();
                if !is_identifier(&v, MAX_TABLE_LEN) {
                    return Err(bad(format!(
                        "{value:?} is not a name of 1 to {MAX_TABLE_LEN} letters, digits \
                         and _ starting with a letter"
                    )));
                }
                t.table = v;
            }
            "region" => {
                let ok = !value.is_empty()
                    && value.len() <= MAX_REGION_LEN
                    && value
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
                if !ok {
                    return Err(bad(format!(
                        "{value:?} is not a name of 1 to {MAX_REGION_LEN} letters, digits, \
                         -, _ and ."
                    )));
                }
                t.region = value.to_owned();
            }
            "size" => {
                let n = parse_size(value).map_err(|e| bad(e.to_string()))?;
                if n == 0 {
                    return Err(bad("a region cannot be empty".into()));
                }
                if self.size.is_some_and(|s| s != n) {
                    return Err(bad("two different sizes".into()));
                }
                self.size = Some(n);
            }
            "chunk" => {
                let n = parse_size(value).map_err(|e| bad(e.to_string()))?;
                let ok = n.is_power_of_two()
                    && (u64::from(farmap_core::MIN_CHUNK_SIZE)..=u64::from(MAX_CQL_CHUNK))
                        .contains(&n);
                if !ok {
                    return Err(bad(format!(
                        "{value:?} is not a power of two from 4KiB to 1MiB (a CQL row holds \
                         one chunk, and cells larger than 1 MiB hurt the server)"
                    )));
                }
                self.chunk_size = Some(n as u32);
            }
            "consistency" => t.consistency = value.parse().map_err(bad)?,
            "create" => t.create = parse_bool("create", value)?,
            "ro" => self.read_only = parse_bool("ro", value)?,
            "replication" => {
                t.replication = parse_count(value, 1..=100u32).map_err(bad)?;
            }
            "connections" => {
                t.connections = Some(parse_count(value, 1..=64usize).map_err(bad)?);
            }
            "timeout" => {
                t.timeout = Some(parse_timeout(value).map_err(bad)?);
            }
            _ => {
                return Err(CqlSpecError::new(format!(
                    "unknown option {key:?} (a cql spec takes: {OPTIONS})"
                )))
            }
        }
        Ok(())
    }
}

/// `user[:password]` before the `@` (both percent-decoded; the user name not empty).
fn parse_userinfo(u: &str) -> Result<(Option<String>, Option<String>), CqlSpecError> {
    let (name, pass) = match u.split_once(':') {
        Some((n, p)) => (n, Some(percent_decode(p, "password")?)),
        None => (u, None),
    };
    let name = percent_decode(name, "user name")?;
    if name.is_empty() {
        return Err(CqlSpecError::new("an empty user name before @"));
    }
    Ok((Some(name), pass))
}

impl FromStr for CqlSpec {
    type Err = CqlSpecError;

    fn from_str(spec: &str) -> Result<Self, CqlSpecError> {
        let rest = spec
            .split_once(':')
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("cql"))
            .map(|(_, rest)| rest)
            .ok_or_else(|| CqlSpecError::new("a CQL spec starts with cql://"))?;
        let hint = "write cql://host:port/keyspace?table=...";
        let rest = rest
            .strip_prefix("//")
            .ok_or_else(|| CqlSpecError::new(format!("no // after cql: ({hint})")))?;
        let (body, query) = match rest.split_once('?') {
            Some((b, q)) => (b, q),
            None => (rest, ""),
        };
        let (authority, keyspace) = body
            .split_once('/')
            .ok_or_else(|| CqlSpecError::new(format!("no keyspace ({hint})")))?;
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        let (user, password) = match userinfo {
            None => (None, None),
            Some(u) => parse_userinfo(u)?,
        };
        if hosts.is_empty() {
            return Err(CqlSpecError::new(format!("no node ({hint})")));
        }
        let nodes = hosts
            .split(',')
            .map(parse_node)
            .collect::<Result<Vec<_>, _>>()?;
        let keyspace = keyspace.to_ascii_lowercase();
        if !is_identifier(&keyspace, MAX_KEYSPACE_LEN) {
            return Err(CqlSpecError::new(format!(
                "keyspace {keyspace:?} is not a name of 1 to {MAX_KEYSPACE_LEN} letters, digits \
                 and _ starting with a letter"
            )));
        }
        let mut out = CqlSpec {
            target: CqlTarget {
                nodes,
                user,
                password,
                keyspace,
                table: DEFAULT_TABLE.into(),
                region: DEFAULT_REGION.into(),
                consistency: CqlConsistency::default(),
                create: false,
                replication: 1,
                connections: None,
                timeout: None,
            },
            size: None,
            chunk_size: None,
            read_only: false,
        };
        for (key, value) in farmap_core::query::pairs(query) {
            out.set_option(key, value)?;
        }
        if let Some(size) = out.size {
            let chunk = u64::from(out.chunk_size.unwrap_or(farmap_core::DEFAULT_CHUNK_SIZE));
            Geometry::new_bounded(size, chunk)
                .map_err(|e| CqlSpecError::new(format!("bad value for size: {e}")))?;
        }
        Ok(out)
    }
}

impl CqlTarget {
    /// `cql://[user[:password]@]nodes/keyspace`, the part before `?`, with the password
    /// (for a spec that must work again: keep it out of logs; see [`shown`](Self::shown)).
    pub fn base(&self) -> String {
        self.base_with(self.password.as_deref().map(percent_encode))
    }

    /// The part before `?` as shown to people: a password as `***` (like a Redis spec's).
    pub fn shown(&self) -> String {
        self.base_with(self.password.as_ref().map(|_| "***".to_owned()))
    }

    fn base_with(&self, password: Option<String>) -> String {
        let mut s = String::from("cql://");
        if let Some(user) = &self.user {
            s.push_str(&percent_encode(user));
            if let Some(p) = password {
                s.push(':');
                s.push_str(&p);
            }
            s.push('@');
        }
        s.push_str(&self.nodes.join(","));
        s.push('/');
        s.push_str(&self.keyspace);
        s
    }

    /// The same, with the password left out (for logs and errors).
    pub fn redacted(&self) -> String {
        CqlTarget {
            password: None,
            ..self.clone()
        }
        .base()
    }

    /// The options of the canonical form, `key=value` (those at their default left out).
    pub fn options(&self) -> Vec<String> {
        let mut opts = vec![
            format!("table={}", self.table),
            format!("region={}", self.region),
        ];
        if self.consistency != CqlConsistency::default() {
            opts.push(format!("consistency={}", self.consistency));
        }
        if self.create {
            opts.push("create=true".into());
        }
        if self.replication != 1 {
            opts.push(format!("replication={}", self.replication));
        }
        if let Some(n) = self.connections {
            opts.push(format!("connections={n}"));
        }
        if let Some(t) = self.timeout {
            opts.push(format!("timeout={}", format_duration(t)));
        }
        opts
    }

    /// `keyspace.table`.
    pub fn table_name(&self) -> String {
        format!("{}.{}", self.keyspace, self.table)
    }

    /// `keyspace.table_regions`, where each region's geometry is kept.
    pub fn regions_table_name(&self) -> String {
        format!("{}.{}_regions", self.keyspace, self.table)
    }

    /// `keyspace.table_objects`, where [`CqlObjects`](crate::CqlObjects) keeps its objects.
    pub fn objects_table_name(&self) -> String {
        format!("{}.{}_objects", self.keyspace, self.table)
    }
}

impl fmt::Display for CqlSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut opts = self.target.options();
        if let Some(s) = self.size {
            opts.push(format!("size={}", format_size(s)));
        }
        if let Some(c) = self.chunk_size {
            opts.push(format!("chunk={}", format_size(u64::from(c))));
        }
        if self.read_only {
            opts.push("ro".into());
        }
        // The password is shown as `***`: a spec's text ends up in logs and messages.
        write!(f, "{}?{}", self.target.shown(), opts.join("&"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<CqlSpec, CqlSpecError> {
        s.parse()
    }

    #[test]
    fn full_spec() {
        let s = parse(
            "cql://alice:p%40ss@10.0.0.1:9043,db2,[::1]:7/Farm?table=Chunks&region=vm-1.a\
             &size=1GiB&chunk=1MiB&consistency=QUORUM&create=true&replication=3\
             &connections=4&timeout=5s&ro",
        )
        .unwrap();
        let t = &s.target;
        assert_eq!(t.nodes, ["10.0.0.1:9043", "db2:9042", "[::1]:7"]);
        assert_eq!(t.user.as_deref(), Some("alice"));
        assert_eq!(t.password.as_deref(), Some("p@ss"));
        assert_eq!(t.keyspace, "farm");
        assert_eq!(t.table, "chunks");
        assert_eq!(t.region, "vm-1.a");
        assert_eq!(t.consistency, CqlConsistency::Quorum);
        assert!(t.create);
        assert_eq!(t.replication, 3);
        assert_eq!(t.connections, Some(4));
        assert_eq!(t.timeout, Some(Duration::from_secs(5)));
        assert_eq!(
            (s.size, s.chunk_size, s.read_only),
            (Some(1 << 30), Some(1 << 20), true)
        );
        let shown = s.to_string();
        assert!(
            shown.starts_with("cql://alice:***@10.0.0.1:9043,") && !shown.contains("p%40ss"),
            "Display hides the password: {shown}"
        );
        // Apart from the password, the displayed spec parses back to the same one.
        let mut back = parse(&shown).unwrap();
        assert_eq!(back.target.password.as_deref(), Some("***"));
        back.target.password = t.password.clone();
        assert_eq!(back, s, "{shown}");
        assert!(
            !format!("{s:?}").contains("p@ss"),
            "Debug hides the password"
        );
        assert_eq!(
            t.redacted(),
            "cql://alice@10.0.0.1:9043,db2:9042,[::1]:7/farm"
        );
    }

    #[test]
    fn defaults() {
        let s = parse("cql://127.0.0.1/ks").unwrap();
        assert_eq!(s.target.nodes, ["127.0.0.1:9042"]);
        assert_eq!(s.target.table, DEFAULT_TABLE);
        assert_eq!(s.target.region, DEFAULT_REGION);
        assert_eq!(s.target.consistency, CqlConsistency::LocalQuorum);
        assert!(!s.target.create);
        assert_eq!(s.target.replication, 1);
        assert_eq!(
            s.to_string(),
            "cql://127.0.0.1:9042/ks?table=farmap_chunks&region=default"
        );
    }

    #[test]
    fn bad_specs_name_the_problem() {
        for (spec, want) in [
            ("cql:127.0.0.1/ks", "no // after cql:"),
            ("cql://127.0.0.1", "no keyspace"),
            ("cql:///ks", "no node"),
            ("cql://h:0/ks", "is not a node"),
            ("cql://h:99999/ks", "is not a node"),
            ("cql://h/1ks", "keyspace \"1ks\""),
            ("cql://h/k-s", "keyspace"),
            ("cql://h/ks?table=a.b", "bad value for table"),
            ("cql://h/ks?region=a/b", "bad value for region"),
            ("cql://h/ks?chunk=2MiB", "from 4KiB to 1MiB"),
            ("cql://h/ks?chunk=3KiB", "from 4KiB to 1MiB"),
            ("cql://h/ks?consistency=any", "not a consistency level"),
            ("cql://h/ks?consistency=serial", "not a consistency level"),
            ("cql://h/ks?create=maybe", "not true or false"),
            ("cql://h/ks?replication=0", "bad value for replication"),
            ("cql://h/ks?connections=100", "bad value for connections"),
            ("cql://h/ks?timeout=5", "bad value for timeout"),
            ("cql://h/ks?size=0", "cannot be empty"),
            ("cql://h/ks?size=1PiB&chunk=4KiB", "bad value for size"),
            ("cql://h/ks?bogus=1", "unknown option \"bogus\""),
            ("cql://:pw@h/ks", "empty user name"),
            ("cql://u:%zz@h/ks", "two hex digits"),
        ] {
            let err = parse(spec).expect_err(spec).to_string();
            assert!(
                err.contains(want),
                "{spec}: {err:?} should contain {want:?}"
            );
        }
    }

    proptest::proptest! {
        /// What the `store_spec` fuzz target checks, on spec-shaped strings: parsing never
        /// panics, and whatever parses prints to a form that parses back to the same spec.
        #[test]
        fn any_accepted_spec_reads_back(
            text in "cql://([a-zA-Z0-9%:@\\[\\]._-]{0,12}(,[a-z0-9:\\[\\]]{0,6})?)/[a-zA-Z0-9_]{0,6}\\?\
                     ((table|region|size|chunk|consistency|create|replication|connections|timeout|ro)\
                     (=[a-zA-Z0-9._%-]{0,6})?&?){0,5}"
        ) {
            if let Ok(spec) = parse(&text) {
                let shown = spec.to_string();
                proptest::prop_assert_eq!(parse(&shown), Ok(as_shown(spec)), "{} -> {}", text, shown);
            }
        }
    }

    /// `s` as its displayed text parses back: a password reads `***`.
    fn as_shown(mut s: CqlSpec) -> CqlSpec {
        if s.target.password.is_some() {
            s.target.password = Some("***".into());
        }
        s
    }

    #[test]
    fn canonical_forms_read_back() {
        for text in [
            "cql://h/ks",
            "cql://u@h:1/ks?size=3MiB&chunk=4KiB",
            "cql://u:a%2Fb%3Ac@h:1,h2:2/ks?consistency=one&timeout=1500ms&ro=false",
            "CQL://H/KS?table=T&region=R&create=0",
        ] {
            let s = parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(
                parse(&s.to_string()),
                Ok(as_shown(s.clone())),
                "{text} -> {s}"
            );
        }
    }
}
