//! The one place where plugin errors become gRPC statuses, following the error codes the
//! CSI v1 spec assigns to each condition.

use tonic::{Code, Status};

use super::{BackingError, PluginError};

/// The gRPC code the CSI spec prescribes for `err`.
pub fn code_of(err: &PluginError) -> Code {
    match err {
        PluginError::MissingField { .. } | PluginError::InvalidField { .. } => {
            Code::InvalidArgument
        }
        PluginError::VolumeNotFound { .. }
        | PluginError::NodeNotFound { .. }
        | PluginError::VolumeNotAtPath { .. } => Code::NotFound,
        PluginError::NameConflict { .. }
        | PluginError::PublishConflict { .. }
        | PluginError::PathConflict { .. } => Code::AlreadyExists,
        PluginError::CapacityOutOfRange { .. } => Code::OutOfRange,
        PluginError::CapacityExhausted { .. } => Code::ResourceExhausted,
        PluginError::FailedPrecondition { .. } => Code::FailedPrecondition,
        // In use, or covered by someone else's mount: the caller must act first.
        PluginError::Backing {
            source: BackingError::Busy { .. } | BackingError::Covered { .. },
            ..
        } => Code::FailedPrecondition,
        PluginError::InvalidToken { .. } => Code::Aborted,
        PluginError::Unimplemented { .. } => Code::Unimplemented,
        PluginError::Store { .. }
        | PluginError::Backing { .. }
        | PluginError::Panicked { .. }
        | PluginError::OpenStore { .. }
        | PluginError::Listen { .. }
        | PluginError::Serve { .. } => Code::Internal,
    }
}

/// Logs `err` once, with the RPC and volume, and converts it to a status carrying the
/// full error chain as its message.
pub fn to_status(rpc: &str, volume_id: &str, err: PluginError) -> Status {
    let code = code_of(&err);
    let mut message = err.to_string();
    let mut source = std::error::Error::source(&err);
    while let Some(s) = source {
        message.push_str(": ");
        message.push_str(&s.to_string());
        source = s.source();
    }
    if code == Code::Internal {
        tracing::error!(rpc, volume_id, %message, "rpc failed");
    } else {
        tracing::info!(rpc, volume_id, ?code, %message, "rpc refused");
    }
    Status::new(code, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_conditions_to_spec_codes() {
        let cases = [
            (
                PluginError::MissingField {
                    rpc: "NodePublishVolume",
                    field: "target_path",
                },
                Code::InvalidArgument,
            ),
            (
                PluginError::VolumeNotFound {
                    rpc: "NodeStageVolume",
                    volume_id: "v".into(),
                },
                Code::NotFound,
            ),
            (
                PluginError::PublishConflict {
                    volume_id: "v".into(),
                    node_id: "n".into(),
                    readonly: true,
                    capability: None,
                },
                Code::AlreadyExists,
            ),
            (
                PluginError::CapacityOutOfRange {
                    requested: 2,
                    total: 1,
                },
                Code::OutOfRange,
            ),
            (
                PluginError::CapacityExhausted {
                    requested: 2,
                    available: 1,
                },
                Code::ResourceExhausted,
            ),
            (
                PluginError::InvalidToken { token: "x".into() },
                Code::Aborted,
            ),
            (
                PluginError::Unimplemented {
                    rpc: "NodeStageVolume",
                },
                Code::Unimplemented,
            ),
        ];
        for (err, code) in cases {
            let status = to_status("Rpc", "v", err);
            assert_eq!(status.code(), code, "{}", status.message());
        }
    }
}
