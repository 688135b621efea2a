//! Retries of store operations that failed with a [retryable](farmap_core::StoreError::is_retryable)
//! error, with exponential backoff and jitter.
//!
//! Only `Timeout` and `Unavailable` errors are retried: a corrupt chunk or a full disk does
//! not get better by asking again, and retrying it only delays the report.

use std::future::Future;
use std::time::Duration;

use farmap_core::StoreResult;
use rand::Rng;

/// How often and how patiently an operation is retried.
///
/// Attempt `n` (counting from 1) that fails with a retryable error is followed by a pause of
/// about `initial_backoff * 2^(n-1)`, capped at `max_backoff`, of which a random half is
/// jitter (so that many workers that failed together do not retry together).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Total number of attempts, the first included. `0` is treated as `1`.
    pub attempts: u32,
    /// Pause after the first failed attempt.
    pub initial_backoff: Duration,
    /// Longest pause between two attempts.
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    /// 5 attempts, 10 ms doubling up to 1 s (at most ≈ 150 ms spent waiting in all).
    fn default() -> Self {
        Self {
            attempts: 5,
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_secs(1),
        }
    }
}

impl RetryPolicy {
    /// One attempt, no retry.
    pub fn none() -> Self {
        Self {
            attempts: 1,
            initial_backoff: Duration::ZERO,
            max_backoff: Duration::ZERO,
        }
    }

    /// `attempts` attempts with no pause between them (for tests and in-memory stores).
    pub fn immediate(attempts: u32) -> Self {
        Self {
            attempts,
            initial_backoff: Duration::ZERO,
            max_backoff: Duration::ZERO,
        }
    }

    /// Attempts 10 ms apart, doubling up to 1 s, for at least `total` of pausing in all
    /// (jitter included): for callers that must outlast an outage, such as a migration's
    /// destination waiting for its source to come back.
    pub fn for_at_least(total: Duration) -> Self {
        let mut p = Self::default();
        let mut waited = Duration::ZERO;
        p.attempts = 1;
        while waited < total && p.attempts < u32::MAX {
            // Each pause is at least half its full length (see `backoff`).
            let full = p
                .initial_backoff
                .saturating_mul(1u32 << (p.attempts - 1).min(31))
                .min(p.max_backoff);
            waited += full / 2;
            p.attempts += 1;
        }
        p
    }

    /// The pause after failed attempt number `attempt` (1-based), jitter included.
    pub fn backoff(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(1).min(31);
        let full = self
            .initial_backoff
            .saturating_mul(1u32 << doublings)
            .min(self.max_backoff);
        if full.is_zero() {
            return full;
        }
        // "Equal jitter": half fixed, half random, so the pause never collapses to nothing.
        let half = full / 2;
        let jitter = rand::thread_rng().gen_range(Duration::ZERO..=full - half);
        half + jitter
    }

    /// Whether another attempt follows failed attempt number `attempt` (1-based).
    pub fn allows_another(&self, attempt: u32) -> bool {
        attempt < self.attempts.max(1)
    }
}

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

    #[test]
    fn for_at_least_outlasts_the_outage_even_with_the_shortest_jitter() {
        for secs in [0u64, 1, 30] {
            let total = Duration::from_secs(secs);
            let p = RetryPolicy::for_at_least(total);
            let least: Duration = (1..p.attempts)
                .map(|n| {
                    p.initial_backoff
                        .saturating_mul(1 << (n - 1).min(31))
                        .min(p.max_backoff)
                        / 2
                })
                .sum();
            assert!(least >= total, "{secs} s: {p:?} waits at least {least:?}");
            assert!(
                least < total + p.max_backoff,
                "{secs} s: not far more than needed"
            );
        }
    }

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

    #[tokio::test(start_paused = true)]
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
        // 5..10 + 10..20 + 20..40 ms
        assert!(waited >= Duration::from_millis(35) && waited <= Duration::from_millis(70));
    }
}
