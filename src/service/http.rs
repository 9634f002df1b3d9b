//! `GET /metrics` over hyper's HTTP/1 server, behind serve's accept gate.
//!
//! - `GET /metrics` (any query string): `200`, the Prometheus text format
//!   0.0.4 (`text/plain; version=0.0.4`). `HEAD` gets the same headers
//!   without the body.
//! - Another path: `404`; another method: `405` with `Allow: GET, HEAD`;
//!   a request hyper cannot parse: `400`; a head over 16 KiB: `431`.
//!
//! One request per connection: keep-alive is off, so every response says
//! `Connection: close` and the connection ends after it. Request bodies are
//! never read (GET and HEAD carry none). Header names are written in title
//! case, as before hyper.
//!
//! Bounds, so that whoever reaches the port cannot make serve hold more
//! than a fixed number of descriptors or do more than a fixed amount of
//! work (see [`Limits`]):
//! - At most `max_connections` connections are served at once, by the
//!   accept gate shared with the service socket ([`accept`](super::accept)):
//!   one over the cap is accepted and closed at once, counted
//!   (`csi_isolator_connections_refused_total{listener="metrics"}`) and
//!   logged at a bounded rate.
//! - One deadline covers the whole request: reading the head, rendering and
//!   writing the response. A connection still open at the deadline is
//!   closed, whatever it was doing.
//! - The head is read into at most 16 KiB.
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

use std::convert::Infallible;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{HeaderValue, ALLOW, CONTENT_TYPE as CONTENT_TYPE_HEADER};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};

use crate::error_chain::Chain;
use crate::service::accept::{Gate, Listen};
use crate::service::metrics::{Refusal, ServiceMetrics};

/// The largest request head read (hyper's buffer; its minimum is 8 KiB).
const MAX_HEAD: usize = 16 * 1024;
/// The content type of the Prometheus text format.
pub const CONTENT_TYPE: &str = crate::service::metrics::CONTENT_TYPE;

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
    slot: tokio::sync::Mutex<Option<(Instant, Bytes)>>,
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
    pub async fn get(&self) -> std::io::Result<Bytes> {
        let mut slot = self.slot.lock().await;
        if let Some((at, body)) = slot.as_ref() {
            if fresh(*at, Instant::now(), self.ttl) {
                return Ok(body.clone());
            }
        }
        let render = self.render.clone();
        let body = Bytes::from(
            tokio::task::spawn_blocking(move || render())
                .await
                .map_err(std::io::Error::other)?,
        );
        *slot = Some((Instant::now(), body.clone()));
        Ok(body)
    }
}

/// The metrics port, for the accept gate: every peer is admitted (the bind
/// address is the operator's choice), up to the cap.
struct MetricsPort(TcpListener);

impl Listen for MetricsPort {
    type Stream = TcpStream;
    const NAME: &'static str = "metrics";
    const OVER_CAPACITY: Refusal = Refusal::MetricsCapacity;

    async fn accept(&mut self) -> std::io::Result<(TcpStream, String)> {
        let (stream, peer) = self.0.accept().await?;
        Ok((stream, peer.to_string()))
    }
}

/// Accepts connections until the task is aborted, one task each, within
/// `limits` (accepting never stops by itself, see [`Gate`]).
pub async fn serve(
    listener: TcpListener,
    render: Render,
    limits: Limits,
    metrics: Arc<ServiceMetrics>,
) {
    let mut gate = Gate::new(MetricsPort(listener), limits.max_connections, metrics);
    let cache = Arc::new(RenderCache::new(render, limits.cache_for));
    loop {
        let conn = gate.next().await;
        let cache = cache.clone();
        tokio::spawn(async move {
            let peer = conn.stream().peer_addr().ok();
            let service = hyper::service::service_fn(move |req| {
                let cache = cache.clone();
                async move { Ok::<_, Infallible>(respond(&req, &cache).await) }
            });
            let http = hyper::server::conn::http1::Builder::new()
                .keep_alive(false)
                .title_case_headers(true)
                .max_buf_size(MAX_HEAD)
                .timer(TokioTimer::new())
                .header_read_timeout(limits.deadline)
                .serve_connection(TokioIo::new(conn), service);
            match tokio::time::timeout(limits.deadline, http).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::debug!(?peer, error = %Chain(&e), "metrics: connection failed")
                }
                Err(_elapsed) => {
                    tracing::debug!(?peer, deadline = ?limits.deadline, "metrics: request not done by its deadline; connection closed")
                }
            }
        });
    }
}

