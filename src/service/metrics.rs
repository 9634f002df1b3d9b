//! What `GET /metrics` shows, in the Prometheus text exposition format
//! (version 0.0.4): every family has `# HELP` and `# TYPE` lines, counters
//! end in `_total`, histograms have cumulative `_bucket{le=...}` series
//! ending in `le="+Inf"`, then `_sum` and `_count`.
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
//! Volume counts come from the checkpoints on disk ([`scan`]), not from the
//! providers' in-memory records, so a scrape never waits for a volume
//! operation in flight.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tonic::Code;

use crate::csi::code_name;
use crate::mount::MountTable;
use crate::provider::status::scan;
use crate::provider::{Manager, VolumeState};

/// The prefix of every metric name.
pub const PREFIX: &str = "csi_isolator";

/// Upper bounds (seconds) of the publish-latency buckets: a publish is
/// three CSI calls and a few durable writes, from milliseconds to the
/// tens of seconds a slow attach takes.
pub const PUBLISH_BUCKETS: [f64; 14] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Every volume state, in lifecycle order (the match in
/// [`state_index`] keeps this list complete).
const STATES: [VolumeState; 10] = [
    VolumeState::Created,
    VolumeState::ControllerPublish,
    VolumeState::NodeReady,
    VolumeState::NodeStage,
    VolumeState::VolReady,
    VolumeState::NodePublish,
    VolumeState::Published,
    VolumeState::NodeUnpublish,
    VolumeState::NodeUnstage,
    VolumeState::ControllerUnpublish,
];

/// The position of a state in [`STATES`]; a new state fails to compile here.
fn state_index(s: VolumeState) -> usize {
    match s {
        VolumeState::Created => 0,
        VolumeState::ControllerPublish => 1,
        VolumeState::NodeReady => 2,
        VolumeState::NodeStage => 3,
        VolumeState::VolReady => 4,
        VolumeState::NodePublish => 5,
        VolumeState::Published => 6,
        VolumeState::NodeUnpublish => 7,
        VolumeState::NodeUnstage => 8,
        VolumeState::ControllerUnpublish => 9,
    }
}

/// A latency histogram over [`PUBLISH_BUCKETS`], lock-free.
#[derive(Debug, Default)]
pub struct LatencyHistogram {
    /// Per bucket, not cumulative; the last one is above the largest bound.
    buckets: [AtomicU64; PUBLISH_BUCKETS.len() + 1],
    count: AtomicU64,
    sum_nanos: AtomicU64,
}

impl LatencyHistogram {
    /// Records one observation.
    pub fn observe(&self, latency: Duration) {
        let secs = latency.as_secs_f64();
        let i = PUBLISH_BUCKETS.partition_point(|b| *b < secs);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Writes the `_bucket`, `_sum` and `_count` series of `name` with the
    /// extra label `labels` (`key="value"`).
    fn encode(&self, out: &mut String, name: &str, labels: &str) {
        let mut total = 0;
        for (i, b) in self.buckets.iter().enumerate() {
            total += b.load(Ordering::Relaxed);
            let le = PUBLISH_BUCKETS
                .get(i)
                .map_or_else(|| "+Inf".to_string(), |b| b.to_string());
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {total}");
        }
        let sum = Duration::from_nanos(self.sum_nanos.load(Ordering::Relaxed));
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", sum.as_secs_f64());
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count());
    }
}

/// A call that publishes volumes, for [`ServiceMetrics::publish`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
}

impl Refusal {
    const ALL: [Refusal; 3] = [
        Refusal::GrpcPeer,
        Refusal::GrpcCapacity,
        Refusal::MetricsCapacity,
    ];

    /// (listener, reason) labels.
    fn labels(self) -> (&'static str, &'static str) {
        match self {
            Refusal::GrpcPeer => ("grpc", "peer"),
            Refusal::GrpcCapacity => ("grpc", "capacity"),
            Refusal::MetricsCapacity => ("metrics", "capacity"),
        }
    }

    fn index(self) -> usize {
        match self {
            Refusal::GrpcPeer => 0,
            Refusal::GrpcCapacity => 1,
            Refusal::MetricsCapacity => 2,
        }
    }
}

/// What the service counts itself (the rest is read at scrape time).
#[derive(Debug, Default)]
pub struct ServiceMetrics {
    requests: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
    prepare: LatencyHistogram,
    update: LatencyHistogram,
    refused: [AtomicU64; Refusal::ALL.len()],
}

