//! Per-RPC call metrics of a [`Client`](super::Client), kept in
//! `prometheus-client` counters, gauges and histograms.
//!
//! Contract: a *call* is one invocation of a client method, however many
//! attempts it took. Each call is counted as `pending` while in flight and
//! ends in exactly one of `finished` (OK), `failed` (error, after its last
//! attempt) or `cancelled` (the caller dropped the future first). Every
//! retry (attempt after the first) adds one to `retries`. The latency of
//! finished and failed calls, retries and sleeps included, goes into a
//! histogram with fixed buckets ([`LATENCY_BUCKETS`]). Recording is a few
//! atomic operations, nothing next to an RPC; a [`Metrics`] is shared by all
//! clones of a client and may be read at any time.
//!
//! Beside those, every call that ends (cancelled ones included) is observed
//! once in `csi_operations_seconds{driver_name,method_name,grpc_status_code}`,
//! the histogram kubelet keeps for its CSI calls, with kubelet's name, labels
//! and buckets ([`OPERATION_BUCKETS`]), so the dashboards and alerts written
//! for kubelet work here: `driver_name` is the plugin's GetPluginInfo name,
//! `method_name` the full gRPC method (`/csi.v1.Node/NodePublishVolume`),
//! `grpc_status_code` the code as gRPC spells it (`OK`, `DeadlineExceeded`,
//! `Canceled`; `unknown-non-grpc` for a call refused before it was sent, as
//! kubelet spells it). Like kubelet, one observation per call: kubelet's CSI
//! client sends each call once, ours retries `UNAVAILABLE` and
//! `DEADLINE_EXCEEDED` within a call, so an observation covers all its
//! attempts and carries the last one's code (the retries are counted in
//! `retries`). kubelet's fourth label, `migrated` (in-tree volume
//! migration), has no meaning here and is left out.
//!
//! [`Collect`] renders the metrics of one or more clients through a
//! `prometheus-client` registry, one family per metric whatever the number
//! of clients, each sample labelled with its client's plugin.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicI64;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use tonic::Code;

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
    /// `Controller.ControllerExpandVolume`.
    ControllerExpandVolume,
    /// `Node.NodeExpandVolume`.
    NodeExpandVolume,
    /// `Controller.ControllerModifyVolume`.
    ControllerModifyVolume,
    // ---- snapshots ----
    /// `Controller.CreateSnapshot`.
    CreateSnapshot,
    /// `Controller.DeleteSnapshot`.
    DeleteSnapshot,
    /// `Controller.ListSnapshots`.
    ListSnapshots,
}

