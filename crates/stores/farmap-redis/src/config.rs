//! What a Redis store spec says: the server (or cluster), credentials, key prefix, pool size,
//! timeout and flush policy. Parsed from the parts of a `redis://`, `rediss://` or
//! `redis+cluster://` spec; the region's size and chunk size stay with the caller (farmap's
//! `StoreSpec`), which hands them to [`RedisStore::open`](crate::RedisStore::open).

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use farmap_core::option::{parse_count, parse_timeout};

/// The options a `redis://` or `redis+cluster://` spec takes besides `size` and `chunk`.
pub const OPTIONS: &[&str] = &["prefix", "connections", "timeout", "flush", "replicas"];
/// The options a `rediss://` spec takes besides `size` and `chunk`.
pub const TLS_OPTIONS: &[&str] = &[
    "prefix",
    "connections",
    "timeout",
    "flush",
    "replicas",
    "ca",
];

/// The prefix used when a spec gives none.
pub const DEFAULT_PREFIX: &str = "farmap";
/// Connections per pool when a spec gives none. Each is multiplexed: concurrent requests on
/// one connection are pipelined, so a few connections keep the server busy.
pub const DEFAULT_CONNECTIONS: usize = 4;
/// Deadline of each request (and of connecting) when a spec gives none.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// What `flush` promises (option `flush=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FlushPolicy {
    /// `flush=none` (the default): `flush` returns at once. A write is complete when the
    /// server acknowledged it, i.e. it is in the server's memory; what survives a crash of
    /// the server depends on its own persistence settings. The store does not report
    /// [`Caps::FLUSH`](farmap_core::Caps::FLUSH).
    #[default]
    None,
    /// `flush=wait` (with `replicas=N`, default 1): `flush` sends `WAIT N timeout` on every
    /// connection of the pool (a cluster client sends it to every primary) and succeeds only
    /// when at least N replicas acknowledged every write that completed before the flush. It
    /// promises that those writes survive the loss of the primary (not of the whole set).
    Wait {
        /// Replicas that must acknowledge.
        replicas: u32,
    },
    /// `flush=fsync`: at open, the server (every primary of a cluster) must run with
    /// `appendonly yes` and `appendfsync always`, checked with `CONFIG GET`; then the server
    /// writes and fsyncs its append-only file before it acknowledges each write, so every
    /// completed write is already on the server's disk and `flush` has nothing left to do.
    /// Opening fails when the server is configured otherwise (or refuses `CONFIG`).
    Fsync,
}

/// Where the store lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// One server (`redis://` or `rediss://`).
    Single {
        /// `host:port`.
        addr: String,
        /// The database number (`/db`, default 0).
        db: u32,
        /// TLS (`rediss://`): the PEM file of the CA that signed the server's certificate,
        /// or `None` for the system's roots.
        tls: Option<Option<PathBuf>>,
    },
    /// A Redis Cluster (`redis+cluster://`): seed nodes, `host:port` each.
    Cluster {
        /// The seed nodes.
        nodes: Vec<String>,
    },
}

/// A parsed Redis store spec (all but size and chunk size).
#[derive(Clone, PartialEq, Eq)]
pub struct RedisConfig {
    /// The server or cluster.
    pub target: Target,
    /// ACL user name, if any.
    pub user: Option<String>,
    /// Password, if any.
    pub password: Option<String>,
    /// Key prefix: chunk `i` is key `<prefix>:<i>`, the geometry record `<prefix>:meta`.
    pub prefix: String,
    /// Connections in the pool.
    pub connections: Option<usize>,
    /// Deadline of each request and of connecting.
    pub timeout: Option<Duration>,
    /// What `flush` promises.
    pub flush: FlushPolicy,
}

impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConfig")
            .field("target", &self.target)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("prefix", &self.prefix)
            .field("connections", &self.connections)
            .field("timeout", &self.timeout)
            .field("flush", &self.flush)
            .finish()
    }
}

/// Why a Redis spec could not be understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RedisSpecError {
    /// The part after the scheme is not `//[user:pass@]host:port[/db]`.
    #[error("{what}")]
    BadAddress {
        /// What is wrong.
        what: String,
        /// How to write it.
        hint: &'static str,
    },
    /// An option with a value it cannot take.
    #[error("bad value for {option}: {reason}")]
    BadOption {
        /// The option.
        option: &'static str,
        /// What is wrong.
        reason: String,
    },
}

