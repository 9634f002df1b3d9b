//! The one place where plugin errors become gRPC statuses, following the error codes the
//! CSI v1 spec assigns to each condition.
//!
//! A status message travels in an HTTP/2 header (`grpc-message`), and a header list over
//! the peer's limit (16 KiB for hyper) is a protocol error that loses the message. Messages
//! quote ids, names and paths the CO chose or that derive from them, of any length, so every
//! message is bounded here: a word over [`MAX_WORD`] bytes keeps its first [`WORD_HEAD`]
//! characters, and the whole message its first [`MAX_MESSAGE`] bytes.

use tonic::{Code, Status};

use super::{BackingError, PluginError};

/// Words (ids, names, paths) longer than this are shortened in status messages.
pub const MAX_WORD: usize = 256;
/// How many characters of a shortened word are kept.
pub const WORD_HEAD: usize = 64;
/// The most bytes of a status message.
pub const MAX_MESSAGE: usize = 4096;

/// `message` bounded as the module doc says; a short message is unchanged.
pub fn bounded(message: &str) -> String {
    let mut out = String::with_capacity(message.len().min(MAX_MESSAGE + 64));
    for (i, word) in message.split(' ').enumerate() {
        if i > 0 {
            out.push(' ');
        }
        if word.len() > MAX_WORD {
            // A value ending a clause (`volume <id>: ...`) keeps its colon.
            let (value, end) = match word.strip_suffix([':', ',']) {
                Some(value) => (value, &word[value.len()..]),
                None => (word, ""),
            };
            out.extend(value.chars().take(WORD_HEAD));
            out.push_str(&format!("… ({} bytes){end}", value.len()));
        } else {
            out.push_str(word);
        }
    }
    if out.len() > MAX_MESSAGE {
        let mut cut = MAX_MESSAGE;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        let total = out.len();
        out.truncate(cut);
        out.push_str(&format!("… (message of {total} bytes cut)"));
    }
    out
}

/// The gRPC code the CSI spec prescribes for `err`.
pub fn code_of(err: &PluginError) -> Code {
    match err {
        PluginError::MissingField { .. } | PluginError::InvalidField { .. } => {
            Code::InvalidArgument
        }
        PluginError::VolumeNotFound { .. }
        | PluginError::SnapshotNotFound { .. }
        | PluginError::NodeNotFound { .. }
        | PluginError::VolumeNotAtPath { .. } => Code::NotFound,
        PluginError::NameConflict { .. }
        | PluginError::PublishConflict { .. }
        | PluginError::PathConflict { .. }
        | PluginError::SnapshotNameConflict { .. } => Code::AlreadyExists,
        PluginError::CapacityOutOfRange { .. }
        | PluginError::BelowFsMinimum { .. }
        | PluginError::OutOfRange { .. } => Code::OutOfRange,
        PluginError::CapacityExhausted { .. }
        | PluginError::FilesystemFull { .. }
        | PluginError::TopologyUnreachable { .. } => Code::ResourceExhausted,
        PluginError::FailedPrecondition { .. } => Code::FailedPrecondition,
        // In use, or covered by someone else's mount: the caller must act first.
        PluginError::Backing {
            source:
                BackingError::Busy { .. }
                | BackingError::Covered { .. }
                // Planted in the volume's directory: someone must remove it.
                | BackingError::UnsafeStorage { .. },
            ..
        } => Code::FailedPrecondition,
        PluginError::InvalidToken { .. } => Code::Aborted,
        // Wrong credentials are UNAUTHENTICATED; missing or unexpected ones, a malformed
        // request (CSI: secrets the SP requires are part of a valid request).
        PluginError::Secrets { mismatch, .. } if mismatch.is_wrong_value() => Code::Unauthenticated,
        PluginError::Secrets { .. } => Code::InvalidArgument,
        PluginError::RequiredSecretsFile { .. } => Code::FailedPrecondition,
        PluginError::Unimplemented { .. } => Code::Unimplemented,
        PluginError::Store { .. }
        | PluginError::SnapshotStore { .. }
        | PluginError::Backing { .. }
        | PluginError::Panicked { .. }
        | PluginError::OpenStore { .. }
        | PluginError::Config(_)
        | PluginError::Listen(_)
        | PluginError::Serve { .. } => Code::Internal,
    }
}

/// Logs `err` once, with the RPC and volume, and converts it to a status carrying the
/// error chain as its message (a cause whose text the message already holds is not
/// repeated), [`bounded`].
pub fn to_status(rpc: &str, volume_id: &str, err: PluginError) -> Status {
    let code = code_of(&err);
    let message = bounded(&csi_isolator::error_chain::full_message(&err));
    let volume_id = bounded(volume_id);
    let volume_id = volume_id.as_str();
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
        use csi_isolator::csi::secrets::Mismatch;
        let secrets = |mismatch| PluginError::Secrets {
            rpc: "NodeStageVolume",
            operation: "node_stage",
            mismatch,
        };
        let cases = [
            (
                secrets(Mismatch::Differs("password".into())),
                Code::Unauthenticated,
            ),
            (
                secrets(Mismatch::Missing("password".into())),
                Code::InvalidArgument,
            ),
            (
                secrets(Mismatch::Unexpected("x".into())),
                Code::InvalidArgument,
            ),
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
                PluginError::BelowFsMinimum {
                    fs_type: "xfs".into(),
                    limit: 1,
                    minimum: 2,
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
                PluginError::FilesystemFull {
                    requested: 2,
                    available: 1,
                    filesystem: "/w".into(),
                },
                Code::ResourceExhausted,
            ),
            (
                PluginError::InvalidToken {
                    rpc: "ListSnapshots",
                    token: "x".into(),
                },
                Code::Aborted,
            ),
            (
                PluginError::SnapshotNotFound {
                    rpc: "CreateVolume",
                    snapshot_id: "s".into(),
                },
                Code::NotFound,
            ),
            (
                PluginError::SnapshotNameConflict {
                    name: "n".into(),
                    snapshot_id: "s".into(),
                    source_volume_id: "v".into(),
                },
                Code::AlreadyExists,
            ),
            (
                PluginError::OutOfRange {
                    rpc: "ControllerExpandVolume",
                    volume_id: "v".into(),
                    reason: "r".into(),
                },
                Code::OutOfRange,
            ),
            (
                PluginError::InvalidToken {
                    rpc: "ListVolumes",
                    token: "x".into(),
                },
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

    #[test]
    fn long_values_are_shortened_in_messages() {
        let id = "/".repeat(4096);
        let err = PluginError::VolumeNotFound {
            rpc: "NodePublishVolume",
            volume_id: id.clone(),
        };
        let status = to_status("NodePublishVolume", &id, err);
        let message = status.message();
        assert!(message.len() < 200, "{message}");
        assert!(
            message.starts_with(&format!(
                "NodePublishVolume: volume {}… (4096 bytes) not found",
                "/".repeat(64)
            )),
            "{message}"
        );
        assert!(message.ends_with(" not found"), "{message}");
        assert_eq!(bounded("short words stay"), "short words stay");
        assert_eq!(
            bounded(&format!("volume {}: gone", "v".repeat(300))),
            format!("volume {}… (300 bytes): gone", "v".repeat(64))
        );
        let many = "w".repeat(200) + " ";
        let long = bounded(&many.repeat(100));
        assert!(
            long.len() < MAX_MESSAGE + 64 && long.ends_with("cut)"),
            "{}",
            long.len()
        );
    }
}
