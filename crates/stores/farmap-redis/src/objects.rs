//! [`RedisObjects`]: named objects in Redis, for the versioned layout (content-addressed
//! chunks, manifests, tags), with a sorted set per folder so that a folder lists without
//! scanning the key space.

use std::fmt;

use bytes::Bytes;
use farmap_core::{check_key, BoxFuture, ErrorKind, Objects, StoreError, StoreResult};
use redis::{Cmd, FromRedisValue, Value};

use crate::config::RedisConfig;
use crate::conn::{Conn, RunError};

/// The largest object created or read: a version manifest of 6.7 million chunks (a 400 GiB
/// region in 64 KiB chunks), as for S3. A larger value is refused by the server-side read
/// script before any of it is sent.
pub const MAX_OBJECT_LEN: usize = 256 << 20;

/// Names asked for per reply when a folder is listed.
const LIST_PAGE: usize = 1000;

/// `KEYS[1]` the object, `KEYS[2..]` folder indexes; `ARGV[1]` the bytes, `ARGV[i]` the name
/// that goes into `KEYS[i]`. Sets the object only if it is absent, and only then indexes it.
const CREATE: &str = r"
if not redis.call('SET', KEYS[1], ARGV[1], 'NX') then return 0 end
for i = 2, #KEYS do redis.call('ZADD', KEYS[i], 0, ARGV[i]) end
return 1
";

/// `KEYS[1]` the object, `ARGV[1]` the longest value sent. Nil when absent, the length when
/// longer than `ARGV[1]` (nothing of it is sent), else the value.
const GET: &str = r"
local n = redis.call('STRLEN', KEYS[1])
if n == 0 and redis.call('EXISTS', KEYS[1]) == 0 then return false end
if n > tonumber(ARGV[1]) then return n end
return redis.call('GET', KEYS[1])
";

/// `KEYS[1]` the object, `KEYS[2]` (if any) its folder's index, `ARGV[1]` its name there.
const DELETE: &str = r"
redis.call('UNLINK', KEYS[1])
if KEYS[2] then redis.call('ZREM', KEYS[2], ARGV[1]) end
return 0
";

/// A Lua script and its SHA-1 (for `EVALSHA`).
struct Lua {
    code: &'static str,
    sha: String,
}

impl Lua {
    fn new(code: &'static str) -> Lua {
        // SHA-1 is what Redis names scripts by; nothing here trusts it.
        let d = ring::digest::digest(&ring::digest::SHA1_FOR_LEGACY_USE_ONLY, code.as_bytes());
        let sha = d.as_ref().iter().map(|b| format!("{b:02x}")).collect();
        Lua { code, sha }
    }
}

