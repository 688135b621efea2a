//! Shared-secret authentication: a [`Key`] both sides hold, proofs that bind it to the
//! nonces of one connection, and the key file an operator copies between hosts.
//!
//! A key never travels. Each side sends a random nonce; each proves it holds the key with an
//! HMAC-SHA256 over a label, both nonces and the context (so a proof is good for one
//! connection, one direction, one purpose), and checks the other's proof in constant time.
//! Keys for narrower purposes ([`Key::derive`]) are HMACs of the parent key: a migration's
//! session key, and from it the key of its data plane.
//!
//! The key file works like SSH's private keys or Erlang's cookie: created once, readable by
//! its owner only (a key file other users can read is refused), copied to the hosts that
//! must trust each other.

use std::fmt;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use ring::hmac;

/// Bytes of a nonce and of a proof.
pub const PROOF_LEN: usize = 32;
/// A nonce: fresh random bytes for each connection.
pub type Nonce = [u8; PROOF_LEN];
/// A proof: HMAC-SHA256 of a transcript under a key.
pub type Proof = [u8; PROOF_LEN];

/// Shortest secret accepted from a key file (a generated one is 64 hex digits).
pub const MIN_SECRET_LEN: usize = 16;
/// Longest key file read.
const MAX_KEY_FILE: u64 = 4096;
/// The environment variable that names the default key file.
pub const KEY_FILE_ENV: &str = "FARMAP_KEY_FILE";

/// A shared secret. Its bytes are never shown (`Debug` prints a fingerprint-free
/// placeholder) and never sent.
#[derive(Clone)]
pub struct Key(hmac::Key);

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Key(..)")
    }
}

/// Why a key could not be had.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// No key file where one was expected.
    #[error(
        "no key file at {}: copy the source host's key file there (it is created by the \
         first `farmap seed`), or pass --key-file",
        path.display()
    )]
    Missing {
        /// Where it was looked for.
        path: PathBuf,
    },
    /// The key file can be read by other users.
    #[error(
        "the key file {} can be read by other users (mode {mode:04o}): run chmod 600 on it",
        path.display()
    )]
    Exposed {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// The key file holds too short (or too long) a secret.
    #[error(
        "the key file {} holds {len} bytes: a key is {MIN_SECRET_LEN} to {MAX_KEY_FILE} \
         bytes (a generated one is 64 hex digits)",
        path.display()
    )]
    BadLength {
        /// The file.
        path: PathBuf,
        /// Bytes of secret found.
        len: usize,
    },
    /// A secret given as text is too short or too long.
    #[error("a key is {MIN_SECRET_LEN} to {MAX_KEY_FILE} bytes; this one is {len}")]
    BadSecret {
        /// Bytes of secret given.
        len: usize,
    },
    /// Neither `FARMAP_KEY_FILE`, `XDG_CONFIG_HOME` nor `HOME` is set.
    #[error(
        "no default key file: set HOME, XDG_CONFIG_HOME or FARMAP_KEY_FILE, or pass --key-file"
    )]
    NoDefault,
    /// Reading or creating the file failed.
    #[error("{what} {}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: io::Error,
    },
}

impl Key {
    /// A key from secret bytes.
    pub fn from_secret(secret: &[u8]) -> Self {
        Self(hmac::Key::new(hmac::HMAC_SHA256, secret))
    }

    /// A fresh random key (for one process: nothing else can know it).
    pub fn random() -> Self {
        Self::from_secret(&random_nonce())
    }

    /// A key for a narrower purpose: `HMAC(self, label || parts)`. Different labels or
    /// parts give unrelated keys; the parent cannot be had back from a derived key.
    pub fn derive(&self, label: &str, parts: &[&[u8]]) -> Key {
        Self::from_secret(&self.prove(label, parts))
    }

    /// The proof of holding this key for `label` over `parts` (nonces and context).
    pub fn prove(&self, label: &str, parts: &[&[u8]]) -> Proof {
        let mut out = [0u8; PROOF_LEN];
        out.copy_from_slice(hmac::sign(&self.0, &transcript(label, parts)).as_ref());
        out
    }

