//! One client connection: the handshake (with STARTTLS), then the transmission phase.
//!
//! The reader task decodes requests and starts each one at once: a request the store
//! answers without waiting (a memory store, a cached chunk) is answered by the reader
//! itself, the rest run as tasks of their own. A reply is written by whoever has it when the
//! connection's write side is free, so a client at queue depth 1 gets its reply without a
//! hand-off; replies that find it busy queue for a writer task, which gathers them into
//! vectored writes. A write's payload that does not fit the receive buffer is read into a
//! buffer of its own, which becomes the chunks the store keeps (no copy).

use std::future::Future;
use std::io;
use std::ops::ControlFlow;
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use farmap_nbd_proto::consts::{errno, REQUEST_LEN};
use farmap_nbd_proto::{
    Command, Incoming, RequestDecoder, RequestHeader, ServerHandshake, ServerStep,
};
use farmap_net::budget::{Budget, Charge};
use farmap_net::counted::{Counted, Written, STOP_STALL};
use farmap_net::fair::Lane;
use farmap_net::{is_clean_close, raised, Activity, BoxStream};
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt, WriteHalf};
use tokio::sync::{mpsc, watch, Mutex, OwnedSemaphorePermit, Semaphore, TryAcquireError};
use tokio::time::Instant;

use crate::ctx::Ctx;
use crate::ops::{error_reply, ExportCtx, Failure, Session};

/// Replies waiting together are gathered into one vectored write of up to this many
/// bytes...
const BATCH_BYTES: usize = 1 << 20;
/// ... or this many pieces.
const BATCH_PIECES: usize = 512;
/// Room kept free in the receive buffer.
const READ_AHEAD: usize = 256 * 1024;
/// A write at least this long is probably followed by more like it: the next header is read
/// alone, so that the next payload lands in a buffer of its own.
const LARGE_WRITE: u32 = 64 * 1024;
/// Bytes charged for a reply's headers, on top of its data.
const OVERHEAD: usize = 64;

/// A reply (or one part of one) and the budget it holds until it has been written.
type Outgoing = (Vec<Bytes>, Option<Charge>);
type Out = Counted<WriteHalf<BoxStream>>;

