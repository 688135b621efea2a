//! Where a region lives in S3, as a store spec names it: `s3://BUCKET/PREFIX?options`.
//!
//! The spec parser of the `farmap` crate splits the query and hands the S3 options here, so
//! that everything S3-specific (bucket rules, endpoint form, option ranges) lives in this crate.

use std::fmt;
use std::time::Duration;

use farmap_core::option::{parse_count, parse_timeout};

/// The S3-specific options a spec takes, for "this scheme takes: ..." messages.
pub const OPTIONS: &str = "endpoint, region, profile, connections, timeout, retries";

/// Most requests in flight (and pooled connections) one store may use.
pub const MAX_CONNECTIONS: usize = 1024;
/// Most retries of one request.
pub const MAX_RETRIES: u32 = 100;

/// A bucket and prefix with the options that say how to reach them. Credentials are never
/// part of it (they come from the environment or a profile; see [`crate::S3Store::open`]),
/// so a location can be printed, logged and handed to another process safely.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Location {
    /// The bucket.
    pub bucket: String,
    /// The key prefix of the region's objects, without leading or trailing `/` (may be empty).
    pub prefix: String,
    /// The server's base URL (`http://127.0.0.1:9000`); `None` means AWS itself, unless
    /// `AWS_ENDPOINT_URL_S3`, `AWS_ENDPOINT_URL` or the profile names one.
    pub endpoint: Option<String>,
    /// The signing region; `None`: `AWS_REGION`, `AWS_DEFAULT_REGION`, the profile, `us-east-1`.
    pub region: Option<String>,
    /// The profile of `~/.aws/credentials` and `~/.aws/config` to take credentials from.
    pub profile: Option<String>,
    /// Requests in flight at once (and idle connections kept), if set.
    pub connections: Option<usize>,
    /// Deadline of each HTTP request, if set.
    pub timeout: Option<Duration>,
    /// Retries of a request that failed for a reason worth retrying, if set.
    pub retries: Option<u32>,
}

/// A part of an `s3://` spec that is not valid. `option` is `bucket`, `prefix` or the
/// option's name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad value for {option}: {reason}")]
pub struct S3SpecError {
    /// What is wrong: `bucket`, `prefix`, or an option's name.
    pub option: &'static str,
    /// Why.
    pub reason: String,
}

fn bad(option: &'static str, reason: impl Into<String>) -> S3SpecError {
    S3SpecError {
        option,
        reason: reason.into(),
    }
}

impl S3Location {
    /// Reads the part of a spec after `s3:` and before `?`: `//BUCKET` or `//BUCKET/PREFIX`.
    pub fn parse(body: &str) -> Result<S3Location, S3SpecError> {
        let rest = body
            .strip_prefix("//")
            .ok_or_else(|| bad("bucket", "write s3://BUCKET/PREFIX"))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        check_bucket(bucket)?;
        let prefix = prefix.trim_matches('/');
        check_prefix(prefix)?;
        Ok(S3Location {
            bucket: bucket.to_owned(),
            prefix: prefix.to_owned(),
            endpoint: None,
            region: None,
            profile: None,
            connections: None,
            timeout: None,
            retries: None,
        })
    }