fn hint(scheme: &str) -> &'static str {
    match scheme {
        "rediss" => "rediss://[USER:PASSWORD@]HOST:PORT[/DB]?size=SIZE",
        "redis+cluster" => "redis+cluster://[USER:PASSWORD@]HOST:PORT,HOST:PORT/?size=SIZE",
        _ => "redis://[USER:PASSWORD@]HOST:PORT[/DB]?size=SIZE",
    }
}

fn check_host_port(hp: &str) -> bool {
    match hp.rsplit_once(':') {
        Some((host, port)) => !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0),
        None => false,
    }
}

/// `[user]:password` or `password` before the `@` (empty parts are absent).
fn parse_credentials(c: &str) -> (Option<String>, Option<String>) {
    let (u, p) = match c.split_once(':') {
        Some((u, p)) => (u, Some(p)),
        None => ("", Some(c)),
    };
    let user = (!u.is_empty()).then(|| u.to_owned());
    let password = p.filter(|p| !p.is_empty()).map(str::to_owned);
    (user, password)
}

impl RedisConfig {
    /// Parses `scheme:body` (`body` is what follows the scheme's colon, before `?`) and the
    /// options other than `size` and `chunk` (already checked against [`OPTIONS`] or
    /// [`TLS_OPTIONS`] by the caller).
    pub fn parse(
        scheme: &str,
        body: &str,
        options: &[(&str, &str)],
    ) -> Result<RedisConfig, RedisSpecError> {
        let hint = hint(scheme);
        let bad_addr = |what: String| RedisSpecError::BadAddress { what, hint };
        let rest = body
            .strip_prefix("//")
            .ok_or_else(|| bad_addr("names no server".into()))?;
        let (creds, rest) = match rest.rsplit_once('@') {
            Some((c, r)) => (Some(c), r),
            None => (None, rest),
        };
        let (user, password) = creds.map_or((None, None), parse_credentials);
        let (hosts, path) = match rest.split_once('/') {
            Some((h, p)) => (h, p),
            None => (rest, ""),
        };
        let target = if scheme == "redis+cluster" {
            if !path.is_empty() {
                return Err(bad_addr(format!(
                    "a cluster has no databases, but {path:?} follows the nodes"
                )));
            }
            let nodes: Vec<String> = hosts.split(',').map(str::to_owned).collect();
            if nodes.iter().any(|n| !check_host_port(n)) {
                return Err(bad_addr(format!(
                    "{hosts:?} is not a list of HOST:PORT separated by commas"
                )));
            }
            Target::Cluster { nodes }
        } else {
            if !check_host_port(hosts) {
                return Err(bad_addr("names no server".into()));
            }
            let db = if path.is_empty() {
                0
            } else {
                path.parse::<u32>()
                    .map_err(|_| bad_addr(format!("database {path:?} is not a whole number")))?
            };
            Target::Single {
                addr: hosts.to_owned(),
                db,
                tls: (scheme == "rediss").then_some(None),
            }
        };
        let mut config = RedisConfig {
            target,
            user,
            password,
            prefix: DEFAULT_PREFIX.to_owned(),
            connections: None,
            timeout: None,
            flush: FlushPolicy::None,
        };
        config.set_options(options)?;
        Ok(config)
    }

