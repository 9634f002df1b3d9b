//! Per-RPC call metrics of a [`Client`](super::Client).
//!
//! Contract: a *call* is one invocation of a client method, however many
//! attempts it took. Each call is counted as `pending` while in flight and
//! ends in exactly one of `finished` (OK), `failed` (error, after its last
//! attempt) or `cancelled` (the caller dropped the future first). Every
//! retry (attempt after the first) adds one to `retries`. The latency of
//! finished and failed calls, retries and sleeps included, goes into a
//! histogram with fixed buckets. Counters are lock-free atomics, so
//! recording costs nothing next to an RPC; a [`Metrics`] is shared by all
//! clones of a client and may be read at any time.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The CSI methods the client calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Rpc {
    /// `Identity.GetPluginInfo`.
    GetPluginInfo,
    /// `Identity.GetPluginCapabilities`.
    GetPluginCapabilities,
    /// `Identity.Probe`.
    Probe,
    /// `Controller.ControllerGetCapabilities`.
    ControllerGetCapabilities,
    /// `Controller.CreateVolume`.
    CreateVolume,
    /// `Controller.DeleteVolume`.
    DeleteVolume,
    /// `Controller.ControllerPublishVolume`.
    ControllerPublishVolume,
    /// `Controller.ControllerUnpublishVolume`.
    ControllerUnpublishVolume,
    /// `Controller.ValidateVolumeCapabilities`.
    ValidateVolumeCapabilities,
    /// `Controller.ListVolumes`.
    ListVolumes,
    /// `Controller.GetCapacity`.
    GetCapacity,
    /// `Node.NodeGetCapabilities`.
    NodeGetCapabilities,
    /// `Node.NodeGetInfo`.
    NodeGetInfo,
    /// `Node.NodeStageVolume`.
    NodeStageVolume,
    /// `Node.NodeUnstageVolume`.
    NodeUnstageVolume,
    /// `Node.NodePublishVolume`.
    NodePublishVolume,
    /// `Node.NodeUnpublishVolume`.
    NodeUnpublishVolume,
    /// `Node.NodeGetVolumeStats`.
    NodeGetVolumeStats,
}

impl Rpc {
    /// Every RPC, in declaration order.
    pub const ALL: [Rpc; 18] = [
        Rpc::GetPluginInfo,
        Rpc::GetPluginCapabilities,
        Rpc::Probe,
        Rpc::ControllerGetCapabilities,
        Rpc::CreateVolume,
        Rpc::DeleteVolume,
        Rpc::ControllerPublishVolume,
        Rpc::ControllerUnpublishVolume,
        Rpc::ValidateVolumeCapabilities,
        Rpc::ListVolumes,
        Rpc::GetCapacity,
        Rpc::NodeGetCapabilities,
        Rpc::NodeGetInfo,
        Rpc::NodeStageVolume,
        Rpc::NodeUnstageVolume,
        Rpc::NodePublishVolume,
        Rpc::NodeUnpublishVolume,
        Rpc::NodeGetVolumeStats,
    ];