    /// Takes one option of [`OPTIONS`].
    ///
    /// # Panics
    /// If `key` is not one of [`OPTIONS`] (the caller checks the key first).
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), S3SpecError> {
        match key {
            "endpoint" => self.endpoint = Some(check_endpoint(value)?),
            "region" => {
                let ok = !value.is_empty()
                    && value.len() <= 64
                    && value
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
                if !ok {
                    return Err(bad(
                        "region",
                        format!("{value:?} is not a region name (like us-east-1)"),
                    ));
                }
                self.region = Some(value.to_owned());
            }
            "profile" => {
                let ok = !value.is_empty()
                    && value.len() <= 128
                    && value
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"-_.@+".contains(&b));
                if !ok {
                    return Err(bad("profile", format!("{value:?} is not a profile name")));
                }
                self.profile = Some(value.to_owned());
            }
            "connections" => {
                let n =
                    parse_count(value, 1..=MAX_CONNECTIONS).map_err(|w| bad("connections", w))?;
                self.connections = Some(n);
            }
            "timeout" => {
                self.timeout = Some(parse_timeout(value).map_err(|w| bad("timeout", w))?);
            }
            "retries" => {
                self.retries =
                    Some(parse_count(value, 0..=MAX_RETRIES).map_err(|w| bad("retries", w))?);
            }
            _ => panic!("{key:?} is not an S3 option ({OPTIONS})"),
        }
        Ok(())
    }

    /// The spec's head (`s3://bucket/prefix`) and its options as `key=value` strings, in the
    /// form [`S3Location::parse`] and [`S3Location::set`] read back.
    pub fn display_parts(&self) -> (String, Vec<String>) {
        let mut opts = Vec::new();
        if let Some(e) = &self.endpoint {
            opts.push(format!("endpoint={e}"));
        }
        if let Some(r) = &self.region {
            opts.push(format!("region={r}"));
        }
        if let Some(p) = &self.profile {
            opts.push(format!("profile={p}"));
        }
        if let Some(n) = self.connections {
            opts.push(format!("connections={n}"));
        }
        if let Some(t) = self.timeout {
            opts.push(format!("timeout={}", farmap_core::format_duration(t)));
        }
        if let Some(n) = self.retries {
            opts.push(format!("retries={n}"));
        }
        (self.to_string(), opts)
    }
}

impl fmt::Display for S3Location {
    /// `s3://bucket/prefix` (no options).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.prefix.is_empty() {
            write!(f, "s3://{}", self.bucket)
        } else {
            write!(f, "s3://{}/{}", self.bucket, self.prefix)
        }
    }
}

/// S3's bucket naming rules (3 to 63 characters; lowercase letters, digits, `.` and `-`;
/// starting and ending with a letter or digit).
fn check_bucket(bucket: &str) -> Result<(), S3SpecError> {
    if bucket.is_empty() {
        return Err(bad(
            "bucket",
            "the spec names no bucket: write s3://BUCKET/PREFIX",
        ));
    }
    let edge = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    let bytes = bucket.as_bytes();
    let ok = (3..=63).contains(&bytes.len())
        && bytes.iter().all(|&b| edge(b) || b == b'.' || b == b'-')
        && edge(bytes[0])
        && edge(bytes[bytes.len() - 1])
        && !bucket.contains("..");
    if ok {
        Ok(())
    } else {
        Err(bad(
            "bucket",
            format!(
                "{bucket:?} is not a bucket name (3 to 63 characters: lowercase letters, digits, '.' and '-', starting and ending with a letter or digit)"
            ),
        ))
    }
}

/// A prefix of `/`-separated parts made of the characters S3 calls safe in keys, with no empty,
/// `.` or `..` part, short enough to leave room for the chunk names (keys are at most 1024
/// bytes).
fn check_prefix(prefix: &str) -> Result<(), S3SpecError> {
    if prefix.is_empty() {
        return Ok(());
    }
    if prefix.len() > 900 {
        return Err(bad("prefix", "longer than 900 bytes"));
    }
    for part in prefix.split('/') {
        if part.is_empty() || part == "." || part == ".." {
            return Err(bad(
                "prefix",
                format!("{prefix:?} has an empty, '.' or '..' part"),
            ));
        }
        if let Some(c) = part
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || "-_.!*'()=".contains(*c)))
        {
            return Err(bad(
                "prefix",
                format!(
                    "{prefix:?} holds {c:?}; a prefix takes letters, digits, '/' and -_.!*'()="
                ),
            ));
        }
    }
    Ok(())
}

