//! A minimal HTTP/1.1 responder for `GET /metrics`, over a tokio
//! `TcpListener`: one request per connection, answered with
//! `Connection: close` and an exact `Content-Length`.
//!
//! - `GET /metrics` (any query string): `200`, `text/plain; version=0.0.4`.
//!   `HEAD` gets the same headers without the body.
//! - Another path: `404`; another method: `405` with `Allow: GET, HEAD`;
//!   a request line that cannot be parsed, or a header block over 16 KiB:
//!   `400`.
//!
//! Request bodies are not read (GET and HEAD carry none); the connection is
//! closed after the response, which HTTP/1.1 allows with `Connection: close`.
//!
//! Bounds, so that whoever reaches the port cannot make serve hold more
//! than a fixed number of descriptors or do more than a fixed amount of
//! work (see [`Limits`]):
//! - At most `max_connections` connections are served at once. One over the
//!   cap is accepted and closed at once (so it neither waits in the backlog
//!   nor holds a descriptor), counted
//!   (`csi_isolator_connections_refused_total{listener="metrics"}`) and
//!   logged at a bounded rate.
//! - One deadline covers the whole request: reading the head, rendering and
//!   writing the response. A connection still open at the deadline is
//!   closed, whatever it was doing.
//! - The rendered body is reused for `cache_for` (1 s by default): a burst
//!   of scrapes renders once, instead of scanning every checkpoint and the
//!   mount table once per scrape. Scrapes that arrive while a render runs
//!   wait for it.
//!
//! Exposure: the metrics name plugins and count volumes per state, which
//! tells whoever can reach the address how the node is used. The default
//! address is loopback (a bare `PORT` means `127.0.0.1:PORT`, see
//! [`parse_addr`]); serve warns when it binds any other address
//! ([`exposure_warning`]).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use crate::service::admission::{is_transient, WarnLimiter};
use crate::service::metrics::{Refusal, ServiceMetrics};

/// The largest request head read.
const MAX_HEAD: usize = 16 * 1024;
/// The content type of the Prometheus text format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Renders the metrics text; called on a blocking thread.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// The bounds of the metrics server (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections served at once; more are closed as soon as accepted.
    pub max_connections: usize,
    /// The whole request: head, render, response.
    pub deadline: Duration,
    /// How long a rendered body is reused.
    pub cache_for: Duration,
}

impl Default for Limits {
    /// 32 connections, a 5 s deadline (a Prometheus scrape times out after
    /// 10 s by default), a body reused for 1 s.
    fn default() -> Self {
        Limits {
            max_connections: 32,
            deadline: Duration::from_secs(5),
            cache_for: Duration::from_secs(1),
        }
    }
}

/// A `--metrics` value: `ADDR:PORT` (`127.0.0.1:9464`, `[::1]:9464`) or a
/// bare `PORT`, which means `127.0.0.1:PORT`.
pub fn parse_addr(value: &str) -> Result<SocketAddr, String> {
    if let Ok(port) = value.parse::<u16>() {
        return Ok(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port));
    }
    value.parse::<SocketAddr>().map_err(|_| {
        format!("'{value}' is neither ADDR:PORT (127.0.0.1:9464, [::1]:9464) nor a port number")
    })
}

/// The warning to give when the metrics are served on `addr`: none for a
/// loopback address (IPv4-mapped ones included).
pub fn exposure_warning(addr: SocketAddr) -> Option<String> {
    if addr.ip().to_canonical().is_loopback() {
        return None;
    }
    Some(format!(
        "metrics on {addr}, which is not a loopback address: anyone who can reach it can read the metrics, which name the CSI plugins and count the volumes per state and the calls per method; serve them on 127.0.0.1 (--metrics PORT) and scrape through a proxy, or firewall the port"
    ))
}

/// The rendered body, reused for a while (see the module doc).
pub struct RenderCache {
    render: Render,
    ttl: Duration,
    slot: tokio::sync::Mutex<Option<(Instant, Arc<String>)>>,
}

