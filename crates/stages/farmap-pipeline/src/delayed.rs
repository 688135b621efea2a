//! [`Delayed`]: emulated latency and bandwidth (like nbdkit's delay and rate filters).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use farmap_core::{
    BoxFuture, Caps, ChunkIdx, ChunkRange, ChunkStatus, Geometry, Store, StoreResult,
};
use parking_lot::Mutex;

use crate::timer::{sleep, sleep_until};

/// How slow a [`Delayed`] stage makes its inner store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct DelayOptions {
    /// Added to every operation, like a network round trip. Zero adds nothing.
    pub latency: Duration,
    /// Bytes per second of the emulated link, shared by all operations; `None` for no limit.
    /// Must not be `Some(0)`.
    pub bandwidth: Option<u64>,
}

/// Makes every operation of its inner store slower, as a remote store behind a link would be.
///
/// - **Latency** is per operation, like a round trip time: each operation waits `latency` in
///   addition to whatever the inner store takes. Concurrent operations wait concurrently, so
///   N operations in flight still complete N per `latency`.
/// - **Bandwidth** models one serial link shared by reads and writes: an operation's payload
///   (a write's data, a read's returned chunk) occupies the link for `len / bandwidth` seconds,
///   starting when the link is free. A write transmits first and then waits `latency` before
///   calling the inner store; a read waits `latency`, calls the inner store, then transmits
///   what it returns. The throughput of a busy stage therefore never exceeds `bandwidth`.
///   `flush`, `trim` and `status` carry no payload.
///
/// Waits use the precise [`timer`](crate::timer), not tokio's millisecond wheel.
///
/// Concurrency contract:
/// - No lock is held while waiting or while the inner store works; the link's "free at"
///   instant is updated under a short lock.
/// - With zero latency and no bandwidth limit, every call goes straight to the inner store.
/// - [`set_latency`](Delayed::set_latency) applies to operations that start after it.
/// - Dropping an operation's future while it waits cancels it (before the inner store is
///   called, except for a read waiting for its transmission); link time already reserved
///   stays reserved.
#[derive(Debug)]
pub struct Delayed<S> {
    inner: S,
    latency_ns: AtomicU64,
    bandwidth: Option<u64>,
    /// When the link finishes transmitting everything reserved so far.
    link_free_at: Mutex<Instant>,
}

impl<S: Store> Delayed<S> {
    /// Wraps `inner` with the given delays.
    ///
    /// # Panics
    /// If `options.bandwidth` is `Some(0)`.
    pub fn new(inner: S, options: DelayOptions) -> Self {
        assert!(
            options.bandwidth != Some(0),
            "a delayed store's bandwidth must be greater than zero"
        );
        Self {
            inner,
            latency_ns: AtomicU64::new(duration_ns(options.latency)),
            bandwidth: options.bandwidth,
            link_free_at: Mutex::new(Instant::now()),
        }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// The latency added to each operation now.
    pub fn latency(&self) -> Duration {
        Duration::from_nanos(self.latency_ns.load(Ordering::Relaxed))
    }

    /// Changes the latency for operations that start from now on.
    pub fn set_latency(&self, latency: Duration) {
        self.latency_ns
            .store(duration_ns(latency), Ordering::Relaxed);
    }

    /// The link's bandwidth in bytes per second, if limited.
    pub fn bandwidth(&self) -> Option<u64> {
        self.bandwidth
    }

    /// Whether operations go straight to the inner store.
    fn is_transparent(&self, latency: Duration) -> bool {
        latency.is_zero() && self.bandwidth.is_none()
    }

    /// Reserves the link for `len` bytes; returns when their transmission ends, or `None`
    /// without a bandwidth limit.
    fn transmit(&self, len: usize) -> Option<Instant> {
        let bandwidth = self.bandwidth?;
        let ns = (len as u128 * 1_000_000_000).div_ceil(u128::from(bandwidth));
        let busy = Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX));
        let now = Instant::now();
        let mut free_at = self.link_free_at.lock();
        let end = (*free_at).max(now) + busy;
        *free_at = end;
        Some(end)
    }

    /// Waits `latency` (from now), or nothing.
    async fn wait_latency(latency: Duration) {
        if !latency.is_zero() {
            sleep(latency).await;
        }
    }
}

fn duration_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl<S: Store> Store for Delayed<S> {
    fn geometry(&self) -> Geometry {
        self.inner.geometry()
    }

    fn caps(&self) -> Caps {
        self.inner.caps()
    }

    fn read(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<Bytes>> {
        let latency = self.latency();
        if self.is_transparent(latency) {
            return self.inner.read(idx);
        }
        Box::pin(async move {
            Self::wait_latency(latency).await;
            let data = self.inner.read(idx).await?;
            if let Some(end) = self.transmit(data.len()) {
                sleep_until(end).await;
            }
            Ok(data)
        })
    }

    fn write(&self, idx: ChunkIdx, data: Bytes) -> BoxFuture<'_, StoreResult<()>> {
        let latency = self.latency();
        if self.is_transparent(latency) {
            return self.inner.write(idx, data);
        }
        Box::pin(async move {
            match self.transmit(data.len()) {
                Some(end) => sleep_until(end + latency).await,
                None => Self::wait_latency(latency).await,
            }
            self.inner.write(idx, data).await
        })
    }

    fn flush(&self) -> BoxFuture<'_, StoreResult<()>> {
        let latency = self.latency();
        if latency.is_zero() {
            return self.inner.flush();
        }
        Box::pin(async move {
            sleep(latency).await;
            self.inner.flush().await
        })
    }

    fn trim(&self, range: ChunkRange) -> BoxFuture<'_, StoreResult<()>> {
        let latency = self.latency();
        if latency.is_zero() {
            return self.inner.trim(range);
        }
        Box::pin(async move {
            sleep(latency).await;
            self.inner.trim(range).await
        })
    }

    fn status(&self, idx: ChunkIdx) -> BoxFuture<'_, StoreResult<ChunkStatus>> {
        let latency = self.latency();
        if latency.is_zero() {
            return self.inner.status(idx);
        }
        Box::pin(async move {
            sleep(latency).await;
            self.inner.status(idx).await
        })
    }
}
