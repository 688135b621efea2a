//! What an answer to a range request means, judged from its status and headers alone (before
//! any of its body is read): the validator that pins the file's version, the
//! `Content-Range` grammar, and the verdicts on the probe of [`crate::HttpStore::open`] and
//! on each read.

use farmap_core::ErrorKind;
use reqwest::header::{
    HeaderMap, HeaderName, HeaderValue, CONTENT_LENGTH, CONTENT_RANGE, ETAG, IF_MATCH,
    IF_UNMODIFIED_SINCE, LAST_MODIFIED,
};
use reqwest::StatusCode;

/// What identifies the version of the file seen at open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Validator {
    /// A strong entity tag, quotes included (`"5f1c-a000"`).
    ETag(String),
    /// The `Last-Modified` date, as sent (one-second resolution: a weaker check).
    LastModified(String),
    /// The server sends neither: only the size can be checked.
    None,
}

fn header<'h>(headers: &'h HeaderMap, name: &HeaderName) -> Option<&'h str> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
}

impl Validator {
    /// The validator of an answer: its strong `ETag`, else its `Last-Modified`.
    pub fn of(headers: &HeaderMap) -> Validator {
        match (header(headers, &ETAG), header(headers, &LAST_MODIFIED)) {
            (Some(e), _) if e.len() >= 2 && e.starts_with('"') && e.ends_with('"') => {
                Validator::ETag(e.to_owned())
            }
            (_, Some(d)) if !d.is_empty() => Validator::LastModified(d.to_owned()),
            _ => Validator::None,
        }
    }

    /// The request header that makes the server refuse (412) to answer for another version.
    pub fn condition(&self) -> Option<(HeaderName, HeaderValue)> {
        let (name, value) = match self {
            Validator::ETag(e) => (IF_MATCH, e),
            Validator::LastModified(d) => (IF_UNMODIFIED_SINCE, d),
            Validator::None => return None,
        };
        Some((name, HeaderValue::from_str(value).ok()?))
    }

    /// Whether the answer's own validator (where it sends one) is this one; if not, what it
    /// sent instead.
    pub fn check(&self, headers: &HeaderMap) -> Result<(), String> {
        let (name, ours) = match self {
            Validator::ETag(e) => (&ETAG, e),
            Validator::LastModified(d) => (&LAST_MODIFIED, d),
            Validator::None => return Ok(()),
        };
        match header(headers, name) {
            Some(theirs) if theirs != ours => Err(format!("{name} {theirs}")),
            _ => Ok(()),
        }
    }

    /// `ETag "5f1c-a000"`, for messages.
    pub fn describe(&self) -> String {
        match self {
            Validator::ETag(e) => format!("ETag {e}"),
            Validator::LastModified(d) => format!("Last-Modified {d}"),
            Validator::None => "no validator".to_owned(),
        }
    }
}

/// A `Content-Range` header: `bytes FIRST-LAST/TOTAL`, `bytes FIRST-LAST/*` or
/// `bytes */TOTAL`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ContentRange {
    /// First and last byte (inclusive), if a range.
    pub range: Option<(u64, u64)>,
    /// The whole file's length, if known.
    pub total: Option<u64>,
}

/// Parses a `Content-Range` value; `None` if malformed.
pub(crate) fn parse_content_range(value: &str) -> Option<ContentRange> {
    let rest = value.trim().strip_prefix("bytes ")?.trim_start();
    let (range, total) = rest.split_once('/')?;
    let number = |s: &str| -> Option<u64> {
        (!s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse().ok())
            .flatten()
    };
    let total = if total == "*" {
        None
    } else {
        Some(number(total)?)
    };
    let range = if range == "*" {
        None
    } else {
        let (a, b) = range.split_once('-')?;
        let (a, b) = (number(a)?, number(b)?);
        if b < a || total.is_some_and(|t| b >= t) {
            return None;
        }
        Some((a, b))
    };
    if range.is_none() && total.is_none() {
        return None;
    }
    Some(ContentRange { range, total })
}

