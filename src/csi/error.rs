//! Errors of the CSI client.
//!
//! Contract: every error names what failed. A failed call names the RPC,
//! the volume it was about (when the request has one), the gRPC code in its
//! canonical upper-case form, the plugin's message and, when the call was
//! retried, how many attempts were made:
//! `NodePublishVolume of volume 'vol-1' failed: UNAVAILABLE: plugin restarting (after 5 attempts)`.
//! A failed connect names the endpoint and the step that did not succeed.

use std::fmt;
use std::time::Duration;

use tonic::Code;

use super::transport::TransportError;

/// An error of the CSI client.
#[derive(Debug, thiserror::Error)]
pub enum CsiError {
    /// The endpoint could not be parsed.
    #[error("connect to {endpoint}")]
    BadEndpoint {
        /// The endpoint as given.
        endpoint: String,
        /// Why it was refused.
        #[source]
        source: TransportError,
    },
    /// The socket never appeared, or never accepted a connection, within
    /// the connect timeout.
    #[error("connect to {endpoint}: {what} within {}{}", fmt_duration(*timeout), last_error.as_ref().map(|e| format!(" (last error: {e})")).unwrap_or_default())]
    ConnectTimeout {
        /// The endpoint.
        endpoint: String,
        /// What did not happen: `socket did not appear`, `socket did not
        /// accept connections`.
        what: &'static str,
        /// The connect timeout.
        timeout: Duration,
        /// The last dial error, if any.
        last_error: Option<String>,
    },
    /// The socket is served by a process csi-isolator does not talk to (not root, not its own
    /// user): nothing was sent.
    #[error("connect to {endpoint}")]
    UntrustedServer {
        /// The endpoint.
        endpoint: String,
        /// Who serves it, and what to do.
        #[source]
        source: std::io::Error,
    },
    /// The plugin kept answering `Probe` with `ready: false`.
    #[error("connect to {endpoint}: plugin did not report ready within {}", fmt_duration(*timeout))]
    NotReady {
        /// The endpoint.
        endpoint: String,
        /// The connect timeout.
        timeout: Duration,
    },
    /// An RPC made while connecting (`Probe`, capability discovery) failed.
    #[error("connect to {endpoint}")]
    Connect {
        /// The endpoint.
        endpoint: String,
        /// The failed call.
        #[source]
        source: Box<CsiError>,
    },
    /// A call failed with a gRPC status (from the plugin, or from the
    /// transport: `UNAVAILABLE` when the socket is gone, `DEADLINE_EXCEEDED`
    /// when the deadline ran out).
    #[error("{}", RpcFailure { rpc, volume: volume.as_ref(), code: *code, message, attempts: *attempts })]
    Rpc {
        /// The CSI method name, e.g. `NodePublishVolume`.
        rpc: &'static str,
        /// The volume the call was about.
        volume: Option<VolumeRef>,
        /// The gRPC code of the last attempt.
        code: Code,
        /// The plugin's (or transport's) message of the last attempt.
        message: String,
        /// Attempts made, the first included.
        attempts: u32,
    },
    /// The plugin answered, but the answer breaks the CSI spec (e.g. a
    /// CreateVolume response without a volume).
    #[error("{rpc}{} failed: invalid response: {problem}", volume.as_ref().map(|v| format!(" of {v}")).unwrap_or_default())]
    InvalidResponse {
        /// The CSI method name.
        rpc: &'static str,
        /// The volume the call was about.
        volume: Option<VolumeRef>,
        /// What is wrong with the response.
        problem: String,
    },
    /// The plugin behind the socket was replaced by one with another
    /// GetPluginInfo name: the call was not sent to it.
    #[error("{}the plugin at {} is now '{}' (vendor version '{}'), not '{}' as before; volume calls are not sent to a different driver", refused(rpc, volume.as_ref()), replacement.endpoint, replacement.found, replacement.vendor_version, replacement.expected)]
    PluginReplaced {
        /// The call that was refused (`None` for an explicit check).
        rpc: Option<&'static str>,
        /// The volume the call was about.
        volume: Option<VolumeRef>,
        /// Which plugin it was and which it is now.
        replacement: Box<Replacement>,
    },
}

/// What [`CsiError::PluginReplaced`] found behind the socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replacement {
    /// The endpoint.
    pub endpoint: String,
    /// The GetPluginInfo name the plugin had.
    pub expected: String,
    /// The GetPluginInfo name of the plugin behind the socket now.
    pub found: String,
    /// The new plugin's vendor_version.
    pub vendor_version: String,
}

/// `NodePublishVolume of volume 'v' refused: ` (or nothing, without an RPC).
fn refused(rpc: &Option<&'static str>, volume: Option<&VolumeRef>) -> String {
    match (rpc, volume) {
        (Some(rpc), Some(v)) => format!("{rpc} of {v} refused: "),
        (Some(rpc), None) => format!("{rpc} refused: "),
        (None, _) => String::new(),
    }
}

