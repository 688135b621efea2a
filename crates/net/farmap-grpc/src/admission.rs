//! [`Admission`]: the service in front of the generated server that charges every call to its
//! connection's memory budget before its request is read.
//!
//! For each call, in this order:
//! 1. its kind comes from its path ([`Op`]), and with it the largest message it may have
//!    and what it is charged ([`Sizes`]);
//! 2. it takes a [`Lease`] of that charge from its connection's budget (found in the
//!    request's extensions, put there by the connection, see [`crate::limits`]), waiting at
//!    most the server's wait and otherwise answered `RESOURCE_EXHAUSTED` with its request
//!    unread (HTTP/2 flow control then keeps its bytes in the client);
//! 3. its request body is capped ([`CappedRequest`]) and the lease put in its extensions (a
//!    read adds its reply's charge once its chunks are known);
//! 4. its reply body keeps the lease until the last of its bytes is dropped
//!    ([`LeasedReply`]).

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tonic::body::Body;
use tonic::codegen::http::{Request, Response};
use tonic::codegen::{BoxFuture, Service};
use tonic::Status;

use crate::lease::{CappedRequest, Lease, LeasedReply};
use crate::limits::ConnInfo;
use crate::sizes::{Op, Sizes};

/// Charges every call of `inner` before it runs (see the [module docs](self)).
#[derive(Debug, Clone)]
pub(crate) struct Admission<S> {
    inner: S,
    sizes: Arc<Sizes>,
    wait: Duration,
}

impl<S> Admission<S> {
    /// `inner`, whose calls wait at most `wait` for memory.
    pub(crate) fn new(inner: S, sizes: Sizes, wait: Duration) -> Admission<S> {
        Admission {
            inner,
            sizes: Arc::new(sizes),
            wait,
        }
    }
}

impl<S> Service<Request<Body>> for Admission<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Response<Body>, Infallible>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        // The clone that was made ready is the one that serves this call.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let op = Op::of(request.uri().path());
        let limit = self.sizes.request_limit(op);
        let charge = self.sizes.request_charge(op);
        let wait = self.wait;
        let conn = request.extensions().get::<ConnInfo>().cloned();
        Box::pin(async move {
            let Some(conn) = conn else {
                return Ok(Status::internal("a call without its connection's budget").into_http());
            };
            let what = || format!("a {} request from {}", op.name(), conn.peer());
            let lease = match Lease::take(conn.budget.clone(), charge, wait, what).await {
                Ok(lease) => lease,
                Err(refused) => return Ok(refused.into_http()),
            };
            let (mut parts, body) = request.into_parts();
            parts.extensions.insert(lease.clone());
            let body = Body::new(CappedRequest::new(body, op, limit));
            // Its store operations take the connection's turns.
            let reply = conn
                .lane
                .run(inner.call(Request::from_parts(parts, body)))
                .await?;
            Ok(reply.map(|body| Body::new(LeasedReply::new(body, lease))))
        })
    }
}
