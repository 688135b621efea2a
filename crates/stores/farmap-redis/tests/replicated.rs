//! `flush=wait` against a real primary with a real replica
//! (scripts/services/redis-replicated.sh): a flush that succeeds has every write on the
//! replica, and it waits on every connection of the pool, however busy the pool is; an
//! object's create waits the same way.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use common::{fresh_store, raw, service};
use farmap_core::{ChunkIdx, Geometry, Objects, Store};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_successful_flush_has_every_write_on_the_replica() {
    let Some(svc) = service(
        "redis-replicated",
        "a_successful_flush_has_every_write_on_the_replica",
    ) else {
        return;
    };
    let g = Geometry::new(64 * 4096, 4096).unwrap();
    let opts = [("flush", "wait"), ("replicas", "1"), ("connections", "4")];
    let s = Arc::new(fresh_store(svc.var("SPEC_BASE"), g, &opts).await);
    let writes = (0..64u64).map(|i| {
        let s = s.clone();
        async move {
            let data = Bytes::from(vec![i as u8 + 1; 4096]);
            s.write(ChunkIdx(i), data).await.unwrap();
        }
    });
    futures::future::join_all(writes).await;
    s.flush().await.expect("one replica acknowledges");
    let mut replica = raw(&format!("127.0.0.1:{}", svc.var("REPLICA_PORT"))).await;
    for i in 0..64u64 {
        let key = s.key(ChunkIdx(i));
        let got: Vec<u8> = redis::cmd("GET")
            .arg(&key)
            .query_async(&mut replica)
            .await
            .unwrap();
        assert_eq!(got, vec![i as u8 + 1; 4096], "{key} on the replica");
    }
}

/// Every command the server runs from now on: (client address, command name in upper case,
/// first argument), from `MONITOR`.
async fn monitor(addr: &str) -> tokio::sync::mpsc::UnboundedReceiver<(String, String, String)> {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"MONITOR\r\n").await.unwrap();
    let mut lines = BufReader::new(s).lines();
    assert_eq!(lines.next_line().await.unwrap().as_deref(), Some("+OK"));
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        // +1700000000.123456 [0 127.0.0.1:54321] "SET" "prefix:3" "..."
        while let Ok(Some(l)) = lines.next_line().await {
            let Some((_, rest)) = l.split_once(" [") else {
                continue;
            };
            let Some((client, cmd)) = rest.split_once("] ") else {
                continue;
            };
            let client = client.split_whitespace().nth(1).unwrap_or("").to_owned();
            let mut words = cmd.split('"').skip(1).step_by(2);
            let name = words.next().unwrap_or("").to_ascii_uppercase();
            let arg = words.next().unwrap_or("").to_owned();
            if tx.send((client, name, arg)).is_err() {
                return;
            }
        }
    });
    rx
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_waits_on_every_connection_that_wrote_even_under_load() {
    let Some(svc) = service(
        "redis-replicated",
        "a_flush_waits_on_every_connection_that_wrote_even_under_load",
    ) else {
        return;
    };
    let g = Geometry::new(256 * 4096, 4096).unwrap();
    let opts = [("flush", "wait"), ("replicas", "1"), ("connections", "4")];
    let s = Arc::new(fresh_store(svc.var("SPEC_BASE"), g, &opts).await);
    let prefix = s.key(ChunkIdx(0));
    let prefix = prefix.trim_end_matches('0').to_owned();
    let mut seen = monitor(&format!("127.0.0.1:{}", svc.var("PORT"))).await;

    // Writers keep the pool busy (and its round-robin counter moving) through every flush.
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..8u64)
        .map(|w| {
            let (s, stop) = (s.clone(), stop.clone());
            tokio::spawn(async move {
                let mut i = w;
                while !stop.load(Ordering::Relaxed) {
                    let data = Bytes::from(vec![i as u8; 4096]);
                    s.write(ChunkIdx(i % 256), data).await.unwrap();
                    i += 8;
                }
            })
        })
        .collect();
    // Each flush between two markers on a connection of the test's own: the server runs
    // the start marker before the flush's first WAIT and the end marker after its last.
    let mut marker = raw(&format!("127.0.0.1:{}", svc.var("PORT"))).await;
    let flushes = 20;
    for n in 0..flushes {
        let _: String = redis::cmd("ECHO")
            .arg(format!("flush-start-{n}"))
            .query_async(&mut marker)
            .await
            .unwrap();
        s.flush().await.expect("the replica acknowledges");
        let _: String = redis::cmd("ECHO")
            .arg(format!("flush-end-{n}"))
            .query_async(&mut marker)
            .await
            .unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await.unwrap();
    }

    // Replay what the server saw: in each flush's window, a WAIT on every connection that
    // carried writes.
    let mut writers_seen = BTreeSet::new();
    let mut waited: Option<BTreeSet<String>> = None;
    let mut windows: HashMap<u32, BTreeSet<String>> = HashMap::new();
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while windows.len() < flushes as usize {
        let Ok(Some((client, name, arg))) = tokio::time::timeout_at(deadline, seen.recv()).await
        else {
            panic!("the monitor saw {} of {flushes} flushes", windows.len());
        };
        match name.as_str() {
            "SET" if arg.starts_with(&prefix) => {
                writers_seen.insert(client);
            }
            "ECHO" if arg.starts_with("flush-start-") => waited = Some(BTreeSet::new()),
            "ECHO" if arg.starts_with("flush-end-") => {
                let n = arg["flush-end-".len()..].parse().unwrap();
                windows.insert(n, waited.take().expect("a start before each end"));
            }
            "WAIT" => {
                if let Some(w) = waited.as_mut() {
                    w.insert(client);
                }
            }
            _ => {}
        }
    }
    assert_eq!(
        writers_seen.len(),
        4,
        "the writes used the whole pool: {writers_seen:?}"
    );
    let mut short: Vec<_> = windows
        .iter()
        // Other tests' connections may send WAITs too: only this store's matter.
        .filter(|(_, w)| !w.is_superset(&writers_seen))
        .map(|(n, w)| (*n, w.len()))
        .collect();
    short.sort();
    assert!(
        short.is_empty(),
        "flushes (number, connections waited on) that left connections that wrote without a \
         WAIT: {short:?}"
    );
}

