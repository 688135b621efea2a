//! [`Lease`]: the memory one call holds, charged to its connection's
//! [`Budget`], and the two bodies that bound and keep it.
//!
//! - A call takes its lease before its request is read ([`Lease::take`]); a read adds its
//!   reply's charge once it knows its chunks ([`Lease::add`]). A charge that does not come
//!   within the server's wait fails the call with `RESOURCE_EXHAUSTED` ([`busy`]).
//! - [`CappedRequest`]: the request body, refused as soon as its message announces (or
//!   brings) more bytes than its kind may have, before tonic buffers or decodes it.
//! - [`LeasedReply`]: the reply body; every data frame it yields owns a clone of the lease,
//!   so the charge comes back when the last of the reply's bytes is dropped: sent, or thrown
//!   away with its stream. (hyper hands each frame to HTTP/2 whole and ends the body at
//!   once; the frame may then wait for the peer's flow-control window for as long as the
//!   peer likes, and is still memory the call holds.)

use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use farmap_core::{ErrorKind, StoreError};
use farmap_net::budget::{Budget, Charge};
use http_body::{Frame, SizeHint};
use tonic::body::Body;
use tonic::{Code, Status};

use crate::convert::status_with_code;
use crate::sizes::Op;

/// The gRPC prefix of a message: a compression flag and a 4-byte length.
const PREFIX: usize = 5;

/// The memory one call holds (see the [module docs](self)); clones share it.
#[derive(Debug, Clone)]
pub(crate) struct Lease(Arc<Held>);

#[derive(Debug)]
struct Held {
    budget: Budget,
    wait: Duration,
    charge: Mutex<Charge>,
}

impl Lease {
    /// Charges `bytes` to `budget`, waiting at most `wait`; `what` says what for, in the
    /// refusal.
    pub(crate) async fn take(
        budget: Budget,
        bytes: usize,
        wait: Duration,
        what: impl FnOnce() -> String,
    ) -> Result<Lease, Status> {
        let charge = charge(&budget, bytes, wait, what).await?;
        Ok(Lease(Arc::new(Held {
            budget,
            wait,
            charge: Mutex::new(charge),
        })))
    }

    /// Adds `bytes` to the lease, waiting as [`take`](Self::take) does.
    pub(crate) async fn add(
        &self,
        bytes: usize,
        what: impl FnOnce() -> String,
    ) -> Result<(), Status> {
        let more = charge(&self.0.budget, bytes, self.0.wait, what).await?;
        self.0
            .charge
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .merge(more);
        Ok(())
    }

    /// Bytes held.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.0
            .charge
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .bytes()
    }
}

async fn charge(
    budget: &Budget,
    bytes: usize,
    wait: Duration,
    what: impl FnOnce() -> String,
) -> Result<Charge, Status> {
    match tokio::time::timeout(wait, budget.charge(bytes)).await {
        Ok(charge) => Ok(charge),
        Err(_) => Err(busy(&what(), bytes, wait)),
    }
}

/// A call refused because the server's memory for calls stayed in use for `wait`: code
/// `RESOURCE_EXHAUSTED`, kind [`ErrorKind::Unavailable`] (retryable).
pub(crate) fn busy(what: &str, bytes: usize, wait: Duration) -> Status {
    tracing::debug!("refusing {what}: no memory for {bytes} bytes within {wait:?}");
    status_with_code(
        Code::ResourceExhausted,
        &StoreError::new(
            ErrorKind::Unavailable,
            format!(
                "{what}: the server's memory for requests stayed in use for {wait:?} \
                 ({bytes} bytes needed); try again later"
            ),
        ),
    )
}

/// What a [`Wrapped`] body does to each frame of the body it wraps: the frame to yield, or
/// the error that ends the body.
pub(crate) trait OnFrame: Send + Unpin + 'static {
    fn on_frame(&mut self, frame: Frame<Bytes>) -> Result<Frame<Bytes>, Status>;
}

/// A body whose frames pass through an [`OnFrame`] on their way out; errors and the end
/// pass as they are.
#[derive(Debug)]
pub(crate) struct Wrapped<F> {
    inner: Body,
    on: F,
}