    /// The CSI method name, e.g. `NodePublishVolume`.
    pub fn name(self) -> &'static str {
        match self {
            Rpc::GetPluginInfo => "GetPluginInfo",
            Rpc::GetPluginCapabilities => "GetPluginCapabilities",
            Rpc::Probe => "Probe",
            Rpc::ControllerGetCapabilities => "ControllerGetCapabilities",
            Rpc::CreateVolume => "CreateVolume",
            Rpc::DeleteVolume => "DeleteVolume",
            Rpc::ControllerPublishVolume => "ControllerPublishVolume",
            Rpc::ControllerUnpublishVolume => "ControllerUnpublishVolume",
            Rpc::ValidateVolumeCapabilities => "ValidateVolumeCapabilities",
            Rpc::ListVolumes => "ListVolumes",
            Rpc::GetCapacity => "GetCapacity",
            Rpc::NodeGetCapabilities => "NodeGetCapabilities",
            Rpc::NodeGetInfo => "NodeGetInfo",
            Rpc::NodeStageVolume => "NodeStageVolume",
            Rpc::NodeUnstageVolume => "NodeUnstageVolume",
            Rpc::NodePublishVolume => "NodePublishVolume",
            Rpc::NodeUnpublishVolume => "NodeUnpublishVolume",
            Rpc::NodeGetVolumeStats => "NodeGetVolumeStats",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Upper bounds of the latency buckets (the last, implicit bucket is
/// `+Inf`): 50µs to 60s, roughly 1-2.5-5 per decade.
pub const LATENCY_BUCKETS: [Duration; 20] = [
    Duration::from_micros(50),
    Duration::from_micros(100),
    Duration::from_micros(250),
    Duration::from_micros(500),
    Duration::from_millis(1),
    Duration::from_micros(2500),
    Duration::from_millis(5),
    Duration::from_millis(10),
    Duration::from_millis(25),
    Duration::from_millis(50),
    Duration::from_millis(100),
    Duration::from_millis(250),
    Duration::from_millis(500),
    Duration::from_secs(1),
    Duration::from_millis(2500),
    Duration::from_secs(5),
    Duration::from_secs(10),
    Duration::from_secs(20),
    Duration::from_secs(30),
    Duration::from_secs(60),
];

#[derive(Default)]
struct RpcCounters {
    pending: AtomicI64,
    finished: AtomicU64,
    failed: AtomicU64,
    cancelled: AtomicU64,
    retries: AtomicU64,
    buckets: [AtomicU64; LATENCY_BUCKETS.len() + 1],
    latency_count: AtomicU64,
    latency_sum_nanos: AtomicU64,
}

/// Call metrics of one client, per RPC.
pub struct Metrics {
    rpcs: [RpcCounters; Rpc::ALL.len()],
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            rpcs: std::array::from_fn(|_| RpcCounters::default()),
        }
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.snapshot()).finish()
    }
}

/// A point-in-time copy of one RPC's counters.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RpcStats {
    /// Calls in flight.
    pub pending: u64,
    /// Calls that returned OK.
    pub finished: u64,
    /// Calls that returned an error (after their last attempt).
    pub failed: u64,
    /// Calls whose future was dropped before they returned.
    pub cancelled: u64,
    /// Attempts after the first, over all calls.
    pub retries: u64,
    /// Latency of finished and failed calls.
    pub latency: Histogram,
}

/// A latency histogram over [`LATENCY_BUCKETS`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Histogram {
    /// Observations per bucket (not cumulative): `counts[i]` counts
    /// latencies in `(LATENCY_BUCKETS[i-1], LATENCY_BUCKETS[i]]`; the last
    /// entry counts those above the largest bound.
    pub counts: Vec<u64>,
    /// Number of observations.
    pub count: u64,
    /// Sum of all observations.
    pub sum: Duration,
}

impl Histogram {
    /// Cumulative counts per upper bound (`None` = `+Inf`), as Prometheus
    /// exposes them.
    pub fn cumulative(&self) -> Vec<(Option<Duration>, u64)> {
        let mut total = 0;
        self.counts
            .iter()
            .enumerate()
            .map(|(i, c)| {
                total += c;
                (LATENCY_BUCKETS.get(i).copied(), total)
            })
            .collect()
    }
}

