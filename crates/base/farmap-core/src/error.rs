//! One error type for every store.

use std::borrow::Cow;
use std::error::Error as StdError;
use std::fmt;
use std::io;

/// Result of a store operation.
pub type StoreResult<T> = Result<T, StoreError>;

/// What went wrong, in terms a frontend can act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The device or service failed to read or write.
    Io,
    /// Something the store needs (a file, a bucket, a key space) does not exist.
    NotFound,
    /// A chunk index or byte range lies outside the region.
    OutOfRange,
    /// The request itself is malformed (wrong chunk length, unaligned range, bad option).
    InvalidInput,
    /// The operation did not finish in time. Retryable.
    Timeout,
    /// The backend cannot be reached right now (connection refused or dropped). Retryable.
    Unavailable,
    /// Data failed verification (checksum, version, short payload).
    Corrupt,
    /// The store was closed; no further operation will succeed.
    Closed,
    /// The store, or this opening of it, does not accept writes.
    ReadOnly,
    /// The store cannot do this operation at all (see [`crate::Caps`]).
    Unsupported,
    /// Credentials were missing or refused.
    PermissionDenied,
    /// No space is left in the backend.
    NoSpace,
    /// The operation was cancelled before it finished.
    Cancelled,
    /// Another writer advanced the region since this one last did (a versioned region has one
    /// writer at a time): this opening may no longer write.
    Fenced,
}

impl ErrorKind {
    /// Every kind, for tables and tests that must cover them all (wire codes, gRPC statuses).
    pub const ALL: [ErrorKind; 14] = [
        ErrorKind::Io,
        ErrorKind::NotFound,
        ErrorKind::OutOfRange,
        ErrorKind::InvalidInput,
        ErrorKind::Timeout,
        ErrorKind::Unavailable,
        ErrorKind::Corrupt,
        ErrorKind::Closed,
        ErrorKind::ReadOnly,
        ErrorKind::Unsupported,
        ErrorKind::PermissionDenied,
        ErrorKind::NoSpace,
        ErrorKind::Cancelled,
        ErrorKind::Fenced,
    ];

    /// The errno a kernel-facing frontend (NBD, FUSE, ublk, userfaultfd) replies with.
    pub fn errno(self) -> i32 {
        // Linux errno values; kept here so that this crate needs no libc.
        match self {
            ErrorKind::Io | ErrorKind::Corrupt => 5,               // EIO
            ErrorKind::NotFound => 2,                              // ENOENT
            ErrorKind::OutOfRange | ErrorKind::InvalidInput => 22, // EINVAL
            ErrorKind::Timeout => 110,                             // ETIMEDOUT
            ErrorKind::Unavailable => 107,                         // ENOTCONN
            ErrorKind::Closed => 108,                              // ESHUTDOWN
            ErrorKind::ReadOnly => 30,                             // EROFS
            ErrorKind::Unsupported => 95,                          // EOPNOTSUPP
            ErrorKind::PermissionDenied => 13,                     // EACCES
            ErrorKind::NoSpace => 28,                              // ENOSPC
            ErrorKind::Cancelled => 125,                           // ECANCELED
            ErrorKind::Fenced => 116,                              // ESTALE
        }
    }

    /// Whether trying the same operation again later may succeed.
    pub fn is_retryable(self) -> bool {
        matches!(self, ErrorKind::Timeout | ErrorKind::Unavailable)
    }

    /// A short lowercase name, stable for logs and wire formats.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Io => "i/o error",
            ErrorKind::NotFound => "not found",
            ErrorKind::OutOfRange => "out of range",
            ErrorKind::InvalidInput => "invalid input",
            ErrorKind::Timeout => "timed out",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Corrupt => "corrupt data",
            ErrorKind::Closed => "closed",
            ErrorKind::ReadOnly => "read-only",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::PermissionDenied => "permission denied",
            ErrorKind::NoSpace => "no space left",
            ErrorKind::Cancelled => "cancelled",
            ErrorKind::Fenced => "fenced",
        }
    }

    /// The kind that best describes an I/O error.
    pub fn from_io(kind: io::ErrorKind) -> Self {
        use io::ErrorKind as K;
        match kind {
            K::NotFound => ErrorKind::NotFound,
            K::PermissionDenied => ErrorKind::PermissionDenied,
            K::TimedOut | K::WouldBlock => ErrorKind::Timeout,
            K::ConnectionRefused
            | K::ConnectionReset
            | K::ConnectionAborted
            | K::NotConnected
            | K::BrokenPipe
            | K::HostUnreachable
            | K::NetworkUnreachable
            | K::NetworkDown
            | K::AddrNotAvailable => ErrorKind::Unavailable,
            K::InvalidInput => ErrorKind::InvalidInput,
            K::InvalidData | K::UnexpectedEof => ErrorKind::Corrupt,
            K::ReadOnlyFilesystem => ErrorKind::ReadOnly,
            K::StorageFull | K::QuotaExceeded | K::FileTooLarge => ErrorKind::NoSpace,
            K::Unsupported => ErrorKind::Unsupported,
            _ => ErrorKind::Io,
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The error of every [`Store`](crate::Store) operation: a [kind](ErrorKind), a sentence of
/// context (what was being done, to what), and optionally the underlying cause.
///
/// The message never repeats its source; use the error chain to see both.
pub struct StoreError {
    kind: ErrorKind,
    context: Cow<'static, str>,
    source: Option<Box<dyn StdError + Send + Sync + 'static>>,
}

impl StoreError {
    /// A new error of `kind` with a context sentence.
    pub fn new(kind: ErrorKind, context: impl Into<Cow<'static, str>>) -> Self {
        Self {
            kind,
            context: context.into(),
            source: None,
        }
    }

    /// Attaches the underlying cause.
    pub fn with_source(mut self, source: impl StdError + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    /// An error for an I/O failure, with its kind derived from the I/O error.
    pub fn io(context: impl Into<Cow<'static, str>>, err: io::Error) -> Self {
        Self::new(ErrorKind::from_io(err.kind()), context).with_source(err)
    }

    /// A chunk index or byte range outside the region.
    pub fn out_of_range(context: impl Into<Cow<'static, str>>) -> Self {
        Self::new(ErrorKind::OutOfRange, context)
    }

    /// A malformed request.
    pub fn invalid(context: impl Into<Cow<'static, str>>) -> Self {
        Self::new(ErrorKind::InvalidInput, context)
    }

    /// What went wrong.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The context sentence.
    pub fn context(&self) -> &str {
        &self.context
    }

    /// The errno a kernel-facing frontend replies with.
    pub fn errno(&self) -> i32 {
        self.kind.errno()
    }

    /// Whether trying again later may succeed.
    pub fn is_retryable(&self) -> bool {
        self.kind.is_retryable()
    }

    /// A copy of this error without its source (sources are not `Clone`); the source's message
    /// is folded into the context so nothing is lost for display.
    pub fn to_owned_lossy(&self) -> Self {
        let context = match &self.source {
            Some(src) => Cow::Owned(format!("{}: {}", self.context, src)),
            None => self.context.clone(),
        };
        Self {
            kind: self.kind,
            context,
            source: None,
        }
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.context, self.kind)
    }
}

impl fmt::Debug for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("StoreError");
        d.field("kind", &self.kind).field("context", &self.context);
        if let Some(src) = &self.source {
            d.field("source", src);
        }
        d.finish()
    }
}

