//! [`WritePool`]: buffers for write payloads, allocated once when the mount starts.
//!
//! fuser hands a write's payload as a borrowed slice of its request buffer, which it reuses
//! for the next request; the payload has to be copied before the request is handed to a task.
//! Without a pool, that copy is a fresh allocation of up to `max_write` bytes per request. A
//! swap server must not allocate there: an allocation that needs a new page can enter reclaim,
//! and reclaim may be waiting for the very swap-out this write is (see `farmap swap on`).
//! With a pool, the payload goes into one of a fixed set of buffers that exist (and are
//! locked, once the process `mlockall`s) from the start, and the buffer comes back to the
//! pool when the last `Bytes` referring to it is dropped.
//!
//! A store that keeps the `Bytes` it is given (the sparse memory store) keeps the buffer, and
//! the pool runs dry; then payloads are copied into fresh allocations and counted as
//! [`misses`](WritePool::misses). Use a pool only over stores that copy what they keep (the
//! dense memory store, remote stores, a managed store over dense local memory).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;

/// A fixed set of equally sized buffers for write payloads (cheap to clone: shared).
#[derive(Clone)]
pub struct WritePool {
    inner: Arc<Inner>,
}

struct Inner {
    /// The free buffers. Its capacity is the pool's size, so returning a buffer never
    /// allocates.
    free: Mutex<Vec<Box<[u8]>>>,
    buffer_len: usize,
    count: usize,
    misses: AtomicU64,
}

impl std::fmt::Debug for WritePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WritePool")
            .field("buffers", &self.inner.count)
            .field("buffer_len", &self.inner.buffer_len)
            .field("free", &self.free())
            .field("misses", &self.misses())
            .finish()
    }
}

impl WritePool {
    /// `count` buffers of `buffer_len` bytes each, allocated and written now (so that every
    /// page exists before the process locks its memory).
    pub fn new(count: usize, buffer_len: usize) -> WritePool {
        let mut free = Vec::with_capacity(count);
        for _ in 0..count {
            // Written, not just allocated: a zeroed allocation may be untouched fresh pages.
            let mut buf = vec![0u8; buffer_len].into_boxed_slice();
            for page in buf.chunks_mut(4096) {
                page[0] = 1;
            }
            free.push(buf);
        }
        WritePool {
            inner: Arc::new(Inner {
                free: Mutex::new(free),
                buffer_len,
                count,
                misses: AtomicU64::new(0),
            }),
        }
    }

    /// A copy of `data` in a buffer of the pool, which goes back to the pool when the last
    /// clone of the returned `Bytes` is dropped. When every buffer is in use (or `data` is
    /// longer than a buffer), a fresh allocation, counted as a miss.
    pub fn copy(&self, data: &[u8]) -> Bytes {
        let buf = if data.len() <= self.inner.buffer_len {
            self.inner.free.lock().pop()
        } else {
            None
        };
        let Some(mut buf) = buf else {
            self.inner.misses.fetch_add(1, Ordering::Relaxed);
            return Bytes::copy_from_slice(data);
        };
        buf[..data.len()].copy_from_slice(data);
        Bytes::from_owner(Pooled {
            buf: Some(buf),
            len: data.len(),
            pool: self.inner.clone(),
        })
    }

    /// Buffers in the pool.
    pub fn count(&self) -> usize {
        self.inner.count
    }

    /// Free buffers now.
    pub fn free(&self) -> usize {
        self.inner.free.lock().len()
    }

    /// Payloads that did not fit in a free buffer and were copied into a fresh allocation.
    pub fn misses(&self) -> u64 {
        self.inner.misses.load(Ordering::Relaxed)
    }
}

/// A buffer lent out by the pool, holding `len` bytes of payload.
struct Pooled {
    buf: Option<Box<[u8]>>,
    len: usize,
    pool: Arc<Inner>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        match &self.buf {
            Some(buf) => &buf[..self.len],
            None => &[],
        }
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            let mut free = self.pool.free.lock();
            // Never more than the pool's own buffers: the push cannot reallocate.
            if free.len() < free.capacity() {
                free.push(buf);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_when_the_last_reference_is_dropped() {
        let pool = WritePool::new(2, 8);
        let a = pool.copy(b"abc");
        let b = pool.copy(b"12345678");
        assert_eq!(&a[..], b"abc");
        assert_eq!(&b[..], b"12345678");
        assert_eq!(pool.free(), 0);
        // A third payload while both are out: a fresh copy, counted.
        let c = pool.copy(b"xyz");
        assert_eq!(&c[..], b"xyz");
        assert_eq!(pool.misses(), 1);
        // A slice keeps its buffer out; dropping the last reference brings it back.
        let tail = a.slice(1..);
        drop(a);
        assert_eq!(pool.free(), 0);
        assert_eq!(&tail[..], b"bc");
        drop(tail);
        assert_eq!(pool.free(), 1);
        drop((b, c));
        assert_eq!(pool.free(), 2);
        // The reused buffer holds the new payload only.
        let d = pool.copy(b"q");
        assert_eq!(&d[..], b"q");
        assert_eq!(pool.misses(), 1);
    }

    #[test]
    fn a_payload_longer_than_a_buffer_is_a_miss() {
        let pool = WritePool::new(1, 4);
        let big = pool.copy(b"too long");
        assert_eq!(&big[..], b"too long");
        assert_eq!((pool.misses(), pool.free()), (1, 1));
    }

    #[test]
    fn buffers_cross_threads() {
        let pool = WritePool::new(4, 4096);
        let handles: Vec<_> = (0..8u8)
            .map(|i| {
                let pool = pool.clone();
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        let b = pool.copy(&[i; 4096]);
                        assert!(b.iter().all(|&x| x == i));
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(pool.free(), 4, "every buffer came back");
    }
}
