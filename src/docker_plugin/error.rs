//! The errors of the Docker volume plugin's calls, and the one seam where
//! they become answers: HTTP 500 (404 for an endpoint that does not exist,
//! 413 for a body over the limit) with `{"Err": "..."}` holding the full
//! error text ([`full_message`]): the endpoint, the volume, and the cause
//! down to the CSI RPC, its code and the plugin's message.

use crate::error_chain::full_message;
use crate::provider::ProviderError;

/// A call failed.
#[derive(Debug, thiserror::Error)]
pub enum DockerError {
    /// An option of `Create` cannot be used.
    #[error("{call} volume '{volume}'")]
    Opts {
        /// The endpoint.
        call: &'static str,
        /// The volume name, escaped.
        volume: String,
        /// Which option and why.
        #[source]
        source: super::opts::OptError,
    },
    /// The provider refused or failed.
    #[error("{call} volume '{volume}'")]
    Provider {
        /// The endpoint.
        call: &'static str,
        /// The volume name, escaped.
        volume: String,
        /// The provider's error (naming the CSI RPC, its code and message).
        #[source]
        source: Box<ProviderError>,
    },
    /// A Mount ID that cannot be a user of a volume.
    #[error("{call} volume '{volume}'")]
    BadId {
        /// The endpoint.
        call: &'static str,
        /// The volume name, escaped.
        volume: String,
        /// Why the id is refused.
        #[source]
        source: Box<crate::resource::ResourceError>,
    },
    /// No volume of that name.
    #[error("{call} volume '{volume}': no such volume (create it with `docker volume create --driver DRIVER {volume}`)")]
    NoSuchVolume {
        /// The endpoint.
        call: &'static str,
        /// The volume name, escaped.
        volume: String,
    },
    /// A field the endpoint needs is missing.
    #[error("{call}: the request has no {field}")]
    Missing {
        /// The endpoint.
        call: &'static str,
        /// The field.
        field: &'static str,
    },
    /// The body is not the endpoint's JSON.
    #[error("{call}: the request body is not valid JSON for it")]
    BadBody {
        /// The endpoint.
        call: &'static str,
        /// The parser's error.
        #[source]
        source: serde_json::Error,
    },
    /// The body is larger than the plugin reads.
    #[error("{call}: the request body is over {limit} bytes")]
    TooLarge {
        /// The endpoint.
        call: String,
        /// The limit.
        limit: usize,
    },
    /// The body was not received in time, or broke off.
    #[error("{call}: the request body was not received")]
    BodyRead {
        /// The endpoint.
        call: String,
    },
    /// No such endpoint.
    #[error("{path}: no such endpoint of the volume plugin protocol")]
    NotFound {
        /// The path asked for, escaped.
        path: String,
    },
    /// The call's task ended without an answer (it panicked).
    #[error("{call}: the call failed unexpectedly (see the plugin's log)")]
    Aborted {
        /// The endpoint.
        call: &'static str,
    },
    /// The call did not finish in time; it goes on in the background (a Mount is then undone).
    #[error(
        "{call}: not done within {secs} s (--call-timeout); it goes on in the background, and a \
         Mount is undone when it ends, as the engine takes this answer for a failure. Try again; \
         for a slower driver raise --call-timeout, and Podman's volume_plugin_timeout (5 s by \
         default) above it"
    )]
    TimedOut {
        /// The endpoint.
        call: &'static str,
        /// The limit.
        secs: u64,
    },
    /// Another method than POST.
    #[error("{method} {path}: the volume plugin protocol takes only POST")]
    Method {
        /// The method, escaped.
        method: String,
        /// The path, escaped.
        path: String,
    },
}

impl DockerError {
    /// The HTTP status of the answer (never 200: Podman takes any 200 as success).
    pub fn status(&self) -> u16 {
        match self {
            DockerError::NotFound { .. } => 404,
            DockerError::Method { .. } => 405,
            DockerError::TooLarge { .. } => 413,
            _ => 500,
        }
    }

    /// The `Err` text.
    pub fn message(&self) -> String {
        full_message(self)
    }
}