    /// Applies the options other than `size` and `chunk`.
    fn set_options(&mut self, options: &[(&str, &str)]) -> Result<(), RedisSpecError> {
        let mut flush = None;
        let mut replicas = None;
        for &(key, value) in options {
            let bad =
                |option: &'static str, reason: String| RedisSpecError::BadOption { option, reason };
            match key {
                "prefix" => {
                    if value.is_empty()
                        || value
                            .chars()
                            .any(|c| c.is_whitespace() || c.is_control() || c == '{' || c == '}')
                    {
                        return Err(bad(
                        "prefix",
                        format!("{value:?} must be non-empty, without spaces or braces (a hash tag would put every chunk in one cluster slot)"),
                    ));
                    }
                    self.prefix = value.to_owned();
                }
                "connections" => {
                    let n = parse_count(value, 1..=256usize).map_err(|w| bad("connections", w))?;
                    self.connections = Some(n);
                }
                "timeout" => {
                    self.timeout = Some(parse_timeout(value).map_err(|w| bad("timeout", w))?);
                }
                "flush" => {
                    flush = Some(match value {
                        "none" => 0,
                        "wait" => 1,
                        "fsync" => 2,
                        _ => {
                            return Err(bad(
                                "flush",
                                format!("{value:?} is not none, wait or fsync"),
                            ))
                        }
                    })
                }
                "replicas" => {
                    replicas =
                        Some(parse_count(value, 1..=100u32).map_err(|w| bad("replicas", w))?);
                }
                "ca" => {
                    if value.is_empty() {
                        return Err(bad("ca", "a path is needed".into()));
                    }
                    match &mut self.target {
                        Target::Single { tls: Some(ca), .. } => *ca = Some(PathBuf::from(value)),
                        _ => return Err(bad("ca", "only rediss:// (TLS) takes a CA".into())),
                    }
                }
                other => {
                    return Err(bad(
                        "option",
                        format!("{other:?} is not an option of a Redis store"),
                    ))
                }
            }
        }
        self.flush = match (flush, replicas) {
            (Some(1), r) => FlushPolicy::Wait {
                replicas: r.unwrap_or(1),
            },
            (_, Some(_)) => {
                return Err(RedisSpecError::BadOption {
                    option: "replicas",
                    reason: "replicas= goes with flush=wait".into(),
                })
            }
            (Some(2), None) => FlushPolicy::Fsync,
            _ => FlushPolicy::None,
        };
        Ok(())
    }

    /// The spec's text before `?` (the password shown as `***`) and its options, for
    /// displaying the spec.
    pub fn display_parts(&self) -> (String, Vec<String>) {
        self.parts(false)
    }

    /// [`display_parts`](Self::display_parts) with the password itself, as it was given: a
    /// spec that must open the store again (a region handed to another process). Keep it out
    /// of logs.
    pub fn display_parts_with_password(&self) -> (String, Vec<String>) {
        self.parts(true)
    }

    fn parts(&self, password: bool) -> (String, Vec<String>) {
        let creds = match (&self.user, &self.password) {
            (None, None) => String::new(),
            // `user@` alone would read back as a password (`PASSWORD@` is the old form).
            (Some(u), None) => format!("{u}:@"),
            (u, Some(p)) => format!(
                "{}:{}@",
                u.as_deref().unwrap_or(""),
                if password { p.as_str() } else { "***" }
            ),
        };
        let mut opts = Vec::new();
        let head = match &self.target {
            Target::Single { addr, db, tls } => {
                let scheme = if tls.is_some() { "rediss" } else { "redis" };
                if let Some(Some(ca)) = tls {
                    opts.push(format!("ca={}", ca.display()));
                }
                format!("{scheme}://{creds}{addr}/{db}")
            }
            Target::Cluster { nodes } => format!("redis+cluster://{creds}{}/", nodes.join(",")),
        };
        if self.prefix != DEFAULT_PREFIX {
            opts.push(format!("prefix={}", self.prefix));
        }
        if let Some(n) = self.connections {
            opts.push(format!("connections={n}"));
        }
        if let Some(t) = self.timeout {
            opts.push(format!("timeout={}", farmap_core::format_duration(t)));
        }
        match self.flush {
            FlushPolicy::None => {}
            FlushPolicy::Wait { replicas } => {
                opts.push("flush=wait".into());
                if replicas != 1 {
                    opts.push(format!("replicas={replicas}"));
                }
            }
            FlushPolicy::Fsync => opts.push("flush=fsync".into()),
        }
        (head, opts)
    }

    /// A short name of the server for messages: `redis 127.0.0.1:6379/0` or
    /// `redis cluster 127.0.0.1:7000,...`.
    pub fn server_name(&self) -> String {
        match &self.target {
            Target::Single { addr, db, tls } => {
                let s = if tls.is_some() { "rediss" } else { "redis" };
                format!("{s} {addr}/{db}")
            }
            Target::Cluster { nodes } => format!("redis cluster {}", nodes.join(",")),
        }
    }

    /// Connections in the pool.
    pub fn connections_or_default(&self) -> usize {
        self.connections.unwrap_or(DEFAULT_CONNECTIONS)
    }

