//! Store capabilities, reported apart from data operations (like nbdkit's `can_*`).

use std::fmt;
use std::ops::{BitAnd, BitOr};

/// What a store can do. A stage computes its own caps from its inner store's.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Caps(u32);

impl Caps {
    /// No capability: a read-only store whose flush does nothing.
    pub const NONE: Caps = Caps(0);
    /// `write` is accepted.
    pub const WRITE: Caps = Caps(1 << 0);
    /// `flush` makes written chunks durable (they survive a crash of this process and,
    /// for local storage, of the machine).
    pub const FLUSH: Caps = Caps(1 << 1);
    /// `trim` releases storage (otherwise it only writes zeros, or is refused).
    pub const TRIM: Caps = Caps(1 << 2);
    /// `status` answers [`ChunkStatus::Zero`](crate::ChunkStatus::Zero) or `Data` from
    /// metadata, without reading the chunk.
    pub const STATUS: Caps = Caps(1 << 3);
    /// Different chunks may be read and written concurrently with real parallelism.
    pub const PARALLEL: Caps = Caps(1 << 4);

    const NAMES: [(Caps, &'static str); 5] = [
        (Caps::WRITE, "write"),
        (Caps::FLUSH, "flush"),
        (Caps::TRIM, "trim"),
        (Caps::STATUS, "status"),
        (Caps::PARALLEL, "parallel"),
    ];

    /// Whether every capability in `other` is present.
    pub fn contains(self, other: Caps) -> bool {
        self.0 & other.0 == other.0
    }

    /// This set without the capabilities in `other`.
    pub fn without(self, other: Caps) -> Caps {
        Caps(self.0 & !other.0)
    }

    /// The names of the capabilities present.
    pub fn names(self) -> impl Iterator<Item = &'static str> {
        Self::NAMES
            .into_iter()
            .filter(move |(c, _)| self.contains(*c))
            .map(|(_, n)| n)
    }
}

impl BitOr for Caps {
    type Output = Caps;
    fn bitor(self, rhs: Caps) -> Caps {
        Caps(self.0 | rhs.0)
    }
}

impl BitAnd for Caps {
    type Output = Caps;
    fn bitand(self, rhs: Caps) -> Caps {
        Caps(self.0 & rhs.0)
    }
}

impl fmt::Debug for Caps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Caps(")?;
        f.write_str(&self.names().collect::<Vec<_>>().join("|"))?;
        f.write_str(")")
    }
}

impl fmt::Display for Caps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<_> = self.names().collect();
        if names.is_empty() {
            f.write_str("read-only")
        } else {
            f.write_str(&names.join(","))
        }
    }
}