    /// Whether `proof` is [`prove`](Self::prove)'s answer for the same label and parts
    /// (compared in constant time).
    pub fn check(&self, label: &str, parts: &[&[u8]], proof: &Proof) -> bool {
        hmac::verify(&self.0, &transcript(label, parts), proof).is_ok()
    }

    /// Reads the key in `path` (see [`read_secret`]).
    pub fn load(path: &Path) -> Result<Key, KeyError> {
        read_secret(path).map(|s| Key::from_secret(s.as_bytes()))
    }

    /// Reads the key in `path`, creating it first when there is none (see
    /// [`read_or_create_secret`]); returns whether it was created.
    pub fn load_or_create(path: &Path) -> Result<(Key, bool), KeyError> {
        read_or_create_secret(path).map(|(s, c)| (Key::from_secret(s.as_bytes()), c))
    }

    /// A key from a secret given as text (white space around it is not part of it).
    pub fn from_text(text: &str) -> Result<Key, KeyError> {
        let secret = text.trim();
        if !secret_len_ok(secret.len()) {
            return Err(KeyError::BadSecret { len: secret.len() });
        }
        Ok(Key::from_secret(secret.as_bytes()))
    }
}

/// The secret in the key file `path`: its text with surrounding white space removed. A file
/// other users can read or write is refused, and so is one that is not text.
pub fn read_secret(path: &Path) -> Result<String, KeyError> {
    let io = |what| {
        let path = path.to_owned();
        move |source| KeyError::Io { what, path, source }
    };
    let f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(KeyError::Missing {
                path: path.to_owned(),
            })
        }
        Err(e) => return Err(io("cannot open the key file")(e)),
    };
    let meta = f.metadata().map_err(io("cannot read the key file"))?;
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(KeyError::Exposed {
            path: path.to_owned(),
            mode,
        });
    }
    let mut buf = Vec::new();
    io::Read::read_to_end(&mut io::Read::take(f, MAX_KEY_FILE + 1), &mut buf)
        .map_err(io("cannot read the key file"))?;
    let secret = buf.trim_ascii();
    if !secret_len_ok(secret.len()) || buf.len() as u64 > MAX_KEY_FILE {
        return Err(KeyError::BadLength {
            path: path.to_owned(),
            len: secret.len(),
        });
    }
    match std::str::from_utf8(secret) {
        Ok(t) => Ok(t.to_owned()),
        Err(e) => Err(io("the key file is not text:")(io::Error::new(
            io::ErrorKind::InvalidData,
            e,
        ))),
    }
}

/// The secret in the key file `path`, created first (a random 256-bit secret as 64 hex
/// digits, mode 0600, its directory 0700 if new) when there is none; and whether it was
/// created. Processes racing to create it all end up with the same secret: the file appears
/// whole or not at all.
pub fn read_or_create_secret(path: &Path) -> Result<(String, bool), KeyError> {
    match read_secret(path) {
        Err(KeyError::Missing { .. }) => {}
        other => return other.map(|k| (k, false)),
    }
    let io = |what| {
        let path = path.to_owned();
        move |source| KeyError::Io { what, path, source }
    };
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    if let Some(dir) = dir {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io("cannot create the directory of the key file"))?;
    }
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    let written = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        let hex: String = random_nonce().iter().map(|b| format!("{b:02x}")).collect();
        f.write_all(format!("{hex}\n").as_bytes())?;
        f.sync_all()
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(io("cannot write a new key file")(e));
    }
    // A hard link fails if the name exists: whoever linked first made the key.
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    let created = match linked {
        Ok(()) => true,
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => false,
        Err(e) => return Err(io("cannot create the key file")(e)),
    };
    Ok((read_secret(path)?, created))
}

/// A key that can be set later and changed, shared between who decides it and a server that
/// checks it (a migration's data plane starts before its session has a key).
#[derive(Debug, Clone, Default)]
pub struct KeySlot(std::sync::Arc<parking_lot::RwLock<Option<Key>>>);

impl KeySlot {
    /// A slot holding `key`.
    pub fn new(key: Key) -> Self {
        let s = Self::default();
        s.set(Some(key));
        s
    }