impl<F: OnFrame> http_body::Body for Wrapped<F> {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        let frame = ready!(Pin::new(&mut this.inner).poll_frame(cx));
        Poll::Ready(frame.map(|f| f.and_then(|f| this.on.on_frame(f))))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A request body whose one message may have at most `limit` bytes (see the
/// [module docs](self)).
pub(crate) type CappedRequest = Wrapped<Cap>;

/// The bound of a [`CappedRequest`].
#[derive(Debug)]
pub(crate) struct Cap {
    op: Op,
    limit: usize,
    /// Bytes seen so far, and the first [`PREFIX`] of them.
    seen: usize,
    prefix: [u8; PREFIX],
}

impl CappedRequest {
    pub(crate) fn new(inner: Body, op: Op, limit: usize) -> CappedRequest {
        let on = Cap {
            op,
            limit,
            seen: 0,
            prefix: [0; PREFIX],
        };
        Wrapped { inner, on }
    }
}

impl Cap {
    /// Takes in `data`; the message's length as far as known (announced or seen).
    fn take_in(&mut self, data: &[u8]) -> usize {
        if self.seen < PREFIX {
            let n = (PREFIX - self.seen).min(data.len());
            self.prefix[self.seen..self.seen + n].copy_from_slice(&data[..n]);
        }
        self.seen = self.seen.saturating_add(data.len());
        let announced = if self.seen >= PREFIX {
            let [_, a, b, c, d] = self.prefix;
            u32::from_be_bytes([a, b, c, d]) as usize
        } else {
            0
        };
        announced.max(self.seen.saturating_sub(PREFIX))
    }

    fn refusal(&self, len: usize) -> Status {
        crate::convert::status_from_error(&StoreError::invalid(format!(
            "a {} request of {len} bytes exceeds this server's limit of {} bytes",
            self.op.name(),
            self.limit
        )))
    }
}

impl OnFrame for Cap {
    fn on_frame(&mut self, frame: Frame<Bytes>) -> Result<Frame<Bytes>, Status> {
        if let Some(data) = frame.data_ref() {
            let len = self.take_in(data);
            if len > self.limit {
                return Err(self.refusal(len));
            }
        }
        Ok(frame)
    }
}

/// A reply body whose data keeps the call's lease (see the [module docs](self)).
pub(crate) type LeasedReply = Wrapped<Lease>;

impl LeasedReply {
    pub(crate) fn new(inner: Body, lease: Lease) -> LeasedReply {
        Wrapped { inner, on: lease }
    }
}

/// Bytes of a reply and the lease they keep.
struct Leased {
    data: Bytes,
    _lease: Lease,
}

impl AsRef<[u8]> for Leased {
    fn as_ref(&self) -> &[u8] {
        &self.data
    }
}

impl OnFrame for Lease {
    fn on_frame(&mut self, frame: Frame<Bytes>) -> Result<Frame<Bytes>, Status> {
        Ok(frame.map_data(|data| {
            Bytes::from_owner(Leased {
                data,
                _lease: self.clone(),
            })
        }))
    }
}

#[cfg(test)]
mod tests {
    use farmap_net::budget::Total;
    use http_body_util::BodyExt;

    use super::*;

    const WAIT: Duration = Duration::from_millis(50);

    fn body(parts: &[&[u8]]) -> Body {
        let frames: Vec<Result<Frame<Bytes>, Status>> = parts
            .iter()
            .map(|p| Ok(Frame::data(Bytes::copy_from_slice(p))))
            .collect();
        Body::new(http_body_util::StreamBody::new(futures::stream::iter(
            frames,
        )))
    }

    async fn read_all(
        mut b: impl http_body::Body<Data = Bytes, Error = Status> + Unpin,
    ) -> Result<usize, Status> {
        let mut n = 0;
        while let Some(frame) = b.frame().await {
            n += frame?.into_data().map_or(0, |d| d.len());
        }
        Ok(n)
    }

    #[tokio::test]
    async fn a_request_is_refused_on_its_announced_length_or_its_bytes() {
        // A message that fits, its prefix in pieces.
        let ok = CappedRequest::new(body(&[&[0, 0], &[0, 0, 3], b"abc"]), Op::Small, 3);
        assert_eq!(read_all(ok).await.expect("fits"), 8);
        // One that announces more: refused at its prefix, before its bytes.
        let mut big = CappedRequest::new(body(&[&[0, 0, 0, 1, 0], b"x"]), Op::Read, 100);
        let e = big.frame().await.expect("a frame").expect_err("refused");
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(e.message().contains("a read request of 256 bytes"), "{e:?}");
        // One that brings more than it announced.
        let liar = CappedRequest::new(body(&[&[0, 0, 0, 0, 1], b"abcd"]), Op::Write, 3);
        assert!(read_all(liar).await.is_err());
    }

    #[tokio::test]
    async fn a_lease_lasts_as_long_as_its_reply_bytes() {
        let total = Total::new(1000);
        let budget = total.connection(1000, 0);
        let lease = Lease::take(budget.clone(), 300, WAIT, String::new)
            .await
            .expect("charged");
        lease.add(200, String::new).await.expect("charged more");
        assert_eq!(lease.bytes(), 500);
        let mut reply = LeasedReply::new(body(&[b"reply"]), lease);
        let data = reply
            .frame()
            .await
            .expect("a frame")
            .expect("data")
            .into_data()
            .expect("data");
        assert!(reply.frame().await.is_none());
        drop(reply);
        assert_eq!(budget.held(), 500, "the reply's bytes still hold the lease");
        drop(data);
        assert_eq!(budget.held(), 0);
        assert_eq!(total.available(), 1000);
    }

    #[tokio::test]
    async fn a_charge_that_does_not_come_in_time_is_refused_as_busy() {
        let total = Total::new(100);
        let budget = total.connection(100, 0);
        let _held = Lease::take(budget.clone(), 100, WAIT, String::new)
            .await
            .expect("charged");
        let e = Lease::take(budget, 1, WAIT, || "writing chunk 3".into())
            .await
            .expect_err("no room");
        assert_eq!(e.code(), Code::ResourceExhausted);
        assert!(
            e.message()
                .starts_with("writing chunk 3: the server's memory"),
            "{e:?}"
        );
        assert_eq!(
            e.metadata()
                .get(crate::ERROR_KIND_METADATA)
                .and_then(|v| v.to_str().ok()),
            Some("ERROR_KIND_UNAVAILABLE")
        );
    }
}
