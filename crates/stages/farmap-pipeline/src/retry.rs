//! Retries of store operations that failed with a [retryable](farmap_core::StoreError::is_retryable)
//! error, with exponential backoff and jitter.
//!
//! Only `Timeout` and `Unavailable` errors are retried: a corrupt chunk or a full disk does
//! not get better by asking again, and retrying it only delays the report.

use std::future::Future;

use farmap_core::StoreResult;

pub use farmap_core::RetryPolicy;

/// Runs `op` until it succeeds, fails with an error that is not retryable, or `policy`
/// runs out of attempts; returns the last result.
///
/// `op` is called once per attempt and must build a fresh future each time.
pub async fn retry<T, F, Fut>(policy: RetryPolicy, mut op: F) -> StoreResult<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = StoreResult<T>>,
{
    let mut attempt = 1;
    loop {
        match op().await {
            Err(e) if e.is_retryable() && policy.allows_another(attempt) => {
                let pause = policy.backoff(attempt);
                if !pause.is_zero() {
                    tokio::time::sleep(pause).await;
                }
                attempt += 1;
            }
            result => return result,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use farmap_core::{ErrorKind, StoreError};
    use std::cell::Cell;
    use std::time::Duration;

    fn failing(kinds: &[ErrorKind]) -> impl FnMut() -> std::future::Ready<StoreResult<u32>> + '_ {
        let calls = Cell::new(0usize);
        move || {
            let n = calls.get();
            calls.set(n + 1);
            std::future::ready(match kinds.get(n) {
                Some(k) => Err(StoreError::new(*k, "injected")),
                None => Ok(n as u32),
            })
        }
    }

    #[tokio::test]
    async fn retryable_errors_are_retried_until_success() {
        let kinds = [
            ErrorKind::Timeout,
            ErrorKind::Unavailable,
            ErrorKind::Timeout,
        ];
        let r = retry(RetryPolicy::immediate(4), failing(&kinds)).await;
        assert_eq!(r.unwrap(), 3, "the fourth attempt succeeds");
    }

    #[tokio::test]
    async fn attempts_are_bounded() {
        let kinds = [ErrorKind::Timeout; 10];
        let r = retry(RetryPolicy::immediate(3), failing(&kinds)).await;
        assert_eq!(r.unwrap_err().kind(), ErrorKind::Timeout);
        let mut calls = 0;
        let _ = retry(RetryPolicy::immediate(3), || {
            calls += 1;
            std::future::ready(Err::<(), _>(StoreError::new(ErrorKind::Timeout, "x")))
        })
        .await;
        assert_eq!(calls, 3);
    }

    #[tokio::test]
    async fn permanent_errors_are_not_retried() {
        let mut calls = 0;
        let r = retry(RetryPolicy::immediate(5), || {
            calls += 1;
            std::future::ready(Err::<(), _>(StoreError::new(ErrorKind::Corrupt, "x")))
        })
        .await;
        assert_eq!(r.unwrap_err().kind(), ErrorKind::Corrupt);
        assert_eq!(calls, 1);
    }

    // Real time (no paused clock: tokio's test-util would give test builds other tokio
    // features than the library's, see the workspace Cargo.toml): the waits are short.
    #[tokio::test]
    async fn backoff_grows_and_is_capped() {
        let p = RetryPolicy {
            attempts: 10,
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(40),
        };
        for _ in 0..100 {
            let b1 = p.backoff(1);
            assert!(b1 >= Duration::from_millis(5) && b1 <= Duration::from_millis(10));
            let b3 = p.backoff(3);
            assert!(b3 >= Duration::from_millis(20) && b3 <= Duration::from_millis(40));
            assert!(p.backoff(30) <= Duration::from_millis(40));
        }
        assert!(p.backoff(u32::MAX) <= Duration::from_millis(40));
        let start = tokio::time::Instant::now();
        let kinds = [ErrorKind::Timeout; 3];
        retry(p, failing(&kinds)).await.unwrap();
        let waited = start.elapsed();
        // 5..10 + 10..20 + 20..40 ms; a loaded machine may sleep longer, never shorter.
        assert!(waited >= Duration::from_millis(35), "{waited:?}");
        assert!(waited <= Duration::from_secs(5), "{waited:?}");
    }
}
