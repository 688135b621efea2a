//! Sending and receiving [`ObjMsg`]s over an authenticated farmap-migrate channel.

use farmap_migrate::channel::Channel;
use farmap_migrate::msg::Msg;

use crate::error::SlopeError;
use crate::msg::ObjMsg;

/// Sends `m` as a `Msg::Object` frame.
pub(crate) async fn send(ch: &mut Channel, m: &ObjMsg) -> Result<(), SlopeError> {
    ch.send(&Msg::Object(m.encode()))
        .await
        .map_err(SlopeError::io("sending an object message"))
}

/// The next object message; an `Abort` from the peer becomes [`SlopeError::Refused`], a
/// closed connection or any other frame a protocol error.
pub(crate) async fn recv(ch: &mut Channel) -> Result<ObjMsg, SlopeError> {
    match ch
        .recv()
        .await
        .map_err(SlopeError::io("receiving an object message"))?
    {
        Some(Msg::Object(b)) => {
            match ObjMsg::decode_shared(&b).map_err(|e| SlopeError::Protocol(e.to_string()))? {
                ObjMsg::Abort { reason } => Err(SlopeError::Refused(reason)),
                m => Ok(m),
            }
        }
        Some(Msg::Abort { reason }) => Err(SlopeError::Refused(reason)),
        Some(other) => Err(SlopeError::Protocol(format!(
            "a {} frame in an object migration",
            other.name()
        ))),
        None => Err(SlopeError::Protocol(
            "the peer closed the connection".into(),
        )),
    }
}

/// Sends a whole `Object` frame built in place (see `source::page_frame`).
pub(crate) async fn send_frame(ch: &mut Channel, frame: &[u8]) -> Result<(), SlopeError> {
    ch.send_frame(frame)
        .await
        .map_err(SlopeError::io("sending an object message"))
}

/// [`recv`], or a protocol error when nothing comes within `limit` (a peer that stops
/// sending must not hold a slot, or the listener, for good).
pub(crate) async fn recv_within(
    ch: &mut Channel,
    limit: std::time::Duration,
) -> Result<ObjMsg, SlopeError> {
    tokio::time::timeout(limit, recv(ch))
        .await
        .unwrap_or_else(|_| {
            Err(SlopeError::Protocol(format!(
                "the peer sent nothing for {limit:?}"
            )))
        })
}

/// Tells the peer why we give up (best effort) and returns `e`.
pub(crate) async fn abort(ch: &mut Channel, e: SlopeError) -> SlopeError {
    let _ = send(
        ch,
        &ObjMsg::Abort {
            reason: e.to_string(),
        },
    )
    .await;
    e
}
