//! Where the file is, as a store spec names it: `http://HOST[:PORT]/PATH?options` (or
//! `https://`).
//!
//! The spec parser of the `farmap` crate splits the query and hands the HTTP options here, so
//! that the rules of an HTTP location live in this crate. A URL of its own query string is not
//! possible: what follows `?` are farmap's options.

use std::fmt;
use std::time::Duration;

use farmap_core::option::{parse_count, parse_timeout};
use reqwest::Url;

/// The HTTP-specific options a spec takes, for "this scheme takes: ..." messages.
pub const OPTIONS: &str = "connections, timeout, retries";

/// Most requests in flight (and pooled connections) one store may use.
pub const MAX_CONNECTIONS: usize = 1024;
/// Most retries of one request.
pub const MAX_RETRIES: u32 = 100;

/// A file's URL with the options that say how to read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpLocation {
    /// `http://host:port/path` or `https://...`, without user, password, query or fragment.
    pub url: Url,
    /// Requests in flight at once (and idle connections kept), if set.
    pub connections: Option<usize>,
    /// Deadline of each request, if set.
    pub timeout: Option<Duration>,
    /// Retries of a request that failed for a reason worth retrying, if set.
    pub retries: Option<u32>,
}

/// A part of an `http://` spec that is not valid. `option` is `url`, `path` (no file named)
/// or the option's name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad value for {option}: {reason}")]
pub struct HttpSpecError {
    /// What is wrong: `url`, `path`, or an option's name.
    pub option: &'static str,
    /// Why.
    pub reason: String,
}

fn bad(option: &'static str, reason: impl Into<String>) -> HttpSpecError {
    HttpSpecError {
        option,
        reason: reason.into(),
    }
}

impl HttpLocation {
    /// Parses `body`, what follows `scheme:` up to the options (`//host:port/path`), for
    /// `scheme` `http` or `https`.
    pub fn parse(scheme: &str, body: &str) -> Result<HttpLocation, HttpSpecError> {
        let scheme = scheme.to_ascii_lowercase();
        if scheme != "http" && scheme != "https" {
            return Err(bad("url", format!("{scheme}: is not http: or https:")));
        }
        if body.contains('#') {
            return Err(bad("url", "a URL with a #fragment names no file"));
        }
        let hint = format!("write {scheme}://HOST[:PORT]/PATH");
        let url = Url::parse(&format!("{scheme}:{body}"))
            .map_err(|e| bad("url", format!("{e}: {hint}")))?;
        if url.host_str().is_none_or(str::is_empty) {
            return Err(bad("url", format!("no host: {hint}")));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(bad(
                "url",
                "credentials in the URL are refused (a spec is printed and logged)",
            ));
        }
        if url.path().is_empty() || url.path().ends_with('/') {
            return Err(bad(
                "path",
                format!("{url} names no file (its path is empty or ends with /): {hint}"),
            ));
        }
        Ok(HttpLocation {
            url,
            connections: None,
            timeout: None,
            retries: None,
        })
    }

    /// Sets one of the [`OPTIONS`].
    ///
    /// # Panics
    /// If `key` is not one of them (the spec parser checks option names first).
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), HttpSpecError> {
        match key {
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
            _ => panic!("{key:?} is not an HTTP option ({OPTIONS})"),
        }
        Ok(())
    }

    /// The spec's head (the URL) and its options as `key=value` strings, in the form
    /// [`HttpLocation::parse`] and [`HttpLocation::set`] read back.
    pub fn display_parts(&self) -> (String, Vec<String>) {
        let mut opts = Vec::new();
        if let Some(n) = self.connections {
            opts.push(format!("connections={n}"));
        }
        if let Some(t) = self.timeout {
            opts.push(format!("timeout={}", farmap_core::format_duration(t)));
        }
        if let Some(r) = self.retries {
            opts.push(format!("retries={r}"));
        }
        (self.url.to_string(), opts)
    }
}

impl fmt::Display for HttpLocation {
    /// The URL only: what error messages name.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.url.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_back() {
        let mut loc = HttpLocation::parse("https", "//example.com:8443/a/disk.img").unwrap();
        loc.set("connections", "8").unwrap();
        loc.set("timeout", "2s").unwrap();
        loc.set("retries", "0").unwrap();
        let (head, opts) = loc.display_parts();
        assert_eq!(head, "https://example.com:8443/a/disk.img");
        assert_eq!(opts, ["connections=8", "timeout=2s", "retries=0"]);
        let again = HttpLocation::parse("https", head.strip_prefix("https:").unwrap()).unwrap();
        assert_eq!(again.url, loc.url);
        assert_eq!(loc.to_string(), head);
    }

    #[test]
    fn bad_locations_say_why() {
        let cases = [
            ("http", "//host", "path"),
            ("http", "//host/", "path"),
            ("http", "//host/dir/", "path"),
            ("http", "///file", "path"),
            ("http", "//user:secret@host/f", "url"),
            ("http", "//host/f#part", "url"),
            ("http", "//ho st/f", "url"),
            ("ftp", "//host/f", "url"),
        ];
        for (scheme, body, option) in cases {
            let e = HttpLocation::parse(scheme, body).expect_err(body);
            assert_eq!(e.option, option, "{body}: {e}");
        }
        let e = HttpLocation::parse("http", "//user:secret@host/f").unwrap_err();
        assert!(!e.to_string().contains("secret"), "{e}");
        let mut loc = HttpLocation::parse("http", "//h/f").unwrap();
        assert_eq!(
            loc.set("connections", "0").unwrap_err().option,
            "connections"
        );
        assert_eq!(loc.set("timeout", "5").unwrap_err().option, "timeout");
        assert_eq!(loc.set("retries", "1000").unwrap_err().option, "retries");
    }
}
