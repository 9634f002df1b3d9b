//! Latency samples and their percentiles (nearest rank), and the number
//! formatting the report uses.

use std::time::Duration;

/// Latencies of one measured operation.
#[derive(Clone, Debug, Default)]
pub struct Samples {
    values: Vec<Duration>,
}

impl Samples {
    /// No samples yet.
    pub fn new() -> Self {
        Samples::default()
    }

    /// Adds one latency.
    pub fn push(&mut self, d: Duration) {
        self.values.push(d);
    }

    /// How many latencies.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// The `p`-th percentile (0 < p <= 100) by nearest rank; zero when empty.
    pub fn percentile(&self, p: f64) -> Duration {
        if self.values.is_empty() {
            return Duration::ZERO;
        }
        let mut sorted = self.values.clone();
        sorted.sort_unstable();
        let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
        sorted[rank.clamp(1, sorted.len()) - 1]
    }

    /// The median.
    pub fn p50(&self) -> Duration {
        self.percentile(50.0)
    }

    /// The 99th percentile.
    pub fn p99(&self) -> Duration {
        self.percentile(99.0)
    }
}

/// A duration in the unit that keeps 3 significant digits readable.
pub fn fmt_dur(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us < 1000.0 {
        format!("{us:.0} us")
    } else if us < 1_000_000.0 {
        format!("{:.2} ms", us / 1000.0)
    } else {
        format!("{:.2} s", us / 1e6)
    }
}

/// `a / b` as a ratio (infinity when `b` is zero).
pub fn ratio(a: Duration, b: Duration) -> f64 {
    if b.is_zero() {
        f64::INFINITY
    } else {
        a.as_secs_f64() / b.as_secs_f64()
    }
}

/// PASS or MISS.
pub fn verdict(pass: bool) -> &'static str {
    if pass {
        "PASS"
    } else {
        "MISS"
    }
}