impl StdError for StoreError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn StdError + 'static))
    }
}

impl From<StoreError> for io::Error {
    /// An I/O error whose kind matches the store error's errno and whose inner error (its
    /// `get_ref`, and its `source`) is the store error itself, context and source included.
    fn from(err: StoreError) -> Self {
        let kind = io::Error::from_raw_os_error(err.errno()).kind();
        io::Error::new(kind, err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_lists_every_kind_once() {
        // An exhaustive match: adding a kind fails to compile here until ALL is updated.
        fn position(k: ErrorKind) -> usize {
            match k {
                ErrorKind::Io => 0,
                ErrorKind::NotFound => 1,
                ErrorKind::OutOfRange => 2,
                ErrorKind::InvalidInput => 3,
                ErrorKind::Timeout => 4,
                ErrorKind::Unavailable => 5,
                ErrorKind::Corrupt => 6,
                ErrorKind::Closed => 7,
                ErrorKind::ReadOnly => 8,
                ErrorKind::Unsupported => 9,
                ErrorKind::PermissionDenied => 10,
                ErrorKind::NoSpace => 11,
                ErrorKind::Cancelled => 12,
                ErrorKind::Fenced => 13,
            }
        }
        for (i, k) in ErrorKind::ALL.iter().enumerate() {
            assert_eq!(position(*k), i, "{k:?}");
        }
    }

    #[test]
    fn retryable_kinds() {
        assert!(StoreError::new(ErrorKind::Timeout, "x").is_retryable());
        assert!(StoreError::new(ErrorKind::Unavailable, "x").is_retryable());
        assert!(!StoreError::new(ErrorKind::Io, "x").is_retryable());
        assert!(!StoreError::new(ErrorKind::Corrupt, "x").is_retryable());
    }

    #[test]
    fn io_errors_made_from_store_errors_keep_them() {
        let e = StoreError::io(
            "reading chunk 3 of ./disk.img",
            io::Error::from(io::ErrorKind::NotFound),
        );
        let io_err = io::Error::from(e);
        assert_eq!(io_err.kind(), io::ErrorKind::NotFound);
        let inner = io_err
            .get_ref()
            .and_then(|e| e.downcast_ref::<StoreError>())
            .expect("the store error is kept");
        assert_eq!(inner.kind(), ErrorKind::NotFound);
        assert_eq!(inner.context(), "reading chunk 3 of ./disk.img");
        assert!(inner.source().is_some(), "and its own source");
        let timeout = io::Error::from(StoreError::new(ErrorKind::Timeout, "slow"));
        assert_eq!(timeout.kind(), io::ErrorKind::TimedOut);
    }

    #[test]
    fn io_errors_keep_their_source_and_kind() {
        let e = StoreError::io(
            "reading chunk 3 of ./disk.img",
            io::Error::from(io::ErrorKind::NotFound),
        );
        assert_eq!(e.kind(), ErrorKind::NotFound);
        assert_eq!(e.errno(), 2);
        assert!(e.source().is_some());
        assert_eq!(e.to_string(), "reading chunk 3 of ./disk.img (not found)");
        let lossy = e.to_owned_lossy();
        assert!(lossy.context().contains("entity not found"));
    }
}

/// An error with its whole chain of causes on one line, "a: b: c", skipping a cause whose
/// text the message before it already contains.
pub fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut cur = Some(err);
    while let Some(e) = cur {
        let s = e.to_string();
        if !parts.last().is_some_and(|p| p.contains(&s)) {
            parts.push(s);
        }
        cur = e.source();
    }
    parts.join(": ")
}

#[cfg(test)]
mod chain_tests {
    #[test]
    fn error_chain_joins_causes_and_skips_repeats() {
        let inner = std::io::Error::other("disk on fire");
        let mid = std::io::Error::other(inner);
        let outer =
            super::StoreError::new(super::ErrorKind::Io, "writing chunk 3").with_source(mid);
        let s = super::error_chain(&outer);
        assert!(s.starts_with("writing chunk 3"), "{s}");
        assert_eq!(s.matches("disk on fire").count(), 1, "{s}");
    }
}
