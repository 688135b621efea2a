//! Waiting in tests, always bounded: a hang fails the test instead of hanging it.

use std::future::Future;
use std::time::{Duration, Instant};

/// Runs a future to completion on a throwaway current-thread runtime (time and I/O enabled):
/// for synchronous tests. Not to be called on a runtime's thread.
pub fn block_on<T>(f: impl Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime")
        .block_on(f)
}

/// A multi-thread runtime of two workers (time and I/O enabled): for synchronous tests that
/// run a server and its clients at once.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// Runs `f` on a thread and waits at most `limit` for it: its result.
///
/// # Panics
/// If `f` takes longer (naming `what`), or panics.
pub fn within<T: Send + 'static>(
    limit: Duration,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("{what} did not finish within {limit:?}"))
}

/// Waits until `cond` holds, checking it every millisecond.
///
/// # Panics
/// If it does not hold within `limit` (naming `what`).
pub fn eventually(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(Instant::now() < deadline, "{what} (not within {limit:?})");
        std::thread::sleep(Duration::from_millis(1));
    }
}
