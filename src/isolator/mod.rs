//! The volume isolator: `prepare` publishes a container's CSI volumes and
//! returns the bind mounts to make; `isolate`, `update`, `cleanup` and
//! `recover` follow the container through its life.

pub mod launch_info;

pub use launch_info::{ContainerConfig, LaunchInfo, TargetRoot, VolumeMount, SANDBOX_IN_ROOTFS};