impl Rpc {
    /// Every RPC, in declaration order.
    pub const ALL: [Rpc; 24] = [
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
        Rpc::ControllerExpandVolume,
        Rpc::NodeExpandVolume,
        Rpc::ControllerModifyVolume,
        Rpc::CreateSnapshot,
        Rpc::DeleteSnapshot,
        Rpc::ListSnapshots,
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
            Rpc::ControllerExpandVolume => "ControllerExpandVolume",
            Rpc::NodeExpandVolume => "NodeExpandVolume",
            Rpc::ControllerModifyVolume => "ControllerModifyVolume",
            Rpc::CreateSnapshot => "CreateSnapshot",
            Rpc::DeleteSnapshot => "DeleteSnapshot",
            Rpc::ListSnapshots => "ListSnapshots",
        }
    }

    /// The full gRPC method, e.g. `/csi.v1.Node/NodePublishVolume` (what
    /// kubelet puts in `method_name`).
    pub fn full_method(self) -> &'static str {
        match self {
            Rpc::GetPluginInfo => "/csi.v1.Identity/GetPluginInfo",
            Rpc::GetPluginCapabilities => "/csi.v1.Identity/GetPluginCapabilities",
            Rpc::Probe => "/csi.v1.Identity/Probe",
            Rpc::ControllerGetCapabilities => "/csi.v1.Controller/ControllerGetCapabilities",
            Rpc::CreateVolume => "/csi.v1.Controller/CreateVolume",
            Rpc::DeleteVolume => "/csi.v1.Controller/DeleteVolume",
            Rpc::ControllerPublishVolume => "/csi.v1.Controller/ControllerPublishVolume",
            Rpc::ControllerUnpublishVolume => "/csi.v1.Controller/ControllerUnpublishVolume",
            Rpc::ValidateVolumeCapabilities => "/csi.v1.Controller/ValidateVolumeCapabilities",
            Rpc::ListVolumes => "/csi.v1.Controller/ListVolumes",
            Rpc::GetCapacity => "/csi.v1.Controller/GetCapacity",
            Rpc::NodeGetCapabilities => "/csi.v1.Node/NodeGetCapabilities",
            Rpc::NodeGetInfo => "/csi.v1.Node/NodeGetInfo",
            Rpc::NodeStageVolume => "/csi.v1.Node/NodeStageVolume",
            Rpc::NodeUnstageVolume => "/csi.v1.Node/NodeUnstageVolume",
            Rpc::NodePublishVolume => "/csi.v1.Node/NodePublishVolume",
            Rpc::NodeUnpublishVolume => "/csi.v1.Node/NodeUnpublishVolume",
            Rpc::NodeGetVolumeStats => "/csi.v1.Node/NodeGetVolumeStats",
            Rpc::ControllerExpandVolume => "/csi.v1.Controller/ControllerExpandVolume",
            Rpc::NodeExpandVolume => "/csi.v1.Node/NodeExpandVolume",
            Rpc::ControllerModifyVolume => "/csi.v1.Controller/ControllerModifyVolume",
            Rpc::CreateSnapshot => "/csi.v1.Controller/CreateSnapshot",
            Rpc::DeleteSnapshot => "/csi.v1.Controller/DeleteSnapshot",
            Rpc::ListSnapshots => "/csi.v1.Controller/ListSnapshots",
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

/// Upper bounds (seconds) of `csi_operations_seconds`: kubelet's.
pub const OPERATION_BUCKETS: [f64; 13] = [
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 25.0, 50.0, 120.0, 300.0, 600.0,
];

/// The name of the kubelet-compatible histogram (no project prefix, so
/// kubelet's queries find it).
pub const OPERATIONS_METRIC: &str = "csi_operations_seconds";

/// The `grpc_status_code` of a call that failed before it reached gRPC
/// (kubelet's spelling).
pub const NON_GRPC_CODE: &str = "unknown-non-grpc";

/// A gRPC code as gRPC's own implementations print it (Go's
/// `codes.Code.String()`, which kubelet puts in `grpc_status_code`):
/// `OK`, `Canceled`, `DeadlineExceeded`.
pub fn grpc_code_string(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "Canceled",
        Code::Unknown => "Unknown",
        Code::InvalidArgument => "InvalidArgument",
        Code::DeadlineExceeded => "DeadlineExceeded",
        Code::NotFound => "NotFound",
        Code::AlreadyExists => "AlreadyExists",
        Code::PermissionDenied => "PermissionDenied",
        Code::ResourceExhausted => "ResourceExhausted",
        Code::FailedPrecondition => "FailedPrecondition",
        Code::Aborted => "Aborted",
        Code::OutOfRange => "OutOfRange",
        Code::Unimplemented => "Unimplemented",
        Code::Internal => "Internal",
        Code::Unavailable => "Unavailable",
        Code::DataLoss => "DataLoss",
        Code::Unauthenticated => "Unauthenticated",
    }
}

fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS.iter().map(Duration::as_secs_f64))
}

fn operation_histogram() -> Histogram {
    Histogram::new(OPERATION_BUCKETS)
}

struct RpcMetrics {
    pending: Gauge<i64, AtomicI64>,
    finished: Counter,
    failed: Counter,
    cancelled: Counter,
    retries: Counter,
    latency: Histogram,
}

impl Default for RpcMetrics {
    fn default() -> Self {
        RpcMetrics {
            pending: Gauge::default(),
            finished: Counter::default(),
            failed: Counter::default(),
            cancelled: Counter::default(),
            retries: Counter::default(),
            latency: latency_histogram(),
        }
    }
}

/// Call metrics of one client, per RPC.
pub struct Metrics {
    rpcs: [RpcMetrics; Rpc::ALL.len()],
    /// `csi_operations_seconds` per (method, code), only the pairs seen.
    operations: Mutex<BTreeMap<(Rpc, &'static str), Histogram>>,
    /// The plugin's GetPluginInfo name, once known.
    driver_name: OnceLock<String>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            rpcs: std::array::from_fn(|_| RpcMetrics::default()),
            operations: Mutex::default(),
            driver_name: OnceLock::new(),
        }
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.snapshot()).finish()
    }
}

/// A point-in-time copy of one RPC's counters.
#[derive(Debug, Clone, PartialEq, Default)]
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
    pub latency: LatencyStats,
}

/// The count and sum of a latency histogram (its buckets are in the
/// rendered metrics).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LatencyStats {
    /// Number of observations.
    pub count: u64,
    /// Sum of all observations.
    pub sum: Duration,
}