/// `http://host[:port]` or `https://host[:port]`, optionally with a path; a trailing `/` is
/// dropped.
fn check_endpoint(value: &str) -> Result<String, S3SpecError> {
    let rest = value
        .strip_prefix("http://")
        .or_else(|| value.strip_prefix("https://"))
        .ok_or_else(|| {
            bad(
                "endpoint",
                format!("{value:?} is not an http:// or https:// URL"),
            )
        })?;
    let host = rest.split('/').next().unwrap_or("");
    let host_ok = !host.is_empty()
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-.:[]_".contains(&b));
    if !host_ok || value.contains(['?', '#', '@', ' ']) {
        return Err(bad(
            "endpoint",
            format!("{value:?} is not a server URL like http://127.0.0.1:9000"),
        ));
    }
    if let Some((_, port)) = host.rsplit_once(':').filter(|_| !host.ends_with(']')) {
        if port.parse::<u16>().ok().filter(|p| *p > 0).is_none() {
            return Err(bad(
                "endpoint",
                format!("{value:?} has a bad port {port:?}"),
            ));
        }
    }
    Ok(value.trim_end_matches('/').to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_bucket_and_prefix() {
        let l = S3Location::parse("//my-bucket/a/b/").unwrap();
        assert_eq!((l.bucket.as_str(), l.prefix.as_str()), ("my-bucket", "a/b"));
        assert_eq!(l.to_string(), "s3://my-bucket/a/b");
        let l = S3Location::parse("//my.bucket").unwrap();
        assert_eq!((l.bucket.as_str(), l.prefix.as_str()), ("my.bucket", ""));
        assert_eq!(l.to_string(), "s3://my.bucket");
    }

    #[test]
    fn refuses_bad_buckets_and_prefixes() {
        for (body, want) in [
            ("bucket/x", "write s3://BUCKET/PREFIX"),
            ("///x", "names no bucket"),
            ("//ab", "not a bucket name"),
            ("//Upper", "not a bucket name"),
            ("//-bucket", "not a bucket name"),
            ("//a..b", "not a bucket name"),
            ("//bucket/a//b", "empty"),
            ("//bucket/a/../b", "'..'"),
            ("//bucket/a b", "holds ' '"),
            ("//bucket/x%41", "holds '%'"),
        ] {
            let e = S3Location::parse(body).expect_err(body).to_string();
            assert!(e.contains(want), "{body}: {e}");
        }
    }

    #[test]
    fn options_are_checked_and_read_back() {
        let mut l = S3Location::parse("//b-1/p").unwrap();
        l.set("endpoint", "http://127.0.0.1:9000/").unwrap();
        l.set("region", "eu-west-3").unwrap();
        l.set("profile", "minio").unwrap();
        l.set("connections", "64").unwrap();
        l.set("timeout", "1500ms").unwrap();
        l.set("retries", "0").unwrap();
        assert_eq!(l.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
        let (head, opts) = l.display_parts();
        assert_eq!(head, "s3://b-1/p");
        let mut again = S3Location::parse(head.strip_prefix("s3:").unwrap()).unwrap();
        for o in &opts {
            let (k, v) = o.split_once('=').unwrap();
            again.set(k, v).unwrap();
        }
        assert_eq!(again, l);
        for (k, v, want) in [
            ("endpoint", "ftp://x", "not an http"),
            ("endpoint", "http://", "not a server URL"),
            ("endpoint", "http://h:99999", "bad port"),
            ("endpoint", "http://h:9000?x=1", "not a server URL"),
            ("region", "US", "not a region"),
            ("profile", "a b", "not a profile"),
            ("connections", "0", "from 1 to 1024"),
            ("timeout", "5", "unit"),
            ("timeout", "0s", "between"),
            ("retries", "101", "from 0 to 100"),
        ] {
            let e = l.set(k, v).expect_err(v).to_string();
            assert!(e.contains(want), "{k}={v}: {e}");
        }
    }
}
