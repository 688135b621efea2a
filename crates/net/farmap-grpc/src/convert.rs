//! Conversions between farmap's types and the generated protobuf messages, and between
//! [`StoreError`] and gRPC [`Status`].

use std::error::Error as _;

use farmap_core::{Caps, ChunkStatus, ErrorKind, StoreError};
use tonic::metadata::MetadataValue;
use tonic::{Code, Status};

use crate::pb;

/// The metadata key of a failed call that names its exact error kind, as the name of a
/// `farmap.v1.ErrorKind` value (`ERROR_KIND_OUT_OF_RANGE`).
pub const ERROR_KIND_METADATA: &str = "farmap-error-kind";

/// Error kinds and their protobuf values (the numbers of the native protocol).
const KINDS: [(ErrorKind, pb::ErrorKind); 14] = [
    (ErrorKind::Io, pb::ErrorKind::Io),
    (ErrorKind::NotFound, pb::ErrorKind::NotFound),
    (ErrorKind::OutOfRange, pb::ErrorKind::OutOfRange),
    (ErrorKind::InvalidInput, pb::ErrorKind::InvalidInput),
    (ErrorKind::Timeout, pb::ErrorKind::Timeout),
    (ErrorKind::Unavailable, pb::ErrorKind::Unavailable),
    (ErrorKind::Corrupt, pb::ErrorKind::Corrupt),
    (ErrorKind::Closed, pb::ErrorKind::Closed),
    (ErrorKind::ReadOnly, pb::ErrorKind::ReadOnly),
    (ErrorKind::Unsupported, pb::ErrorKind::Unsupported),
    (ErrorKind::PermissionDenied, pb::ErrorKind::PermissionDenied),
    (ErrorKind::NoSpace, pb::ErrorKind::NoSpace),
    (ErrorKind::Cancelled, pb::ErrorKind::Cancelled),
    (ErrorKind::Fenced, pb::ErrorKind::Fenced),
];

/// The protobuf value of a kind (a kind added to `farmap-core` later travels as `IO`).
pub(crate) fn kind_to_pb(kind: ErrorKind) -> pb::ErrorKind {
    KINDS
        .iter()
        .find(|(k, _)| *k == kind)
        .map_or(pb::ErrorKind::Io, |(_, p)| *p)
}

/// The kind of a protobuf value; values this version does not know are [`ErrorKind::Io`].
pub(crate) fn kind_from_pb(value: i32) -> ErrorKind {
    KINDS
        .iter()
        .find(|(_, p)| *p as i32 == value)
        .map_or(ErrorKind::Io, |(k, _)| *k)
}

/// The gRPC code that best describes a kind, for clients that do not read the metadata.
fn code_of(kind: ErrorKind) -> Code {
    match kind {
        ErrorKind::NotFound => Code::NotFound,
        ErrorKind::OutOfRange => Code::OutOfRange,
        ErrorKind::InvalidInput => Code::InvalidArgument,
        ErrorKind::Timeout => Code::DeadlineExceeded,
        ErrorKind::Unavailable => Code::Unavailable,
        ErrorKind::Corrupt => Code::DataLoss,
        ErrorKind::Closed => Code::Aborted,
        ErrorKind::ReadOnly => Code::FailedPrecondition,
        ErrorKind::Unsupported => Code::Unimplemented,
        ErrorKind::PermissionDenied => Code::PermissionDenied,
        ErrorKind::NoSpace => Code::ResourceExhausted,
        ErrorKind::Cancelled => Code::Cancelled,
        ErrorKind::Fenced => Code::Aborted,
        _ => Code::Internal,
    }
}

/// The kind of a status that carries no farmap metadata (made by the transport, a proxy, or
/// another implementation of the service).
fn kind_of(code: Code) -> ErrorKind {
    match code {
        Code::NotFound => ErrorKind::NotFound,
        Code::OutOfRange => ErrorKind::OutOfRange,
        // Also what tonic answers for a message over the size limit.
        Code::InvalidArgument | Code::ResourceExhausted => ErrorKind::InvalidInput,
        Code::DeadlineExceeded => ErrorKind::Timeout,
        Code::Unavailable => ErrorKind::Unavailable,
        Code::DataLoss => ErrorKind::Corrupt,
        Code::Unimplemented => ErrorKind::Unsupported,
        Code::PermissionDenied | Code::Unauthenticated => ErrorKind::PermissionDenied,
        // The client never cancels its own calls (a dropped call produces no status): a
        // transport-made CANCELLED means the connection closed before the reply came.
        Code::Cancelled => ErrorKind::Unavailable,
        Code::FailedPrecondition => ErrorKind::InvalidInput,
        _ => ErrorKind::Io,
    }
}

/// The message of an error without its kind (the kind travels apart), sources included.
pub(crate) fn message_of(err: &StoreError) -> String {
    err.to_owned_lossy().context().to_owned()
}

/// A failed call: a code for any client, the exact kind in the metadata for farmap's.
pub(crate) fn status_from_error(err: &StoreError) -> Status {
    status_with_code(code_of(err.kind()), err)
}