/// Whether a body rendered at `rendered` may still be served at `now`.
fn fresh(rendered: Instant, now: Instant, ttl: Duration) -> bool {
    now.saturating_duration_since(rendered) < ttl
}

impl RenderCache {
    /// Caches what `render` returns for `ttl`.
    pub fn new(render: Render, ttl: Duration) -> RenderCache {
        RenderCache {
            render,
            ttl,
            slot: tokio::sync::Mutex::new(None),
        }
    }

    /// The body: the cached one while fresh, else a new render (on a
    /// blocking thread; concurrent callers wait for it and share it).
    pub async fn get(&self) -> std::io::Result<Arc<String>> {
        let mut slot = self.slot.lock().await;
        if let Some((at, body)) = slot.as_ref() {
            if fresh(*at, Instant::now(), self.ttl) {
                return Ok(body.clone());
            }
        }
        let render = self.render.clone();
        let body = Arc::new(
            tokio::task::spawn_blocking(move || render())
                .await
                .map_err(std::io::Error::other)?,
        );
        *slot = Some((Instant::now(), body.clone()));
        Ok(body)
    }
}

/// Accepts connections forever, one task each, within `limits`. Ends only
/// on an accept error that is not per-connection (abort the task to stop it).
pub async fn serve(
    listener: TcpListener,
    render: Render,
    limits: Limits,
    metrics: Arc<ServiceMetrics>,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let cache = Arc::new(RenderCache::new(render, limits.cache_for));
    let mut refusals = WarnLimiter::default();
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
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            drop(stream);
            metrics.refused(Refusal::MetricsCapacity);
            if let Some(left_out) = refusals.allow(Instant::now()) {
                tracing::warn!(%peer, max = limits.max_connections, left_out, "metrics: connection refused: every connection slot is taken");
            }
            continue;
        };
        let cache = cache.clone();
        tokio::spawn(async move {
            let _slot = slot;
            match tokio::time::timeout(limits.deadline, handle(stream, &cache)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!(%peer, error = %e, "metrics: connection failed"),
                Err(_elapsed) => {
                    tracing::debug!(%peer, deadline = ?limits.deadline, "metrics: request not done by its deadline; connection closed")
                }
            }
        });
    }
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