impl Metrics {
    /// Fresh, all-zero metrics.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// A copy of every RPC's counters, keyed by CSI method name.
    pub fn snapshot(&self) -> BTreeMap<&'static str, RpcStats> {
        Rpc::ALL
            .iter()
            .map(|rpc| (rpc.name(), self.stats(*rpc)))
            .collect()
    }

    /// A copy of one RPC's counters.
    pub fn stats(&self, rpc: Rpc) -> RpcStats {
        let c = &self.rpcs[rpc.index()];
        RpcStats {
            pending: u64::try_from(c.pending.load(Ordering::Relaxed)).unwrap_or(0),
            finished: c.finished.load(Ordering::Relaxed),
            failed: c.failed.load(Ordering::Relaxed),
            cancelled: c.cancelled.load(Ordering::Relaxed),
            retries: c.retries.load(Ordering::Relaxed),
            latency: Histogram {
                counts: c
                    .buckets
                    .iter()
                    .map(|b| b.load(Ordering::Relaxed))
                    .collect(),
                count: c.latency_count.load(Ordering::Relaxed),
                sum: Duration::from_nanos(c.latency_sum_nanos.load(Ordering::Relaxed)),
            },
        }
    }

    /// Renders all counters in the Prometheus text exposition format, with
    /// metric names starting with `prefix` (e.g. `csi_client`).
    pub fn encode_prometheus(&self, prefix: &str) -> String {
        let snap = self.snapshot();
        let mut out = String::new();
        type Getter = fn(&RpcStats) -> u64;
        let counters: [(&str, &str, Getter); 5] = [
            ("pending", "gauge", |s| s.pending),
            ("finished_total", "counter", |s| s.finished),
            ("failed_total", "counter", |s| s.failed),
            ("cancelled_total", "counter", |s| s.cancelled),
            ("retries_total", "counter", |s| s.retries),
        ];
        for (name, kind, get) in counters {
            let _ = writeln!(out, "# TYPE {prefix}_{name} {kind}");
            for (rpc, s) in &snap {
                let _ = writeln!(out, "{prefix}_{name}{{rpc=\"{rpc}\"}} {}", get(s));
            }
        }
        let _ = writeln!(out, "# TYPE {prefix}_latency_seconds histogram");
        for (rpc, s) in &snap {
            for (bound, count) in s.latency.cumulative() {
                let le = bound.map_or_else(|| "+Inf".to_string(), |b| b.as_secs_f64().to_string());
                let _ = writeln!(
                    out,
                    "{prefix}_latency_seconds_bucket{{rpc=\"{rpc}\",le=\"{le}\"}} {count}"
                );
            }
            let _ = writeln!(
                out,
                "{prefix}_latency_seconds_sum{{rpc=\"{rpc}\"}} {}",
                s.latency.sum.as_secs_f64()
            );
            let _ = writeln!(
                out,
                "{prefix}_latency_seconds_count{{rpc=\"{rpc}\"}} {}",
                s.latency.count
            );
        }
        out
    }

    /// Starts counting a call; the returned guard ends it.
    pub(crate) fn start(self: &Arc<Self>, rpc: Rpc) -> CallGuard {
        self.rpcs[rpc.index()]
            .pending
            .fetch_add(1, Ordering::Relaxed);
        CallGuard {
            metrics: Arc::clone(self),
            rpc,
            started: Instant::now(),
            done: false,
        }
    }

    fn observe(&self, rpc: Rpc, latency: Duration) {
        let c = &self.rpcs[rpc.index()];
        let bucket = LATENCY_BUCKETS.partition_point(|b| *b < latency);
        c.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        c.latency_count.fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        c.latency_sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }
}

/// Tracks one call from start to end. Dropping it before
/// [`CallGuard::finish`] counts the call as cancelled: that is exactly what
/// happens when the caller drops the call's future.
pub(crate) struct CallGuard {
    metrics: Arc<Metrics>,
    rpc: Rpc,
    started: Instant,
    done: bool,
}

