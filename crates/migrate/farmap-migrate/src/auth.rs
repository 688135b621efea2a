//! Who may take a migration: both sides prove they hold the operator's key before the
//! leecher's `Hello`, a session has a key of its own that a reconnect must prove, and the
//! data plane serves only the holder of the session's key.
//!
//! ```text
//!   L→S  AuthHello     { session (0: new), nonce_l }
//!   S→L  AuthChallenge { nonce_s, HMAC(k, "seeder"  | session | nonce_l | nonce_s) }
//!   L→S  AuthProof     { HMAC(k, "leecher" | session | nonce_l | nonce_s) }
//!   L→S  Hello { session, mode } ...
//! ```
//!
//! `k` is the operator's key for a new session; the session key for a reconnect. A new
//! session's key is derived from the operator's key and that connection's nonces, so only
//! the two peers of that connection know it; the data plane's key is derived from it. The
//! seeder proves itself first, so a leecher reveals nothing to an impostor; either side
//! refuses on a bad proof. Nothing secret travels: without TLS, someone who can read the
//! traffic sees the region's pages, but cannot take the migration over or reconnect in the
//! leecher's place.

use std::io;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use farmap_net::auth::{random_nonce, Key, KeySlot, Nonce, Proof};
use parking_lot::Mutex;

use crate::channel::Channel;
use crate::msg::{Msg, SessionId};

const SEEDER: &str = "farmap migration v2: seeder";
const LEECHER: &str = "farmap migration v2: leecher";
const SESSION: &str = "farmap migration v2: session";
const DATA_PLANE: &str = "farmap migration v2: data plane";

/// A connection both sides proved, and the key of its session.
#[derive(Debug, Clone)]
pub struct Proven {
    /// The session the leecher asked to continue (0: a new one).
    pub session: SessionId,
    /// The session's key: derived here for a new session, the known one for a reconnect.
    pub session_key: Key,
}

impl Proven {
    /// The key the session's data plane requires.
    pub fn data_key(&self) -> Key {
        data_key(&self.session_key)
    }
}

/// The key a session's data plane requires.
pub fn data_key(session_key: &Key) -> Key {
    session_key.derive(DATA_PLANE, &[])
}

fn parts<'a>(session: &'a [u8; 16], l: &'a Nonce, s: &'a Nonce) -> [&'a [u8]; 3] {
    [session, l, s]
}

/// The seeder's side: the sessions a reconnect may continue, and the data plane's key.
#[derive(Debug, Clone)]
pub struct SeederKeys {
    /// The operator's key: proves a new session.
    pub base: Key,
    /// The session a reconnect may continue, with its key (one at a time).
    session: Arc<Mutex<Option<(SessionId, Key)>>>,
    /// What the data plane requires: the current session's data key.
    pub data: KeySlot,
}

impl SeederKeys {
    /// Keys for a seeder whose operator's key is `base`; no session yet (the data plane
    /// refuses everyone).
    pub fn new(base: Key) -> Self {
        Self {
            base,
            session: Arc::default(),
            data: KeySlot::default(),
        }
    }

    /// A session began: reconnects to `id` must prove `key`, and the data plane serves the
    /// holder of its data key only.
    pub fn begin(&self, id: SessionId, key: &Key) {
        *self.session.lock() = Some((id, key.clone()));
        self.data.set(Some(data_key(key)));
    }

    fn key_of(&self, id: SessionId) -> Option<Key> {
        match &*self.session.lock() {
            Some((s, k)) if *s == id => Some(k.clone()),
            _ => None,
        }
    }
}

/// The seeder's half of one exchange, between its challenge and the leecher's proof (no
/// I/O: [`seeder`] runs it on a channel).
#[derive(Debug)]
pub struct SeederExchange {
    key: Key,
    base: Key,
    session: SessionId,
    nonce_l: Nonce,
    nonce_s: Nonce,
}

