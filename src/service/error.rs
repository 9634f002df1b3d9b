//! The one seam where library errors become gRPC statuses.
//!
//! The code tells the caller what kind of failure it is: a request it must
//! fix (`INVALID_ARGUMENT`), something that does not exist (`NOT_FOUND`),
//! a request the current state refuses (`FAILED_PRECONDITION`,
//! `ALREADY_EXISTS`), the CSI plugin's own code where it means the same to
//! the caller (`UNAVAILABLE`, `DEADLINE_EXCEEDED`, `RESOURCE_EXHAUSTED`,
//! ...), `INTERNAL` only for faults of our own (a checkpoint that cannot be
//! written, an unmount that fails). The code is chosen from the typed cause,
//! however deep it lies: a target the launcher refuses inside a running
//! container is the caller's `INVALID_ARGUMENT`, a process that is gone a
//! `FAILED_PRECONDITION`. The message is the error's chain written out by
//! [`crate::error_chain`], so it names the container, the volume, the step,
//! the CSI RPC, its code and the plugin's message.

use tonic::{Code, Status};

use crate::csi::CsiError;
use crate::isolator::oci::OciError;
use crate::isolator::IsolatorError;
use crate::launcher::LaunchError;
use crate::mount::MountError;
use crate::provider::ProviderError;

/// A service call failed.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// A request field is missing or malformed.
    #[error("invalid {field}: {reason}")]
    InvalidArgument {
        /// The request field (`resources_json`, `config.sandbox`, ...).
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// No provider has the requested id.
    #[error("unknown resource provider '{provider}' (known: {})", known.join(", "))]
    UnknownProvider {
        /// The requested provider id.
        provider: String,
        /// The ids the service runs.
        known: Vec<String>,
    },
    /// The request left the provider out, and there is not exactly one.
    #[error("provider_id is required: the service runs {count} resource providers")]
    AmbiguousProvider {
        /// How many providers the service runs.
        count: usize,
    },
    /// An isolator operation failed.
    #[error(transparent)]
    Isolator(Box<IsolatorError>),
    /// A provider operation failed.
    #[error(transparent)]
    Provider(Box<ProviderError>),
    /// The mount table could not be read for the status report.
    #[error("status: read the mount table")]
    MountTable {
        /// The mount table error.
        #[source]
        source: MountError,
    },
}

impl From<IsolatorError> for ServiceError {
    fn from(e: IsolatorError) -> Self {
        ServiceError::Isolator(Box::new(e))
    }
}

impl From<ProviderError> for ServiceError {
    fn from(e: ProviderError) -> Self {
        ServiceError::Provider(Box::new(e))
    }
}

impl ServiceError {
    /// The gRPC code this error is reported with.
    pub fn code(&self) -> Code {
        match self {
            ServiceError::InvalidArgument { .. } | ServiceError::AmbiguousProvider { .. } => {
                Code::InvalidArgument
            }
            ServiceError::UnknownProvider { .. } => Code::NotFound,
            ServiceError::Isolator(e) => isolator_code(e),
            ServiceError::Provider(e) => provider_code(e),
            ServiceError::MountTable { .. } => Code::Internal,
        }
    }
}

impl From<ServiceError> for Status {
    fn from(e: ServiceError) -> Status {
        Status::new(e.code(), full_message(&e))
    }
}

/// The gRPC code of an isolator error.
pub fn isolator_code(e: &IsolatorError) -> Code {
    match e {
        IsolatorError::InvalidContainerId(_)
        | IsolatorError::Resource { .. }
        | IsolatorError::BadTarget { .. }
        | IsolatorError::BadUser { .. }
        | IsolatorError::UnsafeConfigPath { .. } => Code::InvalidArgument,
        IsolatorError::UnknownContainer { .. } => Code::NotFound,
        IsolatorError::AlreadyPrepared { .. } => Code::AlreadyExists,
        IsolatorError::ReadOnlyVolume { .. }
        | IsolatorError::MissingAgentDisk { .. }
        | IsolatorError::NoPid { .. }
        | IsolatorError::NotTheContainer { .. }
        | IsolatorError::PidGone { .. }
        | IsolatorError::UntrustedCheckpoint { .. } => Code::FailedPrecondition,
        IsolatorError::Provider { source, .. } => provider_code(source),
        IsolatorError::Namespace { source, .. } => launch_code(source),
        IsolatorError::Oci { source, .. } => oci_code(source),
        IsolatorError::Checkpoint { .. }
        | IsolatorError::Journal { .. }
        | IsolatorError::Unmount { .. }
        | IsolatorError::Ownership { .. } => Code::Internal,
    }
}