/// The volume a call is about: by id, or by name for `CreateVolume`
/// (whose id the plugin has not assigned yet).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VolumeRef {
    /// A volume id assigned by the plugin.
    Id(String),
    /// The name given to `CreateVolume`.
    Name(String),
}

impl fmt::Display for VolumeRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VolumeRef::Id(id) => write!(f, "volume '{id}'"),
            VolumeRef::Name(name) => write!(f, "volume named '{name}'"),
        }
    }
}

struct RpcFailure<'a> {
    rpc: &'a str,
    volume: Option<&'a VolumeRef>,
    code: Code,
    message: &'a str,
    attempts: u32,
}

impl fmt::Display for RpcFailure<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.rpc)?;
        if let Some(v) = self.volume {
            write!(f, " of {v}")?;
        }
        write!(f, " failed: {}", code_name(self.code))?;
        if !self.message.is_empty() {
            write!(f, ": {}", self.message)?;
        }
        if self.attempts > 1 {
            write!(f, " (after {} attempts)", self.attempts)?;
        }
        Ok(())
    }
}

impl CsiError {
    /// The gRPC code of a failed call (`None` for connect and response
    /// errors that carry no status).
    pub fn code(&self) -> Option<Code> {
        match self {
            CsiError::Rpc { code, .. } => Some(*code),
            CsiError::Connect { source, .. } => source.code(),
            _ => None,
        }
    }

    /// The CSI method that failed, if the error is about a call.
    pub fn rpc(&self) -> Option<&'static str> {
        match self {
            CsiError::Rpc { rpc, .. } | CsiError::InvalidResponse { rpc, .. } => Some(rpc),
            CsiError::PluginReplaced { rpc, .. } => *rpc,
            CsiError::Connect { source, .. } => source.rpc(),
            _ => None,
        }
    }

    /// The id of the volume the failed call was about, if it had one.
    pub fn volume_id(&self) -> Option<&str> {
        match self.volume() {
            Some(VolumeRef::Id(id)) => Some(id),
            _ => None,
        }
    }

    /// The volume (by id or, for `CreateVolume`, by name) the failed call
    /// was about.
    pub fn volume(&self) -> Option<&VolumeRef> {
        match self {
            CsiError::Rpc { volume, .. }
            | CsiError::InvalidResponse { volume, .. }
            | CsiError::PluginReplaced { volume, .. } => volume.as_ref(),
            CsiError::Connect { source, .. } => source.volume(),
            _ => None,
        }
    }

    /// Attempts made by the failed call (0 for errors that are not about a
    /// call).
    pub fn attempts(&self) -> u32 {
        match self {
            CsiError::Rpc { attempts, .. } => *attempts,
            CsiError::InvalidResponse { .. } => 1,
            CsiError::Connect { source, .. } => source.attempts(),
            _ => 0,
        }
    }

    /// The plugin's message of a failed call.
    pub fn message(&self) -> Option<&str> {
        match self {
            CsiError::Rpc { message, .. } => Some(message),
            CsiError::Connect { source, .. } => source.message(),
            _ => None,
        }
    }
}