impl SeederExchange {
    /// Answers an `AuthHello` for `session` with nonce `nonce_l`: `key` is the key that
    /// session must prove (`base`, the operator's key, for a new session). Returns the
    /// `AuthChallenge` to send.
    pub fn start(key: Key, base: Key, session: SessionId, nonce_l: Nonce) -> (Self, Msg) {
        let nonce_s = random_nonce();
        let id = session.to_be_bytes();
        let proof = key.prove(SEEDER, &parts(&id, &nonce_l, &nonce_s));
        let ex = Self {
            key,
            base,
            session,
            nonce_l,
            nonce_s,
        };
        (
            ex,
            Msg::AuthChallenge {
                nonce: nonce_s,
                proof,
            },
        )
    }

    /// Checks the leecher's proof: what it proved, or `None` for a wrong proof.
    pub fn finish(self, proof: &Proof) -> Option<Proven> {
        let id = self.session.to_be_bytes();
        if !self
            .key
            .check(LEECHER, &parts(&id, &self.nonce_l, &self.nonce_s), proof)
        {
            return None;
        }
        let session_key = if self.session == 0 {
            self.base.derive(SESSION, &[&self.nonce_l, &self.nonce_s])
        } else {
            self.key
        };
        Some(Proven {
            session: self.session,
            session_key,
        })
    }
}

/// The leecher's half of one exchange, between its hello and the seeder's challenge (no
/// I/O: [`leecher`] runs it on a channel).
#[derive(Debug)]
pub struct LeecherExchange {
    key: Key,
    session: SessionId,
    nonce_l: Nonce,
}

impl LeecherExchange {
    /// Starts an exchange for `session` (0: a new one, proving the operator's `key`; else
    /// `key` is the session's). Returns the `AuthHello` to send.
    pub fn start(key: &Key, session: SessionId) -> (Self, Msg) {
        let nonce_l = random_nonce();
        let ex = Self {
            key: key.clone(),
            session,
            nonce_l,
        };
        (
            ex,
            Msg::AuthHello {
                session,
                nonce: nonce_l,
            },
        )
    }

    /// Checks the seeder's challenge: the `AuthProof` to send and what was proven, or
    /// [`LeecherAuthError::Impostor`].
    pub fn answer(self, nonce_s: &Nonce, proof: &Proof) -> Result<(Msg, Proven), LeecherAuthError> {
        let id = self.session.to_be_bytes();
        let p = parts(&id, &self.nonce_l, nonce_s);
        if !self.key.check(SEEDER, &p, proof) {
            return Err(LeecherAuthError::Impostor);
        }
        let answer = Msg::AuthProof {
            proof: self.key.prove(LEECHER, &p),
        };
        let session_key = if self.session == 0 {
            self.key.derive(SESSION, &[&self.nonce_l, nonce_s])
        } else {
            self.key
        };
        let proven = Proven {
            session: self.session,
            session_key,
        };
        Ok((answer, proven))
    }
}

/// Tells the peer why it is refused; the reason, as the error.
async fn refuse(ch: &mut Channel, why: String) -> Result<Proven, String> {
    let _ = ch
        .send(&Msg::Abort {
            reason: why.clone(),
        })
        .await;
    Err(why)
}

/// Runs the seeder's side of the exchange on a fresh connection. `Err` is why the peer was
/// refused (it was told, with an `Abort`).
pub async fn seeder(ch: &mut Channel, keys: &SeederKeys) -> Result<Proven, String> {
    seeder_noting(ch, keys, &AtomicU8::new(0)).await
}

/// How far a control connection's handshake has come (see [`seeder_noting`]).
pub(crate) mod stage {
    /// Connected; nothing received yet.
    pub const CONNECTED: u8 = 0;
    /// Its authentication hello came: it waits for its proof.
    pub const HELLO: u8 = 1;
    /// It proved it holds the key.
    pub const PROVEN: u8 = 2;
}

