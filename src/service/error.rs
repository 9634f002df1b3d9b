//! The one seam where library errors become gRPC statuses.
//!
//! The code tells the caller what kind of failure it is: a request it must
//! fix (`INVALID_ARGUMENT`), something that does not exist (`NOT_FOUND`),
//! a request the current state refuses (`FAILED_PRECONDITION`,
//! `ALREADY_EXISTS`), the CSI plugin's own code where it means the same to
//! the caller (`UNAVAILABLE`, `DEADLINE_EXCEEDED`, `RESOURCE_EXHAUSTED`,
//! ...), `INTERNAL` for everything else. The message is the error's full
//! text, its sources included, so it names the container, the volume, the
//! CSI RPC, its code and the plugin's message.

use tonic::{Code, Status};

use crate::csi::CsiError;
use crate::isolator::IsolatorError;
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
    #[error("status: read the mount table: {source}")]
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
        IsolatorError::InvalidContainerId { .. }
        | IsolatorError::Resource { .. }
        | IsolatorError::BadTarget { .. } => Code::InvalidArgument,
        IsolatorError::UnknownContainer { .. } => Code::NotFound,
        IsolatorError::AlreadyPrepared { .. } => Code::AlreadyExists,
        IsolatorError::ReadOnlyVolume { .. }
        | IsolatorError::MissingAgentDisk { .. }
        | IsolatorError::NoPid { .. }
        | IsolatorError::NotTheContainer { .. }
        | IsolatorError::PidGone { .. } => Code::FailedPrecondition,
        IsolatorError::Provider { source, .. } => provider_code(source),
        IsolatorError::Checkpoint { .. }
        | IsolatorError::Namespace { .. }
        | IsolatorError::Oci { .. }
        | IsolatorError::Unmount { .. } => Code::Internal,
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
        | ProviderError::Parameters { .. }
        | ProviderError::UnknownProfile { .. }
        | ProviderError::BadProfileDisk { .. } => Code::InvalidArgument,
        ProviderError::ParametersDiffer { .. } => Code::AlreadyExists,
        ProviderError::InUse { .. }
        | ProviderError::Destroying { .. }
        | ProviderError::ImportRefused { .. }
        | ProviderError::NoListVolumes { .. } => Code::FailedPrecondition,
        ProviderError::Spawn { .. }
        | ProviderError::Checkpoint { .. }
        | ProviderError::CorruptState { .. }
        | ProviderError::Io { .. }
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
        let bad = IsolatorError::InvalidContainerId {
            container: "../x".into(),
            reason: "not a component".into(),
        };
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
}