fn content_range(headers: &HeaderMap) -> Result<Option<ContentRange>, Refusal> {
    match header(headers, &CONTENT_RANGE) {
        None => Ok(None),
        Some(v) => parse_content_range(v).map(Some).ok_or_else(|| Refusal {
            kind: ErrorKind::Io,
            why: format!("the server sent a malformed Content-Range: {v:?}"),
        }),
    }
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    header(headers, &CONTENT_LENGTH).and_then(|v| v.parse().ok())
}

/// Why an answer is refused: the kind of the store error, and a sentence (what follows
/// "reading ... of URL: ").
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refusal {
    pub kind: ErrorKind,
    pub why: String,
}

fn refuse(kind: ErrorKind, why: impl Into<String>) -> Refusal {
    Refusal {
        kind,
        why: why.into(),
    }
}

/// The refusal of an answer whose status is not a success.
fn failed_status(status: StatusCode, validator: &Validator) -> Refusal {
    let code = status.as_u16();
    match code {
        404 | 410 => refuse(
            ErrorKind::NotFound,
            format!("no such file on the server ({status})"),
        ),
        401 | 403 => refuse(
            ErrorKind::PermissionDenied,
            format!("the server refused access ({status}; farmap sends no credentials)"),
        ),
        412 => refuse(
            ErrorKind::Corrupt,
            format!(
                "the file changed on the server since it was opened (it no longer matches its \
                 {}: {status}); open it again to read the new content",
                validator.describe()
            ),
        ),
        416 => refuse(
            ErrorKind::Corrupt,
            format!(
                "the file changed on the server since it was opened (the range is past its \
                 end now: {status}); open it again to read the new content"
            ),
        ),
        408 | 429 | 500..=599 => refuse(
            ErrorKind::Unavailable,
            format!("the server answered {status}"),
        ),
        _ => refuse(ErrorKind::Io, format!("the server answered {status}")),
    }
}

fn changed(validator: &Validator, now: &str) -> Refusal {
    refuse(
        ErrorKind::Corrupt,
        format!(
            "the file changed on the server since it was opened ({} then, {now} now); open it \
             again to read the new content",
            validator.describe()
        ),
    )
}

/// What the probe of [`crate::HttpStore::open`] (`Range: bytes=0-0`) found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Probe {
    /// The file's length.
    pub size: u64,
    /// Its version.
    pub validator: Validator,
    /// Whether the server honoured the range (206); if not, its body (the whole file) is
    /// left unread.
    pub ranges: bool,
}

/// Judges the answer to the probe.
pub(crate) fn judge_probe(status: StatusCode, headers: &HeaderMap) -> Result<Probe, Refusal> {
    let validator = Validator::of(headers);
    match status {
        StatusCode::PARTIAL_CONTENT => {
            let cr = content_range(headers)?;
            match cr {
                Some(ContentRange {
                    range: Some((0, 0)),
                    total: Some(size),
                }) => Ok(Probe {
                    size,
                    validator,
                    ranges: true,
                }),
                Some(ContentRange { total: None, .. }) => Err(refuse(
                    ErrorKind::Unsupported,
                    "the server does not tell the file's length (Content-Range: bytes 0-0/*)",
                )),
                other => Err(refuse(
                    ErrorKind::Io,
                    format!("the server answered bytes 0-0 with Content-Range {other:?}"),
                )),
            }
        }
        StatusCode::OK => match content_length(headers) {
            Some(size) => Ok(Probe {
                size,
                validator,
                ranges: false,
            }),
            None => Err(refuse(
                ErrorKind::Unsupported,
                "the server ignores Range requests and does not tell the file's length \
                 (200 without Content-Length)",
            )),
        },
        StatusCode::RANGE_NOT_SATISFIABLE => match content_range(headers)? {
            Some(ContentRange {
                range: None,
                total: Some(0),
            }) => Err(refuse(
                ErrorKind::InvalidInput,
                "the file is empty: a region cannot be",
            )),
            _ => Err(refuse(
                ErrorKind::Io,
                format!("the server answered the range 0-0 with {status}"),
            )),
        },
        s if s.is_success() => Err(refuse(
            ErrorKind::Io,
            format!("the server answered {s} instead of 206 Partial Content"),
        )),
        s => Err(failed_status(s, &validator)),
    }
}

/// A read: `len` bytes (at least one) at `start` of a file of `size` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Asked {
    pub start: u64,
    pub len: u64,
    pub size: u64,
}

