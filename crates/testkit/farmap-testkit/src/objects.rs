//! The contract every [`Objects`] keeps, checked the same way for each (a directory, memory,
//! S3): get, exists, create once, list a folder, delete, refuse bad keys, and one winner among
//! racing creators.

use std::sync::Arc;

use bytes::Bytes;
use farmap_core::Objects;

/// Checks `o` (empty) against the [`Objects`] contract; panics naming what broke.
pub async fn check_objects_contract(o: Arc<dyn Objects>) {
    assert_eq!(o.get("a/b").await.unwrap(), None);
    assert!(o.create("a/b", Bytes::from_static(b"one")).await.unwrap());
    assert!(!o.create("a/b", Bytes::from_static(b"two")).await.unwrap());
    assert_eq!(o.get("a/b").await.unwrap().unwrap(), &b"one"[..]);
    assert!(o.exists("a/b").await.unwrap());
    assert!(!o.exists("a/x").await.unwrap());
    assert!(o.create("a/c/d", Bytes::new()).await.unwrap());
    assert!(o.create("a/a", Bytes::new()).await.unwrap());
    assert_eq!(o.list("a").await.unwrap(), ["a", "b", "c"]);
    assert!(o.list("z").await.unwrap().is_empty());
    o.delete("a/b").await.unwrap();
    o.delete("a/b").await.unwrap();
    assert_eq!(o.get("a/b").await.unwrap(), None);
    assert!(!o.exists("a/b").await.unwrap());
    assert!(o.get("../x").await.is_err());
    assert!(o.create("a/.tmp", Bytes::new()).await.is_err());
    // Racing creators of one key: exactly one wins, and its bytes are what stays.
    let tasks: Vec<_> = (0..8u8)
        .map(|i| {
            let o = o.clone();
            tokio::spawn(async move { (i, o.create("race", Bytes::from(vec![i; 4096])).await) })
        })
        .collect();
    let mut winners = Vec::new();
    for t in tasks {
        let (i, won) = t.await.unwrap();
        if won.unwrap() {
            winners.push(i);
        }
    }
    assert_eq!(winners.len(), 1, "one creator wins: {winners:?}");
    let kept = o.get("race").await.unwrap().unwrap();
    assert!(kept == vec![winners[0]; 4096], "the winner's bytes stay");
}