impl CallGuard {
    /// Counts one retry of this call.
    pub(crate) fn retry(&self) {
        self.metrics.rpcs[self.rpc.index()]
            .retries
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Ends the call as finished (`ok`) or failed.
    pub(crate) fn finish(mut self, ok: bool) {
        self.done = true;
        let c = &self.metrics.rpcs[self.rpc.index()];
        c.pending.fetch_sub(1, Ordering::Relaxed);
        if ok {
            c.finished.fetch_add(1, Ordering::Relaxed);
        } else {
            c.failed.fetch_add(1, Ordering::Relaxed);
        }
        self.metrics.observe(self.rpc, self.started.elapsed());
    }
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        if !self.done {
            let c = &self.metrics.rpcs[self.rpc.index()];
            c.pending.fetch_sub(1, Ordering::Relaxed);
            c.cancelled.fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_match_declaration_order() {
        for (i, rpc) in Rpc::ALL.iter().enumerate() {
            assert_eq!(rpc.index(), i, "{}", rpc.name());
        }
        let snap = Metrics::new().snapshot();
        assert_eq!(snap.len(), Rpc::ALL.len());
        assert!(snap.values().all(|s| *s
            == RpcStats {
                latency: s.latency.clone(),
                ..RpcStats::default()
            }));
    }

    #[test]
    fn calls_end_in_exactly_one_outcome() {
        let m = Metrics::new();
        let ok = m.start(Rpc::NodePublishVolume);
        let failed = m.start(Rpc::NodePublishVolume);
        let dropped = m.start(Rpc::NodePublishVolume);
        let still_running = m.start(Rpc::NodePublishVolume);
        failed.retry();
        failed.retry();
        assert_eq!(m.stats(Rpc::NodePublishVolume).pending, 4);
        ok.finish(true);
        failed.finish(false);
        drop(dropped);
        let s = m.stats(Rpc::NodePublishVolume);
        assert_eq!(
            (s.pending, s.finished, s.failed, s.cancelled, s.retries),
            (1, 1, 1, 1, 2)
        );
        // Cancelled calls have no latency; the others have one each.
        assert_eq!(s.latency.count, 2);
        assert_eq!(s.latency.counts.iter().sum::<u64>(), 2);
        drop(still_running);
        assert_eq!(m.stats(Rpc::NodePublishVolume).pending, 0);
        assert_eq!(
            m.stats(Rpc::Probe),
            RpcStats {
                latency: m.stats(Rpc::Probe).latency,
                ..Default::default()
            }
        );
    }

    #[test]
    fn latencies_land_in_their_bucket() {
        let m = Metrics::new();
        let cases = [
            (Duration::from_micros(10), 0),
            (Duration::from_micros(50), 0),
            (Duration::from_micros(51), 1),
            (Duration::from_millis(3), 6),
            (Duration::from_secs(60), 19),
            (Duration::from_secs(61), 20),
        ];
        for (latency, _) in cases {
            m.observe(Rpc::Probe, latency);
        }
        let h = m.stats(Rpc::Probe).latency;
        assert_eq!(h.counts.len(), LATENCY_BUCKETS.len() + 1);
        for (latency, bucket) in cases {
            assert!(
                h.counts[bucket] >= 1,
                "{latency:?} not in bucket {bucket}: {:?}",
                h.counts
            );
        }
        assert_eq!(h.counts[0], 2);
        assert_eq!(h.count, 6);
        let sum: Duration = cases.iter().map(|(d, _)| *d).sum();
        assert_eq!(h.sum, sum);
        let cumulative = h.cumulative();
        assert_eq!(cumulative.last(), Some(&(None, 6)));
        assert!(cumulative.windows(2).all(|w| w[0].1 <= w[1].1));
    }

    #[test]
    fn prometheus_text_has_every_series() {
        let m = Metrics::new();
        m.start(Rpc::Probe).finish(true);
        let text = m.encode_prometheus("csi_client");
        assert!(
            text.contains("csi_client_finished_total{rpc=\"Probe\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("csi_client_latency_seconds_bucket{rpc=\"Probe\",le=\"+Inf\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("csi_client_latency_seconds_count{rpc=\"Probe\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("csi_client_pending{rpc=\"NodePublishVolume\"} 0\n"),
            "{text}"
        );
    }
}
