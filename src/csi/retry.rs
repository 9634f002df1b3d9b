//! Retry policy for CSI calls: jittered exponential backoff.
//!
//! Contract: only `UNAVAILABLE` and `DEADLINE_EXCEEDED` are retried (the
//! plugin is restarting or slow; CSI calls are idempotent, so re-sending is
//! safe). Every other code is the plugin's answer and is final. Retries are
//! bounded both in count (`max_attempts`, which counts the first attempt)
//! and in total time (`max_total`, measured from the first attempt): no
//! sleep ends past it, and each attempt's deadline is cut to what is left of
//! it ([`RetryPolicy::attempt_deadline`]), so a call never runs longer than
//! `max_total`. Each
//! sleep is drawn uniformly from `[0, ceiling]` ("full jitter"), where the
//! ceiling grows by `multiplier` per retry from `initial_backoff` up to
//! `max_backoff`, so that many volumes retrying at once against a restarting
//! plugin do not hit it in lockstep.

use std::time::Duration;

use rand::Rng;
use tonic::Code;

/// How a failed call is retried.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Attempts in total, the first one included (1 = never retry).
    pub max_attempts: u32,
    /// Ceiling of the first backoff.
    pub initial_backoff: Duration,
    /// Largest ceiling a backoff can grow to.
    pub max_backoff: Duration,
    /// Time budget for all attempts and sleeps of one call; no retry is
    /// started once the next sleep would end past it.
    pub max_total: Duration,
    /// Growth factor of the ceiling per retry (>= 1).
    pub multiplier: f64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 5,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            max_total: Duration::from_secs(120),
            multiplier: 2.0,
        }
    }
}

impl RetryPolicy {
    /// A policy that never retries.
    pub fn no_retry() -> Self {
        Self {
            max_attempts: 1,
            ..Self::default()
        }
    }

    /// Whether a call that failed with `code` may be sent again.
    pub fn is_retryable(code: Code) -> bool {
        matches!(code, Code::Unavailable | Code::DeadlineExceeded)
    }

    /// The ceiling of the sleep after the `failed_attempts`-th failure
    /// (1-based): `initial_backoff * multiplier^(failed_attempts - 1)`,
    /// capped at `max_backoff`.
    pub fn backoff_ceiling(&self, failed_attempts: u32) -> Duration {
        let exp = failed_attempts.saturating_sub(1).min(64) as i32;
        let factor = self.multiplier.max(1.0).powi(exp);
        let secs = self.initial_backoff.as_secs_f64() * factor;
        let cap = self.max_backoff.as_secs_f64();
        if !secs.is_finite() || secs >= cap {
            self.max_backoff
        } else {
            Duration::from_secs_f64(secs)
        }
    }

    /// The sleep after the `failed_attempts`-th failure, drawn uniformly
    /// from `[0, backoff_ceiling(failed_attempts)]`.
    pub fn backoff<R: Rng + ?Sized>(&self, failed_attempts: u32, rng: &mut R) -> Duration {
        let ceiling = self.backoff_ceiling(failed_attempts);
        let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(rng.random_range(0..=nanos))
    }

    /// The deadline of an attempt starting `elapsed` after the first one: the
    /// per-call `deadline`, cut to what is left of `max_total`; `None` when
    /// nothing is left (no attempt may start).
    pub fn attempt_deadline(&self, deadline: Duration, elapsed: Duration) -> Option<Duration> {
        let left = self.max_total.checked_sub(elapsed)?;
        (!left.is_zero()).then(|| deadline.min(left))
    }

    /// Decides what to do after attempt number `attempts` (1-based) failed
    /// with `code`, `elapsed` after the first attempt started: `Some(sleep)`
    /// to retry after sleeping, `None` to give up and return the error.
    pub fn next_backoff<R: Rng + ?Sized>(
        &self,
        code: Code,
        attempts: u32,
        elapsed: Duration,
        rng: &mut R,
    ) -> Option<Duration> {
        if !Self::is_retryable(code) || attempts >= self.max_attempts {
            return None;
        }
        let sleep = self.backoff(attempts, rng);
        if elapsed.saturating_add(sleep) >= self.max_total {
            return None;
        }
        Some(sleep)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, SeedableRng};

    fn policy() -> RetryPolicy {
        RetryPolicy::default()
    }

    #[test]
    fn ceiling_grows_exponentially_and_is_capped() {
        let p = policy();
        let cases = [
            (1, 100),
            (2, 200),
            (3, 400),
            (4, 800),
            (5, 1600),
            (6, 3200),
            (7, 5000),
            (8, 5000),
            (1000, 5000),
            (u32::MAX, 5000),
        ];
        for (n, ms) in cases {
            assert_eq!(
                p.backoff_ceiling(n),
                Duration::from_millis(ms),
                "failure {n}"
            );
        }
        // A zero count is treated like the first failure.
        assert_eq!(p.backoff_ceiling(0), Duration::from_millis(100));
    }

