//! The HTTP client: reqwest with a connection pool sized to the number of requests the store
//! lets into flight, `TCP_NODELAY`, no proxy, no compression, and rustls with the ring
//! provider and the system's roots (as `farmap-s3` builds its own).

use std::sync::Arc;
use std::time::Duration;

use farmap_core::{ErrorKind, StoreError, StoreResult};
use reqwest::header::{HeaderMap, HeaderValue, ACCEPT_ENCODING};

/// Deadline of a TCP (and TLS) connect.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Redirects followed before a request fails.
const MAX_REDIRECTS: usize = 5;

fn tls_config() -> Result<rustls::ClientConfig, String> {
    use rustls_platform_verifier::BuilderVerifierExt;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_platform_verifier()
        .map_err(|e| e.to_string())?
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// A client keeping `pool` idle connections, each request bounded by `timeout`.
pub(crate) fn build(pool: usize, timeout: Duration) -> StoreResult<reqwest::Client> {
    let failed = |why: String| {
        StoreError::new(
            ErrorKind::Io,
            format!("cannot build the HTTP client: {why}"),
        )
    };
    let mut headers = HeaderMap::new();
    // A range of a compressed representation is a range of the compressed bytes.
    headers.insert(ACCEPT_ENCODING, HeaderValue::from_static("identity"));
    reqwest::Client::builder()
        .default_headers(headers)
        .pool_max_idle_per_host(pool)
        .pool_idle_timeout(Duration::from_secs(30))
        .http1_only()
        .tcp_nodelay(true)
        .timeout(timeout)
        .connect_timeout(CONNECT_TIMEOUT)
        .redirect(reqwest::redirect::Policy::limited(MAX_REDIRECTS))
        .no_proxy()
        .tls_backend_preconfigured(tls_config().map_err(failed)?)
        .build()
        .map_err(|e| failed(e.to_string()))
}
