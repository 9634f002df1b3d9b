//! What `GET /metrics` shows: every family registered with, and rendered
//! by, `prometheus-client` in the Prometheus text exposition format
//! (version 0.0.4: every family has `# HELP` and `# TYPE` lines, a counter's
//! `# TYPE` names it with its `_total`, histograms have cumulative
//! `_bucket{le=...}` series ending in `le="+Inf"`, then `_sum` and `_count`;
//! no `# EOF`, which is OpenMetrics').
//!
//! Families (prefix `csi_isolator_`):
//! - `requests_total{method,code}`: service calls by method and gRPC code.
//! - `publish_duration_seconds{op}`: Prepare and Update calls that publish
//!   provider volumes, whole call (publishing through the provider
//!   dominates; the isolator's checkpoint and, for Update, the mounts into
//!   the running container are included). Its `_count` is the number of
//!   such calls.
//! - `volumes{plugin,state}`: volumes per recorded state, transient states
//!   included (an operation in flight, or interrupted).
//! - `volumes_published{plugin}`: volumes in `PUBLISHED`.
//! - `plugin_terminations_total{plugin}`: unexpected exits of a managed plugin.
//! - `connections_refused_total{listener,reason}`: connections closed at
//!   once: on the service socket (`listener="grpc"`) for a peer that is
//!   neither root nor in the allowed group (`reason="peer"`) or when every
//!   slot is taken (`reason="capacity"`); on `/metrics` (`listener="metrics"`)
//!   when every slot is taken.
//! - `csi_pending`, `csi_finished_total`, `csi_failed_total`,
//!   `csi_cancelled_total`, `csi_retries_total`, `csi_latency_seconds`
//!   (`{plugin,rpc}`): the CSI client's calls (see [`crate::csi::Metrics`]).
//!
//! And, without the prefix, kubelet's
//! `csi_operations_seconds{driver_name,method_name,grpc_status_code,plugin}`:
//! one observation per CSI call (see [`crate::csi::Metrics`]); and kubelet's
//! `kubelet_volume_stats_{capacity_bytes,available_bytes,used_bytes,inodes,inodes_free,inodes_used,health_status_abnormal}{plugin,volume}`,
//! under kubelet's names so its dashboards and alerts work: asked of the plugins at each
//! render ([`crate::provider::stats`], each call within [`STATS_DEADLINE`]) for every
//! published, mounted volume, `volume` being its name (or its id without one); a figure the
//! plugin did not report, or a volume whose stats are unavailable, has no series.
//!
//! Volume counts come from the checkpoints on disk ([`scan`]), not from the
//! providers' in-memory records, so a scrape never waits for a volume
//! operation in flight.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use tonic::Code;

use crate::csi::code_name;
use crate::error_chain::Chain;
use crate::mount::MountTable;
use crate::provider::stats;
use crate::provider::status::scan;
use crate::provider::{Manager, VolumeState};

/// The prefix of every metric name.
pub const PREFIX: &str = "csi_isolator";

/// The content type of what [`ServiceMetrics::render`] returns.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// Upper bounds (seconds) of the publish-latency buckets: a publish is
/// three CSI calls and a few durable writes, from milliseconds to the
/// tens of seconds a slow attach takes.
pub const PUBLISH_BUCKETS: [f64; 14] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Every volume state, in lifecycle order: the provider's own list.
const STATES: [VolumeState; 10] = VolumeState::ALL;

/// The position of a state in [`STATES`].
fn state_index(s: VolumeState) -> usize {
    STATES
        .iter()
        .position(|x| *x == s)
        .expect("VolumeState::ALL lists every state")
}

/// A call that publishes volumes, for [`ServiceMetrics::observe_publish`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PublishOp {
    /// `Prepare`.
    Prepare,
    /// `Update`.
    Update,
}

impl PublishOp {
    fn label(self) -> &'static str {
        match self {
            PublishOp::Prepare => "prepare",
            PublishOp::Update => "update",
        }
    }
}

