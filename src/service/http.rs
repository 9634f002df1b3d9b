//! A minimal HTTP/1.1 responder for `GET /metrics`, over a tokio
//! `TcpListener`: one request per connection, answered with
//! `Connection: close` and an exact `Content-Length`.
//!
//! - `GET /metrics` (any query string): `200`, `text/plain; version=0.0.4`.
//!   `HEAD` gets the same headers without the body.
//! - Another path: `404`; another method: `405` with `Allow: GET, HEAD`;
//!   a request line that cannot be parsed, or a header block over 16 KiB:
//!   `400`; no complete header block within 10 s: the connection is closed.
//!
//! Request bodies are not read (GET and HEAD carry none); the connection is
//! closed after the response, which HTTP/1.1 allows with `Connection: close`.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The largest request head read.
const MAX_HEAD: usize = 16 * 1024;
/// How long a client may take to send its request head.
const READ_TIMEOUT: Duration = Duration::from_secs(10);
/// The content type of the Prometheus text format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Renders the metrics text; called on a blocking thread per request.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// Accepts connections forever, one task each. Ends only on an accept
/// error that is not per-connection (abort the task to stop it).
pub async fn serve(listener: TcpListener, render: Render) -> std::io::Result<()> {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(c) => c,
            // Per-connection failures (reset before accept, out of fds for a moment).
            Err(e) if is_transient(&e) => {
                tracing::warn!(error = %e, "metrics: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        let render = render.clone();
        tokio::spawn(async move {
            if let Err(e) = handle(stream, render).await {
                tracing::debug!(%peer, error = %e, "metrics: connection failed");
            }
        });
    }
}

fn is_transient(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionAborted | ConnectionReset | Interrupted | WouldBlock
    ) || matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// What a request asks for.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    Metrics { head_only: bool },
    NotFound { head_only: bool },
    MethodNotAllowed,
    BadRequest,
}

/// Routes a request head (everything up to the blank line).
fn route(head: &[u8]) -> Route {
    let Some(line) = head.split(|b| *b == b'\n').next() else {
        return Route::BadRequest;
    };
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let Ok(line) = std::str::from_utf8(line) else {
        return Route::BadRequest;
    };
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Route::BadRequest;
    };
    if !version.starts_with("HTTP/1.") || target.is_empty() {
        return Route::BadRequest;
    }
    let head_only = match method {
        "GET" => false,
        "HEAD" => true,
        _ => return Route::MethodNotAllowed,
    };
    let path = target.split_once('?').map_or(target, |(p, _)| p);
    if path == "/metrics" {
        Route::Metrics { head_only }
    } else {
        Route::NotFound { head_only }
    }
}

/// Reads the request head: up to and including the first blank line.
async fn read_head(stream: &mut TcpStream) -> std::io::Result<Option<Vec<u8>>> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 2048];
    loop {
        if let Some(end) = find_end(&head) {
            head.truncate(end);
            return Ok(Some(head));
        }
        if head.len() > MAX_HEAD {
            return Ok(None);
        }
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        head.extend_from_slice(&buf[..n]);
    }
}

/// The end of the head (after `\r\n\r\n`, or a bare `\n\n`, which RFC 9112
/// lets a server accept).
fn find_end(buf: &[u8]) -> Option<usize> {
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4);
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    match (crlf, lf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

async fn handle(mut stream: TcpStream, render: Render) -> std::io::Result<()> {
    let route = match tokio::time::timeout(READ_TIMEOUT, read_head(&mut stream)).await {
        Err(_elapsed) => return Ok(()),
        Ok(Err(e)) => return Err(e),
        Ok(Ok(None)) => Route::BadRequest,
        Ok(Ok(Some(head))) => route(&head),
    };
    let (status, body, head_only, extra) = match route {
        Route::Metrics { head_only } => {
            let body = tokio::task::spawn_blocking(move || render())
                .await
                .map_err(std::io::Error::other)?;
            ("200 OK", body, head_only, "")
        }
        Route::NotFound { head_only } => (
            "404 Not Found",
            "not found: metrics are at /metrics\n".to_string(),
            head_only,
            "",
        ),
        Route::MethodNotAllowed => (
            "405 Method Not Allowed",
            "only GET and HEAD are allowed\n".to_string(),
            false,
            "Allow: GET, HEAD\r\n",
        ),
        Route::BadRequest => ("400 Bad Request", "bad request\n".to_string(), false, ""),
    };
    let content_type = if status.starts_with("200") {
        CONTENT_TYPE
    } else {
        "text/plain; charset=utf-8"
    };
    let mut response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n{extra}Connection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if !head_only {
        response.extend_from_slice(body.as_bytes());
    }
    stream.write_all(&response).await?;
    stream.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        for (head, want) in [
            (
                &b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"[..],
                Route::Metrics { head_only: false },
            ),
            (
                b"HEAD /metrics?x=1 HTTP/1.0\r\n\r\n",
                Route::Metrics { head_only: true },
            ),
            (
                b"GET / HTTP/1.1\r\n\r\n",
                Route::NotFound { head_only: false },
            ),
            (b"POST /metrics HTTP/1.1\r\n\r\n", Route::MethodNotAllowed),
            (b"GET /metrics\r\n\r\n", Route::BadRequest),
            (b"GET /metrics SPDY/3\r\n\r\n", Route::BadRequest),
            (b"\xff\xfe\r\n\r\n", Route::BadRequest),
        ] {
            assert_eq!(route(head), want, "{:?}", String::from_utf8_lossy(head));
        }
    }

    #[test]
    fn head_ends_at_the_first_blank_line() {
        assert_eq!(find_end(b"GET / HTTP/1.1\r\n\r\nbody"), Some(18));
        assert_eq!(find_end(b"GET / HTTP/1.1\n\nbody"), Some(16));
        assert_eq!(find_end(b"GET / HTTP/1.1\r\nHost: x\r\n"), None);
    }

    #[tokio::test]
    async fn serves_metrics_over_tcp() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(serve(
            listener,
            Arc::new(|| "# TYPE x counter\nx_total 1\n".to_string()),
        ));
        let ask = |req: &'static str| async move {
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(req.as_bytes()).await.unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).await.unwrap();
            out
        };
        let ok = ask("GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n").await;
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.contains("Content-Length: 27\r\n"), "{ok}");
        assert!(
            ok.ends_with("\r\n\r\n# TYPE x counter\nx_total 1\n"),
            "{ok}"
        );
        let head = ask("HEAD /metrics HTTP/1.1\r\n\r\n").await;
        assert!(head.ends_with("Connection: close\r\n\r\n"), "{head}");
        let missing = ask("GET /nope HTTP/1.1\r\n\r\n").await;
        assert!(missing.starts_with("HTTP/1.1 404 "), "{missing}");
        let post = ask("POST /metrics HTTP/1.1\r\n\r\n").await;
        assert!(post.starts_with("HTTP/1.1 405 ") && post.contains("Allow: GET, HEAD"));
        server.abort();
    }
}
