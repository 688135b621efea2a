//! One ublk queue: a thread with its io_uring and a smol executor running one task per
//! request slot (tag). Store operations run on the tokio runtime; when one completes, its
//! task is woken and an eventfd, polled through the queue's own ring, wakes the thread from
//! its wait on the ring.
//!
//! Concurrency contract:
//! - Each tag has one request in flight at most (the driver's protocol); tags of one queue
//!   run concurrently on the tokio runtime, so a queue keeps up to `depth` store operations
//!   in flight.
//! - A request's buffer belongs to its tag's task: data is copied out of it (writes) before
//!   the store sees it, and into it (reads) after the store answered, on the queue thread.
//! - A task is woken before the eventfd is written, so clearing the eventfd never loses a
//!   wake-up: every write it clears belongs to a task already queued to run.

use std::future::Future;
use std::os::fd::{AsRawFd, OwnedFd};
use std::rc::Rc;
use std::sync::Arc;

use bytes::Bytes;
use farmap_core::{ErrorKind, Store, StoreError, StoreResult};
use farmap_pipeline::Unaligned;
use libublk::helpers::IoBuf;
use libublk::io::{UblkDev, UblkQueue};
use libublk::uring_async::ublk_submit_sqe_async;
use libublk::{BufDesc, UblkError, UblkUringData};
use rustix::event::{eventfd, EventfdFlags};

/// What every queue of a device shares.
#[derive(Debug)]
pub(crate) struct Shared {
    /// The store, as byte ranges.
    pub(crate) dev: Unaligned<Arc<dyn Store>>,
    /// Where the store's futures run.
    pub(crate) runtime: tokio::runtime::Handle,
}

/// Wakes a queue thread that waits on its ring.
#[derive(Debug, Clone)]
struct Kick(Arc<OwnedFd>);

impl Kick {
    fn new() -> std::io::Result<Self> {
        let fd = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
        Ok(Self(Arc::new(fd)))
    }

    fn kick(&self) {
        // A full counter (never, at 2^64 - 2) would only mean the ring is already woken.
        let _ = rustix::io::write(&*self.0, &1u64.to_ne_bytes());
    }

    fn clear(&self) {
        let mut b = [0u8; 8];
        let _ = rustix::io::read(&*self.0, &mut b);
    }
}

/// Runs queue `qid` until the device stops. Called by libublk on the queue's own thread.
pub(crate) fn run_queue(qid: u16, udev: &UblkDev, shared: Arc<Shared>) {
    let q = match UblkQueue::new(qid, udev) {
        Ok(q) => Rc::new(q),
        Err(e) => {
            tracing::error!(qid, error = %e, "cannot set up the ublk queue");
            return;
        }
    };
    let kick = match Kick::new() {
        Ok(k) => k,
        Err(e) => {
            tracing::error!(qid, error = %e, "cannot create the ublk queue's eventfd");
            return;
        }
    };
    let exe = Rc::new(smol::LocalExecutor::new());
    let mut tasks = Vec::new();
    for tag in q.tags() {
        let (q, shared, kick) = (q.clone(), shared.clone(), kick.clone());
        tasks.push(exe.spawn(async move {
            match io_task(&q, tag, &shared, &kick).await {
                Ok(()) | Err(UblkError::QueueIsDown) => {}
                Err(e) => tracing::error!(qid, tag, error = %e, "ublk request slot failed"),
            }
        }));
    }
    let waker = exe.spawn(kick_task(kick));
    let ticker = exe.clone();
    smol::block_on(exe.run(async {
        let run_ops = || while ticker.try_tick() {};
        let done = || tasks.iter().all(|t| t.is_finished());
        if let Err(e) = libublk::wait_and_handle_io_events(&q, Some(20), run_ops, done).await {
            tracing::error!(qid, error = %e, "ublk queue ended with an error");
        }
    }));
    drop(waker);
}

