//! What can go wrong between us and QEMU's QMP socket.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// A QMP line that cannot be read as a QMP message ([`parse_line`](super::parse_line)).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    /// The line is longer than the codec accepts; nothing of it was parsed.
    #[error("a QMP line of {len} bytes or more is longer than the {max}-byte limit")]
    TooLong {
        /// How many bytes were seen (at least; the reader stops at the limit).
        len: usize,
        /// The limit, [`MAX_LINE`](super::MAX_LINE).
        max: usize,
    },
    /// The line is not UTF-8.
    #[error("a QMP line is not UTF-8")]
    NotUtf8,
    /// The line is not JSON.
    #[error("a QMP line is not JSON")]
    Json(#[source] serde_json::Error),
    /// The line is JSON, but not a QMP message of a known shape.
    #[error("a QMP message is malformed: {what}")]
    Malformed {
        /// What is wrong with it.
        what: &'static str,
    },
}

/// A failure of the QMP client ([`Qmp`](super::Qmp)). Every variant that concerns the socket
/// names its path.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum QmpError {
    /// The socket did not accept a connection before the timeout (QEMU creates it at
    /// start-up; a QEMU that failed to start never does).
    #[error("cannot connect to the QMP socket {}: no QEMU listening after {timeout:?}", path.display())]
    ConnectTimeout {
        /// The socket.
        path: PathBuf,
        /// How long we retried.
        timeout: Duration,
        /// The last connection error.
        #[source]
        source: io::Error,
    },
    /// Reading from or writing to the socket failed.
    #[error("the QMP socket {} failed", path.display())]
    Io {
        /// The socket.
        path: PathBuf,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// QEMU closed the socket (it exited, or it was killed).
    #[error("QEMU closed the QMP socket {}", path.display())]
    Closed {
        /// The socket.
        path: PathBuf,
    },
    /// QEMU sent a line that is not a QMP message.
    #[error("QEMU sent an invalid line on the QMP socket {}", path.display())]
    Codec {
        /// The socket.
        path: PathBuf,
        /// Why the line is invalid.
        #[source]
        source: CodecError,
    },
    /// QEMU sent a valid message where it makes no sense (a second greeting, a first line
    /// that is not a greeting, a reply of the wrong shape).
    #[error("unexpected QMP message on {}: {what}", path.display())]
    Unexpected {
        /// The socket.
        path: PathBuf,
        /// What was expected and what came.
        what: String,
    },
    /// QEMU answered a command with an error.
    #[error("QEMU refused {command}: {desc} ({class})")]
    Qemu {
        /// The command.
        command: String,
        /// The error class (`GenericError`, `CommandNotFound`, ...).
        class: String,
        /// QEMU's description, for people.
        desc: String,
    },
    /// Something awaited on the socket did not come in time.
    #[error("timed out after {timeout:?} waiting for {what} on the QMP socket {}", path.display())]
    Timeout {
        /// The socket.
        path: PathBuf,
        /// What was awaited: a command's reply, an event, a migration status.
        what: String,
        /// The timeout.
        timeout: Duration,
    },
    /// A migration ended (completed, failed or cancelled) without reaching the awaited
    /// status.
    #[error("the migration ended as {status} while waiting for {wanted}{}", error_desc.as_ref().map(|d| format!(": {d}")).unwrap_or_default())]
    MigrationEnded {
        /// The awaited status.
        wanted: String,
        /// The status it ended in.
        status: String,
        /// QEMU's `error-desc` of the migration, when it gave one.
        error_desc: Option<String>,
    },
}

impl QmpError {
    /// The error class of a refused command (`GenericError`, ...), `None` for other errors.
    pub fn qemu_class(&self) -> Option<&str> {
        match self {
            Self::Qemu { class, .. } => Some(class),
            _ => None,
        }
    }
}
