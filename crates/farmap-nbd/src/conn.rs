//! One client connection: the handshake (with STARTTLS), then requests in flight and a
//! writer task that sends replies as they complete.

use std::io::{self, IoSlice};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use farmap_nbd_proto::consts::errno;
use farmap_nbd_proto::{Command, Incoming, RequestDecoder, ServerHandshake, ServerStep};
use farmap_net::BoxStream;
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use crate::ops::{error_reply, Failure, Session};
use crate::server::Ctx;

/// Replies waiting in the writer's queue are gathered into one vectored write of up to
/// this many bytes...
const BATCH_BYTES: usize = 1 << 20;
/// ... or this many pieces.
const BATCH_PIECES: usize = 512;
/// Room kept free in the receive buffer.
const READ_AHEAD: usize = 256 * 1024;
/// Bytes charged for a reply's headers, on top of its data.
const OVERHEAD: usize = 64;

type Outgoing = (Vec<Bytes>, Option<OwnedSemaphorePermit>);

/// Serves one connection to its end.
pub(crate) async fn connection(stream: BoxStream, peer: String, ctx: Arc<Ctx>) {
    let shake = tokio::time::timeout(ctx.opts.handshake_timeout, handshake(stream, &peer, &ctx));
    let (stream, buf, export, session) = match shake.await {
        Ok(Ok(Some(done))) => done,
        Ok(Ok(None)) => return,
        Ok(Err(e)) => {
            tracing::warn!("NBD client {peer}: handshake failed: {e}");
            return;
        }
        Err(_) => {
            tracing::warn!(
                "NBD client {peer}: did not finish the handshake within {:?}",
                ctx.opts.handshake_timeout
            );
            return;
        }
    };
    let name = ctx.exports[export].name.clone();
    ctx.note(format_args!(
        "NBD client {peer} connected to export {name:?}"
    ));
    match transmission(stream, buf, export, session, &ctx, &peer).await {
        Ok(()) => ctx.note(format_args!("NBD client {peer} disconnected")),
        Err(e) => tracing::warn!("NBD client {peer}: {e}"),
    }
}

/// The handshake: the stream (TLS when started), the bytes read past it, the export and
/// what was negotiated; `None` when the client aborted.
async fn handshake(
    mut stream: BoxStream,
    peer: &str,
    ctx: &Ctx,
) -> io::Result<Option<(BoxStream, BytesMut, usize, Session)>> {
    let mut machine = ServerHandshake::new(ctx.handshake.clone());
    let mut out = BytesMut::new();
    machine.greeting(&mut out);
    let mut buf = BytesMut::with_capacity(4096);
    loop {
        let step = machine
            .step(&mut buf, &mut out)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        if !out.is_empty() {
            stream.write_all(&out).await?;
            stream.flush().await?;
            out.clear();
        }
        match step {
            ServerStep::NeedMore => {
                if stream.read_buf(&mut buf).await? == 0 {
                    return Ok(None);
                }
            }
            ServerStep::StartTls => {
                if !buf.is_empty() {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "the client sent bytes after STARTTLS before the TLS handshake",
                    ));
                }
                let Some(acceptor) = &ctx.tls else {
                    return Err(io::Error::other("STARTTLS without a TLS configuration"));
                };
                match acceptor.accept(stream).await {
                    Ok(s) => stream = Box::new(s),
                    Err(e) => {
                        tracing::warn!(
                            "refused NBD client {peer}: {}",
                            farmap_net::describe_server_tls_failure(&e)
                        );
                        return Ok(None);
                    }
                }
                machine.tls_started();
            }
            ServerStep::Aborted => return Ok(None),
            ServerStep::Done(n) => {
                let session = Session {
                    structured: n.structured,
                    allocation: n.allocation_context,
                };
                return Ok(Some((stream, buf, n.export, session)));
            }
        }
    }
}

