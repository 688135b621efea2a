//! Certificates made at run time for TLS tests, as PEM files: a CA, and leaf certificates it
//! signs.
//!
//! [`Pki`] is what most tests need (a CA, a server certificate for `localhost` and
//! `127.0.0.1`, a client certificate), in a temporary directory of its own; [`Ca`] makes more
//! (a second CA that nobody trusts, a certificate for another name). The files are plain
//! paths: each crate's tests build their own TLS configurations from them.

use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, Certificate, CertificateParams, DnType, IsCa, KeyPair};

/// A certificate authority made for one test: its certificate is the PEM file [`Ca::pem`].
pub struct Ca {
    cert: Certificate,
    key: KeyPair,
    /// Its certificate as a PEM file.
    pub pem: PathBuf,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca")
            .field("pem", &self.pem)
            .finish_non_exhaustive()
    }
}

/// A leaf certificate and its key, as PEM files.
#[derive(Debug, Clone)]
pub struct Leaf {
    /// The certificate.
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
}

impl Ca {
    /// A new CA whose subject is `farmap test CA NAME`; its certificate is written to
    /// `DIR/NAME-ca.pem`.
    pub fn new(dir: &Path, name: &str) -> Ca {
        let key = KeyPair::generate().expect("a CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("farmap test CA {name}"));
        let cert = params
            .self_signed(&key)
            .expect("a self-signed CA certificate");
        let pem = dir.join(format!("{name}-ca.pem"));
        write(&pem, &cert.pem());
        Ca { cert, key, pem }
    }

    /// A certificate for `names` (DNS names or IP addresses), signed by this CA, with the
    /// subject `farmap test FILE` (not the CA's: GnuTLS, under nbdkit, qemu-nbd and libnbd,
    /// takes a certificate whose subject is its issuer's for a self-signed one). It is written
    /// to `DIR/FILE.pem`, its key to `DIR/FILE-key.pem`.
    pub fn issue(&self, dir: &Path, file: &str, names: &[&str]) -> Leaf {
        let key = KeyPair::generate().expect("a key");
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        let mut params = CertificateParams::new(names).expect("certificate parameters");
        params
            .distinguished_name
            .push(DnType::CommonName, format!("farmap test {file}"));
        let cert = params
            .signed_by(&key, &self.cert, &self.key)
            .expect("a certificate signed by the CA");
        let leaf = Leaf {
            cert: dir.join(format!("{file}.pem")),
            key: dir.join(format!("{file}-key.pem")),
        };
        write(&leaf.cert, &cert.pem());
        write(&leaf.key, &key.serialize_pem());
        leaf
    }
}

/// Copies each `(file, name)` of `files` to `dir/name` (making `dir`).
fn copy_into(dir: &Path, files: &[(&PathBuf, &str)]) {
    std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("making {}: {e}", dir.display()));
    for (from, name) in files {
        std::fs::copy(from, dir.join(name))
            .unwrap_or_else(|e| panic!("copying {} into {}: {e}", from.display(), dir.display()));
    }
}

fn write(path: &Path, pem: &str) {
    std::fs::write(path, pem).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}

/// A CA and two certificates it signed, in a temporary directory removed when this is
/// dropped: `main-ca.pem`; `server.pem` and `server-key.pem` for `localhost` and `127.0.0.1`;
/// `client.pem` and `client-key.pem` for `client.farmap.test`. The same files are laid out
/// for GnuTLS programs on demand ([`Pki::gnutls_client_dir`], [`Pki::gnutls_server_dir`]).
#[derive(Debug)]
pub struct Pki {
    dir: tempfile::TempDir,
    /// The CA.
    pub ca: Ca,
    /// The server's certificate.
    pub server: Leaf,
    /// The client's certificate.
    pub client: Leaf,
}

impl Pki {
    /// Makes the CA and the certificates (see [`Pki`]).
    pub fn new() -> Pki {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let ca = Ca::new(dir.path(), "main");
        let server = ca.issue(dir.path(), "server", &["localhost", "127.0.0.1"]);
        let client = ca.issue(dir.path(), "client", &["client.farmap.test"]);
        Pki {
            dir,
            ca,
            server,
            client,
        }
    }

    /// The directory holding the files (more may be written there).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// A directory laid out as GnuTLS programs (nbdkit, qemu-nbd, libnbd's
    /// `tls-certificates=DIR`) read it on a client: `ca-cert.pem`, and with `with_cert`
    /// `client-cert.pem` and `client-key.pem` (the client certificate).
    pub fn gnutls_client_dir(&self, with_cert: bool) -> PathBuf {
        let dir = self.dir().join(if with_cert {
            "gnutls-client"
        } else {
            "gnutls-nocert"
        });
        let mut files = vec![(&self.ca.pem, "ca-cert.pem")];
        if with_cert {
            files.push((&self.client.cert, "client-cert.pem"));
            files.push((&self.client.key, "client-key.pem"));
        }
        copy_into(&dir, &files);
        dir
    }

    /// The same for a server (nbdkit's `--tls-certificates`): `ca-cert.pem`, and the server
    /// certificate as `server-cert.pem` and `server-key.pem`.
    pub fn gnutls_server_dir(&self) -> PathBuf {
        let dir = self.dir().join("gnutls-server");
        copy_into(
            &dir,
            &[
                (&self.ca.pem, "ca-cert.pem"),
                (&self.server.cert, "server-cert.pem"),
                (&self.server.key, "server-key.pem"),
            ],
        );
        dir
    }

    /// The files as strings, for command lines: `[ca, server cert, server key, client cert,
    /// client key]`.
    pub fn paths(&self) -> [String; 5] {
        [
            &self.ca.pem,
            &self.server.cert,
            &self.server.key,
            &self.client.cert,
            &self.client.key,
        ]
        .map(|p| p.display().to_string())
    }
}

impl Default for Pki {
    fn default() -> Self {
        Pki::new()
    }
}
