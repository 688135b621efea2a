//! A RemoteStore in front of a served MemoryStore passes the conformance suite every store
//! passes, over TCP, a Unix socket and TLS (each store of the suite gets its own server).

mod common;

use std::sync::Arc;

use common::{addr_of, client, client_tls, connect, memory_server, quiet, server_tls, start};
use farmap_core::Store;
use farmap_net::{ClientOptions, RemoteAddr, ServeOptions};
use farmap_store::MemoryStore;
use farmap_testkit::run_conformance;
use farmap_testkit::tls::Pki;

/// Keeps the server alive as long as the client store: the suite only holds the store.
#[derive(Debug)]
struct Served {
    client: farmap_net::RemoteStore,
    _server: Arc<farmap_net::Server>,
}

impl Store for Served {
    fn geometry(&self) -> farmap_core::Geometry {
        self.client.geometry()
    }
    fn caps(&self) -> farmap_core::Caps {
        self.client.caps()
    }
    fn read(
        &self,
        idx: farmap_core::ChunkIdx,
    ) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<bytes::Bytes>> {
        self.client.read(idx)
    }
    fn write(
        &self,
        idx: farmap_core::ChunkIdx,
        data: bytes::Bytes,
    ) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<()>> {
        self.client.write(idx, data)
    }
    fn flush(&self) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<()>> {
        self.client.flush()
    }
    fn trim(
        &self,
        range: farmap_core::ChunkRange,
    ) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<()>> {
        self.client.trim(range)
    }
    fn status(
        &self,
        idx: farmap_core::ChunkIdx,
    ) -> farmap_core::BoxFuture<'_, farmap_core::StoreResult<farmap_core::ChunkStatus>> {
        self.client.status(idx)
    }
}

async fn served(server: farmap_net::Server, opts: ClientOptions) -> Arc<dyn Store> {
    let client = connect(addr_of(&server), opts).await;
    Arc::new(Served {
        client,
        _server: Arc::new(server),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_store_over_tcp_conforms() {
    run_conformance(|g| async move { served(memory_server(g, quiet()).await, client()).await })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_store_over_unix_socket_conforms() {
    let dir = tempfile::tempdir().unwrap();
    let n = std::sync::atomic::AtomicUsize::new(0);
    let (dir, n) = (&dir, &n);
    run_conformance(|g| async move {
        let i = n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = dir.path().join(format!("s{i}.sock"));
        let server = start(
            Arc::new(MemoryStore::new(g)),
            &format!("unix:{}", path.display()),
            quiet(),
        )
        .await;
        assert_eq!(addr_of(&server), RemoteAddr::Unix(path));
        served(server, client()).await
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_store_over_mutual_tls_conforms() {
    let pki = Pki::new();
    let pki = &pki;
    run_conformance(|g| async move {
        let opts = ServeOptions {
            tls: Some(server_tls(pki, true)),
            ..quiet()
        };
        let server = memory_server(g, opts).await;
        let opts = ClientOptions {
            tls: Some(client_tls(pki, true)),
            ..client()
        };
        served(server, opts).await
    })
    .await;
}
