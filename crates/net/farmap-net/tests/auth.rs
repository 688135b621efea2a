//! A server that requires a key serves only clients that prove they hold it; a client with
//! a key trusts only a server that asks for it.

mod common;

use bytes::Bytes;
use farmap_core::{ChunkIdx, ErrorKind, Geometry, Store};
use farmap_net::auth::{Key, KeySlot};
use farmap_net::{ClientOptions, RemoteStore, ServeOptions};

use common::{addr_of, client, memory_server, quiet};

fn geometry() -> Geometry {
    Geometry::new(1 << 20, 64 << 10).unwrap()
}

fn with_key(key: Option<Key>) -> ClientOptions {
    ClientOptions { key, ..client() }
}

fn requiring(slot: &KeySlot) -> ServeOptions {
    ServeOptions {
        auth: Some(slot.clone()),
        ..quiet()
    }
}

#[tokio::test]
async fn only_a_client_with_the_key_is_served() {
    let key = Key::from_secret(b"the operator's secret");
    let slot = KeySlot::new(key.clone());
    let server = memory_server(geometry(), requiring(&slot)).await;
    let addr = addr_of(&server);

    let none = RemoteStore::connect(addr.clone(), client())
        .await
        .unwrap_err();
    assert_eq!(none.kind(), ErrorKind::PermissionDenied, "{none}");
    assert!(none.to_string().contains("requires a key"), "{none}");

    let wrong = Key::from_secret(b"another secret entirely");
    let bad = RemoteStore::connect(addr.clone(), with_key(Some(wrong)))
        .await
        .unwrap_err();
    assert_eq!(bad.kind(), ErrorKind::PermissionDenied, "{bad}");
    assert!(bad.to_string().contains("not this server's"), "{bad}");
    assert_eq!(server.connections(), 0);

    let good = RemoteStore::connect(addr.clone(), with_key(Some(key)))
        .await
        .unwrap();
    let data = Bytes::from(vec![7u8; 64 << 10]);
    good.write(ChunkIdx(3), data.clone()).await.unwrap();
    assert_eq!(good.read(ChunkIdx(3)).await.unwrap(), data);
    drop(good);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn an_empty_slot_refuses_everyone_until_a_key_is_set() {
    let slot = KeySlot::default();
    let server = memory_server(geometry(), requiring(&slot)).await;
    let addr = addr_of(&server);
    let key = Key::from_secret(b"decided later, by a session");
    let early = RemoteStore::connect(addr.clone(), with_key(Some(key.clone())))
        .await
        .unwrap_err();
    assert!(early.to_string().contains("no client yet"), "{early}");
    slot.set(Some(key.clone()));
    let late = RemoteStore::connect(addr.clone(), with_key(Some(key)))
        .await
        .unwrap();
    late.read(ChunkIdx(0)).await.unwrap();
    drop(late);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_client_with_a_key_refuses_a_server_that_does_not_ask_for_it() {
    let server = memory_server(geometry(), quiet()).await;
    let key = Key::from_secret(b"the operator's secret");
    let e = RemoteStore::connect(addr_of(&server), with_key(Some(key)))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
    assert!(e.to_string().contains("did not ask"), "{e}");
    server.shutdown().await.unwrap();
}
