//! The one grammar of a store spec's query string: `BODY?key=value&flag&...`, the boolean
//! values every option takes alike, and percent-escapes (`%40` for `@`) in names and
//! passwords.

/// Splits a spec's part after its scheme at the first `?`: the body and the query, if any.
pub fn split_query(rest: &str) -> (&str, Option<&str>) {
    match rest.split_once('?') {
        Some((body, query)) => (body, Some(query)),
        None => (rest, None),
    }
}

/// The `key=value` pairs of a query string, in order; empty pairs (`a=1&&b=2`) are skipped
/// and a key without `=` (`ro`) has the value `""`.
pub fn pairs(query: &str) -> impl Iterator<Item = (&str, &str)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| p.split_once('=').unwrap_or((p, "")))
}

/// A boolean option's value: `""` (the bare flag), `1`, `true`, `yes`, or `0`, `false`,
/// `no`. The error is the reason, for the caller's own error type.
pub fn parse_bool(value: &str) -> Result<bool, String> {
    match value {
        "" | "1" | "true" | "yes" => Ok(true),
        "0" | "false" | "no" => Ok(false),
        _ => Err(format!("{value:?} is not true or false")),
    }
}

/// Decodes `%XX` escapes; `None` when a `%` is not followed by two hex digits or the result
/// is not UTF-8.
pub fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Escapes every byte that `keep` refuses as `%XX` (upper-case hex).
pub fn percent_encode(s: &str, keep: impl Fn(u8) -> bool) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if keep(b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_split_into_pairs() {
        assert_eq!(split_query("a/b?x=1"), ("a/b", Some("x=1")));
        assert_eq!(split_query("a/b"), ("a/b", None));
        let got: Vec<_> = pairs("size=1GiB&&ro&name=a=b").collect();
        assert_eq!(got, [("size", "1GiB"), ("ro", ""), ("name", "a=b")]);
    }

    #[test]
    fn booleans() {
        for t in ["", "1", "true", "yes"] {
            assert_eq!(parse_bool(t), Ok(true));
        }
        for f in ["0", "false", "no"] {
            assert_eq!(parse_bool(f), Ok(false));
        }
        assert!(parse_bool("maybe").is_err());
    }

    #[test]
    fn percent_escapes_round_trip() {
        let keep = |b: u8| b.is_ascii_alphanumeric();
        for s in ["p@ss:w/rd", "plain", "é ü", ""] {
            assert_eq!(percent_decode(&percent_encode(s, keep)).as_deref(), Some(s));
        }
        assert_eq!(percent_decode("a%2"), None);
        assert_eq!(percent_decode("a%zz"), None);
        assert_eq!(percent_decode("%ff"), None, "not UTF-8");
    }
}