/// Serves one request (the caller bounds the whole of it by the deadline).
async fn handle(mut stream: TcpStream, cache: &RenderCache) -> std::io::Result<()> {
    let route = match read_head(&mut stream).await? {
        None => Route::BadRequest,
        Some(head) => route(&head),
    };
    let text = |s: &str| Arc::new(s.to_string());
    let (status, body, head_only, extra) = match route {
        Route::Metrics { head_only } => ("200 OK", cache.get().await?, head_only, ""),
        Route::NotFound { head_only } => (
            "404 Not Found",
            text("not found: metrics are at /metrics\n"),
            head_only,
            "",
        ),
        Route::MethodNotAllowed => (
            "405 Method Not Allowed",
            text("only GET and HEAD are allowed\n"),
            false,
            "Allow: GET, HEAD\r\n",
        ),
        Route::BadRequest => ("400 Bad Request", text("bad request\n"), false, ""),
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
            Limits::default(),
            Arc::new(ServiceMetrics::default()),
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

    #[test]
    fn metrics_addresses_parse_with_a_bare_port_meaning_loopback() {
        for (value, want) in [
            ("9464", Some("127.0.0.1:9464")),
            ("0", Some("127.0.0.1:0")),
            ("127.0.0.1:9464", Some("127.0.0.1:9464")),
            ("0.0.0.0:9464", Some("0.0.0.0:9464")),
            ("[::1]:9464", Some("[::1]:9464")),
            ("localhost:9464", None),
            ("70000", None),
            ("", None),
            ("127.0.0.1", None),
        ] {
            let got = parse_addr(value).ok().map(|a| a.to_string());
            assert_eq!(got.as_deref(), want, "{value:?}");
        }
        let e = parse_addr("nope").unwrap_err();
        assert!(e.contains("'nope'") && e.contains("ADDR:PORT"), "{e}");
    }

    #[test]
    fn only_a_non_loopback_address_is_warned_about() {
        for (addr, warned) in [
            ("127.0.0.1:1", false),
            ("127.0.0.2:1", false),
            ("[::1]:1", false),
            ("[::ffff:127.0.0.1]:1", false),
            ("0.0.0.0:1", true),
            ("[::]:1", true),
            ("10.1.2.3:1", true),
            ("[::ffff:10.1.2.3]:1", true),
        ] {
            let w = exposure_warning(addr.parse().unwrap());
            assert_eq!(w.is_some(), warned, "{addr}");
            if let Some(w) = w {
                assert!(w.contains("volumes") && w.contains(addr), "{w}");
            }
        }
    }

    #[test]
    fn a_body_is_fresh_for_its_ttl_only() {
        let t0 = Instant::now();
        let ttl = Duration::from_secs(1);
        for (after, want) in [
            (Duration::ZERO, true),
            (Duration::from_millis(999), true),
            (ttl, false),
            (Duration::from_secs(5), false),
        ] {
            assert_eq!(fresh(t0, t0 + after, ttl), want, "{after:?}");
        }
        // A clock that went backwards (the cache's Instant is later) stays fresh.
        assert!(fresh(t0 + ttl, t0, ttl));
    }

    #[tokio::test]
    async fn a_burst_of_scrapes_renders_once_per_ttl() {
        let renders = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = renders.clone();
        let cache = Arc::new(RenderCache::new(
            Arc::new(move || {
                let n = counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(50));
                format!("render {n}\n")
            }),
            Duration::from_millis(300),
        ));
        let burst: Vec<_> = (0..20)
            .map(|_| {
                let c = cache.clone();
                tokio::spawn(async move { c.get().await.unwrap() })
            })
            .collect();
        for b in burst {
            assert_eq!(b.await.unwrap().as_str(), "render 0\n");
        }
        assert_eq!(renders.load(std::sync::atomic::Ordering::SeqCst), 1);
        tokio::time::sleep(Duration::from_millis(350)).await;
        assert_eq!(cache.get().await.unwrap().as_str(), "render 1\n");
    }

    #[tokio::test]
    async fn connections_over_the_cap_are_closed_at_once_and_a_slow_one_at_the_deadline() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let metrics = Arc::new(ServiceMetrics::default());
        let limits = Limits {
            max_connections: 2,
            deadline: Duration::from_millis(500),
            cache_for: Duration::from_secs(1),
        };
        let server = tokio::spawn(serve(
            listener,
            Arc::new(|| "x_total 1\n".to_string()),
            limits,
            metrics.clone(),
        ));
        // Two idle connections take both slots.
        let mut idle = Vec::new();
        for _ in 0..2 {
            idle.push(TcpStream::connect(addr).await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        // A third is closed at once: EOF well before the deadline.
        let started = Instant::now();
        let mut third = TcpStream::connect(addr).await.unwrap();
        let mut buf = Vec::new();
        let n = tokio::time::timeout(Duration::from_secs(5), third.read_to_end(&mut buf))
            .await
            .expect("closed at once")
            .unwrap_or(0);
        assert_eq!(n, 0);
        assert!(
            started.elapsed() < limits.deadline,
            "{:?}",
            started.elapsed()
        );
        assert_eq!(metrics.refused_count(Refusal::MetricsCapacity), 1);
        // The idle ones are closed at the deadline (EOF, nothing sent).
        for mut s in idle {
            let n = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf))
                .await
                .expect("closed by the deadline")
                .unwrap_or(0);
            assert_eq!(n, 0);
        }
        // Then a scrape is served.
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        assert!(out.starts_with("HTTP/1.1 200 OK\r\n"), "{out}");
        server.abort();
    }
}