impl Asked {
    /// The value of the `Range` header.
    pub fn range_header(&self) -> String {
        format!("bytes={}-{}", self.start, self.start + self.len - 1)
    }
}

/// Judges the answer to a read: `Ok` when exactly `asked.len` bytes of its body are the
/// bytes asked for, of the version seen at open.
pub(crate) fn judge_read(
    asked: Asked,
    validator: &Validator,
    status: StatusCode,
    headers: &HeaderMap,
) -> Result<(), Refusal> {
    let whole = asked.start == 0 && asked.len == asked.size;
    match status {
        StatusCode::PARTIAL_CONTENT => {
            let last = asked.start + asked.len - 1;
            match content_range(headers)? {
                Some(ContentRange { total: Some(t), .. }) if t != asked.size => {
                    return Err(changed(
                        validator,
                        &format!("{t} bytes instead of {}", asked.size),
                    ))
                }
                Some(ContentRange {
                    range: Some((a, b)),
                    ..
                }) if (a, b) == (asked.start, last) => {}
                other => {
                    return Err(refuse(
                        ErrorKind::Io,
                        format!(
                            "the server answered bytes {}-{last} with Content-Range {other:?} \
                             (one range, the one asked for, is expected)",
                            asked.start
                        ),
                    ))
                }
            }
        }
        StatusCode::OK if whole => match content_length(headers) {
            Some(n) if n != asked.size => {
                return Err(changed(
                    validator,
                    &format!("{n} bytes instead of {}", asked.size),
                ))
            }
            _ => {}
        },
        StatusCode::OK => {
            return Err(refuse(
                ErrorKind::Unsupported,
                format!(
                    "the server ignores Range requests (it answered 200 with the whole file{}); \
                     farmap reads a file over HTTP only from a server that honours Range, or a \
                     file of one chunk",
                    content_length(headers)
                        .map(|n| format!(", {n} bytes"))
                        .unwrap_or_default()
                ),
            ))
        }
        s if s.is_success() => {
            return Err(refuse(
                ErrorKind::Io,
                format!("the server answered {s} instead of 206 Partial Content"),
            ))
        }
        s => return Err(failed_status(s, validator)),
    }
    if let Some(n) = content_length(headers).filter(|n| *n != asked.len) {
        return Err(refuse(
            ErrorKind::Corrupt,
            format!(
                "the server announced {n} bytes for a range of {} bytes",
                asked.len
            ),
        ));
    }
    validator
        .check(headers)
        .map_err(|now| changed(validator, &now))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn content_range_grammar() {
        let cr = |r, t| Some(ContentRange { range: r, total: t });
        assert_eq!(
            parse_content_range("bytes 0-0/10"),
            cr(Some((0, 0)), Some(10))
        );
        assert_eq!(parse_content_range("bytes 5-9/*"), cr(Some((5, 9)), None));
        assert_eq!(parse_content_range("bytes */0"), cr(None, Some(0)));
        for bad in [
            "bytes */*",
            "bytes 9-5/10",
            "bytes 0-10/10",
            "bytes -1-5/10",
            "bytes 0-5",
            "items 0-5/10",
            "bytes 0-5/99999999999999999999999",
            "bytes +1-5/10",
        ] {
            assert_eq!(parse_content_range(bad), None, "{bad}");
        }
    }

    #[test]
    fn validator_prefers_a_strong_etag() {
        let v = Validator::of(&headers(&[
            ("etag", "\"abc\""),
            ("last-modified", "Tue, 01 Dec 2026 04:00:00 GMT"),
        ]));
        assert_eq!(v, Validator::ETag("\"abc\"".into()));
        assert_eq!(v.condition().unwrap().0, IF_MATCH);
        let weak = Validator::of(&headers(&[
            ("etag", "W/\"abc\""),
            ("last-modified", "Tue, 01 Dec 2026 04:00:00 GMT"),
        ]));
        assert!(matches!(weak, Validator::LastModified(_)));
        assert_eq!(weak.condition().unwrap().0, IF_UNMODIFIED_SINCE);
        assert_eq!(
            Validator::of(&headers(&[("etag", "W/\"x\"")])),
            Validator::None
        );
        assert!(v.check(&headers(&[("etag", "\"abc\"")])).is_ok());
        assert!(v.check(&headers(&[])).is_ok());
        assert_eq!(
            v.check(&headers(&[("etag", "\"new\"")])).unwrap_err(),
            "etag \"new\""
        );
    }

    #[test]
    fn probe_verdicts() {
        let p = judge_probe(
            StatusCode::PARTIAL_CONTENT,
            &headers(&[("content-range", "bytes 0-0/12345"), ("etag", "\"e\"")]),
        )
        .unwrap();
        assert_eq!((p.size, p.ranges), (12345, true));
        let p = judge_probe(StatusCode::OK, &headers(&[("content-length", "77")])).unwrap();
        assert_eq!((p.size, p.ranges), (77, false));
        let kind = |s: u16, h: &[(&str, &str)]| {
            judge_probe(StatusCode::from_u16(s).unwrap(), &headers(h))
                .unwrap_err()
                .kind
        };
        assert_eq!(kind(200, &[]), ErrorKind::Unsupported);
        assert_eq!(
            kind(206, &[("content-range", "bytes 0-0/*")]),
            ErrorKind::Unsupported
        );
        assert_eq!(
            kind(206, &[("content-range", "bytes 0-9/10")]),
            ErrorKind::Io
        );
        assert_eq!(
            kind(416, &[("content-range", "bytes */0")]),
            ErrorKind::InvalidInput
        );
        assert_eq!(kind(404, &[]), ErrorKind::NotFound);
        assert_eq!(kind(403, &[]), ErrorKind::PermissionDenied);
        assert_eq!(kind(503, &[]), ErrorKind::Unavailable);
        assert_eq!(kind(204, &[]), ErrorKind::Io);
    }

    #[test]
    fn read_verdicts() {
        let v = Validator::ETag("\"e\"".into());
        let asked = Asked {
            start: 100,
            len: 10,
            size: 1000,
        };
        assert_eq!(asked.range_header(), "bytes=100-109");
        let judge = |s: u16, h: &[(&str, &str)]| {
            judge_read(asked, &v, StatusCode::from_u16(s).unwrap(), &headers(h)).map_err(|r| r.kind)
        };
        let good = [("content-range", "bytes 100-109/1000"), ("etag", "\"e\"")];
        assert_eq!(judge(206, &good), Ok(()));
        assert_eq!(
            judge(
                206,
                &[
                    ("content-range", "bytes 100-109/1000"),
                    ("content-length", "10")
                ]
            ),
            Ok(())
        );
        let fails = [
            (
                206,
                &[("content-range", "bytes 100-109/1001")][..],
                ErrorKind::Corrupt,
            ),
            (
                206,
                &[("content-range", "bytes 100-108/1000")],
                ErrorKind::Io,
            ),
            (206, &[], ErrorKind::Io),
            (
                206,
                &[("content-range", "bytes 100-109/1000"), ("etag", "\"f\"")],
                ErrorKind::Corrupt,
            ),
            (
                206,
                &[
                    ("content-range", "bytes 100-109/1000"),
                    ("content-length", "11"),
                ],
                ErrorKind::Corrupt,
            ),
            (200, &[("content-length", "1000")], ErrorKind::Unsupported),
            (412, &[], ErrorKind::Corrupt),
            (416, &[], ErrorKind::Corrupt),
            (404, &[], ErrorKind::NotFound),
            (502, &[], ErrorKind::Unavailable),
            (304, &[], ErrorKind::Io),
        ];
        for (status, h, kind) in fails {
            assert_eq!(judge(status, h), Err(kind), "{status} {h:?}");
        }
        // A 200 is the answer when the range is the whole file (a file of one chunk).
        let whole = Asked {
            start: 0,
            len: 1000,
            size: 1000,
        };
        let ok = judge_read(
            whole,
            &v,
            StatusCode::OK,
            &headers(&[("content-length", "1000")]),
        );
        assert_eq!(ok, Ok(()));
        let grown = judge_read(
            whole,
            &v,
            StatusCode::OK,
            &headers(&[("content-length", "2000")]),
        );
        assert_eq!(grown.unwrap_err().kind, ErrorKind::Corrupt);
    }
}
