//! TLS and mutual TLS: who is refused, and that the refusal says why.

mod common;

use std::sync::Arc;

use bytes::Bytes;
use common::{addr_of, client, client_tls, connect, memory_server, quiet, server_tls};
use farmap_core::{ChunkIdx, ErrorKind, Geometry, Store};
use farmap_net::{ClientOptions, RemoteStore, ServeOptions, TlsClientConfig};
use farmap_testkit::tls::{Ca, Pki};

fn geometry() -> Geometry {
    Geometry::new(1 << 20, 4096).unwrap()
}

async fn refusal(server: &farmap_net::Server, tls: TlsClientConfig) -> (ErrorKind, String) {
    let opts = ClientOptions {
        tls: Some(tls),
        ..client()
    };
    let err = RemoteStore::connect(addr_of(server), opts)
        .await
        .expect_err("the connection should be refused");
    (err.kind(), err.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_refuses_clients_without_a_trusted_certificate_and_serves_the_others() {
    let pki = Pki::new();
    let opts = ServeOptions {
        tls: Some(server_tls(&pki, true)),
        ..quiet()
    };
    let server = memory_server(geometry(), opts).await;

    // No certificate at all.
    let (kind, msg) = refusal(&server, client_tls(&pki, false)).await;
    assert_eq!(kind, ErrorKind::PermissionDenied, "{msg}");
    assert!(
        msg.contains("requires a client certificate") && msg.contains("none was sent"),
        "{msg}"
    );

    // A certificate from another CA.
    let other = Ca::new(pki.dir(), "other");
    let stranger = other.issue(pki.dir(), "stranger", &["client.farmap.test"]);
    let mut tls = client_tls(&pki, false);
    tls.cert = Some(stranger.cert);
    tls.key = Some(stranger.key);
    let (kind, msg) = refusal(&server, tls).await;
    assert_eq!(kind, ErrorKind::PermissionDenied, "{msg}");
    assert!(
        msg.contains("did not trust this client's certificate"),
        "{msg}"
    );

    // A trusted client is served, by the same server, after the refusals.
    let opts = ClientOptions {
        tls: Some(client_tls(&pki, true)),
        ..client()
    };
    let store = connect(addr_of(&server), opts).await;
    store
        .write(ChunkIdx(3), Bytes::from(vec![9u8; 4096]))
        .await
        .unwrap();
    assert_eq!(store.read(ChunkIdx(3)).await.unwrap()[..], [9u8; 4096][..]);
    drop(store);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_certificate_from_an_unknown_ca_or_for_another_name_is_not_trusted() {
    let pki = Pki::new();
    let opts = ServeOptions {
        tls: Some(server_tls(&pki, false)),
        ..quiet()
    };
    let server = memory_server(geometry(), opts).await;

    let other = Ca::new(pki.dir(), "other");
    let mut tls = client_tls(&pki, false);
    tls.ca = other.pem.clone();
    let (kind, msg) = refusal(&server, tls).await;
    assert_eq!(kind, ErrorKind::PermissionDenied, "{msg}");
    assert!(
        msg.contains("server's certificate was not trusted")
            && msg.contains("not issued by the configured CA"),
        "{msg}"
    );

    let mut tls = client_tls(&pki, false);
    tls.server_name = Some("elsewhere.example".into());
    let (_, msg) = refusal(&server, tls).await;
    assert!(msg.contains("not valid for the server name"), "{msg}");

    // Without mutual TLS, a client without a certificate is fine.
    let opts = ClientOptions {
        tls: Some(client_tls(&pki, false)),
        ..client()
    };
    let store = connect(addr_of(&server), opts).await;
    assert!(farmap_core::is_zero(
        &store.read(ChunkIdx(0)).await.unwrap()
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_and_tls_peers_do_not_hang_each_other() {
    let pki = Pki::new();
    let tls_server = memory_server(
        geometry(),
        ServeOptions {
            tls: Some(server_tls(&pki, false)),
            ..quiet()
        },
    )
    .await;
    let err = RemoteStore::connect(addr_of(&tls_server), client())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("expects TLS"), "{err}");

    let plain_server = memory_server(geometry(), quiet()).await;
    let (_, msg) = refusal(&plain_server, client_tls(&pki, false)).await;
    assert!(msg.contains("TLS with"), "{msg}");
    assert!(
        msg.contains("did not answer in TLS") && msg.contains("farmap://"),
        "a TLS client is told the server is plain: {msg}"
    );
}

#[tokio::test]
async fn unreadable_tls_files_are_named() {
    let pki = Pki::new();
    let mut tls = client_tls(&pki, false);
    tls.ca = pki.dir().join("missing.pem");
    let opts = ClientOptions {
        tls: Some(tls),
        ..client()
    };
    let err = RemoteStore::connect(farmap_net::RemoteAddr::Tcp("127.0.0.1:1".into()), opts)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    let source = std::error::Error::source(&err).unwrap().to_string();
    assert!(source.contains("missing.pem"), "{source}");

    let mut bad = server_tls(&pki, false);
    bad.key = pki.dir().join("nope-key.pem");
    let listener = farmap_net::Listener::bind(&"127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let store: Arc<dyn Store> = Arc::new(farmap_store::MemoryStore::new(geometry()));
    let err = farmap_net::serve(
        store,
        listener,
        ServeOptions {
            tls: Some(bad),
            ..quiet()
        },
    )
    .unwrap_err();
    let chain = format!("{err}: {}", std::error::Error::source(&err).unwrap());
    assert!(chain.contains("nope-key.pem"), "{chain}");
}
