//! What the migration tests share.
#![allow(dead_code)] // each test file uses part of it

use std::time::Duration;

use farmap_migrate::seed::SeedOptions;

/// Whether userfaultfd works here; prints why a test is skipped if not.
pub fn uffd(test: &str) -> bool {
    match farmap_uffd::probe() {
        Ok(_) => true,
        Err(e) => {
            farmap_testkit::skip(test, e);
            false
        }
    }
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