    /// Deadline of each request.
    pub fn timeout_or_default(&self) -> Duration {
        self.timeout.unwrap_or(DEFAULT_TIMEOUT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(scheme: &str, body: &str, opts: &[(&str, &str)]) -> RedisConfig {
        RedisConfig::parse(scheme, body, opts).unwrap_or_else(|e| panic!("{body}: {e}"))
    }

    #[test]
    fn single_servers() {
        let c = parse("redis", "//127.0.0.1:6379", &[]);
        assert_eq!(
            c.target,
            Target::Single {
                addr: "127.0.0.1:6379".into(),
                db: 0,
                tls: None
            }
        );
        assert_eq!(c.prefix, "farmap");
        assert_eq!(c.flush, FlushPolicy::None);
        let c = parse(
            "redis",
            "//bob:s3cr:et@h:1/5",
            &[("prefix", "vm:7"), ("flush", "wait"), ("replicas", "2")],
        );
        assert_eq!(c.user.as_deref(), Some("bob"));
        assert_eq!(c.password.as_deref(), Some("s3cr:et"));
        assert!(matches!(c.target, Target::Single { db: 5, .. }));
        assert_eq!(c.flush, FlushPolicy::Wait { replicas: 2 });
        let (head, opts) = c.display_parts();
        assert_eq!(head, "redis://bob:***@h:1/5");
        assert_eq!(opts, ["prefix=vm:7", "flush=wait", "replicas=2"]);
        assert!(
            !format!("{c:?}").contains("s3cr"),
            "Debug hides the password"
        );
        let c = parse("redis", "//:pw@h:1", &[]);
        assert_eq!((c.user, c.password.as_deref()), (None, Some("pw")));
        // A user without a password prints as `user:@`: `user@` would read back as a
        // password (found by the store_spec fuzz target in `rediss://n:@bd:00001`).
        for body in ["//n:@h:1", "//n:@h:1/0"] {
            let c = parse("rediss", body, &[]);
            assert_eq!(
                (c.user.as_deref(), c.password.as_deref()),
                (Some("n"), None)
            );
            let (head, _) = c.display_parts_with_password();
            assert_eq!(head, "rediss://n:@h:1/0");
            let again = parse("rediss", head.strip_prefix("rediss:").unwrap(), &[]);
            assert_eq!((again.user, again.password), (c.user, c.password));
        }
        let c = parse("rediss", "//h:1/0", &[("ca", "ca.pem"), ("flush", "fsync")]);
        assert_eq!(
            c.target,
            Target::Single {
                addr: "h:1".into(),
                db: 0,
                tls: Some(Some("ca.pem".into()))
            }
        );
        assert_eq!(c.flush, FlushPolicy::Fsync);
    }

    #[test]
    fn clusters() {
        let c = parse("redis+cluster", "//a:1,b:2,c:3/", &[("connections", "2")]);
        assert_eq!(
            c.target,
            Target::Cluster {
                nodes: vec!["a:1".into(), "b:2".into(), "c:3".into()]
            }
        );
        assert_eq!(c.display_parts().0, "redis+cluster://a:1,b:2,c:3/");
        assert_eq!(
            parse("redis+cluster", "//a:1", &[]).target,
            Target::Cluster {
                nodes: vec!["a:1".into()]
            }
        );
    }

    #[test]
    fn bad_specs_name_the_problem() {
        for (scheme, body, opts, want) in [
            ("redis", "h:1", &[][..], "names no server"),
            ("redis", "//h", &[], "names no server"),
            ("redis", "//h:0", &[], "names no server"),
            ("redis", "//h:1/x", &[], "database \"x\""),
            (
                "redis+cluster",
                "//a:1,b",
                &[],
                "HOST:PORT separated by commas",
            ),
            ("redis+cluster", "//a:1/3", &[], "no databases"),
            ("redis", "//h:1", &[("prefix", "{x}")], "braces"),
            ("redis", "//h:1", &[("prefix", "")], "non-empty"),
            ("redis", "//h:1", &[("connections", "0")], "from 1 to 256"),
            ("redis", "//h:1", &[("timeout", "5")], "unit"),
            (
                "redis",
                "//h:1",
                &[("flush", "always")],
                "none, wait or fsync",
            ),
            (
                "redis",
                "//h:1",
                &[("replicas", "2")],
                "goes with flush=wait",
            ),
            ("redis", "//h:1", &[("ca", "x.pem")], "only rediss://"),
        ] {
            let err = RedisConfig::parse(scheme, body, opts)
                .expect_err(body)
                .to_string();
            assert!(
                err.contains(want),
                "{body} {opts:?}: {err:?} lacks {want:?}"
            );
        }
    }
}
