//! Shared helpers: certificates made at run time, servers over memory stores.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use farmap_core::{Geometry, Store};
use farmap_net::{
    serve, ClientOptions, ListenAddr, Listener, RemoteAddr, RemoteStore, ServeOptions, Server,
    TlsClientConfig, TlsServerConfig,
};
use farmap_store::MemoryStore;
use rcgen::{BasicConstraints, Certificate, CertificateParams, IsCa, KeyPair};

/// A certificate authority made for one test.
pub struct Ca {
    cert: Certificate,
    key: KeyPair,
    /// Its certificate as a PEM file.
    pub pem: PathBuf,
}

/// A leaf certificate and key, as PEM files.
pub struct Leaf {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Ca {
    pub fn new(dir: &Path, name: &str) -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, format!("farmap test CA {name}"));
        let cert = params.self_signed(&key).unwrap();
        let pem = dir.join(format!("{name}-ca.pem"));
        std::fs::write(&pem, cert.pem()).unwrap();
        Ca { cert, key, pem }
    }

    /// A certificate for `names` (DNS names or IP addresses), signed by this CA.
    pub fn issue(&self, dir: &Path, file: &str, names: &[&str]) -> Leaf {
        let key = KeyPair::generate().unwrap();
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        let params = CertificateParams::new(names).unwrap();
        let cert = params.signed_by(&key, &self.cert, &self.key).unwrap();
        let leaf = Leaf {
            cert: dir.join(format!("{file}.pem")),
            key: dir.join(format!("{file}-key.pem")),
        };
        std::fs::write(&leaf.cert, cert.pem()).unwrap();
        std::fs::write(&leaf.key, key.serialize_pem()).unwrap();
        leaf
    }
}

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

/// TLS files for a server and a client trusted by it.
pub struct Pki {
    pub dir: tempfile::TempDir,
    pub ca: Ca,
    pub server: Leaf,
    pub client: Leaf,
}

impl Pki {
    pub fn new() -> Pki {
        let dir = tempfile::tempdir().unwrap();
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

    pub fn server_tls(&self, mtls: bool) -> TlsServerConfig {
        TlsServerConfig {
            cert: self.server.cert.clone(),
            key: self.server.key.clone(),
            client_ca: mtls.then(|| self.ca.pem.clone()),
        }
    }

    pub fn client_tls(&self, with_cert: bool) -> TlsClientConfig {
        TlsClientConfig {
            ca: self.ca.pem.clone(),
            cert: with_cert.then(|| self.client.cert.clone()),
            key: with_cert.then(|| self.client.key.clone()),
            server_name: None,
        }
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