/// With `flush=wait`, an object's create returns only once the replica has the object and
/// its folder's index (the versioned layout's durability point).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_created_object_is_on_the_replica_when_create_returns() {
    let Some(svc) = service(
        "redis-replicated",
        "a_created_object_is_on_the_replica_when_create_returns",
    ) else {
        return;
    };
    let opts = [("flush", "wait"), ("replicas", "1"), ("connections", "4")];
    let o = common::objects::fresh_objects(svc.var("SPEC_BASE"), "replicated", &opts).await;
    let mut replica = raw(&format!("127.0.0.1:{}", svc.var("REPLICA_PORT"))).await;
    let mut seen = monitor(&format!("127.0.0.1:{}", svc.var("PORT"))).await;
    for i in 0..32u8 {
        let key = format!("chunks/{i:02x}/object-{i}");
        let data = Bytes::from(vec![i + 1; 4096]);
        assert!(o.create(&key, data).await.unwrap());
        let got: Vec<u8> = redis::cmd("GET")
            .arg(o.object_key(&key))
            .query_async(&mut replica)
            .await
            .unwrap();
        assert_eq!(got, vec![i + 1; 4096], "{key} on the replica");
        let index: Vec<String> = redis::cmd("ZRANGE")
            .arg(o.index_key(&format!("chunks/{i:02x}")))
            .arg(0)
            .arg(-1)
            .query_async(&mut replica)
            .await
            .unwrap();
        assert_eq!(
            index,
            [format!("object-{i}")],
            "the index of {key} on the replica"
        );
    }
    // Each create's script was followed by a WAIT on the connection that ran it.
    let mut pending: HashMap<String, u32> = HashMap::new();
    let mut waited = 0;
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while waited < 32 {
        let Ok(Some((client, name, _))) = tokio::time::timeout_at(deadline, seen.recv()).await
        else {
            panic!("the monitor saw {waited} of 32 creates followed by a WAIT");
        };
        match name.as_str() {
            "EVALSHA" | "EVAL" => *pending.entry(client).or_default() += 1,
            "WAIT" => {
                if let Some(n) = pending.get_mut(&client).filter(|n| **n > 0) {
                    *n -= 1;
                    waited += 1;
                }
            }
            _ => {}
        }
    }
}
