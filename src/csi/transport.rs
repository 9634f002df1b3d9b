//! gRPC transport over a Unix domain socket.
//!
//! CSI endpoints are written `unix:///absolute/path`; tonic only speaks
//! URIs, so the channel is given a dummy authority and a connector that
//! dials the socket path instead.

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint};

/// Errors from parsing an endpoint or dialing its socket.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The endpoint is not of the form `unix:///absolute/path`.
    #[error(
        "endpoint '{endpoint}' is not a unix socket endpoint (expected unix:///ABSOLUTE/PATH)"
    )]
    BadEndpoint {
        /// The endpoint as given.
        endpoint: String,
    },
    /// Dialing the socket failed.
    #[error("connect to socket {path}")]
    Connect {
        /// The socket path.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: tonic::transport::Error,
    },
}

/// Parses `unix:///path` (or `unix:/path`) into the socket path.
pub fn socket_path(endpoint: &str) -> Result<PathBuf, TransportError> {
    let bad = || TransportError::BadEndpoint {
        endpoint: endpoint.to_string(),
    };
    let rest = endpoint
        .strip_prefix("unix://")
        .or_else(|| endpoint.strip_prefix("unix:"))
        .ok_or_else(bad)?;
    if !rest.starts_with('/') || rest.contains('\0') {
        return Err(bad());
    }
    Ok(PathBuf::from(rest))
}

/// Formats a socket path as a CSI endpoint.
pub fn endpoint_for(path: &Path) -> String {
    format!("unix://{}", path.display())
}

/// Dials the socket once and returns a connected channel. Callers that
/// must wait for a plugin to come up retry around this.
pub async fn connect_unix(path: &Path) -> Result<Channel, TransportError> {
    let owned = path.to_path_buf();
    Endpoint::from_static("http://csi.local")
        .connect_with_connector(tower::service_fn(move |_| {
            let p = owned.clone();
            async move { UnixStream::connect(p).await.map(TokioIo::new) }
        }))
        .await
        .map_err(|source| TransportError::Connect {
            path: path.to_path_buf(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_unix_endpoints() {
        assert_eq!(
            socket_path("unix:///run/csi.sock").unwrap(),
            PathBuf::from("/run/csi.sock")
        );
        assert_eq!(
            socket_path("unix:/run/csi.sock").unwrap(),
            PathBuf::from("/run/csi.sock")
        );
        for bad in [
            "tcp://1.2.3.4:5",
            "unix://relative",
            "/run/csi.sock",
            "unix:///a\0b",
        ] {
            assert!(socket_path(bad).is_err(), "{bad}");
        }
    }
}
