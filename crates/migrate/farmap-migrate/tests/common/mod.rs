//! What the migration tests share.

pub mod raw;

use std::sync::Arc;
use std::time::Duration;

use farmap_migrate::leech::LeechOptions;
use farmap_migrate::seed::SeedOptions;
use farmap_migrate::{leech, seed, LeechReport, WriterGate};
use farmap_net::RemoteAddr;
use farmap_uffd::Region;

/// Whether userfaultfd works here; records why a test is skipped if not.
pub fn uffd(test: &str) -> bool {
    farmap_testkit::skip::unless(test, farmap_uffd::probe()).is_some()
}

/// A seeder on loopback with no TLS, no log, the default pull, pushing for `push_budget`
/// before an instant hand-over.
pub fn seed_options(push_budget: Duration) -> SeedOptions {
    SeedOptions {
        listen: "127.0.0.1:0".parse().unwrap(),
        data_listen: "127.0.0.1:0".parse().unwrap(),
        tls: None,
        reconnect_wait: Duration::from_secs(5),
        handshake_timeout: Duration::from_secs(5),
        max_handshakes: 64,
        log: false,
        observer: None,
        pull: Default::default(),
        push_budget,
        key: farmap_migrate::auth::process_key(),
    }
}

/// A source region over `store` (direct mode, pushed only when synced, `spec` as its store
/// spec), filled by `fill` on a blocking thread, and the writer gate its writers use.
pub async fn source_region(
    store: std::sync::Arc<dyn farmap_core::Store>,
    spec: Option<String>,
    fill: impl FnOnce(&farmap_uffd::Region) + Send + 'static,
) -> (
    std::sync::Arc<farmap_uffd::Region>,
    std::sync::Arc<farmap_migrate::WriterGate>,
) {
    let region = tokio::task::spawn_blocking(move || {
        let region = farmap_uffd::Region::open(
            store,
            farmap_uffd::RegionOptions {
                push: farmap_pipeline::PushOptions {
                    interval: None,
                    ..farmap_pipeline::PushOptions::default()
                },
                store_spec: spec,
                ..farmap_uffd::RegionOptions::direct()
            },
        )
        .unwrap();
        fill(&region);
        region
    })
    .await
    .unwrap();
    (
        std::sync::Arc::new(region),
        std::sync::Arc::new(farmap_migrate::WriterGate::new(|| {
            bytes::Bytes::from_static(b"state")
        })),
    )
}

/// Leech options for the seeder whose control address is `control`: 5 s to shake hands and
/// to reconnect, the rest the defaults.
#[allow(dead_code)] // not every test file leeches with them
pub fn test_leech_options(control: &farmap_net::ListenAddr) -> LeechOptions {
    LeechOptions {
        handshake_timeout: Duration::from_secs(5),
        reconnect_for: Duration::from_secs(5),
        ..LeechOptions::new(RemoteAddr::from(control))
    }
}

/// Seeds `region` (with [`seed_options`]`(push_budget)`) and moves it to a leecher in this
/// process, with the test's leech options (5 s to shake hands and to reconnect) as changed by
/// `leech_options`: the leech report, once both sides are done.
#[allow(dead_code)] // hostile.rs drives its leechers by hand
pub async fn migrate(
    region: Arc<Region>,
    gate: Arc<WriterGate>,
    push_budget: Duration,
    leech_options: impl FnOnce(LeechOptions) -> LeechOptions,
) -> LeechReport {
    let seeding = seed(region, gate, seed_options(push_budget)).await.unwrap();
    let (_cancel, cancelled) = tokio::sync::watch::channel(false);
    let opts = leech_options(test_leech_options(&seeding.control));
    let report = leech(opts, Box::new(|_, _| {}), cancelled)
        .await
        .expect("the migration completes");
    seeding.finish().await.expect("the seeder completes");
    report
}