/// Why a connection was closed as soon as it was accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// On the service socket: the peer is neither root nor in the allowed group.
    GrpcPeer,
    /// On the service socket: every connection slot is taken.
    GrpcCapacity,
    /// On `/metrics`: every connection slot is taken.
    MetricsCapacity,
    /// On the Docker volume plugin's socket: the peer is neither root nor in the allowed group.
    DockerPeer,
    /// On the Docker volume plugin's socket: every connection slot is taken.
    DockerCapacity,
}

impl Refusal {
    const ALL: [Refusal; 5] = [
        Refusal::GrpcPeer,
        Refusal::GrpcCapacity,
        Refusal::MetricsCapacity,
        Refusal::DockerPeer,
        Refusal::DockerCapacity,
    ];

    /// (listener, reason) labels.
    fn labels(self) -> RefusalLabels {
        let (listener, reason) = match self {
            Refusal::GrpcPeer => ("grpc", "peer"),
            Refusal::GrpcCapacity => ("grpc", "capacity"),
            Refusal::MetricsCapacity => ("metrics", "capacity"),
            Refusal::DockerPeer => ("docker", "peer"),
            Refusal::DockerCapacity => ("docker", "capacity"),
        };
        RefusalLabels { listener, reason }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    method: &'static str,
    code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusalLabels {
    listener: &'static str,
    reason: &'static str,
}

fn publish_histogram() -> Histogram {
    Histogram::new(PUBLISH_BUCKETS)
}

/// What the service counts itself (the rest is read at scrape time).
#[derive(Debug)]
pub struct ServiceMetrics {
    requests: Family<RequestLabels, Counter>,
    publish: Family<OpLabels, Histogram, fn() -> Histogram>,
    refused: Family<RefusalLabels, Counter>,
}

impl Default for ServiceMetrics {
    fn default() -> Self {
        let m = ServiceMetrics {
            requests: Family::default(),
            publish: Family::new_with_constructor(publish_histogram as fn() -> Histogram),
            refused: Family::default(),
        };
        // Every series that can be zero is shown from the start.
        for op in [PublishOp::Prepare, PublishOp::Update] {
            let _ = m.publish.get_or_create(&OpLabels { op: op.label() });
        }
        for why in Refusal::ALL {
            let _ = m.refused.get_or_create(&why.labels());
        }
        m
    }
}

impl ServiceMetrics {
    /// Counts one finished call of `method` with `code`.
    pub fn request(&self, method: &'static str, code: Code) {
        self.requests
            .get_or_create(&RequestLabels {
                method,
                code: code_name(code),
            })
            .inc();
    }

    /// Counts one connection closed at once for `why`.
    pub fn refused(&self, why: Refusal) {
        self.refused.get_or_create(&why.labels()).inc();
    }

    /// How many connections were closed at once for `why`.
    pub fn refused_count(&self, why: Refusal) -> u64 {
        self.refused.get_or_create(&why.labels()).get()
    }

    /// Records one call of `op` that published provider volumes in `took`.
    pub fn observe_publish(&self, op: PublishOp, took: Duration) {
        self.publish
            .get_or_create(&OpLabels { op: op.label() })
            .observe(took.as_secs_f64());
    }

    /// Number of publishing calls of `op` recorded.
    pub fn publish_count(&self, op: PublishOp) -> u64 {
        self.publish
            .get_or_create(&OpLabels { op: op.label() })
            .count()
    }

    /// Renders every family (see the module doc) in the Prometheus text
    /// format 0.0.4 ([`CONTENT_TYPE`]). Volume counts come from the
    /// checkpoints under `work_dir` and the mount `table`; a scan that fails
    /// leaves those families out (and is logged).
    pub fn render(&self, manager: &Manager, work_dir: &Path, table: &dyn MountTable) -> String {
        let mut registry = Registry::with_prefix(PREFIX);
        registry.register(
            "requests",
            "Isolator service calls by method and gRPC status code.",
            self.requests.clone(),
        );
        registry.register(
            "publish_duration_seconds",
            "Duration of Prepare and Update calls that publish provider volumes.",
            self.publish.clone(),
        );
        registry.register(
            "connections_refused",
            "Connections closed as soon as they were accepted, per listener and reason.",
            self.refused.clone(),
        );

        let mut providers = Vec::new();
        let mut csi = Vec::new();
        for pr in manager.providers() {
            providers.push((pr.plugin().to_string(), pr.plugin_terminations()));
            csi.push((Some(pr.plugin().to_string()), pr.client().metrics()));
        }
        let mut scanned = scan(work_dir, table);
        let mut volume_stats = Vec::new();
        if let (Ok(report), Ok(handle)) = (&mut scanned, tokio::runtime::Handle::try_current()) {
            // On the blocking thread the render runs on: each call within its deadline, the
            // whole within two (serve's request deadline is 5 s).
            let clients = stats::provider_clients(manager);
            handle.block_on(stats::attach(report, &clients, STATS_DEADLINE));
            volume_stats = report
                .volumes
                .iter()
                .filter(|v| v.stats.is_some() || v.condition.is_some())
                .map(|v| VolumeFigures {
                    plugin: v.plugin.clone(),
                    volume: v.name.clone().unwrap_or_else(|| v.volume_id.clone()),
                    stats: v.stats.clone().unwrap_or_default(),
                    abnormal: v.condition.as_ref().map(|c| c.abnormal),
                })
                .collect();
        }
        let volumes = match scanned {
            Ok(report) => {
                let mut per_plugin: BTreeMap<String, [u64; STATES.len()]> = providers
                    .iter()
                    .map(|(plugin, _)| (plugin.clone(), [0; STATES.len()]))
                    .collect();
                for v in &report.volumes {
                    per_plugin.entry(v.plugin.clone()).or_default()[state_index(v.state)] += 1;
                }
                Some(per_plugin)
            }
            Err(e) => {
                tracing::warn!(error = %Chain(&e), "metrics: cannot scan the volumes");
                None
            }
        };
        registry.register_collector(Box::new(ScrapeTime { volumes, providers }));
        // The CSI client families carry the `csi_` infix under the prefix;
        // csi_operations_seconds is kubelet's name and carries none.
        let mut unprefixed = Registry::default();
        unprefixed.register_collector(Box::new(KubeletVolumeStats(volume_stats)));
        unprefixed.register_collector(Box::new(crate::csi::metrics::Collect::new(
            &format!("{PREFIX}_csi"),
            csi,
        )));
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &registry);
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &unprefixed);
        out
    }
}

