//! One retry policy for everything that tries again: store operations that failed with a
//! [retryable](crate::StoreError::is_retryable) error (`farmap_pipeline::retry` runs them) and
//! reconnections (`farmap_net`'s remote store): attempts, exponential backoff, jitter.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

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
        half + (full - half).mul_f64(unit_random())
    }

    /// Whether another attempt follows failed attempt number `attempt` (1-based).
    pub fn allows_another(&self, attempt: u32) -> bool {
        attempt < self.attempts.max(1)
    }
}

/// A number in [0, 1] that differs from call to call: the jitter of [`RetryPolicy::backoff`]
/// (the standard library's per-map random keys; no random-number crate needed for spreading
/// retries apart).
fn unit_random() -> f64 {
    let bits = RandomState::new().build_hasher().finish();
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn pauses_double_up_to_the_cap_with_equal_jitter() {
        let p = RetryPolicy {
            attempts: 10,
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(100),
        };
        for (attempt, full) in [(1, 10), (2, 20), (3, 40), (4, 80), (5, 100), (9, 100)] {
            let full = Duration::from_millis(full);
            for _ in 0..50 {
                let d = p.backoff(attempt);
                assert!(
                    d >= full / 2 && d <= full,
                    "attempt {attempt}: {d:?} of {full:?}"
                );
            }
        }
        assert!(p.allows_another(9) && !p.allows_another(10));
        assert_eq!(RetryPolicy::none().backoff(3), Duration::ZERO);
    }
}
