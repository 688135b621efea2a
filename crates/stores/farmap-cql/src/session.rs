//! Connecting to a cluster: what [`CqlStore`](crate::CqlStore) and
//! [`CqlObjects`](crate::CqlObjects) share (contact points, credentials, the request deadline,
//! client-side timestamps, the pool size, the default consistency).

use std::num::NonZeroUsize;
use std::sync::Arc;

use farmap_core::{ErrorKind, StoreError, StoreResult};
use scylla::client::execution_profile::ExecutionProfile;
use scylla::client::session::Session;
use scylla::client::session_builder::SessionBuilder;
use scylla::client::PoolSize;
use scylla::policies::timestamp_generator::MonotonicTimestampGenerator;

use crate::config::{CqlTarget, PASSWORD_ENV};
use crate::error;

/// How long connecting to one node may take.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The deadline of a request when the spec sets none (the driver's own default).
const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// A session to the cluster `t` names: requests run at `t.consistency` with `t.timeout`, and
/// carry client-side timestamps from one monotonic clock (so that of two writes of one
/// session the later wins). A user without a password reads it from [`PASSWORD_ENV`].
pub(crate) async fn connect(t: &CqlTarget) -> StoreResult<Session> {
    let server = t.redacted();
    let mut builder = SessionBuilder::new()
        .known_nodes(&t.nodes)
        .connection_timeout(CONNECT_TIMEOUT)
        .timestamp_generator(Arc::new(MonotonicTimestampGenerator::new()))
        .default_execution_profile_handle(
            ExecutionProfile::builder()
                .consistency(t.consistency.to_driver())
                .request_timeout(Some(t.timeout.unwrap_or(REQUEST_TIMEOUT)))
                .build()
                .into_handle(),
        );
    if let Some(n) = t.connections.and_then(NonZeroUsize::new) {
        builder = builder.pool_size(PoolSize::PerShard(n));
    }
    if let Some(user) = &t.user {
        let password = match &t.password {
            Some(p) => p.clone(),
            None => std::env::var(PASSWORD_ENV).map_err(|_| {
                StoreError::new(
                    ErrorKind::PermissionDenied,
                    format!(
                        "{server} names user {user} but no password: write user:password@ \
                         or set {PASSWORD_ENV}"
                    ),
                )
            })?,
        };
        builder = builder.user(user.clone(), password);
    }
    builder.build().await.map_err(|e| {
        let kind = error::session_kind(&e);
        let what = match kind {
            ErrorKind::PermissionDenied => "the server refused the credentials",
            ErrorKind::NotFound => "no node name resolves",
            _ => "no node answers",
        };
        StoreError::new(
            kind,
            format!("cannot connect to {} ({what})", t.nodes.join(", ")),
        )
        .with_source(e)
    })
}