/// The families read at scrape time: volumes per plugin and state (`None`
/// when the scan failed), and each plugin's terminations.
#[derive(Debug)]
struct ScrapeTime {
    volumes: Option<BTreeMap<String, [u64; STATES.len()]>>,
    providers: Vec<(String, u64)>,
}

impl prometheus_client::collector::Collector for ScrapeTime {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        if let Some(per_plugin) = &self.volumes {
            let mut family = encoder.encode_descriptor(
                "volumes",
                "Volumes per plugin and recorded state (transient states: an operation in flight or interrupted).",
                None,
                MetricType::Gauge,
            )?;
            for (plugin, counts) in per_plugin {
                for (state, n) in STATES.iter().zip(counts) {
                    let state = state.to_string();
                    let labels = [("plugin", plugin.as_str()), ("state", state.as_str())];
                    ConstGauge::new(gauge_value(*n)).encode(family.encode_family(&labels)?)?;
                }
            }
            let mut family = encoder.encode_descriptor(
                "volumes_published",
                "Volumes in state PUBLISHED, per plugin.",
                None,
                MetricType::Gauge,
            )?;
            for (plugin, counts) in per_plugin {
                let n = counts[state_index(VolumeState::Published)];
                ConstGauge::new(gauge_value(n))
                    .encode(family.encode_family(&[("plugin", plugin.as_str())])?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "plugin_terminations",
            "Unexpected exits of a managed CSI plugin.",
            None,
            MetricType::Counter,
        )?;
        for (plugin, n) in &self.providers {
            ConstCounter::new(*n).encode(family.encode_family(&[("plugin", plugin.as_str())])?)?;
        }
        Ok(())
    }
}

/// The deadline of one volume's stats call during a scrape (two bound the whole collection,
/// within the scrape's 5 s).
pub const STATS_DEADLINE: Duration = Duration::from_secs(1);

/// One volume's figures for kubelet's gauges.
#[derive(Debug)]
struct VolumeFigures {
    plugin: String,
    /// Its name, or its id when it has none.
    volume: String,
    stats: stats::VolumeStats,
    abnormal: Option<bool>,
}

/// kubelet's `kubelet_volume_stats_*` gauges under kubelet's names (so dashboards and alerts
/// written for kubelet work), labelled `plugin` and `volume` instead of kubelet's `namespace`
/// and `persistentvolumeclaim`. A figure the plugin did not report has no series.
#[derive(Debug)]
struct KubeletVolumeStats(Vec<VolumeFigures>);

/// The gauges: kubelet's name, its help text, and the figure.
type Figure = fn(&VolumeFigures) -> Option<i64>;

const KUBELET_VOLUME_GAUGES: [(&str, &str, Figure); 7] = [
    (
        "kubelet_volume_stats_capacity_bytes",
        "Capacity in bytes of the volume",
        |f| gauge_of(f.stats.bytes_total),
    ),
    (
        "kubelet_volume_stats_available_bytes",
        "Number of available bytes in the volume",
        |f| gauge_of(f.stats.bytes_available),
    ),
    (
        "kubelet_volume_stats_used_bytes",
        "Number of used bytes in the volume",
        |f| gauge_of(f.stats.bytes_used),
    ),
    (
        "kubelet_volume_stats_inodes",
        "Maximum number of inodes in the volume",
        |f| gauge_of(f.stats.inodes_total),
    ),
    (
        "kubelet_volume_stats_inodes_free",
        "Number of free inodes in the volume",
        |f| gauge_of(f.stats.inodes_free),
    ),
    (
        "kubelet_volume_stats_inodes_used",
        "Number of used inodes in the volume",
        |f| gauge_of(f.stats.inodes_used),
    ),
    (
        "kubelet_volume_stats_health_status_abnormal",
        "Abnormal volume health status. The count is either 1 or 0. 1 indicates the volume is unhealthy, 0 indicates volume is healthy",
        |f| f.abnormal.map(i64::from),
    ),
];

fn gauge_of(v: Option<u64>) -> Option<i64> {
    v.map(gauge_value)
}

impl prometheus_client::collector::Collector for KubeletVolumeStats {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for (name, help, figure) in KUBELET_VOLUME_GAUGES {
            let rows: Vec<_> = self
                .0
                .iter()
                .filter_map(|f| Some((f, figure(f)?)))
                .collect();
            if rows.is_empty() {
                continue;
            }
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (f, value) in rows {
                let labels = [("plugin", f.plugin.as_str()), ("volume", f.volume.as_str())];
                ConstGauge::new(value).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

/// A count as a gauge value (prometheus-client's gauges are signed).
fn gauge_value(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publish_histograms_are_cumulative_with_inf_sum_and_count() {
        let m = ServiceMetrics::default();
        for d in [
            Duration::from_micros(500),
            Duration::from_millis(5),
            Duration::from_secs(120),
        ] {
            m.observe_publish(PublishOp::Prepare, d);
        }
        let mut registry = Registry::with_prefix(PREFIX);
        registry.register("x", "x", m.publish.clone());
        let mut out = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut out, &registry).unwrap();
        for want in [
            "csi_isolator_x_bucket{op=\"prepare\",le=\"0.001\"} 1",
            // 5 ms lands in the le=0.005 bucket (upper bounds are inclusive).
            "csi_isolator_x_bucket{op=\"prepare\",le=\"0.005\"} 2",
            "csi_isolator_x_bucket{op=\"prepare\",le=\"60\"} 2",
            "csi_isolator_x_bucket{op=\"prepare\",le=\"+Inf\"} 3",
            "csi_isolator_x_count{op=\"prepare\"} 3",
            "csi_isolator_x_sum{op=\"prepare\"} 120.0055",
            // A series not observed yet is shown at zero.
            "csi_isolator_x_count{op=\"update\"} 0",
        ] {
            assert!(out.lines().any(|l| l == want), "{want} in {out}");
        }
        assert_eq!(m.publish_count(PublishOp::Prepare), 3);
        assert_eq!(m.publish_count(PublishOp::Update), 0);
    }

    #[test]
    fn scrape_time_families_are_labelled_per_plugin() {
        let mut registry = Registry::with_prefix(PREFIX);
        let mut counts = [0; STATES.len()];
        counts[state_index(VolumeState::Published)] = 2;
        registry.register_collector(Box::new(ScrapeTime {
            volumes: Some(BTreeMap::from([("t/\"a".to_string(), counts)])),
            providers: vec![("t/\"a".to_string(), 3)],
        }));
        let mut out = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut out, &registry).unwrap();
        for want in [
            "# TYPE csi_isolator_volumes gauge",
            "csi_isolator_volumes{plugin=\"t/\\\"a\",state=\"PUBLISHED\"} 2",
            "csi_isolator_volumes{plugin=\"t/\\\"a\",state=\"CREATED\"} 0",
            "csi_isolator_volumes_published{plugin=\"t/\\\"a\"} 2",
            "# TYPE csi_isolator_plugin_terminations_total counter",
            "csi_isolator_plugin_terminations_total{plugin=\"t/\\\"a\"} 3",
        ] {
            assert!(out.lines().any(|l| l == want), "{want} in {out}");
        }
    }