/// Objects in Redis (one server or a Redis Cluster, the same specs and options as
/// [`RedisStore`](crate::RedisStore)): object `KEY` is a string value, and each folder has
/// an index, a sorted set of the names directly under it (all with score 0, so they sort
/// bytewise).
///
/// ```text
///   <prefix>:obj:{chunks/ab}/HASH      the bytes of the object chunks/ab/HASH
///   <prefix>:dir:{chunks/ab}           index of chunks/ab: HASH, ...
///   <prefix>:dir:{chunks}              index of chunks: ab/, cd/, ... (a trailing / marks a folder)
///   <prefix>:obj:NAME                  an object at the top (no folder, no index: the top is
///                                      never listed, as check_key refuses an empty folder)
/// ```
///
/// # Atomicity and clusters
/// - [`create`](Objects::create) is one Lua script: `SET key data NX` and, only if it set,
///   `ZADD` of the name into its folder's index, so the index of a folder never misses an
///   object in it, and of racing creators exactly one gets `true`.
/// - A script may only touch keys of one cluster slot. The folder is the hash tag
///   (`{chunks/ab}`): an object and its folder's index share a slot, on one server or in a
///   cluster alike. A folder is therefore the unit of placement in a cluster (the versioned
///   layout's chunks spread over 256 folders `chunks/00`..`chunks/ff`; one region's
///   versions sit on one node). The prefix has no braces (the spec refuses them), so the
///   folder is the key's hash tag.
/// - Entries for enclosing folders (`ab/` in the index of `chunks`) are in other slots. On
///   one server they are added in the same script. In a cluster they are added first, one
///   `ZADD` each, and the script runs only after they are acknowledged: a crash in between
///   leaves an empty folder listed, never an object whose folder is missing from its
///   parent's list.
/// - [`delete`](Objects::delete) is a script too: the object goes, and its name leaves its
///   folder's index. Folder entries stay in their parents' indexes (a listed folder may be
///   empty), as farmap-store's `DirObjects` keeps empty directories. A name that is both an
///   object and a folder lists once, and stays listed as a folder when the object goes.
/// - A [`get`](Objects::get) sees an object absent or whole (Redis runs each script and
///   command alone); any number of tasks share the pool of multiplexed connections.
///
/// # Durability
/// `create` returns once the object is durable as far as the spec's `flush=` promises (see
/// [`FlushPolicy`](crate::FlushPolicy)): with `flush=fsync` the server wrote and fsynced its
/// append-only file before answering; with `flush=wait` `create` also waits (`WAIT`, on the
/// connection that ran the script) until the replicas asked for have the object; with
/// `flush=none` (the default) the object is in the server's memory and survives a crash
/// only as far as the server's own persistence settings go. `delete` does not wait.
///
/// # Limits
/// Keys are checked with [`check_key`]. An object is at most [`MAX_OBJECT_LEN`] bytes: a
/// larger `create` is refused, and a larger value found is refused as corrupt by the read
/// script before any of it is sent. A folder is listed in pages of names
/// (`ZRANGEBYLEX ... LIMIT`), names that are not valid keys skipped.
pub struct RedisObjects {
    conn: Conn,
    prefix: String,
    location: String,
    create: Lua,
    get: Lua,
    delete: Lua,
}

impl fmt::Debug for RedisObjects {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisObjects")
            .field("server", &self.conn.server)
            .field("prefix", &self.prefix)
            .field("flush", &self.conn.flush)
            .finish_non_exhaustive()
    }
}

/// `(folder, name)` of a key: `("chunks/ab", "HASH")`, or `(None, "NAME")` at the top.
fn split(key: &str) -> (Option<&str>, &str) {
    match key.rsplit_once('/') {
        Some((folder, name)) => (Some(folder), name),
        None => (None, key),
    }
}

/// The Redis key of object `key`: its folder is the hash tag.
fn object_key(prefix: &str, key: &str) -> String {
    match split(key) {
        (Some(folder), name) => format!("{prefix}:obj:{{{folder}}}/{name}"),
        (None, name) => format!("{prefix}:obj:{name}"),
    }
}

/// The Redis key of the index of folder `dir`, in the slot of the objects in it.
fn index_key(prefix: &str, dir: &str) -> String {
    format!("{prefix}:dir:{{{dir}}}")
}

/// The entries naming the folders that enclose `folder`, as `(index, entry)`: for `a/b/c`,
/// `c/` in the index of `a/b` and `b/` in the index of `a`.
fn parent_entries(prefix: &str, folder: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut f = folder;
    while let Some((parent, last)) = f.rsplit_once('/') {
        out.push((index_key(prefix, parent), format!("{last}/")));
        f = parent;
    }
    out
}

impl RedisObjects {
    /// Connects to the server or cluster `config` names (as [`RedisStore`](crate::RedisStore)
    /// does, `flush=fsync` checked at once); the objects are under `config.prefix`.
    pub async fn open(config: &RedisConfig) -> StoreResult<RedisObjects> {
        let conn = Conn::open(config).await?;
        let (head, opts) = config.display_parts();
        let location = if opts.is_empty() {
            head
        } else {
            format!("{head}?{}", opts.join("&"))
        };
        tracing::debug!(server = %conn.server, prefix = %config.prefix, "opened redis objects");
        Ok(RedisObjects {
            conn,
            prefix: config.prefix.clone(),
            location,
            create: Lua::new(CREATE),
            get: Lua::new(GET),
            delete: Lua::new(DELETE),
        })
    }