/// [`seeder`], noting in `progress` how far it came ([`stage`]).
pub(crate) async fn seeder_noting(
    ch: &mut Channel,
    keys: &SeederKeys,
    progress: &AtomicU8,
) -> Result<Proven, String> {
    let (session, nonce_l) = match ch.recv().await {
        Ok(Some(Msg::AuthHello { session, nonce })) => {
            progress.store(stage::HELLO, Ordering::Relaxed);
            (session, nonce)
        }
        Ok(Some(Msg::Hello { .. })) => {
            let why = "this seeder requires the migration key: the leecher is older than this \
                       protocol, or does not authenticate"
                .to_owned();
            return refuse(ch, why).await;
        }
        Ok(Some(other)) => {
            let why = format!("expected an authentication hello, got {}", other.name());
            return refuse(ch, why).await;
        }
        Ok(None) => return Err("it closed without a message".into()),
        Err(e) => return refuse(ch, format!("not a migration message: {e}")).await,
    };
    let key = if session == 0 {
        keys.base.clone()
    } else {
        match keys.key_of(session) {
            Some(k) => k,
            None => {
                let why = "the seeder has no such session to continue".to_owned();
                return refuse(ch, why).await;
            }
        }
    };
    let (exchange, challenge) = SeederExchange::start(key, keys.base.clone(), session, nonce_l);
    ch.send(&challenge)
        .await
        .map_err(|e| format!("the connection failed during authentication: {e}"))?;
    let proof = match ch.recv().await {
        Ok(Some(Msg::AuthProof { proof })) => proof,
        Ok(Some(Msg::Abort { reason })) => return Err(format!("the leecher gave up: {reason}")),
        Ok(Some(other)) => {
            let why = format!("expected an authentication proof, got {}", other.name());
            return refuse(ch, why).await;
        }
        Ok(None) => return Err("it closed during authentication".into()),
        Err(e) => return refuse(ch, format!("not a migration message: {e}")).await,
    };
    match exchange.finish(&proof) {
        Some(proven) => {
            progress.store(stage::PROVEN, Ordering::Relaxed);
            Ok(proven)
        }
        None => {
            let why = if session == 0 {
                "authentication failed: the leecher's migration key is not this seeder's (copy \
                 the source host's key file to the destination, or pass the same --key-file)"
            } else {
                "authentication failed: the leecher does not hold this session's key"
            };
            refuse(ch, why.to_owned()).await
        }
    }
}

/// Why the leecher's side of the exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum LeecherAuthError {
    /// The seeder refused (with its reason).
    #[error("the seeder refused: {0}")]
    Refused(String),
    /// The seeder's proof is wrong: it does not hold the key.
    #[error(
        "the seeder did not prove it holds the migration key: the two hosts' keys differ, or \
         this is not the seeder it claims to be"
    )]
    Impostor,
    /// The seeder answered with something else.
    #[error("the seeder answered the authentication hello with {0}")]
    Unexpected(&'static str),
    /// The connection failed or closed.
    #[error("the connection failed during authentication")]
    Io(#[source] io::Error),
}

/// Runs the leecher's side: `key` is the operator's key for a new session (`session` 0),
/// the session key for a reconnect.
pub async fn leecher(
    ch: &mut Channel,
    key: &Key,
    session: SessionId,
) -> Result<Proven, LeecherAuthError> {
    let (exchange, hello) = LeecherExchange::start(key, session);
    ch.send(&hello).await.map_err(LeecherAuthError::Io)?;
    let (nonce_s, proof) = match ch.recv().await.map_err(LeecherAuthError::Io)? {
        Some(Msg::AuthChallenge { nonce, proof }) => (nonce, proof),
        Some(Msg::Abort { reason }) => return Err(LeecherAuthError::Refused(reason)),
        Some(other) => return Err(LeecherAuthError::Unexpected(other.name())),
        None => {
            return Err(LeecherAuthError::Io(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the seeder closed the connection",
            )))
        }
    };
    match exchange.answer(&nonce_s, &proof) {
        Ok((answer, proven)) => {
            ch.send(&answer).await.map_err(LeecherAuthError::Io)?;
            Ok(proven)
        }
        Err(e) => {
            let _ = ch
                .send(&Msg::Abort {
                    reason: "the seeder's proof of the migration key is wrong".into(),
                })
                .await;
            Err(e)
        }
    }
}

/// The key of seeders and leechers built without one: random for this process, so that
/// both sides of an in-process migration agree and nothing outside the process can join.
pub fn process_key() -> Key {
    static KEY: std::sync::OnceLock<Key> = std::sync::OnceLock::new();
    KEY.get_or_init(Key::random).clone()
}
