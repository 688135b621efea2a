//! The HTTP client under the S3 client: reqwest with a connection pool sized to the number of
//! requests the store lets into flight, `TCP_NODELAY`, and rustls with the ring provider (the
//! TLS stack the rest of farmap uses; certificates checked against the system's roots).

use std::sync::Arc;
use std::time::Duration;

use object_store::client::{HttpClient, HttpConnector};
use object_store::ClientOptions;

/// Builds one reqwest client per S3 client.
#[derive(Debug, Clone)]
pub(crate) struct Connector {
    /// Idle connections kept per host (the store's request limit, so that a burst of
    /// requests reuses them).
    pub pool: usize,
    /// Deadline of one HTTP request (connect, send, whole answer).
    pub timeout: Duration,
    /// Deadline of one TCP (and TLS) connect.
    pub connect_timeout: Duration,
}

/// Why the HTTP client could not be built.
#[derive(Debug, thiserror::Error)]
#[error("cannot build the HTTP client for S3: {0}")]
struct BuildError(String);

fn tls_config() -> Result<rustls::ClientConfig, BuildError> {
    use rustls_platform_verifier::BuilderVerifierExt;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| BuildError(e.to_string()))?
        .with_platform_verifier()
        .map_err(|e| BuildError(e.to_string()))?
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

impl HttpConnector for Connector {
    fn connect(&self, _options: &ClientOptions) -> object_store::Result<HttpClient> {
        let generic = |e: BuildError| object_store::Error::Generic {
            store: "S3",
            source: Box::new(e),
        };
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(self.pool)
            .pool_idle_timeout(Duration::from_secs(30))
            .http1_only()
            .tcp_nodelay(true)
            .timeout(self.timeout)
            .connect_timeout(self.connect_timeout)
            .no_proxy()
            .tls_backend_preconfigured(tls_config().map_err(generic)?)
            .build()
            .map_err(|e| generic(BuildError(e.to_string())))?;
        Ok(HttpClient::new(client))
    }
}
