//! The one accept loop of both of serve's listeners: the service's Unix
//! socket (gRPC) and `/metrics` (TCP).
//!
//! Contract, for every listener:
//! - A connection the listener refuses ([`Listen::admit`]: on the service
//!   socket, a peer that is neither root nor in the allowed group) is closed
//!   at once, before anything reads from it; the listener counts and logs it.
//! - At most `max_connections` admitted connections are open at once; one
//!   over the cap is accepted and closed at once (so it neither waits in the
//!   backlog nor holds a descriptor), counted under the listener's
//!   [`Refusal`] and logged at most [`WARNINGS_PER_WINDOW`] times per
//!   [`WARN_WINDOW`], so a flood cannot fill the log. A slot is freed when its
//!   [`Admitted`] connection is dropped.
//! - Accepting never stops: a transient error (out of descriptors, a
//!   connection reset before it was accepted) is waited out for a moment,
//!   anything else is logged and retried the same way, since a listener that
//!   stopped accepting would leave serve deaf until restarted.

use std::future::Future;
use std::io::ErrorKind;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error_chain::Chain;
use crate::service::metrics::{Refusal, ServiceMetrics};

/// How many refusals of one kind are logged per [`WARN_WINDOW`].
pub const WARNINGS_PER_WINDOW: u32 = 10;
/// The window of [`WARNINGS_PER_WINDOW`].
pub const WARN_WINDOW: Duration = Duration::from_secs(60);

/// Logs at most [`WARNINGS_PER_WINDOW`] events per [`WARN_WINDOW`] and says
/// how many it left out. Pure: the caller passes the time.
#[derive(Debug, Default)]
pub struct WarnLimiter {
    window_start: Option<Instant>,
    shown: u32,
    suppressed: u64,
}

impl WarnLimiter {
    /// Whether the event at `now` is logged; if so, how many were left out
    /// before it (in the windows since the last one logged).
    pub fn allow(&mut self, now: Instant) -> Option<u64> {
        let expired = self
            .window_start
            .is_none_or(|start| now.saturating_duration_since(start) >= WARN_WINDOW);
        if expired {
            self.window_start = Some(now);
            self.shown = 0;
        }
        if self.shown < WARNINGS_PER_WINDOW {
            self.shown += 1;
            Some(std::mem::take(&mut self.suppressed))
        } else {
            self.suppressed += 1;
            None
        }
    }
}

/// Whether an accept error concerns one connection or a passing shortage,
/// not the listener.
pub fn is_transient(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::ConnectionAborted
            | ErrorKind::ConnectionReset
            | ErrorKind::Interrupted
            | ErrorKind::WouldBlock
    ) || matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// A listener the gate accepts from.
pub trait Listen: Send {
    /// An accepted connection.
    type Stream: Send;

    /// The listener's name in logs (`service socket`, `metrics`).
    const NAME: &'static str;

    /// What a connection over the cap is counted as.
    const OVER_CAPACITY: Refusal;

    /// Accepts one connection, with a description of its peer for the logs.
    fn accept(&mut self) -> impl Future<Output = std::io::Result<(Self::Stream, String)>> + Send;

    /// Whether `stream`'s peer may use the listener; a refusal is counted
    /// and logged here. All are admitted unless the listener says otherwise.
    fn admit(&mut self, _stream: &Self::Stream) -> bool {
        true
    }
}

/// An admitted connection: the stream and its slot under the cap, freed
/// when this is dropped.
#[derive(Debug)]
pub struct Admitted<S> {
    stream: S,
    _slot: OwnedSemaphorePermit,
}

impl<S> Admitted<S> {
    /// The connection.
    pub fn stream(&self) -> &S {
        &self.stream
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Admitted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Admitted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// The gate's state, carried from one accepted connection to the next.
pub struct Gate<L> {
    listener: L,
    slots: Arc<Semaphore>,
    metrics: Arc<ServiceMetrics>,
    refused_full: WarnLimiter,
}

impl<L: Listen> Gate<L> {
    /// A gate on `listener` admitting at most `max_connections` at once.
    pub fn new(listener: L, max_connections: usize, metrics: Arc<ServiceMetrics>) -> Gate<L> {
        Gate {
            listener,
            slots: Arc::new(Semaphore::new(max_connections)),
            metrics,
            refused_full: WarnLimiter::default(),
        }
    }

    /// Accepts until a connection passes the gate (see the module doc).
    pub async fn next(&mut self) -> Admitted<L::Stream> {
        loop {
            let (stream, peer) = match self.listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    if is_transient(&e) {
                        tracing::debug!(listener = L::NAME, error = %Chain(&e), "accept failed");
                    } else {
                        tracing::error!(listener = L::NAME, error = %Chain(&e), "accept failed");
                    }
                    // Out of descriptors, or a connection gone before it was
                    // accepted: try again shortly rather than spin or stop.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            if !self.listener.admit(&stream) {
                continue;
            }
            match self.slots.clone().try_acquire_owned() {
                Ok(slot) => {
                    return Admitted {
                        stream,
                        _slot: slot,
                    }
                }
                Err(_) => {
                    // Counted before the close, so that whoever sees the close sees the count.
                    self.metrics.refused(L::OVER_CAPACITY);
                    drop(stream);
                    if let Some(left_out) = self.refused_full.allow(Instant::now()) {
                        tracing::warn!(
                            listener = L::NAME,
                            %peer,
                            left_out,
                            "connection refused: every connection slot is taken (serve --max-connections for the service socket)"
                        );
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warnings_are_limited_per_window_and_count_what_was_left_out() {
        let t0 = Instant::now();
        let mut l = WarnLimiter::default();
        for i in 0..WARNINGS_PER_WINDOW {
            assert_eq!(l.allow(t0 + Duration::from_millis(u64::from(i))), Some(0));
        }
        for _ in 0..5 {
            assert_eq!(l.allow(t0 + Duration::from_secs(1)), None);
        }
        assert_eq!(
            l.allow(t0 + WARN_WINDOW),
            Some(5),
            "the next window says how many"
        );
        assert_eq!(l.allow(t0 + WARN_WINDOW), Some(0));
    }

    #[test]
    fn per_connection_errors_are_transient() {
        for (e, transient) in [
            (std::io::Error::from(ErrorKind::ConnectionAborted), true),
            (std::io::Error::from_raw_os_error(libc::EMFILE), true),
            (std::io::Error::from_raw_os_error(libc::ENFILE), true),
            (std::io::Error::from_raw_os_error(libc::EBADF), false),
            (std::io::Error::from_raw_os_error(libc::EINVAL), false),
        ] {
            assert_eq!(is_transient(&e), transient, "{e}");
        }
    }
}