impl LatencyStats {
    fn of(h: &Histogram) -> LatencyStats {
        LatencyStats {
            count: h.count(),
            sum: Duration::try_from_secs_f64(h.sum()).unwrap_or(Duration::MAX),
        }
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
            pending: u64::try_from(c.pending.get()).unwrap_or(0),
            finished: c.finished.get(),
            failed: c.failed.get(),
            cancelled: c.cancelled.get(),
            retries: c.retries.get(),
            latency: LatencyStats::of(&c.latency),
        }
    }

    /// The `csi_operations_seconds` observations of `rpc` that ended with
    /// `code` (as [`grpc_code_string`] or [`NON_GRPC_CODE`] spell it).
    pub fn operations(&self, rpc: Rpc, code: &str) -> LatencyStats {
        let ops = self.operations.lock().unwrap_or_else(|p| p.into_inner());
        ops.iter()
            .find(|((r, c), _)| *r == rpc && *c == code)
            .map_or_else(LatencyStats::default, |(_, h)| LatencyStats::of(h))
    }

    /// Records the plugin's GetPluginInfo name, the `driver_name` of
    /// `csi_operations_seconds`; the first name given stays (a replaced
    /// plugin must have the same one).
    pub fn set_driver_name(&self, name: &str) {
        let _ = self.driver_name.set(name.to_string());
    }

    /// The driver name, once GetPluginInfo answered.
    pub fn driver_name(&self) -> Option<&str> {
        self.driver_name.get().map(String::as_str)
    }

    /// Renders all families in the Prometheus text exposition format
    /// (0.0.4), with metric names starting with `prefix` (e.g. `csi_client`)
    /// and no plugin label.
    pub fn encode_prometheus(self: &Arc<Self>, prefix: &str) -> String {
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(Collect::new(
            prefix,
            vec![(None, Arc::clone(self))],
        )));
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &registry);
        out
    }

    /// Starts counting a call; the returned guard ends it.
    pub(crate) fn start(self: &Arc<Self>, rpc: Rpc) -> CallGuard {
        self.rpcs[rpc.index()].pending.inc();
        CallGuard {
            metrics: Arc::clone(self),
            rpc,
            started: Instant::now(),
            done: false,
        }
    }

    fn observe_operation(&self, rpc: Rpc, code: &'static str, took: Duration) {
        self.operations
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((rpc, code))
            .or_insert_with(operation_histogram)
            .observe(took.as_secs_f64());
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
        self.metrics.rpcs[self.rpc.index()].retries.inc();
    }

    /// Ends the call with the gRPC code of its last attempt (`Code::Ok`:
    /// finished, any other: failed), or `None` when it failed before
    /// reaching gRPC (a plugin replaced by another driver).
    pub(crate) fn finish(mut self, code: Option<Code>) {
        self.done = true;
        let c = &self.metrics.rpcs[self.rpc.index()];
        c.pending.dec();
        if code == Some(Code::Ok) {
            c.finished.inc();
        } else {
            c.failed.inc();
        }
        let took = self.started.elapsed();
        c.latency.observe(took.as_secs_f64());
        let code = code.map_or(NON_GRPC_CODE, grpc_code_string);
        self.metrics.observe_operation(self.rpc, code, took);
    }
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        if !self.done {
            let c = &self.metrics.rpcs[self.rpc.index()];
            c.pending.dec();
            c.cancelled.inc();
            // What kubelet records for a call whose context was cancelled.
            self.metrics.observe_operation(
                self.rpc,
                grpc_code_string(Code::Cancelled),
                self.started.elapsed(),
            );
        }
    }
}

/// One family of the client metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    Pending,
    Finished,
    Failed,
    Cancelled,
    Retries,
    Latency,
}

impl Family {
    const ALL: [Family; 6] = [
        Family::Pending,
        Family::Finished,
        Family::Failed,
        Family::Cancelled,
        Family::Retries,
        Family::Latency,
    ];

    /// The name after the prefix (a counter's `_total` is added by the
    /// encoder), the help text and the metric of one RPC.
    fn describe(self) -> (&'static str, &'static str) {
        match self {
            Family::Pending => ("pending", "CSI calls in flight."),
            Family::Finished => ("finished", "CSI calls that returned OK."),
            Family::Failed => ("failed", "CSI calls that failed after their last attempt."),
            Family::Cancelled => ("cancelled", "CSI calls abandoned before they returned."),
            Family::Retries => ("retries", "CSI call attempts after the first."),
            Family::Latency => (
                "latency_seconds",
                "Latency of finished and failed CSI calls, retries included.",
            ),
        }
    }

