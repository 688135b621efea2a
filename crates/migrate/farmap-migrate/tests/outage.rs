//! A link that fails while the leecher opens its data plane: the leecher rides it out under
//! its reconnect rule, as it does for the control connection, instead of abandoning the
//! migration (the cut that `farmap-cli/tests/partition.rs` makes at a random moment).

mod common;
use common::uffd;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use farmap_core::{Geometry, Store};
use farmap_migrate::leech::LeechOptions;
use farmap_migrate::{leech, seed};
use farmap_net::RemoteAddr;
use farmap_store::MemoryStore;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};

const SIZE: u64 = 4 << 20;

/// A relay to `to` that resets the first `resets` connections once their client spoke
/// (mid-handshake, as a cut link does) and relays the rest: its address and how many
/// connections it took.
async fn resetting_relay(to: std::net::SocketAddr, resets: usize) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let taken = Arc::new(AtomicUsize::new(0));
    let count = taken.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut client, _)) = listener.accept().await else {
                return;
            };
            let n = count.fetch_add(1, Ordering::AcqRel);
            tokio::spawn(async move {
                if n < resets {
                    let mut hello = [0u8; 8];
                    let _ = client.read_exact(&mut hello).await;
                    let _ = client.set_zero_linger();
                    return;
                }
                let mut server = TcpStream::connect(to).await.unwrap();
                let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
            });
        }
    });
    (addr, taken)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_plane_reset_during_its_handshake_is_retried() {
    if !uffd("a_data_plane_reset_during_its_handshake_is_retried") {
        return;
    }
    let g = Geometry::new(SIZE, 64 << 10).unwrap();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(g));
    let (region, gate) = common::source_region(store, None, |r| {
        for p in 0..SIZE / 4096 {
            r.write_at((p * 4096) as usize, &[p as u8 | 1; 64]).unwrap();
        }
    })
    .await;
    let seeding = seed(region.clone(), gate, common::seed_options(Duration::ZERO))
        .await
        .unwrap();
    let data = match RemoteAddr::from(&seeding.data) {
        RemoteAddr::Tcp(hp) => tokio::net::lookup_host(hp.as_str())
            .await
            .unwrap()
            .next()
            .unwrap(),
        other => panic!("the test seeder's data plane is on TCP, not {other:?}"),
    };
    let (relay, taken) = resetting_relay(data, 3).await;
    let (_cancel, cancelled) = tokio::sync::watch::channel(false);
    let opts = LeechOptions {
        data: Some(relay.parse().unwrap()),
        ..common::test_leech_options(&seeding.control)
    };
    let report = leech(opts, Box::new(|_, _| {}), cancelled)
        .await
        .expect("the leecher rides out the resets of its data plane");
    seeding.finish().await.expect("the seeder completes");
    assert!(
        taken.load(Ordering::Acquire) > 3,
        "the leecher connected again after the resets"
    );
    let (mut want, mut got) = (vec![0u8; SIZE as usize], vec![0u8; SIZE as usize]);
    region.read_at(0, &mut want).unwrap();
    report.region.read_at(0, &mut got).unwrap();
    assert!(want == got, "the region arrived whole");
}