/// A failed call with a code of its own (not the one its kind maps to) and the exact kind in
/// the metadata.
pub(crate) fn status_with_code(code: Code, err: &StoreError) -> Status {
    let mut status = Status::new(code, message_of(err));
    let name = kind_to_pb(err.kind()).as_str_name();
    status
        .metadata_mut()
        .insert(ERROR_KIND_METADATA, MetadataValue::from_static(name));
    status
}

/// The store error of a failed call; `what` says what was being done, to which server.
pub(crate) fn error_from_status(status: &Status, what: impl FnOnce() -> String) -> StoreError {
    let named = status
        .metadata()
        .get(ERROR_KIND_METADATA)
        .and_then(|v| v.to_str().ok())
        .and_then(pb::ErrorKind::from_str_name);
    // A status with a source was made here, by the transport, never by the server: the
    // connection failed or closed (tonic calls that UNKNOWN "transport error").
    let local = status.source().is_some();
    let kind = match (named, status.code()) {
        (Some(k), _) => kind_from_pb(k as i32),
        (None, Code::Unknown | Code::Internal) if local => ErrorKind::Unavailable,
        (None, code) => kind_of(code),
    };
    let mut detail = if status.message().is_empty() {
        status.code().description().to_owned()
    } else {
        status.message().to_owned()
    };
    let mut source = status.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !detail.contains(&text) {
            detail.push_str(": ");
            detail.push_str(&text);
        }
        source = cause.source();
    }
    StoreError::new(kind, format!("{}: {detail}", what()))
}

/// The error of one failed chunk of a read.
pub(crate) fn error_to_pb(err: &StoreError) -> pb::Error {
    pb::Error {
        kind: kind_to_pb(err.kind()) as i32,
        message: message_of(err),
    }
}

/// Capabilities and their protobuf fields.
pub(crate) fn caps_to_pb(caps: Caps) -> pb::Caps {
    pb::Caps {
        write: caps.contains(Caps::WRITE),
        flush: caps.contains(Caps::FLUSH),
        trim: caps.contains(Caps::TRIM),
        status: caps.contains(Caps::STATUS),
        parallel: caps.contains(Caps::PARALLEL),
    }
}

/// The capabilities of their protobuf fields.
pub(crate) fn caps_from_pb(caps: &pb::Caps) -> Caps {
    [
        (caps.write, Caps::WRITE),
        (caps.flush, Caps::FLUSH),
        (caps.trim, Caps::TRIM),
        (caps.status, Caps::STATUS),
        (caps.parallel, Caps::PARALLEL),
    ]
    .into_iter()
    .filter(|(set, _)| *set)
    .fold(Caps::NONE, |acc, (_, c)| acc | c)
}

/// A chunk status as a protobuf value.
pub(crate) fn status_to_pb(status: ChunkStatus) -> pb::ChunkStatus {
    match status {
        ChunkStatus::Zero => pb::ChunkStatus::Zero,
        ChunkStatus::Data => pb::ChunkStatus::Data,
        ChunkStatus::Unknown => pb::ChunkStatus::Unknown,
    }
}

/// The chunk status of a protobuf value, `None` for an invalid one.
pub(crate) fn status_from_pb(value: i32) -> Option<ChunkStatus> {
    match pb::ChunkStatus::try_from(value).ok()? {
        pb::ChunkStatus::Zero => Some(ChunkStatus::Zero),
        pb::ChunkStatus::Data => Some(ChunkStatus::Data),
        pb::ChunkStatus::Unknown => Some(ChunkStatus::Unknown),
        pb::ChunkStatus::Unspecified => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [ErrorKind; 14] = ErrorKind::ALL;

    #[test]
    fn every_kind_survives_a_status() {
        for kind in ALL {
            let err = StoreError::new(kind, "reading chunk 3");
            let status = status_from_error(&err);
            let back = error_from_status(&status, || "server x".into());
            assert_eq!(back.kind(), kind);
            assert_eq!(back.context(), "server x: reading chunk 3");
            assert_eq!(kind_from_pb(error_to_pb(&err).kind), kind);
        }
        assert_eq!(kind_from_pb(0), ErrorKind::Io);
        assert_eq!(kind_from_pb(999), ErrorKind::Io);
    }

    #[test]
    fn statuses_without_metadata_map_by_code() {
        let s = Status::unavailable("connection refused");
        let e = error_from_status(&s, || "connecting".into());
        assert_eq!(e.kind(), ErrorKind::Unavailable);
        assert!(e.is_retryable());
        let s = Status::cancelled("operation was canceled");
        assert_eq!(
            error_from_status(&s, String::new).kind(),
            ErrorKind::Unavailable
        );
        let s = Status::deadline_exceeded("");
        assert_eq!(
            error_from_status(&s, String::new).kind(),
            ErrorKind::Timeout
        );
    }

    #[test]
    fn caps_and_statuses_round_trip() {
        for caps in [
            Caps::NONE,
            Caps::WRITE | Caps::TRIM,
            Caps::WRITE | Caps::FLUSH | Caps::TRIM | Caps::STATUS | Caps::PARALLEL,
        ] {
            assert_eq!(caps_from_pb(&caps_to_pb(caps)), caps);
        }
        for s in [ChunkStatus::Zero, ChunkStatus::Data, ChunkStatus::Unknown] {
            assert_eq!(status_from_pb(status_to_pb(s) as i32), Some(s));
        }
        assert_eq!(status_from_pb(0), None);
    }
}