    fn metric(self, m: &RpcMetrics) -> &dyn EncodeMetric {
        match self {
            Family::Pending => &m.pending,
            Family::Finished => &m.finished,
            Family::Failed => &m.failed,
            Family::Cancelled => &m.cancelled,
            Family::Retries => &m.retries,
            Family::Latency => &m.latency,
        }
    }

    fn metric_type(self) -> MetricType {
        match self {
            Family::Pending => MetricType::Gauge,
            Family::Latency => MetricType::Histogram,
            _ => MetricType::Counter,
        }
    }
}

/// A `prometheus-client` collector of the metrics of several clients: one
/// family per metric (`<prefix>_pending`, `<prefix>_finished_total`, ...,
/// and [`OPERATIONS_METRIC`]), each sample labelled with its client's plugin
/// (when one is given) and its RPC.
#[derive(Debug)]
pub struct Collect {
    prefix: String,
    clients: Vec<(Option<String>, Arc<Metrics>)>,
}

impl Collect {
    /// Collects `clients` (plugin label, metrics) under `prefix`.
    pub fn new(prefix: &str, clients: Vec<(Option<String>, Arc<Metrics>)>) -> Collect {
        Collect {
            prefix: prefix.to_string(),
            clients,
        }
    }
}

/// Label value of a client whose plugin never answered GetPluginInfo
/// (csi-lib-utils' spelling).
const UNKNOWN_DRIVER: &str = "unknown-driver";

