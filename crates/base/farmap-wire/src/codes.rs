//! Stable numeric codes: error kinds, capability bits, chunk status, feature bits.
//!
//! These numbers are part of the protocol: they never change meaning, whatever the Rust enums
//! and bit sets of `farmap-core` do. New values may be added; a receiver maps an error code it
//! does not know to [`ErrorKind::Io`] and ignores capability and feature bits it does not know.

use std::fmt;
use std::ops::{BitAnd, BitOr};

use farmap_core::{Caps, ChunkStatus, ErrorKind};

use crate::WireError;

/// Error kinds and their wire codes (0 is never sent).
const KIND_CODES: [(ErrorKind, u8); 14] = [
    (ErrorKind::Io, 1),
    (ErrorKind::NotFound, 2),
    (ErrorKind::OutOfRange, 3),
    (ErrorKind::InvalidInput, 4),
    (ErrorKind::Timeout, 5),
    (ErrorKind::Unavailable, 6),
    (ErrorKind::Corrupt, 7),
    (ErrorKind::Closed, 8),
    (ErrorKind::ReadOnly, 9),
    (ErrorKind::Unsupported, 10),
    (ErrorKind::PermissionDenied, 11),
    (ErrorKind::NoSpace, 12),
    (ErrorKind::Cancelled, 13),
    (ErrorKind::Fenced, 14),
];

/// The wire code of an error kind (a kind added to `farmap-core` later travels as `Io`).
pub fn kind_to_code(kind: ErrorKind) -> u8 {
    KIND_CODES
        .iter()
        .find(|(k, _)| *k == kind)
        .map_or(1, |(_, c)| *c)
}

/// The error kind of a wire code; codes this version does not know are [`ErrorKind::Io`].
pub fn kind_from_code(code: u8) -> ErrorKind {
    KIND_CODES
        .iter()
        .find(|(_, c)| *c == code)
        .map_or(ErrorKind::Io, |(k, _)| *k)
}

/// Capabilities and their wire bits.
const CAP_BITS: [(Caps, u32); 5] = [
    (Caps::WRITE, 1 << 0),
    (Caps::FLUSH, 1 << 1),
    (Caps::TRIM, 1 << 2),
    (Caps::STATUS, 1 << 3),
    (Caps::PARALLEL, 1 << 4),
];

/// The wire bits of a capability set.
pub fn caps_to_bits(caps: Caps) -> u32 {
    CAP_BITS
        .iter()
        .filter(|(c, _)| caps.contains(*c))
        .fold(0, |acc, (_, b)| acc | b)
}

/// The capability set of wire bits; unknown bits are ignored.
pub fn caps_from_bits(bits: u32) -> Caps {
    CAP_BITS
        .iter()
        .filter(|(_, b)| bits & b != 0)
        .fold(Caps::NONE, |acc, (c, _)| acc | *c)
}

/// The wire code of a chunk status.
pub fn status_to_code(status: ChunkStatus) -> u8 {
    match status {
        ChunkStatus::Zero => 1,
        ChunkStatus::Data => 2,
        ChunkStatus::Unknown => 3,
    }
}

/// The chunk status of a wire code.
pub fn status_from_code(code: u8) -> Result<ChunkStatus, WireError> {
    match code {
        1 => Ok(ChunkStatus::Zero),
        2 => Ok(ChunkStatus::Data),
        3 => Ok(ChunkStatus::Unknown),
        other => Err(WireError::BadStatus(other)),
    }
}

/// Optional protocol features, asked for by the client and granted by the server (the
/// granted set is the intersection of both). Unknown bits are ignored.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Features(u32);

impl Features {
    /// No optional feature.
    pub const NONE: Features = Features(0);
    /// Writes of all-zero chunks travel as a flag, without payload.
    pub const ZERO_WRITES: Features = Features(1 << 0);
    /// Runs of contiguous chunks are read with one request (`READ_RUN`), answered with a
    /// bitmap of zero chunks and the other chunks' bytes in one piece.
    pub const RUN_READS: Features = Features(1 << 1);
    /// Every feature this version implements that a client asks for by default.
    pub const ALL: Features = Features(Features::ZERO_WRITES.0 | Features::RUN_READS.0);
    /// The client holds a key and answers a server's challenge
    /// ([`ServerHello::Challenge`](crate::ServerHello::Challenge)); a server that requires a
    /// key refuses a client without it, and grants it back once the client proved the key.
    pub const AUTH: Features = Features(1 << 2);
    /// The client wants named objects (a versioned layout's store), not a region: the `OBJ_*`
    /// ops. A server that exports objects grants it, and refuses a client that does not ask
    /// for it; a server that exports a region never grants it.
    pub const OBJECTS: Features = Features(1 << 3);
    /// Every feature this version knows.
    const KNOWN: Features = Features(Features::ALL.0 | Features::AUTH.0 | Features::OBJECTS.0);

    /// The features of raw bits, keeping only those this version knows.
    pub fn from_bits(bits: u32) -> Features {
        Features(bits & Features::KNOWN.0)
    }

    /// The raw bits.
    pub fn bits(self) -> u32 {
        self.0
    }

    /// Whether every feature of `other` is present.
    pub fn contains(self, other: Features) -> bool {
        self.0 & other.0 == other.0
    }
}

impl BitOr for Features {
    type Output = Features;
    fn bitor(self, rhs: Features) -> Features {
        Features(self.0 | rhs.0)
    }
}

impl BitAnd for Features {
    type Output = Features;
    fn bitand(self, rhs: Features) -> Features {
        Features(self.0 & rhs.0)
    }
}

impl fmt::Debug for Features {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Features({:#x})", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_round_trips_and_unknown_codes_are_io() {
        for (kind, code) in KIND_CODES {
            assert_eq!(kind_to_code(kind), code);
            assert_eq!(kind_from_code(code), kind);
        }
        assert_eq!(kind_from_code(0), ErrorKind::Io);
        assert_eq!(kind_from_code(200), ErrorKind::Io);
    }

    #[test]
    fn caps_round_trip_and_unknown_bits_are_ignored() {
        let all = Caps::WRITE | Caps::FLUSH | Caps::TRIM | Caps::STATUS | Caps::PARALLEL;
        assert_eq!(caps_from_bits(caps_to_bits(all)), all);
        assert_eq!(caps_to_bits(Caps::NONE), 0);
        assert_eq!(caps_from_bits(1 << 31), Caps::NONE);
        assert_eq!(caps_from_bits(0b1001), Caps::WRITE | Caps::STATUS);
    }

    #[test]
    fn status_codes() {
        for s in [ChunkStatus::Zero, ChunkStatus::Data, ChunkStatus::Unknown] {
            assert_eq!(status_from_code(status_to_code(s)), Ok(s));
        }
        assert_eq!(status_from_code(0), Err(WireError::BadStatus(0)));
    }

    #[test]
    fn features_keep_known_bits() {
        assert_eq!(
            Features::from_bits(u32::MAX),
            Features::ALL | Features::AUTH | Features::OBJECTS
        );
        assert!(!Features::ALL.contains(Features::OBJECTS));
        assert!(!Features::ALL.contains(Features::AUTH));
        assert!(Features::ALL.contains(Features::ZERO_WRITES));
        assert!(Features::ALL.contains(Features::RUN_READS));
        assert!(!Features::ZERO_WRITES.contains(Features::RUN_READS));
        assert_eq!(Features::ALL & Features::NONE, Features::NONE);
    }
}
