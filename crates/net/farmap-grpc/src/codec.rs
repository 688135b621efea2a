//! [`ReservingCodec`]: prost's codec, except that a message is encoded into a buffer reserved
//! for its whole length at once.
//!
//! tonic's buffer grows as the message is written into it (doubling), so a read reply of many
//! chunks would be copied on the way and could hold up to twice its size; reserved up front,
//! it is written once and holds what the server charged for it.

use std::marker::PhantomData;

use prost::Message;
use tonic::codec::{BufferSettings, Codec, EncodeBuf, Encoder};
use tonic::Status;
use tonic_prost::{ProstCodec, ProstDecoder};

/// The codec of the generated client and server (see the [module docs](self)).
#[derive(Debug)]
pub(crate) struct ReservingCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for ReservingCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for ReservingCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ReservingEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ReservingEncoder(PhantomData)
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstCodec::<T, U>::raw_decoder(BufferSettings::default())
    }
}

/// Encodes a message into a buffer reserved for its encoded length.
#[derive(Debug)]
pub(crate) struct ReservingEncoder<T>(PhantomData<T>);

impl<T: Message> Encoder for ReservingEncoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        buf.reserve(item.encoded_len());
        item.encode(buf)
            .map_err(|e| Status::internal(format!("encoding a message failed: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use std::pin::pin;
    use std::task::{Context, Poll, Waker};

    use bytes::Bytes;
    use farmap_testkit::alloc::largest_allocation;
    use tonic::codec::{EncodeBody, SingleMessageCompressionOverride};
    use tonic::codegen::{tokio_stream, Body as _};

    use super::*;
    use crate::pb;

    #[test]
    fn a_reply_is_encoded_into_one_buffer_of_its_length() {
        let reply = pb::ReadReply {
            chunks: (0..5u8)
                .map(|i| pb::ChunkReply {
                    result: Some(pb::chunk_reply::Result::Data(Bytes::from(vec![i; 1 << 20]))),
                })
                .collect(),
        };
        let len = reply.encoded_len();
        let encoder = ReservingCodec::<pb::ReadReply, pb::ReadReply>::default().encoder();
        let source = tokio_stream::once(Ok(reply.clone()));
        let mut body = pin!(EncodeBody::new_server(
            encoder,
            source,
            None,
            SingleMessageCompressionOverride::default(),
            None,
        ));
        let mut frame = None;
        let largest = largest_allocation(|| {
            let mut cx = Context::from_waker(Waker::noop());
            frame = match body.as_mut().poll_frame(&mut cx) {
                Poll::Ready(Some(Ok(frame))) => Some(frame),
                other => panic!("no frame: {other:?}"),
            };
        });
        let data = frame.and_then(|f| f.into_data().ok()).expect("data");
        // The gRPC prefix (5 bytes) and the message, in one buffer of about that size (prost's
        // codec grows its buffer to 8 MiB for this 5 MiB message).
        assert_eq!(data.len(), 5 + len);
        assert!(
            largest < len + (64 << 10),
            "a buffer of {largest} bytes for a message of {len}"
        );
        assert_eq!(pb::ReadReply::decode(&data[5..]).expect("decode"), reply);
    }
}