    #[test]
    fn multiplier_below_one_does_not_shrink() {
        let p = RetryPolicy {
            multiplier: 0.5,
            ..policy()
        };
        assert_eq!(p.backoff_ceiling(5), Duration::from_millis(100));
    }

    #[test]
    fn jitter_stays_within_zero_and_ceiling_and_spreads() {
        let p = policy();
        let mut rng = StdRng::seed_from_u64(7);
        for n in 1..10 {
            let ceiling = p.backoff_ceiling(n);
            let samples: Vec<Duration> = (0..2000).map(|_| p.backoff(n, &mut rng)).collect();
            assert!(samples.iter().all(|d| *d <= ceiling), "failure {n}");
            let min = samples.iter().min().unwrap();
            let max = samples.iter().max().unwrap();
            // Full jitter: the draws cover most of [0, ceiling].
            assert!(
                *min < ceiling / 10,
                "failure {n}: min {min:?} of {ceiling:?}"
            );
            assert!(
                *max > ceiling * 9 / 10,
                "failure {n}: max {max:?} of {ceiling:?}"
            );
        }
    }

    #[test]
    fn only_unavailable_and_deadline_are_retried() {
        for code in [
            Code::Ok,
            Code::Cancelled,
            Code::Unknown,
            Code::InvalidArgument,
            Code::NotFound,
            Code::AlreadyExists,
            Code::PermissionDenied,
            Code::ResourceExhausted,
            Code::FailedPrecondition,
            Code::Aborted,
            Code::OutOfRange,
            Code::Unimplemented,
            Code::Internal,
            Code::DataLoss,
            Code::Unauthenticated,
        ] {
            assert!(!RetryPolicy::is_retryable(code), "{code:?}");
            let mut rng = StdRng::seed_from_u64(1);
            assert_eq!(
                policy().next_backoff(code, 1, Duration::ZERO, &mut rng),
                None
            );
        }
        assert!(RetryPolicy::is_retryable(Code::Unavailable));
        assert!(RetryPolicy::is_retryable(Code::DeadlineExceeded));
    }

    #[test]
    fn attempts_are_bounded_by_count() {
        let p = policy();
        let mut rng = StdRng::seed_from_u64(3);
        for attempts in 1..p.max_attempts {
            let sleep = p.next_backoff(Code::Unavailable, attempts, Duration::ZERO, &mut rng);
            assert!(
                sleep.is_some_and(|s| s <= p.backoff_ceiling(attempts)),
                "attempt {attempts}"
            );
        }
        assert_eq!(
            p.next_backoff(Code::Unavailable, p.max_attempts, Duration::ZERO, &mut rng),
            None
        );
        assert_eq!(
            RetryPolicy::no_retry().next_backoff(Code::Unavailable, 1, Duration::ZERO, &mut rng),
            None
        );
    }

    #[test]
    fn attempt_deadlines_are_cut_to_the_total_budget() {
        let p = RetryPolicy {
            max_total: Duration::from_secs(10),
            ..policy()
        };
        let d = Duration::from_secs(3);
        let cases = [
            (0, Some(3000)),
            (6_000, Some(3000)),
            (7_000, Some(3000)),
            (8_500, Some(1500)),
            (9_999, Some(1)),
            (10_000, None),
            (12_000, None),
        ];
        for (elapsed, want) in cases {
            assert_eq!(
                p.attempt_deadline(d, Duration::from_millis(elapsed)),
                want.map(Duration::from_millis),
                "elapsed {elapsed}ms"
            );
        }
        // With the default unbounded-looking budget the deadline is untouched.
        let unbounded = RetryPolicy {
            max_total: Duration::MAX,
            ..policy()
        };
        assert_eq!(
            unbounded.attempt_deadline(d, Duration::from_secs(1)),
            Some(d)
        );
    }

    #[test]
    fn attempts_are_bounded_by_total_time() {
        let p = RetryPolicy {
            max_attempts: 100,
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(1),
            max_total: Duration::from_secs(10),
            multiplier: 2.0,
        };
        let mut rng = StdRng::seed_from_u64(5);
        assert_eq!(
            p.next_backoff(Code::DeadlineExceeded, 3, Duration::from_secs(10), &mut rng),
            None
        );
        assert_eq!(
            p.next_backoff(Code::DeadlineExceeded, 3, Duration::from_secs(60), &mut rng),
            None
        );
        // Just inside the budget, a retry happens only when its sleep ends in time.
        let elapsed = Duration::from_millis(9_500);
        let (mut retried, mut gave_up) = (0, 0);
        for _ in 0..200 {
            match p.next_backoff(Code::DeadlineExceeded, 3, elapsed, &mut rng) {
                Some(sleep) => {
                    assert!(elapsed + sleep < p.max_total);
                    retried += 1;
                }
                None => gave_up += 1,
            }
        }
        assert!(
            retried > 0 && gave_up > 0,
            "retried {retried}, gave up {gave_up}"
        );
    }
}