    #[test]
    fn kubelet_volume_gauges_show_what_the_plugin_reported() {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(KubeletVolumeStats(vec![
            VolumeFigures {
                plugin: "t/n".into(),
                volume: "da\"ta".into(),
                stats: stats::VolumeStats {
                    bytes_total: Some(100),
                    bytes_used: Some(40),
                    bytes_available: Some(60),
                    inodes_total: Some(10),
                    inodes_used: Some(1),
                    inodes_free: Some(9),
                },
                abnormal: Some(true),
            },
            VolumeFigures {
                plugin: "t/n".into(),
                volume: "blk".into(),
                stats: stats::VolumeStats {
                    bytes_total: Some(7),
                    ..Default::default()
                },
                abnormal: None,
            },
        ])));
        let mut out = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut out, &registry).unwrap();
        for want in [
            "# TYPE kubelet_volume_stats_capacity_bytes gauge",
            "# HELP kubelet_volume_stats_capacity_bytes Capacity in bytes of the volume",
            "kubelet_volume_stats_capacity_bytes{plugin=\"t/n\",volume=\"da\\\"ta\"} 100",
            "kubelet_volume_stats_capacity_bytes{plugin=\"t/n\",volume=\"blk\"} 7",
            "kubelet_volume_stats_used_bytes{plugin=\"t/n\",volume=\"da\\\"ta\"} 40",
            "kubelet_volume_stats_inodes_free{plugin=\"t/n\",volume=\"da\\\"ta\"} 9",
            "kubelet_volume_stats_health_status_abnormal{plugin=\"t/n\",volume=\"da\\\"ta\"} 1",
        ] {
            assert!(out.lines().any(|l| l == want), "{want} in {out}");
        }
        // A figure not reported has no series.
        assert!(
            !out.contains("used_bytes{plugin=\"t/n\",volume=\"blk\"}"),
            "{out}"
        );
        assert!(
            !out.contains("abnormal{plugin=\"t/n\",volume=\"blk\"}"),
            "{out}"
        );
    }

    #[test]
    fn every_refusal_is_counted_apart() {
        let m = ServiceMetrics::default();
        m.refused(Refusal::GrpcCapacity);
        m.refused(Refusal::GrpcCapacity);
        m.refused(Refusal::MetricsCapacity);
        assert_eq!(Refusal::ALL.map(|r| m.refused_count(r)), [0, 2, 1, 0, 0]);
    }

    #[test]
    fn every_state_has_its_index() {
        for (i, s) in STATES.iter().enumerate() {
            assert_eq!(state_index(*s), i, "{s}");
        }
    }
}