/// Writes what arrives on `rx`, gathering replies that wait together into vectored writes;
/// flushes whenever the queue runs dry.
async fn writer<W: AsyncWrite + Unpin>(
    out: &mut W,
    rx: &mut mpsc::Receiver<Outgoing>,
    stall: Duration,
) -> io::Result<()> {
    let mut batch: Vec<Bytes> = Vec::new();
    let mut held: Vec<Option<OwnedSemaphorePermit>> = Vec::new();
    while let Some(first) = rx.recv().await {
        let mut bytes = 0;
        let mut next = Some(first);
        while let Some((parts, permit)) = next.take() {
            held.push(permit);
            for p in parts {
                bytes += p.len();
                batch.push(p);
            }
            if bytes >= BATCH_BYTES || batch.len() >= BATCH_PIECES {
                write_all(out, &mut batch, stall).await?;
                held.clear();
                bytes = 0;
            }
            next = rx.try_recv().ok();
        }
        write_all(out, &mut batch, stall).await?;
        within(stall, out.flush()).await?;
        held.clear();
    }
    within(stall, out.shutdown()).await
}

async fn within<T>(
    limit: Duration,
    step: impl std::future::Future<Output = io::Result<T>>,
) -> io::Result<T> {
    match tokio::time::timeout(limit, step).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the client has not read its replies for {limit:?}"),
        )),
    }
}

async fn write_all<W: AsyncWrite + Unpin>(
    out: &mut W,
    batch: &mut Vec<Bytes>,
    stall: Duration,
) -> io::Result<()> {
    let mut first = 0;
    while first < batch.len() && batch[first].is_empty() {
        first += 1;
    }
    while first < batch.len() {
        let slices: Vec<IoSlice<'_>> = batch[first..]
            .iter()
            .take(1024)
            .map(|b| IoSlice::new(b))
            .collect();
        let mut n = within(stall, out.write_vectored(&slices)).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        while n > 0 && first < batch.len() {
            let head = &mut batch[first];
            if n >= head.len() {
                n -= head.len();
                first += 1;
            } else {
                head.advance(n);
                n = 0;
            }
        }
        while first < batch.len() && batch[first].is_empty() {
            first += 1;
        }
    }
    batch.clear();
    Ok(())
}

