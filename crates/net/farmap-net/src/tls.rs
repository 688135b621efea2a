//! TLS and mutual TLS with rustls (ring provider), configured from PEM files.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{AlertDescription, CertificateError, RootCertStore};

/// TLS settings of a server, from PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsServerConfig {
    /// The server's certificate chain (leaf first).
    pub cert: PathBuf,
    /// The server's private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// When set, mutual TLS: every client must present a certificate issued by one of these
    /// CA certificates, or it is refused.
    pub client_ca: Option<PathBuf>,
}

/// TLS settings of a client, from PEM files.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TlsClientConfig {
    /// CA certificates the server's certificate must be issued by.
    pub ca: PathBuf,
    /// The client's certificate chain, for servers that require one (mutual TLS).
    pub cert: Option<PathBuf>,
    /// The private key of `cert`.
    pub key: Option<PathBuf>,
    /// The name the server's certificate must be valid for; by default the host of the
    /// address (`localhost` for Unix sockets).
    pub server_name: Option<String>,
}

/// Why a TLS configuration could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsConfigError {
    /// A PEM file could not be read or holds nothing usable.
    #[error("cannot read the {what} from {}", path.display())]
    Pem {
        /// What the file should hold.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why it could not be read.
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    /// A certificate file without any certificate.
    #[error("{} holds no certificate", path.display())]
    NoCertificate {
        /// The file.
        path: PathBuf,
    },
    /// rustls refused the certificates or key (a key that does not match its certificate...).
    #[error("the {what} cannot be used")]
    Rejected {
        /// What was refused.
        what: &'static str,
        /// rustls's reason.
        #[source]
        source: rustls::Error,
    },
    /// A client certificate without its key or the reverse.
    #[error("a client certificate needs both cert= and key=")]
    IncompleteClientIdentity,
    /// The client CA file could not make a verifier.
    #[error("the client CA certificates in {} cannot verify clients", path.display())]
    ClientCa {
        /// The file.
        path: PathBuf,
        /// rustls's reason.
        #[source]
        source: rustls::server::VerifierBuilderError,
    },
    /// The name to check the server's certificate against is not a DNS name or IP address.
    #[error("{name:?} is not a valid TLS server name")]
    ServerName {
        /// The name.
        name: String,
    },
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certs(path: &Path, what: &'static str) -> Result<Vec<CertificateDer<'static>>, TlsConfigError> {
    let pem_err = |source| TlsConfigError::Pem {
        what,
        path: path.to_owned(),
        source,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(pem_err)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem_err)?;
    if certs.is_empty() {
        return Err(TlsConfigError::NoCertificate {
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

fn key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsConfigError> {
    PrivateKeyDer::from_pem_file(path).map_err(|source| TlsConfigError::Pem {
        what: "private key",
        path: path.to_owned(),
        source,
    })
}

fn roots(path: &Path, what: &'static str) -> Result<RootCertStore, TlsConfigError> {
    let mut roots = RootCertStore::empty();
    for cert in certs(path, what)? {
        roots
            .add(cert)
            .map_err(|source| TlsConfigError::Rejected { what, source })?;
    }
    Ok(roots)
}

fn versions_err(source: rustls::Error) -> TlsConfigError {
    TlsConfigError::Rejected {
        what: "TLS protocol versions",
        source,
    }
}

impl TlsServerConfig {
    /// Reads the PEM files and builds the rustls configuration.
    pub fn build(&self) -> Result<Arc<rustls::ServerConfig>, TlsConfigError> {
        let provider = provider();
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(versions_err)?;
        let builder = match &self.client_ca {
            Some(ca) => {
                let roots = roots(ca, "client CA certificate")?;
                let verifier = WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                    .build()
                    .map_err(|source| TlsConfigError::ClientCa {
                        path: ca.clone(),
                        source,
                    })?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let config = builder
            .with_single_cert(certs(&self.cert, "server certificate")?, key(&self.key)?)
            .map_err(|source| TlsConfigError::Rejected {
                what: "server certificate and key",
                source,
            })?;
        Ok(Arc::new(config))
    }
}

impl TlsClientConfig {
    /// Reads the PEM files and builds the rustls configuration.
    pub fn build(&self) -> Result<Arc<rustls::ClientConfig>, TlsConfigError> {
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(versions_err)?
            .with_root_certificates(roots(&self.ca, "CA certificate")?);
        let config = match (&self.cert, &self.key) {
            (Some(cert), Some(key_path)) => builder
                .with_client_auth_cert(certs(cert, "client certificate")?, key(key_path)?)
                .map_err(|source| TlsConfigError::Rejected {
                    what: "client certificate and key",
                    source,
                })?,
            (None, None) => builder.with_no_client_auth(),
            _ => return Err(TlsConfigError::IncompleteClientIdentity),
        };
        Ok(Arc::new(config))
    }

    /// What connecting to a server reached as `host` needs: the connector and the name its
    /// certificate must carry ([`server_name`](Self::server_name) if set, else `host`).
    pub fn connector(
        &self,
        host: &str,
    ) -> Result<(tokio_rustls::TlsConnector, ServerName<'static>), TlsConfigError> {
        let config = self.build()?;
        let name = self.server_name.clone().unwrap_or_else(|| host.to_owned());
        let name =
            ServerName::try_from(name.clone()).map_err(|_| TlsConfigError::ServerName { name })?;
        Ok((tokio_rustls::TlsConnector::from(config), name))
    }

    /// Whether a client certificate is configured.
    pub fn has_client_cert(&self) -> bool {
        self.cert.is_some()
    }
}

/// The rustls error inside an I/O error from a TLS stream, if that is what it is.
pub(crate) fn rustls_error(err: &io::Error) -> Option<&rustls::Error> {
    err.get_ref()?.downcast_ref::<rustls::Error>()
}

/// A sentence saying why a TLS session could not be established, from the client's side,
/// or `None` when the error is not a TLS failure.
pub fn describe_client_tls_failure(err: &io::Error, sent_cert: bool) -> Option<String> {
    let tls = rustls_error(err)?;
    Some(match tls {
        rustls::Error::AlertReceived(AlertDescription::CertificateRequired) => {
            "the server requires a client certificate (mutual TLS) and none was sent".into()
        }
        rustls::Error::AlertReceived(AlertDescription::HandshakeFailure) if !sent_cert => {
            "the server refused the TLS handshake (it may require a client certificate, and none was sent)".into()
        }
        rustls::Error::AlertReceived(
            AlertDescription::UnknownCA
            | AlertDescription::BadCertificate
            | AlertDescription::CertificateUnknown
            | AlertDescription::UnsupportedCertificate
            | AlertDescription::CertificateExpired
            | AlertDescription::CertificateRevoked
            | AlertDescription::DecryptError
            | AlertDescription::AccessDenied,
        ) => format!(
            "the server did not trust this client's certificate ({})",
            alert_name(tls)
        ),
        rustls::Error::InvalidCertificate(cert) => {
            format!("the server's certificate was not trusted: {}", cert_problem(cert))
        }
        rustls::Error::InvalidMessage(
            rustls::InvalidMessage::InvalidContentType
            | rustls::InvalidMessage::UnknownProtocolVersion,
        ) => "the server did not answer in TLS (a plain farmap server? connect with farmap:// instead of farmaps://)".into(),
        other => format!("the TLS handshake failed: {other}"),
    })
}

fn alert_name(err: &rustls::Error) -> String {
    match err {
        rustls::Error::AlertReceived(a) => format!("{a:?}"),
        other => other.to_string(),
    }
}

fn cert_problem(err: &CertificateError) -> String {
    match err {
        CertificateError::UnknownIssuer => "it is not issued by the configured CA".into(),
        CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => {
            format!("it is not valid for the server name asked for ({err})")
        }
        CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
            format!("it has expired ({err})")
        }
        other => other.to_string(),
    }
}

/// A sentence saying why a client's TLS handshake failed, from the server's side.
pub fn describe_server_tls_failure(err: &io::Error) -> String {
    match rustls_error(err) {
        Some(rustls::Error::NoCertificatesPresented) => {
            "the client sent no certificate, and this server requires one".into()
        }
        Some(rustls::Error::InvalidCertificate(c)) => {
            format!(
                "the client's certificate was not trusted: {}",
                cert_problem(c)
            )
        }
        Some(rustls::Error::InvalidMessage(
            rustls::InvalidMessage::InvalidContentType
            | rustls::InvalidMessage::UnknownProtocolVersion,
        )) => "the client did not start a TLS handshake (a plain farmap:// client? this server requires farmaps://)".into(),
        Some(other) => format!("TLS handshake failed: {other}"),
        None if crate::stream::is_clean_close(err) => {
            "the client closed the connection during the TLS handshake".into()
        }
        None => format!("TLS handshake failed: {err}"),
    }
}
