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