impl prometheus_client::collector::Collector for Collect {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for family in Family::ALL {
            let (suffix, help) = family.describe();
            let name = format!("{}_{suffix}", self.prefix);
            let mut metric = encoder.encode_descriptor(&name, help, None, family.metric_type())?;
            for (plugin, m) in &self.clients {
                for rpc in Rpc::ALL {
                    let mut labels = Vec::with_capacity(2);
                    if let Some(plugin) = plugin {
                        labels.push(("plugin", plugin.as_str()));
                    }
                    labels.push(("rpc", rpc.name()));
                    family
                        .metric(&m.rpcs[rpc.index()])
                        .encode(metric.encode_family(&labels)?)?;
                }
            }
        }
        let mut metric = encoder.encode_descriptor(
            OPERATIONS_METRIC,
            "Container Storage Interface operation duration with gRPC error code status total (kubelet's histogram), one observation per call.",
            None,
            MetricType::Histogram,
        )?;
        for (plugin, m) in &self.clients {
            let driver = m.driver_name().unwrap_or(UNKNOWN_DRIVER);
            let ops = m.operations.lock().unwrap_or_else(|p| p.into_inner());
            for ((rpc, code), histogram) in ops.iter() {
                let mut labels = vec![
                    ("driver_name", driver),
                    ("method_name", rpc.full_method()),
                    ("grpc_status_code", *code),
                ];
                if let Some(plugin) = plugin {
                    labels.push(("plugin", plugin.as_str()));
                }
                histogram.encode(metric.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_match_declaration_order() {
        for (i, rpc) in Rpc::ALL.iter().enumerate() {
            assert_eq!(rpc.index(), i, "{}", rpc.name());
            assert!(
                rpc.full_method().starts_with("/csi.v1.")
                    && rpc.full_method().ends_with(&format!("/{}", rpc.name())),
                "{}",
                rpc.full_method()
            );
        }
        let snap = Metrics::new().snapshot();
        assert_eq!(snap.len(), Rpc::ALL.len());
        assert!(snap.values().all(|s| *s == RpcStats::default()));
    }

    #[test]
    fn grpc_codes_are_spelled_as_grpc_spells_them() {
        for (code, want) in [
            (Code::Ok, "OK"),
            (Code::Cancelled, "Canceled"),
            (Code::DeadlineExceeded, "DeadlineExceeded"),
            (Code::FailedPrecondition, "FailedPrecondition"),
            (Code::Unavailable, "Unavailable"),
        ] {
            assert_eq!(grpc_code_string(code), want);
        }
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
        ok.finish(Some(Code::Ok));
        failed.finish(Some(Code::Unavailable));
        drop(dropped);
        let s = m.stats(Rpc::NodePublishVolume);
        assert_eq!(
            (s.pending, s.finished, s.failed, s.cancelled, s.retries),
            (1, 1, 1, 1, 2)
        );
        // Cancelled calls have no latency; the others have one each.
        assert_eq!(s.latency.count, 2);
        // Every ended call, the cancelled one too, is one operation.
        for code in ["OK", "Unavailable", "Canceled"] {
            assert_eq!(
                m.operations(Rpc::NodePublishVolume, code).count,
                1,
                "{code}"
            );
        }
        drop(still_running);
        assert_eq!(m.stats(Rpc::NodePublishVolume).pending, 0);
        assert_eq!(m.stats(Rpc::Probe), RpcStats::default());
        m.start(Rpc::Probe).finish(None);
        assert_eq!(m.operations(Rpc::Probe, NON_GRPC_CODE).count, 1);
        assert_eq!(m.stats(Rpc::Probe).failed, 1);
    }

    /// The samples of the rendered text whose line starts with `prefix`.
    fn sample<'t>(text: &'t str, prefix: &str) -> Vec<&'t str> {
        text.lines().filter(|l| l.starts_with(prefix)).collect()
    }

    #[test]
    fn latencies_land_in_their_bucket() {
        let m = Metrics::new();
        let latency = &m.rpcs[Rpc::Probe.index()].latency;
        for d in [
            Duration::from_micros(10),
            Duration::from_micros(50),
            Duration::from_micros(51),
            Duration::from_millis(3),
            Duration::from_secs(60),
            Duration::from_secs(61),
        ] {
            latency.observe(d.as_secs_f64());
        }
        let text = m.encode_prometheus("c");
        let probe = |le: &str| format!("c_latency_seconds_bucket{{rpc=\"Probe\",le=\"{le}\"}} ");
        // Upper bounds are inclusive; counts are cumulative.
        for (le, want) in [
            ("5e-05", 2),
            ("0.0001", 3),
            ("0.0025", 3),
            ("0.005", 4),
            ("60", 5),
            ("+Inf", 6),
        ] {
            assert_eq!(
                sample(&text, &probe(le)),
                [format!("{}{want}", probe(le))],
                "{text}"
            );
        }
        assert_eq!(m.stats(Rpc::Probe).latency.count, 6);
    }

    #[test]
    fn prometheus_text_has_every_series_and_the_kubelet_histogram() {
        let m = Metrics::new();
        m.start(Rpc::Probe).finish(Some(Code::Ok));
        let text = m.encode_prometheus("csi_client");
        for want in [
            "# TYPE csi_client_finished_total counter",
            "csi_client_finished_total{rpc=\"Probe\"} 1",
            "csi_client_latency_seconds_bucket{rpc=\"Probe\",le=\"+Inf\"} 1",
            "csi_client_latency_seconds_count{rpc=\"Probe\"} 1",
            "csi_client_pending{rpc=\"NodePublishVolume\"} 0",
            "# TYPE csi_operations_seconds histogram",
            "csi_operations_seconds_count{driver_name=\"unknown-driver\",method_name=\"/csi.v1.Identity/Probe\",grpc_status_code=\"OK\"} 1",
        ] {
            assert!(text.lines().any(|l| l == want), "{want} in {text}");
        }
        m.set_driver_name("csi.example.org");
        m.set_driver_name("a.second.name");
        let text = m.encode_prometheus("csi_client");
        let bounds: Vec<&str> = sample(&text, "csi_operations_seconds_bucket{")
            .iter()
            .map(|l| l.split("le=\"").nth(1).unwrap().split('"').next().unwrap())
            .collect();
        assert_eq!(
            bounds,
            [
                "0.1", "0.25", "0.5", "1", "2.5", "5", "10", "15", "25", "50", "120", "300", "600",
                "+Inf"
            ]
        );
        assert!(
            text.contains("csi_operations_seconds_count{driver_name=\"csi.example.org\","),
            "{text}"
        );
    }

    #[test]
    fn several_clients_share_one_family_each_sample_labelled() {
        let (a, b) = (Metrics::new(), Metrics::new());
        a.start(Rpc::Probe).finish(Some(Code::Ok));
        b.start(Rpc::Probe).finish(Some(Code::Unavailable));
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(Collect::new(
            "p",
            vec![(Some("t/a".into()), a), (Some("t/\"b".into()), b)],
        )));
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &registry).unwrap();
        assert_eq!(sample(&text, "# TYPE p_failed_total ").len(), 1, "{text}");
        assert_eq!(
            sample(&text, "p_failed_total{")
                .iter()
                .filter(|l| l.contains("rpc=\"Probe\""))
                .copied()
                .collect::<Vec<_>>(),
            [
                "p_failed_total{plugin=\"t/a\",rpc=\"Probe\"} 0",
                "p_failed_total{plugin=\"t/\\\"b\",rpc=\"Probe\"} 1",
            ]
        );
        assert_eq!(sample(&text, "# TYPE csi_operations_seconds ").len(), 1);
        assert!(text.contains("csi_operations_seconds_count{driver_name=\"unknown-driver\",method_name=\"/csi.v1.Identity/Probe\",grpc_status_code=\"Unavailable\",plugin=\"t/\\\"b\"} 1"), "{text}");
    }
}
