//! The container engine's answer to "which containers exist, with which
//! volumes": `GET /containers/json?all=1` of the Docker Engine API (Podman's
//! Docker-compatible service answers it too), over HTTP/1.1 on the engine's
//! Unix socket.
//!
//! The answer is untrusted: the whole exchange is bounded in time
//! ([`EngineLimits::timeout`], each step failing by name), the answer's head
//! by hyper's buffer ([`MAX_HEAD`]) and its body in size
//! ([`EngineLimits::max_body`]); it must be a 200 whose body is a JSON list
//! of containers. The socket must be served by root (its `SO_PEERCRED`,
//! checked on every connection): a listing is what makes the plugin release
//! uses, and only a root engine may say so.

use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::header::{ACCEPT, HOST};
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tokio::time::Instant;

use crate::shown::shown;

use super::holders::Container;

/// The request: every container, running or not.
pub const LIST_PATH: &str = "/containers/json?all=1";

/// The largest answer head read (hyper's buffer).
pub const MAX_HEAD: usize = 64 * 1024;

/// An engine's API endpoint: `unix://<absolute path>`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    path: PathBuf,
}

impl Endpoint {
    /// The socket's path.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "unix://{}", shown(&self.path.to_string_lossy()))
    }
}

impl std::str::FromStr for Endpoint {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.strip_prefix("unix://") {
            Some(path) if path.starts_with('/') && path.len() > 1 => Ok(Endpoint {
                path: PathBuf::from(path),
            }),
            _ => Err(format!(
                "engine endpoint '{}': expected unix:///ABSOLUTE/PATH (such as unix:///var/run/docker.sock); only Unix sockets are supported",
                shown(s)
            )),
        }
    }
}

/// What the plugin spends on one listing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineLimits {
    /// The whole exchange: connect, request, answer.
    pub timeout: Duration,
    /// The largest answer body read.
    pub max_body: usize,
}

impl Default for EngineLimits {
    /// 10 s, 32 MiB (about ten thousand containers as Docker lists them).
    fn default() -> Self {
        EngineLimits {
            timeout: Duration::from_secs(10),
            max_body: 32 << 20,
        }
    }
}

