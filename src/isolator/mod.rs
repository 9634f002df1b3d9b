//! The volume isolator, a containerizer pipeline stage: `recover(known
//! containers)`, `prepare(container, config) -> launch info`,
//! `isolate(container, pid)`, `update(container, resources)`,
//! `cleanup(container)`.
//!
//! `prepare` publishes a container's CSI volumes through the provider
//! manager (ensure-all), resolves each volume's host mount point from its
//! resource (`disk.source.*.root`, relative roots joined to this agent's
//! work dir) and returns one bind mount per volume: relative
//! `container_path`s land in the sandbox, absolute ones in the rootfs.
//! The launcher applies them in the container's new mount namespace;
//! `update` mounts into (and unmounts from) a running container's
//! namespace; the Docker/OCI path binds on the host instead (`oci`).
//!
//! Every path and pid read back from a checkpoint is checked before it is
//! acted on (`checkpoint_paths`): a record that fails is set aside, and
//! nothing it names is unmounted, removed or signalled.

pub mod checkpoint_paths;
pub mod error;
pub mod hook;
pub mod journal;
pub mod launch_info;
pub mod oci;
pub mod ownership;
pub mod process_check;
pub mod publisher;
pub mod record;
pub mod targets;
pub mod volume;

pub use error::IsolatorError;
pub use launch_info::{ContainerConfig, LaunchInfo};
pub use publisher::{Publisher, VolumeUsers};
pub use volume::{ContainerRecord, IsolatorRecovery, VolumeIsolator};
