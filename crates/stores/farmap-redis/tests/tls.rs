//! `rediss://` against a real redis-server that speaks only TLS (scripts/services/redis-tls.sh,
//! with a CA made by openssl): the conformance suite over TLS, and a server whose certificate
//! a wrong CA did not sign is refused with an error that says so.

mod common;

use common::{config, fresh_dyn, service};
use farmap_core::Geometry;
use farmap_redis::RedisStore;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conforms_over_tls() {
    let Some(svc) = service("redis-tls", "conforms_over_tls") else {
        return;
    };
    let base = svc.var("SPEC_BASE").to_owned();
    let ca = svc.var("CA").to_owned();
    assert!(base.starts_with("rediss://"), "{base}");
    farmap_testkit::run_conformance(|g| {
        let (base, ca) = (base.clone(), ca.clone());
        async move { fresh_dyn(&base, g, &[("ca", &ca)]).await }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_the_ca_did_not_sign_is_refused() {
    let Some(svc) = service("redis-tls", "a_server_the_ca_did_not_sign_is_refused") else {
        return;
    };
    let base = svc.var("SPEC_BASE");
    let g = Geometry::new(1 << 20, 64 << 10).unwrap();
    let open = |ca: String| async move {
        let c = config(base, &[("ca", &ca), ("timeout", "5s")]);
        RedisStore::open(&c, Some(g.size()), Some(g.chunk_size())).await
    };
    let e = open(svc.var("WRONG_CA").to_owned())
        .await
        .expect_err("a server certificate from another CA is refused");
    let chain = farmap_core::error_chain(&e);
    assert!(
        chain.contains(&svc.var("PORT").to_string()),
        "names the server: {chain}"
    );
    assert!(
        chain.contains("certificate") && chain.contains("ca="),
        "says the certificate is not trusted and what to check: {chain}"
    );
    // The right CA opens it (so the refusal was the CA's doing).
    open(svc.var("CA").to_owned())
        .await
        .expect("the right CA is accepted");
    // A CA file that is not there is named.
    let e = open("/nonexistent/ca.pem".into())
        .await
        .expect_err("no CA file");
    let chain = farmap_core::error_chain(&e);
    assert!(chain.contains("/nonexistent/ca.pem"), "{chain}");
}
