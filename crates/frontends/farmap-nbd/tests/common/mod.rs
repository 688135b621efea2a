//! Shared helpers: servers over memory stores, their TLS, and reading what a store holds.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use farmap_core::{Geometry, Store};
use farmap_nbd::{serve_nbd, Export, NbdServeOptions, NbdServer};
use farmap_net::{ListenAddr, Listener, TlsServerConfig};
use farmap_store::MemoryStore;
use farmap_testkit::tls::Pki;

/// Server options for tests: quiet, short timeouts.
pub fn quiet() -> NbdServeOptions {
    NbdServeOptions {
        log: false,
        handshake_timeout: Duration::from_secs(10),
        shutdown_grace: Duration::from_secs(5),
        ..NbdServeOptions::default()
    }
}

/// [`quiet`] options with TLS: `pki`'s server certificate; with `mtls`, clients must present
/// a certificate from `pki`'s CA.
pub fn tls_options(pki: &Pki, mtls: bool) -> NbdServeOptions {
    NbdServeOptions {
        tls: Some(TlsServerConfig {
            cert: pki.server.cert.clone(),
            key: pki.server.key.clone(),
            client_ca: mtls.then(|| pki.ca.pem.clone()),
        }),
        ..quiet()
    }
}

pub fn memory(size: u64, chunk: u64) -> Arc<dyn Store> {
    Arc::new(MemoryStore::new(Geometry::new(size, chunk).unwrap()))
}

pub fn export(name: &str, store: Arc<dyn Store>) -> Export {
    Export {
        name: name.into(),
        description: format!("test export {name:?}"),
        store,
        read_only: false,
    }
}

/// Serves `exports` on a free loopback port.
pub async fn start(exports: Vec<Export>, opts: NbdServeOptions) -> NbdServer {
    let addr: ListenAddr = "127.0.0.1:0".parse().unwrap();
    let listener = Listener::bind(&addr).await.unwrap();
    serve_nbd(exports, listener, opts).unwrap()
}

pub fn tcp(server: &NbdServer) -> SocketAddr {
    match server.local_addr() {
        ListenAddr::Tcp(a) => *a,
        other => panic!("{other}"),
    }
}

/// Reads `len` bytes at `offset` of a store.
pub async fn store_bytes(store: &Arc<dyn Store>, offset: u64, len: usize) -> Vec<u8> {
    let u = farmap_pipeline::Unaligned::new(store.clone());
    let mut buf = vec![0; len];
    u.read_at(offset, &mut buf).await.unwrap();
    buf
}
