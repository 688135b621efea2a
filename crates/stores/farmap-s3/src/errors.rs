//! Turning what the S3 client reports into [`StoreError`]s that name the problem.
//!
//! The client (`object_store`) reports an HTTP status and the server's XML error body as text;
//! the S3 error codes in it (`NoSuchBucket`, `InvalidAccessKeyId`, `SignatureDoesNotMatch`,
//! `AccessDenied`, `SlowDown`...) are part of the S3 API, so they are what is matched here.

use farmap_core::{ErrorKind, StoreError};
use object_store::client::{HttpError, HttpErrorKind};

/// What a failed request tells, gathered from the error and its causes.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Failure {
    /// The HTTP status, if the server answered.
    pub status: Option<u16>,
    /// The S3 error code of the answer's body, if any.
    pub code: Option<String>,
    /// The transport failed: connection refused, reset, DNS...
    pub connect: bool,
    /// The request timed out.
    pub timeout: bool,
    /// The client reports the request as not found (404).
    pub not_found: bool,
}

impl Failure {
    /// Reads a client error.
    pub fn of(err: &object_store::Error) -> Failure {
        let mut f = Failure {
            not_found: matches!(err, object_store::Error::NotFound { .. }),
            ..Failure::default()
        };
        let mut text = String::new();
        let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
        while let Some(e) = cur {
            if let Some(h) = e.downcast_ref::<HttpError>() {
                match h.kind() {
                    HttpErrorKind::Connect => f.connect = true,
                    HttpErrorKind::Timeout => f.timeout = true,
                    _ => {}
                }
            }
            text.push_str(&e.to_string());
            text.push('\n');
            cur = e.source();
        }
        f.status = status_in(&text);
        f.code = code_in(&text);
        if f.status == Some(404) {
            f.not_found = true;
        }
        f
    }

    /// Whether the answer was "no such object" (and not "no such bucket").
    pub fn is_missing_object(&self) -> bool {
        self.not_found && self.code.as_deref() != Some("NoSuchBucket")
    }
}

/// `Server returned non-2xx status code: 503 Service Unavailable: ...` → 503.
fn status_in(text: &str) -> Option<u16> {
    let at = text.find("status code: ")? + "status code: ".len();
    text.get(at..at + 3)?.parse().ok()
}

/// `<Code>NoSuchBucket</Code>` → `NoSuchBucket`.
fn code_in(text: &str) -> Option<String> {
    let at = text.find("<Code>")? + "<Code>".len();
    let len = text[at..].find("</Code>")?;
    let code = &text[at..at + len];
    (code.len() <= 64 && code.bytes().all(|b| b.is_ascii_alphanumeric())).then(|| code.to_owned())
}

/// What the error messages say about the store they come from.
#[derive(Debug, Clone)]
pub(crate) struct Describe {
    /// `s3://bucket/prefix`.
    pub location: String,
    /// The bucket.
    pub bucket: String,
    /// `http://127.0.0.1:9000`, or `AWS S3 (us-east-1)`.
    pub endpoint: String,
    /// The access key id in use.
    pub key_id: String,
    /// Where it came from.
    pub key_from: String,
    /// Retries allowed per request.
    pub retries: u32,
}

impl Describe {
    /// The error for a failed request: `doing` says what was being done ("reading chunk 3
    /// (object p/000000000003)").
    pub fn error(&self, doing: &str, err: object_store::Error) -> StoreError {
        let f = Failure::of(&err);
        let (kind, message) = self.classify(doing, &f);
        StoreError::new(kind, message).with_source(err)
    }