/// The gRPC code of a mount into (or unmount from) a running container that failed: a target
/// the request names and the container's files refuse is the caller's to fix; a container whose
/// process or mounts are not what the isolator recorded refuses the request in its current state.
pub fn launch_code(e: &LaunchError) -> Code {
    match e {
        LaunchError::TargetMissingOnHost { .. }
        | LaunchError::TargetParentReadOnly { .. }
        | LaunchError::TargetNotADirectory { .. }
        | LaunchError::TargetNotAFile { .. }
        | LaunchError::ResolveTarget { .. }
        | LaunchError::BadRootfs { .. } => Code::InvalidArgument,
        LaunchError::NotTheVolume { .. }
        | LaunchError::SourceKindMismatch { .. }
        | LaunchError::VolumeStillMounted { .. }
        | LaunchError::RootMismatch { .. }
        | LaunchError::Reaped { .. } => Code::FailedPrecondition,
        LaunchError::OpenNamespace { errno, .. }
            if matches!(*errno, nix::errno::Errno::ENOENT | nix::errno::Errno::ESRCH) =>
        {
            Code::FailedPrecondition
        }
        _ => Code::Internal,
    }
}

/// The gRPC code of a failed Docker/OCI host bind: a container path or destination the request
/// names that cannot be used is the caller's to fix; the binds themselves failing is ours.
pub fn oci_code(e: &OciError) -> Code {
    match e {
        OciError::InvalidContainerPath { .. }
        | OciError::DuplicateDestination { .. }
        | OciError::DuplicateHostPath { .. }
        | OciError::NonUtf8Path { .. }
        | OciError::ResolveTarget { .. } => Code::InvalidArgument,
        OciError::NotABlockDevice { .. } => Code::FailedPrecondition,
        _ => Code::Internal,
    }
}

