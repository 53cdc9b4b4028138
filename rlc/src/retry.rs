//! The one backoff of rlc's retries (the controller push, history requests): exponential
//! between a first and a largest delay, with equal jitter (a delay is drawn in
//! `[cap / 2, cap]`) so that retries of many clients do not march in step, and a bounded
//! number of attempts.

use std::time::Duration;

use rand::Rng;

/// Exponential backoff between `min` and `max`, at most `attempts` tries (`None` = until
/// it succeeds or fails for good).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// First delay (its cap: the delay drawn is at least half of it).
    pub min: Duration,
    /// Largest delay.
    pub max: Duration,
    /// Tries at most.
    pub attempts: Option<u32>,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            min: Duration::from_millis(200),
            max: Duration::from_secs(30),
            attempts: Some(5),
        }
    }
}

impl Backoff {
    /// The wait before try `attempt` (2 is the first retry): drawn in `[cap / 2, cap]`, the
    /// cap doubling from `min` per attempt up to `max`.
    pub fn delay(&self, attempt: u32) -> Duration {
        let cap = self
            .min
            .saturating_mul(1 << attempt.saturating_sub(2).min(20))
            .min(self.max)
            .max(self.min.min(self.max));
        if cap.is_zero() {
            return cap;
        }
        rand::thread_rng().gen_range(cap / 2..=cap)
    }

    /// Whether try `attempt` was the last one allowed.
    pub fn exhausted(&self, attempt: u32) -> bool {
        self.attempts.is_some_and(|n| attempt >= n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_up_to_the_cap_with_jitter_and_attempts_are_bounded() {
        let b = Backoff {
            min: Duration::from_millis(100),
            max: Duration::from_millis(1000),
            attempts: Some(4),
        };
        for _ in 0..100 {
            for (attempt, cap) in [
                (2, 100),
                (3, 200),
                (4, 400),
                (5, 800),
                (6, 1000),
                (30, 1000),
            ] {
                let d = b.delay(attempt).as_millis() as u64;
                assert!((cap / 2..=cap).contains(&d), "attempt {attempt}: {d} ms");
            }
        }
        assert!(!b.exhausted(3));
        assert!(b.exhausted(4));
        assert!(!Backoff {
            attempts: None,
            ..b
        }
        .exhausted(1000));
    }
}