    /// The Redis key holding object `key` (a valid key, see [`check_key`]).
    pub fn object_key(&self, key: &str) -> String {
        object_key(&self.prefix, key)
    }

    /// The Redis key of the index of folder `dir` (a valid key).
    pub fn index_key(&self, dir: &str) -> String {
        index_key(&self.prefix, dir)
    }

    /// The server's name as used in messages (`redis 127.0.0.1:6379/0`).
    pub fn server(&self) -> &str {
        &self.conn.server
    }

    /// Runs `script` with `keys` and `args` on connection `i`: `EVALSHA`, then `EVAL` when
    /// the server does not know the script (the first time, or after a restart).
    async fn eval<T: FromRedisValue>(
        &self,
        i: usize,
        script: &Lua,
        keys: &[String],
        args: &[&[u8]],
    ) -> Result<T, RunError> {
        let cmd = |verb: &str, body: &str| -> Cmd {
            let mut c = redis::cmd(verb);
            c.arg(body).arg(keys.len()).arg(keys);
            for a in args {
                c.arg(*a);
            }
            c
        };
        match self.conn.run_on(i, &cmd("EVALSHA", &script.sha)).await {
            Err(RunError::Redis(e))
                if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
            {
                self.conn.run_on(i, &cmd("EVAL", script.code)).await
            }
            r => r,
        }
    }

    async fn create_checked(&self, key: &str, data: Bytes) -> StoreResult<bool> {
        if data.len() > MAX_OBJECT_LEN {
            return Err(StoreError::invalid(format!(
                "object {key} would be {} bytes, more than the {MAX_OBJECT_LEN} farmap reads",
                data.len()
            )));
        }
        let rkey = self.object_key(key);
        let doing = || format!("creating object {key} (key {rkey})");
        let i = self.conn.pick();
        let mut keys = vec![rkey.clone()];
        let mut names: Vec<String> = Vec::new();
        if let (Some(folder), name) = split(key) {
            keys.push(self.index_key(folder));
            names.push(name.to_owned());
            let parents = parent_entries(&self.prefix, folder);
            if self.conn.is_cluster() {
                // Other slots: indexed first, each on its own, before the object exists.
                let adds = parents.iter().map(|(index, entry)| {
                    let mut c = redis::cmd("ZADD");
                    c.arg(index).arg(0).arg(entry);
                    async move { self.conn.run_on::<i64>(i, &c).await }
                });
                for r in futures::future::join_all(adds).await {
                    r.map_err(|e| self.conn.err(doing(), e))?;
                }
            } else {
                for (index, entry) in parents {
                    keys.push(index);
                    names.push(entry);
                }
            }
        }
        let mut args: Vec<&[u8]> = vec![&data[..]];
        args.extend(names.iter().map(|n| n.as_bytes()));
        let created: i64 = self
            .eval(i, &self.create, &keys, &args)
            .await
            .map_err(|e| self.conn.err(doing(), e))?;
        if created == 0 {
            return Ok(false);
        }
        self.conn
            .wait_for_replicas(&doing(), std::iter::once(i))
            .await?;
        Ok(true)
    }

    async fn get_checked(&self, key: &str) -> StoreResult<Option<Bytes>> {
        let rkey = self.object_key(key);
        let max = MAX_OBJECT_LEN.to_string();
        let value: Value = self
            .eval(
                self.conn.pick(),
                &self.get,
                std::slice::from_ref(&rkey),
                &[max.as_bytes()],
            )
            .await
            .map_err(|e| {
                self.conn
                    .err(format_args!("reading object {key} (key {rkey})"), e)
            })?;
        match value {
            Value::Nil => Ok(None),
            Value::BulkString(b) => Ok(Some(Bytes::from(b))),
            Value::Int(n) => Err(StoreError::new(
                ErrorKind::Corrupt,
                format!(
                    "key {rkey} on {} holds {n} bytes, more than the {MAX_OBJECT_LEN} an object may have; refusing to read it",
                    self.conn.server
                ),
            )),
            other => Err(StoreError::new(
                ErrorKind::Corrupt,
                format!(
                    "reading key {rkey} on {} gave {other:?}, not a value",
                    self.conn.server
                ),
            )),
        }
    }