/// The gRPC code of a provider error.
pub fn provider_code(e: &ProviderError) -> Code {
    match e {
        ProviderError::Csi { source, .. } | ProviderError::Plugin { source, .. } => {
            csi_code(source)
        }
        ProviderError::NotReady { .. } => Code::Unavailable,
        ProviderError::UnknownVolume { .. } | ProviderError::UnknownProvider { .. } => {
            Code::NotFound
        }
        ProviderError::MissingVolumeId { .. }
        | ProviderError::InvalidName { .. }
        | ProviderError::InvalidConfig(_)
        | ProviderError::Parameters { .. }
        | ProviderError::UnknownProfile { .. }
        | ProviderError::BadProfileDisk { .. } => Code::InvalidArgument,
        ProviderError::Secrets { .. } => Code::FailedPrecondition,
        ProviderError::SnapshotRefused { why, .. } => {
            use crate::provider::snapshot::SnapshotRefusal as R;
            match why {
                R::UnknownSnapshot(_) | R::UnknownVolume(_) => Code::NotFound,
                R::NameTaken { .. } => Code::AlreadyExists,
                R::NoSnapshots | R::NoClones | R::Pending { .. } | R::SourceDestroying(_) => {
                    Code::FailedPrecondition
                }
            }
        }
        ProviderError::CorruptSnapshot { .. } => Code::Internal,
        ProviderError::ParametersDiffer { .. }
        | ProviderError::CapabilityDiffers { .. }
        | ProviderError::SecretsFileDiffers { .. } => Code::AlreadyExists,
        ProviderError::ExpandRefused {
            why: crate::provider::expand::Refusal::ZeroSize,
            ..
        } => Code::InvalidArgument,
        ProviderError::ExpandRefused {
            why: crate::provider::expand::Refusal::Shrink { .. },
            ..
        } => Code::OutOfRange,
        ProviderError::ModifyRefused {
            why:
                crate::provider::modify::Refusal::Nothing
                | crate::provider::modify::Refusal::Parameters(_),
            ..
        } => Code::InvalidArgument,
        ProviderError::ModifyRefused {
            why: crate::provider::modify::Refusal::NoCapability,
            ..
        } => Code::FailedPrecondition,
        ProviderError::InUse { .. }
        | ProviderError::HeldByAnotherNode { .. }
        | ProviderError::DetachRefused { .. }
        | ProviderError::AccessModeRefused { .. }
        | ProviderError::AccessModeUnsupported { .. }
        | ProviderError::Destroying { .. }
        | ProviderError::ImportRefused { .. }
        | ProviderError::NotAccessible { .. }
        | ProviderError::ExpandRefused {
            why:
                crate::provider::expand::Refusal::NoCapability
                | crate::provider::expand::Refusal::OfflineOnly { .. },
            ..
        }
        | ProviderError::NoListVolumes { .. }
        | ProviderError::NoDeleteVolume { .. }
        | ProviderError::NoControllerToUnpublish { .. } => Code::FailedPrecondition,
        ProviderError::Spawn { .. }
        | ProviderError::ControllerPlugin { .. }
        | ProviderError::Checkpoint { .. }
        | ProviderError::CorruptState { .. }
        | ProviderError::Io(_)
        | ProviderError::BadCreateResponse { .. }
        | ProviderError::PluginMisbehaved { .. } => Code::Internal,
    }
}

/// The gRPC code of a failed CSI call, as the service reports it: the
/// plugin's code where it means the same to our caller; `UNIMPLEMENTED`
/// (the plugin lacks an RPC, not us) becomes `FAILED_PRECONDITION`; a
/// plugin that cannot be reached is `UNAVAILABLE`; the rest `INTERNAL`.
pub fn csi_code(e: &CsiError) -> Code {
    match e.code() {
        Some(
            c @ (Code::Unavailable
            | Code::DeadlineExceeded
            | Code::ResourceExhausted
            | Code::NotFound
            | Code::AlreadyExists
            | Code::FailedPrecondition
            | Code::Aborted
            | Code::OutOfRange
            | Code::InvalidArgument),
        ) => c,
        Some(Code::Unimplemented) => Code::FailedPrecondition,
        Some(_) => Code::Internal,
        None => match e {
            CsiError::ConnectTimeout { .. } | CsiError::NotReady { .. } => Code::Unavailable,
            CsiError::Connect { .. } => Code::Unavailable,
            CsiError::UntrustedServer { .. } => Code::FailedPrecondition,
            _ => Code::Internal,
        },
    }
}

