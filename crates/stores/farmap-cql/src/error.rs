//! The driver's errors as [`StoreError`]s whose kind a frontend can act on.

use farmap_core::{ErrorKind, StoreError};
use scylla::errors::{
    ConnectionPoolError, DbError, ExecutionError, NewSessionError, PrepareError,
    RequestAttemptError,
};

/// The kind of a server-side error.
fn db_kind(db: &DbError, message: &str) -> ErrorKind {
    match db {
        DbError::Unavailable { .. }
        | DbError::Overloaded
        | DbError::IsBootstrapping
        | DbError::RateLimitReached { .. } => ErrorKind::Unavailable,
        DbError::ReadTimeout { .. } | DbError::WriteTimeout { .. } => ErrorKind::Timeout,
        DbError::AuthenticationError | DbError::Unauthorized => ErrorKind::PermissionDenied,
        DbError::Invalid | DbError::ConfigError
            if message.contains("does not exist") || message.contains("unconfigured table") =>
        {
            ErrorKind::NotFound
        }
        DbError::SyntaxError | DbError::Invalid | DbError::ConfigError => ErrorKind::InvalidInput,
        _ => ErrorKind::Io,
    }
}

fn attempt_kind(e: &RequestAttemptError) -> ErrorKind {
    match e {
        RequestAttemptError::DbError(db, message) => db_kind(db, message),
        RequestAttemptError::BrokenConnectionError(_)
        | RequestAttemptError::UnableToAllocStreamId => ErrorKind::Unavailable,
        _ => ErrorKind::Io,
    }
}

fn pool_kind(e: &ConnectionPoolError) -> ErrorKind {
    // A pool broken by refused credentials is not a node that is down.
    if looks_like_auth(&e.to_string()) {
        ErrorKind::PermissionDenied
    } else {
        ErrorKind::Unavailable
    }
}

fn looks_like_auth(text: &str) -> bool {
    let t = text.to_ascii_lowercase();
    t.contains("authenticat") || t.contains("credentials") || t.contains("password")
}

/// The kind of a failed request.
pub(crate) fn execution_kind(e: &ExecutionError) -> ErrorKind {
    match e {
        ExecutionError::LastAttemptError(a) => attempt_kind(a),
        ExecutionError::ConnectionPoolError(p) => pool_kind(p),
        ExecutionError::PrepareError(p) => prepare_kind(p),
        ExecutionError::RequestTimeout(_) => ErrorKind::Timeout,
        ExecutionError::EmptyPlan => ErrorKind::Unavailable,
        ExecutionError::BadQuery(_) => ErrorKind::InvalidInput,
        _ => ErrorKind::Io,
    }
}

/// The kind of a failed prepare.
pub(crate) fn prepare_kind(e: &PrepareError) -> ErrorKind {
    match e {
        PrepareError::ConnectionPoolError(p) => pool_kind(p),
        PrepareError::AllAttemptsFailed { first_attempt } => attempt_kind(first_attempt),
        _ => ErrorKind::Io,
    }
}

/// The kind of a failure to connect.
pub(crate) fn session_kind(e: &NewSessionError) -> ErrorKind {
    let text = e.to_string();
    if looks_like_auth(&text) {
        ErrorKind::PermissionDenied
    } else {
        match e {
            NewSessionError::FailedToResolveAnyHostname(_) => ErrorKind::NotFound,
            NewSessionError::EmptyKnownNodesList | NewSessionError::IllegalConfig(_) => {
                ErrorKind::InvalidInput
            }
            _ => ErrorKind::Unavailable,
        }
    }
}

/// A request error, with `context` saying what was being done to what.
pub(crate) fn execution(context: String, e: ExecutionError) -> StoreError {
    StoreError::new(execution_kind(&e), context).with_source(e)
}

/// A prepare error, with `context`.
pub(crate) fn prepare(context: String, e: PrepareError) -> StoreError {
    StoreError::new(prepare_kind(&e), context).with_source(e)
}