impl ServiceMetrics {
    /// Counts one finished call of `method` with `code`.
    pub fn request(&self, method: &'static str, code: Code) {
        *self
            .requests
            .lock()
            .unwrap()
            .entry((method, code_name(code)))
            .or_default() += 1;
    }

    /// Counts one connection closed at once for `why`.
    pub fn refused(&self, why: Refusal) {
        self.refused[why.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// How many connections were closed at once for `why`.
    pub fn refused_count(&self, why: Refusal) -> u64 {
        self.refused[why.index()].load(Ordering::Relaxed)
    }

    /// The publish-latency histogram of `op`.
    pub fn publish(&self, op: PublishOp) -> &LatencyHistogram {
        match op {
            PublishOp::Prepare => &self.prepare,
            PublishOp::Update => &self.update,
        }
    }

    /// Renders every family (see the module doc). Volume counts come from
    /// the checkpoints under `work_dir` and the mount `table`; a scan that
    /// fails leaves those families out (and is logged).
    pub fn render(&self, manager: &Manager, work_dir: &Path, table: &dyn MountTable) -> String {
        let mut out = String::new();
        let p = PREFIX;

        header(
            &mut out,
            &format!("{p}_requests_total"),
            "counter",
            "Isolator service calls by method and gRPC status code.",
        );
        for ((method, code), n) in self.requests.lock().unwrap().iter() {
            let _ = writeln!(
                out,
                "{p}_requests_total{{method=\"{method}\",code=\"{code}\"}} {n}"
            );
        }

        let name = format!("{p}_publish_duration_seconds");
        header(
            &mut out,
            &name,
            "histogram",
            "Duration of Prepare and Update calls that publish provider volumes.",
        );
        for op in [PublishOp::Prepare, PublishOp::Update] {
            self.publish(op)
                .encode(&mut out, &name, &format!("op=\"{}\"", op.label()));
        }

        header(
            &mut out,
            &format!("{p}_connections_refused_total"),
            "counter",
            "Connections closed as soon as they were accepted, per listener and reason.",
        );
        for why in Refusal::ALL {
            let (listener, reason) = why.labels();
            let _ = writeln!(
                out,
                "{p}_connections_refused_total{{listener=\"{listener}\",reason=\"{reason}\"}} {}",
                self.refused_count(why)
            );
        }

        match scan(work_dir, table) {
            Ok(report) => {
                let mut per_plugin: BTreeMap<String, [u64; STATES.len()]> = manager
                    .providers()
                    .map(|pr| (pr.plugin().to_string(), [0; STATES.len()]))
                    .collect();
                for v in &report.volumes {
                    per_plugin.entry(v.plugin.clone()).or_default()[state_index(v.state)] += 1;
                }
                header(
                    &mut out,
                    &format!("{p}_volumes"),
                    "gauge",
                    "Volumes per plugin and recorded state (transient states: an operation in flight or interrupted).",
                );
                for (plugin, counts) in &per_plugin {
                    for (state, n) in STATES.iter().zip(counts) {
                        let _ = writeln!(
                            out,
                            "{p}_volumes{{plugin=\"{}\",state=\"{state}\"}} {n}",
                            escape(plugin)
                        );
                    }
                }
                header(
                    &mut out,
                    &format!("{p}_volumes_published"),
                    "gauge",
                    "Volumes in state PUBLISHED, per plugin.",
                );
                for (plugin, counts) in &per_plugin {
                    let _ = writeln!(
                        out,
                        "{p}_volumes_published{{plugin=\"{}\"}} {}",
                        escape(plugin),
                        counts[state_index(VolumeState::Published)]
                    );
                }
            }
            Err(e) => tracing::warn!(error = %e, "metrics: cannot scan the volumes"),
        }

        header(
            &mut out,
            &format!("{p}_plugin_terminations_total"),
            "counter",
            "Unexpected exits of a managed CSI plugin.",
        );
        for pr in manager.providers() {
            let _ = writeln!(
                out,
                "{p}_plugin_terminations_total{{plugin=\"{}\"}} {}",
                escape(pr.plugin()),
                pr.plugin_terminations()
            );
        }

        let csi: Vec<(String, String)> = manager
            .providers()
            .map(|pr| {
                (
                    pr.plugin().to_string(),
                    pr.client().metrics().encode_prometheus(&format!("{p}_csi")),
                )
            })
            .collect();
        encode_csi(&mut out, &csi);
        out
    }
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// A label value with `\`, `"` and newlines escaped, as the format requires.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The help text of a CSI client family, by its name after the prefix.
fn csi_help(suffix: &str) -> &'static str {
    match suffix {
        "pending" => "CSI calls in flight.",
        "finished_total" => "CSI calls that returned OK.",
        "failed_total" => "CSI calls that failed after their last attempt.",
        "cancelled_total" => "CSI calls abandoned before they returned.",
        "retries_total" => "CSI call attempts after the first.",
        "latency_seconds" => "Latency of finished and failed CSI calls.",
        _ => "CSI client metric.",
    }
}

/// Merges the CSI client metrics of several plugins into one set of
/// families (a family's samples must be contiguous), each sample labelled
/// with its plugin.
fn encode_csi(out: &mut String, per_plugin: &[(String, String)]) {
    let mut families: Vec<(String, String, Vec<String>)> = Vec::new();
    for (plugin, text) in per_plugin {
        let mut current: Option<usize> = None;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut parts = rest.split_whitespace();
                let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
                    continue;
                };
                let i = match families.iter().position(|(n, _, _)| n == name) {
                    Some(i) => i,
                    None => {
                        families.push((name.to_string(), kind.to_string(), Vec::new()));
                        families.len() - 1
                    }
                };
                current = Some(i);
            } else if line.starts_with('#') || line.is_empty() {
                continue;
            } else if let Some(i) = current {
                let label = format!("plugin=\"{}\"", escape(plugin));
                let sample = match line.split_once('{') {
                    Some((name, rest)) => format!("{name}{{{label},{rest}"),
                    None => match line.split_once(' ') {
                        Some((name, value)) => format!("{name}{{{label}}} {value}"),
                        None => continue,
                    },
                };
                families[i].2.push(sample);
            }
        }
    }
    let prefix = format!("{PREFIX}_csi_");
    for (name, kind, samples) in families {
        header(
            out,
            &name,
            &kind,
            csi_help(name.strip_prefix(&prefix).unwrap_or(&name)),
        );
        for s in samples {
            let _ = writeln!(out, "{s}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative_with_inf_sum_and_count() {
        let h = LatencyHistogram::default();
        h.observe(Duration::from_micros(500));
        h.observe(Duration::from_millis(5));
        h.observe(Duration::from_secs(120));
        let mut out = String::new();
        h.encode(&mut out, "x", "op=\"prepare\"");
        assert!(
            out.contains("x_bucket{op=\"prepare\",le=\"0.001\"} 1\n"),
            "{out}"
        );
        // 5 ms lands in the le=0.005 bucket (upper bounds are inclusive).
        assert!(
            out.contains("x_bucket{op=\"prepare\",le=\"0.005\"} 2\n"),
            "{out}"
        );
        assert!(
            out.contains("x_bucket{op=\"prepare\",le=\"60\"} 2\n"),
            "{out}"
        );
        assert!(
            out.contains("x_bucket{op=\"prepare\",le=\"+Inf\"} 3\n"),
            "{out}"
        );
        assert!(out.contains("x_count{op=\"prepare\"} 3\n"), "{out}");
        assert!(out.contains("x_sum{op=\"prepare\"} 120.0055\n"), "{out}");
    }

    #[test]
    fn csi_families_are_merged_and_labelled() {
        let a = "# TYPE p_csi_failed_total counter\np_csi_failed_total{rpc=\"Probe\"} 1\n# TYPE p_csi_pending gauge\np_csi_pending{rpc=\"Probe\"} 0\n";
        let b = "# TYPE p_csi_failed_total counter\np_csi_failed_total{rpc=\"Probe\"} 2\n";
        let mut out = String::new();
        encode_csi(
            &mut out,
            &[("t/a".into(), a.into()), ("t/\"b".into(), b.into())],
        );
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(
            lines,
            [
                "# HELP p_csi_failed_total CSI client metric.",
                "# TYPE p_csi_failed_total counter",
                "p_csi_failed_total{plugin=\"t/a\",rpc=\"Probe\"} 1",
                "p_csi_failed_total{plugin=\"t/\\\"b\",rpc=\"Probe\"} 2",
                "# HELP p_csi_pending CSI client metric.",
                "# TYPE p_csi_pending gauge",
                "p_csi_pending{plugin=\"t/a\",rpc=\"Probe\"} 0",
            ]
        );
    }

    #[test]
    fn every_refusal_has_its_index() {
        for (i, r) in Refusal::ALL.iter().enumerate() {
            assert_eq!(r.index(), i, "{r:?}");
        }
    }

    #[test]
    fn every_state_has_its_index() {
        for (i, s) in STATES.iter().enumerate() {
            assert_eq!(state_index(*s), i, "{s}");
        }
    }
}
