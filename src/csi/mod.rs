//! CSI v1: the generated protocol types and services ([`proto`]) and
//! [`Client`], the client the resource providers drive plugins with.
//!
//! Contract: [`Client`] talks to any CSI v1 plugin on a `unix:///path`
//! socket; every call has a deadline, is retried on `UNAVAILABLE` and
//! `DEADLINE_EXCEEDED` only, counted in [`Metrics`], and fails with a
//! [`CsiError`] that names the RPC, the volume, the gRPC code and the
//! plugin's message. The plugin's capabilities are discovered once per
//! connection ([`Capabilities`]).

/// The CSI v1 protocol (`package csi.v1`), generated at build time from
/// `proto/csi.proto`.
pub mod proto {
    #![allow(clippy::all, clippy::pedantic, missing_docs)]
    tonic::include_proto!("csi.v1");
}

pub mod transport;

pub mod caps;
pub mod client;
pub mod error;
pub mod metrics;
pub mod options;
pub mod retry;
pub mod secrets;

pub use caps::{
    Capabilities, ControllerCapabilities, ControllerRpc, NodeCapabilities, NodeRpc,
    PluginCapabilities, PluginService, Services, VolumeExpansion,
};
pub use client::Client;

/// The volume context key by which a plugin says whether a volume holds at most its
/// capacity (`"true"`) or not (`"false"`: e.g. a plain directory on a shared
/// filesystem). The bundled plugin sets it; `status` and the resource JSON show it. Not a
/// CSI standard key: other plugins leave it out, and nothing is then claimed.
pub const CAPACITY_ENFORCED_KEY: &str = "capacity_enforced";
pub use error::{code_name, CsiError, Replacement, VolumeRef};
pub use metrics::{
    grpc_code_string, LatencyStats, Metrics, Rpc, RpcStats, LATENCY_BUCKETS, OPERATIONS_METRIC,
    OPERATION_BUCKETS,
};
pub use options::ClientOptions;
pub use retry::RetryPolicy;
pub use secrets::{Operation, Secrets, SecretsFile};