/// The canonical name of a gRPC code, as the gRPC spec writes it
/// (`UNAVAILABLE`, `DEADLINE_EXCEEDED`, ...).
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// Formats a duration the way people write timeouts: `30s`, `250ms`,
/// `1.5s`.
pub(crate) fn fmt_duration(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else if d < Duration::from_secs(1) && d.subsec_nanos() % 1_000_000 == 0 {
        format!("{}ms", d.as_millis())
    } else {
        format!("{d:?}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error_chain::FullMessage;

    fn rpc_error(
        rpc: &'static str,
        volume: Option<VolumeRef>,
        code: Code,
        message: &str,
        attempts: u32,
    ) -> CsiError {
        CsiError::Rpc {
            rpc,
            volume,
            code,
            message: message.to_string(),
            attempts,
        }
    }

    #[test]
    fn rpc_errors_name_rpc_volume_code_message_and_attempts() {
        let cases = [
            (
                rpc_error("NodePublishVolume", Some(VolumeRef::Id("vol-1".into())), Code::Unavailable, "plugin restarting", 5),
                "NodePublishVolume of volume 'vol-1' failed: UNAVAILABLE: plugin restarting (after 5 attempts)",
            ),
            (
                rpc_error("DeleteVolume", Some(VolumeRef::Id("v".into())), Code::InvalidArgument, "bad id", 1),
                "DeleteVolume of volume 'v' failed: INVALID_ARGUMENT: bad id",
            ),
            (
                rpc_error("CreateVolume", Some(VolumeRef::Name("data".into())), Code::ResourceExhausted, "no space", 1),
                "CreateVolume of volume named 'data' failed: RESOURCE_EXHAUSTED: no space",
            ),
            (
                rpc_error("Probe", None, Code::DeadlineExceeded, "", 3),
                "Probe failed: DEADLINE_EXCEEDED (after 3 attempts)",
            ),
        ];
        for (err, want) in cases {
            assert_eq!(err.full_message(), want);
        }
    }

    #[test]
    fn accessors_expose_the_parts() {
        let err = rpc_error(
            "NodeStageVolume",
            Some(VolumeRef::Id("vol-9".into())),
            Code::Unavailable,
            "gone",
            4,
        );
        assert_eq!(err.code(), Some(Code::Unavailable));
        assert_eq!(err.rpc(), Some("NodeStageVolume"));
        assert_eq!(err.volume_id(), Some("vol-9"));
        assert_eq!(err.attempts(), 4);
        assert_eq!(err.message(), Some("gone"));

        let by_name = rpc_error(
            "CreateVolume",
            Some(VolumeRef::Name("n".into())),
            Code::Internal,
            "x",
            1,
        );
        assert_eq!(by_name.volume_id(), None);
        assert_eq!(by_name.volume(), Some(&VolumeRef::Name("n".into())));

        let wrapped = CsiError::Connect {
            endpoint: "unix:///x/csi.sock".into(),
            source: Box::new(rpc_error(
                "Probe",
                None,
                Code::FailedPrecondition,
                "disk missing",
                1,
            )),
        };
        assert_eq!(
            wrapped.full_message(),
            "connect to unix:///x/csi.sock: Probe failed: FAILED_PRECONDITION: disk missing"
        );
        assert_eq!(wrapped.code(), Some(Code::FailedPrecondition));
        assert_eq!(wrapped.rpc(), Some("Probe"));
        assert_eq!(wrapped.attempts(), 1);
    }

    #[test]
    fn connect_errors_name_endpoint_and_step() {
        let err = CsiError::ConnectTimeout {
            endpoint: "unix:///x/csi.sock".into(),
            what: "socket did not appear",
            timeout: Duration::from_secs(30),
            last_error: None,
        };
        assert_eq!(
            err.full_message(),
            "connect to unix:///x/csi.sock: socket did not appear within 30s"
        );
        assert_eq!(err.code(), None);
        assert_eq!(err.attempts(), 0);

        let err = CsiError::ConnectTimeout {
            endpoint: "unix:///x/csi.sock".into(),
            what: "socket did not accept connections",
            timeout: Duration::from_millis(250),
            last_error: Some("Connection refused (os error 111)".into()),
        };
        assert_eq!(
            err.full_message(),
            "connect to unix:///x/csi.sock: socket did not accept connections within 250ms (last error: Connection refused (os error 111))"
        );

        let err = CsiError::NotReady {
            endpoint: "unix:///x/csi.sock".into(),
            timeout: Duration::from_millis(1500),
        };
        assert_eq!(
            err.full_message(),
            "connect to unix:///x/csi.sock: plugin did not report ready within 1.5s"
        );
    }

    #[test]
    fn a_replaced_plugin_is_named_with_both_names() {
        let replacement = Replacement {
            endpoint: "unix:///x/csi.sock".into(),
            expected: "a.example.com".into(),
            found: "b.example.com".into(),
            vendor_version: "2.0".into(),
        };
        let err = CsiError::PluginReplaced {
            rpc: Some("NodeUnpublishVolume"),
            volume: Some(VolumeRef::Id("vol-1".into())),
            replacement: Box::new(replacement.clone()),
        };
        assert_eq!(
            err.full_message(),
            "NodeUnpublishVolume of volume 'vol-1' refused: the plugin at unix:///x/csi.sock is now 'b.example.com' (vendor version '2.0'), not 'a.example.com' as before; volume calls are not sent to a different driver"
        );
        assert_eq!(err.rpc(), Some("NodeUnpublishVolume"));
        assert_eq!(err.volume_id(), Some("vol-1"));
        assert_eq!(err.code(), None);
        let check = CsiError::PluginReplaced {
            rpc: None,
            volume: None,
            replacement: Box::new(replacement),
        };
        assert!(
            check
                .to_string()
                .starts_with("the plugin at unix:///x/csi.sock is now"),
            "{check}"
        );
    }

    #[test]
    fn code_names_are_canonical() {
        for (code, name) in [
            (Code::Ok, "OK"),
            (Code::Unavailable, "UNAVAILABLE"),
            (Code::DeadlineExceeded, "DEADLINE_EXCEEDED"),
            (Code::InvalidArgument, "INVALID_ARGUMENT"),
            (Code::FailedPrecondition, "FAILED_PRECONDITION"),
            (Code::Unauthenticated, "UNAUTHENTICATED"),
        ] {
            assert_eq!(code_name(code), name);
        }
    }
}
