//! The per-user rate limit of seed 004 §1.5.6 (`RATE_LIMIT_EXCEEDED`): a token bucket per user in
//! this process's memory. With several gateway processes each counts its own requests, so the
//! effective limit is the configured one times the number of processes behind the balancer.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

/// The per-user limits of seed 004 §1.5.6: the per-second bucket here, and the transfers per UTC
/// day (`gateway.daily_count`), counted in the database (`store::record_within_limits`, which
/// also applies the asset's daily amount).
#[derive(Debug)]
pub struct Limits {
    pub rate: RateLimiter,
    pub daily_count: u32,
}

/// At most this many users are tracked; past it the full (idle) buckets are forgotten.
const MAX_TRACKED: usize = 100_000;

#[derive(Debug)]
pub struct RateLimiter {
    per_sec: f64,
    burst: f64,
    buckets: Mutex<HashMap<String, Bucket>>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn refilled(self, now: Instant, per_sec: f64, burst: f64) -> f64 {
        (self.tokens + now.saturating_duration_since(self.at).as_secs_f64() * per_sec).min(burst)
    }
}

impl RateLimiter {
    /// `per_sec` requests per second per user, `burst` at once.
    pub fn new(per_sec: u32, burst: u32) -> RateLimiter {
        RateLimiter {
            per_sec: f64::from(per_sec.max(1)),
            burst: f64::from(burst.max(1)),
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Whether `user` may make a request now (and counts it if so).
    pub fn allow(&self, user: &str) -> bool {
        self.allow_at(user, Instant::now())
    }

    fn allow_at(&self, user: &str, now: Instant) -> bool {
        let (per_sec, burst) = (self.per_sec, self.burst);
        // A panic while holding the lock leaves plain numbers behind: still usable.
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if buckets.len() >= MAX_TRACKED && !buckets.contains_key(user) {
            buckets.retain(|_, b| b.refilled(now, per_sec, burst) < burst);
        }
        let bucket = buckets.entry(user.to_string()).or_insert(Bucket {
            tokens: burst,
            at: now,
        });
        let tokens = bucket.refilled(now, per_sec, burst);
        bucket.at = now;
        if tokens >= 1.0 {
            bucket.tokens = tokens - 1.0;
            true
        } else {
            bucket.tokens = tokens;
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_burst_then_the_rate_per_user() {
        let l = RateLimiter::new(2, 3);
        let t0 = Instant::now();
        assert!((0..3).all(|_| l.allow_at("a", t0)), "the burst");
        assert!(!l.allow_at("a", t0), "above the burst");
        assert!(l.allow_at("b", t0), "another user has a bucket of its own");
        // Half a second at 2 per second: one more.
        let t1 = t0 + Duration::from_millis(500);
        assert!(l.allow_at("a", t1));
        assert!(!l.allow_at("a", t1));
        // A long pause refills to the burst, not beyond.
        let t2 = t1 + Duration::from_secs(60);
        assert!((0..3).all(|_| l.allow_at("a", t2)));
        assert!(!l.allow_at("a", t2));
    }
}