/// Why a connection ended in error.
#[derive(Debug, thiserror::Error)]
enum ConnError {
    #[error("protocol error: {0}")]
    Protocol(#[from] farmap_nbd_proto::RequestError),
    #[error("connection failed: {0}")]
    Io(#[from] io::Error),
    #[error("sent nothing for {0:?} with no request in flight; closed")]
    Idle(Duration),
}

async fn transmission(
    stream: BoxStream,
    mut buf: BytesMut,
    export: usize,
    session: Session,
    ctx: &Arc<Ctx>,
    peer: &str,
) -> Result<(), ConnError> {
    let exp = ctx.exports[export].clone();
    let (mut rd, mut wr) = tokio::io::split(stream);
    let (tx, mut rx) = mpsc::channel::<Outgoing>(1024);
    let stall = ctx.opts.idle_timeout;
    let writer = tokio::spawn(async move { writer(&mut wr, &mut rx, stall).await });
    let budget = Arc::new(Semaphore::new(ctx.conn_budget));
    let in_flight = Arc::new(Semaphore::new(ctx.opts.max_in_flight_per_conn));
    let mut decoder = RequestDecoder::new(exp.max_payload);
    let mut shutdown = ctx.shutdown.clone();
    // Budget charged for a write payload that is still arriving.
    let mut payload_charge: Option<OwnedSemaphorePermit> = None;
    let result: Result<(), ConnError> = 'conn: loop {
        // Decode every complete request in the buffer.
        loop {
            let incoming = match decoder.decode(&mut buf) {
                Ok(Some(i)) => i,
                Ok(None) => break,
                Err(e) => break 'conn Err(e.into()),
            };
            let (header, payload) = match incoming {
                Incoming::Oversized(h) => {
                    let f = Failure {
                        errno: errno::EINVAL,
                        message: format!(
                            "a write of {} bytes is over the maximum of {}",
                            h.length, exp.max_payload
                        ),
                    };
                    let _ = tx.send((error_reply(&h, session, &f), None)).await;
                    continue;
                }
                Incoming::Request { header, payload } => (header, payload),
            };
            if header.command == Command::Disc {
                break 'conn Ok(());
            }
            // Charge the request's bytes (its payload, or its largest reply) to the budget.
            let reply_bytes = match header.command {
                Command::Read => (header.length.min(exp.max_payload)) as usize,
                // A payload that arrived with its header was never charged on its way in.
                Command::Write if payload_charge.is_none() => payload.len(),
                _ => 0,
            };
            let charge = (reply_bytes + OVERHEAD).min(ctx.conn_budget) as u32;
            let mut permit = match budget.clone().acquire_many_owned(charge).await {
                Ok(p) => p,
                Err(_) => break 'conn Ok(()),
            };
            if let Some(p) = payload_charge.take() {
                permit.merge(p);
            }
            // Nothing else in flight and no request behind this one (a client at queue
            // depth 1): answer it here, saving the hand-off to a task of its own.
            let idle = in_flight.available_permits() == ctx.opts.max_in_flight_per_conn;
            if idle && buf.len() < farmap_nbd_proto::consts::REQUEST_LEN {
                let reply = exp.handle(header, payload, session).await;
                if tx.send((reply, Some(permit))).await.is_err() {
                    break 'conn Ok(());
                }
                continue;
            }
            let slot = match in_flight.clone().acquire_owned().await {
                Ok(s) => s,
                Err(_) => break 'conn Ok(()),
            };
            let exp = exp.clone();
            let tx = tx.clone();
            tokio::spawn(async move {
                let reply = exp.handle(header, payload, session).await;
                let _ = tx.send((reply, Some(permit))).await;
                drop(slot);
            });
        }
        // A write payload is on its way: charge it before reading it in.
        if let Some(len) = decoder.awaiting_payload() {
            if payload_charge.is_none() {
                let n = (len as usize).min(ctx.conn_budget) as u32;
                match budget.clone().acquire_many_owned(n).await {
                    Ok(p) => payload_charge = Some(p),
                    Err(_) => break 'conn Ok(()),
                }
                buf.reserve(len as usize);
            }
        }
        if buf.capacity() - buf.len() < READ_AHEAD / 4 {
            buf.reserve(READ_AHEAD);
        }
        let idle = tokio::time::sleep(ctx.opts.idle_timeout);
        tokio::select! {
            r = rd.read_buf(&mut buf) => match r {
                Ok(0) => break 'conn Ok(()),
                Ok(_) => {}
                Err(e) if is_clean_close(&e) => break 'conn Ok(()),
                Err(e) => break 'conn Err(e.into()),
            },
            _ = idle => {
                let busy = in_flight.available_permits() < ctx.opts.max_in_flight_per_conn;
                if !busy {
                    break 'conn Err(ConnError::Idle(ctx.opts.idle_timeout));
                }
            }
            _ = crate::server::raised(&mut shutdown) => break 'conn Ok(()),
        }
    };
    // Let the requests in flight finish and be answered, then close.
    drop(tx);
    match writer.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) if is_clean_close(&e) => {}
        Ok(Err(e)) => {
            if result.is_ok() {
                return Err(e.into());
            }
        }
        Err(e) => tracing::warn!("NBD client {peer}: the reply writer failed: {e}"),
    }
    result
}

fn is_clean_close(err: &io::Error) -> bool {
    use io::ErrorKind as K;
    matches!(
        err.kind(),
        K::UnexpectedEof | K::ConnectionReset | K::BrokenPipe | K::ConnectionAborted
    )
}