/// Keeps a poll of the eventfd in the queue's ring, so that a completion on the runtime
/// wakes the thread waiting on the ring.
async fn kick_task(kick: Kick) {
    loop {
        let sqe = io_uring::opcode::PollAdd::new(
            io_uring::types::Fd(kick.0.as_raw_fd()),
            libc::POLLIN as u32,
        )
        .build();
        if ublk_submit_sqe_async(sqe, UblkUringData::Target as u64)
            .await
            .is_err()
        {
            return;
        }
        kick.clear();
    }
}

/// Serves request slot `tag`: fetch a request, do it, commit its result, repeat.
async fn io_task(
    q: &UblkQueue<'_>,
    tag: u16,
    shared: &Arc<Shared>,
    kick: &Kick,
) -> Result<(), UblkError> {
    let mut buf = IoBuf::<u8>::new(q.dev.dev_info.max_io_buf_bytes as usize);
    q.submit_io_prep_cmd(tag, BufDesc::Slice(buf.as_slice()), 0, Some(&buf))
        .await?;
    loop {
        let iod = q.get_iod(tag);
        let op = iod.op_flags & 0xff;
        let offset = iod.start_sector << 9;
        let len = (iod.nr_sectors as usize) << 9;
        let res = handle(shared, kick, op, offset, len, buf.as_mut_slice()).await;
        q.submit_io_commit_cmd(tag, BufDesc::Slice(buf.as_slice()), res)
            .await?;
    }
}

/// Does one request; returns what the driver expects: the bytes done, or a negative errno.
async fn handle(
    shared: &Arc<Shared>,
    kick: &Kick,
    op: u32,
    offset: u64,
    len: usize,
    buf: &mut [u8],
) -> i32 {
    use libublk::sys::{
        UBLK_IO_OP_DISCARD, UBLK_IO_OP_FLUSH, UBLK_IO_OP_READ, UBLK_IO_OP_WRITE,
        UBLK_IO_OP_WRITE_ZEROES,
    };
    let moves_data = op == UBLK_IO_OP_READ || op == UBLK_IO_OP_WRITE;
    if moves_data && len > buf.len() {
        tracing::warn!(op, len, "ublk request larger than its buffer");
        return -libc::EINVAL;
    }
    let Ok(done) = i32::try_from(len) else {
        return -libc::EINVAL;
    };
    let sh = shared.clone();
    let result: StoreResult<()> = match op {
        UBLK_IO_OP_READ => {
            match on_runtime(
                shared,
                kick,
                async move { sh.dev.read_bytes(offset, len).await },
            )
            .await
            {
                Ok(data) => {
                    buf[..len].copy_from_slice(&data);
                    Ok(())
                }
                Err(e) => Err(e),
            }
        }
        UBLK_IO_OP_WRITE => {
            let data = Bytes::copy_from_slice(&buf[..len]);
            on_runtime(shared, kick, async move {
                sh.dev.write_bytes(offset, data).await
            })
            .await
        }
        UBLK_IO_OP_FLUSH => on_runtime(shared, kick, async move { sh.dev.flush().await }).await,
        UBLK_IO_OP_DISCARD | UBLK_IO_OP_WRITE_ZEROES => {
            on_runtime(shared, kick, async move {
                sh.dev.trim_at(offset, len as u64).await
            })
            .await
        }
        _ => return -libc::EOPNOTSUPP,
    };
    match result {
        Ok(()) => done,
        Err(e) => {
            tracing::debug!(op, offset, len, error = %e, "ublk request failed");
            -e.errno()
        }
    }
}

/// Runs `fut` on the tokio runtime and waits for it from the queue's executor.
async fn on_runtime<T, F>(shared: &Shared, kick: &Kick, fut: F) -> StoreResult<T>
where
    T: Send + 'static,
    F: Future<Output = StoreResult<T>> + Send + 'static,
{
    let (tx, rx) = futures::channel::oneshot::channel();
    let kick = kick.clone();
    shared.runtime.spawn(async move {
        // Wake the task (send) before the ring (kick): see the module's contract.
        let _ = tx.send(fut.await);
        kick.kick();
    });
    rx.await.unwrap_or_else(|_| {
        Err(StoreError::new(
            ErrorKind::Closed,
            "the runtime serving the ublk device shut down",
        ))
    })
}