/// What a request asks for.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    Metrics,
    NotFound,
    MethodNotAllowed,
}

/// Routes a request by its method and path (the query is not part of it).
fn route(method: &Method, path: &str) -> Route {
    if method != Method::GET && method != Method::HEAD {
        Route::MethodNotAllowed
    } else if path == "/metrics" {
        Route::Metrics
    } else {
        Route::NotFound
    }
}

/// The response to one request (hyper leaves the body out for HEAD).
async fn respond<B>(req: &Request<B>, cache: &RenderCache) -> Response<Full<Bytes>> {
    let text = |status: StatusCode, body: &'static str| {
        let mut r = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
        *r.status_mut() = status;
        r.headers_mut().insert(
            CONTENT_TYPE_HEADER,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        r
    };
    match route(req.method(), req.uri().path()) {
        Route::Metrics => match cache.get().await {
            Ok(body) => {
                let mut r = Response::new(Full::new(body));
                r.headers_mut()
                    .insert(CONTENT_TYPE_HEADER, HeaderValue::from_static(CONTENT_TYPE));
                r
            }
            Err(e) => {
                tracing::warn!(error = %Chain(&e), "metrics: render failed");
                text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the metrics could not be rendered\n",
                )
            }
        },
        Route::NotFound => text(
            StatusCode::NOT_FOUND,
            "not found: metrics are at /metrics\n",
        ),
        Route::MethodNotAllowed => {
            let mut r = text(
                StatusCode::METHOD_NOT_ALLOWED,
                "only GET and HEAD are allowed\n",
            );
            r.headers_mut()
                .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
            r
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn routes() {
        for (method, path, want) in [
            (Method::GET, "/metrics", Route::Metrics),
            (Method::HEAD, "/metrics", Route::Metrics),
            (Method::GET, "/", Route::NotFound),
            (Method::GET, "/metrics/", Route::NotFound),
            (Method::POST, "/metrics", Route::MethodNotAllowed),
            (Method::PUT, "/", Route::MethodNotAllowed),
        ] {
            assert_eq!(route(&method, path), want, "{method} {path}");
        }
    }

    async fn ask(addr: SocketAddr, req: &[u8]) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(req).await.unwrap();
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out))
            .await
            .expect("answered and closed in time")
            .unwrap();
        String::from_utf8(out).unwrap()
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
        let ok = ask(addr, b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n").await;
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.contains("Content-Length: 27\r\n"), "{ok}");
        assert!(
            ok.contains(&format!("Content-Type: {CONTENT_TYPE}\r\n")),
            "{ok}"
        );
        assert!(ok.contains("Connection: close\r\n"), "{ok}");
        assert!(
            ok.ends_with("\r\n\r\n# TYPE x counter\nx_total 1\n"),
            "{ok}"
        );
        let old = ask(addr, b"GET /metrics HTTP/1.0\r\n\r\n").await;
        assert!(old.starts_with("HTTP/1.0 200 OK\r\n"), "{old}");
        let head = ask(addr, b"HEAD /metrics HTTP/1.1\r\nHost: a\r\n\r\n").await;
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        assert!(head.ends_with("\r\n\r\n"), "no body after HEAD: {head}");
        let missing = ask(addr, b"GET /nope HTTP/1.1\r\nHost: a\r\n\r\n").await;
        assert!(missing.starts_with("HTTP/1.1 404 "), "{missing}");
        let post = ask(addr, b"POST /metrics HTTP/1.1\r\nHost: a\r\n\r\n").await;
        assert!(
            post.starts_with("HTTP/1.1 405 ") && post.contains("Allow: GET, HEAD"),
            "{post}"
        );
        for bad in [&b"GET /metrics SPDY/3\r\n\r\n"[..], b"\xff\xfe\r\n\r\n"] {
            let answer = ask(addr, bad).await;
            assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
        }
        // A head over the cap is refused, not buffered.
        let huge = format!(
            "GET /metrics HTTP/1.1\r\nHost: a\r\nX-Pad: {}\r\n\r\n",
            "a".repeat(2 * MAX_HEAD)
        );
        let answer = ask(addr, huge.as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 431 "), "{answer}");
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
            assert_eq!(b.await.unwrap(), "render 0\n");
        }
        assert_eq!(renders.load(std::sync::atomic::Ordering::SeqCst), 1);
        tokio::time::sleep(Duration::from_millis(350)).await;
        assert_eq!(cache.get().await.unwrap(), "render 1\n");
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