    async fn list_checked(&self, dir: &str) -> StoreResult<Vec<String>> {
        let index = self.index_key(dir);
        let i = self.conn.pick();
        let mut names = Vec::new();
        let mut from = b"-".to_vec();
        loop {
            let mut c = redis::cmd("ZRANGEBYLEX");
            c.arg(&index)
                .arg(&from)
                .arg("+")
                .arg("LIMIT")
                .arg(0)
                .arg(LIST_PAGE);
            let page: Vec<Vec<u8>> = self.conn.run_on(i, &c).await.map_err(|e| {
                self.conn
                    .err(format_args!("listing folder {dir} (key {index})"), e)
            })?;
            let full = page.len() >= LIST_PAGE;
            if let Some(last) = page.last() {
                from = [&b"("[..], last].concat();
            }
            for raw in page {
                let Ok(entry) = String::from_utf8(raw) else {
                    continue;
                };
                let name = entry.strip_suffix('/').unwrap_or(&entry);
                if !name.contains('/') && check_key(name).is_ok() {
                    names.push(name.to_owned());
                }
            }
            if !full {
                break;
            }
        }
        // A folder entry (`b/`) sorts after names that extend `b` with `-` or `.`.
        names.sort();
        names.dedup();
        Ok(names)
    }

    async fn delete_checked(&self, key: &str) -> StoreResult<()> {
        let rkey = self.object_key(key);
        let mut keys = vec![rkey.clone()];
        let (folder, name) = split(key);
        if let Some(folder) = folder {
            keys.push(self.index_key(folder));
        }
        let _: i64 = self
            .eval(self.conn.pick(), &self.delete, &keys, &[name.as_bytes()])
            .await
            .map_err(|e| {
                self.conn
                    .err(format_args!("deleting object {key} (key {rkey})"), e)
            })?;
        Ok(())
    }
}

impl Objects for RedisObjects {
    fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, StoreResult<Option<Bytes>>> {
        Box::pin(async move {
            check_key(key)?;
            self.get_checked(key).await
        })
    }

    fn create<'a>(&'a self, key: &'a str, data: Bytes) -> BoxFuture<'a, StoreResult<bool>> {
        Box::pin(async move {
            check_key(key)?;
            self.create_checked(key, data).await
        })
    }

    fn list<'a>(&'a self, dir: &'a str) -> BoxFuture<'a, StoreResult<Vec<String>>> {
        Box::pin(async move {
            check_key(dir)?;
            self.list_checked(dir).await
        })
    }

    fn delete<'a>(&'a self, key: &'a str) -> BoxFuture<'a, StoreResult<()>> {
        Box::pin(async move {
            check_key(key)?;
            self.delete_checked(key).await
        })
    }

    fn location(&self) -> String {
        self.location.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hash tag of a Redis key: what is between its first `{` and the next `}`.
    fn tag(key: &str) -> Option<&str> {
        let (_, rest) = key.split_once('{')?;
        rest.split_once('}')
            .map(|(t, _)| t)
            .filter(|t| !t.is_empty())
    }

    #[test]
    fn an_object_and_its_folder_index_share_a_slot() {
        let k = object_key("p", "chunks/ab/0123");
        assert_eq!(k, "p:obj:{chunks/ab}/0123");
        assert_eq!(index_key("p", "chunks/ab"), "p:dir:{chunks/ab}");
        assert_eq!(tag(&k), tag(&index_key("p", "chunks/ab")));
        assert_eq!(object_key("p", "top"), "p:obj:top");
        assert_eq!(tag(&object_key("p", "top")), None);
    }

    #[test]
    fn enclosing_folders_are_named_in_their_parents() {
        assert_eq!(
            parent_entries("p", "a/b/c"),
            [
                ("p:dir:{a/b}".to_owned(), "c/".to_owned()),
                ("p:dir:{a}".to_owned(), "b/".to_owned())
            ]
        );
        assert!(parent_entries("p", "a").is_empty());
    }
}