/// Serves one connection to its end.
pub(crate) async fn connection(
    stream: BoxStream,
    peer: String,
    ctx: Arc<Ctx>,
    activity: Arc<Activity>,
) {
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
    match transmission(stream, buf, export, session, &ctx, (&peer, &activity)).await {
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

/// Where replies go: written at once by whoever has one when the write side is free, or
/// queued for the writer task. A failed write poisons the write side (its stream may end
/// in the middle of a reply) and raises `broken`, which ends the connection.
struct Replies {
    out: Arc<Mutex<Option<Out>>>,
    tx: mpsc::Sender<Outgoing>,
    stall: Duration,
    broken: Arc<watch::Sender<bool>>,
}

fn writer_gone() -> io::Error {
    io::Error::new(
        io::ErrorKind::BrokenPipe,
        "the connection's replies can no longer be written",
    )
}

impl Replies {
    /// Sends the pieces in `parts` (emptied) as one unit; `permit` is released once they
    /// have been written.
    async fn send(&self, parts: &mut Vec<Bytes>, permit: Option<Charge>) -> io::Result<()> {
        if parts.is_empty() {
            return Ok(());
        }
        if let Ok(mut out) = self.out.try_lock() {
            let r = match out.as_mut() {
                Some(w) => write_flushed(w, parts, self.stall).await,
                None => Err(writer_gone()),
            };
            parts.clear();
            if r.is_err() {
                *out = None;
                self.broken.send_replace(true);
            }
            drop(permit);
            return r;
        }
        self.tx
            .send((std::mem::take(parts), permit))
            .await
            .map_err(|_| writer_gone())
    }
}

/// Replies the reader answered itself, sent together once the requests in the receive
/// buffer have all been started.
#[derive(Default)]
struct Batch {
    parts: Vec<Bytes>,
    bytes: usize,
    permit: Option<Charge>,
}

impl Batch {
    fn push(&mut self, reply: Vec<Bytes>, permit: Option<Charge>) {
        for p in reply {
            self.bytes += p.len();
            self.parts.push(p);
        }
        match (&mut self.permit, permit) {
            (Some(held), Some(p)) => held.merge(p),
            (held @ None, p) => *held = p,
            (Some(_), None) => {}
        }
    }

    fn is_full(&self) -> bool {
        self.bytes >= BATCH_BYTES || self.parts.len() >= BATCH_PIECES
    }

    async fn send(&mut self, replies: &Replies) -> io::Result<()> {
        self.bytes = 0;
        replies.send(&mut self.parts, self.permit.take()).await
    }
}

/// Writes what arrives on `rx`, gathering replies that wait together into vectored writes;
/// flushes whenever the queue runs dry. Ends with a clean shutdown of the write side once
/// every sender is gone.
async fn writer(
    out: Arc<Mutex<Option<Out>>>,
    mut rx: mpsc::Receiver<Outgoing>,
    stall: Duration,
    broken: Arc<watch::Sender<bool>>,
) -> io::Result<()> {
    let mut batch: Vec<Bytes> = Vec::new();
    let mut held: Vec<Option<Charge>> = Vec::new();
    while let Some(first) = rx.recv().await {
        let mut guard = out.lock().await;
        let Some(w) = guard.as_mut() else {
            return Err(writer_gone());
        };
        let r = drain(w, &mut rx, first, &mut batch, &mut held, stall).await;
        held.clear();
        if let Err(e) = r {
            *guard = None;
            broken.send_replace(true);
            return Err(e);
        }
    }
    let mut guard = out.lock().await;
    match guard.as_mut() {
        Some(w) => within(stall, w.shutdown()).await,
        None => Ok(()),
    }
}

/// Writes `first` and whatever else waits in `rx`, then flushes.
async fn drain(
    w: &mut Out,
    rx: &mut mpsc::Receiver<Outgoing>,
    first: Outgoing,
    batch: &mut Vec<Bytes>,
    held: &mut Vec<Option<Charge>>,
    stall: Duration,
) -> io::Result<()> {
    let mut bytes = 0;
    let mut next = Some(first);
    while let Some((parts, permit)) = next.take() {
        held.push(permit);
        for p in parts {
            bytes += p.len();
            batch.push(p);
        }
        if bytes >= BATCH_BYTES || batch.len() >= BATCH_PIECES {
            write_all(w, batch, stall).await?;
            held.clear();
            bytes = 0;
        }
        next = rx.try_recv().ok();
    }
    write_flushed(w, batch, stall).await
}

async fn write_flushed(w: &mut Out, parts: &mut Vec<Bytes>, stall: Duration) -> io::Result<()> {
    write_all(w, parts, stall).await?;
    within(stall, w.flush()).await
}

async fn within<T>(limit: Duration, step: impl Future<Output = io::Result<T>>) -> io::Result<T> {
    farmap_net::within(Some(limit), step).await
}

async fn write_all<W: AsyncWrite + Unpin>(
    out: &mut W,
    batch: &mut Vec<Bytes>,
    stall: Duration,
) -> io::Result<()> {
    farmap_net::write_all_vectored(out, batch, Some(stall)).await
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
    #[error("closed without its last replies: the client does not read them")]
    Stalled,
}

/// A permit of `n` from `sem`, sending the reader's batch first when it has to wait (the
/// permits the batch holds may be what it waits for). `None` once `sem` is closed.
async fn permit(
    sem: &Arc<Semaphore>,
    n: u32,
    batch: &mut Batch,
    replies: &Replies,
) -> io::Result<Option<OwnedSemaphorePermit>> {
    match sem.clone().try_acquire_many_owned(n) {
        Ok(p) => return Ok(Some(p)),
        Err(TryAcquireError::Closed) => return Ok(None),
        Err(TryAcquireError::NoPermits) => {}
    }
    batch.send(replies).await?;
    Ok(sem.clone().acquire_many_owned(n).await.ok())
}

/// A charge of `n` bytes to `budget`, sending the reader's batch first when it has to wait
/// (the charges the batch holds may be what it waits for).
async fn charge(
    budget: &Budget,
    n: usize,
    batch: &mut Batch,
    replies: &Replies,
) -> io::Result<Charge> {
    if let Some(c) = budget.try_charge(n) {
        return Ok(c);
    }
    batch.send(replies).await?;
    Ok(budget.charge(n).await)
}

/// Serves a structured read longer than the maximum payload in pieces of at most that
/// size, each read, charged to the connection's budget and sent before the next.
async fn read_in_pieces(
    exp: Arc<ExportCtx>,
    h: RequestHeader,
    s: Session,
    replies: Arc<Replies>,
    (budget, lane): (Budget, Lane),
    mut charge: Option<Charge>,
) {
    if let Err(f) = exp.check_read(&h, s) {
        let _ = replies.send(&mut error_reply(&h, s, &f), charge).await;
        return;
    }
    let end = h.offset + u64::from(h.length);
    let mut at = h.offset;
    while at < end {
        let n = (end - at).min(exp.max_payload.into()) as u32;
        let last = at + u64::from(n) == end;
        let piece = RequestHeader {
            offset: at,
            length: n,
            ..h
        };
        let mut permit = budget.charge(exp.working_set(&piece) + OVERHEAD).await;
        if let Some(c) = charge.take() {
            permit.merge(c);
        }
        let read = lane.run(exp.read_range(h.cookie, at, n, last, s));
        let (mut parts, failed) = match read.await {
            Ok(parts) => (parts, false),
            Err(f) => (error_reply(&h, s, &f), true),
        };
        if replies.send(&mut parts, Some(permit)).await.is_err() || failed {
            return;
        }
        at += u64::from(n);
    }
}

/// How a step of the transmission phase left the connection: go on, or end it with this.
type Flow = ControlFlow<Result<(), ConnError>>;

/// The transmission phase: requests are read and started until the client leaves, breaks
/// the protocol, goes idle, or the server stops; then what is owed is answered.
async fn transmission(
    stream: BoxStream,
    mut buf: BytesMut,
    export: usize,
    session: Session,
    ctx: &Arc<Ctx>,
    (peer, activity): (&str, &Activity),
) -> Result<(), ConnError> {
    let (mut rd, wr) = tokio::io::split(stream);
    let (wr, written) = Counted::new(wr);
    let (broken, mut broken_rx) = watch::channel(false);
    let (mut t, writer) = Transmission::new(ctx, export, session, wr, broken, (peer, activity));
    let idle_limit = ctx.opts.idle_timeout;
    let mut last_input = Instant::now();
    let mut idle = pin!(tokio::time::sleep(idle_limit));
    let mut shutdown = ctx.shutdown.clone();
    let mut stop = pin!(async move {
        tokio::select! {
            () = raised(&mut shutdown) => {}
            () = raised(&mut broken_rx) => {}
        }
    });
    // Whether the client closed its side or the connection failed: nobody reads replies.
    let mut gone = false;
    let result: Result<(), ConnError> = loop {
        while t.tasks.try_join_next().is_some() {}
        if let ControlFlow::Break(end) = t.start_buffered(&mut buf).await {
            break end;
        }
        // Everything in the buffer has been started: send what was answered here.
        if let Err(e) = t.batch.send(&t.replies).await {
            break ended(e);
        }
        let limit = t.read_limit(&mut buf).await;
        let mut room = (&mut buf).limit(limit);
        tokio::select! {
            r = rd.read_buf(&mut room) => match r {
                Ok(0) => {
                    gone = true;
                    break Ok(());
                }
                Ok(_) => last_input = Instant::now(),
                Err(e) if is_clean_close(&e) => {
                    gone = true;
                    break Ok(());
                }
                Err(e) => {
                    gone = true;
                    break Err(e.into());
                }
            },
            () = &mut idle => {
                let busy = t.busy();
                if !busy && last_input.elapsed() >= idle_limit {
                    break Err(ConnError::Idle(idle_limit));
                }
                let from = if busy { Instant::now() } else { last_input };
                idle.as_mut().reset(from + idle_limit);
            }
            () = &mut stop => break Ok(()),
        }
    };
    t.finish(result, gone, writer, written).await
}

/// One connection's transmission phase: the export and session it serves, the replies it
/// owes, the memory and turns its requests hold, and how its input is being read.
struct Transmission<'a> {
    exp: Arc<ExportCtx>,
    session: Session,
    replies: Arc<Replies>,
    budget: Budget,
    /// The connection's turns at the store.
    lane: Lane,
    in_flight: Arc<Semaphore>,
    max_in_flight: usize,
    decoder: RequestDecoder,
    /// Replies answered by the reader, sent together.
    batch: Batch,
    /// Budget charged for a write payload that is still arriving.
    payload_charge: Option<Charge>,
    /// Whether the payload being awaited has a buffer of its own (read exactly into it).
    own_buffer: bool,
    /// Whether the next header is read alone (after a large write).
    header_alone: bool,
    /// Requests that wait on the store run as tasks of this connection: cancelled when the
    /// client goes away (or breaks the protocol), dropped with the connection.
    tasks: tokio::task::JoinSet<()>,
    peer: &'a str,
    activity: &'a Activity,
}

impl<'a> Transmission<'a> {
    /// The state of a connection to `export`, and the task that writes its replies.
    fn new(
        ctx: &Arc<Ctx>,
        export: usize,
        session: Session,
        wr: Out,
        broken: watch::Sender<bool>,
        (peer, activity): (&'a str, &'a Activity),
    ) -> (Self, tokio::task::JoinHandle<io::Result<()>>) {
        let exp = ctx.exports[export].clone();
        let out = Arc::new(Mutex::new(Some(wr)));
        let (tx, rx) = mpsc::channel::<Outgoing>(1024);
        let broken = Arc::new(broken);
        let stall = ctx.opts.idle_timeout;
        let writer = tokio::spawn(writer(out.clone(), rx, stall, broken.clone()));
        let replies = Arc::new(Replies {
            out,
            tx,
            stall,
            broken,
        });
        let max_in_flight = ctx.opts.max_in_flight_per_conn;
        let in_flight = Arc::new(Semaphore::new(max_in_flight));
        activity.watch_slots(in_flight.clone(), max_in_flight);
        let t = Transmission {
            decoder: RequestDecoder::new(exp.max_payload),
            exp,
            session,
            replies,
            budget: ctx.total.connection(ctx.conn_budget, ctx.reserve),
            lane: ctx.fair.lane(),
            in_flight,
            max_in_flight,
            batch: Batch::default(),
            payload_charge: None,
            own_buffer: false,
            header_alone: false,
            tasks: tokio::task::JoinSet::new(),
            peer,
            activity,
        };
        (t, writer)
    }

    /// Whether requests are in flight.
    fn busy(&self) -> bool {
        self.in_flight.available_permits() < self.max_in_flight
    }

    /// Starts every complete request in `buf`.
    async fn start_buffered(&mut self, buf: &mut BytesMut) -> Flow {
        loop {
            let incoming = match self.decoder.decode(buf) {
                Ok(Some(i)) => i,
                Ok(None) => return ControlFlow::Continue(()),
                Err(e) => return ControlFlow::Break(Err(e.into())),
            };
            let Some((header, payload)) = self.admit(incoming) else {
                continue;
            };
            self.own_buffer = false;
            self.activity.touch();
            self.header_alone = header.command == Command::Write && header.length >= LARGE_WRITE;
            if header.command == Command::Disc {
                return ControlFlow::Break(Ok(()));
            }
            self.start(header, payload).await?;
        }
    }

    /// A decoded request ready to start, or `None` when it was answered with an error (a
    /// write over the maximum payload).
    fn admit(&mut self, incoming: Incoming) -> Option<(RequestHeader, Bytes)> {
        match incoming {
            Incoming::Oversized(h) => {
                self.header_alone = false;
                let f = Failure {
                    errno: errno::EINVAL,
                    message: format!(
                        "a write of {} bytes is over the maximum of {}",
                        h.length, self.exp.max_payload
                    ),
                };
                self.batch.push(error_reply(&h, self.session, &f), None);
                None
            }
            // A small payload that shares the read-ahead buffer with other requests gets an
            // allocation of its own: a store that keeps it (a memory store keeps it for good)
            // would otherwise keep the whole 256 KiB buffer alive for every 4 KiB write. A
            // large one (which pins at most 4 times its size) is not copied.
            Incoming::Request { header, payload }
                if !self.own_buffer
                    && !payload.is_empty()
                    && payload.len() < LARGE_WRITE as usize =>
            {
                Some((header, Bytes::copy_from_slice(&payload)))
            }
            Incoming::Request { header, payload } => Some((header, payload)),
        }
    }

    /// Charges one request what it may hold, takes a slot for it, and starts it: answered
    /// here when the store does not wait, else as a task of the connection.
    async fn start(&mut self, header: RequestHeader, payload: Bytes) -> Flow {
        let large = self.exp.read_in_pieces(&header, self.session);
        // Charge what the request may hold (its working set; a write also its payload,
        // unless that was charged on its way in).
        let payload_bytes = match header.command {
            Command::Write if self.payload_charge.is_none() => payload.len(),
            _ => 0,
        };
        // A read served in pieces charges each piece as it goes.
        let work = if large {
            0
        } else {
            self.exp.working_set(&header)
        };
        // Never more than the budget can give beside a payload charge already held.
        let held = self.payload_charge.as_ref().map_or(0, Charge::bytes);
        let limit = self.budget.limit().saturating_sub(held);
        let bytes = (work + payload_bytes + OVERHEAD).min(limit);
        let mut permit =
            match self::charge(&self.budget, bytes, &mut self.batch, &self.replies).await {
                Ok(c) => c,
                Err(e) => return ControlFlow::Break(ended(e)),
            };
        if let Some(p) = self.payload_charge.take() {
            permit.merge(p);
        }
        let slot = match self::permit(&self.in_flight, 1, &mut self.batch, &self.replies).await {
            Ok(Some(s)) => s,
            Ok(None) => return ControlFlow::Break(Ok(())),
            Err(e) => return ControlFlow::Break(ended(e)),
        };
        if large {
            let task = read_in_pieces(
                self.exp.clone(),
                header,
                self.session,
                self.replies.clone(),
                (self.budget.clone(), self.lane.clone()),
                Some(permit),
            );
            self.tasks.spawn(async move {
                task.await;
                drop(slot);
            });
            return ControlFlow::Continue(());
        }
        // Work on it here until it would wait; only then give it a task of its own.
        let (e, lane, session) = (self.exp.clone(), self.lane.clone(), self.session);
        let mut job: Pin<Box<dyn Future<Output = Vec<Bytes>> + Send>> =
            // Its store operations take this connection's turns; the reply does not.
            Box::pin(async move { lane.run(e.handle(header, payload, session)).await });
        match std::future::poll_fn(|cx| Poll::Ready(job.as_mut().poll(cx))).await {
            Poll::Ready(reply) => {
                drop(slot);
                self.batch.push(reply, Some(permit));
                if self.batch.is_full() {
                    if let Err(e) = self.batch.send(&self.replies).await {
                        return ControlFlow::Break(ended(e));
                    }
                }
            }
            Poll::Pending => {
                let replies = self.replies.clone();
                let peer = self.peer.to_owned();
                self.tasks.spawn(async move {
                    let mut reply = job.await;
                    if let Err(e) = replies.send(&mut reply, Some(permit)).await {
                        if !is_clean_close(&e) {
                            tracing::debug!("NBD client {peer}: a reply was not sent: {e}");
                        }
                    }
                    drop(slot);
                });
            }
        }
        ControlFlow::Continue(())
    }

    /// How much to read next: the rest of a payload that has a buffer of its own (charged
    /// before it is read in), a header alone, or as much as the buffer holds.
    async fn read_limit(&mut self, buf: &mut BytesMut) -> usize {
        if let Some(len) = self.decoder.awaiting_payload() {
            let len = len as usize;
            // A write payload is on its way: charge it before reading it in.
            if self.payload_charge.is_none() {
                self.payload_charge = Some(self.budget.charge(len).await);
            }
            let need = len - buf.len();
            if !self.own_buffer && buf.capacity() - buf.len() < need {
                // Only the start of the payload is here (nothing behind it): move it to a
                // buffer of exactly the payload's size and read the rest into that.
                let mut own = BytesMut::with_capacity(len);
                own.extend_from_slice(buf);
                *buf = own;
                self.own_buffer = true;
            }
            if self.own_buffer {
                need
            } else {
                usize::MAX
            }
        } else if self.header_alone {
            if buf.capacity() - buf.len() < REQUEST_LEN {
                buf.reserve(REQUEST_LEN);
            }
            REQUEST_LEN.saturating_sub(buf.len()).max(1)
        } else {
            if buf.capacity() - buf.len() < READ_AHEAD / 4 {
                buf.reserve(READ_AHEAD);
            }
            usize::MAX
        }
    }

    /// The end of the connection, after the reading ended with `result`.
    ///
    /// A client that left (or broke the protocol: `gone`, or an error) waits for nothing:
    /// its requests still in flight are cancelled. Otherwise (it disconnected, or the server
    /// stops) whatever the reader answered is sent and requests in flight finish and are
    /// answered; then the writer closes the write side. A client that does not read its
    /// replies is not waited for.
    async fn finish(
        mut self,
        result: Result<(), ConnError>,
        gone: bool,
        mut writer: tokio::task::JoinHandle<io::Result<()>>,
        written: Written,
    ) -> Result<(), ConnError> {
        if gone || result.is_err() {
            self.tasks.abort_all();
        }
        let peer = self.peer;
        let finish = async {
            let flushed = self.batch.send(&self.replies).await;
            drop(self.replies);
            let sent = match (&mut writer).await {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!("NBD client {peer}: the reply writer failed: {e}");
                    Ok(())
                }
            };
            flushed.and(sent)
        };
        let Some(io) = written.unless_stalled(finish, STOP_STALL).await else {
            writer.abort();
            self.tasks.abort_all();
            return result.and(Err(ConnError::Stalled));
        };
        match (result, io) {
            (Err(e), _) => Err(e),
            (Ok(()), Err(e)) if !is_clean_close(&e) => Err(e.into()),
            (Ok(()), _) => Ok(()),
        }
    }
}

/// How a failed reply write ends the connection: quietly when the client went away.
fn ended(e: io::Error) -> Result<(), ConnError> {
    if is_clean_close(&e) {
        Ok(())
    } else {
        Err(e.into())
    }
}