/// A listing failed; nothing of it is used. Each names the engine and the
/// step.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The socket could not be reached.
    #[error("engine {endpoint}: connect")]
    Connect {
        /// The endpoint.
        endpoint: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The socket's peer credentials could not be read.
    #[error("engine {endpoint}: read the peer credentials of its socket")]
    PeerCredentials {
        /// The endpoint.
        endpoint: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The socket is served by another user than root.
    #[error("engine {endpoint}: its socket is served by uid {uid}, not root: its answers are not trusted")]
    NotRoot {
        /// The endpoint.
        endpoint: String,
        /// The server's uid.
        uid: u32,
    },
    /// An HTTP step failed (the head too large, the connection closed, ...).
    #[error("engine {endpoint}: {step}")]
    Http {
        /// The endpoint.
        endpoint: String,
        /// The step.
        step: &'static str,
        /// Why.
        #[source]
        source: hyper::Error,
    },
    /// A step did not finish within the time limit.
    #[error("engine {endpoint}: {step}: not done within {secs} s")]
    TimedOut {
        /// The endpoint.
        endpoint: String,
        /// The step.
        step: &'static str,
        /// The limit for the whole exchange.
        secs: u64,
    },
    /// The answer is not a 200.
    #[error("engine {endpoint}: GET {LIST_PATH} answered {status}")]
    Status {
        /// The endpoint.
        endpoint: String,
        /// The status.
        status: StatusCode,
    },
    /// The body is over the limit.
    #[error("engine {endpoint}: read the answer of GET {LIST_PATH}: over {limit} bytes")]
    TooLarge {
        /// The endpoint.
        endpoint: String,
        /// The limit.
        limit: usize,
    },
    /// The body broke off.
    #[error("engine {endpoint}: read the answer of GET {LIST_PATH}")]
    Body {
        /// The endpoint.
        endpoint: String,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The body is not a list of containers.
    #[error("engine {endpoint}: parse the answer of GET {LIST_PATH} as a list of containers")]
    Json {
        /// The endpoint.
        endpoint: String,
        /// The parser's error.
        #[source]
        source: serde_json::Error,
    },
}

/// Aborts the connection's task when the listing ends, however it ends.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The uid an engine's socket must be served by.
pub const ROOT: u32 = 0;

/// Every container the engine knows, with its state and mounts. The socket
/// must be served by `trusted_uid` ([`ROOT`]; the unit tests, which need no
/// root, pass their own).
pub async fn list_containers(
    endpoint: &Endpoint,
    limits: EngineLimits,
    trusted_uid: u32,
) -> Result<Vec<Container>, EngineError> {
    let name = || endpoint.to_string();
    let deadline = Instant::now() + limits.timeout;
    let within = |step: &'static str| {
        move |_| EngineError::TimedOut {
            endpoint: endpoint.to_string(),
            step,
            secs: limits.timeout.as_secs(),
        }
    };

    let stream = tokio::time::timeout_at(deadline, UnixStream::connect(&endpoint.path))
        .await
        .map_err(within("connect"))?
        .map_err(|source| EngineError::Connect {
            endpoint: name(),
            source,
        })?;
    let cred = stream
        .peer_cred()
        .map_err(|source| EngineError::PeerCredentials {
            endpoint: name(),
            source,
        })?;
    if cred.uid() != trusted_uid {
        return Err(EngineError::NotRoot {
            endpoint: name(),
            uid: cred.uid(),
        });
    }

    let http = |step| {
        move |source| EngineError::Http {
            endpoint: endpoint.to_string(),
            step,
            source,
        }
    };
    let (mut sender, connection) = hyper::client::conn::http1::Builder::new()
        .max_buf_size(MAX_HEAD)
        .max_header_size(MAX_HEAD)
        .handshake::<_, Empty<Bytes>>(TokioIo::new(stream))
        .await
        .map_err(http("start HTTP/1.1"))?;
    let _connection = AbortOnDrop(tokio::spawn(async move {
        let _ = connection.await;
    }));
    let request = Request::get(LIST_PATH)
        .header(HOST, "docker")
        .header(ACCEPT, "application/json")
        .body(Empty::new())
        .expect("a constant request builds");
    let response = tokio::time::timeout_at(deadline, sender.send_request(request))
        .await
        .map_err(within(
            "send GET /containers/json and read the answer's head",
        ))?
        .map_err(http("send GET /containers/json and read the answer's head"))?;
    if response.status() != StatusCode::OK {
        return Err(EngineError::Status {
            endpoint: name(),
            status: response.status(),
        });
    }
    let body = Limited::new(response.into_body(), limits.max_body);
    let bytes = tokio::time::timeout_at(deadline, body.collect())
        .await
        .map_err(within("read the answer of GET /containers/json"))?
        .map_err(|source| {
            if source.is::<http_body_util::LengthLimitError>() {
                EngineError::TooLarge {
                    endpoint: name(),
                    limit: limits.max_body,
                }
            } else {
                EngineError::Body {
                    endpoint: name(),
                    source,
                }
            }
        })?
        .to_bytes();
    serde_json::from_slice(&bytes).map_err(|source| EngineError::Json {
        endpoint: name(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error_chain::full_message;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn endpoints_are_unix_sockets_only() {
        let e: Endpoint = "unix:///var/run/docker.sock".parse().unwrap();
        assert_eq!(e.path(), std::path::Path::new("/var/run/docker.sock"));
        assert_eq!(e.to_string(), "unix:///var/run/docker.sock");
        for bad in [
            "",
            "/var/run/docker.sock",
            "unix://",
            "unix:///",
            "unix://relative",
            "tcp://127.0.0.1:2375",
        ] {
            let err = bad.parse::<Endpoint>().unwrap_err();
            assert!(err.contains("unix:///"), "{bad}: {err}");
        }
    }

    /// Serves one connection on a fresh socket with `answer` (raw bytes, or
    /// nothing at all), then returns what the engine call said.
    async fn ask(answer: Option<Vec<u8>>, limits: EngineLimits) -> Result<Vec<Container>, String> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("engine.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut head = Vec::new();
            let mut buf = [0u8; 1024];
            while !head.ends_with(b"\r\n\r\n") {
                let n = s.read(&mut buf).await.unwrap();
                if n == 0 {
                    return head;
                }
                head.extend_from_slice(&buf[..n]);
            }
            match answer {
                Some(bytes) => {
                    let _ = s.write_all(&bytes).await;
                }
                None => tokio::time::sleep(Duration::from_secs(60)).await,
            }
            head
        });
        let endpoint: Endpoint = format!("unix://{}", path.display()).parse().unwrap();
        let out = list_containers(&endpoint, limits, nix::unistd::geteuid().as_raw())
            .await
            .map_err(|e| full_message(&e));
        if let Ok(head) = tokio::time::timeout(Duration::from_millis(100), server).await {
            let head = String::from_utf8(head.unwrap()).unwrap();
            assert!(
                head.starts_with("GET /containers/json?all=1 HTTP/1.1\r\n"),
                "{head}"
            );
            assert!(head.to_ascii_lowercase().contains("host: docker"), "{head}");
        }
        out
    }

    fn ok_with(body: &str, chunked: bool) -> Vec<u8> {
        if chunked {
            format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n",
                body.len()
            )
            .into_bytes()
        } else {
            format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .into_bytes()
        }
    }

    #[tokio::test]
    async fn a_listing_is_read_and_every_bad_answer_refused_by_step() {
        let limits = EngineLimits {
            timeout: Duration::from_millis(500),
            max_body: 4096,
        };
        let body = r#"[{"Id":"c","State":"running","Mounts":[{"Type":"volume","Name":"v","Driver":"d"}]}]"#;
        for chunked in [false, true] {
            let got = ask(Some(ok_with(body, chunked)), limits).await.unwrap();
            assert_eq!(got.len(), 1);
            assert_eq!(got[0].mounts[0].name, "v");
        }
        let big = format!("[{}]", " ".repeat(8192));
        let nested = format!("{}{}", "[".repeat(1000), "]".repeat(1000));
        for (answer, expected) in [
            (Some(ok_with("{not json", false)), "parse the answer"),
            (
                Some(ok_with(r#"{"message":"x"}"#, false)),
                "parse the answer",
            ),
            (Some(ok_with(&big, false)), "over 4096 bytes"),
            (Some(ok_with(&big, true)), "over 4096 bytes"),
            (Some(ok_with(&nested, false)), "parse the answer"),
            (
                Some(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n".to_vec()),
                "answered 500",
            ),
            (
                Some(b"HTTP/1.1 abc\r\n\r\n".to_vec()),
                "read the answer's head",
            ),
            (
                Some(format!("HTTP/1.1 200 OK\r\nX: {}\r\n\r\n", "a".repeat(100_000)).into_bytes()),
                "read the answer's head",
            ),
            (
                Some(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n[".to_vec()),
                "read the answer of GET",
            ),
            (None, "not done within"),
        ] {
            let answer_head: String = answer
                .as_ref()
                .map(|a| String::from_utf8_lossy(&a[..a.len().min(40)]).into_owned())
                .unwrap_or_default();
            let err = ask(answer, limits).await.unwrap_err();
            assert!(
                err.contains(expected),
                "{expected}: {err} ({})",
                answer_head
            );
            assert!(err.starts_with("engine unix:///"), "{err}");
        }
    }

    #[tokio::test]
    async fn a_socket_served_by_another_uid_is_not_asked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("engine.sock");
        let _listener = tokio::net::UnixListener::bind(&path).unwrap();
        let endpoint: Endpoint = format!("unix://{}", path.display()).parse().unwrap();
        let other = nix::unistd::geteuid().as_raw() + 1;
        let err = list_containers(&endpoint, EngineLimits::default(), other)
            .await
            .unwrap_err();
        let text = full_message(&err);
        assert!(
            text.contains("its socket is served by uid") && text.contains("not root"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn an_absent_engine_is_a_connect_error() {
        let endpoint: Endpoint = "unix:///nonexistent/engine.sock".parse().unwrap();
        let err = list_containers(&endpoint, EngineLimits::default(), ROOT)
            .await
            .unwrap_err();
        assert!(
            full_message(&err).starts_with("engine unix:///nonexistent/engine.sock: connect: "),
            "{}",
            full_message(&err)
        );
    }
}
