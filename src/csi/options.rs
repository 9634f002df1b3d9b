//! Settings of a [`Client`](super::Client): per-call deadline, how long
//! `connect` waits for the plugin, and the retry policy.

use std::time::Duration;

use super::retry::RetryPolicy;

/// Settings of a [`Client`](super::Client).
#[derive(Debug, Clone, PartialEq)]
pub struct ClientOptions {
    /// Deadline of one attempt of a call: sent to the plugin as
    /// `grpc-timeout` and enforced locally; an attempt that runs out of it
    /// fails with `DEADLINE_EXCEEDED` (and may be retried).
    pub deadline: Duration,
    /// How long [`Client::connect`](super::Client::connect) waits for the
    /// socket to appear, accept connections and answer `Probe` as ready.
    pub connect_timeout: Duration,
    /// How failed calls are retried.
    pub retry: RetryPolicy,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            deadline: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(30),
            retry: RetryPolicy::default(),
        }
    }
}