pub use crate::error_chain::full_message;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::csi::VolumeRef;

    fn rpc_error(code: Code) -> CsiError {
        CsiError::Rpc {
            rpc: "NodePublishVolume",
            volume: Some(VolumeRef::Id("vol-1".into())),
            code,
            message: "plugin says no".into(),
            attempts: 1,
        }
    }

    #[test]
    fn csi_codes_carry_over_where_they_mean_the_same() {
        for (plugin, ours) in [
            (Code::Unavailable, Code::Unavailable),
            (Code::DeadlineExceeded, Code::DeadlineExceeded),
            (Code::ResourceExhausted, Code::ResourceExhausted),
            (Code::NotFound, Code::NotFound),
            (Code::FailedPrecondition, Code::FailedPrecondition),
            (Code::Aborted, Code::Aborted),
            (Code::Unimplemented, Code::FailedPrecondition),
            (Code::Internal, Code::Internal),
            (Code::Unknown, Code::Internal),
            (Code::PermissionDenied, Code::Internal),
        ] {
            assert_eq!(csi_code(&rpc_error(plugin)), ours, "{plugin:?}");
        }
    }

    #[test]
    fn status_names_container_volume_rpc_and_code() {
        let e: ServiceError = IsolatorError::Provider {
            container: "c1".into(),
            source: Box::new(ProviderError::Csi {
                volume: "vol-1".into(),
                source: rpc_error(Code::Unavailable),
            }),
        }
        .into();
        let status = Status::from(e);
        assert_eq!(status.code(), Code::Unavailable);
        let m = status.message();
        for part in [
            "c1",
            "vol-1",
            "NodePublishVolume",
            "UNAVAILABLE",
            "plugin says no",
        ] {
            assert!(m.contains(part), "{part} missing from {m}");
        }
    }

    #[test]
    fn isolator_codes() {
        let unknown = IsolatorError::UnknownContainer {
            container: "c".into(),
        };
        assert_eq!(isolator_code(&unknown), Code::NotFound);
        let bad = IsolatorError::InvalidContainerId(Box::new(
            crate::resource::validate_container_id("../x").unwrap_err(),
        ));
        assert_eq!(isolator_code(&bad), Code::InvalidArgument);
        let in_use = ProviderError::InUse {
            volume: "v".into(),
            users: vec!["c".into()],
        };
        assert_eq!(provider_code(&in_use), Code::FailedPrecondition);
        let e = ServiceError::InvalidArgument {
            field: "resources_json",
            reason: "expected a list".into(),
        };
        assert_eq!(Status::from(e).code(), Code::InvalidArgument);
        let e = ServiceError::from(IsolatorError::NotTheContainer {
            container: "c1".into(),
            pid: 42,
            why: "it is in the isolator's own mount namespace".into(),
        });
        let status = Status::from(e);
        assert_eq!(status.code(), Code::FailedPrecondition);
        assert_eq!(
            status.message(),
            "isolate container 'c1': pid 42 is not the container's process: it is in the isolator's own mount namespace"
        );
    }

    /// Each kind of isolator failure, however deep its typed cause lies, and the code the
    /// caller sees: a refused target or argument is INVALID_ARGUMENT, a state that refuses the
    /// request FAILED_PRECONDITION, something unknown NOT_FOUND, a plugin out of reach
    /// UNAVAILABLE, and only our own faults INTERNAL.
    #[test]
    fn isolator_errors_map_by_their_typed_cause() {
        use crate::isolator::checkpoint_paths::check_canonical;
        use crate::launcher::VolumeRef as At;
        use crate::provider::checkpoint::CheckpointError;
        use nix::errno::Errno;
        use std::path::Path;

        let c = || "c1".to_string();
        let at = || {
            Box::new(At {
                volume_id: Some("vol-1".into()),
                container_path: "data".into(),
                root: "/proc/42/root/sandbox".into(),
            })
        };
        let in_container = |source: LaunchError| IsolatorError::Namespace {
            container: c(),
            step: "mount",
            volume: "vol-1".into(),
            source: Box::new(source),
        };
        let provider = |source: ProviderError| IsolatorError::Provider {
            container: c(),
            source: Box::new(source),
        };
        let unsafe_path =
            || Box::new(check_canonical("sandbox", Path::new("/tmp/..")).unwrap_err());
        let eio = || std::io::Error::from_raw_os_error(libc::EIO);
        let cases: Vec<(IsolatorError, Code)> = vec![
            (
                IsolatorError::InvalidContainerId(Box::new(
                    crate::resource::validate_container_id("a,b").unwrap_err(),
                )),
                Code::InvalidArgument,
            ),
            (
                IsolatorError::BadTarget {
                    container: c(),
                    volume: "vol-1".into(),
                    container_path: "../up".into(),
                    reason: "escapes the sandbox".into(),
                },
                Code::InvalidArgument,
            ),
            (
                IsolatorError::UnsafeConfigPath {
                    container: c(),
                    path: "/w/state.json".into(),
                    source: unsafe_path(),
                },
                Code::InvalidArgument,
            ),
            (
                in_container(LaunchError::TargetNotADirectory {
                    at: at(),
                    kind: "a regular file",
                }),
                Code::InvalidArgument,
            ),
            (
                in_container(LaunchError::TargetMissingOnHost { at: at() }),
                Code::InvalidArgument,
            ),
            (
                in_container(LaunchError::Reaped { pid: 42 }),
                Code::FailedPrecondition,
            ),
            (
                in_container(LaunchError::OpenNamespace {
                    pid: 42,
                    errno: Errno::ESRCH,
                }),
                Code::FailedPrecondition,
            ),
            (
                in_container(LaunchError::OpenNamespace {
                    pid: 42,
                    errno: Errno::EACCES,
                }),
                Code::Internal,
            ),
            (in_container(LaunchError::ThreadPanicked), Code::Internal),
            (
                IsolatorError::UntrustedCheckpoint {
                    container: c(),
                    path: "/w/state.json".into(),
                    source: unsafe_path(),
                },
                Code::FailedPrecondition,
            ),
            (
                IsolatorError::PidGone {
                    container: c(),
                    pid: 42,
                    why: "it exited".into(),
                },
                Code::FailedPrecondition,
            ),
            (
                IsolatorError::NoPid { container: c() },
                Code::FailedPrecondition,
            ),
            (
                IsolatorError::UnknownContainer { container: c() },
                Code::NotFound,
            ),
            (
                IsolatorError::AlreadyPrepared { container: c() },
                Code::AlreadyExists,
            ),
            (
                provider(ProviderError::InUse {
                    volume: "vol-1".into(),
                    users: vec!["c2".into()],
                }),
                Code::FailedPrecondition,
            ),
            (
                provider(ProviderError::UnknownVolume {
                    volume: "vol-9".into(),
                    provider: "p".into(),
                }),
                Code::NotFound,
            ),
            (
                provider(ProviderError::CapabilityDiffers {
                    volume: "data".into(),
                    recorded: "SINGLE_NODE_WRITER".into(),
                    asked: "MULTI_NODE_MULTI_WRITER".into(),
                }),
                Code::AlreadyExists,
            ),
            (
                provider(ProviderError::Csi {
                    volume: "vol-1".into(),
                    source: rpc_error(Code::Unavailable),
                }),
                Code::Unavailable,
            ),
            (
                provider(ProviderError::InvalidConfig(Box::new(
                    crate::resource::validate_path_component("plugin name", "a/b").unwrap_err(),
                ))),
                Code::InvalidArgument,
            ),
            (
                IsolatorError::Checkpoint {
                    container: c(),
                    path: "/w/state.json".into(),
                    source: Box::new(CheckpointError::Write {
                        path: "/w/state.json".into(),
                        source: eio(),
                    }),
                },
                Code::Internal,
            ),
            (
                IsolatorError::Unmount {
                    container: c(),
                    path: "/w/sandbox/data".into(),
                    source: Box::new(MountError::NotMounted {
                        target: "/w/sandbox/data".into(),
                    }),
                },
                Code::Internal,
            ),
        ];
        for (e, want) in cases {
            assert_eq!(isolator_code(&e), want, "{}", full_message(&e));
        }
    }

    /// The status message is the chain written out once: the layer that failed (container,
    /// step, volume), then the launcher's (target and root), each once.
    #[test]
    fn a_refused_target_is_the_callers_error_and_names_step_and_target() {
        let e = ServiceError::from(IsolatorError::Namespace {
            container: "c1".into(),
            step: "mount",
            volume: "vol-1".into(),
            source: Box::new(LaunchError::TargetNotADirectory {
                at: Box::new(crate::launcher::VolumeRef {
                    volume_id: Some("vol-1".into()),
                    container_path: "data".into(),
                    root: "/proc/42/root/sb".into(),
                }),
                kind: "a regular file",
            }),
        });
        let status = Status::from(e);
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(
            status.message(),
            "container 'c1': mount volume vol-1: mount volume 'vol-1' at data in container root \
             /proc/42/root/sb: the target is a regular file, not a directory: refused"
        );
    }
}