    /// The key now (`None`: none yet).
    pub fn get(&self) -> Option<Key> {
        self.0.read().clone()
    }

    /// Sets (or clears) the key; connections already accepted keep theirs.
    pub fn set(&self, key: Option<Key>) {
        *self.0.write() = key;
    }
}

/// Whether a secret of `len` bytes is acceptable.
fn secret_len_ok(len: usize) -> bool {
    (MIN_SECRET_LEN..=MAX_KEY_FILE as usize).contains(&len)
}

/// The bytes a proof is made over: each piece after its length, so that no two different
/// (label, parts) lists give the same bytes.
fn transcript(label: &str, parts: &[&[u8]]) -> Vec<u8> {
    let mut t = Vec::with_capacity(64 + parts.iter().map(|p| p.len() + 4).sum::<usize>());
    for p in std::iter::once(label.as_bytes()).chain(parts.iter().copied()) {
        t.extend_from_slice(&(p.len() as u32).to_be_bytes());
        t.extend_from_slice(p);
    }
    t
}

/// Fresh random bytes from the system's generator.
pub fn random_nonce() -> Nonce {
    let mut n = [0u8; PROOF_LEN];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut n)
        .expect("the system random generator failed");
    n
}

/// The default key file: `$FARMAP_KEY_FILE`, else `$XDG_CONFIG_HOME/farmap/key`, else
/// `$HOME/.config/farmap/key`.
pub fn default_key_file() -> Result<PathBuf, KeyError> {
    let var = |n| std::env::var_os(n).filter(|v| !v.is_empty());
    if let Some(p) = var(KEY_FILE_ENV) {
        return Ok(PathBuf::from(p));
    }
    if let Some(c) = var("XDG_CONFIG_HOME") {
        return Ok(PathBuf::from(c).join("farmap/key"));
    }
    if let Some(h) = var("HOME") {
        return Ok(PathBuf::from(h).join(".config/farmap/key"));
    }
    Err(KeyError::NoDefault)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proof_holds_for_its_key_label_and_parts_only() {
        let k = Key::from_secret(b"0123456789abcdef");
        let p = k.prove("leecher", &[b"n1", b"n2"]);
        assert!(k.check("leecher", &[b"n1", b"n2"], &p));
        assert!(!k.check("seeder", &[b"n1", b"n2"], &p));
        assert!(!k.check("leecher", &[b"n1n", b"2"], &p));
        assert!(!k.check("leecher", &[b"n2", b"n1"], &p));
        let other = Key::from_secret(b"0123456789abcdeF");
        assert!(!other.check("leecher", &[b"n1", b"n2"], &p));
        let d = k.derive("session", &[b"ctx"]);
        assert!(!d.check("leecher", &[b"n1", b"n2"], &p));
        let d2 = k.derive("session", &[b"ctx"]);
        assert_eq!(d.prove("x", &[]), d2.prove("x", &[]));
    }

    #[test]
    fn a_key_file_is_created_private_and_reread_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/key");
        let (k1, created) = Key::load_or_create(&path).unwrap();
        assert!(created);
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        let dmeta = std::fs::metadata(dir.path().join("sub")).unwrap();
        assert_eq!(dmeta.permissions().mode() & 0o777, 0o700);
        let (k2, created) = Key::load_or_create(&path).unwrap();
        assert!(!created);
        assert_eq!(k1.prove("a", &[]), k2.prove("a", &[]));
        assert_eq!(
            std::fs::read_dir(dir.path().join("sub")).unwrap().count(),
            1
        );
    }

    #[test]
    fn exposed_short_and_missing_key_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        assert!(matches!(Key::load(&path), Err(KeyError::Missing { .. })));
        std::fs::write(&path, "0123456789abcdef0123\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = Key::load(&path).unwrap_err();
        assert!(matches!(e, KeyError::Exposed { mode: 0o644, .. }), "{e}");
        assert!(e.to_string().contains("chmod 600"), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        Key::load(&path).unwrap();
        std::fs::write(&path, "  short \n").unwrap();
        assert!(matches!(
            Key::load(&path),
            Err(KeyError::BadLength { len: 5, .. })
        ));
    }
}
