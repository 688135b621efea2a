//! [`SlopeError`].

/// Why an object migration failed. The object stays where it was (and usable there) unless
/// the error says the hand-over was under way.
#[derive(Debug, thiserror::Error)]
pub enum SlopeError {
    /// The connection failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The error.
        source: std::io::Error,
    },
    /// The peer did not prove the key, or refused ours.
    #[error("authentication: {0}")]
    Auth(String),
    /// The peer refused the object (its reason).
    #[error("the peer refused the object: {0}")]
    Refused(String),
    /// The object cannot come into this process (the arenas, builds or slot disagree).
    #[error("the object cannot come here: {0}")]
    Incompatible(String),
    /// The peer broke the protocol.
    #[error("protocol: {0}")]
    Protocol(String),
    /// The object is not this process's to move (its state says where it is).
    #[error("the object in slot {slot} is not here to move ({state})")]
    NotHere {
        /// The slot.
        slot: u32,
        /// Its state, as a word.
        state: &'static str,
    },
    /// Writers did not leave within the patience, every time it was tried.
    #[error("writers of the object did not stop within {0:?}; the object stays here")]
    WritersBusy(std::time::Duration),
    /// The arena's region failed.
    #[error("the arena's region: {0}")]
    Region(#[from] farmap_uffd::RegionError),
}

impl SlopeError {
    pub(crate) fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> SlopeError {
        move |source| SlopeError::Io { what, source }
    }
}
