//! Shared helpers: servers over memory stores, clients, TLS configurations from the test
//! kit's certificates.
// Not every test binary uses every helper, and these name farmap-net's own types, so they
// cannot live in farmap-testkit (which does not depend on farmap-net).
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use farmap_core::{Geometry, Store};
use farmap_net::{
    serve, ClientOptions, ListenAddr, Listener, RemoteAddr, RemoteStore, ServeOptions, Server,
    TlsClientConfig, TlsServerConfig,
};
use farmap_store::MemoryStore;
use farmap_testkit::tls::Pki;

/// Server options for tests: quiet, short timeouts.
pub fn quiet() -> ServeOptions {
    ServeOptions {
        log: false,
        handshake_timeout: Duration::from_secs(5),
        shutdown_grace: Duration::from_secs(5),
        ..ServeOptions::default()
    }
}

/// Client options for tests: short timeouts, fast reconnects.
pub fn client() -> ClientOptions {
    ClientOptions {
        connections: 2,
        request_timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(5),
        ..ClientOptions::default()
    }
}

/// Serves `store` on `addr` with `opts`.
pub async fn start(store: Arc<dyn Store>, addr: &str, opts: ServeOptions) -> Server {
    let addr: ListenAddr = addr.parse().unwrap();
    let listener = Listener::bind(&addr).await.unwrap();
    serve(store, listener, opts).unwrap()
}

/// Serves a fresh memory store of geometry `g` on a free loopback port.
pub async fn memory_server(g: Geometry, opts: ServeOptions) -> Server {
    start(Arc::new(MemoryStore::new(g)), "127.0.0.1:0", opts).await
}

/// The client address of a server.
pub fn addr_of(server: &Server) -> RemoteAddr {
    RemoteAddr::from(server.local_addr())
}

/// A server's TLS with `pki`'s server certificate; with `mtls`, clients must present a
/// certificate from `pki`'s CA.
pub fn server_tls(pki: &Pki, mtls: bool) -> TlsServerConfig {
    TlsServerConfig {
        cert: pki.server.cert.clone(),
        key: pki.server.key.clone(),
        client_ca: mtls.then(|| pki.ca.pem.clone()),
    }
}

/// A client's TLS trusting `pki`'s CA; with `with_cert`, presenting `pki`'s client
/// certificate.
pub fn client_tls(pki: &Pki, with_cert: bool) -> TlsClientConfig {
    TlsClientConfig {
        ca: pki.ca.pem.clone(),
        cert: with_cert.then(|| pki.client.cert.clone()),
        key: with_cert.then(|| pki.client.key.clone()),
        server_name: None,
    }
}

/// Connects with `opts`, panicking with the error's text on failure.
pub async fn connect(addr: RemoteAddr, opts: ClientOptions) -> RemoteStore {
    match RemoteStore::connect(addr.clone(), opts).await {
        Ok(s) => s,
        Err(e) => panic!("cannot connect to {addr}: {e}"),
    }
}

/// The TCP address a test server listens on.
pub fn tcp(server: &Server) -> std::net::SocketAddr {
    match server.local_addr() {
        ListenAddr::Tcp(a) => *a,
        other => panic!("{other}"),
    }
}

/// A raw connection that has completed the handshake (the server's hello is read, and
/// nothing follows it).
pub async fn raw_session(addr: std::net::SocketAddr) -> tokio::net::TcpStream {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut out = bytes::BytesMut::new();
    farmap_net::wire::ClientHello::current().encode(&mut out);
    s.write_all(&out).await.unwrap();
    let mut buf = bytes::BytesMut::new();
    loop {
        if let Some(h) = farmap_net::wire::decode_server_hello(&mut buf).unwrap() {
            assert!(
                matches!(h, farmap_net::wire::ServerHello::Accepted(_)),
                "{h:?}"
            );
            assert!(buf.is_empty());
            return s;
        }
        assert!(s.read_buf(&mut buf).await.unwrap() > 0);
    }
}