    fn classify(&self, doing: &str, f: &Failure) -> (ErrorKind, String) {
        let Describe {
            location,
            bucket,
            endpoint,
            key_id,
            key_from,
            retries,
        } = self;
        let code = f.code.as_deref().unwrap_or("");
        match code {
            "NoSuchBucket" => {
                return (
                    ErrorKind::NotFound,
                    format!(
                        "{doing} of {location}: bucket {bucket} does not exist at {endpoint}; \
                         create it first (for example `aws s3 mb s3://{bucket} --endpoint-url \
                         {endpoint}`, or `mc mb ALIAS/{bucket}` for MinIO)"
                    ),
                )
            }
            "InvalidAccessKeyId" => {
                return (
                    ErrorKind::PermissionDenied,
                    format!(
                        "{doing} of {location}: {endpoint} does not know access key id \
                         {key_id} (from {key_from})"
                    ),
                )
            }
            "SignatureDoesNotMatch" => {
                return (
                    ErrorKind::PermissionDenied,
                    format!(
                        "{doing} of {location}: {endpoint} refused the signature of access key \
                         id {key_id} (from {key_from}): its secret access key is wrong"
                    ),
                )
            }
            "ExpiredToken" | "InvalidToken" | "TokenRefreshRequired" => {
                return (
                    ErrorKind::PermissionDenied,
                    format!(
                        "{doing} of {location}: the session token of access key id {key_id} \
                         (from {key_from}) is expired or invalid ({code})"
                    ),
                )
            }
            _ => {}
        }
        match f.status {
            Some(401 | 403) => (
                ErrorKind::PermissionDenied,
                format!(
                    "{doing} of {location}: {endpoint} refused access key id {key_id} (from \
                     {key_from}){}",
                    if code.is_empty() {
                        String::new()
                    } else {
                        format!(" ({code})")
                    }
                ),
            ),
            Some(404) => (
                ErrorKind::NotFound,
                format!("{doing} of {location}: not found"),
            ),
            Some(s @ (429 | 500..=599)) => (
                ErrorKind::Unavailable,
                format!(
                    "{doing} of {location}: {endpoint} answered {s}{} and still did after \
                     {retries} retries with backoff",
                    if code.is_empty() {
                        String::new()
                    } else {
                        format!(" {code}")
                    }
                ),
            ),
            Some(s) => (
                ErrorKind::Io,
                format!("{doing} of {location}: {endpoint} answered {s} {code}"),
            ),
            None if f.timeout => (
                ErrorKind::Timeout,
                format!("{doing} of {location}: {endpoint} did not answer in time"),
            ),
            None if f.connect => (
                ErrorKind::Unavailable,
                format!("{doing} of {location}: cannot reach {endpoint}"),
            ),
            None => (
                ErrorKind::Io,
                format!("{doing} of {location} at {endpoint} failed"),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn describe() -> Describe {
        Describe {
            location: "s3://b/p".into(),
            bucket: "b".into(),
            endpoint: "http://127.0.0.1:9".into(),
            key_id: "AKID".into(),
            key_from: "AWS_ACCESS_KEY_ID".into(),
            retries: 3,
        }
    }

    fn failure(status: u16, code: &str) -> Failure {
        Failure {
            status: Some(status),
            code: (!code.is_empty()).then(|| code.to_owned()),
            not_found: status == 404,
            ..Failure::default()
        }
    }

    #[test]
    fn reads_status_and_code_from_the_client_text() {
        let text = "Error performing GET http://h/b/k in 2ms - Server returned non-2xx status \
                    code: 404 Not Found: <?xml version=\"1.0\"?><Error><Code>NoSuchBucket</Code>\
                    <Message>The specified bucket does not exist</Message></Error>";
        assert_eq!(status_in(text), Some(404));
        assert_eq!(code_in(text).as_deref(), Some("NoSuchBucket"));
        assert_eq!(status_in("no status here"), None);
        assert_eq!(code_in("<Code>unterminated"), None);
        assert_eq!(code_in("<Code>has space</Code>"), None);
    }

    #[test]
    fn messages_name_the_problem() {
        let d = describe();
        let cases = [
            (
                failure(404, "NoSuchBucket"),
                ErrorKind::NotFound,
                "bucket b does not exist at http://127.0.0.1:9",
            ),
            (
                failure(403, "InvalidAccessKeyId"),
                ErrorKind::PermissionDenied,
                "does not know access key id AKID",
            ),
            (
                failure(403, "SignatureDoesNotMatch"),
                ErrorKind::PermissionDenied,
                "secret access key is wrong",
            ),
            (
                failure(403, "AccessDenied"),
                ErrorKind::PermissionDenied,
                "refused access key id AKID (from AWS_ACCESS_KEY_ID) (AccessDenied)",
            ),
            (
                failure(503, "SlowDown"),
                ErrorKind::Unavailable,
                "answered 503 SlowDown and still did after 3 retries",
            ),
            (
                failure(500, ""),
                ErrorKind::Unavailable,
                "answered 500 and still",
            ),
            (
                failure(400, "InvalidRequest"),
                ErrorKind::Io,
                "answered 400 InvalidRequest",
            ),
            (
                Failure {
                    connect: true,
                    ..Failure::default()
                },
                ErrorKind::Unavailable,
                "cannot reach http://127.0.0.1:9",
            ),
            (
                Failure {
                    timeout: true,
                    ..Failure::default()
                },
                ErrorKind::Timeout,
                "did not answer in time",
            ),
        ];
        for (f, kind, want) in cases {
            let (k, msg) = d.classify("reading chunk 3", &f);
            assert_eq!(k, kind, "{msg}");
            assert!(msg.starts_with("reading chunk 3 of s3://b/p"), "{msg}");
            assert!(msg.contains(want), "{msg} should contain {want}");
        }
        assert!(!failure(404, "NoSuchBucket").is_missing_object());
        assert!(failure(404, "NoSuchKey").is_missing_object());
        assert!(failure(404, "").is_missing_object());
    }
}
